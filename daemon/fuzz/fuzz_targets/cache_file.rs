//! The cache file reader takes files that anyone with write access to the cache directory
//! (or a failing disk) may have changed: it must never panic and must adopt only what is
//! exactly right. Random bytes rarely pass the magic and the header digest, so the first
//! input byte chooses a mode: raw bytes as the file, or a fuzzed `CacheFileHeader` the
//! harness frames correctly (magic, format, length, digest, padding, derived keys) so the
//! record checks, entry bounds, BLAKE3 and padding checks see fuzzed values.
#![no_main]

use std::path::Path;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use packd::key::SegmentKey;
use packd::pack::{Layout, entry_key};
use packd::persist::{cache, record};
use packd::source::Digest;
use packd_proto::v1::CacheFileHeader;
use prost::Message;

const PAGE: u64 = 4096;
const MAX_DATA: u64 = 1 << 20;

fn dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("temp dir")).path()
}

/// Frames `header` as the writer does, with the data padded or cut to the record's size.
fn framed(mut header: CacheFileHeader, data: &[u8], fix_keys: bool) -> Option<(String, Vec<u8>)> {
    let rec = header.segment.as_mut()?;
    if rec.size > MAX_DATA {
        return None;
    }
    if fix_keys {
        if let Ok(h) = blake3::Hash::from_hex(&rec.source_blake3) {
            let source = Digest(*h.as_bytes());
            rec.key = SegmentKey::new(&source, &rec.plan).to_string();
            for e in &mut rec.entries {
                if let Ok(layout) = e.layout.parse::<Layout>() {
                    e.key = entry_key(&source, &e.name, layout).to_string();
                    e.layout_version = layout.version();
                }
            }
        }
    }
    let key = rec.key.clone();
    let size = rec.size as usize;
    // The data offset depends on the header's length, which depends on the data offset:
    // settle it in two rounds (a varint grows by at most a byte or two).
    let mut offset = 0u64;
    for _ in 0..3 {
        header.data_offset = offset;
        let len = 16 + header.encoded_len() + 32;
        offset = (len as u64).div_ceil(PAGE) * PAGE;
    }
    header.data_offset = offset;
    let body = header.encode_to_vec();
    let mut file = cache::MAGIC.to_vec();
    file.extend_from_slice(&record::FORMAT.to_le_bytes());
    file.extend_from_slice(&u32::try_from(body.len()).ok()?.to_le_bytes());
    file.extend_from_slice(&body);
    let digest = blake3::hash(&file);
    file.extend_from_slice(digest.as_bytes());
    file.resize(usize::try_from(offset).ok()?, 0);
    let mut payload = data.to_vec();
    payload.resize(size, 0);
    file.extend_from_slice(&payload);
    Some((key, file))
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let (key, bytes) = match mode % 3 {
        0 => ("raw".to_string(), rest.to_vec()),
        m => {
            // A length-prefixed header, then the segment's data.
            let Some((len, rest)) = rest.split_first_chunk::<2>() else { return };
            let len = (u16::from_le_bytes(*len) as usize).min(rest.len());
            let (head, payload) = rest.split_at(len);
            let Ok(header) = CacheFileHeader::decode(head) else { return };
            match framed(header, payload, m == 2) {
                Some(f) => f,
                None => return,
            }
        }
    };
    // Only a key that is a plain file name can name its file; the reader compares the
    // name it finds with the key it reads, so any other key is read under a wrong name.
    let plain = !key.is_empty() && key.len() < 200 && !key.contains(['/', '\0']) && key != "." && key != "..";
    // Named as `cache::path` names a segment's file (the key with ':' as '_').
    let stem = if plain { key.replace(':', "_") } else { "raw".to_string() };
    let path = dir().join(format!("{stem}.{}", cache::EXT));
    std::fs::write(&path, &bytes).expect("write the cache file");
    let threads = 1 + usize::from(mode / 3 % 3);
    let read = cache::read(&path, PAGE, threads, false, |_| true);
    let in_place = packd_testkit::check_in_place(&path, PAGE);
    let _ = std::fs::remove_file(&path);
    // Both readers apply the same checks.
    assert_eq!(read.is_ok(), in_place.is_ok(), "{:?} vs {:?}", read.as_ref().err(), in_place.as_ref().err());
    if let Ok(a) = read {
        assert_eq!(a.key.as_str(), key);
        assert!(a.size > 0 && a.size % PAGE == 0);
        let mut end = 0;
        for e in &a.entries {
            assert!(e.offset >= end && e.offset + e.length <= a.size);
            end = e.offset + e.length;
            let mut buf = vec![0u8; e.length as usize];
            std::os::unix::fs::FileExt::read_exact_at(&a.file, &mut buf, e.offset).expect("read adopted entry");
            assert_eq!(blake3::hash(&buf).as_bytes(), &e.blake3);
        }
    }
});
