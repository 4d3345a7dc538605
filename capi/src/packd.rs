//! The C ABI of the client library: `libpackd_client.so` / `.a` and `include/packd.h`
//! (generated from this file by cbindgen; a test fails when the committed header is out of
//! date). It wraps [`Client`] and [`Model`]; there is no second protocol implementation.
//!
//! Conventions, stated once here and in the header:
//! - Every call that can fail returns a [`PackdStatus`]; on failure a message is kept for
//!   the calling thread until its next failing call ([`packd_last_error`]).
//! - Objects are created by packd functions and freed by packd functions
//!   ([`packd_client_free`], [`packd_model_release`]); the caller never frees anything with
//!   its own allocator. Strings and pointers in a [`PackdEntry`] live as long as its model.
//! - No panic crosses the boundary: one is caught and reported as `PACKD_STATUS_INTERNAL`.
//! - Thread safety: a client may be used from any number of threads at once (requests are
//!   pipelined on its connection, each within its deadline); a model may be read from any
//!   number of threads;
//!   freeing or releasing an object must not race with any other use of it.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::ptr;

use std::panic::{AssertUnwindSafe, catch_unwind};

use packd_client::{Client, Error, Model, Plan};

pub use crate::ffi::PackdStatus;
use crate::ffi::{ENDING, Failure, LAST_ERROR, clear_out, given, guarded, invalid, opt_str, req_str, text};

/// A connection to packd (opaque).
pub struct PackdClient {
    pub(crate) client: Client,
}

/// A mapped, read-only model (opaque). Holds a lease until released.
pub struct PackdModel {
    model: Model,
    key: CString,
    plan: CString,
    source_blake3: CString,
    entries: Vec<EntryText>,
}

/// NUL-terminated copies of an entry's strings, owned by its model.
struct EntryText {
    name: CString,
    key: CString,
    layout: CString,
    dtype: CString,
    blake3: CString,
    bias: Option<CString>,
}

/// One packed tensor of a model. Every pointer stays valid until the model is released.
#[repr(C)]
#[derive(Debug)]
pub struct PackdEntry {
    /// Tensor name in the source file.
    pub name: *const c_char,
    /// Entry key (`b3:<source>/<name>#<layout>@v<N>`).
    pub key: *const c_char,
    /// Canonical layout, e.g. `f32-gemm:nr=16,kr=1,sr=1`, or `identity`.
    pub layout: *const c_char,
    /// Source dtype (`F32`, `F16`, `BF16`, `I64`, …).
    pub dtype: *const c_char,
    /// Source shape: `ndim` values; NULL when `ndim` is 0.
    pub shape: *const u64,
    /// Number of dimensions (0 for a scalar).
    pub ndim: usize,
    /// The packed bytes, read-only shared memory.
    pub data: *const u8,
    /// Length of `data` in bytes.
    pub length: usize,
    /// BLAKE3 of the packed bytes, 64 hex digits.
    pub blake3: *const c_char,
    /// Name of the bias folded into this GEMM entry, or NULL.
    pub bias: *const c_char,
}

/// More of an entry, for an engine that must not parse keys: where its bytes lie in the
/// segment, the version of its layout's byte format, the plan and the source. Extensible:
/// the caller sets `size` to `sizeof(PackdEntryDetails)` of the header it was compiled
/// with, and the library writes only the fields that fit (later versions append fields, so
/// a program built against this header keeps working with a newer library).
#[repr(C)]
#[derive(Debug)]
pub struct PackdEntryDetails {
    /// Set by the caller: `sizeof(PackdEntryDetails)`.
    pub size: usize,
    /// Byte offset of the entry in the segment, a multiple of 64: the entry's `data` is
    /// `packd_model_data(model, NULL) + offset`.
    pub offset: u64,
    /// Version of the layout's byte format (the `@vN` of the entry key; docs/LAYOUTS.md).
    pub layout_version: u32,
    /// The canonical plan the segment was packed with.
    pub plan: *const c_char,
    /// BLAKE3 of the whole source file, 64 hex digits.
    pub source_blake3: *const c_char,
}

/// Builds a plan from a layout (NULL: the default) and `nrules` rules.
///
/// # Safety
/// `layout` as [`opt_str`]; `rules` is NULL (with `nrules` 0) or points to `nrules` valid
/// C strings.
unsafe fn plan(layout: *const c_char, rules: *const *const c_char, nrules: usize) -> Result<Plan, Failure> {
    // SAFETY: forwarded from the caller.
    let mut plan = Plan::with_layout(unsafe { opt_str(layout, "layout") }?.unwrap_or(""));
    if nrules > 0 && rules.is_null() {
        return Err(invalid("rules is NULL but nrules is not 0"));
    }
    for i in 0..nrules {
        // SAFETY: the caller promises `nrules` readable pointers at `rules`.
        let rule = unsafe { *rules.add(i) };
        // SAFETY: each is a valid C string (caller's promise).
        plan = plan.rule(unsafe { req_str(rule, "a rule") }?);
    }
    Ok(plan)
}

