//! The digest cache (file identity → BLAKE3) kept in the cache directory, so that the first
//! request for a model after a restart or a reboot is a lookup, not a hash of the whole
//! file.
//!
//! File `digests` in the cache directory: the magic `packd-digests-v1\n`, then one record of
//! 7 little-endian u64 (device, inode, size, mtime s/ns, ctime s/ns) and 32 digest bytes per
//! file, then the BLAKE3 of everything before it. Written whole to a temporary file and
//! renamed over the old one. A file that does not check out is ignored (and replaced at the
//! next write): a digest is only a lookup hint, since every pack job hashes what it packs
//! and fails on a mismatch, and a mismatch makes the daemon forget the digest.

use std::path::Path;

use crate::source::{Digest, DigestCache, FileIdentity};

/// The file's name in the cache directory.
pub const NAME: &str = "digests";
const MAGIC: &[u8] = b"packd-digests-v1\n";
const RECORD: usize = 7 * 8 + 32;
/// Largest file read (far above the digest cache's capacity of records).
const MAX_BYTES: u64 = 64 << 20;

/// The file's bytes for `entries`.
fn encode(entries: &[(FileIdentity, Digest)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(MAGIC.len() + entries.len() * RECORD + 32);
    out.extend_from_slice(MAGIC);
    for (id, d) in entries {
        for f in id.to_fields() {
            out.extend_from_slice(&f.to_le_bytes());
        }
        out.extend_from_slice(&d.0);
    }
    let sum = blake3::hash(&out);
    out.extend_from_slice(sum.as_bytes());
    out
}

/// The records of a file's bytes, `None` when they do not check out.
fn decode(bytes: &[u8]) -> Option<Vec<(FileIdentity, Digest)>> {
    let body = bytes.get(..bytes.len().checked_sub(32)?)?;
    if blake3::hash(body).as_bytes() != &bytes[body.len()..] {
        return None;
    }
    let records = body.strip_prefix(MAGIC)?;
    if !records.len().is_multiple_of(RECORD) {
        return None;
    }
    Some(
        records
            .chunks_exact(RECORD)
            .map(|r| {
                let mut f = [0u64; 7];
                for (i, v) in f.iter_mut().enumerate() {
                    *v = u64::from_le_bytes(r[i * 8..i * 8 + 8].try_into().unwrap_or_default());
                }
                let mut d = [0u8; 32];
                d.copy_from_slice(&r[56..]);
                (FileIdentity::from_fields(f), Digest(d))
            })
            .collect(),
    )
}

/// Loads the directory's digests into `cache`; returns how many.
pub fn load(dir: &Path, cache: &DigestCache) -> usize {
    let path = dir.join(NAME);
    let bytes = match super::files::read_regular(&path, MAX_BYTES) {
        // A new directory has none yet: nothing to say.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return 0,
        bytes => bytes,
    };
    match bytes.ok().as_deref().and_then(decode) {
        Some(records) => {
            let n = records.len();
            for (id, d) in records {
                cache.insert(id, d);
            }
            n
        }
        None => {
            tracing::warn!(file = %path.display(), "cache: the digest file does not check out; ignored");
            0
        }
    }
}

/// Writes `cache`'s digests into the directory.
pub fn save(dir: &Path, cache: &DigestCache) -> std::io::Result<()> {
    super::files::replace_file(dir, NAME, &encode(&cache.entries()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn records_round_trip_and_damage_is_ignored() {
        let cache = DigestCache::new(16);
        let id = FileIdentity::from_fields([1, 2, 3, u64::MAX, 5, 6, 7]);
        cache.insert(id.clone(), Digest([9; 32]));
        let dir = tempfile::tempdir().unwrap();
        save(dir.path(), &cache).unwrap();
        let again = DigestCache::new(16);
        assert_eq!(load(dir.path(), &again), 1);
        assert_eq!(again.get(&id), Some(Digest([9; 32])));
        // One flipped bit: the whole file is ignored.
        let path = dir.path().join(NAME);
        let mut bytes = fs::read(&path).unwrap();
        bytes[MAGIC.len() + 3] ^= 1;
        fs::write(&path, &bytes).unwrap();
        assert_eq!(load(dir.path(), &DigestCache::new(16)), 0);
        fs::write(&path, b"short").unwrap();
        assert_eq!(load(dir.path(), &DigestCache::new(16)), 0);
    }
}
