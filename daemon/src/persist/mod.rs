//! Persistence: segments outlive the daemon through systemd's fd store (restarts,
//! upgrades, crashes: the very memfds come back, no copy) and through the cache directory
//! (reboots: files are checked and copied into new sealed memfds).
//!
//! At start, before READY=1, stored fds and cache files are adopted into the index. Then a
//! dedicated thread follows the index's changes: each new segment is handed to the fd
//! store and written to the cache directory; each evicted one is removed from both. The
//! runtime threads never wait for it. Nothing here can make the daemon serve bytes that
//! differ from what a pack job produced: every adopted segment is checked first.
#![forbid(unsafe_code)]

pub mod cache;
pub mod digests;
mod error;
pub mod fdstore;
mod files;
pub mod kernels;
pub mod lock;
pub mod record;

pub use error::PersistError;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use packd_proto::v1::StoredSegment;

use crate::key::SegmentKey;
use crate::service::Packer;
use crate::store::StoreEvent;
use crate::sys::notify::{self, ListenFd, Notifier};
use files::create_private_dir;

/// How long shutdown waits for the persistence thread to finish a cache write.
const FINISH_TIMEOUT: Duration = Duration::from_secs(10);
/// How long start-up may take per extension systemd grants (`EXTEND_TIMEOUT_USEC=`).
const EXTEND: Duration = Duration::from_secs(30);

/// Handle on the persistence thread.
pub struct Persist {
    packer: Arc<Packer>,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
    fd_store: bool,
    cache_max: Arc<AtomicU64>,
    cache_dir: String,
}

impl Persist {
    /// The cache directory in use, as the start line says it: `off (memory only)`, its
    /// path, or its path and why it is read-only or unused.
    pub fn cache_dir_note(&self) -> &str {
        &self.cache_dir
    }

    /// Whether segments go to the fd store.
    pub fn fd_store_enabled(&self) -> bool {
        self.fd_store
    }

    /// Changes the cache directory's size cap (applied within a second).
    pub fn set_cache_max_bytes(&self, bytes: u64) {
        self.cache_max.store(bytes, Ordering::Relaxed);
    }

    /// Stops following the index and waits (bounded) for the last writes and manifest.
    pub async fn finish(&self) {
        self.packer.store.set_events(None);
        let handle = self.worker.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(handle) = handle {
            let join = tokio::task::spawn_blocking(move || handle.join());
            if tokio::time::timeout(FINISH_TIMEOUT, join).await.is_err() {
                tracing::warn!(
                    "persistence did not finish within {FINISH_TIMEOUT:?}; an interrupted cache write is discarded at the next start"
                );
            }
        }
    }
}

/// Opens (creating it, mode 0700) the cache directory; `None` when it cannot be used at
/// all, `Some((dir, false))` when it can only be read.
fn prepare_cache_dir(dir: PathBuf) -> Option<(PathBuf, bool)> {
    if !dir.is_dir()
        && let Err(e) = create_private_dir(&dir)
    {
        tracing::warn!(dir = %dir.display(), error = %e, "cache: cannot create the directory; memory only");
        return None;
    }
    let writable = nix::unistd::access(&dir, nix::unistd::AccessFlags::W_OK).is_ok();
    if !writable {
        tracing::warn!(dir = %dir.display(), "cache: the directory is read-only; its files are served, new segments live in memory only");
    }
    Some((dir, writable))
}

/// Why persistence could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The blocking task adopting the fd store and the cache directory failed.
    #[error("adopting persisted segments failed: {0}")]
    Adopt(tokio::task::JoinError),
    /// The thread that follows the index could not be started.
    #[error("cannot start the persistence thread: {0}")]
    Thread(std::io::Error),
}

/// What persistence is told of the configuration.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Whether to keep segments in systemd's fd store (when systemd offers one).
    pub fd_store: bool,
    /// The cache directory, if any.
    pub cache_dir: Option<PathBuf>,
    /// Bytes of cache files kept at most.
    pub cache_max_bytes: u64,
}

