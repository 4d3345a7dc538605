//! An address-space reservation whose parts are backed on demand: by private anonymous
//! memory (an engine builds into it) or by a sealed memfd mapped read-only (a published
//! segment, or the copy of a build mapped over it).
//! Memory handed out from it never moves, which engines that keep pointers (XNNPACK) need.
//!
//! Every mapping call replaces pages inside the reservation this value owns (the range is
//! checked against its length), and is `unsafe`: replacing memory under a live reference
//! is undefined behaviour, so the caller promises there is none. Nothing here dereferences
//! memory except [`Reservation::bytes`], which reads a range the caller backed.

use std::fs::File;
use std::io;
use std::num::NonZeroUsize;
use std::os::fd::AsFd;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use nix::sys::mman::{MapFlags, ProtFlags, mmap, mmap_anonymous, munmap};

/// A `PROT_NONE` reservation of address space.
pub struct Reservation {
    base: NonNull<std::ffi::c_void>,
    len: usize,
}

// SAFETY: the reservation is address space owned by this value; which thread maps or
// unmaps inside it does not matter, and callers serialise those calls.
unsafe impl Send for Reservation {}
// SAFETY: shared access reads `base` and `len` (never written after creation). Every call
// that maps or unmaps is `unsafe`, and its contract makes the caller keep calls on the same
// pages apart (see the `# Safety` sections): two threads may map disjoint ranges at once.
unsafe impl Sync for Reservation {}

const READ_WRITE: ProtFlags = ProtFlags::PROT_READ.union(ProtFlags::PROT_WRITE);

fn nz(len: usize) -> io::Result<NonZeroUsize> {
    NonZeroUsize::new(len).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))
}

impl Reservation {
    /// Reserves `len` bytes of address space (no memory; `MAP_NORESERVE`), starting at a
    /// multiple of 2 MiB so that committed memory can be backed by huge pages.
    pub fn new(len: usize) -> io::Result<Self> {
        const HUGE: usize = 2 << 20;
        let padded = len.checked_add(HUGE).ok_or(io::ErrorKind::InvalidInput)?;
        // SAFETY: a new anonymous mapping at an address the kernel chooses; it overlaps
        // nothing of ours and is inaccessible (PROT_NONE).
        let raw = unsafe {
            mmap_anonymous(None, nz(padded)?, ProtFlags::PROT_NONE, MapFlags::MAP_PRIVATE | MapFlags::MAP_NORESERVE)
        }?;
        let start = raw.as_ptr() as usize;
        let aligned = start.next_multiple_of(HUGE);
        let (head, tail) = (aligned - start, padded - (aligned - start) - len);
        // SAFETY: the head and tail are parts of the mapping just made, referenced by
        // nothing; what stays is `len` bytes from `aligned`.
        unsafe {
            if head > 0 {
                munmap(raw, head)?;
            }
            if tail > 0 {
                munmap(raw.byte_add(head + len), tail)?;
            }
        }
        // SAFETY: `aligned` lies inside the mapping (head < HUGE ≤ padded - len).
        let base = unsafe { raw.byte_add(head) };
        Ok(Self { base, len })
    }

    /// The first address.
    pub fn base(&self) -> usize {
        self.base.as_ptr() as usize
    }

