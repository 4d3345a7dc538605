//! The store: key index, single flight ([`flight`]), leases, the byte budget and counters.
//!
//! Plain synchronous logic behind one mutex; the async layers translate requests into calls
//! here and never hold the lock across an await. A pack job that fails leaves nothing in the
//! index. Leases belong to client connections and end on release or disconnect, never by a
//! timer. Eviction never pulls memory from under a reader: an evicted segment that is still
//! leased leaves the index but lives on as a *zombie* until its last lease ends.
#![forbid(unsafe_code)]

mod budget;
mod flight;
mod lease;
mod lend;
mod listing;
mod publish;
mod quota;
mod refusal;
mod reports;
mod segment;
mod signal;
mod spare;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Instant, SystemTime};

use crate::key::{EntryKey, FlightKey, Key, SegmentKey};
use crate::source::Digest;
pub use budget::{BudgetChange, BudgetRefused, EvictError, EvictReport, Reservation, Selector};
pub use flight::{Finished, Flight, FlightAbort, FlightResult, JobError, Leader, Lookup, NewSource};
pub use lease::{Peer, ReleaseError};
pub use lend::{Dropped, Held, Inode, LendRefused, LendStats, Lends, Lent, MAX_LENDS_PER_UID, inode_of, lend_bound};
pub use listing::{ClientInfo, EntryInfo, Stats};
pub use publish::{
    Acquired, BuildOutlook, BuildPhase, BuildWait, BuildsRefused, PublishRefused, PublishTicket, Publisher,
    build_outlook, published_entry, published_key, published_plan, published_source,
};
pub use quota::Quotas;
pub use refusal::{BudgetError, QuotaError};
pub use reports::{
    FALLBACKS, Kept, ModelInfo, REPORT_DETAIL_BYTES, REPORT_NAME_BYTES, Report, ReportCounters, Sharing, fallback_name,
};
pub use segment::{LABEL_BYTES, Segment, SegmentId, label, untrusted_text};
pub use spare::SpareClaim;

/// What happened to the index, for persistence (the fd store and the cache directory).
pub enum StoreEvent {
    /// A segment entered the index.
    Indexed {
        /// The segment, unless it is gone by the time the event is handled: a queued
        /// event never keeps an evicted segment's memory (a slow cache directory would
        /// otherwise hold every segment packed while it writes, past the budget).
        seg: std::sync::Weak<Segment>,
        /// Its key (to take it out of the fd store if it is gone).
        key: SegmentKey,
        /// It came from systemd's fd store (it is stored there already).
        in_fd_store: bool,
        /// It came from the cache directory (its file exists).
        in_cache: bool,
    },
    /// The segment with this key left the index (evicted; it may live on as a zombie).
    Unindexed(SegmentKey),
    /// A file's digest was computed for a digest request (the digest file is out of date).
    DigestLearned,
}

/// A segment's contents for [`Store::adopt`]: what a persisted record describes.
#[derive(Debug)]
pub struct Adopted {
    /// The sealed memfd.
    pub file: std::fs::File,
    /// Segment key.
    pub key: SegmentKey,
    /// Size in bytes.
    pub size: u64,
    /// Source digest.
    pub source: Digest,
    /// Canonical plan.
    pub plan: String,
    /// Entries.
    pub entries: Vec<crate::pack::PackedEntry>,
    /// Who published it (`None`: packd packed it).
    pub publisher: Option<Publisher>,
    /// Display label (see [`label`]); empty when none.
    pub label: String,
}

/// Where an earlier run of the daemon left a segment adopted at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeptIn {
    /// In the cache directory.
    CacheDir,
    /// In the service manager's fd store.
    FdStore,
}

#[derive(Default, Clone, Copy)]
struct Counters {
    pack_jobs: u64,
    pack_failures: u64,
    pack_seconds: f64,
    hits: u64,
    misses: u64,
    request_errors: u64,
    evictions: u64,
    builds: u64,
    build_waits: u64,
    builds_abandoned: u64,
    builds_given_up: u64,
    build_waits_slow: u64,
    builds_expired: u64,
    builds_refused: u64,
    publishes: u64,
    publishes_refused: u64,
    publishes_withdrawn: u64,
    aliases_filed: u64,
    duplicates_dropped: u64,
}

