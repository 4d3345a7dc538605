//! The XNNPACK provider's conformance suite: every operator that takes static weights, on
//! two real XNNPACKs — Debian trixie's 2024-11 build and the current one ExecuTorch 1.5.1's
//! wheel carries (fingerprint ids, `alias_data`) — through `examples/xnnpack/ops-worker`.
//! Per operator: XNNPACK's own cache computes what no cache does; four workers started at
//! once build once; the three others compute the same bytes, never crash and never pack a
//! weight they looked up; an operator XNNPACK does not pass through its cache is reported
//! as such (and its builder gives its role up at once). Addresses are reused: A, B at A's
//! addresses, A again, through one cache, hit only what is theirs. Unnameable weights make
//! the builder give its role up, and its waiters go private while it still runs.
//!
//! Needs the XNNPACK roots (`.ci/run` fetches both).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use packd_tests::{Daemon, SafeTensors, values, wait_until, xnnpack_current_root, xnnpack_root};

/// What an XNNPACK does with an operator's weights and its cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path_ {
    /// Looks up, and on a miss reserves, packs and inserts: later workers hit, pack nothing.
    LookedUp,
    /// Never looks up (depthwise convolution, deconvolution): every worker packs into
    /// scratch, and the insert answers with the shared copy (deduplicated, nothing kept).
    InsertOnly,
    /// Never touches the cache (batch matrix multiply's static operand, PReLU).
    Bypass,
    /// Looks up with a key whose kernel is a copy XNNPACK made and never names (the current
    /// XNNPACK's fully connected f16 inference converts the f32 weights into a buffer of its
    /// own, without `alias_data`): nothing can be shared; every worker packs privately,
    /// counted as `unnamed`.
    Unnamed,
}

/// XNNPACK 2024-11 (Debian trixie).
const OPS_2024_11: [(&str, Path_); 16] = [
    ("conv-f32", Path_::LookedUp),
    ("conv-f16", Path_::LookedUp),
    ("conv-grouped-f32", Path_::LookedUp),
    ("conv1x1-f32", Path_::LookedUp),
    ("conv-qs8", Path_::LookedUp),
    ("conv-qd8", Path_::LookedUp),
    ("dwconv-f32", Path_::Bypass),
    ("deconv-f32", Path_::InsertOnly),
    ("fc-f32", Path_::LookedUp),
    ("fc-f16", Path_::LookedUp),
    ("fc-qd8", Path_::LookedUp),
    ("fc-qs8", Path_::LookedUp),
    ("fc-qc4w", Path_::LookedUp),
    ("bmm-f32", Path_::Bypass),
    ("prelu-f32", Path_::Bypass),
    ("convnet-f32", Path_::LookedUp),
];

/// Int8 weights in [-127, 127] (as bytes).
/// XNNPACK 92a7ad5 (ExecuTorch 1.5.1): depthwise convolution looks up too.
const OPS_CURRENT: [(&str, Path_); 16] = [
    ("conv-f32", Path_::LookedUp),
    ("conv-f16", Path_::LookedUp),
    ("conv-grouped-f32", Path_::LookedUp),
    ("conv1x1-f32", Path_::LookedUp),
    ("conv-qs8", Path_::LookedUp),
    ("conv-qd8", Path_::LookedUp),
    ("dwconv-f32", Path_::LookedUp),
    ("deconv-f32", Path_::InsertOnly),
    ("fc-f32", Path_::LookedUp),
    ("fc-f16", Path_::Unnamed),
    ("fc-qd8", Path_::LookedUp),
    ("fc-qs8", Path_::LookedUp),
    ("fc-qc4w", Path_::LookedUp),
    ("bmm-f32", Path_::Bypass),
    ("prelu-f32", Path_::Bypass),
    ("convnet-f32", Path_::LookedUp),
];

