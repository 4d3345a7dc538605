//! Real llama.cpp (one of the versions packd-llama supports, built as shared libraries and
//! llama-server from PyPI's llama-cpp-python sdist by examples/llama/fetch-llama; `.ci/run`
//! runs this file on each) repacking a real GGUF (examples/llama/make-model.py: every type
//! any supported version repacks) through packd with `LD_PRELOAD=libpackd_llama.so`, against
//! the real daemon: later workers repack nothing and compute bit-identical logits; four at
//! once build once; four llama-server processes at once answer over HTTP as without packd;
//! a builder killed mid-repack hands the role on, one whose build cannot be sealed gives it
//! up; a restart serves the copy with no build; a model changed by one block never hits; the
//! ggml version just outside the supported ones, and packd away, leave llama.cpp as it is
//! and say why.
//!
//! Needs `LLAMA_ROOT` (examples/llama/fetch-llama prints it) and `PACKD_LLAMA_MODEL` (a GGUF
//! written by `examples/llama/make-model.py` with its defaults); `.ci/run` makes both under
//! `.ci/cache/llama/`.

use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use packd_tests::{
    Daemon, llama_holder, llama_holder_dlopen, llama_lib, llama_model, llama_root, mapped_memfd_inode, wait_until,
};

/// The holder under `lib_dir`'s llama.cpp, with packd-llama preloaded (unless `plain`).
fn holder_cmd(dir: &Path, lib_dir: &Path, model: &Path, plain: bool, env: &[(&str, &str)]) -> Command {
    holder_cmd_of(llama_holder(), dir, lib_dir, model, plain, env)
}

fn holder_cmd_of(bin: &Path, dir: &Path, lib_dir: &Path, model: &Path, plain: bool, env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(bin);
    // From the libraries' directory: in the release layout, llama_backend_init loads the
    // CPU backend's best module from beside the program or from the current directory.
    cmd.arg(model)
        .current_dir(lib_dir)
        .env("LD_LIBRARY_PATH", lib_dir)
        .env("PACKD_SOCKET_DIR", dir)
        .env("PACKD_NAMES", dir.join("names"))
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if !plain {
        cmd.env("LD_PRELOAD", llama_lib()).env("PACKD_LLAMA_STATUS", "stderr");
    }
    cmd
}

/// What one worker printed: its JSON line, packd-llama's status (null without it), stderr.
struct Run {
    out: serde_json::Value,
    status: serde_json::Value,
    stderr: String,
}

fn finish(child: Child) -> Run {
    let out = child.wait_with_output().expect("wait for the holder");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "holder failed: {stdout}{stderr}");
    let json = |s: &str| serde_json::from_str::<serde_json::Value>(s).unwrap_or_else(|e| panic!("{s:?}: {e}"));
    let line = stdout.lines().next().unwrap_or_else(|| panic!("holder printed nothing: {stderr}"));
    let status = stderr.lines().rev().find(|l| l.starts_with("{\"enabled\"")).map_or(serde_json::Value::Null, json);
    Run { out: json(line), status, stderr }
}

fn run(dir: &Path, model: &Path, env: &[(&str, &str)]) -> Run {
    finish(holder_cmd(dir, &llama_root().join("lib"), model, false, env).spawn().expect("spawn the holder"))
}

/// llama.cpp's own logits digest for `model` (with its repack, without packd).
fn baseline(dir: &Path, model: &Path) -> String {
    let r = finish(holder_cmd(dir, &llama_root().join("lib"), model, true, &[]).spawn().expect("spawn"));
    assert_eq!(r.out["repack"], true);
    r.out["logits"].as_str().expect("logits").to_string()
}

fn n(v: &serde_json::Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("no {key} in {v}"))
}

/// The tensors llama.cpp's CPU_REPACK takes from the test model, by ggml type name, as every
/// supported version's `ggml_repack_get_optimal_repack_type` chooses them on this CPU (the
/// model, make-model.py's `--quant mixed`, holds every type it repacks on x86 and Arm): on
/// x86 with AVX2 Q4_0 (attn_q/k/v and the output), IQ4_NL (attn_output), Q4_K (ffn_down)
/// and MXFP4 (two ffn matrices), and Q2_K (one) with AVX-512 (ggml's `ggml_cpu_has_avx512`:
/// the native build on such a CPU, or the variant its loader picks there); on Arm Q8_0, Q5_K
/// and Q6_K too, not Q2_K. Read from the CPU's flags.
fn repacked_types() -> serde_json::Value {
    let mut t = serde_json::json!({"q4_0": 13, "iq4_nl": 4, "q4_K": 4, "mxfp4": 2});
    if cfg!(target_arch = "x86_64") && packd_tests::cpu_has(&["avx512f"]) {
        t["q2_K"] = 1.into();
    }
    #[cfg(target_arch = "aarch64")]
    {
        t["q8_0"] = 3.into();
        t["q5_K"] = 1.into();
        t["q6_K"] = 1.into();
    }
    t
}

fn repacked_tensors() -> u64 {
    repacked_types().as_object().expect("a map").values().filter_map(serde_json::Value::as_u64).sum()
}

fn assert_built(r: &Run) {
    assert_built_status(&r.status);
}

fn assert_built_status(s: &serde_json::Value) {
    assert_eq!((n(s, "buffers"), n(s, "built"), n(s, "served"), n(s, "private")), (1, 1, 0, 0), "{s}");
    // The old name of `built`, kept until 0.3.
    assert_eq!(n(s, "published"), 1, "{s}");
    assert_eq!(n(s, "tensors_repacked"), repacked_tensors(), "{s}");
    assert_eq!(s["types"], repacked_types(), "{s}");
    assert_eq!(n(s, "bytes_private"), 0, "{s}");
    assert_nothing_unshared(s);
}

/// No weight in a buffer type packd does not share: the roots the suite runs on have none
/// (ggml's AMX is left out of them; KleidiAI is Arm's).
fn assert_nothing_unshared(s: &serde_json::Value) {
    assert_eq!(s["unshared"], serde_json::json!({}), "{s}");
    assert!(s["fallbacks"].get("unshared_buffer_type").is_none(), "{s}");
}

fn assert_served(r: &Run, logits: &str) {
    let s = &r.status;
    assert_eq!((n(s, "buffers"), n(s, "served"), n(s, "built"), n(s, "private")), (1, 1, 0, 0), "{s}");
    assert_eq!((n(s, "tensors_repacked"), n(s, "tensors_served")), (0, repacked_tensors()), "{s}");
    assert_eq!(s["types"], repacked_types(), "{s}");
    assert!(n(s, "bytes_shared") > 0 && n(s, "bytes_private") == 0, "{s}");
    assert_nothing_unshared(s);
    assert_eq!(r.out["logits"], logits, "served weights compute other logits: {}", r.out);
    assert!(r.stderr.contains("mapped from packd: nothing repacked"), "{}", r.stderr);
}

