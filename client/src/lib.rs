//! Thin blocking client for **packd**, the host-wide packer of model weights.
//!
//! packd packs each weight once per host into a sealed memfd and passes the fd over a Unix
//! socket; this crate receives it, checks the seals, maps it read-only and gives typed
//! access to each packed tensor. Every process that maps the same model shares one copy.
//!
//! ```no_run
//! use packd_client::{Client, Plan};
//!
//! # fn main() -> Result<(), packd_client::Error> {
//! let client = Client::connect("/run/packd")?;
//! let model = client.pack("model.safetensors", &Plan::default())?;
//! let q = model.tensor("encoder.layer.0.attention.self.query.weight").expect("tensor");
//! println!("{} {} {:?}: {} bytes", q.name(), q.layout(), q.shape(), q.bytes().len());
//! model.verify()?; // BLAKE3 of every entry matches the daemon's table
//! # Ok(()) }
//! ```
//!
//! When the daemon restarts (an upgrade, a crash), mapped models keep working; calls fail
//! at once with [`Error::Unavailable`] while it is away, and the next call (or
//! [`Client::reconnect_if_lost`]) reconnects with bounded backoff and leases every model
//! this client still holds again.
//!
//! The library is blocking and pulls in neither tokio nor tonic (`packctl` is a crate of its
//! own).
#![warn(missing_docs)]

mod conn;
pub mod names;
mod publish;
pub mod report;
pub mod sys;
mod wire;

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use conn::{Answer, Conn, Kind, Lease};
pub use conn::{BACKOFF_MAX, BACKOFF_MIN};
pub use publish::{AcquireOptions, Acquired, FileDigest, PublishEntry};
pub use report::{Fallback, Obtained, Report, report_later};

use memmap2::Mmap;
pub use packd_proto::v1 as proto;
use proto::{ErrorCode, request};

pub use packd_proto::{CONTROL_SOCKET, DATA_SOCKET};

/// How long client calls wait for the daemon. Every call has a deadline: a daemon that
/// accepts and never answers makes a call fail with [`Error::Timeout`] within `get`, never
/// hang. While a request runs, the daemon reports its progress at least once a second, so
/// a long pack is told apart from a daemon that stopped answering.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// Connecting (and each reconnection), which waits only while the daemon's listen
    /// backlog is full. Default [`Timeouts::DEFAULT_CONNECT`].
    pub connect: Duration,
    /// The longest the daemon may stay silent on any request: a get of a key already
    /// packed is answered within it, a running pack reports progress within it. Also bounds
    /// each write on the socket (a release). Default [`Timeouts::DEFAULT_GET`].
    pub get: Duration,
    /// The longest a pack, an acquire, a publish, or a get that waits for a pack may take
    /// in all while the daemon reports progress. Default [`Timeouts::DEFAULT_PACK`].
    pub pack: Duration,
}

impl Timeouts {
    /// Connecting: a local daemon accepts in microseconds; 5 s is a daemon that is stuck.
    pub const DEFAULT_CONNECT: Duration = Duration::from_secs(5);
    /// Silence: the daemon answers from its index in microseconds and reports a running
    /// request's progress every second; 30 s rides out a loaded host and still unblocks a
    /// caller whose daemon stopped answering.
    pub const DEFAULT_GET: Duration = Duration::from_secs(30);
    /// A whole pack while it makes progress: a day, so that a pack of any size completes
    /// (a daemon that stops answering is caught by the silence deadline, not this).
    pub const DEFAULT_PACK: Duration = Duration::from_secs(24 * 3600);
}

impl Default for Timeouts {
    fn default() -> Self {
        Self { connect: Self::DEFAULT_CONNECT, get: Self::DEFAULT_GET, pack: Self::DEFAULT_PACK }
    }
}

/// What a call waited for when its deadline passed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    /// Connecting.
    Connect,
    /// A get.
    Get,
    /// A pack.
    Pack,
    /// An acquire.
    Acquire,
    /// A publish.
    Publish,
    /// A digest request.
    Digest,
}