/// An XNNPACK to run the suite on.
struct Xnn {
    root: PathBuf,
    interface: u64,
    ops: [(&'static str, Path_); 16],
}

fn trixie() -> Xnn {
    Xnn { root: xnnpack_root(), interface: 202_411, ops: OPS_2024_11 }
}

fn current() -> Xnn {
    Xnn { root: xnnpack_current_root(), interface: 202_603, ops: OPS_CURRENT }
}

/// Why XNNPACK `x` itself computes `op` wrongly on this CPU, if it does (from the CPU's
/// flags): XNNPACK 2024-11 as Debian built it (GCC) takes its AMX qd8-f32-qc4w GEMM where
/// the CPU has AMX-INT8 with AVX-512 F/BW/DQ/VL, VNNI and GFNI, and that kernel tile-loads a
/// stack buffer its compiler never stored the unpacked weights into (GCC's `_tile_loadd`
/// has no memory clobber): for k >= 64 (fc-qc4w's k is 68) the output is garbage that
/// changes from process to process, with or without any cache. Such an operator runs with
/// AMX denied (`--no-amx`: XNNPACK's AVX-512 kernel), where every check holds as elsewhere.
fn broken_in_xnnpack(x: &Xnn, op: &str) -> Option<&'static str> {
    let amx = ["amx_tile", "amx_int8", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "gfni"];
    (x.interface == 202_411 && op == "fc-qc4w" && packd_tests::cpu_has(&amx)).then_some(
        "XNNPACK 2024-11's AMX qd8-f32-qc4w GEMM multiplies weights it never stored (GCC's _tile_loadd \
         without a memory clobber): undefined output for k >= 64",
    )
}

/// `args`, with `--no-amx` where XNNPACK's own kernel for `op` is broken on this CPU.
fn op_args<'a>(x: &Xnn, op: &str, args: &[&'a str]) -> Vec<&'a str> {
    let mut v = args.to_vec();
    if broken_in_xnnpack(x, op).is_some() {
        v.push("--no-amx");
    }
    v
}

/// XNNPACK's own determinism for `op` on this CPU: two runs with no cache and one with its
/// own cache compute the same bytes, unless [`broken_in_xnnpack`] names why not (then the
/// operator is reported by name, and run with AMX denied everywhere else).
fn xnnpack_itself_is_deterministic(x: &Xnn, dir: &Path, m: &str, op: &str) -> Option<String> {
    let run = |extra: &[&str]| {
        let mut args = vec!["--model", m, "--op", op];
        args.extend_from_slice(extra);
        worker(x, dir, &args)["output_blake3"].clone()
    };
    let outs = [run(&["--no-cache"]), run(&["--no-cache"]), run(&["--private"])];
    let same = outs.iter().all(|o| *o == outs[0]);
    match broken_in_xnnpack(x, op) {
        None => {
            assert!(same, "{op}: XNNPACK alone computes different bytes run to run on this CPU: {outs:?}");
            None
        }
        Some(why) => {
            let report = format!(
                "{op}: {why} (on this CPU, alone: {})",
                if same { "the same bytes this time" } else { "different bytes" }
            );
            println!("XNNPACK itself fails here: {report}");
            Some(report)
        }
    }
}

fn bytes_i8(n: usize, seed: u32) -> Vec<u8> {
    (0..u32::try_from(n).expect("small"))
        .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) % 255).to_le_bytes()[0].wrapping_add(129))
        .collect()
}

/// Int32 biases in [-5000, 5000).
fn bytes_i32(n: usize, seed: u32) -> Vec<u8> {
    (0..u32::try_from(n).expect("small"))
        .flat_map(|i| (((i.wrapping_mul(2_654_435_761) ^ seed) % 10_000) as i32 - 5000).to_le_bytes())
        .collect()
}

fn scales(n: usize, seed: u32) -> Vec<f32> {
    values(n, seed).iter().map(|v| 0.002 + v.abs() * 0.01).collect()
}

