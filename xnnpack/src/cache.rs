//! A host-wide weights cache for XNNPACK (`struct xnn_weights_cache_provider`), backed by
//! packd's engine-published segments.
//!
//! Created for a *cache identity* (the model, the XNNPACK build, the CPU features and the
//! provider's own key format), it asks packd for the identity's published segment:
//!
//! * **served**: the segment is mapped read-only and every `look_up` XNNPACK makes is
//!   answered from its table, with no daemon round trip; XNNPACK packs nothing.
//! * **building**: this process is the identity's builder. Packed weights XNNPACK can name
//!   go straight into a memfd mapped writable at the start of the reservation: the size
//!   the engine expects mapped at once, its pages allocated and mapped by a thread of its
//!   own ahead of the packing, a margin past it mapped without its pages (bias, padding
//!   and the table of names), grown past that in steps populated as they are mapped
//!   (packing into pages not yet allocated cost XNNPACK's runtime creation 31 ms against
//!   18 ms into allocated ones, for ExecuTorch's MLP of MiniLM's shapes).
//!   [`XnnCache::finalize`] (after the runtime is created) hands the build to a thread of
//!   its own, which maps the same pages read-only at the same addresses (XNNPACK keeps its
//!   pointers), seals the memfd, publishes it and waits for packd's answer: packd serves
//!   the memfd the builder wrote, with no copy. A builder with nothing to publish gives
//!   its role up at once (at finalize, on a refused publication, or when dropped before
//!   finalize), so that processes waiting for it pack privately without waiting longer.
//! * **private**: packd is away, another process's build overran or gave up, or the caller
//!   asked for it: everything is packed into private memory, counted, nothing published.
//!
//! Keys. XNNPACK's look-up key ([`XnnKey`]) is a seed, the *addresses* of the kernel and
//! bias, and (since Nov 2025) a fingerprint id. An address is named by the packd entry it
//! lies in (any model mapped through the client library, see `packd_client::names`; a released model's
//! addresses are no name any more) or by a range the engine named
//! ([`XnnCache::name_range`]); a key with an address nobody named is never looked up or
//! published: its weights are packed privately and counted as `unnamed`. A name must stand
//! for the whole parameter set of the operator (XNNPACK gives no bias address for qd8
//! nodes, and never the scales).
//!
//! The callbacks as XNNPACK calls them (docs/INTEGRATION.md has the table per operator):
//! `look_up`; on a miss `reserve_space` → XNNPACK fills the block → `look_up_or_insert`
//! with the block; after a hit, convolutions call `look_up_or_insert` with **no block**
//! (NULL) and use the answer as the weights' offset, so that call answers the look-up.
//! Between `reserve_space` and its `look_up_or_insert` the cache's one *slot* is taken, as
//! XNNPACK's own cache holds its mutex: other threads' reservations wait for it.
//!
//! Memory. Everything handed to XNNPACK lies in one address-space reservation: the shared
//! area (the published or building segment) first, then a private area. An offset is an
//! address minus the reservation's base, so `offset_to_addr` needs no lock and nothing ever
//! moves. `reserve_space` memory is 64-byte aligned (XNNPACK's packers use aligned stores).
//!
//! Nothing here reads memory it does not own: `look_up_or_insert` reads only the block this
//! cache reserved for the calling thread, and [`XnnCache::read`] only backed parts of the
//! reservation while no block is outstanding.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};

use packd_client::{AcquireOptions, Acquired, Client, Error, Fallback, PublishEntry, Report, Segment};
use packd_interpose::ledger::Private;

use crate::names;
use crate::sys::provider::WeightsCache;
pub use crate::sys::provider::{NOT_FOUND, XnnKey};
use packd_interpose::sys::vm::{self, Populating, Reservation};

/// The engine name this cache reports to packd.
pub(crate) const ENGINE: &str = "xnnpack";

/// Address space reserved for the shared area and again for the private area: 64 GiB on
/// 64-bit targets, 512 MiB on 32-bit ones.
const AREA: usize = if usize::BITS >= 64 { 1 << (usize::BITS - 28) } else { 1 << 29 };
/// Growth step of the building memfd and of the private area's backing.
const STEP: usize = 4 << 20;
/// Alignment of every `reserve_space` block.
const ALIGN: usize = 64;
/// Version of the provider's key format (part of the identity). 2: the fingerprint id of
/// XNNPACK's current interface is part of every name.
const KEY_FORMAT: u32 = 2;

impl XnnKey {
    /// A 2024-11 key (no fingerprint id).
    pub fn new(seed: u32, kernel: usize, bias: usize) -> Self {
        Self { seed, kernel, bias, fingerprint: None }
    }
}

/// What the cache does for this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub enum XnnMode {
    /// Looks weights up in a segment another process published.
    Served = 0,
    /// Builds the segment and publishes it at [`XnnCache::finalize`].
    Building = 1,
    /// Published the segment it built.
    Published = 2,
    /// Packs privately (see [`XnnStats::reason`]).
    Private = 3,
}

/// Counters an engine (and an operator) can read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct XnnStats {
    /// `look_up` calls answered with an offset.
    pub hits: u64,
    /// `look_up` calls answered "not found".
    pub misses: u64,
    /// `reserve_space` calls (each one is a weight XNNPACK packs in this process).
    pub reserve_space: u64,
    /// Bytes XNNPACK packed in this process (sum of `reserve_space` sizes).
    pub bytes_packed: u64,
    /// Microseconds from the start of the publication to packd's answer (0 until it
    /// answered).
    pub publish_us: u64,
    /// Bytes of packed weights this process holds privately (not shared).
    pub bytes_private: u64,
    /// Bytes of the shared segment this process maps.
    pub bytes_shared: u64,
    /// Weights whose key had an address nobody named (packed privately).
    pub unnamed: u64,
    /// Inserts whose name was known with other bytes (kept privately, never served).
    pub conflicts: u64,
    /// Inserts answered with an existing copy (same name or same bytes).
    pub deduplicated: u64,
    /// `look_up_or_insert` calls with no block (after a hit), answered by a look-up.
    pub reinserts: u64,
    /// `look_up_or_insert` calls refused because their block was not the one this cache
    /// reserved for the calling thread (a caller's bug; nothing is read).
    pub bad_inserts: u64,
    /// `alias_data` calls (XNNPACK's current interface).
    pub aliases: u64,
    /// The mode.
    pub mode: Option<XnnMode>,
    /// Why the weights are private, when they are.
    pub reason: String,
    /// The same as a reason a worker reports (`None` unless private).
    pub fallback: Option<Fallback>,
}