impl std::fmt::Display for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Call::Connect => "a connection",
            Call::Get => "a get request",
            Call::Pack => "a pack request",
            Call::Acquire => "an acquire request",
            Call::Publish => "a publish request",
            Call::Digest => "a digest request",
        })
    }
}

/// Which of a call's deadlines passed (see [`Timeouts`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Deadline {
    /// The daemon stayed silent for `Timeouts::get` (or did not accept for `connect`).
    Silence,
    /// The whole request took longer than `Timeouts::pack`.
    Total,
    /// The daemon stopped reading requests: one could not be sent.
    Send,
}

impl std::fmt::Display for Deadline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Deadline::Silence => "",
            Deadline::Total => " in all",
            Deadline::Send => " (it stopped reading requests)",
        })
    }
}

/// How a reply (or a request this client built) broke the protocol.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    /// A request too large for a frame.
    #[error("request: {0}")]
    Request(packd_proto::frame::FrameTooLarge),
    /// A release could not be written whole at once.
    #[error("only {sent} of {len} bytes were sent")]
    ShortWrite {
        /// Bytes sent.
        sent: usize,
        /// Bytes of the frame.
        len: usize,
    },
    /// A reply larger than a frame may be.
    #[error("reply: {0}")]
    ReplyTooLarge(packd_proto::frame::FrameTooLarge),
    /// A reply that is not a `packd.v1.Reply`.
    #[error("undecodable reply: {0}")]
    Undecodable(prost::DecodeError),
    /// A reply without a body.
    #[error("reply without body")]
    NoBody,
    /// A build reply without a role.
    #[error("a build reply without a role")]
    NoRole,
    /// A build reply to a request that was not an acquire.
    #[error("a build reply to a request that was not an acquire")]
    UnexpectedBuild,
    /// A digest reply to a request that was not a digest request, or another reply to one.
    #[error("a digest reply to another request, or another reply to a digest request")]
    UnexpectedDigest,
    /// A progress frame where an answer was due.
    #[error("a progress frame taken for an answer")]
    UnexpectedProgress,
    /// A segment reply without exactly its one fd.
    #[error("segment reply carries {fds} fds, fd_index {index}")]
    Fds {
        /// Fds received.
        fds: usize,
        /// The reply's fd index.
        index: usize,
    },
    /// The daemon left out a table this client does not have.
    #[error("the daemon omitted a table this client does not have")]
    OmittedTable,
    /// An entry outside its segment.
    #[error("entry {name} lies outside the {size}-byte segment")]
    EntryOutside {
        /// The entry.
        name: String,
        /// The segment's size.
        size: u64,
    },
    /// A segment whose memfd is not the size its reply says.
    #[error("the segment's memfd is not {0} bytes long")]
    SegmentSize(u64),
    /// A segment too large for this process's address space.
    #[error("segment of {0} bytes is too large to map")]
    TooLarge(u64),
    /// A thread that published a segment panicked.
    #[error("the publishing thread panicked")]
    Panicked,
}

