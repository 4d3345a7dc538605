//! The C ABI, used for real: `examples/c/packd_example.c` is compiled with the system C
//! compiler against `include/packd.h` and the built `libpackd_client` (shared and static),
//! run against a real daemon, and its view of every entry — name, layout, dtype, shape,
//! length, BLAKE3, and a checksum of the bytes it read through the mapping — must equal the
//! Rust client's.

use std::path::{Path, PathBuf};
use std::process::Command;

use packd_tests::{Daemon, small_model};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

/// Compiles `source` (relative to the workspace root); `static_link` links
/// `libpackd_client.a` instead of the `.so`.
fn compile(source: &str, out: &Path, static_link: bool) {
    let lib = packd_tests::capi_lib_dir();
    let mut cc = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()));
    cc.args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(out)
        .arg(root().join(source))
        .arg("-I")
        .arg(root().join("capi/include"));
    if static_link {
        cc.arg(lib.join("libpackd_client.a")).args(archive_libs().split_whitespace());
    } else {
        cc.arg("-L").arg(lib).arg("-lpackd_client").arg(format!("-Wl,-rpath,{}", lib.display()));
    }
    let result = cc.output().expect("run the C compiler");
    assert!(result.status.success(), "cc failed:\n{}", String::from_utf8_lossy(&result.stderr));
}

/// The system libraries the archive needs, as `install.sh` writes them into the .pc files.
fn archive_libs() -> String {
    let script = std::fs::read_to_string(root().join("install.sh")).expect("install.sh");
    script
        .lines()
        .find_map(|l| l.strip_prefix("private=\"")?.strip_suffix('"'))
        .expect("no private= line in install.sh")
        .to_string()
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

#[test]
fn the_c_example_sees_the_same_bytes_as_the_rust_client() {
    let d = Daemon::start();
    let model_path = d.dir().join("small.safetensors");
    small_model(&model_path);
    let client = d.client();
    for (static_link, layout) in [(false, ""), (true, "identity"), (false, "f16-gemm:nr=8,kr=1,sr=1")] {
        let exe = d.dir().join(if static_link { "example-static" } else { "example" });
        compile("examples/c/packd_example.c", &exe, static_link);
        let out = Command::new(&exe).arg(&model_path).arg(layout).arg(d.dir()).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));

        let rust = client.pack(&model_path, &packd_client::Plan::with_layout(layout)).unwrap();
        let mut want = vec![format!("segment {} {} {}", rust.key(), rust.info().size, rust.tensors().count())];
        for t in rust.tensors() {
            let shape: Vec<String> = t.shape().iter().map(u64::to_string).collect();
            want.push(format!(
                "entry {} {} {} [{}] {} {} {:016x} {}",
                t.name(),
                t.layout(),
                t.dtype(),
                shape.join(","),
                t.bytes().len(),
                t.entry().blake3,
                fnv1a(t.bytes()),
                t.bias().unwrap_or("-")
            ));
        }
        let first = rust.tensors().next().unwrap();
        let e = first.entry();
        let details = format!("details {} v{} at-offset {}", e.offset, e.layout_version, rust.info().plan);
        let first = first.name().to_string();
        want.extend([
            format!("find {first} same-bytes"),
            details,
            "verify ok".into(),
            "get same".into(),
            "pack_fd same-key".into(),
            "missing NOT_FOUND null".into(),
        ]);
        let got: Vec<&str> = stdout.lines().collect();
        assert_eq!(&got[..want.len()], &want.iter().map(String::as_str).collect::<Vec<_>>()[..], "layout {layout:?}");
        let last = got[want.len()];
        assert!(last.starts_with("out-of-range INVALID_ARGUMENT: entry ") && last.contains("out of range"), "{last}");
    }
    // Every model the C programs held was released (by them, or when they exited).
    assert!(packd_tests::wait_until(std::time::Duration::from_secs(10), || d.stat("leases") == 0));
}

#[test]
fn c_calls_on_a_daemon_that_never_answers_time_out() {
    let silent = packd_tests::SilentDaemon::start();
    let exe = silent.dir().join("deadline");
    compile("tests/c/deadline.c", &exe, false);
    let model = silent.dir().join("small.safetensors");
    small_model(&model);
    let out = Command::new(&exe).arg(silent.dir()).arg(&model).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines[0], "set_timeouts OK");
    assert!(lines[1].starts_with("get TIMEOUT ") && lines[1].contains("a get request within 200ms"), "{stdout}");
    assert!(lines[2].starts_with("pack TIMEOUT ") && lines[2].contains("a pack request within 200ms"), "{stdout}");
    assert_eq!(lines[3], "model null");
}