/// Connection id assigned by [`Store::connect`].
pub type ClientId = u64;

/// A segment in the index with its bookkeeping.
struct Resident {
    seg: Arc<Segment>,
    pinned: bool,
    hits: u64,
    /// Logical clock of the last access (LRU order).
    last_tick: u64,
    last_access: SystemTime,
    packed_at: SystemTime,
    pack_ms: f64,
    /// The uid whose request packed it (its `charged` bytes count against that uid's quota).
    owner: Option<u32>,
}

struct Inner {
    next_client: ClientId,
    tick: u64,
    segments: HashMap<SegmentId, Resident>,
    /// Evicted while leased: alive until the last lease ends.
    zombies: HashMap<SegmentId, Arc<Segment>>,
    /// Segments that left the store under the lock, to be freed when it is released
    /// ([`Locked`]): freeing a table of 300 000 entries must not hold up everyone else.
    graveyard: Vec<Arc<Segment>>,
    by_key: HashMap<SegmentKey, SegmentId>,
    /// Resident segments by source digest (hex), oldest first: an entry key names its source,
    /// so a lookup by entry key asks only those segments ([`Segment::entry`]).
    by_source: HashMap<String, Vec<SegmentId>>,
    flights: HashMap<FlightKey, Flight>,
    /// Published segments by cache identity, oldest first (several namespaces may publish
    /// one identity).
    by_identity: HashMap<String, Vec<SegmentId>>,
    /// The aliases filed to each published segment (also in `by_identity`), for as long as
    /// it is indexed ([`Store::alias`]).
    aliases: HashMap<SegmentId, Vec<String>>,
    /// Builder roles by published segment key ([`published_key`]).
    builds: publish::Builds,
    next_build: u64,
    clients: HashMap<ClientId, lease::ClientState>,
    refcounts: HashMap<SegmentId, u64>,
    /// Connections holding at least one lease on each segment (what sharing saves is
    /// read from it at every scrape: kept with the leases, not counted then).
    holders: HashMap<SegmentId, u64>,
    budget: u64,
    /// Bytes reserved by pack jobs, publications and lends (`lent`).
    reserved: u64,
    /// The room lends hold in `reserved`, and which of them can be taken back.
    lent: budget::LentRoom,
    /// Segments the index holds at most (`limits.max_segments`): each holds an open fd.
    max_segments: usize,
    /// Segments that running pack jobs and publications reserved a place for.
    reserved_segments: usize,
    /// The spare memfd ([`spare`]), counted against the budget.
    spare: spare::SpareSlot,
    counters: Counters,
    reports: ReportCounters,
    events: Option<std::sync::mpsc::Sender<StoreEvent>>,
    quotas: Quotas,
    usage: quota::Usage,
}

impl Inner {
    fn resident_bytes(&self) -> u64 {
        self.segments.values().map(|r| r.seg.charged).sum()
    }

    fn emit(&self, event: StoreEvent) {
        if let Some(tx) = &self.events {
            let _ = tx.send(event);
        }
    }

    /// Tells persistence that `seg`, new (packed, or published and hashed), is in the index.
    fn emit_new(&self, seg: &Arc<Segment>) {
        self.emit(StoreEvent::Indexed {
            seg: Arc::downgrade(seg),
            key: seg.key.clone(),
            in_fd_store: false,
            in_cache: false,
        });
    }

    /// Enters a sealed segment, built by [`Store::build`], into the index.
    fn insert(&mut self, seg: Arc<Segment>, pack_ms: f64, owner: Option<u32>) {
        let id = seg.id;
        self.tick += 1;
        self.by_source.entry(seg.source.hex()).or_default().push(id);
        self.by_key.insert(seg.key.clone(), id);
        if let Some(p) = &seg.publisher {
            self.by_identity.entry(p.identity.clone()).or_default().push(id);
        }
        let now = SystemTime::now();
        let resident = Resident {
            seg: Arc::clone(&seg),
            pinned: false,
            hits: 0,
            last_tick: self.tick,
            last_access: now,
            packed_at: now,
            pack_ms,
            owner,
        };
        if let Some(uid) = owner {
            self.usage.add_packed(uid, seg.charged);
        }
        self.segments.insert(id, resident);
    }