#[test]
#[cfg_attr(
    not(packd_llama),
    ignore = "needs llama.cpp and the test GGUF: run .ci/run, or set LLAMA_ROOT and PACKD_LLAMA_MODEL"
)]
fn later_workers_repack_nothing_and_compute_bit_identical_logits() {
    let d = Daemon::start();
    let model = llama_model();
    let logits = baseline(d.dir(), &model);
    let first = run(d.dir(), &model, &[]);
    assert_built(&first);
    assert_eq!(first.out["logits"], logits.as_str(), "the builder computes other logits");
    assert!(wait_until(Duration::from_secs(20), || d.stat("publishes") == 1));
    for _ in 0..3 {
        let r = run(d.dir(), &model, &[]);
        assert_served(&r, &logits);
        // The source pages of the served tensors left the worker (by default).
        assert!(n(&r.status, "source_bytes_dropped") > 0, "{}", r.status);
    }
    // The memo spared the later workers the model's hashing.
    let again = run(d.dir(), &model, &[("PACKD_LLAMA_DROP_SOURCE", "0")]);
    assert_served(&again, &logits);
    assert_eq!((n(&again.status, "models_hashed"), n(&again.status, "models_remembered")), (0, 1));
    assert_eq!(n(&again.status, "source_bytes_dropped"), 0, "{}", again.status);
    assert_eq!((d.stat("builds"), d.stat("publishes"), d.stat("private_reports")), (1, 1, 0));
    // One published segment, labelled with its identity, one entry covering the buffer.
    let ls = d.packctl(&["ls", "--entries"]);
    let text = String::from_utf8_lossy(&ls.stdout);
    assert_eq!(
        text.lines().filter(|l| l.contains(" engine ") && l.contains(" llama.cpp-repack/")).count(),
        1,
        "{text}"
    );
    assert_eq!(text.matches("CPU_REPACK").count(), 1, "{text}");
}

#[test]
#[cfg_attr(
    not(packd_llama),
    ignore = "needs llama.cpp and the test GGUF: run .ci/run, or set LLAMA_ROOT and PACKD_LLAMA_MODEL"
)]
fn a_llama_cpp_loaded_with_dlopen_after_start_is_served_too() {
    // As Python's ctypes loads it (llama-cpp-python): dlopen(RTLD_LOCAL) after the preloaded
    // library's constructor ran; its calls bind to packd's definition.
    let d = Daemon::start();
    let model = llama_model();
    let logits = baseline(d.dir(), &model);
    let lib = llama_root().join("lib");
    let dl = |env: &[(&str, &str)]| {
        let mut cmd = holder_cmd_of(llama_holder_dlopen(), d.dir(), &lib, &model, false, env);
        finish(cmd.arg("--lib").arg(lib.join("libllama.so")).spawn().expect("spawn the dlopen holder"))
    };
    let first = dl(&[]);
    assert_built(&first);
    assert_eq!(first.out["logits"], logits.as_str());
    assert_served(&dl(&[]), &logits);
    // PACKD_LLAMA=off: packd's definition only forwards.
    let off = dl(&[("PACKD_LLAMA", "off")]);
    assert_eq!(off.out["logits"], logits.as_str());
    assert!(!off.stderr.contains("packd-llama"), "{}", off.stderr);
    assert_eq!((d.stat("builds"), d.stat("publishes")), (1, 1));
}

#[test]
#[cfg_attr(
    not(packd_llama),
    ignore = "needs llama.cpp and the test GGUF: run .ci/run, or set LLAMA_ROOT and PACKD_LLAMA_MODEL"
)]
fn four_workers_at_once_build_once() {
    let d = Daemon::start();
    let model = llama_model();
    let logits = baseline(d.dir(), &model);
    // The builder holds after its first tensor until the three others wait for it.
    let go = d.dir().join("go");
    let env = [("PACKD_LLAMA_HOLD_BUILD", go.to_str().unwrap())];
    let lib = llama_root().join("lib");
    let kids: Vec<Child> =
        (0..4).map(|_| holder_cmd(d.dir(), &lib, &model, false, &env).spawn().expect("spawn")).collect();
    let waiting = wait_until(Duration::from_secs(120), || d.stat("build_waits") >= 3);
    std::fs::write(&go, b"").unwrap();
    let runs: Vec<Run> = kids.into_iter().map(finish).collect();
    assert!(waiting, "three workers never waited for the builder: {}", d.stats());
    let built: Vec<&Run> = runs.iter().filter(|r| n(&r.status, "built") == 1).collect();
    assert_eq!(built.len(), 1, "exactly one builds: {:?}", runs.iter().map(|r| &r.status).collect::<Vec<_>>());
    assert_built(built[0]);
    for r in &runs {
        assert_eq!(r.out["logits"], logits.as_str(), "{}", r.out);
        if n(&r.status, "built") == 0 {
            assert_served(r, &logits);
        }
    }
    assert_eq!((d.stat("builds"), d.stat("publishes")), (1, 1));
    assert!(d.stat("build_waits") >= 3, "the others waited for the builder: {}", d.stats());
}

#[test]
#[cfg_attr(
    not(packd_llama),
    ignore = "needs llama.cpp and the test GGUF: run .ci/run, or set LLAMA_ROOT and PACKD_LLAMA_MODEL"
)]
fn a_builder_killed_mid_repack_hands_the_role_on() {
    let d = Daemon::start();
    let model = llama_model();
    let logits = baseline(d.dir(), &model);
    let lib = llama_root().join("lib");
    let env = [("PACKD_LLAMA_HOLD_BUILD", "600")];
    let mut builder = holder_cmd(d.dir(), &lib, &model, false, &env).spawn().expect("spawn");
    let mut err = BufReader::new(builder.stderr.take().expect("stderr"));
    let mut line = String::new();
    while !line.contains("building the host's copy") {
        line.clear();
        assert!(err.read_line(&mut line).expect("read") > 0, "the builder ended before building");
    }
    assert_eq!(d.stat("builds"), 1);
    let waiter = holder_cmd(d.dir(), &lib, &model, false, &[]).spawn().expect("spawn");
    assert!(wait_until(Duration::from_secs(60), || d.stat("build_waits") == 1), "the second worker waits");
    builder.kill().expect("kill the builder");
    let _ = builder.wait();
    let mut rest = String::new();
    let _ = err.read_to_string(&mut rest);
    let w = finish(waiter);
    assert_built(&w);
    assert_eq!(w.out["logits"], logits.as_str());
    assert_eq!((d.stat("builds"), d.stat("publishes")), (2, 1), "{}", d.stats());
    assert_served(&run(d.dir(), &model, &[]), &logits);
}

#[test]
#[cfg_attr(
    not(packd_llama),
    ignore = "needs llama.cpp and the test GGUF: run .ci/run, or set LLAMA_ROOT and PACKD_LLAMA_MODEL"
)]
fn a_restart_serves_the_copy_from_the_cache_directory_with_no_build() {
    let home = Arc::new(tempfile::tempdir().unwrap());
    let cache = home.path().join("cache");
    let cache_arg = cache.to_str().unwrap().to_string();
    let mut d = Daemon::start_in(Arc::clone(&home), &[], &["--cache-dir", &cache_arg]);
    let model = llama_model();
    let logits = baseline(d.dir(), &model);
    assert_built(&run(d.dir(), &model, &[]));
    assert!(wait_until(Duration::from_secs(20), || !packd_tests::cache_files(&cache).is_empty()));
    d.terminate();
    let d = Daemon::start_in(home, &[], &["--cache-dir", &cache_arg]);
    assert_served(&run(d.dir(), &model, &[]), &logits);
    assert_eq!((d.stat("builds"), d.stat("publishes")), (0, 0), "zero rebuilds");
}

/// A copy of `model` in the daemon's directory with one byte of its last tensor
/// (blk.3.ffn_down, Q4_K, repacked) changed.
fn changed_by_one_block(d: &Daemon, model: &Path) -> std::path::PathBuf {
    let changed = d.dir().join("changed.gguf");
    let mut bytes = std::fs::read(model).unwrap();
    let at = bytes.len() - 100;
    bytes[at] ^= 0x10;
    std::fs::write(&changed, &bytes).unwrap();
    changed
}

