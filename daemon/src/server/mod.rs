//! Wiring: sockets (bound or socket-activated), warm state, both planes, the service
//! manager's notifications, SIGHUP reloads and a bounded drain on SIGTERM/SIGINT.
#![forbid(unsafe_code)]

mod lifecycle;
mod sockets;

use std::sync::Arc;

use anyhow::Context;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

pub use sockets::{CONTROL_NAME, DATA_NAME, bind};

use crate::config::{Args, Config};
use crate::sys::notify::{self, Notifier};
use crate::{Daemon, control, dataplane};

/// An error that restarting cannot fix (bad configuration, a wrongly configured socket):
/// the daemon exits with status 64, which the unit's `RestartPreventExitStatus=` honours.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

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
    daemon: &Daemon,
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
                    Ok(read) => config = lifecycle::apply_reload(read, config, daemon, persist),
                    Err(e) => tracing::error!(error = %e, "SIGHUP: reading the configuration failed; keeping the running one"),
                }
                if std::mem::take(&mut again) {
                    reading = Some(lifecycle::read_config(args));
                } else {
                    lifecycle::state(notifier, format!("READY=1\n{}", lifecycle::status_line(daemon))).await;
                }
            }
        }
    }
}

/// Runs the daemon until SIGTERM or SIGINT. `args` are re-read (with the config file) on
/// SIGHUP.
pub async fn run(args: Args, config: Config) -> anyhow::Result<()> {
    // Handlers first: SIGHUP's default action would kill a daemon that systemd already
    // considers ready to reload.
    let term = signal(SignalKind::terminate())?;
    let int = signal(SignalKind::interrupt())?;
    let hup = signal(SignalKind::hangup())?;
    let notifier = Arc::new(Notifier::from_env().context("connecting to NOTIFY_SOCKET")?);
    let passed = notify::listen_fds().map_err(|e| UsageError(format!("socket activation: {e}")))?;
    let (data, control_listener, stored) = sockets::listeners(&config, passed)?;
    let daemon = Daemon::new(&config);
    let (stop_tx, stop_rx) = watch::channel(false);
    // Watchdog pings start now: adopting a large cache must not look like a hang.
    let ticker = tokio::spawn(lifecycle::tick(Arc::clone(&daemon), Arc::clone(&notifier), stop_rx.clone()));
    tokio::spawn(lifecycle::return_free_memory(stop_rx.clone()));
    tokio::spawn(lifecycle::expire_builds(Arc::clone(&daemon.store), stop_rx.clone()));
    let persist = crate::persist::start(&daemon, &config, stored, &notifier).await?;

    let data_task = tokio::spawn(dataplane::serve(data.listener, Arc::clone(&daemon), stop_rx.clone()));
    let tcp = match config.control_tcp {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding the control plane to {addr}"))?,
        ),
        None => None,
    };
    let control_task =
        tokio::spawn(control::serve(control_listener.listener, tcp, Arc::clone(&daemon), stop_rx.clone()));
    tracing::info!(
        data = %data.path,
        control = %control_listener.path,
        activated = data.owned_path.is_none(),
        generation = daemon.store.generation(),
        isa = %daemon.isa,
        budget = config.max_bytes,
        budget_from = %config.max_bytes_source,
        cache_dir = %config.cache_dir.as_deref().map_or("off (memory only)".into(), |d| d.display().to_string()),
        cache_dir_from = config.cache_dir_source,
        fd_store = persist.fd_store_enabled(),
        huge_pages = %crate::sys::proc::huge_pages_note(config.huge_pages),
        "packd serving"
    );
    for warning in config.warnings() {
        tracing::warn!("{warning}");
    }
    lifecycle::state(&notifier, format!("READY=1\n{}", lifecycle::status_line(&daemon))).await;

    let signals = Signals { term, int, hup };
    let config = serve_signals(signals, &args, config, &daemon, &persist, &notifier).await;

    let stopping = "STOPPING=1\nSTATUS=stopping: no new connections, waiting for running pack jobs";
    lifecycle::state(&notifier, stopping.to_string()).await;
    let _ = stop_tx.send(true);
    let _ = data_task.await;
    let _ = ticker.await;
    // The control plane finishes its in-flight RPCs (a Prefetch may be packing) within the
    // same bound as the data plane's pack jobs.
    let grace = config.shutdown_timeout;
    let (control, ()) = tokio::join!(tokio::time::timeout(grace, control_task), lifecycle::drain(&daemon, grace));
    match control {
        Ok(Ok(Err(e))) => tracing::warn!(error = %e, "control plane ended with an error"),
        Ok(Err(e)) => tracing::warn!(error = %e, "control plane task failed"),
        Err(_) => tracing::warn!("control-plane requests still running at the shutdown timeout are abandoned"),
        Ok(Ok(Ok(()))) => {}
    }
    persist.finish().await;
    for path in [data.owned_path, control_listener.owned_path].into_iter().flatten() {
        let _ = std::fs::remove_file(path);
    }
    let s = daemon.store.stats();
    tracing::info!(segments = s.segments, bytes = s.bytes_resident, "packd stopped");
    Ok(())
}
