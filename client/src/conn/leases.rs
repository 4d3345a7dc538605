//! The leases of the models this client holds: which segment each names on which
//! connection, the registry of them, and how a lease ends.

use std::sync::{Arc, Mutex, Weak};

use proto::request;

use super::lock::lock;
use crate::proto;

/// Held models' weak references are swept when their count reaches a power of two at
/// least this large, so the registry stays within twice the models alive.
const LEASE_SWEEP_FROM: usize = 32;

/// Which segment a lease names on which connection.
#[derive(Clone, Copy)]
pub(crate) struct LeaseIds {
    pub(super) segment_id: u64,
    pub(super) generation: u64,
    /// The connection (by count of connections made) the ids belong to.
    pub(super) epoch: u64,
}

/// A held model's lease, shared between its owner and the connection's registry.
pub(crate) struct LeaseCell {
    pub(super) key: String,
    pub(super) ids: Mutex<LeaseIds>,
}

/// What the leases ask of the connection that holds them: the registry, and a request
/// sent without waiting.
pub(crate) trait Leasing {
    /// The registry: a weak reference to every held model's lease.
    fn leases(&self) -> &Mutex<Vec<Weak<LeaseCell>>>;

    /// Sends a request that is not answered on the connection of `epoch` (any, with
    /// `None`) in one write that never waits (the connection's `notify`).
    fn notify(&self, body: request::Body, epoch: Option<u64>);

    /// Registers the lease the daemon counts for the segment `info` on connection `epoch`.
    fn lease(self: &Arc<Self>, info: &proto::SegmentReply, epoch: u64) -> Lease<Self>
    where
        Self: Sized,
    {
        let cell = Arc::new(LeaseCell {
            key: info.key.clone(),
            ids: Mutex::new(LeaseIds { segment_id: info.segment_id, generation: info.generation, epoch }),
        });
        let mut leases = lock(self.leases());
        if leases.len() >= LEASE_SWEEP_FROM && leases.len().is_power_of_two() {
            leases.retain(|w| w.strong_count() > 0);
        }
        leases.push(Arc::downgrade(&cell));
        Lease { conn: Arc::clone(self), cell }
    }

    /// Tells the daemon a lease ends (a lease of a lost connection needs no release: the
    /// daemon ended it with the connection). Takes only the write side for one write that
    /// never waits: not for another caller's reply, nor for a daemon that stopped reading.
    /// A release that cannot be written whole at once loses the connection instead (a
    /// closed connection releases every lease, and the next call leases held models again).
    fn release(&self, ids: LeaseIds) {
        let body =
            request::Body::Release(proto::ReleaseRequest { segment_id: ids.segment_id, generation: ids.generation });
        self.notify(body, Some(ids.epoch));
    }
}

/// A lease on a segment; dropping it tells the daemon without waiting for anything but
/// one small write.
pub(crate) struct Lease<C: Leasing> {
    conn: Arc<C>,
    cell: Arc<LeaseCell>,
}

impl<C: Leasing> Drop for Lease<C> {
    fn drop(&mut self) {
        let ids = *lock(&self.cell.ids);
        self.conn.release(ids);
    }
}
