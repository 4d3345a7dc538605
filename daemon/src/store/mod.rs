//! The store: key index, single flight, leases and counters.
//!
//! Plain synchronous logic behind one mutex; the async layers translate requests into calls
//! here and never hold the lock across an await. A pack job that fails leaves nothing in the
//! index. Leases belong to client connections and end on release or disconnect, never by a
//! timer.
#![forbid(unsafe_code)]

mod segment;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use tokio::sync::watch;

use crate::pack::{PackError, Packed};
use crate::source::Digest;
pub use segment::{Segment, SegmentId, segment_key};

/// Outcome of a pack job as seen by everyone waiting on it.
pub type FlightResult = Result<Arc<Segment>, Arc<PackError>>;

/// A receiver that yields the pack job's outcome once it is known.
pub type Flight = watch::Receiver<Option<FlightResult>>;

/// Connection id assigned by [`Store::connect`].
pub type ClientId = u64;

/// What a lookup found.
pub enum Lookup {
    /// The segment is packed.
    Ready(Arc<Segment>),
    /// A pack job for it is running; wait on the flight.
    Wait(Flight),
    /// Nobody packs it yet: the caller must run the job and hand the result to [`Leader::finish`].
    Lead(Leader),
}

/// Obligation to finish a pack job. Dropping it unfinished fails the job for all waiters.
pub struct Leader {
    store: Arc<Store>,
    key: String,
    tx: Option<watch::Sender<Option<FlightResult>>>,
}

impl Leader {
    /// The segment key being packed.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Publishes the job's result: inserts the segment into the index (on success) and wakes
    /// every waiter.
    pub fn finish(mut self, result: Result<(Packed, Digest, String), PackError>) -> FlightResult {
        let outcome = self.store.complete(&self.key, result);
        if let Some(tx) = self.tx.take() {
            tx.send_replace(Some(outcome.clone()));
        }
        outcome
    }
}

impl Drop for Leader {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            let mut inner = self.store.lock();
            inner.flights.remove(&self.key);
            inner.counters.pack_failures += 1;
            drop(inner);
            let err = PackError::Source(crate::source::SourceError::Changed("the pack job was abandoned".into()));
            tx.send_replace(Some(Err(Arc::new(err))));
        }
    }
}

/// Why a release was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReleaseError {
    /// The generation belongs to another daemon instance.
    #[error("segment {id} generation {got} is not this daemon's generation {want}")]
    Generation {
        /// Segment id.
        id: SegmentId,
        /// Generation sent.
        got: u64,
        /// This daemon's generation.
        want: u64,
    },
    /// The connection holds no lease on the segment.
    #[error("this connection holds no lease on segment {0}")]
    NotHeld(SegmentId),
}

#[derive(Default, Clone, Copy)]
struct Counters {
    pack_jobs: u64,
    pack_failures: u64,
    hits: u64,
    misses: u64,
    request_errors: u64,
}

struct ClientState {
    leases: HashMap<SegmentId, u64>,
}

#[derive(Default)]
struct Inner {
    next_segment: SegmentId,
    next_client: ClientId,
    segments: HashMap<SegmentId, Arc<Segment>>,
    by_key: HashMap<String, SegmentId>,
    by_entry: HashMap<String, SegmentId>,
    flights: HashMap<String, Flight>,
    clients: HashMap<ClientId, ClientState>,
    counters: Counters,
}

/// A consistent snapshot of the store's figures.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stats {
    /// Entries across all segments in the index.
    pub entries: u64,
    /// Segments in the index.
    pub segments: u64,
    /// Leases held (sum of refcounts).
    pub leases: u64,
    /// Connected clients.
    pub clients: u64,
    /// Pack jobs started.
    pub pack_jobs: u64,
    /// Pack jobs that failed.
    pub pack_failures: u64,
    /// Requests served by an existing or in-flight segment.
    pub hits: u64,
    /// Requests that started a pack job.
    pub misses: u64,
    /// Requests answered with an error.
    pub request_errors: u64,
    /// Bytes of all segments in the index.
    pub bytes_resident: u64,
    /// Seconds since the store was created.
    pub uptime_seconds: f64,
}

