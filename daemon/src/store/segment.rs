//! A sealed segment in the index.

use std::fs::File;

use crate::pack::PackedEntry;
use crate::source::Digest;

/// Daemon-local segment id; with the daemon's generation it names a segment on the wire.
pub type SegmentId = u64;

/// One sealed memfd holding the entries of one pack job.
pub struct Segment {
    /// Id, unique within this daemon instance.
    pub id: SegmentId,
    /// Segment key: `b3:<source>@plan:<plan digest>`.
    pub key: String,
    /// The sealed memfd. Only its fd leaves the daemon, never a mapping.
    pub file: File,
    /// Size in bytes (page multiple).
    pub size: u64,
    /// Digest of the source file.
    pub source: Digest,
    /// Canonical plan text.
    pub plan: String,
    /// Entries in source order.
    pub entries: Vec<PackedEntry>,
    /// The data plane's encoded replies for this segment (full table, table omitted),
    /// built on first use: opaque bytes to the store.
    pub wire: std::sync::OnceLock<(Vec<u8>, Vec<u8>)>,
}

/// The key of the segment packed from `source` with the plan whose canonical text is `plan`.
pub fn segment_key(source: &Digest, plan: &str) -> String {
    let p = blake3::hash(plan.as_bytes()).to_hex();
    format!("b3:{}@plan:{}", source.hex(), &p[..16])
}
