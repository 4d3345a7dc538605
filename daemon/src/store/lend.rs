//! Lent memory: a memfd allocated for an engine builder while its model file is hashed.
//!
//! An engine builder packs into a memfd it then publishes; allocating those shared pages is
//! a large part of its build (about 0.4 ms per MiB here, twice private memory). A
//! connection that asks for a file's digest with `build_bytes` opts in; the one whose
//! request hashes the file (the first to ask: the likely builder) has a memfd of that size
//! allocated on a thread of its own while the hash runs ("parked" with its connection). The
//! next acquire of an opted-in connection of that uid that makes it a builder with the same
//! `build_bytes` claims it: most often the same connection's, but workers starting together
//! all ask once the hash is done, and whichever is first becomes the builder. The parking
//! connection's acquire that ends served, private or in an error, or the connection
//! closing, frees it if nobody claimed it.
//!
//! A lend never costs anyone else anything:
//! - it is at most [`lend_bound`] of the file's size (a bigger ask is refused);
//! - its pages are allocated only within what the host can spare
//!   ([`crate::sys::proc::memory_to_spare`], looked at again every [`CHUNK`]);
//! - until a builder claims it, anything that needs room in the budget takes it back first
//!   (revoked: `Store::reserve_lend`), and nobody claiming it within the claim timeout
//!   (`limits.lend_claim_timeout`, from the digest's reply) frees it;
//! - a uid holds at most its share ([`Lends::limit`]) and [`MAX_LENDS_PER_UID`] lends.
//!
//! Every lend is accounted by a [`Held`] that travels with its memfd and is dropped after
//! it: in its uid's lent bytes and lends, and in the budget and the uid's quota (a
//! reservation that takes no segment place and evicts nothing). So memory still being
//! allocated, or dropped on its way, stays counted in its uid's lent bytes until its pages
//! are gone; a lend taken back for room gives the budget its room at once (what needed it
//! goes ahead), while its thread stops within a chunk and frees the pages. Until it is
//! claimed, the lend's own thread holds its memfd and frees it when told (revoked,
//! expired, its connection gone). Claimed, a lend stays counted until the same memfd
//! (device and inode) is published: the segment then counts it. The daemon cannot see
//! when a builder that never publishes lets go of the pages (it may keep them as private
//! memory), so those stay counted in the uid's lent bytes until restart.
#![forbid(unsafe_code)]

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::signal::{Signal, Stop};
use super::{ClientId, QuotaError, Reservation, Store};

/// Lends one uid may hold at once, parked and handed out (each holds its memfd's pages).
pub const MAX_LENDS_PER_UID: usize = 16;

/// How much a lend's allocation does between looks at whether it is still wanted and the
/// host can still spare it.
const CHUNK: u64 = 64 << 20;

/// The most a build from a file of `file_size` bytes can need, and so the largest lend for
/// it: the file's size and an eighth, and 1 MiB. llama.cpp's repack (the engine adapter
/// that asks for lends) keeps every tensor's size, so its buffer is at most the file's
/// tensor data and their alignment.
pub fn lend_bound(file_size: u64) -> u64 {
    file_size.saturating_add(file_size / 8).saturating_add(1 << 20)
}

/// A memfd's identity: device and inode.
pub type Inode = (u64, u64);

/// The device and inode of `file`.
pub fn inode_of(file: &File) -> Option<Inode> {
    file.metadata().ok().map(|m| (m.dev(), m.ino()))
}

/// Why nothing was lent for a digest request with `build_bytes`.
#[derive(Debug, thiserror::Error)]
pub enum LendRefused {
    /// Over [`lend_bound`] of the file.
    #[error("{asked} bytes is more than a build from a file of {file} bytes can need ({bound} at most)")]
    Oversized {
        /// Bytes asked (page-rounded).
        asked: u64,
        /// The file's size.
        file: u64,
        /// [`lend_bound`] of it.
        bound: u64,
    },
    /// The uid's lent bytes or lends are at their bound.
    #[error("uid {uid} has {held} bytes in {lends} lend(s); its bound is {limit} bytes and {MAX_LENDS_PER_UID} lends")]
    Uid {
        /// The uid.
        uid: u32,
        /// Its lent bytes now.
        held: u64,
        /// Its lends now.
        lends: usize,
        /// Its bound ([`Lends::limit`]).
        limit: u64,
    },
    /// No free room in the budget or the uid's quota.
    #[error("{0}")]
    Room(QuotaError),
    /// The host cannot spare it (or stopped being able to, mid-allocation).
    #[error("the host can spare {spare} bytes without pressure, {allocating} of them being lent already")]
    HostMemory {
        /// What [`crate::sys::proc::memory_to_spare`] said.
        spare: u64,
        /// Bytes of other lends still being allocated.
        allocating: u64,
    },
}