/// The store.
pub struct Store {
    inner: Mutex<Inner>,
    generation: u64,
    started: Instant,
}

impl Store {
    /// A new, empty store. `generation` distinguishes this daemon instance on the wire.
    pub fn new(generation: u64) -> Arc<Self> {
        Arc::new(Self {
            inner: Mutex::new(Inner { next_segment: 1, next_client: 1, ..Inner::default() }),
            generation,
            started: Instant::now(),
        })
    }

    /// This instance's generation.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain data behind; keep serving.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Finds the segment `key`, joins its pack job, or makes the caller the job's leader.
    pub fn lookup_or_lead(self: &Arc<Self>, key: &str) -> Lookup {
        let mut inner = self.lock();
        if let Some(seg) = inner.by_key.get(key).and_then(|id| inner.segments.get(id)).cloned() {
            inner.counters.hits += 1;
            return Lookup::Ready(seg);
        }
        if let Some(flight) = inner.flights.get(key).cloned() {
            inner.counters.hits += 1;
            return Lookup::Wait(flight);
        }
        let (tx, rx) = watch::channel(None);
        inner.flights.insert(key.to_string(), rx);
        inner.counters.misses += 1;
        inner.counters.pack_jobs += 1;
        Lookup::Lead(Leader { store: Arc::clone(self), key: key.to_string(), tx: Some(tx) })
    }

    /// Finds a segment by segment key or entry key, or the pack job producing it.
    pub fn get(&self, key: &str) -> Option<Lookup> {
        let mut inner = self.lock();
        let id = inner.by_key.get(key).or_else(|| inner.by_entry.get(key)).copied();
        if let Some(seg) = id.and_then(|id| inner.segments.get(&id)).cloned() {
            inner.counters.hits += 1;
            return Some(Lookup::Ready(seg));
        }
        let flight = inner.flights.get(key).cloned()?;
        inner.counters.hits += 1;
        Some(Lookup::Wait(flight))
    }

    fn complete(&self, key: &str, result: Result<(Packed, Digest, String), PackError>) -> FlightResult {
        let mut inner = self.lock();
        inner.flights.remove(key);
        match result {
            Ok((packed, source, plan)) => {
                let id = inner.next_segment;
                inner.next_segment += 1;
                let seg = Arc::new(Segment {
                    id,
                    key: key.to_string(),
                    file: packed.file,
                    size: packed.size,
                    source,
                    plan,
                    entries: packed.entries,
                });
                for e in &seg.entries {
                    inner.by_entry.insert(e.key.clone(), id);
                }
                inner.by_key.insert(key.to_string(), id);
                inner.segments.insert(id, Arc::clone(&seg));
                Ok(seg)
            }
            Err(e) => {
                inner.counters.pack_failures += 1;
                Err(Arc::new(e))
            }
        }
    }

    /// Registers a new client connection.
    pub fn connect(&self) -> ClientId {
        let mut inner = self.lock();
        let id = inner.next_client;
        inner.next_client += 1;
        inner.clients.insert(id, ClientState { leases: HashMap::new() });
        id
    }

    /// Drops a connection and every lease it held.
    pub fn disconnect(&self, client: ClientId) {
        self.lock().clients.remove(&client);
    }

    /// Records one more lease of `client` on `seg`.
    pub fn lease(&self, client: ClientId, seg: &Segment) {
        if let Some(c) = self.lock().clients.get_mut(&client) {
            *c.leases.entry(seg.id).or_insert(0) += 1;
        }
    }

