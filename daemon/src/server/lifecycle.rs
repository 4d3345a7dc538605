//! The service's life after start: status and watchdog pings, SIGHUP reloads, the drain
//! on shutdown.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::config::{Args, Config, ConfigError};
use crate::control::ModelRoots;
use crate::persist::Persist;
use crate::store::Store;
use crate::sys::notify::{self, Notifier};

/// How often `STATUS=` is refreshed when systemd asks for no watchdog.
const STATUS_EVERY: Duration = Duration::from_secs(5);

/// The `STATUS=` line: what `systemctl status packd` shows.
pub fn status_line(store: &Store) -> String {
    let s = store.stats();
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
pub async fn tick(store: Arc<Store>, notifier: Arc<Notifier>, mut stop: watch::Receiver<bool>) {
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
        let status = status_line(&store);
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

/// Free heap the allocator may keep for reuse before it is given back to the kernel: a few
/// bursts' worth of reply buffers, far below any budget.
const KEEP_FREE_HEAP: u64 = 32 << 20;

/// How often the free heap is looked at: often enough that a burst does not linger in RSS,
/// rarely enough to cost nothing (one `mallinfo2`).
const TRIM_EVERY: Duration = Duration::from_secs(5);

/// Every few seconds, gives the allocator's free memory back to the kernel when it holds
/// more than [`KEEP_FREE_HEAP`]: a burst (a model with a huge tensor table packed and
/// evicted, thousands of connections come and gone) must not stay in the daemon's RSS.
pub async fn return_free_memory(mut stop: watch::Receiver<bool>) {
    let mut interval = tokio::time::interval(TRIM_EVERY);
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

/// Ends every builder role of a published segment at its deadline: its waiters are told to
/// build privately and the role leaves memory then, not when its connection closes. Sleeps
/// until the earliest deadline, or until a role with an earlier one is taken.
pub async fn expire_builds(store: Arc<crate::store::Store>, mut stop: watch::Receiver<bool>) {
    loop {
        let next = store.expire_builds();
        let sleep = async {
            match next {
                Some(at) => tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = sleep => {}
            () = store.build_added() => {}
            _ = stop.changed() => return,
        }
    }
}

/// Re-reads flags, environment and the config file, on the blocking pool: reading files,
/// resolving model roots, looking a group up (NSS) and reading the cgroup may block, and
/// must not stall the runtime. The caller applies the result with [`apply_reload`].
pub fn read_config(args: &Args) -> tokio::task::JoinHandle<Result<Config, ConfigError>> {
    let args = args.clone();
    tokio::task::spawn_blocking(move || Config::from_args(args))
}

/// A setting that needs a restart: the running value stays (so the next reload compares
/// against what is in effect), and its name is added to `restart` if it changed.
fn keep<T: PartialEq>(name: &'static str, new: T, old: T, restart: &mut Vec<String>) -> T {
    named(restart, name, new != old);
    old
}

/// Adds to `restart` each of a table's `keys` that changed (`prefix` + key); a table that
/// `changed` in no key named here (a field added later) names all of them.
fn named_keys(restart: &mut Vec<String>, prefix: &str, keys: &[(&str, bool)], changed: bool) {
    let any = keys.iter().any(|&(_, c)| c);
    for &(key, c) in keys {
        named(restart, &format!("{prefix}{key}"), c || (changed && !any));
    }
}

/// Adds the config key `name` to `restart` if it `changed`.
fn named(restart: &mut Vec<String>, name: &str, changed: bool) {
    if changed {
        restart.push(name.to_string());
    }
}

/// Applies a re-read configuration: what can change while serving (budget, model roots,
/// cache size cap, shutdown timeout) takes effect; what needs a restart keeps its running
/// value and is named in the log. An invalid configuration is logged and the running one
/// kept. Every field of [`Config`] is named below, without `..`: a new setting does not
/// compile until it is either applied here or kept until a restart.
pub fn apply_reload(
    read: Result<Config, ConfigError>,
    old: Config,
    store: &Store,
    roots: &ModelRoots,
    persist: &Persist,
) -> Config {
    let new = match read {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "SIGHUP: the configuration is invalid; keeping the running one");
            return old;
        }
    };
    let Config {
        socket_dir,
        digest_cache,
        isa,
        kernels_file,
        max_bytes,
        max_bytes_source,
        spare_bytes,
        spare_bytes_default,
        model_roots,
        control_tcp,
        metrics_listen,
        metrics_max_models,
        cache_dir,
        cache_dir_source: _,
        cache_max_bytes,
        cache_max_bytes_default,
        fd_store,
        huge_pages,
        shutdown_timeout,
        limits,
        control_policy,
        data_allow,
        trusted_publishers,
        socket_mode,
        socket_group,
        socket_group_name: _,
    } = new;
    let mut applied = Vec::new();
    // A new budget applies as SetBudget's does, with its guard: one that would evict more
    // than half of what is resident (a typo such as 100MiB for 100GiB) is refused, and the
    // running budget stays (so the next reload tries again).
    let (max_bytes, max_bytes_source) = if max_bytes == old.max_bytes {
        (max_bytes, max_bytes_source)
    } else {
        match store.set_budget(max_bytes, false) {
            Ok(c) => {
                applied.push(format!(
                    "max_bytes={} (evicted {} segment(s), {} bytes){}",
                    c.budget,
                    c.evicted_segments,
                    c.evicted_bytes,
                    if c.fits { "" } else { "; over budget: segments are held" }
                ));
                (max_bytes, max_bytes_source)
            }
            Err(refused) => {
                tracing::error!(
                    "SIGHUP: max_bytes = {max_bytes} refused: {refused}; the budget stays {} until the file's \
                     max_bytes evicts less, or `packctl budget {max_bytes} --evict-most` applies it",
                    store.stats().budget_bytes
                );
                (old.max_bytes, old.max_bytes_source.clone())
            }
        }
    };
    // The default cache cap is the configured budget in force, not a refused one.
    let cache_max_bytes = if cache_max_bytes_default { max_bytes } else { cache_max_bytes };
    if model_roots != old.model_roots {
        roots.set(model_roots.clone());
        applied.push(format!("model_roots={model_roots:?}"));
    }
    if cache_max_bytes != old.cache_max_bytes {
        persist.set_cache_max_bytes(cache_max_bytes);
        applied.push(format!("cache_max_bytes={cache_max_bytes}"));
    }
    if shutdown_timeout != old.shutdown_timeout {
        applied.push(format!("shutdown_timeout={shutdown_timeout:?}"));
    }
    let mut restart = Vec::new();
    let r = &mut restart;
    let running = Config {
        max_bytes,
        max_bytes_source,
        model_roots,
        cache_max_bytes,
        cache_max_bytes_default,
        shutdown_timeout,
        socket_dir: keep("socket_dir", socket_dir, old.socket_dir, r),
        digest_cache: keep("digest_cache", digest_cache, old.digest_cache, r),
        isa: keep("isa", isa, old.isa, r),
        kernels_file: keep("kernels_file", kernels_file, old.kernels_file, r),
        // The default spare follows max_bytes: not a change of spare_bytes by itself.
        spare_bytes: if spare_bytes_default && old.spare_bytes_default {
            old.spare_bytes
        } else {
            keep("spare_bytes", spare_bytes, old.spare_bytes, r)
        },
        spare_bytes_default: old.spare_bytes_default,
        control_tcp: keep("control_tcp", control_tcp, old.control_tcp, r),
        metrics_listen: keep("metrics_listen", metrics_listen, old.metrics_listen, r),
        metrics_max_models: keep("metrics_max_models", metrics_max_models, old.metrics_max_models, r),
        cache_dir: keep("cache_dir", cache_dir, old.cache_dir, r),
        cache_dir_source: old.cache_dir_source,
        fd_store: keep("fd_store", fd_store, old.fd_store, r),
        huge_pages: keep("huge_pages", huge_pages, old.huge_pages, r),
        // Tables are named key by key as the file names them.
        limits: {
            let (was, now) = (old.limits.describe(), limits.describe());
            let keys: Vec<(&str, bool)> =
                was.iter().zip(&now).map(|(a, b)| (b.split(" = ").next().unwrap_or(b), a != b)).collect();
            named_keys(r, "limits.", &keys, old.limits != limits);
            old.limits
        },
        control_policy: {
            let (was, now) = (&old.control_policy, &control_policy);
            let keys = [
                ("admin_uids", was.admins.uids != now.admins.uids),
                ("admin_gids", was.admins.gids != now.admins.gids),
                ("control_tcp_allow_mutations", was.tcp_mutations != now.tcp_mutations),
            ];
            named_keys(r, "", &keys, was != now);
            old.control_policy
        },
        data_allow: {
            let (was, now) = (&old.data_allow.0, &data_allow.0);
            named_keys(
                r,
                "",
                &[("allow_uids", was.uids != now.uids), ("allow_gids", was.gids != now.gids)],
                was != now,
            );
            old.data_allow
        },
        trusted_publishers: {
            let (was, now) = (&old.trusted_publishers, &trusted_publishers);
            let keys =
                [("trusted_publisher_uids", was.uids != now.uids), ("trusted_publisher_gids", was.gids != now.gids)];
            named_keys(r, "", &keys, was != now);
            old.trusted_publishers
        },
        socket_mode: keep("socket_mode", socket_mode, old.socket_mode, r),
        socket_group: keep("socket_group", socket_group, old.socket_group, r),
        socket_group_name: old.socket_group_name,
    };
    let applied = if applied.is_empty() { "nothing changed".to_string() } else { applied.join(", ") };
    tracing::info!(%applied, "SIGHUP: configuration reloaded");
    if !restart.is_empty() {
        tracing::warn!(settings = %restart.join(", "), "SIGHUP: these settings changed but take effect only after a restart");
    }
    running
}

/// Waits up to `timeout` for running pack jobs to finish.
pub async fn drain(store: &Store, timeout: Duration) {
    let start = Instant::now();
    let running = store.flights_in_progress();
    if running == 0 {
        return;
    }
    tracing::info!(running, timeout_s = timeout.as_secs_f64(), "waiting for running pack jobs");
    while store.flights_in_progress() > 0 && start.elapsed() < timeout {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let left = store.flights_in_progress();
    if left > 0 {
        tracing::warn!(abandoned = left, "pack jobs still running at the shutdown timeout are abandoned");
    }
}