#[test]
#[cfg_attr(
    not(packd_llama),
    ignore = "needs llama.cpp and the test GGUF: run .ci/run, or set LLAMA_ROOT and PACKD_LLAMA_MODEL"
)]
fn a_model_changed_by_one_block_never_hits() {
    let d = Daemon::start();
    let model = llama_model();
    assert_built(&run(d.dir(), &model, &[]));
    let changed = changed_by_one_block(&d, &model);
    let logits = baseline(d.dir(), &changed);
    let r = run(d.dir(), &changed, &[]);
    assert_built(&r);
    assert_eq!(r.out["logits"], logits.as_str());
    assert_eq!((d.stat("builds"), d.stat("publishes")), (2, 2));
    assert_served(&run(d.dir(), &changed, &[]), &logits);
}

/// The root's ggml version (written by fetch-llama), and the one just after it, outside
/// the supported table.
fn versions() -> (String, String) {
    let v = std::fs::read_to_string(llama_root().join("ggml-version")).expect("the root's ggml-version");
    let v = v.trim().to_string();
    let (head, patch) = v.rsplit_once('.').expect("major.minor.patch");
    let next = format!("{head}.{}", patch.parse::<u32>().expect("a patch number") + 1);
    assert_eq!(next.len(), v.len(), "the version just after {v} has another length");
    (v, next)
}

#[test]
#[cfg_attr(
    not(packd_llama),
    ignore = "needs llama.cpp and the test GGUF: run .ci/run, or set LLAMA_ROOT and PACKD_LLAMA_MODEL"
)]
fn the_ggml_version_just_outside_the_window_runs_as_without_packd_and_says_why() {
    let d = Daemon::start();
    let model = llama_model();
    let logits = baseline(d.dir(), &model);
    // The same libraries, but libggml-base says it is the version just after the root's.
    let (ours, next) = versions();
    let other = d.dir().join("lib");
    std::fs::create_dir(&other).unwrap();
    for entry in std::fs::read_dir(llama_root().join("lib")).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name();
        if !entry.file_type().unwrap().is_file() && !entry.file_type().unwrap().is_symlink() {
            continue;
        }
        let mut bytes = std::fs::read(entry.path()).unwrap();
        if name.to_string_lossy().starts_with("libggml-base.so") {
            let needle = format!("{ours}\0");
            let at = bytes.windows(needle.len()).position(|w| w == needle.as_bytes()).expect("the version string");
            bytes[at..at + next.len()].copy_from_slice(next.as_bytes());
        }
        std::fs::write(other.join(&name), bytes).unwrap();
    }
    let r = finish(holder_cmd(d.dir(), &other, &model, false, &[]).spawn().expect("spawn"));
    let s = &r.status;
    assert_eq!(s["ggml_version"], next.as_str(), "{s}");
    assert!(
        s["unsupported"].as_str().is_some_and(|u| u.contains("supports ggml 0.9.8, 0.15.1 and 0.25.3 (llama.cpp")),
        "{s}"
    );
    assert_eq!((s["hooked"].as_array().map(Vec::len), n(s, "buffers")), (Some(0), 0), "{s}");
    assert!(r.stderr.contains(&format!("llama.cpp runs without packd: ggml {next}")), "{}", r.stderr);
    assert_eq!(r.out["logits"], logits.as_str(), "llama.cpp repacks as ever");
    assert!(wait_until(Duration::from_secs(10), || d.stat("private_reports") == 1), "{}", d.stats());
    assert_eq!(d.stats()["private_fallbacks"]["unknown_interface"], 1, "{}", d.stats());
    assert_eq!(d.stat("builds"), 0);
}

#[test]
#[cfg_attr(
    not(packd_llama),
    ignore = "needs llama.cpp and the test GGUF: run .ci/run, or set LLAMA_ROOT and PACKD_LLAMA_MODEL"
)]
fn with_packd_away_llama_cpp_repacks_privately_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let model = llama_model();
    let logits = baseline(dir.path(), &model);
    let r = run(dir.path(), &model, &[]);
    let s = &r.status;
    assert_eq!((n(s, "private"), n(s, "tensors_repacked"), n(s, "bytes_shared")), (1, repacked_tensors(), 0), "{s}");
    assert!(s["reasons"].as_object().is_some_and(|m| m.keys().any(|k| k.starts_with("packd is away"))), "{s}");
    assert_eq!(s["fallbacks"]["daemon_away"], 1, "{s}");
    assert!(r.stderr.contains("repacks its weights privately: packd is away"), "{}", r.stderr);
    assert_eq!(r.out["logits"], logits.as_str());
}