/// The lent memfds: parked with a connection, or handed out to a builder.
pub struct Lends {
    inner: Mutex<Inner>,
    /// `limits.max_lent_bytes_per_uid` (`None`: a quarter of the budget; 0: off).
    max_per_uid: Option<u64>,
    claim_timeout: Duration,
    page: u64,
    /// `huge_pages` (config): a lend's pages are huge where the host allows it.
    huge_pages: bool,
    /// Bytes of lends whose pages are still being allocated.
    allocating: AtomicU64,
    refused: AtomicU64,
    expired: AtomicU64,
}

#[derive(Default)]
struct Inner {
    /// Connections that asked for a digest with `build_bytes`: only they are lent memory.
    askers: HashSet<ClientId>,
    parked: HashMap<ClientId, Parked>,
    out: HashMap<u32, Vec<Out>>,
    /// Lent bytes and lends per uid, parked and handed out.
    per_uid: HashMap<u32, (u64, usize)>,
    /// Builder roles that came with a lent memfd.
    handed: u64,
}

type Memory = Option<(File, Held)>;

struct Parked {
    uid: u32,
    bytes: u64,
    memory: Option<oneshot::Receiver<Memory>>,
    signal: Arc<Signal>,
}

impl Drop for Parked {
    /// Its thread frees the memfd unless a builder claimed it.
    fn drop(&mut self) {
        self.signal.cancel();
    }
}

struct Out {
    inode: Inode,
    held: Held,
}

/// A lend's account: its bytes in its uid's lent bytes, and its reservation in the budget.
/// Dropped after the memfd it travels with (field order), it gives both back.
pub struct Held {
    lends: Weak<Lends>,
    uid: u32,
    bytes: u64,
    /// `None` while a publication of the memfd has taken its room.
    reservation: Option<Reservation>,
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(lends) = self.lends.upgrade() {
            lends.forget(self.uid, self.bytes);
        }
    }
}

/// A memfd handed to a builder.
pub struct Lent {
    /// The memfd, `bytes` long, its pages allocated.
    pub file: File,
    /// Its size.
    pub bytes: u64,
}

/// What a lend leaves to drop off the async runtime (freeing many pages takes a while):
/// its memfd, once allocated, and then its account.
pub struct Dropped(#[allow(dead_code)] Option<oneshot::Receiver<Memory>>, #[allow(dead_code)] Memory);

/// A receiver being waited for: dropped off the runtime if the wait is given up (the
/// client hung up), since it may hold an allocated memfd by then.
struct Waiting(Option<oneshot::Receiver<Memory>>);

impl Drop for Waiting {
    fn drop(&mut self) {
        let Some(rx) = self.0.take() else { return };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(move || drop(rx))),
            Err(_) => drop(rx),
        }
    }
}

/// Counts of what was lent and refused (`GetStats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LendStats {
    /// Lent bytes not yet published (parked, being allocated, handed out).
    pub bytes: u64,
    /// Builder roles that came with a lent memfd.
    pub handed: u64,
    /// Digest requests with `build_bytes` that were lent nothing ([`LendRefused`]).
    pub refused: u64,
    /// Lends nobody claimed within the claim timeout.
    pub expired: u64,
}

