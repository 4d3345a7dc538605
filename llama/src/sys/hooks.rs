//! The hooks. `ggml_backend_buft_alloc_buffer` is replaced in the GOT slots of the objects
//! that call it; for a buffer of the type named `CPU_REPACK` (llama.cpp's repacked weights)
//! the real function allocates it as ever, then the buffer's memory is swapped for an
//! address-space reservation of packd's and four entries of its function table for
//! packd's: `init_tensor` (records the layout, then repack's own), `set_tensor` (on the
//! first call asks packd, then maps the published copy — nothing repacked — or repacks with
//! ggml's own code into private memory), `clear`, `memset_tensor` and `free_buffer`.
//!
//! A builder repacks straight into a memfd mapped over the buffer (its pages allocated at
//! once), telling packd how far it has come. Once every tensor recorded was set, the
//! mapping is replaced by a read-only one of the same pages, the memfd is sealed and a
//! thread publishes it: the segment packd serves is the memfd the builder wrote, with no
//! copy, and the thread does no work of its own (packd hashes the segment).
//!
//! Everything dereferenced is a structure ggml handed to the hook (a buffer this module
//! swapped, a tensor in it), laid out as `crate::ggml` declares for the ggml version
//! `crate::enable` found in its table before any slot was written.

use std::collections::{HashMap, HashSet};
use std::ffi::{CStr, c_char, c_void};
use std::fs::File;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

use packd_client::{Client, PublishEntry, Segment};
use packd_interpose::maps::at as mapping_at;
use packd_interpose::memo::mapped_file_digest;
use packd_interpose::say;
use packd_interpose::sys::{Reservation, allocate_alongside, memfd, page, reopen_read_only, seal};

use crate::ggml::{
    Buffer, BufferIface, BufferIface09, BufferPtr, BufferTypePtr, BuftDeviceFn, DevRegFn, Fns, Iface, Layout, MAX_NAME,
    NbytesFn, ProcAddressFn, TensorPtr, TypeNameFn,
};
use crate::store::{self, Decision, Engine, TensorInfo, micros, note_private};
use packd_client::Fallback;

/// `ggml_backend_buft_alloc_buffer`.
pub(crate) type AllocFn = unsafe extern "C" fn(BufferTypePtr, usize) -> BufferPtr;
/// `ggml_backend_buft_name`.
pub(crate) type NameFn = unsafe extern "C" fn(BufferTypePtr) -> *const c_char;

/// ggml's functions packd calls and what the identity needs of the build, set once (for a
/// supported ggml) before any slot points at a hook.
pub(crate) struct Reals {
    pub buft_name: NameFn,
    pub nbytes: NbytesFn,
    pub type_name: TypeNameFn,
    /// `ggml_backend_buft_get_device`, `ggml_backend_dev_backend_reg` and
    /// `ggml_backend_reg_get_proc_address` (to tell the extra buffer types, `sys::unshared`).
    pub devices: Option<(BuftDeviceFn, DevRegFn, ProcAddressFn)>,
    /// The running version's buffer layout.
    pub layout: Layout,
    pub engine: Engine,
}

pub(crate) static REALS: OnceLock<Reals> = OnceLock::new();

/// The key of the one entry a published buffer has.
const ENTRY: &str = "CPU_REPACK";

/// A `CPU_REPACK` buffer packd looks after.
struct Repack {
    res: Arc<Reservation>,
    /// The buffer's size, and the reservation's length (page-rounded).
    size: usize,
    len: usize,
    /// The buffer's function table and memory as ggml made them.
    orig: Fns,
    orig_context: usize,
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
    /// Repacked and published (or being published).
    Published,
    /// Repacking privately.
    Private,
}

struct Inner {
    tensors: Vec<TensorInfo>,
    /// Tensor address → index in `tensors`.
    index: HashMap<usize, usize>,
    /// Tensors set so far.
    set: HashSet<usize>,
    phase: Phase,
    client: Option<Client>,
    identity: String,
    /// Keeps the served segment's lease.
    segment: Option<Segment>,
    /// The memfd a build writes (mapped writable over the buffer until it is complete).
    build: Option<File>,
    /// Bytes of whole tensors the build has written, and what the last progress report told.
    built_bytes: u64,
    told_bytes: u64,
    publishing: Option<JoinHandle<Option<Segment>>>,
    started: Option<Instant>,
    /// The model file the identity's digest covers: its mapping's range (where the first
    /// tensor came from), and its device and inode.
    source: Option<Source>,
    /// A tensor came from another file (a split GGUF): the build is not published, since
    /// the identity covers only the first file.
    mixed: bool,
}

