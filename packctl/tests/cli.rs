//! The `packctl` binary's command line. (Having an integration test here also makes
//! `cargo test --workspace` build the binary that the end-to-end tests in `tests/` run.)

use std::process::Command;

#[test]
fn every_command_has_help() {
    let packctl = env!("CARGO_BIN_EXE_packctl");
    let out = Command::new(packctl).arg("--help").output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    for cmd in ["pack", "map", "cat", "stats", "--socket-dir"] {
        assert!(help.contains(cmd), "--help lacks {cmd}:\n{help}");
    }
    for (cmd, flags) in [
        ("pack", &["--layout", "--rule", "--json"][..]),
        ("map", &["--touch", "--verify", "--hold", "--layout", "--rule"][..]),
        ("cat", &["--tensor", "--layout", "--rule"][..]),
        ("stats", &["--json"][..]),
    ] {
        let out = Command::new(packctl).args([cmd, "--help"]).output().unwrap();
        let help = String::from_utf8(out.stdout).unwrap();
        for flag in flags {
            assert!(help.contains(flag), "packctl {cmd} --help lacks {flag}:\n{help}");
        }
    }
}

#[test]
fn a_missing_daemon_is_a_clear_error() {
    let dir = std::env::temp_dir().join(format!("packctl-no-daemon-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_packctl"))
        .arg("--socket-dir")
        .arg(&dir)
        .args(["pack", "/nonexistent.safetensors"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot connect") && err.contains("is packd running?"), "{err}");
}
