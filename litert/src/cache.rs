//! One model's weight cache: what [`WeightCache::open`] asks packd for before LiteRT compiles
//! the model, the path LiteRT is given, and what [`WeightCache::finish`] does once it has.
//!
//! - **Served**: the path names the sealed memfd packd serves (`/proc/self/fd/N`); LiteRT
//!   maps it read-only and packs nothing.
//! - **Build**: the path names a memfd of this process; LiteRT builds its cache into it. Once
//!   the compile returns, the file is padded to whole pages ([`crate::format::pad`]), the
//!   mappings LiteRT made of it are made again through a read-only fd (the same pages), and
//!   it is sealed and published: the builder keeps the pages it wrote, and every later
//!   worker maps the same ones.
//! - **Private**: the path is empty (LiteRT runs without a cache file, as it does by
//!   default), and the reason is counted, said once on stderr and reported to packd.

use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use packd_client::{AcquireOptions, Acquired, Client, Fallback, PublishEntry, Segment};
use packd_interpose::ledger::{Journal, Kept, Mapped, ModelStatus, Private, Publication, Renaming};
use packd_interpose::memo::{ModelName, PendingDigest, Provisional};
use packd_interpose::{identity, maps, memo, sys::vm};

use crate::format::{self, Header};
use serde::Serialize;

/// The engine name workers are reported under.
pub const ENGINE: &str = "litert";
/// The identity format (the first word of every identity).
const FORMAT: &str = "litert-xnnpack/1";
/// The key of the one entry a published cache has: the whole file.
const ENTRY: &str = "xnnpack-weight-cache";
/// The libraries whose build is the engine's (XNNPACK is linked into them), by file name.
const LIBRARIES: [&str; 3] = ["libLiteRt.so", "libpywrap_litert_common.so", "_pywrap_litert_compiled_model_wrapper"];

/// What changes XNNPACK's packing beyond the model, LiteRT's build and the CPU: the
/// `CpuOptions` fields that choose kernels (-1: not set).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settings {
    /// `CpuOptions.xnnpack_flags`.
    pub xnnpack_flags: i64,
    /// `CpuOptions.kernel_mode`.
    pub kernel_mode: i64,
    /// `Options.hardware_accelerators` (with another accelerator, XNNPACK gets other parts
    /// of the model).
    pub accelerators: i64,
}

impl Default for Settings {
    fn default() -> Self {
        Self { xnnpack_flags: -1, kernel_mode: -1, accelerators: 1 }
    }
}

/// The model LiteRT compiles.
#[derive(Clone, Copy, Debug)]
pub enum Model<'a> {
    /// A `.tflite` file (`CompiledModel.from_file`).
    Path(&'a Path),
    /// Its bytes (`CompiledModel.from_buffer`).
    Bytes(&'a [u8]),
}

/// What this process did, as [`status`] returns it (as JSON, flattened: these fields'
/// names). A unit of work is a model: `models` packd's weight cache was asked for, each
/// `served` (LiteRT mapped packd's and packed nothing), `built` (built here and published) or
/// `private` (compiled without packd's cache, for the `reasons`); LiteRT's `libraries` (each
/// with the digest that names its build), the last model's `identity`, `identify_us`; and
/// the kit's ledger (`engine`: the first of LiteRT's libraries found, `bytes_shared`: bytes
/// of caches mapped from packd, `acquire_us`, `publish_us`: sealing, then packd's answer).
pub type Status = ModelStatus<Models>;

/// The unit LiteRT's status counts.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Models {
    /// Models whose weight cache packd was asked for.
    pub models: u64,
}

/// The status, the connection for reports, and what is said of models compiled privately.
static JOURNAL: Journal<Status> = Journal::new(ENGINE, "packd-litert: LiteRT compiles without packd's weight cache");

/// What packd did for LiteRT in this process so far, once the publications under way have
/// ended (a minute at most).
pub fn status() -> Status {
    JOURNAL.snapshot(STATUS_WAIT)
}

/// Counts a model LiteRT compiles without packd's cache, says why on stderr (once per
/// reason) and tells packd (on `client`, or on the next connection this process makes).
pub fn note_private(model: &str, why: &Private, client: Option<&Client>) {
    JOURNAL.private(model, why, 0, client);
}