/// Where a block handed out by `reserve_space` lies.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Area {
    Shared,
    Private,
}

/// The block `reserve_space` handed out and `look_up_or_insert` has not taken yet: the
/// cache's one slot.
struct Reserved {
    thread: ThreadId,
    area: Area,
    offset: usize,
    len: usize,
}

/// The shared area's state.
enum Shared {
    /// A published segment, mapped read-only at offset 0; its table by name.
    Served { segment: Segment, table: HashMap<String, (usize, usize)> },
    /// The build, in `file` (a memfd) mapped writable at offset 0: `cursor` bytes used,
    /// `backed` bytes of the memfd mapped; `limit` and `max_entries`, what the daemon
    /// accepts in a publication (weights past them are packed privately, so the
    /// publication is never refused for its size); `told`, the size past which the build
    /// tells packd its progress again.
    /// `populating`: a thread mapping the pages the build is expected to fill, ahead of it.
    Building {
        file: File,
        cursor: usize,
        backed: usize,
        told: usize,
        entries: Vec<PublishEntry>,
        limit: usize,
        max_entries: usize,
        populating: Option<Populating>,
    },
    /// The published (or, if publishing failed, privately kept) build, read-only, `size`
    /// bytes of the sealed memfd the build wrote.
    Done { segment: Option<Segment>, size: usize },
    /// None.
    Nothing,
}

/// A build complete in `file` (the runtime is created, its weights written): `size`
/// bytes of it used, `backed` mapped writable, pages mapped ahead by `populating`.
struct Built {
    file: File,
    size: usize,
    backed: usize,
    populating: Option<Populating>,
}

impl Built {
    /// Stops mapping pages ahead, unmaps what lies past the build and cuts the memfd to it.
    fn cut(&mut self, res: &Reservation) {
        if let Some(populating) = self.populating.take() {
            populating.finish();
        }
        if self.backed > self.size {
            // SAFETY: `[size, backed)` lies past every block handed out (they end at the
            // cursor ≤ `size`, and the build hands out no more), so no reference into it
            // exists; unmapped before the memfd is cut to `size`.
            let _ = unsafe { res.decommit(self.size, self.backed - self.size) };
            self.backed = self.size;
        }
        // Pages allocated ahead past the build are given back here too.
        if self.file.metadata().is_ok_and(|m| m.len() != self.size as u64) {
            let _ = self.file.set_len(self.size as u64);
        }
    }

    /// Cuts the build, maps its `size` bytes read-only at the same addresses (the same pages:
    /// XNNPACK's pointers stay valid) from a read-only fd so that the memfd can be sealed,
    /// and seals it: the memfd, ready to publish.
    fn seal(mut self, res: &Reservation) -> Result<File, Private> {
        self.cut(res);
        let sealed = vm::reopen_read_only(&self.file).and_then(|ro| {
            // SAFETY: the runtime is created (nobody writes packed weights after creation,
            // and the build hands out no more blocks); the new mapping shows the same bytes
            // of the same memfd, which is `size` bytes long and changes size only in `cut`.
            // The engine may read the weights meanwhile: each step is replaced at once (a
            // read waits for it, then finds the same bytes). Populated: the engine's first
            // inference reads them all.
            unsafe { res.map_file_populated_in_steps(0, self.size, &ro, 0) }?;
            vm::seal(&self.file)
        });
        sealed.map(|()| self.file).map_err(|e| Private::io("making the build read-only and sealing it failed", e))
    }
}

#[derive(Default)]
struct Counters {
    /// Microseconds from the start of the publication to packd's answer.
    publish_us: u64,
    hits: u64,
    misses: u64,
    reserve_calls: u64,
    bytes_packed: u64,
    unnamed: u64,
    conflicts: u64,
    deduplicated: u64,
    reinserts: u64,
    bad_inserts: u64,
    aliases: u64,
}

/// A publication's thread: it seals the build and ends with packd's answer (or why the
/// build stays private, its role given up) and how long that took.
type Publishing = JoinHandle<(Result<Segment, Private>, Duration)>;

impl State {
    /// Private from now on, for `why`.
    fn go_private(&mut self, why: Private) {
        self.mode = XnnMode::Private;
        self.private = Some(Arc::new(why));
    }
}

/// A published segment larger than the cache's address range.
#[derive(Debug, thiserror::Error)]
#[error("the published segment is {0} bytes, over the {AREA} bytes of the cache's area")]
struct OverArea(u64);

struct State {
    shared: Shared,
    mode: XnnMode,
    /// Why the cache is private (in `Private` mode).
    private: Option<Arc<Private>>,
    private_cursor: usize,
    private_backed: usize,
    /// Named weights inserted in this process: name → (offset, length).
    inserted: HashMap<String, (usize, usize)>,
    /// Unnamed private weights by content, for deduplication.
    by_bytes: HashMap<[u8; 32], (usize, usize)>,
    /// Each thread's last look-up (its name, if any), for the `reserve_space` that follows.
    pending: HashMap<ThreadId, Option<String>>,
    /// Ranges the engine named: start → (end, name).
    named: BTreeMap<usize, (usize, String)>,
    /// Addresses XNNPACK said hold the same data as a named one (`alias_data`): address →
    /// the original's name. Forgotten at finalize: XNNPACK frees those buffers with the
    /// subgraph, and a freed address must name nothing.
    aliases: HashMap<usize, String>,
    /// The slot: the block handed out and not filed yet.
    reserved: Option<Reserved>,
    /// The publication running in the background since `finalize`.
    publishing: Option<Publishing>,
    /// A build under provisional names: finds the content names at finalize.
    renamer: Option<Renamer>,
    /// Undoes how the process's status counted this build, if packd refuses its publication
    /// after it was counted ([`XnnCache::count_built`]).
    uncount: Option<Uncount>,
    /// Served: where the segment's table of provisional to content names is (offset,
    /// length), if it has one; read only when asked for.
    names_table: Option<(usize, usize)>,
    /// The model as reported to packd: the identity asked for, the one served (an alias's
    /// segment's), or the one published.
    model: String,
    counters: Counters,
}

