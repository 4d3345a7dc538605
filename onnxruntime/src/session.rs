//! One session's share of packd, from before ONNX Runtime creates it until it is dropped.
//!
//! - **Build** (the first worker on the host): ONNX Runtime is to write the model's optimized
//!   form into a private folder ([`Share::build_model_path`]), its weights and MLAS's
//!   prepacked weights as external data in [`DATA_FILE`] — a symlink to a memfd of this
//!   process. [`Share::finish_build`] appends the optimized model to the memfd, seals it,
//!   publishes it on a thread of its own and lays it out as a served worker would: the
//!   builder's session is then created over its own sealed copy.
//! - **Served**: the private folder holds the optimized model and a placeholder of the data
//!   file; while the session is created, ONNX Runtime's opens of the placeholder open the
//!   sealed memfd instead (`sys`), which it maps: the weights and prepacks are the pages
//!   every worker maps, and nothing is prepacked. [`Share::served`] checks that ONNX
//!   Runtime mapped the memfd and never read the placeholder.
//! - **Private**: ONNX Runtime creates the session as it would without packd; the reason is
//!   counted, said once on stderr and reported to packd.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use packd_client::{AcquireOptions, Acquired, Client, Fallback, PublishEntry, Segment};
use packd_interpose::ledger::{Journal, Kept, Mapped, ModelStatus, Private, Publication, Renaming};
use packd_interpose::memo::{self, ModelName, PendingDigest, Provisional};
use packd_interpose::{identity, maps, sys::vm};
use serde::Serialize;

use crate::onnx;
use crate::sys::{StandIn, Watch};

/// The engine name workers are reported under.
pub const ENGINE: &str = "onnxruntime";
/// The identity format (the first word of every identity).
const FORMAT: &str = "onnxruntime/1";
/// The published entries: ONNX Runtime's external data file, and the optimized model.
const DATA_ENTRY: &str = "onnxruntime-data";
const MODEL_ENTRY: &str = "onnxruntime-model";
/// The name ONNX Runtime is given for the optimized model's external data file.
pub const DATA_FILE: &str = "packd-weights.bin";
/// The optimized model's file name in the private folder.
const MODEL_FILE: &str = "model.onnx";
/// The longest [`status`] waits for publications under way.
const STATUS_WAIT: Duration = Duration::from_secs(60);
/// The largest optimized model (without its external data) read back: ONNX's protobuf limit.
const MAX_MODEL: u64 = 2 << 30;

/// Session config entries that change the optimized model or the prepacked weights: their
/// values are part of the identity (with the graph optimization level, free dimension
/// overrides and disabled optimizers, which the front ends add). Entries that only change how
/// a session runs are left out.
pub const KEYED_ENTRIES: [&str; 29] = [
    "session.disable_prepacking",
    "session.disable_quant_qdq",
    "session.disable_double_qdq_remover",
    "session.enable_quant_qdq_cleanup",
    "session.disable_qdq_constant_folding",
    "session.disable_aot_function_inlining",
    "session.function_expansion_byte_limit",
    "session.function_expansion_node_limit",
    "session.qdqisint8allowed",
    "session.x64quantprecision",
    "session.qdq_matmulnbits_accuracy_level",
    "session.qdq_matmulnbits_block_size",
    "session.enable_dq_matmulnbits_fusion",
    "session.graph_optimizations_loop_level",
    "session.allow_released_opsets_only",
    "session.strict_shape_type_inference",
    "session.set_denormal_as_zero",
    "session.gqa_value_layout",
    "session.max_shape_override",
    "optimization.enable_gelu_approximation",
    "optimization.enable_cast_chain_elimination",
    "optimization.disable_specified_optimizers",
    "optimization.minimal_build_optimizations",
    "optimization.constant_folding_max_output_size_in_bytes",
    "mlas.disable_kleidiai",
    "mlas.use_lut_gemm",
    "mlas.qnbit.force_fp32",
    "mlas.nchwc_depthwise_sliding",
    "mlas.nchwc_pointwise_conv_max_input_channel_batch",
];