/// Wraps a model for C and stores it in `*out`.
///
/// # Safety
/// `out` is a valid pointer to write to.
unsafe fn hand_out(model: Model, out: *mut *mut PackdModel) {
    let entries = model
        .tensors()
        .map(|t| EntryText {
            name: text(t.name()),
            key: text(t.key()),
            layout: text(t.layout()),
            dtype: text(t.dtype()),
            blake3: text(&t.entry().blake3),
            bias: t.bias().map(text),
        })
        .collect();
    let key = text(model.key());
    let (plan, source_blake3) = (text(&model.info().plan), text(&model.info().source_blake3));
    let boxed = Box::new(PackdModel { model, key, plan, source_blake3, entries });
    // SAFETY: `out` is valid for writes (checked non-NULL by the caller of this helper).
    unsafe { *out = Box::into_raw(boxed) };
}

/// The body shared by the calls that hand out a model: clears `*out`, checks `client`,
/// runs `make` and hands its model out.
///
/// # Safety
/// `client` is NULL or a live client; `out` is NULL or valid for writes.
unsafe fn produce(
    client: *const PackdClient,
    out: *mut *mut PackdModel,
    make: impl FnOnce(&Client) -> Result<Model, Failure>,
) -> PackdStatus {
    guarded(|| {
        // SAFETY: forwarded from the caller.
        unsafe { clear_out(out) }?;
        // SAFETY: forwarded from the caller.
        let c = unsafe { given(client, "client")?.as_ref() };
        let model = make(&c.client)?;
        // SAFETY: `out` was checked non-NULL by clear_out.
        unsafe { hand_out(model, out) };
        Ok(())
    })
}

/// Connects to `SOCKET_DIR/packd.sock`; `socket_dir` NULL means the default resolution
/// (`$PACKD_SOCKET_DIR`, else `/run/packd`, else `$XDG_RUNTIME_DIR/packd`), as `packctl`.
/// On success `*out` holds a client to free with [`packd_client_free`].
///
/// Returns `OK`; `INVALID_ARGUMENT` (NULL `out`, a directory that is not UTF-8); `CONNECT`
/// (no socket there, refused, or permission denied: the message says which and what to do);
/// `TIMEOUT` (connecting); `INTERNAL`.
///
/// Thread safety: safe to call from any thread.
///
/// # Safety
/// `socket_dir` is NULL or a valid C string; `out` is valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_connect(socket_dir: *const c_char, out: *mut *mut PackdClient) -> PackdStatus {
    guarded(|| {
        // SAFETY: `out` is valid for writes or NULL (caller's promise), checked here.
        unsafe { clear_out(out) }?;
        // SAFETY: `socket_dir` is NULL or a valid C string (caller's promise).
        let client = match unsafe { opt_str(socket_dir, "socket_dir") }? {
            Some(dir) => Client::connect(dir)?,
            None => Client::connect_default()?,
        };
        // SAFETY: checked non-NULL above.
        unsafe { *out = Box::into_raw(Box::new(PackdClient { client })) };
        Ok(())
    })
}

/// Frees a client. Models it handed out keep working and keep their leases: each holds the
/// connection, which closes when the client and every model from it are gone (released, or
/// the process exits); the daemon then ends their leases. Without models, the connection
/// closes now. NULL is ignored.
///
/// Thread safety: no other call may use `client` at the same time or afterwards.
///
/// # Safety
/// `client` is NULL or came from [`packd_connect`] and is not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_client_free(client: *mut PackdClient) {
    if !client.is_null() {
        // SAFETY: created by Box::into_raw in packd_connect; ownership returns here once.
        let _ = catch_unwind(AssertUnwindSafe(|| drop(unsafe { Box::from_raw(client) })));
    }
}

/// Sets how long later calls on `client` wait for the daemon, in milliseconds; 0 keeps a
/// value as it is. Defaults: connecting 5 000; `get_ms` 30 000, the longest the daemon may
/// stay silent on any call (it reports a running pack's progress every second);
/// `pack_ms` 86 400 000, a whole pack. A call that waits longer returns
/// `PACKD_STATUS_TIMEOUT` (the message says what it waited for);
/// the connection stays usable. Returns `PACKD_STATUS_INVALID_ARGUMENT` for a NULL client.
///
/// Thread safety: any number of threads may call this at once with the same client; calls
/// already waiting keep their deadline.
///
/// # Safety
/// `client` is NULL or a live client from [`packd_connect`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_client_set_timeouts(
    client: *const PackdClient,
    connect_ms: u64,
    get_ms: u64,
    pack_ms: u64,
) -> PackdStatus {
    guarded(|| {
        // SAFETY: NULL or a live client (caller's promise).
        let c = unsafe { given(client, "client")?.as_ref() };
        let mut t = c.client.timeouts();
        let set = |ms: u64, field: &mut std::time::Duration| {
            if ms > 0 {
                *field = std::time::Duration::from_millis(ms);
            }
        };
        set(connect_ms, &mut t.connect);
        set(get_ms, &mut t.get);
        set(pack_ms, &mut t.pack);
        c.client.set_timeouts(t);
        Ok(())
    })
}

