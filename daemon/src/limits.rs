//! Limits on what clients can make the daemon hold or do: connections, request sizes, fds,
//! deadlines, blocking work and log lines.
//!
//! Every limit has a key in the `[limits]` table of the config file (deploy/packd.toml
//! documents each with its default) and a sentence here on why the default is what it is.
//! A request that hits a limit fails with an error naming the limit's key; it never slows
//! down another client. docs/SECURITY.md lists them all.
#![forbid(unsafe_code)]

use std::time::Duration;

use serde::Deserialize;

/// The limits in effect.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// Data-plane connections open at once, from everyone. Each costs a task and a socket
    /// (about 2 KiB while idle); 4096 is far beyond the eight to a few hundred workers a host
    /// runs, and far below the daemon's open-file limit.
    pub max_connections: usize,
    /// Data-plane connections open at once by one uid, so one user cannot take every slot.
    pub max_connections_per_uid: usize,
    /// Control-plane (gRPC) connections open at once, from everyone (TCP ones included);
    /// an admin's Unix connection is held to its uid's limit only, so operators can always
    /// look at a daemon whose global limit others filled.
    /// Each costs a socket, a task and HTTP/2 state (about 16 KiB idle, at most ~0.4 MiB
    /// of a client's bytes); `packctl` and grpcurl open one per command (`packctl top` one
    /// per refresh), so 256 is far beyond what a host's operators use.
    pub max_control_connections: usize,
    /// Control-plane connections open at once by one uid (all TCP callers count as one):
    /// a user who leaks connections locks out only itself, and it takes eight such users to
    /// fill `max_control_connections`. Past a limit the newcomer is closed at once (HTTP/2
    /// cannot be told why first), logged, and counted in `control_connections_refused`.
    pub max_control_connections_per_uid: usize,
    /// Largest request payload in bytes. Requests are a key or a plan: a few hundred bytes;
    /// 64 KiB leaves room for plans with hundreds of rules.
    pub max_request_bytes: usize,
    /// Time a client has to finish a frame once its first byte arrived (against slowloris).
    /// A real client writes a frame in one call; 10 s forgives a stalled peer.
    pub frame_timeout: Duration,
    /// A connection that holds no lease and sends nothing for this long is closed. Workers
    /// hold leases and are never closed; an idle client reconnects on its next call.
    pub idle_timeout: Duration,
    /// A source (the client's fd, or a file under a model root) that does not answer a read
    /// or an open for this long fails its request. Local disks answer in milliseconds; a
    /// network file system that hangs longer is not one to load weights from.
    pub source_timeout: Duration,
    /// Blocking operations on sources (checks, header reads, hashing, pack jobs) running at
    /// once, from everyone; more wait their turn. Two per core keeps the disk and the cores
    /// busy without letting a flood of requests start thousands of threads.
    pub max_source_ops: usize,
    /// Blocking operations on sources running at once for one uid: a user whose sources
    /// hang holds at most this many threads; its further requests wait their turn for at
    /// most `source_timeout`, then fail. Other uids are not delayed.
    pub max_source_ops_per_uid: usize,
    /// Frames one connection may have handled in a row before it lets others run.
    pub frames_per_turn: usize,
    /// Segments the index holds at most, each an open fd (packed, published or adopted).
    /// At the limit a new one evicts the least recently used unleased, unpinned segment,
    /// as the byte budget does; if every segment is held, it is refused. Default: the
    /// open-file limit (raised to its hard limit at start) less the connection limits and
    /// 1024 for everything else, at least 64 — so segments alone can never take the fds
    /// that connections and pack jobs need.
    pub max_segments: usize,
    /// Leases one uid may hold at once over all its connections. A worker holds one per
    /// model it maps; 16 384 is far beyond what real workers hold, and stops one user's
    /// runaway loop of gets from pinning the index (leased segments cannot be evicted).
    pub max_leases_per_uid: u64,
    /// Bytes (as charged to the budget) of segments in the index that one uid's data-plane
    /// requests caused to be packed, and reserved by its running pack jobs; a pack over it
    /// is refused before any work. `None`
    /// (the default) means only the budget applies: on a host whose workers all run as
    /// one user a smaller share would only refuse them; on a shared host, set it to the
    /// share each user may take.
    pub max_packed_bytes_per_uid: Option<u64>,
    /// Per-request failures logged per second at most; the rest are counted and summarised
    /// in one line per second (so 40 000 bad requests cannot fill the journal).
    pub request_log_per_second: u32,
    /// How long a connection keeps the role of building a published segment (an acquire
    /// may ask for less). XNNPACK packs MiniLM in tens of milliseconds and a 7B model in tens
    /// of seconds; 120 s covers both on a slow host, and a builder that hangs holds its
    /// namespace's waiters no longer than that.
    pub build_timeout: Duration,
    /// How long an acquire waits at most for another connection's build (an acquire may ask
    /// for less); then it is told to build privately. Waiting costs no thread.
    pub build_wait: Duration,
    /// Largest segment a client may publish. The budget and the per-uid quota still apply;
    /// this refuses a single absurd publication before any of it is read.
    pub max_publish_bytes: u64,
    /// Most entries one publication may have (and the table must fit in
    /// `max_request_bytes`). An engine publishes one entry per packed operator: a few
    /// hundred for an LLM.
    pub max_publish_entries: usize,
    /// Bytes of memfds one uid's builders may have lent at once (allocated by the daemon
    /// while their model is hashed, until published; one never published stays counted
    /// until restart, since the daemon cannot see when its builder lets it go). `None`: a
    /// quarter of the budget; never more than the budget. They also count in the budget,
    /// where anything that needs room takes unclaimed ones back first. 0 turns lending off.
    pub max_lent_bytes_per_uid: Option<u64>,
    /// How long lent memory waits for a builder to claim it after its digest's reply
    /// before it is freed. Workers that start together acquire within milliseconds of the
    /// reply; 10 s covers a loaded host.
    pub lend_claim_timeout: Duration,
    /// Builder roles of published segments one connection may hold at once (each ~600
    /// bytes until it ends). A worker takes one per model it loads through an engine and
    /// ends it by publishing within seconds; 256 is far beyond that, and stops a client that
    /// asks for identity after identity without publishing from growing the daemon's heap.
    pub max_builds_per_connection: u64,
    /// Builder roles one uid may hold at once over all its connections: 4096 × ~600 bytes
    /// is at most ~2.4 MiB per uid.
    pub max_builds_per_uid: u64,
    /// Models one connection's worker reports are kept for (the latest report per engine
    /// and model, ~600 bytes each); reports of more models are counted, not kept. A worker
    /// reports once per model it loads.
    pub max_reports_per_connection: usize,
}

