//! Helpers for packd's end-to-end tests: start the real `packd` binary in a fresh
//! directory, run real `packctl` processes, write safetensors files, speak the raw
//! protocol, and read `/proc` of other processes.
#![allow(clippy::cast_possible_truncation)] // test data sizes are small

mod bins;
mod daemon;
pub mod docs;
pub mod sys;
pub mod systemd;

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use packd_client::proto;
use prost::Message;

pub use bins::{bin_dir, packctl_bin, packd_bin};
pub use daemon::{Daemon, START_TIMEOUT, packd_command, release, shared_kernels_file};

pub use packd_testkit::wait_until;

/// Child processes killed and reaped when dropped, so a test that fails half-way leaves
/// none running.
#[derive(Default)]
pub struct Held(pub Vec<Child>);

impl Drop for Held {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A well-behaved worker holding a mapped model while a test attacks the daemon: its
/// bytes must never change and its connection must keep answering.
pub struct Bystander {
    /// The held model.
    pub model: packd_client::Model,
    /// Its connection.
    pub client: packd_client::Client,
    snapshot: Vec<u8>,
}

impl Bystander {
    /// Packs a small model in `d`'s directory and maps it.
    pub fn new(d: &Daemon) -> Self {
        let file = d.dir().join("bystander.safetensors");
        small_model(&file);
        let client = d.client();
        let model = client.pack(&file, &packd_client::Plan::default()).expect("bystander pack");
        let snapshot = model.bytes().to_vec();
        Self { model, client, snapshot }
    }

    /// Asserts the daemon lives, the bytes are unchanged and a get + map is answered.
    pub fn check(&self, d: &mut Daemon, after: &str) {
        assert!(d.alive(), "daemon died after {after}; log:\n{}", d.log());
        assert_eq!(self.model.bytes(), self.snapshot.as_slice(), "bystander bytes changed after {after}");
        self.model.verify().expect("bystander verify");
        // The bystander's connection still works.
        let again = self.client.get(self.model.key()).unwrap_or_else(|e| panic!("bystander get after {after}: {e}"));
        assert_eq!(again.key(), self.model.key());
    }
}

pub use packd_testkit::safetensors::{SafeTensors, f32_bytes};

/// Deterministic pseudo-random f32 values in [-1, 1).
pub fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(747_796_405).wrapping_add(2_891_336_453) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        })
        .collect()
}

/// A small model: an embedding, two linear layers with biases, a norm and I64 ids.
pub fn small_model(path: &Path) {
    SafeTensors::default()
        .f32("embeddings.word_embeddings.weight", &[10, 8], &values(80, 1))
        .add("embeddings.position_ids", "I64", &[1, 4], (0i64..4).flat_map(|v| v.to_le_bytes()).collect())
        .f32("layer.0.dense.bias", &[17], &values(17, 2))
        .f32("layer.0.dense.weight", &[17, 8], &values(17 * 8, 3))
        .f32("layer.1.proj.weight", &[3, 17], &values(51, 4))
        .f32("layer.1.norm.weight", &[3], &values(3, 5))
        .write(path);
}

/// Sends bytes as they are (a frame, half a frame, garbage) with optional fds attached to
/// the first byte.
pub fn send_raw(stream: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) {
    let mut sent = packd_client::sys::send_with_fds(stream.as_fd(), bytes, fds, false).expect("send");
    while sent < bytes.len() {
        sent += packd_client::sys::send_with_fds(stream.as_fd(), &bytes[sent..], &[], false).expect("send");
    }
}