    /// Drops one lease of `client` on segment `id` of generation `generation`.
    pub fn release(&self, client: ClientId, id: SegmentId, generation: u64) -> Result<(), ReleaseError> {
        if generation != self.generation {
            return Err(ReleaseError::Generation { id, got: generation, want: self.generation });
        }
        let mut inner = self.lock();
        let c = inner.clients.get_mut(&client).ok_or(ReleaseError::NotHeld(id))?;
        match c.leases.get_mut(&id) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                c.leases.remove(&id);
            }
            None => return Err(ReleaseError::NotHeld(id)),
        }
        Ok(())
    }

    /// Counts a request that was answered with an error.
    pub fn count_error(&self) {
        self.lock().counters.request_errors += 1;
    }

    /// A consistent snapshot of the figures.
    pub fn stats(&self) -> Stats {
        let inner = self.lock();
        let c = inner.counters;
        Stats {
            entries: inner.segments.values().map(|s| s.entries.len() as u64).sum(),
            segments: inner.segments.len() as u64,
            leases: inner.clients.values().flat_map(|c| c.leases.values()).sum(),
            clients: inner.clients.len() as u64,
            pack_jobs: c.pack_jobs,
            pack_failures: c.pack_failures,
            hits: c.hits,
            misses: c.misses,
            request_errors: c.request_errors,
            bytes_resident: inner.segments.values().map(|s| s.size).sum(),
            uptime_seconds: self.started.elapsed().as_secs_f64(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pack::Packed;

    fn packed() -> (Packed, Digest, String) {
        let file = crate::sys::memfd::create("t").unwrap();
        file.set_len(4096).unwrap();
        (Packed { file, size: 4096, entries: vec![] }, Digest([7; 32]), "p".into())
    }

    #[test]
    fn single_flight_then_hits() {
        let store = Store::new(9);
        let Lookup::Lead(leader) = store.lookup_or_lead("k") else { panic!("first lookup must lead") };
        let Lookup::Wait(mut flight) = store.lookup_or_lead("k") else { panic!("second must wait") };
        let seg = leader.finish(Ok(packed())).unwrap();
        assert_eq!(flight.borrow_and_update().as_ref().unwrap().as_ref().unwrap().id, seg.id);
        assert!(matches!(store.lookup_or_lead("k"), Lookup::Ready(_)));
        let s = store.stats();
        assert_eq!((s.pack_jobs, s.misses, s.hits, s.segments, s.bytes_resident), (1, 1, 2, 1, 4096));
    }

    #[test]
    fn abandoned_leader_fails_waiters_and_leaves_nothing() {
        let store = Store::new(1);
        let Lookup::Lead(leader) = store.lookup_or_lead("k") else { panic!() };
        let Lookup::Wait(flight) = store.lookup_or_lead("k") else { panic!() };
        drop(leader);
        assert!(flight.borrow().as_ref().unwrap().is_err());
        assert_eq!(store.stats().segments, 0);
        assert!(matches!(store.lookup_or_lead("k"), Lookup::Lead(_)));
    }

    #[test]
    fn leases_follow_connections() {
        let store = Store::new(5);
        let Lookup::Lead(leader) = store.lookup_or_lead("k") else { panic!() };
        let seg = leader.finish(Ok(packed())).unwrap();
        let (a, b) = (store.connect(), store.connect());
        store.lease(a, &seg);
        store.lease(a, &seg);
        store.lease(b, &seg);
        assert_eq!(store.stats().leases, 3);
        assert_eq!(store.release(a, seg.id, 4), Err(ReleaseError::Generation { id: seg.id, got: 4, want: 5 }));
        store.release(a, seg.id, 5).unwrap();
        assert_eq!(store.stats().leases, 2);
        store.disconnect(a);
        assert_eq!(store.stats().leases, 1);
        assert_eq!(store.release(a, seg.id, 5), Err(ReleaseError::NotHeld(seg.id)));
        assert_eq!(store.stats().clients, 1);
    }
}
