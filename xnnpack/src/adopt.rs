//! Adoption without a rebuild: packd as the weights cache of an engine that exports
//! XNNPACK's C API (ExecuTorch's PyPI wheel), unmodified.
//!
//! [`enable`] finds the loaded library that defines XNNPACK (`xnn_create_runtime_v4`), and
//! points the GOT slots through which the process's objects call a few of its functions at
//! packd's hooks (`packd_interpose::scan`); the engine's own code is not touched, and objects
//! that do not import those functions are not either. `dlopen` is not hooked (glibc resolves
//! a library's dependencies by its caller's RUNPATH, which a hook would change): an engine
//! loaded after `enable` is found by calling `enable` again (the Python front end loads
//! ExecuTorch's runtime itself). The hooks:
//!
//! * `xnn_define_tensor_value` and its quantised variants record each static tensor of a
//!   subgraph: its address, its size (dims × the datatype's bits), and what else determines
//!   its packing (datatype, dims, zero point, scales, channel and block layout).
//! * `xnn_create_runtime_v4` with no weights cache (what ExecuTorch passes by default): the
//!   subgraph's static tensors are named by content (BLAKE3 of those parameters and the
//!   bytes, hashed on every core), a [`XnnCache`] is made for the identity (the names, the
//!   engine's build and XNNPACK build identifier, the runtime flags, the CPU) and passed to
//!   the real function as the provider, then finalized: the first process builds and
//!   publishes, later ones are served. A pointer is never a name (the engine unmaps and
//!   reuses addresses); the names are dropped when the runtime is created. Tensors the memo
//!   does not know, all in file mappings, are named provisionally instead (by the file's
//!   identity and their place, nothing hashed): the builder hashes their content names
//!   beside the build and publishes under those, the provisional identity its alias, with
//!   the table of names its waiters read (`crate::names`).
//! * `xnn_delete_runtime` releases the runtime's reference to its cache; the last one frees
//!   it (and its lease). `xnn_delete_subgraph` forgets the subgraph's tensors.
//!
//! Whenever sharing is not possible (packd is away, the engine's weights-cache interface is
//! not one packd knows, two XNNPACKs are loaded, the engine brought its own cache, the build
//! was lost), the runtime is created exactly as without packd, and the reason is counted in
//! [`status`] and logged once to stderr.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::ffi::CStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

use packd_client::{AcquireOptions, Fallback};
use packd_interpose::ledger::{Journal, Keeps, Ledger, Private, micros};
use packd_interpose::memo::{self, Memo, Span as Tensor};
use packd_interpose::scan::{Adapter, Pinned, Scanner, Slot};
use serde::Serialize;

use crate::cache::{ENGINE, XnnCache, XnnMode};
use crate::engine::{self, InterfaceError};
use crate::sys::hooks::{self, Handler, REALS, Reals};
use crate::sys::provider::{Ctx, Provider};

