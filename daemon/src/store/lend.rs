//! Lent memory: a memfd allocated for an engine builder while its model file is hashed.
//!
//! An engine builder packs into a memfd it then publishes; allocating those shared pages is
//! a large part of its build (about 0.4 ms per MiB here, twice private memory). A
//! connection that asks for a file's digest with `build_bytes` opts in; the one whose
//! request hashes the file (the first to ask: the likely builder) has a memfd of that size
//! allocated on a thread of its own while the hash runs ("parked" with its connection). The
//! next acquire of an opted-in connection of that uid that makes it a builder with the same
//! `build_bytes` takes it: most often the same connection's, but workers starting together
//! all ask once the hash is done, and whichever is first becomes the builder. The parking
//! connection's acquire that ends served, private or in an error, or the connection
//! closing, frees it if nobody took it.
//!
//! Every lend is accounted by a [`Held`] that travels with its memfd and is dropped after
//! it: in `limits.max_lent_bytes_per_uid` (bytes) and [`MAX_LENDS_PER_UID`] (lends) of its
//! uid, and in the budget and the uid's quota (a reservation that takes no segment place
//! and evicts nothing: without free room nothing is lent). So memory still being allocated,
//! or dropped on its way, stays counted until its pages are gone. Handed out, a lend stays
//! counted until the same memfd (device and inode) is published: the segment then counts
//! it. The daemon cannot see when a builder that never publishes lets go of the pages (it
//! may keep them as private memory), so those stay counted until restart.
#![forbid(unsafe_code)]

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use tokio::sync::oneshot;

use super::{ClientId, Reservation, Store};

/// Lends one uid may hold at once, parked and handed out (each holds its memfd's pages).
pub const MAX_LENDS_PER_UID: usize = 16;

/// How much a lend's allocation does between looks at whether it is still wanted.
const CHUNK: u64 = 64 << 20;

/// A memfd's identity: device and inode.
pub type Inode = (u64, u64);

/// The device and inode of `file`.
pub fn inode_of(file: &File) -> Option<Inode> {
    file.metadata().ok().map(|m| (m.dev(), m.ino()))
}

/// The lent memfds: parked with a connection, or handed out to a builder.
pub struct Lends {
    inner: Mutex<Inner>,
    max_per_uid: u64,
    page: u64,
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
    memory: oneshot::Receiver<Memory>,
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

impl Lends {
    /// No lends yet; each uid may hold `max_per_uid` lent bytes (0: lending is off).
    pub fn new(max_per_uid: u64, page: u64) -> Arc<Self> {
        Arc::new(Self { inner: Mutex::new(Inner::default()), max_per_uid, page: page.max(1) })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Connection `client` asked for a digest with `build_bytes`: it may be lent memory.
    pub fn asked(&self, client: ClientId) {
        self.lock().askers.insert(client);
    }

    /// Starts allocating `bytes` (page-rounded) for open connection `client` of `uid` on a
    /// thread of its own, if the uid's limits, the budget's free room and the uid's quota
    /// allow and the connection has none parked. Called by the request that hashes the
    /// model file, off the async runtime.
    pub fn park(self: &Arc<Self>, store: &Arc<Store>, client: ClientId, uid: u32, bytes: u64) {
        let Some(bytes) = bytes.checked_next_multiple_of(self.page).filter(|&b| b > 0) else { return };
        {
            let mut inner = self.lock();
            let (held, lends) = inner.per_uid.get(&uid).copied().unwrap_or((0, 0));
            if inner.parked.contains_key(&client)
                || lends >= MAX_LENDS_PER_UID
                || held.saturating_add(bytes) > self.max_per_uid
            {
                return;
            }
            let e = inner.per_uid.entry(uid).or_default();
            (e.0, e.1) = (e.0 + bytes, e.1 + 1);
        }
        // From here on the account gives the bytes back whatever happens to the lend.
        let mut held = Held { lends: Arc::downgrade(self), uid, bytes, reservation: None };
        let Ok(reservation) = store.reserve_free(Some(uid), bytes) else { return };
        held.reservation = Some(reservation);
        let (tx, rx) = oneshot::channel();
        let spawned = std::thread::Builder::new().name("packd-lend".into()).spawn(move || {
            let file = allocate(bytes, &tx);
            if let Some(file) = file {
                // Refused when nobody waits any more: the memfd, then the account, go here.
                let _ = tx.send(Some((file, held)));
            }
        });
        if spawned.is_err() {
            return;
        }
        let mut inner = self.lock();
        // A connection that closed meanwhile never takes it: the thread sees nobody waits.
        if store.connected(client) && !inner.parked.contains_key(&client) {
            inner.parked.insert(client, Parked { uid, bytes, memory: rx });
        } else {
            drop(inner);
            drop(rx);
        }
    }

    /// A memfd parked for a builder role of `build_bytes` that connection `client` of `uid`
    /// just took (if it asked for a digest with `build_bytes`): its own, else another
    /// connection's of the same uid and size. Waits for its allocation. `None` when none
    /// fits or its allocation failed; then what is left to drop off the runtime.
    pub async fn take(&self, client: ClientId, uid: u32, build_bytes: u64) -> (Option<Lent>, Option<Dropped>) {
        let Some(wanted) = build_bytes.checked_next_multiple_of(self.page).filter(|&b| b > 0) else {
            return (None, None);
        };
        let parked = {
            let mut inner = self.lock();
            let fits = |p: &Parked| p.uid == uid && p.bytes == wanted;
            let owner = if !inner.askers.contains(&client) {
                None
            } else if inner.parked.get(&client).is_some_and(fits) {
                Some(client)
            } else {
                inner.parked.iter().find(|(_, p)| fits(p)).map(|(c, _)| *c)
            };
            owner.and_then(|c| inner.parked.remove(&c))
        };
        let Some(parked) = parked else { return (None, None) };
        let mut waiting = Waiting(Some(parked.memory));
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
        (Some(Lent { file, bytes: parked.bytes }), None)
    }

    /// Frees what `client` has parked (its acquire ended served, private or in an error).
    pub fn unpark_of(&self, client: ClientId) -> Option<Dropped> {
        let parked = self.lock().parked.remove(&client)?;
        Some(Dropped(Some(parked.memory), None))
    }

    /// Connection `client` closed: frees what it has parked.
    pub fn disconnected(&self, client: ClientId) -> Option<Dropped> {
        let mut inner = self.lock();
        inner.askers.remove(&client);
        let parked = inner.parked.remove(&client)?;
        Some(Dropped(Some(parked.memory), None))
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

    /// Lent bytes not yet published (parked, being allocated, and handed out), and builder
    /// roles that came with a lent memfd.
    pub fn stats(&self) -> (u64, u64) {
        let inner = self.lock();
        (inner.per_uid.values().map(|e| e.0).sum(), inner.handed)
    }
}

/// A memfd of `bytes` with every page allocated, in chunks while `tx` is still waited on;
/// `None` if that fails or nobody waits any more (the memfd is dropped here).
fn allocate(bytes: u64, tx: &oneshot::Sender<Memory>) -> Option<File> {
    let file = crate::sys::memfd::create("packd-lent").ok()?;
    file.set_len(bytes).ok()?;
    let mut done = 0;
    while done < bytes {
        if tx.is_closed() {
            return None;
        }
        let step = CHUNK.min(bytes - done);
        crate::sys::memfd::allocate(&file, done, step).ok()?;
        done += step;
    }
    Some(file)
}
