//! Single flight: concurrent requests for one segment key cause one pack job. The first
//! becomes its [`Leader`]; the others wait on its [`Flight`] and share its outcome. A job
//! that fails, is aborted or whose leader vanishes leaves nothing in the index.

use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::watch;

use super::{Adopted, Reservation, Segment, Store, charge};
use crate::key::{FileFlight, FlightKey, SegmentKey};
use crate::pack::{PackError, Packed};
use crate::source::{Digest, SourceError};
use crate::store::QuotaError;

/// Why a pack job produced no segment: the job itself failed, or the budget or a quota
/// refused its reservation. Shared by every request waiting on the job.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// Packing failed (the source, the plan, the memfd).
    #[error(transparent)]
    Pack(#[from] PackError),
    /// The budget or a per-uid quota refused the job's bytes.
    #[error(transparent)]
    Quota(#[from] QuotaError),
    /// The job's leader went before the job ran (its request was dropped while it waited
    /// for a slot of the source pool, or its uid's slots did not come): nothing is wrong
    /// with the source. A request waiting on such a flight looks the key up again and leads the
    /// job itself (see `service::pack_source`).
    #[error("the pack job was abandoned before it ran (its requester left, or its uid's source slots stayed busy)")]
    Abandoned,
}

impl JobError {
    /// The job was stopped before it finished (`why` says by what).
    pub fn stopped(why: &'static str) -> Self {
        JobError::Pack(PackError::Source(SourceError::Stopped(why)))
    }
}

/// Outcome of a pack job as seen by everyone waiting on it.
pub type FlightResult = Result<Arc<Segment>, Arc<JobError>>;

/// A receiver that yields the pack job's outcome once it is known.
pub type Flight = watch::Receiver<Option<FlightResult>>;

/// What a lookup found.
pub enum Lookup {
    /// The segment is packed.
    Ready(Arc<Segment>),
    /// A pack job for it is running; wait on the flight.
    Wait(Flight),
    /// Nobody packs it yet: the caller must run the job and hand the result to [`Leader::finish`].
    Lead(Leader),
}

/// What a lookup for a source of unknown digest found ([`Store::lookup_or_lead_new`]).
pub enum NewSource {
    /// Nobody packs this file yet: the caller leads its job.
    Lead(Leader),
    /// This file's job is running; wait on it.
    Wait(Flight),
    /// Another file of the same size is being packed for the first time (with the same
    /// plan): wait for it, then look again by digest.
    Sibling(Flight),
}

/// A finished pack job, ready to enter the index.
pub struct Finished {
    /// The segment's key, when it is not the flight's: a job started before its source's
    /// digest was known runs under a flight named after the file and learns its key at
    /// the end.
    pub key: Option<SegmentKey>,
    /// The sealed segment.
    pub packed: Packed,
    /// Source digest.
    pub source: Digest,
    /// Canonical plan.
    pub plan: String,
    /// How long the job took, in milliseconds.
    pub pack_ms: f64,
    /// Display label of the request that started the job.
    pub label: String,
    /// The budget reservation the job made for it (and the uid whose quota the segment
    /// counts against: [`Reservation::owner`]).
    pub reservation: Reservation,
}

/// The sending side of a flight, shared by its [`Leader`] and its [`FlightAbort`] handles:
/// whoever takes it first decides the outcome.
type FlightSender = Arc<Mutex<Option<watch::Sender<Option<FlightResult>>>>>;

/// Obligation to finish a pack job. Dropping it unfinished ends the flight with
/// [`JobError::Abandoned`], which tells its waiters to look again.
pub struct Leader {
    store: Arc<Store>,
    key: FlightKey,
    tx: FlightSender,
    /// The job began ([`Leader::start`]): dropped unfinished now, it failed (a panic),
    /// rather than being abandoned before it ran.
    started: bool,
}

/// A handle that fails a running pack job's flight from outside the job: when its source
/// stopped answering, or nobody waits for it any more. The job's thread may still run; its
/// result is then discarded (nothing enters the index, its reservation is given back).
#[derive(Clone)]
pub struct FlightAbort {
    store: Arc<Store>,
    key: FlightKey,
    tx: FlightSender,
}

fn lock_tx(tx: &FlightSender) -> MutexGuard<'_, Option<watch::Sender<Option<FlightResult>>>> {
    tx.lock().unwrap_or_else(|p| p.into_inner())
}

