//! The data plane's handle: what its connections use, and no more.

use std::sync::Arc;

use super::Admission;
use crate::access::{DataAllow, Ids};
use crate::limits::Limits;
use crate::ratelog::RateLog;
use crate::service::Packer;
use crate::store::Store;

/// What the data plane uses, and no more: the packer (and its store), the client limits,
/// its admission of connections, who may connect, whose publications everyone may use,
/// and the per-request log budget.
pub struct DataPlane {
    /// Packs sources; holds the store.
    pub packer: Arc<Packer>,
    /// The store (the packer's).
    pub store: Arc<Store>,
    /// Limits on what clients can make the daemon hold.
    pub limits: Limits,
    /// Open connections and their admission (connection limits, shedding).
    pub admission: Arc<Admission>,
    /// Who may use the data plane.
    pub allow: DataAllow,
    /// Whose published segments every client may use.
    pub trusted_publishers: Ids,
    /// The per-second budget of per-request log lines (shared with the control plane,
    /// which reports what it suppressed).
    pub request_log: Arc<RateLog>,
}

impl DataPlane {
    /// A data plane over `packer`, within `limits`.
    pub fn new(
        packer: Arc<Packer>,
        limits: Limits,
        allow: DataAllow,
        trusted_publishers: Ids,
        request_log: Arc<RateLog>,
    ) -> Arc<Self> {
        let admission = Admission::new(limits.max_connections, limits.max_connections_per_uid);
        let store = Arc::clone(&packer.store);
        Arc::new(Self { packer, store, limits, admission, allow, trusted_publishers, request_log })
    }
}