/// Why no identity could be made.
#[derive(Debug, thiserror::Error)]
enum IdentityError {
    #[error("cannot read the model {model}: {source}")]
    Model { model: String, source: std::io::Error },
    #[error("packd could not digest the model: {0}")]
    Digest(#[from] packd_client::Error),
    #[error("LiteRT's libraries ({}) are not loaded in this process", LIBRARIES.join(", "))]
    NoEngine,
    #[error("cannot name LiteRT's build: {0}")]
    Engine(#[from] memo::DigestError),
    #[error("cannot name the model: {0}")]
    Named(memo::DigestError),
}

impl IdentityError {
    fn fallback(&self) -> Fallback {
        match self {
            Self::Digest(e) => e.fallback(),
            Self::NoEngine => Fallback::UnknownInterface,
            Self::Model { .. } | Self::Engine(_) => Fallback::WorkerError,
            Self::Named(_) => Fallback::UnnamedWeights,
        }
    }
}

/// LiteRT's libraries loaded in this process, each as `name@c:DIGEST` (packd digests each
/// file once per host; the memo remembers it for this user). Found once; not cached while
/// none is loaded.
fn engine(client: &Client) -> Result<Vec<String>, IdentityError> {
    static FOUND: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut found = FOUND.lock().unwrap_or_else(|p| p.into_inner());
    if found.is_empty() {
        let mappings = maps::all();
        let mut builds = Vec::new();
        for lib in LIBRARIES {
            let first = mappings.iter().find(|m| {
                m.offset == 0 && Path::new(&m.path).file_name().is_some_and(|n| n.to_string_lossy().starts_with(lib))
            });
            if let Some(m) = first {
                let d = memo::mapped_file_digest(m.lo, Some(client), 0)?;
                let name = Path::new(&m.path).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                builds.push(format!("{name}@{}", d.name));
            }
        }
        if builds.is_empty() {
            return Err(IdentityError::NoEngine);
        }
        *found = builds;
    }
    Ok(found.clone())
}

/// What names a model's weight cache: its identity, the model's size, the model file as it
/// was named (LiteRT is to read that very file), and, when the model file was named by its
/// provisional name (the memo did not know its digest), what a builder needs to publish
/// under the digest's identity ([`Renamer`]).
struct Identified {
    identity: String,
    size: u64,
    model_file: Option<File>,
    provisional: Option<(Provisional, Renamer)>,
}

/// Makes the identity of a model given its digest name (`c:…`): LiteRT's build, the CPU
/// and the settings as they were when it was named.
#[derive(Clone)]
struct Renamer {
    engine: Vec<String>,
    settings: Settings,
    size: u64,
}

impl Renamer {
    /// The cache identity: the model's digest name (or its provisional name) and size,
    /// LiteRT's build, the CPU and the settings.
    fn identity(&self, model: &str) -> String {
        let mut h = blake3::Hasher::new();
        h.update(model.as_bytes());
        h.update(&self.size.to_le_bytes());
        for lib in &self.engine {
            h.update(lib.as_bytes());
            h.update(b"\n");
        }
        h.update(identity::cpu_identity().as_bytes());
        h.update(&self.settings.xnnpack_flags.to_le_bytes());
        h.update(&self.settings.kernel_mode.to_le_bytes());
        h.update(&self.settings.accelerators.to_le_bytes());
        h.update(&crate::format::VERSION.to_le_bytes());
        format!("{FORMAT} {}", &h.finalize().to_hex()[..48])
    }
}

/// Names `model` under `settings` ([`Identified`]): a model file by its digest from the
/// names memo, else by its provisional name (the build starts at once; the digest is found
/// beside it); a model in memory by packd's digest of a memfd of its bytes.
fn identify(client: &Client, model: Model<'_>, settings: Settings) -> Result<Identified, IdentityError> {
    let engine = engine(client)?;
    {
        let mut st = JOURNAL.lock();
        st.ledger.engine = engine.first().cloned();
        st.naming.libraries = engine.clone();
    }
    match model {
        Model::Path(p) => {
            let f = File::open(p).map_err(|source| IdentityError::Model { model: p.display().to_string(), source })?;
            let size =
                f.metadata().map_err(|source| IdentityError::Model { model: p.display().to_string(), source })?.len();
            let renamer = Renamer { engine, settings, size };
            let named = memo::name_opened_files(&[(p, &f)], Some(client)).map_err(IdentityError::Named)?;
            let (identity, provisional) = match named {
                ModelName::Known(d) => (renamer.identity(d.first().map_or("", |d| d.name.as_str())), None),
                ModelName::Provisional(prov) => (renamer.identity(&prov.name()), Some((prov, renamer))),
            };
            Ok(Identified { identity, size, model_file: Some(f), provisional })
        }
        Model::Bytes(b) => {
            let in_memory = |source| IdentityError::Model { model: "in memory".into(), source };
            let mut f = vm::memfd("packd-litert-model").map_err(in_memory)?;
            f.write_all(b).map_err(in_memory)?;
            let d = client.file_digest(&f)?;
            let name = format!("c:{}", &blake3::Hash::from_bytes(d.blake3).to_hex()[..32]);
            let identity = Renamer { engine, settings, size: d.size }.identity(&name);
            Ok(Identified { identity, size: d.size, model_file: None, provisional: None })
        }
    }
}

/// Tells packd, every 50 ms, how far the build has come: the bytes LiteRT wrote so far,
/// once they are a quarter of the model's size. LiteRT writes each weight once it is packed
/// whole, so the file grows by steps (a layer of 16 MiB at once) after a start that writes
/// nothing; the pace over the first steps would make a waiter think the build slow and build
/// privately beside it. From a quarter on, the steps are small beside what was written.
struct Progress {
    /// Dropped to stop the thread at once (it waits on the channel between reports).
    stop: std::sync::mpsc::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

impl Progress {
    fn start(client: Arc<Client>, file: &File, identity: &str, total: u64) -> Option<Self> {
        let file = file.try_clone().ok()?;
        let identity = identity.to_string();
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("packd-litert".into())
            .spawn(move || {
                while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                    stopped.recv_timeout(Duration::from_millis(50))
                {
                    let done = file.metadata().map_or(0, |m| m.len()).min(total);
                    if done.saturating_mul(4) >= total {
                        client.build_progress(&identity, done, total);
                    }
                }
            })
            .ok()?;
        Some(Self { stop, thread })
    }

    /// Stops the thread without waiting out its 50 ms (the builder's compile is over).
    fn stop(self) {
        drop(self.stop);
        let _ = self.thread.join();
    }
}

enum Role {
    /// LiteRT maps the served segment; `before`: this process's mappings of it before the
    /// compile (a second compile of the model maps it again).
    Served {
        segment: Segment,
        client: Client,
        before: usize,
    },
    Build {
        client: Arc<Client>,
        file: File,
        progress: Option<Progress>,
        /// Under the model's provisional name: its digest being found, and how the identity
        /// is made of it.
        renaming: Option<(PendingDigest, Renamer)>,
    },
    /// Sealed; packd checks and hashes the publication on a thread of its own, so that the
    /// builder's compile returns meanwhile (the waiters get the segment when it is done). The
    /// thread puts the segment (its lease) in `segment` if this cache still exists by then.
    Publishing {
        _segment: Kept,
        _client: Arc<Client>,
        _file: File,
    },
    Private,
    /// The fds LiteRT was given stay open as long as the model (LiteRT keeps their paths).
    Done {
        _segment: Option<Segment>,
        _client: Option<Arc<Client>>,
        _file: Option<File>,
    },
}

/// The longest [`status`] waits for publications under way.
const STATUS_WAIT: Duration = Duration::from_secs(60);

/// How a model's cache ended ([`WeightCache::finish`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Served,
    /// Sealed and being published (the status counts it once packd accepted it).
    Built,
    Private,
}

impl Outcome {
    /// `served`, `built` or `private`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Served => "served",
            Self::Built => "built",
            Self::Private => "private",
        }
    }
}

