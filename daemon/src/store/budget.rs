//! The byte budget: reservations for pack jobs, LRU eviction of unleased and unpinned
//! segments, forced eviction into zombies, pinning.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use packd_proto::units::format_size;

use super::signal::Signal;
use super::{BudgetError, Inner, QuotaError, SegmentId, Store};
use crate::key::Key;

/// Which segments an operation applies to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Selector {
    /// A segment key, or an entry key (meaning its segment).
    Key(Key),
    /// Every segment whose key, or one of whose entry keys, starts with this.
    Prefix(String),
}

/// Held segments a budget refusal names at most (the largest first): the message stays
/// short however many segments are leased.
const HOLDERS_NAMED: usize = 8;

/// Why an eviction was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EvictError {
    /// Nothing matched.
    #[error("no segment matches {0}")]
    NotFound(String),
    /// Matching segments are leased and `force` was not given.
    #[error("leased, not evicted without force: {0}")]
    Leased(String),
}

/// What an eviction did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct EvictReport {
    /// Keys of segments removed and freed.
    pub evicted: Vec<String>,
    /// Keys of leased segments removed from the index; their memory lives until released.
    pub zombies: Vec<String>,
}

/// Bytes set aside for a pack job; returned to the budget when dropped, or turned into
/// resident bytes when the job's segment enters the index. While it lives, its bytes also
/// count against its owner's quota of packed bytes, so concurrent jobs of one uid cannot
/// each pass the quota on their own.
pub struct Reservation {
    store: Arc<Store>,
    bytes: u64,
    owner: Option<u32>,
    /// Whether it still holds a place among `limits.max_segments`.
    place: bool,
    /// The lend it is the room of ([`Store::reserve_lend`]), if any.
    lend: Option<u64>,
}

/// The budget's room for lent memory (`store::lend`): the bytes of every lend's
/// reservation, and which lends nobody has claimed yet. Those are taken back (revoked)
/// before anything else is refused or evicted for room.
#[derive(Default)]
pub(super) struct LentRoom {
    next: u64,
    /// Bytes of live lend reservations, claimed or not (part of `Inner::reserved`).
    pub(super) bytes: u64,
    /// Lends not claimed by a builder yet: revocable.
    unclaimed: HashMap<u64, Unclaimed>,
    /// Lends claimed by a builder, until its build's deadline: past it, unpublished, their
    /// pages are the builder's and they give their room back.
    claimed: HashMap<u64, Claimed>,
    /// Revoked lends whose reservation still lives: their room was given back already.
    revoked: HashSet<u64>,
    /// Lends revoked since start-up.
    pub(super) revocations: u64,
}

struct Unclaimed {
    bytes: u64,
    owner: Option<u32>,
    signal: Arc<Signal>,
}

struct Claimed {
    bytes: u64,
    owner: Option<u32>,
    until: Instant,
}

impl Reservation {
    /// A reservation of `bytes` and one place among `max_segments`, already counted in the
    /// store's `reserved` and `reserved_segments` (and in `owner`'s usage, if any).
    pub(super) fn new(store: Arc<Store>, bytes: u64, owner: Option<u32>) -> Self {
        Self { store, bytes, owner, place: true, lend: None }
    }

    /// The uid whose request the job serves (`None` for Prefetch).
    pub fn owner(&self) -> Option<u32> {
        self.owner
    }

    /// Gives the reserved bytes back, to the budget and to the owner's usage.
    fn give_back(&mut self, inner: &mut Inner) {
        if let Some(id) = self.lend.take() {
            if inner.lent.revoked.remove(&id) {
                // Revoked: its room went back then.
                self.bytes = 0;
                return;
            }
            inner.lent.unclaimed.remove(&id);
            inner.lent.claimed.remove(&id);
            inner.lent.bytes = inner.lent.bytes.saturating_sub(self.bytes);
        }
        if std::mem::take(&mut self.place) {
            inner.reserved_segments = inner.reserved_segments.saturating_sub(1);
        }
        inner.reserved = inner.reserved.saturating_sub(self.bytes);
        if let Some(uid) = self.owner {
            inner.usage.sub_packed(uid, self.bytes);
        }
        self.bytes = 0;
    }