/// The file the repacked tensors come from.
struct Source {
    lo: usize,
    hi: usize,
    file: ((u64, u64), u64),
}

impl Source {
    fn at(addr: usize) -> Option<Self> {
        mapping_at(addr).map(|m| Source { lo: m.lo, hi: m.hi, file: (m.dev, m.inode) })
    }

    /// Whether `[addr, addr + len)` lies in this file: within its mapping (no system call),
    /// or in another mapping of the same device and inode.
    fn holds(&self, addr: usize, len: usize) -> bool {
        if addr >= self.lo && addr.saturating_add(len) <= self.hi {
            return true;
        }
        Source::at(addr).is_some_and(|m| m.file == self.file && addr.saturating_add(len) <= m.hi)
    }
}

static BUFFERS: OnceLock<Mutex<HashMap<usize, Arc<Repack>>>> = OnceLock::new();

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn buffers() -> MutexGuard<'static, HashMap<usize, Arc<Repack>>> {
    lock(BUFFERS.get_or_init(Mutex::default))
}

fn repack_of(buffer: BufferPtr) -> Option<Arc<Repack>> {
    buffers().get(&(buffer as usize)).cloned()
}

/// Ends the process with a message: ggml asked something of a served buffer that cannot be
/// answered without giving it wrong weights (never seen with the supported llama.cpp).
fn fatal(what: &str) -> ! {
    say!("packd-llama: {what}; stopping rather than computing with wrong weights");
    std::process::abort();
}

/// ggml's own `ggml_backend_buft_alloc_buffer`, found whether or not packd acts (the
/// interposed definition below must forward every call).
pub(crate) static REAL_ALLOC: OnceLock<AllocFn> = OnceLock::new();

/// The address of [`ggml_backend_buft_alloc_buffer`], for the GOT slots.
pub(crate) fn alloc_hook_address() -> usize {
    ggml_backend_buft_alloc_buffer as AllocFn as usize
}

/// `ggml_backend_buft_alloc_buffer` as the hooked objects call it. Exported under ggml's
/// name, so that with `LD_PRELOAD` a llama.cpp loaded later (`dlopen`, as Python's ctypes
/// loads it, even `RTLD_LOCAL`) binds its calls here too; GOT slots of objects loaded before
/// are rewritten to it by `crate::enable`. Without a supported ggml it only forwards.
///
/// # Safety
/// As ggml's function: `buft` is a live buffer type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ggml_backend_buft_alloc_buffer(buft: BufferTypePtr, size: usize) -> BufferPtr {
    let real = match REAL_ALLOC.get() {
        Some(f) => *f,
        None => {
            // The first call of a llama.cpp loaded after start: find it now.
            crate::on_first_call();
            *REAL_ALLOC.get().unwrap_or_else(|| fatal("cannot find ggml's own ggml_backend_buft_alloc_buffer"))
        }
    };
    // SAFETY: ggml's function with the caller's own arguments.
    let buffer = unsafe { real(buft, size) };
    if REALS.get().is_none() && crate::waits_for_cpu_backend() {
        // The release layout: the CPU backend may have been loaded since the last scan.
        crate::on_first_call();
    }
    let Some(reals) = REALS.get() else { return buffer }; // not acting: as without packd
    if buffer.is_null() || size < page() {
        return buffer; // the 0-byte probes llama.cpp makes, and failures, pass through
    }
    // SAFETY: ggml_backend_buft_name takes any buffer type and returns a static string.
    let name = unsafe { (reals.buft_name)(buft) };
    if name.is_null() {
        return buffer;
    }
    // SAFETY: a NUL-terminated string ggml owns for the buffer type's lifetime.
    let name = unsafe { CStr::from_ptr(name) };
    if name.to_bytes() != b"CPU_REPACK" {
        let ggml = super::unshared::Ggml {
            layout: reals.layout,
            devices: reals.devices,
            nbytes: reals.nbytes,
            type_name: reals.type_name,
        };
        // SAFETY: the live buffer just allocated for `buft`, laid out as the running
        // version's table entry says, not yet seen by our caller; ggml's own functions.
        unsafe { super::unshared::watch(&ggml, buffer, buft, &name.to_string_lossy(), size) };
        return buffer;
    }
    store::status().buffers += 1;
    // SAFETY: `buffer` is the live buffer just allocated, owned by our caller, which has
    // not seen it yet: nothing else reads or writes it meanwhile; laid out as the running
    // version's table entry says (checked before REALS was set).
    let adopted = unsafe {
        match reals.layout {
            Layout::Ggml09 => adopt::<BufferIface09>(buffer, buft, size),
            Layout::Ggml013 => adopt::<BufferIface>(buffer, buft, size),
        }
    };
    if let Err(reason) = adopted {
        note_private(Fallback::UnknownInterface, &reason.to_string(), size, "", None);
    }
    buffer
}

