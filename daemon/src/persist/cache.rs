//! The cache directory: one file per segment, so a reboot does not mean repacking.
//!
//! File layout (little-endian): `PACKDSEG` magic (8 bytes), format `u32`, header length
//! `u32`, the header (`packd.v1.CacheFileHeader`, protobuf), the BLAKE3 of everything
//! before it (32 bytes), zeros up to `data_offset` (a multiple of 4096), then the segment's
//! bytes. Files are written to a temporary name, fsynced and renamed, so a crash leaves a
//! whole file or none. A file is adopted only if every check passes: magic, format, header
//! digest, record (keys, layout versions), exact length, every entry's BLAKE3 and zero
//! padding. It is then copied into a new sealed memfd, so what clients map carries the
//! same seals as a freshly packed segment and no later change to the file can reach them.

use std::collections::VecDeque;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use nix::fcntl::PosixFadviseAdvice;

use packd_proto::v1::{self, CacheFileHeader};
use prost::Message;

use super::{PersistError, record};
use crate::key::SegmentKey;
use crate::service::Packer;
use crate::store::{Adopted, Reservation, Segment};
use crate::sys::memfd;

/// First bytes of every cache file.
pub const MAGIC: &[u8; 8] = b"PACKDSEG";
/// Extension of cache files.
pub const EXT: &str = "pack";
/// Bytes before the header: magic, format, header length.
const FIXED: usize = 16;
/// Largest header read: the record of a segment with a million entries is ~200 MB, so a
/// larger length can only be corruption (and is refused before any allocation).
const MAX_HEADER: usize = 256 << 20;
/// Length of the BLAKE3 digest after the header.
const DIGEST_LEN: usize = 32;
/// The segment's bytes start at a multiple of this, so the file can be mapped page-aligned.
const DATA_ALIGN: u64 = 4096;
/// How far back each drop of a cache file's page cache reaches while adopting it: more
/// than the largest page cache folio.
const DROP_BEHIND: u64 = 8 << 20;
/// Bytes copied from the memfd into the file at a time: large enough for sequential disk
/// writes, small enough to stay off the heap's high-water mark.
const COPY_CHUNK: usize = 8 << 20;

/// Path of the cache file of segment `key`.
pub fn path(dir: &Path, key: &SegmentKey) -> PathBuf {
    dir.join(format!("{}.{EXT}", record::stored_name(key)))
}

/// Writes `seg` to its cache file (temp file, fsync, rename, fsync of the directory).
/// Blocking. On failure nothing is left behind. Once renamed, the file is in place: a
/// failed fsync of the directory is logged, not returned (a crash may then lose the file,
/// and its model is packed again; the file must still be counted and, on eviction, removed).
pub fn write(dir: &Path, seg: &Segment) -> io::Result<()> {
    let final_path = path(dir, &seg.key);
    let tmp = dir.join(format!(".{}.tmp.{}", record::stored_name(&seg.key), std::process::id()));
    let result = write_tmp(&tmp, seg).and_then(|()| fs::rename(&tmp, &final_path));
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
        return result;
    }
    if let Err(e) = File::open(dir).and_then(|d| d.sync_all()) {
        tracing::warn!(dir = %dir.display(), key = %seg.key, error = %e, "cache: file written but the directory could not be synced; a crash may lose it");
    }
    Ok(())
}

fn encode_head(seg: &Segment) -> Vec<u8> {
    let mut header = CacheFileHeader { segment: Some(record::record(seg)), data_offset: 0 }.encode_to_vec();
    // The offset depends on the header's length, which depends on the offset's varint.
    for _ in 0..3 {
        let len = FIXED + header.len() + DIGEST_LEN;
        let data_offset = (len as u64).div_ceil(DATA_ALIGN) * DATA_ALIGN;
        header = CacheFileHeader { segment: Some(record::record(seg)), data_offset }.encode_to_vec();
    }
    let mut head = Vec::with_capacity(FIXED + header.len() + DIGEST_LEN);
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(&record::FORMAT.to_le_bytes());
    // The record of a segment is far below 4 GiB (MAX_HEADER is checked on reading).
    head.extend_from_slice(&u32::try_from(header.len()).unwrap_or(u32::MAX).to_le_bytes());
    head.extend_from_slice(&header);
    let digest = blake3::hash(&head);
    head.extend_from_slice(digest.as_bytes());
    head
}

