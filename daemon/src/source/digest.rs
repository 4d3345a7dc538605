//! Source digests and a cache of them keyed by file identity.
//!
//! Hashing a large model takes tens of milliseconds; a worker that sends the same file
//! again (same device, inode, size, mtime and ctime) gets its digest from the cache, and
//! workers that send it at the same moment wait for one hash instead of each computing it.
//! Any write changes mtime/ctime, and ctime cannot be set back by anyone. A cached digest
//! is only a lookup hint: a pack job always re-hashes exactly the bytes it packs and
//! fails if they do not match.

use std::collections::HashMap;
use std::fmt;
use std::fs::Metadata;
use std::os::unix::fs::MetadataExt;
use std::sync::{Condvar, Mutex, MutexGuard};

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
    /// Its fields as numbers: device, inode, size, mtime (s, ns), ctime (s, ns).
    pub fn to_fields(&self) -> [u64; 7] {
        // Times are stored as their two's-complement bits: a round trip gives them back.
        let t = |v: i64| u64::from_le_bytes(v.to_le_bytes());
        [self.dev, self.ino, self.size, t(self.mtime.0), t(self.mtime.1), t(self.ctime.0), t(self.ctime.1)]
    }

    /// The identity whose fields [`FileIdentity::to_fields`] gave.
    pub fn from_fields(f: [u64; 7]) -> Self {
        let t = |v: u64| i64::from_le_bytes(v.to_le_bytes());
        Self { dev: f[0], ino: f[1], size: f[2], mtime: (t(f[3]), t(f[4])), ctime: (t(f[5]), t(f[6])) }
    }

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

enum Slot {
    /// Being hashed by one caller; the others wait.
    Pending,
    Done(Digest),
}

/// A bounded map from file identity to digest, with single flight for the hashing.
pub struct DigestCache {
    map: Mutex<HashMap<FileIdentity, Slot>>,
    ready: Condvar,
    capacity: usize,
    computed: std::sync::atomic::AtomicU64,
}