/// The session config entries a builder's options get, so that ONNX Runtime writes the
/// optimized model with its weights and prepacked blobs as external data in [`DATA_FILE`].
pub const BUILD_ENTRIES: [(&str, &str); 3] = [
    ("session.optimized_model_external_initializers_file_name", DATA_FILE),
    ("session.optimized_model_external_initializers_min_size_in_bytes", "1024"),
    ("session.save_external_prepacked_constant_initializers", "1"),
];

/// What this process did, as [`status`] returns it (as JSON, flattened: these fields'
/// names). A unit of work is a session: `sessions` packd was asked about, each `served` (ONNX
/// Runtime mapped packd's copy and prepacked nothing), `built` (the optimized form built here
/// and published) or `private` (created as without packd, for the `reasons`); ONNX Runtime's
/// `libraries` (with the build-id that names its build), the last session's `identity`,
/// `identify_us`; and the kit's ledger (`engine`, `bytes_shared`: bytes of packd's copies
/// mapped, `bytes_private`, `acquire_us`, `publish_us`).
pub type Status = ModelStatus<Sessions>;

/// The unit ONNX Runtime's status counts.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Sessions {
    /// Sessions packd was asked about.
    pub sessions: u64,
}

static JOURNAL: Journal<Status> =
    Journal::new(ENGINE, "packd-onnxruntime: ONNX Runtime creates the session without packd");

/// What packd did for ONNX Runtime in this process so far, once the publications under way
/// have ended (a minute at most).
pub fn status() -> Status {
    JOURNAL.snapshot(STATUS_WAIT)
}

/// The model a session is created from.
#[derive(Clone, Copy, Debug)]
pub enum Model<'a> {
    /// An `.onnx` file (its external data files beside it).
    Path(&'a Path),
    /// Its bytes.
    Bytes(&'a [u8]),
}

/// What a session's share is now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// ONNX Runtime is to write the optimized model to [`Share::build_model_path`].
    Build,
    /// ONNX Runtime is to load [`Share::model_path`].
    Served,
    /// ONNX Runtime creates the session as without packd.
    Private,
}

impl Role {
    /// `build`, `served` or `private`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Build => "build",
            Self::Served => "served",
            Self::Private => "private",
        }
    }
}

