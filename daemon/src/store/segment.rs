//! A sealed segment in the index.

use std::fs::File;

use crate::key::{EntryKey, SegmentKey};
use crate::pack::PackedEntry;
use crate::source::Digest;

/// Daemon-local segment id; with the daemon's generation it names a segment on the wire.
pub type SegmentId = u64;

/// One sealed memfd holding the entries of one pack job.
pub struct Segment {
    /// Id, unique within this daemon instance.
    pub id: SegmentId,
    /// Segment key: `b3:<source>@plan:<plan digest>`.
    pub key: SegmentKey,
    /// The sealed memfd. Only its fd leaves the daemon, never a mapping.
    pub file: File,
    /// Size in bytes (page multiple).
    pub size: u64,
    /// What it counts against the budget: `size` plus its metadata in whole pages
    /// ([`crate::pack::charged_bytes`]).
    pub charged: u64,
    /// Digest of the source file.
    pub source: Digest,
    /// Canonical plan text.
    pub plan: String,
    /// Entries in source order (for a published segment: in offset order).
    pub entries: Vec<PackedEntry>,
    /// Who published it; `None` for a segment packd packed itself.
    pub publisher: Option<super::Publisher>,
    /// Display label from the request that packed it (untrusted; empty when none).
    pub label: String,
    /// A publication indexed before packd hashed it: its entries' digests are not known yet
    /// (zeros here, empty on the wire) and it is not persisted until they are.
    pub pending: bool,
    /// Where an earlier run of the daemon left it, when it was adopted at start.
    pub kept: Option<super::KeptIn>,
    /// Indices of `entries` sorted by entry key, for [`Segment::entry`].
    by_key: Vec<u32>,
    /// The encoded `SegmentReply` the data plane sends: with its entry table, and without.
    wire: (Vec<u8>, Vec<u8>),
}

impl Segment {
    /// A segment with its lookup table and reply encodings built. Called off the store's lock
    /// and off the async runtime: for a table of 300 000 entries this takes a while.
    pub(super) fn build(id: SegmentId, generation: u64, a: super::Adopted, charged: u64) -> Self {
        Self::build_as(id, generation, a, charged, false)
    }

    /// [`Segment::build`], `pending` saying whether its entries' digests are still unknown.
    pub(super) fn build_as(id: SegmentId, generation: u64, a: super::Adopted, charged: u64, pending: bool) -> Self {
        let mut by_key: Vec<u32> = (0..u32::try_from(a.entries.len()).unwrap_or(u32::MAX)).collect();
        by_key.sort_unstable_by(|&x, &y| a.entries[x as usize].key.cmp(&a.entries[y as usize].key));
        let mut seg = Self {
            id,
            key: a.key,
            file: a.file,
            size: a.size,
            charged,
            source: a.source,
            plan: a.plan,
            entries: a.entries,
            publisher: a.publisher,
            label: a.label,
            pending,
            kept: None,
            by_key,
            wire: (Vec::new(), Vec::new()),
        };
        let mut reply = seg.to_proto(generation);
        // The label is another client's text: recorded, not sent.
        reply.label.clear();
        let full = prost::Message::encode_to_vec(&reply);
        reply.entries.clear();
        reply.entries_omitted = true;
        seg.wire = (full, prost::Message::encode_to_vec(&reply));
        seg
    }

    /// The entry whose key is `key`, if this segment has one.
    pub fn entry(&self, key: &EntryKey) -> Option<&PackedEntry> {
        let i = self.by_key.binary_search_by(|&i| self.entries[i as usize].key.cmp(key)).ok()?;
        self.entries.get(self.by_key[i] as usize)
    }

    /// The encoded `SegmentReply` (for this daemon instance), with or without its entry
    /// table: built once, shared by every reply.
    pub fn encoded(&self, omit_entries: bool) -> &[u8] {
        if omit_entries { &self.wire.1 } else { &self.wire.0 }
    }

    /// The segment's description as the data plane sends it (and persistence records it),
    /// for daemon instance `generation`.
    pub fn to_proto(&self, generation: u64) -> packd_proto::v1::SegmentReply {
        packd_proto::v1::SegmentReply {
            segment_id: self.id,
            generation,
            key: self.key.to_string(),
            size: self.size,
            fd_index: 0,
            source_blake3: self.source.hex(),
            plan: self.plan.clone(),
            entries: self
                .entries
                .iter()
                .map(|e| packd_proto::v1::Entry {
                    name: e.name.clone(),
                    key: e.key.to_string(),
                    layout: e.layout.to_string(),
                    layout_version: e.layout.version(),
                    dtype: e.dtype.name().to_string(),
                    shape: e.shape.clone(),
                    offset: e.offset,
                    length: e.length,
                    blake3: if self.pending {
                        String::new()
                    } else {
                        blake3::Hash::from_bytes(e.blake3).to_hex().to_string()
                    },
                    bias: e.bias.clone().unwrap_or_default(),
                })
                .collect(),
            entries_omitted: false,
            publisher: self.publisher.as_ref().map(|p| packd_proto::v1::Publisher {
                uid: p.uid,
                gid: p.gid,
                groups: p.groups.clone(),
                identity: p.identity.clone(),
            }),
            label: self.label.clone(),
            // Per reply, appended after this cached encoding (frame::segment_outcome_suffix).
            outcome: 0,
            digests_pending: self.pending,
        }
    }

    /// Whether a client with `uid` may be served this segment: packd's own segments are
    /// everyone's; a published one is its publisher's, and everyone's if `trusted` names
    /// its publisher.
    pub fn visible_to(&self, uid: u32, trusted: &crate::access::Ids) -> bool {
        self.publisher.as_ref().is_none_or(|p| p.trusted_by(uid, trusted))
    }
}

/// Most bytes of a display label kept.
pub const LABEL_BYTES: usize = 128;

/// A client's display label as the daemon keeps it: at most [`LABEL_BYTES`] bytes (cut at a
/// character boundary), control characters replaced by `?`.
pub fn label(text: &str) -> String {
    untrusted_text(text, LABEL_BYTES)
}

/// A client's text as the daemon keeps it: at most `max` bytes (cut at a character
/// boundary), control characters replaced by `?`.
pub fn untrusted_text(text: &str, max: usize) -> String {
    let mut out = String::new();
    for c in text.chars() {
        let c = if c.is_control() { '?' } else { c };
        if out.len() + c.len_utf8() > max {
            break;
        }
        out.push(c);
    }
    out
}
