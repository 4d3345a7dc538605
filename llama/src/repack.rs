//! What packd does with each `CPU_REPACK` buffer: the handler the hooks ask
//! (`sys::handler::Handler`, through `crate::adapter`).
//!
//! On a buffer's first write it is decided: the model file's digest (the memo, packd, or
//! hashed here), the identity, and packd's answer: **served** (packd's segment mapped under
//! the buffer: nothing is repacked), **built** (ggml repacks straight into a memfd mapped
//! under the buffer, its pages allocated at once, telling packd how far it has come; once
//! every tensor recorded was set a thread maps the same pages read-only, seals the memfd
//! and publishes it, while ggml goes on: the segment packd serves is the memfd the builder
//! wrote, with no copy) or **private** (ggml repacks into private memory, as without packd; the reason is
//! counted and told).

#![forbid(unsafe_code)]

use std::any::Any;
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

use packd_client::{Client, Fallback, PublishEntry, Segment};
use packd_interpose::ledger::{Mapped, Private, Publication, Renaming, Sealing, digest_beside, micros};
use packd_interpose::memo::{ModelName, PendingDigest, name_mapped_file};
use packd_interpose::say;
use packd_interpose::sys::memfd;

use crate::key::{self, Decision};
use crate::status::JOURNAL;
use crate::sys::buffer::{Backing, BackingError, ModelFile};
use crate::sys::handler::{AdoptError, BufferId, TensorId, TensorInfo, Write};
use crate::sys::hooks::{fatal, type_name};

/// The key of the one entry a published buffer has.
const ENTRY: &str = "CPU_REPACK";

/// A `CPU_REPACK` buffer packd looks after.
struct Repack {
    backing: Arc<Backing>,
    /// The buffer's size, and the memory's length (page-rounded).
    size: usize,
    len: usize,
    inner: Mutex<Inner>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Phase {
    /// Tensors are being placed; the memory is not backed yet.
    Pending,
    /// Mapped from packd: nothing is repacked.
    Served,
    /// Repacking, to publish.
    Building,
    /// Repacked and handed to the publication's thread, which seals and publishes it (if
    /// sealing or publishing fails, the thread gives the role up and counts it private).
    Published,
    /// Repacking privately.
    Private,
}

struct Inner {
    tensors: Vec<TensorInfo>,
    /// Tensor address → index in `tensors`.
    index: HashMap<TensorId, usize>,
    /// Tensors set so far.
    set: HashSet<TensorId>,
    phase: Phase,
    client: Option<Client>,
    identity: String,
    /// Keeps the served segment's lease.
    segment: Option<Segment>,
    /// The memfd a build writes (mapped writable under the buffer until it is complete).
    build: Option<File>,
    /// Bytes of whole tensors the build has written, and what the last progress report told.
    built_bytes: u64,
    told_bytes: u64,
    publishing: Option<JoinHandle<Option<Segment>>>,
    started: Option<Instant>,
    /// The model file the identity's digest covers (the mapping the first tensor came from).
    source: Option<ModelFile>,
    /// A tensor came from another file (a split GGUF): the build is not published, since
    /// the identity covers only the first file.
    mixed: bool,
    /// Decided under the model file's provisional name: its digest, being computed beside
    /// the build, and the layout digest the final identity is made with.
    renaming: Option<(PendingDigest, String)>,
}

static BUFFERS: OnceLock<Mutex<HashMap<BufferId, Arc<Repack>>>> = OnceLock::new();

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn buffers() -> MutexGuard<'static, HashMap<BufferId, Arc<Repack>>> {
    lock(BUFFERS.get_or_init(Mutex::default))
}

fn repack_of(buffer: BufferId, what: &str) -> Arc<Repack> {
    buffers().get(&buffer).cloned().unwrap_or_else(|| fatal(&format!("{what} on a buffer packd does not know")))
}

/// A `CPU_REPACK` buffer now has packd's memory under it.
pub(crate) fn adopted(buffer: BufferId, backing: Arc<Backing>, size: usize) {
    JOURNAL.lock().buffers += 1;
    let len = backing.len();
    let inner = Mutex::new(Inner {
        tensors: Vec::new(),
        index: HashMap::new(),
        set: HashSet::new(),
        phase: Phase::Pending,
        client: None,
        identity: String::new(),
        segment: None,
        build: None,
        built_bytes: 0,
        told_bytes: 0,
        publishing: None,
        started: None,
        source: None,
        mixed: false,
        renaming: None,
    });
    buffers().insert(buffer, Arc::new(Repack { backing, size, len, inner }));
}