/// What [`status`] reports (as JSON: [`Status::to_json`], these fields' names). A unit of
/// work is a runtime created through the hook.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Status {
    /// Whether [`enable`] ran.
    pub enabled: bool,
    /// Its weights-cache interface (202411, 202511, 202603), once known.
    pub interface: Option<u32>,
    /// Why the interface is not one packd knows (or why no engine is used).
    pub interface_error: Option<String>,
    /// Objects whose calls into XNNPACK now go through packd.
    pub hooked: Vec<String>,
    /// Runtimes created through the hook: `served`, `built` (built and published, or being
    /// published; counted `private` instead once packd refuses the publication) or `private`
    /// (created exactly as without packd, for the `reasons`).
    pub runtimes: u64,
    /// Runtimes alive with a packd cache.
    pub live: u64,
    /// Static tensors named by content, and their bytes hashed.
    pub tensors_named: u64,
    /// Bytes hashed to name them.
    pub bytes_hashed: u64,
    /// Static tensors of a datatype packd does not size (never named: packed privately).
    pub tensors_unknown: u64,
    /// Static tensors whose name was remembered from an earlier worker (not hashed).
    pub tensors_remembered: u64,
    /// Static tensors named provisionally (by the file they are mapped from and where):
    /// built under those names while their content names were hashed beside the build, or
    /// served through them and renamed by the publisher's table.
    pub tensors_provisional: u64,
    /// The caches' counters, summed over every runtime created with one (deleted or not):
    /// look-ups answered, missed, `reserve_space` calls and the bytes XNNPACK packed in this
    /// process.
    pub hits: u64,
    /// See `hits`.
    pub misses: u64,
    /// See `hits`.
    pub reserve_space: u64,
    /// See `hits`.
    pub bytes_packed: u64,
    /// Time spent, summed over runtimes, in microseconds: naming the static tensors
    /// (hashing), XNNPACK's runtime creation (its packing or look-ups), and finalizing
    /// (sealing; publication runs in the background: `publish_us`).
    pub hash_us: u64,
    /// See `hash_us`.
    pub create_us: u64,
    /// See `hash_us`.
    pub finalize_us: u64,
    /// Microseconds spent hashing content names beside builds under provisional names (off
    /// the runtime's creation, unless the creation was shorter).
    pub hash_beside_us: u64,
    /// What every adapter counts: `engine` (the library that defines XNNPACK's API),
    /// `served`, `built`, `private` with `reasons` and `fallbacks`, `bytes_shared`,
    /// `bytes_private`, `acquire_us`, `publish_us`.
    #[serde(flatten)]
    pub ledger: Ledger,
}

impl Keeps for Status {
    fn ledger(&mut self) -> &mut Ledger {
        &mut self.ledger
    }
}

impl Status {
    fn add(&mut self, s: &crate::cache::XnnStats) {
        self.hits += s.hits;
        self.misses += s.misses;
        self.reserve_space += s.reserve_space;
        self.bytes_packed += s.bytes_packed;
        self.ledger.publish_us += s.publish_us;
    }

    /// One line of JSON.
    pub fn to_json(&self) -> String {
        packd_interpose::status::to_json(self)
    }
}

/// The status, the connection and what is said of runtimes created privately.
pub(crate) static JOURNAL: Journal<Status> =
    Journal::new(ENGINE, "packd: an XNNPACK runtime packs its weights privately, as without packd");

/// The engine: the one loaded library that defines XNNPACK's API.
struct Engine {
    path: String,
    interface: Result<u32, InterfaceError>,
    /// Its build (for the cache identity), or why it has none.
    identity: Option<String>,
}

/// A provider handed to XNNPACK and its callbacks' context, boxed so that neither moves
/// while a runtime holds them; dropped after the runtime.
pub(crate) struct Adopted {
    // Declared first: dropped before the context it points to.
    provider: Box<Provider>,
    ctx: Box<Ctx<XnnCache>>,
    /// The ranges named for the runtime's creation.
    ranges: Vec<usize>,
}

impl Adopted {
    fn cache(&self) -> &XnnCache {
        &self.ctx.cache
    }
}

#[derive(Default)]
struct State {
    enabled: bool,
    engine: Option<Engine>,
    /// More than one library defines XNNPACK: nothing is hooked (a hook would not know
    /// which one its caller meant).
    ambiguous: Option<InterfaceError>,
    hooked: Vec<String>,
    subgraphs: HashMap<usize, Vec<Tensor>>,
    runtimes: HashMap<usize, Arc<Adopted>>,
}

static STATE: OnceLock<Mutex<State>> = OnceLock::new();
/// Most static tensors remembered per subgraph, and subgraphs remembered at once: bounds
/// for a program that defines and never creates or deletes.
const MAX_TENSORS: usize = 1 << 20;
const MAX_SUBGRAPHS: usize = 4096;

fn state() -> MutexGuard<'static, State> {
    STATE.get_or_init(Mutex::default).lock().unwrap_or_else(|p| p.into_inner())
}

/// Turns adoption on: finds the engine among the loaded objects and hooks the calls into
/// it; objects loaded since the last call are looked at again. Idempotent; safe from any
/// thread. `PACKD_XNNPACK=off` in the environment makes it do nothing.
pub fn enable() -> Status {
    if packd_interpose::entry::turned_off("PACKD_XNNPACK") {
        return status(); // turned off for this process: nothing is hooked
    }
    state().enabled = true;
    scan();
    status()
}

