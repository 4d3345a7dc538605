//! The connection to the daemon: requests pipelined on one socket, each within a deadline,
//! and how the connection rides out a daemon restart.
//!
//! Locks, each held for one short step and never while waiting for the daemon:
//! * `link`: the stream, its epoch and the timeouts. Held to connect (bounded by the connect timeout) and
//!   to write one frame (bounded by the socket's send timeout). A release takes only this
//!   lock, for one small write: it never waits behind another caller's request.
//! * `inbox`: a slot per request in flight, the frame reader, and the requests given up on.
//!   A caller registers its slot before it sends, then waits on its own slot until its
//!   deadline. One caller at a time takes the reader out of the inbox and reads frames
//!   without holding any lock, filing each frame in the slot of its request and waking
//!   that caller only; a caller that leaves hands the reader on to one still waiting.
//!
//! Lock order: `link` may be held when taking `inbox`, never the other way round.
//!
//! A caller whose deadline passes gets [`Error::Timeout`] and abandons its request: when
//! the reply comes after all, it is dropped (and a segment's lease given back).
//!
//! When the daemon goes away, mappings keep working (they belong to this process) and the
//! connection is marked lost: requests fail at once with [`Error::Unavailable`]. The next
//! call reconnects — at most once per backoff interval, which doubles from
//! [`BACKOFF_MIN`] to [`BACKOFF_MAX`] while the daemon stays away — and re-establishes the
//! lease of every model this client still holds, by key, so the new daemon counts them.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use packd_proto::stream::Receiver;
use proto::{ErrorCode, reply, request};

use crate::error::{Error, ProtocolError};
use crate::timeouts::{Call, Deadline, Timeouts};
use crate::wire::{self, Received, RecvFailure};
use crate::{proto, sys};

/// First wait between reconnection attempts.
pub const BACKOFF_MIN: Duration = Duration::from_millis(10);
/// Longest wait between reconnection attempts.
pub const BACKOFF_MAX: Duration = Duration::from_secs(1);
/// Held models' weak references are swept when their count reaches a power of two at
/// least this large, so the registry stays within twice the models alive.
const LEASE_SWEEP_FROM: usize = 32;

/// Which segment a lease names on which connection.
#[derive(Clone, Copy)]
struct LeaseIds {
    segment_id: u64,
    generation: u64,
    /// The connection (by count of connections made) the ids belong to.
    epoch: u64,
}

/// A held model's lease, shared between its owner and the connection's registry.
pub(crate) struct LeaseCell {
    key: String,
    ids: Mutex<LeaseIds>,
}

/// The write side: the live stream, and when to try again while it is lost.
struct Link {
    stream: Option<Arc<UnixStream>>,
    /// The process whose connection `stream` is ([`sys::fork_generation`]): a child of
    /// `fork` inherits it, but its requests, replies and leases are the parent's.
    process: u64,
    /// The client's timeouts (kept here: a connection is made with them).
    timeouts: Timeouts,
    epoch: u64,
    backoff: Duration,
    next_attempt: Instant,
    last_error: String,
}

/// Why the connection of an epoch stopped, for every caller still waiting on it.
#[derive(Clone)]
enum Broken {
    /// The daemon refused the connection with a reason (reply id 0) and closed it.
    Refused(ErrorCode, String),
    /// The stream failed.
    Lost(String),
}

/// A request sent and not answered yet: what has come for it, and its caller's wake-up.
struct Slot {
    reply: Option<Received>,
    /// The latest progress frame its caller has not seen yet.
    progress: Option<proto::Progress>,
    /// Its caller sleeps on `wake` (it is not sending, reading or in a progress callback).
    asleep: bool,
    wake: Arc<Condvar>,
}

/// The read side of the current connection.
struct Inbox {
    epoch: u64,
    /// Requests in flight, by id: each caller waits on its own slot.
    slots: HashMap<u64, Slot>,
    /// Requests whose callers gave up; their replies are dropped when they come.
    abandoned: HashSet<u64>,
    /// The frame receiver, `None` while a caller is reading with it.
    reader: Option<Receiver>,
    broken: Option<Broken>,
}