/// How a worker obtained a model's weights, for [`packd_report`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackdObtained {
    /// It maps a segment packd serves.
    Served = 1,
    /// It built the weights and published them.
    Built = 2,
    /// It holds them privately (a [`PackdFallback`] says why).
    Private = 3,
}

/// Why a worker holds a model's weights privately, for [`packd_report`]; the daemon counts
/// them by these names in lowercase (`daemon_away`, ...). docs/OPERATIONS.md explains each.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackdFallback {
    /// Not private (for `SERVED` and `BUILT`).
    None = 0,
    /// Anything else (say what in `detail`).
    Other = 1,
    /// packd could not be reached when the model was loaded.
    DaemonAway = 2,
    /// The engine's interface or version is not one packd supports.
    UnknownInterface = 3,
    /// packd could not name the engine's weights.
    UnnamedWeights = 4,
    /// A quota or limit refused the publication or the lease.
    OverQuota = 5,
    /// The wait for another worker's build, or the builder's deadline, ran out.
    BuildTimeout = 6,
    /// The builder gave its role up with nothing to publish.
    BuilderGaveUp = 7,
    /// The connection or uid held as many builder roles as the limits allow.
    BuildLimit = 8,
    /// packd refused the publication.
    PublishRefused = 9,
    /// The engine brought a weights cache of its own.
    EngineCache = 10,
    /// Private mode was asked for.
    Asked = 11,
    /// An error in the worker or on the connection.
    WorkerError = 12,
    /// The build waited for would have taken longer than building privately.
    BuildSlow = 13,
    /// The engine put the weights in a buffer type packd does not share.
    UnsharedBufferType = 14,
}

/// Tells packd how this worker obtained model `model`'s weights: `obtained` is a
/// [`PackdObtained`] value; `fallback` a [`PackdFallback`] value other than NONE for
/// `PRIVATE`, and NONE (0) for `SERVED` and `BUILT`; `detail` free text (NULL: none); and
/// the bytes the worker holds privately or maps from packd. `engine` names the engine
/// ("xnnpack", "llama.cpp", your own); `model` the model, by its cache identity or segment
/// key when it has one (a PRIVATE report then counts under that model in `packctl models`
/// and the per-model metrics; SERVED and BUILT reports show with the worker in `packctl
/// clients` — a model's served workers are counted from their leases). The daemon keeps at
/// most 128 bytes of `engine` and `model` and 256 of `detail`, control characters
/// replaced. Not answered, and never waits (a report that cannot be written at once is sent
/// by the client's next call or report): the daemon counts a PRIVATE one (`private_fallbacks`
/// by reason) unless it repeats this client's previous report of the same engine and model,
/// shows them (`packctl clients`, `packctl top`) attributed to this process's pid and uid,
/// and never decides anything on them. The client keeps its latest report per engine and
/// model (64 pairs; a report of a 65th pair is sent once, not kept) and sends them again
/// after a reconnect. With `client` NULL — packd could not be reached, so there is no client
/// — the report is kept and sent by the next client of this process that connects (a client
/// connected already does not send it: pass it instead); `PACKD_STATUS_RESOURCE_EXHAUSTED`
/// when 64 reports of other engines and models wait already (this one is not kept).
/// Returns `PACKD_STATUS_INVALID_ARGUMENT` for an `obtained` or `fallback` out of range, a
/// PRIVATE report without a fallback or another with one, a NULL `engine` or `model`, or
/// text that is not UTF-8.
///
/// Thread safety: any number of threads may call this at once with the same client.
///
/// # Safety
/// `client` is NULL or a live client from [`packd_connect`]; `engine`, `model` and
/// `detail` are NULL or NUL-terminated strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_report(
    client: *const PackdClient,
    engine: *const c_char,
    model: *const c_char,
    obtained: u32,
    fallback: u32,
    detail: *const c_char,
    private_bytes: u64,
    shared_bytes: u64,
) -> PackdStatus {
    guarded(|| {
        // SAFETY: NULL or NUL-terminated strings valid for this call (caller's promise).
        let (engine, model, detail) = unsafe {
            (req_str(engine, "engine")?, req_str(model, "model")?, opt_str(detail, "detail")?.unwrap_or_default())
        };
        let fallback = i32::try_from(fallback)
            .ok()
            .and_then(|f| packd_client::Fallback::try_from(f).ok())
            .ok_or_else(|| invalid(format!("fallback {fallback} is not a PackdFallback value (0-14)")))?;
        let obtained = match obtained {
            1 | 2 if fallback != packd_client::Fallback::Unspecified => {
                return Err(invalid("only a PRIVATE report has a fallback (give PACKD_FALLBACK_NONE)"));
            }
            1 => packd_client::Obtained::Served,
            2 => packd_client::Obtained::Built,
            3 if fallback == packd_client::Fallback::Unspecified => {
                return Err(invalid("a PRIVATE report needs a fallback (PACKD_FALLBACK_OTHER and up)"));
            }
            3 => packd_client::Obtained::Private(fallback),
            n => return Err(invalid(format!("obtained {n} is not a PackdObtained value (1-3)"))),
        };
        let report = packd_client::Report {
            engine: engine.to_string(),
            model: model.to_string(),
            obtained,
            detail: detail.to_string(),
            private_bytes,
            shared_bytes,
        };
        // SAFETY: NULL or a live client (caller's promise).
        match unsafe { client.as_ref() } {
            Some(c) => c.client.report(&report),
            None if packd_client::report_later(&report) => {}
            None => {
                return Err(Failure(
                    PackdStatus::ResourceExhausted,
                    "64 reports made without a client wait already: this one is not kept".to_string(),
                ));
            }
        }
        Ok(())
    })
}

