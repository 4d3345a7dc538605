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
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use packd_client::{AcquireOptions, Acquired, Client, Fallback, PublishEntry, Report, Segment};
use packd_interpose::status::Reasons;
use packd_interpose::{identity, maps, memo, sys::vm};
use serde::Serialize;

use crate::format::{self, Header};

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
}

impl Default for Settings {
    fn default() -> Self {
        Self { xnnpack_flags: -1, kernel_mode: -1 }
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

/// What this process did, as [`status`] returns it (as JSON: these fields' names).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Status {
    /// Models whose weight cache packd was asked for.
    pub models: u64,
    /// Models whose cache packd served (LiteRT mapped it and packed nothing).
    pub served: u64,
    /// Models whose cache this process built and published.
    pub built: u64,
    /// Models LiteRT compiled without packd's cache, for the `reasons` below.
    pub private: u64,
    /// Bytes of caches mapped from packd (served or published).
    pub bytes_shared: u64,
    /// LiteRT's libraries, with the digests that name their build, once found.
    pub engine: Vec<String>,
    /// The identity of the last model asked for.
    pub identity: Option<String>,
    /// Microseconds: naming the model and LiteRT (digests, from packd: once per host),
    /// asking packd (with waiting for another process's build), making the build read-only
    /// and publishing it.
    pub identify_us: u64,
    /// See `identify_us`.
    pub acquire_us: u64,
    /// See `identify_us`.
    pub publish_us: u64,
    /// Why models went without packd, with counts (`reasons`), and the same by reason as
    /// packd counts them (`fallbacks`).
    #[serde(flatten)]
    pub why: Reasons,
}

static STATUS: LazyLock<Mutex<Status>> = LazyLock::new(Mutex::default);

fn state() -> MutexGuard<'static, Status> {
    STATUS.lock().unwrap_or_else(|p| p.into_inner())
}