/// The operators' weights, under the names `ops.c` reads; `seed` makes another model.
fn ops_model(path: &Path, seed: u32) {
    let s = seed * 100;
    SafeTensors::default()
        .f32("conv.weight", &[19, 3, 3, 13], &values(19 * 9 * 13, s + 1))
        .f32("conv.bias", &[19], &values(19, s + 2))
        .add("conv.qweight", "I8", &[19, 3, 3, 13], bytes_i8(19 * 9 * 13, s + 3))
        .f32("conv.qscale", &[19], &scales(19, s + 4))
        .add("conv.qbias", "I32", &[19], bytes_i32(19, s + 5))
        .f32("gconv.weight", &[15, 3, 3, 4], &values(15 * 9 * 4, s + 6))
        .f32("gconv.bias", &[15], &values(15, s + 7))
        .f32("pw.weight", &[24, 1, 1, 32], &values(24 * 32, s + 8))
        .f32("pw.bias", &[24], &values(24, s + 9))
        .f32("dw.weight", &[1, 3, 3, 16], &values(9 * 16, s + 10))
        .f32("dw.bias", &[16], &values(16, s + 11))
        .f32("deconv.weight", &[5, 3, 3, 6], &values(5 * 9 * 6, s + 12))
        .f32("deconv.bias", &[5], &values(5, s + 13))
        .f32("fc.weight", &[45, 67], &values(45 * 67, s + 14))
        .f32("fc.bias", &[45], &values(45, s + 15))
        .add("fc.qweight", "I8", &[45, 67], bytes_i8(45 * 67, s + 16))
        .f32("fc.qscale", &[45], &scales(45, s + 17))
        .add("fc.qbias", "I32", &[45], bytes_i32(45, s + 18))
        .add("fc.q4weight", "U8", &[45, 34], bytes_i8(45 * 34, s + 19))
        .f32("fc.q4scale", &[45], &scales(45, s + 20))
        .f32("bmm.weight", &[2, 10, 6], &values(120, s + 21))
        .f32("prelu.slope", &[16], &values(16, s + 22))
        .f32("net.conv.weight", &[64, 3, 3, 32], &values(64 * 9 * 32, s + 23))
        .f32("net.conv.bias", &[64], &values(64, s + 24))
        .f32("net.dw.weight", &[1, 3, 3, 64], &values(9 * 64, s + 25))
        .f32("net.dw.bias", &[64], &values(64, s + 26))
        .f32("net.pw.weight", &[64, 1, 1, 64], &values(64 * 64, s + 27))
        .f32("net.pw.bias", &[64], &values(64, s + 28))
        .f32("net.fc1.weight", &[768, 1024], &values(768 * 1024, s + 29))
        .f32("net.fc1.bias", &[768], &values(768, s + 30))
        .f32("net.fc2.weight", &[3072, 768], &values(3072 * 768, s + 31))
        .f32("net.fc2.bias", &[3072], &values(3072, s + 32))
        .write(path);
}

fn worker_cmd(x: &Xnn, dir: &Path, args: &[&str]) -> Command {
    let lib = packd_tests::capi_lib_dir();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/xnnpack/ops-worker");
    let mut cmd = Command::new(script);
    cmd.env("XNNPACK_ROOT", &x.root)
        .env("PACKD_LIB_DIR", lib)
        .env("CARGO_TARGET_DIR", lib.parent().expect("target dir"))
        .arg("--socket-dir")
        .arg(dir)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

fn parse(text: &str) -> serde_json::Value {
    serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("ops-worker printed {text:?}: {e}"))
}

/// Runs the worker to its end and returns its JSON line.
fn worker(x: &Xnn, dir: &Path, args: &[&str]) -> serde_json::Value {
    let out = worker_cmd(x, dir, args).output().expect("run ops-worker");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "ops-worker {args:?} failed ({}): {text}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    parse(&text)
}

