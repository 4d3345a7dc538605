//! packd under a service manager, without one running: socket activation through
//! `systemd-socket-activate`, notifications on a datagram socket, SIGHUP reloads, the fd
//! store played by a harness across restarts, and refused sockets.

use std::os::fd::OwnedFd;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;
use packd_tests::systemd;
use packd_tests::{Daemon, packd_bin, small_model, wait_until};

fn model_bytes(model: &packd_client::Model) -> Vec<u8> {
    model.bytes().to_vec()
}

#[test]
#[cfg_attr(
    not(packd_socket_activate),
    ignore = "needs systemd-socket-activate: apt-get install systemd (.ci/run does)"
)]
fn socket_activation_ready_watchdog_and_reload() {
    let home = Arc::new(tempfile::tempdir().unwrap());
    let dir = home.path();
    let manager = systemd::manager(dir);
    let config = dir.join("packd.toml");
    std::fs::write(&config, "max_bytes = \"64MiB\"\n").unwrap();
    let mut cmd = Command::new("systemd-socket-activate");
    // The metrics listener as deploy/packd-metrics.socket passes it.
    let port = packd_tests::free_port();
    cmd.arg("-l").arg(dir.join("packd.sock")).arg("-l").arg(dir.join("control.sock"));
    cmd.arg("-l").arg(format!("127.0.0.1:{port}"));
    cmd.arg("--fdname=data:control:metrics").arg(format!("--setenv=NOTIFY_SOCKET={}", manager.socket().display()));
    // systemd-socket-activate passes only the variables it is told to.
    cmd.arg("--setenv=WATCHDOG_USEC=200000")
        .arg("--setenv=RUST_LOG")
        .arg("--setenv=PACKD_CACHE_DIR=off")
        .arg(packd_bin());
    cmd.arg("--config").arg(&config).arg("--socket-dir").arg(dir.join("unused"));
    let mut d = Daemon::spawn(Arc::clone(&home), cmd);
    assert!(wait_until(Duration::from_secs(20), || dir.join("control.sock").exists()), "{}", d.log());

    // The first connection starts packd; the request waits in the socket's backlog.
    let file = dir.join("m.safetensors");
    small_model(&file);
    let model = packd_client::Client::connect(dir).unwrap().pack(&file, &Default::default()).unwrap();
    model.verify().unwrap();
    let ready = manager.wait_line(0, "READY=1").expect("READY=1");
    assert!(manager.messages()[ready].contains("STATUS=serving"), "{:?}", manager.messages());
    assert!(manager.wait_line(ready, "WATCHDOG=1").is_some(), "no WATCHDOG=1: {:?}", manager.messages());
    assert!(manager.wait_line(0, "STATUS=serving 1 segments").is_some(), "{:?}", manager.messages());
    assert!(!dir.join("unused").exists(), "activated sockets are used, none bound");
    assert_eq!(d.stat("budget_bytes"), 64 << 20);
    assert_eq!(d.stat("pack_jobs"), 1);
    assert!(d.log().contains("activated=true"), "{}", d.log());
    let (status, body) = packd_tests::http_get(port, "/metrics");
    assert!(status.contains("200") && body.contains("\npackd_segments 1\n"), "{status}\n{body}");

    std::fs::write(&config, "max_bytes = \"96MiB\"\n").unwrap();
    let before = manager.messages().len();
    d.signal(Signal::SIGHUP);
    let reloading = manager.wait_line(before, "RELOADING=1").expect("RELOADING=1");
    assert!(manager.messages()[reloading].contains("MONOTONIC_USEC="), "{:?}", manager.messages());
    assert!(manager.wait_line(reloading + 1, "READY=1").is_some(), "READY=1 after the reload");
    assert_eq!(d.stat("budget_bytes"), 96 << 20);

    // A broken config file is refused on reload; the daemon keeps serving as it was.
    std::fs::write(&config, "max_bytes = \"lots\"\nsocket_dir = \"/elsewhere\"\n").unwrap();
    let before = manager.messages().len();
    d.signal(Signal::SIGHUP);
    assert!(manager.wait_line(before, "READY=1").is_some());
    assert!(d.log().contains("keeping the running one"), "{}", d.log());
    assert_eq!(d.stat("budget_bytes"), 96 << 20);
    std::fs::write(&config, "max_bytes = \"96MiB\"\nisa = \"scalar\"\n").unwrap();
    let before = manager.messages().len();
    d.signal(Signal::SIGHUP);
    assert!(manager.wait_line(before, "READY=1").is_some());
    assert!(d.log().contains("take effect only after a restart") && d.log().contains("isa"), "{}", d.log());
    // Keys are named as the file names them; the default spare follows max_bytes (which
    // changed above) without being named.
    std::fs::write(&config, "max_bytes = \"96MiB\"\nadmin_uids = [4321]\n[limits]\nidle_timeout = 7\n").unwrap();
    let before = manager.messages().len();
    d.signal(Signal::SIGHUP);
    assert!(manager.wait_line(before, "READY=1").is_some());
    let restart_lines = |log: String| -> Vec<String> {
        log.lines().filter(|l| l.contains("take effect only after a restart")).map(str::to_string).collect()
    };
    let lines = restart_lines(d.log());
    let last = lines.last().expect("a restart warning");
    assert!(last.contains("admin_uids") && last.contains("limits.idle_timeout"), "{last}");
    assert!(lines.iter().all(|l| !l.contains("spare_bytes") && !l.contains("control_policy")), "{lines:?}");

    // A budget that would evict most of what is resident is refused as SetBudget refuses
    // it: the segment (no longer leased) stays, and so does the budget.
    let key = model.key().to_string();
    drop(model);
    assert!(wait_until(Duration::from_secs(10), || d.stat("leases") == 0));
    std::fs::write(&config, "max_bytes = \"4KiB\"\n").unwrap();
    let before = manager.messages().len();
    d.signal(Signal::SIGHUP);
    assert!(manager.wait_line(before, "READY=1").is_some());
    assert!(d.log().contains("max_bytes = 4096 refused") && d.log().contains("--evict-most"), "{}", d.log());
    // The default cache cap (the budget) does not follow the refused budget either.
    assert!(!d.log().contains("cache_max_bytes=4096"), "{}", d.log());
    assert_eq!(d.stat("budget_bytes"), 96 << 20);
    assert_eq!(d.stat("segments"), 1);
    let model = packd_client::Client::connect(dir).unwrap().get(&key).unwrap();

    let before = manager.messages().len();
    let status = d.terminate();
    assert!(status.success(), "{status}: {}", d.log());
    assert!(manager.wait_line(before, "STOPPING=1").is_some());
    assert!(dir.join("packd.sock").exists(), "activated sockets belong to the manager and stay");
    model.verify().unwrap();
}

