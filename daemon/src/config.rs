//! Command line, environment and config-file settings, validated before anything binds.
//!
//! Each setting is taken from the first of: the command-line flag, its environment
//! variable, the TOML config file, the built-in default. The config file is `--config
//! FILE`, else `$PACKD_CONFIG`, else `/etc/packd/packd.toml` when it exists.
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

use clap::Parser;
use packd_proto::units::{SizeError, format_size, parse_size};
use serde::Deserialize;

use crate::access::{DataAllow, Ids, Policy};
use crate::pack::IsaError;
use crate::pack::choice::IsaSetting;

pub use packd_proto::{CONTROL_SOCKET, DATA_SOCKET};
/// Config file read when neither `--config` nor `$PACKD_CONFIG` is given, if it exists.
pub const DEFAULT_CONFIG: &str = "/etc/packd/packd.toml";
/// Group of the sockets when `socket_group` is not set and a group of this name exists.
pub const DEFAULT_SOCKET_GROUP: &str = "packd";
/// Budgets below this are warned about: no real model fits.
pub const MIN_PLAUSIBLE_BUDGET: u64 = 64 << 20;
/// Default capacity of the digest cache.
pub const DEFAULT_DIGEST_CACHE: usize = 4096;

/// packd — packs model weights once per host into sealed shared memory and serves them to
/// inference processes over a Unix socket.
///
/// Runs in the foreground. Each setting comes from the first of: its flag, its environment
/// variable, the config file, the built-in default. Logs go to stderr; RUST_LOG sets the
/// level (e.g. RUST_LOG=packd=debug). SIGTERM or Ctrl-C stops it. Exit status 64 means bad
/// configuration or usage.
#[derive(Debug, Clone, Parser)]
#[command(name = "packd", version, about, long_about)]
pub struct Args {
    /// TOML config file with the keys socket_dir, digest_cache, isa, kernels_file, max_bytes, model_roots,
    /// control_tcp, control_tcp_allow_remote, metrics_listen, metrics_allow_remote,
    /// metrics_max_models, cache_dir, cache_max_bytes, spare_bytes, fd_store,
    /// huge_pages, shutdown_timeout, socket_mode, socket_group, admin_uids, admin_gids, allow_uids, allow_gids,
    /// trusted_publisher_uids, trusted_publisher_gids, control_tcp_allow_mutations and the [limits] table on clients: connections, request sizes,
    /// deadlines, blocking work, log lines (deploy/packd.toml documents each). Default: /etc/packd/packd.toml
    /// when it exists. SIGHUP re-reads it.
    #[arg(long, value_name = "FILE", env = "PACKD_CONFIG")]
    pub config: Option<PathBuf>,

    /// Directory for the sockets packd.sock (data plane) and control.sock (gRPC control
    /// plane); created if missing. Default: $RUNTIME_DIRECTORY (set by systemd), else
    /// /run/packd when writable, else $XDG_RUNTIME_DIR/packd.
    #[arg(long, value_name = "DIR", env = "PACKD_SOCKET_DIR")]
    pub socket_dir: Option<PathBuf>,

    /// Number of source files whose digest is remembered by (device, inode, size, mtime,
    /// ctime), so a worker that sends the same file again does not wait for hashing.
    /// Default: 4096.
    #[arg(long, value_name = "N", env = "PACKD_DIGEST_CACHE")]
    pub digest_cache: Option<usize>,

    /// Instruction set of the packing kernels: auto, one of scalar, avx2, avx512 or neon,
    /// or a comma-separated list of them. Default auto: the fastest this CPU has for each
    /// layout kind. When the CPU has more than one SIMD ISA, a start uses the measurement
    /// kept in --kernels-file, else AVX2 (or the best ISA when AVX2 is not a candidate), and
    /// measures off the start path, at low priority (a fraction of a second; seconds with
    /// scalar among the candidates); pack jobs
    /// that start after it use the fastest. A name forces that ISA for every layout; a list
    /// (e.g. scalar,avx2) measures among those. An ISA the CPU lacks is refused (`packd
    /// --version` lists them). Every ISA produces the same bytes.
    #[arg(long, value_name = "ISA", env = "PACKD_ISA")]
    pub isa: Option<String>,

    /// File that keeps the kernel measurement for this CPU (see --isa), so later starts, and
    /// other daemons of the same user given the same file, measure nothing. Default: CACHE_DIR/kernels, or
    /// none when there is no cache directory. `off`: keep none (each start measures again).
    #[arg(long, value_name = "FILE", env = "PACKD_KERNELS_FILE")]
    pub kernels_file: Option<PathBuf>,

    /// Byte budget for packed segments, e.g. 8GiB, 1.5G or 500M (K, M, G, T are powers of 1024).
    /// Before a new segment would exceed it, least-recently-used segments that no client
    /// holds and nobody pinned are evicted; if that is not enough the request fails. Default:
    /// half of the memory limit of packd's cgroup, or half of the RAM without a limit.
    #[arg(long, value_name = "BYTES", env = "PACKD_MAX_BYTES")]
    pub max_bytes: Option<String>,

    /// Memory kept allocated for the next pack job (a "spare" memfd), so that a first pack
    /// writes into pages that exist instead of allocating fresh shared memory on its
    /// critical path, e.g. 512MiB; `0` or `off`: none. Counted against --max-bytes and the
    /// first thing to go when segments need the room (never a reason to evict one); made
    /// again in the background after a job took it. Default: 128MiB, at most a sixteenth of
    /// --max-bytes.
    #[arg(long, value_name = "BYTES", env = "PACKD_SPARE_BYTES")]
    pub spare_bytes: Option<String>,