fn write_tmp(tmp: &Path, seg: &Segment) -> io::Result<()> {
    let mut out =
        OpenOptions::new().write(true).create_new(true).mode(0o600).custom_flags(libc::O_CLOEXEC).open(tmp)?;
    let head = encode_head(seg);
    let data_offset = (head.len() as u64).div_ceil(DATA_ALIGN) * DATA_ALIGN;
    out.write_all(&head)?;
    out.write_all(&vec![0u8; usize::try_from(data_offset).unwrap_or(0) - head.len()])?;
    // Positioned reads: the memfd's file offset is shared with every client holding it.
    let mut buf = vec![0u8; COPY_CHUNK.min(usize::try_from(seg.size).unwrap_or(COPY_CHUNK))];
    let mut at = 0u64;
    while at < seg.size {
        let n = usize::try_from((seg.size - at).min(buf.len() as u64)).unwrap_or(buf.len());
        seg.file.read_exact_at(&mut buf[..n], at)?;
        out.write_all(&buf[..n])?;
        at += n as u64;
    }
    out.sync_all()
}

fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// A cache file whose header checked out (everything but the segment's bytes).
pub struct Opened {
    /// The file, open read-only.
    pub file: File,
    /// Its record.
    pub record: v1::SegmentReply,
    /// Offset of the segment's bytes in the file.
    pub data_offset: u64,
}

/// A failed read of a cache file's header: the file ends `where` (it is truncated), or the
/// read failed (an `EIO` keeps the file for the next start).
fn header_read(where_: &'static str) -> impl FnOnce(std::io::Error) -> PersistError {
    move |e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => PersistError::Truncated(where_),
        _ => PersistError::io("reading the header")(e),
    }
}

/// Opens the cache file at `path` and checks everything but the segment's bytes.
pub fn open(path: &Path) -> Result<Opened, PersistError> {
    // Not blocking on a FIFO, nor following a symlink.
    let file = super::files::open_regular(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::InvalidData => PersistError::NotAFile,
        _ => PersistError::io("cannot open")(e),
    })?;
    let meta = file.metadata().map_err(PersistError::io("cannot stat"))?;
    let mut fixed = [0u8; FIXED];
    file.read_exact_at(&mut fixed, 0).map_err(header_read("before the end of the fixed header"))?;
    if &fixed[..8] != MAGIC {
        return Err(PersistError::Foreign);
    }
    let format = le_u32(&fixed[8..12]);
    if format != record::FORMAT {
        return Err(PersistError::Format { found: format, current: record::FORMAT });
    }
    let hlen = le_u32(&fixed[12..16]) as usize;
    if hlen > MAX_HEADER {
        return Err(PersistError::Implausible { what: "header", bytes: hlen as u64 });
    }
    let mut head = vec![0u8; FIXED + hlen + DIGEST_LEN];
    file.read_exact_at(&mut head, 0).map_err(header_read("inside the header"))?;
    let (covered, digest) = head.split_at(FIXED + hlen);
    if blake3::hash(covered).as_bytes() != digest {
        return Err(PersistError::HeaderDigest);
    }
    let header =
        CacheFileHeader::decode(&covered[FIXED..]).map_err(|source| PersistError::Decode { what: "header", source })?;
    let rec = header.segment.ok_or(PersistError::NoSegment)?;
    let want_offset = (head.len() as u64).div_ceil(DATA_ALIGN) * DATA_ALIGN;
    if header.data_offset != want_offset {
        return Err(PersistError::DataOffset { found: header.data_offset, expected: want_offset });
    }
    if Some(meta.len()) != want_offset.checked_add(rec.size) {
        return Err(PersistError::Length { found: meta.len(), expected: want_offset.saturating_add(rec.size) });
    }
    let named = SegmentKey::parse(&rec.key).map(|k| record::stored_name(&k));
    if named.is_none() || path.file_stem().and_then(|s| s.to_str()) != named.as_deref() {
        return Err(PersistError::Misnamed(rec.key));
    }
    Ok(Opened { file, record: rec, data_offset: want_offset })
}

/// Reads and checks the cache file at `path` and copies its segment into a new sealed
/// memfd, on up to `threads` threads (runs of whole entries). `fits(segment)` is asked,
/// with the memfd still empty, before any memory is taken.
///
/// Each chunk (256 KiB, so it stays in the CPU's cache) is read, checked and written into
/// the memfd by the same thread while readahead streams the rest of the file; no writable
/// mapping exists, so sealing cannot be refused. The file's page cache is dropped behind
/// the reading, so adopting does not hold the segment twice (clean page cache can be
/// reclaimed, but it would first push out other files' pages).
///
/// With `huge_pages` (where the host grants them only to advised mappings:
/// `sys::proc::huge_pages_only_when_advised`), the memfd's pages are allocated first, as
/// transparent huge pages, on every core, through a mapping that is gone before the copy:
/// the copy's writes would allocate small pages one by one.
pub fn read(
    path: &Path,
    page: u64,
    threads: usize,
    huge_pages: bool,
    fits: impl FnOnce(&Adopted) -> bool,
) -> Result<Adopted, PersistError> {
    let pending = Pending::open(path, page)?;
    if !fits(&pending.adopted) {
        return Err(PersistError::DoesNotFit(pending.adopted.size));
    }
    pending.fill(threads, huge_pages)
}

