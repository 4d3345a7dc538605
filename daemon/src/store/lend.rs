//! Lent memory: a memfd allocated for an engine builder while its model file is hashed.
//!
//! An engine builder packs into a memfd it then publishes; allocating those shared pages is
//! a large part of its build (about 0.4 ms per MiB here, twice private memory). A digest
//! request that names `build_bytes` and is the one that hashes its file (the first for it:
//! the likely builder) has a memfd of that size allocated on a thread of its own while the
//! hash runs ("parked" with its connection). The next acquire of that uid that makes its
//! connection a builder with the same `build_bytes` takes it: most often the same
//! connection's, but workers starting together all ask once the hash is done, and whichever
//! is first becomes the builder. The parking connection's acquire that ends served or
//! private, or the connection closing, frees it if nobody took it.
//!
//! Its bytes are reserved in the budget and the uid's quota from the start. Handed out,
//! they stay counted until the same memfd (device and inode) is published: the segment then
//! counts them. The daemon cannot see when a builder that never publishes lets go of the
//! pages (it may keep them as private memory), so those stay counted until restart; a uid
//! holds at most `limits.max_lent_bytes_per_uid` lent bytes, parked or handed out, and past
//! that its builders allocate their own memory, as without lending.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::oneshot;

use super::{ClientId, Reservation, Store};

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
    parked: HashMap<ClientId, Parked>,
    out: HashMap<u32, Vec<Out>>,
    /// Lent bytes per uid, parked and handed out.
    per_uid: HashMap<u32, u64>,
    /// Builder roles that came with a lent memfd.
    handed: u64,
}

struct Parked {
    uid: u32,
    bytes: u64,
    memory: oneshot::Receiver<Option<File>>,
    reservation: Reservation,
}

struct Out {
    inode: Inode,
    bytes: u64,
    /// `None` while a publication of it has taken its room.
    reservation: Option<Reservation>,
}

/// A memfd handed to a builder.
pub struct Lent {
    /// The memfd, `bytes` long, its pages allocated.
    pub file: File,
    /// Its size.
    pub bytes: u64,
}

/// What a dropped lend leaves: its memfd (if its allocation finished: dropping the channel
/// drops it) and its reservation. Dropped off the async runtime, since freeing many pages
/// takes a while.
pub struct Dropped(
    #[allow(dead_code)] Option<oneshot::Receiver<Option<File>>>,
    #[allow(dead_code)] Option<Reservation>,
);

