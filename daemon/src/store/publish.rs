//! Engine-published segments: namespaces, visibility, and single flight across processes.
//!
//! A client publishes a segment it built as the cache of a *cache identity* in its own
//! namespace (its uid). The segment's key derives from the namespace and the identity
//! ([`published_key`]), so a publication is found by whoever may see it without knowing
//! anything but the identity. Visibility is [`Publisher::trusted_by`]: the publisher's uid,
//! and everyone if `trusted_publishers` names the publisher.
//!
//! Single flight: an [`Store::acquire`] that finds nothing published and nobody building
//! makes its connection the *builder* for that namespace and identity, until a deadline.
//! Others of the namespace then wait on a [`BuildWait`]. The role ends with a publication
//! (waiters get the segment), the builder's connection closing (a waiter becomes the next
//! builder), the builder giving it up with nothing to publish, or the deadline (in both,
//! waiters build privately). A build is never visible: only a
//! sealed, checked, published segment enters the index.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::{Adopted, ClientId, Inner, QuotaError, Segment, Store};
use crate::access::Ids;
use crate::key::SegmentKey;
use crate::pack::{Layout, PackedEntry, entry_key};
use crate::source::{Digest, Dtype, Progress};

/// Who published a segment, and as the cache of which identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Publisher {
    /// The publisher's uid: its namespace.
    pub uid: u32,
    /// Its primary gid when it published.
    pub gid: u32,
    /// Its supplementary groups when it published.
    pub groups: Vec<u32>,
    /// The cache identity.
    pub identity: String,
}

impl Publisher {
    /// Whether a client with `uid` may use this publisher's segments: its own, or any
    /// publisher `trusted` names (by uid, primary gid or supplementary group).
    pub fn trusted_by(&self, uid: u32, trusted: &Ids) -> bool {
        self.uid == uid || self.trusted_by_everyone(trusted)
    }

    /// Whether `trusted` names this publisher, so that every uid may use its segments.
    pub fn trusted_by_everyone(&self, trusted: &Ids) -> bool {
        trusted.names(self.uid, self.gid, || &self.groups)
    }
}

/// The "source digest" of the segment published for `identity` in the namespace of `uid`:
/// a keyed BLAKE3 of both, so no file's digest can collide with it.
pub fn published_source(uid: u32, identity: &str) -> Digest {
    let mut h = blake3::Hasher::new_derive_key("packd published segment v1");
    h.update(&uid.to_le_bytes());
    h.update(identity.as_bytes());
    Digest(*h.finalize().as_bytes())
}

/// The "plan" of a published segment: its namespace and identity, spelled out.
pub fn published_plan(uid: u32, identity: &str) -> String {
    format!("publish:uid={uid};identity={identity}")
}

/// The segment key of the segment published for `identity` in the namespace of `uid`.
pub fn published_key(uid: u32, identity: &str) -> SegmentKey {
    SegmentKey::new(&published_source(uid, identity), &published_plan(uid, identity))
}

/// The index entry for an engine's entry `name` at `offset`, `length` bytes long, in the
/// segment whose source digest is `source`.
pub fn published_entry(source: &Digest, name: &str, offset: u64, length: u64, blake3: [u8; 32]) -> PackedEntry {
    PackedEntry {
        name: name.to_string(),
        key: entry_key(source, name, Layout::Engine),
        layout: Layout::Engine,
        dtype: Dtype::U8,
        shape: vec![length],
        offset,
        length,
        blake3,
        bias: None,
    }
}

/// Where a build stands, as its waiters see it.
#[derive(Clone)]
pub enum BuildPhase {
    /// The builder works.
    Building,
    /// Published: ask again to be served it.
    Published,
    /// The builder's connection closed first: ask again (one asker becomes the builder).
    Abandoned,
    /// The builder's deadline passed: build privately.
    Expired,
    /// The builder gave the role up with nothing to publish (its reason): build privately,
    /// at once.
    GaveUp(String),
}