/// Adopts the fd store's fds and the cache directory's files (blocking work, off the
/// runtime), then starts following the index.
pub async fn start(
    packer: &Arc<Packer>,
    settings: Settings,
    stored: Vec<ListenFd>,
    notifier: &Arc<Notifier>,
) -> Result<Persist, StartError> {
    let fd_store = settings.fd_store && notifier.enabled();
    let configured = settings.cache_dir.clone();
    let cache = settings.cache_dir.and_then(prepare_cache_dir);
    let cache_dir = match (&configured, &cache) {
        (None, _) => "off (memory only)".to_string(),
        (Some(dir), None) => format!("{} (unusable: memory only)", dir.display()),
        (Some(_), Some((dir, false))) => format!("{} (read-only: new segments memory only)", dir.display()),
        (Some(_), Some((dir, true))) => dir.display().to_string(),
    };
    let (tx, rx) = mpsc::channel();
    packer.store.set_events(Some(tx));
    let (d, n, c) = (Arc::clone(packer), Arc::clone(notifier), cache.clone());
    let started = Instant::now();
    let (fds, load) = tokio::task::spawn_blocking(move || {
        if let Some((dir, _)) = &c {
            let n = digests::load(dir, &d.digests);
            tracing::debug!(digests = n, "cache: source digests recalled");
        }
        let fds = fdstore::adopt(&d, stored, &n);
        let mut extended: Option<Instant> = None;
        let load = c.map(|(dir, writable)| {
            cache::load(&d, &dir, writable, |bytes| {
                if extended.is_none_or(|t| t.elapsed() > EXTEND / 6) {
                    // Reading and checking runs well above 100 MB/s; allow that, at least EXTEND.
                    let usec = EXTEND.as_micros().max(u128::from(bytes / 100));
                    let _ = n.send(&format!("EXTEND_TIMEOUT_USEC={usec}"));
                    extended = Some(Instant::now());
                }
            })
        });
        (fds, load)
    })
    .await
    .map_err(StartError::Adopt)?;
    let load = load.unwrap_or_default();
    tracing::info!(
        ms = crate::telemetry::log_ms(started.elapsed()),
        fd_store_adopted = fds.adopted,
        fd_store_bytes = fds.bytes,
        fd_store_refused = fds.refused,
        cache_adopted = load.adopted,
        cache_bytes = load.bytes,
        cache_discarded = load.discarded,
        cache_deferred = load.deferred,
        "warm state adopted"
    );
    packer.telemetry.restored("fd_store", fds.adopted as u64);
    packer.telemetry.restored("cache_dir", load.adopted as u64);

    let cache_max = Arc::new(AtomicU64::new(settings.cache_max_bytes));
    let mut worker = Worker {
        notifier: Arc::clone(notifier),
        fd_store,
        store_slots: fd_store_slots(),
        warned_full: false,
        records: BTreeMap::new(),
        manifest_seq: fds.manifest_seq,
        dirty: fd_store,
        digests: cache.as_ref().filter(|(_, writable)| *writable).map(|(dir, _)| (dir.clone(), Arc::clone(packer))),
        digests_dirty: false,
        cache: cache.map(|(dir, writable)| CacheFiles::new(dir, writable, Arc::clone(&cache_max), load.kept)),
    };
    let handle = std::thread::Builder::new()
        .name("packd-persist".into())
        .spawn(move || worker.run(&rx))
        .map_err(StartError::Thread)?;
    Ok(Persist { packer: Arc::clone(packer), worker: Mutex::new(Some(handle)), fd_store, cache_max, cache_dir })
}

/// How many segments systemd's fd store can take: `$FDSTORE` (its
/// `FileDescriptorStoreMax=`, told by systemd >= 254) minus two for the manifests.
fn fd_store_slots() -> Option<usize> {
    crate::sys::notify::fd_store_max().map(|max| max.saturating_sub(2))
}

/// The cache directory's files, least recently written first.
struct CacheFiles {
    dir: PathBuf,
    /// The directory could be written at start: files may be written and removed.
    writable: bool,
    /// The last write was refused (the directory turned read-only, or its permissions
    /// changed): said once; each new segment still tries (a failed open costs nothing),
    /// and evicted segments' files are still removed.
    refused: bool,
    max: Arc<AtomicU64>,
    order: BTreeMap<u64, (SegmentKey, u64)>,
    by_key: HashMap<SegmentKey, u64>,
    next: u64,
    total: u64,
}