#[test]
fn a_c_pack_with_a_progress_callback_hears_the_acknowledgement_and_maps_the_model() {
    let d = Daemon::start();
    let exe = d.dir().join("progress");
    compile("tests/c/progress.c", &exe, false);
    let model = d.dir().join("small.safetensors");
    small_model(&model);
    let out = Command::new(&exe).arg(d.dir()).arg(&model).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<&str> = stdout.lines().collect();
    let fields: Vec<u64> = lines[0].strip_prefix("progress ").unwrap().split(' ').map(|f| f.parse().unwrap()).collect();
    // The daemon acknowledges every pack before it starts: at least one call, the first
    // one ACCEPTED (1); bytes never pass the file's size.
    let size = std::fs::metadata(&model).unwrap().len();
    assert!(fields[0] >= 1 && fields[1] == 1 && fields[2] <= size && fields[3] <= size, "{stdout}");
    let rust = d.client().pack(&model, &packd_client::Plan::with_layout("identity")).unwrap();
    assert_eq!(lines[1], format!("segment {} {}", rust.key(), rust.bytes().len()));
}

#[test]
fn c_reports_reach_the_daemon_one_kept_while_there_was_no_client() {
    use std::io::{BufRead, BufReader};
    let d = Daemon::start();
    let exe = d.dir().join("report");
    compile("tests/c/report.c", &exe, false);
    let mut child = Command::new(&exe)
        .arg(d.dir())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let got: Vec<String> = (0..8).map(|_| lines.next().unwrap().unwrap()).collect();
    assert_eq!(
        got,
        [
            "later OK",
            "connect OK",
            "private OK",
            "served OK",
            "bad_obtained INVALID_ARGUMENT",
            "bad_fallback INVALID_ARGUMENT",
            "no_reason INVALID_ARGUMENT",
            "served_with_reason INVALID_ARGUMENT"
        ]
    );
    assert!(packd_tests::wait_until(std::time::Duration::from_secs(5), || d.stats()["worker_reports"] == 3));
    let s = d.stats();
    assert_eq!(
        (s["private_fallbacks"]["daemon_away"].as_u64(), s["private_fallbacks"]["engine_cache"].as_u64()),
        (Some(1), Some(1)),
        "{s}"
    );
    assert_eq!((s["workers_private"].as_u64(), s["private_bytes"].as_u64()), (Some(1), Some(3000)), "{s}");
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
}

#[test]
fn calls_made_while_a_thread_ends_return_and_never_abort() {
    // After the library's thread-locals are gone (an atexit handler, a pthread key
    // destructor), a failing call still returns its status and packd_last_error() a
    // message: no panic crosses the C boundary (it would abort the process).
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("teardown");
    compile("tests/c/teardown.c", &exe, false);
    for (arg, want) in [
        (None, vec!["main INVALID_ARGUMENT client is NULL", "atexit INVALID_ARGUMENT "]),
        (Some("thread"), vec!["worker INVALID_ARGUMENT client is NULL", "key-destructor INVALID_ARGUMENT ", "joined"]),
    ] {
        let out = Command::new(&exe).args(arg).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{arg:?}: {:?}\n{stdout}\n{stderr}", out.status);
        let lines: Vec<&str> = stdout.lines().collect();
        assert_eq!(lines.len(), want.len(), "{arg:?}: {stdout}");
        for (line, want) in lines.iter().zip(&want) {
            assert!(line.starts_with(want), "{arg:?}: {line:?} does not start with {want:?}");
        }
        // The message during teardown: the one kept, or the static one, never empty.
        assert!(lines[1].len() > want[1].len(), "{arg:?}: {stdout}");
    }
}

#[test]
fn a_forked_child_uses_inherited_clients_and_models_without_touching_the_parents() {
    use std::io::{BufRead, BufReader, Write};
    let d = Daemon::start();
    let model = d.dir().join("m.safetensors");
    small_model(&model);
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("fork");
    compile("tests/c/fork.c", &exe, false);
    let mut child = Command::new(&exe)
        .arg(d.dir())
        .arg(&model)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut stdin = child.stdin.take().unwrap();
    // Killed if an assertion fails before it exits.
    let mut held = packd_tests::Held(vec![child]);
    let mut lines = BufReader::new(stdout).lines();
    let parent = lines.next().unwrap().unwrap();
    assert!(parent.starts_with("parent b3:"), "{parent}");
    assert_eq!(lines.next().unwrap().unwrap(), "child same");
    // The parent's own packs may still run after the child is done: wait for them.
    assert_eq!(lines.next().unwrap().unwrap(), "parent idle");
    // The child is gone with its own connection; the parent's one lease is still counted.
    // Releases carry no reply, so the daemon may count the last one a moment later.
    packd_tests::wait_until(std::time::Duration::from_secs(10), || {
        let s = d.stats();
        s["clients"] == 1 && s["leases"] == 1
    });
    let s = d.stats();
    assert_eq!((s["clients"].as_u64(), s["leases"].as_u64()), (Some(1), Some(1)), "{s}");
    writeln!(stdin, "done").unwrap();
    assert!(held.0[0].wait().unwrap().success());
}