/// Waits for a spawned worker and returns its JSON line.
fn finish(child: Child, what: &str) -> serde_json::Value {
    let out = child.wait_with_output().expect("wait");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{what} failed ({}): {text}{}", out.status, String::from_utf8_lossy(&out.stderr));
    parse(&text)
}

#[test]
#[cfg_attr(
    not(packd_xnnpack),
    ignore = "needs an XNNPACK root: run .ci/run, or set XNNPACK_ROOT (examples/xnnpack/fetch-xnnpack)"
)]
fn every_operator_on_xnnpack_2024_11() {
    every_operator_builds_once_and_later_workers_compute_the_same_bytes_packing_nothing_they_looked_up(&trixie());
}

#[test]
#[cfg_attr(
    not(packd_xnnpack_current),
    ignore = "needs the current XNNPACK: run .ci/run, or set XNNPACK_CURRENT_ROOT \
              (examples/xnnpack/fetch-xnnpack-current)"
)]
fn every_operator_on_the_current_xnnpack() {
    every_operator_builds_once_and_later_workers_compute_the_same_bytes_packing_nothing_they_looked_up(&current());
}

fn every_operator_builds_once_and_later_workers_compute_the_same_bytes_packing_nothing_they_looked_up(x: &Xnn) {
    let d = Daemon::start();
    let model = d.dir().join("ops.safetensors");
    ops_model(&model, 1);
    let m = model.to_str().unwrap();
    let listed = worker_cmd(x, d.dir(), &["--list"]).output().expect("list");
    let listed: Vec<String> = String::from_utf8_lossy(&listed.stdout).lines().map(str::to_string).collect();
    assert_eq!(listed, x.ops.map(|(op, _)| op.to_string()), "the suite covers every operator ops.c has");
    let mut failing = Vec::new();
    for (op, path) in x.ops {
        failing.extend(xnnpack_itself_is_deterministic(x, d.dir(), m, op));
        let reference = worker(x, d.dir(), &op_args(x, op, &["--model", m, "--op", op, "--no-cache"]));
        let digest = &reference["output_blake3"];
        let own = worker(x, d.dir(), &op_args(x, op, &["--model", m, "--op", op, "--private"]));
        assert_eq!(&own["output_blake3"], digest, "{op}: XNNPACK's own cache computes what no cache does: {own}");
        assert_eq!(own["interface"], x.interface, "{own}");
        assert_eq!(own["engine_interface"], x.interface, "told at run time from the library's symbols: {own}");

        // Four workers at once: one builds, three wait (until the test lets the builder
        // finalize), then are served (or, for an operator that bypasses the cache, told at
        // once that the builder had nothing to publish).
        let go = d.dir().join(format!("go-{op}"));
        let args = op_args(x, op, &["--model", m, "--op", op, "--finalize-when", go.to_str().unwrap()]);
        let (builds, waits) = (d.stat("builds") + 1, d.stat("build_waits") + 3);
        let children: Vec<Child> = (0..4).map(|_| worker_cmd(x, d.dir(), &args).spawn().expect("spawn")).collect();
        assert!(
            wait_until(Duration::from_secs(60), || d.stat("builds") == builds && d.stat("build_waits") == waits),
            "{op}: one builds, three wait: {} builds, {} waits",
            d.stat("builds"),
            d.stat("build_waits")
        );
        std::fs::write(&go, b"").unwrap();
        let lines: Vec<serde_json::Value> = children.into_iter().map(|c| finish(c, op)).collect();
        for l in &lines {
            assert_eq!(&l["output_blake3"], digest, "{op}: every worker computes what no cache does: {l}");
        }
        let builder = lines
            .iter()
            .find(|l| l["cache"] != "served" && l["reason"].as_str().is_none_or(|r| !r.contains("gave its role up")));
        let builder = builder.unwrap_or_else(|| panic!("{op}: no builder among {lines:?}"));
        let others: Vec<&serde_json::Value> = lines.iter().filter(|l| !std::ptr::eq(*l, builder)).collect();
        match path {
            Path_::LookedUp | Path_::InsertOnly => {
                assert_eq!(builder["cache"], "published", "{op}: {builder}");
                assert_eq!(
                    builder["reserve_space"], own["reserve_space"],
                    "{op}: packd's provider packs what XNNPACK's cache does"
                );
                assert_eq!(builder["bytes_private"], 0, "{op}: {builder}");
                for l in &others {
                    assert_eq!(l["cache"], "served", "{op}: {l}");
                    assert_eq!(l["bytes_private"], 0, "{op}: nothing held privately: {l}");
                    assert!(l["bytes_shared"].as_u64() > Some(0), "{op}: mapped after finalize: {l}");
                    if path == Path_::LookedUp {
                        assert_eq!(
                            (l["misses"].as_u64(), l["reserve_space"].as_u64()),
                            (Some(0), Some(0)),
                            "{op}: {l}"
                        );
                        assert!(l["hits"].as_u64() >= Some(1), "{op}: {l}");
                    } else {
                        assert_eq!(
                            l["deduplicated"], l["reserve_space"],
                            "{op}: every scratch packing answered by the shared copy: {l}"
                        );
                        assert!(l["reserve_space"].as_u64() >= Some(1), "{op}: {l}");
                    }
                }
            }
            Path_::Bypass | Path_::Unnamed => {
                assert_eq!(builder["cache"], "private", "{op}: {builder}");
                if path == Path_::Bypass {
                    assert_eq!(own["reserve_space"], 0, "{op} bypasses XNNPACK's own cache too: {own}");
                }
                for l in lines.iter() {
                    let calls = (l["hits"].as_u64(), l["reserve_space"].as_u64(), l["unnamed"].as_u64());
                    let want = if path == Path_::Bypass {
                        (Some(0), Some(0), Some(0))
                    } else {
                        (Some(0), own["reserve_space"].as_u64(), own["reserve_space"].as_u64())
                    };
                    assert_eq!(calls, want, "{op}: {l}");
                }
                for l in &others {
                    assert!(l["reason"].as_str().is_some_and(|r| r.contains("gave its role up")), "{op}: {l}");
                }
            }
        }
        // A worker started later is served without waiting (or, bypassing, builds again).
        let later = worker(x, d.dir(), &op_args(x, op, &["--model", m, "--op", op]));
        assert_eq!(&later["output_blake3"], digest, "{op}: {later}");
    }
    assert_eq!(d.stat("builds_expired"), 0);
    println!("operators XNNPACK itself computes wrongly on this CPU: {failing:?}");
}