/// A cache file whose header has been read and checked, and the segment it describes with
/// its memfd still empty: no memory is taken for it yet.
struct Pending {
    file: File,
    data_offset: u64,
    adopted: Adopted,
}

impl Pending {
    fn open(path: &Path, page: u64) -> Result<Self, PersistError> {
        let Opened { file, record: rec, data_offset } = open(path)?;
        let memfd = memfd::create(&format!("packd:{}", rec.key))?;
        let adopted = record::adopted(&rec, memfd, page)?;
        Ok(Self { file, data_offset, adopted })
    }

    /// Copies and checks the file's segment into the memfd, then seals it ([`read`]).
    fn fill(self, threads: usize, huge_pages: bool) -> Result<Adopted, PersistError> {
        let Self { file, data_offset, adopted } = self;
        let advise = |at: u64, len: u64, advice| {
            let off = i64::try_from(data_offset + at).unwrap_or(i64::MAX);
            let _ = nix::fcntl::posix_fadvise(&file, off, i64::try_from(len).unwrap_or(0), advice);
        };
        // Let the disk stream the whole file while the chunks are checked and copied.
        advise(0, adopted.size, PosixFadviseAdvice::POSIX_FADV_WILLNEED);
        if huge_pages {
            memfd::FillMap::with_threads(&adopted.file, adopted.size, true, threads)?.finish()?;
        } else {
            adopted.file.set_len(adopted.size).map_err(PersistError::io("sizing the memfd"))?;
        }
        record::verify_parallel(&adopted, threads, |buf, at| {
            file.read_exact_at(buf, data_offset + at).map_err(PersistError::io("reading the data"))?;
            adopted.file.write_all_at(buf, at).map_err(PersistError::io("filling the memfd"))?;
            // The page cache may hold a chunk in folios larger than it: each drop reaches back
            // over the last few MiB, so a folio goes once its last byte has been read. (Near a
            // span's start this may drop a neighbour span's readahead, which is then read
            // again: a few MiB at most.)
            let back = at.saturating_sub(DROP_BEHIND);
            advise(back, at + buf.len() as u64 - back, PosixFadviseAdvice::POSIX_FADV_DONTNEED);
            Ok(())
        })?;
        advise(0, adopted.size, PosixFadviseAdvice::POSIX_FADV_DONTNEED);
        memfd::seal(&adopted.file)?;
        Ok(adopted)
    }
}

/// A cache file that stays: the segment's key and its file size.
pub struct Kept {
    /// Segment key.
    pub key: SegmentKey,
    /// File size in bytes.
    pub bytes: u64,
}

/// What loading the cache directory did.
#[derive(Default)]
pub struct Load {
    /// Files kept, oldest first: their segments are in the index, but for the
    /// [`Load::deferred`] ones.
    pub kept: Vec<Kept>,
    /// Segments adopted from files.
    pub adopted: usize,
    /// Bytes of segments adopted.
    pub bytes: u64,
    /// Files discarded (invalid, or not fitting the budget).
    pub discarded: usize,
    /// Files kept but not adopted: a system call failed (the open-file limit, memory for
    /// the memfd); they are tried again at the next start.
    pub deferred: usize,
}

/// What loading one file did: its segment's key, and the segment's size if it was adopted
/// now (`None`: it was served already, from the fd store).
type Loaded = (SegmentKey, Option<u64>);

/// A file of the cache directory to load: its mtime, size and path.
struct Candidate {
    mtime: i64,
    len: u64,
    path: PathBuf,
}