/// A `CPU_REPACK` buffer left to ggml.
pub(crate) fn not_adopted(size: usize, why: AdoptError) {
    JOURNAL.lock().buffers += 1;
    note_private(&Private::adapter(Fallback::UnknownInterface, why), size, "");
}

/// ggml placed a tensor: recorded while the buffer is pending (views are not).
pub(crate) fn placed(buffer: BufferId, tensor: TensorId, info: TensorInfo, view: bool) {
    let rp = repack_of(buffer, "init_tensor");
    let mut st = lock(&rp.inner);
    if st.phase != Phase::Pending && !view {
        // A tensor placed after the buffer was decided: the served copy would not hold it.
        if st.phase == Phase::Served {
            fatal(&format!("tensor {} was placed in a served CPU_REPACK buffer", info.name));
        }
    } else if !view && info.offset.checked_add(info.nbytes).is_some_and(|e| e <= rp.size) {
        let i = st.tensors.len();
        st.index.insert(tensor, i);
        st.tensors.push(info);
    }
}

/// ggml writes a tensor: decides the buffer on its first write, then maps (served) or
/// lets ggml repack (`repack`) into the build or private memory.
pub(crate) fn set(buffer: BufferId, write: Write, repack: &mut dyn FnMut()) {
    let Write { tensor, data, offset, size } = write;
    let rp = repack_of(buffer, "set_tensor");
    let mut st = lock(&rp.inner);
    if st.phase == Phase::Pending {
        decide(&rp, &mut st, data);
    }
    let known = st.index.get(&tensor).copied();
    let whole = known.is_some_and(|i| offset == 0 && size == st.tensors[i].nbytes);
    let same_file = st.source.as_ref().is_some_and(|s| s.holds(data, size));
    if st.phase == Phase::Served {
        if !whole {
            fatal("a served CPU_REPACK buffer was written in part or with a tensor it does not hold");
        }
        if !same_file {
            // Builders publish only buffers whose tensors all come from the one file the
            // identity's digest covers: a served buffer cannot take a second file's tensor.
            fatal("a served CPU_REPACK buffer got a tensor from a second model file");
        }
        st.set.insert(tensor);
        JOURNAL.lock().tensors_served += 1;
        drop_source(st.source.as_ref(), data, size);
        return;
    }
    if st.phase == Phase::Published {
        // Its memory is (or is being made) read-only, and shared: stopped before writing.
        fatal("a published CPU_REPACK buffer was written after its build was complete");
    }
    // Backed writable (committed, or the build's memfd) since the phase is neither Pending
    // nor Served (the hook checks it: a split GGUF's complete build is read-only while the
    // phase is Private, and a write would stop the process).
    repack();
    JOURNAL.lock().tensors_repacked += 1;
    if st.phase != Phase::Building {
        return;
    }
    // Only pages of the model file's mapping are dropped: a tensor from anywhere else
    // (heap memory) would lose its bytes.
    if same_file {
        drop_source(st.source.as_ref(), data, size);
    }
    st.mixed |= !same_file;
    if whole && st.set.insert(tensor) {
        if st.set.len() == 1 {
            // Held before any progress is told: waiters have only the host's past builds
            // to judge it by.
            hold_build();
        }
        st.built_bytes += size as u64;
        tell_progress(&rp, &mut st);
    }
    if st.set.len() == st.tensors.len() {
        finish_build(&rp, &mut st);
    }
}

/// ggml's `memset_tensor`: a weight written before it was loaded makes a pending buffer
/// private; shared weights are never written.
pub(crate) fn memset(buffer: BufferId, memset: &mut dyn FnMut()) {
    let rp = repack_of(buffer, "memset_tensor");
    let mut st = lock(&rp.inner);
    match st.phase {
        Phase::Pending => {
            commit(&rp);
            st.phase = Phase::Private;
            note_private(&Private::said(Fallback::Other, "a weight was written before it was loaded"), rp.size, "");
        }
        Phase::Served | Phase::Published => fatal("memset_tensor on repacked weights that are shared"),
        Phase::Building | Phase::Private => {}
    }
    memset();
}

