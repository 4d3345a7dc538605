//! A persisted segment's record: the data plane's `SegmentReply`, checked strictly before
//! it describes bytes anyone will be served.

use packd_proto::v1;

use super::PersistError;
use crate::key::SegmentKey;
use crate::pack::{Layout, PackedEntry, entry_key};
use crate::source::{Digest, Dtype};
use crate::store::{Adopted, Publisher, Segment, published_plan, published_source};

/// Version of the persisted record formats (manifest and cache file). A daemon adopts only
/// records of its own format; anything else is repacked.
pub const FORMAT: u32 = 1;

/// The fd store name and cache file stem of segment `key`: the key with `:` (which
/// `FDNAME=` forbids) replaced by `_`. Printable ASCII, well under 255 characters.
pub fn stored_name(key: &SegmentKey) -> String {
    key.as_str().replace(':', "_")
}

/// The segment key a [`stored_name`] was made from (`None` for any other name).
pub fn key_of_stored_name(name: &str) -> Option<SegmentKey> {
    SegmentKey::parse(&name.replacen('_', ":", 2)).filter(|k| stored_name(k) == name)
}

/// The record of `seg` (ids and generation zeroed: they mean nothing after a restart).
pub fn record(seg: &Segment) -> v1::SegmentReply {
    let mut r = seg.to_proto(0);
    r.segment_id = 0;
    r
}

fn hex32(text: &str, what: &'static str) -> Result<[u8; 32], PersistError> {
    let h = blake3::Hash::from_hex(text).map_err(|_| PersistError::Digest { what, text: text.to_string() })?;
    Ok(*h.as_bytes())
}

/// Checks a record and turns it, with its sealed `file`, into a segment for the index.
/// Every derived value (segment key, entry keys, layout versions, entry bounds) must agree
/// with what this daemon would compute; a record from another packer version is refused.
pub fn adopted(r: &v1::SegmentReply, file: std::fs::File, page: u64) -> Result<Adopted, PersistError> {
    let source = Digest(hex32(&r.source_blake3, "source digest")?);
    let key = SegmentKey::new(&source, &r.plan);
    if key.as_str() != r.key {
        return Err(PersistError::SegmentKey { found: r.key.clone(), derived: key.to_string() });
    }
    let publisher = r.publisher.as_ref().map(|p| Publisher {
        uid: p.uid,
        gid: p.gid,
        groups: p.groups.clone(),
        identity: p.identity.clone(),
    });
    if let Some(p) = &publisher
        && (r.plan != published_plan(p.uid, &p.identity) || source != published_source(p.uid, &p.identity))
    {
        return Err(PersistError::Published {
            key: key.to_string(),
            what: "its plan or source does not match its publisher",
        });
    }
    if r.size == 0 || !r.size.is_multiple_of(page) {
        return Err(PersistError::Size { size: r.size, page });
    }
    let mut entries = Vec::with_capacity(r.entries.len());
    let mut end = 0u64;
    for e in &r.entries {
        let layout: Layout = match &publisher {
            Some(_) if e.layout == "engine" => Layout::Engine,
            Some(_) => {
                return Err(PersistError::Published {
                    key: key.to_string(),
                    what: "an entry's layout is not \"engine\"",
                });
            }
            None => e.layout.parse().map_err(|source| PersistError::Layout { entry: e.name.clone(), source })?,
        };
        if layout.version() != e.layout_version {
            return Err(PersistError::LayoutVersion {
                entry: e.name.clone(),
                layout: e.layout.clone(),
                found: e.layout_version,
                current: layout.version(),
            });
        }
        let entry = entry_key(&source, &e.name, layout);
        if entry.as_str() != e.key {
            return Err(PersistError::EntryKey { entry: e.name.clone(), key: e.key.clone() });
        }
        let dtype: Dtype =
            e.dtype.parse().map_err(|()| PersistError::Dtype { entry: e.name.clone(), dtype: e.dtype.clone() })?;
        let stop = e.offset.checked_add(e.length).filter(|&s| s <= r.size && e.offset >= end);
        end = stop.ok_or_else(|| PersistError::Bounds { entry: e.name.clone(), offset: e.offset, length: e.length })?;
        entries.push(PackedEntry {
            name: e.name.clone(),
            key: entry,
            layout,
            dtype,
            shape: e.shape.clone(),
            offset: e.offset,
            length: e.length,
            blake3: hex32(&e.blake3, "entry digest")?,
            bias: Some(e.bias.clone()).filter(|b| !b.is_empty()),
        });
    }
    let label = crate::store::label(&r.label);
    Ok(Adopted { file, key, size: r.size, source, plan: r.plan.clone(), entries, publisher, label })
}