    /// Whether a persisted segment `key` charged `charged` bytes may enter the index: not
    /// there yet, and it fits beside everything resident and reserved without evicting.
    fn admits(&self, key: &SegmentKey, charged: u64) -> bool {
        !self.by_key.contains_key(key)
            && self.resident_bytes() + self.reserved + self.spare.bytes() + charged <= self.budget
            && self.segments.len() + self.reserved_segments < self.max_segments
    }

    /// The resident segment holding the entry `key` (the newest, if several do).
    fn find_entry(&self, key: &EntryKey) -> Option<SegmentId> {
        let ids = self.by_source.get(key.source_hex())?;
        ids.iter().rev().copied().find(|id| self.segments.get(id).is_some_and(|r| r.seg.entry(key).is_some()))
    }

    /// The resident segment whose segment key or entry key is `key`.
    fn find(&self, key: &Key) -> Option<SegmentId> {
        match key {
            Key::Segment(k) => self.by_key.get(k).copied(),
            Key::Entry(k) => self.find_entry(k),
        }
    }

    fn touch(&mut self, id: SegmentId) -> Option<Arc<Segment>> {
        self.tick += 1;
        let tick = self.tick;
        let r = self.segments.get_mut(&id)?;
        r.hits += 1;
        r.last_tick = tick;
        r.last_access = SystemTime::now();
        Some(Arc::clone(&r.seg))
    }

    /// Removes a segment from the index; keeps it as a zombie if leased.
    fn unindex(&mut self, id: SegmentId) -> Option<Arc<Segment>> {
        let r = self.segments.remove(&id)?;
        if let Some(uid) = r.owner {
            self.usage.sub_packed(uid, r.seg.charged);
        }
        self.by_key.remove(&r.seg.key);
        let aliases = self.aliases.remove(&id).unwrap_or_default();
        for name in r.seg.publisher.iter().map(|p| &p.identity).chain(&aliases) {
            if let Some(ids) = self.by_identity.get_mut(name) {
                ids.retain(|&i| i != id);
                if ids.is_empty() {
                    self.by_identity.remove(name);
                }
            }
        }
        let source = r.seg.source.hex();
        if let Some(ids) = self.by_source.get_mut(&source) {
            ids.retain(|&i| i != id);
            if ids.is_empty() {
                self.by_source.remove(&source);
            }
        }
        if self.refcounts.get(&id).copied().unwrap_or(0) > 0 {
            self.zombies.insert(id, Arc::clone(&r.seg));
        }
        self.counters.evictions += 1;
        self.emit(StoreEvent::Unindexed(r.seg.key.clone()));
        self.graveyard.push(Arc::clone(&r.seg));
        Some(r.seg)
    }
}

/// What a segment made of `a` counts against the budget ([`crate::pack::charged_bytes`]).
fn charge(a: &Adopted) -> u64 {
    crate::pack::charged_bytes(a.size, &a.entries, crate::sys::proc::page_size())
}

/// The store's lock, held. Segments the store let go of while it was held and whose
/// tables are large are freed on a thread of their own when it is released, so that
/// neither the lock nor a runtime thread waits on freeing 300 000 entries; small ones (a
/// handful of entries and an fd) are freed right here.
struct Locked<'a>(MutexGuard<'a, Inner>);

/// Entries in the segments let go of at once above which they are freed on a thread of
/// their own.
const FREE_ASIDE_ENTRIES: usize = 16 * 1024;

