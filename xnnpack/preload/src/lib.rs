//! `libpackd_xnnpack_preload.so`: packd as the weights cache of an unmodified engine that
//! exports XNNPACK's C API (ExecuTorch's PyPI wheel, a program linked with libXNNPACK).
//!
//! ```sh
//! LD_PRELOAD=libpackd_xnnpack_preload.so my-worker ...
//! ```
//!
//! Loaded, it turns adoption on (`packd_xnnpack::adopt::enable`): the calls the process's
//! objects make into XNNPACK's runtime creation go through packd. The engine must be loaded
//! with the program (linked to it, as a C++ runner linking ExecuTorch's libraries is); one
//! the program `dlopen`s later is adopted when the program calls `packd_xnnpack_enable()`
//! after loading it. Environment:
//!
//! * `PACKD_XNNPACK=off`: do nothing (the program runs as without the library).
//! * `PACKD_XNNPACK_STATUS=stderr` or `=PATH`: at exit, write what adoption did (one line
//!   of JSON, as `packd_xnnpack_status` returns it) to stderr or append it to PATH.
//! * `PACKD_SOCKET_DIR`: where packd listens (default `/run/packd`).
//!
//! The library exports two C functions for programs that want to ask:
//! `size_t packd_xnnpack_status(char* buf, size_t len)` and `void packd_xnnpack_enable(void)`.

use std::ffi::c_char;

use packd_interpose::entry::{caught, turned_off, write_status_line};

/// Runs when the library is loaded (before `main` with `LD_PRELOAD`).
extern "C" fn init() {
    caught((), || {
        if turned_off("PACKD_XNNPACK") {
            return;
        }
        packd_xnnpack::adopt::enable();
        if std::env::var_os("PACKD_XNNPACK_STATUS").is_some() {
            // SAFETY: registers a function with no arguments that libc runs at exit.
            unsafe { libc::atexit(report) };
        }
    });
}

#[used]
#[unsafe(link_section = ".init_array")]
static INIT: extern "C" fn() = init;

/// Writes the status where `PACKD_XNNPACK_STATUS` says.
extern "C" fn report() {
    caught((), || {
        let status = packd_xnnpack::adopt::status();
        // Nothing for a process with no XNNPACK (a shell, a helper the worker ran).
        if status.engine.is_some() || status.runtimes > 0 {
            write_status_line("PACKD_XNNPACK_STATUS", &status.to_json());
        }
    });
}

/// Writes what adoption did as one line of JSON (NUL-terminated, truncated to `len`) into
/// `buf`, and returns its length without the NUL (call again with a larger buffer when it
/// is `len` or more). `buf` may be NULL with `len` 0.
///
/// # Safety
/// `buf` is NULL or points at `len` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_xnnpack_status(buf: *mut c_char, len: usize) -> usize {
    let json = caught(String::from("{}"), || packd_xnnpack::adopt::status().to_json());
    // SAFETY: the caller's promise, passed on.
    unsafe { packd_interpose::sys::copy_to_c(&json, buf, len) }
}

/// Turns adoption on now (the library does at load unless `PACKD_XNNPACK=off`), e.g. after
/// `dlopen`ing an engine from an object that packd had not seen.
#[unsafe(no_mangle)]
pub extern "C" fn packd_xnnpack_enable() {
    caught((), || {
        packd_xnnpack::adopt::enable();
    });
}
