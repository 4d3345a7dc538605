//! Access policy, with real clients running as other uids (`setpriv`): the control plane's
//! read-only RPCs serve everyone who can reach the socket, its mutating RPCs only admins
//! (root, packd's uid, admin_uids, admin_gids); non-admins see only their own clients; the
//! data plane admits only the allow lists when they are set.
//!
//! Needs root (to run clients as other uids); `.ci/run` runs it with `--ignored`.

use std::os::unix::fs::PermissionsExt;
use std::process::Output;

use packd_tests::{Bystander, Daemon, packctl_bin, small_model};

/// Lets every uid reach the daemon's sockets and files in its directory.
fn open_up(d: &Daemon) {
    for p in [d.dir().to_path_buf(), d.dir().join("packd.sock"), d.dir().join("control.sock")] {
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o777)).unwrap();
    }
}

/// `packctl --socket-dir DIR ARGS…` run as `uid` (and gid `uid`).
fn packctl_as(d: &Daemon, uid: u32, args: &[&str]) -> Output {
    packctl_with_groups(d, uid, &[], args)
}

/// `packctl` as `uid` (primary gid the same) with supplementary `groups`.
fn packctl_with_groups(d: &Daemon, uid: u32, groups: &[u32], args: &[&str]) -> Output {
    let id = uid.to_string();
    let mut cmd = std::process::Command::new("setpriv");
    cmd.args(["--reuid", &id, "--regid", &id]);
    if groups.is_empty() {
        cmd.arg("--clear-groups");
    } else {
        let list: Vec<String> = groups.iter().map(u32::to_string).collect();
        cmd.args(["--groups", &list.join(",")]);
    }
    cmd.arg(packctl_bin()).arg("--socket-dir").arg(d.dir()).args(args).output().expect("setpriv packctl")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
#[ignore = "root-only, run with --ignored (as .ci/run does): runs clients as other uids (setpriv)"]
fn mutating_rpcs_need_an_admin_and_others_see_only_their_own_clients() {
    let mut d = Daemon::start_config("admin_uids = [4242]\n");
    open_up(&d);
    let by = Bystander::new(&d); // a root client holding a lease
    let key = by.model.key().to_string();
    let nobody = 65534;

    // Read-only RPCs serve anyone.
    let stats = packctl_as(&d, nobody, &["stats", "--json"]);
    assert!(stats.status.success(), "{}", text(&stats));
    // Mutating RPCs are refused to a non-admin, naming why; nothing changes.
    for args in [
        vec!["evict", &key, "--force"],
        vec!["pin", &key],
        vec!["unpin", &key],
        vec!["budget", "1"],
        vec!["prefetch", "x.safetensors"],
    ] {
        let out = packctl_as(&d, nobody, &args);
        assert!(!out.status.success(), "{args:?} as nobody succeeded");
        let t = text(&out);
        assert!(t.contains("needs an admin") && t.contains("uid 65534"), "{args:?}: {t}");
    }
    assert_eq!(d.stat("segments"), 1, "nothing was evicted");
    assert_eq!(d.stat("evictions"), 0);
    // A non-admin sees only its own uid's clients; root sees every client.
    let theirs: serde_json::Value =
        serde_json::from_slice(&packctl_as(&d, nobody, &["clients", "--json"]).stdout).unwrap();
    assert_eq!(theirs["clients"].as_array().map(Vec::len), Some(0), "{theirs}");
    let all: serde_json::Value = serde_json::from_slice(&d.packctl(&["clients", "--json"]).stdout).unwrap();
    assert_eq!(all["clients"].as_array().map(Vec::len), Some(1), "{all}");
    // A configured admin uid may mutate: unpinning an unpinned key is answered.
    let out = packctl_as(&d, 4242, &["unpin", &key]);
    assert!(out.status.success(), "{}", text(&out));
    by.check(&mut d, "refused control calls");
}

#[test]
#[ignore = "root-only, run with --ignored (as .ci/run does): runs clients as other uids (setpriv)"]
fn the_data_plane_admits_only_the_allow_lists_when_set() {
    let mut d = Daemon::start_config("allow_uids = [4242]\n");
    open_up(&d);
    let by = Bystander::new(&d); // root is always admitted
    let model = d.dir().join("shared.safetensors");
    small_model(&model);
    std::fs::set_permissions(&model, std::fs::Permissions::from_mode(0o644)).unwrap();
    let m = model.to_str().unwrap();

    let refused = packctl_as(&d, 65534, &["pack", m]);
    assert!(!refused.status.success());
    let t = text(&refused);
    assert!(t.contains("not allowed on packd's data plane") && t.contains("PERMISSION_DENIED"), "{t}");
    let allowed = packctl_as(&d, 4242, &["pack", m]);
    assert!(allowed.status.success(), "{}", text(&allowed));
    assert!(d.stat("connections_refused") >= 1);
    by.check(&mut d, "a refused uid");
}

#[test]
#[ignore = "root-only, run with --ignored (as .ci/run does): runs clients as other uids and groups (setpriv)"]
fn supplementary_groups_count_for_the_admin_and_allow_lists() {
    let mut d = Daemon::start_config("admin_gids = [7001]\nallow_gids = [7002]\n");
    open_up(&d);
    let by = Bystander::new(&d);
    let key = by.model.key().to_string();
    let model = d.dir().join("shared.safetensors");
    small_model(&model);
    std::fs::set_permissions(&model, std::fs::Permissions::from_mode(0o644)).unwrap();
    let m = model.to_str().unwrap();

    // uid 4300's primary group is 4300: only a supplementary group can let it in.
    let refused = packctl_with_groups(&d, 4300, &[9], &["pack", m]);
    assert!(text(&refused).contains("PERMISSION_DENIED"), "{}", text(&refused));
    let admitted = packctl_with_groups(&d, 4300, &[9, 7002], &["pack", m]);
    assert!(admitted.status.success(), "{}", text(&admitted));

    let denied = packctl_with_groups(&d, 4300, &[7002], &["pin", &key]);
    assert!(text(&denied).contains("needs an admin"), "{}", text(&denied));
    let admin = packctl_with_groups(&d, 4300, &[7001], &["pin", &key]);
    assert!(admin.status.success(), "{}", text(&admin));
    by.check(&mut d, "callers admitted by supplementary groups");
}

#[test]
fn socket_mode_and_group_apply_to_the_sockets_packd_binds() {
    use std::os::unix::fs::MetadataExt;
    // Root can give the sockets any group; anyone else, one of its own.
    let gid = if nix::unistd::getuid().is_root() { 4242 } else { nix::unistd::getgid().as_raw() };
    let d = Daemon::start_config(&format!("socket_mode = \"0600\"\nsocket_group = {gid}\n"));
    for name in ["packd.sock", "control.sock"] {
        let meta = std::fs::metadata(d.dir().join(name)).unwrap();
        assert_eq!((meta.mode() & 0o777, meta.gid()), (0o600, gid), "{name}");
    }
    // A mode that locks packd out of its own socket is refused before anything binds.
    std::fs::write(d.dir().join("bad.toml"), "socket_mode = \"0066\"\n").unwrap();
    let bad = std::process::Command::new(packd_tests::packd_bin())
        .args(["--check-config", "--socket-dir", "/nonexistent"])
        .arg("--config")
        .arg(d.dir().join("bad.toml"))
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("socket_mode"), "{}", String::from_utf8_lossy(&bad.stderr));
}