#[test]
fn a_socket_of_the_wrong_type_is_refused() {
    let home = Arc::new(tempfile::tempdir().unwrap());
    let manager = systemd::manager(home.path());
    let dgram = std::os::unix::net::UnixDatagram::bind(home.path().join("dgram")).unwrap();
    let mut fds = systemd::sockets(home.path());
    fds[0] = ("data".into(), OwnedFd::from(dgram));
    let cmd = systemd::command(&manager, fds, &[], &["--socket-dir", home.path().to_str().unwrap()]);
    let mut d = Daemon::spawn(Arc::clone(&home), cmd);
    let status = d.wait_exit();
    assert_eq!(status.code(), Some(64), "{}", d.log());
    assert!(d.log().contains("passed as \"data\"") && d.log().contains("not a stream socket"), "{}", d.log());
    assert!(manager.messages().iter().all(|m| !m.contains("READY=1")));
}

#[test]
fn fd_store_round_trip_serves_the_same_memfds_without_packing() {
    let home = Arc::new(tempfile::tempdir().unwrap());
    let dir = home.path().to_path_buf();
    let manager = systemd::manager(&dir);
    let socks = systemd::sockets(&dir);
    let env = [("FDSTORE", "64")];
    let args = ["--socket-dir", dir.to_str().unwrap()];
    let mut d = systemd::start(&manager, Arc::clone(&home), &socks, &env, &args);
    let file = dir.join("m.safetensors");
    small_model(&file);
    let first = d.client().pack(&file, &Default::default()).unwrap();
    let key = first.key().to_string();
    let first_segment_ino =
        std::os::unix::fs::MetadataExt::ino(&d.client().get_segment(&key).unwrap().file().metadata().unwrap());
    let name = key.replace(':', "_");
    let stored_once = |names: Vec<String>| {
        names.iter().filter(|n| **n == name).count() == 1
            && names.iter().filter(|n| n.starts_with("packd-manifest.")).count() == 1
            && names.len() == 2
    };
    assert!(
        wait_until(Duration::from_secs(10), || stored_once(manager.stored_names())),
        "{:?}",
        manager.stored_names()
    );
    let bytes = model_bytes(&first);

    // A crash: the stored fds come back and are served again, nothing is packed.
    d.crash();
    let mut d = systemd::start(&manager, Arc::clone(&home), &socks, &env, &args);
    assert_eq!(d.stat("pack_jobs"), 0, "{}", d.log());
    assert_eq!(d.stat("segments"), 1);
    let again = d.client().get(&key).unwrap();
    again.verify().unwrap();
    assert_eq!(model_bytes(&again), bytes);
    // No copy: the daemon serves the very memfd it packed before the crash.
    let ino = |seg: &packd_client::Segment| std::os::unix::fs::MetadataExt::ino(&seg.file().metadata().unwrap());
    let before_crash = first_segment_ino;
    assert_eq!(ino(&d.client().get_segment(&key).unwrap()), before_crash, "the same memfd, not a copy");
    let packed = d.client().pack(&file, &Default::default()).unwrap();
    assert_eq!(model_bytes(&packed), bytes);
    assert_eq!(d.stat("pack_jobs"), 0, "the source was recognised, not repacked");
    assert_eq!(packed.info().outcome(), packd_client::proto::PackOutcome::FoundInFdStore);
    drop((again, packed));

    // A tampered fd under the segment's name and an unknown fd: both refused and removed;
    // the real segment is stored again.
    let tampered = packd::sys::memfd::create("impostor").unwrap();
    std::io::Write::write_all(&mut &tampered, &bytes).unwrap();
    packd::sys::memfd::seal(&tampered).unwrap();
    manager.inject(&name, OwnedFd::from(tampered));
    let unsealed = packd::sys::memfd::create("unknown").unwrap();
    manager.inject("bogus", OwnedFd::from(unsealed));
    assert!(d.terminate().success());
    let d = systemd::start(&manager, Arc::clone(&home), &socks, &env, &args);
    let log = d.log();
    assert!(log.contains("another file") && log.contains("the manifest does not name it"), "{log}");
    assert_eq!(d.stat("pack_jobs"), 0);
    assert_eq!(model_bytes(&d.client().get(&key).unwrap()), bytes);
    assert!(
        wait_until(Duration::from_secs(10), || stored_once(manager.stored_names())),
        "{:?}",
        manager.stored_names()
    );

    // Eviction takes the segment out of the store.
    let out = d.packctl(&["evict", &key]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        wait_until(Duration::from_secs(10), || manager.stored_names().iter().all(|n| n.starts_with("packd-manifest."))),
        "{:?}",
        manager.stored_names()
    );
    first.verify().unwrap();
}

