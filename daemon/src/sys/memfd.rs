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

/// Allocates every page of `file`'s bytes `offset..offset + len` (a memfd at least that long).
/// With `huge_pages` where the host gives memfds huge pages only to advised mappings
/// (`shmem_enabled` is `advise`), through a mapping advised `MADV_HUGEPAGE` (a `fallocate`
/// would allocate small pages there); else with `fallocate`.
pub fn allocate(file: &File, offset: u64, len: u64, huge_pages: bool) -> std::io::Result<()> {
    let bad = |_| std::io::Error::from(std::io::ErrorKind::InvalidInput);
    if huge_pages && crate::sys::proc::huge_pages_only_when_advised() && allocate_huge(file, offset, len).is_ok() {
        return Ok(());
    }
    let (offset, len) = (i64::try_from(offset).map_err(bad)?, i64::try_from(len).map_err(bad)?);
    fallocate(file.as_fd(), FallocateFlags::empty(), offset, len).map_err(std::io::Error::from)
}

/// [`allocate`] through a shared mapping advised `MADV_HUGEPAGE`, then unmapped.
fn allocate_huge(file: &File, offset: u64, len: u64) -> std::io::Result<()> {
    let bad = || std::io::Error::from(std::io::ErrorKind::InvalidInput);
    let end = offset.checked_add(len).ok_or_else(bad)?;
    if len == 0 || file.metadata()?.len() < end {
        return Err(bad()); // the file covers the range: no access can fault
    }
    // SAFETY: a memfd this process created and has not shared (a lend is handed out only
    // once allocated), mapped over a range it covers (checked). The mapping is never read
    // or written here: only advised, then dropped.
    let map = unsafe {
        memmap2::MmapOptions::new().offset(offset).len(usize::try_from(len).map_err(|_| bad())?).map_mut(file)
    }?;
    let _ = map.advise(memmap2::Advice::HugePage);
    populate(&map, 0, map.len(), 1)
}

/// A read-only mapping of the first `len` bytes of `file`, a memfd sealed against shrinking
/// and writing (checked here): its bytes can neither change nor vanish while mapped, so
/// reading them never faults (`None` when the seals are not there or the file is shorter).
pub fn map_sealed(file: &File, len: u64) -> Option<memmap2::Mmap> {
    let seals = packd_proto::sys::seals(file.as_fd()).ok()?;
    let needed = nix::fcntl::SealFlag::F_SEAL_SHRINK | nix::fcntl::SealFlag::F_SEAL_WRITE;
    if !seals.contains(needed) || file.metadata().ok()?.len() < len {
        return None;
    }
    let len = usize::try_from(len).ok()?;
    // SAFETY: the memfd can no longer shrink (F_SEAL_SHRINK) nor be written (F_SEAL_WRITE,
    // which also means no writable mapping of it exists): the mapped bytes stay as they
    // are and present for the mapping's whole life.
    unsafe { memmap2::MmapOptions::new().len(len).map(file) }.ok()
}

/// A writable shared mapping of a not yet sealed memfd. Dropping it unmaps, which must
/// happen before [`seal`] (`F_SEAL_WRITE` fails with EBUSY while it exists).
pub struct FillMap {
    map: MmapMut,
    /// Bytes of the file (the mapping may be longer: a [`Prepared`] memfd shrunk).
    len: usize,
    /// A [`Prepared`] memfd being shrunk to `len` on a thread of its own.
    shrink: Option<std::thread::JoinHandle<io::Result<()>>>,
}