/// Why a `CPU_REPACK` buffer is left to ggml.
#[derive(Debug, thiserror::Error)]
enum AdoptError {
    #[error("the CPU_REPACK buffer lacks a function packd needs (another ggml build?)")]
    MissingFunction,
    #[error("the CPU_REPACK buffer has a 2-D copy packd does not take over (another ggml build?)")]
    OtherWriter,
    #[error("the CPU_REPACK buffer is not laid out as this ggml version's CPU buffer")]
    Layout,
    #[error("cannot reserve {len} bytes of address space: {source}")]
    Reserve { len: usize, source: std::io::Error },
}

/// Why a published segment cannot be mapped over a buffer.
#[derive(Debug, thiserror::Error)]
enum ServeError {
    #[error("cannot stat the published segment: {0}")]
    Stat(std::io::Error),
    #[error("the published segment is {segment} bytes, the buffer {buffer} (not the same build)")]
    Size { segment: u64, buffer: usize },
    #[error("cannot map the published segment: {0}")]
    Map(std::io::Error),
}

/// Puts packd's memory and functions in a fresh `CPU_REPACK` buffer, whose function table
/// is an `I`.
///
/// # Safety
/// `buffer` must be the live buffer ggml just allocated for `buft`, a `Buffer<I>`, seen by
/// nobody else yet.
unsafe fn adopt<I: Iface>(buffer: BufferPtr, buft: BufferTypePtr, size: usize) -> Result<(), AdoptError> {
    let typed = buffer as *mut Buffer<I>;
    // SAFETY: the caller's promise: a live Buffer<I>, ours alone for now (read by value).
    let iface = unsafe { (*typed).iface }.fns();
    let (Some(get_base), Some(_), Some(_), Some(_)) =
        (iface.get_base, iface.init_tensor, iface.set_tensor, iface.free_buffer)
    else {
        return Err(AdoptError::MissingFunction);
    };
    // SAFETY: as above (read by value).
    if unsafe { (*typed).iface }.other_writer() {
        return Err(AdoptError::OtherWriter);
    }
    // SAFETY: the buffer's own get_base on the buffer (no reference into it is held).
    let base = unsafe { get_base(buffer) } as usize;
    // SAFETY: the caller's promise: a live Buffer<I>, ours alone for now; the only reference.
    let b = unsafe { &mut *typed };
    if b.buft != buft || b.size != size || base != b.context as usize {
        return Err(AdoptError::Layout);
    }
    let len = size.next_multiple_of(page());
    let res = Reservation::new(len).map_err(|source| AdoptError::Reserve { len, source })?;
    let repack = Arc::new(Repack {
        res: Arc::new(res),
        size,
        len,
        orig: iface,
        orig_context: b.context as usize,
        inner: Mutex::new(Inner {
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
        }),
    });
    b.context = repack.res.base() as *mut c_void;
    b.iface.set_fns(&Fns {
        init_tensor: Some(init_hook),
        set_tensor: Some(set_hook),
        memset_tensor: Some(memset_hook),
        clear: Some(clear_hook),
        free_buffer: Some(free_hook::<I>),
        ..iface
    });
    buffers().insert(buffer as usize, repack);
    Ok(())
}

