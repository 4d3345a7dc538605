//! This crate's `unsafe`: a built cache sealed in place, LiteRT's mappings of it made again
//! read-only.

use std::fs::File;
use std::io;

use packd_client::Fallback;
use packd_interpose::maps::{self, Mapping};
use packd_interpose::sys::vm;

use crate::format::{self, Header};

/// Makes what LiteRT built into `file` ready to publish: checks its header, pads it to whole
/// pages, maps LiteRT's shared mappings of it again read-only and seals it. Returns its
/// size; on failure the reason as packd counts it, and in words.
///
/// # Safety
/// As [`crate::WeightCache::finish`].
pub(crate) unsafe fn seal_build(file: &File) -> Result<u64, (Fallback, String)> {
    let header = Header::read(file).map_err(|e| {
        let fallback = match e {
            format::FormatError::Version { found } if found != 0 => Fallback::UnknownInterface,
            _ => Fallback::WorkerError,
        };
        (fallback, format!("LiteRT's cache file cannot be served: {e}"))
    })?;
    // Private mappings do not keep the memfd from being sealed and are left as they are.
    let shared: Vec<_> = maps::of_file(file).into_iter().filter(|m| m.perms.ends_with('s')).collect();
    if shared.is_empty() {
        return Err((Fallback::Other, "LiteRT did not map the weight cache packd gave it".into()));
    }
    if let Some(m) = shared.iter().find(|m| m.perms != "r--s") {
        let reason = format!("LiteRT maps its weight cache {}: packd cannot seal it", m.perms);
        return Err((Fallback::UnknownInterface, reason));
    }
    let worker = |what: &str, e: &dyn std::fmt::Display| (Fallback::WorkerError, format!("{what}: {e}"));
    let page = vm::page() as u64;
    let size = format::pad(file, &header, page).map_err(|e| worker("padding the cache to whole pages failed", &e))?;
    // SAFETY: forwarded from the caller; `shared` was read just now and holds only r--s
    // mappings of `file`.
    unsafe { remap_read_only(&shared, file) }.map_err(|e| worker("mapping LiteRT's cache read-only failed", &e))?;
    vm::seal(file).map_err(|e| worker("sealing the cache failed", &e))?;
    Ok(size)
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
