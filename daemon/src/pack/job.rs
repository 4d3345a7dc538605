//! A pack job: one source + one plan → one sealed memfd segment.
//!
//! The job streams the source in file order with positioned reads, hashing exactly the
//! bytes it packs, once. A job started for a known digest fails if they do not hash to it
//! (the file changed), so a segment's bytes always belong to its key. A job started without
//! one (a file never seen before) learns the digest from the same pass and names its
//! entries after it: the bytes packed are the bytes hashed, with no second read. Packed bytes go
//! straight into the memfd through a temporary writable mapping: the daemon never holds a
//! private copy of a model (its scratch is one nr-block of rows). The mapping is dropped
//! and the memfd sealed before the segment is returned.

use std::fs::File;

use super::choice::Kernels;
use super::gemm;
use super::kernels::{self, Isa};
use super::layout::{GemmKind, GemmParams, Layout};
use super::plan::{Plan, PlanError};
use crate::key::EntryKey;
use crate::source::{Change, Digest, Dtype, Source, SourceError, TensorInfo};
use crate::sys::memfd::{self, FillMap, MemfdError, Prepared};

/// Source bytes read, hashed and packed at a time for one GEMM tensor.
const CHUNK_BYTES: usize = 8 << 20;

/// Packs whole blocks `rows` → `dest` on up to `threads` threads (blocks are independent).
#[allow(clippy::too_many_arguments)]
fn pack_blocks(
    isa: Isa,
    kind: GemmKind,
    p: GemmParams,
    src: Dtype,
    k: usize,
    rows: &[u8],
    dest: &mut [u8],
    threads: usize,
) {
    let bl = kind.block_len(p, k);
    let row_block = p.nr as usize * k * gemm::src_size(src);
    let blocks = dest.len() / bl.max(1);
    let pack_range = |rows: &[u8], dest: &mut [u8]| kernels::pack_matrix(isa, kind, p, src, k, rows, dest);
    if threads <= 1 || blocks < 2 * threads || bl == 0 {
        pack_range(rows, dest);
        return;
    }
    let per = blocks.div_ceil(threads);
    std::thread::scope(|scope| {
        let mut rest_rows = rows;
        let mut rest_dest = dest;
        while !rest_dest.is_empty() {
            let take = per.min(rest_dest.len() / bl);
            let (d, dt) = rest_dest.split_at_mut(take * bl);
            let (r, rt) = rest_rows.split_at((take * row_block).min(rest_rows.len()));
            scope.spawn(move || pack_range(r, d));
            rest_dest = dt;
            rest_rows = rt;
        }
    });
}

/// Entry offsets within a segment are multiples of this.
pub const ENTRY_ALIGN: u64 = 64;

