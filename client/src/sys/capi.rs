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

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char, c_int};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;

use crate::proto::ErrorCode;
use crate::{Client, Error, Model, Plan};

/// Outcome of a packd call. Codes 1–9 are the daemon's own (the protocol's `ErrorCode`);
/// codes from 20 arise in the client.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackdStatus {
    /// Success.
    Ok = 0,
    /// A bad argument: NULL where a value is needed, text that is not UTF-8, an index out of
    /// range; or the daemon's INVALID_ARGUMENT (unknown layout, bad rule).
    InvalidArgument = 1,
    /// No segment, entry or tensor with this key or name.
    NotFound = 2,
    /// The model file is not a valid safetensors file (or stopped answering).
    BadSource = 3,
    /// The file descriptor is not a readable regular file.
    BadFd = 4,
    /// The daemon refused a request as too large.
    FrameTooLarge = 5,
    /// The daemon could not decode a request.
    MalformedFrame = 6,
    /// A limit was reached (the budget, a quota, open files).
    ResourceExhausted = 7,
    /// A failure inside the daemon, or a panic caught in the library.
    Internal = 8,
    /// This user may not use the daemon.
    PermissionDenied = 9,
    /// A publish for a cache identity that is already published in this user's namespace.
    AlreadyExists = 10,
    /// The daemon's socket could not be reached.
    Connect = 20,
    /// The model file could not be opened.
    Open = 21,
    /// A socket or mapping operation failed.
    Io = 22,
    /// The daemon went away (restarting); mapped models keep working, the next call
    /// reconnects.
    Unavailable = 23,
    /// The daemon closed the connection.
    Disconnected = 24,
    /// This process is at its open-file limit: the segment's fd was dropped.
    FdDropped = 25,
    /// The daemon's reply broke the protocol.
    Protocol = 26,
    /// A segment arrived without its seals and was refused.
    NotSealed = 27,
    /// Bytes do not match their BLAKE3.
    Corrupt = 28,
    /// The daemon did not answer within the client's deadline
    /// ([`packd_client_set_timeouts`]); the connection stays usable.
    Timeout = 29,
}

/// A connection to packd (opaque).
pub struct PackdClient {
    client: Client,
}

/// A mapped, read-only model (opaque). Holds a lease until released.
pub struct PackdModel {
    model: Model,
    key: CString,
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
    /// Source shape: `ndim` values.
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

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_error(message: &str) {
    LAST_ERROR.with(|e| *e.borrow_mut() = text(message));
}

fn status_of(e: &Error) -> PackdStatus {
    match e {
        Error::Daemon { code, .. } => match code {
            ErrorCode::InvalidArgument => PackdStatus::InvalidArgument,
            ErrorCode::NotFound => PackdStatus::NotFound,
            ErrorCode::BadSource => PackdStatus::BadSource,
            ErrorCode::BadFd => PackdStatus::BadFd,
            ErrorCode::FrameTooLarge => PackdStatus::FrameTooLarge,
            ErrorCode::MalformedFrame => PackdStatus::MalformedFrame,
            ErrorCode::ResourceExhausted => PackdStatus::ResourceExhausted,
            ErrorCode::PermissionDenied => PackdStatus::PermissionDenied,
            ErrorCode::AlreadyExists => PackdStatus::AlreadyExists,
            ErrorCode::Internal | ErrorCode::Unspecified => PackdStatus::Internal,
        },
        Error::Connect { .. } => PackdStatus::Connect,
        Error::Open { .. } => PackdStatus::Open,
        Error::Io(_) => PackdStatus::Io,
        Error::Disconnected => PackdStatus::Disconnected,
        Error::Unavailable { .. } => PackdStatus::Unavailable,
        Error::Timeout { .. } => PackdStatus::Timeout,
        Error::FdDropped(_) => PackdStatus::FdDropped,
        Error::Protocol(_) => PackdStatus::Protocol,
        Error::NotSealed(_) => PackdStatus::NotSealed,
        Error::Corrupt { .. } => PackdStatus::Corrupt,
    }
}

/// A failure to report: its status and message.
struct Failure(PackdStatus, String);

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure(status_of(&e), e.to_string())
    }
}

fn invalid(message: impl Into<String>) -> Failure {
    Failure(PackdStatus::InvalidArgument, message.into())
}

/// Runs `body`, turning its failure or a panic into a status and the thread's last error.
fn guarded(body: impl FnOnce() -> Result<(), Failure>) -> PackdStatus {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => PackdStatus::Ok,
        Ok(Err(Failure(status, message))) => {
            set_error(&message);
            status
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown".into());
            set_error(&format!("internal error in packd's client library (a panic): {what}"));
            PackdStatus::Internal
        }
    }
}

/// Reads a C string argument; NULL gives `None`.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string valid for the call.
unsafe fn opt_str<'a>(p: *const c_char, what: &str) -> Result<Option<&'a str>, Failure> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller promises a NUL-terminated string that outlives this call.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str().map(Some).map_err(|_| invalid(format!("{what} is not UTF-8")))
}

/// Reads a required C string argument.
///
/// # Safety
/// As [`opt_str`].
unsafe fn req_str<'a>(p: *const c_char, what: &str) -> Result<&'a str, Failure> {
    // SAFETY: forwarded from the caller.
    unsafe { opt_str(p, what) }?.ok_or_else(|| invalid(format!("{what} is NULL")))
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

fn text(s: &str) -> CString {
    CString::new(s.replace('\0', " ")).unwrap_or_default()
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
    let boxed = Box::new(PackdModel { model, key, entries });
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
        let c = unsafe { client.as_ref() }.ok_or_else(|| invalid("client is NULL"))?;
        let model = make(&c.client)?;
        // SAFETY: `out` was checked non-NULL by clear_out.
        unsafe { hand_out(model, out) };
        Ok(())
    })
}