/// Errors of the client.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Connecting to the daemon failed.
    #[error("cannot connect to {path}: {source}; {hint}", hint = connect_hint(path, source))]
    Connect {
        /// Socket path.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// Opening the model file failed.
    #[error("cannot open {path}: {source}")]
    Open {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A socket or mapping operation failed.
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    /// The daemon closed the connection.
    #[error("the daemon closed the connection")]
    Disconnected,
    /// The daemon went away (stopped, restarting, crashed). Mappings keep working; the
    /// next call reconnects (with backoff) and re-establishes the leases of held models.
    #[error("packd is unavailable at {path}: {reason} (mapped models keep working; the next call reconnects)")]
    Unavailable {
        /// Socket path.
        path: PathBuf,
        /// What happened.
        reason: String,
    },
    /// The daemon did not answer in time (see [`Timeouts`]). The connection stays usable:
    /// a reply that comes later is dropped (and its lease given back).
    #[error("packd at {path} did not answer {call}{how} within {waited:?} (is it overloaded or stuck?)")]
    Timeout {
        /// Socket path.
        path: PathBuf,
        /// What was waited for.
        call: Call,
        /// Which deadline passed.
        how: Deadline,
        /// How long.
        waited: Duration,
    },
    /// The daemon refused the request.
    #[error("daemon: {message} ({code})", code = code.as_str_name())]
    Daemon {
        /// Class of failure.
        code: ErrorCode,
        /// The daemon's message.
        message: String,
    },
    /// The kernel dropped the segment fd of a reply (`MSG_CTRUNC`): this process is at its
    /// open-file limit. The connection stays usable and the lease was given back.
    #[error(
        "the fd of segment {0} was dropped by the kernel: this process is at its open-file limit \
         (RLIMIT_NOFILE); close files or raise the limit (the lease was released)"
    )]
    FdDropped(String),
    /// The reply broke the protocol (wrong fds, entries out of range, ...).
    #[error("protocol error: {0}")]
    Protocol(#[from] ProtocolError),
    /// A received segment is not sealed; it was not mapped.
    #[error("{0}")]
    NotSealed(String),
    /// An entry's bytes do not match its BLAKE3.
    #[error("entry {name}: BLAKE3 {got} does not match the table's {want}")]
    Corrupt {
        /// Tensor name.
        name: String,
        /// Computed digest.
        got: String,
        /// Digest in the table.
        want: String,
    },
}

/// Opens the model file at `path` to send it, and its name as the segment's label. A
/// directory is refused here, as `open()` refuses to read one (`EISDIR`), rather than by
/// the daemon as a bad fd. Every client's pack-by-path goes through it (Rust, C, Python).
pub fn open_source(path: &Path) -> Result<(File, String), Error> {
    let open_error = |source| Error::Open { path: path.to_path_buf(), source };
    let file = File::open(path).map_err(open_error)?;
    if file.metadata().map_err(open_error)?.is_dir() {
        return Err(open_error(std::io::Error::from_raw_os_error(libc::EISDIR)));
    }
    let label = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    Ok((file, label))
}

/// What to do about a failed connection to the socket at `path`: a permission problem
/// names the socket's owner, group and mode and how to join; a missing socket or refused
/// connection means no daemon listens there. Used by every client (Rust, C, Python, packctl).
pub fn connect_hint(path: &Path, error: &std::io::Error) -> String {
    use std::os::unix::fs::MetadataExt;
    match error.kind() {
        std::io::ErrorKind::PermissionDenied => {
            let Ok(meta) = std::fs::metadata(path) else {
                return "packd may be running, but this user may not reach its socket directory".into();
            };
            let group = nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(meta.gid()))
                .ok()
                .flatten()
                .map_or_else(|| meta.gid().to_string(), |g| g.name);
            let owner = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(meta.uid()))
                .ok()
                .flatten()
                .map_or_else(|| meta.uid().to_string(), |u| u.name);
            let mode = meta.mode() & 0o7777;
            let fix = if meta.gid() == 0 {
                "only root can use it: the operator should create a group for packd's users (groupadd --system \
                 packd; usermod -aG packd USER) and restart packd, or set socket_group in packd.toml"
                    .to_string()
            } else {
                format!(
                    "join group {group:?} (usermod -aG {group} $USER, then log in again), or have the operator \
                     set socket_group in packd.toml"
                )
            };
            // EACCES comes before the kernel looks for a listener: a stale socket gives it too.
            format!("this user may not use packd's socket ({owner}:{group}, mode {mode:04o}): {fix}")
        }
        std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused => format!(
            "is packd running? Start it with `packd`, or point the client at the directory where it \
             listens (--socket-dir DIR or PACKD_SOCKET_DIR; this was {})",
            path.parent().map_or_else(|| ".".into(), |d| d.display().to_string())
        ),
        _ => "is packd running, and is this its socket?".into(),
    }
}