/// A builder role.
pub(super) struct Build {
    client: ClientId,
    /// The cache identity being built (for the per-model figures).
    pub(super) identity: String,
    pub(super) uid: u32,
    token: u64,
    deadline: Instant,
    tx: watch::Sender<BuildPhase>,
    /// When the role was taken.
    started: Instant,
    /// Bytes the build writes in all (0: not known), as the builder said.
    total: u64,
    /// Bytes the builder said it has written.
    done: Arc<Progress>,
    /// The fastest the build went so far (bytes done / seconds since the role was taken, at
    /// a progress report), bytes per second.
    best_rate: f64,
}

/// Most engines whose build rate is remembered (they are named by their identities'
/// prefix, so a client could make up any number).
const MAX_RATES: usize = 64;

/// Where a waiter stands against the build it waits for: what is left of it, and what
/// building itself would take, in seconds (both estimates).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BuildOutlook {
    /// Seconds the build still needs.
    pub remaining: f64,
    /// Seconds a build of the same bytes takes at the rate this host's builds went.
    pub own: f64,
}

impl BuildOutlook {
    /// Whether waiting costs more than building: the build left takes a quarter longer,
    /// and 100 ms more, than a build of its own would (the margin keeps a waiter from
    /// leaving a builder that is merely noisy).
    pub fn slower_than_building(&self) -> bool {
        self.remaining > self.own * 1.25 + 0.1
    }
}

/// The outlook of a build of `total` bytes that has `done` of them after `elapsed`
/// seconds, when builds go at `rate` bytes a second at best (`None` without a total or a
/// rate: nothing to compare).
pub fn build_outlook(elapsed: f64, done: u64, total: u64, rate: f64) -> Option<BuildOutlook> {
    if total == 0 || rate <= 0.0 || !rate.is_finite() {
        return None;
    }
    let own = total as f64 / rate;
    let done = done.min(total);
    let remaining = if done > 0 {
        // At the pace it kept so far.
        elapsed * (total - done) as f64 / done as f64
    } else if elapsed > own {
        // Nothing told yet and already late: as long again, at least.
        elapsed
    } else {
        own - elapsed
    };
    Some(BuildOutlook { remaining, own })
}

/// The engine an identity belongs to, for the build rates: its part before the first
/// `:` or space (at most 32 bytes).
fn engine_of(identity: &str) -> &str {
    let e = identity.split([':', ' ']).next().unwrap_or_default();
    &e[..e.len().min(32)]
}

/// Builder roles by key, with the indexes that bound them: by deadline (so a role leaves
/// memory when it expires, [`Store::expire_builds`]), and counts by connection and by uid
/// (`limits.max_builds_per_connection`, `limits.max_builds_per_uid`).
#[derive(Default)]
pub(super) struct Builds {
    by_key: HashMap<SegmentKey, Build>,
    by_deadline: BTreeMap<(Instant, u64), SegmentKey>,
    per_client: HashMap<ClientId, u64>,
    per_uid: HashMap<u32, u64>,
    /// The rate (bytes per second) of the latest builds that were published, by engine
    /// ([`engine_of`]): a moving average.
    rates: HashMap<String, f64>,
}

fn drop_one<K: std::hash::Hash + Eq>(map: &mut HashMap<K, u64>, k: K) {
    if let std::collections::hash_map::Entry::Occupied(mut e) = map.entry(k) {
        *e.get_mut() -= 1;
        if *e.get() == 0 {
            e.remove();
        }
    }
}

impl Builds {
    fn get(&self, key: &SegmentKey) -> Option<&Build> {
        self.by_key.get(key)
    }

    /// The build of `key` (if one runs) ends with `size` bytes published: its engine's rate
    /// learns from it (bytes from the role to the publication).
    fn learn_rate(&mut self, key: &SegmentKey, size: u64) {
        let Some(b) = self.by_key.get(key) else { return };
        let secs = b.started.elapsed().as_secs_f64();
        let engine = engine_of(&b.identity).to_string();
        if secs > 0.0 && size > 0 && (self.rates.len() < MAX_RATES || self.rates.contains_key(&engine)) {
            let rate = size as f64 / secs;
            let r = self.rates.entry(engine).or_insert(rate);
            *r = 0.5 * *r + 0.5 * rate;
        }
    }

    fn insert(&mut self, key: SegmentKey, b: Build) {
        self.by_deadline.insert((b.deadline, b.token), key.clone());
        *self.per_client.entry(b.client).or_insert(0) += 1;
        *self.per_uid.entry(b.uid).or_insert(0) += 1;
        if let Some(old) = self.by_key.insert(key, b) {
            self.forget(&old);
        }
    }