/// One model's weight cache, from before LiteRT compiles it until the compiled model is
/// dropped: keep it as long as the model (it holds packd's lease on the segment, and the fds
/// LiteRT was given paths to).
pub struct WeightCache {
    model: String,
    identity: Option<String>,
    path: String,
    /// The model file packd hashed, which LiteRT is to read ([`WeightCache::model_path`]).
    model_file: Option<File>,
    role: Role,
}

impl WeightCache {
    /// Asks packd for `model`'s cache: the segment, or the role of building it (waiting
    /// while another process builds it), or neither (then [`WeightCache::path`] is empty and
    /// the reason is counted and reported). Never fails: whatever goes wrong leaves LiteRT
    /// to compile as it would without packd.
    pub fn open(model: Model<'_>, settings: Settings) -> Self {
        let name = match model {
            Model::Path(p) => p.display().to_string(),
            Model::Bytes(b) => format!("a model of {} bytes in memory", b.len()),
        };
        JOURNAL.lock().units.models += 1;
        if std::env::var("PACKD_LITERT").is_ok_and(|v| v.trim().eq_ignore_ascii_case("off")) {
            return Self::private(name, Private::said(Fallback::Asked, "PACKD_LITERT=off"), None);
        }
        let client = match Client::connect_default() {
            Ok(c) => c,
            Err(e) => return Self::private(name, Private::packd("packd is away", e), None),
        };
        let t = Instant::now();
        let identified = identify(&client, model, settings);
        JOURNAL.add_time(|s| &mut s.naming.identify_us, t.elapsed());
        let Identified { mut identity, size, model_file, provisional } = match identified {
            Ok(x) => x,
            Err(e) => return Self::private(name, Private::adapter(e.fallback(), e), Some(client)),
        };
        JOURNAL.lock().naming.identity = Some(identity.clone());
        let t = Instant::now();
        let acquired = client.acquire(&identity, AcquireOptions { build_bytes: size, ..AcquireOptions::default() });
        JOURNAL.add_time(|s| &mut s.ledger.acquire_us, t.elapsed());
        if let Ok(Acquired::Segment(segment)) = &acquired {
            identity = packd_interpose::ledger::served_identity(segment, &identity);
            JOURNAL.lock().naming.identity = Some(identity.clone());
        }
        let (role, path) = match acquired {
            Ok(Acquired::Segment(segment)) => {
                let path = format!("/proc/self/fd/{}", segment.file().as_raw_fd());
                let before = maps::of_file(segment.file()).len();
                (Role::Served { segment, client, before }, path)
            }
            Ok(Acquired::Build { memory, .. }) => {
                let file = match memory.map_or_else(|| vm::memfd("packd-litert-cache"), Ok) {
                    Ok(f) => f,
                    Err(e) => {
                        let why = Private::io("cannot create a memfd for the build", e);
                        client.give_up(&identity, &why.to_string());
                        return Self::private_with(name, Some(identity), why, Some(client));
                    }
                };
                // Under a provisional name: the digest is found beside the compile.
                let renaming = match packd_interpose::ledger::digest_beside(provisional, &client, &identity) {
                    Ok(r) => r,
                    Err(why) => return Self::private_with(name, Some(identity), why, Some(client)),
                };
                packd_interpose::hold::hold_as("PACKD_LITERT_HOLD_BUILD");
                let path = format!("/proc/self/fd/{}", file.as_raw_fd());
                let client = Arc::new(client);
                let progress = Progress::start(client.clone(), &file, &identity, size);
                (Role::Build { client, file, progress, renaming }, path)
            }
            Ok(Acquired::Private { fallback, reason }) => {
                return Self::private_with(name, Some(identity), Private::given(fallback, reason), Some(client));
            }
            Err(e) => {
                let why = Private::packd("packd refused the acquire", e);
                return Self::private_with(name, Some(identity), why, Some(client));
            }
        };
        Self { model: name, identity: Some(identity), path, model_file, role }
    }