/// A pack of the small model is over before SIGTERM lands: this needs MiniLM's.
#[test]
#[cfg_attr(not(packd_model), ignore = "needs the MiniLM model: run .ci/run or set PACKD_TEST_MODEL")]
fn sigterm_during_a_pack_finishes_it_or_drops_it_whole() {
    let model = packd_tests::model_path();
    assert!(model.is_file(), "needs the MiniLM model: run .ci/run or set PACKD_TEST_MODEL");
    for timeout in ["20", "0"] {
        let home = Arc::new(tempfile::tempdir().unwrap());
        let dir = home.path().to_path_buf();
        let manager = systemd::manager(&dir);
        let socks = systemd::sockets(&dir);
        let cache = dir.join("cache");
        let args = [
            "--socket-dir",
            dir.to_str().unwrap(),
            "--cache-dir",
            cache.to_str().unwrap(),
            "--shutdown-timeout",
            timeout,
        ];
        let mut d = systemd::start(&manager, Arc::clone(&home), &socks, &[], &args);
        // A first pack makes packd keep a spare; the next job takes it, so its end would ask
        // for another one.
        let small = dir.join("small.safetensors");
        packd_tests::small_model(&small);
        d.client().pack(&small, &packd_client::Plan::default()).unwrap();
        assert!(wait_until(Duration::from_secs(20), || d.stat("spare_bytes") > 0), "{}", d.log());
        assert!(wait_until(Duration::from_secs(20), || packd_tests::cache_files(&cache).len() == 1), "{}", d.log());
        let client = d.client();
        let m = model.clone();
        let packing = std::thread::spawn(move || {
            client.pack(&m, &packd_client::Plan::with_layout("qc8w-gemm:nr=16,kr=4,sr=1")).map(|m| m.verify())
        });
        assert!(wait_until(Duration::from_secs(20), || d.stat("pack_jobs") == 2));
        let before = manager.messages().len();
        let status = d.terminate();
        assert!(status.success(), "timeout {timeout}: {status}\n{}", d.log());
        assert!(manager.wait_line(before, "STOPPING=1").is_some());
        // A job that ends while the daemon stops makes no new spare (128 MiB for nothing).
        let log = d.log();
        if let Some(at) = log.find("waiting for running pack jobs") {
            assert!(!log[at..].contains("spare memfd ready"), "timeout {timeout}: a spare made while stopping\n{log}");
        }
        drop(socks);
        match packing.join().unwrap() {
            Ok(verified) => verified.expect("a finished pack is whole"),
            Err(e) => {
                assert_eq!(timeout, "0", "with time to finish, the pack finishes: {e}");
                assert!(matches!(e, packd_client::Error::Unavailable { .. }), "timeout {timeout}: {e}");
            }
        }
        // The cache holds the whole segment or nothing, never a part (beside the small one).
        let d = Daemon::start_in(Arc::clone(&home), &[], &args[2..]);
        let segments = d.stat("segments") - 1;
        let pack_files = packd_tests::cache_files(&cache).len() - 1;
        assert!(
            segments <= 1 && pack_files as u64 == segments,
            "timeout {timeout}: {segments} segments, {pack_files} files\n{}",
            d.log()
        );
        if timeout == "20" {
            assert_eq!(segments, 1, "the finished pack was cached before exit:\n{}", d.log());
            assert!(d.log().contains("waiting for running pack jobs"), "{}", d.log());
        }
        eprintln!("timeout {timeout}: {segments} segment(s) after the restart");
    }
}