/// Bytes read and checked at a time: small enough that a chunk is checked (and copied on)
/// while it is still in the CPU's cache (half of a 512 KiB L2); the disk reads ahead.
const CHUNK: u64 = 256 << 10;
/// Alignment of chunk boundaries within the segment (and so within the file, whose data
/// starts page-aligned): reads of whole pages.
const CHUNK_ALIGN: u64 = 4096;

/// Checks that the segment read in chunks by `read_at(buf, offset)` holds exactly what `a`
/// describes: every entry's BLAKE3 matches and every byte between entries is zero.
pub fn verify_reader(
    a: &Adopted,
    read_at: impl FnMut(&mut [u8], u64) -> Result<(), PersistError>,
) -> Result<(), PersistError> {
    verify_span(a, 0..a.entries.len(), 0, a.size, read_at)
}

/// [`verify_reader`] on `threads` threads, each taking a run of whole entries (and the
/// padding after them) of about equal bytes. `read_at` must be callable from any thread.
pub fn verify_parallel(
    a: &Adopted,
    threads: usize,
    read_at: impl Fn(&mut [u8], u64) -> Result<(), PersistError> + Sync,
) -> Result<(), PersistError> {
    let n = a.entries.len();
    let threads = threads.clamp(1, n.max(1));
    // Group boundaries: entry indexes where a group starts.
    let share = a.size / threads as u64 + 1;
    let mut starts = vec![0usize];
    for (i, e) in a.entries.iter().enumerate().skip(1) {
        if e.offset >= share * starts.len() as u64 && starts.len() < threads {
            starts.push(i);
        }
    }
    let spans: Vec<(std::ops::Range<usize>, u64, u64)> = starts
        .iter()
        .enumerate()
        .map(|(g, &first)| {
            let last = starts.get(g + 1).copied().unwrap_or(n);
            let from = if g == 0 { 0 } else { a.entries[first].offset };
            let to = if last == n { a.size } else { a.entries[last].offset };
            (first..last, from, to)
        })
        .collect();
    if spans.len() == 1 {
        let (range, from, to) = spans.into_iter().next().unwrap_or((0..0, 0, 0));
        return verify_span(a, range, from, to, &read_at);
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = spans
            .into_iter()
            .map(|(range, from, to)| {
                let read_at = &read_at;
                scope.spawn(move || verify_span(a, range, from, to, read_at))
            })
            .collect();
        handles.into_iter().try_for_each(|h| h.join().unwrap_or(Err(PersistError::Panicked)))
    })
}

/// Checks entries `range` of `a` and the padding around them within bytes `[from, to)`,
/// read in chunks. Chunk boundaries fall on multiples of [`CHUNK_ALIGN`] (but for the
/// span's own ends), whatever the entries' offsets.
fn verify_span(
    a: &Adopted,
    range: std::ops::Range<usize>,
    from: u64,
    to: u64,
    mut read_at: impl FnMut(&mut [u8], u64) -> Result<(), PersistError>,
) -> Result<(), PersistError> {
    let mut buf = vec![0u8; usize::try_from(CHUNK.min(to - from)).unwrap_or(0)];
    let mut check = Checker::new(&a.entries[range], from);
    let mut at = from;
    while at < to {
        let end = if at.is_multiple_of(CHUNK_ALIGN) { at + CHUNK } else { at.next_multiple_of(CHUNK_ALIGN) }.min(to);
        let chunk = &mut buf[..usize::try_from(end - at).unwrap_or(0)];
        read_at(chunk, at)?;
        check.feed(chunk)?;
        at = end;
    }
    check.finish()
}