/// What packd did for LiteRT in this process so far.
pub fn status() -> Status {
    state().clone()
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Counts a model LiteRT compiles without packd's cache, says why on stderr (once per
/// reason) and tells packd (on `client`, or on the next connection this process makes).
pub fn note_private(model: &str, fallback: Fallback, reason: &str, client: Option<&Client>) {
    let first = {
        let mut st = state();
        st.private += 1;
        st.why.count(fallback, reason)
    };
    if first {
        packd_interpose::say!("packd-litert: LiteRT compiles without packd's weight cache: {reason}");
    }
    packd_interpose::status::report(&Report::private(ENGINE, model, fallback, reason, 0), client);
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
}

impl IdentityError {
    fn fallback(&self) -> Fallback {
        match self {
            Self::Digest(e) => e.fallback(),
            Self::NoEngine => Fallback::UnknownInterface,
            Self::Model { .. } | Self::Engine(_) => Fallback::WorkerError,
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

/// The cache identity of `model` under `settings`, and the model's size: the model's
/// BLAKE3 (packd's, once per host), LiteRT's build, the CPU and the settings.
fn identify(client: &Client, model: Model<'_>, settings: Settings) -> Result<(String, u64), IdentityError> {
    let digest = match model {
        Model::Path(p) => {
            let f = File::open(p).map_err(|source| IdentityError::Model { model: p.display().to_string(), source })?;
            client.file_digest(&f)?
        }
        Model::Bytes(b) => {
            let in_memory = |source| IdentityError::Model { model: "in memory".into(), source };
            let mut f = vm::memfd("packd-litert-model").map_err(in_memory)?;
            f.write_all(b).map_err(in_memory)?;
            client.file_digest(&f)?
        }
    };
    let engine = engine(client)?;
    let mut h = blake3::Hasher::new();
    h.update(&digest.blake3);
    h.update(&digest.size.to_le_bytes());
    for lib in &engine {
        h.update(lib.as_bytes());
        h.update(b"\n");
    }
    h.update(identity::cpu_identity().as_bytes());
    h.update(&settings.xnnpack_flags.to_le_bytes());
    h.update(&settings.kernel_mode.to_le_bytes());
    h.update(&format::VERSION.to_le_bytes());
    state().engine = engine;
    Ok((format!("{FORMAT} {}", &h.finalize().to_hex()[..48]), digest.size))
}

/// Tells packd, every 50 ms, how far the build has come: the bytes LiteRT wrote so far.
struct Progress {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl Progress {
    fn start(client: Arc<Client>, file: &File, identity: &str, total: u64) -> Option<Self> {
        let file = file.try_clone().ok()?;
        let identity = identity.to_string();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("packd-litert".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(50));
                    let done = file.metadata().map_or(0, |m| m.len());
                    client.build_progress(&identity, done.min(total), total);
                }
            })
            .ok()?;
        Some(Self { stop, thread })
    }

    fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.thread.join();
    }
}

enum Role {
    Served { segment: Segment, client: Client },
    Build { client: Arc<Client>, file: File, progress: Option<Progress> },
    Private,
    Done { _segment: Option<Segment>, _client: Option<Arc<Client>> },
}

/// How a model's cache ended ([`WeightCache::finish`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Served,
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
/// dropped: keep it as long as the model (it holds packd's lease on the segment).
pub struct WeightCache {
    model: String,
    identity: Option<String>,
    path: String,
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
        state().models += 1;
        if std::env::var("PACKD_LITERT").is_ok_and(|v| v.trim().eq_ignore_ascii_case("off")) {
            return Self::private(name, Fallback::Asked, "PACKD_LITERT=off", None);
        }
        let client = match Client::connect_default() {
            Ok(c) => c,
            Err(e) => return Self::private(name, e.fallback(), &format!("packd is away: {e}"), None),
        };
        let t = Instant::now();
        let identified = identify(&client, model, settings);
        state().identify_us += micros(t.elapsed());
        let (identity, size) = match identified {
            Ok(x) => x,
            Err(e) => return Self::private(name, e.fallback(), &e.to_string(), Some(&client)),
        };
        state().identity = Some(identity.clone());
        let t = Instant::now();
        let acquired = client.acquire(&identity, AcquireOptions { build_bytes: size, ..AcquireOptions::default() });
        state().acquire_us += micros(t.elapsed());
        let (role, path) = match acquired {
            Ok(Acquired::Segment(segment)) => {
                let path = format!("/proc/self/fd/{}", segment.file().as_raw_fd());
                (Role::Served { segment, client }, path)
            }
            Ok(Acquired::Build { memory, .. }) => {
                let file = match memory.map_or_else(|| vm::memfd("packd-litert-cache"), Ok) {
                    Ok(f) => f,
                    Err(e) => {
                        let reason = format!("cannot create a memfd for the build: {e}");
                        client.give_up(&identity, &reason);
                        return Self::private_with(name, Some(identity), Fallback::WorkerError, &reason, Some(&client));
                    }
                };
                packd_interpose::hold::hold_as("PACKD_LITERT_HOLD_BUILD");
                let path = format!("/proc/self/fd/{}", file.as_raw_fd());
                let client = Arc::new(client);
                let progress = Progress::start(client.clone(), &file, &identity, size);
                (Role::Build { client, file, progress }, path)
            }
            Ok(Acquired::Private { fallback, reason }) => {
                return Self::private_with(name, Some(identity), fallback, &reason, Some(&client));
            }
            Err(e) => {
                let reason = format!("packd refused the acquire: {e}");
                return Self::private_with(name, Some(identity), e.fallback(), &reason, Some(&client));
            }
        };
        Self { model: name, identity: Some(identity), path, role }
    }

    /// A cache packd takes no part in, for `reason` (counted and reported now).
    pub fn private(model: String, fallback: Fallback, reason: &str, client: Option<&Client>) -> Self {
        Self::private_with(model, None, fallback, reason, client)
    }

    fn private_with(
        model: String,
        identity: Option<String>,
        fallback: Fallback,
        reason: &str,
        client: Option<&Client>,
    ) -> Self {
        note_private(identity.as_deref().unwrap_or(&model), fallback, reason, client);
        Self { model, identity, path: String::new(), role: Role::Private }
    }

    /// The path to give LiteRT as `xnnpack_weight_cache_path`: empty when packd takes no
    /// part (LiteRT then compiles without a cache file).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The model's cache identity, once known.
    pub fn identity(&self) -> Option<&str> {
        self.identity.as_deref()
    }

    /// LiteRT compiled the model: a builder publishes what LiteRT wrote; a served worker
    /// checks that LiteRT mapped the segment. Counts and reports the outcome.
    pub fn finish(&mut self) -> Outcome {
        let identity = self.identity.clone().unwrap_or_default();
        match std::mem::replace(&mut self.role, Role::Private) {
            Role::Served { segment, client } => {
                if maps::of_file(segment.file()).is_empty() {
                    let reason = "LiteRT did not load the weight cache packd served (its log says why)";
                    note_private(&identity, Fallback::WorkerError, reason, Some(&client));
                    return Outcome::Private;
                }
                let size = segment.info().size;
                {
                    let mut st = state();
                    st.served += 1;
                    st.bytes_shared += size;
                }
                client.report(&Report::served(ENGINE, &identity, size));
                self.role = Role::Done { _segment: Some(segment), _client: Some(Arc::new(client)) };
                Outcome::Served
            }
            Role::Build { client, file, progress } => {
                if let Some(p) = progress {
                    p.stop();
                }
                let t = Instant::now();
                let published = publish(&client, &identity, &file);
                state().publish_us += micros(t.elapsed());
                match published {
                    Ok(segment) => {
                        let size = segment.info().size;
                        {
                            let mut st = state();
                            st.built += 1;
                            st.bytes_shared += size;
                        }
                        client.report(&Report::built(ENGINE, &identity, size));
                        self.role = Role::Done { _segment: Some(segment), _client: Some(client) };
                        Outcome::Built
                    }
                    Err((fallback, reason)) => {
                        client.give_up(&identity, &reason);
                        note_private(&identity, fallback, &reason, Some(&client));
                        // LiteRT keeps its own mapping of the file: the worker runs as built.
                        self.role = Role::Done { _segment: None, _client: Some(client) };
                        Outcome::Private
                    }
                }
            }
            Role::Private => Outcome::Private,
            done @ Role::Done { .. } => {
                self.role = done;
                Outcome::Private
            }
        }
    }

    /// LiteRT failed to compile the model: a builder gives its role up at once (the workers
    /// waiting for it are told to build themselves), and the failure is counted.
    pub fn abandon(&mut self, error: &str) {
        let reason = format!("LiteRT failed to compile the model: {error}");
        let identity = self.identity.clone().unwrap_or_else(|| self.model.clone());
        match std::mem::replace(&mut self.role, Role::Private) {
            Role::Build { client, progress, .. } => {
                if let Some(p) = progress {
                    p.stop();
                }
                client.give_up(&identity, &reason);
                note_private(&identity, Fallback::WorkerError, &reason, Some(&client));
            }
            Role::Served { client, .. } => note_private(&identity, Fallback::WorkerError, &reason, Some(&client)),
            Role::Private | Role::Done { .. } => {}
        }
    }
}

