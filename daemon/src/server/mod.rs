//! Wiring: sockets (bound or socket-activated), warm state, both planes, the service
//! manager's notifications, SIGHUP reloads and a bounded drain on SIGTERM/SIGINT.
#![forbid(unsafe_code)]

mod error;
mod lifecycle;
mod sockets;

use std::sync::Arc;

use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

pub use error::{ServerError, Step, Usage, chain};
pub use sockets::{CONTROL_NAME, DATA_NAME, bind};

use crate::config::{Args, Config};
use crate::control::{self, ControlPlane, ModelRoots};
use crate::dataplane::{self, Admission, DataPlane};
use crate::ratelog::RateLog;
use crate::service::Packer;
use crate::store::{Quotas, Store};
use crate::sys::notify::{self, Notifier};

/// The signals the serving loop answers.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

/// Answers signals until SIGTERM or SIGINT: SIGHUP reloads. A reload reads the
/// configuration on the blocking pool while this loop keeps answering signals; a SIGHUP
/// during a reload starts another one after it. Returns the configuration in effect.
async fn serve_signals(
    mut signals: Signals,
    args: &Args,
    mut config: Config,
    parts: &Parts,
    persist: &crate::persist::Persist,
    notifier: &Arc<Notifier>,
) -> Config {
    let mut reading: Option<tokio::task::JoinHandle<_>> = None;
    let mut again = false;
    loop {
        tokio::select! {
            _ = signals.term.recv() => { tracing::info!("SIGTERM: shutting down"); return config; }
            _ = signals.int.recv() => { tracing::info!("SIGINT: shutting down"); return config; }
            _ = signals.hup.recv() => {
                if reading.is_some() {
                    again = true;
                    continue;
                }
                lifecycle::state(notifier, format!("RELOADING=1\nMONOTONIC_USEC={}", notify::monotonic_usec())).await;
                reading = Some(lifecycle::read_config(args));
            }
            read = async {
                match reading.as_mut() {
                    Some(handle) => handle.await,
                    None => std::future::pending().await,
                }
            }, if reading.is_some() => {
                reading = None;
                match read {
                    Ok(read) => config = lifecycle::apply_reload(read, config, &parts.packer.store, &parts.roots, persist),
                    Err(e) => tracing::error!(error = %e, "SIGHUP: reading the configuration failed; keeping the running one"),
                }
                if std::mem::take(&mut again) {
                    reading = Some(lifecycle::read_config(args));
                } else {
                    lifecycle::state(notifier, format!("READY=1\n{}", lifecycle::status_line(&parts.packer.store))).await;
                }
            }
        }
    }
}

/// The daemon's parts, wired from its configuration: each plane gets what it uses. Public
/// for harnesses that drive a plane without sockets (the fuzz targets).
pub struct Parts {
    /// What packing needs (the store, the digests, the source pool).
    pub packer: Arc<Packer>,
    /// The data plane's handle.
    pub data: Arc<DataPlane>,
    /// The control plane's handle.
    pub control: Arc<ControlPlane>,
    /// The model roots a reload replaces.
    pub roots: Arc<ModelRoots>,
}

impl Parts {
    /// Builds every part from `config` (an empty store, no sockets, no tasks), with the
    /// kernels a start would use before any measurement (nothing read or measured).
    pub fn wire(config: &Config) -> Self {
        let kernels = crate::pack::KernelChoice::without_measuring(&config.isa)
            .unwrap_or_else(|| crate::pack::KernelChoice::default_among(&config.isa.candidates(), false));
        Self::wire_with(config, kernels)
    }

    /// Builds every part from `config` with `kernels`.
    pub fn wire_with(config: &Config, kernels: crate::pack::KernelChoice) -> Self {
        let store = Store::new(rand_generation(), config.max_bytes);
        store.set_max_segments(config.limits.max_segments);
        store.set_quotas(Quotas {
            leases_per_uid: config.limits.max_leases_per_uid,
            packed_bytes_per_uid: config.limits.max_packed_bytes_per_uid.unwrap_or(u64::MAX),
            builds_per_connection: config.limits.max_builds_per_connection,
            builds_per_uid: config.limits.max_builds_per_uid,
            reports_per_connection: config.limits.max_reports_per_connection,
        });
        let packer = Arc::new(Packer {
            telemetry: Arc::default(),
            store,
            digests: Arc::new(crate::source::DigestCache::new(config.digest_cache)),
            source_ops: crate::blocking::SourceOps::new(
                config.limits.max_source_ops,
                config.limits.max_source_ops_per_uid,
                config.limits.source_timeout,
            ),
            page_size: crate::sys::proc::page_size(),
            kernels: crate::pack::choice::KernelsInUse::new(kernels),
            huge_pages: config.huge_pages,
            spare: crate::service::Spare::new(config.spare_bytes),
            lends: crate::store::Lends::new(
                config.limits.max_lent_bytes_per_uid,
                config.limits.lend_claim_timeout,
                crate::sys::proc::page_size(),
                config.huge_pages,
            ),
        });
        let request_log = Arc::new(RateLog::new(config.limits.request_log_per_second));
        let data = DataPlane::new(
            Arc::clone(&packer),
            config.limits.clone(),
            config.data_allow.clone(),
            config.trusted_publishers.clone(),
            Arc::clone(&request_log),
        );
        let roots = Arc::new(ModelRoots::new(config.model_roots.clone()));
        let control = Arc::new(ControlPlane {
            packer: Arc::clone(&packer),
            policy: config.control_policy.clone(),
            model_roots: Arc::clone(&roots),
            admission: Arc::clone(&data.admission),
            connections: Admission::new(
                config.limits.max_control_connections,
                config.limits.max_control_connections_per_uid,
            ),
            max_request_bytes: config.limits.max_request_bytes + 4096,
            request_log,
            trusted_publishers: config.trusted_publishers.clone(),
        });
        Self { packer, data, control, roots }
    }
}

