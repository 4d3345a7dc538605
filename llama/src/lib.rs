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
//! (`sys::hooks` says what happens then). Any other ggml, a second ggml, or a static build
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

pub mod ggml;
mod store;
mod sys;

use std::ffi::{CStr, c_char};

use packd_interpose::entry::{caught, turned_off, write_status_line};
use packd_interpose::say;
use packd_interpose::scan::{Adapter, Pinned, Scanner, Slot};

pub use store::Status;
use sys::ggml_api;
use sys::hooks::{self, REAL_ALLOC, REALS};

/// The function whose calls are taken over.
pub(crate) const HOOKED: &str = "ggml_backend_buft_alloc_buffer";

/// The objects scanned so far.
static SCANNER: Scanner = Scanner::new();

/// Finds ggml among the loaded objects and hooks the calls into it (objects loaded since the
/// last call are looked at again). Idempotent. `PACKD_LLAMA=off` makes it do nothing.
pub fn enable() -> Status {
    if turned_off("PACKD_LLAMA") {
        return status();
    }
    store::status().enabled = true;
    scan();
    status()
}

/// What the library did so far in this process.
pub fn status() -> Status {
    store::status().clone()
}

/// ggml's allocator was called before a scan found all of ggml (a llama.cpp `dlopen`ed
/// after start, or the release layout's CPU backend loaded after libggml-base): looks now.
pub(crate) fn on_first_call() {
    scan();
}

/// Waits for publications in progress (a worker exiting right after its load still leaves
/// its copy to the host).
pub fn wait_publications() {
    hooks::wait_publications();
}

fn scan() {
    let acting = REALS.get().is_some();
    let mut hooked = SCANNER.scan(&Llama);
    if !acting && REALS.get().is_some() && lock(&BASE_WITHOUT_CPU).take().is_some() {
        // ggml's CPU backend came after libggml-base (the release layout): the objects
        // scanned before it are scanned again, for their slots.
        SCANNER.forget();
        hooked.extend(SCANNER.scan(&Llama));
    }
    let mut st = store::status();
    for h in hooked {
        if !st.hooked.contains(&h) {
            st.hooked.push(h);
        }
    }
}

/// Whether packd-llama waits for ggml's CPU backend: libggml-base is loaded (its path is
/// kept) but no loaded object defines the CPU backend yet. In llama.cpp's release layout
/// (`GGML_BACKEND_DL`) the backend is a `libggml-cpu-<variant>.so` that
/// `ggml_backend_load_all()` loads at `llama_backend_init`, after every scan at start.
pub(crate) fn waits_for_cpu_backend() -> bool {
    lock(&BASE_WITHOUT_CPU).is_some()
}

static BASE_WITHOUT_CPU: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The adapter as the scan sees it.
struct Llama;

impl Adapter for Llama {
    fn own_address(&self) -> usize {
        hooks::alloc_hook_address()
    }

    fn found(&self, fresh: &[Pinned]) -> Vec<Slot> {
        let me = self.own_address();
        // libggml-base, seen by an earlier scan that found no CPU backend: pinned again.
        let earlier: Option<Pinned> = if REALS.get().is_none() {
            let name = lock(&BASE_WITHOUT_CPU).clone();
            name.filter(|n| !fresh.iter().any(|p| &p.object.name == n)).and_then(|n| {
                packd_interpose::sys::objects().into_iter().find(|o| o.name == n).and_then(|o| Pinned::pin(&o))
            })
        } else {
            None
        };
        let defines = |name: &CStr| -> Vec<(&Pinned, usize)> {
            fresh
                .iter()
                .chain(earlier.iter())
                .filter(|p| !p.object.contains(me))
                .filter_map(|p| Some((p, p.defines(name)?)))
                .collect()
        };
        if REALS.get().is_none() {
            let enabled = store::status().enabled;
            let base = defines(c"ggml_backend_buft_alloc_buffer");
            // ggml's CPU backend (its repack code): `ggml_backend_cpu_reg` is defined there in
            // every supported version (`ggml_backend_cpu_buffer_type` moved to libggml-base).
            let cpu = defines(c"ggml_backend_cpu_reg");
            if let [(lib, _)] = base.as_slice()
                && let Some(alloc) = ggml_api::alloc_of(lib)
            {
                let _ = REAL_ALLOC.set(alloc);
            }
            match (base.as_slice(), cpu.as_slice()) {
                _ if !enabled => {}
                ([], _) => {}
                ([(p, _)], [(_, cpu_fn)]) => {
                    find_reals(p, *cpu_fn);
                    if REALS.get().is_none() {
                        lock(&BASE_WITHOUT_CPU).take();
                    }
                }
                ([(p, _)], []) => {
                    store::status().ggml = Some(p.object.name.clone());
                    *lock(&BASE_WITHOUT_CPU) = Some(p.object.name.clone());
                }
                ([_], cpus) => {
                    let names: Vec<String> = cpus.iter().map(|(p, _)| p.object.name.clone()).collect();
                    unsupported(&format!("more than one ggml CPU backend is loaded ({})", names.join(", ")));
                }
                (many, _) => {
                    let names: Vec<String> = many.iter().map(|(p, _)| p.object.name.clone()).collect();
                    unsupported(&format!("more than one loaded library defines ggml ({})", names.join(", ")));
                }
            }
        }
        ggml_api::slots()
    }
}