impl Error {
    /// The error's code as a name: the daemon's (`"NOT_FOUND"`, `"BAD_SOURCE"`, … as the
    /// protocol names them) or the client's own (`"CONNECT"`, `"UNAVAILABLE"`, …). The
    /// names the C ABI's `packd_status_name` and the Python package's `PackdError.code` use.
    pub fn code(&self) -> &'static str {
        match self {
            Error::Daemon { code, .. } => code.as_str_name(),
            Error::Connect { .. } => "CONNECT",
            Error::Open { .. } => "OPEN",
            Error::Io(_) => "IO",
            Error::Disconnected => "DISCONNECTED",
            Error::Unavailable { .. } => "UNAVAILABLE",
            Error::Timeout { .. } => "TIMEOUT",
            Error::FdDropped(_) => "FD_DROPPED",
            Error::Protocol(_) => "PROTOCOL",
            Error::NotSealed(_) => "NOT_SEALED",
            Error::Corrupt { .. } => "CORRUPT",
        }
    }
}

/// Which layout each tensor gets: `GLOB=LAYOUT` rules in front of the default rules, and the
/// layout of the default GEMM rule.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Rules tried in order before the defaults, e.g. `"*.attention.*=identity"`.
    pub rules: Vec<String>,
    /// Layout for 2-D float `X.weight` tensors; empty means `f32-gemm:nr=16,kr=1,sr=1`.
    pub layout: String,
}

impl Plan {
    /// A plan whose default GEMM rule uses `layout` (`"identity"` keeps every tensor as is).
    pub fn with_layout(layout: impl Into<String>) -> Self {
        Self { rules: Vec::new(), layout: layout.into() }
    }

    /// Adds a `GLOB=LAYOUT` rule after the ones already present.
    pub fn rule(mut self, rule: impl Into<String>) -> Self {
        self.rules.push(rule.into());
        self
    }
}

/// Entry tables kept per requested key, so that repeated gets of the same segment need not
/// transfer its table again.
const TABLE_CACHE: usize = 1024;

/// A connection to packd's data plane. Cheap to share between threads: requests from
/// several threads are pipelined on the one connection (the daemon answers them in order),
/// no thread holds a lock while it waits for a reply, and dropping a model never waits for
/// another thread's request.
#[derive(Clone)]
pub struct Client {
    conn: Arc<Conn>,
}

impl Client {
    /// Connects to `DIR/packd.sock` with the default [`Timeouts`].
    pub fn connect(socket_dir: impl AsRef<Path>) -> Result<Self, Error> {
        Self::connect_with(socket_dir, Timeouts::default())
    }

    /// Connects to `DIR/packd.sock`; every call waits at most as long as `timeouts` says.
    pub fn connect_with(socket_dir: impl AsRef<Path>, timeouts: Timeouts) -> Result<Self, Error> {
        let path = socket_dir.as_ref().join(DATA_SOCKET);
        Ok(Self { conn: Arc::new(Conn::connect(path, timeouts)?) })
    }

    /// The deadlines calls use now.
    pub fn timeouts(&self) -> Timeouts {
        self.conn.timeouts()
    }

    /// Changes the deadlines of later calls (on every clone of this client).
    pub fn set_timeouts(&self, timeouts: Timeouts) {
        self.conn.set_timeouts(timeouts);
    }

    /// Checks the connection without sending a request. If the daemon went away, tries to
    /// reconnect (at most once per backoff interval) and re-establishes the leases of every
    /// model this client still holds. Returns `Ok(true)` when it reconnected now, `Ok(false)`
    /// when the connection was fine, [`Error::Unavailable`] while the daemon is away.
    pub fn reconnect_if_lost(&self) -> Result<bool, Error> {
        self.conn.check()
    }