/// Checks an out-pointer and clears what it points to.
///
/// # Safety
/// `out` is NULL or valid for writes.
unsafe fn clear_out<T>(out: *mut *mut T) -> Result<(), Failure> {
    if out.is_null() {
        return Err(invalid("out is NULL"));
    }
    // SAFETY: non-NULL and valid for writes (caller's promise).
    unsafe { *out = ptr::null_mut() };
    Ok(())
}

/// Connects to `SOCKET_DIR/packd.sock`; `socket_dir` NULL means the default resolution
/// (`$PACKD_SOCKET_DIR`, else `/run/packd`, else `$XDG_RUNTIME_DIR/packd`), as `packctl`.
/// On success `*out` holds a client to free with [`packd_client_free`].
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

/// Closes a client's connection. Models it handed out stay mapped (their leases end when
/// they are released or the process exits). NULL is ignored.
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
/// value as it is. Defaults: connecting 5 000, a get 30 000, a pack 600 000. A call that
/// waits longer returns `PACKD_STATUS_TIMEOUT` (the message says what it waited for);
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
        let c = unsafe { client.as_ref() }.ok_or_else(|| invalid("client is NULL"))?;
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

/// Opens `path`, sends it to the daemon, which packs it with the plan (or finds it
/// packed), and maps the result. `layout` NULL means the default GEMM layout
/// (`f32-gemm:nr=16,kr=1,sr=1`); `"identity"` keeps every tensor as is. `rules` are
/// `GLOB=LAYOUT` rules tried first (`nrules` of them; NULL if 0). On success `*out` holds a
/// model to release with [`packd_model_release`].
///
/// Thread safety: any number of threads may call this at once with the same client.
///
/// # Safety
/// `client` came from [`packd_connect`]; strings are valid C strings; `rules` points to
/// `nrules` of them; `out` is valid for writes.
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

/// Like [`packd_pack_path`] with an open, readable file descriptor of a safetensors file.
/// The caller keeps `fd` (the library sends a duplicate).
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
        let file = unsafe { super::dup_raw_fd(fd) }.map_err(|e| match e.kind() {
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
/// Thread safety: any number of threads may call this at once with the same client.
///
/// # Safety
/// `client` came from [`packd_connect`]; `key` is a valid C string; `out` is valid for
/// writes.
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
/// NULL). NULL for a NULL model.
///
/// Thread safety: any number of threads may read the same model at once.
///
/// # Safety
/// `model` is NULL or a live model; `len` is NULL or valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_model_data(model: *const PackdModel, len: *mut usize) -> *const u8 {
    // SAFETY: NULL or a live model (caller's promise).
    let Some(m) = (unsafe { model.as_ref() }) else { return ptr::null() };
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

fn describe(m: &PackdModel, i: usize) -> Option<PackdEntry> {
    let t = m.model.tensor_at(i)?;
    let s = m.entries.get(i)?;
    Some(PackdEntry {
        name: s.name.as_ptr(),
        key: s.key.as_ptr(),
        layout: s.layout.as_ptr(),
        dtype: s.dtype.as_ptr(),
        shape: t.shape().as_ptr(),
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
/// Thread safety: any number of threads may read the same model at once.
///
/// # Safety
/// `model` is NULL or a live model; `out` is valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_model_entry(
    model: *const PackdModel,
    index: usize,
    out: *mut PackdEntry,
) -> PackdStatus {
    guarded(|| {
        // SAFETY: NULL or a live model (caller's promise).
        let m = unsafe { model.as_ref() }.ok_or_else(|| invalid("model is NULL"))?;
        if out.is_null() {
            return Err(invalid("out is NULL"));
        }
        let n = m.entries.len();
        let e =
            describe(m, index).ok_or_else(|| invalid(format!("entry {index} is out of range (the model has {n})")))?;
        // SAFETY: non-NULL and valid for writes (caller's promise).
        unsafe { out.write(e) };
        Ok(())
    })
}

/// Describes the entry of the tensor named `name` in `*out`; `PACKD_STATUS_NOT_FOUND` if the
/// model has none (a bias folded into its weight has no entry of its own).
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
        let m = unsafe { model.as_ref() }.ok_or_else(|| invalid("model is NULL"))?;
        // SAFETY: a valid C string (caller's promise).
        let name = unsafe { req_str(name, "name") }?;
        if out.is_null() {
            return Err(invalid("out is NULL"));
        }
        let index = m
            .model
            .position(name)
            .ok_or_else(|| Failure(PackdStatus::NotFound, format!("the model has no tensor named {name:?}")))?;
        let e = describe(m, index).ok_or_else(|| invalid("entry vanished"))?;
        // SAFETY: non-NULL and valid for writes (caller's promise).
        unsafe { out.write(e) };
        Ok(())
    })
}

/// Checks every entry's bytes against its BLAKE3 (`PACKD_STATUS_CORRUPT` if one differs).
///
/// Thread safety: any number of threads may read the same model at once.
///
/// # Safety
/// `model` is NULL or a live model.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_model_verify(model: *const PackdModel) -> PackdStatus {
    guarded(|| {
        // SAFETY: NULL or a live model (caller's promise).
        let m = unsafe { model.as_ref() }.ok_or_else(|| invalid("model is NULL"))?;
        Ok(m.model.verify()?)
    })
}

/// The message of the calling thread's last failed call (empty if none). Valid until the
/// thread's next failing call; never NULL.
///
/// Thread safety: each thread has its own last error.
#[unsafe(no_mangle)]
pub extern "C" fn packd_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
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
        _ => c"UNKNOWN",
    };
    name.as_ptr()
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
