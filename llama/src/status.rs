//! What the integration did in this process: its status, and what is said and reported of
//! buffers repacked privately.

#![forbid(unsafe_code)]

use packd_client::{Fallback, Report};
use packd_interpose::ledger::{Journal, Keeps, Ledger, Private};
use serde::Serialize;

/// What the integration did in this process ([`crate::status`]; as JSON:
/// [`Status::to_json`], these fields' names). A unit of work is a `CPU_REPACK` buffer.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Status {
    /// Whether [`crate::enable`] ran (and `PACKD_LLAMA` is not `off`).
    pub enabled: bool,
    /// The library defining ggml's backend API (`libggml-base`), once found: the same as
    /// `engine`, kept under this name too.
    pub ggml: Option<String>,
    /// Its `ggml_version()`.
    pub ggml_version: Option<String>,
    /// Why nothing is hooked although ggml is loaded (another version, a second ggml).
    pub unsupported: Option<String>,
    /// The objects whose calls to `ggml_backend_buft_alloc_buffer` go through packd.
    pub hooked: Vec<String>,
    /// `CPU_REPACK` buffers allocated through packd: `served` (mapped from packd; nothing
    /// repacked), `built` (repacked here and published) or `private` (repacked privately,
    /// for the `reasons`).
    pub buffers: u64,
    /// The old name of `built`, written beside it until 0.3; read `built`.
    pub published: u64,
    /// Tensors this process repacked (in any mode).
    pub tensors_repacked: u64,
    /// Tensors whose repacked bytes came from packd.
    pub tensors_served: u64,
    /// The tensors of the `CPU_REPACK` buffers (those llama.cpp repacks, whether this
    /// process repacked them or packd served them), by ggml type name (`q4_0`, `mxfp4`, …).
    pub types: std::collections::BTreeMap<String, u64>,
    /// Bytes of the model file's pages dropped from this process (unless
    /// `PACKD_LLAMA_DROP_SOURCE=0`).
    pub source_bytes_dropped: u64,
    /// Model files this process hashed (neither the memo nor packd gave their digest),
    /// remembered (the memo knew them), and digested by packd (once per host).
    pub models_hashed: u64,
    /// See `models_hashed`.
    pub models_remembered: u64,
    /// See `models_hashed`.
    pub models_from_daemon: u64,
    /// Buffers decided under the model file's provisional name (its identity: the memo did
    /// not know its digest). A builder's digest is computed beside its build and counted
    /// above once known; a worker served under the provisional name computes none.
    pub models_provisional: u64,
    /// Microseconds: finding the model's digest, and repacking (first tensor to last).
    pub hash_us: u64,
    /// See `hash_us`.
    pub repack_us: u64,
    /// Builds made in memory packd lent (allocated while it hashed the model).
    pub lent_builds: u64,
    /// The identity of the last buffer decided.
    pub identity: Option<String>,
    /// Weights llama.cpp put in buffer types packd does not share (ggml's `AMX`,
    /// `CPU_KLEIDIAI`, …), by buffer type: private in every process, as without packd.
    pub unshared: std::collections::BTreeMap<String, Unshared>,
    /// What every adapter counts: `engine` (libggml-base), `served`, `built`, `private` with
    /// `reasons` and `fallbacks` (`daemon_away`, `unknown_interface`, ...), `bytes_shared`
    /// (repacked weights mapped from packd), `bytes_private` (repacked weights held
    /// privately), `acquire_us` (with waiting for another process's build), `publish_us`
    /// (making the build read-only and sealing it, then packd's answer).
    #[serde(flatten)]
    pub ledger: Ledger,
}

impl Keeps for Status {
    fn ledger(&mut self) -> &mut Ledger {
        &mut self.ledger
    }
}

/// The weights of one buffer type packd does not share.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Unshared {
    /// Buffers allocated of this type, and their bytes.
    pub buffers: u64,
    /// See `buffers`.
    pub bytes: u64,
    /// The tensors placed in them, by ggml type name (`q4_0`, `f16`, …).
    pub types: std::collections::BTreeMap<String, u64>,
    /// The bytes of those tensors as ggml counts them (`ggml_nbytes`, before any conversion).
    pub tensor_bytes: u64,
}

impl Status {
    /// One line of JSON.
    pub fn to_json(&self) -> String {
        packd_interpose::status::to_json(self)
    }
}

/// The status, the process's connection for reports, and what is said of buffers repacked
/// privately.
pub(crate) static JOURNAL: Journal<Status> =
    Journal::new("llama.cpp", "packd-llama: llama.cpp repacks its weights privately");

/// The status as [`crate::status`] returns it (with the old names filled in).
pub(crate) fn snapshot() -> Status {
    let mut s = JOURNAL.lock().clone();
    s.published = s.ledger.built;
    s.ledger.engine.clone_from(&s.ggml);
    s
}

/// Counts a buffer of `bytes` of the extra buffer type `buft` (not shared), says it on
/// stderr (once per type) and tells packd (fallback `unshared_buffer_type`).
pub(crate) fn note_unshared(buft: &str, bytes: usize) {
    let why = Private::adapter(Fallback::UnsharedBufferType, ExtraBufferType(buft.to_string()));
    let reason = why.to_string();
    let (first, total) = {
        let mut st = JOURNAL.lock();
        let u = st.unshared.entry(buft.to_string()).or_default();
        u.buffers += 1;
        u.bytes += bytes as u64;
        let total = u.bytes;
        (st.ledger.why.count(Fallback::UnsharedBufferType, &reason), total)
    };
    if first {
        packd_interpose::say!("packd-llama: {reason}");
    }
    let model = format!("llama.cpp {buft} buffer");
    let report = Report::private(JOURNAL.engine(), &model, Fallback::UnsharedBufferType, &reason, total);
    packd_interpose::status::report(&report, JOURNAL.client().ok());
}

/// Weights in an extra buffer type (its name), which packd does not share.
#[derive(Debug, thiserror::Error)]
#[error(
    "llama.cpp put weights in its {0} buffer type, which converts them into private memory in every process; packd \
     shares CPU_REPACK only"
)]
struct ExtraBufferType(String);

/// Counts a tensor of ggml type `ty` (`bytes` as ggml counts them) placed in a buffer of
/// the extra buffer type `buft`.
pub(crate) fn count_unshared_tensor(buft: &str, ty: &str, bytes: usize) {
    let mut st = JOURNAL.lock();
    let u = st.unshared.entry(buft.to_string()).or_default();
    *u.types.entry(ty.to_string()).or_default() += 1;
    u.tensor_bytes += bytes as u64;
}
