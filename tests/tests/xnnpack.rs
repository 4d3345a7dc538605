//! Real XNNPACK (Debian trixie's 2024-11 build, under its own loader) sharing what it packs
//! through packd: the `examples/xnnpack/minilm-fc` worker, as a user runs it, against the
//! real daemon. Later workers hit every look-up, pack nothing and compute the same bytes as
//! XNNPACK's own cache and as no cache at all; workers started at once build once; a builder
//! killed before it publishes leaves the role to another; restarts rebuild nothing; another
//! identity never hits.
//!
//! Needs the MiniLM model and an XNNPACK root (`.ci/run` fetches both).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use packd_tests::{Daemon, mapped_memfd_inode, model_path, systemd, wait_until, xnnpack_root};

fn worker_cmd(dir: &Path, dtype: &str, extra: &[&str]) -> Command {
    worker_cmd_on(&xnnpack_root(), dir, dtype, extra)
}

fn worker_cmd_on(root: &Path, dir: &Path, dtype: &str, extra: &[&str]) -> Command {
    let lib = packd_tests::capi_lib_dir();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/xnnpack/minilm-fc");
    let mut cmd = Command::new(script);
    cmd.env("XNNPACK_ROOT", root)
        .env("PACKD_LIB_DIR", lib)
        .env("CARGO_TARGET_DIR", lib.parent().expect("target dir"))
        .arg("--socket-dir")
        .arg(dir)
        .arg("--model")
        .arg(model_path())
        .args(["--dtype", dtype])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// Runs the worker to its end and returns its JSON line.
fn worker(dir: &Path, dtype: &str, extra: &[&str]) -> serde_json::Value {
    worker_on(&xnnpack_root(), dir, dtype, extra)
}

fn worker_on(root: &Path, dir: &Path, dtype: &str, extra: &[&str]) -> serde_json::Value {
    let out = worker_cmd_on(root, dir, dtype, extra).output().expect("run minilm-fc");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "minilm-fc failed: {text}{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("minilm-fc printed {text:?}: {e}"))
}

fn first_line(child: &mut Child) -> serde_json::Value {
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().expect("stdout")).read_line(&mut line).expect("read");
    serde_json::from_str(line.trim()).unwrap_or_else(|e| panic!("minilm-fc printed {line:?}: {e}"))
}

fn assert_hit_everything(v: &serde_json::Value, digest: &serde_json::Value) {
    assert_eq!(v["cache"], "served", "{v}");
    assert_eq!((v["hits"].as_u64(), v["misses"].as_u64()), (Some(37), Some(0)), "{v}");
    assert_eq!((v["reserve_space"].as_u64(), v["bytes_packed"].as_u64()), (Some(0), Some(0)), "{v}");
    assert_eq!(v["bytes_private"].as_u64(), Some(0), "{v}");
    assert!(v["bytes_shared"].as_u64() > Some(0), "the served segment stays mapped after finalize: {v}");
    assert_eq!(&v["output_blake3"], digest, "{v}");
}

#[test]
#[cfg_attr(
    not(all(packd_model, packd_xnnpack)),
    ignore = "needs the MiniLM model and an XNNPACK root: run .ci/run, or set PACKD_TEST_MODEL and XNNPACK_ROOT \
              (examples/xnnpack/fetch-xnnpack)"
)]
fn later_workers_hit_every_look_up_pack_nothing_and_compute_the_same_bytes() {
    later_workers_hit_every_look_up(&xnnpack_root(), &["f32", "f16", "qd8"]);
}

#[test]
#[cfg_attr(
    not(all(packd_model, packd_xnnpack_current)),
    ignore = "needs the MiniLM model and the current XNNPACK: run .ci/run, or set PACKD_TEST_MODEL and \
              XNNPACK_CURRENT_ROOT (examples/xnnpack/fetch-xnnpack-current)"
)]
fn later_workers_hit_every_look_up_on_the_current_xnnpack() {
    // f16 inference is left out: the current XNNPACK keys it by a converted copy it never
    // names (docs/INTEGRATION.md, the operator table); tests/tests/xnnpack_ops.rs covers it.
    later_workers_hit_every_look_up(&packd_tests::xnnpack_current_root(), &["f32", "qd8"]);
}

