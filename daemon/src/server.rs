//! Wiring: bind the sockets, serve both planes, drain on SIGTERM/SIGINT.
#![forbid(unsafe_code)]

use std::fs;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, bail};
use tokio::net::UnixListener;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

use crate::config::Config;
use crate::{Daemon, control, dataplane};

/// Binds a Unix socket at `path` with mode 0660, replacing a stale socket file but never
/// one another live daemon is serving.
pub fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            bail!("{} is served by another running daemon", path.display());
        }
        fs::remove_file(path).with_context(|| format!("removing stale socket {}", path.display()))?;
    }
    let listener = UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o660))
        .with_context(|| format!("chmod {}", path.display()))?;
    Ok(listener)
}

/// Runs the daemon until SIGTERM or SIGINT.
pub async fn run(config: Config) -> anyhow::Result<()> {
    if !config.socket_dir.is_dir() {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(&config.socket_dir)
            .with_context(|| format!("creating socket directory {}", config.socket_dir.display()))?;
    }
    let data = bind(&config.data_socket())?;
    let control_listener = bind(&config.control_socket())?;
    let daemon = Daemon::new(config.digest_cache, config.isa, config.max_bytes, config.model_roots.clone());

    let (stop_tx, stop_rx) = watch::channel(false);
    let data_task = tokio::spawn(dataplane::serve(data, Arc::clone(&daemon), stop_rx.clone()));
    let tcp = match config.control_tcp {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding the control plane to {addr}"))?,
        ),
        None => None,
    };
    let control_task = tokio::spawn(control::serve(control_listener, tcp, Arc::clone(&daemon), stop_rx));
    tracing::info!(
        data = %config.data_socket().display(),
        control = %config.control_socket().display(),
        generation = daemon.store.generation(),
        isa = %daemon.isa,
        budget = config.max_bytes,
        budget_from = %config.max_bytes_source,
        "packd serving"
    );

    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
    }
    let _ = stop_tx.send(true);
    let _ = data_task.await;
    match control_task.await {
        Ok(Err(e)) => tracing::warn!(error = %e, "control plane ended with an error"),
        Err(e) => tracing::warn!(error = %e, "control plane task failed"),
        Ok(Ok(())) => {}
    }
    for path in [config.data_socket(), config.control_socket()] {
        let _ = fs::remove_file(path);
    }
    Ok(())
}