/// A worker that keeps the model loaded until its stdin closes, and its stdout (kept open:
/// it writes one more line).
struct Holding(Child, #[allow(dead_code)] BufReader<std::process::ChildStdout>);

/// Starts a [`Holding`] worker; returns it once it has loaded (its first line read).
fn holding(d: &Daemon, model: &Path, env: &[(&str, &str)]) -> (Holding, serde_json::Value) {
    let mut cmd = holder_cmd(d.dir(), &llama_root().join("lib"), model, false, env);
    let mut child = cmd.arg("--hold").stdin(Stdio::piped()).spawn().expect("spawn a holding worker");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("read the worker's line");
    let v = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
    (Holding(child, out), v)
}

/// The latest report each connected process made, by pid: (obtained, fallback reason).
fn reports_by_pid(d: &Daemon) -> Vec<(u64, String)> {
    let out = d.packctl(&["clients", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("clients --json");
    v["clients"]
        .as_array()
        .expect("clients")
        .iter()
        .flat_map(|c| {
            let pid = c["pid"].as_u64().unwrap_or(0);
            c["reports"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .map(move |r| (pid, r["obtained"].as_str().unwrap_or_default().to_string()))
        })
        .collect()
}

/// The builder repacks into the memfd packd then serves (no copy: it builds in a writable
/// memfd, and a served worker maps that inode), and is reported built while it runs.
#[test]
#[cfg_attr(
    not(packd_llama),
    ignore = "needs llama.cpp and the test GGUF: run .ci/run, or set LLAMA_ROOT and PACKD_LLAMA_MODEL"
)]
fn the_builder_writes_the_memfd_packd_serves_and_is_reported_built_while_it_runs() {
    let d = Daemon::start();
    let model = llama_model();
    // Held after its first tensor: it builds, in a writable memfd packd allocated while it
    // hashed the model (the builder was the first to ask for its digest: without
    // provisional names, the digest comes before the build).
    let go = d.dir().join("go");
    let env = [("PACKD_PROVISIONAL_NAMES", "off")];
    let mut cmd = holder_cmd(d.dir(), &llama_root().join("lib"), &model, false, &env);
    cmd.env("PACKD_LLAMA_HOLD_BUILD", &go).arg("--hold").stdin(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn the builder");
    let pid = child.id();
    let mut building = None;
    assert!(
        wait_until(Duration::from_secs(60), || {
            building = mapped_memfd_inode(pid, "packd-lent", "rw-s");
            building.is_some()
        }),
        "the builder maps no writable memfd while it builds"
    );
    std::fs::write(&go, b"").unwrap();
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("read the builder's line");
    let builder = Holding(child, out);
    assert!(wait_until(Duration::from_secs(60), || d.stat("publishes") == 1), "{}", d.stats());
    let built = wait_until(Duration::from_secs(20), || reports_by_pid(&d).contains(&(u64::from(pid), "built".into())));
    assert!(built, "the running builder is not reported built: {:?}", reports_by_pid(&d));
    let (served, out) = holding(&d, &model, &[]);
    assert_eq!(out["repack"], true);
    let (a, b) = (building, mapped_memfd_inode(served.0.id(), "packd-lent", "r"));
    assert!(a.is_some() && a == b, "the builder built in memfd inode {a:?}, the served worker maps {b:?}");
    assert_eq!(mapped_memfd_inode(pid, "packd-lent", "r--s"), a, "the builder maps the published memfd read-only");
    assert_eq!(mapped_memfd_inode(pid, "packd-lent", "rw"), None, "no writable mapping of it is left");
    assert_eq!((d.stat("builds_lent"), d.stat("lent_bytes")), (1, 0), "lent, then published: {}", d.stats());
    for Holding(mut c, _out) in [builder, served] {
        drop(c.stdin.take());
        assert!(c.wait().expect("wait").success());
    }
    assert_eq!((d.stat("builds"), d.stat("publishes")), (1, 1));
}

/// A build that cannot be sealed (its memfd mapped writable elsewhere, here by another
/// process) is never published: its sealing thread gives the role up and the buffer is
/// counted private, the builder computes llama.cpp's own logits, and the next worker builds.
#[test]
#[cfg_attr(
    not(packd_llama),
    ignore = "needs llama.cpp and the test GGUF: run .ci/run, or set LLAMA_ROOT and PACKD_LLAMA_MODEL"
)]
fn a_build_that_cannot_be_sealed_is_given_up_and_its_buffer_kept_private() {
    let d = Daemon::start();
    let model = llama_model();
    let logits = baseline(d.dir(), &model);
    let go = d.dir().join("go");
    let mut cmd = holder_cmd(d.dir(), &llama_root().join("lib"), &model, false, &[]);
    let child = cmd.env("PACKD_LLAMA_HOLD_BUILD", &go).spawn().expect("spawn the builder");
    let pid = child.id();
    let mut inode = None;
    assert!(
        wait_until(Duration::from_secs(60), || {
            inode = mapped_memfd_inode(pid, "packd-llama", "rw-s");
            inode.is_some()
        }),
        "the builder maps no writable memfd of its own while it builds"
    );
    // The fds of that memfd, by its inode (the populating thread holds a second one for a
    // while): the mapper opens the first still open and checks the inode again.
    let inode = inode.expect("checked above");
    let fds: Vec<_> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the builder's fds")
        .flatten()
        .filter(|e| std::fs::metadata(e.path()).is_ok_and(|m| m.ino() == inode))
        .map(|e| e.path())
        .collect();
    assert!(!fds.is_empty(), "no fd of the builder's memfd {inode}");
    // Another process maps the build writable while it is under way: sealing it must fail.
    let map = "import mmap, os, sys
for p in sys.argv[2:]:
    try:
        fd = os.open(p, os.O_RDWR)
    except OSError:
        continue
    if os.fstat(fd).st_ino == int(sys.argv[1]):
        m = mmap.mmap(fd, 0, mmap.MAP_SHARED)
        print('mapped', flush=True)
        sys.stdin.read()
        break
";
    let mut mapper = Command::new("python3")
        .args(["-c", map])
        .arg(inode.to_string())
        .args(&fds)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3");
    let mut line = String::new();
    BufReader::new(mapper.stdout.take().expect("stdout")).read_line(&mut line).expect("the mapper's line");
    assert_eq!(line.trim(), "mapped");
    std::fs::write(&go, b"").unwrap();
    let r = finish(child);
    drop(mapper.stdin.take());
    assert!(mapper.wait().expect("wait for the mapper").success());
    let s = &r.status;
    assert_eq!((n(s, "built"), n(s, "private"), n(s, "bytes_shared")), (0, 1, 0), "{s}");
    assert!(s["reasons"].as_object().is_some_and(|m| m.keys().any(|k| k.starts_with("cannot seal the build"))), "{s}");
    assert_eq!(s["fallbacks"]["worker_error"], 1, "{s}");
    assert_eq!(r.out["logits"], logits.as_str(), "the builder computes with its own copy");
    assert_eq!(d.stat("publishes"), 0, "{}", d.stats());
    // The role was given up: the next worker builds, and publishes.
    let next = run(d.dir(), &model, &[]);
    assert_eq!(n(&next.status, "built"), 1, "{}", next.status);
    assert_eq!(next.out["logits"], logits.as_str());
    assert!(wait_until(Duration::from_secs(30), || d.stat("publishes") == 1), "{}", d.stats());
}

/// Workers started together cause one hash of the model file, by packd; none hashes it.
/// The builder takes its role under the model file's provisional name and packd hashes the
/// file beside its build (PROTOCOL.md, "Building under a provisional name"); the others wait
/// on that name and are served the publication its alias names.
#[test]
#[cfg_attr(
    not(packd_llama),
    ignore = "needs llama.cpp and the test GGUF: run .ci/run, or set LLAMA_ROOT and PACKD_LLAMA_MODEL"
)]
fn workers_at_once_cause_one_hash_of_the_model() {
    let d = Daemon::start();
    let model = llama_model();
    let lib = llama_root().join("lib");
    let kids: Vec<Child> =
        (0..4).map(|_| holder_cmd(d.dir(), &lib, &model, false, &[]).spawn().expect("spawn")).collect();
    let runs: Vec<Run> = kids.into_iter().map(finish).collect();
    let builder: Vec<&Run> = runs.iter().filter(|r| n(&r.status, "built") == 1).collect();
    assert_eq!(builder.len(), 1, "{}", d.stats());
    let b = &builder[0].status;
    assert_eq!((n(b, "models_provisional"), n(b, "models_from_daemon")), (1, 1), "{b}");
    for r in &runs {
        assert_eq!(n(&r.status, "models_hashed"), 0, "a worker hashed the model itself: {}", r.status);
        // Named by the provisional name (served through its alias), or by the memo the
        // builder wrote once it published (served the content identity).
        assert_eq!(n(&r.status, "models_provisional") + n(&r.status, "models_remembered"), 1, "{}", r.status);
        assert_eq!(n(&r.status, "built") + n(&r.status, "served"), 1, "{}", r.status);
    }
    assert_eq!(d.stat("source_hashes"), 1, "{}", d.stats());
    assert_eq!((d.stat("builds"), d.stat("publishes"), d.stat("aliases_filed")), (1, 1, 1));
    // No memory lent: the build started before any digest request.
    assert_eq!((d.stat("builds_lent"), d.stat("lent_bytes")), (0, 0), "{}", d.stats());
    // A daemon that only serves engines' publications keeps no spare: it never packed.
    assert_eq!(d.stat("spare_bytes"), 0, "{}", d.stats());
    assert!(!d.log().contains("spare memfd ready"), "{}", d.log());
    // The same daemon makes one once it packs.
    let st = d.dir().join("m.safetensors");
    packd_tests::SafeTensors::default().f32("l.weight", &[64, 64], &packd_tests::values(64 * 64, 1)).write(&st);
    d.client().pack(&st, &packd_client::Plan::default()).unwrap();
    assert!(wait_until(Duration::from_secs(60), || d.stat("spare_bytes") > 0), "{}", d.stats());
}

/// With `PACKD_PROVISIONAL_NAMES=off` workers started together ask packd for the model's
/// digest before any build (one hash, by packd), and the builder is lent the memory packd
/// allocated while it hashed.
#[test]
#[cfg_attr(
    not(packd_llama),
    ignore = "needs llama.cpp and the test GGUF: run .ci/run, or set LLAMA_ROOT and PACKD_LLAMA_MODEL"
)]
fn without_provisional_names_workers_wait_for_one_hash_and_the_builder_is_lent_memory() {
    let d = Daemon::start();
    let model = llama_model();
    let lib = llama_root().join("lib");
    let env = [("PACKD_PROVISIONAL_NAMES", "off")];
    let kids: Vec<Child> =
        (0..4).map(|_| holder_cmd(d.dir(), &lib, &model, false, &env).spawn().expect("spawn")).collect();
    let runs: Vec<Run> = kids.into_iter().map(finish).collect();
    for r in &runs {
        assert_eq!(n(&r.status, "models_hashed"), 0, "a worker hashed the model itself: {}", r.status);
        assert_eq!(n(&r.status, "models_provisional"), 0, "{}", r.status);
        assert_eq!(n(&r.status, "models_from_daemon") + n(&r.status, "models_remembered"), 1, "{}", r.status);
    }
    assert_eq!(d.stat("source_hashes"), 1, "{}", d.stats());
    assert_eq!((d.stat("builds"), d.stat("publishes"), d.stat("aliases_filed")), (1, 1, 0));
    // The builder was lent the memory packd allocated while it hashed, if it asked packd for
    // the digest (one that started late may find it in the memo, written by the first to
    // ask, and then builds in its own memory: INTEGRATION.md). Nothing else was kept.
    let builder: Vec<&Run> = runs.iter().filter(|r| n(&r.status, "built") == 1).collect();
    assert_eq!(builder.len(), 1, "{}", d.stats());
    let lent: u64 = runs.iter().map(|r| n(&r.status, "lent_builds")).sum();
    let asked = n(&builder[0].status, "models_from_daemon");
    assert_eq!((lent, d.stat("builds_lent"), d.stat("lent_bytes")), (asked, asked, 0), "{}", builder[0].status);
}