/// Why no identity could be made.
#[derive(Debug, thiserror::Error)]
enum IdentityError {
    #[error("cannot read the model {model}: {source}")]
    Model { model: String, source: std::io::Error },
    #[error("the model {model} cannot be read as ONNX: {error}")]
    NotOnnx { model: String, error: onnx::ModelError },
    #[error("a model in memory whose weights are in external files ({0}): pass its path instead")]
    ExternalFromBytes(String),
    #[error("packd could not digest the model: {0}")]
    Digest(#[from] packd_client::Error),
    #[error("ONNX Runtime's library is not loaded in this process")]
    NoEngine,
    #[error("cannot name ONNX Runtime's build ({0})")]
    Engine(String),
    #[error("ONNX Runtime's library {0} opens files through no call packd can take over")]
    Unhooked(String),
    #[error("cannot name the model: {0}")]
    Named(memo::DigestError),
}

impl IdentityError {
    fn fallback(&self) -> Fallback {
        match self {
            Self::Digest(e) => e.fallback(),
            Self::NoEngine | Self::ExternalFromBytes(_) | Self::NotOnnx { .. } | Self::Unhooked(_) => {
                Fallback::UnknownInterface
            }
            Self::Model { .. } | Self::Engine(_) => Fallback::WorkerError,
            Self::Named(_) => Fallback::UnnamedWeights,
        }
    }
}

/// ONNX Runtime's libraries loaded in this process, each as `name@BUILD`, with its hooks in
/// place. Found once; looked for again while none is loaded.
fn engine() -> Result<Vec<String>, IdentityError> {
    static FOUND: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut found = FOUND.lock().unwrap_or_else(|p| p.into_inner());
    if found.is_empty() {
        let mut builds = Vec::new();
        for e in crate::sys::hook_engine() {
            if e.hooked == 0 {
                return Err(IdentityError::Unhooked(e.name));
            }
            builds.push(identity::library_build(e.at).ok_or(IdentityError::Engine(e.name))?);
        }
        if builds.is_empty() {
            return Err(IdentityError::NoEngine);
        }
        builds.sort();
        *found = builds;
    }
    Ok(found.clone())
}

/// Makes a session's identity from its model files' names (`c:…` digests, or the provisional
/// name): the model's and every external data file's (by location), ONNX Runtime's build,
/// the CPU and the options.
#[derive(Clone)]
struct Renamer {
    engine: Vec<String>,
    options: String,
    /// The external data files' locations, in the order the names follow the model's.
    locations: Vec<String>,
    /// The files' sizes: the model's, then each location's.
    sizes: Vec<u64>,
}

impl Renamer {
    /// The identity, given the files' names (the model's, then each location's), or one
    /// provisional name for them all.
    fn identity(&self, names: &[&str]) -> String {
        let mut h = blake3::Hasher::new();
        let name = |i: usize| names.get(i).or(names.first()).copied().unwrap_or("");
        h.update(name(0).as_bytes());
        h.update(&self.sizes.first().copied().unwrap_or(0).to_le_bytes());
        for (i, location) in self.locations.iter().enumerate() {
            h.update(location.as_bytes());
            h.update(b"\n");
            h.update(name(i + 1).as_bytes());
            h.update(&self.sizes.get(i + 1).copied().unwrap_or(0).to_le_bytes());
        }
        for lib in &self.engine {
            h.update(lib.as_bytes());
            h.update(b"\n");
        }
        h.update(identity::cpu_identity().as_bytes());
        h.update(b"\n");
        h.update(self.options.as_bytes());
        format!("{FORMAT} {}", &h.finalize().to_hex()[..48])
    }
}

/// The identity of `model` under `options` ([`Renamer`]): a model file and its external data
/// files by their digests from the names memo, else by their provisional name (then also
/// returned, with its renamer: the build starts at once and the digests are found beside
/// it); a model in memory by packd's digest of a memfd of its bytes.
fn identify(
    client: &Client,
    model: Model<'_>,
    options: &str,
) -> Result<(String, Option<(Provisional, Renamer)>), IdentityError> {
    let engine = engine()?;
    {
        let mut st = JOURNAL.lock();
        st.ledger.engine = engine.first().cloned();
        st.naming.libraries = engine.clone();
    }
    let mut renamer = Renamer { engine, options: options.to_string(), locations: Vec::new(), sizes: Vec::new() };
    match model {
        Model::Path(p) => {
            let shown = || p.display().to_string();
            let f = File::open(p).map_err(|source| IdentityError::Model { model: shown(), source })?;
            let size = f.metadata().map_err(|source| IdentityError::Model { model: shown(), source })?.len();
            if size > 0 {
                let bytes =
                    crate::sys::map_model(&f).map_err(|source| IdentityError::Model { model: shown(), source })?;
                renamer.locations = onnx::external_locations(&bytes)
                    .map_err(|error| IdentityError::NotOnnx { model: shown(), error })?;
            }
            let dir = p.parent().unwrap_or(Path::new("."));
            let mut files = vec![(p.to_path_buf(), f)];
            for location in &renamer.locations {
                let path = dir.join(location);
                let f = File::open(&path)
                    .map_err(|source| IdentityError::Model { model: path.display().to_string(), source })?;
                files.push((path, f));
            }
            for (path, f) in &files {
                let md = f
                    .metadata()
                    .map_err(|source| IdentityError::Model { model: path.display().to_string(), source })?;
                renamer.sizes.push(md.len());
            }
            let opened: Vec<(&Path, &File)> = files.iter().map(|(p, f)| (p.as_path(), f)).collect();
            match memo::name_opened_files(&opened, Some(client)).map_err(IdentityError::Named)? {
                ModelName::Known(d) => {
                    let names: Vec<&str> = d.iter().map(|d| d.name.as_str()).collect();
                    Ok((renamer.identity(&names), None))
                }
                ModelName::Provisional(prov) => Ok((renamer.identity(&[&prov.name()]), Some((prov, renamer)))),
            }
        }
        Model::Bytes(b) => {
            let locations = onnx::external_locations(b)
                .map_err(|error| IdentityError::NotOnnx { model: "in memory".into(), error })?;
            if !locations.is_empty() {
                return Err(IdentityError::ExternalFromBytes(locations.join(", ")));
            }
            let in_memory = |source| IdentityError::Model { model: "in memory".into(), source };
            let mut f = vm::memfd("packd-onnxruntime-model").map_err(in_memory)?;
            f.write_all(b).map_err(in_memory)?;
            let d = client.file_digest(&f)?;
            renamer.sizes.push(d.size);
            let name = format!("c:{}", &blake3::Hash::from_bytes(d.blake3).to_hex()[..32]);
            Ok((renamer.identity(&[&name]), None))
        }
    }
}

enum State {
    /// ONNX Runtime writes the optimized model into `dir`, its data into `file`; under the
    /// model's provisional name, its digests are being found beside.
    Build {
        client: Client,
        file: File,
        dir: Folder,
        renaming: Option<(PendingDigest, Renamer)>,
    },
    /// ONNX Runtime is to load `dir`'s model, whose data reads as `file`.
    Serve(Serve),
    Private,
    /// Kept as long as the session: packd's lease, and the connection reports go on.
    Done {
        _segment: Option<Segment>,
        _publishing: Option<Kept>,
        _client: Option<Client>,
    },
}

struct Serve {
    client: Client,
    /// How the memfd came: served by packd (its lease) or built here (being published).
    how: Mapped,
    segment: Option<Segment>,
    publishing: Option<Kept>,
    file: File,
    size: u64,
    dir: Folder,
    _stand: StandIn,
    watch: Watch,
    before: usize,
}

/// A session's share of packd: keep it as long as the session (it holds packd's lease on
/// the memory ONNX Runtime maps).
pub struct Share {
    model: String,
    identity: Option<String>,
    state: State,
}

impl Share {
    /// Asks packd for `model`'s optimized form under `options` (every session option that
    /// changes optimization or prepacking, as text): the published copy, or the role of
    /// building it (waiting while another process builds it), or neither (then the role is
    /// [`Role::Private`] and the reason is counted and reported). Never fails: whatever goes
    /// wrong leaves ONNX Runtime to create the session as it would without packd.
    pub fn open(model: Model<'_>, options: &str) -> Self {
        let name = match model {
            Model::Path(p) => p.display().to_string(),
            Model::Bytes(b) => format!("a model of {} bytes in memory", b.len()),
        };
        JOURNAL.lock().units.sessions += 1;
        if packd_interpose::entry::turned_off("PACKD_ONNXRUNTIME") {
            return Self::private(name, None, Private::said(Fallback::Asked, "PACKD_ONNXRUNTIME=off"), None);
        }
        let client = match Client::connect_default() {
            Ok(c) => c,
            Err(e) => return Self::private(name, None, Private::packd("packd is away", e), None),
        };
        let t = Instant::now();
        let identified = identify(&client, model, options);
        JOURNAL.add_time(|s| &mut s.naming.identify_us, t.elapsed());
        let (mut identity, provisional) = match identified {
            Ok(x) => x,
            Err(e) => return Self::private(name, None, Private::adapter(e.fallback(), e), Some(client)),
        };
        JOURNAL.lock().naming.identity = Some(identity.clone());
        let t = Instant::now();
        // No memory is asked to be lent: ONNX Runtime writes its data file from the start.
        let acquired = client.acquire(&identity, AcquireOptions::default());
        JOURNAL.add_time(|s| &mut s.ledger.acquire_us, t.elapsed());
        if let Ok(Acquired::Segment(segment)) = &acquired {
            identity = packd_interpose::ledger::served_identity(segment, &identity);
            JOURNAL.lock().naming.identity = Some(identity.clone());
        }
        let state = match acquired {
            Ok(Acquired::Segment(segment)) => match serve_segment(&segment) {
                Ok((file, len, dir, stand, watch)) => State::Serve(Serve {
                    before: maps::of_file(&file).len(),
                    size: len,
                    client,
                    how: Mapped::Served,
                    segment: Some(segment),
                    publishing: None,
                    file,
                    dir,
                    _stand: stand,
                    watch,
                }),
                Err(why) => return Self::private(name, Some(identity), why, Some(client)),
            },
            Ok(Acquired::Build { .. }) => match build_folder() {
                Ok((file, dir)) => {
                    // Under a provisional name: the digests are found beside the build.
                    let renaming = match packd_interpose::ledger::digest_beside(provisional, &client, &identity) {
                        Ok(r) => r,
                        Err(why) => return Self::private(name, Some(identity), why, Some(client)),
                    };
                    packd_interpose::hold::hold_as("PACKD_ONNXRUNTIME_HOLD_BUILD");
                    State::Build { client, file, dir, renaming }
                }
                Err(why) => {
                    client.give_up(&identity, &why.to_string());
                    return Self::private(name, Some(identity), why, Some(client));
                }
            },
            Ok(Acquired::Private { fallback, reason }) => {
                return Self::private(name, Some(identity), Private::given(fallback, reason), Some(client));
            }
            Err(e) => {
                let why = Private::packd("packd refused the acquire", e);
                return Self::private(name, Some(identity), why, Some(client));
            }
        };
        Self { model: name, identity: Some(identity), state }
    }

