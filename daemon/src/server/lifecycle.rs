//! The service's life after start: status and watchdog pings, SIGHUP reloads, the drain
//! on shutdown.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::Daemon;
use crate::config::{Args, Config};
use crate::persist::Persist;
use crate::sys::notify::{self, Notifier};

/// How often `STATUS=` is refreshed when systemd asks for no watchdog.
const STATUS_EVERY: Duration = Duration::from_secs(5);

/// The `STATUS=` line: what `systemctl status packd` shows.
pub fn status_line(daemon: &Daemon) -> String {
    let s = daemon.store.stats();
    format!(
        "STATUS=serving {} segments ({} entries, {} MiB of {} MiB budget), {} clients, {} leases",
        s.segments,
        s.entries,
        s.bytes_resident >> 20,
        s.budget_bytes >> 20,
        s.clients,
        s.leases
    )
}

/// Sends a state change (`READY=1`, `RELOADING=1`, `STOPPING=1`) to the service manager,
/// waiting for room in its queue on a blocking thread, never on the runtime's.
pub async fn state(notifier: &Arc<Notifier>, message: String) {
    let n = Arc::clone(notifier);
    match tokio::task::spawn_blocking(move || n.send_wait(&message)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "cannot notify the service manager"),
        Err(e) => tracing::warn!(error = %e, "notify task failed"),
    }
}

/// Sends `WATCHDOG=1` at half the interval systemd asked for, and `STATUS=` when it
/// changed, from a task on the serving runtime: a runtime that stalls stops the pings and
/// systemd restarts the service.
pub async fn tick(daemon: Arc<Daemon>, notifier: Arc<Notifier>, mut stop: watch::Receiver<bool>) {
    if !notifier.enabled() {
        return;
    }
    let watchdog = notify::watchdog_interval();
    let period = watchdog.map_or(STATUS_EVERY, |w| (w / 2).min(STATUS_EVERY).max(Duration::from_millis(10)));
    let mut interval = tokio::time::interval(period);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_status = String::new();
    loop {
        tokio::select! {
            _ = interval.tick() => {}
            _ = stop.changed() => return,
        }
        let status = status_line(&daemon);
        let mut msg = String::new();
        if watchdog.is_some() {
            msg.push_str("WATCHDOG=1\n");
        }
        if status != last_status {
            msg.push_str(&status);
            last_status = status;
        }
        if let Err(e) = notifier.send(msg.trim_end()) {
            tracing::debug!(error = %e, "notify failed");
        }
    }
}

/// Free heap the allocator may keep for reuse before it is given back to the kernel.
const KEEP_FREE_HEAP: u64 = 32 << 20;

/// Every few seconds, gives the allocator's free memory back to the kernel when it holds
/// more than [`KEEP_FREE_HEAP`]: a burst (a model with a huge tensor table packed and
/// evicted, thousands of connections come and gone) must not stay in the daemon's RSS.
pub async fn return_free_memory(mut stop: watch::Receiver<bool>) {
    let mut interval = tokio::time::interval(Duration::from_secs(5));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = interval.tick() => {}
            _ = stop.changed() => return,
        }
        let trim = || {
            if crate::sys::proc::heap_free_bytes() > KEEP_FREE_HEAP {
                crate::sys::proc::trim_heap();
            }
        };
        let _ = tokio::task::spawn_blocking(trim).await;
    }
}

/// Re-reads flags, environment and the config file. Applies what can change while
/// serving (budget, model roots, cache size cap, shutdown timeout) and names in the log what
/// needs a restart. An invalid new configuration is logged and the running one kept.
pub fn reload(args: &Args, old: Config, daemon: &Daemon, persist: &Persist) -> Config {
    let mut new = match Config::from_args(args.clone()) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "SIGHUP: the configuration is invalid; keeping the running one");
            return old;
        }
    };
    let mut applied = Vec::new();
    if new.max_bytes != old.max_bytes {
        let (budget, fits) = daemon.store.set_budget(new.max_bytes);
        applied.push(format!("max_bytes={budget}{}", if fits { "" } else { " (over budget: segments are held)" }));
    }
    if new.model_roots != old.model_roots {
        *daemon.model_roots.write().unwrap_or_else(|p| p.into_inner()) = new.model_roots.clone();
        applied.push(format!("model_roots={:?}", new.model_roots));
    }
    if new.cache_max_bytes != old.cache_max_bytes {
        persist.set_cache_max_bytes(new.cache_max_bytes);
        applied.push(format!("cache_max_bytes={}", new.cache_max_bytes));
    }
    if new.shutdown_timeout != old.shutdown_timeout {
        applied.push(format!("shutdown_timeout={:?}", new.shutdown_timeout));
    }
    // Settings that need a restart keep their running values (so the next reload compares
    // against what is in effect) and are named in the log.
    let mut restart = Vec::new();
    macro_rules! keep {
        ($($field:ident),*) => {$(
            if new.$field != old.$field {
                restart.push(stringify!($field));
                new.$field = old.$field.clone();
            }
        )*};
    }
    keep!(
        socket_dir,
        digest_cache,
        isa,
        control_tcp,
        cache_dir,
        fd_store,
        limits,
        control_policy,
        data_allow,
        socket_mode,
        socket_group
    );
    let applied = if applied.is_empty() { "nothing changed".to_string() } else { applied.join(", ") };
    tracing::info!(%applied, "SIGHUP: configuration reloaded");
    if !restart.is_empty() {
        tracing::warn!(settings = %restart.join(", "), "SIGHUP: these settings changed but take effect only after a restart");
    }
    new
}

/// Waits up to `timeout` for running pack jobs to finish.
pub async fn drain(daemon: &Daemon, timeout: Duration) {
    let start = Instant::now();
    let running = daemon.store.flights_in_progress();
    if running == 0 {
        return;
    }
    tracing::info!(running, timeout_s = timeout.as_secs_f64(), "waiting for running pack jobs");
    while daemon.store.flights_in_progress() > 0 && start.elapsed() < timeout {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let left = daemon.store.flights_in_progress();
    if left > 0 {
        tracing::warn!(abandoned = left, "pack jobs still running at the shutdown timeout are abandoned");
    }
}