    /// Models (and unmapped segments) this client holds whose leases the connected daemon
    /// counts. After a daemon restart it falls to 0 until [`Client::reconnect_if_lost`] or
    /// the next call re-establishes them.
    pub fn live_leases(&self) -> usize {
        self.conn.live_leases()
    }

    /// Connects to the default socket directory (see [`default_socket_dir`]).
    pub fn connect_default() -> Result<Self, Error> {
        Self::connect(default_socket_dir())
    }

    /// Opens `path`, sends the open file to the daemon (which never opens client paths),
    /// and maps the packed model. The file's name goes with it as the segment's display
    /// label (`packctl ls` shows it), if this request is the one that packs it.
    pub fn pack(&self, path: impl AsRef<Path>, plan: &Plan) -> Result<Model, Error> {
        let (file, label) = open_source(path.as_ref())?;
        self.pack_labeled(&file, plan, &label)?.map()
    }

    /// Sends an open safetensors file and maps the packed model.
    pub fn pack_file(&self, file: &File, plan: &Plan) -> Result<Model, Error> {
        self.pack_segment(file, plan)?.map()
    }

    /// Sends an open safetensors file and returns the sealed segment without mapping it.
    pub fn pack_segment(&self, file: &File, plan: &Plan) -> Result<Segment, Error> {
        self.pack_labeled(file, plan, "")
    }

    /// [`Client::pack_segment`] with a display label for the segment (e.g. the model's file
    /// name): untrusted text the daemon keeps (128 bytes at most) for operators' listings.
    pub fn pack_labeled(&self, file: &File, plan: &Plan, label: &str) -> Result<Segment, Error> {
        self.pack_tracked(file, plan, label, None)
    }

    /// [`Client::pack_labeled`], calling `on_progress` with each of the daemon's progress
    /// reports: `ACCEPTED` at once, before any work (even for a model found packed), then at
    /// least one a second while the pack runs, each with the stage and the bytes done and in
    /// all (the source file's size while hashing or packing; see [`proto::Progress`]).
    /// Called on this thread, between reads of the socket.
    pub fn pack_with_progress(
        &self,
        file: &File,
        plan: &Plan,
        label: &str,
        on_progress: &dyn Fn(&proto::Progress),
    ) -> Result<Segment, Error> {
        self.pack_tracked(file, plan, label, Some(on_progress))
    }

    fn pack_tracked(
        &self,
        file: &File,
        plan: &Plan,
        label: &str,
        on_progress: Option<&dyn Fn(&proto::Progress)>,
    ) -> Result<Segment, Error> {
        let body = request::Body::Pack(proto::PackRequest {
            plan: Some(proto::Plan { rules: plan.rules.clone(), layout: plan.layout.clone() }),
            label: label.to_string(),
        });
        let Answer { info, file, epoch } = self.conn.call_tracked(body, Some(file), Kind::Pack, on_progress)?;
        let lease = self.conn.lease(&info, epoch);
        self.finish(Arc::new(info), file, lease)
    }

    /// Maps the segment that holds `key` (an entry key or a segment key).
    pub fn get(&self, key: &str) -> Result<Model, Error> {
        self.get_segment(key)?.map()
    }

    /// Returns the sealed segment that holds `key` without mapping it.
    pub fn get_segment(&self, key: &str) -> Result<Segment, Error> {
        let known = self.conn.tables.lock().unwrap_or_else(|p| p.into_inner()).get(key).cloned();
        let (known_segment_id, known_generation) = known.as_ref().map_or((0, 0), |t| (t.segment_id, t.generation));
        let body = request::Body::Get(proto::GetRequest { key: key.to_string(), known_segment_id, known_generation });
        let Answer { info, file, epoch } = self.conn.call(body, None, Kind::Get)?;
        let lease = self.conn.lease(&info, epoch);
        let info = if info.entries_omitted {
            match known {
                Some(t) if t.segment_id == info.segment_id && t.generation == info.generation => t,
                _ => return Err(ProtocolError::OmittedTable.into()),
            }
        } else {
            let info = Arc::new(info);
            let mut tables = self.conn.tables.lock().unwrap_or_else(|p| p.into_inner());
            if tables.len() >= TABLE_CACHE {
                tables.clear();
            }
            tables.insert(key.to_string(), Arc::clone(&info));
            info
        };
        self.finish(info, file, lease)
    }

