//! [`Conn`], which holds the parts' state and ties them: a request and its reply, a request
//! sent without waiting, a check of an idle connection, and the timeouts.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use proto::request;

use super::inbox::{Answer, Answered, Broken, Deadlines, Inbox, OnProgress, Reading, Slot};
use super::leases::{self, LeaseCell, Leasing};
use super::link::{self, Link, Linking};
use super::lock::lock;
use super::reports::{self, Reporting, Reports};
use crate::error::{Error, Lost, ProtocolError};
use crate::timeouts::{Call, Deadline, Timeouts};
use crate::{proto, wire};

/// The connection to the daemon: the state of its parts, and what ties them.
pub(crate) struct Conn {
    path: PathBuf,
    link: Mutex<Link>,
    inbox: Mutex<Inbox>,
    next_id: AtomicU64,
    pub(crate) tables: Mutex<HashMap<String, Arc<proto::SegmentReply>>>,
    leases: Mutex<Vec<Weak<LeaseCell>>>,
    reports: Mutex<Reports>,
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
        let link = Link::connect(&path, timeouts)?;
        Ok(Self {
            path,
            link: Mutex::new(link),
            inbox: Mutex::new(Inbox::fresh(1)),
            next_id: AtomicU64::new(1),
            tables: Mutex::new(HashMap::new()),
            leases: Mutex::new(Vec::new()),
            reports: Mutex::new(Reports::default()),
        })
        .inspect(|c| c.send_reports(true))
    }

    pub(crate) fn timeouts(&self) -> Timeouts {
        lock(&self.link).timeouts
    }

    pub(crate) fn set_timeouts(&self, timeouts: Timeouts) {
        lock(&self.link).timeouts = timeouts;
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
                None => Err(self.unavailable(Lost::NotConnected)),
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
                    self.lose(epoch, Broken::Lost(Lost::send(&e)));
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

    /// Sends a request that is not answered (a release, a give-up) on the connection of
    /// `epoch` (any, with `None`) in one write that never waits, as [`Leasing::release`]
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
            self.lose(at, Broken::Lost(Lost::OneWay(Arc::new(e))));
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
            Some(Ok(0)) => self.lose(epoch, Broken::Lost(Lost::Closed)),
            Some(Ok(_)) => {
                // A refusal or a close notice (reply id 0) is the only thing the daemon
                // sends unasked; read it so the next call reports it.
                self.lose(epoch, Broken::Lost(Lost::Unasked));
            }
            Some(Err(e)) => self.lose(epoch, Broken::Lost(Lost::Errno(e))),
        }
        self.ensure()
    }

    /// Keeps `r` as this client's latest report of its engine and model and sends what is
    /// unsent ([`Reporting::report`]).
    pub(crate) fn report(self: &Arc<Self>, r: proto::WorkerReport) {
        Reporting::report(self, r);
    }

    /// Registers the lease the daemon counts for the segment `info` on connection `epoch`
    /// ([`Leasing::lease`]).
    pub(crate) fn lease(self: &Arc<Self>, info: &proto::SegmentReply, epoch: u64) -> Lease {
        Leasing::lease(self, info, epoch)
    }

    /// Leases held by this client that the connected daemon counts ([`Linking::live_leases`]).
    pub(crate) fn live_leases(&self) -> usize {
        Linking::live_leases(self)
    }
}

/// A lease on a segment, counted on a [`Conn`].
pub(crate) type Lease = leases::Lease<Conn>;

impl Leasing for Conn {
    fn leases(&self) -> &Mutex<Vec<Weak<LeaseCell>>> {
        &self.leases
    }

    fn notify(&self, body: request::Body, epoch: Option<u64>) {
        Conn::notify(self, body, epoch);
    }
}

impl Reading for Conn {
    fn inbox(&self) -> &Mutex<Inbox> {
        &self.inbox
    }

    fn unavailable(&self, reason: Lost) -> Error {
        Error::Unavailable { path: self.path.clone(), reason }
    }

    fn lose(&self, epoch: u64, why: Broken) {
        link::lose(self, epoch, why);
    }
}

impl Linking for Conn {
    fn link_mutex(&self) -> &Mutex<Link> {
        &self.link
    }

    fn path(&self) -> &Path {
        &self.path
    }

    fn tables(&self) -> &Mutex<HashMap<String, Arc<proto::SegmentReply>>> {
        &self.tables
    }

    fn get(&self, body: request::Body) -> Result<Answered, Error> {
        self.exchange(body, None, Kind::Get, None)
    }

    fn send_reports(&self, all: bool) {
        reports::send_reports(self, all);
    }
}

impl Reporting for Conn {
    fn reports(&self) -> &Mutex<Reports> {
        &self.reports
    }
}