    /// A compile packd was asked about and takes no part in, for `reason` (the worker's own
    /// choice: its own cache file, YNNPACK, another accelerator): counted and reported on a
    /// connection kept as long as this value, so that the worker shows in `packctl clients`.
    pub fn skip(model: String, fallback: Fallback, reason: &str) -> Self {
        JOURNAL.lock().units.models += 1;
        Self::private(model, Private::given(fallback, reason.to_string()), Client::connect_default().ok())
    }

    /// A cache packd takes no part in, for `reason` (counted and reported now, on `client`
    /// if there is one, which is kept).
    fn private(model: String, why: Private, client: Option<Client>) -> Self {
        Self::private_with(model, None, why, client)
    }

    fn private_with(model: String, identity: Option<String>, why: Private, client: Option<Client>) -> Self {
        note_private(identity.as_deref().unwrap_or(&model), &why, client.as_ref());
        let role = Role::Done { _segment: None, _client: client.map(Arc::new), _file: None };
        Self { model, identity, path: String::new(), model_file: None, role }
    }

    /// The path to give LiteRT as `xnnpack_weight_cache_path`: empty when packd takes no
    /// part (LiteRT then compiles without a cache file).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The path LiteRT is to read the model from when packd takes part in a compile from a
    /// file: `/proc/self/fd/N` of the file packd hashed, so that a model replaced at its path
    /// meanwhile is never compiled with the other's cache. `None` otherwise.
    pub fn model_path(&self) -> Option<String> {
        match (&self.model_file, &self.role) {
            (Some(f), Role::Served { .. } | Role::Build { .. }) => Some(format!("/proc/self/fd/{}", f.as_raw_fd())),
            _ => None,
        }
    }