impl Inbox {
    fn fresh(epoch: u64) -> Self {
        Self {
            epoch,
            slots: HashMap::new(),
            abandoned: HashSet::new(),
            reader: Some(wire::reply_receiver()),
            broken: None,
        }
    }

    /// Wakes every waiting caller (the connection broke, or another replaced it).
    fn wake_all(&self) {
        for slot in self.slots.values() {
            slot.wake.notify_one();
        }
    }

    /// Starts over for the connection of `epoch`; callers waiting on the old one wake and
    /// find it gone.
    fn renew(&mut self, epoch: u64) {
        self.wake_all();
        *self = Inbox::fresh(epoch);
    }

    /// The caller of `id` leaves: its slot goes, and if nobody reads, one caller asleep is
    /// woken to read next (one awake takes the reader when it next looks).
    fn leave(&mut self, id: u64) {
        self.slots.remove(&id);
        if self.reader.is_some()
            && let Some(next) = self.slots.values().find(|s| s.asleep)
        {
            next.wake.notify_one();
        }
    }
}

pub(crate) struct Conn {
    path: PathBuf,
    link: Mutex<Link>,
    inbox: Mutex<Inbox>,
    next_id: AtomicU64,
    pub(crate) tables: Mutex<HashMap<String, Arc<proto::SegmentReply>>>,
    leases: Mutex<Vec<Weak<LeaseCell>>>,
    reports: Mutex<Reports>,
}

/// This client's worker reports.
#[derive(Default)]
struct Reports {
    /// The latest report per engine and model, each with whether the current connection
    /// has it; all are sent again on every new connection (at most [`MAX_REPORTS`]).
    list: Vec<(proto::WorkerReport, bool)>,
    /// Some report waits to be sent (a write would have blocked): the next call, or the
    /// flusher thread, sends it.
    pending: bool,
    /// A flusher thread runs ([`Conn::flush_reports_later`]): at most one per client.
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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A reply that answered a request: the segment, its fd, and the connection it came on.
pub(crate) struct Answer {
    pub(crate) info: proto::SegmentReply,
    pub(crate) file: File,
    /// The connection the daemon counts the lease on.
    pub(crate) epoch: u64,
}

/// A reply that answered a request with a segment or with a build role.
pub(crate) enum Answered {
    Segment(Answer),
    /// The role, and the memfd lent with it (when `lent_bytes` is not 0 and it arrived).
    Build(proto::BuildReply, Option<File>),
    Digest(proto::FileDigestReply),
}

/// Called with each progress frame of a running request.
pub(crate) type OnProgress<'a> = Option<&'a dyn Fn(&proto::Progress)>;

/// A request's deadlines: the longest silence, and the end.
#[derive(Clone, Copy)]
struct Deadlines {
    silence: Duration,
    end: Instant,
}

/// What a request is, for deadlines and error messages.
#[derive(Clone, Copy)]
pub(crate) enum Kind {
    Get,
    Pack,
    /// May wait for another process's build: the pack deadline.
    Acquire,
    /// Hashes the whole published segment: the pack deadline.
    Publish,
    /// Hashes a whole file: the pack deadline.
    Digest,
}

impl Kind {
    fn call(self) -> Call {
        match self {
            Kind::Get => Call::Get,
            Kind::Pack => Call::Pack,
            Kind::Acquire => Call::Acquire,
            Kind::Publish => Call::Publish,
            Kind::Digest => Call::Digest,
        }
    }
}

impl Conn {
    /// Connects to `path` within `timeouts.connect`.
    pub(crate) fn connect(path: PathBuf, timeouts: Timeouts) -> Result<Self, Error> {
        let stream = sys::connect_within(&path, timeouts.connect, timeouts.get).map_err(|source| {
            if source.kind() == std::io::ErrorKind::TimedOut {
                Error::Timeout {
                    path: path.clone(),
                    call: Call::Connect,
                    how: Deadline::Silence,
                    waited: timeouts.connect,
                }
            } else {
                Error::Connect { path: path.clone(), source }
            }
        })?;
        Ok(Self {
            path,
            link: Mutex::new(Link {
                stream: Some(Arc::new(stream)),
                process: sys::fork_generation(),
                timeouts,
                epoch: 1,
                backoff: BACKOFF_MIN,
                next_attempt: Instant::now(),
                last_error: String::new(),
            }),
            inbox: Mutex::new(Inbox::fresh(1)),
            next_id: AtomicU64::new(1),
            tables: Mutex::new(HashMap::new()),
            leases: Mutex::new(Vec::new()),
            reports: Mutex::new(Reports::default()),
        })
        .inspect(|c| c.send_reports(true))
    }