#[test]
fn socket_mode_takes_the_octal_a_user_writes() {
    let check = |value: &str| {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("packd.toml"), format!("socket_mode = {value}\n")).unwrap();
        std::process::Command::new(packd_tests::packd_bin())
            .args(["--check-config", "--socket-dir", "/nonexistent"])
            .arg("--config")
            .arg(dir.path().join("packd.toml"))
            .output()
            .unwrap()
    };
    // 660 as chmod reads it, TOML's 0o660 (the number 432) and the string all mean 0660.
    for value in ["660", "0o660", "\"0660\"", "\"660\""] {
        let out = check(value);
        assert_eq!(out.status.code(), Some(0), "{value}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).contains("socket_mode = 0660"), "{value}");
    }
    let out = check("1224");
    assert_eq!(out.status.code(), Some(64));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("socket_mode 1224 must be an octal mode of at most 777"), "{err}");
}

#[test]
#[ignore = "root-only, run with --ignored (as .ci/run does): starts packd as root, runs a client as another uid (setpriv)"]
fn a_socket_only_root_can_reach_is_warned_about_and_explained_to_the_refused_client() {
    let packd_group = nix::unistd::Group::from_name("packd").unwrap();
    let d = Daemon::start();
    // The directory is open; the socket keeps the mode and group packd gave it.
    std::fs::set_permissions(d.dir(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = packctl_as(&d, 65534, &["stats"]);
    assert!(!out.status.success());
    let err = text(&out);
    if packd_group.is_none() {
        assert!(d.log().contains("only root can connect, since there is no group \"packd\""), "{}", d.log());
        assert!(d.log().contains("Nothing to do if every worker runs as root"), "{}", d.log());
        assert!(err.contains("Permission denied"), "{err}");
        assert!(err.contains("this user may not use packd's socket (root:root, mode 0660)"), "{err}");
        assert!(err.contains("groupadd --system packd"), "{err}");
        assert!(!err.contains("is packd running?"), "{err}");
    } else {
        assert!(!d.log().contains("only root can connect"), "{}", d.log());
        assert!(err.contains("join group \"packd\""), "{err}");
    }
    // The data plane (the client library) explains it the same way, and says it once.
    let out = packctl_as(&d, 65534, &["pack", "/etc/hostname"]);
    let err = text(&out);
    assert!(err.contains("this user may not use packd's socket"), "{err}");
    assert_eq!(err.matches("os error 13").count(), 1, "{err}");
    // So does health, which does not call packd down for it.
    let out = packctl_as(&d, 65534, &["health"]);
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), text(&out));
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("this user may not use packd's sockets") && !said.contains("not serving"), "{said}");
    assert!(said.contains("this user may not use packd's socket"), "{said}");
}

#[test]
fn a_missing_daemon_is_named_as_such_with_the_directory_tried() {
    let dir = tempfile::tempdir().unwrap();
    for args in [&["stats"][..], &["pack", "/etc/hostname"]] {
        let out =
            std::process::Command::new(packctl_bin()).arg("--socket-dir").arg(dir.path()).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("is packd running? Start it with `packd`"), "{err}");
        assert!(err.contains(&format!("this was {}", dir.path().display())), "{err}");
        assert_eq!(err.matches("os error 2").count(), 1, "{err}");
    }
}
