//! What every C entry point of this library shares: the status it returns
//! ([`PackdStatus`]), the calling thread's last error, panics caught, and the checks of
//! the pointers a caller passes (NULL, UTF-8).

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr::{self, NonNull};

use packd_client::Error;
use packd_client::proto::ErrorCode;

/// Outcome of a packd call. Codes 1–10 are the daemon's own (the protocol's `ErrorCode`);
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
    /// A publication served before the daemon hashed it: no digest to verify against yet
    /// (get it again later).
    DigestsPending = 30,
}

thread_local! {
    pub(crate) static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// What [`packd_last_error`] says on a thread whose thread-locals are gone (a call from an
/// `atexit` handler, a C++ static destructor, a pthread key destructor).
pub(crate) const ENDING: &CStr = c"(the calling thread is ending: its last error is no longer kept)";

pub(crate) fn set_error(message: &str) {
    // Never a panic: after the thread's thread-local destructors ran (calls from atexit
    // handlers, C++ static destructors, pthread key destructors), there is no slot to keep
    // the message in, and `with` would panic across the C boundary.
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = text(message));
}

pub(crate) fn status_of(e: &Error) -> PackdStatus {
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
        Error::NotSealed { .. } => PackdStatus::NotSealed,
        Error::Corrupt { .. } => PackdStatus::Corrupt,
        Error::DigestsPending { .. } => PackdStatus::DigestsPending,
    }
}

/// A failure to report: its status and message.
pub(crate) struct Failure(pub(crate) PackdStatus, pub(crate) String);

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure(status_of(&e), e.to_string())
    }
}

pub(crate) fn invalid(message: impl Into<String>) -> Failure {
    Failure(PackdStatus::InvalidArgument, message.into())
}

/// Runs `body`, turning its failure or a panic into a status and the thread's last error.
pub(crate) fn guarded(body: impl FnOnce() -> Result<(), Failure>) -> PackdStatus {
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
pub(crate) unsafe fn opt_str<'a>(p: *const c_char, what: &str) -> Result<Option<&'a str>, Failure> {
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
pub(crate) unsafe fn req_str<'a>(p: *const c_char, what: &str) -> Result<&'a str, Failure> {
    // SAFETY: forwarded from the caller.
    unsafe { opt_str(p, what) }?.ok_or_else(|| invalid(format!("{what} is NULL")))
}

/// `p` as a non-NULL pointer; NULL is an `INVALID_ARGUMENT` failure saying "`what` is NULL".
/// The one check of a pointer argument.
pub(crate) fn given<T>(p: *const T, what: &str) -> Result<NonNull<T>, Failure> {
    NonNull::new(p.cast_mut()).ok_or_else(|| invalid(format!("{what} is NULL")))
}

pub(crate) fn text(s: &str) -> CString {
    CString::new(s.replace('\0', " ")).unwrap_or_default()
}

/// Checks an out-pointer and clears what it points to.
///
/// # Safety
/// `out` is NULL or valid for writes.
pub(crate) unsafe fn clear_out<T>(out: *mut *mut T) -> Result<(), Failure> {
    given(out, "out")?;
    // SAFETY: non-NULL and valid for writes (caller's promise).
    unsafe { *out = ptr::null_mut() };
    Ok(())
}