impl FillMap {
    /// Waits for a shrink under way ([`Prepared::into_fill`]) and unmaps. Must be called
    /// before [`seal`]: an error means the file may not have its size.
    pub fn finish(mut self) -> Result<(), MemfdError> {
        let size = self.len as u64;
        match self.shrink.take().map(std::thread::JoinHandle::join) {
            None | Some(Ok(Ok(()))) => Ok(()),
            Some(Ok(Err(source))) => Err(MemfdError::Size { size, source }),
            Some(Err(_)) => Err(MemfdError::Size { size, source: io::Error::other("the shrinking thread panicked") }),
        }
    }
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
        Self::with_threads(file, size, huge_pages, available_threads())
    }

    /// [`FillMap::new`] populating on at most `threads` threads.
    pub fn with_threads(file: &File, size: u64, huge_pages: bool, threads: usize) -> Result<Self, MemfdError> {
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
        match populate(&map, 0, len, threads) {
            Ok(()) => Ok(Self { map, len, shrink: None }),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                // A kernel without MADV_POPULATE_WRITE: allocate with fallocate instead.
                drop(map);
                let off = libc::off_t::try_from(size).map_err(|_| MemfdError::Size { size, source: invalid() })?;
                fallocate(file.as_fd(), FallocateFlags::empty(), 0, off)
                    .map_err(|e| MemfdError::Size { size, source: io::Error::from(e) })?;
                // SAFETY: as above; every page is allocated now (fallocate), so no access
                // can fault with SIGBUS.
                let map = unsafe { MmapMut::map_mut(file) }.map_err(|source| MemfdError::Map { size, source })?;
                Ok(Self { map, len, shrink: None })
            }
            Err(source) => Err(MemfdError::Size { size, source }),
        }
    }

    /// The mapped bytes.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the first `len` bytes of the mapping lie within the file (a shrunk
        // [`Prepared`] memfd's mapping is longer than the file: no reference reaches past
        // `len`), every page of them is allocated (`new`, `into_fill`), and the returned
        // slice borrows `self` mutably, so it is the only reference into the mapping.
        unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr(), self.len) }
    }
}

/// A memfd sized, allocated and mapped ahead of need (the daemon's spare, see
/// `store::spare`): a pack job that takes it writes into pages that exist already instead
/// of allocating them on its critical path. Never shared before [`Prepared::into_fill`]
/// hands it to one job.
pub struct Prepared {
    file: File,
    fill: FillMap,
    huge_pages: bool,
}

impl Prepared {
    /// Creates a memfd named `name` of `size` bytes and allocates every page, populating on
    /// one thread (it runs in the background, beside the jobs that use every core).
    pub fn new(name: &str, size: u64, huge_pages: bool) -> Result<Self, MemfdError> {
        let file = create(name)?;
        let fill = FillMap::with_threads(&file, size, huge_pages, 1)?;
        Ok(Self { file, fill, huge_pages })
    }

    /// Its size in bytes.
    pub fn size(&self) -> u64 {
        self.fill.len as u64
    }

    /// The memfd, sized to `size`, with its fill mapping: shrunk when it was larger (the
    /// pages past `size` go back to the system), grown when it was smaller (only the new
    /// pages are allocated, on every core). The pages it had keep their mapping, so the job
    /// writes them without a page fault.
    pub fn into_fill(self, size: u64) -> Result<(File, FillMap), MemfdError> {
        let Self { file, mut fill, huge_pages } = self;
        let invalid = || io::Error::from(io::ErrorKind::InvalidInput);
        let len = usize::try_from(size).map_err(|_| MemfdError::Size { size, source: invalid() })?;
        if len == 0 {
            return Err(MemfdError::Map { size, source: invalid() });
        }
        if len <= fill.len {
            // Shrinking frees the pages past `size` (about 0.3 ms per MiB on a VM): on a
            // thread of its own while the job writes the pages before `size`, which stay.
            // The mapping stays as long as it was; `bytes_mut` never reaches past `size`.
            fill.len = len;
            if len < fill.map.len() {
                let dup = file.try_clone().map_err(|source| MemfdError::Size { size, source })?;
                let shrink = move || dup.set_len(size);
                match std::thread::Builder::new().name("packd-shrink".into()).spawn(shrink) {
                    Ok(t) => fill.shrink = Some(t),
                    Err(_) => file.set_len(size).map_err(|source| MemfdError::Size { size, source })?,
                }
            }
            return Ok((file, fill));
        }
        let old = fill.len;
        file.set_len(size).map_err(|source| MemfdError::Size { size, source })?;
        // SAFETY: the memfd has not been shared, so nothing else can change its size; it is
        // `size` bytes now, so the grown mapping lies within the file. The mapping may move:
        // no reference into it is alive (`fill` is owned here and borrowed by nobody).
        unsafe { fill.map.remap(len, memmap2::RemapOptions::new().may_move(true)) }
            .map_err(|source| MemfdError::Map { size, source })?;
        if huge_pages {
            let _ = fill.map.advise_range(memmap2::Advice::HugePage, old, len - old);
        }
        match populate(&fill.map, old, len - old, available_threads()) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                // No MADV_POPULATE_WRITE (the spare was then allocated with fallocate too).
                let (start, more) = (to_off(old as u64)?, to_off(size - old as u64)?);
                fallocate(file.as_fd(), FallocateFlags::empty(), start, more)
                    .map_err(|e| MemfdError::Size { size, source: io::Error::from(e) })?;
            }
            Err(source) => return Err(MemfdError::Size { size, source }),
        }
        fill.len = len;
        Ok((file, fill))
    }
}