/// Why a pack job failed.
#[derive(Debug, thiserror::Error)]
pub enum PackError {
    /// The source is unusable.
    #[error(transparent)]
    Source(#[from] SourceError),
    /// The plan does not fit the source.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// Creating, filling or sealing the memfd failed.
    #[error(transparent)]
    Memfd(#[from] MemfdError),
    /// The packed model would not fit in the address space.
    #[error("packed size of tensor {0} overflows")]
    TooLarge(String),
}

/// One packed tensor in a segment.
#[derive(Clone, Debug)]
pub struct PackedEntry {
    /// Tensor name.
    pub name: String,
    /// Entry key: `b3:<source>/<name>#<layout>@v<version>`.
    pub key: EntryKey,
    /// Layout.
    pub layout: Layout,
    /// Source dtype.
    pub dtype: Dtype,
    /// Source shape.
    pub shape: Vec<u64>,
    /// Offset in the segment (multiple of [`ENTRY_ALIGN`]).
    pub offset: u64,
    /// Packed length in bytes.
    pub length: u64,
    /// BLAKE3 of the packed bytes.
    pub blake3: [u8; 32],
    /// Name of the folded bias tensor.
    pub bias: Option<String>,
}

/// A sealed, filled segment.
pub struct Packed {
    /// The sealed memfd.
    pub file: File,
    /// Its size (a multiple of the page size).
    pub size: u64,
    /// Entries in source order.
    pub entries: Vec<PackedEntry>,
    /// BLAKE3 of the source bytes packed (the whole file).
    pub digest: Digest,
    /// Where the job's time went.
    pub stages: Stages,
}

/// Where a pack job's time went (wall time of each stage; stages that overlap are counted
/// once, under the one named).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Stages {
    /// Allocating and mapping the segment's pages (all cores).
    pub populate: std::time::Duration,
    /// Reading the source (`pread`), GEMM sources and biases.
    pub read: std::time::Duration,
    /// Reading identity tensors straight into the segment, and hashing them.
    pub copy: std::time::Duration,
    /// Packing GEMM chunks (all cores but one) while one core hashes the chunk.
    pub pack: std::time::Duration,
    /// Hashing what was read outside of packing (headers, biases).
    pub hash: std::time::Duration,
    /// BLAKE3 of every entry (all cores).
    pub entry_hashes: std::time::Duration,
    /// Sealing the memfd.
    pub seal: std::time::Duration,
}

impl Stages {
    /// A one-line summary in milliseconds, e.g. for a log line.
    pub fn summary(&self) -> String {
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        format!(
            "populate {:.1} ms, read {:.1} ms, copy {:.1} ms, pack {:.1} ms, hash {:.1} ms, entry hashes {:.1} ms, seal {:.1} ms",
            ms(self.populate),
            ms(self.read),
            ms(self.copy),
            ms(self.pack),
            ms(self.hash),
            ms(self.entry_hashes),
            ms(self.seal)
        )
    }
}

/// The key of an entry.
pub fn entry_key(source: &Digest, name: &str, layout: Layout) -> EntryKey {
    EntryKey::new(source, name, layout, layout.version())
}

fn to_usize(v: u64, name: &str) -> Result<usize, PackError> {
    usize::try_from(v).map_err(|_| PackError::TooLarge(name.to_string()))
}

/// Where and how a pack job runs.
pub struct JobConfig<'a> {
    /// memfd name (shown in `/proc/PID/maps`).
    pub name: &'a str,
    /// Page size; the segment size is a multiple of it.
    pub page: u64,
    /// Kernels to use, per GEMM kind.
    pub kernels: Kernels,
    /// Ask for transparent huge pages.
    pub huge_pages: bool,
    /// Gives the job a memfd allocated ahead of it, if there is one (the daemon's spare);
    /// the job then allocates only what the spare lacks.
    pub spare: Option<&'a dyn Fn() -> Option<Prepared>>,
}

/// Which entry a source tensor feeds.
#[derive(Clone, Copy)]
enum Role {
    Entry(usize),
    Bias(usize),
}

/// A source laid out for packing: entries with offsets, and the segment size.
struct Layouted {
    raw_header: Vec<u8>,
    header: crate::source::Header,
    roles: Vec<Option<Role>>,
    entries: Vec<PackedEntry>,
    size: u64,
}

fn lay_out(source: &Source, plan: &Plan, expected: &Digest, page: u64) -> Result<Layouted, PackError> {
    let (raw_header, header) = source.header()?;
    let assignments = plan.assign(&header.tensors)?;
    let mut roles: Vec<Option<Role>> = vec![None; header.tensors.len()];
    let mut entries = Vec::with_capacity(assignments.len());
    let mut cursor = 0u64;
    for (ei, a) in assignments.iter().enumerate() {
        let t = &header.tensors[a.tensor];
        let (n, k) = match t.shape.as_slice() {
            [n, k] => (to_usize(*n, &t.name)?, to_usize(*k, &t.name)?),
            _ => (0, 0),
        };
        let length = a.layout.packed_len(n, k, t.len).ok_or_else(|| PackError::TooLarge(t.name.clone()))?;
        let offset = cursor.div_ceil(ENTRY_ALIGN) * ENTRY_ALIGN;
        cursor = offset.checked_add(length).ok_or_else(|| PackError::TooLarge(t.name.clone()))?;
        roles[a.tensor] = Some(Role::Entry(ei));
        if let Some(b) = a.bias {
            roles[b] = Some(Role::Bias(ei));
        }
        entries.push(PackedEntry {
            name: t.name.clone(),
            key: entry_key(expected, &t.name, a.layout),
            layout: a.layout,
            dtype: t.dtype,
            shape: t.shape.clone(),
            offset,
            length,
            blake3: [0; 32],
            bias: a.bias.map(|b| header.tensors[b].name.clone()),
        });
    }
    let size = cursor.max(1).div_ceil(page) * page;
    Ok(Layouted { raw_header, header, roles, entries, size })
}

/// The size of the segment `source` packs into with `plan` (pages of `page` bytes), from
/// its header alone: what admission to the budget needs before any hashing or packing.
pub fn packed_size(source: &Source, plan: &Plan, page: u64) -> Result<u64, PackError> {
    let l = lay_out(source, plan, &Digest([0; 32]), page)?;
    Ok(charged_bytes(l.size, &l.entries, page))
}