    /// The model's cache identity, once known.
    pub fn identity(&self) -> Option<&str> {
        self.identity.as_deref()
    }

    /// LiteRT compiled the model: a builder's file is sealed and published (on a thread of
    /// its own); a served worker's mapping of the segment is checked. Counts and reports the
    /// outcome (a publication once packd accepted it).
    ///
    /// # Safety
    /// No other thread may map, unmap or resize LiteRT's mappings of the cache meanwhile:
    /// call it when the compile has returned and before the compiled model is handed to
    /// anyone (a builder's mappings are made again read-only in place).
    pub unsafe fn finish(&mut self) -> Outcome {
        let identity = self.identity.clone().unwrap_or_default();
        let model_file = self.model_file.take();
        match std::mem::replace(&mut self.role, Role::Private) {
            Role::Served { segment, client, before } => {
                let mapped = maps::of_file(segment.file()).len() > before;
                let size = segment.info().size;
                let client = Arc::new(client);
                let outcome = if mapped {
                    JOURNAL.shared(&identity, Mapped::Served, size, &client);
                    Outcome::Served
                } else {
                    let why = Private::said(
                        Fallback::WorkerError,
                        "LiteRT did not load the weight cache packd served (its log says why)",
                    );
                    note_private(&identity, &why, Some(&client));
                    Outcome::Private
                };
                self.role = Role::Done { _segment: Some(segment), _client: Some(client), _file: model_file };
                outcome
            }
            Role::Build { client, file, progress, renaming } => {
                if let Some(p) = progress {
                    p.stop();
                }
                let t = Instant::now();
                let sealed = ready_to_seal(&file).and_then(|(size, shared)| {
                    // SAFETY: forwarded from the caller (LiteRT's mappings are left alone
                    // meanwhile); `shared` was read just now and holds all of them, r--s.
                    let sealed = unsafe { crate::sys::seal_mapped(&file, &shared) };
                    sealed.map(|()| size).map_err(|e| Private::adapter(Fallback::WorkerError, e))
                });
                JOURNAL.add_time(|s| &mut s.ledger.publish_us, t.elapsed());
                let published = match sealed {
                    // (A publication that cannot start gives the role up itself.)
                    Ok(size) => publish_aside((*client).clone(), identity.clone(), &file, size, renaming),
                    Err(why) => {
                        client.give_up(&identity, &why.to_string());
                        Err(why)
                    }
                };
                match published {
                    Ok(segment) => {
                        self.role = Role::Publishing { _segment: segment, _client: client, _file: file };
                        Outcome::Built
                    }
                    Err(why) => {
                        note_private(&identity, &why, Some(&client));
                        // LiteRT keeps its own mapping of the file: the worker runs as built.
                        self.role = Role::Done { _segment: None, _client: Some(client), _file: Some(file) };
                        Outcome::Private
                    }
                }
            }
            Role::Private => Outcome::Private,
            done @ Role::Done { .. } => {
                self.role = done;
                Outcome::Private
            }
            publishing @ Role::Publishing { .. } => {
                self.role = publishing;
                Outcome::Built
            }
        }
    }

