//! Connection admission: at most `limits.max_connections` data-plane connections, and at
//! most `limits.max_connections_per_uid` from one uid. A slot is held for the life of the
//! connection and given back when its task ends, however it ends. The control plane keeps
//! an admission of its own (`limits.max_control_connections`, `…_per_uid`) that only
//! refuses ([`Admission::admit_if_room`]): a gRPC connection cannot be told why it would be
//! shed.
//!
//! At a limit the newcomer is not simply refused: the workers of a host usually run as one
//! uid, and a pile of forgotten idle connections must not lock out the next worker. The
//! oldest connection that holds no lease and has no request in flight is **shed** — told
//! why with a last error frame, then closed — and the newcomer takes its slot: the oldest
//! idle one of the newcomer's uid first, then (at the global limit) the oldest idle one of
//! any uid. Only when every candidate holds a lease or is busy is the newcomer refused.
//!
//! A connection is idle, busy or shed, and counts the requests it began, all in one atomic
//! word; the change from idle to busy (a request begins) and from idle to shed are
//! compare-and-swaps on it, so a request never begins on a connection being shed, and a
//! connection is never shed mid-request. Leases are only taken during a request, so a
//! connection seen idle and without a lease is shed only if no request began since it was
//! seen: one that leased something in between is never the one closed.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use tokio::sync::Notify;

use crate::store::ClientId;

/// Which limit refused a connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// `limits.max_connections`, with every connection leased or busy.
    #[error(
        "packd has {open} data-plane connections open, its limit (limits.max_connections), and each \
         holds a lease or is busy; try again later"
    )]
    Global {
        /// Connections open.
        open: usize,
    },
    /// `limits.max_connections_per_uid`, with every connection of the uid leased or busy.
    #[error(
        "uid {uid} has {open} data-plane connections open, the per-uid limit \
         (limits.max_connections_per_uid), and each holds a lease or is busy; share connections or close some"
    )]
    PerUid {
        /// The uid.
        uid: u32,
        /// Its connections open.
        open: usize,
    },
}

/// Why a connection was shed, sent to it as its last frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ShedReason {
    /// Its uid reached `limits.max_connections_per_uid`.
    #[error(
        "closed to admit a newer connection of uid {uid} at the per-uid limit (limits.max_connections_per_uid): \
         this was its oldest connection with no lease and no request in flight; reconnect when needed"
    )]
    PerUid {
        /// The uid.
        uid: u32,
    },
    /// The daemon reached `limits.max_connections`.
    #[error(
        "closed to admit a newer connection at the limit (limits.max_connections): this was the oldest \
         connection with no lease and no request in flight; reconnect when needed"
    )]
    Global,
}

/// The low bits of a connection's state word: what it does.
const DOING: u64 = 0b11;
/// Waiting for a request.
const IDLE: u64 = 0;
/// Answering one.
const BUSY: u64 = 1;
/// Shed at the per-uid limit; closes at its next turn.
const SHED_PER_UID: u64 = 2;
/// Shed at the global limit; closes at its next turn.
const SHED_GLOBAL: u64 = 3;
/// One request begun, in the state word's count (the bits above [`DOING`]).
const ONE_REQUEST: u64 = DOING + 1;

/// The state of one admitted connection shared between its task and admission.
#[derive(Debug)]
pub struct Tracked {
    uid: u32,
    /// What it does ([`DOING`] bits) and how many requests it began (the rest).
    state: AtomicU64,
    /// Set once the store has registered the connection.
    client: OnceLock<ClientId>,
    /// Wakes the connection's task when it is shed.
    shed: Notify,
}