/// Frames and sends a request (the protocol crate's one encoder).
pub fn send_request(stream: &UnixStream, req: &proto::Request, fds: &[BorrowedFd<'_>]) {
    send_raw(stream, &packd_proto::frame::encode(req).expect("request fits a frame"), fds);
}

/// Reads one reply frame (the protocol crate's one reader, keeping every fd that came
/// with it); `None` when the daemon closed the connection.
pub fn recv_reply(stream: &UnixStream) -> Option<(proto::Reply, Vec<OwnedFd>)> {
    use packd_proto::frame::{FrameReader, MAX_REPLY_BYTES};
    use packd_proto::sys::MAX_FDS;
    let mut reader = FrameReader::new(MAX_REPLY_BYTES, MAX_FDS);
    match packd_proto::stream::recv_frame(stream, &mut reader) {
        Ok(frame) => Some((proto::Reply::decode(frame.payload.as_slice()).expect("decode reply"), frame.fds)),
        Err(packd_proto::stream::RecvError::Closed) => None,
        Err(e) => panic!("recv: {e}"),
    }
}

/// A pack request with the default plan.
pub fn pack_request(id: u64, layout: &str, rules: &[&str]) -> proto::Request {
    proto::Request {
        progress: false,
        id,
        body: Some(proto::request::Body::Pack(proto::PackRequest {
            plan: Some(proto::Plan { rules: rules.iter().map(|r| r.to_string()).collect(), layout: layout.into() }),
            label: String::new(),
        })),
    }
}

/// The error of a reply, or a panic naming what came instead.
pub fn expect_error(reply: &proto::Reply) -> (proto::ErrorCode, String) {
    match &reply.body {
        Some(proto::reply::Body::Error(e)) => (e.code(), e.message.clone()),
        other => panic!("expected an error reply, got {other:?}"),
    }
}

/// The finished cache files (`*.pack`) in `dir`, sorted (a write in progress is a hidden
/// temporary file and is not listed).
pub fn cache_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|e| e == "pack")).collect())
        .unwrap_or_default();
    files.sort();
    files
}

/// Path of the MiniLM test model (`PACKD_TEST_MODEL` or `.ci/cache/minilm/`).
pub fn model_path() -> PathBuf {
    std::env::var_os("PACKD_TEST_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.ci/cache/minilm/model.safetensors"))
}

/// Path of grpcurl (`PACKD_GRPCURL` or `.ci/cache/venv/bin/grpcurl`).
pub fn grpcurl_path() -> PathBuf {
    std::env::var_os("PACKD_GRPCURL")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.ci/cache/venv/bin/grpcurl"))
}

/// A one-tensor model whose bytes depend on `seed` (so each seed is a distinct source).
pub fn seeded_model(path: &Path, seed: u32) {
    SafeTensors::default()
        .f32("w.weight", &[8, 8], &values(64, seed))
        .f32("w.bias", &[8], &values(8, seed + 1))
        .write(path);
}

/// Sums per-mapping fields of `/proc/PID/smaps` over the read-only mappings whose path
/// contains `needle` (how workers map segments; the daemon's one writable mapping of a
/// memfd is its spare, or a segment being filled).
pub fn smaps_matching(pid: u32, needle: &str) -> std::collections::HashMap<String, u64> {
    packd_testkit::smaps_sums(pid, |header| header.contains(needle) && !packd_testkit::writable_mapping(header))
}

/// A stand-in for a daemon that stopped answering: it binds `DIR/packd.sock`, accepts every
/// connection and reads its requests, and answers only what [`SilentDaemon::answer_first_get`]
/// tells it to. Every request it reads is sent to [`SilentDaemon::requests`], so a test can
/// see what a client sent while the client waits.
pub struct SilentDaemon {
    dir: tempfile::TempDir,
    /// Requests as they arrive (decoded), in order.
    pub requests: std::sync::mpsc::Receiver<proto::Request>,
}

impl SilentDaemon {
    /// Starts it in a fresh directory; it never answers anything.
    pub fn start() -> Self {
        Self::start_with(None)
    }

    /// Starts it; the first get on each connection is answered with a real sealed segment
    /// of `size` bytes (no entries), everything after that never.
    pub fn answer_first_get(size: u64) -> Self {
        Self::start_with(Some(size))
    }

