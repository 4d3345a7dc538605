//! ggml's exported functions packd calls, found by name in the pinned library that defines
//! ggml's API (`libggml-base`), with the signatures ggml's headers give them; and the GOT
//! slot packd takes over.

use std::ffi::{CStr, c_char};

use packd_interpose::scan::{Pinned, Slot};

use super::ggml::{BuftDeviceFn, DevRegFn, Layout, NbytesFn, ProcAddressFn, TypeNameFn};
use super::hooks::{self, NameFn, REAL_ALLOC, REALS, Reals};

/// The function whose calls are taken over.
pub(crate) const HOOKED: &str = "ggml_backend_buft_alloc_buffer";

/// `ggml_version()` of `lib`; `None` when it has no such function (ggml before 0.9).
pub(crate) fn version_of(lib: &Pinned) -> Option<String> {
    let at = lib.defines(c"ggml_version")?;
    // SAFETY: ggml declares `const char * ggml_version(void)` (ggml.h) since 0.9; the
    // symbol of that name in the library defining ggml's API is it.
    let version_fn: unsafe extern "C" fn() -> *const c_char = unsafe { std::mem::transmute(at) };
    // SAFETY: takes nothing, returns a static string.
    let v = unsafe { version_fn() };
    if v.is_null() {
        return Some(String::new());
    }
    // SAFETY: a NUL-terminated static string (checked for NULL).
    Some(unsafe { CStr::from_ptr(v) }.to_string_lossy().into_owned())
}

/// The functions the hooks call, from `lib`, whose `ggml_version()` the caller found in the
/// table (with `layout`); `None` when `lib` lacks one of them.
pub(crate) fn reals_of(lib: &Pinned, layout: Layout) -> Option<Reals> {
    let name_fn = lib.defines(c"ggml_backend_buft_name")?;
    let (nbytes_fn, type_name_fn) = (lib.defines(c"ggml_nbytes")?, lib.defines(c"ggml_type_name")?);
    let devices = (
        lib.defines(c"ggml_backend_buft_get_device"),
        lib.defines(c"ggml_backend_dev_backend_reg"),
        lib.defines(c"ggml_backend_reg_get_proc_address"),
    );
    // SAFETY: the functions of these names in every supported ggml have the signatures of
    // the types they are cast to (ggml-backend.h, ggml.h; `enum ggml_type` is an int; the
    // device, registry and buffer type handles are pointers).
    Some(unsafe {
        Reals {
            buft_name: std::mem::transmute::<usize, NameFn>(name_fn),
            nbytes: std::mem::transmute::<usize, NbytesFn>(nbytes_fn),
            type_name: std::mem::transmute::<usize, TypeNameFn>(type_name_fn),
            devices: match devices {
                (Some(d), Some(r), Some(p)) => Some((
                    std::mem::transmute::<usize, BuftDeviceFn>(d),
                    std::mem::transmute::<usize, DevRegFn>(r),
                    std::mem::transmute::<usize, ProcAddressFn>(p),
                )),
                _ => None,
            },
            layout,
        }
    })
}

/// The slot packd takes over, once ggml's functions are known.
pub(crate) fn slots() -> Vec<Slot> {
    let (Some(_), Some(real)) = (REALS.get(), REAL_ALLOC.get()) else { return Vec::new() };
    // SAFETY: the hook has ggml_backend_buft_alloc_buffer's signature (ggml-backend.h) and
    // lives in this library, which stays loaded.
    vec![unsafe { Slot::new(HOOKED, hooks::alloc_hook_address(), *real as usize) }]
}