impl Lends {
    /// No lends yet; each uid may hold `max_per_uid` lent bytes (0: lending is off).
    pub fn new(max_per_uid: u64, page: u64) -> Self {
        Self { inner: Mutex::new(Inner::default()), max_per_uid, page: page.max(1) }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts allocating `bytes` (page-rounded) for connection `client` of `uid` on a thread
    /// of its own, if the uid's limit, the budget and the uid's quota allow and the
    /// connection has none parked. Called by the request that hashes the model file.
    pub fn park(&self, store: &Arc<Store>, client: ClientId, uid: u32, bytes: u64) {
        let Some(bytes) = bytes.checked_next_multiple_of(self.page).filter(|&b| b > 0) else { return };
        let mut inner = self.lock();
        let held = inner.per_uid.get(&uid).copied().unwrap_or(0);
        if inner.parked.contains_key(&client) || held.saturating_add(bytes) > self.max_per_uid {
            return;
        }
        let Ok(reservation) = store.reserve(Some(uid), bytes) else { return };
        let (tx, rx) = oneshot::channel();
        let spawned = std::thread::Builder::new().name("packd-lend".into()).spawn(move || {
            let _ = tx.send(allocate(bytes));
        });
        if spawned.is_err() {
            drop(inner);
            drop(reservation);
            return;
        }
        *inner.per_uid.entry(uid).or_default() += bytes;
        inner.parked.insert(client, Parked { uid, bytes, memory: rx, reservation });
    }

    /// A memfd parked for a builder role of `build_bytes` that connection `client` of `uid`
    /// just took: its own, else another connection's of the same uid and size. Waits for its
    /// allocation. `None` when none fits, or its allocation failed (then what is left to
    /// free, see [`Dropped`]).
    pub async fn take(&self, client: ClientId, uid: u32, build_bytes: u64) -> (Option<Lent>, Option<Dropped>) {
        let Some(wanted) = build_bytes.checked_next_multiple_of(self.page).filter(|&b| b > 0) else {
            return (None, None);
        };
        let parked = {
            let mut inner = self.lock();
            let fits = |p: &Parked| p.uid == uid && p.bytes == wanted;
            let owner = if inner.parked.get(&client).is_some_and(fits) {
                Some(client)
            } else {
                inner.parked.iter().find(|(_, p)| fits(p)).map(|(c, _)| *c)
            };
            owner.and_then(|c| inner.parked.remove(&c))
        };
        let Some(Parked { uid, bytes, memory, reservation }) = parked else { return (None, None) };
        let file = memory.await.ok().flatten();
        let inode = file.as_ref().and_then(inode_of);
        let (Some(file), Some(inode)) = (file, inode) else {
            self.forget(uid, bytes);
            return (None, Some(Dropped(None, Some(reservation))));
        };
        let mut inner = self.lock();
        inner.handed += 1;
        inner.out.entry(uid).or_default().push(Out { inode, bytes, reservation: Some(reservation) });
        (Some(Lent { file, bytes }), None)
    }

    /// Frees what `client` has parked (an acquire that does not build, or the connection
    /// closing).
    pub fn unpark_of(&self, client: ClientId) -> Option<Dropped> {
        let parked = self.lock().parked.remove(&client)?;
        Some(self.unpark(parked))
    }

    fn unpark(&self, parked: Parked) -> Dropped {
        self.forget(parked.uid, parked.bytes);
        Dropped(Some(parked.memory), Some(parked.reservation))
    }

    fn forget(&self, uid: u32, bytes: u64) {
        let mut inner = self.lock();
        if let Some(held) = inner.per_uid.get_mut(&uid) {
            *held = held.saturating_sub(bytes);
            if *held == 0 {
                inner.per_uid.remove(&uid);
            }
        }
    }

    /// The reservation of the memfd `inode` lent to `uid`, for a publication of it to take
    /// its room; give it back with [`Lends::put_back`] if the publication is refused.
    pub fn reservation_of(&self, uid: u32, inode: Inode) -> Option<Reservation> {
        let mut inner = self.lock();
        inner.out.get_mut(&uid)?.iter_mut().find(|o| o.inode == inode)?.reservation.take()
    }

    /// Gives back what [`Lends::reservation_of`] took (the publication was refused).
    pub fn put_back(&self, uid: u32, inode: Inode, reservation: Option<Reservation>) {
        let Some(reservation) = reservation else { return };
        let mut inner = self.lock();
        let out = inner.out.get_mut(&uid).and_then(|v| v.iter_mut().find(|o| o.inode == inode));
        match out {
            Some(out) if out.reservation.is_none() => out.reservation = Some(reservation),
            _ => {
                drop(inner);
                drop(reservation);
            }
        }
    }

    /// The memfd `inode` lent to `uid` was published: its segment counts its bytes now.
    pub fn published(&self, uid: u32, inode: Inode) {
        let mut inner = self.lock();
        let Some(list) = inner.out.get_mut(&uid) else { return };
        let Some(at) = list.iter().position(|o| o.inode == inode) else { return };
        let out = list.swap_remove(at);
        if list.is_empty() {
            inner.out.remove(&uid);
        }
        drop(inner);
        self.forget(uid, out.bytes);
        drop(out.reservation);
    }

    /// Lent bytes not yet published (parked and handed out), and builder roles that came
    /// with a lent memfd.
    pub fn stats(&self) -> (u64, u64) {
        let inner = self.lock();
        (inner.per_uid.values().sum(), inner.handed)
    }
}

/// A memfd of `bytes` with every page allocated; `None` if that fails.
fn allocate(bytes: u64) -> Option<File> {
    let file = crate::sys::memfd::create("packd-lent").ok()?;
    file.set_len(bytes).ok()?;
    crate::sys::memfd::allocate(&file, bytes).ok()?;
    Some(file)
}