    /// LiteRT failed to compile the model: a builder gives its role up at once (the workers
    /// waiting for it are told to build themselves), and the failure is counted.
    pub fn abandon(&mut self, error: &str) {
        let why = Private::engine("LiteRT failed to compile the model", error);
        let identity = self.identity.clone().unwrap_or_else(|| self.model.clone());
        match std::mem::replace(&mut self.role, Role::Private) {
            Role::Build { client, progress, .. } => {
                if let Some(p) = progress {
                    p.stop();
                }
                client.give_up(&identity, &why.to_string());
                note_private(&identity, &why, Some(&client));
            }
            Role::Served { client, .. } => note_private(&identity, &why, Some(&client)),
            role @ (Role::Private | Role::Done { .. } | Role::Publishing { .. }) => self.role = role,
        }
    }
}

impl Drop for WeightCache {
    fn drop(&mut self) {
        if matches!(self.role, Role::Build { .. }) {
            self.abandon("the weight cache was dropped before the compile ended");
        }
        // A publication under way is not waited for: its thread drops the segment itself.
    }
}

/// Why LiteRT's build cannot be served.
#[derive(Debug, thiserror::Error)]
enum Unservable {
    #[error("LiteRT's cache file cannot be served: {0}")]
    Format(format::FormatError),
    #[error("LiteRT did not map the weight cache packd gave it")]
    NotMapped,
    #[error("padding the cache to whole pages failed: {0}")]
    Pad(format::FormatError),
    /// LiteRT maps the cache with these permissions (`rw-s`, ...).
    #[error("LiteRT maps its weight cache {0}: packd cannot seal it")]
    Mapped(String),
}

/// Makes what LiteRT built into `file` ready to seal (`sys::seal_mapped`): checks its
/// header and pads it to whole pages. Returns its size and LiteRT's mappings of it (all
/// `r--s`), or why not.
fn ready_to_seal(file: &File) -> Result<(u64, Vec<maps::Mapping>), Private> {
    let header = Header::read(file).map_err(|e| {
        let fallback = match e {
            format::FormatError::Version { found } if found != 0 => Fallback::UnknownInterface,
            _ => Fallback::WorkerError,
        };
        Private::adapter(fallback, Unservable::Format(e))
    })?;
    // Private mappings do not keep the memfd from being sealed and are left as they are.
    let shared: Vec<_> = maps::of_file(file).into_iter().filter(|m| m.perms.ends_with('s')).collect();
    if shared.is_empty() {
        return Err(Private::adapter(Fallback::Other, Unservable::NotMapped));
    }
    if let Some(m) = shared.iter().find(|m| m.perms != "r--s") {
        return Err(Private::adapter(Fallback::UnknownInterface, Unservable::Mapped(m.perms.clone())));
    }
    let page = vm::page() as u64;
    let size =
        format::pad(file, &header, page).map_err(|e| Private::adapter(Fallback::WorkerError, Unservable::Pad(e)))?;
    Ok((size, shared))
}

/// Publishes the sealed `file` of `size` bytes as the cache of `identity` on a thread of its
/// own ([`Journal::publish_kept`]: counted and reported there).
/// Built under the model's provisional name (`renaming`), it is published under the identity
/// its digest makes, with `identity` as its alias.
fn publish_aside(
    client: Client,
    identity: String,
    file: &File,
    size: u64,
    renaming: Option<(PendingDigest, Renamer)>,
) -> Result<Kept, Private> {
    let entries = vec![PublishEntry { key: ENTRY.into(), offset: 0, length: size }];
    let renaming = renaming.map(|(digest, renamer)| Renaming {
        digest,
        identity_of: Box::new(move |digests: &[memo::FileDigest]| {
            let identity = renamer.identity(digests.first().map_or("", |d| d.name.as_str()));
            JOURNAL.lock().naming.identity = Some(identity.clone());
            identity
        }),
    });
    let publication = Publication { renaming, ..Publication::of_duplicate(client, identity, file, size, entries)? };
    JOURNAL.publish_kept(publication, "packd-litert-pub")
}
