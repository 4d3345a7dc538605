//! The spare: one memfd allocated ahead of the next pack job, so that the job writes into
//! pages that exist instead of allocating fresh shared memory on its critical path.
//!
//! Its bytes count against the budget like a reservation, but it is the first thing to go:
//! a reservation, a budget change or a persisted segment that needs its room drops it
//! before any segment is evicted, and it is made again only when it fits beside everything
//! resident and reserved. A refill claims its bytes before allocating them (so two refills
//! never overlap and the budget sees them at once); dropping a claim while its memory is
//! being allocated makes the refill throw that memory away.

use crate::sys::memfd::Prepared;

use super::{Inner, Store};

/// The spare's state in the store, under the store's lock.
#[derive(Default)]
pub(super) struct SpareSlot {
    /// The memory, once a refill has allocated it.
    ready: Option<Prepared>,
    /// Bytes claimed (a refill under way or `ready`), counted against the budget.
    claimed: u64,
    /// Changes whenever a claim ends: a refill whose claim ended keeps nothing.
    generation: u64,
    /// A dropped spare, freed after the lock is released (unmapping it takes a while).
    dropped: Option<Prepared>,
    /// Pack jobs that took the spare.
    pub(super) takes: u64,
}

/// A refill's right to allocate the spare's bytes ([`Store::claim_spare`]).
#[derive(Debug, PartialEq, Eq)]
pub struct SpareClaim {
    bytes: u64,
    generation: u64,
}

impl SpareClaim {
    /// Bytes to allocate.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl SpareSlot {
    /// Bytes counted against the budget (a spare ready or being made).
    pub(super) fn bytes(&self) -> u64 {
        self.claimed
    }

    /// Bytes of the spare ready for a job.
    pub(super) fn ready_bytes(&self) -> u64 {
        self.ready.as_ref().map_or(0, Prepared::size)
    }

    /// Ends the claim (and drops the memory, if any, once the lock is released).
    fn release(&mut self) {
        self.claimed = 0;
        self.generation += 1;
        if let Some(p) = self.ready.take() {
            self.dropped = Some(p);
        }
    }

    /// The dropped spare, to be freed outside the lock.
    pub(super) fn take_dropped(&mut self) -> Option<Prepared> {
        self.dropped.take()
    }
}

impl Inner {
    /// Drops the spare if `needed` more bytes would not fit beside it (before anything is
    /// evicted for them).
    pub(super) fn spare_yields_to(&mut self, needed: u64) {
        let over = self.resident_bytes() + self.reserved + self.spare.bytes() + needed > self.budget;
        if over && self.spare.bytes() > 0 {
            tracing::debug!(bytes = self.spare.bytes(), "spare dropped: the budget needs its room");
            self.spare.release();
        }
    }
}

impl Store {
    /// Claims `bytes` for a new spare when there is none, no refill is under way, and the
    /// bytes fit beside everything resident and reserved (nothing is evicted for a spare).
    pub fn claim_spare(&self, bytes: u64) -> Option<SpareClaim> {
        let mut inner = self.lock();
        let free = inner.budget.saturating_sub(inner.resident_bytes() + inner.reserved);
        if bytes == 0 || inner.spare.claimed > 0 || bytes > free {
            return None;
        }
        inner.spare.claimed = bytes;
        Some(SpareClaim { bytes, generation: inner.spare.generation })
    }

    /// Gives the memory allocated for `claim`, or the claim's failure, back to the store.
    /// Returns whether it was kept (false: the claim was dropped meanwhile, and so is it).
    pub fn fill_spare(&self, claim: SpareClaim, memory: Option<Prepared>) -> bool {
        let mut inner = self.lock();
        let current = inner.spare.generation == claim.generation && inner.spare.claimed == claim.bytes;
        match memory {
            Some(p) if current => {
                inner.spare.ready = Some(p);
                true
            }
            Some(p) => {
                inner.spare.dropped = Some(p);
                false
            }
            None => {
                if current {
                    inner.spare.release();
                }
                false
            }
        }
    }

    /// Takes the spare for a pack job, if one is ready; its bytes leave the budget's count
    /// (the job reserves its own next).
    pub fn take_spare(&self) -> Option<Prepared> {
        let mut inner = self.lock();
        let p = inner.spare.ready.take()?;
        inner.spare.release();
        inner.spare.takes += 1;
        Some(p)
    }
}
