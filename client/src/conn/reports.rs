//! The worker reports: the latest per engine and model this client keeps, those made
//! while packd could not be reached, how they are sent, and the thread that sends what a
//! full socket left unsent.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use proto::request;

use super::inbox::Broken;
use super::link::Linking;
use super::lock::lock;
use crate::error::{Error, Lost};
use crate::{proto, wire};

/// This client's worker reports.
#[derive(Default)]
pub(super) struct Reports {
    /// The latest report per engine and model, each with whether the current connection
    /// has it; all are sent again on every new connection (at most [`MAX_REPORTS`]).
    list: Vec<(proto::WorkerReport, bool)>,
    /// Some report waits to be sent (a write would have blocked): the next call, or the
    /// flusher thread, sends it.
    pub(super) pending: bool,
    /// A flusher thread runs ([`Reporting::flush_reports_later`]): at most one per client.
    flushing: bool,
}

/// Reports made while packd could not be reached ([`crate::report_later`]): the next
/// connection any client of this process makes takes them over and sends them.
static UNSENT: Mutex<Vec<(proto::WorkerReport, bool)>> = Mutex::new(Vec::new());

/// Reports (engine and model pairs) one client keeps and resends; later ones of new models
/// are sent once and not kept.
pub const MAX_REPORTS: usize = 64;

/// Keeps `r` in `list` as the latest report of its engine and model, not yet sent;
/// returns false for a new pair past `MAX_REPORTS` (not kept).
fn keep_report(list: &mut Vec<(proto::WorkerReport, bool)>, r: proto::WorkerReport) -> bool {
    if let Some(old) = list.iter_mut().find(|(o, _)| o.engine == r.engine && o.model == r.model) {
        *old = (r, false);
    } else if list.len() < MAX_REPORTS {
        list.push((r, false));
    } else {
        return false;
    }
    true
}

/// Keeps a report until a client of this process connects (see [`crate::report_later`]);
/// false when [`MAX_REPORTS`] others are kept already.
pub(crate) fn remember_unsent(r: proto::WorkerReport) -> bool {
    keep_report(&mut lock(&UNSENT), r)
}

/// What the reports ask of the connection that holds them: the reports themselves.
pub(super) trait Reporting: Linking {
    fn reports(&self) -> &Mutex<Reports>;

    /// Keeps `r` as this client's latest report of its engine and model and sends what is
    /// unsent. A report of a new pair past [`MAX_REPORTS`] is sent once, not kept. What a
    /// full socket leaves unsent goes with the next call, or a short-lived thread of its own
    /// sends it within seconds (a worker that reports and then never calls again is seen).
    fn report(self: &Arc<Self>, r: proto::WorkerReport)
    where
        Self: Sized + Send + Sync + 'static,
    {
        let kept = keep_report(&mut lock(self.reports()).list, r.clone());
        if !kept {
            self.notify(request::Body::Report(r), None);
        }
        self.send_reports(false);
        if lock(self.reports()).pending {
            self.flush_reports_later();
        }
    }

    /// Starts a thread (unless one runs) that retries unsent reports every 10 ms for at
    /// most 10 s, then ends.
    fn flush_reports_later(self: &Arc<Self>)
    where
        Self: Sized + Send + Sync + 'static,
    {
        if std::mem::replace(&mut lock(self.reports()).flushing, true) {
            return;
        }
        let conn = Arc::downgrade(self);
        let spawned = std::thread::Builder::new().name("packd-reports".into()).spawn(move || {
            for _ in 0..1000 {
                std::thread::sleep(Duration::from_millis(10));
                let Some(conn) = conn.upgrade() else { return };
                conn.send_reports(false);
                let mut reports = lock(conn.reports());
                if !reports.pending {
                    // Under the lock: a report kept meanwhile is seen by its own caller,
                    // which starts a thread once this one is gone.
                    reports.flushing = false;
                    return;
                }
            }
            if let Some(conn) = conn.upgrade() {
                lock(conn.reports()).flushing = false;
            }
        });
        if spawned.is_err() {
            lock(self.reports()).flushing = false;
        }
    }
}

/// Sends the reports the current connection does not have (`all`: a new connection has
/// none, and takes over those made while packd was away). A write that would block
/// leaves the rest for the next call (a burst of reports must not cost the connection);
/// any other failure loses the connection, and the next one sends them all. The
/// connection answers [`Linking::send_reports`] with it.
pub(super) fn send_reports(conn: &impl Reporting, all: bool) {
    let todo: Vec<(usize, proto::WorkerReport)> = {
        let mut reports = lock(conn.reports());
        let mine = &mut reports.list;
        if all {
            for (r, _) in std::mem::take(&mut *lock(&UNSENT)) {
                keep_report(mine, r);
            }
            for (_, sent) in mine.iter_mut() {
                *sent = false;
            }
        }
        mine.iter().enumerate().filter(|(_, (_, sent))| !sent).map(|(i, (r, _))| (i, r.clone())).collect()
    };
    for (i, r) in todo {
        let (written, at) = {
            let link = conn.link();
            match &link.stream {
                Some(stream) => {
                    let req = proto::Request { id: 0, body: Some(request::Body::Report(r.clone())), progress: false };
                    (wire::try_send(stream, &req), link.epoch)
                }
                None => return, // the next connection sends them all
            }
        };
        match written {
            Ok(()) => {
                if let Some((kept, sent)) = lock(conn.reports()).list.get_mut(i)
                    && kept.engine == r.engine
                    && kept.model == r.model
                {
                    *sent = *kept == r;
                }
            }
            Err(Error::Io(e)) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) => {
                conn.lose(at, Broken::Lost(Lost::Report(Arc::new(e))));
                return;
            }
        }
    }
    // From the list itself, under its lock: a report kept meanwhile by another thread
    // (whose own write may have failed) is seen here, never overwritten as sent.
    let mut reports = lock(conn.reports());
    reports.pending = reports.list.iter().any(|(_, sent)| !sent);
}
