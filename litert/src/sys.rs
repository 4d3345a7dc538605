//! This crate's `unsafe`: a built cache sealed in place, LiteRT's mappings of it made again
//! read-only.

use std::fs::File;
use std::io;

use packd_interpose::maps::Mapping;
use packd_interpose::sys::vm;

/// Maps LiteRT's `shared` mappings of `file` again read-only (the same pages) and seals the
/// memfd against any change.
///
/// # Safety
/// `shared` was read from `/proc/self/maps` just before and holds all of LiteRT's
/// mappings of `file`, each `r--s`; nothing maps, unmaps or resizes them meanwhile (as
/// [`crate::WeightCache::finish`]).
pub(crate) unsafe fn seal_mapped(file: &File, shared: &[Mapping]) -> Result<(), SealError> {
    // SAFETY: forwarded from the caller.
    unsafe { remap_read_only(shared, file) }.map_err(SealError::Remap)?;
    vm::seal(file).map_err(SealError::Seal)
}

/// Why a built cache could not be sealed in place.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SealError {
    /// A remap of LiteRT's mappings failed.
    #[error("mapping LiteRT's cache read-only failed: {0}")]
    Remap(io::Error),
    /// Sealing the memfd failed.
    #[error("sealing the cache failed: {0}")]
    Seal(io::Error),
}

/// Maps each of `mappings` (LiteRT's shared read-only mappings of `file`) again through a
/// read-only fd of `file`: the same pages, so that the memfd can be sealed against writing.
/// Should a remap fail after the kernel took the old mapping away, the process stops with a
/// message: LiteRT would read the hole at its next inference.
///
/// # Safety
/// `mappings` were read from `/proc/self/maps` just before, all `r--s` mappings of `file`,
/// and no other thread maps, unmaps or resizes them meanwhile.
unsafe fn remap_read_only(mappings: &[Mapping], file: &File) -> io::Result<()> {
    for m in mappings {
        // SAFETY: `m` is a shared read-only mapping of `file` from `m.offset`, left alone
        // meanwhile (the caller's promise): the new mapping is shared and read-only too, and
        // shows every reference into it the same bytes.
        let remapped = unsafe { packd_interpose::sys::remap_read_only(m.lo, m.hi - m.lo, file, m.offset) };
        if let Err(e) = remapped {
            if !packd_interpose::maps::all().iter().any(|x| x.lo <= m.lo && x.hi >= m.hi) {
                packd_interpose::say!(
                    "packd-litert: LiteRT's weight cache at {:#x} was unmapped by a failed remap ({e}); stopping",
                    m.lo
                );
                std::process::abort();
            }
            return Err(e);
        }
    }
    Ok(())
}