impl Lends {
    /// No lends yet; each uid may hold `max_per_uid` lent bytes (`None`: a quarter of the
    /// budget; 0: lending is off); one unclaimed `claim_timeout` after its digest's reply is
    /// freed. With `huge_pages`, a lend's pages are huge where the host allows it.
    pub fn new(max_per_uid: Option<u64>, claim_timeout: Duration, page: u64, huge_pages: bool) -> Arc<Self> {
        Arc::new(Self {
            inner: Mutex::new(Inner::default()),
            huge_pages,
            max_per_uid,
            claim_timeout,
            page: page.max(1),
            allocating: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            expired: AtomicU64::new(0),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The bytes one uid may have lent under a budget of `budget`: its configured bound,
    /// else a quarter of the budget; never more than the budget.
    pub fn limit(&self, budget: u64) -> u64 {
        self.max_per_uid.unwrap_or(budget / 4).min(budget)
    }

    /// Connection `client` asked for a digest with `build_bytes`: it may be lent memory.
    pub fn asked(&self, client: ClientId) {
        self.lock().askers.insert(client);
    }

    /// Starts allocating `bytes` (page-rounded) for open connection `client` of `uid` on a
    /// thread of its own, for a build from a file of `file_size` bytes, if the bound for the
    /// file, the uid's bounds, the budget's free room, the uid's quota and the host's spare
    /// memory allow and the connection has none parked. Called by the request that hashes
    /// the model file, off the async runtime; [`Lends::hashed`] once it is done.
    pub fn park(
        self: &Arc<Self>,
        store: &Arc<Store>,
        client: ClientId,
        uid: u32,
        bytes: u64,
        file_size: u64,
    ) -> Result<(), LendRefused> {
        let Some(bytes) = bytes.checked_next_multiple_of(self.page).filter(|&b| b > 0) else { return Ok(()) };
        if self.max_per_uid == Some(0) {
            return Ok(());
        }
        let refused = |why: LendRefused| {
            self.refused.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(client, uid, bytes, reason = %why, "nothing lent for a build");
            Err(why)
        };
        let bound = lend_bound(file_size);
        if bytes > bound {
            return refused(LendRefused::Oversized { asked: bytes, file: file_size, bound });
        }
        let allocating = self.allocating.load(Ordering::Relaxed);
        if let Some(spare) = crate::sys::proc::memory_to_spare()
            && bytes.saturating_add(allocating) > spare
        {
            return refused(LendRefused::HostMemory { spare, allocating });
        }
        let limit = self.limit(store.budget());
        let mut gone = None;
        {
            let mut inner = self.lock();
            // One lend parked per connection; one taken back or expired makes way.
            if inner.parked.get(&client).is_some_and(|p| p.signal.stopped().is_some()) {
                gone = inner.parked.remove(&client);
            }
            if inner.parked.contains_key(&client) {
                return Ok(());
            }
            let (held, lends) = inner.per_uid.get(&uid).copied().unwrap_or((0, 0));
            if lends >= MAX_LENDS_PER_UID || held.saturating_add(bytes) > limit {
                drop(inner);
                return refused(LendRefused::Uid { uid, held, lends, limit });
            }
            let e = inner.per_uid.entry(uid).or_default();
            (e.0, e.1) = (e.0 + bytes, e.1 + 1);
        }
        drop(gone);
        // From here on the account gives the bytes back whatever happens to the lend.
        let mut held = Held { lends: Arc::downgrade(self), uid, bytes, reservation: None };
        let signal = Arc::new(Signal::default());
        // Claimed by then at the latest, even if the digest's reply never comes: the claim
        // timeout after a hash of the file at 64 MiB/s (a slow disk).
        signal.claim_by(Instant::now() + self.claim_timeout + Duration::from_secs(file_size / (64 << 20)));
        match store.reserve_lend(Some(uid), bytes, Arc::clone(&signal)) {
            Ok(reservation) => held.reservation = Some(reservation),
            Err(e) => return refused(LendRefused::Room(e)),
        }
        let (tx, rx) = oneshot::channel();
        let lends = Arc::downgrade(self);
        let thread_signal = Arc::clone(&signal);
        let huge_pages = self.huge_pages;
        self.allocating.fetch_add(bytes, Ordering::Relaxed);
        let spawned = std::thread::Builder::new().name("packd-lend".into()).spawn(move || {
            let file = allocate(bytes, &thread_signal, &lends, huge_pages);
            let Some(file) = file else {
                thread_signal.ended();
                return;
            };
            match thread_signal.wait() {
                // Refused when nobody waits any more: the memfd, then the account, go here.
                Ok(()) => drop(tx.send(Some((file, held)))),
                Err(Stop::Expired) => {
                    if let Some(lends) = lends.upgrade() {
                        lends.expired.fetch_add(1, Ordering::Relaxed);
                    }
                    tracing::debug!(bytes, "lent memory nobody claimed in time freed");
                }
                Err(Stop::Revoked | Stop::Cancelled) => {}
            }
        });
        if spawned.is_err() {
            self.allocating.fetch_sub(bytes, Ordering::Relaxed);
            return Ok(());
        }
        let parked = Parked { uid, bytes, memory: Some(rx), signal };
        let kept = match self.lock().parked.entry(client) {
            std::collections::hash_map::Entry::Occupied(_) => Some(parked),
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(parked);
                None
            }
        };
        drop(kept);
        // A connection that closed meanwhile never claims it (see `disconnected`: the store
        // forgets a connection before its lends do).
        if !store.connected(client) {
            drop(self.lock().parked.remove(&client));
        }
        Ok(())
    }

    /// The digest request of `client` that parked a lend has its reply: unclaimed within
    /// the claim timeout from now, the lend is freed.
    pub fn hashed(&self, client: ClientId) {
        let at = Instant::now() + self.claim_timeout;
        if let Some(p) = self.lock().parked.get(&client) {
            p.signal.claim_by(at);
        }
    }

    /// A memfd parked for a builder role of `build_bytes` that connection `client` of `uid`
    /// just took (if it asked for a digest with `build_bytes`): its own, else another
    /// connection's of the same uid and size. Claimed for a build that ends by `until` (the
    /// budget no longer takes it back until then), then waited for. `None` when none fits, it was taken back or its allocation failed;
    /// then what is left to drop off the runtime.
    pub async fn take(
        &self,
        store: &Store,
        client: ClientId,
        uid: u32,
        build_bytes: u64,
        until: Instant,
    ) -> (Option<Lent>, Option<Dropped>) {
        let Some(wanted) = build_bytes.checked_next_multiple_of(self.page).filter(|&b| b > 0) else {
            return (None, None);
        };
        let parked = {
            let mut inner = self.lock();
            let fits = |p: &Parked| p.uid == uid && p.bytes == wanted && p.signal.stopped().is_none();
            let owner = if !inner.askers.contains(&client) {
                None
            } else if inner.parked.get(&client).is_some_and(fits) {
                Some(client)
            } else {
                inner.parked.iter().find(|(_, p)| fits(p)).map(|(c, _)| *c)
            };
            owner.and_then(|c| inner.parked.remove(&c))
        };
        let Some(mut parked) = parked else { return (None, None) };
        let rx = parked.memory.take();
        if !store.claim_lend(&parked.signal, until) {
            return (None, Some(Dropped(rx, None)));
        }
        parked.signal.want();
        let bytes = parked.bytes;
        drop(parked);
        let mut waiting = Waiting(rx);
        let got = match waiting.0.as_mut() {
            Some(rx) => rx.await.ok().flatten(),
            None => None,
        };
        waiting.0 = None;
        let Some((file, held)) = got else { return (None, None) };
        let Some(inode) = inode_of(&file) else { return (None, Some(Dropped(None, Some((file, held))))) };
        let mut inner = self.lock();
        inner.handed += 1;
        inner.out.entry(uid).or_default().push(Out { inode, held });
        (Some(Lent { file, bytes }), None)
    }

    /// Frees what `client` has parked (its acquire ended served, private or in an error).
    pub fn unpark_of(&self, client: ClientId) -> Option<Dropped> {
        let mut parked = self.lock().parked.remove(&client)?;
        Some(Dropped(parked.memory.take(), None))
    }

    /// Connection `client` closed: frees what it has parked.
    pub fn disconnected(&self, client: ClientId) -> Option<Dropped> {
        let mut inner = self.lock();
        inner.askers.remove(&client);
        let mut parked = inner.parked.remove(&client)?;
        Some(Dropped(parked.memory.take(), None))
    }

    fn forget(&self, uid: u32, bytes: u64) {
        let mut inner = self.lock();
        if let Some(e) = inner.per_uid.get_mut(&uid) {
            (e.0, e.1) = (e.0.saturating_sub(bytes), e.1.saturating_sub(1));
            if e.1 == 0 {
                inner.per_uid.remove(&uid);
            }
        }
    }

    /// The reservation of the memfd `inode` lent to `uid`, for a publication of it to take
    /// its room; give it back with [`Lends::put_back`] if the publication is refused.
    pub fn reservation_of(&self, uid: u32, inode: Inode) -> Option<Reservation> {
        let mut inner = self.lock();
        inner.out.get_mut(&uid)?.iter_mut().find(|o| o.inode == inode)?.held.reservation.take()
    }

    /// Gives back what [`Lends::reservation_of`] took (the publication was refused).
    pub fn put_back(&self, uid: u32, inode: Inode, reservation: Option<Reservation>) {
        let Some(reservation) = reservation else { return };
        let mut inner = self.lock();
        let out = inner.out.get_mut(&uid).and_then(|v| v.iter_mut().find(|o| o.inode == inode));
        match out {
            Some(out) if out.held.reservation.is_none() => out.held.reservation = Some(reservation),
            _ => {
                drop(inner);
                drop(reservation);
            }
        }
    }

    /// The memfd `inode` lent to `uid` was published and is served: its segment counts it now.
    pub fn published(&self, uid: u32, inode: Inode) {
        let mut inner = self.lock();
        let Some(list) = inner.out.get_mut(&uid) else { return };
        let Some(at) = list.iter().position(|o| o.inode == inode) else { return };
        let out = list.swap_remove(at);
        if list.is_empty() {
            inner.out.remove(&uid);
        }
        // Its account is given back once the lock is let go.
        drop(inner);
        drop(out);
    }

    /// The memfd `inode` lent to `uid` never reached its builder (the reply could not be
    /// sent): its account, to drop after the memfd, whose pages then go.
    pub fn not_sent(&self, uid: u32, inode: Inode) -> Option<Held> {
        let mut inner = self.lock();
        let list = inner.out.get_mut(&uid)?;
        let at = list.iter().position(|o| o.inode == inode)?;
        let out = list.swap_remove(at);
        if list.is_empty() {
            inner.out.remove(&uid);
        }
        Some(out.held)
    }

    /// What is lent now, and what was lent and refused since start-up.
    pub fn stats(&self) -> LendStats {
        let inner = self.lock();
        LendStats {
            bytes: inner.per_uid.values().map(|e| e.0).sum(),
            handed: inner.handed,
            refused: self.refused.load(Ordering::Relaxed),
            expired: self.expired.load(Ordering::Relaxed),
        }
    }
}

/// A memfd of `bytes` with every page allocated, in chunks while the lend is still wanted
/// and the host can spare the next chunk; `None` otherwise (the memfd is dropped here).
fn allocate(bytes: u64, signal: &Signal, lends: &Weak<Lends>, huge_pages: bool) -> Option<File> {
    // What is left of this lend's allocation stays counted as allocating until it ends.
    struct Left<'a>(&'a Weak<Lends>, u64);
    impl Drop for Left<'_> {
        fn drop(&mut self) {
            if let Some(lends) = self.0.upgrade() {
                lends.allocating.fetch_sub(self.1, Ordering::Relaxed);
            }
        }
    }
    let mut left = Left(lends, bytes);
    let file = crate::sys::memfd::create("packd-lent").ok()?;
    file.set_len(bytes).ok()?;
    let mut done = 0;
    while done < bytes {
        if signal.stopped().is_some() {
            return None;
        }
        let step = CHUNK.min(bytes - done);
        if crate::sys::proc::memory_to_spare().is_some_and(|spare| spare < step) {
            if let Some(lends) = lends.upgrade() {
                lends.refused.fetch_add(1, Ordering::Relaxed);
            }
            tracing::debug!(bytes, done, "lent memory given up: the host cannot spare more");
            return None;
        }
        crate::sys::memfd::allocate(&file, done, step, huge_pages).ok()?;
        done += step;
        if let Some(l) = lends.upgrade() {
            l.allocating.fetch_sub(step, Ordering::Relaxed);
            left.1 -= step;
        }
    }
    Some(file)
}