    /// Keeps `r` as this client's latest report of its engine and model and sends what is
    /// unsent. A report of a new pair past [`MAX_REPORTS`] is sent once, not kept. What a
    /// full socket leaves unsent goes with the next call, or a short-lived thread of its own
    /// sends it within seconds (a worker that reports and then never calls again is seen).
    pub(crate) fn report(self: &Arc<Self>, r: proto::WorkerReport) {
        let kept = keep_report(&mut lock(&self.reports).list, r.clone());
        if !kept {
            self.notify(request::Body::Report(r), None);
        }
        self.send_reports(false);
        if lock(&self.reports).pending {
            self.flush_reports_later();
        }
    }

    /// Starts a thread (unless one runs) that retries unsent reports every 10 ms for at
    /// most 10 s, then ends.
    fn flush_reports_later(self: &Arc<Self>) {
        if std::mem::replace(&mut lock(&self.reports).flushing, true) {
            return;
        }
        let conn = Arc::downgrade(self);
        let spawned = std::thread::Builder::new().name("packd-reports".into()).spawn(move || {
            for _ in 0..1000 {
                std::thread::sleep(Duration::from_millis(10));
                let Some(conn) = conn.upgrade() else { return };
                conn.send_reports(false);
                let mut reports = lock(&conn.reports);
                if !reports.pending {
                    // Under the lock: a report kept meanwhile is seen by its own caller,
                    // which starts a thread once this one is gone.
                    reports.flushing = false;
                    return;
                }
            }
            if let Some(conn) = conn.upgrade() {
                lock(&conn.reports).flushing = false;
            }
        });
        if spawned.is_err() {
            lock(&self.reports).flushing = false;
        }
    }

