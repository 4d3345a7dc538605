//! Accepted control-plane connections: each holds its slot of the connection limits
//! (`limits.max_control_connections`, `…_per_uid`) until it closes, fails if its peer sends
//! no HTTP/2 preface in time or stops reading for long, and a Unix one carries
//! its caller's supplementary groups: tonic reports a Unix peer's uid and primary gid
//! (`SO_PEERCRED`); membership of `admin_gids` must also count groups the caller holds
//! besides its primary one (`SO_PEERGROUPS`, read once at accept, as the kernel recorded
//! them at connect).
#![forbid(unsafe_code)]

use std::io;
use std::os::fd::AsFd;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpStream, UnixStream};
use tokio::time::Sleep;
use tonic::transport::server::{Connected, TcpConnectInfo, UdsConnectInfo};

use crate::dataplane::Slot;
use crate::ratelog::RateLog;

/// Length of the HTTP/2 client connection preface (`PRI * HTTP/2.0…`), the first bytes
/// every client sends.
const PREFACE_BYTES: usize = 24;

/// Time a new connection has to send the HTTP/2 preface. A gRPC client sends it at once;
/// until it does, HTTP/2's keepalive pings cannot start, so without this a silent socket
/// would hold its slot for ever.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// Time writes to a connection may make no progress (its peer reads nothing, or too slowly
/// to drain the socket) before the connection is closed with the answers queued for it.
/// HTTP/2's own close after an unanswered ping cannot get through a full socket; this can.
pub const WRITE_STALL_TIMEOUT: Duration = Duration::from_secs(60);

/// The uid all TCP callers count as against `limits.max_control_connections_per_uid`:
/// `(uid_t)-1`, which no process has.
pub const TCP_PEER: u32 = u32::MAX;

/// How the log names the peer counted as `uid`.
pub fn describe(uid: u32) -> String {
    if uid == TCP_PEER { "TCP".to_string() } else { format!("uid {uid}") }
}

/// The supplementary groups of `stream`'s peer (none if the kernel cannot tell).
pub fn groups_of(stream: &UnixStream) -> Arc<[u32]> {
    crate::sys::socket::peer_groups(stream.as_fd()).unwrap_or_default().into()
}

/// An accepted control-plane connection: its slot, the two deadlines above, and (Unix) its
/// peer's supplementary groups.
pub struct Accepted<S> {
    inner: S,
    /// The uid it counts as ([`TCP_PEER`] for TCP).
    uid: u32,
    /// Its peer's supplementary groups (Unix; empty for TCP).
    groups: Arc<[u32]>,
    /// The log budget the lines about its close come out of.
    log: Arc<RateLog>,
    /// Bytes read, counted up to [`PREFACE_BYTES`].
    greeted: usize,
    /// Until the preface is in: when the connection fails if it is not in by then.
    hello_by: Option<Pin<Box<Sleep>>>,
    /// While writes make no progress: when the connection fails if none does by then.
    stalled: Option<Pin<Box<Sleep>>>,
    /// Given back when the connection closes.
    _slot: Slot,
}

impl<S> Accepted<S> {
    /// Wraps `inner`, admitted with `slot` as `uid`; the preface deadline starts now.
    pub fn new(inner: S, slot: Slot, uid: u32, groups: Arc<[u32]>, log: Arc<RateLog>) -> Self {
        let hello_by = Some(Box::pin(tokio::time::sleep(HELLO_TIMEOUT)));
        Self { inner, uid, groups, log, greeted: 0, hello_by, stalled: None, _slot: slot }
    }

    /// The error that closes the connection for `why`, logged within the log budget.
    fn closing(&self, why: String) -> io::Error {
        if self.log.allow() {
            tracing::warn!(peer = %describe(self.uid), "control plane: connection closed: {why}");
        }
        io::Error::new(io::ErrorKind::TimedOut, why)
    }

    /// Passes a write's outcome on, unless writes have made no progress for
    /// [`WRITE_STALL_TIMEOUT`]: then an error, which closes the connection.
    fn unless_stalled<T>(&mut self, cx: &mut Context<'_>, polled: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.stalled = None;
            return polled;
        }
        let stall = self.stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(WRITE_STALL_TIMEOUT)));
        match stall.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(self.closing(format!(
                "no write progressed for {} s (the peer reads nothing, or too slowly)",
                WRITE_STALL_TIMEOUT.as_secs()
            )))),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// What a request learns about its Unix-socket caller.
#[derive(Clone, Debug)]
pub struct LocalInfo {
    /// Peer address and `SO_PEERCRED` credentials.
    pub uds: UdsConnectInfo,
    /// Supplementary groups (`SO_PEERGROUPS`).
    pub groups: Arc<[u32]>,
}

impl Connected for Accepted<UnixStream> {
    type ConnectInfo = LocalInfo;

    fn connect_info(&self) -> LocalInfo {
        LocalInfo { uds: self.inner.connect_info(), groups: Arc::clone(&self.groups) }
    }
}

impl Connected for Accepted<TcpStream> {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.inner.connect_info()
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Accepted<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Some(hello_by) = this.hello_by.as_mut()
            && hello_by.as_mut().poll(cx).is_ready()
        {
            let why = format!("no HTTP/2 preface within {} s of connecting", HELLO_TIMEOUT.as_secs());
            return Poll::Ready(Err(this.closing(why)));
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            this.greeted = this.greeted.saturating_add(buf.filled().len() - before);
            if this.greeted >= PREFACE_BYTES {
                this.hello_by = None;
            }
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Accepted<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.unless_stalled(cx, polled)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.unless_stalled(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_flush(cx);
        this.unless_stalled(cx, polled)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_shutdown(cx);
        this.unless_stalled(cx, polled)
    }
}