    /// Ends the reservation as its segment enters the index (which charges the segment
    /// itself), under the same lock.
    pub(super) fn settle(mut self, inner: &mut Inner) {
        self.give_back(inner);
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.bytes > 0 || self.place || self.lend.is_some() {
            let store = Arc::clone(&self.store);
            self.give_back(&mut store.lock());
        }
    }
}

impl LentRoom {
    /// Bytes of lends whose room can be taken back now (of `owner` only, if given):
    /// unclaimed, or claimed and past their build's deadline.
    fn reclaimable(&self, owner: Option<u32>) -> u64 {
        let now = Instant::now();
        let mine = |o: Option<u32>| owner.is_none() || o == owner;
        let unclaimed: u64 = self.unclaimed.values().filter(|u| mine(u.owner)).map(|u| u.bytes).sum();
        let overdue: u64 = self.claimed.values().filter(|c| mine(c.owner) && c.until <= now).map(|c| c.bytes).sum();
        unclaimed + overdue
    }
}

impl Inner {
    /// Segments that cannot be evicted (leased or pinned).
    fn held_segments(&self) -> usize {
        self.segments.iter().filter(|(id, r)| r.pinned || self.refcounts.get(id).copied().unwrap_or(0) > 0).count()
    }

    /// Whether one more segment would find a place among `limits.max_segments` if every
    /// unleased, unpinned segment went.
    fn could_place(&self) -> bool {
        self.held_segments() + self.reserved_segments < self.max_segments
    }

    fn segments_error(&self) -> QuotaError {
        QuotaError::Segments { max: self.max_segments, held: self.held_segments(), reserved: self.reserved_segments }
    }

    /// Whether `needed` more bytes would fit if every unleased, unpinned segment went.
    fn could_fit(&self, needed: u64) -> bool {
        let held: u64 = self
            .segments
            .iter()
            .filter(|(id, r)| r.pinned || self.refcounts.get(id).copied().unwrap_or(0) > 0)
            .map(|(_, r)| r.seg.charged)
            .sum();
        let reserved = self.reserved.saturating_sub(self.lent.reclaimable(None));
        held.saturating_add(reserved).saturating_add(needed) <= self.budget
    }

    fn budget_error(&self, needed: u64) -> BudgetError {
        BudgetError {
            needed,
            budget: self.budget,
            resident: self.resident_bytes(),
            reserved: self.reserved.saturating_sub(self.lent.bytes),
            lent: self.lent.bytes,
            held: self.holders(),
        }
    }

    /// Whether `owner` may have `needed` more bytes packed once its unclaimed lends are
    /// taken back (they are, if that is what it needs).
    fn packed_allowed_revoking(&mut self, owner: Option<u32>, needed: u64) -> Result<(), QuotaError> {
        let Err(e) = self.packed_allowed(owner, needed) else { return Ok(()) };
        let QuotaError::PackedBytes { used, quota, .. } = e else { return Err(e) };
        let short = used.saturating_add(needed).saturating_sub(quota);
        if self.lent.reclaimable(owner) < short {
            return Err(e);
        }
        self.revoke_lends(short, owner);
        self.packed_allowed(owner, needed)
    }