/// A waiter beside a builder held back goes private once what is left of the build would
/// take longer than building itself (judged by this host's earlier builds), while the
/// builder still holds; the builder's copy still serves later workers.
#[test]
#[cfg_attr(
    not(packd_llama),
    ignore = "needs llama.cpp and the test GGUF: run .ci/run, or set LLAMA_ROOT and PACKD_LLAMA_MODEL"
)]
fn a_waiter_beside_a_builder_held_back_builds_privately() {
    let d = Daemon::start();
    let model = llama_model();
    // An earlier build teaches packd how fast this host repacks.
    assert_built(&run(d.dir(), &model, &[]));
    let changed = changed_by_one_block(&d, &model);
    let logits = baseline(d.dir(), &changed);
    let go = d.dir().join("go");
    let lib = llama_root().join("lib");
    let env = [("PACKD_LLAMA_HOLD_BUILD", go.to_str().unwrap())];
    let builder = holder_cmd(d.dir(), &lib, &changed, false, &env).spawn().expect("spawn the builder");
    assert!(wait_until(Duration::from_secs(60), || d.stat("builds") == 2), "{}", d.stats());
    let waiter = run(d.dir(), &changed, &[]);
    let s = &waiter.status;
    assert!(!go.exists());
    assert_eq!((n(s, "private"), n(s, "served")), (1, 0), "{s}");
    assert_eq!(s["fallbacks"]["build_slow"], 1, "{s}");
    assert!(
        s["reasons"].as_object().is_some_and(|m| m.keys().any(|k| k.contains("longer than building privately"))),
        "{s}"
    );
    assert_eq!(waiter.out["logits"], logits.as_str());
    assert_eq!(d.stat("build_waits_slow"), 1, "{}", d.stats());
    std::fs::write(&go, b"").unwrap();
    assert_built(&finish(builder));
    assert_served(&run(d.dir(), &changed, &[]), &logits);
    assert!(wait_until(Duration::from_secs(10), || d.stats()["private_fallbacks"]["build_slow"] == 1), "{}", d.stats());
}

/// Weights not read from a mapped file (`use_mmap = false`): repacked privately, with the
/// reason told to packd while the worker runs (not only on its stderr).
#[test]
#[cfg_attr(
    not(packd_llama),
    ignore = "needs llama.cpp and the test GGUF: run .ci/run, or set LLAMA_ROOT and PACKD_LLAMA_MODEL"
)]
fn a_worker_without_mmap_repacks_privately_and_tells_packd() {
    let d = Daemon::start();
    let model = llama_model();
    let logits = baseline(d.dir(), &model);
    let mut cmd = holder_cmd(d.dir(), &llama_root().join("lib"), &model, false, &[]);
    // stderr to /dev/null, as llama-cpp-python's verbose=False does during the load.
    cmd.args(["--no-mmap", "--hold"]).stdin(Stdio::piped()).stderr(Stdio::null());
    let mut child = cmd.spawn().expect("spawn");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("read the worker's line");
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["logits"], logits.as_str());
    let pid = u64::from(child.id());
    let told = wait_until(Duration::from_secs(20), || reports_by_pid(&d).contains(&(pid, "private".into())));
    assert!(told, "the running worker's private copy is not reported: {:?}", reports_by_pid(&d));
    assert_eq!(d.stats()["private_fallbacks"]["unnamed_weights"], 1, "{}", d.stats());
    assert_eq!(d.stat("builds"), 0);
    // Its stdout stays open until it exits (it writes one more line).
    drop(child.stdin.take());
    assert!(child.wait().expect("wait").success());
    drop(out);
}

/// One HTTP/1.1 request to `127.0.0.1:port`: the status code and the body (`None` when the
/// server does not answer yet).
fn http(port: u16, method: &str, path: &str, body: &str) -> Option<(u16, String)> {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(300))).ok()?;
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).ok()?;
    let out = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = out.split_once("\r\n\r\n")?;
    let code = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, body.to_string()))
}

/// A `llama-server` of the root on loopback, on a port it binds itself (`--port 0`: no
/// window for another process to take it), with packd-llama preloaded unless `plain`,
/// writing its status to `status` at exit; its log (stderr) is kept for failure messages.
struct Server {
    child: Child,
    port: u16,
    log: std::path::PathBuf,
}

impl Server {
    fn start(d: &Daemon, model: &Path, plain: bool, status: &Path, env: &[(&str, &str)]) -> Server {
        let root = llama_root();
        let log = status.with_extension("log");
        let mut cmd = Command::new(root.join("bin/llama-server"));
        cmd.arg("-m")
            .arg(model)
            .args(["--host", "127.0.0.1", "--port", "0", "-t", "1", "-c", "256", "-np", "1"])
            .env("LD_LIBRARY_PATH", root.join("lib"))
            .env("PACKD_SOCKET_DIR", d.dir())
            .env("PACKD_NAMES", d.dir().join("names"))
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("create the server's log"));
        if !plain {
            cmd.env("LD_PRELOAD", llama_lib()).env("PACKD_LLAMA_STATUS", status);
        }
        Server { child: cmd.spawn().expect("spawn llama-server"), port: 0, log }
    }

    /// The end of its log.
    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// Waits until it says which port it bound and answers `/health` there with 200.
    fn ready(&mut self) {
        let log = self.log.clone();
        let mut port = None;
        let bound = wait_until(Duration::from_secs(300), || {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            port = text
                .split("listening on http://127.0.0.1:")
                .nth(1)
                .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next().and_then(|p| p.parse::<u16>().ok()));
            port.is_some()
        });
        assert!(bound, "llama-server never said its port ({:?}); its log:\n{}", self.child.try_wait(), self.log_tail());
        self.port = port.unwrap_or_default();
        let p = self.port;
        let up = wait_until(Duration::from_secs(300), || http(p, "GET", "/health", "").is_some_and(|(c, _)| c == 200));
        assert!(
            up,
            "llama-server on port {p} never became ready ({:?}); its log:\n{}",
            self.child.try_wait(),
            self.log_tail()
        );
    }

    /// One greedy completion: its text and the probabilities of its tokens (computed from the
    /// logits, so bit-identical logits give identical numbers).
    fn complete(&self) -> (serde_json::Value, serde_json::Value) {
        // The test model's byte tokens (3..=258) are banned: random weights would otherwise
        // emit bytes that are no UTF-8, which the server refuses to return.
        let body = serde_json::json!({
            "prompt": "w1 w2 w3 w4 w5", "n_predict": 8, "temperature": 0, "top_k": 1, "seed": 1,
            "n_probs": 4, "cache_prompt": false,
            "logit_bias": (3..=258).map(|t| serde_json::json!([t, false])).collect::<Vec<_>>(),
        })
        .to_string();
        let (code, text) = http(self.port, "POST", "/completion", &body)
            .unwrap_or_else(|| panic!("the server does not answer /completion; its log:\n{}", self.log_tail()));
        assert_eq!(code, 200, "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        (v["content"].clone(), v["completion_probabilities"].clone())
    }

    /// Stops it as a service manager would (SIGTERM) and waits for its exit.
    fn stop(mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM llama-server");
        let ended = wait_until(Duration::from_secs(60), || self.child.try_wait().ok().flatten().is_some());
        assert!(ended, "llama-server did not stop on SIGTERM");
    }
}