/// What adoption did so far.
pub fn status() -> Status {
    // The runtimes' counters first: reading them ends publications that are over, which
    // may count a refused build private.
    let st = state();
    let counters: Vec<_> = st.runtimes.values().map(|a| a.cache().stats()).collect();
    let mut s = JOURNAL.lock().clone();
    s.enabled = st.enabled;
    s.ledger.engine = st.engine.as_ref().map(|e| e.path.clone());
    let interface = st.ambiguous.clone().map(Err).or_else(|| st.engine.as_ref().map(|e| e.interface.clone()));
    s.interface = interface.as_ref().and_then(|i| i.as_ref().ok().copied());
    s.interface_error = interface.and_then(|i| i.err()).map(|e| e.to_string());
    s.hooked = st.hooked.clone();
    s.live = st.runtimes.len() as u64;
    for c in &counters {
        s.add(c);
    }
    s
}

/// The objects scanned so far (one scan at a time; never taken by a hook, so a hook never
/// waits for a scan).
static SCANNER: Scanner = Scanner::new();

/// Looks at objects loaded since the last scan: finds the engine, hooks their imports.
pub(crate) fn scan() {
    if !state().enabled {
        return;
    }
    hooks::HANDLER.register(&Adoption);
    let hooked = SCANNER.scan(&Adoption);
    state().hooked.extend(hooked);
}

/// The adoption as the scan and the hooks see it.
struct Adoption;

impl Adapter for Adoption {
    fn own_address(&self) -> usize {
        hooks::own_address()
    }

    fn found(&self, fresh: &[Pinned]) -> Vec<Slot> {
        let definers: Vec<(&Pinned, usize)> =
            fresh.iter().filter_map(|p| Some((p, p.defines(c"xnn_create_runtime_v4")?))).collect();
        let found = match definers.as_slice() {
            [(p, create)] if state().engine.is_none() => Some(engine_of(p, *create)),
            _ => None,
        };
        let mut st = state();
        if let Some(e) = found {
            st.engine = Some(e);
        } else if !definers.is_empty() && st.ambiguous.is_none() {
            // A second XNNPACK (at once, or after the engine was found): nothing more is
            // hooked; hooks already in place keep calling the engine they were made for.
            let mut names: Vec<String> = definers.iter().map(|(p, _)| p.object.name.clone()).collect();
            names.extend(st.engine.as_ref().map(|e| e.path.clone()));
            st.ambiguous = Some(InterfaceError::Ambiguous(names));
        }
        match (&st.ambiguous, REALS.get()) {
            (None, Some(reals)) => hooks::slots(reals),
            _ => Vec::new(),
        }
    }
}

impl Handler for Adoption {
    fn defined(&self, subgraph: usize, tensor: Option<Tensor>) {
        defined(subgraph, tensor);
    }

    fn subgraph_deleted(&self, subgraph: usize) {
        state().subgraphs.remove(&subgraph);
    }

    fn runtime_deleted(&self, runtime: usize) -> Option<Box<dyn std::any::Any>> {
        runtime_deleted(runtime).map(|a| Box::new(a) as Box<dyn std::any::Any>)
    }

    fn create_runtime(
        &self,
        subgraph: usize,
        engine_cache: usize,
        flags: u32,
        real: &mut dyn FnMut(usize) -> (i32, usize),
    ) -> i32 {
        create_runtime(subgraph, engine_cache, flags, real)
    }
}

/// The engine defined by the pinned object `p` (whose `xnn_create_runtime_v4` is at
/// `create`): its interface, build and real functions (set once, before any slot points at
/// a hook).
fn engine_of(p: &Pinned, create: usize) -> Engine {
    let real = |name: &CStr| p.defines(name);
    let _ = REALS.set(Reals::find(real));
    Engine {
        path: p.display_name(),
        interface: engine::engine_interface(create),
        identity: engine::engine_identity(create),
    }
}