    /// A session packd was asked about and takes no part in, for `reason` (another execution
    /// provider, an ORT-format model, options packd cannot honour): counted and reported on a
    /// connection kept as long as this value, so that the worker shows in `packctl clients`.
    pub fn skip(model: String, fallback: Fallback, reason: &str) -> Self {
        JOURNAL.lock().units.sessions += 1;
        let why = Private::given(fallback, reason.to_string());
        Self::private(model, None, why, Client::connect_default().ok())
    }

    fn private(model: String, identity: Option<String>, why: Private, client: Option<Client>) -> Self {
        JOURNAL.private(identity.as_deref().unwrap_or(&model), &why, 0, client.as_ref());
        Self { model, identity, state: State::Done { _segment: None, _publishing: None, _client: client } }
    }

    /// What the share is now.
    pub fn role(&self) -> Role {
        match self.state {
            State::Build { .. } => Role::Build,
            State::Serve(_) => Role::Served,
            State::Private | State::Done { .. } => Role::Private,
        }
    }

    /// The session's identity, once known.
    pub fn identity(&self) -> Option<&str> {
        self.identity.as_deref()
    }

    /// A builder's `optimized_model_filepath`: the optimized model goes there, its external
    /// data (in [`DATA_FILE`]) into this process's memfd.
    pub fn build_model_path(&self) -> Option<PathBuf> {
        match &self.state {
            State::Build { dir, .. } => Some(dir.path().join(MODEL_FILE)),
            _ => None,
        }
    }