    fn start_with(segment: Option<u64>) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let listener = std::os::unix::net::UnixListener::bind(dir.path().join(packd_proto::DATA_SOCKET)).expect("bind");
        let (tx, requests) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                let tx = tx.clone();
                std::thread::spawn(move || Self::serve(&stream, &tx, segment));
            }
        });
        Self { dir, requests }
    }

    fn serve(stream: &UnixStream, tx: &std::sync::mpsc::Sender<proto::Request>, mut segment: Option<u64>) {
        use packd_proto::frame::{FrameReader, MAX_FRAME_FDS, MAX_REQUEST_BYTES};
        let mut reader = FrameReader::new(MAX_REQUEST_BYTES, MAX_FRAME_FDS);
        while let Ok(frame) = packd_proto::stream::recv_frame(stream, &mut reader) {
            let Ok(req) = proto::Request::decode(frame.payload.as_slice()) else { return };
            let get = matches!(req.body, Some(proto::request::Body::Get(_)));
            let id = req.id;
            if tx.send(req).is_err() {
                return;
            }
            if let (true, Some(size)) = (get, segment.take()) {
                let memfd = memfd::MemfdOptions::default().allow_sealing(true).close_on_exec(true).create("silent");
                let memfd = memfd.expect("memfd");
                memfd.as_file().set_len(size).expect("size");
                memfd
                    .add_seals(&[
                        memfd::FileSeal::SealShrink,
                        memfd::FileSeal::SealGrow,
                        memfd::FileSeal::SealWrite,
                        memfd::FileSeal::SealSeal,
                    ])
                    .expect("seal");
                let reply = proto::Reply {
                    id,
                    body: Some(proto::reply::Body::Segment(proto::SegmentReply {
                        segment_id: 1,
                        generation: 1,
                        key: "b3:silent@plan:0".into(),
                        size,
                        ..Default::default()
                    })),
                };
                let bytes = packd_proto::frame::encode(&reply).expect("encode");
                packd_proto::stream::send_frame(stream.as_fd(), &bytes, Some(memfd.as_file().as_fd())).expect("send");
            }
        }
    }

    /// The socket directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

/// The XNNPACK root for the XNNPACK tests (`XNNPACK_ROOT`, or `.ci/cache/xnnpack/root`).
pub fn xnnpack_root() -> PathBuf {
    std::env::var_os("XNNPACK_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.ci/cache/xnnpack/root"))
}

/// The root of the current XNNPACK (ExecuTorch 1.5.1's, `examples/xnnpack/fetch-xnnpack-current`)
/// for the XNNPACK tests of the current interface (`XNNPACK_CURRENT_ROOT`, or
/// `.ci/cache/xnnpack-current/root`).
pub fn xnnpack_current_root() -> PathBuf {
    std::env::var_os("XNNPACK_CURRENT_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.ci/cache/xnnpack-current/root"))
}

/// The llama.cpp root for the llama.cpp tests (`LLAMA_ROOT`, or `.ci/cache/llama/0.3.36/root`,
/// made by `examples/llama/fetch-llama`).
pub fn llama_root() -> PathBuf {
    std::env::var_os("LLAMA_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.ci/cache/llama/0.3.36/root"))
}

/// The CPU's flags as the kernel reports them (`/proc/cpuinfo`: `flags` on x86,
/// `Features` on Arm), read apart from any feature detection the code under test uses.
pub fn cpu_flags() -> Vec<String> {
    let text = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with("flags") || l.starts_with("Features"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, f)| f.split_whitespace().map(str::to_string).collect())
        .unwrap_or_default()
}

/// Whether the CPU has every flag of `all` (see [`cpu_flags`]).
pub fn cpu_has(all: &[&str]) -> bool {
    let flags = cpu_flags();
    all.iter().all(|f| flags.iter().any(|g| g == f))
}

/// How `examples/llama/fetch-llama` built a root (its `cpu-build` file: `layout`, `amx`,
/// `cpu-amx-flags`, `c-flags`, `why`).
pub fn llama_root_build(root: &Path) -> std::collections::BTreeMap<String, String> {
    let path = root.join("cpu-build");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (a root made by an older fetch-llama: run it again)", path.display()));
    text.lines().filter_map(|l| l.split_once(' ')).map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// The GGUF the llama.cpp tests load (`PACKD_LLAMA_MODEL`, or `.ci/cache/llama/test.gguf`,
/// made by `examples/llama/make-model.py`).
pub fn llama_model() -> PathBuf {
    std::env::var_os("PACKD_LLAMA_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.ci/cache/llama/test.gguf"))
}

/// The inode of the memfd named `name` that process `pid` maps with permissions starting
/// `perms` (`rw-s`: writable and shared; `r`: any readable), if it maps one.
pub fn mapped_memfd_inode(pid: u32, name: &str, perms: &str) -> Option<u64> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    let memfd = format!("/memfd:{name} ");
    maps.lines()
        .find(|l| l.contains(&memfd) && l.split_whitespace().nth(1).is_some_and(|p| p.starts_with(perms)))
        .and_then(|l| l.split_whitespace().nth(4)?.parse().ok())
}