/// Records a static tensor a subgraph defined (the hooks call it after the real definition
/// succeeded). `None` params: a datatype packd does not size.
fn defined(subgraph: usize, tensor: Option<Tensor>) {
    let mut st = state();
    let Some(t) = tensor else {
        drop(st);
        JOURNAL.lock().tensors_unknown += 1;
        return;
    };
    if !st.subgraphs.contains_key(&subgraph) && st.subgraphs.len() >= MAX_SUBGRAPHS {
        return;
    }
    let list = st.subgraphs.entry(subgraph).or_default();
    if list.len() < MAX_TENSORS {
        list.push(t);
    }
}

/// The runtime is being deleted: its cache leaves the map (counted), for the caller to drop
/// after the real deletion, outside the lock (freeing a cache may wait for its publication).
fn runtime_deleted(runtime: usize) -> Option<Arc<Adopted>> {
    let gone = state().runtimes.remove(&runtime);
    if let Some(a) = &gone {
        let stats = a.cache().stats();
        JOURNAL.lock().add(&stats);
    }
    gone
}

/// Why the engine cannot be adopted.
#[derive(Debug, thiserror::Error)]
enum Unadoptable {
    #[error("{0}")]
    Interface(InterfaceError),
    #[error("no XNNPACK library was found in this process")]
    NoEngine,
    #[error("unknown weights-cache interface: {0}")]
    UnknownInterface(InterfaceError),
    #[error("cannot tell the build of {0}")]
    NoBuild(String),
}

/// Why a runtime is created without packd.
pub(crate) struct NotAdopted {
    why: Private,
    /// Bytes of the subgraph's static weights (what XNNPACK packs privately, roughly).
    bytes: u64,
    /// The model as reported: its cache identity once known.
    model: String,
}

impl NotAdopted {
    fn new(why: Private) -> Self {
        Self { why, bytes: 0, model: "xnnpack runtime".into() }
    }
}

/// Counts a runtime created without packd, logs the reason once, and reports it to packd
/// (at once, or once packd can be reached), whose stats and metrics count it.
fn private(n: NotAdopted) {
    let NotAdopted { why, bytes, model } = n;
    // A cache that went private reported it already, with no bytes yet: this report (the
    // same model and reason) replaces it. Connecting again right after packd could not be
    // reached would only wait again.
    let client = if why.fallback == Fallback::DaemonAway { None } else { JOURNAL.client().ok() };
    JOURNAL.private(&model, &why, bytes, client);
}

