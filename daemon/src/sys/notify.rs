//! The service manager's side channels: `sd_notify` messages (with fds for the fd store)
//! on `$NOTIFY_SOCKET`, and the fds systemd passes in `LISTEN_FDS` / `LISTEN_FDNAMES`.
//!
//! Written against systemd's documented protocol (`sd_notify(3)`, `sd_listen_fds(3)`,
//! `FILE_DESCRIPTOR_STORE.md`); without systemd, every call here is a no-op and the daemon
//! binds its own sockets.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::time::Duration;

use nix::errno::Errno;
use nix::fcntl::{FcntlArg, FdFlag, fcntl};
use nix::sys::socket::{AddressFamily, SockType, SockaddrLike, getsockname, getsockopt, sockopt};
use packd_proto::sys::{MAX_FDS, send_with_fds};

/// The first fd systemd passes (`SD_LISTEN_FDS_START`).
const LISTEN_FDS_START: RawFd = 3;

/// A connection to the service manager's notification socket; inert without one.
pub struct Notifier {
    sock: Option<UnixDatagram>,
}

impl Notifier {
    /// Connects to `$NOTIFY_SOCKET` (a path, or `@name` for an abstract socket); inert
    /// when the variable is unset.
    pub fn from_env() -> io::Result<Self> {
        let Some(path) = std::env::var_os("NOTIFY_SOCKET").filter(|p| !p.is_empty()) else {
            return Ok(Self { sock: None });
        };
        let sock = UnixDatagram::unbound()?;
        let bytes = path.as_encoded_bytes();
        if let Some(name) = bytes.strip_prefix(b"@") {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
            sock.connect_addr(&addr)?;
        } else {
            sock.connect(&path)?;
        }
        Ok(Self { sock: Some(sock) })
    }

    /// An inert notifier.
    pub fn none() -> Self {
        Self { sock: None }
    }

    /// Whether a service manager listens.
    pub fn enabled(&self) -> bool {
        self.sock.is_some()
    }

    /// Sends newline-separated `KEY=VALUE` assignments without waiting: if the manager's
    /// queue is full the message is dropped (the next one carries the news) rather than
    /// stalling the caller, which may be the serving runtime.
    pub fn send(&self, message: &str) -> io::Result<()> {
        match &self.sock {
            Some(sock) if !message.is_empty() => send_with_fds(sock.as_fd(), message.as_bytes(), &[], true).map(drop),
            _ => Ok(()),
        }
    }

    /// Sends `message`, waiting for room in the manager's queue: for the state changes
    /// (`READY=1`, `RELOADING=1`, `STOPPING=1`) that must not be dropped. Blocking.
    pub fn send_wait(&self, message: &str) -> io::Result<()> {
        match &self.sock {
            Some(sock) if !message.is_empty() => send_with_fds(sock.as_fd(), message.as_bytes(), &[], false).map(drop),
            _ => Ok(()),
        }
    }

    /// Sends `message` with `fds` attached (`FDSTORE=1`), waiting for room in the
    /// manager's queue. At most [`MAX_FDS`] fds per message.
    pub fn send_fds(&self, message: &str, fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        match &self.sock {
            Some(sock) if fds.len() <= MAX_FDS => send_with_fds(sock.as_fd(), message.as_bytes(), fds, false).map(drop),
            Some(_) => Err(io::Error::new(io::ErrorKind::InvalidInput, "too many fds in one notify message")),
            None => Ok(()),
        }
    }
}

/// The watchdog interval systemd asked for (`WATCHDOG_USEC`, when `WATCHDOG_PID` is unset
/// or names this process).
pub fn watchdog_interval() -> Option<Duration> {
    if let Some(pid) = std::env::var_os("WATCHDOG_PID")
        && pid.to_str().and_then(|p| p.parse::<u32>().ok()) != Some(std::process::id())
    {
        return None;
    }
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    (usec > 0).then(|| Duration::from_micros(usec))
}

