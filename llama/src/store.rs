//! What a `CPU_REPACK` buffer is keyed by, what packd answers for it, and what the
//! integration did in this process (its status).

#![forbid(unsafe_code)]

use std::sync::{LazyLock, Mutex, MutexGuard};
use std::time::Duration;

use packd_client::{AcquireOptions, Acquired, Client, Fallback, Report, Segment};
use packd_interpose::status::Reasons;
use serde::Serialize;

/// A tensor as `init_tensor` placed it in the buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TensorInfo {
    pub name: String,
    pub type_: i32,
    pub ne: [i64; 4],
    pub nb: [usize; 4],
    /// Its offset in the buffer.
    pub offset: usize,
    /// `ggml_nbytes`.
    pub nbytes: usize,
}

/// The llama.cpp build in this process, as the identity holds it.
#[derive(Clone, Debug, Default)]
pub(crate) struct Engine {
    /// `ggml_version()`.
    pub ggml_version: String,
    /// The build of `libggml-cpu` (its GNU build-id, else a digest of the file): the repack
    /// code and layouts.
    pub cpu_lib: String,
    /// This process's CPU (what chose the repack layout).
    pub cpu: String,
}

/// A digest of the buffer's layout: its size and every tensor's name, type, shape, strides,
/// offset and size, in offset order.
pub(crate) fn layout_digest(size: usize, tensors: &[TensorInfo]) -> String {
    let mut sorted: Vec<&TensorInfo> = tensors.iter().collect();
    sorted.sort_by_key(|t| (t.offset, t.name.clone()));
    let mut h = blake3::Hasher::new();
    h.update(format!("size={size}\n").as_bytes());
    for t in sorted {
        h.update(format!("{}|{}|{:?}|{:?}|{}|{}\n", t.name, t.type_, t.ne, t.nb, t.offset, t.nbytes).as_bytes());
    }
    h.finalize().to_hex()[..32].to_string()
}

/// The cache identity of a buffer: the integration's format, ggml's version, the CPU
/// library's build, the CPU, the layout and the model file's content (at most 100
/// printable characters; the parts are in the status).
pub(crate) fn identity(engine: &Engine, layout: &str, model: &str) -> String {
    let mut h = blake3::Hasher::new();
    for part in [FORMAT, &engine.ggml_version, &engine.cpu_lib, &engine.cpu, layout, model] {
        h.update(part.as_bytes());
        h.update(b"\n");
    }
    format!("{FORMAT} ggml-{} {}", engine.ggml_version, &h.finalize().to_hex()[..48])
}

/// The identity format (part of every identity).
const FORMAT: &str = "llama.cpp-repack/1";

/// What packd said for a buffer.
pub(crate) enum Decision {
    /// Map this segment: nothing to repack.
    Served { segment: Segment, client: Client },
    /// Repack, then publish (within the daemon's build deadline); into `memory` if packd
    /// lent it (a memfd, its pages allocated while it hashed the model).
    Build { client: Client, memory: Option<std::fs::File> },
    /// Repack privately.
    Private { fallback: Fallback, reason: String, client: Option<Client> },
}

/// Asks packd for `identity` on `connected` (a connection to the socket directory from
/// `PACKD_SOCKET_DIR`, else the default), for a build of `build_bytes`. Waits while
/// another process builds it.
pub(crate) fn acquire(connected: Result<Client, packd_client::Error>, identity: &str, build_bytes: u64) -> Decision {
    let client = match connected {
        Ok(c) => c,
        Err(e) => {
            return Decision::Private { fallback: e.fallback(), reason: format!("packd is away: {e}"), client: None };
        }
    };
    match client.acquire(identity, AcquireOptions { build_bytes, ..AcquireOptions::default() }) {
        Ok(Acquired::Segment(segment)) => Decision::Served { segment, client },
        Ok(Acquired::Build { memory, .. }) => Decision::Build { client, memory },
        Ok(Acquired::Private { fallback, reason }) => Decision::Private { fallback, reason, client: Some(client) },
        Err(e) => Decision::Private {
            fallback: e.fallback(),
            reason: format!("packd refused the acquire: {e}"),
            client: Some(client),
        },
    }
}