    /// Sends the reports the current connection does not have (`all`: a new connection has
    /// none, and takes over those made while packd was away). A write that would block
    /// leaves the rest for the next call (a burst of reports must not cost the connection);
    /// any other failure loses the connection, and the next one sends them all.
    fn send_reports(&self, all: bool) {
        let todo: Vec<(usize, proto::WorkerReport)> = {
            let mut reports = lock(&self.reports);
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
                let link = self.link();
                match &link.stream {
                    Some(stream) => {
                        let req =
                            proto::Request { id: 0, body: Some(request::Body::Report(r.clone())), progress: false };
                        (wire::try_send(stream, &req), link.epoch)
                    }
                    None => return, // the next connection sends them all
                }
            };
            match written {
                Ok(()) => {
                    if let Some((kept, sent)) = lock(&self.reports).list.get_mut(i)
                        && kept.engine == r.engine
                        && kept.model == r.model
                    {
                        *sent = *kept == r;
                    }
                }
                Err(Error::Io(e)) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    self.lose(at, Broken::Lost(format!("a report could not be sent at once: {e}")));
                    return;
                }
            }
        }
        // From the list itself, under its lock: a report kept meanwhile by another thread
        // (whose own write may have failed) is seen here, never overwritten as sent.
        let mut reports = lock(&self.reports);
        reports.pending = reports.list.iter().any(|(_, sent)| !sent);
    }

    pub(crate) fn timeouts(&self) -> Timeouts {
        lock(&self.link).timeouts
    }

    pub(crate) fn set_timeouts(&self, timeouts: Timeouts) {
        lock(&self.link).timeouts = timeouts;
    }

    fn unavailable(&self, reason: String) -> Error {
        Error::Unavailable { path: self.path.clone(), reason }
    }

    /// The link, as this process may use it. In a child of `fork` the inherited stream is
    /// the parent's connection: the child closes its copy of the fd (no `shutdown`, which
    /// would end the parent's connection too) and moves to a new epoch, so its next call
    /// connects anew and leases the models it holds, and its releases of leases counted on
    /// the parent's connection are never sent (they would end the parent's leases).
    fn link(&self) -> MutexGuard<'_, Link> {
        let mut link = lock(&self.link);
        let me = sys::fork_generation();
        if link.process != me {
            link.process = me;
            link.stream = None;
            link.epoch += 1;
            link.backoff = BACKOFF_MIN;
            link.next_attempt = Instant::now();
            link.last_error = "the connection belongs to the parent process (fork)".to_string();
            lock(&self.inbox).renew(link.epoch);
            lock(&self.tables).clear();
        }
        link
    }

    /// Marks the connection of `epoch` lost (if it is still the current one), so the next
    /// call reconnects, and tells every caller waiting on it. The socket is shut down: a
    /// caller blocked reading it wakes at once, and the daemon ends the connection's leases
    /// (the next connection leases held models again).
    fn lose(&self, epoch: u64, why: Broken) {
        let mut link = self.link();
        if link.epoch == epoch
            && let Some(stream) = link.stream.take()
        {
            let _ = stream.shutdown(std::net::Shutdown::Both);
            link.last_error = match &why {
                Broken::Refused(code, message) => format!("{message} ({})", code.as_str_name()),
                Broken::Lost(reason) => reason.clone(),
            };
            link.backoff = BACKOFF_MIN;
            link.next_attempt = Instant::now();
        }
        drop(link);
        let mut inbox = lock(&self.inbox);
        if inbox.epoch == epoch && inbox.broken.is_none() {
            inbox.broken = Some(why);
            inbox.wake_all();
        }
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
                return Err(self.unavailable(format!("{}; next attempt in {} ms", link.last_error, wait.as_millis())));
            }
            let timeouts = link.timeouts;
            match sys::connect_within(&self.path, timeouts.connect, timeouts.get) {
                Ok(stream) => {
                    link.stream = Some(Arc::new(stream));
                    link.epoch += 1;
                    link.backoff = BACKOFF_MIN;
                    lock(&self.inbox).renew(link.epoch);
                    lock(&self.tables).clear();
                    link.epoch
                }
                Err(e) => {
                    link.last_error = format!("cannot connect: {e}");
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
            return Err(self.unavailable(format!("the new connection was lost before the daemon answered: {e}")));
        }
        self.send_reports(true);
        Ok(true)
    }

    /// Asks the new daemon for every held model again, so it holds leases for them. Fails
    /// when the new connection is lost before the daemon answered; a model it could not
    /// lease on a connection that stays (a timeout, say) is left unleased.
    fn relet(&self, epoch: u64) -> Result<(), Error> {
        let cells: Vec<Arc<LeaseCell>> = {
            let mut leases = lock(&self.leases);
            leases.retain(|w| w.strong_count() > 0);
            leases.iter().filter_map(Weak::upgrade).collect()
        };
        for cell in cells {
            let body = request::Body::Get(proto::GetRequest { key: cell.key.clone(), ..Default::default() });
            match self.exchange(body, None, Kind::Get, None) {
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

    /// Sends a request and waits for its segment reply (reconnecting first if needed).
    /// A connection the daemon closed while it was idle — it held no lease for
    /// `limits.idle_timeout`, or was shed to admit a newer connection at a connection
    /// limit (the daemon says why, then closes it) — is reconnected once, at once, and the
    /// request sent again (pack and get are idempotent).
    pub(crate) fn call(&self, body: request::Body, fd: Option<&File>, kind: Kind) -> Result<Answer, Error> {
        self.call_tracked(body, fd, kind, None)
    }

    /// [`Conn::call`], telling `on_progress` of each progress frame.
    pub(crate) fn call_tracked(
        &self,
        body: request::Body,
        fd: Option<&File>,
        kind: Kind,
        on_progress: OnProgress<'_>,
    ) -> Result<Answer, Error> {
        match self.call_any(body, fd, kind, on_progress)? {
            Answered::Segment(answer) => Ok(answer),
            Answered::Build(..) => Err(ProtocolError::UnexpectedBuild.into()),
            Answered::Digest(_) => Err(ProtocolError::UnexpectedDigest.into()),
        }
    }

    /// [`Conn::call`] for a request that may be answered with a build role (an acquire).
    pub(crate) fn call_any(
        &self,
        body: request::Body,
        fd: Option<&File>,
        kind: Kind,
        on_progress: OnProgress<'_>,
    ) -> Result<Answered, Error> {
        let fresh = self.ensure()?;
        match self.exchange(body.clone(), fd, kind, on_progress) {
            Err(Error::Unavailable { .. } | Error::Daemon { .. }) if !fresh && self.link().stream.is_none() => {
                self.ensure()?;
                self.exchange(body, fd, kind, on_progress)
            }
            other => other,
        }
    }

    /// One request and its reply on the live stream. The daemon reports progress at least
    /// every second while a request runs (`Request.progress`): the request fails when it
    /// stays silent for `timeouts.get`, or when a pack, acquire or publish (or a get
    /// waiting for a pack) takes longer than `timeouts.pack` in all.
    fn exchange(
        &self,
        body: request::Body,
        fd: Option<&File>,
        kind: Kind,
        on_progress: OnProgress<'_>,
    ) -> Result<Answered, Error> {
        if lock(&self.reports).pending {
            self.send_reports(false);
        }
        let timeouts = self.timeouts();
        let (silence, total) = match kind {
            Kind::Get => (timeouts.get, timeouts.get.max(timeouts.pack)),
            Kind::Pack | Kind::Acquire | Kind::Publish | Kind::Digest => {
                (timeouts.get.min(timeouts.pack), timeouts.pack)
            }
        };
        let limits = Deadlines { silence, end: Instant::now() + total };
        let timeout = silence;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let req = proto::Request { id, body: Some(body), progress: true };
        let wake = Arc::new(Condvar::new());
        let sent = {
            let link = self.link();
            match &link.stream {
                None => Err(self.unavailable("not connected".into())),
                Some(stream) => {
                    let epoch = link.epoch;
                    // Registered under the link: the inbox is that of `epoch` (a new
                    // connection replaces both under it).
                    let slot = Slot { reply: None, progress: None, asleep: false, wake: Arc::clone(&wake) };
                    lock(&self.inbox).slots.insert(id, slot);
                    let stream = Arc::clone(stream);
                    match wire::send(&stream, &req, fd.map(|f| f.as_fd())) {
                        Ok(()) => Ok((stream, epoch)),
                        // The daemon may have refused the connection (a limit, an allow
                        // list) and closed it before reading anything: its reason is queued
                        // for us, and the reader below finds it.
                        Err(Error::Io(e))
                            if matches!(
                                e.kind(),
                                std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
                            ) =>
                        {
                            Ok((stream, epoch))
                        }
                        Err(Error::Io(e)) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            Err(self.timed_out(kind, timeout, Deadline::Send))
                        }
                        Err(e) => Err(e),
                    }
                }
            }
        };
        let (stream, epoch) = match sent {
            Ok(sent) => sent,
            Err(e) => {
                lock(&self.inbox).leave(id);
                if !matches!(e, Error::Unavailable { .. }) {
                    let epoch = self.link().epoch;
                    self.lose(epoch, Broken::Lost(format!("sending a request failed: {e}")));
                }
                return Err(e);
            }
        };
        let received = self.wait_reply(&stream, epoch, id, &wake, limits, on_progress);
        match received {
            Ok(received) => self.accept(received, epoch),
            Err(None) if Instant::now() >= limits.end => Err(self.timed_out(kind, total, Deadline::Total)),
            Err(None) => Err(self.timed_out(kind, silence, Deadline::Silence)),
            Err(Some(e)) => Err(e),
        }
    }

    fn timed_out(&self, kind: Kind, waited: Duration, how: Deadline) -> Error {
        Error::Timeout { path: self.path.clone(), call: kind.call(), how, waited }
    }

    /// Waits on the slot of `id` until its reply comes (read by this caller or another),
    /// the connection breaks (`Err(Some)`), or a deadline passes (`Err(None)`: abandoned):
    /// no frame for the request within `limits.silence`, or `limits.end`. Each progress
    /// frame of the request restarts the silence and goes to `on_progress`. While nobody
    /// reads, this caller reads.
    fn wait_reply(
        &self,
        stream: &UnixStream,
        epoch: u64,
        id: u64,
        wake: &Condvar,
        limits: Deadlines,
        on_progress: OnProgress<'_>,
    ) -> Result<Received, Option<Error>> {
        let mut heard = Instant::now();
        loop {
            let mut inbox = lock(&self.inbox);
            let current = inbox.epoch == epoch;
            let Some(slot) = inbox.slots.get_mut(&id).filter(|_| current) else {
                return Err(Some(self.unavailable("connection lost while waiting for a reply".into())));
            };
            if let Some(p) = slot.progress.take() {
                heard = Instant::now();
                drop(inbox);
                if let Some(f) = on_progress
                    && let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&p)))
                {
                    // The caller's callback panicked: its request is given up, its slot goes.
                    let mut inbox = lock(&self.inbox);
                    if inbox.epoch == epoch {
                        inbox.leave(id);
                        inbox.abandoned.insert(id);
                    }
                    drop(inbox);
                    std::panic::resume_unwind(panic);
                }
                continue;
            }
            if let Some(received) = slot.reply.take() {
                inbox.leave(id);
                return Ok(received);
            }
            if let Some(broken) = inbox.broken.clone() {
                inbox.leave(id);
                return Err(Some(match broken {
                    Broken::Refused(code, message) => Error::Daemon { code, message },
                    Broken::Lost(reason) => self.unavailable(reason),
                }));
            }
            let deadline = (heard + limits.silence).min(limits.end);
            let now = Instant::now();
            if now >= deadline {
                inbox.leave(id);
                inbox.abandoned.insert(id);
                return Err(None);
            }
            match inbox.reader.take() {
                Some(reader) => {
                    drop(inbox);
                    self.read_one(stream, epoch, reader, deadline, id);
                }
                None => {
                    if let Some(slot) = inbox.slots.get_mut(&id) {
                        slot.asleep = true;
                    }
                    let (mut inbox, _) = wake.wait_timeout(inbox, deadline - now).unwrap_or_else(|p| p.into_inner());
                    if inbox.epoch == epoch
                        && let Some(slot) = inbox.slots.get_mut(&id)
                    {
                        slot.asleep = false;
                    }
                }
            }
        }
    }

    /// Reads one frame of the connection of `epoch` (until `deadline`) with the reader the
    /// caller took, puts the reader back, and files the frame: in the slot of its request
    /// (waking that caller unless it is `me`, the reader), or, for a refusal or a broken
    /// stream, as the connection's end.
    fn read_one(&self, stream: &UnixStream, epoch: u64, mut reader: Receiver, deadline: Instant, me: u64) {
        let got = wire::recv(stream, &mut reader, Some(deadline));
        let mut inbox = lock(&self.inbox);
        if inbox.epoch != epoch {
            return; // a new connection has its own reader
        }
        inbox.reader = Some(reader);
        let broken = match got {
            Ok(received) => {
                let rid = received.reply.id;
                let progress = matches!(received.reply.body, Some(reply::Body::Progress(_)));
                if rid == 0 {
                    // A connection-level refusal (a connection limit, an allow list, a frame
                    // deadline): the daemon closes the connection after it.
                    Some(match received.reply.body {
                        Some(reply::Body::Error(e)) => Broken::Refused(e.code(), e.message),
                        _ => Broken::Refused(ErrorCode::Internal, "reply for request 0 without an error".into()),
                    })
                } else if let Some(slot) = inbox.slots.get_mut(&rid) {
                    match received.reply.body {
                        // Not an answer: the request runs on.
                        Some(reply::Body::Progress(p)) => slot.progress = Some(p),
                        _ => {
                            slot.progress = None;
                            slot.reply = Some(received);
                        }
                    }
                    if rid != me {
                        slot.wake.notify_one();
                    }
                    None
                } else {
                    // Nobody waits for it (its caller gave up): progress is dropped, a
                    // reply's lease given back.
                    if !progress {
                        inbox.abandoned.remove(&rid);
                        drop(inbox);
                        self.drop_reply(received, epoch);
                    }
                    return;
                }
            }
            Err(RecvFailure::TimedOut) => None,
            Err(RecvFailure::Broken(e)) => Some(Broken::Lost(format!("connection lost: {e}"))),
        };
        drop(inbox);
        if let Some(why) = broken {
            self.lose(epoch, why);
        }
    }

    /// A reply nobody waits for any more: its fd closes; its lease is given back.
    fn drop_reply(&self, received: Received, epoch: u64) {
        if let Some(reply::Body::Segment(info)) = received.reply.body {
            self.release(LeaseIds { segment_id: info.segment_id, generation: info.generation, epoch });
        }
    }

    /// Turns a reply into the answer to the request, or its error.
    fn accept(&self, received: Received, epoch: u64) -> Result<Answered, Error> {
        let Received { reply, mut fds, fds_dropped } = received;
        match reply.body {
            Some(reply::Body::Segment(info)) if fds_dropped => {
                // The reply was read to its end, so the stream is in sync; give the lease
                // back, since this process cannot hold the segment's fd.
                self.release(LeaseIds { segment_id: info.segment_id, generation: info.generation, epoch });
                Err(Error::FdDropped(info.key))
            }
            Some(reply::Body::Segment(info)) => {
                let idx = info.fd_index as usize;
                if fds.len() != 1 || idx != 0 {
                    let e = Error::Protocol(ProtocolError::Fds { fds: fds.len(), index: idx });
                    self.lose(epoch, Broken::Lost(e.to_string()));
                    return Err(e);
                }
                Ok(Answered::Segment(Answer { info, file: File::from(fds.swap_remove(0)), epoch }))
            }
            Some(reply::Body::Build(b)) => {
                // A lent memfd comes alone with the reply; anything else is left (closed).
                let lent = (b.lent_bytes > 0 && fds.len() == 1).then(|| File::from(fds.swap_remove(0)));
                Ok(Answered::Build(b, lent))
            }
            Some(reply::Body::Digest(d)) => Ok(Answered::Digest(d)),
            Some(reply::Body::Error(e)) => Err(Error::Daemon { code: e.code(), message: e.message }),
            // Progress frames never reach here: `wait_reply` files them apart.
            Some(reply::Body::Progress(_)) => Err(ProtocolError::UnexpectedProgress.into()),
            None => Err(ProtocolError::NoBody.into()),
        }
    }

    /// Tells the daemon a lease ends (a lease of a lost connection needs no release: the
    /// daemon ended it with the connection). Takes only the write side for one write that
    /// never waits: not for another caller's reply, nor for a daemon that stopped reading.
    /// A release that cannot be written whole at once loses the connection instead (a
    /// closed connection releases every lease, and the next call leases held models again).
    fn release(&self, ids: LeaseIds) {
        let body =
            request::Body::Release(proto::ReleaseRequest { segment_id: ids.segment_id, generation: ids.generation });
        self.notify(body, Some(ids.epoch));
    }

    /// Sends a request that is not answered (a release, a give-up) on the connection of
    /// `epoch` (any, with `None`) in one write that never waits, as [`Conn::release`]
    /// does; nothing is sent when that connection is gone (the daemon ended what it held).
    pub(crate) fn notify(&self, body: request::Body, epoch: Option<u64>) {
        let (written, at) = {
            let link = self.link();
            let at = link.epoch;
            match (&link.stream, epoch.is_none_or(|e| e == at)) {
                (Some(stream), true) => {
                    (wire::try_send(stream, &proto::Request { id: 0, body: Some(body), progress: false }), at)
                }
                _ => (Ok(()), at),
            }
        };
        if let Err(e) = written {
            self.lose(at, Broken::Lost(format!("a one-way request could not be sent at once: {e}")));
        }
    }

    /// Checks the connection without a request: if the daemon closed it, marks it lost
    /// and tries to reconnect (within the backoff). Returns whether it reconnected now.
    pub(crate) fn check(&self) -> Result<bool, Error> {
        let (epoch, peeked) = {
            // Under the link: no request can be registered (and sent) meanwhile.
            let link = self.link();
            let busy = {
                let inbox = lock(&self.inbox);
                !inbox.slots.is_empty() || !inbox.abandoned.is_empty() || inbox.reader.is_none()
            };
            if busy {
                // Replies are due: bytes on the socket are theirs, and a reader will notice
                // a close.
                return Ok(false);
            }
            let peeked = link.stream.as_ref().map(|stream| {
                let mut byte = [0u8; 1];
                let flags = nix::sys::socket::MsgFlags::MSG_PEEK | nix::sys::socket::MsgFlags::MSG_DONTWAIT;
                nix::sys::socket::recv(stream.as_raw_fd(), &mut byte, flags)
            });
            (link.epoch, peeked)
        };
        match peeked {
            None => {}
            Some(Err(nix::errno::Errno::EAGAIN)) => return Ok(false),
            Some(Ok(0)) => self.lose(epoch, Broken::Lost("the daemon closed the connection".into())),
            Some(Ok(_)) => {
                // A refusal or a close notice (reply id 0) is the only thing the daemon
                // sends unasked; read it so the next call reports it.
                self.lose(epoch, Broken::Lost("the daemon sent bytes nobody asked for".into()));
            }
            Some(Err(e)) => self.lose(epoch, Broken::Lost(format!("connection lost: {e}"))),
        }
        self.ensure()
    }

    /// Registers the lease the daemon counts for the segment `info` on connection `epoch`.
    pub(crate) fn lease(self: &Arc<Self>, info: &proto::SegmentReply, epoch: u64) -> Lease {
        let cell = Arc::new(LeaseCell {
            key: info.key.clone(),
            ids: Mutex::new(LeaseIds { segment_id: info.segment_id, generation: info.generation, epoch }),
        });
        let mut leases = lock(&self.leases);
        if leases.len() >= LEASE_SWEEP_FROM && leases.len().is_power_of_two() {
            leases.retain(|w| w.strong_count() > 0);
        }
        leases.push(Arc::downgrade(&cell));
        Lease { conn: Arc::clone(self), cell }
    }

    /// Leases held by this client that the connected daemon counts.
    pub(crate) fn live_leases(&self) -> usize {
        let epoch = {
            let link = self.link();
            if link.stream.is_none() {
                return 0;
            }
            link.epoch
        };
        lock(&self.leases).iter().filter_map(Weak::upgrade).filter(|c| lock(&c.ids).epoch == epoch).count()
    }
}

/// A lease on a segment; dropping it tells the daemon without waiting for anything but
/// one small write.
pub(crate) struct Lease {
    conn: Arc<Conn>,
    cell: Arc<LeaseCell>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let ids = *lock(&self.cell.ids);
        self.conn.release(ids);
    }
}
