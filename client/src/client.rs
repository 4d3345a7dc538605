//! The connection a process holds, and its calls.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::conn::{Answer, Conn, Kind, Lease};
use crate::error::{Error, ProtocolError};
use crate::model::{Model, Segment};
use crate::proto::{self, request};
use crate::timeouts::Timeouts;
use crate::{DATA_SOCKET, sys};

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
    pub(crate) conn: Arc<Conn>,
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
    pub(crate) fn finish(&self, info: Arc<proto::SegmentReply>, file: File, lease: Lease) -> Result<Segment, Error> {
        let file = sys::SealedFile::check(file).map_err(|e| match e.kind() {
            std::io::ErrorKind::PermissionDenied => Error::NotSealed { key: Some(info.key.clone()), error: e },
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