/// Checks a run of entries and the padding around them from bytes fed in order.
struct Checker<'a> {
    entries: &'a [PackedEntry],
    /// Offset of the next byte fed.
    pos: u64,
    /// The entry being hashed (entries before it are checked).
    next: usize,
    hasher: blake3::Hasher,
}

impl<'a> Checker<'a> {
    fn new(entries: &'a [PackedEntry], from: u64) -> Self {
        Checker { entries, pos: from, next: 0, hasher: blake3::Hasher::new() }
    }

    /// Completes every entry that ends at `pos`; fails on a digest mismatch.
    fn complete(&mut self) -> Result<(), PersistError> {
        while let Some(e) = self.entries.get(self.next).filter(|e| e.offset + e.length == self.pos) {
            if *self.hasher.finalize().as_bytes() != e.blake3 {
                return Err(PersistError::EntryDigest { entry: e.name.clone() });
            }
            self.hasher.reset();
            self.next += 1;
        }
        Ok(())
    }

    fn feed(&mut self, mut bytes: &[u8]) -> Result<(), PersistError> {
        while !bytes.is_empty() {
            self.complete()?;
            // Up to the next entry (padding), or to the end of the current one.
            let (n, in_entry) = match self.entries.get(self.next) {
                Some(e) if self.pos < e.offset => (e.offset - self.pos, false),
                Some(e) => (e.offset + e.length - self.pos, true),
                None => (u64::MAX, false),
            };
            let n = usize::try_from(n).unwrap_or(usize::MAX).min(bytes.len());
            let (now, later) = bytes.split_at(n);
            if in_entry {
                self.hasher.update(now);
            } else if now.iter().any(|&x| x != 0) {
                let place = match self.entries.get(self.next) {
                    Some(e) => format!("before entry {}", e.name),
                    None => "after the last entry".into(),
                };
                return Err(PersistError::Padding { place });
            }
            self.pos += n as u64;
            bytes = later;
        }
        Ok(())
    }

    /// Checks the entries that end where the bytes did, and that none is left.
    fn finish(mut self) -> Result<(), PersistError> {
        self.complete()?;
        match self.entries.get(self.next) {
            Some(e) => Err(PersistError::EntryDigest { entry: e.name.clone() }),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)] // test data sizes are small
mod tests {
    use super::*;

    const PAGE: u64 = 4096;

    #[test]
    fn a_stored_name_gives_back_its_key_and_no_other_name_does() {
        let key = SegmentKey::parse(&format!("b3:{}@plan:{}", "ab".repeat(32), "0123456789abcdef")).unwrap();
        let name = stored_name(&key);
        assert_eq!(key_of_stored_name(&name), Some(key));
        for other in ["", "b3_", "digests", &name.replacen('_', ":", 1), &format!("{name}_x"), &name.replace('_', "-")]
        {
            assert_eq!(key_of_stored_name(other), None, "{other}");
        }
    }

    #[test]
    fn only_a_missing_resource_or_a_device_error_keeps_a_cache_file_that_failed() {
        let io = |errno| PersistError::Io { what: "x", source: std::io::Error::from_raw_os_error(errno) };
        for errno in [libc::EMFILE, libc::ENFILE, libc::ENOMEM, libc::ENOSPC, libc::EIO] {
            assert!(!io(errno).discards_the_file(), "errno {errno}");
        }
        assert!(
            !PersistError::Memfd(crate::sys::memfd::MemfdError::Create(nix::errno::Errno::EMFILE)).discards_the_file()
        );
        for bad in [io(libc::ELOOP), io(libc::EACCES), PersistError::Foreign, PersistError::Panicked] {
            assert!(bad.discards_the_file(), "{bad}");
        }
    }