/// Heap bytes the daemon holds for a segment's entries besides the memfd: each entry in the
/// index (its struct, name, key, shape and bias name), its slot in the segment's entry
/// lookup table, and its part of the data plane's cached reply encoding (name, key, layout, hex BLAKE3).
/// Computed from the entries alone, so the admission from the header, the reservation of
/// the pack job and the charge of the segment in the index agree.
pub fn metadata_bytes(entries: &[PackedEntry]) -> u64 {
    // Per entry: the struct, a map slot, the encoding's fixed part (64 hex digits of
    // BLAKE3, the layout text, dtype, offsets and field tags) and the allocator's overhead
    // on each of them. Calibrated on a model of 300 000 one-byte tensors: the daemon's heap
    // grew by 880 bytes per entry (docs/SECURITY.md), when a global map also held a copy of
    // each key; since the lookup table is per segment it errs high, kept as a conservative
    // bound.
    let fixed = std::mem::size_of::<PackedEntry>() as u64 + 64 + 360;
    entries
        .iter()
        .map(|e| {
            let name = e.name.len() as u64;
            let key = e.key.as_str().len() as u64;
            let bias = e.bias.as_ref().map_or(0, |b| b.len() as u64);
            fixed + 2 * name + 3 * key + 2 * bias + 16 * e.shape.len() as u64
        })
        .sum()
}

/// What a segment counts against the byte budget: its size plus its metadata
/// ([`metadata_bytes`]) in whole pages, rounded down: about 1 KB per tensor, so an
/// ordinary model costs little more than its memfd and one with 300 000 tiny tensors costs
/// what its table takes.
pub fn charged_bytes(size: u64, entries: &[PackedEntry], page: u64) -> u64 {
    let page = page.max(1);
    size.saturating_add(metadata_bytes(entries) / page * page)
}

/// Packs `source` with `plan` into a new sealed memfd. `expected` is the source digest the
/// job's key was derived from, if known (the job fails unless the bytes hash to it);
/// without it the digest is learned from the bytes packed ([`Packed::digest`]) and the
/// entry keys derive from it. Once the segment's size is known, and before any memory is
/// taken for it, `reserve(charged)` is called with its [`charged_bytes`] (the daemon's
/// budget); its value is returned with the segment.
pub fn pack<R, E: From<PackError>>(
    source: &Source,
    plan: &Plan,
    expected: Option<&Digest>,
    job: &JobConfig<'_>,
    reserve: impl FnOnce(u64) -> Result<R, E>,
) -> Result<(Packed, R), E> {
    let mut l = lay_out(source, plan, expected.unwrap_or(&Digest([0; 32])), job.page)?;
    // Reserved first: a job the budget refuses leaves the spare where it is (and a budget
    // too tight for both drops the spare, never a segment).
    let reservation = reserve(charged_bytes(l.size, &l.entries, job.page))?;
    let spare = job.spare.and_then(|take| take());
    let started = std::time::Instant::now();
    let (file, mut map) = match spare {
        Some(spare) => spare.into_fill(l.size).map_err(PackError::from)?,
        None => {
            let file = memfd::create(job.name).map_err(PackError::from)?;
            let map = FillMap::new(&file, l.size, job.huge_pages).map_err(PackError::from)?;
            (file, map)
        }
    };
    let populate = started.elapsed();
    let (mut stages, digest) = fill(source, &mut l, map.bytes_mut(), expected, job.kernels)?;
    // Sealing counts the wait for a spare's shrink, if it has not ended yet.
    let sealing = std::time::Instant::now();
    map.finish().map_err(PackError::from)?;
    memfd::seal(&file).map_err(PackError::from)?;
    stages.populate = populate;
    stages.seal = sealing.elapsed();
    Ok((Packed { file, size: l.size, entries: l.entries, digest, stages }, reservation))
}

/// Packs `source` into private anonymous memory, the way an inference runtime does today
/// (the baseline of `packctl bench memory`). Same bytes as [`pack`].
pub fn pack_private(
    source: &Source,
    plan: &Plan,
    expected: &Digest,
    kernels: Kernels,
) -> Result<(Vec<u8>, Vec<PackedEntry>), PackError> {
    let mut l = lay_out(source, plan, expected, 64)?;
    let mut dest = vec![0u8; usize::try_from(l.size).map_err(|_| PackError::TooLarge("model".into()))?];
    fill(source, &mut l, &mut dest, Some(expected), kernels)?;
    Ok((dest, l.entries))
}

