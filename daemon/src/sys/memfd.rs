//! Sealed memfd segments: create, size, fill through a temporary writable mapping, seal.
//!
//! A segment's fd never leaves the daemon before [`seal`] has applied
//! `F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE` and then `F_SEAL_SEAL`.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};

use memmap2::MmapMut;
use nix::errno::Errno;
use nix::fcntl::{FallocateFlags, FcntlArg, fallocate, fcntl};
use packd_proto::sys::required_seals;

/// `MFD_NOEXEC_SEAL` (Linux 6.3+): the memfd is not executable and cannot be made so.
const MFD_NOEXEC_SEAL: libc::c_uint = 0x0008;

/// Errors of memfd handling.
#[derive(Debug, thiserror::Error)]
pub enum MemfdError {
    /// `memfd_create` failed.
    #[error("memfd_create failed: {}", explain_create(*.0))]
    Create(Errno),
    /// Sizing the memfd failed (ENOSPC/ENOMEM when tmpfs or memory is exhausted).
    #[error("cannot size memfd to {size} bytes: {source}")]
    Size {
        /// Requested size.
        size: u64,
        /// The error from `ftruncate`.
        source: io::Error,
    },
    /// Mapping the memfd for filling failed.
    #[error("cannot map memfd of {size} bytes for filling: {source}")]
    Map {
        /// Size of the mapping.
        size: u64,
        /// The error from `mmap`.
        source: io::Error,
    },
    /// Adding seals failed.
    #[error("cannot seal memfd: {0}")]
    Seal(Errno),
}

/// The reason a `memfd_create` failed, with what an operator can do about the limits.
fn explain_create(e: Errno) -> String {
    match e {
        Errno::EMFILE => format!(
            "{e}: packd is at its open-file limit (RLIMIT_NOFILE, LimitNOFILE= in the unit); \
             try again later, evict segments or raise the limit"
        ),
        Errno::ENFILE => format!("{e}: the system-wide open-file limit is reached (fs.file-max); try again later"),
        Errno::ENOMEM => format!("{e}: out of memory; try again later"),
        e => e.to_string(),
    }
}

/// Creates an empty memfd named `name` (shown in `/proc/PID/maps`), close-on-exec, with
/// sealing allowed and, where the kernel supports it, `MFD_NOEXEC_SEAL`.
pub fn create(name: &str) -> Result<File, MemfdError> {
    let cname = CString::new(name.replace('\0', "_")).map_err(|_| MemfdError::Create(Errno::EINVAL))?;
    let base = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    for flags in [base | MFD_NOEXEC_SEAL, base] {
        // SAFETY: `cname` is a valid NUL-terminated string that outlives the call; the flags
        // are plain bits. The call either fails (-1) or returns a new fd that we own.
        let fd = unsafe { libc::memfd_create(cname.as_ptr(), flags) };
        if fd >= 0 {
            // SAFETY: `fd` was just returned by memfd_create, is open, and nothing else owns it.
            return Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }));
        }
        let err = Errno::last();
        // Kernels before 6.3 reject the unknown MFD_NOEXEC_SEAL flag with EINVAL.
        if err != Errno::EINVAL || flags == base {
            return Err(MemfdError::Create(err));
        }
    }
    Err(MemfdError::Create(Errno::EINVAL))
}

/// A writable shared mapping of a not yet sealed memfd. Dropping it unmaps, which must
/// happen before [`seal`] (`F_SEAL_WRITE` fails with EBUSY while it exists).
pub struct FillMap {
    map: MmapMut,
}