/// `CLOCK_MONOTONIC` in microseconds, for `MONOTONIC_USEC=` on reload.
pub fn monotonic_usec() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|t| u64::try_from(t.tv_sec()).unwrap_or(0) * 1_000_000 + u64::try_from(t.tv_nsec()).unwrap_or(0) / 1_000)
        .unwrap_or(0)
}

/// One fd passed by the service manager, with its name (`unknown` when unnamed).
pub struct ListenFd {
    /// `FileDescriptorName=` of the socket, or the `FDNAME=` it was stored under.
    pub name: String,
    /// The fd, owned and close-on-exec.
    pub fd: OwnedFd,
}

/// Takes the fds systemd passed (`LISTEN_PID` must be this process). Each becomes an
/// owned, close-on-exec fd; an fd number that is not open is an error.
pub fn listen_fds() -> io::Result<Vec<ListenFd>> {
    let invalid = |what: String| io::Error::new(io::ErrorKind::InvalidInput, what);
    let Some(pid) = std::env::var_os("LISTEN_PID") else { return Ok(Vec::new()) };
    let pid: u32 =
        pid.to_str().and_then(|p| p.parse().ok()).ok_or_else(|| invalid("LISTEN_PID is not a pid".into()))?;
    if pid != std::process::id() {
        return Ok(Vec::new());
    }
    let count: RawFd = std::env::var("LISTEN_FDS")
        .ok()
        .and_then(|n| n.parse().ok())
        .filter(|n| (0..=65536).contains(n))
        .ok_or_else(|| invalid("LISTEN_FDS is not a count of fds".into()))?;
    let names: Vec<String> = match std::env::var("LISTEN_FDNAMES") {
        Ok(n) if !n.is_empty() => n.split(':').map(str::to_string).collect(),
        _ => Vec::new(),
    };
    if !names.is_empty() && names.len() != count as usize {
        return Err(invalid(format!("LISTEN_FDNAMES names {} fds but LISTEN_FDS is {count}", names.len())));
    }
    let mut fds = Vec::with_capacity(count as usize);
    for i in 0..count {
        let raw = LISTEN_FDS_START + i;
        // SAFETY: F_GETFD on any number is harmless; it tells whether `raw` is open.
        let borrowed = unsafe { BorrowedFd::borrow_raw(raw) };
        fcntl(borrowed, FcntlArg::F_GETFD).map_err(|e| invalid(format!("LISTEN_FDS fd {raw} is not open: {e}")))?;
        // SAFETY: systemd's protocol hands fds LISTEN_FDS_START..+LISTEN_FDS to this process
        // (LISTEN_PID checked above); `raw` is open (checked) and nothing else in this
        // process claims these numbers, so taking ownership is sound.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        fcntl(fd.as_fd(), FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC)).map_err(io::Error::from)?;
        let name = names.get(i as usize).cloned().unwrap_or_else(|| "unknown".to_string());
        fds.push(ListenFd { name, fd });
    }
    Ok(fds)
}

/// Why a passed socket cannot serve as a listening Unix stream socket.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PassedSocketError {
    /// Not a socket at all.
    #[error("not a socket ({0})")]
    NotASocket(Errno),
    /// A datagram or seqpacket socket.
    #[error("a {} socket, not a stream socket (ListenStream=)", sock_type_name(*.0))]
    NotStream(SockType),
    /// A TCP or other non-Unix socket.
    #[error("a {0} socket, not a Unix socket (ListenStream= must be a path)")]
    NotUnix(String),
    /// A socket that does not listen.
    #[error("not listening")]
    NotListening,
    /// Its address or state could not be read.
    #[error("cannot inspect it: {0}")]
    Inspect(Errno),
}