/// A build under provisional names, renamed ([`XnnCache::rename_at_finalize`]).
pub(crate) struct Renamed {
    /// The identity the content names make: published under it, with the provisional
    /// identity as its alias.
    pub(crate) identity: String,
    /// Provisional name → content name.
    pub(crate) names: HashMap<String, String>,
    /// Run once the publication is accepted, or refused because the identity is published
    /// already (the names are right either way): the adapter remembers the names.
    pub(crate) then: Box<dyn FnOnce() + Send>,
}

/// Finds the content names of a build under provisional names (joins what hashes them, and
/// checks the source did not change); `Err`: nothing may be published.
pub(crate) type Renamer = Box<dyn FnOnce() -> Result<Renamed, Private> + Send>;
/// See [`XnnCache::count_built`].
pub(crate) type Uncount = Box<dyn FnOnce(Arc<Private>, u64) + Send>;

/// The provider's state (see the module documentation). One lock guards it; a condition
/// variable wakes those waiting for the slot.
pub struct XnnCache {
    client: Client,
    identity: String,
    /// The address space handed to XNNPACK; mapped before the cache is shared, then only
    /// under `state`'s lock.
    res: Arc<Reservation>,
    state: Mutex<State>,
    slot_freed: Condvar,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Maps the build's memfd `file` writable over the part of the shared area a build of
/// `expected` bytes (the weights' size, 0 when unknown) will fill, at most `limit`, and
/// starts a thread mapping its pages ahead of the packing: XNNPACK then writes into pages
/// already there (shared pages cost about twice private ones to allocate and map, and the
/// second core pays for them). Past that, a margin ([`margin`]) is mapped without its pages:
/// packing adds bias and padding, and the table of names follows the weights; a page of it
/// is allocated only if written. The bytes mapped (0 for a small or unknown build, which
/// grows as it goes) and the thread.
fn populate_ahead(res: &Arc<Reservation>, file: &File, expected: u64, limit: usize) -> (usize, Option<Populating>) {
    let len =
        usize::try_from(expected).ok().and_then(|e| e.checked_next_multiple_of(vm::page())).unwrap_or(0).min(limit);
    let mapped = len.saturating_add(margin(len)).min(limit);
    if len < 2 * STEP || file.set_len(mapped as u64).is_err() {
        return (0, None);
    }
    // SAFETY: the shared area of a new build: nothing was handed out from it, so no
    // reference into it exists; the memfd (this process's own) is `mapped` bytes long.
    if unsafe { res.map_file_writable_lazily(0, mapped, file, 0) }.is_err() {
        return (0, None);
    }
    (mapped, Populating::start(Arc::clone(res), 0, len, file, 0).ok())
}

/// What is mapped, unpopulated, past the `len` bytes a build is expected to write: a
/// sixteenth and 1 MiB, in whole pages. ExecuTorch's MLP of MiniLM's shapes packed its
/// 42.5 MB of weights into 3 KB less than their size, and the table of names then needed a
/// step of its own (4 MiB populated at once: 1.4 ms of finalize).
fn margin(len: usize) -> usize {
    round_up(len / 16 + (1 << 20), vm::page())
}

/// `n` rounded up to a multiple of `to`; only for values far below `usize::MAX` (offsets
/// inside the reservation), see `checked_next_multiple_of` for a caller's sizes.
pub(crate) fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

/// The cache identity of `model` packed by the XNNPACK build `engine` on this CPU: at most
/// 256 printable ASCII characters.
pub fn identity(model: &str, engine: &str, cpu: &str) -> String {
    let short = |s: &str| {
        if s.len() <= 80 && s.bytes().all(|b| (0x21..0x7f).contains(&b) && b != b';') {
            s.to_string()
        } else {
            format!("b3:{}", &blake3::hash(s.as_bytes()).to_hex()[..32])
        }
    };
    format!(
        "xnnpack;key=v{KEY_FORMAT}/{}b;model={};engine={};cpu={}",
        std::mem::size_of::<usize>() * 8,
        short(model),
        short(engine),
        short(cpu)
    )
}

impl XnnCache {
    /// A cache for `identity` (see [`identity`]): acquires the identity from packd and
    /// serves, builds or packs privately accordingly. With `private`, packd is not asked.
    /// A daemon that is away, refuses or overruns makes the cache private; only a published
    /// segment that cannot be mapped or whose memfd has the wrong size fails it.
    pub fn new(client: Client, identity: String, options: AcquireOptions, private: bool) -> Result<Self, Error> {
        let res = Arc::new(Reservation::new(2 * AREA)?);
        let cache = Self {
            client,
            identity: identity.clone(),
            res,
            state: Mutex::new(State {
                shared: Shared::Nothing,
                mode: XnnMode::Private,
                private: None,
                private_cursor: 0,
                private_backed: 0,
                inserted: HashMap::new(),
                by_bytes: HashMap::new(),
                pending: HashMap::new(),
                named: BTreeMap::new(),
                aliases: HashMap::new(),
                reserved: None,
                publishing: None,
                renamer: None,
                uncount: None,
                names_table: None,
                model: identity.clone(),
                counters: Counters::default(),
            }),
            slot_freed: Condvar::new(),
        };
        let outcome = if private {
            Err(Private::said(Fallback::Asked, "private mode was asked for"))
        } else {
            match cache.client.acquire(&cache.identity, options) {
                Ok(Acquired::Segment(seg)) => {
                    lock(&cache.state).model = packd_interpose::ledger::served_identity(&seg, &cache.identity);
                    cache.serve(seg)?.map(|shared| (shared, XnnMode::Served))
                }
                Ok(Acquired::Build { max_bytes, max_entries, .. }) => match vm::memfd("packd-xnnpack") {
                    Ok(file) => {
                        let limit =
                            usize::try_from(max_bytes).unwrap_or(usize::MAX).min(AREA) / vm::page() * vm::page();
                        let (backed, populating) = populate_ahead(&cache.res, &file, options.build_bytes, limit);
                        let building = Shared::Building {
                            file,
                            cursor: 0,
                            backed,
                            told: 0,
                            entries: Vec::new(),
                            limit,
                            max_entries: usize::try_from(max_entries).unwrap_or(usize::MAX),
                            populating,
                        };
                        Ok((building, XnnMode::Building))
                    }
                    Err(e) => {
                        let why = Private::io("cannot make the memfd to build into", e);
                        cache.client.give_up(&cache.identity, &why.to_string());
                        Err(why)
                    }
                },
                Ok(Acquired::Private { fallback, reason }) => Err(Private::given(fallback, reason)),
                Err(e) => Err(Private::packd("packd", e)),
            }
        };
        let mode = {
            let mut st = lock(&cache.state);
            match outcome {
                Ok((shared, mode)) => {
                    st.shared = shared;
                    st.mode = mode;
                }
                Err(why) => st.go_private(why),
            }
            st.mode
        };
        if mode != XnnMode::Building {
            cache.send_report();
        }
        Ok(cache)
    }

