//! The daemon's life: usage errors, one daemon per directory, stale sockets, SIGTERM.

use std::process::Command;

use packd_tests::{Daemon, packd_bin, small_model};

#[test]
fn bad_usage_exits_64_with_a_message() {
    for (args, want) in [
        (vec!["--no-such-flag"], "--no-such-flag"),
        (vec!["--socket-dir", ""], "a value is required"),
        (vec!["--socket-dir", "/tmp/x", "--digest-cache", "0"], "at least 1"),
        (vec!["--config", "/nonexistent/packd.toml"], "cannot read config file"),
        (vec!["--socket-dir", "/tmp/x", "--cache-max-bytes", "lots"], "cache_max_bytes"),
        (vec!["--socket-dir", "/tmp/x", "--fd-store", "maybe"], "fd_store"),
        (vec!["--socket-dir", "/tmp/x", "--shutdown-timeout", "99999"], "shutdown_timeout"),
        (vec!["--socket-dir", "/tmp/x", "--cache-dir", "relative/dir"], "cache_dir"),
    ] {
        let out = Command::new(packd_bin()).args(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(64), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

#[test]
fn a_second_daemon_on_the_same_directory_is_refused() {
    let d = Daemon::start();
    for sock in ["packd.sock", "control.sock"] {
        let mode =
            std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(d.dir().join(sock)).unwrap().permissions());
        assert_eq!(mode & 0o777, 0o660, "{sock} mode");
    }
    let out = Command::new(packd_bin()).arg("--socket-dir").arg(d.dir()).output().unwrap();
    // Exit status 64, as OPERATIONS.md says: a configuration to change, not a failure to retry.
    assert_eq!(out.status.code(), Some(64));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("served by another running daemon"), "{err}");
    // The first one still serves.
    let file = d.dir().join("m.safetensors");
    small_model(&file);
    assert!(d.packctl(&["pack", file.to_str().unwrap()]).status.success());
}

#[test]
fn sigterm_stops_cleanly_and_a_stale_socket_is_replaced() {
    let dir = std::sync::Arc::new(tempfile::tempdir().unwrap());
    // A stale socket file left by a crashed daemon: nothing listens on it.
    let sock = dir.path().join("packd.sock");
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    // Started as the harness does: ready once it logs "packd serving", not once a connect
    // succeeds (a sibling test's fork-then-exec can hold the stale listener open for a
    // moment, and a connect would then be accepted by the stale socket).
    let mut cmd = Command::new(packd_bin());
    cmd.arg("--socket-dir").arg(dir.path());
    let mut d = Daemon::start_cmd(std::sync::Arc::clone(&dir), cmd);
    let file = dir.path().join("m.safetensors");
    small_model(&file);
    let model = packd_client::Client::connect(dir.path()).unwrap().pack(&file, &Default::default()).unwrap();
    let health = || {
        Command::new(packd_tests::packctl_bin())
            .arg("--socket-dir")
            .arg(dir.path())
            .args(["--timeout", "5", "health", "--json"])
            .output()
            .unwrap()
    };
    let up = health();
    assert!(up.status.success(), "{}", String::from_utf8_lossy(&up.stdout));
    assert!(String::from_utf8_lossy(&up.stdout).contains("\"serving\":true"));

    let status = d.terminate();
    assert!(status.success(), "{status}; log:\n{}", d.log());
    assert!(!sock.exists() && !dir.path().join("control.sock").exists(), "sockets removed");
    let down = health();
    assert_eq!(down.status.code(), Some(1), "{}", String::from_utf8_lossy(&down.stdout));
    assert!(String::from_utf8_lossy(&down.stdout).contains("\"serving\":false"));
    // Mappings outlive the daemon.
    model.verify().unwrap();
}

#[test]
fn an_implausibly_small_budget_is_warned_about_by_check_config_and_at_start() {
    let out = Command::new(packd_bin())
        .args(["--check-config", "--socket-dir", "/nonexistent", "--cache-dir", "off", "--max-bytes", "10"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("max_bytes = 10 bytes (flag or environment)"), "{text}");
    assert!(text.contains("warning: max_bytes is 10 bytes: smaller than almost any model"), "{text}");
    assert!(text.contains("cache_dir = off (turned off)"), "{text}");
    let d = Daemon::start_args(&[], &["--max-bytes", "10"]);
    assert!(d.log().contains("max_bytes is 10 bytes: smaller than almost any model"), "{}", d.log());
    let fine = Command::new(packd_bin())
        .args(["--check-config", "--socket-dir", "/nonexistent", "--max-bytes", "1GiB"])
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&fine.stdout).contains("max_bytes is"), "a sane budget is not warned about");
}

#[test]
fn settings_that_defeat_themselves_are_warned_about_by_check_config() {
    let dir = tempfile::tempdir().unwrap();
    let check = |toml: &str, extra: &[&str]| {
        let file = dir.path().join("packd.toml");
        std::fs::write(&file, toml).unwrap();
        let out = Command::new(packd_bin())
            .arg("--config")
            .arg(&file)
            .args(["--check-config", "--socket-dir", "/nonexistent"])
            .args(if extra.is_empty() { &["--cache-dir", "off"][..] } else { extra })
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{toml}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let limits =
        check("[limits]\nmax_connections = 10\nmax_connections_per_uid = 20\nmax_segments = 4000000000\n", &[]);
    assert!(
        limits.contains("warning: limits.max_connections_per_uid (20) is more than limits.max_connections"),
        "{limits}"
    );
    assert!(limits.contains("warning: limits.max_segments (4000000000) is more than the open-file limit"), "{limits}");
    let open = check("socket_mode = \"0777\"\n", &[]);
    assert!(open.contains("warning: socket_mode 0777 lets every local user connect"), "{open}");
    let closed = check("socket_mode = \"0640\"\n", &[]);
    assert!(closed.contains("warning: socket_mode 0640 gives the socket's group no write permission"), "{closed}");
    let cache = dir.path().join("cache");
    let never = check("", &["--cache-dir", cache.to_str().unwrap(), "--cache-max-bytes", "0"]);
    assert!(never.contains("warning: cache_max_bytes is 0: no segment is ever written"), "{never}");
    // The defaults warn about none of these.
    let fine = check("", &[]);
    for what in ["max_connections_per_uid", "max_segments", "socket_mode", "cache_max_bytes"] {
        assert!(
            !fine.contains(&format!("warning: {what}")) && !fine.contains(&format!("warning: limits.{what}")),
            "{fine}"
        );
    }
}