/// What `xnn_create_runtime_v4` does through the hook. `real(provider)` creates the runtime
/// with that weights cache (NULL: none) and returns XNNPACK's status and the runtime.
fn create_runtime(
    subgraph: usize,
    engine_cache: usize,
    flags: u32,
    real: &mut dyn FnMut(usize) -> (i32, usize),
) -> i32 {
    JOURNAL.lock().runtimes += 1;
    let prepared = if engine_cache != 0 {
        Err(NotAdopted::new(Private::said(
            Fallback::EngineCache,
            "the engine passed a weights cache of its own (packd leaves it in place)",
        )))
    } else {
        prepare(subgraph, flags)
    };
    let adopted = match prepared {
        Ok(a) => a,
        Err(not) => {
            private(not);
            return real(engine_cache).0;
        }
    };
    let adopted = Arc::new(adopted);
    // The hash beside a build ends before this returns, even on a panic.
    let _settle = Settle(adopted.cache());
    let t = Instant::now();
    let (status, runtime) = real(&raw const *adopted.provider as usize);
    let created = t.elapsed();
    if status == 0 && runtime != 0 {
        // Kept from now on (the runtime holds the provider), whatever happens below.
        state().runtimes.insert(runtime, Arc::clone(&adopted));
    }
    adopted.cache().tell_built();
    hold_build(&adopted);
    let t = Instant::now();
    let _ = adopted.cache().finalize();
    let finalized = t.elapsed();
    // The engine unmaps the weights after creation and may map others there.
    for &ptr in &adopted.ranges {
        adopted.cache().unname_range(ptr);
    }
    if status != 0 || runtime == 0 {
        return status; // the cache goes (a build gives its role up)
    }
    let stats = adopted.cache().stats();
    {
        let mut st = JOURNAL.lock();
        st.create_us += micros(created);
        st.finalize_us += micros(finalized);
    }
    // The weights this runtime maps from packd (served, or built and being published).
    let shared = stats.bytes_shared;
    let model = adopted.cache().identity().to_string();
    let counted = match stats.mode {
        Some(XnnMode::Served) => {
            let mut st = JOURNAL.lock();
            st.ledger.served += 1;
            st.ledger.bytes_shared += shared;
            true
        }
        // Built: counted so until packd refuses the publication, if it does.
        Some(XnnMode::Building | XnnMode::Published) => {
            let model = model.clone();
            adopted.cache().count_built(
                || {
                    let mut st = JOURNAL.lock();
                    st.ledger.built += 1;
                    st.ledger.bytes_shared += shared;
                },
                Box::new(move |why, bytes| {
                    {
                        let mut st = JOURNAL.lock();
                        st.ledger.built = st.ledger.built.saturating_sub(1);
                        st.ledger.bytes_shared = st.ledger.bytes_shared.saturating_sub(shared);
                    }
                    private(NotAdopted { why: Private::adapter(why.fallback, why), bytes, model });
                }),
            )
        }
        _ => false,
    };
    // A build that could not be published (its source changed, nothing named, refused
    // before it was counted): counted private with its reason, as the runtime packed for
    // itself.
    if let Some(why) = adopted.cache().why_private().filter(|_| !counted) {
        private(NotAdopted { why: Private::adapter(why.fallback, why), bytes: stats.bytes_private, model });
    }
    status
}

/// Settles a cache's renamer when dropped ([`XnnCache::settle_renamer`]): after finalize
/// there is none left; before it (a panic on the way), its thread is joined, as it reads the
/// engine's tensors, which the engine may unmap once the hook returned.
struct Settle<'a>(&'a XnnCache);

impl Drop for Settle<'_> {
    fn drop(&mut self) {
        self.0.settle_renamer();
    }
}

/// `PACKD_XNNPACK_HOLD_BUILD=SECONDS` (or `=/PATH`: until that file exists): a builder
/// waits before it finalizes (and publishes). For tests and demonstrations of the single
/// flight: other workers wait for it, and a builder killed meanwhile hands the role on.
fn hold_build(a: &Adopted) {
    if std::env::var_os("PACKD_XNNPACK_HOLD_BUILD").is_some() && a.cache().stats().mode == Some(XnnMode::Building) {
        packd_interpose::hold::hold_as("PACKD_XNNPACK_HOLD_BUILD");
    }
}

