//! What the tests need of the system: attempts to defeat a segment's seals, for the seal
//! tests (each returns the errno the kernel answered with, or `None` if the attempt
//! succeeded, which the tests reject), and the start of the [`guard`] that keeps tests off
//! the host's packd directories.

pub mod guard;

use std::fs::File;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, AsRawFd};
use std::ptr::NonNull;

use nix::errno::Errno;
use nix::sys::mman::{MapFlags, ProtFlags, mmap, mprotect, munmap};

/// Tries `mmap(PROT_READ|PROT_WRITE, MAP_SHARED)` of `len` bytes.
pub fn map_shared_writable(file: &File, len: usize) -> Option<Errno> {
    let len = NonZeroUsize::new(len)?;
    // SAFETY: a fresh mapping chosen by the kernel (no address hint), of a file we hold open;
    // if it succeeds it is unmapped at once and never dereferenced.
    match unsafe {
        mmap(None, len, ProtFlags::PROT_READ | ProtFlags::PROT_WRITE, MapFlags::MAP_SHARED, file.as_fd(), 0)
    } {
        Ok(ptr) => {
            // SAFETY: `ptr` is the mapping of `len` bytes just created above.
            let _ = unsafe { munmap(ptr, len.get()) };
            None
        }
        Err(e) => Some(e),
    }
}

/// Maps `len` bytes read-only shared, then tries `mprotect(PROT_READ|PROT_WRITE)`.
pub fn mprotect_to_writable(file: &File, len: usize) -> Option<Errno> {
    let len = NonZeroUsize::new(len)?;
    // SAFETY: as above; the read-only mapping is never written and is unmapped before return.
    let ptr: NonNull<libc::c_void> =
        unsafe { mmap(None, len, ProtFlags::PROT_READ, MapFlags::MAP_SHARED, file.as_fd(), 0) }.ok()?;
    // SAFETY: `ptr`/`len` describe the mapping created above.
    let res = unsafe { mprotect(ptr, len.get(), ProtFlags::PROT_READ | ProtFlags::PROT_WRITE) };
    // SAFETY: `ptr`/`len` describe the mapping created above; nothing refers to it any more.
    let _ = unsafe { munmap(ptr, len.get()) };
    res.err()
}

/// Maps `len` bytes of `file` writable and shared, runs `while_mapped` with the mapping
/// alive, and unmaps it: for a publisher that keeps its writable mapping while it seals.
pub fn with_writable_mapping<T>(file: &File, len: usize, while_mapped: impl FnOnce() -> T) -> Result<T, Errno> {
    let size = NonZeroUsize::new(len).ok_or(Errno::EINVAL)?;
    // SAFETY: a fresh mapping chosen by the kernel (no address hint) of a file we hold open;
    // it is never dereferenced, only kept alive while `while_mapped` runs, then unmapped.
    let ptr = unsafe {
        mmap(None, size, ProtFlags::PROT_READ | ProtFlags::PROT_WRITE, MapFlags::MAP_SHARED, file.as_fd(), 0)
    }?;
    let out = while_mapped();
    // SAFETY: `ptr` is the mapping of `len` bytes created above, unmapped once.
    let _ = unsafe { munmap(ptr, len) };
    Ok(out)
}

/// Pages of `file` in the page cache (`mincore` of a read-only mapping that is never read).
pub fn resident_pages(file: &File) -> usize {
    let len = usize::try_from(file.metadata().map(|m| m.len()).unwrap_or(0)).unwrap_or(0);
    let Some(size) = NonZeroUsize::new(len) else { return 0 };
    // SAFETY: a fresh read-only mapping chosen by the kernel of a file we hold open; it is
    // never dereferenced (mincore only asks about it) and unmapped before return.
    let ptr = unsafe { mmap(None, size, ProtFlags::PROT_READ, MapFlags::MAP_SHARED, file.as_fd(), 0) }
        .expect("mapping the file to ask mincore");
    let page = usize::try_from(nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE).ok().flatten().unwrap_or(4096))
        .unwrap_or(4096);
    let mut vec = vec![0u8; len.div_ceil(page)];
    // SAFETY: `ptr`/`len` describe the mapping created above; `vec` has one byte per page.
    let rc = unsafe { libc::mincore(ptr.as_ptr(), len, vec.as_mut_ptr()) };
    // SAFETY: `ptr`/`len` describe the mapping created above; nothing refers to it any more.
    let _ = unsafe { munmap(ptr, len) };
    assert_eq!(rc, 0, "mincore: {}", Errno::last());
    vec.iter().filter(|&&b| b & 1 == 1).count()
}

/// Connects to the stream socket at `path` without blocking: `Ok(None)` when its backlog is
/// full (`EAGAIN`), where `UnixStream::connect` would wait for the daemon to accept.
pub fn connect_nonblocking(path: &std::path::Path) -> Result<Option<std::os::unix::net::UnixStream>, Errno> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket};
    let fd = socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC, None)?;
    match connect(fd.as_raw_fd(), &UnixAddr::new(path)?) {
        Ok(()) => Ok(Some(std::os::unix::net::UnixStream::from(fd))),
        Err(Errno::EAGAIN) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Starts the host-directory guard ([`guard`]) before `main` and has it report at
/// exit.
#[used]
#[unsafe(link_section = ".init_array")]
static GUARD_AT_START: extern "C" fn() = guard_at_start;

extern "C" fn guard_at_start() {
    guard::start();
    // SAFETY: registers a plain `extern "C" fn` with no arguments, as atexit wants.
    unsafe { libc::atexit(guard_at_exit) };
}

extern "C" fn guard_at_exit() {
    if let Some(report) = guard::report() {
        eprintln!("{report}");
        // SAFETY: ends the process at once; `exit` must not be called again from an atexit
        // handler, `_exit` runs none.
        unsafe { libc::_exit(1) };
    }
}