/// Fails the flight `key` with `err` unless it already ended; true if this call ended it.
/// With `unless_waited`, a flight that any request waits for is left running (the caller
/// has dropped its own receiver): the count is read under the store lock, which every
/// request joining a flight holds while it subscribes, so no request can join between the
/// check and the abort.
fn fail_flight(store: &Store, key: &FlightKey, tx: &FlightSender, err: JobError, unless_waited: bool) -> bool {
    let mut tx = lock_tx(tx);
    let mut inner = store.lock();
    let Some(sender) = tx.as_ref() else { return false };
    // The index holds one receiver; any other is a waiting request.
    if unless_waited && sender.receiver_count() > 1 {
        return false;
    }
    let Some(sender) = tx.take() else { return false };
    drop(tx);
    inner.flights.remove(key);
    if matches!(err, JobError::Abandoned) {
        // Never ran: not a pack job, nor a failed one (its waiters lead one of their own).
        inner.counters.pack_jobs = inner.counters.pack_jobs.saturating_sub(1);
    } else {
        inner.counters.pack_failures += 1;
    }
    drop(inner);
    sender.send_replace(Some(Err(Arc::new(err))));
    true
}

impl Leader {
    /// The segment key being packed.
    pub fn key(&self) -> &FlightKey {
        &self.key
    }

    /// Marks the job as begun: from now on, dropping this leader unfinished fails the
    /// flight (the job went wrong) instead of abandoning it for a waiter to run again.
    pub fn start(&mut self) {
        self.started = true;
    }

    /// The store, to reserve budget for the job.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// A handle that can fail this job's flight from outside.
    pub fn abort_handle(&self) -> FlightAbort {
        FlightAbort { store: Arc::clone(&self.store), key: self.key.clone(), tx: Arc::clone(&self.tx) }
    }

    /// Publishes the job's result: inserts the segment into the index (on success) and wakes
    /// every waiter. If the flight was aborted meanwhile, the result is discarded.
    pub fn finish(self, result: Result<Finished, JobError>) -> FlightResult {
        let mut tx = lock_tx(&self.tx);
        let Some(sender) = tx.take() else {
            drop(tx);
            // Dropping `result` gives its reservation back and closes its memfd.
            return Err(Arc::new(JobError::stopped("the pack job was aborted before it finished")));
        };
        let outcome = self.store.complete(&self.key, result);
        sender.send_replace(Some(outcome.clone()));
        outcome
    }
}

impl Drop for Leader {
    fn drop(&mut self) {
        let err = if self.started {
            JobError::stopped("the pack job ended without a result (a fault inside packd)")
        } else {
            JobError::Abandoned
        };
        fail_flight(&self.store, &self.key, &self.tx, err, false);
    }
}

impl FlightAbort {
    /// Fails the flight with `err` (if it is still running); true if this call ended it.
    pub fn abort(&self, err: JobError) -> bool {
        fail_flight(&self.store, &self.key, &self.tx, err, false)
    }

    /// Fails the flight with `err` only if no request waits for it (drop your own
    /// receiver first); true if this call ended it. Used when the leader's requester leaves.
    pub fn abort_unless_waited(&self, err: JobError) -> bool {
        fail_flight(&self.store, &self.key, &self.tx, err, true)
    }

    /// A receiver for the flight's outcome (for the leader's requester).
    pub fn subscribe(&self) -> Option<Flight> {
        lock_tx(&self.tx).as_ref().map(watch::Sender::subscribe)
    }
}