fn to_off(n: u64) -> Result<libc::off_t, MemfdError> {
    libc::off_t::try_from(n)
        .map_err(|_| MemfdError::Size { size: n, source: io::Error::from(io::ErrorKind::InvalidInput) })
}

fn available_threads() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// Attempts at sealing while the kernel reports pages still referenced (`EBUSY`).
const SEAL_ATTEMPTS: u32 = 5;

/// Bytes per part when populating a mapping on several threads.
const POPULATE_PART: usize = 8 << 20;

/// Allocates and maps every page of `map` in `[from, from + len)` (`MADV_POPULATE_WRITE`),
/// its parts on up to `threads` threads. `from` is a multiple of the page size. Fails with
/// `EINVAL` on kernels before 5.14, `ENOMEM` when memory or tmpfs is full.
fn populate(map: &MmapMut, from: usize, len: usize, threads: usize) -> io::Result<()> {
    let page = usize::try_from(crate::sys::proc::page_size()).unwrap_or(4096);
    let part = len.div_ceil(threads.max(1)).max(POPULATE_PART).div_ceil(page) * page;
    let end = from + len;
    let advise = |start: usize| map.advise_range(memmap2::Advice::PopulateWrite, start, part.min(end - start));
    let starts: Vec<usize> = (from..end).step_by(part).collect();
    if starts.is_empty() {
        return Ok(());
    }
    std::thread::scope(|s| {
        let helpers: Vec<_> = starts[1..]
            .iter()
            .map(|&start| std::thread::Builder::new().spawn_scoped(s, move || advise(start)))
            .collect();
        let mut result = advise(from);
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

    /// A prepared memfd shrunk or grown for a job: the file has the job's size, every byte
    /// reads zero until written, what is written is what the sealed file holds.
    #[test]
    #[allow(clippy::cast_possible_truncation)] // i % 251 < 256
    fn a_prepared_memfd_shrinks_or_grows_to_the_size_of_its_job() {
        let page = crate::sys::proc::page_size();
        for (prepared, size) in [(64 * page, 3 * page), (4 * page, 4 * page), (3 * page, 70 * page + 17)] {
            let p = Prepared::new("packd-test-spare", prepared, false).unwrap();
            assert_eq!(p.size(), prepared);
            let (file, mut fill) = p.into_fill(size).unwrap();
            let bytes = fill.bytes_mut();
            assert_eq!(bytes.len() as u64, size);
            assert!(bytes.iter().all(|&b| b == 0), "a fresh page is not zero");
            for (i, b) in bytes.iter_mut().enumerate() {
                *b = (i % 251) as u8;
            }
            fill.finish().unwrap();
            assert_eq!(file.metadata().unwrap().len(), size);
            seal(&file).unwrap();
            let mut back = vec![0u8; usize::try_from(size).unwrap()];
            std::os::unix::fs::FileExt::read_exact_at(&file, &mut back, 0).unwrap();
            assert!(back.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8), "{prepared} -> {size}");
        }
    }

    /// Growing a prepared memfd allocates every new page before the job writes (none is
    /// left to a page fault, which would raise SIGBUS when memory is short), whichever part
    /// of the populating threads covers it.
    #[test]
    fn a_grown_prepared_memfd_has_every_page_allocated() {
        let page = usize::try_from(crate::sys::proc::page_size()).unwrap();
        let p = Prepared::new("packd-test-spare", 4 * page as u64, false).unwrap();
        let size = 3 * POPULATE_PART + 5 * page;
        let (_file, fill) = p.into_fill(size as u64).unwrap();
        let mut resident = vec![0u8; size.div_ceil(page)];
        // SAFETY: the mapping is `fill.map`, at least `size` bytes long and page-aligned;
        // `resident` has one byte per page of it; mincore only writes into `resident`.
        let rc = unsafe { libc::mincore(fill.map.as_ptr() as *mut libc::c_void, size, resident.as_mut_ptr()) };
        assert_eq!(rc, 0, "{}", io::Error::last_os_error());
        let missing: Vec<usize> = resident.iter().enumerate().filter(|(_, r)| *r & 1 == 0).map(|(i, _)| i).collect();
        assert!(
            missing.is_empty(),
            "{} of {} pages not allocated, first {:?}",
            missing.len(),
            resident.len(),
            missing.first()
        );
    }
}