    /// Its length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty (never: a reservation has at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check(&self, offset: usize, len: usize) -> io::Result<NonNull<std::ffi::c_void>> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) || !offset.is_multiple_of(page()) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "range outside the reservation or unaligned"));
        }
        // SAFETY: `offset` is inside the reservation (checked), so the sum stays in it.
        Ok(unsafe { self.base.byte_add(offset) })
    }

    /// Maps `len` bytes of `file` from `file_offset` at `offset`, shared and read-only.
    /// Replaces whatever was mapped there.
    ///
    /// # Safety
    /// No reference into `[offset, offset + len)` may be live unless the new mapping shows
    /// it the same bytes (the same pages of the same file), `file` must cover
    /// `file_offset + len` bytes for as long as the mapping is used (else access faults),
    /// and no other call on this reservation may map, unmap or protect the same pages
    /// meanwhile.
    pub unsafe fn map_file(&self, offset: usize, len: usize, file: &File, file_offset: u64) -> io::Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.map_file_with(offset, len, file, file_offset, MapFlags::empty()) }
    }

    /// [`Reservation::map_file`], with the pages mapped at once (`MADV_POPULATE_READ`): for memory
    /// an engine reads whole right away (llama.cpp's first prompt reads every weight), one
    /// call costs less than a fault per page on the engine's critical path.
    ///
    /// # Safety
    /// As [`Reservation::map_file`].
    pub unsafe fn map_file_populated(
        &self,
        offset: usize,
        len: usize,
        file: &File,
        file_offset: u64,
    ) -> io::Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.map_file_with(offset, len, file, file_offset, MapFlags::MAP_POPULATE) }
    }

    /// [`Reservation::map_file_populated`] 2 MiB at a time: for replacing a mapping the
    /// engine may use meanwhile on other threads (a build mapped read-only after the
    /// engine went on). Each step holds the process's address-space lock for a step only,
    /// so the engine's own mapping calls wait for a step, not for the whole range (40 MiB
    /// remapped in one call kept ExecuTorch's frees after its runtime's creation waiting
    /// 2-6 ms). A step that fails leaves the range mapped as before from there on.
    ///
    /// # Safety
    /// As [`Reservation::map_file`].
    pub unsafe fn map_file_populated_in_steps(
        &self,
        offset: usize,
        len: usize,
        file: &File,
        file_offset: u64,
    ) -> io::Result<()> {
        const STEP: usize = 2 << 20;
        self.check(offset, len)?;
        let mut done = 0;
        while done < len {
            let n = STEP.min(len - done);
            // SAFETY: a part of the caller's range, under the caller's guarantees.
            unsafe { self.map_file_populated(offset + done, n, file, file_offset + done as u64) }?;
            done += n;
        }
        Ok(())
    }

    /// Maps `len` bytes of `file` from `file_offset` at `offset`, shared and writable, the
    /// pages allocated at once (a build writes them all). Replaces whatever was mapped there.
    /// While this mapping exists the memfd cannot be sealed against writing: replace it
    /// with a read-only mapping of a read-only fd ([`reopen_read_only`]) first.
    ///
    /// # Safety
    /// As [`Reservation::map_file`]; and nothing else may write the file's range meanwhile
    /// unless the writes are the caller's own through this mapping.
    pub unsafe fn map_file_writable(&self, offset: usize, len: usize, file: &File, file_offset: u64) -> io::Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.map_file_prot(offset, len, file, file_offset, READ_WRITE, MapFlags::MAP_POPULATE) }
    }

    /// [`Reservation::map_file_writable`] with no page mapped yet: the build's writes map
    /// them, or a [`Populating`] thread ahead of it.
    ///
    /// # Safety
    /// As [`Reservation::map_file_writable`].
    pub unsafe fn map_file_writable_lazily(
        &self,
        offset: usize,
        len: usize,
        file: &File,
        file_offset: u64,
    ) -> io::Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.map_file_prot(offset, len, file, file_offset, READ_WRITE, MapFlags::empty()) }
    }

    /// # Safety
    /// As [`Reservation::map_file`].
    unsafe fn map_file_with(
        &self,
        offset: usize,
        len: usize,
        file: &File,
        file_offset: u64,
        extra: MapFlags,
    ) -> io::Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.map_file_prot(offset, len, file, file_offset, ProtFlags::PROT_READ, extra) }
    }

    /// # Safety
    /// As [`Reservation::map_file`] (and, writable, [`Reservation::map_file_writable`]).
    unsafe fn map_file_prot(
        &self,
        offset: usize,
        len: usize,
        file: &File,
        file_offset: u64,
        prot: ProtFlags,
        extra: MapFlags,
    ) -> io::Result<()> {
        let at = self.check(offset, len)?;
        let file_offset = i64::try_from(file_offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // MAP_POPULATE maps a shared file's pages one by one: about 6 times the cost of
        // MADV_POPULATE_READ, which maps them in batches (476 MiB read-only: 310 against
        // 50 ms). The flag is kept only for kernels without the advice (before 5.14).
        let populate = extra.contains(MapFlags::MAP_POPULATE);
        let mut flags = MapFlags::MAP_SHARED | MapFlags::MAP_FIXED | (extra - MapFlags::MAP_POPULATE);
        loop {
            // SAFETY: MAP_FIXED inside our own reservation (checked by `check`), replacing
            // only pages of it, none of them under a live reference unless it keeps its
            // bytes; the file covers the range (both by this function's contract).
            unsafe {
                mmap(
                    Some(NonZeroUsize::new(at.as_ptr() as usize).ok_or(io::ErrorKind::InvalidInput)?),
                    nz(len)?,
                    prot,
                    flags,
                    file.as_fd(),
                    file_offset,
                )
            }?;
            if prot.contains(ProtFlags::PROT_WRITE) && shmem_huge_when_advised() {
                // A build's pages: huge where the host gives memfds huge pages only to
                // advised mappings (the reservation is 2 MiB aligned). Only advice.
                // SAFETY: the range is the mapping just made; the advice changes no byte.
                unsafe { libc::madvise(at.as_ptr(), len, libc::MADV_HUGEPAGE) };
            }
            if !populate || flags.contains(MapFlags::MAP_POPULATE) {
                return Ok(());
            }
            let advice =
                if prot.contains(ProtFlags::PROT_WRITE) { libc::MADV_POPULATE_WRITE } else { libc::MADV_POPULATE_READ };
            // SAFETY: the range is the mapping just made, backed by the file over its whole
            // length: the advice only maps its pages.
            if unsafe { libc::madvise(at.as_ptr(), len, advice) } == 0 {
                return Ok(());
            }
            match io::Error::last_os_error() {
                e if e.raw_os_error() == Some(libc::EINVAL) => flags |= MapFlags::MAP_POPULATE,
                e => return Err(e),
            }
        }
    }

    /// Backs `len` bytes at `offset` with fresh private memory (zeroed).
    ///
    /// # Safety
    /// No reference into `[offset, offset + len)` may be live (its bytes are replaced), and
    /// no other call may map, unmap or protect the same pages meanwhile.
    pub unsafe fn commit(&self, offset: usize, len: usize) -> io::Result<()> {
        // SAFETY: forwarded from the caller.
        // Populated at once: it is about to be filled, and one call costs less than a fault
        // per page.
        unsafe { self.anon(offset, len, ProtFlags::PROT_READ | ProtFlags::PROT_WRITE, MapFlags::MAP_POPULATE) }
    }

    /// Makes `len` bytes at `offset` read-only.
    ///
    /// # Safety
    /// Nobody may hold a mutable reference into the range or write it afterwards (a write
    /// faults), and no other call may map, unmap or protect the same pages meanwhile.
    pub unsafe fn protect_read(&self, offset: usize, len: usize) -> io::Result<()> {
        let at = self.check(offset, len)?;
        // SAFETY: our own range (checked); writers are excluded by the caller.
        unsafe { nix::sys::mman::mprotect(at, len, ProtFlags::PROT_READ) }?;
        Ok(())
    }

    /// Returns `len` bytes at `offset` to the reservation (inaccessible, no memory).
    ///
    /// # Safety
    /// No reference into `[offset, offset + len)` may be live (it becomes inaccessible), and
    /// no other call may map, unmap or protect the same pages meanwhile.
    pub unsafe fn decommit(&self, offset: usize, len: usize) -> io::Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.anon(offset, len, ProtFlags::PROT_NONE, MapFlags::MAP_NORESERVE) }
    }

    /// # Safety
    /// As [`Reservation::commit`].
    unsafe fn anon(&self, offset: usize, len: usize, prot: ProtFlags, extra: MapFlags) -> io::Result<()> {
        let at = self.check(offset, len)?;
        // SAFETY: MAP_FIXED inside our own reservation (checked by `check`), over pages no
        // live reference points into (this function's contract).
        unsafe {
            mmap_anonymous(
                Some(NonZeroUsize::new(at.as_ptr() as usize).ok_or(io::ErrorKind::InvalidInput)?),
                nz(len)?,
                prot,
                MapFlags::MAP_PRIVATE | MapFlags::MAP_FIXED | extra,
            )
        }?;
        Ok(())
    }

    /// The bytes at `[offset, offset + len)`.
    ///
    /// # Safety
    /// The range must be backed (committed or mapped from a file that covers it) and nobody
    /// may write it while the slice lives.
    pub unsafe fn bytes(&self, offset: usize, len: usize) -> &[u8] {
        assert!(offset.checked_add(len).is_some_and(|end| end <= self.len), "range outside the reservation");
        // SAFETY: inside the reservation (asserted) and backed and unchanging (caller).
        unsafe { std::slice::from_raw_parts(self.base.as_ptr().cast::<u8>().add(offset), len) }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        // SAFETY: the whole reservation is ours; nothing handed out from it is used after the
        // value is dropped (its owner's contract).
        let _ = unsafe { munmap(self.base, self.len) };
    }
}