/// Names the subgraph's tensors and makes the cache, or says why not.
fn prepare(subgraph: usize, flags: u32) -> Result<Adopted, NotAdopted> {
    let (tensors, interface, engine_id) = {
        let st = state();
        let unknown = |why: Unadoptable| NotAdopted::new(Private::adapter(Fallback::UnknownInterface, why));
        if let Some(why) = &st.ambiguous {
            return Err(unknown(Unadoptable::Interface(why.clone())));
        }
        let e = st.engine.as_ref().ok_or_else(|| unknown(Unadoptable::NoEngine))?;
        let interface = e.interface.clone().map_err(|e| unknown(Unadoptable::UnknownInterface(e)))?;
        let id = e.identity.clone().ok_or_else(|| unknown(Unadoptable::NoBuild(e.path.clone())))?;
        (st.subgraphs.get(&subgraph).cloned().unwrap_or_default(), interface, id)
    };
    if tensors.is_empty() {
        let why = Private::said(Fallback::UnnamedWeights, "the subgraph has no static tensors packd could name");
        return Err(NotAdopted::new(why));
    }
    let bytes = tensors.iter().map(|t| t.len as u64).sum();
    // A runtime of this process may still be publishing (two methods sharing their
    // weights): its publication ends first, so that this one is served from it instead of
    // building it again, and finds the names it remembered.
    let live: Vec<Arc<Adopted>> = state().runtimes.values().cloned().collect();
    for a in live {
        a.cache().wait_published();
    }
    let engine = format!("{engine_id};flags={flags:x}");
    let identity_of =
        move |names: &[String]| crate::cache::identity(&model_of(names), &engine, &engine::cpu_identity());
    let t = Instant::now();
    let memo = Memo::look_up(&tensors);
    // Names the memo lacks: hashed now, or (a file's tensors) provisional while a build
    // hashes them beside it.
    let provisional = if memo.known.iter().any(Option::is_none) && memo::provisional_names() {
        memo.provisional(&tensors)
    } else {
        None
    };
    let names = match &provisional {
        Some(p) => p.clone(),
        None => {
            let names = name_all(&tensors, &memo, threads(0));
            memo.remember(&tensors, &names);
            names
        }
    };
    JOURNAL.add_time(|s| &mut s.hash_us, t.elapsed());
    let identity = identity_of(&names);
    let not = |why: Private| NotAdopted { why, bytes, model: identity.clone() };
    let client = JOURNAL.client().map_err(|e| not(Private::packd("packd is away", e)))?.clone();
    let t = Instant::now();
    // What a build writes is about what the weights are (packing adds bias and padding).
    let options = AcquireOptions { build_bytes: bytes, ..AcquireOptions::default() };
    let cache = XnnCache::new(client, identity.clone(), options, false).map_err(|e| not(Private::packd("packd", e)));
    JOURNAL.add_time(|s| &mut s.ledger.acquire_us, t.elapsed());
    let cache = cache?;
    if let Some(why) = cache.why_private() {
        let fallback = why.fallback;
        return Err(not(Private::adapter(fallback, why)));
    }
    let names = match provisional {
        None => names,
        Some(provisional) => {
            JOURNAL.lock().tensors_provisional += tensors.len() as u64;
            if cache.stats().mode == Some(XnnMode::Served) {
                served_names(&cache, &tensors, &memo, &provisional)
            } else {
                let renamer = hash_beside(&tensors, memo, provisional.clone(), identity_of)
                    .map_err(|e| not(Private::io("cannot start hashing the tensors' names", e)))?;
                cache.rename_at_finalize(renamer);
                provisional
            }
        }
    };
    let mut ranges = Vec::with_capacity(tensors.len());
    for (t, name) in tensors.iter().zip(&names) {
        cache.name_range(t.ptr, t.len, name);
        ranges.push(t.ptr);
    }
    let ctx = Box::new(Ctx { cache, interface });
    let provider = Box::new(Provider::new(&ctx));
    Ok(Adopted { provider, ctx, ranges })
}

/// The model name the tensors' names make (content or provisional: they never meet).
fn model_of(names: &[String]) -> String {
    let mut model = blake3::Hasher::new();
    for n in names {
        model.update(n.as_bytes());
        model.update(b"\n");
    }
    format!("b3:{}", &model.finalize().to_hex()[..32])
}

/// Threads to hash with: every core, less `spare` (at least one).
fn threads(spare: usize) -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get()).saturating_sub(spare).max(1)
}

/// A worker served under provisional names: the content names, from the table the builder
/// published, else (no table, or a name missing from it) hashed here and remembered.
fn served_names(cache: &XnnCache, tensors: &[Tensor], memo: &Memo, provisional: &[String]) -> Vec<String> {
    let table = cache.published_names(provisional);
    let known: Option<Vec<String>> =
        provisional.iter().zip(&memo.known).map(|(p, k)| k.clone().or_else(|| table.get(p).cloned())).collect();
    known.unwrap_or_else(|| {
        let t = Instant::now();
        let names = name_all(tensors, memo, threads(0));
        memo.remember(tensors, &names);
        JOURNAL.add_time(|s| &mut s.hash_us, t.elapsed());
        names
    })
}

/// The source file changed during the build.
#[derive(Debug, thiserror::Error)]
#[error("the model file changed while its weights were packed: nothing built from it is published")]
struct Changed;

