//! What a lent memfd's thread is told, by the builder that claims it ([`super::lend`]) and
//! by the budget that takes its room back ([`super::budget`]).
#![forbid(unsafe_code)]

use std::sync::{Condvar, Mutex};
use std::time::Instant;

/// What a lend's thread is told: claimed by a builder, taken back, or no longer wanted.
#[derive(Default)]
pub struct Signal {
    told: Mutex<Told>,
    cv: Condvar,
}

#[derive(Default)]
struct Told {
    wanted: bool,
    revoked: bool,
    cancelled: bool,
    expired: bool,
    /// The thread ended without the memfd (its allocation failed or was given up).
    ended: bool,
    claim_by: Option<Instant>,
}

/// Why a lend's thread stopped without handing its memfd over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stop {
    Revoked,
    Cancelled,
    Expired,
}

impl Signal {
    fn tell(&self, f: impl FnOnce(&mut Told)) {
        f(&mut self.told.lock().unwrap_or_else(|p| p.into_inner()));
        self.cv.notify_all();
    }

    /// The budget took the lend's room back (under the store's lock: never blocks long).
    pub(super) fn revoke(&self) {
        self.tell(|t| t.revoked = true);
    }

    pub(super) fn want(&self) {
        self.tell(|t| t.wanted = true);
    }

    pub(super) fn cancel(&self) {
        self.tell(|t| t.cancelled = true);
    }

    /// The lend's thread ended without a memfd to hand over.
    pub(super) fn ended(&self) {
        self.tell(|t| t.ended = true);
    }

    pub(super) fn claim_by(&self, at: Instant) {
        self.tell(|t| t.claim_by = Some(t.claim_by.map_or(at, |old| old.min(at))));
    }

    /// Whether the budget took the lend's room back.
    #[cfg(test)]
    pub(super) fn is_revoked(&self) -> bool {
        self.told.lock().unwrap_or_else(|p| p.into_inner()).revoked
    }

    /// Why to stop allocating now, if so.
    pub(super) fn stopped(&self) -> Option<Stop> {
        let t = self.told.lock().unwrap_or_else(|p| p.into_inner());
        if t.revoked {
            Some(Stop::Revoked)
        } else if t.wanted {
            None
        } else if t.cancelled {
            Some(Stop::Cancelled)
        } else if t.expired || t.ended {
            Some(Stop::Expired)
        } else {
            None
        }
    }

    /// Waits until the lend is claimed (`Ok`) or is to be freed.
    pub(super) fn wait(&self) -> Result<(), Stop> {
        let mut t = self.told.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if t.revoked {
                return Err(Stop::Revoked);
            }
            if t.wanted {
                return Ok(());
            }
            if t.cancelled {
                return Err(Stop::Cancelled);
            }
            t = match t.claim_by {
                Some(at) => {
                    let now = Instant::now();
                    if now >= at {
                        t.expired = true;
                        return Err(Stop::Expired);
                    }
                    self.cv.wait_timeout(t, at - now).unwrap_or_else(|p| p.into_inner()).0
                }
                None => self.cv.wait(t).unwrap_or_else(|p| p.into_inner()),
            };
        }
    }
}