    /// Directory the control plane's Prefetch may read models from; repeatable (the
    /// environment variable takes a ':'-separated list). Without one, Prefetch is refused.
    #[arg(long = "model-root", value_name = "DIR", env = "PACKD_MODEL_ROOTS", value_delimiter = ':')]
    pub model_roots: Vec<PathBuf>,

    /// Also serve the control plane on this TCP address, e.g. 127.0.0.1:7070. Only loopback
    /// addresses are accepted unless --control-tcp-allow-remote is given.
    #[arg(long, value_name = "ADDR", env = "PACKD_CONTROL_TCP")]
    pub control_tcp: Option<String>,

    /// Allow --control-tcp on a non-loopback address (the control plane has no
    /// authentication of its own: firewall it).
    #[arg(long)]
    pub control_tcp_allow_remote: bool,

    /// Serve Prometheus metrics over HTTP at http://ADDR/metrics, e.g. 127.0.0.1:9478
    /// (off by default; a socket passed by systemd as `metrics` is used too). Only
    /// loopback addresses unless --metrics-allow-remote. docs/OPERATIONS.md lists them.
    #[arg(long, value_name = "ADDR", env = "PACKD_METRICS_LISTEN")]
    pub metrics_listen: Option<String>,

    /// Allow --metrics-listen on a non-loopback address (the metrics name models and
    /// counts workers: firewall it).
    #[arg(long)]
    pub metrics_allow_remote: bool,

    /// Models labelled one by one in the per-model metrics (the largest by resident bytes);
    /// the rest are summed as model="(other)". Default 50.
    #[arg(long, value_name = "N")]
    pub metrics_max_models: Option<usize>,

    /// Persistent cache directory: every packed segment is also written here, and valid
    /// files are served again after a restart or reboot without repacking. Default:
    /// $CACHE_DIRECTORY or $STATE_DIRECTORY (set by systemd), else $XDG_CACHE_HOME/packd,
    /// else /var/cache/packd for root, else ~/.cache/packd. `off` keeps segments in memory
    /// only (in the config file, `cache_dir = ""` too). The start log says which directory
    /// is used.
    #[arg(long, value_name = "DIR", env = "PACKD_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,

    /// Size cap of the cache directory, e.g. 20GiB; the least recently packed files are
    /// removed beyond it (their segments stay served from memory). Default: --max-bytes.
    #[arg(long, value_name = "BYTES", env = "PACKD_CACHE_MAX_BYTES")]
    pub cache_max_bytes: Option<String>,

    /// Hand every sealed segment to systemd's fd store, so a restart serves it again with
    /// no repacking and no copy: auto (when systemd announces a store in $FDSTORE), on (for
    /// systemd < 254 with FileDescriptorStoreMax= set) or off. Default: auto.
    #[arg(long, value_name = "MODE", env = "PACKD_FD_STORE")]
    pub fd_store: Option<String>,

    /// Ask for transparent huge pages on segments (MADV_HUGEPAGE): auto (ask; the host
    /// grants them when /sys/kernel/mm/transparent_hugepage/shmem_enabled is advise,
    /// within_size or always, and not when it is never, the kernel's default) or off.
    /// Allocating a 90 MB segment takes 4–10 ms instead of 40–57 ms with them
    /// (docs/OPERATIONS.md). Default: auto.
    #[arg(long, value_name = "MODE", env = "PACKD_HUGE_PAGES")]
    pub huge_pages: Option<String>,

    /// Let callers of the TCP control plane use its mutating RPCs (Evict, Pin, Unpin,
    /// SetBudget, Prefetch). TCP carries no credentials, so this makes every process that
    /// can reach the port an admin; off by default, and packd warns at start when on.
    #[arg(long)]
    pub control_tcp_allow_mutations: bool,

    /// Check the configuration (flags, environment, config file), print it and exit: 0
    /// when valid, 64 naming the bad key otherwise. Nothing is bound or started.
    #[arg(long)]
    pub check_config: bool,

    /// Seconds SIGTERM waits for running pack jobs before exiting anyway (they are
    /// abandoned; nothing half-packed is ever served or stored). Default: 20.
    #[arg(long, value_name = "SECONDS", env = "PACKD_SHUTDOWN_TIMEOUT")]
    pub shutdown_timeout: Option<f64>,
}

/// The config file's contents; every key is optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// See `--socket-dir`.
    pub socket_dir: Option<PathBuf>,
    /// See `--digest-cache`.
    pub digest_cache: Option<usize>,
    /// See `--isa`.
    pub isa: Option<String>,
    /// See `--kernels-file` (empty: none).
    pub kernels_file: Option<PathBuf>,
    /// See `--max-bytes` (a number of bytes or a string such as "8GiB").
    pub max_bytes: Option<toml::Value>,
    /// See `--model-root`.
    pub model_roots: Option<Vec<PathBuf>>,
    /// See `--control-tcp`.
    pub control_tcp: Option<String>,
    /// See `--control-tcp-allow-remote`.
    pub control_tcp_allow_remote: Option<bool>,
    /// See `--metrics-listen`.
    pub metrics_listen: Option<String>,
    /// See `--metrics-allow-remote`.
    pub metrics_allow_remote: Option<bool>,
    /// See `--metrics-max-models`.
    pub metrics_max_models: Option<usize>,
    /// See `--cache-dir` (empty: no cache).
    pub cache_dir: Option<PathBuf>,
    /// See `--cache-max-bytes`.
    pub cache_max_bytes: Option<toml::Value>,
    /// See `--spare-bytes`.
    pub spare_bytes: Option<toml::Value>,
    /// See `--fd-store`.
    pub fd_store: Option<String>,
    /// See `--huge-pages`.
    pub huge_pages: Option<String>,
    /// See `--shutdown-timeout`.
    pub shutdown_timeout: Option<f64>,
    /// See `--control-tcp-allow-mutations`.
    pub control_tcp_allow_mutations: Option<bool>,
    /// Mode of the sockets packd binds itself, as an octal string ("0660") or a number.
    pub socket_mode: Option<toml::Value>,
    /// Group of the sockets packd binds itself: a name or a gid.
    pub socket_group: Option<toml::Value>,
    /// uids allowed the control plane's mutating RPCs besides root and packd's own.
    pub admin_uids: Option<Vec<u32>>,
    /// gids whose members (primary or supplementary) may use the control plane's mutating RPCs.
    pub admin_gids: Option<Vec<u32>>,
    /// uids allowed on the data plane (empty: whoever can open the socket).
    pub allow_uids: Option<Vec<u32>>,
    /// gids (primary or supplementary) allowed on the data plane (empty: whoever can open
    /// the socket).
    pub allow_gids: Option<Vec<u32>>,
    /// uids whose published segments every client may use (a publisher's own are always
    /// visible to itself).
    pub trusted_publisher_uids: Option<Vec<u32>>,
    /// gids (primary or supplementary, when it published) whose members' published
    /// segments every client may use.
    pub trusted_publisher_gids: Option<Vec<u32>>,
    /// Limits on clients (`[limits]` table; see [`crate::limits::Limits`]).
    pub limits: Option<crate::limits::LimitsFile>,
}

