//! Fault injection against the real daemon: clients SIGKILLed at random points under load,
//! and a daemon at its open-file limit. (The leader of a single flight killed mid-pack is
//! in `hung_source.rs`, where a source that answers only when told keeps the job running.)

use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use packd_client::{Error, Plan};
use packd_tests::sys::connect_nonblocking;
use packd_tests::{Daemon, packctl_bin, packd_bin, small_model, wait_until};

/// Runs `cmd` to its end, killing it (and failing) after `limit`.
fn output_within(mut cmd: Command, limit: Duration) -> std::process::Output {
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn");
    let end = Instant::now() + limit;
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > end {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!("{cmd:?} ran past {limit:?}; stderr:\n{}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

#[test]
fn random_sigkills_under_load_corrupt_nothing_and_leak_nothing() {
    // A budget smaller than the run's segments, so eviction and refusals happen too.
    let mut d = Daemon::start_config("max_bytes = \"12M\"\n");
    let mut cmd = d.packctl_cmd(&["bench", "stress", "--clients", "4", "--seconds", "6", "--kill-ms", "8", "--json"]);
    cmd.current_dir(d.dir());
    let out = output_within(cmd, Duration::from_secs(180));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let doc: serde_json::Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("{e}: {stdout}\nstderr:\n{}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(doc["checksum_failures"], 0, "{doc}");
    assert_eq!(doc["unexpected_errors"], 0, "{doc}");
    assert_eq!(doc["leaked_leases"], 0, "{doc}");
    assert!(doc["leaked_fds"].as_i64().unwrap() <= 0, "{doc}");
    assert_eq!(doc["daemon_alive"], true, "{doc}");
    assert_eq!(doc["final_check"], "ok", "{doc}");
    // The run did what it says: clients were killed at random points, and every kind of
    // operation ran many times.
    assert!(doc["kills"].as_u64().unwrap() >= 50, "{doc}");
    for op in ["pack", "get", "verify", "release", "half_frame"] {
        assert!(doc["ops"][op].as_u64().unwrap_or(0) >= 10, "{op}: {doc}");
    }
    assert!(out.status.success(), "{doc}");
    assert!(d.alive());
    assert!(!d.log().contains("INTERNAL"), "log:\n{}", d.log());
}

/// The CPU time (user + system, in clock ticks) `pid` has used so far.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

#[test]
fn a_daemon_at_its_open_file_limit_refuses_clearly_keeps_serving_and_recovers() {
    const LIMIT: usize = 64;
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let mut cmd = Command::new("sh");
    cmd.arg("-c").arg(format!("ulimit -n {LIMIT} && exec \"$0\" --socket-dir \"$1\"")).arg(packd_bin()).arg(dir.path());
    let d = Daemon::start_cmd(Arc::clone(&dir), cmd);
    let file = d.dir().join("small.safetensors");
    small_model(&file);
    let worker = d.client();
    let held = worker.pack(&file, &Plan::default()).unwrap();

    // Connections until the daemon has no fd left; the rest wait in the backlog. The
    // connects never block (a full backlog answers EAGAIN), so the window only waits for
    // the daemon to accept, however busy the machine.
    let mut hogs: Vec<UnixStream> = Vec::new();
    let sock = d.dir().join("packd.sock");
    let hog = |hogs: &mut Vec<UnixStream>| {
        for _ in 0..8 {
            match connect_nonblocking(&sock) {
                Ok(Some(s)) => hogs.push(s),
                Ok(None) => break, // the backlog is full: the daemon has to accept first
                Err(e) => panic!("connect: {e}"),
            }
        }
    };
    let full = wait_until(Duration::from_secs(60), || {
        hog(&mut hogs);
        d.all_fd_count() >= LIMIT
    });
    assert!(full, "daemon fds {} of {LIMIT} with {} connections made", d.all_fd_count(), hogs.len());

    // A new pack needs a new fd in the daemon: a clear RESOURCE_EXHAUSTED, not INTERNAL.
    match worker.pack(&file, &Plan::with_layout("identity")) {
        Err(Error::Daemon { code, message }) => {
            assert_eq!(code, packd_client::proto::ErrorCode::ResourceExhausted, "{message}");
            assert!(message.contains("open-file limit"), "{message}");
        }
        other => panic!("expected RESOURCE_EXHAUSTED, got {:?}", other.map(|m| m.key().to_string())),
    }
    // What is packed is still served on existing connections, bytes intact.
    let again = worker.get(held.key()).unwrap();
    again.verify().unwrap();
    assert_eq!(again.bytes(), held.bytes());

    // The accept loops back off instead of spinning on EMFILE.
    let t0 = cpu_ticks(d.pid());
    std::thread::sleep(Duration::from_secs(1));
    let used = cpu_ticks(d.pid()) - t0;
    assert!(used < 50, "the daemon used {used} ticks of CPU in 1 s at its fd limit");

    // packctl gives up after its timeout and says what it waited for. An fd the daemon
    // frees for a moment (its accept loops retrying) may let one control connection in:
    // then more hogs take the room and packctl asks again.
    let mut answered = Vec::new();
    let out = loop {
        let mut stats = Command::new(packctl_bin());
        stats.args(["--timeout", "1", "stats"]).arg("--socket-dir").arg(d.dir());
        let out = output_within(stats, Duration::from_secs(30));
        if !out.status.success() || answered.len() >= 4 {
            break out;
        }
        answered.push(d.all_fd_count());
        hog(&mut hogs);
    };
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("GetStats: no answer") && err.contains("--timeout"),
        "status {:?}, daemon fds when answered: {answered:?}\nstdout:\n{}\nstderr:\n{err}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );

    // Once the hogs leave, everything works again.
    drop(hogs);
    assert!(wait_until(Duration::from_secs(20), || d.fd_count() < LIMIT / 2), "fds {}", d.fd_count());
    let fresh = worker.pack(&file, &Plan::with_layout("identity")).unwrap();
    fresh.verify().unwrap();
    assert_eq!(d.stat("segments"), 2);
    assert!(!d.log().contains("INTERNAL"), "log:\n{}", d.log());
}