/// What the integration did in this process ([`crate::status`]; as JSON:
/// [`Status::to_json`], these fields' names).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Status {
    /// Whether [`crate::enable`] ran (and `PACKD_LLAMA` is not `off`).
    pub enabled: bool,
    /// The library defining ggml's backend API (`libggml-base`), once found.
    pub ggml: Option<String>,
    /// Its `ggml_version()`.
    pub ggml_version: Option<String>,
    /// Why nothing is hooked although ggml is loaded (another version, a second ggml).
    pub unsupported: Option<String>,
    /// The objects whose calls to `ggml_backend_buft_alloc_buffer` go through packd.
    pub hooked: Vec<String>,
    /// `CPU_REPACK` buffers allocated through packd.
    pub buffers: u64,
    /// Buffers served (mapped from packd; nothing repacked).
    pub served: u64,
    /// Buffers this process repacked and published.
    pub published: u64,
    /// Buffers repacked privately.
    pub private: u64,
    /// Tensors this process repacked (in any mode).
    pub tensors_repacked: u64,
    /// Tensors whose repacked bytes came from packd.
    pub tensors_served: u64,
    /// The tensors of the `CPU_REPACK` buffers (those llama.cpp repacks, whether this
    /// process repacked them or packd served them), by ggml type name (`q4_0`, `mxfp4`, …).
    pub types: std::collections::BTreeMap<String, u64>,
    /// Bytes of repacked weights mapped from packd (served or published).
    pub bytes_shared: u64,
    /// Bytes of repacked weights this process holds privately.
    pub bytes_private: u64,
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
    /// Microseconds: finding the model's digest, asking packd (with waiting for another
    /// process's build), repacking (first tensor to last), publishing (making the build
    /// read-only and sealing it, then packd's answer to the publication).
    pub hash_us: u64,
    /// See `hash_us`.
    pub acquire_us: u64,
    /// See `hash_us`.
    pub repack_us: u64,
    /// See `hash_us`.
    pub publish_us: u64,
    /// Builds made in memory packd lent (allocated while it hashed the model).
    pub lent_builds: u64,
    /// The identity of the last buffer decided.
    pub identity: Option<String>,
    /// Weights llama.cpp put in buffer types packd does not share (ggml's `AMX`,
    /// `CPU_KLEIDIAI`, …), by buffer type: private in every process, as without packd.
    pub unshared: std::collections::BTreeMap<String, Unshared>,
    /// Why buffers were repacked privately, with counts (`reasons`), and the same by reason
    /// as packd counts them (`fallbacks`: "daemon_away", "unknown_interface", ...).
    #[serde(flatten)]
    pub why: Reasons,
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

static STATUS: LazyLock<Mutex<Status>> = LazyLock::new(Mutex::default);

/// The status, locked, to read or update.
pub(crate) fn status() -> MutexGuard<'static, Status> {
    STATUS.lock().unwrap_or_else(|p| p.into_inner())
}

/// The engine name buffers are reported under.
const ENGINE: &str = "llama.cpp";

/// Counts a private buffer of `bytes` with its reason, says it on stderr (once per
/// reason) and tells packd — on `client`, or on the next connection this process makes
/// when there is none (a report of model `model`: the buffer's identity once known).
pub(crate) fn note_private(fallback: Fallback, reason: &str, bytes: usize, model: &str, client: Option<&Client>) {
    let first = {
        let mut st = status();
        st.private += 1;
        st.bytes_private += bytes as u64;
        st.why.count(fallback, reason)
    };
    if first {
        packd_interpose::say!("packd-llama: llama.cpp repacks its weights privately: {reason}");
    }
    let model = if model.is_empty() { "llama.cpp buffer" } else { model };
    packd_interpose::status::report(&Report::private(ENGINE, model, fallback, reason, bytes as u64), client);
}

/// A connection kept for the life of the process, to tell packd of work that is private
/// whatever happens (packd shows this worker so while it runs); `None` while packd is away
/// (the report is then sent by the next connection).
pub(crate) fn reporter() -> Option<&'static Client> {
    static REPORTER: std::sync::OnceLock<Client> = std::sync::OnceLock::new();
    if let Some(c) = REPORTER.get() {
        return Some(c);
    }
    Client::connect_default().ok().map(|c| REPORTER.get_or_init(|| c))
}