    /// Checks a received segment (its seals, every entry inside it); `info` is its entry
    /// table (the reply's, or the one this client keeps when the reply omitted it).
    fn finish(&self, info: Arc<proto::SegmentReply>, file: File, lease: Lease) -> Result<Segment, Error> {
        let file = sys::SealedFile::check(file).map_err(|e| match e.kind() {
            std::io::ErrorKind::PermissionDenied => Error::NotSealed(format!("{}: {e}", info.key)),
            _ => Error::Io(e),
        })?;
        let seg = Segment { info, file, lease };
        for e in &seg.info.entries {
            if e.offset.checked_add(e.length).is_none_or(|end| end > seg.info.size) {
                return Err(ProtocolError::EntryOutside { name: e.name.clone(), size: seg.info.size }.into());
            }
        }
        Ok(seg)
    }
}

/// A received, sealed segment that is not mapped yet. Holds a lease until dropped.
pub struct Segment {
    info: Arc<proto::SegmentReply>,
    file: sys::SealedFile,
    lease: Lease,
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment")
            .field("key", &self.info.key)
            .field("size", &self.info.size)
            .field("entries", &self.info.entries.len())
            .finish_non_exhaustive()
    }
}

impl Segment {
    /// The daemon's description of the segment.
    pub fn info(&self) -> &proto::SegmentReply {
        &self.info
    }

    /// The sealed memfd (read-only by the kernel's seals).
    pub fn file(&self) -> &File {
        self.file.file()
    }

    /// Maps the segment read-only and closes its fd; the lease moves to the model.
    pub fn map(self) -> Result<Model, Error> {
        self.map_with(false)
    }

    /// Like [`Segment::map`], and maps every page up front (`MADV_POPULATE_READ`): one system call
    /// instead of a page fault per 4 KiB on first access.
    pub fn map_populated(self) -> Result<Model, Error> {
        self.map_with(true)
    }

    fn map_with(self, populate: bool) -> Result<Model, Error> {
        let map = self.file.map(self.info.size, populate).map_err(|e| match e.kind() {
            std::io::ErrorKind::PermissionDenied => Error::NotSealed(e.to_string()),
            _ => Error::Io(e),
        })?;
        names::register(map.as_ptr() as usize, map.len(), &self.info);
        Ok(Model { map, info: self.info, by_name: OnceLock::new(), _lease: self.lease })
    }
}

/// A mapped model: one read-only shared mapping of a sealed segment and its entry table.
/// Dropping it unmaps and releases the lease.
pub struct Model {
    map: Mmap,
    info: Arc<proto::SegmentReply>,
    /// Entry index by tensor name, built on the first lookup by name.
    by_name: OnceLock<HashMap<String, usize>>,
    _lease: Lease,
}

impl Drop for Model {
    fn drop(&mut self) {
        names::unregister(self.map.as_ptr() as usize);
    }
}

impl Model {
    /// The segment key (`b3:<source>@plan:<plan digest>`).
    pub fn key(&self) -> &str {
        &self.info.key
    }

    /// The daemon's description of the segment.
    pub fn info(&self) -> &proto::SegmentReply {
        &self.info
    }