    fn remove(&mut self, key: &SegmentKey) -> Option<Build> {
        let b = self.by_key.remove(key)?;
        self.forget(&b);
        Some(b)
    }

    fn forget(&mut self, b: &Build) {
        self.by_deadline.remove(&(b.deadline, b.token));
        drop_one(&mut self.per_client, b.client);
        drop_one(&mut self.per_uid, b.uid);
    }

    /// Every role held now.
    pub(super) fn iter(&self) -> impl Iterator<Item = &Build> {
        self.by_key.values()
    }

    /// Roles `client` holds now.
    pub(super) fn count_of(&self, client: ClientId) -> u64 {
        self.per_client.get(&client).copied().unwrap_or(0)
    }

    /// Roles held now.
    pub(super) fn len(&self) -> usize {
        self.by_key.len()
    }

    /// The key of the role whose deadline passed first, if one did by `now`.
    fn first_expired(&self, now: Instant) -> Option<SegmentKey> {
        self.by_deadline.first_key_value().filter(|((d, _), _)| *d <= now).map(|(_, k)| k.clone())
    }

    /// The earliest deadline of a role held.
    fn next_deadline(&self) -> Option<Instant> {
        self.by_deadline.first_key_value().map(|((d, _), _)| *d)
    }

    /// Keys of the roles `client` holds.
    fn held_by(&self, client: ClientId) -> Vec<SegmentKey> {
        if !self.per_client.contains_key(&client) {
            return Vec::new();
        }
        self.by_key.iter().filter(|(_, b)| b.client == client).map(|(k, _)| k.clone()).collect()
    }
}

/// What an acquire found.
pub enum Acquired {
    /// A published segment the asker may use.
    Ready(Arc<Segment>),
    /// The asker is the builder until `deadline`.
    Build {
        /// When the role ends.
        deadline: Instant,
    },
    /// Another connection builds; wait.
    Wait(BuildWait),
    /// The asker may not take another builder role now (a limit on roles held): build
    /// privately.
    Refused(BuildsRefused),
}

/// Why an acquire may not become a builder: a limit on the roles held at once.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BuildsRefused {
    /// The connection holds `limits.max_builds_per_connection` roles already.
    #[error(
        "this connection already builds {held} identities (limits.max_builds_per_connection): publish or give up one \
         first; build this one privately"
    )]
    PerConnection {
        /// Roles the connection holds.
        held: u64,
    },
    /// The uid holds `limits.max_builds_per_uid` roles already.
    #[error(
        "uid {uid} already builds {held} identities over its connections (limits.max_builds_per_uid); build this one \
         privately"
    )]
    PerUid {
        /// The uid.
        uid: u32,
        /// Roles it holds.
        held: u64,
    },
}

/// A wait on another connection's build.
pub struct BuildWait {
    /// Changes when the build ends.
    pub phase: watch::Receiver<BuildPhase>,
    /// The builder's deadline.
    pub deadline: Instant,
    /// Bytes the builder has written, as it told.
    pub done: Arc<Progress>,
    /// Bytes it writes in all when it said (0: not known).
    pub total: u64,
    key: SegmentKey,
    token: u64,
}

/// Why a publication was refused by the store (the request's own checks come first).
#[derive(Debug, thiserror::Error)]
pub enum PublishRefused {
    /// The namespace already has a segment for the identity.
    #[error("identity {identity:?} is already published in the namespace of uid {uid}; keep your own copy")]
    Exists {
        /// The namespace.
        uid: u32,
        /// The identity.
        identity: String,
    },
    /// The budget or the publisher's quota of packed bytes.
    #[error(transparent)]
    Quota(#[from] QuotaError),
}

/// The room a publication took before its bytes were read: its key, and the reservation of
/// what it will count (given back if the publication fails).
pub struct PublishTicket {
    key: SegmentKey,
    charged: u64,
    reservation: super::Reservation,
}

impl Inner {
    /// The published segment for `identity` that `uid` may use: its own first, then the
    /// oldest trusted one.
    fn published_for(&self, uid: u32, identity: &str, trusted: &Ids) -> Option<super::SegmentId> {
        let ids = self.by_identity.get(identity)?;
        let visible = |own: bool| {
            ids.iter().copied().find(|id| {
                self.segments
                    .get(id)
                    .and_then(|r| r.seg.publisher.as_ref())
                    .is_some_and(|p| if own { p.uid == uid } else { p.trusted_by(uid, trusted) })
            })
        };
        visible(true).or_else(|| visible(false))
    }

