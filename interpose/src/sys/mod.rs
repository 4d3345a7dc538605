//! Where this crate's `unsafe` lives: the loaded objects and their GOT slots ([`got`]),
//! libraries held by handle ([`dl`]), the address-space reservation and sealed memfds
//! ([`vm`]), text copied into a C caller's buffer ([`copy_to_c`]), and a
//! function run at exit ([`at_exit`]).

pub mod dl;
pub mod got;
pub mod maps;
pub mod vm;

pub use dl::{Loaded, keep_global};
pub use got::{Object, Pinned, Slot, hook_object, objects};
pub use vm::{Populating, Reservation, memfd, page, remap_read_only, reopen_read_only, seal, shmem_huge_when_advised};

/// Copies `text` into `buf` (NUL-terminated, cut to `len - 1` bytes) and returns the whole
/// text's length without the NUL: a caller whose buffer was too small calls again with a
/// larger one. Nothing is written when `buf` is NULL or `len` is 0.
///
/// # Safety
/// `buf` is NULL or points at `len` writable bytes.
pub unsafe fn copy_to_c(text: &str, buf: *mut std::ffi::c_char, len: usize) -> usize {
    if !buf.is_null() && len > 0 {
        let n = text.len().min(len - 1);
        // SAFETY: `n + 1 <= len` bytes at `buf` (the caller's promise); the source is a str.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr().cast::<std::ffi::c_char>(), buf, n);
            *buf.add(n) = 0;
        }
    }
    text.len()
}

/// Has libc run `f` at exit (after `main` returns or `exit` is called).
pub fn at_exit(f: extern "C" fn()) {
    // SAFETY: registers a function with no arguments; libc calls it once at exit.
    unsafe { libc::atexit(f) };
}