/// Whether segments go to systemd's fd store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FdStoreMode {
    /// When `$FDSTORE` (systemd ≥ 254) is set and non-zero.
    Auto,
    /// Always (systemd < 254 with `FileDescriptorStoreMax=`).
    On,
    /// Never.
    Off,
}

impl FdStoreMode {
    /// Whether the store is used, given the environment.
    pub fn enabled(self) -> bool {
        match self {
            FdStoreMode::On => true,
            FdStoreMode::Off => false,
            FdStoreMode::Auto => crate::sys::notify::fd_store_max().unwrap_or(0) > 0,
        }
    }
}

/// A validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Socket directory.
    pub socket_dir: PathBuf,
    /// Digest cache capacity.
    pub digest_cache: usize,
    /// Packing kernels' instruction set: forced, or measured among candidates.
    pub isa: IsaSetting,
    /// Where the kernel measurement is kept, if anywhere.
    pub kernels_file: Option<PathBuf>,
    /// Byte budget for segments.
    pub max_bytes: u64,
    /// Where the budget came from (for the log).
    pub max_bytes_source: String,
    /// Bytes of the spare memfd kept for the next pack job (0: none).
    pub spare_bytes: u64,
    /// Whether `spare_bytes` is the default, which follows `max_bytes`.
    pub spare_bytes_default: bool,
    /// Canonical model roots for Prefetch.
    pub model_roots: Vec<PathBuf>,
    /// Loopback (or allowed) TCP address of the control plane.
    pub control_tcp: Option<std::net::SocketAddr>,
    /// Loopback (or allowed) TCP address of the metrics.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Models labelled one by one in the metrics.
    pub metrics_max_models: usize,
    /// Persistent cache directory, if any.
    pub cache_dir: Option<PathBuf>,
    /// Where the cache directory came from (for the log).
    pub cache_dir_source: &'static str,
    /// Size cap of the cache directory.
    pub cache_max_bytes: u64,
    /// Whether `cache_max_bytes` is the default, which follows `max_bytes`.
    pub cache_max_bytes_default: bool,
    /// fd store use.
    pub fd_store: FdStoreMode,
    /// Whether segments ask for transparent huge pages.
    pub huge_pages: bool,
    /// How long SIGTERM waits for running pack jobs.
    pub shutdown_timeout: std::time::Duration,
    /// Limits on what clients can make the daemon hold.
    pub limits: crate::limits::Limits,
    /// Who may use the control plane's mutating RPCs.
    pub control_policy: Policy,
    /// Who may use the data plane (empty lists: everyone who can open the socket).
    pub data_allow: DataAllow,
    /// Whose published segments every client may use (`trusted_publisher_uids`,
    /// `trusted_publisher_gids`; empty: each uid sees only its own).
    pub trusted_publishers: Ids,
    /// Mode of the sockets packd binds itself (socket activation: the socket units decide).
    pub socket_mode: u32,
    /// Group of the sockets packd binds itself (`None`: packd's own group).
    pub socket_group: Option<u32>,
    /// The socket group's name, when it was given (or found) by name.
    pub socket_group_name: Option<String>,
}

/// A configuration that cannot be used; each variant names the key (or file) at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file cannot be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The config file is not valid TOML or has an unknown key.
    #[error("config file {path}: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's error (it names the key and line).
        source: Box<toml::de::Error>,
    },
    /// No socket directory could be chosen.
    #[error(
        "no socket directory: set --socket-dir or PACKD_SOCKET_DIR, run under systemd (RUNTIME_DIRECTORY), \
         make /run/packd writable, or set XDG_RUNTIME_DIR"
    )]
    NoSocketDir,
    /// A setting outside its range (the rule says which).
    #[error("{key} {rule}")]
    Range {
        /// The key.
        key: &'static str,
        /// What the value must be, e.g. "must be at least 1".
        rule: String,
    },
    /// A setting of the wrong TOML type.
    #[error("{key} must be {expected}, not {found}")]
    Type {
        /// The key.
        key: &'static str,
        /// What it must be.
        expected: &'static str,
        /// What was found.
        found: toml::Value,
    },
    /// A byte count that does not parse.
    #[error("{key}: {source}")]
    Size {
        /// The key.
        key: &'static str,
        /// Why.
        source: SizeError,
    },
    /// The ISA asked for.
    #[error("isa: {0}")]
    Isa(#[from] IsaError),
    /// A model root that cannot be resolved.
    #[error("model root {path}: {source}")]
    ModelRoot {
        /// The root as given.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A TCP address that does not parse.
    #[error("{key} {text:?} is not an IP:PORT address: {source}")]
    Address {
        /// The setting.
        key: &'static str,
        /// The text given.
        text: String,
        /// The parser's error.
        source: std::net::AddrParseError,
    },
    /// A TCP address that is not loopback, without the flag that allows it.
    #[error(
        "{key} {addr} is not a loopback address; add --{flag}-allow-remote to serve the \
         unauthenticated {what} there",
        flag = if *key == "control_tcp" { "control-tcp" } else { "metrics" },
        what = if *key == "control_tcp" { "control plane" } else { "metrics" }
    )]
    NotLoopback {
        /// The setting.
        key: &'static str,
        /// The address.
        addr: std::net::SocketAddr,
    },
    /// The socket group named does not exist, or cannot be looked up.
    #[error("socket_group {name:?}: {}", match .source { Some(e) => e.to_string(), None => "no such group".into() })]
    Group {
        /// The group name.
        name: String,
        /// The lookup's error (`None`: no such group).
        source: Option<nix::errno::Errno>,
    },
    /// The RAM size (for the default budget) cannot be read.
    #[error("sysinfo: {0}; set --max-bytes")]
    Sysinfo(nix::errno::Errno),
    /// A `[limits]` value.
    #[error(transparent)]
    Limits(#[from] crate::limits::LimitsError),
}

