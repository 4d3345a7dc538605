//! The `packd` binary's command line. (Having an integration test here also makes
//! `cargo test --workspace` build the binary that the end-to-end tests in `tests/` start.)

use std::process::Command;

#[test]
fn help_explains_every_flag_and_version_prints() {
    let out = Command::new(env!("CARGO_BIN_EXE_packd")).arg("--help").output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    for flag in ["--socket-dir", "--digest-cache", "--config", "PACKD_SOCKET_DIR", "RUST_LOG", "64"] {
        assert!(help.contains(flag), "--help lacks {flag}:\n{help}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_packd")).arg("--version").output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("packd "));
}