impl Tracked {
    /// Sheds the connection if its state is still `seen` (idle, and no request begun since).
    fn try_shed(&self, seen: u64, reason: ShedReason) -> bool {
        let shed = match reason {
            ShedReason::PerUid { .. } => SHED_PER_UID,
            ShedReason::Global => SHED_GLOBAL,
        };
        self.state.compare_exchange(seen, shed, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    /// Why it was shed, if it was.
    fn shed_reason(&self) -> Option<ShedReason> {
        match self.state.load(Ordering::Acquire) & DOING {
            SHED_PER_UID => Some(ShedReason::PerUid { uid: self.uid }),
            SHED_GLOBAL => Some(ShedReason::Global),
            _ => None,
        }
    }
}

/// Open connections, in order of arrival.
#[derive(Debug, Default)]
struct Book {
    by_id: BTreeMap<u64, Arc<Tracked>>,
    per_uid: HashMap<u32, usize>,
}

/// Counts of open connections.
#[derive(Debug)]
pub struct Admission {
    max: usize,
    max_per_uid: usize,
    next_id: AtomicU64,
    book: Mutex<Book>,
    shed_count: AtomicU64,
    refused_count: AtomicU64,
}

/// One admitted connection; dropping it frees the slot.
#[derive(Debug)]
pub struct Slot {
    admission: Arc<Admission>,
    id: u64,
    tracked: Arc<Tracked>,
}

impl Admission {
    /// Admission with these limits.
    pub fn new(max: usize, max_per_uid: usize) -> Arc<Self> {
        Arc::new(Self {
            max,
            max_per_uid,
            next_id: AtomicU64::new(1),
            book: Mutex::new(Book::default()),
            shed_count: AtomicU64::new(0),
            refused_count: AtomicU64::new(0),
        })
    }

    fn book(&self) -> MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes a slot for a connection of `uid`. At a limit, sheds the oldest idle connection
    /// without a lease (`holds_lease` says which hold one) — of `uid` first, then of
    /// anyone at the global limit — or says which limit refuses.
    pub fn admit(self: &Arc<Self>, uid: u32, holds_lease: impl Fn(ClientId) -> bool) -> Result<Slot, Refusal> {
        let mut book = self.book();
        let mine = book.per_uid.get(&uid).copied().unwrap_or(0);
        if mine >= self.max_per_uid {
            if !self.shed_oldest(&mut book, Some(uid), ShedReason::PerUid { uid }, &holds_lease) {
                return Err(Refusal::PerUid { uid, open: mine });
            }
        } else if book.by_id.len() >= self.max
            && !self.shed_oldest(&mut book, Some(uid), ShedReason::Global, &holds_lease)
            && !self.shed_oldest(&mut book, None, ShedReason::Global, &holds_lease)
        {
            return Err(Refusal::Global { open: book.by_id.len() });
        }
        Ok(self.enter(&mut book, uid))
    }

    /// Takes a slot for a connection of `uid` if both limits have room, or says which limit
    /// refuses; never sheds another connection. For connections that cannot be told why
    /// they would be closed (the control plane's: gRPC over HTTP/2). A `reserved` one (an
    /// admin's) is held to its uid's limit only, so operators can look at a daemon whose
    /// global limit others filled; it still counts towards that limit.
    pub fn admit_if_room(self: &Arc<Self>, uid: u32, reserved: bool) -> Result<Slot, Refusal> {
        let mut book = self.book();
        let mine = book.per_uid.get(&uid).copied().unwrap_or(0);
        if mine >= self.max_per_uid {
            return Err(Refusal::PerUid { uid, open: mine });
        }
        if book.by_id.len() >= self.max && !reserved {
            return Err(Refusal::Global { open: book.by_id.len() });
        }
        Ok(self.enter(&mut book, uid))
    }

    /// Books a new connection of `uid`.
    fn enter(self: &Arc<Self>, book: &mut Book, uid: u32) -> Slot {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let tracked =
            Arc::new(Tracked { uid, state: AtomicU64::new(IDLE), client: OnceLock::new(), shed: Notify::new() });
        book.by_id.insert(id, Arc::clone(&tracked));
        *book.per_uid.entry(uid).or_insert(0) += 1;
        Slot { admission: Arc::clone(self), id, tracked }
    }

    /// Sheds the oldest idle, lease-free connection (of `uid` if given) and takes it out of
    /// the book at once, so its slot is free for the newcomer; its task closes it.
    fn shed_oldest(
        &self,
        book: &mut Book,
        uid: Option<u32>,
        reason: ShedReason,
        holds_lease: &impl Fn(ClientId) -> bool,
    ) -> bool {
        let victim = book.by_id.iter().find_map(|(&id, t)| {
            // Seen first, leases looked at second: the swap fails if a request began since.
            let seen = t.state.load(Ordering::Acquire);
            let candidate = uid.is_none_or(|u| t.uid == u)
                && seen & DOING == IDLE
                && t.client.get().is_none_or(|&c| !holds_lease(c));
            (candidate && t.try_shed(seen, reason)).then_some(id)
        });
        let Some(id) = victim else { return false };
        if let Some(t) = book.by_id.remove(&id) {
            forget_uid(&mut book.per_uid, t.uid);
            t.shed.notify_one();
        }
        self.shed_count.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Connections shed to admit newer ones since start-up.
    pub fn shed_count(&self) -> u64 {
        self.shed_count.load(Ordering::Relaxed)
    }

    /// Counts a connection refused (at a connection limit, or by the allow lists).
    pub fn count_refused(&self) {
        self.refused_count.fetch_add(1, Ordering::Relaxed);
    }

    /// Connections refused since start-up.
    pub fn refused_count(&self) -> u64 {
        self.refused_count.load(Ordering::Relaxed)
    }

    /// Connections open now (shed ones no longer count).
    pub fn open(&self) -> usize {
        self.book().by_id.len()
    }
}

fn forget_uid(per_uid: &mut HashMap<u32, usize>, uid: u32) {
    if let Some(n) = per_uid.get_mut(&uid) {
        *n -= 1;
        if *n == 0 {
            per_uid.remove(&uid);
        }
    }
}

impl Slot {
    /// Records the store's id of this connection, so its leases can be looked up.
    pub fn set_client(&self, client: ClientId) {
        let _ = self.tracked.client.set(client);
    }

    /// A request begins; `Err` with the reason if the connection was shed first.
    pub fn begin_request(&self) -> Result<(), ShedReason> {
        let state = &self.tracked.state;
        let mut now = state.load(Ordering::Acquire);
        // Only this connection's task moves it out of idle or busy; admission only sheds.
        while now & DOING == IDLE {
            let busy = (now & !DOING).wrapping_add(ONE_REQUEST) | BUSY;
            match state.compare_exchange(now, busy, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Ok(()),
                Err(actual) => now = actual,
            }
        }
        Err(self.shed_reason())
    }

    /// The request is answered; the connection is idle again (its count kept).
    pub fn end_request(&self) {
        let state = &self.tracked.state;
        let now = state.load(Ordering::Acquire);
        if now & DOING == BUSY {
            // Nothing else changes a busy connection's state.
            let _ = state.compare_exchange(now, (now & !DOING) | IDLE, Ordering::AcqRel, Ordering::Acquire);
        }
    }

    /// Resolves when the connection is shed (at once if it already was).
    pub async fn shed(&self) -> ShedReason {
        self.tracked.shed.notified().await;
        self.shed_reason()
    }

    fn shed_reason(&self) -> ShedReason {
        self.tracked.shed_reason().unwrap_or(ShedReason::Global)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut book = self.admission.book();
        // A shed connection has left the book already.
        if book.by_id.remove(&self.id).is_some() {
            forget_uid(&mut book.per_uid, self.tracked.uid);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NO_LEASES: fn(ClientId) -> bool = |_| false;

    #[test]
    fn limits_are_global_and_per_uid_and_slots_come_back() {
        let a = Admission::new(3, 2);
        let s1 = a.admit(1, NO_LEASES).unwrap();
        let s2 = a.admit(1, NO_LEASES).unwrap();
        s1.begin_request().unwrap();
        s2.begin_request().unwrap();
        assert_eq!(a.admit(1, NO_LEASES).unwrap_err(), Refusal::PerUid { uid: 1, open: 2 });
        let s3 = a.admit(2, NO_LEASES).unwrap();
        s3.begin_request().unwrap();
        assert_eq!(a.admit(3, NO_LEASES).unwrap_err(), Refusal::Global { open: 3 });
        drop(s1);
        assert_eq!(a.open(), 2);
        let _s4 = a.admit(1, NO_LEASES).unwrap();
        assert_eq!((a.open(), a.shed_count()), (3, 0));
    }

    #[test]
    fn at_the_per_uid_limit_the_oldest_idle_connection_without_a_lease_is_shed() {
        let a = Admission::new(10, 3);
        let leased = a.admit(7, NO_LEASES).unwrap();
        leased.set_client(100);
        let busy = a.admit(7, NO_LEASES).unwrap();
        busy.begin_request().unwrap();
        let idle = a.admit(7, NO_LEASES).unwrap();
        let holds = |c: ClientId| c == 100;
        // The leased one is older, the busy one too: the idle one goes.
        let newcomer = a.admit(7, holds).unwrap();
        assert_eq!(idle.begin_request(), Err(ShedReason::PerUid { uid: 7 }));
        assert_eq!((a.open(), a.shed_count()), (3, 1));
        // Now nothing of uid 7 can go: refused, and nobody else is touched.
        newcomer.begin_request().unwrap();
        assert_eq!(a.admit(7, holds).unwrap_err(), Refusal::PerUid { uid: 7, open: 3 });
        assert!(leased.begin_request().is_ok() && busy.begin_request().is_err());
        drop(idle);
        assert_eq!(a.open(), 3, "a shed slot is not given back twice");
    }

    #[test]
    fn at_the_global_limit_the_newcomers_uid_goes_first_then_the_oldest_of_anyone() {
        let a = Admission::new(3, 10);
        let other = a.admit(1, NO_LEASES).unwrap();
        let mine = a.admit(2, NO_LEASES).unwrap();
        let third = a.admit(3, NO_LEASES).unwrap();
        let _n1 = a.admit(2, NO_LEASES).unwrap();
        assert_eq!(mine.begin_request(), Err(ShedReason::Global));
        assert!(other.begin_request().is_ok(), "another uid's older connection stays while the newcomer's own can go");
        let _n2 = a.admit(5, NO_LEASES).unwrap();
        assert_eq!(third.begin_request(), Err(ShedReason::Global));
        assert_eq!(a.shed_count(), 2);
    }

    #[test]
    fn admit_if_room_refuses_at_either_limit_and_sheds_nobody() {
        let a = Admission::new(3, 2);
        let first = a.admit_if_room(1, false).unwrap();
        let _second = a.admit_if_room(1, false).unwrap();
        assert_eq!(a.admit_if_room(1, false).unwrap_err(), Refusal::PerUid { uid: 1, open: 2 });
        let _other = a.admit_if_room(2, false).unwrap();
        assert_eq!(a.admit_if_room(3, false).unwrap_err(), Refusal::Global { open: 3 });
        assert_eq!((a.open(), a.shed_count()), (3, 0));
        assert!(first.begin_request().is_ok(), "an idle connection is never shed");
        first.end_request();
        drop(first);
        let _back = a.admit_if_room(1, false).unwrap();
        assert_eq!(a.open(), 3);
        // A reserved connection passes the global limit, not its uid's; it counts.
        let admin = a.admit_if_room(0, true).unwrap();
        let _admin2 = a.admit_if_room(0, true).unwrap();
        assert_eq!(a.admit_if_room(0, true).unwrap_err(), Refusal::PerUid { uid: 0, open: 2 });
        assert_eq!(a.open(), 5);
        drop(admin);
        assert_eq!(a.admit_if_room(4, false).unwrap_err(), Refusal::Global { open: 4 });
    }

    #[test]
    fn a_request_never_begins_on_a_shed_connection_nor_is_a_busy_one_shed() {
        let a = Admission::new(1, 1);
        let s = a.admit(1, NO_LEASES).unwrap();
        s.begin_request().unwrap();
        assert!(a.admit(1, NO_LEASES).is_err());
        s.end_request();
        let _n = a.admit(1, NO_LEASES).unwrap();
        assert!(s.begin_request().is_err());
        s.end_request(); // harmless: a shed connection stays shed
        assert!(s.begin_request().is_err());
    }

    #[test]
    fn a_connection_that_began_a_request_since_it_was_seen_is_not_shed() {
        let a = Admission::new(10, 10);
        let s = a.admit(1, NO_LEASES).unwrap();
        // Seen idle without a lease; then it begins (and may lease in) a request.
        let seen = s.tracked.state.load(Ordering::Acquire);
        s.begin_request().unwrap();
        s.end_request();
        assert!(!s.tracked.try_shed(seen, ShedReason::PerUid { uid: 1 }), "a request began since it was seen");
        assert_eq!(s.tracked.shed_reason(), None);
        // Shed for the reason of the swap that won, not of one that failed before.
        assert!(s.tracked.try_shed(s.tracked.state.load(Ordering::Acquire), ShedReason::Global));
        assert_eq!(s.begin_request(), Err(ShedReason::Global));
    }
}