impl std::ops::Deref for Locked<'_> {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Inner {
        &mut self.0
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        if let Some(spare) = self.0.spare.take_dropped() {
            // Unmapping and freeing up to a few hundred MiB: on a thread of its own (or
            // here, if none can be started).
            let _ = std::thread::Builder::new().name("packd-free".into()).spawn(move || drop(spare));
        }
        if self.0.graveyard.is_empty() {
            return;
        }
        let dead = std::mem::take(&mut self.0.graveyard);
        if dead.iter().map(|s| s.entries.len()).sum::<usize>() > FREE_ASIDE_ENTRIES {
            // If no thread can be started, the closure (and the segments) drop here.
            let _ = std::thread::Builder::new().name("packd-free".into()).spawn(move || drop(dead));
        }
    }
}

/// The store.
pub struct Store {
    inner: Mutex<Inner>,
    generation: u64,
    next_segment: AtomicU64,
    started: Instant,
    /// Told when a builder role with the earliest deadline is taken.
    builds_changed: tokio::sync::Notify,
    /// Told when a publication served before it was hashed is hashed or withdrawn.
    hashes_done: tokio::sync::Notify,
}

impl Store {
    /// A new, empty store holding at most `budget` bytes of segments.
    /// `generation` distinguishes this daemon instance on the wire.
    pub fn new(generation: u64, budget: u64) -> Arc<Self> {
        Arc::new(Self {
            inner: Mutex::new(Inner {
                next_client: 1,
                tick: 0,
                segments: HashMap::new(),
                zombies: HashMap::new(),
                graveyard: Vec::new(),
                by_key: HashMap::new(),
                by_source: HashMap::new(),
                flights: HashMap::new(),
                by_identity: HashMap::new(),
                aliases: HashMap::new(),
                builds: publish::Builds::default(),
                next_build: 1,
                clients: HashMap::new(),
                refcounts: HashMap::new(),
                holders: HashMap::new(),
                budget,
                reserved: 0,
                lent: budget::LentRoom::default(),
                max_segments: usize::MAX,
                reserved_segments: 0,
                spare: spare::SpareSlot::default(),
                counters: Counters::default(),
                events: None,
                quotas: Quotas::default(),
                reports: ReportCounters::default(),
                usage: quota::Usage::default(),
            }),
            generation,
            next_segment: AtomicU64::new(1),
            started: Instant::now(),
            builds_changed: tokio::sync::Notify::new(),
            hashes_done: tokio::sync::Notify::new(),
        })
    }