    /// Maps a published segment read-only at the start of the reservation.
    fn serve(&self, seg: Segment) -> Result<Result<Shared, Private>, Error> {
        let size = usize::try_from(seg.info().size)
            .map_err(|_| Error::Protocol(packd_client::ProtocolError::TooLarge(seg.info().size)))?;
        if size > AREA {
            return Ok(Err(Private::adapter(Fallback::Other, OverArea(seg.info().size))));
        }
        if seg.file().metadata()?.len() != seg.info().size {
            return Err(Error::Protocol(packd_client::ProtocolError::SegmentSize(size as u64)));
        }
        // SAFETY: nothing has been handed out of the reservation yet (the cache is being
        // created), so no reference into the range exists; the sealed memfd (the client
        // checked its seals) is exactly `size` bytes long (checked above) and cannot shrink.
        unsafe { self.res.map_file(0, size, seg.file(), 0) }?;
        let mut table = HashMap::new();
        for e in &seg.info().entries {
            let at = (usize::try_from(e.offset), usize::try_from(e.length));
            if let (Ok(offset), Ok(length)) = at {
                if e.name == names::TABLE_KEY && offset.saturating_add(length) <= size {
                    lock(&self.state).names_table = Some((offset, length));
                }
                table.insert(e.name.clone(), (offset, length));
            }
        }
        Ok(Ok(Shared::Served { segment: seg, table }))
    }

    /// The cache identity.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Served: the content names the publisher wrote for the provisional names `wanted`
    /// (those it has; none when the segment has no table, or a table over the bound of
    /// [`names::table_bound`] for that many names).
    pub(crate) fn published_names(&self, wanted: &[String]) -> HashMap<String, String> {
        let st = lock(&self.state);
        let (Shared::Served { .. }, Some((offset, length))) = (&st.shared, st.names_table) else {
            return HashMap::new();
        };
        if length > names::table_bound(wanted.len()) {
            return HashMap::new();
        }
        // SAFETY: the served segment is mapped read-only at the start of the reservation for
        // as long as the state is `Served` (checked under the lock held here); the range lies
        // inside it (checked when it was served); it is sealed, so nothing writes it.
        let bytes = unsafe { self.res.bytes(offset, length) };
        let wanted: std::collections::HashSet<&str> = wanted.iter().map(String::as_str).collect();
        let mut table = names::parse(bytes);
        table.retain(|p, _| wanted.contains(p.as_str()));
        table
    }

    /// Runs a renamer not run yet (its thread reads the engine's tensors, which must not
    /// outlive the runtime's creation), leaving in its place one that fails: a build
    /// interrupted before finalize publishes nothing.
    pub(crate) fn settle_renamer(&self) {
        let renamer = lock(&self.state).renamer.take();
        if let Some(r) = renamer {
            let _ = r();
            let failed: Renamer = Box::new(|| {
                Err(Private::said(Fallback::Other, "the runtime's creation was interrupted before it was finalized"))
            });
            lock(&self.state).renamer = Some(failed);
        }
    }

    /// Building under provisional names: at [`XnnCache::finalize`], `renamer` gives the
    /// content names; every entry is renamed, the table of names is written into the
    /// segment, and it is published under the content identity with this cache's identity
    /// as its alias. A renamer that fails makes the build private (its role given up). Not
    /// building: `renamer` runs at once (it may hold a thread that must end).
    pub(crate) fn rename_at_finalize(&self, renamer: Renamer) {
        let mut st = lock(&self.state);
        if let Shared::Building { .. } = st.shared {
            st.renamer = Some(renamer);
        } else {
            drop(st);
            let _ = renamer();
        }
    }

    /// Names `[ptr, ptr + len)`: a kernel or bias address inside it is named `name` (with
    /// `+OFFSET` past its start), for as long as the cache lives or until
    /// [`XnnCache::unname_range`]. The name must stand for the weights' bytes *and* every
    /// other parameter XNNPACK packs with them (bias, scales), since those may not be in
    /// XNNPACK's key.
    pub fn name_range(&self, ptr: usize, len: usize, name: &str) {
        if len > 0 {
            lock(&self.state).named.insert(ptr, (ptr.saturating_add(len), name.to_string()));
        }
    }

    /// Forgets the range named at `ptr` (its memory is about to be freed or reused).
    pub fn unname_range(&self, ptr: usize) {
        lock(&self.state).named.remove(&ptr);
    }

    fn name_of(st: &State, addr: usize) -> Option<String> {
        if let Some(name) = st.aliases.get(&addr) {
            return Some(name.clone());
        }
        if let Some((start, (end, name))) = st.named.range(..=addr).next_back()
            && addr < *end
        {
            return Some(if addr == *start { name.clone() } else { format!("{name}+{}", addr - start) });
        }
        packd_client::names::entry_at(addr)
    }

    /// The provider's name of a look-up key, `None` when an address is not named.
    fn key_name(st: &State, key: &XnnKey) -> Option<String> {
        if key.kernel == 0 {
            return None;
        }
        let k = Self::name_of(st, key.kernel)?;
        let b = if key.bias == 0 { "-".to_string() } else { Self::name_of(st, key.bias)? };
        Some(match key.fingerprint {
            Some(f) => format!("s={:08x};f={f:08x};k={k};b={b}", key.seed),
            None => format!("s={:08x};k={k};b={b}", key.seed),
        })
    }