/// Opens `path`, sends it to the daemon, which packs it with the plan (or finds it
/// packed), and maps the result. `layout` NULL means the default GEMM layout
/// (`f32-gemm:nr=16,kr=1,sr=1`); `"identity"` keeps every tensor as is. `rules` are
/// `GLOB=LAYOUT` rules tried first (`nrules` of them; NULL if 0). On success `*out` holds a
/// model to release with [`packd_model_release`].
///
/// Returns `OK`; `INVALID_ARGUMENT` (a NULL client, path or `out`, text that is not UTF-8,
/// or the daemon's: an unknown layout, a bad rule); `OPEN` (the file cannot be opened);
/// `BAD_SOURCE`, `BAD_FD`; `RESOURCE_EXHAUSTED` (the budget, a quota); `PERMISSION_DENIED`
/// (the data plane's allow lists); `TIMEOUT`, `UNAVAILABLE`, `DISCONNECTED`, `IO`, `PROTOCOL`, `NOT_SEALED`, `FD_DROPPED`, `INTERNAL`.
///
/// Thread safety: any number of threads may call this at once with the same client.
///
/// # Safety
/// `client` is NULL or came from [`packd_connect`]; strings are NULL or valid C strings;
/// `rules` is NULL or points to `nrules` of them; `out` is NULL or valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_pack_path(
    client: *const PackdClient,
    path: *const c_char,
    layout: *const c_char,
    rules: *const *const c_char,
    nrules: usize,
    out: *mut *mut PackdModel,
) -> PackdStatus {
    let make = |c: &Client| {
        // SAFETY: `path` is NULL or a NUL-terminated string valid for this call (# Safety).
        let path = unsafe { req_str(path, "path") }?;
        // SAFETY: `layout` is NULL or a valid C string; `rules` is NULL with `nrules` 0 or
        // points to `nrules` valid C strings (# Safety).
        let plan = unsafe { plan(layout, rules, nrules) }?;
        Ok(c.pack(path, &plan)?)
    };
    // SAFETY: `client` is NULL or a live client from packd_connect; `out` is NULL or valid
    // for writes (# Safety).
    unsafe { produce(client, out, make) }
}

/// What a running pack is doing, as [`PackdProgressFn`] is told.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackdProgressStage {
    /// Accepted; not reading yet (waiting for a slot of the daemon's source pool).
    Accepted = 1,
    /// Waiting for another request's pack of the same model.
    Waiting = 2,
    /// Hashing the file (a copy of a model packed before is found by its digest).
    Hashing = 3,
    /// Reading and packing the file.
    Packing = 4,
}

/// Called with each of the daemon's progress reports on a pack: `ACCEPTED` (bytes 0 of 0)
/// at once, before any work, even for a model found packed already; then, while the pack
/// runs, at least once a second (a pack done within a second reports `ACCEPTED` only).
/// While `HASHING` or `PACKING`, `bytes_total` is the source file's size and `bytes_done`
/// grows; while `ACCEPTED` or `WAITING` both are 0. No report marks the end: the call's
/// return does. Runs on the thread that called the pack, between reads of the
/// socket: it should return quickly, and must not call into this library with the same
/// client, nor throw a C++ exception or `longjmp` out of it (unwinding through the library
/// is undefined behaviour).
pub type PackdProgressFn =
    Option<unsafe extern "C" fn(user_data: *mut c_void, stage: PackdProgressStage, bytes_done: u64, bytes_total: u64)>;