    /// The model ONNX Runtime is to load when served: the optimized model in a private
    /// folder, beside the placeholder of its data.
    pub fn model_path(&self) -> Option<PathBuf> {
        match &self.state {
            State::Serve(s) => Some(s.dir.path().join(MODEL_FILE)),
            _ => None,
        }
    }

    /// ONNX Runtime wrote the optimized model ([`Share::build_model_path`]): it is appended to
    /// the data, sealed, published on a thread of its own, and laid out to be loaded as a
    /// served worker loads it ([`Share::model_path`]). Returns the role now: [`Role::Served`],
    /// or [`Role::Private`] when it cannot be sealed or published (the reason counted, the
    /// waiters told to build themselves) or, published, cannot be laid out here (the reason
    /// counted; the others are served).
    pub fn finish_build(&mut self) -> Role {
        let State::Build { client, file, dir, renaming } = std::mem::replace(&mut self.state, State::Private) else {
            return self.role();
        };
        let identity = self.identity.clone().unwrap_or_default();
        // The build's session is gone: the heap it freed goes back to the system before the
        // sealed copy is mapped.
        crate::sys::trim_heap();
        let t = Instant::now();
        let sealed = seal_build(&file, dir.path());
        JOURNAL.add_time(|s| &mut s.ledger.publish_us, t.elapsed());
        drop(dir);
        let (size, entries) = match sealed {
            Ok(x) => x,
            Err(why) => {
                client.give_up(&identity, &why.to_string());
                return self.give_private(why, client);
            }
        };
        let laid = lay_out(&file, &entries);
        let renaming = renaming.map(|(digest, renamer)| Renaming {
            digest,
            identity_of: Box::new(move |digests: &[memo::FileDigest]| {
                let names: Vec<&str> = digests.iter().map(|d| d.name.as_str()).collect();
                let identity = renamer.identity(&names);
                JOURNAL.lock().naming.identity = Some(identity.clone());
                identity
            }),
        });
        let publication = Publication::of_duplicate(client.clone(), identity.clone(), &file, size, entries)
            .map(|p| Publication { renaming, ..p });
        let publishing = match publication.and_then(|p| JOURNAL.publish_kept(p, "packd-ort-pub")) {
            Ok(slot) => slot,
            Err(why) => return self.give_private(why, client),
        };
        match laid {
            Ok((dir, stand, watch)) => {
                self.state = State::Serve(Serve {
                    before: maps::of_file(&file).len(),
                    client,
                    how: Mapped::Built,
                    segment: None,
                    publishing: Some(publishing),
                    file,
                    size,
                    dir,
                    _stand: stand,
                    watch,
                });
                Role::Served
            }
            Err(why) => {
                // Published for the others (counted built when packd accepts it); this
                // session is created as without packd.
                JOURNAL.private(&identity, &why, 0, Some(&client));
                self.state = State::Done { _segment: None, _publishing: Some(publishing), _client: Some(client) };
                Role::Private
            }
        }
    }