/// Reads what the layout needs of a tensor.
///
/// # Safety
/// `tensor` must be a live tensor ggml passed to a hook.
unsafe fn tensor_info(tensor: TensorPtr, base: usize) -> TensorInfo {
    // SAFETY: the caller's promise.
    let t = unsafe { &*tensor };
    let name = &t.name[..t.name.iter().position(|&c| c == 0).unwrap_or(MAX_NAME)];
    let nbytes = REALS.get().map_or(0, |r| {
        // SAFETY: ggml_nbytes reads the live tensor's type, shape and strides.
        unsafe { (r.nbytes)(tensor) }
    });
    TensorInfo {
        name: String::from_utf8_lossy(name).into_owned(),
        type_: t.type_,
        ne: t.ne,
        nb: t.nb,
        offset: (t.data as usize).wrapping_sub(base),
        nbytes,
    }
}

unsafe extern "C" fn init_hook(buffer: BufferPtr, tensor: TensorPtr) -> i32 {
    let Some(rp) = repack_of(buffer) else { fatal("init_tensor on a buffer packd does not know") };
    {
        let mut st = lock(&rp.inner);
        // SAFETY: a live tensor ggml is placing in this buffer.
        let info = unsafe { tensor_info(tensor, rp.res.base()) };
        // SAFETY: as above; view_src is a plain field.
        let is_view = !unsafe { &*tensor }.view_src.is_null();
        if st.phase != Phase::Pending && !is_view {
            // A tensor placed after the buffer was decided: the served copy would not hold it.
            if st.phase == Phase::Served {
                fatal(&format!("tensor {} was placed in a served CPU_REPACK buffer", info.name));
            }
        } else if !is_view && info.offset.checked_add(info.nbytes).is_some_and(|e| e <= rp.size) {
            let i = st.tensors.len();
            st.index.insert(tensor as usize, i);
            st.tensors.push(info);
        }
    }
    let init = rp.orig.init_tensor.unwrap_or_else(|| fatal("the buffer lost its init_tensor"));
    // SAFETY: repack's own init_tensor with ggml's arguments.
    unsafe { init(buffer, tensor) }
}

/// Backs the whole buffer with private memory (a build, or a private repack).
fn commit(rp: &Repack) {
    // SAFETY: the reservation is not backed yet (Pending): no reference into it exists.
    if let Err(e) = unsafe { rp.res.commit(0, rp.len) } {
        fatal(&format!("cannot back the {} bytes of repacked weights: {e}", rp.len));
    }
}

/// Decides a pending buffer on its first write; `src` is where the bytes come from.
fn decide(rp: &Repack, st: &mut Inner, src: usize) {
    let reals = REALS.get().unwrap_or_else(|| fatal("no ggml functions"));
    let connected = Client::connect_default();
    count_types(reals, &st.tensors);
    let t0 = Instant::now();
    let model = mapped_file_digest(src, connected.as_ref().ok(), rp.len as u64);
    let hashed = t0.elapsed();
    let model = match model {
        Ok(m) => {
            let mut s = store::status();
            s.hash_us += micros(hashed);
            if m.from_daemon {
                s.models_from_daemon += 1;
            } else if m.remembered {
                s.models_remembered += 1;
            } else {
                s.models_hashed += 1;
            }
            m.name
        }
        Err(why) => {
            // Told to packd whenever it is up: the worker shows as private while it runs.
            let reason = format!("the weights do not come from a mapped model file ({why}; use_mmap off?)");
            return go_private(rp, st, Fallback::UnnamedWeights, &reason, connected.ok());
        }
    };
    st.source = Source::at(src);
    let layout = store::layout_digest(rp.size, &st.tensors);
    st.identity = store::identity(&reals.engine, &layout, &model);
    store::status().identity = Some(st.identity.clone());
    let t1 = Instant::now();
    let decision = store::acquire(connected, &st.identity, rp.len as u64);
    store::status().acquire_us += micros(t1.elapsed());
    match decision {
        Decision::Served { segment, client } => match serve(rp, &segment) {
            Ok(()) => {
                st.phase = Phase::Served;
                st.segment = Some(segment);
                store::note_shared(&st.identity, rp.size, false, Some(&client));
                st.client = Some(client);
                let mut s = store::status();
                s.served += 1;
                s.bytes_shared += rp.len as u64;
                drop(s);
                say!(
                    "packd-llama: {} tensors ({} MiB) repacked once on this host, mapped from packd: nothing repacked",
                    st.tensors.len(),
                    rp.size >> 20
                );
            }
            Err(why) => go_private(rp, st, Fallback::WorkerError, &why.to_string(), Some(client)),
        },
        Decision::Build { client, memory } => match build_memory(rp, memory) {
            Ok(file) => {
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
                let reason = format!("cannot make the shared memory to build into: {e}");
                client.give_up(&st.identity, &reason);
                go_private(rp, st, Fallback::WorkerError, &reason, Some(client));
            }
        },
        Decision::Private { fallback, reason, client } => go_private(rp, st, fallback, &reason, client),
    }
}