    /// Where the weights named `name` are: the served table, then what was filed here.
    fn find(st: &State, name: &str) -> Option<(usize, usize)> {
        let served = match &st.shared {
            Shared::Served { table, .. } => table.get(name).copied(),
            _ => None,
        };
        served.or_else(|| st.inserted.get(name).copied())
    }

    /// XNNPACK's `look_up`.
    pub fn look_up(&self, key: &XnnKey) -> usize {
        let mut st = lock(&self.state);
        let name = Self::key_name(&st, key);
        let found = name.as_deref().and_then(|n| Self::find(&st, n));
        st.pending.insert(std::thread::current().id(), name);
        match found {
            Some((offset, _)) => {
                st.counters.hits += 1;
                offset
            }
            None => {
                st.counters.misses += 1;
                NOT_FOUND
            }
        }
    }

    /// XNNPACK's `reserve_space`: 64-byte-aligned memory that never moves; NULL (0) when
    /// none can be had. Takes the cache's slot until this thread's `look_up_or_insert`
    /// (waiting while another thread holds it); a thread that reserves again without
    /// having filed its last block gives that block up.
    pub fn reserve_space(&self, n: usize) -> usize {
        let me = std::thread::current().id();
        let mut st = self.slot(lock(&self.state));
        let got = self.reserve(&mut st, me, n.max(1));
        if got.is_none() {
            drop(st);
            self.slot_freed.notify_all();
        }
        got.map_or(0, |offset| self.res.base() + offset)
    }

    /// Waits until no other thread holds the slot; a block the calling thread holds is
    /// given back (it reserves again, or reads or finalizes with a block it never filed:
    /// waiting for itself would never end).
    fn slot<'a>(&self, mut st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        let me = std::thread::current().id();
        loop {
            match &st.reserved {
                None => return st,
                Some(r) if r.thread == me => {
                    if let Some(r) = st.reserved.take() {
                        Self::give_back(&mut st, &r);
                    }
                    return st;
                }
                Some(_) => st = self.slot_freed.wait(st).unwrap_or_else(|p| p.into_inner()),
            }
        }
    }

    fn reserve(&self, st: &mut State, thread: ThreadId, n: usize) -> Option<usize> {
        let named = st.pending.remove(&thread).flatten();
        st.counters.reserve_calls += 1;
        let len = n.checked_next_multiple_of(ALIGN).filter(|&l| l <= AREA)?;
        st.counters.bytes_packed += len as u64;
        if named.is_some()
            && let Some(start) = self.alloc_shared(st, len)
        {
            st.reserved = Some(Reserved { thread, area: Area::Shared, offset: start, len });
            return Some(start);
        }
        let start = round_up(st.private_cursor, ALIGN);
        let end = start.checked_add(len).filter(|&e| e <= AREA)?;
        if end > st.private_backed {
            let grown = round_up(end, STEP).min(AREA);
            // SAFETY: `[private_backed, grown)` of the private area was never handed out, so
            // no reference into it exists.
            unsafe { self.res.commit(AREA + st.private_backed, grown - st.private_backed) }.ok()?;
            st.private_backed = grown;
        }
        st.private_cursor = end;
        st.reserved = Some(Reserved { thread, area: Area::Private, offset: AREA + start, len });
        Some(AREA + start)
    }

    /// `len` bytes of the build (committed as needed); `None` when not building or out of
    /// room.
    fn alloc_shared(&self, st: &mut State, len: usize) -> Option<usize> {
        let Shared::Building { file, cursor, backed, told, entries, limit, max_entries, .. } = &mut st.shared else {
            return None;
        };
        if entries.len() >= *max_entries {
            return None;
        }
        let start = round_up(*cursor, ALIGN);
        // The segment is published page-rounded.
        let end = start.checked_add(len).filter(|&e| round_up(e, vm::page()) <= *limit)?;
        if end > *told {
            // How far the build has come, at every step (its waiters compare it with
            // building themselves).
            self.client.build_progress(&self.identity, start as u64, 0);
            *told = round_up(end, STEP);
        }
        if end > *backed {
            let grown = round_up(end, STEP).min(*limit);
            // Grown only: the file may be longer already, where pages were allocated ahead.
            if file.metadata().ok()?.len() < grown as u64 {
                file.set_len(grown as u64).ok()?;
            }
            // SAFETY: `[backed, grown)` of the shared area was never handed out (blocks end
            // at `cursor` ≤ `backed`), so no reference into it exists; the memfd (this
            // process's own, written only through this mapping) is `grown` bytes long.
            unsafe { self.res.map_file_writable(*backed, grown - *backed, file, *backed as u64) }.ok()?;
            *backed = grown;
        }
        *cursor = end;
        Some(start)
    }

    /// Gives back a block that will not be filed, if it is the last one handed out.
    fn give_back(st: &mut State, r: &Reserved) {
        match r.area {
            Area::Private => {
                if st.private_cursor + AREA == r.offset + r.len {
                    st.private_cursor -= r.len;
                }
            }
            Area::Shared => {
                if let Shared::Building { cursor, .. } = &mut st.shared
                    && *cursor == r.offset + r.len
                {
                    *cursor -= r.len;
                }
            }
        }
    }