#[test]
#[cfg_attr(
    not(packd_xnnpack),
    ignore = "needs an XNNPACK root: run .ci/run, or set XNNPACK_ROOT (examples/xnnpack/fetch-xnnpack)"
)]
fn a_model_mapped_where_another_was_never_hits_the_others_packings_on_xnnpack_2024_11() {
    a_model_mapped_where_another_was_never_hits_the_others_packings(&trixie());
}

#[test]
#[cfg_attr(
    not(packd_xnnpack_current),
    ignore = "needs the current XNNPACK: run .ci/run, or set XNNPACK_CURRENT_ROOT \
              (examples/xnnpack/fetch-xnnpack-current)"
)]
fn a_model_mapped_where_another_was_never_hits_the_others_packings_on_the_current_xnnpack() {
    a_model_mapped_where_another_was_never_hits_the_others_packings(&current());
}

fn a_model_mapped_where_another_was_never_hits_the_others_packings(x: &Xnn) {
    let d = Daemon::start();
    let (a, b) = (d.dir().join("a.safetensors"), d.dir().join("b.safetensors"));
    ops_model(&a, 1);
    ops_model(&b, 2);
    for op in ["conv-f32", "fc-f32", "fc-qd8", "dwconv-f32"] {
        let r = worker(x, d.dir(), &["--reuse", a.to_str().unwrap(), b.to_str().unwrap(), op]);
        assert_eq!(r["same_address"], true, "{op}: B was mapped where A had been, and A again there: {r}");
        assert_eq!(r["outputs_match"], true, "{op}: A, B, A computed what no cache does: {r}");
        if x.ops.iter().any(|&(o, p)| o == op && p == Path_::LookedUp) {
            assert!(r["hits"].as_u64() >= Some(1), "{op}: A's second run hit A's first packing: {r}");
        }
    }
}