impl CacheFiles {
    fn new(dir: PathBuf, writable: bool, max: Arc<AtomicU64>, kept: Vec<cache::Kept>) -> Self {
        let mut c = Self {
            dir,
            writable,
            refused: false,
            max,
            order: BTreeMap::new(),
            by_key: HashMap::new(),
            next: 0,
            total: 0,
        };
        for k in kept {
            c.add(k.key, k.bytes);
        }
        c
    }

    fn add(&mut self, key: SegmentKey, bytes: u64) {
        self.next += 1;
        self.order.insert(self.next, (key.clone(), bytes));
        self.by_key.insert(key, self.next);
        self.total += bytes;
    }

    fn remove(&mut self, key: &SegmentKey) {
        if let Some(seq) = self.by_key.remove(key) {
            if let Some((_, bytes)) = self.order.remove(&seq) {
                self.total -= bytes;
            }
            if self.writable
                && let Err(e) = std::fs::remove_file(cache::path(&self.dir, key))
            {
                tracing::warn!(key = %key, error = %e, "cache: cannot remove a file");
            }
        }
    }

    fn write(&mut self, seg: &crate::store::Segment) {
        if !self.writable || self.by_key.contains_key(&seg.key) {
            return;
        }
        if seg.size > self.max.load(Ordering::Relaxed) {
            tracing::info!(key = %seg.key, bytes = seg.size, "cache: segment larger than cache_max_bytes; memory only");
            return;
        }
        let started = Instant::now();
        match cache::write(&self.dir, seg) {
            Ok(()) => {
                if std::mem::take(&mut self.refused) {
                    tracing::info!(dir = %self.dir.display(), "cache: the directory takes files again");
                }
                tracing::debug!(key = %seg.key, ms = crate::telemetry::log_ms(started.elapsed()), "cache: written");
                let bytes = std::fs::metadata(cache::path(&self.dir, &seg.key)).map_or(seg.size, |m| m.len());
                self.add(seg.key.clone(), bytes);
                self.trim();
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ReadOnlyFilesystem | std::io::ErrorKind::PermissionDenied
                ) =>
            {
                if !std::mem::replace(&mut self.refused, true) {
                    tracing::warn!(
                        dir = %self.dir.display(),
                        error = %e,
                        "cache: directory not writable; new segments are memory only until it takes files again"
                    );
                }
            }
            Err(e) => {
                tracing::warn!(key = %seg.key, error = %e, "cache: write failed (disk full?); the segment is served from memory only");
            }
        }
    }

    /// Removes the least recently written files until the cap holds.
    fn trim(&mut self) {
        let max = self.max.load(Ordering::Relaxed);
        while self.total > max && self.writable {
            let Some((_, (key, _))) = self.order.first_key_value().map(|(s, v)| (*s, v.clone())) else { break };
            tracing::info!(key = %key, total = self.total, max, "cache: over cache_max_bytes; oldest file removed");
            self.remove(&key);
        }
    }
}

/// The persistence thread's state.
struct Worker {
    notifier: Arc<Notifier>,
    fd_store: bool,
    /// Segments the fd store can take (`$FDSTORE` minus the manifest and its successor),
    /// when systemd says.
    store_slots: Option<usize>,
    warned_full: bool,
    /// What the next manifest records, by segment key.
    records: BTreeMap<SegmentKey, StoredSegment>,
    manifest_seq: u64,
    dirty: bool,
    /// The cache directory and the daemon whose digest cache is kept there.
    digests: Option<(PathBuf, Arc<Packer>)>,
    /// A segment was packed since the digests were last written.
    digests_dirty: bool,
    cache: Option<CacheFiles>,
}

/// How long the persistence worker waits for the next index change before it writes a
/// pending manifest: changes within it share one manifest (a burst of packs writes one).
const MANIFEST_EVERY: Duration = Duration::from_secs(1);