fn range(key: &'static str, rule: impl Into<String>) -> ConfigError {
    ConfigError::Range { key, rule: rule.into() }
}

impl Config {
    /// Merges flags/environment (already in `args`) over the config file over defaults,
    /// and checks every value. Blocking: reads files, resolves paths, looks up a group.
    pub fn from_args(args: Args) -> Result<Self, ConfigError> {
        let file = match &args.config {
            Some(path) => read_file(path)?,
            None if Path::new(DEFAULT_CONFIG).is_file() => read_file(Path::new(DEFAULT_CONFIG))?,
            None => FileConfig::default(),
        };
        let socket_dir = socket_dir(args.socket_dir.or(file.socket_dir))?;
        let digest_cache = match args.digest_cache.or(file.digest_cache) {
            Some(0) => return Err(range("digest_cache", "must be at least 1")),
            n => n.unwrap_or(DEFAULT_DIGEST_CACHE),
        };
        let isa = args.isa.or(file.isa).map_or(Ok(IsaSetting::Auto), |name| IsaSetting::parse(&name))?;
        let (max_bytes, max_bytes_source) = match size_setting("max_bytes", args.max_bytes, file.max_bytes)? {
            Some((0, _)) => return Err(range("max_bytes", "must be more than 0")),
            Some((n, from)) => (n, from.to_string()),
            None => default_budget()?,
        };
        let (spare_bytes, spare_bytes_default) = match (args.spare_bytes, file.spare_bytes) {
            (Some(off), _) if off.trim() == "off" => (0, false),
            (None, Some(toml::Value::String(off))) if off.trim() == "off" => (0, false),
            (flag, file) => {
                size_setting("spare_bytes", flag, file)?.map_or((default_spare(max_bytes), true), |(n, _)| (n, false))
            }
        };
        let roots = if args.model_roots.is_empty() { file.model_roots.unwrap_or_default() } else { args.model_roots };
        let model_roots = roots
            .into_iter()
            .map(|path| path.canonicalize().map_err(|source| ConfigError::ModelRoot { path, source }))
            .collect::<Result<Vec<_>, _>>()?;
        let allow_remote = args.control_tcp_allow_remote || file.control_tcp_allow_remote.unwrap_or(false);
        let control_tcp =
            args.control_tcp.or(file.control_tcp).map(|a| tcp_address("control_tcp", a, allow_remote)).transpose()?;
        let metrics_remote = args.metrics_allow_remote || file.metrics_allow_remote.unwrap_or(false);
        let metrics_listen = args
            .metrics_listen
            .or(file.metrics_listen)
            .filter(|a| !a.is_empty() && a != "off")
            .map(|a| tcp_address("metrics_listen", a, metrics_remote))
            .transpose()?;
        let metrics_max_models = args.metrics_max_models.or(file.metrics_max_models).unwrap_or(50);
        let (cache_dir, cache_dir_source) = cache_dir(args.cache_dir.or(file.cache_dir))?;
        let kernels_file = match args.kernels_file.or(file.kernels_file) {
            Some(f) if f.as_os_str().is_empty() || f.as_os_str() == "off" => None,
            Some(f) if f.is_relative() || f.file_name().is_none() => {
                return Err(range("kernels_file", format!("{} must be an absolute file path, or off", f.display())));
            }
            Some(f) => Some(f),
            None => cache_dir.as_ref().map(|d| d.join(crate::persist::kernels::NAME)),
        };
        let (cache_max_bytes, cache_max_bytes_default) =
            size_setting("cache_max_bytes", args.cache_max_bytes, file.cache_max_bytes)?
                .map_or((max_bytes, true), |(n, _)| (n, false));
        let fd_store = match args.fd_store.or(file.fd_store).as_deref() {
            None | Some("auto") => FdStoreMode::Auto,
            Some("on" | "true" | "yes") => FdStoreMode::On,
            Some("off" | "false" | "no") => FdStoreMode::Off,
            Some(other) => return Err(range("fd_store", format!("{other:?} must be auto, on or off"))),
        };
        let huge_pages = match args.huge_pages.or(file.huge_pages).as_deref() {
            None | Some("auto" | "on" | "true" | "yes") => true,
            Some("off" | "false" | "no") => false,
            Some(other) => return Err(range("huge_pages", format!("{other:?} must be auto or off"))),
        };
        let shutdown_timeout = match args.shutdown_timeout.or(file.shutdown_timeout) {
            None => DEFAULT_SHUTDOWN_TIMEOUT,
            Some(s) if s.is_finite() && (0.0..=3600.0).contains(&s) => std::time::Duration::from_secs_f64(s),
            Some(s) => return Err(range("shutdown_timeout", format!("{s} must be between 0 and 3600 seconds"))),
        };
        let (socket_group, socket_group_name) = socket_group(file.socket_group)?;
        let limits = crate::limits::Limits::from_file(&file.limits.unwrap_or_default())?;
        let control_policy = Policy {
            admins: Ids { uids: file.admin_uids.unwrap_or_default(), gids: file.admin_gids.unwrap_or_default() },
            tcp_mutations: args.control_tcp_allow_mutations || file.control_tcp_allow_mutations.unwrap_or(false),
        };
        let data_allow =
            DataAllow(Ids { uids: file.allow_uids.unwrap_or_default(), gids: file.allow_gids.unwrap_or_default() });
        let trusted_publishers = Ids {
            uids: file.trusted_publisher_uids.unwrap_or_default(),
            gids: file.trusted_publisher_gids.unwrap_or_default(),
        };
        Ok(Self {
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
            cache_dir_source,
            cache_max_bytes,
            cache_max_bytes_default,
            fd_store,
            huge_pages,
            shutdown_timeout,
            limits,
            control_policy,
            data_allow,
            trusted_publishers,
            socket_mode: socket_mode(file.socket_mode)?,
            socket_group,
            socket_group_name,
        })
    }

