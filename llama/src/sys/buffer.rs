//! The memory under a `CPU_REPACK` buffer, and the model file's pages its tensors come from.
//!
//! [`Backing`] is the address-space reservation packd puts under a buffer in place of
//! ggml's memory. It starts unbacked (any access would fault), is backed once — private
//! pages, a memfd of this process mapped writable to build into, or a served segment mapped
//! read-only — and a build is sealed in place. Each operation checks the state it needs, so
//! the adapter drives it without `unsafe`. [`ModelFile`] is a mapping of the model file,
//! whose pages a tensor was read from may be dropped from the process when it is shared
//! and read-only.

use std::fs::File;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

use packd_interpose::maps::at as mapping_at;
use packd_interpose::sys::{Populating, Reservation, page, reopen_read_only, seal};

/// What is mapped under the buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Backed {
    /// Nothing: ggml has the addresses but has read and written nothing there.
    No,
    /// Private pages, writable.
    Private,
    /// A memfd (its device and inode), writable: a build.
    Build { file: (u64, u64) },
    /// Read-only: a served segment, or a sealed build.
    ReadOnly,
}

/// Why the memory under a buffer could not be mapped as asked.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BackingError {
    #[error("the buffer's memory is {is:?}, not {want:?}")]
    State { is: Backed, want: Backed },
    #[error("the memfd is {have} bytes, the buffer {len}")]
    Len { have: u64, len: usize },
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// The memory under one buffer.
pub(crate) struct Backing {
    res: Arc<Reservation>,
    state: Mutex<Backed>,
    /// A build's pages being mapped ahead of it, until it is sealed.
    populating: Mutex<Option<Populating>>,
}

impl Backing {
    /// An unbacked reservation of `len` bytes (a whole number of pages).
    pub(crate) fn new(len: usize) -> io::Result<Self> {
        Ok(Self { res: Arc::new(Reservation::new(len)?), state: Mutex::new(Backed::No), populating: Mutex::new(None) })
    }

    /// Its first address.
    pub(crate) fn base(&self) -> usize {
        self.res.base()
    }

    /// Its length.
    pub(crate) fn len(&self) -> usize {
        self.res.len()
    }