impl Worker {
    fn run(&mut self, rx: &Receiver<StoreEvent>) {
        loop {
            let first = match rx.recv_timeout(MANIFEST_EVERY) {
                Ok(ev) => Some(ev),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => {
                    self.flush();
                    return;
                }
            };
            for ev in first.into_iter().chain(std::iter::from_fn(|| rx.try_recv().ok())) {
                self.handle(ev);
            }
            if let Some(c) = &mut self.cache {
                c.trim();
            }
            self.flush();
        }
    }

    fn handle(&mut self, ev: StoreEvent) {
        match ev {
            StoreEvent::Indexed { seg, key, in_fd_store, in_cache } => {
                // Evicted (and not held) before its turn came: nothing to keep; its
                // Unindexed event follows. One adopted from the fd store leaves it now
                // (it has no record for that event to find).
                let Some(seg) = seg.upgrade() else {
                    if in_fd_store {
                        fdstore::remove(&self.notifier, &record::stored_name(&key));
                    }
                    return;
                };
                // Packed now (not adopted): its source's digest is new to the digest file.
                self.digests_dirty |= !in_fd_store && !in_cache && seg.publisher.is_none();
                let name = record::stored_name(&seg.key);
                let full = self.store_slots.is_some_and(|slots| self.records.len() >= slots);
                if self.fd_store && full {
                    if !self.warned_full {
                        tracing::warn!(
                            slots = self.store_slots,
                            "fd store: full ($FDSTORE, FileDescriptorStoreMax= minus 2 for the manifest); further segments \
                             survive restarts only through the cache directory"
                        );
                        self.warned_full = true;
                    }
                    if in_fd_store {
                        fdstore::remove(&self.notifier, &name);
                    }
                } else if self.fd_store {
                    if !in_fd_store && let Err(e) = fdstore::store(&self.notifier, &name, &seg.file) {
                        tracing::warn!(key = %seg.key, error = %e, "fd store: cannot store a segment");
                    }
                    match notify::identify(std::os::fd::AsFd::as_fd(&seg.file)) {
                        Ok(id) => {
                            let segment = Some(record::record(&seg));
                            let rec = StoredSegment { fd_name: name, dev: id.dev, ino: id.ino, segment };
                            self.records.insert(seg.key.clone(), rec);
                            self.dirty = true;
                        }
                        Err(e) => tracing::warn!(key = %seg.key, error = %e, "fd store: cannot identify a segment"),
                    }
                } else if in_fd_store {
                    fdstore::remove(&self.notifier, &name);
                }
                if let (Some(c), false) = (&mut self.cache, in_cache) {
                    c.write(&seg);
                }
            }
            StoreEvent::DigestLearned => self.digests_dirty = true,
            StoreEvent::Unindexed(key) => {
                if self.fd_store && self.records.remove(&key).is_some() {
                    fdstore::remove(&self.notifier, &record::stored_name(&key));
                    self.dirty = true;
                    self.warned_full = false;
                }
                if let Some(c) = &mut self.cache {
                    c.remove(&key);
                }
            }
        }
    }

    /// Stores a new manifest if the records changed, then removes the previous one (in that
    /// order: a crash in between leaves two, and the newer wins).
    fn flush(&mut self) {
        if self.digests_dirty
            && let Some((dir, packer)) = &self.digests
        {
            if let Err(e) = digests::save(dir, &packer.digests) {
                tracing::warn!(dir = %dir.display(), error = %e, "cache: cannot write the source digests");
            }
            self.digests_dirty = false;
        }
        if !self.fd_store || !self.dirty {
            return;
        }
        let seq = self.manifest_seq + 1;
        match fdstore::write_manifest(&self.notifier, seq, self.records.values().cloned().collect()) {
            Ok(()) => {
                if self.manifest_seq > 0 {
                    fdstore::remove(&self.notifier, &format!("{}{}", fdstore::MANIFEST_PREFIX, self.manifest_seq));
                }
                self.manifest_seq = seq;
                self.dirty = false;
            }
            Err(e) => tracing::warn!(error = %e, "fd store: cannot store the manifest"),
        }
    }
}