    /// Ends the build of `key` (if any) and tells its waiters `phase`.
    fn end_build(&mut self, key: &SegmentKey, phase: BuildPhase) {
        if let Some(b) = self.builds.remove(key) {
            b.tx.send_replace(phase);
        }
    }

    /// Ends the builder roles `client` holds (its connection closed). Roles whose deadline
    /// passed count as expired, not abandoned.
    pub(super) fn abandon_builds(&mut self, client: ClientId) {
        self.expire_builds(Instant::now());
        for key in self.builds.held_by(client) {
            self.counters.builds_abandoned += 1;
            self.end_build(&key, BuildPhase::Abandoned);
        }
    }

    /// Ends every role whose deadline passed by `now` (waiters build privately).
    fn expire_builds(&mut self, now: Instant) {
        while let Some(key) = self.builds.first_expired(now) {
            self.counters.builds_expired += 1;
            self.end_build(&key, BuildPhase::Expired);
        }
    }

    /// Whether `client` (of `uid`) may take one more builder role.
    fn build_allowed(&self, client: ClientId, uid: u32) -> Result<(), BuildsRefused> {
        let held = self.builds.per_client.get(&client).copied().unwrap_or(0);
        if held >= self.quotas.builds_per_connection {
            return Err(BuildsRefused::PerConnection { held });
        }
        let held = self.builds.per_uid.get(&uid).copied().unwrap_or(0);
        if held >= self.quotas.builds_per_uid {
            return Err(BuildsRefused::PerUid { uid, held });
        }
        Ok(())
    }
}

impl Store {
    /// Finds the segment published for `identity` that a client with `uid` may use, or
    /// makes connection `client` its builder for `build_for`, or has it wait for the
    /// namespace's builder.
    /// `build_bytes` is what the build writes, when the asker knows (0: not known).
    pub fn acquire(
        &self,
        client: ClientId,
        uid: u32,
        identity: &str,
        trusted: &Ids,
        build_for: Duration,
        build_bytes: u64,
    ) -> Acquired {
        let mut inner = self.lock();
        if let Some(seg) = inner.published_for(uid, identity, trusted).and_then(|id| inner.touch(id)) {
            inner.counters.hits += 1;
            return Acquired::Ready(seg);
        }
        let key = published_key(uid, identity);
        let now = Instant::now();
        inner.expire_builds(now);
        if let Some(b) = inner.builds.get(&key) {
            if b.client == client {
                // Asked again by its builder: the role stands, with its deadline.
                return Acquired::Build { deadline: b.deadline };
            }
            let wait = BuildWait {
                phase: b.tx.subscribe(),
                deadline: b.deadline,
                done: Arc::clone(&b.done),
                total: b.total,
                key,
                token: b.token,
            };
            inner.counters.build_waits += 1;
            return Acquired::Wait(wait);
        }
        if let Err(refused) = inner.build_allowed(client, uid) {
            inner.counters.builds_refused += 1;
            inner.counters.misses += 1;
            return Acquired::Refused(refused);
        }
        let deadline = now + build_for;
        let token = inner.next_build;
        inner.next_build += 1;
        let (tx, _) = watch::channel(BuildPhase::Building);
        let first = inner.builds.next_deadline().is_none_or(|d| deadline < d);
        let build = Build {
            client,
            identity: identity.to_string(),
            uid,
            token,
            deadline,
            tx,
            started: now,
            total: build_bytes,
            done: Arc::default(),
            best_rate: 0.0,
        };
        inner.builds.insert(key, build);
        inner.counters.builds += 1;
        inner.counters.misses += 1;
        drop(inner);
        if first {
            // The expiry task sleeps until the earliest deadline: this one is earlier.
            self.builds_changed.notify_one();
        }
        Acquired::Build { deadline }
    }

