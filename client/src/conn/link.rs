//! The link: connecting, the live stream and its epoch, what a child of `fork` does with
//! its parent's connection, losing the connection, and reconnecting within a backoff that
//! leases held models again.

use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use proto::request;

use super::inbox::{Answered, Broken, Reading};
use super::leases::{LeaseCell, LeaseIds};
use super::lock::lock;
use crate::error::{Error, Lost};
use crate::timeouts::{Call, Deadline, Timeouts};
use crate::{proto, sys};

/// First wait between reconnection attempts.
pub const BACKOFF_MIN: Duration = Duration::from_millis(10);
/// Longest wait between reconnection attempts.
pub const BACKOFF_MAX: Duration = Duration::from_secs(1);

/// The write side: the live stream, and when to try again while it is lost.
pub(super) struct Link {
    pub(super) stream: Option<Arc<UnixStream>>,
    /// The process whose connection `stream` is ([`sys::fork_generation`]): a child of
    /// `fork` inherits it, but its requests, replies and leases are the parent's.
    process: u64,
    /// The client's timeouts (kept here: a connection is made with them).
    pub(super) timeouts: Timeouts,
    pub(super) epoch: u64,
    backoff: Duration,
    next_attempt: Instant,
    last_error: Lost,
}

impl Link {
    /// The first connection (epoch 1), to `path` within `timeouts.connect`.
    pub(super) fn connect(path: &Path, timeouts: Timeouts) -> Result<Self, Error> {
        let stream = sys::connect_within(path, timeouts.connect, timeouts.get).map_err(|source| {
            if source.kind() == std::io::ErrorKind::TimedOut {
                Error::Timeout {
                    path: path.to_path_buf(),
                    call: Call::Connect,
                    how: Deadline::Silence,
                    waited: timeouts.connect,
                }
            } else {
                Error::Connect { path: path.to_path_buf(), source }
            }
        })?;
        Ok(Link {
            stream: Some(Arc::new(stream)),
            process: sys::fork_generation(),
            timeouts,
            epoch: 1,
            backoff: BACKOFF_MIN,
            next_attempt: Instant::now(),
            last_error: Lost::NotConnected,
        })
    }
}

/// What the link asks of the connection that holds it: the link itself, the socket's path,
/// the tables the daemon sent on the connection, a get (to lease held models again), and
/// the reports (sent again on a new connection).
pub(super) trait Linking: Reading {
    fn link_mutex(&self) -> &Mutex<Link>;

    fn path(&self) -> &Path;

    fn tables(&self) -> &Mutex<HashMap<String, Arc<proto::SegmentReply>>>;

    /// Sends a get on the live stream and waits for its reply (the connection's `exchange`).
    fn get(&self, body: request::Body) -> Result<Answered, Error>;

    /// Sends the reports the current connection does not have (`reports::send_reports`).
    fn send_reports(&self, all: bool);