impl DigestCache {
    /// A cache holding at most `capacity` identities (finished ones are dropped when full).
    pub fn new(capacity: usize) -> Self {
        Self { map: Mutex::new(HashMap::new()), ready: Condvar::new(), capacity, computed: Default::default() }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<FileIdentity, Slot>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Digests computed (files hashed in full) since start.
    pub fn computed(&self) -> u64 {
        self.computed.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Every digest recorded (for persisting them).
    pub fn entries(&self) -> Vec<(FileIdentity, Digest)> {
        self.lock()
            .iter()
            .filter_map(|(id, slot)| match slot {
                Slot::Done(d) => Some((id.clone(), *d)),
                Slot::Pending => None,
            })
            .collect()
    }

    /// Records `digest` for `id` (a persisted record), unless the cache is full or `id` is
    /// known already.
    pub fn insert(&self, id: FileIdentity, digest: Digest) {
        let mut map = self.lock();
        if map.len() < self.capacity {
            map.entry(id).or_insert(Slot::Done(digest));
        }
    }

    /// Records `digest` for `id`, learned by a pack job that hashed the file as it packed
    /// it. When the cache is full, finished entries make room (as for a hash).
    pub fn learned(&self, id: &FileIdentity, digest: Digest) {
        let mut map = self.lock();
        if !map.contains_key(id) {
            self.make_room(&mut map);
        }
        if map.len() < self.capacity {
            map.insert(id.clone(), Slot::Done(digest));
        }
    }

    /// When the cache is full, drops every finished entry (those being hashed stay: their
    /// callers wait on them).
    fn make_room(&self, map: &mut HashMap<FileIdentity, Slot>) {
        if map.len() >= self.capacity {
            map.retain(|_, slot| matches!(slot, Slot::Pending));
        }
    }

    /// Digests recorded for files of `size` bytes: the candidates a file of that size may
    /// be a copy of.
    pub fn of_size(&self, size: u64) -> Vec<Digest> {
        self.lock()
            .iter()
            .filter_map(|(id, slot)| match slot {
                Slot::Done(d) if id.size == size => Some(*d),
                _ => None,
            })
            .collect()
    }

    /// Every digest recorded, once each.
    pub fn digests(&self) -> std::collections::HashSet<Digest> {
        self.lock()
            .values()
            .filter_map(|slot| match slot {
                Slot::Done(d) => Some(*d),
                Slot::Pending => None,
            })
            .collect()
    }

    /// Forgets the digest of `id` (its bytes turned out to differ: the file was changed
    /// without its identity changing), so the next request hashes it again.
    pub fn forget(&self, id: &FileIdentity) {
        let mut map = self.lock();
        if matches!(map.get(id), Some(Slot::Done(_))) {
            map.remove(id);
        }
    }

    /// The digest recorded for `id`, if any.
    pub fn get(&self, id: &FileIdentity) -> Option<Digest> {
        match self.lock().get(id) {
            Some(Slot::Done(d)) => Some(*d),
            _ => None,
        }
    }

    /// The digest of `id`: from the cache, from a caller hashing it right now (blocking until
    /// it is done), or from `compute`, whose success is recorded. Blocking: call it off the
    /// async threads.
    pub fn get_or_compute<E>(
        &self,
        id: &FileIdentity,
        compute: impl FnOnce() -> Result<Digest, E>,
    ) -> Result<Digest, E> {
        let mut map = self.lock();
        loop {
            match map.get(id) {
                Some(Slot::Done(d)) => return Ok(*d),
                Some(Slot::Pending) => map = self.ready.wait(map).unwrap_or_else(|p| p.into_inner()),
                None => break,
            }
        }
        self.make_room(&mut map);
        map.insert(id.clone(), Slot::Pending);
        drop(map);
        // Whatever happens (error or panic), the pending slot must not strand the waiters.
        struct Unpend<'a>(&'a DigestCache, &'a FileIdentity, Option<Digest>);
        impl Drop for Unpend<'_> {
            fn drop(&mut self) {
                let mut map = self.0.lock();
                match self.2 {
                    Some(d) => map.insert(self.1.clone(), Slot::Done(d)),
                    None => map.remove(self.1),
                };
                self.0.ready.notify_all();
            }
        }
        let mut guard = Unpend(self, id, None);
        self.computed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let digest = compute()?;
        guard.2 = Some(digest);
        Ok(digest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn identity(ino: u64) -> FileIdentity {
        FileIdentity { dev: 1, ino, size: 10, mtime: (0, 0), ctime: (0, 0) }
    }

    #[test]
    fn concurrent_callers_hash_once() {
        let cache = Arc::new(DigestCache::new(16));
        let computed = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (cache, computed) = (Arc::clone(&cache), Arc::clone(&computed));
                std::thread::spawn(move || {
                    cache.get_or_compute(&identity(1), || {
                        computed.fetch_add(1, Ordering::SeqCst);
                        std::thread::sleep(std::time::Duration::from_millis(50));
                        Ok::<_, ()>(Digest([9; 32]))
                    })
                })
            })
            .collect();
        for t in threads {
            assert_eq!(t.join().unwrap(), Ok(Digest([9; 32])));
        }
        assert_eq!(computed.load(Ordering::SeqCst), 1);
        assert_eq!(cache.get(&identity(1)), Some(Digest([9; 32])));
    }

    #[test]
    fn a_failed_hash_is_not_recorded_and_frees_waiters() {
        let cache = DigestCache::new(16);
        assert_eq!(cache.get_or_compute(&identity(2), || Err::<Digest, _>("short read")), Err("short read"));
        assert_eq!(cache.get(&identity(2)), None);
        assert_eq!(cache.get_or_compute(&identity(2), || Ok::<_, ()>(Digest([1; 32]))), Ok(Digest([1; 32])));
    }
}
