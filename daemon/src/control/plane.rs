//! The control plane's handle: what its RPCs use, and no more.

use std::path::PathBuf;
use std::sync::Arc;

use super::access::Policy;
use crate::dataplane::Admission;
use crate::ratelog::RateLog;
use crate::service::Packer;

/// What the control plane uses: the packer (its store for stats, listings, eviction, pins
/// and the budget; its pack jobs for prefetch), who may change things, the model roots
/// prefetch may read, and the data plane's connection counts and log budget it reports.
pub struct ControlPlane {
    /// Packs prefetched files; holds the store.
    pub packer: Arc<Packer>,
    /// Who may use the mutating RPCs.
    pub policy: Policy,
    /// Directories `Prefetch` may read models from; SIGHUP replaces them.
    pub model_roots: Arc<ModelRoots>,
    /// The data plane's admission, for its counts of refused and shed connections.
    pub admission: Arc<Admission>,
    /// The control plane's own connection limits (`limits.max_control_connections`,
    /// `…_per_uid`): a slot per accepted connection, refused past a limit, never shed.
    pub connections: Arc<Admission>,
    /// Largest control-plane request message: `limits.max_request_bytes` (a Prefetch
    /// carries a plan, as a data-plane pack does) plus 4 KiB for its path.
    pub max_request_bytes: usize,
    /// The per-request log budget, for its count of suppressed lines.
    pub request_log: Arc<RateLog>,
    /// Publishers whose segments every uid may use (`trusted_publisher_uids`, `…_gids`):
    /// a non-admin's ListEntries shows other uids' publications only from them.
    pub trusted_publishers: crate::access::Ids,
}

/// Directories `Prefetch` may read models from (canonical paths); SIGHUP replaces them.
#[derive(Debug, Default)]
pub struct ModelRoots(std::sync::RwLock<Vec<PathBuf>>);

impl ModelRoots {
    /// The roots `roots`.
    pub fn new(roots: Vec<PathBuf>) -> Self {
        Self(std::sync::RwLock::new(roots))
    }

    /// The roots now in effect.
    pub fn get(&self) -> Vec<PathBuf> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Replaces the roots (a reload).
    pub fn set(&self, roots: Vec<PathBuf>) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = roots;
    }
}
