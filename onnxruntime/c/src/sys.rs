//! The C exports over [`packd_onnxruntime::Share`]: this crate's `unsafe` (pointers from C).

use std::ffi::{CStr, CString, OsStr, c_char, c_int};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use packd_interpose::entry::caught;
use packd_interpose::sys::copy_to_c;
use packd_onnxruntime::{BUILD_ENTRIES, KEYED_ENTRIES, Model, Role, Share};

fn role_code(role: Role) -> c_int {
    match role {
        Role::Private => 0,
        Role::Build => 1,
        Role::Served => 2,
    }
}

/// The text of a NUL-terminated string, or "" for NULL.
///
/// # Safety
/// `s` is NULL or a NUL-terminated string.
unsafe fn text<'a>(s: *const c_char) -> &'a [u8] {
    if s.is_null() {
        return b"";
    }
    // SAFETY: the caller's promise.
    unsafe { CStr::from_ptr(s) }.to_bytes()
}

/// Asks packd for the optimized form of the model at `model_path` (or, when it is NULL, of
/// the `len` bytes at `model`) under `options` (the identity's options text; NULL for none).
/// Waits while another process builds it. Never NULL but after a panic; free it with
/// `packd_ort_free` once the session is released.
///
/// # Safety
/// `model_path` and `options` are NULL or NUL-terminated strings; when `model_path` is NULL,
/// `model` is NULL or points at `len` readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_ort_open(
    model_path: *const c_char,
    model: *const u8,
    len: usize,
    options: *const c_char,
) -> *mut Share {
    caught(std::ptr::null_mut(), || {
        // SAFETY: the caller's promise, passed on.
        let options = String::from_utf8_lossy(unsafe { text(options) }).into_owned();
        let share = if model_path.is_null() {
            let bytes: &[u8] = if model.is_null() || len == 0 {
                &[]
            } else {
                // SAFETY: `len` readable bytes at `model` (the caller's promise).
                unsafe { std::slice::from_raw_parts(model, len) }
            };
            Share::open(Model::Bytes(bytes), &options)
        } else {
            // SAFETY: the caller's promise, passed on.
            let path = PathBuf::from(OsStr::from_bytes(unsafe { text(model_path) }));
            Share::open(Model::Path(&path), &options)
        };
        Box::into_raw(Box::new(share))
    })
}

/// A session packd takes no part in, for `reason` (what the caller could not hand packd):
/// counted and reported; the share to free as any other.
///
/// # Safety
/// `model` and `reason` are NULL or NUL-terminated strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_ort_skip(model: *const c_char, reason: *const c_char) -> *mut Share {
    caught(std::ptr::null_mut(), || {
        // SAFETY: the caller's promise, passed on.
        let (model, reason) = unsafe { (text(model), text(reason)) };
        let model = String::from_utf8_lossy(model).into_owned();
        let share = Share::skip(model, packd_interpose::ledger::Fallback::Other, &String::from_utf8_lossy(reason));
        Box::into_raw(Box::new(share))
    })
}

/// The share behind `share`, if any.
///
/// # Safety
/// `share` is NULL or came from `packd_ort_open` and was not freed; no other thread uses it
/// meanwhile.
unsafe fn share_mut<'a>(share: *mut Share) -> Option<&'a mut Share> {
    // SAFETY: the caller's promise.
    unsafe { share.as_mut() }
}

/// 0: ONNX Runtime alone (private), 1: build, 2: served.
///
/// # Safety
/// As `share_mut`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_ort_role(share: *mut Share) -> c_int {
    // SAFETY: forwarded.
    caught(0, || unsafe { share_mut(share) }.map_or(0, |s| role_code(s.role())))
}

fn copy_path(path: Option<&Path>, buf: *mut c_char, len: usize) -> usize {
    let text = path.map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
    // SAFETY: the caller's promise (`buf` NULL or `len` writable bytes), passed on.
    unsafe { copy_to_c(&text, buf, len) }
}

