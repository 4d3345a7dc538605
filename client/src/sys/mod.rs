//! The system calls of the client side: seal checks and read-only mappings; and the C ABI
//! ([`capi`]). The only modules of this crate with `unsafe`. fd passing itself and the seal
//! set live in [`packd_proto::sys`] (shared with the daemon) and are re-exported here.

pub mod capi;

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, RawFd};

use memmap2::{Mmap, MmapOptions};
pub use packd_proto::sys::{MAX_FDS, Received, recv_with_fds, required_seals, seals, send_with_fds};

/// Maps the first `len` bytes of a sealed segment read-only and shared.
///
/// Fails with `PermissionDenied` unless `file` carries all of [`required_seals`], and with
/// `InvalidData` unless the file is exactly `len` bytes long.
/// With `populate`, every page is mapped at once (`MAP_POPULATE`).
pub fn map_sealed(file: &File, len: u64, populate: bool) -> io::Result<Mmap> {
    let have = seals(file.as_fd())?;
    if !have.contains(required_seals()) {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("segment is not sealed (seals {have:?}); refusing to map it"),
        ));
    }
    let size = file.metadata()?.len();
    if size != len {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("segment is {size} bytes, the reply says {len}"),
        ));
    }
    let len = usize::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    // SAFETY: the file carries F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_WRITE|F_SEAL_SEAL (checked
    // above, and seals can never be removed), so its size is fixed at `len` and its bytes can
    // never change: the mapping can neither fault with SIGBUS nor see writes.
    unsafe {
        let mut options = MmapOptions::new();
        options.len(len);
        if populate {
            options.populate();
        }
        options.map(file)
    }
}

/// A duplicate (close-on-exec) of an open file descriptor that a C or Python caller gives
/// as a bare number; the caller keeps its own. A negative number is `InvalidInput`, one
/// that is not open `EBADF`.
pub fn dup_raw_fd(fd: RawFd) -> io::Result<File> {
    if fd < 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{fd} is not a file descriptor")));
    }
    // SAFETY: the caller states that `fd` is its open file descriptor; it is only borrowed
    // for this call, to duplicate it. If it is not open, the duplication fails with EBADF
    // and nothing else happens.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    Ok(File::from(borrowed.try_clone_to_owned()?))
}
