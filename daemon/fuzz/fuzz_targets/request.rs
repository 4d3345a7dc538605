//! Request decoding and validation take untrusted bytes: whatever a peer sends, decoding
//! must not panic, a decoded request must survive re-encoding, and the daemon's own
//! handler (a real data plane wired as the daemon wires it: its store and pack path) must
//! answer it without panicking.
//! Pack requests carry a small real model in a memfd, so fuzzed plans reach the packer;
//! publish requests carry a sealed one-page memfd, so fuzzed tables reach the checks.
#![no_main]

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use packd::config;
use packd::dataplane::{DataPlane, Outcome, request};
use packd_proto::v1::{self, request::Body};
use prost::Message;

struct World {
    plane: Arc<DataPlane>,
    runtime: tokio::runtime::Runtime,
    model: Vec<u8>,
    /// The socket a request "came" on (publish reads its peer's groups).
    sock: (UnixStream, UnixStream),
    _dir: tempfile::TempDir,
}

/// A safetensors file with a GEMM-able weight, its bias, an embedding and a scalar.
fn small_model() -> Vec<u8> {
    let tensors: [(&str, &str, &[u64]); 4] = [
        ("layer.weight", "F32", &[5, 3]),
        ("layer.bias", "F32", &[5]),
        ("embed.weight", "F16", &[4, 2]),
        ("scale", "BF16", &[]),
    ];
    let mut json = String::from("{");
    let mut data = Vec::new();
    for (i, (name, dtype, shape)) in tensors.iter().enumerate() {
        let elems: u64 = shape.iter().product();
        let size = if *dtype == "F32" { 4 } else { 2 };
        let start = data.len();
        data.extend((0..elems * size).map(|b| (b as u8).wrapping_mul(37).wrapping_add(i as u8)));
        if i > 0 {
            json.push(',');
        }
        json.push_str(&format!(
            "\"{name}\":{{\"dtype\":\"{dtype}\",\"shape\":{shape:?},\"data_offsets\":[{start},{}]}}",
            data.len()
        ));
    }
    json.push('}');
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(json.as_bytes());
    out.extend_from_slice(&data);
    out
}

fn world() -> &'static World {
    static WORLD: OnceLock<World> = OnceLock::new();
    WORLD.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temp dir");
        let sockets = dir.path().to_str().expect("utf-8 temp dir");
        let args = <config::Args as clap::Parser>::try_parse_from([
            "packd",
            "--socket-dir",
            sockets,
            "--max-bytes",
            "64M",
        ])
        .expect("arguments");
        let cfg = config::Config::from_args(args).expect("config");
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let sock = UnixStream::pair().expect("socket pair");
        World { plane: packd::server::Parts::wire(&cfg).data, runtime, model: small_model(), sock, _dir: dir }
    })
}

fn model_fd(bytes: &[u8]) -> OwnedFd {
    let f = memfd::MemfdOptions::default().create("fuzz-model").expect("memfd");
    std::io::Write::write_all(&mut f.as_file(), bytes).expect("write model");
    f.into_file().into()
}

fn sealed_page() -> OwnedFd {
    let f = memfd::MemfdOptions::default().allow_sealing(true).create("fuzz-publish").expect("memfd");
    f.as_file().set_len(4096).expect("size");
    f.add_seals(&[
        memfd::FileSeal::SealShrink,
        memfd::FileSeal::SealGrow,
        memfd::FileSeal::SealWrite,
        memfd::FileSeal::SealSeal,
    ])
    .expect("seal");
    f.into_file().into()
}

fuzz_target!(|data: &[u8]| {
    let Ok(req) = v1::Request::decode(data) else { return };
    let again = v1::Request::decode(req.encode_to_vec().as_slice()).expect("re-encoded request decodes");
    assert_eq!(again, req);
    let w = world();
    let fds = match req.body {
        Some(Body::Pack(_) | Body::Digest(_)) => vec![model_fd(&w.model)],
        Some(Body::Publish(_)) => vec![sealed_page()],
        _ => Vec::new(),
    };
    let id = req.id;
    let peer = packd::store::Peer { pid: None, uid: 1000, gid: 1000 };
    let fds = request::Fds { fds, extra: false, truncated: false };
    let handling = request::handle(&w.plane, 1, peer, w.sock.0.as_fd(), req, fds, packd::service::Track::default());
    let outcome = w.runtime.block_on(handling);
    match outcome {
        Outcome::Segment { id: reply_id, seg, .. } => {
            assert_eq!(reply_id, id);
            assert!(seg.size > 0);
        }
        Outcome::Error { id: reply_id, message, .. } => {
            assert_eq!(reply_id, id);
            assert!(!message.is_empty());
        }
        Outcome::Build { id: reply_id, reply, lent } => {
            assert_eq!(reply_id, id);
            assert!(!reply.reason.is_empty());
            let size = lent.as_ref().map(|f| f.metadata().unwrap().len());
            assert_eq!(size.unwrap_or(0), reply.lent_bytes, "a lent memfd has the size the reply says");
        }
        Outcome::Digest { id: reply_id, reply } => {
            assert_eq!(reply_id, id);
            assert_eq!(reply.blake3, blake3::hash(&w.model).as_bytes().to_vec());
        }
        Outcome::NoReply => {}
    }
});