fn later_workers_hit_every_look_up(root: &Path, dtypes: &[&str]) {
    let d = Daemon::start();
    let worker = |dir: &Path, dtype: &str, extra: &[&str]| worker_on(root, dir, dtype, extra);
    for (i, &dtype) in dtypes.iter().enumerate() {
        let reference = worker(d.dir(), dtype, &["--no-cache"]);
        let digest = reference["output_blake3"].clone();
        let own = worker(d.dir(), dtype, &["--private"]);
        assert_eq!(own["output_blake3"], digest, "XNNPACK's own cache computes what no cache does: {own}");
        assert_eq!(own["reserve_space"].as_u64(), Some(37), "{own}");
        // Figures a run has no source for are null, not a number.
        assert!(own["hits"].is_null() && own["misses"].is_null(), "{own}");
        assert!(reference["hits"].is_null() && reference["bytes_packed"].is_null(), "{reference}");
        let first = worker(d.dir(), dtype, &[]);
        assert_eq!(first["cache"], "published", "{first}");
        assert_eq!(first["output_blake3"], digest, "{first}");
        assert_eq!(first["reserve_space"], own["reserve_space"]);
        assert_eq!(first["bytes_packed"], own["bytes_packed"], "packd's provider packs what XNNPACK's cache does");
        assert_eq!(first["bytes_private"].as_u64(), Some(0), "{first}");
        for _ in 0..2 {
            assert_hit_everything(&worker(d.dir(), dtype, &[]), &digest);
        }
        assert_eq!(d.stat("builds"), i as u64 + 1, "one build per dtype");
    }
    assert_eq!(d.stat("published_segments"), dtypes.len() as u64);
    assert_eq!(d.stat("builds_abandoned") + d.stat("builds_expired"), 0);
}

#[test]
#[cfg_attr(
    not(all(packd_model, packd_xnnpack)),
    ignore = "needs the MiniLM model and an XNNPACK root: run .ci/run, or set PACKD_TEST_MODEL and XNNPACK_ROOT"
)]
fn workers_started_at_once_build_once_and_the_others_wait_and_hit() {
    let d = Daemon::start();
    let digest = worker(d.dir(), "f32", &["--no-cache"])["output_blake3"].clone();
    // The builder publishes only once the test has seen the three others wait.
    let go = d.dir().join("finalize-now");
    let args = ["--finalize-when", go.to_str().unwrap()];
    let mut children: Vec<Child> = (0..4).map(|_| worker_cmd(d.dir(), "f32", &args).spawn().expect("spawn")).collect();
    assert!(
        wait_until(Duration::from_secs(60), || d.stat("builds") == 1 && d.stat("build_waits") == 3),
        "one builds, three wait: {} builds, {} waits",
        d.stat("builds"),
        d.stat("build_waits")
    );
    std::fs::write(&go, b"").unwrap();
    let lines: Vec<serde_json::Value> = children.iter_mut().map(first_line).collect();
    for c in &mut children {
        assert!(c.wait().unwrap().success());
    }
    let published = lines.iter().filter(|l| l["cache"] == "published").count();
    assert_eq!(published, 1, "{lines:?}");
    for l in lines.iter().filter(|l| l["cache"] != "published") {
        assert_hit_everything(l, &digest);
    }
    assert_eq!((d.stat("builds"), d.stat("build_waits")), (1, 3));
}

#[test]
#[cfg_attr(
    not(all(packd_model, packd_xnnpack)),
    ignore = "needs the MiniLM model and an XNNPACK root: run .ci/run, or set PACKD_TEST_MODEL and XNNPACK_ROOT"
)]
fn a_builder_killed_before_publishing_leaves_the_role_to_another_worker() {
    let d = Daemon::start();
    let digest = worker(d.dir(), "f32", &["--no-cache"])["output_blake3"].clone();
    let mut builder = worker_cmd(d.dir(), "f32", &["--pause-before-finalize", "60"]).spawn().expect("spawn");
    assert!(wait_until(Duration::from_secs(30), || d.stat("builds") == 1), "the first worker builds");
    let mut waiter = worker_cmd(d.dir(), "f32", &[]).spawn().expect("spawn");
    assert!(wait_until(Duration::from_secs(30), || d.stat("build_waits") == 1), "the second worker waits");
    builder.kill().unwrap();
    let _ = builder.wait();
    let line = first_line(&mut waiter);
    assert!(waiter.wait().unwrap().success());
    assert_eq!(line["cache"], "published", "the waiter became the builder: {line}");
    assert_eq!(line["output_blake3"], digest);
    assert_eq!(d.stat("builds_abandoned"), 1);
    assert_eq!(d.stat("published_segments"), 1, "nothing of the killed build was indexed");
    assert_hit_everything(&worker(d.dir(), "f32", &[]), &digest);
}