/// Copies a builder's `optimized_model_filepath` into `buf` (NUL-terminated, cut to `len`);
/// returns its whole length (0: not a builder).
///
/// # Safety
/// As `share_mut`; `buf` is NULL or points at `len` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_ort_build_model_path(share: *mut Share, buf: *mut c_char, len: usize) -> usize {
    // SAFETY: forwarded.
    caught(0, || unsafe { share_mut(share) }.map_or(0, |s| copy_path(s.build_model_path().as_deref(), buf, len)))
}

/// Copies the model ONNX Runtime is to load when served into `buf` (NUL-terminated, cut to
/// `len`); returns its whole length (0: not served).
///
/// # Safety
/// As `packd_ort_build_model_path`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_ort_model_path(share: *mut Share, buf: *mut c_char, len: usize) -> usize {
    // SAFETY: forwarded.
    caught(0, || unsafe { share_mut(share) }.map_or(0, |s| copy_path(s.model_path().as_deref(), buf, len)))
}

/// The optimized model was written: seals and publishes it. Returns the role now (2: load
/// `packd_ort_model_path`; 0: create the session as without packd).
///
/// # Safety
/// As `share_mut`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_ort_finish_build(share: *mut Share) -> c_int {
    // SAFETY: forwarded.
    caught(0, || unsafe { share_mut(share) }.map_or(0, |s| role_code(s.finish_build())))
}

/// The session over `packd_ort_model_path` was created: 1 when it maps packd's copy; 0 when
/// it must be released and created again as without packd.
///
/// # Safety
/// As `share_mut`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_ort_served(share: *mut Share) -> c_int {
    // SAFETY: forwarded.
    caught(0, || unsafe { share_mut(share) }.map_or(0, |s| c_int::from(s.served())))
}

/// ONNX Runtime failed with `error` (NULL: no words): a builder gives its role up.
///
/// # Safety
/// As `share_mut`; `error` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_ort_abandon(share: *mut Share, error: *const c_char) {
    caught((), || {
        // SAFETY: forwarded.
        let words = String::from_utf8_lossy(unsafe { text(error) }).into_owned();
        // SAFETY: forwarded.
        if let Some(s) = unsafe { share_mut(share) } {
            s.abandon(&words);
        }
    });
}

/// Frees a share (its lease on packd's copy ends): after the session is released.
///
/// # Safety
/// `share` is NULL or came from `packd_ort_open` and was not freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_ort_free(share: *mut Share) {
    if !share.is_null() {
        // SAFETY: the caller's promise: a box this library made, freed once.
        caught((), || drop(unsafe { Box::from_raw(share) }));
    }
}

static KEYED: LazyLock<Vec<CString>> =
    LazyLock::new(|| KEYED_ENTRIES.iter().filter_map(|k| CString::new(*k).ok()).collect());
static BUILD: LazyLock<Vec<(CString, CString)>> = LazyLock::new(|| {
    BUILD_ENTRIES.iter().filter_map(|(k, v)| Some((CString::new(*k).ok()?, CString::new(*v).ok()?))).collect()
});

/// The `i`-th session config entry whose value is part of the identity; NULL past the last.
#[unsafe(no_mangle)]
pub extern "C" fn packd_ort_keyed_entry(i: usize) -> *const c_char {
    caught(std::ptr::null(), || KEYED.get(i).map_or(std::ptr::null(), |k| k.as_ptr()))
}

/// The `i`-th session config entry a builder's options get: its key, and its value in
/// `*value`; NULL past the last.
///
/// # Safety
/// `value` is NULL or points at a writable pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_ort_build_entry(i: usize, value: *mut *const c_char) -> *const c_char {
    caught(std::ptr::null(), || {
        let Some((k, v)) = BUILD.get(i) else { return std::ptr::null() };
        if !value.is_null() {
            // SAFETY: a writable pointer (the caller's promise).
            unsafe { *value = v.as_ptr() };
        }
        k.as_ptr()
    })
}