/// Like [`packd_pack_path`], calling `progress(user_data, …)` with each of the daemon's
/// progress reports while it packs. `progress` NULL is [`packd_pack_path`].
///
/// Returns what [`packd_pack_path`] returns.
///
/// Thread safety: any number of threads may call this at once with the same client; each
/// call's `progress` runs on its own thread.
///
/// # Safety
/// As [`packd_pack_path`]; `progress` is NULL or a function safe to call with `user_data`
/// from this thread during the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_pack_path_progress(
    client: *const PackdClient,
    path: *const c_char,
    layout: *const c_char,
    rules: *const *const c_char,
    nrules: usize,
    progress: PackdProgressFn,
    user_data: *mut c_void,
    out: *mut *mut PackdModel,
) -> PackdStatus {
    let make = |c: &Client| {
        // SAFETY: `path` is NULL or a NUL-terminated string valid for this call (# Safety).
        let path = unsafe { req_str(path, "path") }?;
        // SAFETY: `layout` is NULL or a valid C string; `rules` is NULL with `nrules` 0 or
        // points to `nrules` valid C strings (# Safety).
        let plan = unsafe { plan(layout, rules, nrules) }?;
        let (file, label) = packd_client::open_source(std::path::Path::new(path))?;
        let report = |p: &packd_client::proto::Progress| {
            let stage = match packd_client::proto::ProgressStage::try_from(p.stage) {
                Ok(packd_client::proto::ProgressStage::Waiting) => PackdProgressStage::Waiting,
                Ok(packd_client::proto::ProgressStage::Hashing) => PackdProgressStage::Hashing,
                Ok(packd_client::proto::ProgressStage::Packing) => PackdProgressStage::Packing,
                _ => PackdProgressStage::Accepted,
            };
            if let Some(f) = progress {
                // SAFETY: the caller promised `progress` may be called with `user_data` on
                // this thread during the call (# Safety).
                unsafe { f(user_data, stage, p.bytes_done, p.bytes_total) };
            }
        };
        Ok(c.pack_with_progress(&file, &plan, &label, &report)?.map()?)
    };
    // SAFETY: `client` is NULL or a live client from packd_connect; `out` is NULL or valid
    // for writes (# Safety).
    unsafe { produce(client, out, make) }
}

/// Like [`packd_pack_path`] with an open, readable file descriptor of a safetensors file.
/// The caller keeps `fd` (the library sends a duplicate).
///
/// Returns what [`packd_pack_path`] returns, except `OPEN`: `INVALID_ARGUMENT` for a
/// negative `fd`, `IO` for one that is not open, `BAD_FD` for one the daemon cannot read as
/// a regular file.
///
/// Thread safety: any number of threads may call this at once with the same client.
///
/// # Safety
/// As [`packd_pack_path`]; `fd` is an open file descriptor for the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_pack_fd(
    client: *const PackdClient,
    fd: c_int,
    layout: *const c_char,
    rules: *const *const c_char,
    nrules: usize,
    out: *mut *mut PackdModel,
) -> PackdStatus {
    let make = |c: &Client| {
        // SAFETY: `fd` is the caller's own descriptor, open for this call (# Safety).
        let file = unsafe { packd_client::sys::dup_raw_fd(fd) }.map_err(|e| match e.kind() {
            std::io::ErrorKind::InvalidInput => invalid(format!("fd {e}")),
            _ => Failure::from(Error::Io(e)),
        })?;
        // SAFETY: `layout` is NULL or a valid C string; `rules` is NULL with `nrules` 0 or
        // points to `nrules` valid C strings (# Safety).
        let plan = unsafe { plan(layout, rules, nrules) }?;
        Ok(c.pack_file(&file, &plan)?)
    };
    // SAFETY: `client` is NULL or a live client from packd_connect; `out` is NULL or valid
    // for writes (# Safety).
    unsafe { produce(client, out, make) }
}

