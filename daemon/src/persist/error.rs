//! Why a persisted segment (a cache file, an fd from the fd store, a manifest) is not
//! served again, or could not be persisted. Every variant names what was checked; the
//! file or fd it concerns is named by the caller's log line.

use std::io;

use crate::pack::LayoutError;
use crate::sys::memfd::MemfdError;

/// A persisted segment that cannot be adopted, or a segment that cannot be persisted.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    /// A digest field is not 64 hex digits.
    #[error("{what} {text:?} is not a BLAKE3 hex digest")]
    Digest {
        /// Which digest.
        what: &'static str,
        /// The text found.
        text: String,
    },
    /// The segment key is not the one its source digest and plan give.
    #[error("segment key {found:?} does not match its source and plan ({derived})")]
    SegmentKey {
        /// The key recorded.
        found: String,
        /// The key this daemon derives.
        derived: String,
    },
    /// A published segment's plan or source digest is not the one its publisher and
    /// identity give, or an entry of it has a layout other than `engine`.
    #[error("published segment {key:?}: {what}")]
    Published {
        /// The key recorded.
        key: String,
        /// What does not match.
        what: &'static str,
    },
    /// The segment size is not a positive multiple of the page size.
    #[error("size {size} is not a positive multiple of the page size {page}")]
    Size {
        /// Recorded size.
        size: u64,
        /// Page size.
        page: u64,
    },
    /// An entry's layout is not one this daemon knows.
    #[error("entry {entry}: {source}")]
    Layout {
        /// Tensor name.
        entry: String,
        /// Why.
        source: LayoutError,
    },
    /// An entry was packed by another version of its layout.
    #[error("entry {entry}: layout {layout} version {found} is outdated (this packer writes version {current})")]
    LayoutVersion {
        /// Tensor name.
        entry: String,
        /// Layout.
        layout: String,
        /// Version recorded.
        found: u32,
        /// Version this daemon writes.
        current: u32,
    },
    /// An entry's key is not the one its source and layout give.
    #[error("entry {entry}: key {key:?} does not match its source and layout")]
    EntryKey {
        /// Tensor name.
        entry: String,
        /// The key recorded.
        key: String,
    },
    /// An entry's dtype is unknown.
    #[error("entry {entry}: unknown dtype {dtype:?}")]
    Dtype {
        /// Tensor name.
        entry: String,
        /// The dtype recorded.
        dtype: String,
    },
    /// An entry overlaps the one before it or leaves the segment.
    #[error("entry {entry} [{offset}, +{length}) overlaps or leaves the segment")]
    Bounds {
        /// Tensor name.
        entry: String,
        /// Offset recorded.
        offset: u64,
        /// Length recorded.
        length: u64,
    },
    /// An entry's bytes do not hash to its recorded BLAKE3.
    #[error("entry {entry}: BLAKE3 does not match the record")]
    EntryDigest {
        /// Tensor name.
        entry: String,
    },
    /// Bytes outside every entry are not zero.
    #[error("non-zero padding {place}")]
    Padding {
        /// Where ("before entry X", "after the last entry").
        place: String,
    },
    /// A system call on the file failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The error.
        source: io::Error,
    },
    /// Creating, sizing or sealing a memfd failed.
    #[error(transparent)]
    Memfd(#[from] MemfdError),
    /// A cache file that is not a regular file.
    #[error("not a regular file")]
    NotAFile,
    /// A file shorter than its structure.
    #[error("truncated {0}")]
    Truncated(&'static str),
    /// A file without the cache file magic.
    #[error("foreign file: no PACKDSEG magic")]
    Foreign,
    /// A record format other than this daemon's.
    #[error("format {found} is not this daemon's {current} (outdated or newer)")]
    Format {
        /// Format recorded.
        found: u32,
        /// This daemon's.
        current: u32,
    },
    /// A header or manifest larger than any this daemon writes.
    #[error("{what} of {bytes} bytes is implausible")]
    Implausible {
        /// Header or manifest.
        what: &'static str,
        /// Its size.
        bytes: u64,
    },
    /// The cache file header's BLAKE3 does not match.
    #[error("corrupt: the header's BLAKE3 does not match")]
    HeaderDigest,
    /// A header or manifest that is not valid protobuf.
    #[error("corrupt {what}: {source}")]
    Decode {
        /// Header or manifest.
        what: &'static str,
        /// The decoder's error.
        source: prost::DecodeError,
    },
    /// A cache file header without its segment record.
    #[error("header without a segment")]
    NoSegment,
    /// The recorded data offset is not where this format puts the data.
    #[error("data offset {found} is not {expected}")]
    DataOffset {
        /// Offset recorded.
        found: u64,
        /// Offset the format gives.
        expected: u64,
    },
    /// A file whose length is not header + data.
    #[error("truncated or extended: {found} bytes, the header says {expected}")]
    Length {
        /// File length.
        found: u64,
        /// Length the header gives.
        expected: u64,
    },
    /// A cache file named after another segment.
    #[error("holds segment {0} under another name")]
    Misnamed(String),
    /// The segment does not fit in the budget (or among `max_segments`) beside what is
    /// resident and what other files being adopted hold.
    #[error("its {0} bytes do not fit in the budget")]
    DoesNotFit(u64),
    /// The segment is served already (from the fd store), or did not fit when indexed.
    #[error("its segment is already served or does not fit")]
    NotIndexed,
    /// An fd that is not a memfd.
    #[error("it is not a memfd")]
    NotAMemfd,
    /// An fd without the full seal set.
    #[error("it lacks seals (has {0})")]
    Unsealed(String),
    /// An fd that is not the file the manifest names.
    #[error("it is another file (inode {ino} on {dev}, the manifest says {want_ino} on {want_dev})")]
    OtherFile {
        /// Its inode.
        ino: u64,
        /// Its device.
        dev: u64,
        /// The manifest's inode.
        want_ino: u64,
        /// The manifest's device.
        want_dev: u64,
    },
    /// An fd whose size is not the manifest's.
    #[error("its size is {found} bytes, the manifest says {expected}")]
    FdSize {
        /// Its size.
        found: u64,
        /// The manifest's.
        expected: u64,
    },
    /// A manifest name without its sequence number.
    #[error("no sequence number in its name")]
    NoSequence,
    /// An fd the manifest does not name.
    #[error("the manifest does not name it")]
    Unnamed,
    /// A thread checking part of a file panicked.
    #[error("a check thread panicked")]
    Panicked,
}

impl PersistError {
    /// An `io::Error` while doing `what`.
    pub fn io(what: &'static str) -> impl FnOnce(io::Error) -> Self {
        move |source| PersistError::Io { what, source }
    }

    /// Whether a cache file that failed to load with this error is deleted: it is invalid,
    /// packd may not read it (`EACCES`), or its segment does not fit (the newest files are
    /// kept). The daemon lacking a resource (the open-file limit, memory or room for the
    /// memfd) or the device failing a read (`EIO`, perhaps for a moment) says nothing
    /// against the file: it stays for the next start.
    pub fn discards_the_file(&self) -> bool {
        match self {
            PersistError::Io { source, .. } => !matches!(
                source.raw_os_error(),
                Some(
                    libc::EMFILE | libc::ENFILE | libc::ENOMEM | libc::ENOSPC | libc::EAGAIN | libc::EINTR | libc::EIO
                )
            ),
            PersistError::Memfd(_) => false,
            _ => true,
        }
    }
}