/// ggml's `clear`: on memory backed writable; a pending buffer cleared to zeros reads as
/// zeros once backed (or is replaced by the served copy).
pub(crate) fn clear(buffer: BufferId, value: u8) {
    let rp = repack_of(buffer, "clear");
    let st = lock(&rp.inner);
    match st.phase {
        Phase::Pending if value == 0 => {}
        Phase::Building | Phase::Private => {
            if !rp.backing.fill(value, rp.size) {
                fatal("clear on memory packd has not backed");
            }
        }
        _ => fatal("clear on repacked weights that are shared or not loaded"),
    }
}

/// ggml frees the buffer: its publication (if one runs) ends first; a build not complete
/// gives its role up. Returns the buffer's state, to drop after ggml's own free.
pub(crate) fn freed(buffer: BufferId) -> Option<Box<dyn Any>> {
    let rp = buffers().remove(&buffer).unwrap_or_else(|| fatal("free on a buffer packd does not know"));
    {
        let mut st = lock(&rp.inner);
        wait_published(&mut st);
        if st.phase == Phase::Building
            && let Some(c) = &st.client
        {
            c.give_up(&st.identity, "the model was freed before every weight was loaded");
        }
    }
    Some(Box::new(rp))
}

/// Backs the whole buffer with private memory (a private repack).
fn commit(rp: &Repack) {
    if let Err(e) = rp.backing.commit() {
        fatal(&format!("cannot back the {} bytes of repacked weights: {e}", rp.len));
    }
}

/// Decides a pending buffer on its first write; `src` is where the bytes come from.
fn decide(rp: &Repack, st: &mut Inner, src: usize) {
    let Some(engine) = key::ENGINE.get() else { fatal("a buffer before ggml's build was known") };
    let connected = Client::connect_default();
    count_types(&st.tensors);
    let t0 = Instant::now();
    let named = name_mapped_file(src, connected.as_ref().ok(), rp.len as u64);
    let hashed = t0.elapsed();
    let mut provisional = None;
    let model = match named {
        Ok(ModelName::Known(m)) => {
            let mut s = JOURNAL.lock();
            s.hash_us += micros(hashed);
            m.iter().for_each(|m| count_digest(&mut s, m));
            m.into_iter().next().map(|m| m.name).unwrap_or_default()
        }
        Ok(ModelName::Provisional(p)) => {
            // Built under the file's identity while its digest is computed beside the build.
            let mut s = JOURNAL.lock();
            s.hash_us += micros(hashed);
            s.models_provisional += 1;
            let name = p.name();
            provisional = Some(p);
            name
        }
        Err(e) => {
            // Told to packd whenever it is up: the worker shows as private while it runs.
            let why = Private::adapter(Fallback::UnnamedWeights, NotMapped(e));
            return go_private(rp, st, why, connected.ok());
        }
    };
    st.source = ModelFile::at(src);
    let layout = key::layout_digest(rp.size, &st.tensors);
    st.identity = key::identity(engine, &layout, &model);
    let provisional = provisional.map(|p| (p, layout));
    JOURNAL.lock().identity = Some(st.identity.clone());
    let t1 = Instant::now();
    let decision = key::acquire(connected, &st.identity, rp.len as u64);
    JOURNAL.add_time(|s| &mut s.ledger.acquire_us, t1.elapsed());
    if let Decision::Served { segment, .. } = &decision {
        st.identity = packd_interpose::ledger::served_identity(segment, &st.identity);
        JOURNAL.lock().identity = Some(st.identity.clone());
    }
    match decision {
        Decision::Served { segment, client } => match rp.backing.map_served(segment.file()) {
            Ok(()) => {
                st.phase = Phase::Served;
                st.segment = Some(segment);
                JOURNAL.shared(&st.identity, Mapped::Served, rp.len as u64, &client);
                st.client = Some(client);
                say!(
                    "packd-llama: {} tensors ({} MiB) repacked once on this host, mapped from packd: nothing repacked",
                    st.tensors.len(),
                    rp.size >> 20
                );
            }
            Err(e) => go_private(rp, st, Private::adapter(Fallback::WorkerError, Unservable(e)), Some(client)),
        },
        Decision::Build { client, memory } => match build_memory(rp, memory) {
            Ok(file) => {
                match digest_beside(provisional, &client, &st.identity) {
                    Ok(renaming) => st.renaming = renaming,
                    Err(why) => return go_private(rp, st, why, Some(client)),
                }
                st.phase = Phase::Building;
                st.build = Some(file);
                st.client = Some(client);
                st.started = Some(Instant::now());
                say!(
                    "packd-llama: building the host's copy of {} repacked tensors ({} MiB) for later workers",
                    st.tensors.len(),
                    rp.size >> 20
                );
            }
            Err(e) => {
                let why = Private::adapter(Fallback::WorkerError, NoBuildMemory(e));
                client.give_up(&st.identity, &why.to_string());
                go_private(rp, st, why, Some(client));
            }
        },
        Decision::Private { why, client } => go_private(rp, st, why, client),
    }
}

