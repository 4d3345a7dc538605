//! A received segment, a mapped model and its tensors.

use std::collections::HashMap;
use std::fs::File;
use std::sync::{Arc, OnceLock};

use memmap2::Mmap;

use crate::conn::Lease;
use crate::error::Error;
use crate::proto;
use crate::{names, sys};

/// A received, sealed segment that is not mapped yet. Holds a lease until dropped.
pub struct Segment {
    pub(crate) info: Arc<proto::SegmentReply>,
    pub(crate) file: sys::SealedFile,
    pub(crate) lease: Lease,
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment")
            .field("key", &self.info.key)
            .field("size", &self.info.size)
            .field("entries", &self.info.entries.len())
            .finish_non_exhaustive()
    }
}

impl Segment {
    /// The daemon's description of the segment.
    pub fn info(&self) -> &proto::SegmentReply {
        &self.info
    }

    /// The sealed memfd (read-only by the kernel's seals).
    pub fn file(&self) -> &File {
        self.file.file()
    }

    /// Maps the segment read-only and closes its fd; the lease moves to the model.
    pub fn map(self) -> Result<Model, Error> {
        self.map_with(false)
    }

    /// Like [`Segment::map`], and maps every page up front (`MADV_POPULATE_READ`): one system call
    /// instead of a page fault per 4 KiB on first access.
    pub fn map_populated(self) -> Result<Model, Error> {
        self.map_with(true)
    }

    fn map_with(self, populate: bool) -> Result<Model, Error> {
        let map = self.file.map(self.info.size, populate).map_err(|e| match e.kind() {
            std::io::ErrorKind::PermissionDenied => Error::NotSealed { key: None, error: e },
            _ => Error::Io(e),
        })?;
        names::register(map.as_ptr() as usize, map.len(), &self.info);
        Ok(Model { map, info: self.info, by_name: OnceLock::new(), _lease: self.lease })
    }
}

/// A mapped model: one read-only shared mapping of a sealed segment and its entry table.
/// Dropping it unmaps and releases the lease.
pub struct Model {
    map: Mmap,
    info: Arc<proto::SegmentReply>,
    /// Entry index by tensor name, built on the first lookup by name.
    by_name: OnceLock<HashMap<String, usize>>,
    _lease: Lease,
}

impl Drop for Model {
    fn drop(&mut self) {
        names::unregister(self.map.as_ptr() as usize);
    }
}

impl Model {
    /// The segment key (`b3:<source>@plan:<plan digest>`).
    pub fn key(&self) -> &str {
        &self.info.key
    }

    /// The daemon's description of the segment.
    pub fn info(&self) -> &proto::SegmentReply {
        &self.info
    }

    /// The whole mapped segment.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// Every packed tensor, in source order.
    pub fn tensors(&self) -> impl Iterator<Item = Tensor<'_>> {
        self.info.entries.iter().map(|entry| self.view(entry))
    }

    /// The packed tensor named `name` (see [`Model::position`]).
    pub fn tensor(&self, name: &str) -> Option<Tensor<'_>> {
        self.tensor_at(self.position(name)?)
    }

    /// Where the tensor named `name` is in source order. The first lookup indexes the table
    /// (O(entries)); each one after is a hash lookup.
    pub fn position(&self, name: &str) -> Option<usize> {
        let index = self.by_name.get_or_init(|| {
            let mut map = HashMap::with_capacity(self.info.entries.len());
            for (i, e) in self.info.entries.iter().enumerate() {
                map.entry(e.name.clone()).or_insert(i);
            }
            map
        });
        index.get(name).copied()
    }

    /// The packed tensor at `index` in source order (the order of [`Model::tensors`]).
    pub fn tensor_at(&self, index: usize) -> Option<Tensor<'_>> {
        self.info.entries.get(index).map(|entry| self.view(entry))
    }

    /// How many packed tensors the model has.
    pub fn len(&self) -> usize {
        self.info.entries.len()
    }

    /// Whether the model has no packed tensor at all.
    pub fn is_empty(&self) -> bool {
        self.info.entries.is_empty()
    }

    fn view<'a>(&'a self, entry: &'a proto::Entry) -> Tensor<'a> {
        // In range: checked when the segment was received (and the mapping fits in usize).
        let start = usize::try_from(entry.offset).unwrap_or(usize::MAX);
        let end = usize::try_from(entry.offset.saturating_add(entry.length)).unwrap_or(usize::MAX);
        Tensor { entry, bytes: self.map.get(start..end).unwrap_or(&[]) }
    }

    /// Checks every entry's bytes against the BLAKE3 in the table.
    pub fn verify(&self) -> Result<(), Error> {
        for t in self.tensors() {
            if self.info.digests_pending {
                return Err(Error::DigestsPending { name: t.entry.name.clone() });
            }
            let got = blake3::hash(t.bytes()).to_hex().to_string();
            if got != t.entry.blake3 {
                return Err(Error::Corrupt { name: t.entry.name.clone(), got, want: t.entry.blake3.clone() });
            }
        }
        Ok(())
    }
}

/// One packed tensor of a mapped [`Model`].
#[derive(Clone, Copy)]
pub struct Tensor<'a> {
    entry: &'a proto::Entry,
    bytes: &'a [u8],
}

impl<'a> Tensor<'a> {
    /// Tensor name in the source.
    pub fn name(&self) -> &'a str {
        &self.entry.name
    }
    /// Entry key (`b3:<source>/<name>#<layout>@v<version>`).
    pub fn key(&self) -> &'a str {
        &self.entry.key
    }
    /// Canonical layout, e.g. `f32-gemm:nr=16,kr=1,sr=1`.
    pub fn layout(&self) -> &'a str {
        &self.entry.layout
    }
    /// Source dtype name (`F32`, `I64`, …).
    pub fn dtype(&self) -> &'a str {
        &self.entry.dtype
    }
    /// Source shape.
    pub fn shape(&self) -> &'a [u64] {
        &self.entry.shape
    }
    /// Name of the bias folded into this GEMM entry, if any.
    pub fn bias(&self) -> Option<&'a str> {
        Some(self.entry.bias.as_str()).filter(|b| !b.is_empty())
    }
    /// The packed bytes (read-only shared memory).
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }
    /// The daemon's table entry.
    pub fn entry(&self) -> &'a proto::Entry {
        self.entry
    }
}