    /// Takes back the room of claimed lends past their build's deadline (all of them), then
    /// of unclaimed lends (of `owner` only, if given; the largest first) until `needed`
    /// bytes of room came back or none is left; their builders build in their own memory.
    /// Returns the bytes that came back.
    fn revoke_lends(&mut self, needed: u64, owner: Option<u32>) -> u64 {
        let mut freed = 0;
        let now = Instant::now();
        let overdue: Vec<u64> = self.lent.claimed.iter().filter(|(_, c)| c.until <= now).map(|(id, _)| *id).collect();
        for id in overdue {
            let Some(c) = self.lent.claimed.remove(&id) else { continue };
            self.lent.revoked.insert(id);
            self.lent.bytes = self.lent.bytes.saturating_sub(c.bytes);
            self.reserved = self.reserved.saturating_sub(c.bytes);
            if let Some(uid) = c.owner {
                self.usage.sub_packed(uid, c.bytes);
            }
            if owner.is_none() || c.owner == owner {
                freed += c.bytes;
            }
            tracing::debug!(bytes = c.bytes, "lent memory unpublished past its build's deadline gave its room back");
        }
        while freed < needed {
            let Some((&id, _)) = self
                .lent
                .unclaimed
                .iter()
                .filter(|(_, u)| owner.is_none() || u.owner == owner)
                .max_by_key(|(id, u)| (u.bytes, std::cmp::Reverse(**id)))
            else {
                break;
            };
            let Some(u) = self.lent.unclaimed.remove(&id) else { break };
            u.signal.revoke();
            self.lent.revoked.insert(id);
            self.lent.revocations += 1;
            self.lent.bytes = self.lent.bytes.saturating_sub(u.bytes);
            self.reserved = self.reserved.saturating_sub(u.bytes);
            if let Some(uid) = u.owner {
                self.usage.sub_packed(uid, u.bytes);
            }
            freed += u.bytes;
            tracing::debug!(bytes = u.bytes, "lent memory nobody claimed yet taken back for room");
        }
        freed
    }

    /// Takes back unclaimed lends for what `needed` more bytes lack of the budget's room.
    fn revoke_lends_for(&mut self, needed: u64) {
        let over = (self.resident_bytes() + self.reserved + needed).saturating_sub(self.budget);
        if over > 0 {
            self.revoke_lends(over, None);
        }
    }

    /// Evicts least-recently-used unleased, unpinned segments until `needed` more bytes fit
    /// (or nothing more can go), once unclaimed lends have given their room back. Returns
    /// whether they fit.
    fn make_room(&mut self, needed: u64) -> bool {
        self.spare_yields_to(needed);
        self.revoke_lends_for(needed);
        let (victims, fits) = self.victims(needed, 1);
        self.evict_lru(victims);
        fits
    }

    /// Takes `victims` (from [`Inner::victims`]) out of the index.
    fn evict_lru(&mut self, victims: Vec<SegmentId>) {
        for id in victims {
            if let Some(seg) = self.unindex(id) {
                tracing::info!(key = %seg.key, bytes = seg.charged, "evicted (least recently used)");
            }
        }
    }

    /// The segments [`Inner::make_room`] would evict for `needed` more bytes, least recently
    /// used first, and whether the bytes would then fit.
    /// The spare does not count: it gives way before anything is evicted.
    fn victims(&self, needed: u64, new_segments: usize) -> (Vec<SegmentId>, bool) {
        let mut over = (self.resident_bytes() + self.reserved + needed).saturating_sub(self.budget);
        // And places among `limits.max_segments` for `new_segments` new segments.
        let mut places =
            (self.segments.len() + self.reserved_segments + new_segments).saturating_sub(self.max_segments);
        if over == 0 && places == 0 {
            return (Vec::new(), true);
        }
        let mut unheld: Vec<(u64, SegmentId, u64)> = self
            .segments
            .iter()
            .filter(|(id, r)| !r.pinned && self.refcounts.get(id).copied().unwrap_or(0) == 0)
            .map(|(id, r)| (r.last_tick, *id, r.seg.charged))
            .collect();
        unheld.sort_unstable();
        let mut victims = Vec::new();
        for (_, id, charged) in unheld {
            if over == 0 && places == 0 {
                break;
            }
            victims.push(id);
            over = over.saturating_sub(charged);
            places = places.saturating_sub(1);
        }
        (victims, over == 0 && places == 0)
    }