    fn give_private(&mut self, why: Private, client: Client) -> Role {
        let identity = self.identity.clone().unwrap_or_else(|| self.model.clone());
        JOURNAL.private(&identity, &why, 0, Some(&client));
        self.state = State::Done { _segment: None, _publishing: None, _client: Some(client) };
        Role::Private
    }

    /// ONNX Runtime created the session over [`Share::model_path`]: true when it mapped
    /// packd's memory and never read the placeholder (counted served; a builder's own is
    /// counted once packd accepted its publication). False when the session must not be used
    /// (it read the placeholder's zeros, or did not map the memfd): create it again as
    /// without packd (the reason is counted).
    pub fn served(&mut self) -> bool {
        let State::Serve(s) = std::mem::replace(&mut self.state, State::Private) else { return false };
        let identity = self.identity.clone().unwrap_or_default();
        let Serve { client, how, segment, publishing, file, size, dir, _stand, watch, before } = s;
        drop(_stand);
        let touched = watch.touched();
        let mapped = maps::of_file(&file).len() > before;
        drop(dir);
        let problem = if touched {
            Some(Unservable::ReadPlaceholder)
        } else if !mapped {
            Some(Unservable::NotMapped)
        } else {
            None
        };
        if let Some(p) = problem {
            let why = Private::adapter(Fallback::UnknownInterface, p);
            JOURNAL.private(&identity, &why, 0, Some(&client));
            self.state = State::Done { _segment: segment, _publishing: publishing, _client: Some(client) };
            return false;
        }
        if how == Mapped::Served {
            JOURNAL.shared(&identity, Mapped::Served, size, &client);
        }
        self.state = State::Done { _segment: segment, _publishing: publishing, _client: Some(client) };
        true
    }