/// A builder under provisional names hashes the content names on a thread of its own, on
/// every core but one (the build's), beside the runtime's creation; at finalize the cache
/// joins it (the thread reads the engine's tensors, which live until the creation
/// returns), checks the files are unchanged and renames. The names go to the memo only once
/// published: until then a worker that starts names provisionally and waits for the build.
fn hash_beside(
    tensors: &[Tensor],
    memo: Memo,
    provisional: Vec<String>,
    identity_of: impl FnOnce(&[String]) -> String + Send + 'static,
) -> std::io::Result<crate::cache::Renamer> {
    let tensors = tensors.to_vec();
    let hashing = std::thread::Builder::new().name("packd-xnn-names".into()).spawn(move || {
        let t = Instant::now();
        let names = name_all(&tensors, &memo, threads(1));
        JOURNAL.add_time(|s| &mut s.hash_beside_us, t.elapsed());
        (names, memo, tensors)
    })?;
    Ok(Box::new(move || {
        let (names, memo, tensors) =
            hashing.join().map_err(|_| Private::said(Fallback::Other, "naming the tensors panicked"))?;
        if !memo.unchanged(&tensors) {
            return Err(Private::adapter(Fallback::UnnamedWeights, Changed));
        }
        let identity = identity_of(&names);
        let renames = provisional.into_iter().zip(names.iter().cloned()).collect();
        let then = Box::new(move || memo.remember(&tensors, &names));
        Ok(crate::cache::Renamed { identity, names: renames, then })
    }))
}

/// Each tensor's name: BLAKE3 of its packing parameters and its bytes, on every core (the
/// largest tensors first); a tensor defined twice (same bytes, same parameters) is hashed
/// once.
fn name_all(tensors: &[Tensor], memo: &Memo, threads: usize) -> Vec<String> {
    let mut order: Vec<usize> = (0..tensors.len()).filter(|&i| memo.known[i].is_none()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(tensors[i].len));
    let mut first: HashMap<(usize, usize, &[u8]), usize> = HashMap::new();
    let mut same_as = vec![usize::MAX; tensors.len()];
    let mut unique = Vec::new();
    for &i in &order {
        let t = &tensors[i];
        match first.get(&(t.ptr, t.len, t.params.as_slice())) {
            Some(&j) => same_as[i] = j,
            None => {
                first.insert((t.ptr, t.len, t.params.as_slice()), i);
                unique.push(i);
            }
        }
    }
    let names: Vec<OnceLock<String>> = (0..tensors.len()).map(|_| OnceLock::new()).collect();
    let next = AtomicUsize::new(0);
    let threads = threads.min(unique.len()).max(1);
    let work = || {
        loop {
            let k = next.fetch_add(1, Ordering::Relaxed);
            let Some(&i) = unique.get(k) else { break };
            let t = &tensors[i];
            let mut h = blake3::Hasher::new();
            h.update(&(t.params.len() as u64).to_le_bytes());
            h.update(&t.params);
            h.update(hooks::tensor_bytes(t));
            let _ = names[i].set(format!("c:{}", &h.finalize().to_hex()[..32]));
        }
    };
    std::thread::scope(|scope| {
        // Helpers where threads can be had; this thread hashes too (and alone, without).
        for _ in 1..threads {
            let _ = std::thread::Builder::new().name("packd-xnn-hash".into()).spawn_scoped(scope, work);
        }
        work();
    });
    let mut st = JOURNAL.lock();
    st.tensors_named += tensors.len() as u64;
    st.bytes_hashed += unique.iter().map(|&i| tensors[i].len as u64).sum::<u64>();
    st.tensors_remembered += memo.known.iter().filter(|k| k.is_some()).count() as u64;
    drop(st);
    let all: Vec<String> = (0..tensors.len())
        .map(|i| match &memo.known[i] {
            Some(name) => name.clone(),
            None => {
                let j = if same_as[i] == usize::MAX { i } else { same_as[i] };
                names[j].get().cloned().unwrap_or_default()
            }
        })
        .collect();
    all
}
