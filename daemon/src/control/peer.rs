//! Accepted control-plane connections: each holds its slot of the connection limits
//! (`limits.max_control_connections`, `…_per_uid`) until it closes, and a Unix one carries
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

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpStream, UnixStream};
use tonic::transport::server::{Connected, TcpConnectInfo, UdsConnectInfo};

use crate::dataplane::Slot;

/// An accepted control-plane connection, its slot, and (Unix) its peer's supplementary
/// groups.
pub struct Accepted<S> {
    inner: S,
    groups: Arc<[u32]>,
    /// Given back when the connection closes.
    _slot: Slot,
}

impl Accepted<UnixStream> {
    /// Wraps `inner`, reading its peer's groups (none if the kernel cannot tell).
    pub fn local(inner: UnixStream, slot: Slot) -> Self {
        let groups = crate::sys::socket::peer_groups(inner.as_fd()).unwrap_or_default().into();
        Self { inner, groups, _slot: slot }
    }
}

impl Accepted<TcpStream> {
    /// Wraps `inner`.
    pub fn tcp(inner: TcpStream, slot: Slot) -> Self {
        Self { inner, groups: Arc::new([]), _slot: slot }
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
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Accepted<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}