    /// What holds the resident bytes, for a budget refusal: the largest held segments
    /// (at most [`HOLDERS_NAMED`]) with their size and lease count, never the holders' pids
    /// (the refusal goes to any data-plane client; `ListClients` shows a caller its own).
    fn holders(&self) -> String {
        // (bytes, key, leases, pinned) of every held segment; only those named are formatted.
        let mut held: Vec<(u64, &str, u64, bool)> = self
            .segments
            .iter()
            .map(|(id, r)| (r.seg.charged, r.seg.key.as_str(), self.refcounts.get(id).copied().unwrap_or(0), r.pinned))
            .filter(|&(_, _, leases, pinned)| leases > 0 || pinned)
            .collect();
        if held.is_empty() {
            return "nothing holds them".into();
        }
        held.sort_unstable_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(b.1)));
        let mut parts: Vec<String> = held
            .iter()
            .take(HOLDERS_NAMED)
            .map(|&(bytes, key, leases, pinned)| match (leases, pinned) {
                (0, _) => format!("{key} ({bytes} bytes) pinned"),
                (n, p) => format!("{key} ({bytes} bytes) {n} lease(s){}", if p { ", pinned" } else { "" }),
            })
            .collect();
        if held.len() > HOLDERS_NAMED {
            parts.push(format!("and {} more held segment(s)", held.len() - HOLDERS_NAMED));
        }
        parts.join("; ")
    }

    fn holder_pids(&self, id: SegmentId) -> String {
        let mut pids: Vec<String> = self
            .clients
            .values()
            .filter(|c| c.leases.contains_key(&id))
            .map(|c| c.peer.pid.map_or("?".to_string(), |p| p.to_string()))
            .collect();
        pids.sort();
        pids.join(",")
    }

    fn select(&self, sel: &Selector) -> Vec<SegmentId> {
        let mut ids: Vec<SegmentId> = match sel {
            Selector::Key(k) => self.find(k).into_iter().collect(),
            Selector::Prefix(p) => self
                .segments
                .iter()
                .filter(|(_, r)| {
                    r.seg.key.starts_with(p.as_str()) || r.seg.entries.iter().any(|e| e.key.starts_with(p.as_str()))
                })
                .map(|(id, _)| *id)
                .collect(),
        };
        ids.sort_unstable();
        ids
    }
}

fn describe(sel: &Selector) -> String {
    match sel {
        Selector::Key(Key::Segment(k)) => format!("key {:?}", k.as_str()),
        Selector::Key(Key::Entry(k)) => format!("key {:?}", k.as_str()),
        Selector::Prefix(p) => format!("prefix {p:?}"),
    }
}

impl Store {
    /// Refuses a new segment of `bytes`, packed at the request of `owner` (a data-plane
    /// request's uid; `None` for Prefetch), that would take `owner` over its quota or could
    /// not fit even after evicting everything unleased and unpinned; evicts nothing
    /// (admission before any work is done for it).
    pub fn admit(&self, owner: Option<u32>, bytes: u64) -> Result<(), QuotaError> {
        let inner = self.lock();
        if let Err(e) = inner.packed_allowed(owner, bytes) {
            // Unclaimed lends of the uid give their room back when its job reserves.
            let QuotaError::PackedBytes { used, quota, .. } = e else { return Err(e) };
            if used.saturating_add(bytes).saturating_sub(quota) > inner.lent.reclaimable(owner) {
                return Err(e);
            }
        }
        if !inner.could_place() {
            return Err(inner.segments_error());
        }
        if inner.could_fit(bytes) { Ok(()) } else { Err(inner.budget_error(bytes).into()) }
    }

    /// Reserves `bytes` for a new segment packed at the request of `owner`, checking its
    /// quota and then evicting LRU unleased, unpinned segments as needed. A segment over
    /// the quota or that cannot fit is refused before anything is evicted.
    pub fn reserve(self: &Arc<Self>, owner: Option<u32>, bytes: u64) -> Result<Reservation, QuotaError> {
        let mut inner = self.lock();
        Self::reserve_locked(&mut inner, owner, bytes)?;
        Ok(Reservation::new(Arc::clone(self), bytes, owner))
    }

