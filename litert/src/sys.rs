//! This crate's one `unsafe` call: LiteRT's mappings of a built cache made again read-only.

use std::fs::File;
use std::io;

use packd_interpose::maps::Mapping;

/// Maps each of `mappings` (LiteRT's mappings of `file`, read from `/proc/self/maps` just
/// before) again through a read-only fd of `file`: the same pages, so that the memfd can be
/// sealed against writing.
pub(crate) fn remap_read_only(mappings: &[Mapping], file: &File) -> io::Result<()> {
    for m in mappings {
        // SAFETY: `m` is a mapping of `file` from `m.offset` (the caller read it from
        // /proc/self/maps after LiteRT's compile returned), so the new mapping shows every
        // reference into it the same bytes; LiteRT maps, resizes or unmaps it only while it
        // builds or frees the compiled model, and the compile is over and the model not yet
        // handed to its caller.
        unsafe { packd_interpose::sys::remap_read_only(m.lo, m.hi - m.lo, file, m.offset) }?;
    }
    Ok(())
}
