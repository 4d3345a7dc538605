//! Per-uid quotas: leases held at once, and bytes of segments in the index that a uid's
//! data-plane requests caused to be packed. Connections per uid are limited by the data
//! plane's admission. A request over a quota fails with `RESOURCE_EXHAUSTED` naming it.

use std::collections::HashMap;

use super::{Inner, QuotaError, Store};

/// The quotas in effect (see `limits.max_leases_per_uid`, `limits.max_packed_bytes_per_uid`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quotas {
    /// Leases one uid may hold at once, over all its connections.
    pub leases_per_uid: u64,
    /// Bytes (as charged to the budget) of segments in the index packed at one uid's
    /// request; `u64::MAX` for none beyond the budget.
    pub packed_bytes_per_uid: u64,
    /// Builder roles of published segments one connection may hold at once.
    pub builds_per_connection: u64,
    /// Builder roles one uid may hold at once, over all its connections.
    pub builds_per_uid: u64,
    /// Models one connection's reports are kept for (`limits.max_reports_per_connection`).
    pub reports_per_connection: usize,
}

impl Default for Quotas {
    fn default() -> Self {
        Self {
            leases_per_uid: u64::MAX,
            packed_bytes_per_uid: u64::MAX,
            builds_per_connection: u64::MAX,
            builds_per_uid: u64::MAX,
            reports_per_connection: 64,
        }
    }
}

/// Per-uid usage.
#[derive(Default)]
pub(super) struct Usage {
    pub(super) leases: HashMap<u32, u64>,
    pub(super) packed: HashMap<u32, u64>,
}

fn add(map: &mut HashMap<u32, u64>, uid: u32, n: u64) {
    *map.entry(uid).or_insert(0) += n;
}

fn sub(map: &mut HashMap<u32, u64>, uid: u32, n: u64) {
    if let Some(v) = map.get_mut(&uid) {
        *v = v.saturating_sub(n);
        if *v == 0 {
            map.remove(&uid);
        }
    }
}

impl Usage {
    pub(super) fn add_leases(&mut self, uid: u32, n: u64) {
        add(&mut self.leases, uid, n);
    }

    pub(super) fn sub_leases(&mut self, uid: u32, n: u64) {
        sub(&mut self.leases, uid, n);
    }

    pub(super) fn add_packed(&mut self, uid: u32, n: u64) {
        add(&mut self.packed, uid, n);
    }

    pub(super) fn sub_packed(&mut self, uid: u32, n: u64) {
        sub(&mut self.packed, uid, n);
    }
}

impl Inner {
    /// Whether `uid` may hold one more lease.
    pub(super) fn lease_allowed(&self, uid: u32) -> Result<(), QuotaError> {
        let held = self.usage.leases.get(&uid).copied().unwrap_or(0);
        if held >= self.quotas.leases_per_uid { Err(QuotaError::Leases { uid, held }) } else { Ok(()) }
    }

    /// Whether `owner` may have `needed` more bytes packed: its segments in the index and
    /// its jobs' reservations, plus `needed`, within its quota.
    pub(super) fn packed_allowed(&self, owner: Option<u32>, needed: u64) -> Result<(), QuotaError> {
        let Some(uid) = owner else { return Ok(()) };
        let used = self.usage.packed.get(&uid).copied().unwrap_or(0);
        let quota = self.quotas.packed_bytes_per_uid;
        if used.saturating_add(needed) > quota {
            return Err(QuotaError::PackedBytes { uid, needed, used, quota });
        }
        Ok(())
    }
}

impl Store {
    /// Sets the quotas (at start; they apply to later requests).
    pub fn set_quotas(&self, quotas: Quotas) {
        self.lock().quotas = quotas;
    }

    /// Leases `uid` holds now, over all its connections.
    pub fn leases_of(&self, uid: u32) -> u64 {
        self.lock().usage.leases.get(&uid).copied().unwrap_or(0)
    }
}