/// Streams the source in file order into `dest`, hashing what it reads; fails if that is
/// not `expected` (when given), else names the entries after it; fills the entries' BLAKE3.
/// Returns the stage times and the digest.
fn fill(
    source: &Source,
    l: &mut Layouted,
    dest: &mut [u8],
    expected: Option<&Digest>,
    kernels: Kernels,
) -> Result<(Stages, Digest), PackError> {
    let (header, roles, entries) = (&l.header, &l.roles, &mut l.entries);
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    let mut f = Filler {
        source,
        hasher: blake3::Hasher::new(),
        scratch: Vec::new(),
        threads,
        kernels,
        stages: Stages::default(),
    };
    f.hasher.update(&l.raw_header);
    let mut prehashed = vec![false; entries.len()];
    for (ti, t) in header.tensors.iter().enumerate() {
        match roles[ti] {
            Some(Role::Entry(ei)) => {
                let e = &entries[ei];
                let out = entry_bytes(dest, e)?;
                match e.layout {
                    // A plan never gives `Engine`; copied unchanged like identity if it did.
                    Layout::Identity | Layout::Engine => {
                        entries[ei].blake3 = f.copy(t, out)?;
                        prehashed[ei] = true;
                    }
                    Layout::Gemm(kind, p) => f.gemm(t, kind, p, out)?,
                }
            }
            Some(Role::Bias(ei)) => {
                let e = &entries[ei];
                f.bias(t, e, entry_bytes(dest, e)?)?;
            }
            // Unreachable by construction (every tensor is an entry or a folded bias), but
            // hashed anyway so the digest check stays exact.
            None => f.hash_only(t)?,
        }
    }
    let (mut stages, got) = (f.stages, Digest(*f.hasher.finalize().as_bytes()));
    match expected {
        Some(want) if got != *want => {
            return Err(SourceError::Changed(Change::Digest { got, want: *want }).into());
        }
        Some(_) => {}
        None => {
            for e in entries.iter_mut() {
                e.key = entry_key(&got, &e.name, e.layout);
            }
        }
    }
    let at = std::time::Instant::now();
    hash_entries(entries, &prehashed, dest, threads)?;
    stages.entry_hashes += at.elapsed();
    Ok((stages, got))
}

/// The bytes of entry `e` in the segment.
fn entry_bytes<'d>(dest: &'d mut [u8], e: &PackedEntry) -> Result<&'d mut [u8], PackError> {
    let off = to_usize(e.offset, &e.name)?;
    Ok(&mut dest[off..off + to_usize(e.length, &e.name)?])
}

/// One pass over a source in file order: what it read so far is in `hasher`.
struct Filler<'a> {
    source: &'a Source,
    hasher: blake3::Hasher,
    scratch: Vec<u8>,
    threads: usize,
    kernels: Kernels,
    stages: Stages,
}

impl Filler<'_> {
    /// Reads tensor `t` straight into its entry `out`; returns the entry's BLAKE3, taken
    /// on the other cores while one adds the bytes to the source's hash.
    fn copy(&mut self, t: &TensorInfo, out: &mut [u8]) -> Result<[u8; 32], PackError> {
        let at = std::time::Instant::now();
        self.source.read_exact_at(out, t.start)?;
        let out: &[u8] = out;
        let mut own = [0; 32];
        hash_beside(&mut self.hasher, out, self.threads, |cores| {
            own = *crate::source::tree::hash_slice(out, cores).as_bytes();
        });
        self.stages.copy += at.elapsed();
        Ok(own)
    }

    /// Packs the 2-D tensor `t` into `out`: reads (and hashes) a chunk of whole blocks in
    /// file order, then packs its blocks on every core.
    fn gemm(&mut self, t: &TensorInfo, kind: GemmKind, p: GemmParams, out: &mut [u8]) -> Result<(), PackError> {
        let (n, k) = (to_usize(t.shape[0], &t.name)?, to_usize(t.shape[1], &t.name)?);
        if n == 0 {
            // No rows, no blocks: and its column count, which no size bounds, is not used.
            return Ok(());
        }
        let row = gemm::src_size(t.dtype) * k;
        let bl = kind.block_len(p, k);
        let nr = p.nr as usize;
        let blocks_per_chunk = (CHUNK_BYTES / (nr * row).max(1)).max(1);
        let mut blk = 0;
        while blk < p.blocks(n) {
            let last = (blk + blocks_per_chunk).min(p.blocks(n));
            let (first_row, end_row) = (blk * nr, (last * nr).min(n));
            self.scratch.resize((end_row - first_row) * row, 0);
            let at = std::time::Instant::now();
            self.source.read_exact_at(&mut self.scratch, t.start + (first_row * row) as u64)?;
            self.stages.read += at.elapsed();
            let at = std::time::Instant::now();
            let (dest, scratch, isa) = (&mut out[blk * bl..last * bl], &self.scratch, self.kernels.for_kind(kind));
            hash_beside(&mut self.hasher, scratch, self.threads, |cores| {
                pack_blocks(isa, kind, p, t.dtype, k, scratch, dest, cores);
            });
            self.stages.pack += at.elapsed();
            blk = last;
        }
        Ok(())
    }

    /// Reads the bias `t` folded into entry `e` and writes it into the entry's bias slots.
    fn bias(&mut self, t: &TensorInfo, e: &PackedEntry, out: &mut [u8]) -> Result<(), PackError> {
        self.read_whole(t)?;
        let at = std::time::Instant::now();
        self.hasher.update(&self.scratch);
        self.stages.hash += at.elapsed();
        if let Layout::Gemm(kind, p) = e.layout {
            gemm::write_bias(kind, p, to_usize(e.shape[1], &e.name)?, t.dtype, &self.scratch, out);
        }
        Ok(())
    }

    /// Reads and hashes tensor `t`, using it for nothing else.
    fn hash_only(&mut self, t: &TensorInfo) -> Result<(), PackError> {
        self.read_whole(t)?;
        self.hasher.update(&self.scratch);
        Ok(())
    }

    /// Reads tensor `t` whole into the scratch buffer.
    fn read_whole(&mut self, t: &TensorInfo) -> Result<(), PackError> {
        self.scratch.resize(to_usize(t.len, &t.name)?, 0);
        let at = std::time::Instant::now();
        self.source.read_exact_at(&mut self.scratch, t.start)?;
        self.stages.read += at.elapsed();
        Ok(())
    }
}

