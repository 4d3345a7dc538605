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

impl Segment {
    /// The segment's description as the data plane sends it (and persistence records it),
    /// for daemon instance `generation`.
    pub fn to_proto(&self, generation: u64) -> packd_proto::v1::SegmentReply {
        packd_proto::v1::SegmentReply {
            segment_id: self.id,
            generation,
            key: self.key.clone(),
            size: self.size,
            fd_index: 0,
            source_blake3: self.source.hex(),
            plan: self.plan.clone(),
            entries: self
                .entries
                .iter()
                .map(|e| packd_proto::v1::Entry {
                    name: e.name.clone(),
                    key: e.key.clone(),
                    layout: e.layout.to_string(),
                    layout_version: e.layout.version(),
                    dtype: e.dtype.name().to_string(),
                    shape: e.shape.clone(),
                    offset: e.offset,
                    length: e.length,
                    blake3: blake3::Hash::from_bytes(e.blake3).to_hex().to_string(),
                    bias: e.bias.clone().unwrap_or_default(),
                })
                .collect(),
            entries_omitted: false,
        }
    }
}

/// The key of the segment packed from `source` with the plan whose canonical text is `plan`.
pub fn segment_key(source: &Digest, plan: &str) -> String {
    let p = blake3::hash(plan.as_bytes()).to_hex();
    format!("b3:{}@plan:{}", source.hex(), &p[..16])
}