impl Drop for Server {
    /// A server a failed assertion left running is killed.
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Upstream's server, built from the same sources, as a worker: four started at once under
/// the preload (the builder held until the three others wait for it) answer one completion
/// each over HTTP, identical to llama-server without packd; one repacks, the three others
/// map its copy and repack nothing.
#[test]
#[cfg_attr(
    not(packd_llama),
    ignore = "needs llama.cpp and the test GGUF: run .ci/run, or set LLAMA_ROOT and PACKD_LLAMA_MODEL"
)]
fn four_llama_servers_at_once_repack_once_and_answer_as_without_packd() {
    let d = Daemon::start();
    let model = llama_model();
    let mut plain = Server::start(&d, &model, true, &d.dir().join("plain.json"), &[]);
    plain.ready();
    let expected = plain.complete();
    plain.stop();
    assert!(expected.0.as_str().is_some_and(|t| !t.is_empty()), "{expected:?}");
    assert!(expected.1.as_array().is_some_and(|p| p.len() == 8), "{expected:?}");

    let status = |i: usize| d.dir().join(format!("status-{i}.json"));
    let go = d.dir().join("go");
    let env = [("PACKD_LLAMA_HOLD_BUILD", go.to_str().unwrap())];
    let mut servers: Vec<Server> = (0..4).map(|i| Server::start(&d, &model, false, &status(i), &env)).collect();
    let waiting = wait_until(Duration::from_secs(300), || d.stat("build_waits") >= 3);
    std::fs::write(&go, b"").unwrap();
    assert!(waiting, "three servers never waited for the builder: {}", d.stats());
    for s in &mut servers {
        s.ready();
    }
    for s in &servers {
        assert_eq!(s.complete(), expected, "a server under packd completes otherwise");
    }
    assert_eq!((d.stat("builds"), d.stat("publishes")), (1, 1), "{}", d.stats());
    let pids: Vec<u64> = servers.iter().map(|s| u64::from(s.child.id())).collect();
    let reports = || {
        let r = reports_by_pid(&d);
        let count = |what: &str| r.iter().filter(|(p, o)| pids.contains(p) && o == what).count();
        (count("built"), count("served"))
    };
    assert!(wait_until(Duration::from_secs(20), || reports() == (1, 3)), "reports: {:?}", reports_by_pid(&d));
    for s in servers {
        s.stop();
    }
    let mut runs: Vec<serde_json::Value> = (0..4)
        .map(|i| {
            let text = std::fs::read_to_string(status(i)).unwrap_or_else(|e| panic!("server {i} left no status: {e}"));
            serde_json::from_str(text.lines().last().expect("a line")).expect("status JSON")
        })
        .collect();
    runs.sort_by_key(|s| std::cmp::Reverse(n(s, "tensors_repacked")));
    assert_built_status(&runs[0]);
    for s in &runs[1..] {
        assert_eq!(
            (n(s, "served"), n(s, "tensors_repacked"), n(s, "tensors_served")),
            (1, 0, repacked_tensors()),
            "{s}"
        );
        assert_eq!(s["types"], repacked_types(), "{s}");
    }
}

/// fetch-llama's AMX decision, from the CPU flags it is told to read: a CPU with AMX gets a
/// build without it (ggml's AMX kernels crash on such CPUs, llama.cpp #20824) unless
/// `--amx keep`; the release layout never builds the AMX variant.
#[test]
fn fetch_llama_builds_without_amx_on_a_cpu_with_amx_unless_told_to_keep_it() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/llama/fetch-llama");
    let dir = tempfile::tempdir().unwrap();
    let decide = |flags: &str, args: &[&str]| -> std::collections::BTreeMap<String, String> {
        let out = Command::new(&script)
            .arg("--dry-run")
            .args(args)
            .arg(dir.path().join("v"))
            .env("PACKD_FETCH_LLAMA_CPU_FLAGS", flags)
            .output()
            .expect("run fetch-llama");
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{args:?}: {err}");
        assert!(err.contains("fetch-llama: llama.cpp 0.3.36 is built"), "the decision is printed: {err}");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_once(' '))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    let sapphire = "sse4_2 avx2 fma f16c bmi2 avx512f avx512bw avx512vl avx512_vnni amx_bf16 amx_tile amx_int8";
    let no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16";
    let d = decide(sapphire, &[]);
    assert_eq!((d["layout"].as_str(), d["amx"].as_str(), d["c-flags"].as_str()), ("native", "off", no_amx), "{d:?}");
    assert_eq!(d["cpu-amx-flags"], "amx_bf16 amx_tile amx_int8", "{d:?}");
    let d = decide(sapphire, &["--amx", "keep"]);
    assert_eq!((d["amx"].as_str(), d["c-flags"].as_str()), ("native", "none"), "{d:?}");
    let d = decide("sse4_2 avx2 fma f16c bmi2", &[]);
    assert_eq!((d["amx"].as_str(), d["cpu-amx-flags"].as_str(), d["c-flags"].as_str()), ("native", "none", "none"));
    let d = decide("sse4_2 avx2 fma f16c bmi2", &["--amx", "off"]);
    assert_eq!((d["amx"].as_str(), d["c-flags"].as_str()), ("off", no_amx), "{d:?}");
    let d = decide(sapphire, &["--layout", "release"]);
    assert_eq!((d["layout"].as_str(), d["amx"].as_str()), ("release", "off"), "{d:?}");
    let bad = Command::new(&script).args(["--dry-run", "--amx", "sometimes"]).output().unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--amx sometimes: auto, off or keep"));
    let bad = Command::new(&script)
        .args(["--dry-run", "--layout", "release"])
        .env("PACKD_FETCH_LLAMA_VARIANTS", "haswell sapphirerapids")
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2), "the AMX variant is refused");
}

/// The dynamic symbols `lib` defines (`readelf --dyn-syms`).
fn defined_symbols(lib: &Path) -> Vec<String> {
    let out = Command::new("readelf").args(["-W", "--dyn-syms"]).arg(lib).output().expect("run readelf");
    assert!(out.status.success(), "readelf {}", lib.display());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.contains(" UND "))
        .filter_map(|l| l.split_whitespace().nth(7))
        .map(|s| s.split('@').next().unwrap_or(s).to_string())
        .collect()
}

/// ggml's CPU backend libraries of a root: `libggml-cpu.so` (native) or its variants.
fn cpu_backends(root: &Path) -> Vec<std::path::PathBuf> {
    let mut libs: Vec<std::path::PathBuf> = std::fs::read_dir(root.join("lib"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            name.starts_with("libggml-cpu") && name.ends_with(".so")
        })
        .collect();
    libs.sort();
    libs
}

/// The variant ggml's loader must pick among `variants` on this CPU, from its flags (as
/// ggml's own `ggml_backend_score` of each variant checks them).
fn best_variant(variants: &[String]) -> Option<String> {
    let wants: [(&str, &[&str]); 2] = [
        ("skylakex", &["avx2", "fma", "f16c", "bmi2", "avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"]),
        ("haswell", &["avx2", "fma", "f16c", "bmi2"]),
    ];
    wants
        .iter()
        .find(|(v, flags)| variants.iter().any(|x| x == v) && packd_tests::cpu_has(flags))
        .map(|(v, _)| v.to_string())
}