#[test]
#[cfg_attr(
    not(all(packd_model, packd_xnnpack)),
    ignore = "needs the MiniLM model and an XNNPACK root: run .ci/run, or set PACKD_TEST_MODEL and XNNPACK_ROOT"
)]
fn another_identity_never_hits() {
    let d = Daemon::start();
    let first = worker(d.dir(), "f32", &[]);
    assert_eq!(first["cache"], "published");
    // Another engine build or CPU feature set is another identity: built anew, no hit.
    let other = worker(d.dir(), "f32", &["--identity-extra", "engine=another-build"]);
    assert_eq!(other["cache"], "published", "{other}");
    assert_eq!((other["hits"].as_u64(), other["misses"].as_u64()), (Some(0), Some(37)), "{other}");
    assert_eq!(other["output_blake3"], first["output_blake3"]);
    // f16 inference over the same f32 weights is another identity too.
    assert_eq!(worker(d.dir(), "f16", &[])["cache"], "published");
    assert_eq!(d.stat("builds"), 3);
}

#[test]
#[cfg_attr(
    not(all(packd_model, packd_xnnpack)),
    ignore = "needs the MiniLM model and an XNNPACK root: run .ci/run, or set PACKD_TEST_MODEL and XNNPACK_ROOT"
)]
fn restarts_through_the_cache_directory_and_the_fd_store_rebuild_nothing() {
    // Reboot: the cache directory.
    let home = Arc::new(tempfile::tempdir().unwrap());
    let cache = home.path().join("cache");
    let cache_arg = cache.to_str().unwrap().to_string();
    let mut d = Daemon::start_in(Arc::clone(&home), &[], &["--cache-dir", &cache_arg]);
    let first = worker(d.dir(), "qd8", &[]);
    assert_eq!(first["cache"], "published");
    // The identity segment and the published one.
    assert!(wait_until(Duration::from_secs(20), || packd_tests::cache_files(&cache).len() == 2));
    d.terminate();
    let d = Daemon::start_in(home, &[], &["--cache-dir", &cache_arg]);
    assert_hit_everything(&worker(d.dir(), "qd8", &[]), &first["output_blake3"]);
    assert_eq!((d.stat("builds"), d.stat("pack_jobs")), (0, 0), "zero rebuilds, zero repacks");
    drop(d);

    // Restart: systemd's fd store.
    let home = Arc::new(tempfile::tempdir().unwrap());
    let dir = home.path().to_path_buf();
    let manager = systemd::manager(&dir);
    let socks = systemd::sockets(&dir);
    let env = [("FDSTORE", "64")];
    let args = ["--socket-dir", dir.to_str().unwrap()];
    let mut d = systemd::start(&manager, Arc::clone(&home), &socks, &env, &args);
    let first = worker(&dir, "f32", &[]);
    assert_eq!(first["cache"], "published");
    // The identity segment and the published one, and a manifest that lists both: the
    // daemon stores a segment's fd, then a new manifest; a crash in between would lose the
    // segment's record, so the test waits for that manifest.
    assert!(
        wait_until(Duration::from_secs(20), || segments_listed(&manager) == Some(2)),
        "{:?}",
        manager.stored_names()
    );
    d.crash();
    let d = systemd::start(&manager, Arc::clone(&home), &socks, &env, &args);
    assert_hit_everything(&worker(&dir, "f32", &[]), &first["output_blake3"]);
    assert_eq!((d.stat("builds"), d.stat("pack_jobs")), (0, 0), "zero rebuilds, zero repacks");
}

/// How many segments the fd store holds when its newest manifest lists every one of them
/// (`None` while one is stored but not listed yet).
fn segments_listed(manager: &packd_testkit::supervisor::Manager) -> Option<usize> {
    use prost::Message;
    use std::os::unix::fs::FileExt;
    let stored = manager.stored().ok()?;
    let (manifests, segments): (Vec<_>, Vec<_>) =
        stored.into_iter().partition(|(name, _)| name.starts_with("packd-manifest."));
    let newest = manifests
        .into_iter()
        .max_by_key(|(name, _)| name.trim_start_matches("packd-manifest.").parse::<u64>().unwrap_or(0))?;
    let file = std::fs::File::from(newest.1);
    let mut bytes = vec![0u8; usize::try_from(file.metadata().ok()?.len()).ok()?];
    file.read_exact_at(&mut bytes, 0).ok()?;
    let manifest = packd_proto::v1::FdStoreManifest::decode(bytes.as_slice()).ok()?;
    let listed: Vec<&str> = manifest.segments.iter().map(|s| s.fd_name.as_str()).collect();
    segments.iter().all(|(name, _)| listed.contains(&name.as_str())).then_some(segments.len())
}

