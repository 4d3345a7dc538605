//! The connection to the daemon, and how it rides out a daemon restart.
//!
//! When the daemon goes away, mappings keep working (they belong to this process) and the
//! connection is marked lost: requests fail at once with [`Error::Unavailable`]. The next
//! call reconnects — at most once per backoff interval, which doubles from
//! [`BACKOFF_MIN`] to [`BACKOFF_MAX`] while the daemon stays away — and re-establishes the
//! lease of every model this client still holds, by key, so the new daemon counts them.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use crate::{Error, proto, wire};
use proto::{reply, request};

/// First wait between reconnection attempts.
pub const BACKOFF_MIN: Duration = Duration::from_millis(10);
/// Longest wait between reconnection attempts.
pub const BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Which segment a lease names on which connection.
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

struct State {
    stream: Option<UnixStream>,
    epoch: u64,
    backoff: Duration,
    next_attempt: Instant,
    last_error: String,
}

pub(crate) struct Conn {
    path: PathBuf,
    state: Mutex<State>,
    next_id: AtomicU64,
    pub(crate) tables: Mutex<HashMap<String, Arc<proto::SegmentReply>>>,
    leases: Mutex<Vec<Weak<LeaseCell>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Conn {
    pub(crate) fn new(path: PathBuf, stream: UnixStream) -> Self {
        Self {
            path,
            state: Mutex::new(State {
                stream: Some(stream),
                epoch: 1,
                backoff: BACKOFF_MIN,
                next_attempt: Instant::now(),
                last_error: String::new(),
            }),
            next_id: AtomicU64::new(1),
            tables: Mutex::new(HashMap::new()),
            leases: Mutex::new(Vec::new()),
        }
    }

    fn unavailable(&self, reason: String) -> Error {
        Error::Unavailable { path: self.path.clone(), reason }
    }

    /// Marks the connection lost after `e`, so the next call reconnects.
    fn lose(&self, st: &mut State, e: &Error) {
        st.stream = None;
        st.last_error = e.to_string();
        st.backoff = BACKOFF_MIN;
        st.next_attempt = Instant::now();
    }

    /// The live stream, reconnecting (within the backoff) and re-leasing if it was lost.
    /// Returns whether this call reconnected.
    fn ensure(&self, st: &mut State) -> Result<bool, Error> {
        if st.stream.is_some() {
            return Ok(false);
        }
        let now = Instant::now();
        if now < st.next_attempt {
            let wait = st.next_attempt - now;
            return Err(self.unavailable(format!("{}; next attempt in {} ms", st.last_error, wait.as_millis())));
        }
        match UnixStream::connect(&self.path) {
            Ok(stream) => {
                st.stream = Some(stream);
                st.epoch += 1;
                st.backoff = BACKOFF_MIN;
                lock(&self.tables).clear();
                self.relet(st);
                Ok(true)
            }
            Err(e) => {
                st.last_error = format!("cannot connect: {e}");
                st.next_attempt = now + st.backoff;
                st.backoff = (st.backoff * 2).min(BACKOFF_MAX);
                Err(self.unavailable(st.last_error.clone()))
            }
        }
    }

    /// Asks the new daemon for every held model again, so it holds leases for them.
    fn relet(&self, st: &mut State) {
        let cells: Vec<Arc<LeaseCell>> = {
            let mut leases = lock(&self.leases);
            leases.retain(|w| w.strong_count() > 0);
            leases.iter().filter_map(Weak::upgrade).collect()
        };
        for cell in cells {
            let body = request::Body::Get(proto::GetRequest { key: cell.key.clone(), ..Default::default() });
            match self.exchange(st, body, None) {
                Ok((info, _fd)) => {
                    *lock(&cell.ids) =
                        LeaseIds { segment_id: info.segment_id, generation: info.generation, epoch: st.epoch };
                }
                Err(Error::Daemon { .. }) => {} // not served any more: the mapping stays, unleased // not served any more: the mapping stays, unleased
                Err(_) => return,               // lost again; the next call retries
            }
        }
    }

    /// One request and its reply on the live stream; a broken stream is marked lost.
    fn exchange(
        &self,
        st: &mut State,
        body: request::Body,
        fd: Option<&File>,
    ) -> Result<(proto::SegmentReply, File), Error> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let req = proto::Request { id, body: Some(body) };
        let result = {
            let stream = st.stream.as_ref().ok_or_else(|| self.unavailable("not connected".into()))?;
            match wire::send(stream, &req, fd.map(|f| f.as_fd())) {
                Ok(()) => wire::recv(stream),
                // The daemon may have refused the connection (a limit, an allow list) and
                // closed it before reading anything: its reason is queued for us.
                Err(Error::Io(e))
                    if matches!(e.kind(), std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset) =>
                {
                    match wire::recv(stream) {
                        Ok(r) if r.reply.id == 0 => Ok(r),
                        _ => Err(Error::Io(e)),
                    }
                }
                Err(e) => Err(e),
            }
        };
        let wire::Received { reply, mut fds, fds_dropped } = match result {
            Ok(r) => r,
            Err(e) => {
                self.lose(st, &e);
                return Err(match e {
                    Error::Disconnected | Error::Io(_) => self.unavailable(format!("connection lost: {e}")),
                    other => other,
                });
            }
        };
        if reply.id == 0
            && let Some(reply::Body::Error(e)) = &reply.body
        {
            // A connection-level refusal (a connection limit, an allow list, a frame
            // deadline): the daemon closes the connection after it.
            let err = Error::Daemon { code: e.code(), message: e.message.clone() };
            self.lose(st, &err);
            return Err(err);
        }
        if reply.id != id {
            let e = Error::Protocol(format!("reply for request {} while waiting for {id}", reply.id));
            self.lose(st, &e);
            return Err(e);
        }
        match reply.body {
            Some(reply::Body::Segment(info)) if fds_dropped => {
                // The reply was read to its end, so the stream is in sync; give the lease
                // back, since this process cannot hold the segment's fd.
                let stream = st.stream.as_ref().ok_or_else(|| self.unavailable("not connected".into()))?;
                let release = proto::Request {
                    id: 0,
                    body: Some(request::Body::Release(proto::ReleaseRequest {
                        segment_id: info.segment_id,
                        generation: info.generation,
                    })),
                };
                if let Err(e) = wire::send(stream, &release, None) {
                    self.lose(st, &e);
                }
                Err(Error::FdDropped(info.key))
            }
            Some(reply::Body::Segment(info)) => {
                let idx = info.fd_index as usize;
                if fds.len() != 1 || idx != 0 {
                    let e = Error::Protocol(format!("segment reply carries {} fds, fd_index {idx}", fds.len()));
                    self.lose(st, &e);
                    return Err(e);
                }
                Ok((info, File::from(fds.swap_remove(0))))
            }
            Some(reply::Body::Error(e)) => Err(Error::Daemon { code: e.code(), message: e.message }),
            None => Err(Error::Protocol("reply without body".into())),
        }
    }

