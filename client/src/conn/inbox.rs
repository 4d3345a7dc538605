//! The read side: a slot per request in flight, the frame reader handed from caller to
//! caller, and what becomes of each reply read.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use packd_proto::stream::Receiver;
use proto::{ErrorCode, reply};

use super::leases::{LeaseIds, Leasing};
use super::lock::lock;
use crate::error::{Error, Lost, ProtocolError};
use crate::proto;
use crate::wire::{self, Received, RecvFailure};

/// Why the connection of an epoch stopped, for every caller still waiting on it.
#[derive(Clone)]
pub(super) enum Broken {
    /// The daemon refused the connection with a reason (reply id 0) and closed it.
    Refused(ErrorCode, String),
    /// The stream failed.
    Lost(Lost),
}

/// A request sent and not answered yet: what has come for it, and its caller's wake-up.
pub(super) struct Slot {
    pub(super) reply: Option<Received>,
    /// The latest progress frame its caller has not seen yet.
    pub(super) progress: Option<proto::Progress>,
    /// Its caller sleeps on `wake` (it is not sending, reading or in a progress callback).
    pub(super) asleep: bool,
    pub(super) wake: Arc<Condvar>,
}

/// The read side of the current connection.
pub(super) struct Inbox {
    pub(super) epoch: u64,
    /// Requests in flight, by id: each caller waits on its own slot.
    pub(super) slots: HashMap<u64, Slot>,
    /// Requests whose callers gave up; their replies are dropped when they come.
    pub(super) abandoned: HashSet<u64>,
    /// The frame receiver, `None` while a caller is reading with it.
    pub(super) reader: Option<Receiver>,
    pub(super) broken: Option<Broken>,
}

impl Inbox {
    pub(super) fn fresh(epoch: u64) -> Self {
        Self {
            epoch,
            slots: HashMap::new(),
            abandoned: HashSet::new(),
            reader: Some(wire::reply_receiver()),
            broken: None,
        }
    }

    /// Wakes every waiting caller (the connection broke, or another replaced it).
    pub(super) fn wake_all(&self) {
        for slot in self.slots.values() {
            slot.wake.notify_one();
        }
    }

    /// Starts over for the connection of `epoch`; callers waiting on the old one wake and
    /// find it gone.
    pub(super) fn renew(&mut self, epoch: u64) {
        self.wake_all();
        *self = Inbox::fresh(epoch);
    }

    /// The caller of `id` leaves: its slot goes, and if nobody reads, one caller asleep is
    /// woken to read next (one awake takes the reader when it next looks).
    pub(super) fn leave(&mut self, id: u64) {
        self.slots.remove(&id);
        if self.reader.is_some()
            && let Some(next) = self.slots.values().find(|s| s.asleep)
        {
            next.wake.notify_one();
        }
    }
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
pub(super) struct Deadlines {
    pub(super) silence: Duration,
    pub(super) end: Instant,
}

/// What reading replies asks of the connection that holds the inbox: the inbox, the error
/// of an unavailable connection, and losing the connection.
pub(super) trait Reading: Leasing {
    fn inbox(&self) -> &Mutex<Inbox>;

    /// [`Error::Unavailable`] for `reason`.
    fn unavailable(&self, reason: Lost) -> Error;

    /// Marks the connection of `epoch` lost (`link::lose`).
    fn lose(&self, epoch: u64, why: Broken);

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
            let mut inbox = lock(self.inbox());
            let current = inbox.epoch == epoch;
            let Some(slot) = inbox.slots.get_mut(&id).filter(|_| current) else {
                return Err(Some(self.unavailable(Lost::WhileWaiting)));
            };
            if let Some(p) = slot.progress.take() {
                heard = Instant::now();
                drop(inbox);
                if let Some(f) = on_progress
                    && let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&p)))
                {
                    // The caller's callback panicked: its request is given up, its slot goes.
                    let mut inbox = lock(self.inbox());
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
        let mut inbox = lock(self.inbox());
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
            Err(RecvFailure::Broken(e)) => Some(Broken::Lost(Lost::Broken(Arc::new(e)))),
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
                    let lost = ProtocolError::Fds { fds: fds.len(), index: idx };
                    self.lose(epoch, Broken::Lost(Lost::Broken(Arc::new(Error::Protocol(lost)))));
                    return Err(Error::Protocol(ProtocolError::Fds { fds: fds.len(), index: idx }));
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
}
