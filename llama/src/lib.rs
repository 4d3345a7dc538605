//! packd as the host's store of llama.cpp's repacked weights.
//!
//! llama.cpp's CPU backend repacks quantised weights at load (the `CPU_REPACK` buffer type)
//! into interleaved layouts its kernels run faster on, into private memory in every
//! process. With this library in the process, the first process on the host repacks (with
//! ggml's own code) and publishes the result to packd as a sealed segment; every later
//! process maps that segment read-only and repacks nothing. Processes starting at once
//! build once: packd gives one of them the builder role and the others wait for it.
//!
//! ```sh
//! LD_PRELOAD=libpackd_llama.so llama-server -m model.gguf ...
//! ```
//!
//! or, in llama-cpp-python, `packd.llama.enable()`, which loads this library with `dlopen`;
//! loaded that way (even `RTLD_LOCAL`), it puts itself in the process's global scope, so that
//! a llama.cpp loaded after it binds its allocations to this library as with `LD_PRELOAD`.
//!
//! Loaded, it finds ggml among the loaded objects (in llama.cpp's release layout,
//! `GGML_BACKEND_DL`, the CPU backend is found when `ggml_backend_load_all()` has loaded the
//! `libggml-cpu-<variant>.so` it picked) and, when `ggml_version()` is one of the
//! versions this library is built for (`ggml::SUPPORTED`), replaces
//! `ggml_backend_buft_alloc_buffer` in the GOT slots of the objects that call it
//! (`repack` says what happens then). Any other ggml, a second ggml, or a static build
//! leaves llama.cpp exactly as it is, and says why (stderr, [`status`], the daemon's
//! `private_reports`).
//!
//! The cache identity holds the model file's content digest (BLAKE3, remembered per file
//! identity as packd's XNNPACK names are), `ggml_version()`, the build-id of
//! `libggml-cpu`, the CPU's identity, and a digest of the buffer's layout (every tensor's
//! name, type, shape, offset and size).
//!
//! Environment:
//! * `PACKD_LLAMA=off`: do nothing.
//! * `PACKD_LLAMA_STATUS=stderr` or `=PATH`: at exit, write what the library did (one line
//!   of JSON, [`Status::to_json`]) to stderr or append it to PATH.
//! * `PACKD_LLAMA_DROP_SOURCE=0`: keep the model file's pages of tensors served or repacked
//!   through packd mapped (by default they are dropped from the process: llama.cpp never
//!   reads them again, and the page cache keeps them).
//! * `PACKD_SOCKET_DIR`: where packd listens (default `/run/packd`).
//!
//! C exports: `size_t packd_llama_status(char* buf, size_t len)` and
//! `void packd_llama_enable(void)` (for a program that loads llama.cpp after start).

mod adapter;
mod key;
mod repack;
mod status;
mod sys;

use packd_interpose::say;

pub use adapter::{enable, status, wait_publications};
pub use status::Status;
pub use sys::ggml;

packd_interpose::c_entry! {
    off: "PACKD_LLAMA",
    status_var: "PACKD_LLAMA_STATUS",
    enable: || {
        enable();
    },
    json: || status().to_json(),
    // Nothing for a process without llama.cpp (a shell, a helper).
    status: || {
        let status = status();
        status.ggml.is_some().then(|| status.to_json())
    },
    at_load: keep_global,
    // A worker that ends right after its load still leaves its copy to the host.
    at_exit: wait_publications,
    status_fn: packd_llama_status,
    enable_fn: packd_llama_enable,
}

/// Loaded with dlopen(RTLD_LOCAL) (ctypes.CDLL's default) rather than preloaded, a llama.cpp
/// loaded later would bind to ggml's own allocator and never be seen: this library puts
/// itself in the global scope, where it binds to this library's, as with `LD_PRELOAD`.
/// `enable_fn`: the address of this library's `packd_llama_enable`.
fn keep_global(enable_fn: usize) {
    let global = packd_interpose::sys::Loaded::program().and_then(|p| p.symbol(c"packd_llama_enable"));
    let preloaded = global.is_some_and(|f| f.as_ptr() as usize == enable_fn);
    if !preloaded
        && let Some(me) = packd_interpose::identity::library_at(enable_fn)
        && !packd_interpose::sys::keep_global(&me)
    {
        say!("packd-llama: cannot put {me} in the global scope: a llama.cpp loaded later is not seen");
    }
}