    /// ONNX Runtime failed to create the session (`error`, its words): a builder gives its
    /// role up at once (the workers waiting for it are told to build themselves), and the
    /// failure is counted.
    pub fn abandon(&mut self, error: &str) {
        let why = Private::engine("ONNX Runtime failed to create the session", error);
        let identity = self.identity.clone().unwrap_or_else(|| self.model.clone());
        match std::mem::replace(&mut self.state, State::Private) {
            State::Build { client, .. } => {
                client.give_up(&identity, &why.to_string());
                JOURNAL.private(&identity, &why, 0, Some(&client));
                self.state = State::Done { _segment: None, _publishing: None, _client: Some(client) };
            }
            State::Serve(s) => {
                JOURNAL.private(&identity, &why, 0, Some(&s.client));
                self.state = State::Done { _segment: s.segment, _publishing: s.publishing, _client: Some(s.client) };
            }
            other => self.state = other,
        }
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        if matches!(self.state, State::Build { .. }) {
            self.abandon("the session was dropped before it was built");
        }
    }
}

/// Why a build or a served copy cannot be used.
#[derive(Debug, thiserror::Error)]
enum Unservable {
    #[error("ONNX Runtime wrote no optimized model ({0})")]
    NoModel(std::io::Error),
    #[error("the optimized model is larger than 2 GiB")]
    ModelTooLarge,
    #[error("ONNX Runtime wrote no external data: the model has no weight of 1 KiB or more")]
    NoData,
    #[error("the optimized model names external data other than packd's ({0})")]
    OtherData(String),
    #[error("the optimized model cannot be read as ONNX: {0}")]
    NotOnnx(onnx::ModelError),
    #[error("the published copy has no {0} entry")]
    NoEntry(&'static str),
    #[error("the published copy's data does not start at its first byte")]
    DataNotFirst,
    #[error("ONNX Runtime read the placeholder of the data file itself, not packd's memory")]
    ReadPlaceholder,
    #[error("ONNX Runtime did not map the memory packd served")]
    NotMapped,
}

/// A private folder (mode 0700, in the temporary directory) for one session's files, and
/// its canonical path: ONNX Runtime names the files in it by the path it is given, which the
/// stand-in must equal byte for byte.
struct Folder {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

impl Folder {
    fn new() -> Result<Self, Private> {
        let dir = tempfile::Builder::new()
            .prefix("packd-onnxruntime-")
            .tempdir()
            .map_err(|e| Private::io("cannot make a private folder for ONNX Runtime's files", e))?;
        let path = dir.path().canonicalize().map_err(|e| Private::io("cannot name the private folder", e))?;
        Ok(Self { _dir: dir, path })
    }