/// The weights are not read from a mapped model file.
#[derive(Debug, thiserror::Error)]
#[error("the weights do not come from a mapped model file ({0}; use_mmap off?)")]
struct NotMapped(packd_interpose::memo::DigestError);

/// A published segment that cannot be mapped under the buffer.
#[derive(Debug, thiserror::Error)]
#[error("cannot map the published segment under the buffer (not the same build?): {0}")]
struct Unservable(BackingError);

/// The memory to build into could not be made.
#[derive(Debug, thiserror::Error)]
#[error("cannot make the shared memory to build into: {0}")]
struct NoBuildMemory(BackingError);

/// A complete build could not be sealed.
#[derive(Debug, thiserror::Error)]
#[error("cannot seal the build: {0}")]
struct Unsealed(BackingError);

/// Counts where a model's digest came from.
fn count_digest(s: &mut crate::status::Status, m: &packd_interpose::memo::FileDigest) {
    if m.from_daemon {
        s.models_from_daemon += 1;
    } else if m.remembered {
        s.models_remembered += 1;
    } else {
        s.models_hashed += 1;
    }
}

/// Adds the buffer's tensors to the status's count by ggml type name.
fn count_types(tensors: &[TensorInfo]) {
    let names: Vec<String> = tensors.iter().map(|t| type_name(t.type_)).collect();
    let mut s = JOURNAL.lock();
    for name in names {
        *s.types.entry(name).or_default() += 1;
    }
}

/// Backs a pending buffer with private memory (repacked as without packd) and records why
/// it is not shared, telling packd on `client` (or the next connection) with the buffer's
/// identity, once known.
fn go_private(rp: &Repack, st: &mut Inner, why: Private, client: Option<Client>) {
    commit(rp);
    st.phase = Phase::Private;
    JOURNAL.private(model_name(&st.identity), &why, rp.size as u64, client.as_ref());
    st.client = client;
}

/// Counts a buffer repacked privately (its identity not known yet), says why on stderr once
/// and tells packd, on this process's connection if it has one.
fn note_private(why: &Private, bytes: usize, identity: &str) {
    JOURNAL.private(model_name(identity), why, bytes as u64, None);
}

/// A buffer as reports name it: its identity once known.
fn model_name(identity: &str) -> &str {
    if identity.is_empty() { "llama.cpp buffer" } else { identity }
}

/// A memfd of the buffer's size mapped writable under it, its pages allocated and mapped
/// ahead of the repacking on a thread of its own: the build writes there, and it is what is
/// published. `lent`: packd's memfd, its pages allocated
/// already, used when it has the buffer's size.
fn build_memory(rp: &Repack, lent: Option<File>) -> Result<File, BackingError> {
    let lent = lent.filter(|f| f.metadata().is_ok_and(|m| m.len() == rp.len as u64));
    let file = match lent {
        Some(file) => {
            JOURNAL.lock().lent_builds += 1;
            file
        }
        None => {
            let file = memfd("packd-llama")?;
            file.set_len(rp.len as u64)?;
            file
        }
    };
    rp.backing.map_build(&file)?;
    Ok(file)
}

/// Tells packd how far the build has come: after the first tensor, then at every 1/32 of
/// the buffer (a waiter compares the pace with building itself).
fn tell_progress(rp: &Repack, st: &mut Inner) {
    let step = (rp.size as u64 / 32).max(1);
    if st.told_bytes == 0 || st.built_bytes >= st.told_bytes + step {
        if let Some(c) = &st.client {
            c.build_progress(&st.identity, st.built_bytes, rp.len as u64);
        }
        st.told_bytes = st.built_bytes;
    }
}

/// `PACKD_LLAMA_HOLD_BUILD=SECONDS` (or `=/PATH`: until that file exists): a builder waits
/// after its first tensor (for tests and demonstrations: other workers wait for it; one
/// killed meanwhile hands the role on).
fn hold_build() {
    packd_interpose::hold::hold_as("PACKD_LLAMA_HOLD_BUILD");
}