    /// The configuration as `key = value` lines in the config file's terms, for
    /// `--check-config`.
    pub fn describe(&self) -> String {
        let list = |ids: &[u32]| {
            if ids.is_empty() { "[] (root and packd's own uid only)".to_string() } else { format!("{ids:?}") }
        };
        let opt_dir = |d: &Option<PathBuf>| d.as_ref().map_or("off".to_string(), |d| d.display().to_string());
        let mut lines = vec![
            format!("socket_dir = {}", self.socket_dir.display()),
            format!("socket_mode = {:04o}", self.socket_mode),
            format!(
                "socket_group = {}",
                match (&self.socket_group_name, self.socket_group) {
                    (Some(name), Some(gid)) => format!("{name} (gid {gid})"),
                    (None, Some(gid)) => format!("gid {gid}"),
                    _ => "packd's own group".to_string(),
                }
            ),
            format!("max_bytes = {} ({})", format_size(self.max_bytes), self.max_bytes_source),
            format!(
                "spare_bytes = {}",
                if self.spare_bytes == 0 { "off".to_string() } else { format_size(self.spare_bytes) }
            ),
            format!("cache_dir = {} ({})", opt_dir(&self.cache_dir), self.cache_dir_source),
            format!("cache_max_bytes = {}", format_size(self.cache_max_bytes)),
            format!("fd_store = {}", format!("{:?}", self.fd_store).to_lowercase()),
            format!("huge_pages = {}", if self.huge_pages { "auto" } else { "off" }),
            format!(
                "isa = {}",
                match &self.isa {
                    IsaSetting::Auto =>
                        "auto (the fastest per layout kind on this CPU: the kernels line says which)".into(),
                    IsaSetting::Among(_) => format!("{} (the fastest of these per layout kind)", self.isa),
                    IsaSetting::Forced(_) => self.isa.to_string(),
                }
            ),
            format!(
                "kernels_file = {}",
                self.kernels_file.as_ref().map_or("off".to_string(), |f| f.display().to_string())
            ),
            format!("digest_cache = {}", self.digest_cache),
            format!("model_roots = {:?}", self.model_roots),
            format!("control_tcp = {}", self.control_tcp.map_or("off".to_string(), |a| a.to_string())),
            format!("control_tcp_allow_mutations = {}", self.control_policy.tcp_mutations),
            format!("metrics_listen = {}", self.metrics_listen.map_or("off".to_string(), |a| a.to_string())),
            format!("metrics_max_models = {}", self.metrics_max_models),
            format!("shutdown_timeout = {} s", self.shutdown_timeout.as_secs_f64()),
            format!("admin_uids = {}", list(&self.control_policy.admins.uids)),
            format!("admin_gids = {:?}", self.control_policy.admins.gids),
            format!("allow_uids = {:?}", self.data_allow.0.uids),
            format!("allow_gids = {:?}", self.data_allow.0.gids),
            format!("trusted_publisher_uids = {:?}", self.trusted_publishers.uids),
            format!("trusted_publisher_gids = {:?}", self.trusted_publishers.gids),
            "[limits]".to_string(),
        ];
        lines.extend(self.limits.describe());
        lines.join("\n")
    }

