//! What can go wrong, and what to do about it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::proto::ErrorCode;
use crate::timeouts::{Call, Deadline};

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
        reason: Lost,
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
    #[error("{}{error}", key.as_ref().map(|k| format!("{k}: ")).unwrap_or_default())]
    NotSealed {
        /// The segment's key, when known.
        key: Option<String>,
        /// What the seal check found.
        error: std::io::Error,
    },
    /// The segment was served before packd hashed it (a publication): its entries' digests
    /// are not known yet. Get it again later to verify it.
    #[error(
        "entry {name}: no BLAKE3 to check yet (packd serves this publication before hashing it; get it again later)"
    )]
    DigestsPending {
        /// Tensor name.
        name: String,
    },
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
            Error::NotSealed { .. } => "NOT_SEALED",
            Error::Corrupt { .. } => "CORRUPT",
            Error::DigestsPending { .. } => "DIGESTS_PENDING",
        }
    }
}

/// Why the connection to the daemon is lost, or why it is not made again yet.
#[derive(Clone, Debug, thiserror::Error)]
pub enum Lost {
    /// This client has no connection (none was made yet).
    #[error("not connected")]
    NotConnected,
    /// The connection went while this caller waited for its reply.
    #[error("connection lost while waiting for a reply")]
    WhileWaiting,
    /// The daemon closed the connection.
    #[error("the daemon closed the connection")]
    Closed,
    /// The daemon sent a frame no request asked for.
    #[error("the daemon sent bytes nobody asked for")]
    Unasked,
    /// The connection belongs to the parent process (this one is a child of a `fork`).
    #[error("the connection belongs to the parent process (fork)")]
    Forked,
    /// Reading from the connection failed, or a check of it.
    #[error("connection lost: {0}")]
    Broken(Arc<Error>),
    /// A check of the connection failed.
    #[error("connection lost: {0}")]
    Errno(nix::errno::Errno),
    /// Sending a request failed: the error's code (`IO`, `PROTOCOL`, ...) and the
    /// system's error, when there was one.
    #[error("sending a request failed: {}", os.as_ref().map_or_else(|| code.to_string(), ToString::to_string))]
    Send {
        /// [`Error::code`] of the failure.
        code: &'static str,
        /// The system's error.
        os: Option<Arc<std::io::Error>>,
    },
    /// A one-way request (a release, a give-up) could not be written whole at once.
    #[error("a one-way request could not be sent at once: {0}")]
    OneWay(Arc<Error>),
    /// A worker report could not be written whole at once.
    #[error("a report could not be sent at once: {0}")]
    Report(Arc<Error>),
    /// Connecting failed.
    #[error("cannot connect: {0}")]
    Connect(Arc<std::io::Error>),
    /// The daemon refused the connection (a reply with no request) and closed it.
    #[error("{message} ({})", code.as_str_name())]
    Refused {
        /// Its code.
        code: ErrorCode,
        /// The daemon's words.
        message: String,
    },
    /// A new connection was lost before the daemon answered the leases held.
    #[error("the new connection was lost before the daemon answered: {0}")]
    Relet(Arc<Error>),
    /// The last attempt failed (`last`); the next waits out the backoff.
    #[error("{last}; next attempt in {} ms", wait.as_millis())]
    Backoff {
        /// Why the last attempt failed.
        last: Box<Lost>,
        /// How long until the next.
        wait: Duration,
    },
}

impl Lost {
    /// Sending a request failed with `e` (which the caller gets).
    pub(crate) fn send(e: &Error) -> Self {
        let os = match e {
            Error::Io(io) => {
                Some(Arc::new(io.raw_os_error().map_or_else(|| io.kind().into(), std::io::Error::from_raw_os_error)))
            }
            _ => None,
        };
        Lost::Send { code: e.code(), os }
    }
}