    /// [`verify_reader`] over a whole segment in memory.
    fn verify_bytes(a: &Adopted, bytes: &[u8]) -> Result<(), PersistError> {
        verify_reader(a, |buf, at| {
            let start = usize::try_from(at).map_err(|_| PersistError::Truncated("offset"))?;
            let src = bytes.get(start..start + buf.len()).ok_or(PersistError::Truncated("segment"))?;
            buf.copy_from_slice(src);
            Ok(())
        })
    }

    fn record_of(entries: &[(&str, u64, u64)]) -> v1::SegmentReply {
        let source = Digest([7; 32]);
        let plan = "rules=;layout=identity".to_string();
        v1::SegmentReply {
            key: SegmentKey::new(&source, &plan).to_string(),
            size: PAGE,
            source_blake3: source.hex(),
            plan,
            entries: entries
                .iter()
                .map(|&(name, offset, length)| v1::Entry {
                    name: name.into(),
                    key: entry_key(&source, name, Layout::Identity).to_string(),
                    layout: "identity".into(),
                    layout_version: 1,
                    dtype: "U8".into(),
                    shape: vec![length],
                    offset,
                    length,
                    blake3: blake3::hash(&vec![1u8; usize::try_from(length).unwrap()]).to_hex().to_string(),
                    bias: String::new(),
                })
                .collect(),
            ..Default::default()
        }
    }

    fn file() -> std::fs::File {
        crate::sys::memfd::create("record-test").unwrap()
    }

    #[test]
    fn a_record_is_adopted_only_if_everything_derived_agrees() {
        let good = record_of(&[("a", 0, 10), ("b", 64, 5)]);
        let a = adopted(&good, file(), PAGE).unwrap();
        assert_eq!((a.entries.len(), a.size, a.key.as_str()), (2, PAGE, good.key.as_str()));

        let mut r = good.clone();
        r.entries[1].layout_version = 2;
        assert!(matches!(adopted(&r, file(), PAGE).unwrap_err(), PersistError::LayoutVersion { found: 2, .. }));
        let mut r = good.clone();
        r.plan.push('x');
        assert!(matches!(adopted(&r, file(), PAGE).unwrap_err(), PersistError::SegmentKey { .. }));
        let mut r = good.clone();
        r.entries[0].key = r.entries[1].key.clone();
        assert!(matches!(adopted(&r, file(), PAGE).unwrap_err(), PersistError::EntryKey { .. }));
        let r = record_of(&[("a", 0, 100), ("b", 64, 5)]);
        assert!(matches!(adopted(&r, file(), PAGE).unwrap_err(), PersistError::Bounds { offset: 64, .. }));
        let r = record_of(&[("a", 4090, 10)]);
        assert!(matches!(adopted(&r, file(), PAGE).unwrap_err(), PersistError::Bounds { offset: 4090, .. }));
        let mut r = good.clone();
        r.size = 100;
        assert!(matches!(adopted(&r, file(), PAGE).unwrap_err(), PersistError::Size { size: 100, .. }));
        let mut r = good;
        r.entries[0].layout = "f99-gemm".into();
        assert!(matches!(adopted(&r, file(), PAGE).unwrap_err(), PersistError::Layout { .. }));
    }

    #[test]
    fn stored_names_are_valid_fdnames() {
        let key = SegmentKey::new(&Digest([0xab; 32]), "rules=*.weight=f32-gemm:nr=16;default=identity");
        let name = stored_name(&key);
        assert!(name.len() <= 255 && !name.contains(':'), "{name}");
        assert!(name.bytes().all(|b| b.is_ascii_graphic()), "{name}");
        assert_eq!(name, key.as_str().replace(':', "_"));
    }

    #[test]
    fn bytes_must_match_every_entry_and_zero_padding() {
        let a = adopted(&record_of(&[("a", 0, 10), ("b", 64, 5)]), file(), PAGE).unwrap();
        let mut bytes = vec![0u8; 4096];
        bytes[..10].fill(1);
        bytes[64..69].fill(1);
        verify_bytes(&a, &bytes).unwrap();
        bytes[3] = 2;
        assert!(matches!(verify_bytes(&a, &bytes).unwrap_err(), PersistError::EntryDigest { entry } if entry == "a"));
        bytes[3] = 1;
        bytes[30] = 1;
        assert!(verify_bytes(&a, &bytes).unwrap_err().to_string().contains("padding before entry b"));
        bytes[30] = 0;
        bytes[4000] = 9;
        assert!(verify_bytes(&a, &bytes).unwrap_err().to_string().contains("after the last entry"));
    }