    /// Settings that are valid but probably not what was meant, each as a sentence: logged
    /// at start and printed by `--check-config`.
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        if self.max_bytes < MIN_PLAUSIBLE_BUDGET {
            warnings.push(format!(
                "max_bytes is {}: smaller than almost any model, so most pack requests will be refused \
                 (sizes take units: 8GiB, 500M)",
                format_size(self.max_bytes)
            ));
        }
        if self.spare_bytes > self.max_bytes / 2 {
            warnings.push(format!(
                "spare_bytes is {}, more than half of max_bytes ({}): it is made only while that much of the \
                 budget is free, and gives way to every segment that needs the room",
                format_size(self.spare_bytes),
                format_size(self.max_bytes)
            ));
        }
        let (ops, per_uid) = (self.limits.max_source_ops, self.limits.max_source_ops_per_uid);
        if ops <= per_uid {
            warnings.push(format!(
                "limits.max_source_ops ({ops}) is not more than limits.max_source_ops_per_uid ({per_uid}): one uid \
                 whose sources hang (a stuck network or FUSE file system) can hold every slot and stall every \
                 other uid's packs and publications; make max_source_ops larger"
            ));
        }
        let l = &self.limits;
        if l.max_connections_per_uid > l.max_connections {
            warnings.push(format!(
                "limits.max_connections_per_uid ({}) is more than limits.max_connections ({}): one uid may take \
                 every connection",
                l.max_connections_per_uid, l.max_connections
            ));
        }
        let files = crate::sys::proc::open_file_limit();
        if l.max_segments as u64 > files {
            warnings.push(format!(
                "limits.max_segments ({}) is more than the open-file limit ({files}; LimitNOFILE= in the unit): each \
                 segment is an open fd, so packs fail with \"too many open files\" before max_segments is reached",
                l.max_segments
            ));
        }
        if self.cache_dir.is_some() && self.cache_max_bytes == 0 {
            warnings.push(
                "cache_max_bytes is 0: no segment is ever written to the cache directory (its files are still \
                 read at start); set cache_dir = \"off\" to say so"
                    .to_string(),
            );
        }
        warnings
    }

    /// Warnings about `socket_mode`, which applies to the sockets packd binds itself (not
    /// to sockets a service manager passes): `--check-config` and a start that binds.
    pub fn socket_mode_warning(&self) -> Option<String> {
        // Connecting to a Unix socket takes write permission.
        if self.socket_mode & 0o002 != 0 {
            Some(format!(
                "socket_mode {:04o} lets every local user connect (allow_uids, allow_gids and admin_uids still \
                 decide what each may do); 0660 limits it to socket_group",
                self.socket_mode
            ))
        } else if self.socket_mode & 0o020 == 0 {
            Some(format!(
                "socket_mode {:04o} gives the socket's group no write permission, which connecting needs: only the \
                 daemon's user can connect; 0660 lets socket_group connect",
                self.socket_mode
            ))
        } else {
            None
        }
    }

    /// `--check-config`'s warning when the sockets packd binds would be reachable only by
    /// root (the running daemon checks the real socket instead).
    pub fn socket_warning(&self) -> Option<String> {
        if self.socket_group.is_none() && nix::unistd::geteuid().is_root() && self.socket_mode & 0o006 != 0o006 {
            return Some(format!(
                "running as root with no group {DEFAULT_SOCKET_GROUP:?} and no socket_group: the sockets will be \
                 root:root mode {:04o}, so only root can connect (nothing to do if every worker runs as root); \
                 for workers of other users create the group (groupadd --system {DEFAULT_SOCKET_GROUP}; usermod \
                 -aG {DEFAULT_SOCKET_GROUP} USER) or set socket_group",
                self.socket_mode
            ));
        }
        None
    }

    /// Path of the data socket.
    pub fn data_socket(&self) -> PathBuf {
        self.socket_dir.join(DATA_SOCKET)
    }

    /// Path of the control socket.
    pub fn control_socket(&self) -> PathBuf {
        self.socket_dir.join(CONTROL_SOCKET)
    }
}

/// How long SIGTERM waits for running pack jobs unless `shutdown_timeout` says otherwise.
const DEFAULT_SHUTDOWN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);

/// The socket directory: as set, else the default (see `--socket-dir`).
fn socket_dir(set: Option<PathBuf>) -> Result<PathBuf, ConfigError> {
    match set {
        Some(d) if d.as_os_str().is_empty() => Err(range("socket_dir", "must not be empty")),
        Some(d) => Ok(d),
        None => default_socket_dir().ok_or(ConfigError::NoSocketDir),
    }
}

/// A TCP address setting (`key`): loopback unless `allow_remote`.
fn tcp_address(key: &'static str, text: String, allow_remote: bool) -> Result<std::net::SocketAddr, ConfigError> {
    let addr: std::net::SocketAddr = text.parse().map_err(|source| ConfigError::Address { key, text, source })?;
    if !addr.ip().is_loopback() && !allow_remote {
        return Err(ConfigError::NotLoopback { key, addr });
    }
    Ok(addr)
}

/// The cache directory and where it came from: as set (`off` or empty: none), else the
/// default (see `--cache-dir`).
fn cache_dir(set: Option<PathBuf>) -> Result<(Option<PathBuf>, &'static str), ConfigError> {
    match set {
        Some(d) if d.as_os_str().is_empty() || d.as_os_str() == "off" => Ok((None, "turned off")),
        Some(d) if d.is_relative() => {
            Err(range("cache_dir", format!("{} must be an absolute path, or off", d.display())))
        }
        Some(d) => Ok((Some(d), "set")),
        None => Ok(default_cache_dir().map_or((None, "no default applies"), |(d, from)| (Some(d), from))),
    }
}

/// The default cache directory and why: systemd's `$CACHE_DIRECTORY` or
/// `$STATE_DIRECTORY`, else `$XDG_CACHE_HOME/packd`, else `/var/cache/packd` for root
/// (when `/var/cache` can take it), else `$HOME/.cache/packd`.
pub fn default_cache_dir() -> Option<(PathBuf, &'static str)> {
    let env = |v: &str| std::env::var_os(v).filter(|d| !d.is_empty()).map(PathBuf::from);
    for (var, from) in [("CACHE_DIRECTORY", "$CACHE_DIRECTORY"), ("STATE_DIRECTORY", "$STATE_DIRECTORY")] {
        if let Some(d) = env(var) {
            // systemd may list several directories separated by ':'; the first is ours.
            return Some((PathBuf::from(d.to_string_lossy().split(':').next().unwrap_or_default()), from));
        }
    }
    if let Some(d) = env("XDG_CACHE_HOME").filter(|d| d.is_absolute()) {
        return Some((d.join("packd"), "$XDG_CACHE_HOME"));
    }
    let system = Path::new("/var/cache/packd");
    if nix::unistd::geteuid().is_root() && (writable(system) || (!system.exists() && writable(Path::new("/var/cache"))))
    {
        return Some((system.to_path_buf(), "default for root"));
    }
    env("HOME").filter(|d| d.is_absolute()).map(|d| (d.join(".cache/packd"), "$HOME/.cache"))
}

