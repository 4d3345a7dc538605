//! What a `CPU_REPACK` buffer is keyed by, and what packd answers for it.

#![forbid(unsafe_code)]

use std::sync::OnceLock;

use packd_client::{AcquireOptions, Acquired, Client, Segment};
use packd_interpose::ledger::Private;

use crate::sys::handler::TensorInfo;

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

/// The llama.cpp build in this process, once a supported ggml was found (before any slot
/// points at a hook).
pub(crate) static ENGINE: OnceLock<Engine> = OnceLock::new();

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
    Private { why: Private, client: Option<Client> },
}

/// Asks packd for `identity` on `connected` (a connection to the socket directory from
/// `PACKD_SOCKET_DIR`, else the default), for a build of `build_bytes`. Waits while
/// another process builds it.
pub(crate) fn acquire(connected: Result<Client, packd_client::Error>, identity: &str, build_bytes: u64) -> Decision {
    let client = match connected {
        Ok(c) => c,
        Err(e) => return Decision::Private { why: Private::packd("packd is away", e), client: None },
    };
    match client.acquire(identity, AcquireOptions { build_bytes, ..AcquireOptions::default() }) {
        Ok(Acquired::Segment(segment)) => Decision::Served { segment, client },
        Ok(Acquired::Build { memory, .. }) => Decision::Build { client, memory },
        Ok(Acquired::Private { fallback, reason }) => {
            Decision::Private { why: Private::given(fallback, reason), client: Some(client) }
        }
        Err(e) => Decision::Private { why: Private::packd("packd refused the acquire", e), client: Some(client) },
    }
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