    /// The link, as this process may use it. In a child of `fork` the inherited stream is
    /// the parent's connection: the child closes its copy of the fd (no `shutdown`, which
    /// would end the parent's connection too) and moves to a new epoch, so its next call
    /// connects anew and leases the models it holds, and its releases of leases counted on
    /// the parent's connection are never sent (they would end the parent's leases).
    fn link(&self) -> MutexGuard<'_, Link> {
        let mut link = lock(self.link_mutex());
        let me = sys::fork_generation();
        if link.process != me {
            link.process = me;
            link.stream = None;
            link.epoch += 1;
            link.backoff = BACKOFF_MIN;
            link.next_attempt = Instant::now();
            link.last_error = Lost::Forked;
            lock(self.inbox()).renew(link.epoch);
            lock(self.tables()).clear();
        }
        link
    }

    /// Makes sure a stream is live, reconnecting (within the backoff) and re-leasing held
    /// models if it was lost. Returns whether this call reconnected.
    fn ensure(&self) -> Result<bool, Error> {
        let epoch = {
            let mut link = self.link();
            if link.stream.is_some() {
                return Ok(false);
            }
            let now = Instant::now();
            if now < link.next_attempt {
                let wait = link.next_attempt - now;
                return Err(self.unavailable(Lost::Backoff { last: Box::new(link.last_error.clone()), wait }));
            }
            let timeouts = link.timeouts;
            match sys::connect_within(self.path(), timeouts.connect, timeouts.get) {
                Ok(stream) => {
                    link.stream = Some(Arc::new(stream));
                    link.epoch += 1;
                    link.backoff = BACKOFF_MIN;
                    lock(self.inbox()).renew(link.epoch);
                    lock(self.tables()).clear();
                    link.epoch
                }
                Err(e) => {
                    link.last_error = Lost::Connect(Arc::new(e));
                    link.next_attempt = now + link.backoff;
                    link.backoff = (link.backoff * 2).min(BACKOFF_MAX);
                    return Err(self.unavailable(link.last_error.clone()));
                }
            }
        };
        // A daemon being killed may still take connections into its listening socket's
        // backlog for a moment (its process closes its fds one by one): a connection lost
        // again before it answered is no reconnection.
        if let Err(e) = self.relet(epoch) {
            // Not at once again: the next attempt waits out the backoff, as after a refusal.
            let mut link = self.link();
            link.next_attempt = Instant::now() + link.backoff;
            link.backoff = (link.backoff * 2).min(BACKOFF_MAX);
            drop(link);
            return Err(self.unavailable(Lost::Relet(Arc::new(e))));
        }
        self.send_reports(true);
        Ok(true)
    }

    /// Asks the new daemon for every held model again, so it holds leases for them. Fails
    /// when the new connection is lost before the daemon answered; a model it could not
    /// lease on a connection that stays (a timeout, say) is left unleased.
    fn relet(&self, epoch: u64) -> Result<(), Error> {
        let cells: Vec<Arc<LeaseCell>> = {
            let mut leases = lock(self.leases());
            leases.retain(|w| w.strong_count() > 0);
            leases.iter().filter_map(Weak::upgrade).collect()
        };
        for cell in cells {
            let body = request::Body::Get(proto::GetRequest { key: cell.key.clone(), ..Default::default() });
            match self.get(body) {
                Ok(Answered::Segment(answer)) if answer.epoch == epoch => {
                    *lock(&cell.ids) =
                        LeaseIds { segment_id: answer.info.segment_id, generation: answer.info.generation, epoch };
                }
                Ok(Answered::Build(..) | Answered::Digest(_)) => {} // not a reply to a get: leave it unleased
                Ok(_) => return Ok(()),                             // yet another connection relets
                Err(Error::Daemon { .. }) => {}                     // not served any more: the mapping stays, unleased
                Err(e) => {
                    let link = self.link();
                    if link.epoch != epoch || link.stream.is_none() {
                        return Err(e); // lost again; the next call retries
                    }
                }
            }
        }
        Ok(())
    }

    /// Leases held by this client that the connected daemon counts.
    fn live_leases(&self) -> usize {
        let epoch = {
            let link = self.link();
            if link.stream.is_none() {
                return 0;
            }
            link.epoch
        };
        lock(self.leases()).iter().filter_map(Weak::upgrade).filter(|c| lock(&c.ids).epoch == epoch).count()
    }
}

/// Marks the connection of `epoch` lost (if it is still the current one), so the next
/// call reconnects, and tells every caller waiting on it. The socket is shut down: a
/// caller blocked reading it wakes at once, and the daemon ends the connection's leases
/// (the next connection leases held models again). The connection answers
/// [`Reading::lose`] with it.
pub(super) fn lose(conn: &impl Linking, epoch: u64, why: Broken) {
    let mut link = conn.link();
    if link.epoch == epoch
        && let Some(stream) = link.stream.take()
    {
        let _ = stream.shutdown(std::net::Shutdown::Both);
        link.last_error = match &why {
            Broken::Refused(code, message) => Lost::Refused { code: *code, message: message.clone() },
            Broken::Lost(reason) => reason.clone(),
        };
        link.backoff = BACKOFF_MIN;
        link.next_attempt = Instant::now();
    }
    drop(link);
    let mut inbox = lock(conn.inbox());
    if inbox.epoch == epoch && inbox.broken.is_none() {
        inbox.broken = Some(why);
        inbox.wake_all();
    }
}