    /// Reserves `bytes` for memory lent to a builder of `owner` (`store::lend`): within its
    /// quota and the budget's free room now. It takes no place among `limits.max_segments`,
    /// evicts nothing and takes back no other lend (the spare gives way, as always);
    /// refused otherwise. Until [`Store::claim_lend`], anything that needs room takes it
    /// back first (`signal` is told).
    pub fn reserve_lend(
        self: &Arc<Self>,
        owner: Option<u32>,
        bytes: u64,
        signal: Arc<Signal>,
    ) -> Result<Reservation, QuotaError> {
        let mut inner = self.lock();
        inner.packed_allowed(owner, bytes)?;
        inner.spare_yields_to(bytes);
        if inner.resident_bytes() + inner.reserved + bytes > inner.budget {
            return Err(inner.budget_error(bytes).into());
        }
        inner.reserved += bytes;
        if let Some(uid) = owner {
            inner.usage.add_packed(uid, bytes);
        }
        inner.lent.next += 1;
        let id = inner.lent.next;
        inner.lent.bytes += bytes;
        inner.lent.unclaimed.insert(id, Unclaimed { bytes, owner, signal });
        Ok(Reservation { store: Arc::clone(self), bytes, owner, place: false, lend: Some(id) })
    }

    /// A builder whose build ends by `until` claims the lend told through `signal`
    /// ([`Store::reserve_lend`]): it is no longer taken back for room until then. False if
    /// it was taken back already.
    pub fn claim_lend(&self, signal: &Arc<Signal>, until: Instant) -> bool {
        let mut inner = self.lock();
        let id = inner.lent.unclaimed.iter().find(|(_, u)| Arc::ptr_eq(&u.signal, signal)).map(|(id, _)| *id);
        let Some(u) = id.and_then(|id| inner.lent.unclaimed.remove(&id)) else { return false };
        inner.lent.claimed.insert(id.unwrap_or_default(), Claimed { bytes: u.bytes, owner: u.owner, until });
        true
    }

    /// The budget now.
    pub fn budget(&self) -> u64 {
        self.lock().budget
    }

    /// [`Store::reserve`] in the room of `old`, given back first under the same lock (a
    /// publication of memory the daemon lent). Refused, `old` is kept as it was.
    pub fn reserve_instead(
        self: &Arc<Self>,
        owner: Option<u32>,
        bytes: u64,
        mut old: Reservation,
    ) -> Result<Reservation, (QuotaError, Reservation)> {
        let mut inner = self.lock();
        // A claimed lend's room (only those are published), unless it was given back at
        // the build's deadline: then there is nothing to give back or to restore.
        let claimed = old.lend.and_then(|id| inner.lent.claimed.get(&id).map(|c| (id, c.until)));
        let (old_bytes, old_place) =
            if old.lend.is_some() && claimed.is_none() { (0, false) } else { (old.bytes, old.place) };
        old.give_back(&mut inner);
        if let Err(e) = Self::reserve_locked(&mut inner, owner, bytes) {
            inner.reserved += old_bytes;
            inner.reserved_segments += usize::from(old_place);
            if let Some(uid) = old.owner {
                inner.usage.add_packed(uid, old_bytes);
            }
            if let Some((id, until)) = claimed {
                inner.lent.bytes += old_bytes;
                inner.lent.claimed.insert(id, Claimed { bytes: old_bytes, owner: old.owner, until });
                old.lend = Some(id);
            }
            (old.bytes, old.place) = (old_bytes, old_place);
            return Err((e, old));
        }
        Ok(Reservation::new(Arc::clone(self), bytes, owner))
    }

    fn reserve_locked(inner: &mut Inner, owner: Option<u32>, bytes: u64) -> Result<(), QuotaError> {
        inner.packed_allowed_revoking(owner, bytes)?;
        if !inner.could_place() {
            return Err(inner.segments_error());
        }
        if !inner.could_fit(bytes) || !inner.make_room(bytes) {
            return Err(inner.budget_error(bytes).into());
        }
        inner.reserved += bytes;
        inner.reserved_segments += 1;
        if let Some(uid) = owner {
            inner.usage.add_packed(uid, bytes);
        }
        Ok(())
    }

    /// Sets `limits.max_segments`: segments the index holds at most, each an open fd. At
    /// the limit a new segment evicts the least recently used unleased, unpinned one.
    pub fn set_max_segments(&self, max: usize) {
        self.lock().max_segments = max.max(1);
    }