    /// The whole mapped segment.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// Every packed tensor, in source order.
    pub fn tensors(&self) -> impl Iterator<Item = Tensor<'_>> {
        self.info.entries.iter().map(|entry| self.view(entry))
    }

    /// The packed tensor named `name` (see [`Model::position`]).
    pub fn tensor(&self, name: &str) -> Option<Tensor<'_>> {
        self.tensor_at(self.position(name)?)
    }

    /// Where the tensor named `name` is in source order. The first lookup indexes the table
    /// (O(entries)); each one after is a hash lookup.
    pub fn position(&self, name: &str) -> Option<usize> {
        let index = self.by_name.get_or_init(|| {
            let mut map = HashMap::with_capacity(self.info.entries.len());
            for (i, e) in self.info.entries.iter().enumerate() {
                map.entry(e.name.clone()).or_insert(i);
            }
            map
        });
        index.get(name).copied()
    }

    /// The packed tensor at `index` in source order (the order of [`Model::tensors`]).
    pub fn tensor_at(&self, index: usize) -> Option<Tensor<'_>> {
        self.info.entries.get(index).map(|entry| self.view(entry))
    }

    /// How many packed tensors the model has.
    pub fn len(&self) -> usize {
        self.info.entries.len()
    }

    /// Whether the model has no packed tensor at all.
    pub fn is_empty(&self) -> bool {
        self.info.entries.is_empty()
    }

    fn view<'a>(&'a self, entry: &'a proto::Entry) -> Tensor<'a> {
        // In range: checked when the segment was received (and the mapping fits in usize).
        let start = usize::try_from(entry.offset).unwrap_or(usize::MAX);
        let end = usize::try_from(entry.offset.saturating_add(entry.length)).unwrap_or(usize::MAX);
        Tensor { entry, bytes: self.map.get(start..end).unwrap_or(&[]) }
    }

    /// Checks every entry's bytes against the BLAKE3 in the table.
    pub fn verify(&self) -> Result<(), Error> {
        for t in self.tensors() {
            let got = blake3::hash(t.bytes()).to_hex().to_string();
            if got != t.entry.blake3 {
                return Err(Error::Corrupt { name: t.entry.name.clone(), got, want: t.entry.blake3.clone() });
            }
        }
        Ok(())
    }
}

/// One packed tensor of a mapped [`Model`].
#[derive(Clone, Copy)]
pub struct Tensor<'a> {
    entry: &'a proto::Entry,
    bytes: &'a [u8],
}

impl<'a> Tensor<'a> {
    /// Tensor name in the source.
    pub fn name(&self) -> &'a str {
        &self.entry.name
    }
    /// Entry key (`b3:<source>/<name>#<layout>@v<version>`).
    pub fn key(&self) -> &'a str {
        &self.entry.key
    }
    /// Canonical layout, e.g. `f32-gemm:nr=16,kr=1,sr=1`.
    pub fn layout(&self) -> &'a str {
        &self.entry.layout
    }
    /// Source dtype name (`F32`, `I64`, …).
    pub fn dtype(&self) -> &'a str {
        &self.entry.dtype
    }
    /// Source shape.
    pub fn shape(&self) -> &'a [u64] {
        &self.entry.shape
    }
    /// Name of the bias folded into this GEMM entry, if any.
    pub fn bias(&self) -> Option<&'a str> {
        Some(self.entry.bias.as_str()).filter(|b| !b.is_empty())
    }
    /// The packed bytes (read-only shared memory).
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }
    /// The daemon's table entry.
    pub fn entry(&self) -> &'a proto::Entry {
        self.entry
    }
}

/// The socket directory a client uses by default: `$PACKD_SOCKET_DIR`, else `/run/packd`
/// if a daemon socket is there, else `$XDG_RUNTIME_DIR/packd` if a daemon socket is there,
/// else `/run/packd`.
pub fn default_socket_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("PACKD_SOCKET_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    let run = PathBuf::from("/run/packd");
    if run.join(DATA_SOCKET).exists() {
        return run;
    }
    if let Some(x) = std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        let d = PathBuf::from(x).join("packd");
        if d.join(DATA_SOCKET).exists() {
            return d;
        }
    }
    run
}