    #[test]
    fn checking_on_threads_finds_what_one_thread_finds() {
        let spec: Vec<(String, u64, u64)> = (0..9).map(|i| (format!("t{i}"), i * 448, 300 + i)).collect();
        let spec: Vec<(&str, u64, u64)> = spec.iter().map(|(n, o, l)| (n.as_str(), *o, *l)).collect();
        let a = adopted(&record_of(&spec), file(), PAGE).unwrap();
        let mut bytes = vec![0u8; 4096];
        for &(_, o, l) in &spec {
            bytes[o as usize..(o + l) as usize].fill(1);
        }
        let read = |bytes: &Vec<u8>| {
            let b = bytes.clone();
            move |buf: &mut [u8], at: u64| {
                buf.copy_from_slice(&b[at as usize..at as usize + buf.len()]);
                Ok(())
            }
        };
        for threads in [1, 2, 3, 4, 9, 20] {
            verify_parallel(&a, threads, read(&bytes)).unwrap();
        }
        // A flipped byte anywhere (in an entry, in padding between, at the end) is found
        // whichever thread owns it.
        for at in [0usize, 350, 447, 2000, 3600, 4095] {
            let mut bad = bytes.clone();
            bad[at] ^= 0x80;
            for threads in [1, 2, 3, 4] {
                assert!(verify_parallel(&a, threads, read(&bad)).is_err(), "byte {at}, {threads} threads");
            }
        }
    }

    #[test]
    fn chunks_straddling_entries_are_read_whole_pages_and_checked() {
        // Entries that cross chunk and page boundaries, one empty, padding of odd lengths.
        let spec =
            [("a", 0, CHUNK + 100), ("b", CHUNK + 128, 5000), ("e", CHUNK + 5184, 0), ("c", 2 * CHUNK + 64, CHUNK)];
        let mut r = record_of(&spec);
        r.size = 3 * CHUNK + PAGE;
        let a = adopted(&r, file(), PAGE).unwrap();
        let mut bytes = vec![0u8; usize::try_from(a.size).unwrap()];
        for &(_, o, l) in &spec {
            bytes[o as usize..(o + l) as usize].fill(1);
        }
        let reads = std::sync::Mutex::new(Vec::new());
        let read = |src: &[u8]| {
            let (src, reads) = (src.to_vec(), &reads);
            move |buf: &mut [u8], at: u64| {
                reads.lock().unwrap().push((at, buf.len() as u64));
                buf.copy_from_slice(&src[at as usize..at as usize + buf.len()]);
                Ok(())
            }
        };
        for threads in [1, 2, 3] {
            reads.lock().unwrap().clear();
            verify_parallel(&a, threads, read(&bytes)).unwrap();
            // The reads tile the segment, and start on a page but where a span starts.
            let mut seen = reads.lock().unwrap().clone();
            seen.sort_unstable();
            let mut end = 0;
            for &(at, len) in &seen {
                assert_eq!(at, end, "{threads} threads: reads tile the segment");
                end = at + len;
            }
            assert_eq!(end, a.size);
            let unaligned = seen.iter().filter(|(at, _)| !at.is_multiple_of(CHUNK_ALIGN)).count();
            assert!(unaligned < threads, "{threads} threads: {unaligned} unaligned reads");
            for at in [0usize, CHUNK as usize + 99, CHUNK as usize + 100, CHUNK as usize + 5183, bytes.len() - 1] {
                let mut bad = bytes.clone();
                bad[at] ^= 0x80;
                assert!(verify_parallel(&a, threads, read(&bad)).is_err(), "byte {at}, {threads} threads");
            }
        }
    }
}