    /// XNNPACK's `look_up_or_insert`. With `ptr` 0 (what convolutions call after a hit):
    /// the offset of the weights the key names, [`NOT_FOUND`] if none. Otherwise `ptr` must
    /// be the block `reserve_space` handed to this thread and `size` at most its length:
    /// files it under the key's name, or answers with an identical copy already held, and
    /// frees the slot. Any other block is refused ([`NOT_FOUND`], nothing read).
    pub fn look_up_or_insert(&self, key: &XnnKey, ptr: usize, size: usize) -> usize {
        let mut st = lock(&self.state);
        let me = std::thread::current().id();
        // A look-up's name is for the `reserve_space` right after it, nothing later.
        st.pending.remove(&me);
        if ptr == 0 {
            st.counters.reinserts += 1;
            let name = Self::key_name(&st, key);
            return name.as_deref().and_then(|n| Self::find(&st, n)).map_or(NOT_FOUND, |(offset, _)| offset);
        }
        let ours = st.reserved.as_ref().is_some_and(|r| r.thread == me);
        let matches = st
            .reserved
            .as_ref()
            .is_some_and(|r| ours && ptr.checked_sub(self.res.base()) == Some(r.offset) && size <= r.len);
        if !matches {
            st.counters.bad_inserts += 1;
            if ours && let Some(r) = st.reserved.take() {
                Self::give_back(&mut st, &r);
                drop(st);
                self.slot_freed.notify_all();
            }
            return NOT_FOUND;
        }
        let Some(r) = st.reserved.take() else { return NOT_FOUND };
        let offset = self.file_block(&mut st, key, &r, size);
        drop(st);
        self.slot_freed.notify_all();
        offset
    }

    /// Files the filled block `r` (`size` bytes used) under the key's name.
    fn file_block(&self, st: &mut State, key: &XnnKey, r: &Reserved, size: usize) -> usize {
        let offset = r.offset;
        // SAFETY: `[offset, offset + size)` is the block this cache reserved for the calling
        // thread (checked by the caller: `size` ≤ its length), backed when it was handed
        // out; the thread that filled it has called `look_up_or_insert`, so nothing writes
        // it any more, and the state lock keeps other blocks from being handed out over it.
        let bytes = unsafe { self.res.bytes(offset, size) };
        let same = |o: usize, l: usize| {
            // SAFETY: `o`, `l` is an entry filed earlier (shared or private, backed) whose
            // bytes are complete and no longer written.
            l == size && unsafe { self.res.bytes(o, l) } == bytes
        };
        let Some(name) = Self::key_name(st, key) else {
            st.counters.unnamed += 1;
            let digest = *blake3::hash(bytes).as_bytes();
            if let Some(&(o, l)) = st.by_bytes.get(&digest)
                && same(o, l)
            {
                st.counters.deduplicated += 1;
                Self::give_back(st, r);
                return o;
            }
            st.by_bytes.insert(digest, (offset, size));
            return offset;
        };
        if let Some((o, l)) = Self::find(st, &name) {
            if same(o, l) {
                st.counters.deduplicated += 1;
                Self::give_back(st, r);
                return o;
            }
            // The name does not stand for these bytes: keep them (in the building memfd they
            // stay unlisted), never file or publish them under the name.
            st.counters.conflicts += 1;
            return offset;
        }
        // A named block packed into private memory while building (an operator that never
        // looks up, so its name was not known at `reserve_space`: deconvolution) moves into
        // the shared area; XNNPACK takes the offset returned here.
        let offset = match r.area {
            Area::Private => match self.alloc_shared(st, r.len) {
                Some(shared) => {
                    // SAFETY: `shared` is a fresh block of `r.len` ≥ `size` bytes of the
                    // building memfd, mapped writable and referenced by nothing; `bytes` is
                    // the filled private block (a different range of the reservation).
                    unsafe {
                        std::ptr::copy_nonoverlapping(bytes.as_ptr(), (self.res.base() + shared) as *mut u8, size)
                    };
                    Self::give_back(st, r);
                    shared
                }
                None => offset,
            },
            Area::Shared => offset,
        };
        st.inserted.insert(name.clone(), (offset, size));
        if offset < AREA
            && let Shared::Building { entries, .. } = &mut st.shared
        {
            entries.push(PublishEntry { key: name, offset: offset as u64, length: size as u64 });
        }
        offset
    }

    /// XNNPACK's `offset_to_addr`: lock-free (called on every inference).
    pub fn offset_to_addr(&self, offset: usize) -> usize {
        if offset < self.res.len() { self.res.base() + offset } else { 0 }
    }

    /// XNNPACK's `alias_data` (current interface, Mar 2026): `alias` is a buffer XNNPACK
    /// made holding data semantically equal to the weights at `original` (an f16 or bf16
    /// constant converted to f32 when the CPU lacks f16 kernels), and keys will carry
    /// `alias`. The alias is named as the original is (if it is named), until
    /// [`XnnCache::finalize`]. Always succeeds: an unnamed original leaves the alias
    /// unnamed (its weights are then packed privately).
    pub fn alias_data(&self, alias: usize, original: usize) -> bool {
        let mut st = lock(&self.state);
        st.counters.aliases += 1;
        match Self::name_of(&st, original) {
            Some(name) if alias != 0 => {
                st.aliases.insert(alias, name);
            }
            _ => {
                st.aliases.remove(&alias);
            }
        }
        true
    }

    /// A copy of the `len` bytes at `offset` (an offset `look_up` or `look_up_or_insert`
    /// returned), for checking what the cache holds. Waits while a `reserve_space` block is
    /// being filled (until its `look_up_or_insert`). `None` when the range is not memory
    /// the cache holds.
    pub fn read(&self, offset: usize, len: usize) -> Option<Vec<u8>> {
        let st = self.slot(lock(&self.state));
        let shared = match &st.shared {
            Shared::Served { segment, .. } => usize::try_from(segment.info().size).ok()?,
            Shared::Building { backed, .. } => *backed,
            Shared::Done { size, .. } => *size,
            Shared::Nothing => 0,
        };
        let end = offset.checked_add(len)?;
        if !(end <= shared || (offset >= AREA && end <= AREA + st.private_backed)) {
            return None;
        }
        // SAFETY: the range is backed (the shared area's mapped part, or the private area's
        // committed part, checked above), and with no reserved block outstanding (checked
        // under the state lock `reserve_space` takes) nothing writes any of it.
        Some(unsafe { self.res.bytes(offset, len) }.to_vec())
    }

    /// Publishes what this process built (in `Building` mode; otherwise nothing to do).
    /// Call it after `xnn_create_runtime*` returned and before the runtime is set up on
    /// other threads; it waits for a block being filled on another thread. The built
    /// weights stay where they are; making them read-only, sealing them and the
    /// publication itself (packd hashes every entry) run on a thread of its own, so the
    /// engine need not wait for them ([`XnnCache::wait_published`] does). With nothing to
    /// publish (no weight could be named) the builder role is given up at once. A publication packd refuses (already
    /// published by another process, over a limit) leaves the weights private; the reason
    /// is in [`XnnCache::stats`].
    pub fn finalize(&self) -> Result<(), Error> {
        let done = self.finish_build();
        if lock(&self.state).mode == XnnMode::Private {
            // Now with the bytes XNNPACK packed privately.
            self.send_report();
        }
        done
    }