/// Chunks smaller than this are hashed before packing, on this thread: a thread of its own
/// costs more than hashing them (a model of many small matrices would start one per matrix).
const HASH_ASIDE: usize = 1 << 20;

/// Hashes `chunk` into `hasher` on a thread of its own while `work` (packing the chunk,
/// or taking an entry's own hash) runs here with the other cores (all of them when there
/// is only one, or when the chunk is small).
fn hash_beside(hasher: &mut blake3::Hasher, chunk: &[u8], threads: usize, work: impl FnOnce(usize)) {
    if threads <= 1 || chunk.len() < HASH_ASIDE {
        hasher.update(chunk);
        work(threads);
        return;
    }
    std::thread::scope(|s| {
        let hashing = s.spawn(|| {
            hasher.update(chunk);
        });
        work(threads - 1);
        hashing.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
    });
}

/// Entries at least this large are hashed one at a time, each on every core; smaller ones
/// are shared out between the cores.
const SPLIT_ENTRY: u64 = 2 * crate::source::tree::LEAF;

/// Fills the BLAKE3 of every entry not `prehashed` from its bytes in `dest`, on up to
/// `threads` threads.
fn hash_entries(entries: &mut [PackedEntry], prehashed: &[bool], dest: &[u8], threads: usize) -> Result<(), PackError> {
    // (entry index, its bytes in `dest`) of every entry still to hash.
    let mut todo = Vec::with_capacity(entries.len());
    for (i, e) in entries.iter().enumerate().filter(|(i, _)| !prehashed[*i]) {
        let off = to_usize(e.offset, &e.name)?;
        todo.push((i, off..off + to_usize(e.length, &e.name)?));
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let small = |out: &mut Vec<(usize, [u8; 32])>| loop {
        let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let Some((i, r)) = todo.get(n) else { break };
        if (r.len() as u64) < SPLIT_ENTRY {
            out.push((*i, *crate::source::tree::hash_slice(&dest[r.clone()], 1).as_bytes()));
        }
    };
    let mut hashes: Vec<(usize, [u8; 32])> = std::thread::scope(|s| {
        let helpers: Vec<_> = (1..threads.max(1))
            .filter_map(|_| {
                std::thread::Builder::new()
                    .spawn_scoped(s, || {
                        let mut out = Vec::new();
                        small(&mut out);
                        out
                    })
                    .ok()
            })
            .collect();
        let mut out = Vec::new();
        small(&mut out);
        for h in helpers {
            out.extend(h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
        }
        out
    });
    for (i, r) in &todo {
        if (r.len() as u64) >= SPLIT_ENTRY {
            hashes.push((*i, *crate::source::tree::hash_slice(&dest[r.clone()], threads).as_bytes()));
        }
    }
    for (i, h) in hashes {
        entries[i].blake3 = h;
    }
    Ok(())
}