/// Adds the buffer's tensors to the status's count by ggml type name.
fn count_types(reals: &Reals, tensors: &[TensorInfo]) {
    let mut s = store::status();
    for t in tensors {
        // SAFETY: the type of a live tensor ggml made (so below GGML_TYPE_COUNT, which
        // ggml_type_name indexes its table with); it returns a static string.
        let name = unsafe { (reals.type_name)(t.type_) };
        let name = if name.is_null() {
            format!("type {}", t.type_)
        } else {
            // SAFETY: a NUL-terminated static string (checked for NULL).
            unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
        };
        *s.types.entry(name).or_default() += 1;
    }
}

/// Backs a pending buffer with private memory (repacked as without packd) and records why
/// it is not shared, telling packd on `client` (or the next connection) with the buffer's
/// identity, once known.
fn go_private(rp: &Repack, st: &mut Inner, fallback: Fallback, reason: &str, client: Option<Client>) {
    commit(rp);
    st.phase = Phase::Private;
    note_private(fallback, reason, rp.size, &st.identity, client.as_ref());
    st.client = client;
}

/// A memfd of the buffer's size mapped writable over the (unbacked) reservation, its pages
/// allocated: the build writes there, and it is what is published. `lent`: packd's memfd,
/// its pages allocated already, used when it has the buffer's size.
fn build_memory(rp: &Repack, lent: Option<File>) -> std::io::Result<File> {
    let lent = lent.filter(|f| f.metadata().is_ok_and(|m| m.len() == rp.len as u64));
    let (file, helper) = match lent {
        Some(file) => {
            store::status().lent_builds += 1;
            (file, None)
        }
        None => {
            let file = memfd("packd-llama")?;
            file.set_len(rp.len as u64)?;
            // The upper half allocated on a second thread while this one populates from the
            // start.
            let half = (rp.len / 2 / page() * page()) as u64;
            let helper = allocate_alongside(&file, half, rp.len as u64 - half).ok();
            (file, helper)
        }
    };
    // SAFETY: the reservation is unbacked (Pending): no reference into it exists; the memfd
    // is `len` bytes long, this process's own, and only this mapping writes it.
    let mapped = unsafe { rp.res.map_file_writable(0, rp.len, &file, 0) };
    if let Some(helper) = helper {
        let _ = helper.join();
    }
    mapped?;
    Ok(file)
}

/// Maps a published segment over the (unbacked) reservation, read-only.
fn serve(rp: &Repack, segment: &Segment) -> Result<(), ServeError> {
    let len = segment.file().metadata().map_err(ServeError::Stat)?.len();
    if len != rp.len as u64 {
        return Err(ServeError::Size { segment: len, buffer: rp.len });
    }
    // SAFETY: the reservation is unbacked (Pending): no reference into it exists; the sealed
    // memfd is `len` bytes and cannot shrink. Populated: the first prompt reads every weight
    // (as a default worker's, written at load, are mapped already).
    unsafe { rp.res.map_file_populated(0, rp.len, segment.file(), 0) }.map_err(ServeError::Map)
}