    /// Tells packd how this cache got its weights (served, built and published, or
    /// privately and why, with the bytes), as `engine` "xnnpack" and model its identity.
    fn send_report(&self) {
        let s = self.stats();
        let model = lock(&self.state).model.clone();
        let report = match s.mode {
            Some(XnnMode::Served) => Report::served(ENGINE, &model, s.bytes_shared),
            Some(XnnMode::Published) => Report::built(ENGINE, &model, s.bytes_shared),
            Some(XnnMode::Private) => {
                Report::private(ENGINE, &model, s.fallback.unwrap_or(Fallback::Other), &s.reason, s.bytes_private)
            }
            Some(XnnMode::Building) | None => return,
        };
        self.client.report(&report);
    }

    fn finish_build(&self) -> Result<(), Error> {
        // Under provisional names: the content names (hashed beside the build), found before
        // the state is locked (the hash may take a while; look-ups and stats go on).
        let renamer = lock(&self.state).renamer.take();
        let renamed = renamer.map(|r| r());
        let mut st = self.slot(lock(&self.state));
        st.aliases.clear();
        // Look-ups of this runtime's creation are over: their names are for nothing later
        // (and a thread pool that churns threads would otherwise grow the map).
        st.pending.clear();
        // Only a build changes here: a served segment stays mapped and leased.
        let Shared::Building { .. } = &st.shared else { return Ok(()) };
        // Every entry renamed, and their table written into the build.
        let renamed = match renamed {
            None => Ok(None),
            Some(Ok(r)) => {
                self.rename_build(&mut st, &r);
                st.model = r.identity.clone();
                Ok(Some(r))
            }
            Some(Err(why)) => Err(why),
        };
        let Shared::Building { file, cursor, backed, entries, populating, .. } =
            std::mem::replace(&mut st.shared, Shared::Nothing)
        else {
            return Ok(());
        };
        // Never past what was mapped (nothing, when nothing was built).
        let size = round_up(cursor, vm::page()).min(backed);
        let mut built = Built { file, size, backed, populating };
        let outcome = renamed.and_then(|renamed| {
            if size == 0 || entries.is_empty() {
                Err(Private::said(Fallback::UnnamedWeights, "no weight could be named: nothing to publish"))
            } else {
                Ok(renamed)
            }
        });
        match outcome {
            // Sealing (the remap read-only is most of it: 3-5 ms for 40 MiB) and the
            // publication run on a thread of their own: the runtime is created already.
            Ok(renamed) => match self.start_publishing(built, entries, renamed) {
                Ok(handle) => st.publishing = Some(handle),
                Err(why) => {
                    self.client.give_up(&self.identity, &why.to_string());
                    st.go_private(why);
                }
            },
            Err(why) => {
                built.cut(&self.res);
                self.client.give_up(&self.identity, &why.to_string());
                st.go_private(why);
            }
        }
        st.shared = Shared::Done { segment: None, size };
        Ok(())
    }

    /// Tells packd the build has written all it will (the runtime is created): what is left
    /// is sealing and publishing, so its waiters wait for it.
    pub fn tell_built(&self) {
        if let Shared::Building { cursor, .. } = &lock(&self.state).shared {
            self.client.build_progress(&self.identity, *cursor as u64, *cursor as u64);
        }
    }

    /// Renames the build's entries by `r` and writes the table of names into the build as an
    /// entry of its own (left out when it does not fit: served workers then hash their
    /// names; and when nothing was named: nothing is published). Two provisional names of
    /// the same content rename two entries alike: the second is listed under a key of its
    /// own (its bytes stay listed, so packd can serve the builder's memfd as it is).
    fn rename_build(&self, st: &mut State, r: &Renamed) {
        let Shared::Building { entries, .. } = &mut st.shared else { return };
        let mut seen = std::collections::HashSet::new();
        for e in entries.iter_mut() {
            e.key = names::rename_key(&e.key, &r.names);
            if !seen.insert(e.key.clone()) {
                e.key = format!("{}{:x}", names::DUPLICATE_KEY, e.offset);
            }
        }
        let table = names::table(&r.names);
        if entries.is_empty() || table.is_empty() {
            return;
        }
        if let Some(at) = self.alloc_shared(st, table.len()) {
            // SAFETY: `at` is a fresh block of `table.len()` bytes of the building memfd past
            // every block handed out, mapped writable by `alloc_shared`; no block is
            // outstanding (the slot is free) and the state lock is held, so nothing else
            // reads or writes it.
            unsafe { std::ptr::copy_nonoverlapping(table.as_ptr(), (self.res.base() + at) as *mut u8, table.len()) };
            if let Shared::Building { entries, .. } = &mut st.shared {
                let key = names::TABLE_KEY.to_string();
                entries.push(PublishEntry { key, offset: at as u64, length: table.len() as u64 });
            }
        }
    }

    /// Seals the build and publishes it on a thread of its own, which then only waits for
    /// packd's answer (packd hashes it on its own threads) and reports the worker built as
    /// soon as packd serves it. Renamed: under the content identity, this cache's
    /// (provisional) identity its alias. A build that cannot be sealed, or that packd
    /// refuses, gives its role up from the thread.
    fn start_publishing(
        &self,
        built: Built,
        entries: Vec<PublishEntry>,
        renamed: Option<Renamed>,
    ) -> Result<Publishing, Private> {
        let client = self.client.clone();
        let res = Arc::clone(&self.res);
        let provisional = self.identity.clone();
        let (identity, aliases, then) = match renamed {
            Some(r) => (r.identity, vec![self.identity.clone()], Some(r.then)),
            None => (self.identity.clone(), Vec::new(), None),
        };
        std::thread::Builder::new()
            .name("packd-xnn-publish".into())
            .spawn(move || {
                let t = Instant::now();
                let size = built.size;
                let published = built.seal(&res).and_then(|file| {
                    let published = client.publish_aliased(&identity, &aliases, &file, size as u64, &entries);
                    let there = match &published {
                        Ok(_) => true,
                        Err(e) => e.code() == "ALREADY_EXISTS",
                    };
                    if let Some(then) = then.filter(|_| there) {
                        then();
                    }
                    published.map_err(|e| Private::packd("publishing failed", e))
                });
                match &published {
                    Ok(_) => client.report(&Report::built(ENGINE, &identity, size as u64)),
                    Err(why) => client.give_up(&provisional, &why.to_string()),
                }
                (published, t.elapsed())
            })
            .map_err(|e| Private::io("cannot start publishing", e))
    }

