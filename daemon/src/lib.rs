//! packd: packs model weights once per host into sealed memfd segments and shares them
//! with inference processes over a Unix socket.
//!
//! Layers, dependencies pointing one way: [`sys`] (system calls) → [`source`], [`pack`],
//! [`store`] (pure logic) → [`dataplane`], [`control`] (protocols), [`persist`] (fd store,
//! cache directory) → [`server`] (wiring).
//! The library also exposes [`pack`] (layouts, reference kernels) to tests and benches.

pub mod access;
pub mod blocking;
pub mod config;
pub mod control;
pub mod dataplane;
pub mod limits;
pub mod pack;
pub mod persist;
pub mod ratelog;
pub mod server;
pub mod service;
pub mod source;
pub mod store;
pub mod sys;

use std::sync::Arc;

/// Shared state of a running daemon.
pub struct Daemon {
    /// Index, flights, leases, counters.
    pub store: Arc<store::Store>,
    /// Digests of recently seen source files.
    pub digests: source::DigestCache,
    /// The system page size; segment sizes are multiples of it.
    pub page_size: u64,
    /// The instruction set pack jobs use.
    pub isa: pack::Isa,
    /// Whether segments ask for transparent huge pages.
    pub huge_pages: bool,
    /// Directories `Prefetch` may read models from (canonical paths); SIGHUP replaces them.
    pub model_roots: std::sync::RwLock<Vec<std::path::PathBuf>>,
    /// Limits on what clients can make the daemon hold.
    pub limits: limits::Limits,
    /// The per-second budget of per-request log lines.
    pub request_log: ratelog::RateLog,
    /// Data-plane connections refused at a connection limit.
    pub connections_refused: std::sync::atomic::AtomicU64,
    /// Data-plane connections open, and their admission (connection limits, shedding).
    pub admission: Arc<dataplane::Admission>,
    /// The bounded, watched pool for blocking work on sources.
    pub source_ops: blocking::SourceOps,
    /// Who may use the control plane's mutating RPCs.
    pub control_policy: control::Policy,
    /// Who may use the data plane.
    pub data_allow: access::DataAllow,
    /// Whose published segments every client may use.
    pub trusted_publishers: access::Ids,
}

impl Daemon {
    /// A daemon with an empty store, configured by `config`.
    pub fn new(config: &config::Config) -> Arc<Self> {
        let store = store::Store::new(rand_generation(), config.max_bytes);
        store.set_quotas(store::Quotas {
            leases_per_uid: config.limits.max_leases_per_uid,
            packed_bytes_per_uid: config.limits.max_packed_bytes_per_uid.unwrap_or(u64::MAX),
            builds_per_connection: config.limits.max_builds_per_connection,
            builds_per_uid: config.limits.max_builds_per_uid,
        });
        Arc::new(Self {
            store,
            model_roots: std::sync::RwLock::new(config.model_roots.clone()),
            digests: source::DigestCache::new(config.digest_cache),
            page_size: sys::proc::page_size(),
            isa: config.isa,
            huge_pages: config.huge_pages,
            limits: config.limits.clone(),
            request_log: ratelog::RateLog::new(config.limits.request_log_per_second),
            connections_refused: std::sync::atomic::AtomicU64::new(0),
            admission: dataplane::Admission::new(config.limits.max_connections, config.limits.max_connections_per_uid),
            source_ops: blocking::SourceOps::new(
                config.limits.max_source_ops,
                config.limits.max_source_ops_per_uid,
                config.limits.source_timeout,
            ),
            control_policy: config.control_policy.clone(),
            data_allow: config.data_allow.clone(),
            trusted_publishers: config.trusted_publishers.clone(),
        })
    }

    /// The model roots now in effect.
    pub fn model_roots(&self) -> Vec<std::path::PathBuf> {
        self.model_roots.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// A generation number unlikely to repeat across daemon starts.
fn rand_generation() -> u64 {
    let mut h = blake3::Hasher::new();
    h.update(&std::process::id().to_le_bytes());
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    h.update(&now.as_nanos().to_le_bytes());
    let b = h.finalize();
    let mut g = [0u8; 8];
    g.copy_from_slice(&b.as_bytes()[..8]);
    u64::from_le_bytes(g).max(1)
}