/// Loads every valid cache file in `dir` (newest first, while the budget allows) into
/// the index; deletes invalid files, leftovers of interrupted writes, and files whose
/// segments do not fit. `progress(bytes)` is called before each file is read. Blocking.
pub fn load(packer: &Packer, dir: &Path, writable: bool, progress: impl FnMut(u64) + Send) -> Load {
    let files = match candidates(dir, writable) {
        Ok(files) => files,
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "cache: cannot list the directory");
            return Load::default();
        }
    };
    // Two threads per core (one computes while the other waits for the disk) take files
    // from one queue, newest first; the index takes them in whatever order they finish,
    // while the budget allows. Fewer files than threads: the spare threads check parts of
    // each file.
    let served: Vec<SegmentKey> = packer.store.keys();
    let huge_pages = packer.huge_pages && crate::sys::proc::huge_pages_only_when_advised();
    let threads = 2 * std::thread::available_parallelism().map_or(1, usize::from);
    let per_file = (threads / files.len().max(1)).max(1);
    let workers = threads.min(files.len()).max(1);
    // Each file's header is read and its room reserved in queue order, under the queue's
    // lock (a header is small): the budget goes to the newest files whatever order their
    // copies finish in, and the copies together never pass it.
    let queue = Mutex::new((files.into_iter().collect::<VecDeque<_>>(), progress));
    let next = || {
        let mut q = lock(&queue);
        let file = q.0.pop_front()?;
        let begun = begin(packer, &served, &file, &mut q.1);
        Some((file, begun))
    };
    let outcomes: Vec<(Candidate, Result<Loaded, PersistError>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    while let Some((file, begun)) = next() {
                        let outcome = begun.and_then(|b| finish(packer, b, per_file, huge_pages));
                        done.push((file, outcome));
                    }
                    done
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap_or_default()).collect()
    });
    let mut out = Load::default();
    let mut kept = Vec::new();
    for (file, outcome) in outcomes {
        match outcome {
            Ok((key, adopted)) => {
                if let Some(bytes) = adopted {
                    out.adopted += 1;
                    out.bytes += bytes;
                }
                kept.push((file.mtime, Kept { key, bytes: file.len }));
            }
            Err(why) if !why.discards_the_file() => {
                tracing::warn!(
                    file = %file.path.display(),
                    why = %why,
                    "cache: file kept but not adopted (tried again at the next start; its model is packed again if asked for)"
                );
                out.deferred += 1;
                // Still on disk: it counts against cache_max_bytes, and a segment packed
                // again under its key is not written twice.
                let stem = file.path.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
                if let Some(key) = record::key_of_stored_name(stem) {
                    kept.push((file.mtime, Kept { key, bytes: file.len }));
                }
            }
            Err(why) => {
                tracing::warn!(file = %file.path.display(), why = %why, "cache: file discarded");
                if writable {
                    let _ = fs::remove_file(&file.path);
                }
                out.discarded += 1;
            }
        }
    }
    kept.sort_by_key(|(mtime, _)| *mtime);
    out.kept = kept.into_iter().map(|(_, k)| k).collect();
    out
}

/// The cache files of `dir`, newest first; removes leftovers of interrupted writes (when
/// `writable`) and leaves other files alone.
fn candidates(dir: &Path, writable: bool) -> io::Result<Vec<Candidate>> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir)?.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') && name.contains(".tmp.") {
            if writable {
                let _ = fs::remove_file(&path);
            }
            continue;
        }
        if name == super::digests::NAME || name == super::kernels::NAME || name == super::lock::NAME {
            continue;
        }
        if path.extension().and_then(|e| e.to_str()) != Some(EXT) {
            tracing::warn!(file = %path.display(), "cache: not a cache file; left alone");
            continue;
        }
        let (mtime, len) = entry.metadata().map(|m| (m.mtime(), m.len())).unwrap_or((0, 0));
        files.push(Candidate { mtime, len, path });
    }
    files.sort_by_key(|f| std::cmp::Reverse(f.mtime));
    Ok(files)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How adopting one cache file begins.
enum Begun {
    /// Its segment is served already (from the fd store).
    Served(SegmentKey),
    /// Its header checks out and room for its segment is reserved.
    Adopting(Box<(Pending, Reservation)>),
}

/// Begins adopting the cache file `file` unless its segment is among `served` already:
/// reads and checks its header and reserves its segment's room (without evicting
/// anything). An error says why not (and [`PersistError::discards_the_file`] whether the
/// file must go). `progress(bytes)` is told of a file about to be read.
fn begin(
    packer: &Packer,
    served: &[SegmentKey],
    file: &Candidate,
    progress: &mut impl FnMut(u64),
) -> Result<Begun, PersistError> {
    let p = file.path.as_path();
    let stem = p.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
    if let Some(key) = served.iter().find(|k| record::stored_name(k) == stem) {
        return Ok(Begun::Served(key.clone()));
    }
    progress(file.len);
    let pending = Pending::open(p, packer.page_size)?;
    match packer.store.reserve_adoption(&pending.adopted) {
        Some(room) => Ok(Begun::Adopting(Box::new((pending, room)))),
        None => Err(PersistError::DoesNotFit(pending.adopted.size)),
    }
}

/// Copies and checks a begun file's segment on `threads` threads and enters it into the
/// index. Returns the segment key and, if it was adopted now, its size.
fn finish(packer: &Packer, begun: Begun, threads: usize, huge_pages: bool) -> Result<Loaded, PersistError> {
    let (pending, room) = match begun {
        Begun::Served(key) => return Ok((key, None)),
        Begun::Adopting(begun) => *begun,
    };
    let a = pending.fill(threads, huge_pages)?;
    let (key, size) = (a.key.clone(), a.size);
    if packer.store.adopt_reserved(a, room, false, true).is_none() {
        return Err(PersistError::NotIndexed);
    }
    Ok((key, Some(size)))
}