/// The root the suite runs on is built for this CPU's class: on a CPU with AMX, a native
/// root has no AMX code (proven from libggml-cpu's symbols: ggml's AMX buffer type is
/// compiled only with AMX); a release-layout root has at least two CPU variants, none with
/// AMX, and ggml's loader picks the one this CPU's flags call for.
#[test]
#[cfg_attr(
    not(all(packd_llama, packd_c_tools)),
    ignore = "needs llama.cpp, the test GGUF and readelf: run .ci/run, or set LLAMA_ROOT and PACKD_LLAMA_MODEL"
)]
fn the_root_is_built_for_this_cpu_class() {
    let root = llama_root();
    let build = packd_tests::llama_root_build(&root);
    let amx_cpu = packd_tests::cpu_has(&["amx_tile", "amx_int8"]);
    let libs = cpu_backends(&root);
    let with_amx: Vec<&std::path::PathBuf> =
        // A C++ symbol (`_Z28ggml_backend_amx_buffer_typev`), defined only where AMX is compiled.
        libs.iter().filter(|l| defined_symbols(l).iter().any(|s| s.contains("ggml_backend_amx_buffer_type"))).collect();
    println!("root {}: {build:?}; CPU with AMX: {amx_cpu}; CPU backends {libs:?}", root.display());
    match build["layout"].as_str() {
        "native" => {
            assert_eq!(libs, [root.join("lib/libggml-cpu.so")], "one CPU backend, linked");
            if amx_cpu {
                assert_eq!(build["amx"], "off", "on a CPU with AMX the suite runs on a root without it: {build:?}");
            }
            let amx = build["amx"] == "native" && amx_cpu;
            assert_eq!(!with_amx.is_empty(), amx, "AMX code in {with_amx:?}; the build says {build:?}");
            assert!(defined_symbols(&libs[0]).iter().any(|s| s == "ggml_backend_cpu_reg"), "not ggml's CPU backend");
        }
        "release" => {
            assert!(libs.len() >= 2, "the loader chooses among two variants or more: {libs:?}");
            assert!(with_amx.is_empty(), "no AMX variant: {with_amx:?}");
            for l in &libs {
                let name = l.file_name().unwrap();
                assert!(root.join("bin").join(name).is_file(), "{name:?} beside llama-server too, as released");
            }
            let variants: Vec<String> = libs
                .iter()
                .map(|l| l.file_stem().unwrap().to_string_lossy().trim_start_matches("libggml-cpu-").to_string())
                .collect();
            let want = best_variant(&variants).unwrap_or_else(|| panic!("no variant of {variants:?} runs here"));
            // A worker under packd: the loader's pick is the module it maps.
            let d = Daemon::start();
            let (mut held, out) = holding(&d, &llama_model(), &[]);
            assert_eq!(out["repack"], true);
            let maps = std::fs::read_to_string(format!("/proc/{}/maps", held.0.id())).unwrap();
            let mapped: std::collections::BTreeSet<String> = maps
                .lines()
                .filter_map(|l| l.split_whitespace().nth(5))
                .filter_map(|p| Path::new(p).file_name().map(|f| f.to_string_lossy().into_owned()))
                .filter(|f| f.starts_with("libggml-cpu"))
                .collect();
            assert_eq!(
                mapped.into_iter().collect::<Vec<_>>(),
                [format!("libggml-cpu-{want}.so")],
                "ggml's loader picks {want} on this CPU"
            );
            drop(held.0.stdin.take());
            assert!(held.0.wait().unwrap().success());
            assert_eq!((d.stat("builds"), d.stat("publishes")), (1, 1), "{}", d.stats());
        }
        other => panic!("layout {other}"),
    }
}

/// Weights llama.cpp puts in ggml's AMX buffer type (a root built with AMX, on a CPU with
/// AMX; the model only loads: ggml's AMX kernels crash at the first decode on such CPUs,
/// llama.cpp #20824) are counted by buffer type and ggml type, told to packd
/// (`unshared_buffer_type`) and shown by `packctl clients`; the rest is shared as ever.
#[test]
#[ignore = "run by .ci/run on a CPU with AMX: needs LLAMA_AMX_ROOT, a root of \
            `examples/llama/fetch-llama --amx keep --libs-only`"]
fn weights_in_a_buffer_type_packd_does_not_share_are_counted_and_told() {
    assert!(packd_tests::cpu_has(&["amx_tile", "amx_int8", "avx512_vnni"]), "a CPU with AMX runs this");
    let root = std::path::PathBuf::from(std::env::var_os("LLAMA_AMX_ROOT").expect("LLAMA_AMX_ROOT"));
    assert_eq!(packd_tests::llama_root_build(&root)["amx"], "native");
    let d = Daemon::start();
    let model = llama_model();
    let mut cmd = holder_cmd(d.dir(), &root.join("lib"), &model, false, &[]);
    let mut child = cmd.args(["--load-only", "--hold"]).stdin(Stdio::piped()).spawn().expect("spawn");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("read the worker's line");
    assert!(line.contains("\"loaded\":true"), "{line}");
    let pid = u64::from(child.id());
    let told = wait_until(Duration::from_secs(20), || {
        d.stats()["private_fallbacks"]["unshared_buffer_type"].as_u64() >= Some(1)
            && reports_by_pid(&d).contains(&(pid, "private".into()))
    });
    assert!(told, "packd is told: {} {:?}", d.stats(), reports_by_pid(&d));
    let clients = String::from_utf8_lossy(&d.packctl(&["clients"]).stdout).into_owned();
    assert!(clients.contains("unshared_buffer_type") && clients.contains("AMX"), "{clients}");
    drop(child.stdin.take());
    let mut err = String::new();
    child.stderr.take().expect("stderr").read_to_string(&mut err).unwrap();
    assert!(child.wait().unwrap().success(), "{err}");
    drop(out);
    let s: serde_json::Value = err
        .lines()
        .rev()
        .find(|l| l.starts_with("{\"enabled\""))
        .map(|l| serde_json::from_str(l).unwrap())
        .unwrap_or_else(|| panic!("no status: {err}"));
    let amx = &s["unshared"]["AMX"];
    assert!(n(amx, "buffers") >= 1 && n(amx, "bytes") > 0 && n(amx, "tensor_bytes") > 0, "{s}");
    // What ggml's AMX buffer type takes (amx.cpp's supports_op): these ggml types only.
    let takes = ["q4_0", "q4_1", "q8_0", "q4_K", "q5_K", "q6_K", "iq4_xs", "f16"];
    let types = amx["types"].as_object().expect("types");
    assert!(!types.is_empty() && types.keys().all(|t| takes.contains(&t.as_str())), "{s}");
    // No weight is silent: each one CPU_REPACK takes without AMX is in CPU_REPACK (shared)
    // or counted under AMX.
    for (t, want) in repacked_types().as_object().expect("a map") {
        let got = s["types"][t].as_u64().unwrap_or(0) + types.get(t).and_then(serde_json::Value::as_u64).unwrap_or(0);
        assert_eq!(Some(got), want.as_u64(), "{t}: {s}");
    }
    assert_eq!((n(&s, "built"), n(&s, "private")), (1, 0), "the rest is shared as ever: {s}");
    assert!(s["fallbacks"]["unshared_buffer_type"].as_u64() >= Some(1), "{s}");
    assert!(err.contains("put weights in its AMX buffer type"), "said on stderr: {err}");
}