    /// This instance's generation.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    fn lock(&self) -> Locked<'_> {
        // A panic while holding the lock leaves plain data behind; keep serving.
        Locked(self.inner.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Finds a segment by segment key or entry key, or the pack job producing it. A segment
    /// the requester may not see (`visible` says no: another uid's publication) is not
    /// found, and neither its hits nor its place in the eviction order change.
    pub fn get(&self, key: &Key, visible: impl Fn(&Segment) -> bool) -> Option<Lookup> {
        let mut inner = self.lock();
        let id = inner.find(key);
        if let Some(id) = id
            && inner.segments.get(&id).is_some_and(|r| !visible(&r.seg))
        {
            return None;
        }
        if let Some(seg) = id.and_then(|id| inner.touch(id)) {
            inner.counters.hits += 1;
            return Some(Lookup::Ready(seg));
        }
        let Key::Segment(key) = key else { return None };
        let flight = inner.flights.get(&FlightKey::Segment(key.clone())).cloned()?;
        inner.counters.hits += 1;
        Some(Lookup::Wait(flight))
    }

    /// A segment ready to enter the index: id assigned, budget charge, entry lookup table and
    /// reply encodings built. Runs without the lock (the caller is off the runtime).
    fn build(&self, a: Adopted, charged: u64) -> Arc<Segment> {
        self.build_as(a, charged, false)
    }

    /// [`Store::build`] of a segment whose entries' digests are still unknown (`pending`).
    fn build_as(&self, a: Adopted, charged: u64, pending: bool) -> Arc<Segment> {
        let id = self.next_segment.fetch_add(1, Ordering::Relaxed);
        Arc::new(Segment::build_as(id, self.generation, a, charged, pending))
    }

    /// Sends index changes to `events` from now on (`None` stops them).
    pub fn set_events(&self, events: Option<std::sync::mpsc::Sender<StoreEvent>>) {
        self.lock().events = events;
    }

    /// Enters a persisted segment (from the fd store or the cache directory) into the
    /// index, if it fits in the budget without evicting anything. Returns `None` when it
    /// does not fit or its key is already in the index.
    pub fn adopt(self: &Arc<Self>, a: Adopted, in_fd_store: bool, in_cache: bool) -> Option<Arc<Segment>> {
        let room = self.reserve_adoption(&a)?;
        self.adopt_reserved(a, room, in_fd_store, in_cache)
    }

    /// Sets aside room for the persisted segment `a` (its memfd still empty) before its
    /// bytes are read, if it fits in the budget and among `max_segments` without evicting
    /// anything, counting the room of adoptions still in progress: files adopted on several
    /// threads at once never take memory beyond the budget together. `None` when it does
    /// not fit or its key is in the index.
    pub fn reserve_adoption(self: &Arc<Self>, a: &Adopted) -> Option<Reservation> {
        let charged = charge(a);
        let mut inner = self.lock();
        inner.spare_yields_to(charged);
        if !inner.admits(&a.key, charged) {
            return None;
        }
        inner.reserved += charged;
        inner.reserved_segments += 1;
        Some(Reservation::new(Arc::clone(self), charged, None))
    }

    /// [`Store::adopt`] for a segment whose room `reservation` ([`Store::reserve_adoption`])
    /// holds: the reservation becomes the segment's resident bytes under the same lock.
    pub fn adopt_reserved(
        &self,
        a: Adopted,
        reservation: Reservation,
        in_fd_store: bool,
        in_cache: bool,
    ) -> Option<Arc<Segment>> {
        let charged = charge(&a);
        let id = self.next_segment.fetch_add(1, Ordering::Relaxed);
        let mut seg = Segment::build_as(id, self.generation, a, charged, false);
        seg.kept = Some(if in_cache { KeptIn::CacheDir } else { KeptIn::FdStore });
        let seg = Arc::new(seg);
        let mut inner = self.lock();
        reservation.settle(&mut inner);
        if !inner.admits(&seg.key, charged) {
            return None;
        }
        inner.insert(Arc::clone(&seg), 0.0, None);
        inner.emit(StoreEvent::Indexed { seg: Arc::downgrade(&seg), key: seg.key.clone(), in_fd_store, in_cache });
        Some(seg)
    }

    /// Keys of the segments in the index.
    pub fn keys(&self) -> Vec<SegmentKey> {
        self.lock().by_key.keys().cloned().collect()
    }

    /// Whether the segment `key` is in the index or being packed.
    pub fn known(&self, key: &SegmentKey) -> bool {
        let inner = self.lock();
        inner.by_key.contains_key(key) || inner.flights.contains_key(&FlightKey::Segment(key.clone()))
    }

    /// Source digests of the segments packed with `plan` (canonical), published ones aside.
    pub fn sources_with_plan(&self, plan: &str) -> Vec<Digest> {
        let inner = self.lock();
        inner
            .segments
            .values()
            .filter(|r| r.seg.publisher.is_none() && r.seg.plan == plan)
            .map(|r| r.seg.source)
            .collect()
    }

    /// Whether the index holds the segment `key`.
    pub fn contains(&self, key: &SegmentKey) -> bool {
        self.lock().by_key.contains_key(key)
    }

    /// Pack jobs running now.
    pub fn flights_in_progress(&self) -> usize {
        self.lock().flights.len()
    }

    /// Counts a pack request refused before its job started (bad source or plan, over the
    /// budget): it counts as a failed pack.
    pub fn count_pack_failure(&self) {
        self.lock().counters.pack_failures += 1;
    }

    /// Counts a request that was answered with an error.
    pub fn count_error(&self) {
        self.lock().counters.request_errors += 1;
    }

    /// Tells persistence that a digest request taught the digest cache a file's digest.
    pub fn digest_learned(&self) {
        self.lock().emit(StoreEvent::DigestLearned);
    }
}

#[cfg(test)]
mod tests;