    /// Waits for the publication [`XnnCache::finalize`] started (if any) and records its
    /// outcome: `Published`, or `Private` with the reason packd refused it (and the
    /// builder role given up).
    pub fn wait_published(&self) {
        let Some(handle) = lock(&self.state).publishing.take() else { return };
        let (result, took) = handle.join().unwrap_or_else(|_| {
            let why = Private::packd("publishing failed", Error::Protocol(packd_client::ProtocolError::Panicked));
            self.client.give_up(&self.identity, &why.to_string());
            (Err(why), Duration::ZERO)
        });
        let mut st = lock(&self.state);
        st.counters.publish_us += packd_interpose::ledger::micros(took);
        match result {
            Ok(seg) => {
                if let Shared::Done { segment, .. } = &mut st.shared {
                    *segment = Some(seg);
                }
                st.mode = XnnMode::Published;
                st.uncount = None;
            }
            // The thread gave the role up.
            Err(why) => st.go_private(why),
        }
        let undo = st.uncount.take().zip(st.private.clone().filter(|_| st.mode == XnnMode::Private));
        drop(st);
        self.send_report();
        if let Some((uncount, why)) = undo {
            uncount(why, self.stats().bytes_private);
        }
    }

    /// Counts this build in the process's status: `count` runs now, under the cache's lock,
    /// unless the cache went private already (false: it is to be counted as that). If
    /// packd refuses the publication after this, `uncount` runs then, once, with the
    /// reason and the bytes the build holds privately.
    pub(crate) fn count_built(&self, count: impl FnOnce(), uncount: Uncount) -> bool {
        let mut st = lock(&self.state);
        if st.mode == XnnMode::Private {
            return false;
        }
        count();
        if st.publishing.is_some() {
            st.uncount = Some(uncount);
        }
        true
    }

    /// Why the cache is private, typed (`None` unless it is).
    pub fn why_private(&self) -> Option<Arc<Private>> {
        let st = lock(&self.state);
        st.private.clone().filter(|_| st.mode == XnnMode::Private)
    }

    /// The counters.
    pub fn stats(&self) -> XnnStats {
        if lock(&self.state).publishing.as_ref().is_some_and(JoinHandle::is_finished) {
            self.wait_published();
        }
        let st = lock(&self.state);
        let shared_bytes = match &st.shared {
            Shared::Served { segment, .. } => segment.info().size,
            Shared::Done { segment: Some(seg), .. } => seg.info().size,
            _ => 0,
        };
        let built_private = match (&st.shared, st.mode) {
            (Shared::Building { cursor, .. }, _) => *cursor as u64,
            (Shared::Done { segment: None, .. }, XnnMode::Private) => {
                st.inserted.values().filter(|(o, _)| *o < AREA).map(|(_, l)| *l as u64).sum()
            }
            _ => 0,
        };
        let c = &st.counters;
        XnnStats {
            publish_us: c.publish_us,
            hits: c.hits,
            misses: c.misses,
            reserve_space: c.reserve_calls,
            bytes_packed: c.bytes_packed,
            bytes_private: st.private_cursor as u64 + built_private,
            bytes_shared: shared_bytes,
            unnamed: c.unnamed,
            conflicts: c.conflicts,
            deduplicated: c.deduplicated,
            reinserts: c.reinserts,
            bad_inserts: c.bad_inserts,
            aliases: c.aliases,
            mode: Some(st.mode),
            reason: st.private.as_ref().map(ToString::to_string).unwrap_or_default(),
            fallback: st.private.as_ref().filter(|_| st.mode == XnnMode::Private).map(|p| p.fallback),
        }
    }
}

/// The provider's callbacks, on this cache.
impl WeightsCache for XnnCache {
    fn look_up(&self, key: &XnnKey) -> usize {
        XnnCache::look_up(self, key)
    }

    fn reserve_space(&self, n: usize) -> usize {
        XnnCache::reserve_space(self, n)
    }

    fn look_up_or_insert(&self, key: &XnnKey, ptr: usize, size: usize) -> usize {
        XnnCache::look_up_or_insert(self, key, ptr, size)
    }

    fn offset_to_addr(&self, offset: usize) -> usize {
        XnnCache::offset_to_addr(self, offset)
    }

    fn alias_data(&self, alias: usize, original: usize) -> bool {
        XnnCache::alias_data(self, alias, original)
    }
}

impl Drop for XnnCache {
    fn drop(&mut self) {
        // A publication under way finishes (or fails) before the weights are unmapped; a
        // build never finalized gives its role up.
        self.wait_published();
        // A renamer never run still holds a thread reading the engine's tensors: it ends here.
        let renamer = lock(&self.state).renamer.take();
        if let Some(r) = renamer {
            let _ = r();
        }
        let st = lock(&self.state);
        if let Shared::Building { .. } = st.shared {
            self.client.give_up(&self.identity, "the cache was freed before it was finalized");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_are_bounded_printable_and_change_with_every_part() {
        let a = identity("b3:abc", "libXNNPACK.so@id:12", "cpu1");
        assert!(a.len() <= 256 && a.bytes().all(|b| (0x20..0x7f).contains(&b)), "{a}");
        assert_ne!(a, identity("b3:abd", "libXNNPACK.so@id:12", "cpu1"));
        assert_ne!(a, identity("b3:abc", "libXNNPACK.so@id:13", "cpu1"));
        assert_ne!(a, identity("b3:abc", "libXNNPACK.so@id:12", "cpu2"));
        let long = identity(&"m".repeat(1000), "e;x", "c");
        assert!(long.len() <= 256, "{long}");
    }
}
