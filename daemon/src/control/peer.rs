//! Control-plane connections that carry their caller's supplementary groups: tonic reports
//! a Unix peer's uid and primary gid (`SO_PEERCRED`); membership of `admin_gids` must also
//! count groups the caller holds besides its primary one (`SO_PEERGROUPS`, read once at
//! accept, as the kernel recorded them at connect).
#![forbid(unsafe_code)]

use std::io;
use std::os::fd::AsFd;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::UnixStream;
use tonic::transport::server::{Connected, UdsConnectInfo};

/// An accepted control-plane connection and its peer's supplementary groups.
pub struct CredStream {
    inner: UnixStream,
    groups: Arc<[u32]>,
}

impl CredStream {
    /// Wraps `inner`, reading its peer's groups (none if the kernel cannot tell).
    pub fn new(inner: UnixStream) -> Self {
        let groups = crate::sys::socket::peer_groups(inner.as_fd()).unwrap_or_default().into();
        Self { inner, groups }
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

impl Connected for CredStream {
    type ConnectInfo = LocalInfo;

    fn connect_info(&self) -> LocalInfo {
        LocalInfo { uds: self.inner.connect_info(), groups: Arc::clone(&self.groups) }
    }
}

impl AsyncRead for CredStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for CredStream {
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