/// Open fds set aside, besides connections and segments: listening sockets, files being
/// packed, fds waiting to be closed, the spare, persistence, logs.
const FDS_SET_ASIDE: u64 = 1024;

/// Default of `max_segments`: the open-file limit `nofile` less the connection limits and
/// [`FDS_SET_ASIDE`], at least 64.
fn default_max_segments(nofile: u64, connections: usize, control_connections: usize) -> usize {
    let taken = (connections as u64).saturating_add(control_connections as u64).saturating_add(FDS_SET_ASIDE);
    usize::try_from(nofile.saturating_sub(taken)).unwrap_or(usize::MAX).max(64)
}

/// Default of `max_source_ops_per_uid`.
const DEFAULT_SOURCE_OPS_PER_UID: usize = 4;

/// Default of `max_source_ops`: two per core, and always twice what one uid may hold, so a
/// uid whose reads hang (each keeps its slot until the read returns) leaves as many slots to
/// everyone else on a host of one or two cores.
fn default_source_ops(cores: usize, per_uid: usize) -> usize {
    (2 * cores.max(1)).max(2 * per_uid)
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 4096,
            max_connections_per_uid: 1024,
            max_control_connections: 256,
            max_control_connections_per_uid: 32,
            max_request_bytes: 64 << 10,
            frame_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(300),
            source_timeout: Duration::from_secs(30),
            max_source_ops: default_source_ops(
                std::thread::available_parallelism().map_or(2, usize::from),
                DEFAULT_SOURCE_OPS_PER_UID,
            ),
            max_source_ops_per_uid: DEFAULT_SOURCE_OPS_PER_UID,
            frames_per_turn: 16,
            max_segments: default_max_segments(crate::sys::proc::open_file_limit(), 4096, 256),
            max_leases_per_uid: 16_384,
            max_packed_bytes_per_uid: None,
            request_log_per_second: 20,
            build_timeout: Duration::from_secs(120),
            build_wait: Duration::from_secs(120),
            max_publish_bytes: 64 << 30,
            max_publish_entries: 16_384,
            max_lent_bytes_per_uid: None,
            lend_claim_timeout: Duration::from_secs(10),
            max_builds_per_connection: 256,
            max_builds_per_uid: 4096,
            max_reports_per_connection: 64,
        }
    }
}