    /// Sends a request and waits for its segment reply (reconnecting first if needed).
    /// A connection the daemon closed while it was idle (it holds no lease after
    /// `limits.idle_timeout`) is reconnected once, at once, and the request sent again
    /// (pack and get are idempotent).
    pub(crate) fn call(&self, body: request::Body, fd: Option<&File>) -> Result<(proto::SegmentReply, File), Error> {
        let mut st = lock(&self.state);
        let fresh = self.ensure(&mut st)?;
        match self.exchange(&mut st, body.clone(), fd) {
            Err(Error::Unavailable { .. }) if !fresh && st.stream.is_none() => {
                self.ensure(&mut st)?;
                self.exchange(&mut st, body, fd)
            }
            other => other,
        }
    }

    /// Checks the connection without a request: if the daemon closed it, marks it lost
    /// and tries to reconnect (within the backoff). Returns whether it reconnected now.
    pub(crate) fn check(&self) -> Result<bool, Error> {
        let mut st = lock(&self.state);
        let peeked = st.stream.as_ref().map(|stream| {
            let mut byte = [0u8; 1];
            let flags = nix::sys::socket::MsgFlags::MSG_PEEK | nix::sys::socket::MsgFlags::MSG_DONTWAIT;
            nix::sys::socket::recv(stream.as_raw_fd(), &mut byte, flags)
        });
        match peeked {
            None => {}
            Some(Err(nix::errno::Errno::EAGAIN)) => return Ok(false),
            Some(Ok(0)) => self.lose(&mut st, &Error::Disconnected),
            Some(Ok(_)) => self.lose(&mut st, &Error::Protocol("the daemon sent bytes nobody asked for".into())),
            Some(Err(e)) => self.lose(&mut st, &Error::Io(e.into())),
        }
        self.ensure(&mut st)
    }

    /// Registers a lease on the segment `key` named by `info` on the current connection.
    pub(crate) fn lease(self: &Arc<Self>, info: &proto::SegmentReply) -> Lease {
        let epoch = lock(&self.state).epoch;
        let cell = Arc::new(LeaseCell {
            key: info.key.clone(),
            ids: Mutex::new(LeaseIds { segment_id: info.segment_id, generation: info.generation, epoch }),
        });
        let mut leases = lock(&self.leases);
        if leases.len() >= 32 && leases.len().is_power_of_two() {
            leases.retain(|w| w.strong_count() > 0);
        }
        leases.push(Arc::downgrade(&cell));
        Lease { conn: Arc::clone(self), cell }
    }

    /// Leases held by this client that the connected daemon counts.
    pub(crate) fn live_leases(&self) -> usize {
        let epoch = {
            let st = lock(&self.state);
            if st.stream.is_none() {
                return 0;
            }
            st.epoch
        };
        lock(&self.leases).iter().filter_map(Weak::upgrade).filter(|c| lock(&c.ids).epoch == epoch).count()
    }
}

/// A lease on a segment; dropping it tells the daemon (best effort: a closed connection
/// releases every lease anyway, and a lease of a lost connection needs no release).
pub(crate) struct Lease {
    conn: Arc<Conn>,
    cell: Arc<LeaseCell>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let st = lock(&self.conn.state);
        let ids = lock(&self.cell.ids);
        if let (Some(stream), true) = (&st.stream, ids.epoch == st.epoch) {
            let req = proto::Request {
                id: 0,
                body: Some(request::Body::Release(proto::ReleaseRequest {
                    segment_id: ids.segment_id,
                    generation: ids.generation,
                })),
            };
            let _ = wire::send(stream, &req, None);
        }
    }
}
