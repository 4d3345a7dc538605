//! Control-plane commands over gRPC (tonic on control.sock).

use std::path::Path;
use std::process::ExitCode;

use anyhow::bail;
use clap::Subcommand;
use packd_client::CONTROL_SOCKET;
use packd_client::proto::control_client::ControlClient;
use packd_client::proto::{self as pb};
use serde_json::{Value, json};
use tonic::transport::{Channel, Endpoint};

/// Control-plane commands.
#[derive(Debug, Subcommand)]
pub enum ControlCmd {
    /// Check that packd serves: the data socket accepts and the control plane's
    /// grpc.health.v1 check says SERVING. Exit 0 if so, 1 otherwise (a liveness or
    /// readiness probe that works over the Unix sockets, e.g. in Kubernetes).
    Health {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print the daemon's counters.
    Stats {
        /// Print JSON with snake_case keys (sizes in bytes).
        #[arg(long)]
        json: bool,
        /// Print sizes in bytes instead of KiB/MiB/GiB.
        #[arg(long)]
        bytes: bool,
    },
    /// List the segments in the index, one row each, shortened to fit 100 columns (--wide:
    /// whole). --json lists every entry with its segment's size and resident bytes.
    ///
    /// Columns: entries; size (the memfd's length, as `packctl pack` gives it); refs (leases
    /// clients hold on it); pin (pinned); hits; layout (the GEMM layout of its entries);
    /// label (the model file's name, or for a segment an engine published its cache
    /// identity, as `packctl models` and `packctl clients` name it); segment (its key).
    Ls {
        /// Only entries whose key, or whose segment's key, starts with this: a segment key's
        /// prefix lists all of its entries, an entry key's only the entries it matches
        /// (evict, pin and unpin take the segments of either).
        #[arg(long, value_name = "PREFIX", default_value = "", hide_default_value = true)]
        prefix: String,
        /// Also list every entry (tensor) under its segment.
        #[arg(long)]
        entries: bool,
        /// Whole keys and labels (to copy a key for evict, pin, unpin).
        #[arg(long)]
        wide: bool,
        /// Print sizes in bytes instead of KiB/MiB/GiB.
        #[arg(long)]
        bytes: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List connected clients (workers), one row each.
    ///
    /// Columns: id (the connection); pid; uid; gid; leases (segments it holds); mapped
    /// (bytes of them); builds (builder roles it holds); reported (how it got each model's
    /// weights, as the worker reports it: served, built, or private with the reason).
    Clients {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List models (a cache identity, or a packed source file with every plan), one row each.
    /// Names past 31 characters are cut in the table; --json has them whole.
    ///
    /// Columns: resident (bytes in memory, once); mapped (size times the workers mapping
    /// it); saved (mapped minus resident: what sharing saves); served, building, private (workers
    /// served, building, or on a private copy); hits; model (its label, or its cache
    /// identity or source file).
    Models {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Evict a segment by key (segment or entry key) or every segment matching --prefix.
    /// Leased segments are refused unless --force (readers keep their mappings). A pin
    /// keeps a segment from the budget's eviction, not from this explicit one: pinned
    /// segments are evicted (and unpinned) too.
    Evict {
        #[command(flatten)]
        target: Target,
        /// Also evict leased segments.
        #[arg(long)]
        force: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Pin segments so that the budget never evicts them (until the daemon stops: pins do
    /// not survive a restart).
    Pin {
        #[command(flatten)]
        target: Target,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Unpin segments.
    Unpin {
        #[command(flatten)]
        target: Target,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Set the byte budget (e.g. 8GiB); evicts least-recently-used unleased segments to fit.
    Budget {
        /// New budget: a byte count with an optional K, M, G or T suffix (10 means 10 bytes;
        /// write 10G for gibibytes). Segments no client holds and nobody pinned are evicted,
        /// least recently used first, until the resident bytes fit; their cache files go with
        /// them. Lasts until the daemon stops: a restart starts from its configured max_bytes.
        bytes: String,
        /// Allow a budget that evicts more than half of the resident bytes (without it, such
        /// a change is refused and changes nothing).
        #[arg(long)]
        evict_most: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Ask the daemon to pack a file under one of its --model-root directories.
    Prefetch {
        /// Path of the safetensors file (absolute, or relative to a model root).
        path: String,
        /// Layout of the default GEMM rule (default: f32-gemm:nr=16,kr=1,sr=1).
        #[arg(long, value_name = "SPEC")]
        layout: Option<String>,
        /// GLOB=LAYOUT rule in front of the defaults; repeatable.
        #[arg(long = "rule", value_name = "GLOB=LAYOUT")]
        rules: Vec<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// Which segments a command applies to: one key, or every match of a prefix.
#[derive(Debug, clap::Args)]
#[group(required = true, multiple = false)]
pub struct Target {
    /// Segment key, or an entry key (meaning its segment); or --prefix.
    key: Option<String>,
    /// Every segment whose key, or one of whose entry keys, starts with this.
    #[arg(long, value_name = "PREFIX")]
    prefix: Option<String>,
}

impl Target {
    fn parts(self) -> (String, String) {
        (self.key.unwrap_or_default(), self.prefix.unwrap_or_default())
    }
}

pub(crate) async fn connect(dir: &Path) -> anyhow::Result<ControlClient<Channel>> {
    let path = dir.join(CONTROL_SOCKET);
    let channel = match Endpoint::from_shared(format!("unix://{}", path.display()))?.connect().await {
        Ok(channel) => channel,
        Err(e) => {
            // tonic's error repeats its cause at every layer; the OS error is what matters.
            let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&e);
            while let Some(c) = cause {
                if let Some(io) = c.downcast_ref::<std::io::Error>() {
                    if closed_under_us(io) {
                        bail!("cannot connect to {}: {io}: {CLOSED_AT_ONCE}", path.display());
                    }
                    bail!("cannot connect to {}: {io}; {}", path.display(), packd_client::connect_hint(&path, io));
                }
                cause = c.source();
            }
            bail!("cannot connect to {}: {e}", path.display());
        }
    };
    Ok(ControlClient::new(channel))
}

/// Whether `e` (or a cause of it) says the daemon closed the connection under the call:
/// the socket reset or broken, or hyper's "connection closed" before the request went out.
fn closed_under_us(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(c) = cause {
        if let Some(io) = c.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind::{BrokenPipe, ConnectionReset, UnexpectedEof};
            if matches!(io.kind(), BrokenPipe | ConnectionReset | UnexpectedEof) {
                return true;
            }
        }
        if c.source().is_none() && c.to_string() == "connection closed" {
            return true;
        }
        cause = c.source();
    }
    false
}

/// Why the daemon may close a control connection before answering on it.
const CLOSED_AT_ONCE: &str = "the daemon closed the connection before answering. It closes a new control \
    connection at once when the caller's uid already holds limits.max_control_connections_per_uid of them, or \
    everyone limits.max_control_connections (its log says so; `packctl stats` counts \
    control_connections_refused), or it stopped";

/// A refused RPC: the daemon's message and the gRPC code, spelled as gRPC (and the data
/// plane's codes) spell it: `FAILED_PRECONDITION`, not `FailedPrecondition`; or, when the
/// connection broke under the call, why that may be.
pub(crate) fn status(e: tonic::Status) -> anyhow::Error {
    if closed_under_us(&e) {
        return anyhow::anyhow!("{} ({}): {CLOSED_AT_ONCE}", e.message(), code_name(e.code()));
    }
    anyhow::anyhow!("{} ({})", e.message(), code_name(e.code()))
}

/// `FailedPrecondition` → `FAILED_PRECONDITION`.
fn code_name(code: tonic::Code) -> String {
    let mut name = String::new();
    for (i, c) in format!("{code:?}").chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            name.push('_');
        }
        name.push(c.to_ascii_uppercase());
    }
    name
}

fn print(doc: &Value, json: bool, text: impl FnOnce(&Value) -> String) {
    if json {
        crate::output::emit(&format!("{doc}\n"));
    } else {
        crate::output::emit(&text(doc));
    }
}

/// One row per segment (entries, bytes, leases, pin, hits, its label — the file name the
/// packing client gave, the cache identity of an engine's segment, else `[tensor NAME]` of
/// one of its tensors — and its key); with
/// `entries`, each entry indented below its segment.
fn segment_table(list: &[pb::EntryStatus], table: Table) -> String {
    let mut order: Vec<&str> = Vec::new();
    let mut by_segment: std::collections::HashMap<&str, Vec<&pb::EntryStatus>> = std::collections::HashMap::new();
    for e in list {
        let group = by_segment.entry(e.segment_key.as_str()).or_default();
        if group.is_empty() {
            order.push(&e.segment_key);
        }
        group.push(e);
    }
    // 100 columns: 7 + 10 + 4 + 3 + 6 + 24 + 22 + 16 and the gaps.
    let (layout_w, label_w) = (24, 22);
    let mut t = format!(
        "{:>7} {:>10} {:>4} {:>3} {:>6}  {:<layout_w$} {:<label_w$} segment\n",
        "entries", "size", "refs", "pin", "hits", "layout", "label"
    );
    for key in order {
        let group = &by_segment[key];
        let first = group[0];
        // The GEMM layout its entries take (identity only when nothing else is there).
        let mut layouts: Vec<&str> = Vec::new();
        for e in group.iter().filter(|e| e.layout != "identity") {
            if !layouts.contains(&e.layout.as_str()) {
                layouts.push(&e.layout);
            }
        }
        let layout = match layouts.as_slice() {
            [] => "identity".to_string(),
            [one] => (*one).to_string(),
            [one, rest @ ..] => format!("{one} +{}", rest.len()),
        };
        let label = if !first.label.is_empty() {
            first.label.clone()
        } else if !first.identity.is_empty() {
            first.identity.clone()
        } else {
            format!("[tensor {}]", first.name)
        };
        let (layout, label, key) = if table.wide {
            (layout, label, key.to_string())
        } else {
            (shorten(&layout, layout_w), shorten(&label, label_w), short_key(key))
        };
        t.push_str(&format!(
            "{:>7} {:>10} {:>4} {:>3} {:>6}  {layout:<layout_w$} {label:<label_w$} {key}\n",
            group.len(),
            size_text(first.segment_bytes, table.bytes),
            first.refcount,
            if first.pinned { "yes" } else { "no" },
            first.hits,
        ));
        if table.entries {
            for e in group {
                t.push_str(&format!("        {:>10}  {:<26} {}\n", size_text(e.bytes, table.bytes), e.layout, e.name));
            }
        }
    }
    t
}

/// A segment key cut to 16 columns: the start of the source's digest and the end of the
/// plan's (`8087e9bf…3b19fb`), which tell the rows apart; `--wide` prints it whole.
fn short_key(key: &str) -> String {
    let body = key.strip_prefix("b3:").unwrap_or(key);
    let chars: Vec<char> = body.chars().collect();
    if chars.len() <= 16 {
        return body.to_string();
    }
    format!("{}…{}", chars[..8].iter().collect::<String>(), chars[chars.len() - 7..].iter().collect::<String>())
}

/// `key value` lines, the values in one column however long the keys.
fn kv_table(doc: &Value) -> String {
    let Some(m) = doc.as_object() else { return String::new() };
    let width = m.keys().map(String::len).max().unwrap_or(0);
    m.iter().map(|(k, v)| format!("{k:<width$}  {}\n", plain(v))).collect()
}

/// A value as text for people: strings without quotes, a map as `k=v k=v` (`-` when
/// empty), anything else as JSON.
fn plain(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Object(m) if m.is_empty() => "-".to_string(),
        Value::Object(m) => m.iter().map(|(k, v)| format!("{k}={}", plain(v))).collect::<Vec<_>>().join(" "),
        other => other.to_string(),
    }
}

use packd_proto::units::format_size;

fn parse_size(text: &str) -> anyhow::Result<u64> {
    Ok(packd_proto::units::parse_size(text)?)
}

/// Checks both planes (see [`ControlCmd::Health`]).
async fn health(dir: &Path, json: bool) -> anyhow::Result<ExitCode> {
    use tonic_health::pb::health_check_response::ServingStatus;
    let data = dir.join(packd_client::DATA_SOCKET);
    let connected = std::os::unix::net::UnixStream::connect(&data);
    // A socket this user may not use is no sign that packd is down: say so, and how to fix it.
    let denied = matches!(&connected, Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied);
    let data_ok = connected.map_err(|e| format!("{}: {e}; {}", data.display(), packd_client::connect_hint(&data, &e)));
    let path = dir.join(CONTROL_SOCKET);
    let control = async {
        let channel = Endpoint::from_shared(format!("unix://{}", path.display()))?.connect().await?;
        let mut h = tonic_health::pb::health_client::HealthClient::new(channel);
        let req = tonic_health::pb::HealthCheckRequest { service: packd_proto::CONTROL_SERVICE.to_string() };
        anyhow::Ok(h.check(req).await?.into_inner().status())
    };
    let control_ok = match control.await {
        Ok(ServingStatus::Serving) => Ok(()),
        Ok(other) => Err(format!("{}: {}", path.display(), other.as_str_name())),
        Err(e) => {
            let why = if closed_under_us(e.root_cause()) { format!(": {CLOSED_AT_ONCE}") } else { String::new() };
            Err(format!("{}: {}{why}", path.display(), e.root_cause()))
        }
    };
    let ok = data_ok.is_ok() && control_ok.is_ok();
    let err = |r: &Result<_, String>| r.as_ref().err().cloned().unwrap_or_default();
    let doc = json!({"serving": ok, "data": err(&data_ok.as_ref().map(drop).map_err(Clone::clone)), "control": err(&control_ok)});
    print(&doc, json, |_| {
        if ok {
            "packd is serving\n".to_string()
        } else {
            format!(
                "{}:{}{}\n",
                if denied { "this user may not use packd's sockets" } else { "packd is not serving" },
                data_ok.as_ref().err().map_or(String::new(), |e| format!(" {e};")),
                control_ok.as_ref().err().map_or(String::new(), |e| format!(" {e}"))
            )
        }
    });
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

impl ControlCmd {
    /// The call a command waits for, for messages.
    fn rpc(&self) -> &'static str {
        match self {
            ControlCmd::Health { .. } => "grpc.health.v1.Health/Check",
            ControlCmd::Stats { .. } => "GetStats",
            ControlCmd::Ls { .. } => "ListEntries",
            ControlCmd::Clients { .. } => "ListClients",
            ControlCmd::Models { .. } => "ListModels",
            ControlCmd::Evict { .. } => "Evict",
            ControlCmd::Pin { .. } => "Pin",
            ControlCmd::Unpin { .. } => "Unpin",
            ControlCmd::Budget { .. } => "SetBudget",
            ControlCmd::Prefetch { .. } => "Prefetch",
        }
    }
}

/// Runs one control-plane command, giving up after `timeout`.
pub fn run(dir: &Path, cmd: ControlCmd, timeout: std::time::Duration) -> anyhow::Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let what = cmd.rpc();
    rt.block_on(async {
        match tokio::time::timeout(timeout, run_cmd(dir, cmd)).await {
            Ok(result) => result,
            Err(_) => anyhow::bail!(
                "{what}: no answer from packd at {} in {} s (--timeout); is it running, or at its open-file limit?",
                dir.join(CONTROL_SOCKET).display(),
                timeout.as_secs_f64()
            ),
        }
    })
}

async fn run_cmd(dir: &Path, cmd: ControlCmd) -> anyhow::Result<ExitCode> {
    let mut c = match cmd {
        ControlCmd::Health { json } => return health(dir, json).await,
        _ => connect(dir).await?,
    };
    match cmd {
        ControlCmd::Health { .. } => {}
        ControlCmd::Stats { json, bytes } => print_stats(&mut c, json, bytes).await?,
        ControlCmd::Ls { prefix, entries, wide, bytes, json } => {
            ls(&mut c, prefix, Table { entries, wide, bytes }, json).await?
        }
        ControlCmd::Clients { json } => clients(&mut c, json).await?,
        ControlCmd::Models { json } => models(&mut c, json).await?,
        ControlCmd::Evict { target, force, json } => evict(&mut c, target, force, json).await?,
        ControlCmd::Pin { target, json } => pin(&mut c, target, json, true).await?,
        ControlCmd::Unpin { target, json } => pin(&mut c, target, json, false).await?,
        ControlCmd::Budget { bytes, evict_most, json } => {
            let r = c
                .set_budget(pb::SetBudgetRequest { bytes: parse_size(&bytes)?, evict_most })
                .await
                .map_err(status)?
                .into_inner();
            let doc = json!({"budget_bytes": r.budget_bytes, "bytes_resident": r.bytes_resident, "fits": r.fits,
                "evicted_segments": r.evicted_segments, "evicted_bytes": r.evicted_bytes});
            print(&doc, json, |d| kv_table(&sizes_readable(d, false)));
        }
        ControlCmd::Prefetch { path, layout, rules, json } => {
            let r = c
                .prefetch(pb::PrefetchRequest { path, layout: layout.unwrap_or_default(), rules })
                .await
                .map_err(status)?
                .into_inner();
            let doc = json!({"key": r.key, "bytes": r.bytes, "entries": r.entries});
            print(&doc, json, |d| kv_table(&sizes_readable(d, false)));
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `packctl stats`.
async fn print_stats(c: &mut ControlClient<Channel>, json: bool, exact: bool) -> anyhow::Result<()> {
    let s = c.get_stats(pb::GetStatsRequest {}).await.map_err(status)?.into_inner();
    let doc = json!({
        "entries": s.entries, "segments": s.segments, "leases": s.leases, "clients": s.clients,
        "pack_jobs": s.pack_jobs, "pack_failures": s.pack_failures, "pack_seconds": s.pack_seconds,
        "hits": s.hits, "misses": s.misses, "request_errors": s.request_errors,
        "bytes_resident": s.bytes_resident, "budget_bytes": s.budget_bytes, "zombie_bytes": s.zombie_bytes,
        "spare_bytes": s.spare_bytes, "spare_takes": s.spare_takes,
        "evictions": s.evictions, "uptime_seconds": s.uptime_seconds, "isa": s.isa,
        "kernels": s.kernels.iter().collect::<std::collections::BTreeMap<_, _>>(), "kernels_reason": s.kernels_reason,
        "log_lines_suppressed": s.log_lines_suppressed, "connections_refused": s.connections_refused,
        "connections_shed": s.connections_shed,
        "control_connections": s.control_connections, "control_connections_refused": s.control_connections_refused,
        "published_segments": s.published_segments, "published_bytes": s.published_bytes,
        "builds": s.builds, "build_waits": s.build_waits, "builds_abandoned": s.builds_abandoned,
        "builds_expired": s.builds_expired, "builds_given_up": s.builds_given_up, "publishes": s.publishes,
        "build_waits_slow": s.build_waits_slow,
        "private_reports": s.private_reports,
        "builds_active": s.builds_active, "builds_refused": s.builds_refused,
        "publishes_refused": s.publishes_refused, "publishes_withdrawn": s.publishes_withdrawn, "source_hashes": s.source_hashes,
        "duplicates_dropped": s.duplicates_dropped,
    });
    // JSON: every reason (0 for none yet); text: the reasons seen.
    let fallbacks: std::collections::BTreeMap<&String, &u64> =
        s.private_fallbacks.iter().filter(|(_, n)| json || **n > 0).collect();
    let sharing = json!({
        "bytes_mapped": s.bytes_mapped, "bytes_saved": s.bytes_saved,
        "workers_served": s.workers_served, "workers_building": s.workers_building,
        "workers_private": s.workers_private, "private_bytes": s.private_bytes,
        "private_fallbacks": fallbacks,
        "worker_reports": s.worker_reports, "worker_reports_dropped": s.worker_reports_dropped,
        "lent_bytes": s.lent_bytes, "builds_lent": s.builds_lent, "lends_refused": s.lends_refused,
        "lends_revoked": s.lends_revoked, "lends_expired": s.lends_expired, "reserved_bytes": s.reserved_bytes,
        "aliases_filed": s.aliases_filed,
    });
    let mut doc = doc;
    if let (Some(d), Some(more)) = (doc.as_object_mut(), sharing.as_object()) {
        d.extend(more.clone());
    }
    if json {
        print(&doc, true, |_| String::new());
        return Ok(());
    }
    let clients = c.list_clients(pb::ListClientsRequest {}).await.map_err(status)?.into_inner().clients;
    crate::output::emit(&crate::stats::text(&s, &crate::stats::by_engine(&clients), exact));
    Ok(())
}

/// How `packctl ls` prints its table.
#[derive(Clone, Copy, Debug)]
struct Table {
    entries: bool,
    wide: bool,
    bytes: bool,
}

/// A size as the tables print it: KiB/MiB/GiB, or bytes with `exact`.
fn size_text(n: u64, exact: bool) -> String {
    if exact { n.to_string() } else { format_size(n) }
}

/// `doc` with every `…bytes…` number as KiB/MiB/GiB (unless `exact`).
fn sizes_readable(doc: &Value, exact: bool) -> Value {
    let mut doc = doc.clone();
    if let (false, Some(m)) = (exact, doc.as_object_mut()) {
        for (k, v) in m.iter_mut() {
            if let (true, Some(n)) = (k.contains("bytes"), v.as_u64()) {
                *v = Value::String(format_size(n));
            }
        }
    }
    doc
}

/// `packctl ls`.
async fn ls(c: &mut ControlClient<Channel>, prefix: String, table: Table, json: bool) -> anyhow::Result<()> {
    let r = c.list_entries(pb::ListEntriesRequest { prefix }).await.map_err(status)?.into_inner();
    let list: Vec<Value> = r
        .entries
        .iter()
        .map(|e| {
            json!({"key": e.key, "segment_key": e.segment_key, "name": e.name, "layout": e.layout,
                   "bytes": e.bytes, "refcount": e.refcount, "pinned": e.pinned, "hits": e.hits,
                   "last_access": e.last_access, "packed_at": e.packed_at, "pack_ms": e.pack_ms,
                   "blake3": e.blake3, "publisher_uid": e.publisher_uid, "identity": e.identity,
                   "label": e.label, "segment_bytes": e.segment_bytes, "resident_bytes": e.resident_bytes})
        })
        .collect();
    print(&json!({ "entries": list }), json, |_| segment_table(&r.entries, table));
    Ok(())
}

/// `packctl clients`.
async fn clients(c: &mut ControlClient<Channel>, json: bool) -> anyhow::Result<()> {
    let r = c.list_clients(pb::ListClientsRequest {}).await.map_err(status)?.into_inner();
    let list: Vec<Value> = r
        .clients
        .iter()
        .map(|c| {
            let reports: Vec<Value> = c.reports.iter().map(report_json).collect();
            json!({"id": c.id, "pid": c.pid, "uid": c.uid, "gid": c.gid, "connected_since": c.connected_since,
                   "leases": c.leases, "bytes_mapped": c.bytes_mapped, "builds": c.builds, "reports": reports})
        })
        .collect();
    print(&json!({ "clients": list }), json, |_| {
        let mut t = format!(
            "{:>6} {:>8} {:>6} {:>6} {:>6} {:>10} {:>6}  {}\n",
            "id", "pid", "uid", "gid", "leases", "mapped", "builds", "reported"
        );
        for c in &r.clients {
            t.push_str(&format!(
                "{:>6} {:>8} {:>6} {:>6} {:>6} {:>10} {:>6}  {}\n",
                c.id,
                c.pid,
                c.uid,
                c.gid,
                c.leases,
                format_size(c.bytes_mapped),
                c.builds,
                c.reports.iter().map(report_text).collect::<Vec<_>>().join("; ")
            ));
        }
        t
    });
    Ok(())
}

/// A worker's report as JSON.
fn report_json(w: &pb::WorkerStatus) -> Value {
    let r = w.report.clone().unwrap_or_default();
    json!({"engine": r.engine, "model": r.model, "obtained": obtained_name(r.obtained()),
           "fallback": if r.obtained() == pb::Obtained::Private { Some(fallback_name(r.fallback())) } else { None },
           "detail": r.detail, "private_bytes": r.private_bytes, "shared_bytes": r.shared_bytes,
           "reported_at": w.reported_at})
}

/// `text` cut to `max` characters, the cut marked with `…`.
fn shorten(text: &str, max: usize) -> String {
    if text.chars().count() > max {
        format!("{}…", text.chars().take(max.saturating_sub(1)).collect::<String>())
    } else {
        text.to_string()
    }
}

/// A worker's report in a few words: `private over_quota (xnnpack m2, 12 KiB)`.
pub fn report_text(w: &pb::WorkerStatus) -> String {
    let r = w.report.clone().unwrap_or_default();
    let model = shorten(&r.model, 24);
    match r.obtained() {
        pb::Obtained::Private => {
            format!(
                "private {} ({} {}, {})",
                fallback_name(r.fallback()),
                r.engine,
                model,
                format_size(r.private_bytes)
            )
        }
        o => format!("{} ({} {}, {})", obtained_name(o), r.engine, model, format_size(r.shared_bytes)),
    }
}

/// `served`, `built`, `private`.
pub fn obtained_name(o: pb::Obtained) -> &'static str {
    match o {
        pb::Obtained::Served => "served",
        pb::Obtained::Built => "built",
        pb::Obtained::Private => "private",
        pb::Obtained::Unspecified => "unknown",
    }
}

/// The reason's lowercase name, as the daemon's stats and metrics name it.
pub fn fallback_name(f: pb::Fallback) -> String {
    packd_client::report::fallback_name(f)
}

/// `packctl models`.
async fn models(c: &mut ControlClient<Channel>, json: bool) -> anyhow::Result<()> {
    let r = c.list_models(pb::ListModelsRequest {}).await.map_err(status)?.into_inner();
    let list: Vec<Value> = r
        .models
        .iter()
        .map(|m| {
            json!({"model": m.model, "label": m.label, "segments": m.segments, "bytes_resident": m.bytes_resident,
                   "bytes_mapped": m.bytes_mapped, "bytes_saved": m.bytes_saved, "workers_served": m.workers_served,
                   "workers_building": m.workers_building, "workers_private": m.workers_private,
                   "private_bytes": m.private_bytes, "hits": m.hits})
        })
        .collect();
    print(&json!({ "models": list }), json, |_| {
        let mut t = format!(
            "{:>10} {:>10} {:>10} {:>6} {:>8} {:>7} {:>10}  {}\n",
            "resident", "mapped", "saved", "served", "building", "private", "hits", "model"
        );
        for m in &r.models {
            let name = if m.label.is_empty() || m.label == m.model { m.model.as_str() } else { m.label.as_str() };
            // The table fits 100 columns: a long identity is cut (--json has it whole).
            let name = shorten(name, 31);
            t.push_str(&format!(
                "{:>10} {:>10} {:>10} {:>6} {:>8} {:>7} {:>10}  {}\n",
                format_size(m.bytes_resident),
                format_size(m.bytes_mapped),
                format_size(m.bytes_saved),
                m.workers_served,
                m.workers_building,
                m.workers_private,
                m.hits,
                name
            ));
        }
        t
    });
    Ok(())
}

/// `packctl evict`.
async fn evict(c: &mut ControlClient<Channel>, target: Target, force: bool, json: bool) -> anyhow::Result<()> {
    let (key, prefix) = target.parts();
    let r = c.evict(pb::EvictRequest { key, prefix, force }).await.map_err(status)?.into_inner();
    print(&json!({"evicted": r.evicted, "zombies": r.zombies}), json, |_| {
        let mut t = String::new();
        for k in &r.evicted {
            t.push_str(&format!("evicted {k}\n"));
        }
        for k in &r.zombies {
            t.push_str(&format!("evicted {k} (still leased: freed when released)\n"));
        }
        t
    });
    Ok(())
}

async fn pin(c: &mut ControlClient<Channel>, target: Target, json: bool, pinned: bool) -> anyhow::Result<()> {
    let (key, prefix) = target.parts();
    let req = pb::PinRequest { key, prefix };
    let r = if pinned { c.pin(req).await } else { c.unpin(req).await }.map_err(status)?.into_inner();
    let verb = if pinned { "pinned" } else { "unpinned" };
    print(&json!({ verb: r.segments }), json, |_| r.segments.iter().map(|k| format!("{verb} {k}\n")).collect());
    Ok(())
}

/// Evicts segment `key` if it is packed and unleased (for benchmarks that need a cold
/// start); a missing segment is fine, a leased one is reported and left alone.
pub fn evict_quietly(dir: &Path, key: &str) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let mut c = connect(dir).await?;
        match c.evict(pb::EvictRequest { key: key.to_string(), prefix: String::new(), force: false }).await {
            Ok(_) => Ok(()),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(()),
            Err(s) => {
                eprintln!("note: {key} stays packed ({}); the first worker will find it packed", s.message());
                Ok(())
            }
        }
    })
}

/// The daemon's counters (for benchmarks).
pub fn stats(dir: &Path) -> anyhow::Result<pb::Stats> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let mut c = connect(dir).await?;
        Ok(c.get_stats(pb::GetStatsRequest {}).await.map_err(status)?.into_inner())
    })
}