/// The mode of the sockets packd binds: an octal string (`"0660"`) or a number, at most
/// 0777, and readable and writable by packd's own user. Default 0660. A number is read as
/// the octal digits a user writes, as chmod does (`660`); TOML's `0o660` (the number 432)
/// is accepted too: the two readings cannot both be valid modes.
fn socket_mode(set: Option<toml::Value>) -> Result<u32, ConfigError> {
    let valid = |mode: u32| mode <= 0o777 && mode & 0o600 == 0o600;
    let rule = "must be an octal mode of at most 777 that lets packd's own user read and write (6xx), such as \"0660\"";
    let mode = match set {
        None => 0o660,
        Some(toml::Value::String(m)) => u32::from_str_radix(m.trim_start_matches("0o"), 8)
            .ok()
            .filter(|&mode| valid(mode))
            .ok_or_else(|| range("socket_mode", format!("{m:?} {rule}")))?,
        Some(toml::Value::Integer(n)) => [u32::from_str_radix(&n.to_string(), 8).ok(), u32::try_from(n).ok()]
            .into_iter()
            .flatten()
            .find(|&mode| valid(mode))
            .ok_or_else(|| range("socket_mode", format!("{n} {rule}")))?,
        Some(found) => {
            return Err(ConfigError::Type { key: "socket_mode", expected: "an octal string such as \"0660\"", found });
        }
    };
    Ok(mode)
}

/// The group of the sockets packd binds, and its name when known: a gid, or a name looked
/// up (NSS); by default the group `packd` when it exists, else packd's own group.
fn socket_group(set: Option<toml::Value>) -> Result<(Option<u32>, Option<String>), ConfigError> {
    let by_name = |name: String| match nix::unistd::Group::from_name(&name) {
        Ok(Some(g)) => Ok((Some(g.gid.as_raw()), Some(name))),
        Ok(None) => Err(ConfigError::Group { name, source: None }),
        Err(e) => Err(ConfigError::Group { name, source: Some(e) }),
    };
    match set {
        None => Ok(by_name(DEFAULT_SOCKET_GROUP.to_string()).unwrap_or((None, None))),
        Some(toml::Value::Integer(n)) => {
            u32::try_from(n).map(|g| (Some(g), None)).map_err(|_| range("socket_group", format!("{n} is not a gid")))
        }
        Some(toml::Value::String(name)) => by_name(name),
        Some(found) => Err(ConfigError::Type { key: "socket_group", expected: "a group name or a gid", found }),
    }
}

/// A byte-count setting from its flag (a string) or the config file (a number or a string),
/// with where it came from; `None` when neither sets it.
fn size_setting(
    key: &'static str,
    flag: Option<String>,
    file: Option<toml::Value>,
) -> Result<Option<(u64, &'static str)>, ConfigError> {
    let size = |text: &str| parse_size(text).map_err(|source| ConfigError::Size { key, source });
    let found = match (flag, file) {
        (Some(v), _) => Some((size(&v)?, "flag or environment")),
        (None, Some(toml::Value::Integer(n))) => {
            Some((u64::try_from(n).map_err(|_| range(key, format!("{n} is negative")))?, "config file"))
        }
        (None, Some(toml::Value::String(v))) => Some((size(&v)?, "config file")),
        (None, Some(found)) => return Err(ConfigError::Type { key, expected: "a number or a string", found }),
        (None, None) => None,
    };
    Ok(found)
}

/// The spare's default: 128 MiB, at most a sixteenth of the budget, in whole pages.
fn default_spare(max_bytes: u64) -> u64 {
    let page = crate::sys::proc::page_size();
    (128 << 20).min(max_bytes / 16) / page * page
}

/// Half of the cgroup memory limit, or half of the machine's RAM (`sysinfo(2)`, which
/// works where `/proc/meminfo` is hidden, as under `ProcSubset=pid`).
fn default_budget() -> Result<(u64, String), ConfigError> {
    if let Some(limit) = crate::sys::proc::cgroup_memory_limit() {
        return Ok((limit / 2, format!("half of the cgroup memory limit ({limit} bytes)")));
    }
    let total = nix::sys::sysinfo::sysinfo().map_err(ConfigError::Sysinfo)?.ram_total();
    Ok((total / 2, format!("half of the RAM ({total} bytes)")))
}

fn read_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text =
        std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
    toml::from_str(&text).map_err(|e| ConfigError::Parse { path: path.to_path_buf(), source: Box::new(e) })
}

fn writable(dir: &Path) -> bool {
    nix::unistd::access(dir, nix::unistd::AccessFlags::W_OK).is_ok()
}