impl Limits {
    /// The limits as `key = value` lines in the config file's terms.
    pub fn describe(&self) -> Vec<String> {
        let secs = |d: Duration| format!("{} s", d.as_secs_f64());
        vec![
            format!("max_connections = {}", self.max_connections),
            format!("max_connections_per_uid = {}", self.max_connections_per_uid),
            format!("max_control_connections = {}", self.max_control_connections),
            format!("max_control_connections_per_uid = {}", self.max_control_connections_per_uid),
            format!("max_request_bytes = {}", self.max_request_bytes),
            format!("frame_timeout = {}", secs(self.frame_timeout)),
            format!("idle_timeout = {}", secs(self.idle_timeout)),
            format!("source_timeout = {}", secs(self.source_timeout)),
            format!("max_source_ops = {}", self.max_source_ops),
            format!("max_source_ops_per_uid = {}", self.max_source_ops_per_uid),
            format!("max_segments = {}", self.max_segments),
            format!("frames_per_turn = {}", self.frames_per_turn),
            format!("max_leases_per_uid = {}", self.max_leases_per_uid),
            format!(
                "max_packed_bytes_per_uid = {}",
                self.max_packed_bytes_per_uid.map_or("none (the budget applies)".to_string(), |b| b.to_string())
            ),
            format!("request_log_per_second = {}", self.request_log_per_second),
            format!("build_timeout = {}", secs(self.build_timeout)),
            format!("build_wait = {}", secs(self.build_wait)),
            format!("max_publish_bytes = {}", self.max_publish_bytes),
            format!("max_publish_entries = {}", self.max_publish_entries),
            format!(
                "max_lent_bytes_per_uid = {}",
                self.max_lent_bytes_per_uid.map_or("a quarter of the budget".to_string(), |b| b.to_string())
            ),
            format!("lend_claim_timeout = {}", secs(self.lend_claim_timeout)),
            format!("max_builds_per_connection = {}", self.max_builds_per_connection),
            format!("max_builds_per_uid = {}", self.max_builds_per_uid),
            format!("max_reports_per_connection = {}", self.max_reports_per_connection),
        ]
    }
}

