//! The files in `deploy/` stay valid: systemd's own checker finds nothing to say about the
//! units, their exposure score does not regress, the example config parses with every key.

use std::path::{Path, PathBuf};
use std::process::Command;

use packd_tests::packd_bin;

/// The exposure `systemd-analyze security` gives deploy/packd.service today; the test fails
/// if a change makes it worse.
const EXPOSURE_GATE: f64 = 0.4;

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn analyze(args: &[&str], dir: &Path) -> (bool, String) {
    let out = Command::new("systemd-analyze")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("systemd-analyze is missing: install Debian's systemd package (.ci/run does)");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

#[test]
#[cfg_attr(not(packd_systemd_analyze), ignore = "needs systemd-analyze: apt-get install systemd (.ci/run does)")]
fn units_verify_clean() {
    // `verify` checks that ExecStart's binary exists: point it at the one just built.
    let dir = tempfile::tempdir().unwrap();
    for unit in ["packd.service", "packd.socket", "packd-control.socket", "packd-metrics.socket"] {
        let text = std::fs::read_to_string(deploy().join(unit)).unwrap();
        let text = text.replace("/usr/bin/packd", packd_bin().to_str().unwrap());
        std::fs::write(dir.path().join(unit), text).unwrap();
    }
    let (ok, text) = analyze(
        &["verify", "packd.service", "packd.socket", "packd-control.socket", "packd-metrics.socket"],
        dir.path(),
    );
    assert!(ok && text.trim().is_empty(), "systemd-analyze verify:\n{text}");
}

#[test]
#[cfg_attr(not(packd_systemd_analyze), ignore = "needs systemd-analyze: apt-get install systemd (.ci/run does)")]
fn the_service_exposure_does_not_regress() {
    let unit = deploy().join("packd.service");
    let (ok, text) = analyze(&["security", "--offline=yes", unit.to_str().unwrap()], &deploy());
    assert!(ok, "{text}");
    let score: f64 = text
        .lines()
        .find_map(|l| l.split("Overall exposure level for packd.service:").nth(1))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no overall exposure in:\n{text}"));
    assert!(score <= EXPOSURE_GATE, "exposure {score} is above {EXPOSURE_GATE}:\n{text}");
    // The loopback TCP drop-in gives up network isolation; it stays a drop-in.
    let dropin = std::fs::read_to_string(deploy().join("dropins/control-tcp.conf")).unwrap();
    assert!(dropin.contains("PrivateNetwork=no"));
    let service = std::fs::read_to_string(&unit).unwrap();
    for line in
        ["PrivateNetwork=yes", "RestrictAddressFamilies=AF_UNIX\n", "Type=notify\n", "RestartPreventExitStatus=64"]
    {
        assert!(service.contains(line), "packd.service lacks {line:?}");
    }
}

#[test]
fn the_example_config_parses_and_documents_every_key() {
    let text = std::fs::read_to_string(deploy().join("packd.toml")).unwrap();
    // Every key appears, commented out with its default or set; uncommented they all parse.
    let uncommented: String = text
        .lines()
        .map(|l| match l.strip_prefix("# ") {
            Some(rest)
                if rest
                    .split(" = ")
                    .next()
                    .is_some_and(|k| !k.is_empty() && k.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
                    && rest.contains(" = ") =>
            {
                rest
            }
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\n");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("packd.toml");
    let uncommented =
        uncommented.replace("model_roots = [\"/srv/models\"]", &format!("model_roots = [{:?}]", dir.path()));
    std::fs::write(&file, &uncommented).unwrap();
    for key in [
        "socket_dir",
        "max_bytes",
        "cache_dir",
        "cache_max_bytes",
        "fd_store",
        "shutdown_timeout",
        "model_roots",
        "isa",
        "digest_cache",
        "control_tcp",
        "control_tcp_allow_remote",
        "control_tcp_allow_mutations",
        "socket_mode",
        "socket_group",
        "admin_uids",
        "admin_gids",
        "allow_uids",
        "allow_gids",
        "max_connections",
        "max_connections_per_uid",
        "max_request_bytes",
        "frame_timeout",
        "idle_timeout",
        "source_timeout",
        "max_source_ops",
        "max_source_ops_per_uid",
        "frames_per_turn",
        "max_segments",
        "request_log_per_second",
    ] {
        assert!(uncommented.lines().any(|l| l.starts_with(&format!("{key} = "))), "packd.toml does not document {key}");
    }
    // `--help` exits before anything binds; a bad file would exit 64 first.
    // The example names the packd group, which exists only where packd is installed.
    let isa_free = uncommented
        .replace("isa = \"avx512\"", "")
        .replace("socket_group = \"packd\"", &format!("socket_group = {}", nix::unistd::getgid()));
    std::fs::write(&file, isa_free).unwrap();
    let out = Command::new(packd_bin()).arg("--config").arg(&file).arg("--check-config").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn the_kubernetes_config_map_holds_a_valid_config() {
    let yaml = std::fs::read_to_string(deploy().join("kubernetes/packd.yaml")).unwrap();
    let toml: String = yaml
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("packd.toml: |"))
        .skip(1)
        .take_while(|l| l.starts_with("    "))
        .map(|l| format!("{}\n", &l[4..]))
        .collect();
    assert!(toml.contains("cache_dir"), "no packd.toml in the ConfigMap:\n{yaml}");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("packd.toml"), &toml).unwrap();
    let out = Command::new(packd_bin())
        .arg("--config")
        .arg(dir.path().join("packd.toml"))
        .arg("--check-config")
        .output()
        .unwrap();
    assert!(out.status.success(), "{toml}\n{}", String::from_utf8_lossy(&out.stderr));
    // The probes use the health command packctl really has.
    assert!(yaml.contains("\"health\"]"));
    let help = Command::new(packd_tests::packctl_bin()).args(["health", "--help"]).output().unwrap();
    assert!(help.status.success());
}