/// Maps the segment holding `key` (an entry key or a segment key) that is already packed.
/// On success `*out` holds a model to release with [`packd_model_release`];
/// `PACKD_STATUS_NOT_FOUND` if nothing has that key.
///
/// Returns `OK`; `INVALID_ARGUMENT` (a NULL client, key or `out`); `NOT_FOUND`;
/// `PERMISSION_DENIED`; `RESOURCE_EXHAUSTED` (the lease quota); `TIMEOUT`, `UNAVAILABLE`, `DISCONNECTED`, `IO`, `PROTOCOL`, `NOT_SEALED`, `FD_DROPPED`, `INTERNAL`.
///
/// Thread safety: any number of threads may call this at once with the same client.
///
/// # Safety
/// `client` is NULL or came from [`packd_connect`]; `key` is NULL or a valid C string; `out` is
/// NULL or valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_get(
    client: *const PackdClient,
    key: *const c_char,
    out: *mut *mut PackdModel,
) -> PackdStatus {
    let make = |c: &Client| {
        // SAFETY: `key` is NULL or a NUL-terminated string valid for this call (# Safety).
        let key = unsafe { req_str(key, "key") }?;
        Ok(c.get(key)?)
    };
    // SAFETY: `client` is NULL or a live client from packd_connect; `out` is NULL or valid
    // for writes (# Safety).
    unsafe { produce(client, out, make) }
}

/// Unmaps a model and releases its lease. NULL is ignored. Pointers from it become invalid.
///
/// Thread safety: no other call may use `model` (or its entries) at the same time or
/// afterwards.
///
/// # Safety
/// `model` is NULL or came from a packd function and is not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_model_release(model: *mut PackdModel) {
    if !model.is_null() {
        // SAFETY: created by Box::into_raw in hand_out; ownership returns here once.
        let _ = catch_unwind(AssertUnwindSafe(|| drop(unsafe { Box::from_raw(model) })));
    }
}

/// The model's segment key, or NULL for a NULL model. Valid until the model is released.
///
/// Thread safety: any number of threads may read the same model at once.
///
/// # Safety
/// `model` is NULL or a live model.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_model_key(model: *const PackdModel) -> *const c_char {
    // SAFETY: NULL or a live model (caller's promise).
    unsafe { model.as_ref() }.map_or(ptr::null(), |m| m.key.as_ptr())
}

/// The whole mapped segment: its first byte, and its length in `*len` (if `len` is not
/// NULL). For a NULL model: NULL, and `*len` is set to 0.
///
/// Thread safety: any number of threads may read the same model at once.
///
/// # Safety
/// `model` is NULL or a live model; `len` is NULL or valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_model_data(model: *const PackdModel, len: *mut usize) -> *const u8 {
    // SAFETY: NULL or a live model (caller's promise).
    let Some(m) = (unsafe { model.as_ref() }) else {
        if !len.is_null() {
            // SAFETY: non-NULL and valid for writes (caller's promise).
            unsafe { *len = 0 };
        }
        return ptr::null();
    };
    let bytes = m.model.bytes();
    if !len.is_null() {
        // SAFETY: non-NULL and valid for writes (caller's promise).
        unsafe { *len = bytes.len() };
    }
    bytes.as_ptr()
}

/// The number of entries (packed tensors) of the model; 0 for NULL.
///
/// Thread safety: any number of threads may read the same model at once.
///
/// # Safety
/// `model` is NULL or a live model.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_model_entry_count(model: *const PackdModel) -> usize {
    // SAFETY: NULL or a live model (caller's promise).
    unsafe { model.as_ref() }.map_or(0, |m| m.entries.len())
}

/// Entry `index` of `m`, or `INVALID_ARGUMENT` naming the range.
fn tensor_at(m: &PackdModel, index: usize) -> Result<packd_client::Tensor<'_>, Failure> {
    let n = m.entries.len();
    m.model.tensor_at(index).ok_or_else(|| invalid(format!("entry {index} is out of range (the model has {n})")))
}

fn describe(m: &PackdModel, i: usize) -> Result<PackdEntry, Failure> {
    let t = tensor_at(m, i)?;
    let s = &m.entries[i]; // one per tensor, built with them
    Ok(PackdEntry {
        name: s.name.as_ptr(),
        key: s.key.as_ptr(),
        layout: s.layout.as_ptr(),
        dtype: s.dtype.as_ptr(),
        shape: if t.shape().is_empty() { ptr::null() } else { t.shape().as_ptr() },
        ndim: t.shape().len(),
        data: t.bytes().as_ptr(),
        length: t.bytes().len(),
        blake3: s.blake3.as_ptr(),
        bias: s.bias.as_ref().map_or(ptr::null(), |b| b.as_ptr()),
    })
}

/// Describes entry `index` (0 ≤ index < [`packd_model_entry_count`], in source order) in
/// `*out`.
///
/// Returns `OK`; `INVALID_ARGUMENT` (a NULL model or `out`, an index out of range).
///
/// Thread safety: any number of threads may read the same model at once.
///
/// # Safety
/// `model` is NULL or a live model; `out` is NULL or valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_model_entry(
    model: *const PackdModel,
    index: usize,
    out: *mut PackdEntry,
) -> PackdStatus {
    guarded(|| {
        // SAFETY: NULL or a live model (caller's promise).
        let m = unsafe { given(model, "model")?.as_ref() };
        given(out, "out")?;
        let e = describe(m, index)?;
        // SAFETY: non-NULL and valid for writes (caller's promise).
        unsafe { out.write(e) };
        Ok(())
    })
}