impl Store {
    /// Finds the segment `key`, joins its pack job, or makes the caller the job's leader.
    pub fn lookup_or_lead(self: &Arc<Self>, key: &SegmentKey) -> Lookup {
        let mut inner = self.lock();
        if let Some(seg) = inner.by_key.get(key).copied().and_then(|id| inner.touch(id)) {
            inner.counters.hits += 1;
            return Lookup::Ready(seg);
        }
        let flight = FlightKey::Segment(key.clone());
        if let Some(flight) = inner.flights.get(&flight).cloned() {
            inner.counters.hits += 1;
            return Lookup::Wait(flight);
        }
        Lookup::Lead(self.lead(inner, flight))
    }

    /// For a source whose digest is unknown, under the flight name `flight`: joins its
    /// pack job, or reports another running flight whose name starts with `siblings` (a
    /// file that may hold the same bytes), or makes the caller the job's leader, all under
    /// one lock, so two copies arriving together see each other.
    pub fn lookup_or_lead_new(self: &Arc<Self>, flight: &FileFlight, siblings: &str) -> NewSource {
        let mut inner = self.lock();
        let flight = FlightKey::File(flight.clone());
        if let Some(f) = inner.flights.get(&flight).cloned() {
            inner.counters.hits += 1;
            return NewSource::Wait(f);
        }
        let sibling =
            inner.flights.iter().find(|(k, _)| matches!(k, FlightKey::File(f) if f.as_str().starts_with(siblings)));
        if let Some(f) = sibling.map(|(_, f)| f.clone()) {
            return NewSource::Sibling(f);
        }
        NewSource::Lead(self.lead(inner, flight))
    }

    /// Opens the flight `key` with the caller as its leader.
    fn lead(self: &Arc<Self>, mut inner: super::Locked<'_>, key: FlightKey) -> Leader {
        let (tx, rx) = watch::channel(None);
        inner.flights.insert(key.clone(), rx);
        inner.counters.misses += 1;
        inner.counters.pack_jobs += 1;
        Leader { store: Arc::clone(self), key, tx: Arc::new(Mutex::new(Some(tx))), started: false }
    }

    /// Ends the flight `flight` with `result`: enters the segment into the index under its
    /// key, unless a segment with that key is there already (the same bytes, packed for
    /// another file or by another plan spelling): then that one is served and this one
    /// dropped, its reservation given back.
    fn complete(&self, flight: &FlightKey, result: Result<Finished, JobError>) -> FlightResult {
        let built = result.and_then(|done| {
            // A job under a file's flight learns its segment key; one under a segment's
            // flight makes that segment.
            let key = match (done.key, flight) {
                (Some(key), _) => key,
                (None, FlightKey::Segment(key)) => key.clone(),
                (None, FlightKey::File(_)) => {
                    return Err(JobError::stopped("a file's pack job ended without its segment key"));
                }
            };
            let adopted = Adopted {
                file: done.packed.file,
                key,
                size: done.packed.size,
                source: done.source,
                plan: done.plan,
                entries: done.packed.entries,
                publisher: None,
                label: done.label,
            };
            let charged = charge(&adopted);
            Ok((self.build(adopted, charged), done.pack_ms, done.reservation))
        });
        let mut inner = self.lock();
        inner.flights.remove(flight);
        match built {
            Ok((seg, _, reservation)) if inner.by_key.contains_key(&seg.key) => {
                reservation.settle(&mut inner);
                let existing = inner.by_key.get(&seg.key).copied().and_then(|id| inner.touch(id));
                inner.counters.duplicates_dropped += 1;
                existing.ok_or_else(|| Arc::new(JobError::stopped("the segment it duplicates went meanwhile")))
            }
            Ok((seg, pack_ms, reservation)) => {
                inner.insert(Arc::clone(&seg), pack_ms, reservation.owner());
                inner.counters.pack_seconds += pack_ms / 1e3;
                // The reservation becomes resident bytes under the same lock.
                reservation.settle(&mut inner);
                inner.emit_new(&seg);
                Ok(seg)
            }
            Err(e) => {
                inner.counters.pack_failures += 1;
                Err(Arc::new(e))
            }
        }
    }
}