/// The `[limits]` table of the config file; every key is optional.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsFile {
    /// See [`Limits::max_connections`].
    pub max_connections: Option<usize>,
    /// See [`Limits::max_connections_per_uid`].
    pub max_connections_per_uid: Option<usize>,
    /// See [`Limits::max_control_connections`].
    pub max_control_connections: Option<usize>,
    /// See [`Limits::max_control_connections_per_uid`].
    pub max_control_connections_per_uid: Option<usize>,
    /// See [`Limits::max_request_bytes`].
    pub max_request_bytes: Option<usize>,
    /// See [`Limits::frame_timeout`] (seconds).
    pub frame_timeout: Option<f64>,
    /// See [`Limits::idle_timeout`] (seconds).
    pub idle_timeout: Option<f64>,
    /// See [`Limits::source_timeout`] (seconds).
    pub source_timeout: Option<f64>,
    /// See [`Limits::max_source_ops`].
    pub max_source_ops: Option<usize>,
    /// See [`Limits::max_source_ops_per_uid`].
    pub max_source_ops_per_uid: Option<usize>,
    /// See [`Limits::max_segments`].
    pub max_segments: Option<usize>,
    /// See [`Limits::frames_per_turn`].
    pub frames_per_turn: Option<usize>,
    /// See [`Limits::max_leases_per_uid`].
    pub max_leases_per_uid: Option<u64>,
    /// See [`Limits::max_packed_bytes_per_uid`]: a byte count, or a string with a K, M, G
    /// or T suffix.
    pub max_packed_bytes_per_uid: Option<toml::Value>,
    /// See [`Limits::request_log_per_second`].
    pub request_log_per_second: Option<u32>,
    /// See [`Limits::build_timeout`] (seconds).
    pub build_timeout: Option<f64>,
    /// See [`Limits::build_wait`] (seconds).
    pub build_wait: Option<f64>,
    /// See [`Limits::max_publish_bytes`]: a byte count, or a string with a K, M, G or T
    /// suffix.
    pub max_publish_bytes: Option<toml::Value>,
    /// See [`Limits::max_publish_entries`].
    pub max_publish_entries: Option<usize>,
    /// See [`Limits::max_lent_bytes_per_uid`]: 0, a byte count, or a string with a K, M, G
    /// or T suffix.
    pub max_lent_bytes_per_uid: Option<toml::Value>,
    /// See [`Limits::lend_claim_timeout`] (seconds).
    pub lend_claim_timeout: Option<f64>,
    /// See [`Limits::max_builds_per_connection`].
    pub max_builds_per_connection: Option<u64>,
    /// See [`Limits::max_builds_per_uid`].
    pub max_builds_per_uid: Option<u64>,
    /// See [`Limits::max_reports_per_connection`].
    pub max_reports_per_connection: Option<usize>,
}

/// Largest `max_request_bytes` accepted: the protocol's ceiling, which clients were
/// promised before the limit became configurable.
pub const REQUEST_BYTES_CEILING: usize = packd_proto::frame::MAX_REQUEST_BYTES;

/// A `[limits]` value out of range; each names its key.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LimitsError {
    /// A count of 0.
    #[error("limits.{0} must be at least 1")]
    Zero(&'static str),
    /// A duration that is not a positive number of seconds up to a day.
    #[error("limits.{key} {seconds} must be more than 0 and at most {MAX_SECONDS} seconds")]
    Seconds {
        /// The key.
        key: &'static str,
        /// The value given.
        seconds: f64,
    },
    /// A byte count (`max_packed_bytes_per_uid`, `max_publish_bytes`) that is not one above 0.
    #[error("limits.{0} {1} is not a byte count above 0")]
    Bytes(&'static str, toml::Value),
    /// `max_request_bytes` above the protocol's ceiling.
    #[error("limits.max_request_bytes {0} is over the protocol's ceiling of {REQUEST_BYTES_CEILING} bytes")]
    OverCeiling(usize),
}

/// A byte count above 0: an integer, or a string with a K, M, G or T suffix.
fn byte_count(key: &'static str, v: &toml::Value) -> Result<u64, LimitsError> {
    match v {
        toml::Value::Integer(n) if *n > 0 => Ok(n.unsigned_abs()),
        toml::Value::String(text) => packd_proto::units::parse_size(text)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| LimitsError::Bytes(key, v.clone())),
        other => Err(LimitsError::Bytes(key, other.clone())),
    }
}

/// Longest deadline a `[limits]` duration may set: a day.
const MAX_SECONDS: f64 = 86_400.0;