/// Describes entry `index` further (see [`PackdEntryDetails`]) in `*out`, whose `size`
/// the caller set. `PACKD_STATUS_INVALID_ARGUMENT` for a NULL model or `out`, a `size`
/// smaller than the first two fields, or an index out of range.
///
/// Thread safety: any number of threads may read the same model at once.
///
/// # Safety
/// `model` is NULL or a live model; `out` is NULL or valid for reads and writes of
/// `out->size` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_model_entry_details(
    model: *const PackdModel,
    index: usize,
    out: *mut PackdEntryDetails,
) -> PackdStatus {
    guarded(|| {
        // SAFETY: NULL or a live model (caller's promise).
        let m = unsafe { given(model, "model")?.as_ref() };
        given(out, "out")?;
        // SAFETY: non-NULL and valid for reads of its first field (caller's promise).
        let size = unsafe { (*out).size };
        let least = std::mem::offset_of!(PackdEntryDetails, layout_version);
        if size < least {
            return Err(invalid(format!("out->size is {size}: set it to sizeof(PackdEntryDetails)")));
        }
        let t = tensor_at(m, index)?;
        let full = PackdEntryDetails {
            size,
            offset: t.entry().offset,
            layout_version: t.entry().layout_version,
            plan: m.plan.as_ptr(),
            source_blake3: m.source_blake3.as_ptr(),
        };
        let fit = size.min(std::mem::size_of::<PackdEntryDetails>());
        // SAFETY: `out` is valid for writes of `size` bytes (caller's promise) and `fit` is
        // at most that and at most the size of `full`; the two do not overlap.
        unsafe { ptr::copy_nonoverlapping((&raw const full).cast::<u8>(), out.cast::<u8>(), fit) };
        Ok(())
    })
}

/// Describes the entry of the tensor named `name` in `*out`; `PACKD_STATUS_NOT_FOUND` if the
/// model has none (a bias folded into its weight has no entry of its own).
///
/// Returns `OK`; `NOT_FOUND`; `INVALID_ARGUMENT` (a NULL model, name or `out`; a name that is
/// not UTF-8).
///
/// Thread safety: any number of threads may read the same model at once.
///
/// # Safety
/// `model` is NULL or a live model; `name` is a valid C string; `out` is valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_model_find(
    model: *const PackdModel,
    name: *const c_char,
    out: *mut PackdEntry,
) -> PackdStatus {
    guarded(|| {
        // SAFETY: NULL or a live model (caller's promise).
        let m = unsafe { given(model, "model")?.as_ref() };
        // SAFETY: a valid C string (caller's promise).
        let name = unsafe { req_str(name, "name") }?;
        given(out, "out")?;
        let index = m
            .model
            .position(name)
            .ok_or_else(|| Failure(PackdStatus::NotFound, format!("the model has no tensor named {name:?}")))?;
        let e = describe(m, index)?;
        // SAFETY: non-NULL and valid for writes (caller's promise).
        unsafe { out.write(e) };
        Ok(())
    })
}

/// Checks every entry's bytes against its BLAKE3 (`PACKD_STATUS_CORRUPT` if one differs).
///
/// Returns `OK`; `CORRUPT`; `DIGESTS_PENDING` (a publication served before the daemon hashed
/// it: get it again later); `INVALID_ARGUMENT` (a NULL model).
///
/// Thread safety: any number of threads may read the same model at once.
///
/// # Safety
/// `model` is NULL or a live model.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_model_verify(model: *const PackdModel) -> PackdStatus {
    guarded(|| {
        // SAFETY: NULL or a live model (caller's promise).
        let m = unsafe { given(model, "model")?.as_ref() };
        Ok(m.model.verify()?)
    })
}

/// The message of the calling thread's last failed call (empty if none). Valid until the
/// thread's next failing call or its end; never NULL. Called while the thread ends (an
/// `atexit` handler, a C++ static destructor, a pthread key destructor), after packd's
/// thread-locals are gone, it returns a static text saying so.
///
/// Thread safety: each thread has its own last error.
#[unsafe(no_mangle)]
pub extern "C" fn packd_last_error() -> *const c_char {
    LAST_ERROR.try_with(|e| e.borrow().as_ptr()).unwrap_or(ENDING.as_ptr())
}

