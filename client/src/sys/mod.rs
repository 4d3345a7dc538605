//! The system calls of the client side: seal checks, read-only mappings, connecting with a
//! deadline, duplicating a caller's fd. The only module of this crate with `unsafe`. fd
//! passing itself and the seal set live in [`packd_proto::sys`] (shared with the daemon)
//! and are re-exported here. The C ABI and the XNNPACK provider, which hand raw memory to C,
//! are a crate of their own (`packd-capi`).

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, UnixAddr};

use memmap2::{Mmap, MmapOptions};
pub use packd_proto::sys::{MAX_FDS, Received, recv_with_fds, required_seals, seals, send_with_fds};

/// Children of `fork` counted by a `pthread_atfork` handler (registered at the first
/// [`fork_generation`]).
static FORKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// Whether the handler could not be registered (then the pid tells processes apart).
static FORKS_UNWATCHED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn count_fork_in_child() {
    FORKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// Which process this is, as far as connections go: changes in the child of every `fork`
/// made after the first call. An atomic load on the request path, no system call (the
/// pid's `getpid` would be one per lock of a connection); the pid only if the fork
/// handler could not be registered.
pub fn fork_generation() -> u64 {
    static WATCH: std::sync::Once = std::sync::Once::new();
    WATCH.call_once(|| {
        // SAFETY: registers a child handler that only adds to an atomic, which is
        // async-signal-safe and so allowed in the child of a multi-threaded fork; no
        // pointer is passed.
        if unsafe { libc::pthread_atfork(None, None, Some(count_fork_in_child)) } != 0 {
            FORKS_UNWATCHED.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    });
    if FORKS_UNWATCHED.load(std::sync::atomic::Ordering::Relaxed) {
        return u64::from(std::process::id()) | 1 << 63;
    }
    FORKS.load(std::sync::atomic::Ordering::Relaxed)
}

/// `PermissionDenied` unless `file` carries all of [`required_seals`].
fn check_seals(file: &File) -> io::Result<()> {
    let have = seals(file.as_fd())?;
    if !have.contains(required_seals()) {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("segment is not sealed (seals {have:?}); refusing to map it"),
        ));
    }
    Ok(())
}

/// Maps the first `len` bytes of `file`, whose seals the caller has checked
/// ([`check_seals`]), read-only and shared; `InvalidData` unless the file is exactly `len`
/// bytes long.
fn map_checked(file: &File, len: u64, populate: bool) -> io::Result<Mmap> {
    let size = file.metadata()?.len();
    if size != len {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("segment is {size} bytes, the reply says {len}"),
        ));
    }
    let len = usize::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    // SAFETY: the file carries F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_WRITE|F_SEAL_SEAL (both
    // callers checked with `check_seals`, and seals can never be removed), so its size is
    // fixed at `len` and its bytes can never change: the mapping can neither fault with
    // SIGBUS nor see writes.
    let map = unsafe { MmapOptions::new().len(len).map(file) }?;
    if !populate {
        return Ok(map);
    }
    // MADV_POPULATE_READ maps the pages in batches: about a sixth of MAP_POPULATE's cost
    // for a shared file (476 MiB: 50 against 310 ms). MAP_POPULATE before Linux 5.14.
    match map.advise(memmap2::Advice::PopulateRead) {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            drop(map);
            // SAFETY: as above.
            unsafe { MmapOptions::new().len(len).populate().map(file) }
        }
        Err(e) => Err(e),
        Ok(()) => Ok(map),
    }
}

/// A file known to carry every one of [`required_seals`]: made only by
/// [`SealedFile::check`]. Seals can never be removed, so this stays true for the file's life
/// and mapping it needs no second check (one system call less per get).
#[derive(Debug)]
pub struct SealedFile(File);

impl SealedFile {
    /// Checks `file`'s seals: `PermissionDenied` unless it carries all of
    /// [`required_seals`] (shrink, grow, write and seal); a file that cannot be sealed at
    /// all (not a memfd or tmpfs file) fails with `InvalidInput` (`EINVAL`).
    pub fn check(file: File) -> io::Result<Self> {
        check_seals(&file)?;
        Ok(SealedFile(file))
    }

    /// The file.
    pub fn file(&self) -> &File {
        &self.0
    }

    /// Maps the whole file, which must be exactly `len` bytes long (`InvalidData`
    /// otherwise), read-only and shared. With `populate`, every page is mapped at once
    /// (`MADV_POPULATE_READ`).
    pub fn map(&self, len: u64, populate: bool) -> io::Result<Mmap> {
        map_checked(&self.0, len, populate)
    }
}

/// Maps a sealed segment of exactly `len` bytes, whole, read-only and shared.
///
/// Fails with `PermissionDenied` unless `file` carries all of [`required_seals`] (shrink,
/// grow, write and seal), with `InvalidInput` for a file that cannot be sealed at all, and
/// with `InvalidData` unless the file is exactly `len` bytes long.
/// With `populate`, every page is mapped at once (`MADV_POPULATE_READ`).
pub fn map_sealed(file: &File, len: u64, populate: bool) -> io::Result<Mmap> {
    check_seals(file)?;
    map_checked(file, len, populate)
}

/// How long [`connect_within`] sleeps between attempts while the listen backlog is full.
const CONNECT_RETRY: Duration = Duration::from_millis(2);

/// Connects a close-on-exec stream socket to `path` within `timeout`. A Unix socket's
/// connect blocks only while the listener's backlog is full; here it is non-blocking and
/// retried until `timeout` (then `TimedOut`). Writes on the returned (blocking) stream
/// wait at most `send_timeout`, so no write can hang on a daemon that stopped reading.
pub fn connect_within(path: &Path, timeout: Duration, send_timeout: Duration) -> io::Result<UnixStream> {
    let addr = UnixAddr::new(path).map_err(io::Error::from)?;
    let fd =
        socket::socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK, None)
            .map_err(io::Error::from)?;
    let deadline = Instant::now() + timeout;
    loop {
        match socket::connect(std::os::fd::AsRawFd::as_raw_fd(&fd), &addr) {
            Ok(()) => break,
            Err(Errno::EINTR) => {}
            Err(Errno::EAGAIN) if Instant::now() < deadline => std::thread::sleep(CONNECT_RETRY),
            Err(Errno::EAGAIN) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("the daemon's listen backlog stayed full for {timeout:?}"),
                ));
            }
            Err(e) => return Err(e.into()),
        }
    }
    let stream = UnixStream::from(fd);
    stream.set_nonblocking(false)?;
    stream.set_write_timeout(Some(send_timeout.max(Duration::from_millis(1))))?;
    Ok(stream)
}

/// A duplicate (close-on-exec) of an open file descriptor that a C or Python caller gives
/// as a bare number; the caller keeps its own. A negative number is `InvalidInput`, one
/// that is not open `EBADF`.
///
/// # Safety
/// `fd` must be a file descriptor the caller owns and keeps open for the duration of the
/// call, or a number that is not open at all. Any other open number (one that belongs to
/// another part of the process, such as stdout when a language turned `True` into 1) is
/// duplicated and sent to the daemon as if the caller had meant it.
pub unsafe fn dup_raw_fd(fd: RawFd) -> io::Result<File> {
    if fd < 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{fd} is not a file descriptor")));
    }
    // SAFETY: by this function's contract `fd` is the caller's own descriptor, open for the
    // call; it is only borrowed to duplicate it. A number that is not open fails the
    // duplication with EBADF and nothing else happens.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    Ok(File::from(borrowed.try_clone_to_owned()?))
}