/// `fetch-xnnpack --print-mirror` for the apt configuration in `etc` (and `XNNPACK_MIRROR`).
fn print_mirror(etc: &std::path::Path, mirror: Option<&str>) -> String {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/xnnpack/fetch-xnnpack");
    let mut cmd = std::process::Command::new(script);
    cmd.arg("--print-mirror").env("XNNPACK_APT_ETC", etc).env_remove("XNNPACK_MIRROR");
    if let Some(m) = mirror {
        cmd.env("XNNPACK_MIRROR", m);
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn fetch_xnnpack_takes_the_debian_mirror_apt_uses() {
    let etc = tempfile::tempdir().unwrap();
    let parts = etc.path().join("sources.list.d");
    std::fs::create_dir(&parts).unwrap();
    // Nothing configured (or only Ubuntu's archive): Debian's own.
    std::fs::write(etc.path().join("sources.list"), "deb http://archive.ubuntu.com/ubuntu noble main\n").unwrap();
    assert_eq!(print_mirror(etc.path(), None), "http://deb.debian.org/debian (from default)");
    // One-line entries: the security archive is skipped, options in brackets too.
    std::fs::write(
        etc.path().join("sources.list"),
        "# a comment\ndeb [signed-by=/k.gpg] http://mirror.example/debian-security bookworm-security main\n\
         deb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian bookworm main\n",
    )
    .unwrap();
    let from = etc.path().join("sources.list");
    assert_eq!(print_mirror(etc.path(), None), format!("http://mirror.example/debian (from {})", from.display()));
    // deb822 files come first, as apt reads them: Ubuntu's stanza skipped, deb-src too.
    let sources = parts.join("debian.sources");
    std::fs::write(
        &sources,
        "Types: deb\nURIs: http://ports.ubuntu.com/ubuntu\nSuites: noble\n\n\
         Types: deb-src\nURIs: http://src.example/debian\nSuites: trixie\n\n\
         Types: deb\n# a comment\nURIs: http://local.example/debian/\nSuites: trixie trixie-updates\nComponents: main\n",
    )
    .unwrap();
    assert_eq!(print_mirror(etc.path(), None), format!("http://local.example/debian/ (from {})", sources.display()));
    // The environment overrides them all.
    assert_eq!(
        print_mirror(etc.path(), Some("http://x.example/debian")),
        "http://x.example/debian (from XNNPACK_MIRROR)"
    );
}

/// The builder packs into the memfd packd then serves: while it builds, a writable memfd is
/// mapped in it, and the segment a served worker maps is that memfd (same inode): no copy.
#[test]
#[cfg_attr(
    not(all(packd_model, packd_xnnpack)),
    ignore = "needs the MiniLM model and an XNNPACK root: run .ci/run, or set PACKD_TEST_MODEL and XNNPACK_ROOT"
)]
fn the_builder_packs_into_the_memfd_packd_serves() {
    let d = Daemon::start();
    let go = d.dir().join("finalize-now");
    let args = ["--finalize-when", go.to_str().unwrap(), "--hold", "60"];
    let mut builder = worker_cmd(d.dir(), "f32", &args).spawn().expect("spawn the builder");
    let mut building = None;
    assert!(
        wait_until(Duration::from_secs(60), || {
            building = mapped_memfd_inode(builder.id(), "packd-xnnpack", "rw-s");
            building.is_some()
        }),
        "the builder maps no writable memfd while it builds"
    );
    std::fs::write(&go, b"").unwrap();
    assert_eq!(first_line(&mut builder)["cache"], "published");
    let mut served = worker_cmd(d.dir(), "f32", &["--hold", "60"]).spawn().expect("spawn a served worker");
    assert_eq!(first_line(&mut served)["cache"], "served");
    let (a, b) = (building, mapped_memfd_inode(served.id(), "packd-xnnpack", "r"));
    for c in [&mut builder, &mut served] {
        let _ = c.kill();
        let _ = c.wait();
    }
    assert!(a.is_some() && a == b, "the builder built in memfd inode {a:?}, the served worker maps {b:?}");
    assert_eq!((d.stat("builds"), d.stat("publishes")), (1, 1));
}