unsafe extern "C" fn set_hook(buffer: BufferPtr, tensor: TensorPtr, data: *const c_void, offset: usize, size: usize) {
    let Some(rp) = repack_of(buffer) else { fatal("set_tensor on a buffer packd does not know") };
    let mut st = lock(&rp.inner);
    if st.phase == Phase::Pending {
        decide(&rp, &mut st, data as usize);
    }
    let known = st.index.get(&(tensor as usize)).copied();
    let whole = known.is_some_and(|i| offset == 0 && size == st.tensors[i].nbytes);
    let same_file = st.source.as_ref().is_some_and(|s| s.holds(data as usize, size));
    if st.phase == Phase::Served {
        if !whole {
            fatal("a served CPU_REPACK buffer was written in part or with a tensor it does not hold");
        }
        if !same_file {
            // Builders publish only buffers whose tensors all come from the one file the
            // identity's digest covers: a served buffer cannot take a second file's tensor.
            fatal("a served CPU_REPACK buffer got a tensor from a second model file");
        }
        st.set.insert(tensor as usize);
        store::status().tensors_served += 1;
        drop_source(data as usize, size);
        return;
    }
    if st.phase == Phase::Published {
        // Its memory is read-only now (or the sealed copy): ggml's write would fault.
        fatal("a published CPU_REPACK buffer was written after its build was complete");
    }
    let set = rp.orig.set_tensor.unwrap_or_else(|| fatal("the buffer lost its set_tensor"));
    // SAFETY: repack's own set_tensor with ggml's arguments; the tensor's memory is backed
    // (committed, writable) since the phase is not Pending or Served.
    unsafe { set(buffer, tensor, data, offset, size) };
    store::status().tensors_repacked += 1;
    if st.phase != Phase::Building {
        return;
    }
    // Only pages of the model file's mapping are dropped: a tensor from anywhere else
    // (heap memory) would lose its bytes.
    if same_file {
        drop_source(data as usize, size);
    }
    st.mixed |= !same_file;
    if whole && st.set.insert(tensor as usize) {
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
/// inside the model file's mapping (`same_file` in [`set_hook`]).
fn drop_source(src: usize, len: usize) {
    if std::env::var_os("PACKD_LLAMA_DROP_SOURCE").is_some_and(|v| v == "0" || v == "off") {
        return;
    }
    let p = page();
    let (lo, hi) = (src.next_multiple_of(p), (src + len) / p * p);
    if hi <= lo {
        return;
    }
    // SAFETY: MADV_DONTNEED on whole pages of the model file's shared, read-only mapping
    // (the tensor's source, which ggml reads no more: its repacked copy is used): they are
    // dropped from this process and read again from the file if touched.
    if unsafe { libc::madvise(lo as *mut c_void, hi - lo, libc::MADV_DONTNEED) } == 0 {
        store::status().source_bytes_dropped += (hi - lo) as u64;
    }
}

/// Every tensor is repacked: makes the build read-only, seals it and publishes it on a
/// thread (which only waits for packd's answer).
fn finish_build(rp: &Arc<Repack>, st: &mut Inner) {
    if let Some(t) = st.started {
        store::status().repack_us += micros(t.elapsed());
    }
    let Some(file) = st.build.take() else { fatal("a build without its memory") };
    let t = Instant::now();
    // The same pages, read-only from now on: ggml writes no weights after loading them.
    let sealed = reopen_read_only(&file).and_then(|ro| {
        // SAFETY: the build is complete; the read-only mapping of the same memfd shows the
        // same bytes at the same addresses; the memfd is `len` bytes long and this process
        // alone can change its size (until it is sealed, just below).
        unsafe { rp.res.map_file_populated(0, rp.len, &ro, 0) }?;
        seal(&file)
    });
    store::status().publish_us += micros(t.elapsed());
    if st.mixed || sealed.is_err() {
        // A split GGUF: the identity names only its first file, so a later worker whose
        // other files differ would be served wrong weights. Keep this copy private (the
        // memfd's pages are this process's own; the mapping keeps them).
        st.phase = Phase::Private;
        let reason = match sealed {
            Err(e) => format!("cannot seal the build: {e}"),
            Ok(()) => "the repacked tensors come from more than one model file (a split GGUF): not shared".into(),
        };
        if let Some(c) = &st.client {
            c.give_up(&st.identity, &reason);
        }
        let fallback = if st.mixed { Fallback::Other } else { Fallback::WorkerError };
        note_private(fallback, &reason, rp.size, &st.identity, st.client.as_ref());
        return;
    }
    st.phase = Phase::Published;
    let Some(client) = st.client.clone() else { return };
    let (len, size, identity) = (rp.len, rp.size, st.identity.clone());
    let spawned = std::thread::Builder::new().name("packd-llama-publish".into()).spawn(move || {
        let t = Instant::now();
        let entries = [PublishEntry { key: ENTRY.into(), offset: 0, length: size as u64 }];
        let published = client.publish(&identity, &file, len as u64, &entries);
        store::status().publish_us += micros(t.elapsed());
        // Counted and reported as soon as packd serves it: a long-lived worker shows as
        // the builder all its life.
        match published {
            Ok(segment) => {
                store::note_shared(&identity, size, true, Some(&client));
                let mut s = store::status();
                s.published += 1;
                s.bytes_shared += len as u64;
                Some(segment)
            }
            Err(e) => {
                let reason = format!("publishing failed: {e}");
                client.give_up(&identity, &reason);
                note_private(e.fallback(), &reason, size, &identity, Some(&client));
                None
            }
        }
    });
    match spawned {
        Ok(h) => st.publishing = Some(h),
        Err(e) => {
            st.phase = Phase::Private;
            let reason = format!("cannot start publishing: {e}");
            if let Some(c) = &st.client {
                c.give_up(&st.identity, &reason);
            }
            note_private(Fallback::WorkerError, &reason, size, &st.identity, st.client.as_ref());
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

unsafe extern "C" fn memset_hook(buffer: BufferPtr, tensor: TensorPtr, value: u8, offset: usize, size: usize) {
    let Some(rp) = repack_of(buffer) else { fatal("memset_tensor on a buffer packd does not know") };
    let mut st = lock(&rp.inner);
    match st.phase {
        Phase::Pending => {
            commit(&rp);
            st.phase = Phase::Private;
            note_private(Fallback::Other, "a weight was written before it was loaded", rp.size, "", None);
        }
        Phase::Served | Phase::Published => fatal("memset_tensor on repacked weights that are shared"),
        Phase::Building | Phase::Private => {}
    }
    let f = rp.orig.memset_tensor.unwrap_or_else(|| fatal("the buffer has no memset_tensor"));
    // SAFETY: the CPU buffer's memset_tensor with ggml's arguments, on backed memory.
    unsafe { f(buffer, tensor, value, offset, size) };
}

unsafe extern "C" fn clear_hook(buffer: BufferPtr, value: u8) {
    let Some(rp) = repack_of(buffer) else { fatal("clear on a buffer packd does not know") };
    let st = lock(&rp.inner);
    match st.phase {
        // Not backed yet: it reads as zeros once backed, or is replaced by the served copy.
        Phase::Pending if value == 0 => {}
        Phase::Building | Phase::Private => {
            // SAFETY: the buffer's own memory, backed and writable in these phases; `size`
            // bytes from the reservation's start.
            unsafe { std::ptr::write_bytes(rp.res.base() as *mut u8, value, rp.size) };
        }
        _ => fatal("clear on repacked weights that are shared or not loaded"),
    }
}

unsafe extern "C" fn free_hook<I: Iface>(buffer: BufferPtr) {
    let Some(rp) = buffers().remove(&(buffer as usize)) else { fatal("free on a buffer packd does not know") };
    {
        let mut st = lock(&rp.inner);
        wait_published(&mut st);
        if st.phase == Phase::Building
            && let Some(c) = &st.client
        {
            c.give_up(&st.identity, "the model was freed before every weight was loaded");
        }
    }
    // SAFETY: `buffer` is the live Buffer<I> ggml frees now (`adopt::<I>` put this hook in
    // it); it gets back the memory and the free function ggml gave it, and frees as ggml
    // would.
    unsafe {
        let b = &mut *(buffer as *mut Buffer<I>);
        b.context = rp.orig_context as *mut c_void;
        let mut fns = b.iface.fns();
        fns.free_buffer = rp.orig.free_buffer;
        b.iface.set_fns(&fns);
        if let Some(f) = rp.orig.free_buffer {
            f(buffer);
        }
    }
    // `rp` drops here: the reservation is unmapped; ggml holds no pointer into it any more.
}