/// The daemon's default socket directory (see `--socket-dir`).
pub fn default_socket_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("RUNTIME_DIRECTORY").filter(|d| !d.is_empty()) {
        // systemd may list several directories separated by ':'; the first is ours.
        let first = d.to_string_lossy().split(':').next().unwrap_or_default().to_string();
        return Some(PathBuf::from(first));
    }
    let run = Path::new("/run/packd");
    if (run.is_dir() && writable(run)) || (!run.exists() && writable(Path::new("/run"))) {
        return Some(run.to_path_buf());
    }
    std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()).map(|d| PathBuf::from(d).join("packd"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Args {
        Args::try_parse_from(std::iter::once("packd").chain(list.iter().copied())).unwrap()
    }

    /// The spare: 128 MiB by default, at most a sixteenth of the budget; `off` and `0` turn it
    /// off; a size from the flag or the file; more than half the budget is warned about.
    #[test]
    fn the_spare_has_a_bounded_default_and_can_be_turned_off() {
        let c = |list: &[&str]| Config::from_args(args(&[&["--socket-dir", "/x"], list].concat())).unwrap();
        assert_eq!(c(&["--max-bytes", "8GiB"]).spare_bytes, 128 << 20);
        assert_eq!(c(&["--max-bytes", "160MiB"]).spare_bytes, 10 << 20);
        assert_eq!(c(&["--max-bytes", "8GiB", "--spare-bytes", "off"]).spare_bytes, 0);
        assert_eq!(c(&["--max-bytes", "8GiB", "--spare-bytes", "0"]).spare_bytes, 0);
        let big = c(&["--max-bytes", "1GiB", "--spare-bytes", "1GiB"]);
        assert_eq!(big.spare_bytes, 1 << 30);
        assert!(big.warnings().iter().any(|w| w.contains("spare_bytes is 1.0 GiB")), "{:?}", big.warnings());
        assert!(c(&["--max-bytes", "8GiB"]).warnings().is_empty());
        let mut one_uid_holds_all = c(&["--max-bytes", "8GiB"]);
        one_uid_holds_all.limits.max_source_ops = one_uid_holds_all.limits.max_source_ops_per_uid;
        let w = one_uid_holds_all.warnings();
        assert!(w.len() == 1 && w[0].contains("max_source_ops (4) is not more than"), "{w:?}");
        assert!(c(&["--max-bytes", "8GiB"]).describe().contains("spare_bytes = 128.0 MiB"));
        let e = Config::from_args(args(&["--socket-dir", "/x", "--spare-bytes", "lots"])).unwrap_err();
        assert!(matches!(e, ConfigError::Size { key: "spare_bytes", .. }), "{e}");
    }

    #[test]
    fn flags_override_the_file_which_overrides_defaults() {
        let dir = std::env::temp_dir().join(format!("packd-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("packd.toml");
        std::fs::write(&file, "socket_dir = \"/srv/from-file\"\ndigest_cache = 7\n").unwrap();
        let f = file.to_str().unwrap();
        let c = Config::from_args(args(&["--config", f])).unwrap();
        assert_eq!((c.socket_dir.to_str().unwrap(), c.digest_cache), ("/srv/from-file", 7));
        let c = Config::from_args(args(&["--config", f, "--socket-dir", "/x", "--digest-cache", "9"])).unwrap();
        assert_eq!((c.socket_dir.to_str().unwrap(), c.digest_cache), ("/x", 9));

        std::fs::write(&file, "socket_dri = \"/typo\"\n").unwrap();
        let e = Config::from_args(args(&["--config", f])).unwrap_err();
        assert!(matches!(e, ConfigError::Parse { .. }) && e.to_string().contains("socket_dri"), "{e}");
        let e = Config::from_args(args(&["--config", "/nonexistent/packd.toml"])).unwrap_err();
        assert!(matches!(e, ConfigError::Read { .. }), "{e}");
        let e = Config::from_args(args(&["--socket-dir", "/x", "--digest-cache", "0"])).unwrap_err();
        assert!(matches!(e, ConfigError::Range { key: "digest_cache", .. }), "{e}");
        let e = Config::from_args(args(&["--socket-dir", "/x", "--isa", "mmx"])).unwrap_err();
        assert!(matches!(e, ConfigError::Isa(IsaError::Unknown(_))), "{e}");
        let c = Config::from_args(args(&["--socket-dir", "/x", "--isa", "scalar"])).unwrap();
        assert_eq!(c.isa, IsaSetting::Forced(crate::pack::Isa::scalar()));
        let c = Config::from_args(args(&["--socket-dir", "/x", "--isa", "auto"])).unwrap();
        assert_eq!(c.isa, IsaSetting::Auto);
        let c = Config::from_args(args(&["--socket-dir", "/x", "--cache-dir", "/c"])).unwrap();
        assert_eq!(c.kernels_file.as_deref(), Some(Path::new("/c/kernels")), "kept in the cache directory");
        let c =
            Config::from_args(args(&["--socket-dir", "/x", "--cache-dir", "off", "--kernels-file", "/k/f"])).unwrap();
        assert_eq!(c.kernels_file.as_deref(), Some(Path::new("/k/f")));
        assert!(c.describe().contains("kernels_file = /k/f"));
        let c = Config::from_args(args(&["--socket-dir", "/x", "--cache-dir", "/c", "--kernels-file", "off"])).unwrap();
        assert_eq!(c.kernels_file, None);
        let e = Config::from_args(args(&["--socket-dir", "/x", "--kernels-file", "rel"])).unwrap_err();
        assert!(matches!(e, ConfigError::Range { key: "kernels_file", .. }), "{e}");
        let c = Config::from_args(args(&["--socket-dir", "/x", "--max-bytes", "3MiB"])).unwrap();
        assert_eq!(c.max_bytes, 3 << 20);
        let e = Config::from_args(args(&["--socket-dir", "/x", "--max-bytes", "3 parsecs"])).unwrap_err();
        assert!(matches!(e, ConfigError::Size { key: "max_bytes", source: SizeError::Unit(_) }), "{e}");
        let e = Config::from_args(args(&["--socket-dir", "/x", "--control-tcp", "10.1.2.3:7070"])).unwrap_err();
        assert!(matches!(e, ConfigError::NotLoopback { .. }), "{e}");
        let c = Config::from_args(args(&["--socket-dir", "/x", "--control-tcp", "[::1]:7070"])).unwrap();
        assert!(c.control_tcp.is_some());
        let e = Config::from_args(args(&["--socket-dir", "/x", "--model-root", "/nonexistent/models"])).unwrap_err();
        assert!(matches!(e, ConfigError::ModelRoot { .. }), "{e}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