/// Drops the model file's pages a tensor was repacked from out of this process (whole pages
/// only; they stay in the page cache), unless `PACKD_LLAMA_DROP_SOURCE=0`. Only for a range
/// inside the model file (`same_file` in [`set`]).
fn drop_source(source: Option<&ModelFile>, src: usize, len: usize) {
    if std::env::var_os("PACKD_LLAMA_DROP_SOURCE").is_some_and(|v| v == "0" || v == "off") {
        return;
    }
    let Some(source) = source else { return };
    let dropped = source.drop_pages(src, len);
    if dropped > 0 {
        JOURNAL.lock().source_bytes_dropped += dropped as u64;
    }
}

/// Every tensor is repacked: makes the build read-only, seals it and publishes it on a
/// thread (which only waits for packd's answer).
fn finish_build(rp: &Repack, st: &mut Inner) {
    if let Some(t) = st.started {
        JOURNAL.add_time(|s| &mut s.repack_us, t.elapsed());
    }
    let Some(file) = st.build.take() else { fatal("a build without its memory") };
    if st.mixed {
        // A split GGUF: the identity names only its first file, so a later worker whose
        // other files differ would be served wrong weights. Keep this copy private (the
        // memfd's pages are this process's own; the mapping keeps them), read-only as a
        // published one is (rare: sealed here, on ggml's thread).
        st.phase = Phase::Private;
        let _ = rp.backing.seal_build(&file);
        let why = Private::said(
            Fallback::Other,
            "the repacked tensors come from more than one model file (a split GGUF): not shared",
        );
        if let Some(c) = &st.client {
            c.give_up(&st.identity, &why.to_string());
        }
        JOURNAL.private(&st.identity, &why, rp.size as u64, st.client.as_ref());
        return;
    }
    // ggml writes no weights after loading them: a write through ggml's tensor calls now
    // stops the process, and any write faults once the thread below has remapped the page.
    st.phase = Phase::Published;
    let Some(client) = st.client.clone() else { return };
    let entries = vec![PublishEntry { key: ENTRY.into(), offset: 0, length: rp.size as u64 }];
    let (len, bytes, identity) = (rp.len as u64, rp.size as u64, st.identity.clone());
    let renaming = st.renaming.take().map(|(digest, layout)| {
        let Some(engine) = key::ENGINE.get().cloned() else { fatal("a build without ggml's build known") };
        let identity_of = Box::new(move |digests: &[packd_interpose::memo::FileDigest]| {
            let model = digests.first().map_or("", |d| d.name.as_str());
            let identity = key::identity(&engine, &layout, model);
            let mut s = JOURNAL.lock();
            digests.iter().for_each(|d| count_digest(&mut s, d));
            s.identity = Some(identity.clone());
            identity
        });
        Renaming { digest, identity_of }
    });
    // Sealed on the publication's thread: remapping hundreds of MiB read-only and mapping
    // their pages again took about 50 ms of the builder's load; there it overlaps the
    // first prompt.
    let backing = Arc::clone(&rp.backing);
    let sealing: Sealing = Box::new(move |file: &File| {
        backing.seal_build(file).map_err(|e| Private::adapter(Fallback::WorkerError, Unsealed(e)))
    });
    let publication = Publication { client, identity, file, len, entries, bytes, renaming, sealing: Some(sealing) };
    // Counted and reported as soon as packd serves it: a long-lived worker shows as the
    // builder all its life.
    match JOURNAL.publish_aside(publication, "packd-llama-publish", |segment| segment) {
        Ok(h) => st.publishing = Some(h),
        Err(why) => {
            st.phase = Phase::Private;
            JOURNAL.private(&st.identity, &why, rp.size as u64, st.client.as_ref());
        }
    }
}

/// Waits for a buffer's publication, if one runs, and keeps its segment's lease.
fn wait_published(st: &mut Inner) {
    let Some(h) = st.publishing.take() else { return };
    if let Ok(Some(segment)) = h.join() {
        st.segment = Some(segment);
    }
}

/// Waits for every publication in progress (at exit: a worker that ends right after loading
/// still leaves its copy to the host).
pub(crate) fn wait_publications() {
    let all: Vec<Arc<Repack>> = buffers().values().cloned().collect();
    for rp in all {
        let mut st = lock(&rp.inner);
        wait_published(&mut st);
    }
}