impl Limits {
    /// The defaults overridden by the file's `[limits]` table, checked.
    pub fn from_file(file: &LimitsFile) -> Result<Self, LimitsError> {
        let d = Self::default();
        let count = |key: &'static str, v: Option<usize>, default: usize| match v {
            Some(0) => Err(LimitsError::Zero(key)),
            Some(n) => Ok(n),
            None => Ok(default),
        };
        let count64 = |key: &'static str, v: Option<u64>, default: u64| match v {
            Some(0) => Err(LimitsError::Zero(key)),
            Some(n) => Ok(n),
            None => Ok(default),
        };
        let secs = |key: &'static str, v: Option<f64>, default: Duration| match v {
            None => Ok(default),
            Some(s) if s.is_finite() && s > 0.0 && s <= MAX_SECONDS => Ok(Duration::from_secs_f64(s)),
            Some(seconds) => Err(LimitsError::Seconds { key, seconds }),
        };
        let per_uid_ops = count("max_source_ops_per_uid", file.max_source_ops_per_uid, d.max_source_ops_per_uid)?;
        let limits = Self {
            max_connections: count("max_connections", file.max_connections, d.max_connections)?,
            max_connections_per_uid: count(
                "max_connections_per_uid",
                file.max_connections_per_uid,
                d.max_connections_per_uid,
            )?,
            max_control_connections: count(
                "max_control_connections",
                file.max_control_connections,
                d.max_control_connections,
            )?,
            max_control_connections_per_uid: count(
                "max_control_connections_per_uid",
                file.max_control_connections_per_uid,
                d.max_control_connections_per_uid,
            )?,
            max_request_bytes: count("max_request_bytes", file.max_request_bytes, d.max_request_bytes)?,
            frame_timeout: secs("frame_timeout", file.frame_timeout, d.frame_timeout)?,
            idle_timeout: secs("idle_timeout", file.idle_timeout, d.idle_timeout)?,
            source_timeout: secs("source_timeout", file.source_timeout, d.source_timeout)?,
            max_source_ops_per_uid: per_uid_ops,
            // Unset, it follows a per-uid limit the file sets.
            max_source_ops: count(
                "max_source_ops",
                file.max_source_ops,
                default_source_ops(std::thread::available_parallelism().map_or(2, usize::from), per_uid_ops),
            )?,
            frames_per_turn: count("frames_per_turn", file.frames_per_turn, d.frames_per_turn)?,
            // Unset, it follows connection limits the file sets.
            max_segments: count(
                "max_segments",
                file.max_segments,
                default_max_segments(
                    crate::sys::proc::open_file_limit(),
                    file.max_connections.unwrap_or(d.max_connections),
                    file.max_control_connections.unwrap_or(d.max_control_connections),
                ),
            )?,
            max_leases_per_uid: count64("max_leases_per_uid", file.max_leases_per_uid, d.max_leases_per_uid)?,
            max_packed_bytes_per_uid: match &file.max_packed_bytes_per_uid {
                None => None,
                Some(v) => Some(byte_count("max_packed_bytes_per_uid", v)?),
            },
            request_log_per_second: file.request_log_per_second.unwrap_or(d.request_log_per_second),
            build_timeout: secs("build_timeout", file.build_timeout, d.build_timeout)?,
            build_wait: secs("build_wait", file.build_wait, d.build_wait)?,
            max_publish_bytes: match &file.max_publish_bytes {
                None => d.max_publish_bytes,
                Some(v) => byte_count("max_publish_bytes", v)?,
            },
            max_publish_entries: count("max_publish_entries", file.max_publish_entries, d.max_publish_entries)?,
            max_lent_bytes_per_uid: match &file.max_lent_bytes_per_uid {
                None => d.max_lent_bytes_per_uid,
                Some(toml::Value::Integer(0)) => Some(0),
                Some(v) => Some(byte_count("max_lent_bytes_per_uid", v)?),
            },
            lend_claim_timeout: secs("lend_claim_timeout", file.lend_claim_timeout, d.lend_claim_timeout)?,
            max_builds_per_connection: count64(
                "max_builds_per_connection",
                file.max_builds_per_connection,
                d.max_builds_per_connection,
            )?,
            max_builds_per_uid: count64("max_builds_per_uid", file.max_builds_per_uid, d.max_builds_per_uid)?,
            max_reports_per_connection: count(
                "max_reports_per_connection",
                file.max_reports_per_connection,
                d.max_reports_per_connection,
            )?,
        };
        if limits.max_request_bytes > REQUEST_BYTES_CEILING {
            return Err(LimitsError::OverCeiling(limits.max_request_bytes));
        }
        Ok(limits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_get_the_fds_that_connections_and_the_rest_leave() {
        assert_eq!(default_max_segments(65_536, 4096, 256), 65_536 - 4096 - 256 - 1024);
        assert_eq!(default_max_segments(1024, 4096, 256), 64, "at least 64");
        assert_eq!(default_max_segments(u64::MAX, 4096, 256), usize::MAX - 5376);
        let f: LimitsFile = toml::from_str("max_connections = 100\n").unwrap();
        let l = Limits::from_file(&f).unwrap();
        assert_eq!(l.max_segments, default_max_segments(crate::sys::proc::open_file_limit(), 100, 256));
        let f: LimitsFile = toml::from_str("max_segments = 3\n").unwrap();
        assert_eq!(Limits::from_file(&f).unwrap().max_segments, 3);
    }

    #[test]
    fn the_source_pool_leaves_one_uid_half_of_it_on_any_core_count() {
        for cores in [1, 2, 3, 4, 8, 64] {
            let ops = default_source_ops(cores, DEFAULT_SOURCE_OPS_PER_UID);
            assert!(ops >= 2 * DEFAULT_SOURCE_OPS_PER_UID && ops >= 2 * cores, "{cores} cores: {ops}");
        }
        assert_eq!(default_source_ops(2, 4), 8);
        assert_eq!(default_source_ops(16, 4), 32);
        let d = Limits::default();
        assert!(d.max_source_ops >= 2 * d.max_source_ops_per_uid);
        // A per-uid limit set alone takes the global default with it.
        let f: LimitsFile = toml::from_str("max_source_ops_per_uid = 10\n").unwrap();
        let l = Limits::from_file(&f).unwrap();
        assert!(l.max_source_ops_per_uid == 10 && l.max_source_ops >= 20, "{}", l.max_source_ops);
    }

    #[test]
    fn file_values_override_defaults_and_bad_ones_are_named() {
        let f: LimitsFile = toml::from_str("max_connections = 7\nframe_timeout = 0.5\n").unwrap();
        let l = Limits::from_file(&f).unwrap();
        assert_eq!((l.max_connections, l.frame_timeout), (7, Duration::from_millis(500)));
        assert_eq!(l.idle_timeout, Limits::default().idle_timeout);
        let f: LimitsFile = toml::from_str("max_connections_per_uid = 0").unwrap();
        assert_eq!(Limits::from_file(&f).unwrap_err(), LimitsError::Zero("max_connections_per_uid"));
        let f: LimitsFile = toml::from_str("max_control_connections_per_uid = 3").unwrap();
        let l = Limits::from_file(&f).unwrap();
        assert_eq!((l.max_control_connections, l.max_control_connections_per_uid), (256, 3));
        let f: LimitsFile = toml::from_str("max_control_connections = 0").unwrap();
        assert_eq!(Limits::from_file(&f).unwrap_err(), LimitsError::Zero("max_control_connections"));
        let f: LimitsFile = toml::from_str("idle_timeout = -1").unwrap();
        assert!(matches!(Limits::from_file(&f).unwrap_err(), LimitsError::Seconds { key: "idle_timeout", .. }));
        let f: LimitsFile = toml::from_str("max_packed_bytes_per_uid = \"2G\"\nmax_leases_per_uid = 9").unwrap();
        let l = Limits::from_file(&f).unwrap();
        assert_eq!((l.max_packed_bytes_per_uid, l.max_leases_per_uid), (Some(2 << 30), 9));
        let f: LimitsFile = toml::from_str("max_packed_bytes_per_uid = \"lots\"").unwrap();
        assert!(matches!(Limits::from_file(&f).unwrap_err(), LimitsError::Bytes("max_packed_bytes_per_uid", _)));
        let f: LimitsFile = toml::from_str("max_request_bytes = 2000000").unwrap();
        assert_eq!(Limits::from_file(&f).unwrap_err(), LimitsError::OverCeiling(2_000_000));
        assert!(toml::from_str::<LimitsFile>("max_conections = 1").is_err());
    }
}