#[test]
#[cfg_attr(
    not(packd_xnnpack),
    ignore = "needs an XNNPACK root: run .ci/run, or set XNNPACK_ROOT (examples/xnnpack/fetch-xnnpack)"
)]
fn unnameable_weights_make_the_builder_give_up_at_once_on_xnnpack_2024_11() {
    unnameable_weights_make_the_builder_give_up_at_once_and_its_waiters_never_wait_for_its_exit(&trixie());
}

#[test]
#[cfg_attr(
    not(packd_xnnpack_current),
    ignore = "needs the current XNNPACK: run .ci/run, or set XNNPACK_CURRENT_ROOT \
              (examples/xnnpack/fetch-xnnpack-current)"
)]
fn unnameable_weights_make_the_builder_give_up_at_once_on_the_current_xnnpack() {
    unnameable_weights_make_the_builder_give_up_at_once_and_its_waiters_never_wait_for_its_exit(&current());
}

fn unnameable_weights_make_the_builder_give_up_at_once_and_its_waiters_never_wait_for_its_exit(x: &Xnn) {
    let d = Daemon::start();
    let model = d.dir().join("ops.safetensors");
    ops_model(&model, 1);
    let m = model.to_str().unwrap();
    let digest = worker(x, d.dir(), &["--model", m, "--op", "conv-f32", "--no-cache"])["output_blake3"].clone();
    let go = d.dir().join("go");
    // The builder stays alive for a long time after finalizing; its waiters must not wait
    // for that.
    let builder_args =
        ["--model", m, "--op", "conv-f32", "--unnamed", "--finalize-when", go.to_str().unwrap(), "--hold", "600"];
    let mut builder = worker_cmd(x, d.dir(), &builder_args).spawn().expect("spawn");
    assert!(wait_until(Duration::from_secs(60), || d.stat("builds") == 1), "the first worker builds");
    let args = ["--model", m, "--op", "conv-f32", "--unnamed"];
    let waiters: Vec<Child> = (0..3).map(|_| worker_cmd(x, d.dir(), &args).spawn().expect("spawn")).collect();
    assert!(wait_until(Duration::from_secs(60), || d.stat("build_waits") == 3), "three wait");
    std::fs::write(&go, b"").unwrap();
    let mut line = String::new();
    BufReader::new(builder.stdout.as_mut().expect("stdout")).read_line(&mut line).expect("read");
    let first = parse(&line);
    assert_eq!(first["cache"], "private", "{first}");
    assert!(first["reason"].as_str().is_some_and(|r| r.contains("no weight could be named")), "{first}");
    for w in waiters {
        let l = finish(w, "waiter");
        assert_eq!(l["cache"], "private", "{l}");
        assert!(l["reason"].as_str().is_some_and(|r| r.contains("gave its role up")), "{l}");
        assert_eq!(l["output_blake3"], digest, "{l}");
    }
    assert_eq!(builder.try_wait().unwrap(), None, "the waiters finished while the builder still runs");
    builder.kill().unwrap();
    let _ = builder.wait();
    assert_eq!((d.stat("builds_given_up"), d.stat("builds_expired"), d.stat("publishes")), (1, 0, 0));
}