/// What persistence is told of the configuration.
fn persist_settings(config: &Config) -> crate::persist::Settings {
    crate::persist::Settings {
        fd_store: config.fd_store.enabled(),
        cache_dir: config.cache_dir.clone(),
        cache_max_bytes: config.cache_max_bytes,
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

/// What a daemon that stopped leaves behind, for the last line of its log (written once the
/// runtime is down: [`Stopped::log`]).
#[derive(Debug, Clone, Copy)]
pub struct Stopped {
    /// Segments in the index at the end.
    pub segments: u64,
    /// Their resident bytes.
    pub bytes: u64,
    /// When the stop began (the signal was received).
    pub since: std::time::Instant,
}

impl Stopped {
    /// Logs "packd stopped", with how long the stop took and how long the runtime's
    /// shutdown (`runtime`) waited for blocking work. Call it last.
    pub fn log(&self, runtime: std::time::Duration) {
        tracing::info!(
            segments = self.segments,
            bytes = self.bytes,
            stop_ms = self.since.elapsed().as_millis(),
            runtime_shutdown_ms = runtime.as_millis(),
            "packd stopped"
        );
    }
}

/// Runs the daemon until SIGTERM or SIGINT. `args` are re-read (with the config file) on
/// SIGHUP. The caller logs the last line once its runtime is down ([`Stopped::log`]).
pub async fn run(args: Args, config: Config) -> Result<Stopped, ServerError> {
    let started = std::time::Instant::now();
    // Handlers first: SIGHUP's default action would kill a daemon that systemd already
    // considers ready to reload.
    let term = signal(SignalKind::terminate()).map_err(ServerError::io(Step::Signal("SIGTERM")))?;
    let int = signal(SignalKind::interrupt()).map_err(ServerError::io(Step::Signal("SIGINT")))?;
    let hup = signal(SignalKind::hangup()).map_err(ServerError::io(Step::Signal("SIGHUP")))?;
    let notifier = Arc::new(Notifier::from_env().map_err(ServerError::io(Step::NotifySocket))?);
    let passed = notify::listen_fds().map_err(|e| ServerError::Usage(Usage::Activation(e)))?;
    // The cache directory is this daemon's alone (a second one would delete the first
    // one's files): locked before anything in it is read or written, and before a socket
    // is bound (a daemon refused here leaves nothing behind); held until exit. Then the
    // sockets, then which kernels pack at start (read, never measured here: a measurement
    // runs once serving). Blocking work, off the runtime threads.
    let (isa, kernels_file) = (config.isa.clone(), config.kernels_file.clone());
    let dir = config.cache_dir.clone();
    let cache_lock = tokio::task::spawn_blocking(move || dir.as_deref().map(crate::persist::lock::acquire).transpose())
        .await
        .map_err(|e| ServerError::Usage(Usage::LockThread(e)))?
        .map_err(|e| ServerError::Usage(Usage::CacheDirInUse(e)))?
        .flatten();
    let (metrics_fd, passed) = sockets::take_metrics(passed)?;
    let (data, control_listener, stored) = sockets::listeners(&config, passed)?;
    let (file, setting) = (kernels_file.clone(), isa.clone());
    let kernels = tokio::task::spawn_blocking(move || crate::persist::kernels::at_start(&isa, file.as_deref()))
        .await
        .unwrap_or_else(|_| {
            crate::pack::KernelChoice::without_measuring(&setting)
                .unwrap_or_else(|| crate::pack::KernelChoice::default_among(&setting.candidates(), false))
        });
    let parts = Parts::wire_with(&config, kernels);
    let store = Arc::clone(&parts.packer.store);
    let (stop_tx, stop_rx) = watch::channel(false);
    // Watchdog pings start now: adopting a large cache must not look like a hang.
    let ticker = tokio::spawn(lifecycle::tick(Arc::clone(&store), Arc::clone(&notifier), stop_rx.clone()));
    tokio::spawn(lifecycle::return_free_memory(stop_rx.clone()));
    tokio::spawn(lifecycle::expire_builds(Arc::clone(&store), stop_rx.clone()));
    let persist = crate::persist::start(&parts.packer, persist_settings(&config), stored, &notifier).await?;
    // The keeper starts once the persisted segments are in (they come first in the budget);
    // it makes the spare after the first pack job.
    parts.packer.spare.start(&store, parts.packer.huge_pages);

    let data_task = tokio::spawn(dataplane::serve(data.listener, Arc::clone(&parts.data), stop_rx.clone()));
    let tcp = match config.control_tcp {
        Some(addr) => {
            Some(tokio::net::TcpListener::bind(addr).await.map_err(ServerError::io(Step::BindControl(addr)))?)
        }
        None => None,
    };
    let control_task =
        tokio::spawn(control::serve(control_listener.listener, tcp, Arc::clone(&parts.control), stop_rx.clone()));
    let metrics_listener = match (metrics_fd, config.metrics_listen) {
        (Some(l), _) => Some(l),
        (None, Some(addr)) => {
            Some(tokio::net::TcpListener::bind(addr).await.map_err(ServerError::io(Step::BindMetrics(addr)))?)
        }
        (None, None) => None,
    };
    let metrics_at = metrics_listener.as_ref().and_then(|l| l.local_addr().ok());
    let metrics_task = metrics_listener.map(|l| {
        let metrics = Arc::new(crate::metrics::Metrics::new(Arc::clone(&parts.control), config.metrics_max_models));
        tokio::spawn(crate::metrics::http::serve(l, metrics))
    });
    tracing::info!(
        data = %data.path,
        control = %control_listener.path,
        activated = %match (data.owned_path.is_none(), control_listener.owned_path.is_none()) {
            (true, true) => "true",
            (true, false) => "data only",
            (false, true) => "control only",
            (false, false) => "false",
        },
        generation = store.generation(),
        kernels = %parts.packer.kernels.get(),
        kernels_why = %parts.packer.kernels.get().reason(),
        start_ms = started.elapsed().as_millis(),
        budget = config.max_bytes,
        budget_from = %config.max_bytes_source,
        cache_dir = %persist.cache_dir_note(),
        cache_dir_from = config.cache_dir_source,
        fd_store = persist.fd_store_enabled(),
        huge_pages = %crate::sys::proc::huge_pages_note(config.huge_pages),
        spare_bytes = %if config.spare_bytes == 0 { "off".to_string() } else { config.spare_bytes.to_string() },
        metrics = %metrics_at.map_or("off".to_string(), |a| format!("http://{a}/metrics")),
        "packd serving"
    );
    // socket_mode applies only to sockets packd binds itself.
    let binds_one = data.owned_path.is_some() || control_listener.owned_path.is_some();
    for warning in config.warnings().into_iter().chain(config.socket_mode_warning().filter(|_| binds_one)) {
        tracing::warn!("{warning}");
    }
    lifecycle::state(&notifier, format!("READY=1\n{}", lifecycle::status_line(&store))).await;
    crate::persist::kernels::measure_later(&parts.packer, kernels_file);

    let signals = Signals { term, int, hup };
    let config = serve_signals(signals, &args, config, &parts, &persist, &notifier).await;
    let since = std::time::Instant::now();
    // Stopping: pack jobs that finish now take no spare to be made again.
    parts.packer.spare.stop();

    let stopping = "STOPPING=1\nSTATUS=stopping: no new connections, waiting for running pack jobs";
    lifecycle::state(&notifier, stopping.to_string()).await;
    let _ = stop_tx.send(true);
    let _ = data_task.await;
    if let Some(t) = metrics_task {
        t.abort();
    }
    let _ = ticker.await;
    // The control plane finishes its in-flight RPCs (a Prefetch may be packing) within the
    // same bound as the data plane's pack jobs.
    let grace = config.shutdown_timeout;
    let (control, ()) = tokio::join!(tokio::time::timeout(grace, control_task), lifecycle::drain(&store, grace));
    match control {
        Ok(Ok(Err(e))) => tracing::warn!(error = %e, "control plane ended with an error"),
        Ok(Err(e)) => tracing::warn!(error = %e, "control plane task failed"),
        Err(_) => tracing::warn!("control-plane requests still running at the shutdown timeout are abandoned"),
        Ok(Ok(Ok(()))) => {}
    }
    // Reads still running for clients (a hash nobody waits for now) end at their next read.
    parts.packer.source_ops.stop_all();
    persist.finish().await;
    // Only now may another daemon use the directory.
    drop(cache_lock);
    for path in [data.owned_path, control_listener.owned_path].into_iter().flatten() {
        let _ = std::fs::remove_file(path);
    }
    let s = store.stats();
    Ok(Stopped { segments: s.segments, bytes: s.bytes_resident, since })
}