    /// Ends every builder role whose deadline has passed (their waiters build privately,
    /// the roles leave memory) and returns the next deadline of a role still held. Called
    /// by the daemon's expiry task at each deadline.
    pub fn expire_builds(&self) -> Option<Instant> {
        let mut inner = self.lock();
        inner.expire_builds(Instant::now());
        inner.builds.next_deadline()
    }

    /// Wakes when a role with an earlier deadline than all others is taken.
    pub async fn build_added(&self) {
        self.builds_changed.notified().await;
    }

    /// Builder roles held now.
    pub fn builds_active(&self) -> usize {
        self.lock().builds.len()
    }

    /// Ends the build of `identity` that connection `client` holds (if it holds it), telling
    /// its waiters to build privately with `reason`: the builder has nothing to publish.
    /// Returns whether a role was given up.
    pub fn give_up_build(&self, client: ClientId, uid: u32, identity: &str, reason: &str) -> bool {
        let mut inner = self.lock();
        let key = published_key(uid, identity);
        if inner.builds.get(&key).is_none_or(|b| b.client != client) {
            return false;
        }
        inner.counters.builds_given_up += 1;
        inner.end_build(&key, BuildPhase::GaveUp(reason.to_string()));
        true
    }

    /// Ends the build `wait` waited on if its deadline has passed (waiters then build
    /// privately); a build that ended or was replaced meanwhile is left alone.
    pub fn expire_build(&self, wait: &BuildWait) {
        let mut inner = self.lock();
        if inner.builds.get(&wait.key).is_some_and(|b| b.token == wait.token && b.deadline <= Instant::now()) {
            inner.counters.builds_expired += 1;
            inner.end_build(&wait.key, BuildPhase::Expired);
        }
    }

    /// Records how far the build of `identity` that connection `client` holds has come.
    /// Returns whether it holds that role.
    pub fn build_progress(&self, client: ClientId, uid: u32, identity: &str, done: u64, total: u64) -> bool {
        let mut inner = self.lock();
        let key = published_key(uid, identity);
        let Some(b) = inner.builds.by_key.get_mut(&key).filter(|b| b.client == client) else { return false };
        if total > 0 {
            b.total = total;
        }
        let before = b.done.bytes();
        if done > before {
            b.done.advance(done - before);
        }
        let elapsed = b.started.elapsed().as_secs_f64();
        if elapsed > 0.0 {
            b.best_rate = b.best_rate.max(b.done.bytes() as f64 / elapsed);
        }
        true
    }

    /// What is left of the build `wait` waits for against building privately: `None` when
    /// it cannot be told (no size or rate known yet) or the build ended.
    pub fn build_outlook(&self, wait: &BuildWait) -> Option<BuildOutlook> {
        let inner = self.lock();
        let b = inner.builds.get(&wait.key).filter(|b| b.token == wait.token)?;
        let remembered = inner.builds.rates.get(engine_of(&b.identity)).copied().unwrap_or(0.0);
        let rate = b.best_rate.max(remembered);
        build_outlook(b.started.elapsed().as_secs_f64(), b.done.bytes(), b.total, rate)
    }

    /// Counts a wait ended because building privately was faster.
    pub fn count_build_slow(&self) {
        self.lock().counters.build_waits_slow += 1;
    }

    /// Counts a publication refused before it reached the store (bad seals, table, size).
    pub fn count_publish_refused(&self) {
        self.lock().counters.publishes_refused += 1;
    }

    /// Takes a publication's room before any of its bytes is read: refuses an identity the
    /// namespace already has, and reserves what the segment will count against the budget
    /// and the publisher's quota (`entries` as they will be indexed; their digests do not
    /// change the charge). A refusal here costs the daemon no read, hash or copy.
    pub fn reserve_publication(
        self: &Arc<Self>,
        uid: u32,
        identity: &str,
        size: u64,
        entries: &[PackedEntry],
        lent: &mut Option<super::Reservation>,
    ) -> Result<PublishTicket, PublishRefused> {
        let key = published_key(uid, identity);
        let charged = crate::pack::charged_bytes(size, entries, crate::sys::proc::page_size());
        let reserved = if self.contains(&key) {
            Err(PublishRefused::Exists { uid, identity: identity.to_string() })
        } else if let Some(old) = lent.take() {
            self.reserve_instead(Some(uid), charged, old).map_err(|(e, old)| {
                *lent = Some(old);
                PublishRefused::from(e)
            })
        } else {
            self.reserve(Some(uid), charged).map_err(PublishRefused::from)
        };
        let reservation = reserved.inspect_err(|_| self.count_publish_refused())?;
        Ok(PublishTicket { key, charged, reservation })
    }