    fn state(&self) -> MutexGuard<'_, Backed> {
        lock(&self.state)
    }

    /// The state `from`, or an error saying the memory is already backed.
    fn take(&self, from: Backed) -> Result<MutexGuard<'_, Backed>, BackingError> {
        let st = self.state();
        if *st != from {
            return Err(BackingError::State { is: *st, want: from });
        }
        Ok(st)
    }

    /// Backs the whole buffer with private pages (a private repack).
    pub(crate) fn commit(&self) -> Result<(), BackingError> {
        let mut st = self.take(Backed::No)?;
        // SAFETY: unbacked (checked): nothing was read or written there, no reference into
        // it exists.
        unsafe { self.res.commit(0, self.len()) }?;
        *st = Backed::Private;
        Ok(())
    }

    /// Maps `file` (a memfd of the buffer's length: this process's own, or one packd lent)
    /// writable over the whole buffer: a build writes there. Its pages are allocated and
    /// mapped on a thread of its own, from the start, ahead of the repacking (which writes
    /// from the start too), until the build is sealed.
    pub(crate) fn map_build(&self, file: &File) -> Result<(), BackingError> {
        let mut st = self.take(Backed::No)?;
        check_len(file, self.len())?;
        // SAFETY: unbacked (checked): no reference into it exists; the memfd is `len` bytes
        // (checked), and nobody but this process changes its size (packd, which may hold a
        // lent one too, never does).
        unsafe { self.res.map_file_writable_lazily(0, self.len(), file, 0) }?;
        *st = Backed::Build { file: identity(file)? };
        // Without the thread the repacking maps each page as it writes it.
        *lock(&self.populating) = Populating::start(Arc::clone(&self.res), 0, self.len(), file, 0).ok();
        Ok(())
    }

    /// Maps the sealed `file` (a served segment of the buffer's length) read-only over the
    /// whole buffer, its pages populated (the first prompt reads every weight).
    pub(crate) fn map_served(&self, file: &File) -> Result<(), BackingError> {
        let mut st = self.take(Backed::No)?;
        check_len(file, self.len())?;
        // SAFETY: unbacked (checked): no reference into it exists; the sealed memfd is `len`
        // bytes (checked) and cannot shrink.
        unsafe { self.res.map_file_populated(0, self.len(), file, 0) }?;
        *st = Backed::ReadOnly;
        Ok(())
    }

    /// The build in `file` is complete: the same pages mapped again read-only (ggml writes
    /// no weights after loading them: a write would fault), and the memfd sealed. Safe
    /// while ggml reads the weights on other threads (its first prompt): the pages are
    /// remapped 2 MiB at a time, so its faults wait for a step at most.
    pub(crate) fn seal_build(&self, file: &File) -> Result<(), BackingError> {
        let mut st = self.state();
        let built = identity(file)?;
        if *st != (Backed::Build { file: built }) {
            return Err(BackingError::State { is: *st, want: Backed::Build { file: built } });
        }
        check_len(file, self.len())?;
        if let Some(populating) = lock(&self.populating).take() {
            populating.finish();
        }
        let ro = reopen_read_only(file)?;
        // Read-only from here on, whatever happens below: a remap that mapped and then failed
        // to populate has left the range read-only.
        *st = Backed::ReadOnly;
        // SAFETY: the build mapping of this very memfd (state Build with its device and inode,
        // checked): the read-only mapping shows the same bytes at the same addresses, so every
        // pointer into it stays valid, and ggml's threads reading meanwhile see the old
        // mapping or the new one (each step replaces its pages under the address-space
        // lock); no other call maps these pages meanwhile (the state lock is held throughout,
        // the populating thread has ended); the reservation lives while `self` does; the memfd
        // is `len` bytes and nobody changes its size before it is sealed, just below.
        unsafe { self.res.map_file_populated_in_steps(0, self.len(), &ro, 0) }?;
        Ok(seal(file)?)
    }

    /// Whether the memory is backed writable (private pages, or a build).
    pub(crate) fn writable(&self) -> bool {
        matches!(*self.state(), Backed::Private | Backed::Build { .. })
    }

    /// Writes `value` over the first `size` bytes (ggml's `clear`); false when the memory is
    /// not backed writable.
    pub(crate) fn fill(&self, value: u8, size: usize) -> bool {
        let st = self.state();
        if !matches!(*st, Backed::Private | Backed::Build { .. }) || size > self.len() {
            return false;
        }
        // SAFETY: backed and writable (checked, held while writing), `size` bytes from the
        // reservation's start lie in it (checked); ggml's own clear writes the same bytes.
        unsafe { std::ptr::write_bytes(self.base() as *mut u8, value, size) };
        true
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `file`'s device and inode.
fn identity(file: &File) -> Result<(u64, u64), BackingError> {
    use std::os::unix::fs::MetadataExt;
    let m = file.metadata()?;
    Ok((m.dev(), m.ino()))
}

/// Whether `file` is `len` bytes long.
fn check_len(file: &File, len: usize) -> Result<(), BackingError> {
    let have = file.metadata()?.len();
    if have != len as u64 {
        return Err(BackingError::Len { have, len });
    }
    Ok(())
}

/// A mapping of a file (the model file, where a tensor's bytes came from).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ModelFile {
    lo: usize,
    hi: usize,
    /// Device and inode.
    file: ((u64, u64), u64),
    /// Shared and read-only (`r--s`): its pages hold nothing but the file's bytes.
    droppable: bool,
}

impl ModelFile {
    /// The mapping at `addr`, if it maps a file.
    pub(crate) fn at(addr: usize) -> Option<Self> {
        let m = mapping_at(addr)?;
        let droppable = m.perms.starts_with('r') && !m.perms.contains('w') && m.perms.ends_with('s');
        (m.inode != 0).then_some(ModelFile { lo: m.lo, hi: m.hi, file: (m.dev, m.inode), droppable })
    }

    /// Whether `[addr, addr + len)` lies in this file: within this mapping (no system call),
    /// or in another mapping of the same device and inode.
    pub(crate) fn holds(&self, addr: usize, len: usize) -> bool {
        if addr >= self.lo && addr.saturating_add(len) <= self.hi {
            return true;
        }
        ModelFile::at(addr).is_some_and(|m| m.file == self.file && addr.saturating_add(len) <= m.hi)
    }

    /// Drops the whole pages of `[addr, addr + len)` that lie in this file's shared read-only
    /// mapping from the process (they stay in the page cache, and are read again from the
    /// file if touched); returns the bytes dropped (0 from any other kind of mapping).
    pub(crate) fn drop_pages(&self, addr: usize, len: usize) -> usize {
        let m = if addr >= self.lo && addr < self.hi {
            *self
        } else {
            match ModelFile::at(addr) {
                Some(m) if m.file == self.file => m,
                _ => return 0,
            }
        };
        if !m.droppable {
            return 0;
        }
        let p = page();
        let lo = addr.max(m.lo).next_multiple_of(p);
        let hi = (addr.saturating_add(len).min(m.hi)) / p * p;
        if hi <= lo {
            return 0;
        }
        // SAFETY: MADV_DONTNEED on whole pages of a shared read-only mapping of a file (`m`,
        // checked when it was made; `[lo, hi)` lies in it): its pages are the page cache's,
        // so none holds bytes the file does not; a later read reads the file again.
        let dropped = unsafe { libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_DONTNEED) } == 0;
        if dropped { hi - lo } else { 0 }
    }
}