impl Drop for WeightCache {
    fn drop(&mut self) {
        if matches!(self.role, Role::Build { .. }) {
            self.abandon("the weight cache was dropped before the compile ended");
        }
    }
}

/// Makes what LiteRT built into `file` the published cache of `identity`: checks its
/// header, pads it to whole pages, maps LiteRT's mappings of it again read-only, seals it
/// and publishes it. On failure: the reason as packd counts it, and in words.
fn publish(client: &Client, identity: &str, file: &File) -> Result<Segment, (Fallback, String)> {
    let header = Header::read(file).map_err(|e| {
        let fallback = match e {
            format::FormatError::Version { .. } => Fallback::UnknownInterface,
            _ => Fallback::WorkerError,
        };
        (fallback, format!("LiteRT's cache file cannot be served: {e}"))
    })?;
    let mapped = maps::of_file(file);
    if mapped.is_empty() {
        return Err((Fallback::Other, "LiteRT did not build into the weight cache packd gave it".into()));
    }
    if mapped.iter().any(|m| m.perms.contains('w')) {
        return Err((Fallback::UnknownInterface, "LiteRT maps its weight cache writable: packd cannot seal it".into()));
    }
    let worker = |what: &str, e: &dyn std::fmt::Display| (Fallback::WorkerError, format!("{what}: {e}"));
    let page = vm::page() as u64;
    let size = format::pad(file, &header, page).map_err(|e| worker("padding the cache to whole pages failed", &e))?;
    crate::sys::remap_read_only(&mapped, file).map_err(|e| worker("mapping LiteRT's cache read-only failed", &e))?;
    vm::seal(file).map_err(|e| worker("sealing the cache failed", &e))?;
    let entries = [PublishEntry { key: ENTRY.into(), offset: 0, length: size }];
    client.publish(identity, file, size, &entries).map_err(|e| (e.fallback(), format!("packd refused the cache: {e}")))
}