/// The ops worker's binary for `x`, built by `examples/xnnpack/build` (self-contained: its
/// loader and libraries are in its ELF), to run directly with `LD_PRELOAD` (not through
/// the shell script, whose helpers would load the preload library too).
fn worker_bin(x: &Xnn) -> PathBuf {
    let lib = packd_tests::capi_lib_dir();
    let build = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/xnnpack/build");
    let out = Command::new(build)
        .args(["ops.c", "ops-worker"])
        .env("XNNPACK_ROOT", &x.root)
        .env("PACKD_LIB_DIR", lib)
        .env("CARGO_TARGET_DIR", lib.parent().expect("target dir"))
        .output()
        .expect("build the ops worker");
    assert!(out.status.success(), "build failed: {}", String::from_utf8_lossy(&out.stderr));
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// The ops worker with no weights cache of its own (as an engine that passes none, like
/// ExecuTorch by default), adopted by packd through `LD_PRELOAD`; the preload library
/// appends its status to `status`.
fn adopted_cmd(bin: &Path, dir: &Path, status: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(bin);
    cmd.env("LD_PRELOAD", packd_tests::preload_lib())
        .env("PACKD_SOCKET_DIR", dir)
        .env("PACKD_XNNPACK_STATUS", status)
        .arg("--socket-dir")
        .arg(dir)
        .arg("--no-cache")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

fn adopted_status(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("no status at {}: {e}", path.display()));
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1, "one process with XNNPACK wrote its status: {text}");
    parse(lines[0])
}

#[test]
#[cfg_attr(
    not(packd_xnnpack),
    ignore = "needs an XNNPACK root: run .ci/run, or set XNNPACK_ROOT (examples/xnnpack/fetch-xnnpack)"
)]
fn an_unmodified_engine_adopted_through_ld_preload_shares_every_operator_on_xnnpack_2024_11() {
    an_unmodified_engine_adopted_through_ld_preload_shares_every_operator(&trixie());
}

#[test]
#[cfg_attr(
    not(packd_xnnpack_current),
    ignore = "needs the current XNNPACK: run .ci/run, or set XNNPACK_CURRENT_ROOT \
              (examples/xnnpack/fetch-xnnpack-current)"
)]
fn an_unmodified_engine_adopted_through_ld_preload_shares_every_operator_on_the_current_xnnpack() {
    an_unmodified_engine_adopted_through_ld_preload_shares_every_operator(&current());
}