/// A static, human-readable name of a status code, e.g. `"NOT_FOUND"` (`"UNKNOWN"` for a
/// value that is no status).
///
/// Thread safety: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn packd_status_name(status: c_int) -> *const c_char {
    let name: &'static CStr = match status {
        0 => c"OK",
        1 => c"INVALID_ARGUMENT",
        2 => c"NOT_FOUND",
        3 => c"BAD_SOURCE",
        4 => c"BAD_FD",
        5 => c"FRAME_TOO_LARGE",
        6 => c"MALFORMED_FRAME",
        7 => c"RESOURCE_EXHAUSTED",
        8 => c"INTERNAL",
        9 => c"PERMISSION_DENIED",
        10 => c"ALREADY_EXISTS",
        20 => c"CONNECT",
        21 => c"OPEN",
        22 => c"IO",
        23 => c"UNAVAILABLE",
        24 => c"DISCONNECTED",
        25 => c"FD_DROPPED",
        26 => c"PROTOCOL",
        27 => c"NOT_SEALED",
        28 => c"CORRUPT",
        29 => c"TIMEOUT",
        30 => c"DIGESTS_PENDING",
        _ => c"UNKNOWN",
    };
    name.as_ptr()
}

/// Writes the BLAKE3 of `len` bytes at `data` as 64 lowercase hex digits and a NUL into
/// `out` (65 bytes), the digest packd uses for every entry: for checking bytes from C.
///
/// Returns `OK`; `INVALID_ARGUMENT` (a NULL `out`, or NULL `data` with `len` above 0).
///
/// Thread safety: safe from any thread.
///
/// # Safety
/// `data` is valid for `len` reads (or `len` is 0); `out` is NULL or valid for 65 writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_blake3_hex(data: *const u8, len: usize, out: *mut c_char) -> PackdStatus {
    guarded(|| {
        if out.is_null() || (data.is_null() && len > 0) {
            return Err(invalid("data or out is NULL"));
        }
        let bytes: &[u8] = if len == 0 {
            &[]
        } else {
            // SAFETY: valid for `len` reads (caller's promise), non-NULL (checked).
            unsafe { std::slice::from_raw_parts(data, len) }
        };
        let hex = blake3::hash(bytes).to_hex();
        // SAFETY: `out` is valid for 65 writes (caller's promise); hex is 64 ASCII bytes.
        unsafe {
            ptr::copy_nonoverlapping(hex.as_bytes().as_ptr().cast::<c_char>(), out, 64);
            *out.add(64) = 0;
        }
        Ok(())
    })
}

/// The library's version, e.g. `"0.1.0"`.
///
/// Thread safety: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn packd_version() -> *const c_char {
    const VERSION: &CStr = match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
        Ok(v) => v,
        Err(_) => c"unknown",
    };
    VERSION.as_ptr()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last_error() -> String {
        // SAFETY: packd_last_error never returns NULL; the string lives until this thread's
        // next failing call, and is copied at once.
        unsafe { CStr::from_ptr(packd_last_error()) }.to_string_lossy().into_owned()
    }

    #[test]
    fn bad_arguments_are_errors_with_messages_not_crashes() {
        let mut client = ptr::null_mut();
        // SAFETY: a valid C string and a valid out-pointer.
        let s = unsafe { packd_connect(c"/nonexistent-packd-dir".as_ptr(), &mut client) };
        assert_eq!(s, PackdStatus::Connect);
        assert!(client.is_null());
        assert!(last_error().contains("/nonexistent-packd-dir"), "{}", last_error());
        // SAFETY: NULL pointers are allowed arguments; they must be refused.
        let s = unsafe { packd_connect(ptr::null(), ptr::null_mut()) };
        assert_eq!(s, PackdStatus::InvalidArgument);
        assert!(last_error().contains("out is NULL"));
        let mut model = ptr::null_mut();
        // SAFETY: as above.
        let s = unsafe { packd_get(ptr::null(), c"k".as_ptr(), &mut model) };
        assert_eq!((s, model.is_null()), (PackdStatus::InvalidArgument, true));
        // SAFETY: NULL is allowed for every accessor and destructor.
        unsafe {
            assert_eq!(packd_model_entry_count(ptr::null()), 0);
            assert!(packd_model_key(ptr::null()).is_null());
            assert!(packd_model_data(ptr::null(), ptr::null_mut()).is_null());
            packd_model_release(ptr::null_mut());
            packd_client_free(ptr::null_mut());
        }
        // SAFETY: packd_status_name returns static strings.
        let names = unsafe { (CStr::from_ptr(packd_status_name(2)), CStr::from_ptr(packd_status_name(99))) };
        assert_eq!(names, (c"NOT_FOUND", c"UNKNOWN"));
    }

    #[test]
    fn a_panic_is_reported_not_unwound_into_c() {
        let s = guarded(|| panic!("boom"));
        assert_eq!(s, PackdStatus::Internal);
        assert!(last_error().contains("boom"), "{}", last_error());
    }
}
