//! Source digests and a cache of them keyed by file identity.
//!
//! Hashing a large model takes tens of milliseconds; a worker that sends the same file
//! again (same device, inode, size, mtime and ctime) gets its digest from the cache.
//! Any write changes mtime/ctime, and ctime cannot be set back by anyone. A cached digest
//! is only a lookup hint: a pack job always re-hashes exactly the bytes it packs and
//! fails if they do not match.

use std::collections::HashMap;
use std::fmt;
use std::fs::Metadata;
use std::os::unix::fs::MetadataExt;
use std::sync::Mutex;

/// BLAKE3 of a source file.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    /// Lowercase hex.
    pub fn hex(&self) -> String {
        blake3::Hash::from_bytes(self.0).to_hex().to_string()
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "b3:{}", self.hex())
    }
}

/// What identifies one version of a file without reading it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FileIdentity {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl FileIdentity {
    /// The identity of the file `meta` describes.
    pub fn of(meta: &Metadata) -> Self {
        Self {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        }
    }
}

/// A bounded map from file identity to digest.
pub struct DigestCache {
    map: Mutex<HashMap<FileIdentity, Digest>>,
    capacity: usize,
}

impl DigestCache {
    /// A cache holding at most `capacity` identities (it is cleared when full).
    pub fn new(capacity: usize) -> Self {
        Self { map: Mutex::new(HashMap::new()), capacity }
    }

    /// The digest recorded for `id`, if any.
    pub fn get(&self, id: &FileIdentity) -> Option<Digest> {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).get(id).copied()
    }

    /// Records `digest` for `id`.
    pub fn put(&self, id: FileIdentity, digest: Digest) {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() >= self.capacity {
            map.clear();
        }
        map.insert(id, digest);
    }
}