    fn path(&self) -> &Path {
        &self.path
    }
}

/// The builder's folder: [`DATA_FILE`] a symlink to a fresh memfd of this process (ONNX
/// Runtime writes through it).
fn build_folder() -> Result<(File, Folder), Private> {
    let file =
        vm::memfd("packd-onnxruntime-build").map_err(|e| Private::io("cannot create a memfd for the build", e))?;
    let dir = Folder::new()?;
    let target = format!("/proc/{}/fd/{}", std::process::id(), std::os::fd::AsRawFd::as_raw_fd(&file));
    std::os::unix::fs::symlink(target, dir.path().join(DATA_FILE))
        .map_err(|e| Private::io("cannot link the build's data file", e))?;
    Ok((file, dir))
}

/// Appends the optimized model in `dir` to the data in `file` (at a page boundary), pads to
/// whole pages and seals. Returns the size and the entries.
fn seal_build(file: &File, dir: &Path) -> Result<(u64, Vec<PublishEntry>), Private> {
    let unservable = |u| Private::adapter(Fallback::UnknownInterface, u);
    let model_path = dir.join(MODEL_FILE);
    let meta = std::fs::metadata(&model_path).map_err(|e| unservable(Unservable::NoModel(e)))?;
    if meta.len() > MAX_MODEL {
        return Err(unservable(Unservable::ModelTooLarge));
    }
    let model = std::fs::read(&model_path).map_err(|e| unservable(Unservable::NoModel(e)))?;
    let locations = onnx::external_locations(&model).map_err(|e| unservable(Unservable::NotOnnx(e)))?;
    if let Some(other) = locations.iter().find(|l| *l != DATA_FILE) {
        return Err(unservable(Unservable::OtherData(other.clone())));
    }
    let data = file.metadata().map_err(|e| Private::io("cannot read the build's size", e))?.len();
    if data == 0 || locations.is_empty() {
        return Err(unservable(Unservable::NoData));
    }
    let page = vm::page() as u64;
    let at = data.next_multiple_of(page);
    file.write_all_at(&model, at).map_err(|e| Private::io("cannot append the optimized model", e))?;
    let size = (at + model.len() as u64).next_multiple_of(page);
    file.set_len(size).map_err(|e| Private::io("cannot pad the build", e))?;
    vm::seal(file).map_err(|e| Private::io("cannot seal the build", e))?;
    let entries = vec![
        PublishEntry { key: DATA_ENTRY.into(), offset: 0, length: data },
        PublishEntry { key: MODEL_ENTRY.into(), offset: at, length: model.len() as u64 },
    ];
    Ok((size, entries))
}

/// A served segment laid out for ONNX Runtime: its memfd, its data's length, the folder, the
/// stand-in and the watch on the placeholder.
fn serve_segment(segment: &Segment) -> Result<(File, u64, Folder, StandIn, Watch), Private> {
    let entries: Vec<PublishEntry> = segment
        .info()
        .entries
        .iter()
        .map(|e| PublishEntry { key: e.name.clone(), offset: e.offset, length: e.length })
        .collect();
    let file = segment.file().try_clone().map_err(|e| Private::io("cannot duplicate the segment's fd", e))?;
    let (dir, stand, watch) = lay_out(&file, &entries)?;
    Ok((file, segment.info().size, dir, stand, watch))
}

/// Writes the optimized model of `file` (entries as published) and a placeholder of its data
/// into a private folder, and makes the placeholder stand for `file`.
fn lay_out(file: &File, entries: &[PublishEntry]) -> Result<(Folder, StandIn, Watch), Private> {
    let unservable = |u| Private::adapter(Fallback::UnknownInterface, u);
    let find = |key: &'static str| entries.iter().find(|e| e.key == key).ok_or(unservable(Unservable::NoEntry(key)));
    let (data, model) = (find(DATA_ENTRY)?, find(MODEL_ENTRY)?);
    if data.offset != 0 {
        return Err(unservable(Unservable::DataNotFirst));
    }
    let len = usize::try_from(model.length).map_err(|_| unservable(Unservable::ModelTooLarge))?;
    let mut bytes = vec![0; len];
    file.read_exact_at(&mut bytes, model.offset).map_err(|e| Private::io("cannot read the optimized model", e))?;
    let dir = Folder::new()?;
    std::fs::write(dir.path().join(MODEL_FILE), &bytes)
        .map_err(|e| Private::io("cannot write the optimized model", e))?;
    let placeholder = dir.path().join(DATA_FILE);
    let p = File::create(&placeholder).map_err(|e| Private::io("cannot make the data file's placeholder", e))?;
    p.set_len(data.length).map_err(|e| Private::io("cannot size the data file's placeholder", e))?;
    drop(p);
    let watch = Watch::new(&placeholder).map_err(|e| Private::io("cannot watch the placeholder", e))?;
    let stand = StandIn::new(&placeholder, file).map_err(|e| Private::io("cannot stand the memfd in", e))?;
    Ok((dir, stand, watch))
}