    /// Indexes a checked, sealed segment `publisher` published with the room `ticket` took
    /// ([`Store::reserve_publication`]): enters it into the index, ends the namespace's build
    /// and wakes its waiters. Runs off the async runtime (building the reply encoding of a
    /// large table takes a while). `pending`: the entries' digests are not computed yet
    /// (served as unknown; the segment enters the fd store and the cache directory once
    /// [`Store::hashed`] gives them); else `entries` are hashed already and it enters them now.
    pub fn publish(
        self: &Arc<Self>,
        ticket: PublishTicket,
        publisher: Publisher,
        file: std::fs::File,
        size: u64,
        entries: Vec<PackedEntry>,
        pending: bool,
    ) -> Result<Arc<Segment>, PublishRefused> {
        let result = self.publish_inner(ticket, publisher, file, size, entries, pending);
        let mut inner = self.lock();
        match &result {
            Ok(_) => inner.counters.publishes += 1,
            Err(_) => inner.counters.publishes_refused += 1,
        }
        result
    }

    fn publish_inner(
        self: &Arc<Self>,
        ticket: PublishTicket,
        publisher: Publisher,
        file: std::fs::File,
        size: u64,
        entries: Vec<PackedEntry>,
        pending: bool,
    ) -> Result<Arc<Segment>, PublishRefused> {
        let (uid, identity) = (publisher.uid, publisher.identity.clone());
        let PublishTicket { key, charged, reservation } = ticket;
        debug_assert_eq!(key, published_key(uid, &identity), "the ticket is this publication's");
        let exists = || PublishRefused::Exists { uid, identity: identity.clone() };
        let adopted = Adopted {
            file,
            key: key.clone(),
            size,
            source: published_source(uid, &identity),
            plan: published_plan(uid, &identity),
            entries,
            publisher: Some(publisher),
            label: String::new(),
        };
        let seg = self.build_as(adopted, charged, pending);
        let mut inner = self.lock();
        if inner.by_key.contains_key(&key) {
            return Err(exists());
        }
        inner.insert(Arc::clone(&seg), 0.0, reservation.owner());
        reservation.settle(&mut inner);
        inner.builds.learn_rate(&key, size);
        inner.end_build(&key, BuildPhase::Published);
        if !pending {
            inner.emit_new(&seg);
        }
        Ok(seg)
    }

    /// The entries' digests of a publication indexed before packd hashed it ([`Store::publish`]
    /// with `pending`), in its entries' order: the segment in the index is made again with
    /// them (the same id and memfd; replies carry them from now on) and enters the fd store
    /// and the cache directory. Returns that segment; one that left the index meanwhile
    /// (evicted: its leases keep the one they hold) is returned with its digests, not
    /// indexed.
    pub fn hashed(&self, seg: &Arc<Segment>, digests: &[[u8; 32]]) -> Arc<Segment> {
        let Ok(file) = seg.file.try_clone() else {
            self.hashes_done.notify_waiters();
            return Arc::clone(seg);
        };
        let mut entries = seg.entries.clone();
        for (e, d) in entries.iter_mut().zip(digests) {
            e.blake3 = *d;
        }
        let adopted = Adopted {
            file,
            key: seg.key.clone(),
            size: seg.size,
            source: seg.source,
            plan: seg.plan.clone(),
            entries,
            publisher: seg.publisher.clone(),
            label: seg.label.clone(),
        };
        let done = Arc::new(Segment::build(seg.id, self.generation, adopted, seg.charged));
        let mut inner = self.lock();
        let Some(r) = inner.segments.get_mut(&seg.id).filter(|r| Arc::ptr_eq(&r.seg, seg)) else {
            drop(inner);
            self.hashes_done.notify_waiters();
            return done;
        };
        let old = std::mem::replace(&mut r.seg, Arc::clone(&done));
        inner.graveyard.push(old);
        inner.emit_new(&done);
        drop(inner);
        self.hashes_done.notify_waiters();
        done
    }