/// A model file changed while a build under its provisional name runs is never served: the
/// builder checks the file again once packd's digest is in, gives its role up and keeps its
/// copy private; the next worker names the changed file anew and builds once more.
#[test]
#[cfg_attr(
    not(packd_llama),
    ignore = "needs llama.cpp and the test GGUF: run .ci/run, or set LLAMA_ROOT and PACKD_LLAMA_MODEL"
)]
fn a_model_file_changed_during_its_build_is_never_served() {
    let d = Daemon::start();
    let model = d.dir().join("copy.gguf");
    std::fs::copy(llama_model(), &model).unwrap();
    let logits = baseline(d.dir(), &model);
    let go = d.dir().join("go");
    let env = [("PACKD_LLAMA_HOLD_BUILD", go.to_str().unwrap())];
    let builder = holder_cmd(d.dir(), &llama_root().join("lib"), &model, false, &env).spawn().expect("spawn");
    assert!(wait_until(Duration::from_secs(60), || d.stat("builds") == 1), "{}", d.stats());
    // Written during the build (here: its times only; its bytes are the same).
    let f = std::fs::OpenOptions::new().write(true).open(&model).unwrap();
    f.set_modified(std::time::SystemTime::now() + Duration::from_secs(5)).unwrap();
    drop(f);
    std::fs::write(&go, b"").unwrap();
    let r = finish(builder);
    let s = &r.status;
    assert_eq!((n(s, "built"), n(s, "private"), n(s, "models_provisional")), (0, 1, 1), "{s}");
    assert_eq!(s["fallbacks"]["unnamed_weights"], 1, "{s}");
    assert!(s["reasons"].as_object().is_some_and(|m| m.keys().any(|k| k.contains("changed"))), "{s}");
    assert_eq!(r.out["logits"], logits.as_str(), "the builder computes with its own copy");
    assert_eq!((d.stat("publishes"), d.stat("aliases_filed"), d.stat("builds_given_up")), (0, 0, 1), "{}", d.stats());
    // The changed file has another provisional name: built again, then served.
    assert_built(&run(d.dir(), &model, &[]));
    let served = run(d.dir(), &model, &[]);
    assert_eq!(n(&served.status, "served"), 1, "{}", served.status);
    assert_eq!(served.out["logits"], logits.as_str());
    assert_eq!((d.stat("builds"), d.stat("publishes")), (2, 1), "{}", d.stats());
}

/// A builder held at its build until a second worker waits for it, then let go; returns
/// both (holding the model) once the waiter printed its logits, which equal `logits`.
fn builder_and_served_waiter(
    d: &Daemon,
    model: &Path,
    logits: &str,
) -> (Child, Child, BufReader<std::process::ChildStdout>) {
    let lib = llama_root().join("lib");
    let go = d.dir().join("go");
    let mut cmd = holder_cmd(d.dir(), &lib, model, false, &[("PACKD_LLAMA_HOLD_BUILD", go.to_str().unwrap())]);
    let builder = cmd.arg("--hold").stdin(Stdio::piped()).spawn().expect("spawn the builder");
    assert!(wait_until(Duration::from_secs(60), || d.stat("builds") == 1), "{}", d.stats());
    let mut cmd = holder_cmd(d.dir(), &lib, model, false, &[]);
    let mut waiter = cmd.arg("--hold").stdin(Stdio::piped()).spawn().expect("spawn the waiter");
    assert!(wait_until(Duration::from_secs(60), || d.stat("build_waits") == 1), "{}", d.stats());
    std::fs::write(&go, b"").unwrap();
    let mut out = BufReader::new(waiter.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("the waiter's line");
    let w: serde_json::Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
    assert_eq!(w["logits"], logits);
    (builder, waiter, out)
}

/// A worker waiting on a build is served the builder's very memfd before packd has hashed
/// it; the cache directory gets it only once hashed.
#[test]
#[cfg_attr(
    not(packd_llama),
    ignore = "needs llama.cpp and the test GGUF: run .ci/run, or set LLAMA_ROOT and PACKD_LLAMA_MODEL"
)]
fn a_waiter_is_served_the_builders_memfd_before_packd_has_hashed_it() {
    let cache = tempfile::tempdir().unwrap();
    let packs = || {
        std::fs::read_dir(cache.path())
            .map(|r| r.flatten().filter(|e| e.path().extension().is_some_and(|x| x == "pack")).count())
            .unwrap_or(0)
    };
    let d =
        Daemon::start_args(&[("PACKD_TEST_HASH_DELAY_MS", "10000")], &["--cache-dir", cache.path().to_str().unwrap()]);
    let model = llama_model();
    let logits = baseline(d.dir(), &model);
    let (mut builder, mut waiter, out) = builder_and_served_waiter(&d, &model, &logits);
    let (built, served) =
        (mapped_memfd_inode(builder.id(), "packd-llama", "r"), mapped_memfd_inode(waiter.id(), "packd-llama", "r"));
    assert!(built.is_some() && built == served, "the builder maps memfd {built:?}, the waiter {served:?}");
    assert_eq!(packs(), 0, "in the cache directory before it was hashed");
    for c in [&mut builder, &mut waiter] {
        drop(c.stdin.take());
    }
    let (b, w) = (finish(builder), finish_after(waiter, out));
    assert_built(&b);
    assert_eq!(n(&w.status, "served"), 1, "{}", w.status);
    assert!(wait_until(Duration::from_secs(60), || packs() == 1), "written once hashed: {}", d.stats());
}

/// A publication whose hash fails after a waiter was served it: the waiter keeps it, new
/// workers are not served it.
#[test]
#[cfg_attr(
    not(packd_llama),
    ignore = "needs llama.cpp and the test GGUF: run .ci/run, or set LLAMA_ROOT and PACKD_LLAMA_MODEL"
)]
fn a_publication_whose_hash_fails_is_withdrawn_and_the_next_worker_builds_again() {
    // Every publication's hash held, then failed (a debug build's test fault).
    let d = Daemon::start_with(&[("PACKD_TEST_HASH_DELAY_MS", "3000"), ("PACKD_TEST_HASH_FAIL", "*")]);
    let model = llama_model();
    let logits = baseline(d.dir(), &model);
    // The waiter is served in the window, before the hash that then fails: it keeps what it
    // maps (sealed, the builder's very bytes) and answers alike.
    let (mut builder, mut waiter, out) = builder_and_served_waiter(&d, &model, &logits);
    assert!(wait_until(Duration::from_secs(60), || d.stat("publishes_withdrawn") == 1), "{}", d.stats());
    for c in [&mut builder, &mut waiter] {
        drop(c.stdin.take());
    }
    let (b, w) = (finish(builder), finish_after(waiter, out));
    assert_eq!(b.out["logits"], logits.as_str(), "{}", b.stderr);
    assert_eq!(n(&w.status, "served"), 1, "{}", w.status);
    // Withdrawn from new clients: the next worker is not served it, it builds again.
    let next = run(d.dir(), &model, &[]);
    assert_eq!(next.out["logits"], logits.as_str(), "{}", next.stderr);
    assert_eq!(n(&next.status, "served"), 0, "{}", next.status);
    assert_eq!(d.stat("builds"), 2, "{}", d.stats());
    assert!(d.log().contains("a publication's hash failed: withdrawn from the index"), "{}", d.log());
}

/// [`finish`] of a worker whose stdout was taken.
fn finish_after(mut child: Child, mut out: BufReader<std::process::ChildStdout>) -> Run {
    let mut rest = String::new();
    let _ = out.read_to_string(&mut rest);
    let mut stderr = String::new();
    let _ = child.stderr.take().map(|mut e| e.read_to_string(&mut stderr));
    assert!(child.wait().expect("wait").success(), "{stderr}");
    let status = stderr
        .lines()
        .rev()
        .find(|l| l.starts_with("{\"enabled\""))
        .map_or(serde_json::Value::Null, |l| serde_json::from_str(l).unwrap());
    Run { out: serde_json::Value::Null, status, stderr }
}