#[test]
fn a_cache_being_verified_extends_the_start_timeout_before_ready() {
    let home = Arc::new(tempfile::tempdir().unwrap());
    let dir = home.path().to_path_buf();
    let manager = systemd::manager(&dir);
    let socks = systemd::sockets(&dir);
    let cache = dir.join("cache");
    let args = ["--socket-dir", dir.to_str().unwrap(), "--cache-dir", cache.to_str().unwrap()];
    let mut d = systemd::start(&manager, Arc::clone(&home), &socks, &[], &args);
    let file = dir.join("m.safetensors");
    small_model(&file);
    d.client().pack(&file, &Default::default()).unwrap();
    assert!(wait_until(Duration::from_secs(10), || packd_tests::cache_files(&cache).len() == 1));
    assert!(d.terminate().success());
    let before = manager.messages().len();
    let d = systemd::start(&manager, Arc::clone(&home), &socks, &[], &args);
    let extend = manager.wait_line(before, "EXTEND_TIMEOUT_USEC=").expect("EXTEND_TIMEOUT_USEC");
    let ready = manager.wait_line(before, "READY=1").unwrap();
    assert!(extend < ready, "{:?}", manager.messages());
    assert_eq!((d.stat("segments"), d.stat("pack_jobs")), (1, 0));
}

#[test]
fn a_full_fd_store_keeps_what_fits_and_says_so() {
    let home = Arc::new(tempfile::tempdir().unwrap());
    let dir = home.path().to_path_buf();
    let manager = systemd::manager(&dir);
    let socks = systemd::sockets(&dir);
    // FileDescriptorStoreMax=3: one segment and the manifest (plus its successor).
    let d = systemd::start(
        &manager,
        Arc::clone(&home),
        &socks,
        &[("FDSTORE", "3")],
        &["--socket-dir", dir.to_str().unwrap()],
    );
    let client = d.client();
    let keys: Vec<String> = (0..3)
        .map(|i| {
            let f = dir.join(format!("m{i}.safetensors"));
            packd_tests::seeded_model(&f, i * 7);
            client.pack(&f, &Default::default()).unwrap().key().to_string()
        })
        .collect();
    assert!(wait_until(Duration::from_secs(10), || d.log().contains("fd store: full")), "{}", d.log());
    let segments = || manager.stored_names().into_iter().filter(|n| n.starts_with("b3_")).collect::<Vec<_>>();
    assert!(wait_until(Duration::from_secs(10), || segments() == vec![keys[0].replace(':', "_")]), "{:?}", segments());
    // Evicting the stored one frees its slot for the next pack.
    drop(client);
    assert!(wait_until(Duration::from_secs(10), || d.stat("leases") == 0));
    assert!(d.packctl(&["evict", &keys[0]]).status.success());
    let f = dir.join("m9.safetensors");
    packd_tests::seeded_model(&f, 99);
    let key = d.client().pack(&f, &Default::default()).unwrap().key().to_string();
    assert!(wait_until(Duration::from_secs(10), || segments() == vec![key.replace(':', "_")]), "{:?}", segments());
}