/// Per operator: four workers that pass XNNPACK no weights cache, started at once under
/// the preload library, compute what they compute without it; one builds, the others are
/// served and pack nothing they looked up; packd being away changes nothing but the reason.
fn an_unmodified_engine_adopted_through_ld_preload_shares_every_operator(x: &Xnn) {
    let d = Daemon::start();
    let model = d.dir().join("ops.safetensors");
    ops_model(&model, 1);
    let m = model.to_str().unwrap();
    let bin = worker_bin(x);
    for (op, path) in x.ops {
        // Where XNNPACK's own kernel is broken on this CPU, with AMX denied (see
        // `broken_in_xnnpack`; the suite above reports it).
        let reference = worker(x, d.dir(), &op_args(x, op, &["--model", m, "--op", op, "--no-cache"]));
        let digest = &reference["output_blake3"];
        let builds = d.stat("builds");
        let status: Vec<PathBuf> = (0..4).map(|i| d.dir().join(format!("status-{op}-{i}"))).collect();
        let args = op_args(x, op, &["--model", m, "--op", op]);
        let children: Vec<Child> =
            status.iter().map(|s| adopted_cmd(&bin, d.dir(), s, &args).spawn().expect("spawn")).collect();
        for c in children {
            let l = finish(c, op);
            assert_eq!(&l["output_blake3"], digest, "{op}: adopted, the worker computes what it does alone: {l}");
        }
        let s: Vec<serde_json::Value> = status.iter().map(|p| adopted_status(p)).collect();
        // Each static tensor named once (weights and bias; one operand for BMM and PReLU;
        // five layers of two for the network), however XNNPACK chains its definitions.
        let statics = match op {
            "bmm-f32" | "prelu-f32" => 1,
            "convnet-f32" => 10,
            _ => 2,
        };
        for one in &s {
            assert_eq!(one["tensors_named"], statics, "{op}: {one}");
            assert_eq!(one["interface"], x.interface, "{op}: {one}");
            assert_eq!(one["runtimes"], 1, "{op}: {one}");
            assert_eq!(one["hooked"].as_array().map(Vec::len).map(|n| n >= 1), Some(true), "{op}: {one}");
        }
        let count = |k: &str| s.iter().filter(|one| one[k] == 1).count();
        match path {
            Path_::LookedUp | Path_::InsertOnly => {
                assert_eq!((count("built"), count("served")), (1, 3), "{op}: one builds, three are served: {s:?}");
                assert_eq!(d.stat("builds"), builds + 1, "{op}");
                for one in s.iter().filter(|one| one["served"] == 1) {
                    if path == Path_::LookedUp {
                        assert_eq!((&one["misses"], &one["reserve_space"]), (&0.into(), &0.into()), "{op}: {one}");
                        assert!(one["hits"].as_u64() >= Some(1), "{op}: {one}");
                    }
                }
            }
            Path_::Bypass | Path_::Unnamed => {
                assert_eq!(count("served"), 0, "{op}: nothing to share: {s:?}");
            }
        }
    }
    // An engine that brings its own weights cache (the worker's --private: XNNPACK's) keeps
    // it: the worker says why it does not share, and packd counts its report.
    let reports = d.stat("private_reports");
    let status = d.dir().join("status-own");
    let mut own = adopted_cmd(&bin, d.dir(), &status, &[]);
    own.args(["--model", m, "--op", "fc-f32"]);
    let own_args: Vec<String> =
        own.get_args().map(|a| a.to_string_lossy().into_owned()).filter(|a| a != "--no-cache").collect();
    let mut cmd = Command::new(&bin);
    cmd.envs(own.get_envs().filter_map(|(k, v)| v.map(|v| (k.to_owned(), v.to_owned()))))
        .args(&own_args)
        .arg("--private")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let l = finish(cmd.spawn().expect("spawn"), "fc-f32 with its own cache");
    let s = adopted_status(&status);
    assert_eq!((&s["private"], &s["served"], &s["built"]), (&1.into(), &0.into(), &0.into()), "{s} {l}");
    let reasons = s["reasons"].as_object().expect("reasons");
    assert!(reasons.keys().any(|r| r.starts_with("the engine passed a weights cache of its own")), "{s}");
    assert!(
        wait_until(Duration::from_secs(10), || d.stat("private_reports") == reports + 1),
        "packd counts the worker's report: {}",
        d.stat("private_reports")
    );
    assert_eq!(s["fallbacks"]["engine_cache"], 1, "{s}");
    assert!(d.stats()["private_fallbacks"]["engine_cache"].as_u64() >= Some(1), "{}", d.stats());

    // packd away (the worker maps its model from the daemon, but the preload library is
    // pointed elsewhere): the worker computes the same, packs privately, and says why.
    let reference = worker(x, d.dir(), &["--model", m, "--op", "fc-f32", "--no-cache"]);
    let status = d.dir().join("status-away");
    let out = adopted_cmd(&bin, d.dir(), &status, &["--model", m, "--op", "fc-f32"])
        .env("PACKD_SOCKET_DIR", d.dir().join("nowhere"))
        .spawn()
        .expect("spawn");
    let l = finish(out, "fc-f32, packd away");
    assert_eq!(l["output_blake3"], reference["output_blake3"], "{l}");
    let s = adopted_status(&status);
    assert_eq!((&s["private"], &s["served"], &s["built"]), (&1.into(), &0.into(), &0.into()), "{s}");
    let reasons = s["reasons"].as_object().expect("reasons");
    assert!(reasons.keys().any(|r| r.starts_with("packd is away")), "{s}");
    assert_eq!(s["fallbacks"]["daemon_away"], 1, "{s}");
}
