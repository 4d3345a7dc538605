//! Fault injection against the real daemon: clients SIGKILLed at random points under load,
//! the leader of a single flight killed mid-pack while another client waits on it, and a
//! daemon at its open-file limit.

use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use packd_client::{Error, Plan};
use packd_tests::{Daemon, SafeTensors, packctl_bin, packd_bin, small_model, wait_until};

const GEMM: &str = "f32-gemm:nr=16,kr=1,sr=1";

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

#[test]
fn the_leader_of_a_single_flight_killed_mid_pack_leaves_the_job_to_its_waiter() {
    let d = Daemon::start();
    // 256 MiB of f32: its GEMM pack job runs long enough to kill its requester mid-job.
    let file = d.dir().join("big.safetensors");
    SafeTensors::default().add("w.weight", "F32", &[8192, 8192], vec![0u8; 8192 * 8192 * 4]).write(&file);
    let path = file.to_str().unwrap().to_string();
    // An identity pack first, so the digest is known and both requests go straight to the
    // GEMM job's flight.
    drop(d.client().pack(&file, &Plan::with_layout("identity")).unwrap());
    let (jobs, failures) = (d.stat("pack_jobs"), d.stat("pack_failures"));
    let started = |d: &Daemon| d.log().matches("pack job started").count();
    let before = started(&d);

    let mut leader = d.packctl_cmd(&["pack", &path, "--layout", GEMM]).stdout(Stdio::null()).spawn().unwrap();
    assert!(wait_until(Duration::from_secs(30), || started(&d) > before), "log:\n{}", d.log());
    let hits = d.stat("hits");
    let dir = d.dir().to_path_buf();
    let waiter = std::thread::spawn(move || {
        let client = packd_client::Client::connect(&dir).unwrap();
        let model = client.pack(&path, &Plan::with_layout(GEMM))?;
        model.verify()?;
        Ok::<_, Error>((model.key().to_string(), model.tensor("w.weight").map(|t| t.bytes().len())))
    });
    // The waiter has joined the running job's flight.
    assert!(wait_until(Duration::from_secs(30), || d.stat("hits") > hits), "{}", d.stats());
    assert_eq!(d.stat("segments"), 1, "the GEMM job must still be running when its leader dies");
    leader.kill().unwrap(); // SIGKILL, mid-pack
    leader.wait().unwrap();

    let (key, weight_len) = waiter.join().unwrap().expect("the waiter gets the segment");
    assert!(weight_len.is_some_and(|n| n >= 8192 * 8192 * 4), "{weight_len:?}");
    assert!(key.contains("@plan:"), "{key}");
    assert_eq!(d.stat("pack_jobs"), jobs + 1, "one job served both requests");
    assert_eq!(d.stat("pack_failures"), failures, "the job was not cancelled");
    assert!(!d.log().contains("every requester left"), "log:\n{}", d.log());
    assert_eq!(d.stat("segments"), 2);
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

    // Connections until the daemon has no fd left; the rest wait in the backlog.
    let mut hogs: Vec<UnixStream> = Vec::new();
    let full = wait_until(Duration::from_secs(20), || {
        for _ in 0..8 {
            hogs.push(UnixStream::connect(d.dir().join("packd.sock")).unwrap());
        }
        d.fd_count() >= LIMIT
    });
    assert!(full, "daemon fds {} of {LIMIT}", d.fd_count());

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

    // packctl gives up after its timeout and says what it waited for.
    let mut stats = Command::new(packctl_bin());
    stats.args(["--timeout", "1", "stats"]).arg("--socket-dir").arg(d.dir());
    let out = output_within(stats, Duration::from_secs(30));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("GetStats: no answer") && err.contains("--timeout"), "{err}");

    // Once the hogs leave, everything works again.
    drop(hogs);
    assert!(wait_until(Duration::from_secs(20), || d.fd_count() < LIMIT / 2), "fds {}", d.fd_count());
    let fresh = worker.pack(&file, &Plan::with_layout("identity")).unwrap();
    fresh.verify().unwrap();
    assert_eq!(d.stat("segments"), 2);
    assert!(!d.log().contains("INTERNAL"), "log:\n{}", d.log());
}