/// Builds `libpackd_llama.so` once per test process and returns its path.
pub fn llama_lib() -> &'static Path {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| build_lib("packd-llama", "libpackd_llama.so").join("libpackd_llama.so"))
}

/// Builds `examples/llama/holder.c` against [`llama_root`] once per test process (with no
/// run path: run it with `LD_LIBRARY_PATH` set to the libraries it should load).
pub fn llama_holder() -> &'static Path {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| build_holder("llama-holder", false))
}

/// The same holder built to `dlopen` llama.cpp at run time (`RTLD_LOCAL`, as Python's ctypes
/// loads it) from its `--lib PATH`.
pub fn llama_holder_dlopen() -> &'static Path {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| build_holder("llama-holder-dlopen", true))
}

fn build_holder(name: &str, dlopen: bool) -> PathBuf {
    let root = llama_root();
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/llama/holder.c");
    let out = bin_dir().join(name);
    let mut cc = Command::new("cc");
    cc.args(["-O2", "-Wall", "-Wextra", "-Werror"]).arg(&src).arg("-I").arg(root.join("include"));
    // llama.cpp before `load_mode` (0.3.36) says `use_mmap`.
    let header = std::fs::read_to_string(root.join("include/llama.h")).unwrap_or_default();
    if !header.contains("enum llama_load_mode") {
        cc.arg("-DHOLDER_USE_MMAP_BOOL");
    }
    if dlopen {
        cc.args(["-DHOLDER_DLOPEN", "-ldl"]);
    } else {
        cc.arg("-L").arg(root.join("lib")).args(["-lllama", "-lggml", "-lggml-base"]);
        cc.arg(format!("-Wl,-rpath-link,{}", root.join("lib").display()));
    }
    let built = cc.arg("-o").arg(&out).output().expect("run cc");
    assert!(built.status.success(), "cc holder.c: {}", String::from_utf8_lossy(&built.stderr));
    out
}

/// Builds `package`'s library into the directory holding the workspace's binaries (`cargo
/// test` does not build a library's C artifacts for other crates' tests) and checks that
/// `file` is there.
fn build_lib(package: &str, file: &str) -> PathBuf {
    let dir = bin_dir();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let built = Command::new(env!("CARGO"))
        .args(["build", "--quiet", "-p", package, "--lib"])
        .env("CARGO_TARGET_DIR", dir.parent().expect("target dir"))
        .current_dir(&root)
        .status()
        .expect("run cargo build");
    assert!(built.success(), "cargo build -p {package} failed");
    assert!(dir.join(file).exists(), "{file} not built in {}", dir.display());
    dir
}

/// Builds `libpackd_xnnpack_preload.so` once per test process and returns its path.
pub fn preload_lib() -> &'static Path {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| {
        build_lib("packd-xnnpack-preload", "libpackd_xnnpack_preload.so").join("libpackd_xnnpack_preload.so")
    })
}

/// Builds libpackd_client (packd-capi's cdylib and staticlib) once per test process and
/// returns the directory holding it.
pub fn capi_lib_dir() -> &'static Path {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| {
        let dir = build_lib("packd-capi", "libpackd_client.so");
        // Programs linked here ask for the SONAME (capi/build.rs): its link, as ldconfig makes.
        let link = dir.join(client_soname());
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink("libpackd_client.so", &link).expect("SONAME link");
        dir
    })
}

/// The C library's SONAME: `libpackd_client.so.X.Y` for 0.Y releases, `.so.X` from 1.0.
pub fn client_soname() -> String {
    let (major, minor) = (env!("CARGO_PKG_VERSION_MAJOR"), env!("CARGO_PKG_VERSION_MINOR"));
    if major == "0" { format!("libpackd_client.so.{major}.{minor}") } else { format!("libpackd_client.so.{major}") }
}

/// A loopback port nobody listens on now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// `GET path` on 127.0.0.1:port over HTTP/1.1: (status line, body).
pub fn http_get(port: u16, path: &str) -> (String, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect to the metrics listener");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    write!(s, "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").expect("write");
    let mut text = String::new();
    s.read_to_string(&mut text).expect("read");
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP answer");
    (head.lines().next().unwrap_or_default().to_string(), body.to_string())
}