    /// Waits until `seg`, a publication served before it was hashed, is hashed, withdrawn
    /// or gone from the index, or until `end`. Returns at once when it is none of those now.
    pub async fn until_hashed(&self, seg: &Arc<Segment>, end: Instant) {
        let notified = self.hashes_done.notified();
        tokio::pin!(notified);
        // Registered before the check: a notice between the check and the wait is not lost.
        notified.as_mut().enable();
        let current = { self.lock().segments.get(&seg.id).is_some_and(|r| Arc::ptr_eq(&r.seg, seg)) };
        if current && seg.pending {
            let _ = tokio::time::timeout_at(end.into(), notified).await;
        }
    }

    /// Files `aliases` (checked identities) to the segment `uid` published for `identity` in
    /// its own namespace: each alias's builder role in the namespace ends as published (its
    /// waiters are served the segment), and later acquires of the alias by `uid` (or anyone
    /// who trusts the publisher) find it, for as long as the segment is indexed. An alias
    /// that already names a segment `uid` published keeps it. Returns how many were filed;
    /// 0 when `uid` has no such segment.
    pub fn alias(&self, uid: u32, identity: &str, aliases: &[String]) -> usize {
        let mut inner = self.lock();
        let own =
            |inner: &Inner, name: &str| {
                inner.by_identity.get(name)?.iter().copied().find(|id| {
                    inner.segments.get(id).and_then(|r| r.seg.publisher.as_ref()).is_some_and(|p| p.uid == uid)
                })
            };
        let Some(id) = own(&inner, identity) else { return 0 };
        let mut filed = 0;
        for alias in aliases {
            if alias != identity && own(&inner, alias).is_none() {
                inner.by_identity.entry(alias.clone()).or_default().push(id);
                inner.aliases.entry(id).or_default().push(alias.clone());
                filed += 1;
            }
            let (key, size) = (published_key(uid, alias), inner.segments.get(&id).map_or(0, |r| r.seg.size));
            inner.builds.learn_rate(&key, size);
            inner.end_build(&key, BuildPhase::Published);
        }
        inner.counters.aliases_filed += filed as u64;
        filed
    }

    /// Takes a publication whose hash failed out of the index: new clients are not served it
    /// (those that hold it keep it: sealed, it cannot have changed). Counted as withdrawn.
    pub fn withdraw(&self, seg: &Arc<Segment>) -> bool {
        let mut inner = self.lock();
        if !inner.segments.get(&seg.id).is_some_and(|r| Arc::ptr_eq(&r.seg, seg)) {
            return false;
        }
        inner.unindex(seg.id);
        // Not an eviction.
        inner.counters.evictions = inner.counters.evictions.saturating_sub(1);
        inner.counters.publishes_withdrawn += 1;
        drop(inner);
        self.hashes_done.notify_waiters();
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_build_is_slower_than_building_only_when_what_is_left_outlasts_a_build() {
        // 100 MB at 100 MB/s: a build takes 1 s.
        let o = |elapsed, done| build_outlook(elapsed, done, 100_000_000, 1e8).unwrap();
        assert_eq!(o(0.2, 0).own, 1.0);
        // On pace, or told nothing yet and not late: keep waiting.
        assert!(!o(0.5, 50_000_000).slower_than_building());
        assert!(!o(0.5, 0).slower_than_building());
        assert!(!o(0.9, 0).slower_than_building());
        // A tenth done after a second: nine seconds left.
        assert!(o(1.0, 10_000_000).slower_than_building());
        // Told nothing and 1.4 s late: as long again, at least.
        assert!(o(1.4, 0).slower_than_building());
        // Almost done, however slowly: keep waiting.
        assert!(!o(4.0, 99_000_000).slower_than_building());
        // Nothing to compare without a size or a rate.
        assert_eq!(build_outlook(1.0, 0, 0, 1e8), None);
        assert_eq!(build_outlook(1.0, 0, 100, 0.0), None);
        assert_eq!(engine_of("llama.cpp-repack/1 ggml-0.25.3 abc"), "llama.cpp-repack/1");
        assert_eq!(engine_of("xnnpack:model=c:1"), "xnnpack");
    }
}