    /// Evicts the selected segments. Unleased ones are freed; leased ones are refused unless
    /// `force`, in which case they leave the index and live on as zombies until released.
    pub fn evict(&self, sel: &Selector, force: bool) -> Result<EvictReport, EvictError> {
        let mut inner = self.lock();
        let ids = inner.select(sel);
        if ids.is_empty() {
            return Err(EvictError::NotFound(describe(sel)));
        }
        let leased: Vec<String> = ids
            .iter()
            .filter(|id| inner.refcounts.get(id).copied().unwrap_or(0) > 0)
            .map(|id| {
                let key = inner.segments.get(id).map(|r| r.seg.key.to_string()).unwrap_or_default();
                format!("{key} held by {} lease(s), pid {}", inner.refcounts[id], inner.holder_pids(*id))
            })
            .collect();
        if !leased.is_empty() && !force {
            return Err(EvictError::Leased(leased.join("; ")));
        }
        let mut report = EvictReport::default();
        for id in ids {
            let zombie = inner.refcounts.get(&id).copied().unwrap_or(0) > 0;
            if let Some(seg) = inner.unindex(id) {
                let key = seg.key.to_string();
                if zombie { report.zombies.push(key) } else { report.evicted.push(key) }
            }
        }
        Ok(report)
    }

    /// Pins or unpins the selected segments (pinned segments are never evicted by the
    /// budget). Returns the keys changed.
    pub fn pin(&self, sel: &Selector, pinned: bool) -> Result<Vec<String>, EvictError> {
        let mut inner = self.lock();
        let ids = inner.select(sel);
        if ids.is_empty() {
            return Err(EvictError::NotFound(describe(sel)));
        }
        Ok(ids
            .into_iter()
            .filter_map(|id| {
                let r = inner.segments.get_mut(&id)?;
                r.pinned = pinned;
                Some(r.seg.key.to_string())
            })
            .collect())
    }

    /// Sets the budget and evicts LRU segments until the resident bytes fit, as far as
    /// leases and pins allow. Unless `evict_most`, a budget that would evict more than half
    /// of the resident bytes is refused and changes nothing.
    pub fn set_budget(&self, bytes: u64, evict_most: bool) -> Result<BudgetChange, BudgetRefused> {
        let mut inner = self.lock();
        let old = inner.budget;
        inner.budget = bytes;
        let (victims, fits) = inner.victims(0, 0);
        if !victims.is_empty() || !fits {
            // Unclaimed lends go before any segment (and are not put back if refused).
            inner.revoke_lends_for(0);
        }
        let (victims, fits) = inner.victims(0, 0);
        let segments = victims.len() as u64;
        let evicted_bytes: u64 = victims.iter().filter_map(|id| inner.segments.get(id)).map(|r| r.seg.charged).sum();
        let resident = inner.resident_bytes();
        if !evict_most && evicted_bytes > 0 && evicted_bytes * 2 > resident {
            inner.budget = old;
            return Err(BudgetRefused { budget: bytes, segments, bytes: evicted_bytes, resident });
        }
        inner.evict_lru(victims);
        inner.spare_yields_to(0);
        Ok(BudgetChange { budget: bytes, fits, evicted_segments: segments, evicted_bytes })
    }
}

/// What a budget change did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BudgetChange {
    /// The budget now in force.
    pub budget: u64,
    /// Whether the resident bytes fit it (false: leases or pins hold more).
    pub fits: bool,
    /// Segments evicted to fit it.
    pub evicted_segments: u64,
    /// Bytes (as charged) of those segments.
    pub evicted_bytes: u64,
}

/// A budget change refused because it would evict most of what is resident.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "a budget of {} would evict {segments} segment(s), {} of the {} resident; nothing was changed \
     (to do it anyway, ask again with evict_most: packctl budget --evict-most)",
    format_size(*budget), format_size(*bytes), format_size(*resident)
)]
pub struct BudgetRefused {
    /// The budget asked for.
    pub budget: u64,
    /// Segments it would evict.
    pub segments: u64,
    /// Bytes it would evict.
    pub bytes: u64,
    /// Bytes resident now.
    pub resident: u64,
}