/// The page size.
pub fn page() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n).ok().filter(|&n| n > 0).unwrap_or(4096)
}

/// The same file as `file` (a memfd), opened again read-only: a shared mapping of it never
/// counts as writable, so the memfd can be sealed against writing while it is mapped (a
/// read-only mapping of a read-write fd counts, since it could be made writable).
pub fn reopen_read_only(file: &File) -> io::Result<File> {
    use std::os::fd::AsRawFd;
    std::fs::OpenOptions::new().read(true).open(format!("/proc/self/fd/{}", file.as_raw_fd()))
}

/// Maps `len` bytes of `file` from `file_offset` at `addr` again, shared and read-only,
/// through a read-only open of it ([`reopen_read_only`]): for a mapping an engine made
/// itself, through a read-write fd, of a memfd packd is to seal. Such a mapping counts as
/// writable (it could be made so) and keeps the memfd from being sealed against writing;
/// the new one shows the same pages and does not. Fails with `EINVAL` when `addr` or
/// `file_offset` is not page-aligned.
///
/// # Safety
/// `[addr, addr + len)` must be a shared, read-only mapping of this same file from
/// `file_offset` (as [`crate::maps::of_file`] reads it just before: `r--s`), so that every
/// reference into it sees the same bytes after; and no other thread may map, unmap or resize
/// it meanwhile. (The mapping's `mlock` and advice are not carried over.)
pub unsafe fn remap_read_only(addr: usize, len: usize, file: &File, file_offset: u64) -> io::Result<()> {
    let read_only = reopen_read_only(file)?;
    let at = NonZeroUsize::new(addr).ok_or(io::ErrorKind::InvalidInput)?;
    let file_offset = i64::try_from(file_offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: MAP_FIXED over a mapping of the same pages of the same file (the caller's
    // promise): what was readable there reads the same bytes, nothing else is replaced.
    unsafe {
        mmap(
            Some(at),
            nz(len)?,
            ProtFlags::PROT_READ,
            MapFlags::MAP_SHARED | MapFlags::MAP_FIXED,
            read_only.as_fd(),
            file_offset,
        )
    }?;
    Ok(())
}

/// A thread mapping a build's pages ahead of the build ([`Populating::start`]).
pub struct Populating {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Populating {
    /// Step of the population: the thread looks at its stop flag between steps.
    const STEP: usize = 2 << 20;

    /// Maps the pages of `[offset, offset + len)` of `res`, a shared writable mapping of
    /// `file` from `file_offset` ([`Reservation::map_file_writable_lazily`]), on a thread of
    /// its own, from the start, a step at a time (`MADV_POPULATE_WRITE`: each page is
    /// allocated and mapped writable). A build writing from the start then finds its pages
    /// there and takes no fault: the second core pays for them. The thread never reads or
    /// writes a byte, so the build may write meanwhile; a step over a range mapped otherwise
    /// since (or not covered by the file) fails harmlessly and ends the thread. On a kernel
    /// without the advice (before 5.14) the file's pages are allocated instead (`fallocate`).
    pub fn start(res: Arc<Reservation>, offset: usize, len: usize, file: &File, file_offset: u64) -> io::Result<Self> {
        let at = res.check(offset, len)?.as_ptr() as usize;
        let file = file.try_clone()?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let thread = std::thread::Builder::new().name("packd-populate".into()).spawn(move || {
            let _held = res; // the address range stays reserved while the thread runs
            let mut done = 0;
            while done < len && !stopped.load(Ordering::Relaxed) {
                let n = Self::STEP.min(len - done);
                // SAFETY: inside the reservation (checked above, and kept by `_held`); the
                // advice only maps pages, never changes a byte, and fails (EFAULT, ENOMEM)
                // where the range is not a mapping it can populate.
                if unsafe { libc::madvise((at + done) as *mut libc::c_void, n, libc::MADV_POPULATE_WRITE) } != 0 {
                    if done == 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
                        let (Ok(offset), Ok(len)) = (i64::try_from(file_offset), i64::try_from(len)) else { return };
                        let _ = nix::fcntl::fallocate(&file, nix::fcntl::FallocateFlags::empty(), offset, len);
                    }
                    return;
                }
                done += n;
            }
        })?;
        Ok(Self { stop, thread: Some(thread) })
    }

    /// Stops the thread after its current step and waits for it (before the range is
    /// mapped otherwise, cut or sealed).
    pub fn finish(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Populating {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Whether this host gives memfds huge pages only through a mapping advised with
/// `MADV_HUGEPAGE` (`/sys/kernel/mm/transparent_hugepage/shmem_enabled` is `advise`). Read
/// once.
pub fn shmem_huge_when_advised() -> bool {
    static ADVISE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ADVISE.get_or_init(|| {
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
            .is_ok_and(|t| t.split_once('[').and_then(|(_, r)| r.split_once(']')).is_some_and(|(v, _)| v == "advise"))
    })
}

/// A new memfd that can be sealed, close-on-exec.
pub fn memfd(name: &str) -> io::Result<File> {
    use nix::sys::memfd::{MFdFlags, memfd_create};
    let fd = memfd_create(name, MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)?;
    Ok(File::from(fd))
}

/// Seals `file` against shrinking, growing and writing, and seals the seals. Fails with
/// `EBUSY` while a writable shared mapping of it exists (replace one made by
/// [`Reservation::map_file_writable`], or by an engine, with [`remap_read_only`] first); a page referenced for a moment
/// beyond its mappings (migration, compaction) also gives `EBUSY`, so that is tried a few
/// times (the kernel waits about 150 ms each time).
pub fn seal(file: &File) -> io::Result<()> {
    let mut attempt = 1;
    loop {
        match nix::fcntl::fcntl(file.as_fd(), nix::fcntl::FcntlArg::F_ADD_SEALS(packd_client::sys::required_seals())) {
            Ok(_) => return Ok(()),
            Err(nix::errno::Errno::EBUSY) if attempt < 5 => attempt += 1,
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ShmemPmdMapped` of the mapping at `addr` in `/proc/self/smaps`, in kB.
    fn pmd_mapped_kb(addr: usize) -> u64 {
        smaps_kb(addr, "ShmemPmdMapped:")
    }

    /// The field `field` of the mapping at `addr` in `/proc/self/smaps`, in kB.
    fn smaps_kb(addr: usize, field: &str) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut mine = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ')
                && let Some((start, _)) = range.split_once('-')
                && let Ok(start) = usize::from_str_radix(start, 16)
            {
                mine = start == addr;
            } else if mine && let Some(kb) = line.strip_prefix(field) {
                return kb.trim().trim_end_matches("kB").trim().parse().unwrap();
            }
        }
        0
    }

    /// Waits (at most 30 s, else fails) until every page of the `len` bytes mapped at `addr`
    /// is mapped in the process.
    fn wait_all_mapped(addr: usize, len: usize) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while smaps_kb(addr, "Rss:") < (len / 1024) as u64 {
            assert!(std::time::Instant::now() < deadline, "{} kB mapped", smaps_kb(addr, "Rss:"));
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// The kernel's count of huge shared pages it could not allocate (`thp_file_fallback`).
    fn fallbacks() -> u64 {
        let vmstat = std::fs::read_to_string("/proc/vmstat").unwrap_or_default();
        vmstat.lines().find_map(|l| l.strip_prefix("thp_file_fallback ")).and_then(|v| v.parse().ok()).unwrap_or(0)
    }

    /// A build's pages populated beside it are huge where the host gives memfds huge pages
    /// only through advised mappings, and small ones where it gives none: what the host's
    /// `shmem_enabled` says is what the test expects.
    #[test]
    fn pages_populated_alongside_are_huge_where_the_host_allows_advised_ones() {
        let setting = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled").unwrap_or_default();
        let setting = setting.split_once('[').and_then(|(_, r)| r.split_once(']')).map(|(v, _)| v.to_string());
        const LEN: usize = 8 << 20;
        let before = fallbacks();
        let file = memfd("packd-test-huge").unwrap();
        file.set_len(LEN as u64).unwrap();
        // A 2 MiB-aligned build mapping (advised where the host wants it), populated beside.
        let r = Arc::new(Reservation::new(LEN).unwrap());
        // SAFETY: the whole reservation, referenced by nothing; the memfd covers it.
        unsafe { r.map_file_writable_lazily(0, LEN, &file, 0) }.unwrap();
        let populating = Populating::start(Arc::clone(&r), 0, LEN, &file, 0).unwrap();
        wait_all_mapped(r.base(), LEN);
        populating.finish();
        // SAFETY: the memfd covers the mapping, which nothing else maps, writes or resizes.
        let bytes = unsafe { r.bytes(0, LEN) };
        assert!(bytes.iter().step_by(4096).all(|&b| b == 0), "populated pages read as zeros");
        let kb = pmd_mapped_kb(r.base());
        match setting.as_deref() {
            // Unless the kernel found no free 2 MiB page (it counts each such fallback).
            Some("advise") if fallbacks() > before => eprintln!("no huge page free: {kb} kB PMD-mapped"),
            Some("advise") => assert!(kb >= 2048, "shmem_enabled is advise: huge pages expected, {kb} kB PMD-mapped"),
            Some("never") | None => assert_eq!(kb, 0, "shmem_enabled is never: no huge pages expected"),
            Some(other) => eprintln!("shmem_enabled is {other}: {kb} kB PMD-mapped (not asserted)"),
        }
    }

    /// A build's pages are mapped ahead of it by the populating thread while the build
    /// writes: every page ends up mapped in the process, each byte is the build's, and the
    /// memfd's pages are allocated.
    #[test]
    fn populating_maps_every_page_of_a_build_while_it_writes() {
        const LEN: usize = 16 << 20;
        let file = memfd("packd-test-populate").unwrap();
        file.set_len(LEN as u64).unwrap();
        let r = Arc::new(Reservation::new(LEN).unwrap());
        // SAFETY: the whole reservation, referenced by nothing; the memfd covers it.
        unsafe { r.map_file_writable_lazily(0, LEN, &file, 0) }.unwrap();
        assert_eq!(smaps_kb(r.base(), "Rss:"), 0, "mapped lazily: no page yet");
        let populating = Populating::start(Arc::clone(&r), 0, LEN, &file, 0).unwrap();
        // The build writes the second half meanwhile; the thread maps the first half for it.
        let half = LEN / 2;
        // SAFETY: the writable mapping made above, which only this test writes.
        unsafe { std::ptr::write_bytes((r.base() + half) as *mut u8, 0xA5, half) };
        wait_all_mapped(r.base(), LEN);
        populating.finish();
        // SAFETY: the mapping above, which nothing writes any more.
        let bytes = unsafe { r.bytes(0, LEN) };
        assert!(bytes[..half].iter().all(|&b| b == 0), "the thread changed no byte");
        assert!(bytes[half..].iter().all(|&b| b == 0xA5), "the build's bytes stay");
        use std::os::unix::fs::MetadataExt;
        assert!(file.metadata().unwrap().blocks() * 512 >= LEN as u64, "every page of the memfd allocated");
    }

    /// A build mapped read-only again in steps shows the same bytes, read-only, populated,
    /// and leaves no writable mapping behind: the memfd can be sealed.
    #[test]
    fn a_build_mapped_read_only_in_steps_keeps_its_bytes_and_can_be_sealed() {
        const LEN: usize = (5 << 20) + 4096;
        let file = memfd("packd-test-steps").unwrap();
        file.set_len(LEN as u64).unwrap();
        let r = Reservation::new(LEN).unwrap();
        // SAFETY: the whole reservation, referenced by nothing; the memfd covers it.
        unsafe { r.map_file_writable_lazily(0, LEN, &file, 0) }.unwrap();
        let pattern = |i: usize| (i / 4096 * 7 + i).to_le_bytes()[0];
        // SAFETY: the writable mapping made above, which only this test writes.
        let w = unsafe { std::slice::from_raw_parts_mut(r.base() as *mut u8, LEN) };
        for (i, b) in w.iter_mut().enumerate() {
            *b = pattern(i);
        }
        let ro = reopen_read_only(&file).unwrap();
        // SAFETY: the same bytes of the same memfd at the same addresses; nothing else maps.
        unsafe { r.map_file_populated_in_steps(0, LEN, &ro, 0) }.unwrap();
        assert_eq!(smaps_kb(r.base(), "Rss:"), (LEN / 1024) as u64, "every page mapped");
        let m = crate::maps::at(r.base()).unwrap();
        assert_eq!((m.lo, m.hi, m.perms.as_str()), (r.base(), r.base() + LEN, "r--s"), "one read-only mapping");
        // SAFETY: the read-only mapping above; the memfd is sealed below, so nothing writes.
        let bytes = unsafe { r.bytes(0, LEN) };
        assert!(bytes.iter().enumerate().all(|(i, &b)| b == pattern(i)), "the build's bytes kept");
        seal(&file).expect("no writable mapping left");
    }
}
