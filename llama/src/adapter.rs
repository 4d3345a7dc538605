//! The adapter: finding ggml among the loaded objects (the scan), what packd-llama did in
//! this process, and the handler the hooks call (`sys::handler::Handler`), which hands each
//! buffer to `crate::repack` and each count to `crate::status`.

#![forbid(unsafe_code)]

use std::any::Any;
use std::ffi::CStr;
use std::sync::Arc;

use packd_client::Fallback;
use packd_interpose::entry::turned_off;
use packd_interpose::ledger::Private;
use packd_interpose::say;
use packd_interpose::scan::{Adapter, Pinned, Scanner, Slot};

use crate::status::{self, JOURNAL, Status};
use crate::sys::buffer::Backing;
use crate::sys::ggml::{self as ggml};
use crate::sys::ggml_api;
use crate::sys::handler::{AdoptError, BufferId, HANDLER, Handler, TensorId, TensorInfo, Write};
use crate::sys::hooks::{self, REAL_ALLOC, REALS};
use crate::{key, repack};

/// The objects scanned so far.
static SCANNER: Scanner = Scanner::new();

/// Finds ggml among the loaded objects and hooks the calls into it (objects loaded since the
/// last call are looked at again). Idempotent. `PACKD_LLAMA=off` makes it do nothing.
pub fn enable() -> Status {
    if turned_off("PACKD_LLAMA") {
        return status();
    }
    JOURNAL.lock().enabled = true;
    HANDLER.register(&Llama);
    scan();
    status()
}

/// What the library did so far in this process.
pub fn status() -> Status {
    status::snapshot()
}

/// Waits for publications in progress (a worker exiting right after its load still leaves
/// its copy to the host).
pub fn wait_publications() {
    repack::wait_publications();
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
    let mut st = JOURNAL.lock();
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
fn waits_for_cpu_backend() -> bool {
    lock(&BASE_WITHOUT_CPU).is_some()
}

static BASE_WITHOUT_CPU: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The adapter as the scan and the hooks see it.
struct Llama;

impl Handler for Llama {
    fn scan(&self) {
        // ggml's allocator was called before a scan found all of ggml (a llama.cpp
        // `dlopen`ed after start, or the release layout's CPU backend loaded after
        // libggml-base): look now.
        scan();
    }

    fn waits_for_cpu_backend(&self) -> bool {
        waits_for_cpu_backend()
    }

    fn adopted(&self, buffer: BufferId, backing: Arc<Backing>, size: usize) {
        repack::adopted(buffer, backing, size);
    }

    fn not_adopted(&self, size: usize, why: AdoptError) {
        repack::not_adopted(size, why);
    }

    fn placed(&self, buffer: BufferId, tensor: TensorId, info: TensorInfo, view: bool) {
        repack::placed(buffer, tensor, info, view);
    }

    fn set(&self, buffer: BufferId, write: Write, repack: &mut dyn FnMut()) {
        repack::set(buffer, write, repack);
    }

    fn memset(&self, buffer: BufferId, memset: &mut dyn FnMut()) {
        repack::memset(buffer, memset);
    }

    fn clear(&self, buffer: BufferId, value: u8) {
        repack::clear(buffer, value);
    }

    fn freed(&self, buffer: BufferId) -> Option<Box<dyn Any>> {
        repack::freed(buffer)
    }

    fn unshared(&self, buft: &str, size: usize) {
        status::note_unshared(buft, size);
    }

    fn unshared_tensor(&self, buft: &str, ty: &str, bytes: usize) {
        status::count_unshared_tensor(buft, ty, bytes);
    }
}

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
            let enabled = JOURNAL.lock().enabled;
            let base = defines(c"ggml_backend_buft_alloc_buffer");
            // ggml's CPU backend (its repack code): `ggml_backend_cpu_reg` is defined there in
            // every supported version (`ggml_backend_cpu_buffer_type` moved to libggml-base).
            let cpu = defines(c"ggml_backend_cpu_reg");
            if let [(lib, _)] = base.as_slice()
                && let Some(alloc) = hooks::alloc_of(lib)
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
                    JOURNAL.lock().ggml = Some(p.object.name.clone());
                    *lock(&BASE_WITHOUT_CPU) = Some(p.object.name.clone());
                }
                ([_], cpus) => {
                    let names: Vec<String> = cpus.iter().map(|(p, _)| p.object.name.clone()).collect();
                    unsupported(Unsupported::CpuBackends(names));
                }
                (many, _) => {
                    let names: Vec<String> = many.iter().map(|(p, _)| p.object.name.clone()).collect();
                    unsupported(Unsupported::Ggmls(names));
                }
            }
        }
        ggml_api::slots()
    }
}

/// Why llama.cpp runs without packd.
#[derive(Debug, thiserror::Error)]
enum Unsupported {
    #[error("more than one ggml CPU backend is loaded ({})", .0.join(", "))]
    CpuBackends(Vec<String>),
    #[error("more than one loaded library defines ggml ({})", .0.join(", "))]
    Ggmls(Vec<String>),
    #[error("ggml has no ggml_version(): older than {}", ggml::supported_list())]
    NoVersion,
    #[error("ggml {version}: this build of packd-llama supports {}", ggml::supported_list(), version = .0)]
    Version(String),
    #[error("cannot read the build of libggml-cpu")]
    NoCpuBuild,
    #[error("ggml lacks ggml_backend_buft_name, ggml_nbytes or ggml_type_name")]
    MissingFunctions,
}

/// Records that nothing is hooked and why (once).
fn unsupported(why: Unsupported) {
    let why = Private::adapter(Fallback::UnknownInterface, why);
    let mut st = JOURNAL.lock();
    if st.unsupported.is_none() {
        st.unsupported = Some(why.to_string());
        drop(st);
        say!("packd-llama: llama.cpp runs without packd: {why}");
        // Kept connected for the life of the process: packd shows this worker as private
        // while it runs.
        let report = packd_client::Report::private(JOURNAL.engine(), "llama.cpp", why.fallback, &why.to_string(), 0);
        packd_interpose::status::report(&report, JOURNAL.client().ok());
    }
}

/// Checks ggml's version and takes the functions packd calls from `obj` (libggml-base).
fn find_reals(lib: &Pinned, cpu_fn: usize) {
    JOURNAL.lock().ggml = Some(lib.display_name());
    let Some(version) = ggml_api::version_of(lib) else {
        return unsupported(Unsupported::NoVersion);
    };
    JOURNAL.lock().ggml_version = Some(version.clone());
    let Some(entry) = ggml::supported(&version) else {
        return unsupported(Unsupported::Version(version));
    };
    let Some(cpu_lib) = packd_interpose::identity::library_build(cpu_fn) else {
        return unsupported(Unsupported::NoCpuBuild);
    };
    let engine = key::Engine { ggml_version: version, cpu_lib, cpu: packd_interpose::identity::cpu_identity() };
    let Some(reals) = ggml_api::reals_of(lib, entry.layout) else {
        return unsupported(Unsupported::MissingFunctions);
    };
    // The identity's parts first: a hook acts once REALS is set.
    let _ = key::ENGINE.set(engine);
    let _ = REALS.set(reals);
}