impl FillMap {
    /// Sizes `file` to `size` bytes, maps it read-write shared, and allocates and maps every
    /// page up front, on every core (`MADV_POPULATE_WRITE`, Linux 5.14+; before that,
    /// `fallocate` on one thread and page faults while filling).
    ///
    /// Allocating up front turns "out of memory or tmpfs space" into a clean error here;
    /// without it, a page fault while filling would raise SIGBUS in the daemon.
    /// With `huge_pages`, transparent huge pages are asked for (`MADV_HUGEPAGE`).
    pub fn new(file: &File, size: u64, huge_pages: bool) -> Result<Self, MemfdError> {
        let invalid = || io::Error::from(io::ErrorKind::InvalidInput);
        if size == 0 {
            return Err(MemfdError::Map { size, source: invalid() });
        }
        let len = usize::try_from(size).map_err(|_| MemfdError::Size { size, source: invalid() })?;
        file.set_len(size).map_err(|source| MemfdError::Size { size, source })?;
        // SAFETY: `file` is a memfd this process created and has not shared with anyone (the
        // fd has not been sent), so no other party can truncate or write it while mapped. Its
        // pages may not be allocated yet: nothing touches the mapping before `populate`
        // below has allocated every page (or failed, and the mapping is dropped untouched),
        // so no access can fault with SIGBUS.
        let map = unsafe { MmapMut::map_mut(file) }.map_err(|source| MemfdError::Map { size, source })?;
        if huge_pages {
            // Only advice: a host whose shmem_enabled is `never` keeps small pages.
            let _ = map.advise(memmap2::Advice::HugePage);
        }
        match populate(&map, len) {
            Ok(()) => Ok(Self { map }),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                // A kernel without MADV_POPULATE_WRITE: allocate with fallocate instead.
                drop(map);
                let off = libc::off_t::try_from(size).map_err(|_| MemfdError::Size { size, source: invalid() })?;
                fallocate(file.as_fd(), FallocateFlags::empty(), 0, off)
                    .map_err(|e| MemfdError::Size { size, source: io::Error::from(e) })?;
                // SAFETY: as above; every page is allocated now (fallocate), so no access
                // can fault with SIGBUS.
                let map = unsafe { MmapMut::map_mut(file) }.map_err(|source| MemfdError::Map { size, source })?;
                Ok(Self { map })
            }
            Err(source) => Err(MemfdError::Size { size, source }),
        }
    }

    /// The mapped bytes.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map
    }
}

/// Attempts at sealing while the kernel reports pages still referenced (`EBUSY`).
const SEAL_ATTEMPTS: u32 = 5;

/// Bytes per part when populating a mapping on several threads.
const POPULATE_PART: usize = 8 << 20;

/// Allocates and maps every page of `map` (`MADV_POPULATE_WRITE`), its parts on every core.
/// Fails with `EINVAL` on kernels before 5.14, `ENOMEM` when memory or tmpfs is full.
fn populate(map: &MmapMut, len: usize) -> io::Result<()> {
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    let page = usize::try_from(crate::sys::proc::page_size()).unwrap_or(4096);
    let part = len.div_ceil(threads).max(POPULATE_PART).div_ceil(page) * page;
    let advise = |start: usize| map.advise_range(memmap2::Advice::PopulateWrite, start, part.min(len - start));
    let starts: Vec<usize> = (0..len).step_by(part).collect();
    std::thread::scope(|s| {
        let helpers: Vec<_> = starts[1..]
            .iter()
            .map(|&start| std::thread::Builder::new().spawn_scoped(s, move || advise(start)))
            .collect();
        let mut result = advise(0);
        for (h, &start) in helpers.into_iter().zip(&starts[1..]) {
            let r = match h {
                Ok(h) => h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
                Err(_) => advise(start),
            };
            result = result.and(r);
        }
        result
    })
}

/// Seals `file` against shrinking, growing and writing, then seals the seals.
///
/// `F_SEAL_WRITE` fails with `EBUSY` while a page of the file has a reference beyond its
/// mappings (the kernel waits about 150 ms for them to go first): page migration or
/// compaction can hold one for a moment after the pages were filled. A few more attempts
/// ride that out; a writable mapping that really is still there fails each of them.
pub fn seal(file: &File) -> Result<(), MemfdError> {
    let mut attempt = 1;
    loop {
        match fcntl(file.as_fd(), FcntlArg::F_ADD_SEALS(required_seals())) {
            Ok(_) => return Ok(()),
            Err(Errno::EBUSY) if attempt < SEAL_ATTEMPTS => {
                tracing::warn!(attempt, "sealing a memfd: pages still referenced (EBUSY); trying again");
                attempt += 1;
            }
            Err(e) => return Err(MemfdError::Seal(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn sealed_memfd_refuses_writes() {
        let file = create("packd-test").unwrap();
        {
            let mut map = FillMap::new(&file, 4096, false).unwrap();
            map.bytes_mut()[..4].copy_from_slice(b"abcd");
        }
        seal(&file).unwrap();
        assert!(packd_proto::sys::seals(file.as_fd()).unwrap().contains(required_seals()));
        let err = (&file).write(b"x").unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EPERM));
        assert_eq!(file.set_len(1).unwrap_err().raw_os_error(), Some(libc::EPERM));
        let mut buf = [0u8; 4];
        std::os::unix::fs::FileExt::read_at(&file, &mut buf, 0).unwrap();
        assert_eq!(&buf, b"abcd");
    }
}
