//! Client connections and their leases. A lease pins a segment's memory (in the index or
//! as a zombie) until it is released or its connection closes.

use std::collections::HashMap;
use std::time::SystemTime;

use super::{ClientId, Inner, SegmentId, Store};
use crate::store::{QuotaError, Segment};

/// Peer credentials of a connection (SO_PEERCRED).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Peer {
    /// Process id, when the kernel reports one.
    pub pid: Option<i32>,
    /// User id.
    pub uid: u32,
    /// Group id.
    pub gid: u32,
}

pub(super) struct ClientState {
    pub(super) peer: Peer,
    pub(super) connected_at: SystemTime,
    pub(super) leases: HashMap<SegmentId, u64>,
    /// Latest report per engine and model, oldest first (bounded by the quotas).
    pub(super) reports: Vec<super::Report>,
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

impl Inner {
    /// One connection fewer holds `id`.
    fn unhold(&mut self, id: SegmentId) {
        if let std::collections::hash_map::Entry::Occupied(mut e) = self.holders.entry(id) {
            *e.get_mut() -= 1;
            if *e.get() == 0 {
                e.remove();
            }
        }
    }

    /// Drops `n` leases on `id`; a zombie whose last lease ends is freed.
    fn unref(&mut self, id: SegmentId, n: u64) {
        let left = match self.refcounts.get_mut(&id) {
            Some(c) if *c > n => {
                *c -= n;
                *c
            }
            _ => {
                self.refcounts.remove(&id);
                0
            }
        };
        if left == 0 {
            // Dropping the Arc closes the daemon's fd; clients' mappings stay valid.
            if let Some(seg) = self.zombies.remove(&id) {
                self.graveyard.push(seg);
            }
        }
    }
}

impl Store {
    /// Registers a new client connection.
    pub fn connect(&self, peer: Peer) -> ClientId {
        let mut inner = self.lock();
        let id = inner.next_client;
        inner.next_client += 1;
        inner.clients.insert(
            id,
            ClientState { peer, connected_at: SystemTime::now(), leases: HashMap::new(), reports: Vec::new() },
        );
        id
    }

    /// Whether connection `client` is open (connected, not yet disconnected).
    pub fn connected(&self, client: ClientId) -> bool {
        self.lock().clients.contains_key(&client)
    }

    /// Drops a connection, every lease it held and every builder role it had.
    pub fn disconnect(&self, client: ClientId) {
        let mut inner = self.lock();
        inner.abandon_builds(client);
        if let Some(c) = inner.clients.remove(&client) {
            inner.usage.sub_leases(c.peer.uid, c.leases.values().sum());
            for (id, n) in c.leases {
                inner.unhold(id);
                inner.unref(id, n);
            }
        }
    }

    /// Leases `client` holds now.
    pub fn lease_count(&self, client: ClientId) -> u64 {
        self.lock().clients.get(&client).map_or(0, |c| c.leases.values().sum())
    }

    /// Whether `client` holds something the idle timeout and shedding must not drop: a
    /// lease, or a report that its worker holds a model privately (closing the connection
    /// would hide that worker from the figures).
    pub fn holds_anything(&self, client: ClientId) -> bool {
        self.lock()
            .clients
            .get(&client)
            .is_some_and(|c| !c.leases.is_empty() || c.reports.iter().any(|r| r.is_private()))
    }

    /// Records one more lease of `client` on `seg`, unless its uid holds its quota of
    /// leases (`limits.max_leases_per_uid`).
    pub fn lease(&self, client: ClientId, seg: &Segment) -> Result<(), QuotaError> {
        let mut inner = self.lock();
        let Some(uid) = inner.clients.get(&client).map(|c| c.peer.uid) else { return Ok(()) };
        inner.lease_allowed(uid)?;
        if let Some(c) = inner.clients.get_mut(&client) {
            let n = c.leases.entry(seg.id).or_insert(0);
            *n += 1;
            if *n == 1 {
                *inner.holders.entry(seg.id).or_insert(0) += 1;
            }
        }
        *inner.refcounts.entry(seg.id).or_insert(0) += 1;
        inner.usage.add_leases(uid, 1);
        Ok(())
    }

    /// Drops one lease of `client` on segment `id` of generation `generation`.
    pub fn release(&self, client: ClientId, id: SegmentId, generation: u64) -> Result<(), ReleaseError> {
        if generation != self.generation {
            return Err(ReleaseError::Generation { id, got: generation, want: self.generation });
        }
        let mut inner = self.lock();
        let c = inner.clients.get_mut(&client).ok_or(ReleaseError::NotHeld(id))?;
        let uid = c.peer.uid;
        match c.leases.get_mut(&id) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                c.leases.remove(&id);
                inner.unhold(id);
            }
            None => return Err(ReleaseError::NotHeld(id)),
        }
        inner.usage.sub_leases(uid, 1);
        inner.unref(id, 1);
        Ok(())
    }
}