/// Checks that a passed socket can serve as a listening Unix stream socket.
pub fn check_listening_unix_stream(fd: BorrowedFd<'_>) -> Result<(), PassedSocketError> {
    let ty = getsockopt(&fd, sockopt::SockType).map_err(PassedSocketError::NotASocket)?;
    if ty != SockType::Stream {
        return Err(PassedSocketError::NotStream(ty));
    }
    let addr: nix::sys::socket::SockaddrStorage = getsockname(fd.as_raw_fd()).map_err(PassedSocketError::Inspect)?;
    if addr.family() != Some(AddressFamily::Unix) {
        let family = match addr.family() {
            Some(AddressFamily::Inet) => "TCP/IPv4 (AF_INET)".to_string(),
            Some(AddressFamily::Inet6) => "TCP/IPv6 (AF_INET6)".to_string(),
            Some(other) => format!("{other:?}"),
            None => "unknown".to_string(),
        };
        return Err(PassedSocketError::NotUnix(family));
    }
    if !getsockopt(&fd, sockopt::AcceptConn).map_err(PassedSocketError::Inspect)? {
        return Err(PassedSocketError::NotListening);
    }
    Ok(())
}

/// A socket type as `socket(2)` names it (`SOCK_DGRAM`), for messages.
fn sock_type_name(ty: SockType) -> &'static str {
    match ty {
        SockType::Stream => "stream (SOCK_STREAM)",
        SockType::Datagram => "datagram (SOCK_DGRAM)",
        SockType::SeqPacket => "seqpacket (SOCK_SEQPACKET)",
        SockType::Raw => "raw (SOCK_RAW)",
        _ => "other",
    }
}

/// The path a Unix socket is bound to, for logs.
pub fn socket_path(fd: BorrowedFd<'_>) -> String {
    getsockname::<nix::sys::socket::UnixAddr>(fd.as_raw_fd())
        .ok()
        .and_then(|a| a.path().map(|p| p.display().to_string()))
        .unwrap_or_else(|| "(unnamed)".into())
}

/// What an fd is, read from the kernel: for checking fds the fd store gives back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdIdentity {
    /// `st_dev`.
    pub dev: u64,
    /// `st_ino`.
    pub ino: u64,
    /// `st_size`.
    pub size: u64,
    /// A regular file created by `memfd_create` (its `/proc/self/fd` link names `/memfd:`).
    pub memfd: bool,
}

/// Identifies `fd` (fstat and its `/proc/self/fd` link).
pub fn identify(fd: BorrowedFd<'_>) -> io::Result<FdIdentity> {
    let st = nix::sys::stat::fstat(fd).map_err(io::Error::from)?;
    let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))?;
    let regular = (st.st_mode & libc::S_IFMT) == libc::S_IFREG;
    Ok(FdIdentity {
        dev: st.st_dev,
        ino: st.st_ino,
        size: u64::try_from(st.st_size).unwrap_or(0),
        memfd: regular && link.as_os_str().as_encoded_bytes().starts_with(b"/memfd:"),
    })
}

/// `$FDSTORE`: how many fds systemd's store takes (its `FileDescriptorStoreMax=`, told by
/// systemd >= 254); `None` when not told.
pub fn fd_store_max() -> Option<usize> {
    std::env::var("FDSTORE").ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notifications_reach_the_socket_and_fds_travel() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let listener = UnixDatagram::bind(&path).unwrap();
        let sock = UnixDatagram::unbound().unwrap();
        sock.connect(&path).unwrap();
        let n = Notifier { sock: Some(sock) };
        n.send("READY=1\nSTATUS=ok").unwrap();
        let mut buf = [0u8; 64];
        let got = listener.recv(&mut buf).unwrap();
        assert_eq!(&buf[..got], b"READY=1\nSTATUS=ok");
        let memfd = crate::sys::memfd::create("t").unwrap();
        n.send_fds("FDSTORE=1\nFDNAME=x", &[memfd.as_fd()]).unwrap();
        let r = packd_proto::sys::recv_with_fds(listener.as_fd(), &mut buf, false).unwrap();
        assert_eq!((r.fds.len(), &buf[..r.bytes]), (1, &b"FDSTORE=1\nFDNAME=x"[..]));
        let id = identify(r.fds[0].as_fd()).unwrap();
        assert!(id.memfd && id == identify(memfd.as_fd()).unwrap());
        assert!(!identify(listener.as_fd()).unwrap().memfd);
        assert_eq!(
            check_listening_unix_stream(listener.as_fd()).unwrap_err(),
            PassedSocketError::NotStream(SockType::Datagram)
        );
        assert!(Notifier::none().send("READY=1").is_ok());
    }
}