/// Counts a buffer of `bytes` of the extra buffer type `buft` (not shared), says it on
/// stderr (once per type) and tells packd (fallback `unshared_buffer_type`).
pub(crate) fn note_unshared(buft: &str, bytes: usize) {
    let reason = format!(
        "llama.cpp put weights in its {buft} buffer type, which converts them into private memory in every \
         process; packd shares CPU_REPACK only"
    );
    let (first, total) = {
        let mut st = status();
        let u = st.unshared.entry(buft.to_string()).or_default();
        u.buffers += 1;
        u.bytes += bytes as u64;
        let total = u.bytes;
        (st.why.count(Fallback::UnsharedBufferType, &reason), total)
    };
    if first {
        packd_interpose::say!("packd-llama: {reason}");
    }
    let model = format!("llama.cpp {buft} buffer");
    packd_interpose::status::report(
        &Report::private(ENGINE, &model, Fallback::UnsharedBufferType, &reason, total),
        reporter(),
    );
}

/// Counts a tensor of ggml type `ty` (`bytes` as ggml counts them) placed in a buffer of
/// the extra buffer type `buft`.
pub(crate) fn count_unshared_tensor(buft: &str, ty: &str, bytes: usize) {
    let mut st = status();
    let u = st.unshared.entry(buft.to_string()).or_default();
    *u.types.entry(ty.to_string()).or_default() += 1;
    u.tensor_bytes += bytes as u64;
}

/// Tells packd a buffer of `model` is mapped from it (`built`: this process published it).
pub(crate) fn note_shared(model: &str, bytes: usize, built: bool, client: Option<&Client>) {
    if let Some(c) = client {
        let bytes = bytes as u64;
        c.report(&if built { Report::built(ENGINE, model, bytes) } else { Report::served(ENGINE, model, bytes) });
    }
}

pub(crate) fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str, offset: usize) -> TensorInfo {
        TensorInfo { name: name.into(), type_: 2, ne: [64, 8, 1, 1], nb: [18, 36, 288, 288], offset, nbytes: 288 }
    }

    #[test]
    fn the_identity_changes_with_every_part_and_stays_printable_and_short() {
        let e = Engine { ggml_version: "0.25.3".into(), cpu_lib: "libggml-cpu.so@id:ab".into(), cpu: "c1".into() };
        let base = identity(&e, "l", "m");
        assert!(base.len() <= 100 && base.bytes().all(|b| (0x20..0x7f).contains(&b)), "{base}");
        assert!(base.starts_with("llama.cpp-repack/1 ggml-0.25.3 "));
        let mut seen = std::collections::HashSet::from([base.clone()]);
        for (e2, l, m) in [
            (Engine { ggml_version: "0.25.4".into(), ..e.clone() }, "l", "m"),
            (Engine { cpu_lib: "other".into(), ..e.clone() }, "l", "m"),
            (Engine { cpu: "c2".into(), ..e.clone() }, "l", "m"),
            (e.clone(), "l2", "m"),
            (e.clone(), "l", "m2"),
        ] {
            assert!(seen.insert(identity(&e2, l, m)), "a part left the identity unchanged");
        }
    }

    #[test]
    fn the_layout_digest_sees_every_field_but_not_the_order_tensors_came_in() {
        let a = vec![t("a", 0), t("b", 320)];
        let b = vec![t("b", 320), t("a", 0)];
        assert_eq!(layout_digest(640, &a), layout_digest(640, &b));
        assert_ne!(layout_digest(640, &a), layout_digest(704, &a));
        let mut c = a.clone();
        c[1].type_ = 8;
        assert_ne!(layout_digest(640, &a), layout_digest(640, &c));
        let mut d = a.clone();
        d[1].name = "c".into();
        assert_ne!(layout_digest(640, &a), layout_digest(640, &d));
        let mut e = a.clone();
        e[0].ne[1] = 16;
        assert_ne!(layout_digest(640, &a), layout_digest(640, &e));
    }
}