/// Records that nothing is hooked and why (once).
fn unsupported(why: &str) {
    let mut st = store::status();
    if st.unsupported.is_none() {
        st.unsupported = Some(why.to_string());
        drop(st);
        say!("packd-llama: llama.cpp runs without packd: {why}");
        // Kept connected for the life of the process: packd shows this worker as private
        // while it runs.
        let report =
            packd_client::Report::private("llama.cpp", "llama.cpp", packd_client::Fallback::UnknownInterface, why, 0);
        packd_interpose::status::report(&report, store::reporter());
    }
}

/// Checks ggml's version and takes the functions packd calls from `obj` (libggml-base).
fn find_reals(lib: &Pinned, cpu_fn: usize) {
    store::status().ggml = Some(lib.display_name());
    let Some(version) = ggml_api::version_of(lib) else {
        return unsupported(&format!("ggml has no ggml_version(): older than {}", ggml::supported_list()));
    };
    store::status().ggml_version = Some(version.clone());
    let Some(entry) = ggml::supported(&version) else {
        return unsupported(&format!("ggml {version}: this build of packd-llama supports {}", ggml::supported_list()));
    };
    let Some(cpu_lib) = packd_interpose::identity::library_build(cpu_fn) else {
        return unsupported("cannot read the build of libggml-cpu");
    };
    let engine = store::Engine { ggml_version: version, cpu_lib, cpu: packd_interpose::identity::cpu_identity() };
    let Some(reals) = ggml_api::reals_of(lib, entry.layout, engine) else {
        return unsupported("ggml lacks ggml_backend_buft_name, ggml_nbytes or ggml_type_name");
    };
    let _ = REALS.set(reals);
}

/// Runs when the library is loaded (before `main` with `LD_PRELOAD`).
extern "C" fn init() {
    caught((), || {
        if turned_off("PACKD_LLAMA") {
            return;
        }
        enable();
        // Loaded with dlopen(RTLD_LOCAL) (ctypes.CDLL's default) rather than preloaded: a
        // llama.cpp loaded later would bind to ggml's own allocator and never be seen.
        // In the global scope, it binds to this library's, as with LD_PRELOAD.
        let global = packd_interpose::sys::Loaded::program().and_then(|p| p.symbol(c"packd_llama_enable"));
        let preloaded = global.is_some_and(|f| f.as_ptr() as usize == packd_llama_enable as extern "C" fn() as usize);
        if !preloaded
            && let Some(me) = packd_interpose::identity::library_at(init as extern "C" fn() as usize)
            && !packd_interpose::sys::keep_global(&me)
        {
            say!("packd-llama: cannot put {me} in the global scope: a llama.cpp loaded later is not seen");
        }
        // SAFETY: registers a function with no arguments that libc runs at exit.
        unsafe { libc::atexit(at_exit) };
    });
}

#[used]
#[unsafe(link_section = ".init_array")]
static INIT: extern "C" fn() = init;

/// Waits for publications, then writes the status where `PACKD_LLAMA_STATUS` says.
extern "C" fn at_exit() {
    caught((), write_status);
}

fn write_status() {
    wait_publications();
    let status = status();
    if status.ggml.is_none() {
        return; // a process without llama.cpp (a shell, a helper)
    }
    write_status_line("PACKD_LLAMA_STATUS", &status.to_json());
}

/// Copies the status JSON (NUL-terminated, truncated to `len`) into `buf`; returns the
/// length of the whole JSON (without the NUL).
///
/// # Safety
/// `buf` must be writable for `len` bytes (or NULL with `len` 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_llama_status(buf: *mut c_char, len: usize) -> usize {
    let json = caught(String::from("{}"), || status().to_json());
    // SAFETY: the caller's promise, passed on.
    unsafe { packd_interpose::sys::copy_to_c(&json, buf, len) }
}

/// Looks at the loaded objects again (after the program loaded llama.cpp with `dlopen`).
#[unsafe(no_mangle)]
pub extern "C" fn packd_llama_enable() {
    caught((), || {
        enable();
    });
}
