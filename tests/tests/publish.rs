//! Engine-published segments, with the real daemon and real client processes: publish and
//! acquire, single flight across processes (one build; a killed builder's role passes on;
//! an overrunning builder sends waiters to build privately), persistence across restarts,
//! and every bad publication refused with its reason while other clients are unaffected.

use std::io::{BufRead, BufReader};
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use packd_client::proto::{self, ErrorCode, request};
use packd_client::{AcquireOptions, Acquired, PublishEntry};
use packd_tests::{Bystander, Daemon, expect_error, recv_reply, send_request, wait_until};

fn publisher(d: &Daemon, identity: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_publisher"));
    cmd.arg(d.dir()).arg(identity).args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd
}

/// The first JSON line a publisher process prints.
fn first_line(child: &mut Child) -> serde_json::Value {
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().expect("stdout")).read_line(&mut line).expect("read");
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("publisher printed {line:?}: {e}"))
}

fn run(d: &Daemon, identity: &str, args: &[&str]) -> serde_json::Value {
    let mut child = publisher(d, identity, args).spawn().expect("spawn publisher");
    let v = first_line(&mut child);
    let _ = child.wait();
    v
}

/// A sealed memfd like the publisher binary builds: entry i is 100 + i bytes at 128 × i.
fn segment(entries: u64, seed: u8) -> (std::fs::File, u64, Vec<PublishEntry>) {
    let file = unsealed(4096);
    let mut table = Vec::new();
    for i in 0..entries {
        let bytes: Vec<u8> = (0..100 + i).map(|j| seed.wrapping_add((i + j).to_le_bytes()[0])).collect();
        file.write_all_at(&bytes, 128 * i).unwrap();
        table.push(PublishEntry { key: format!("op{i}"), offset: 128 * i, length: 100 + i });
    }
    seal(&file, &[memfd::FileSeal::SealShrink, memfd::FileSeal::SealGrow, memfd::FileSeal::SealWrite]);
    seal(&file, &[memfd::FileSeal::SealSeal]);
    (file, 4096, table)
}

fn unsealed(size: u64) -> std::fs::File {
    let file = memfd::MemfdOptions::default().allow_sealing(true).create("test").unwrap().into_file();
    file.set_len(size).unwrap();
    file
}

fn seal(file: &std::fs::File, seals: &[memfd::FileSeal]) {
    let mfd = memfd::Memfd::try_from_file(file.try_clone().unwrap()).unwrap();
    mfd.add_seals(seals).unwrap();
}

#[test]
fn a_published_segment_is_served_to_the_next_acquire_with_the_same_bytes() {
    let d = Daemon::start();
    let builder = d.client();
    let Acquired::Build { deadline, max_entries, .. } = builder.acquire("id-1", AcquireOptions::default()).unwrap()
    else {
        panic!("the first acquire must build")
    };
    assert!(deadline > Duration::from_secs(100) && max_entries == 16_384, "{deadline:?} {max_entries}");
    let (file, size, table) = segment(5, 7);
    let published = builder.publish("id-1", &file, size, &table).unwrap().map().unwrap();
    published.verify().unwrap();
    assert_eq!(published.len(), 5);

    let other = d.client();
    let Acquired::Segment(seg) = other.acquire("id-1", AcquireOptions::default()).unwrap() else {
        panic!("the second acquire must be served")
    };
    let got = seg.map().unwrap();
    got.verify().unwrap();
    assert_eq!(got.key(), published.key());
    for (i, t) in got.tensors().enumerate() {
        let i = i as u64;
        let want: Vec<u8> = (0..100 + i).map(|j| 7u8.wrapping_add((i + j).to_le_bytes()[0])).collect();
        assert_eq!(t.name(), format!("op{i}"));
        assert_eq!(t.layout(), "engine");
        assert_eq!(t.bytes(), want.as_slice(), "entry {i}");
    }
    let publisher = got.info().publisher.clone().expect("publisher recorded");
    assert_eq!((publisher.uid, publisher.identity.as_str()), (nix::unistd::getuid().as_raw(), "id-1"));
    assert_eq!(d.stat("builds"), 1);
    assert_eq!(d.stat("publishes"), 1);
    assert_eq!(d.stat("published_segments"), 1);
    assert_eq!(d.stat("published_bytes"), 4096);
    // A second publication of the identity is refused; the first stays.
    let (file, size, table) = segment(2, 9);
    let err = other.publish("id-1", &file, size, &table).unwrap_err();
    assert_eq!(err.code(), "ALREADY_EXISTS", "{err}");
    // The listing names the publisher and the identity.
    let listed = d.packctl(&["ls", "--json"]);
    let text = String::from_utf8_lossy(&listed.stdout);
    assert!(text.contains("\"identity\":\"id-1\"") || text.contains("\"identity\": \"id-1\""), "{text}");
    // The table fits 100 columns with an engine's segment in it, named by its identity as
    // `packctl models` names it.
    let table = String::from_utf8_lossy(&d.packctl(&["ls"]).stdout).to_string();
    assert!(table.lines().all(|l| l.chars().count() <= 100), "{table}");
    assert!(table.lines().nth(1).is_some_and(|row| row.contains(" id-1 ")), "{table}");
    let models = String::from_utf8_lossy(&d.packctl(&["models"]).stdout).to_string();
    assert!(models.lines().nth(1).is_some_and(|row| row.ends_with(" id-1")), "{models}");
    // Another identity is not served by this one.
    assert!(matches!(other.acquire("id-2", AcquireOptions::default()).unwrap(), Acquired::Build { .. }));
}

#[test]
fn processes_started_at_once_build_once_and_the_others_wait_and_hit() {
    let d = Daemon::start();
    // The builder publishes only once the test has seen the three others wait.
    let go = d.dir().join("publish-now");
    let args = ["--publish-when", go.to_str().unwrap()];
    let mut children: Vec<Child> = (0..4).map(|_| publisher(&d, "flight", &args).spawn().expect("spawn")).collect();
    assert!(
        wait_until(Duration::from_secs(30), || d.stat("builds") == 1 && d.stat("build_waits") == 3),
        "one builds, three wait: {} builds, {} waits",
        d.stat("builds"),
        d.stat("build_waits")
    );
    std::fs::write(&go, b"").unwrap();
    let lines: Vec<serde_json::Value> = children.iter_mut().map(first_line).collect();
    for c in &mut children {
        let _ = c.wait();
    }
    let built = lines.iter().filter(|l| l["got"] == "built").count();
    let served = lines.iter().filter(|l| l["got"] == "segment").count();
    assert_eq!((built, served), (1, 3), "{lines:?}");
    let digests: Vec<&serde_json::Value> = lines.iter().map(|l| &l["blake3"]).collect();
    assert!(digests.windows(2).all(|w| w[0] == w[1]), "one copy of the bytes: {digests:?}");
    assert_eq!(d.stat("builds"), 1);
    assert_eq!(d.stat("build_waits"), 3);
}

#[test]
fn a_killed_builder_gives_its_role_to_a_waiter_and_nothing_half_built_is_served() {
    let d = Daemon::start();
    let mut hung = publisher(&d, "killed", &["--hang"]).spawn().expect("spawn");
    assert_eq!(first_line(&mut hung)["got"], "building");
    let mut waiter = publisher(&d, "killed", &["--seed", "3"]).spawn().expect("spawn");
    assert!(wait_until(Duration::from_secs(10), || d.stat("build_waits") == 1), "the second process waits");
    hung.kill().unwrap();
    let _ = hung.wait();
    let line = first_line(&mut waiter);
    let _ = waiter.wait();
    assert_eq!(line["got"], "built", "the waiter became the builder: {line}");
    assert_eq!(d.stat("builds"), 2);
    assert_eq!(d.stat("builds_abandoned"), 1);
    assert_eq!(run(&d, "killed", &[])["got"], "segment");
}

#[test]
fn waiters_build_privately_when_the_builder_overruns_its_deadline() {
    let d = Daemon::start();
    // The waiter must be waiting before the builder's deadline: 5 s leaves a loaded host
    // time to start it.
    let mut hung = publisher(&d, "slow", &["--hang", "--build-seconds", "5"]).spawn().expect("spawn");
    assert_eq!(first_line(&mut hung)["got"], "building");
    let line = run(&d, "slow", &[]);
    assert_eq!(line["got"], "private", "{line}");
    assert!(line["reason"].as_str().unwrap().contains("deadline"), "{line}");
    assert_eq!(line["fallback"], "build_timeout", "{line}");
    assert_eq!(d.stat("builds_expired"), 1);
    // A waiter that waits less than the deadline is told so.
    let mut hung2 = publisher(&d, "slow2", &["--hang"]).spawn().expect("spawn");
    assert_eq!(first_line(&mut hung2)["got"], "building");
    let line = run(&d, "slow2", &["--wait-seconds", "1"]);
    assert_eq!(line["got"], "private", "{line}");
    assert!(line["reason"].as_str().unwrap().contains("limits.build_wait"), "{line}");
    assert_eq!(line["fallback"], "build_timeout", "{line}");
    // After the deadline, the next acquire builds (and the late builder's role is gone).
    assert_eq!(run(&d, "slow", &[])["got"], "built");
    hung.kill().unwrap();
    hung2.kill().unwrap();
}

#[test]
fn published_segments_survive_a_restart_through_the_cache_directory() {
    let home = std::sync::Arc::new(tempfile::tempdir().unwrap());
    let cache = home.path().join("cache");
    let cache_arg = cache.to_str().unwrap().to_string();
    let mut d = Daemon::start_in(std::sync::Arc::clone(&home), &[], &["--cache-dir", &cache_arg]);
    let built = run(&d, "persist", &["--entries", "4"]);
    assert_eq!(built["got"], "built");
    assert!(
        wait_until(Duration::from_secs(10), || packd_tests::cache_files(&cache).len() == 1),
        "the published segment reaches the cache directory"
    );
    d.terminate();
    let d = Daemon::start_in(home, &[], &["--cache-dir", &cache_arg]);
    let served = run(&d, "persist", &[]);
    assert_eq!(served["got"], "segment", "{served}");
    assert_eq!(served["blake3"], built["blake3"], "same bytes after the restart");
    assert_eq!(d.stat("builds"), 0, "zero rebuilds");
    assert_eq!(d.stat("published_segments"), 1);
}

/// Sends a publish request with `fds` on a raw connection and returns the error.
fn publish_raw(d: &Daemon, req: proto::PublishRequest, fds: &[std::os::fd::BorrowedFd<'_>]) -> (ErrorCode, String) {
    let s = d.raw();
    send_request(&s, &proto::Request { id: 7, body: Some(request::Body::Publish(req)), progress: false }, fds);
    let (reply, got) = recv_reply(&s).expect("a reply");
    assert!(got.is_empty(), "an error carries no fd");
    expect_error(&reply)
}

fn table(entries: &[(&str, u64, u64)]) -> Vec<proto::PublishedEntry> {
    entries.iter().map(|&(k, offset, length)| proto::PublishedEntry { key: k.into(), offset, length }).collect()
}

#[test]
fn every_bad_publication_is_refused_with_its_reason_and_harms_nobody() {
    let mut d = Daemon::start();
    let by = Bystander::new(&d);
    let req = |size, entries: &[(&str, u64, u64)]| proto::PublishRequest {
        identity: "bad".into(),
        size,
        entries: table(entries),
        ..Default::default()
    };
    let good = [("a", 0, 64), ("b", 64, 64)];
    let (sealed, _, _) = segment(2, 1);

    // Unsealed, partially sealed, and sealed while a writable mapping was kept.
    let bare = unsealed(4096);
    let (code, msg) = publish_raw(&d, req(4096, &good), &[bare.as_fd()]);
    assert_eq!(code, ErrorCode::BadFd, "{msg}");
    assert!(msg.contains("lacks the seals") && msg.contains("SEAL_WRITE"), "{msg}");
    // A memfd made without MFD_ALLOW_SEALING carries F_SEAL_SEAL alone: the reply says to
    // make it with the flag (no seal can be added to it).
    let no_sealing = memfd::MemfdOptions::default().allow_sealing(false).create("test").unwrap().into_file();
    no_sealing.set_len(4096).unwrap();
    let (code, msg) = publish_raw(&d, req(4096, &good), &[no_sealing.as_fd()]);
    assert!(code == ErrorCode::BadFd && msg.contains("MFD_ALLOW_SEALING") && msg.contains("can take no more"), "{msg}");
    let partial = unsealed(4096);
    seal(&partial, &[memfd::FileSeal::SealShrink, memfd::FileSeal::SealGrow]);
    let (code, msg) = publish_raw(&d, req(4096, &good), &[partial.as_fd()]);
    assert!(code == ErrorCode::BadFd && msg.contains("F_SEAL_WRITE") && msg.contains("F_SEAL_SEAL"), "{msg}");
    let mapped = unsealed(4096);
    let tried = packd_tests::sys::with_writable_mapping(&mapped, 4096, || {
        let mfd = memfd::Memfd::try_from_file(mapped.try_clone().unwrap()).unwrap();
        mfd.add_seals(&[memfd::FileSeal::SealWrite]).is_err()
    });
    assert_eq!(tried, Ok(true), "F_SEAL_WRITE fails while a writable mapping exists");
    seal(&mapped, &[memfd::FileSeal::SealShrink, memfd::FileSeal::SealGrow, memfd::FileSeal::SealSeal]);
    let (code, msg) = publish_raw(&d, req(4096, &good), &[mapped.as_fd()]);
    assert!(
        code == ErrorCode::BadFd
            && msg.contains("F_SEAL_WRITE")
            && msg.contains("writable shared mapping")
            && msg.contains("add F_SEAL_SEAL last"),
        "{msg}"
    );

    // Not a memfd at all, and no fd.
    let plain = std::fs::File::open(d.dir().join("bystander.safetensors")).unwrap();
    let (code, msg) = publish_raw(&d, req(4096, &good), &[plain.as_fd()]);
    assert!(code == ErrorCode::BadFd && msg.contains("not a sealable memfd"), "{msg}");
    let (code, msg) = publish_raw(&d, req(4096, &good), &[]);
    assert!(code == ErrorCode::BadFd && msg.contains("carries no fd"), "{msg}");
    let (code, msg) = publish_raw(&d, req(4096, &good), &[sealed.as_fd(), sealed.as_fd()]);
    assert!(code == ErrorCode::BadFd && msg.contains("more than 1 fd"), "{msg}");
    // A sealed memfd sent write-only cannot be read: the sender's mistake, not the daemon's.
    let write_only = std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&sealed)))
        .unwrap();
    let (code, msg) = publish_raw(&d, req(4096, &good), &[write_only.as_fd()]);
    assert!(code == ErrorCode::BadFd && msg.contains("write-only"), "{code:?} {msg}");

    // Lies and bad tables.
    for (size, entries, want, want_code) in [
        (8192, &good[..], "the request says 8192", ErrorCode::InvalidArgument),
        (4096, &[("a", 0, 128), ("b", 64, 64)][..], "overlap", ErrorCode::InvalidArgument),
        (4096, &[("a", 0, 64), ("b", 96, 64)][..], "not a multiple of 64", ErrorCode::InvalidArgument),
        (4096, &[("a", 4032, 128)][..], "not inside the segment", ErrorCode::InvalidArgument),
        (4096, &[("a", 0, 64), ("a", 64, 64)][..], "appears twice", ErrorCode::InvalidArgument),
        (4096, &[][..], "empty", ErrorCode::InvalidArgument),
        (1000, &good[..], "multiple of the page size", ErrorCode::InvalidArgument),
        (1 << 40, &good[..], "limits.max_publish_bytes", ErrorCode::ResourceExhausted),
    ] {
        let (code, msg) = publish_raw(&d, req(size, entries), &[sealed.as_fd()]);
        assert!(code == want_code && msg.contains(want), "{size} {entries:?}: {code:?} {msg}");
    }
    let (code, msg) = publish_raw(
        &d,
        proto::PublishRequest { identity: "bad\nid".into(), size: 4096, entries: table(&good), ..Default::default() },
        &[sealed.as_fd()],
    );
    assert!(code == ErrorCode::InvalidArgument && msg.contains("printable ASCII"), "{msg}");
    // A huge table: over the frame limit, the connection is closed with a reason.
    let s = d.raw();
    let huge: Vec<(String, u64, u64)> = (0..6_000u64).map(|i| (format!("k{i}"), i * 64, 64)).collect();
    let entries =
        huge.iter().map(|(k, o, l)| proto::PublishedEntry { key: k.clone(), offset: *o, length: *l }).collect();
    let req_huge = proto::PublishRequest { identity: "bad".into(), size: 6_000 * 64, entries, ..Default::default() };
    send_request(
        &s,
        &proto::Request { id: 8, body: Some(request::Body::Publish(req_huge)), progress: false },
        &[sealed.as_fd()],
    );
    let (reply, _) = recv_reply(&s).expect("a reply");
    let (code, msg) = expect_error(&reply);
    assert!(code == ErrorCode::FrameTooLarge && msg.contains("max_request_bytes"), "{msg}");

    assert_eq!(d.stat("published_segments"), 0, "nothing was indexed");
    // Every refusal counts but the huge frame's (its connection closed before it was read):
    // six bad fds, no fd, two fds and nine bad requests.
    assert_eq!(d.stat("publishes_refused"), 17);
    by.check(&mut d, "bad publications");
    // The identity is still free: a good publication goes through.
    let c = d.client();
    let (file, size, table) = segment(2, 1);
    c.publish("bad", &file, size, &table).unwrap();
    assert_eq!(d.stat("published_segments"), 1);
}

/// The publisher binary as `uid` (primary gid the same, no supplementary groups).
fn publisher_as(d: &Daemon, uid: u32, identity: &str, args: &[&str]) -> serde_json::Value {
    let id = uid.to_string();
    let out = Command::new("setpriv")
        .args(["--reuid", &id, "--regid", &id, "--clear-groups"])
        .arg(env!("CARGO_BIN_EXE_publisher"))
        .arg(d.dir())
        .arg(identity)
        .args(args)
        .output()
        .expect("setpriv publisher");
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.lines().next().unwrap_or_default())
        .unwrap_or_else(|e| panic!("publisher as {uid}: {text} {}: {e}", String::from_utf8_lossy(&out.stderr)))
}

#[test]
#[ignore = "root-only, run with --ignored (as .ci/run does): runs clients as other uids (setpriv)"]
fn a_publication_is_visible_to_its_own_uid_only_unless_its_publisher_is_trusted() {
    use std::os::unix::fs::PermissionsExt;
    let mut d = Daemon::start_config("trusted_publisher_uids = [4243]\n");
    for p in [d.dir().to_path_buf(), d.dir().join("packd.sock"), d.dir().join("control.sock")] {
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o777)).unwrap();
    }
    let by = Bystander::new(&d);
    // 4242 publishes; 4244 is not served its bytes: it builds in its own namespace.
    let theirs = publisher_as(&d, 4242, "t", &["--seed", "1"]);
    assert_eq!(theirs["got"], "built", "{theirs}");
    let mine = publisher_as(&d, 4244, "t", &["--seed", "2"]);
    assert_eq!(mine["got"], "built", "an untrusted publication is not served to another uid: {mine}");
    assert_ne!(mine["blake3"], theirs["blake3"]);
    // Neither poisoned the other: each uid is served its own bytes.
    assert_eq!(publisher_as(&d, 4242, "t", &[])["blake3"], theirs["blake3"]);
    assert_eq!(publisher_as(&d, 4244, "t", &[])["blake3"], mine["blake3"]);
    // Nor by key: a get of 4242's segment key as 4244 finds nothing; 4242's own get does.
    let key = packd::store::published_key(4242, "t");
    let hits = d.stat("hits");
    assert_eq!(publisher_as(&d, 4244, "-", &["--get", key.as_str()])["code"], "NOT_FOUND");
    assert_eq!(d.stat("hits"), hits, "a get of a segment its requester may not see is not a hit");
    assert_eq!(publisher_as(&d, 4242, "-", &["--get", key.as_str()])["got"], "segment");
    // A trusted publisher's publication is served to everyone.
    let trusted = publisher_as(&d, 4243, "u", &["--seed", "5"]);
    assert_eq!(trusted["got"], "built");
    let served = publisher_as(&d, 4244, "u", &[]);
    assert_eq!((served["got"].as_str(), &served["blake3"]), (Some("segment"), &trusted["blake3"]), "{served}");
    // ListEntries likewise: a non-admin sees its own and trusted publications, not others';
    // root (an admin) sees all three.
    let packctl_as = |uid: Option<u32>, what: &str| -> serde_json::Value {
        let mut cmd = Command::new("setpriv");
        let id = uid.unwrap_or(0).to_string();
        cmd.args(["--reuid", &id, "--regid", &id, "--clear-groups"]);
        let out = cmd
            .arg(packd_tests::packctl_bin())
            .args(["--socket-dir", d.dir().to_str().unwrap(), what, "--json"])
            .output()
            .unwrap();
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)))
    };
    let listed = |uid: Option<u32>| -> Vec<String> {
        let v = packctl_as(uid, "ls");
        let mut keys: Vec<String> =
            v["entries"].as_array().unwrap().iter().map(|e| e["segment_key"].as_str().unwrap().to_string()).collect();
        keys.dedup();
        keys
    };
    let (k4242, k4243, k4244) = (
        key.to_string(),
        packd::store::published_key(4243, "u").to_string(),
        packd::store::published_key(4244, "t").to_string(),
    );
    let seen = listed(Some(4244));
    assert!(seen.contains(&k4244) && seen.contains(&k4243) && !seen.contains(&k4242), "{seen:?}");
    let all = listed(None);
    assert!([&k4242, &k4243, &k4244].iter().all(|k| all.contains(k)), "{all:?}");
    // ListModels likewise: 4242's and 4244's publications share the identity "t", and a
    // non-admin's figures for it count only its own.
    let segments_of = |uid: Option<u32>, model: &str| -> u64 {
        let v = packctl_as(uid, "models");
        v["models"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["model"] == model)
            .map(|m| m["segments"].as_u64().unwrap())
            .sum()
    };
    assert_eq!((segments_of(Some(4244), "t"), segments_of(Some(4244), "u")), (1, 1), "4244's view");
    assert_eq!((segments_of(None, "t"), segments_of(None, "u")), (2, 1), "root's view");
    // Nor another uid's workers' reports: 4242 reports a model it runs privately.
    // Nor its leases or builder roles: 4242 holds the trusted "u" (a segment 4244 sees
    // too) and holds the builder role of "b" without publishing.
    let spawn_4242 = |args: &[&str]| {
        Command::new("setpriv")
            .args(["--reuid", "4242", "--regid", "4242", "--clear-groups"])
            .arg(env!("CARGO_BIN_EXE_publisher"))
            .arg(d.dir())
            .args(args)
            .stdout(Stdio::null())
            .spawn()
            .unwrap()
    };
    // Killed on drop, also when an assertion fails.
    let workers = packd_tests::Held(vec![
        spawn_4242(&["--report-only", "xnnpack", "secret-model", "build_timeout", "4096", "--hold", "60"]),
        spawn_4242(&["u", "--hold", "60"]),
        spawn_4242(&["b", "--hang"]),
    ]);
    let model = |uid: Option<u32>, name: &str| -> Option<serde_json::Value> {
        packctl_as(uid, "models")["models"].as_array().unwrap().iter().find(|m| m["model"] == name).cloned()
    };
    let count = |m: &Option<serde_json::Value>, key: &str| m.as_ref().map_or(0, |m| m[key].as_u64().unwrap());
    assert!(
        wait_until(Duration::from_secs(20), || {
            model(None, "secret-model").is_some()
                && count(&model(None, "u"), "workers_served") >= 1
                && count(&model(None, "b"), "workers_building") == 1
        }),
        "root's view: {}; log:\n{}",
        packctl_as(None, "models"),
        d.log()
    );
    assert!(model(Some(4242), "secret-model").is_some(), "its own uid sees its report");
    assert_eq!(count(&model(Some(4242), "b"), "workers_building"), 1, "and its role");
    assert!(model(Some(4244), "secret-model").is_none(), "another uid does not: {}", packctl_as(Some(4244), "models"));
    assert!(model(Some(4244), "b").is_none(), "nor its role: {}", packctl_as(Some(4244), "models"));
    assert_eq!(count(&model(Some(4244), "u"), "workers_served"), 0, "nor its lease");
    drop(workers);
    by.check(&mut d, "publications of several uids");
}

#[test]
fn a_publication_counts_against_the_budget_and_the_publishers_quota() {
    let d = Daemon::start_config("[limits]\nmax_packed_bytes_per_uid = 6000\nmax_publish_entries = 4\n");
    let c = d.client();
    // Two pages (8 KiB) are over the uid's 6000 bytes.
    let file = unsealed(8192);
    seal(&file, &[memfd::FileSeal::SealShrink, memfd::FileSeal::SealGrow, memfd::FileSeal::SealWrite]);
    seal(&file, &[memfd::FileSeal::SealSeal]);
    let entries = [PublishEntry { key: "a".into(), offset: 0, length: 8192 }];
    let err = c.publish("quota", &file, 8192, &entries).unwrap_err();
    assert_eq!(err.code(), "RESOURCE_EXHAUSTED", "{err}");
    assert!(err.to_string().contains("max_packed_bytes_per_uid"), "{err}");
    // More entries than limits.max_publish_entries.
    let (file, size, table) = segment(5, 1);
    let err = c.publish("entries", &file, size, &table).unwrap_err();
    assert!(err.code() == "RESOURCE_EXHAUSTED" && err.to_string().contains("limits.max_publish_entries"), "{err}");
    // One page fits.
    let (file, size, table) = segment(4, 1);
    c.publish("fits", &file, size, &table).unwrap();
    assert_eq!((d.stat("published_segments"), d.stat("publishes_refused")), (1, 2));
}

/// A sealed memfd of one page: entries `a` at 0 and `b` at 1024 (64 bytes each), and `fill`
/// in every byte outside them.
fn padded_segment(fill: u8) -> (std::fs::File, Vec<PublishEntry>) {
    let file = unsealed(4096);
    let mut bytes = vec![fill; 4096];
    bytes[..64].copy_from_slice(&[1; 64]);
    bytes[1024..1088].copy_from_slice(&[2; 64]);
    file.write_all_at(&bytes, 0).unwrap();
    seal(&file, &[memfd::FileSeal::SealShrink, memfd::FileSeal::SealGrow, memfd::FileSeal::SealWrite]);
    seal(&file, &[memfd::FileSeal::SealSeal]);
    let table = vec![
        PublishEntry { key: "a".into(), offset: 0, length: 64 },
        PublishEntry { key: "b".into(), offset: 1024, length: 64 },
    ];
    (file, table)
}

#[test]
fn a_publication_with_bytes_between_entries_is_served_zero_padded_before_and_after_a_restart() {
    let home = std::sync::Arc::new(tempfile::tempdir().unwrap());
    let cache = home.path().join("cache");
    let cache_arg = cache.to_str().unwrap().to_string();
    let mut d = Daemon::start_in(std::sync::Arc::clone(&home), &[], &["--cache-dir", &cache_arg]);
    let (file, table) = padded_segment(0xab);
    let published = d.client().publish("padded", &file, 4096, &table).unwrap().map().unwrap();
    published.verify().unwrap();
    let mut want = vec![0u8; 4096];
    want[..64].copy_from_slice(&[1; 64]);
    want[1024..1088].copy_from_slice(&[2; 64]);
    assert!(published.bytes() == want.as_slice(), "the served copy holds the entries and zeros elsewhere");
    assert!(
        wait_until(Duration::from_secs(10), || packd_tests::cache_files(&cache).len() == 1),
        "the publication reaches the cache directory"
    );
    d.terminate();
    let d = Daemon::start_in(home, &[], &["--cache-dir", &cache_arg]);
    let Acquired::Segment(seg) = d.client().acquire("padded", AcquireOptions::default()).unwrap() else {
        panic!("after the restart the publication is served: {}", d.log())
    };
    let served = seg.map().unwrap();
    assert!(served.bytes() == want.as_slice(), "the same bytes after the restart");
    assert_eq!((d.stat("builds"), d.stat("published_segments")), (0, 1));
    assert!(!d.log().contains("padding"), "the cache file was adopted: {}", d.log());
}

#[test]
fn builder_roles_are_bounded_per_connection_and_per_uid_and_end_at_their_deadline() {
    let d = Daemon::start_config("[limits]\nmax_builds_per_connection = 3\nmax_builds_per_uid = 5\n");
    let opts = AcquireOptions { build_seconds: 600, ..AcquireOptions::default() };
    let a = d.client();
    for i in 0..3 {
        assert!(matches!(a.acquire(&format!("a{i}"), opts).unwrap(), Acquired::Build { .. }));
    }
    let Acquired::Private { reason, fallback } = a.acquire("a3", opts).unwrap() else {
        panic!("a 4th role is refused")
    };
    assert!(reason.contains("limits.max_builds_per_connection"), "{reason}");
    assert_eq!(fallback, packd_client::Fallback::BuildLimit);
    let b = d.client();
    for i in 0..2 {
        assert!(matches!(b.acquire(&format!("b{i}"), opts).unwrap(), Acquired::Build { .. }));
    }
    let Acquired::Private { reason, fallback } = b.acquire("b2", opts).unwrap() else {
        panic!("a 6th role is refused")
    };
    assert_eq!(fallback, packd_client::Fallback::BuildLimit);
    assert!(reason.contains("limits.max_builds_per_uid"), "{reason}");
    assert_eq!((d.stat("builds_active"), d.stat("builds_refused")), (5, 2));
    // Publishing ends a role: the connection may take another.
    let (file, size, table) = segment(1, 3);
    a.publish("a0", &file, size, &table).unwrap();
    assert!(matches!(a.acquire("a3", opts).unwrap(), Acquired::Build { .. }));
    // Closing a connection ends its roles.
    drop(a);
    assert!(wait_until(Duration::from_secs(10), || d.stat("builds_active") == 2), "a's roles ended");
    assert_eq!(d.stat("builds_abandoned"), 3);

    // A role ends at its deadline although its connection stays open, and counts as
    // expired, not abandoned, when the connection closes later.
    let short = AcquireOptions { build_seconds: 1, ..AcquireOptions::default() };
    let c = d.client();
    let given = std::time::Instant::now();
    assert!(matches!(c.acquire("c0", short).unwrap(), Acquired::Build { .. }));
    // Active until its deadline: checked only when the stat comes back well inside it (a
    // loaded machine may take longer than the role's second to ask).
    let active = d.stat("builds_active");
    if given.elapsed() < Duration::from_millis(800) {
        assert_eq!(active, 3, "c's role is active before its deadline");
    }
    assert!(wait_until(Duration::from_secs(10), || d.stat("builds_active") == 2), "c's role expired");
    assert_eq!(d.stat("builds_expired"), 1);
    drop(c);
    drop(b);
    assert!(wait_until(Duration::from_secs(10), || d.stat("builds_active") == 0), "b's roles ended");
    assert_eq!((d.stat("builds_abandoned"), d.stat("builds_expired")), (5, 1));
}

/// Resident anonymous memory of process `pid` (`RssAnon`), in bytes.
fn rss_anon(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("RssAnon:")).expect("RssAnon");
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

#[test]
fn expired_roles_on_an_open_connection_leave_the_heap_where_it_was() {
    // Limits high enough that every acquire becomes a role: this is about expiry alone.
    let dir = std::sync::Arc::new(tempfile::tempdir().unwrap());
    let config = dir.path().join("packd.toml");
    std::fs::write(&config, "[limits]\nmax_builds_per_connection = 1000000\nmax_builds_per_uid = 1000000\n").unwrap();
    // One malloc arena: how glibc spreads a busy round over per-thread arenas is noise of
    // several MiB beside a loaded machine, and not what this test is about.
    let d = Daemon::start_in(dir, &[("MALLOC_ARENA_MAX", "1")], &["--config", config.to_str().unwrap()]);
    let c = d.client();
    let opts = AcquireOptions { build_seconds: 1, ..AcquireOptions::default() };
    let mut after = Vec::new();
    for round in 0..4 {
        for i in 0..50_000 {
            let got = c.acquire(&format!("r{round}-{i}"), opts).unwrap();
            assert!(matches!(got, Acquired::Build { .. }), "acquire {round}/{i}");
        }
        assert!(wait_until(Duration::from_secs(30), || d.stat("builds_active") == 0), "round {round}: roles expired");
        after.push(rss_anon(d.pid()));
    }
    eprintln!("rss_anon after each round: {after:?}");
    assert_eq!(d.stat("builds_expired"), 200_000);
    // Before roles expired on their own, each round of 50 000 grew the heap by ~27 MiB.
    // The first two rounds warm the heap up; rounds 3 and 4 must not grow it.
    let grown = after[3].saturating_sub(after[1]);
    assert!(grown < 8 << 20, "the heap grew by {grown} bytes over rounds 3 and 4 ({after:?})");
}

/// `field` of `/proc/PID/status` in kB (VmHWM, VmRSS, …).
fn status_kb(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with(&format!("{field}:"))).unwrap_or_else(|| panic!("{field}"));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Bytes the process read with read-like calls (`rchar` of `/proc/PID/io`).
fn read_bytes(pid: u32) -> u64 {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).unwrap();
    io.lines().find_map(|l| l.strip_prefix("rchar: ")).unwrap().trim().parse().unwrap()
}

/// A sealed memfd of `size` bytes that costs its sender one page: zeros but for one byte
/// at 4096 (so a publication with an entry at 0 only is not zero-padded).
fn sparse_sealed(size: u64) -> std::fs::File {
    let file = unsealed(size);
    file.write_all_at(&[1], 4096).unwrap();
    seal(&file, &[memfd::FileSeal::SealShrink, memfd::FileSeal::SealGrow, memfd::FileSeal::SealWrite]);
    seal(&file, &[memfd::FileSeal::SealSeal]);
    file
}

#[test]
fn a_publication_the_budget_refuses_or_that_exists_costs_no_read_and_no_memory() {
    let mut d = Daemon::start_args(&[], &["--max-bytes", "64M", "--spare-bytes", "off"]);
    let by = Bystander::new(&d);
    let pid = d.pid();
    let entry = [("a", 0, 64)];
    let req = |identity: &str, size| proto::PublishRequest {
        identity: identity.into(),
        size,
        entries: table(&entry),
        ..Default::default()
    };
    let (hwm, read) = (status_kb(pid, "VmHWM"), read_bytes(pid));

    // 2 GiB against a 64 MiB budget: refused before the daemon reads it, or copies it to
    // zero the byte outside the entry (which would take 2 GiB of its own memory).
    let big = sparse_sealed(2 << 30);
    let (code, msg) = publish_raw(&d, req("big", 2 << 30), &[big.as_fd()]);
    assert!(code == ErrorCode::ResourceExhausted && msg.contains("budget"), "{code:?} {msg}");

    // An identity the namespace has: refused before its 2 GiB are hashed.
    let (file, size, t) = segment(2, 1);
    d.client().publish("taken", &file, size, &t).unwrap();
    let whole = [("a", 0, 32 << 20)];
    let again = proto::PublishRequest {
        identity: "taken".into(),
        size: 32 << 20,
        entries: table(&whole),
        ..Default::default()
    };
    let sparse = sparse_sealed(32 << 20);
    let (code, msg) = publish_raw(&d, again, &[sparse.as_fd()]);
    assert!(code == ErrorCode::AlreadyExists && msg.contains("already published"), "{code:?} {msg}");

    let (grew_kb, read) = (status_kb(pid, "VmHWM").saturating_sub(hwm), read_bytes(pid) - read);
    assert!(grew_kb < 16 << 10, "the daemon's peak memory grew by {grew_kb} kB");
    assert!(read < 8 << 20, "the daemon read {read} bytes for two refused publications");
    assert_eq!((d.stat("published_segments"), d.stat("publishes_refused")), (1, 2));
    by.check(&mut d, "refused large publications");
}

/// A file of `len` bytes of a pattern seeded by `seed` (a model an engine maps).
fn model_file(d: &Daemon, name: &str, len: usize, seed: u8) -> std::fs::File {
    let path = d.dir().join(name);
    let bytes: Vec<u8> = (0..len).map(|i| seed.wrapping_add(i.to_le_bytes()[0] ^ (i >> 8).to_le_bytes()[0])).collect();
    std::fs::write(&path, bytes).unwrap();
    std::fs::File::open(&path).unwrap()
}

fn inode(file: &std::fs::File) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let m = file.metadata().unwrap();
    (m.dev(), m.ino())
}

#[test]
fn the_first_to_hash_a_model_builds_into_memory_packd_lent_and_that_memfd_is_served() {
    use std::os::unix::fs::MetadataExt;
    let d = Daemon::start();
    let model = model_file(&d, "model.gguf", 3 << 20, 1);
    let (lead, later, waiter) = (d.client(), d.client(), d.client());
    // 1 MiB and a bit: lent page-rounded.
    let build = (1u64 << 20) + 100;
    let lent = build.next_multiple_of(4096);
    let first = lead.file_digest_for_build(&model, build).unwrap();
    assert!(first.hashed);
    assert_eq!(d.stat("lent_bytes"), lent, "lent while hashing, counted");
    // Asking once the digest is known lends nothing: that process hashed nothing.
    let second = later.file_digest_for_build(&model, build).unwrap();
    assert_eq!((second.hashed, second.blake3), (false, first.blake3));
    assert_eq!(d.stat("lent_bytes"), lent);

    let opts = AcquireOptions { build_bytes: build, ..AcquireOptions::default() };
    let Acquired::Build { memory: Some(memory), .. } = lead.acquire("lent", opts).unwrap() else {
        panic!("the lead builds, with the memory lent")
    };
    let m = memory.metadata().unwrap();
    assert_eq!(m.len(), lent);
    assert!(m.blocks() * 512 >= lent, "every page allocated: {} blocks", m.blocks());
    assert_eq!(d.stat("builds_lent"), 1);
    // Another process of the same model waits for that build.
    let waiting = std::thread::spawn(move || match waiter.acquire("lent", opts).unwrap() {
        Acquired::Segment(seg) => {
            let at = inode(seg.file());
            (at, seg.map().unwrap().tensor_at(0).unwrap().bytes().to_vec())
        }
        _ => panic!("the waiter is served"),
    });
    assert!(wait_until(Duration::from_secs(10), || d.stat("build_waits") == 1));

    let weights: Vec<u8> = (0..1000u32).map(|i| (i * 7).to_le_bytes()[0]).collect();
    memory.write_all_at(&weights, 0).unwrap();
    seal(&memory, &[memfd::FileSeal::SealShrink, memfd::FileSeal::SealGrow, memfd::FileSeal::SealWrite]);
    seal(&memory, &[memfd::FileSeal::SealSeal]);
    let entries = [PublishEntry { key: "w".into(), offset: 0, length: weights.len() as u64 }];
    lead.publish("lent", &memory, lent, &entries).unwrap();
    let (served, bytes) = waiting.join().unwrap();
    assert_eq!(served, inode(&memory), "the waiter maps the very memfd packd lent");
    assert_eq!(bytes, weights);
    assert_eq!(d.stat("lent_bytes"), 0, "published: the segment counts it now");
    assert_eq!(d.stat("publishes"), 1);
}

#[test]
fn lent_memory_is_bounded_per_uid_freed_when_not_built_into_and_kept_counted_when_never_published() {
    let d = Daemon::start_config("[limits]\nmax_lent_bytes_per_uid = \"1M\"\n");
    // Over the uid's limit: nothing lent, the build allocates its own.
    let big = d.client();
    big.file_digest_for_build(&model_file(&d, "big", 1 << 20, 2), 2 << 20).unwrap();
    assert_eq!(d.stat("lent_bytes"), 0);
    let opts = |bytes| AcquireOptions { build_bytes: bytes, ..AcquireOptions::default() };
    assert!(matches!(big.acquire("big", opts(2 << 20)).unwrap(), Acquired::Build { memory: None, .. }));

    // Lent, then an acquire that does not build: freed at once.
    let p = segment(1, 3);
    let publisher = d.client();
    let Acquired::Build { .. } = publisher.acquire("done", AcquireOptions::default()).unwrap() else { panic!() };
    publisher.publish("done", &p.0, p.1, &p.2).unwrap();
    let served = d.client();
    served.file_digest_for_build(&model_file(&d, "small", 1 << 16, 4), 64 << 10).unwrap();
    assert_eq!(d.stat("lent_bytes"), 64 << 10);
    assert!(matches!(served.acquire("done", opts(64 << 10)).unwrap(), Acquired::Segment(_)));
    assert!(wait_until(Duration::from_secs(10), || d.stat("lent_bytes") == 0), "not built into: freed");

    // Lent and handed out, the builder gone without publishing: still counted (its pages
    // may live on in whoever holds the memfd), so the uid's limit stays spent.
    let gone = d.client();
    gone.file_digest_for_build(&model_file(&d, "gone", 1 << 16, 5), 1 << 20).unwrap();
    let Acquired::Build { memory: Some(kept), .. } = gone.acquire("gone", opts(1 << 20)).unwrap() else { panic!() };
    let before = d.stat("clients");
    drop(gone);
    assert!(wait_until(Duration::from_secs(10), || d.stat("clients") == before - 1));
    assert_eq!(d.stat("lent_bytes"), 1 << 20);
    let next = d.client();
    next.file_digest_for_build(&model_file(&d, "next", 1 << 16, 6), 4096).unwrap();
    assert_eq!(d.stat("lent_bytes"), 1 << 20, "the limit is spent");
    assert!(matches!(next.acquire("next", opts(4096)).unwrap(), Acquired::Build { memory: None, .. }));
    assert_eq!(kept.metadata().unwrap().len(), 1 << 20, "the memory stays the holder's");
    assert_eq!(d.stat("builds_lent"), 1);
}

#[test]
fn the_worker_that_acquires_first_builds_in_the_memory_lent_to_the_one_that_hashed() {
    let d = Daemon::start();
    let model = model_file(&d, "model.gguf", 1 << 20, 7);
    let (lead, first, plain) = (d.client(), d.client(), d.client());
    lead.file_digest_for_build(&model, 1 << 16).unwrap();
    let opts = AcquireOptions { build_bytes: 1 << 16, ..AcquireOptions::default() };
    // A connection that never asked for a digest with build_bytes is lent nothing.
    assert!(matches!(plain.acquire("p", opts).unwrap(), Acquired::Build { memory: None, .. }));
    // Another worker of the uid that started with it (and asked too) acquires first: it
    // builds, in that memory.
    assert!(!first.file_digest_for_build(&model, 1 << 16).unwrap().hashed);
    let Acquired::Build { memory: Some(memory), .. } = first.acquire("m", opts).unwrap() else {
        panic!("the first to acquire builds, in the memory lent")
    };
    // The worker that hashed waits for that build; the memory stays with the builder.
    let waiting = std::thread::spawn(move || matches!(lead.acquire("m", opts).unwrap(), Acquired::Segment(_)));
    assert!(wait_until(Duration::from_secs(10), || d.stat("build_waits") == 1));
    assert_eq!(d.stat("lent_bytes"), 1 << 16);
    memory.write_all_at(&[5; 64], 0).unwrap();
    seal(&memory, &[memfd::FileSeal::SealShrink, memfd::FileSeal::SealGrow, memfd::FileSeal::SealWrite]);
    seal(&memory, &[memfd::FileSeal::SealSeal]);
    let entries = [PublishEntry { key: "w".into(), offset: 0, length: 64 }];
    first.publish("m", &memory, 1 << 16, &entries).unwrap();
    assert!(waiting.join().unwrap(), "the waiter is served");
    assert_eq!((d.stat("lent_bytes"), d.stat("builds_lent")), (0, 1));
}

/// The `.pack` files in `dir`.
fn packs_in(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .map(|r| r.flatten().filter(|e| e.path().extension().is_some_and(|x| x == "pack")).count())
        .unwrap_or(0)
}

#[test]
fn a_waiter_is_served_a_publication_before_packd_has_hashed_it() {
    let cache = tempfile::tempdir().unwrap();
    let cache_dir = cache.path().to_str().unwrap().to_string();
    // Every hash held 3 s (a debug build's test fault): the window is wide open.
    let d = Daemon::start_args(&[("PACKD_TEST_HASH_DELAY_MS", "3000")], &["--cache-dir", &cache_dir]);
    let builder = d.client();
    assert!(matches!(builder.acquire("id-w", AcquireOptions::default()).unwrap(), Acquired::Build { .. }));
    let waiter = {
        let c = d.client();
        std::thread::spawn(move || {
            let got = c.acquire("id-w", AcquireOptions { wait_seconds: 60, ..AcquireOptions::default() });
            (c, got)
        })
    };
    assert!(wait_until(Duration::from_secs(30), || d.stat("build_waits") == 1), "the waiter waits");
    let (file, size, table) = segment(5, 7);
    let published_inode = inode(&file);
    let publisher = std::thread::spawn(move || {
        let seg = builder.publish("id-w", &file, size, &table);
        (builder, seg)
    });
    let (_waiter_client, got) = waiter.join().unwrap();
    let Acquired::Segment(seg) = got.unwrap() else { panic!("the waiter must be served") };
    // Served before the hash: the digests are not known yet, the bytes are the builder's own
    // memfd's, and nothing of it is in the cache directory.
    assert!(seg.info().digests_pending, "served before the hash");
    assert!(seg.info().entries.iter().all(|e| e.blake3.is_empty()));
    assert_eq!(inode(seg.file()), published_inode, "the very memfd the builder sealed");
    let served = seg.map().unwrap();
    assert_eq!(served.verify().unwrap_err().code(), "DIGESTS_PENDING");
    for (i, t) in served.tensors().enumerate() {
        let i = i as u64;
        let want: Vec<u8> = (0..100 + i).map(|j| 7u8.wrapping_add((i + j).to_le_bytes()[0])).collect();
        assert_eq!(t.bytes(), want.as_slice(), "entry {i}");
    }
    assert_eq!(packs_in(cache.path()), 0, "a publication is written to the cache directory once hashed");
    // A client asking for verified entries is answered once hashed, with the digests.
    let verified = {
        let c = d.client();
        std::thread::spawn(move || {
            c.acquire("id-w", AcquireOptions { wait_seconds: 60, verified: true, ..AcquireOptions::default() }).map(
                |got| match got {
                    Acquired::Segment(s) => !s.info().digests_pending && s.map().unwrap().verify().is_ok(),
                    _ => false,
                },
            )
        })
    };
    // The publisher's own reply comes once hashed, with the digests; so does every later one.
    let (_builder, published) = publisher.join().unwrap();
    let published = published.unwrap();
    assert!(!published.info().digests_pending);
    published.map().unwrap().verify().unwrap();
    let Acquired::Segment(again) = d.client().acquire("id-w", AcquireOptions::default()).unwrap() else {
        panic!("served again")
    };
    assert!(!again.info().digests_pending && again.info().entries.iter().all(|e| e.blake3.len() == 64));
    assert_eq!(inode(again.file()), published_inode);
    again.map().unwrap().verify().unwrap();
    assert!(wait_until(Duration::from_secs(30), || packs_in(cache.path()) == 1), "written once hashed");
    assert_eq!((d.stat("publishes"), d.stat("publishes_withdrawn")), (1, 0));
    assert!(verified.join().unwrap().unwrap(), "served hashed, and it verifies");
    // Asked with a wait shorter than the hash: told to build privately.
    // Held long enough that the impatient acquire always comes while it is pending.
    let d = Daemon::start_with(&[("PACKD_TEST_HASH_DELAY_MS", "8000")]);
    let builder = d.client();
    assert!(matches!(builder.acquire("id-v", AcquireOptions::default()).unwrap(), Acquired::Build { .. }));
    let (file, size, table) = segment(2, 3);
    let publisher = std::thread::spawn(move || builder.publish("id-v", &file, size, &table).map(|_| ()));
    assert!(wait_until(Duration::from_secs(30), || d.stat("publishes") == 1), "published, hashing");
    let impatient = AcquireOptions { wait_seconds: 1, verified: true, ..AcquireOptions::default() };
    let Acquired::Private { fallback, reason } = d.client().acquire("id-v", impatient).unwrap() else {
        panic!("not served unhashed")
    };
    assert_eq!(fallback, packd_client::Fallback::BuildTimeout, "{reason}");
    assert!(reason.contains("verified entries"), "{reason}");
    publisher.join().unwrap().unwrap();
}

#[test]
fn a_publication_whose_hash_fails_is_withdrawn_from_new_clients() {
    let d = Daemon::start_with(&[("PACKD_TEST_HASH_FAIL", "id-bad"), ("PACKD_TEST_HASH_DELAY_MS", "1000")]);
    let builder = d.client();
    assert!(matches!(builder.acquire("id-bad", AcquireOptions::default()).unwrap(), Acquired::Build { .. }));
    let waiter = {
        let c = d.client();
        std::thread::spawn(move || {
            let got = c.acquire("id-bad", AcquireOptions { wait_seconds: 60, ..AcquireOptions::default() });
            (c, got)
        })
    };
    assert!(wait_until(Duration::from_secs(30), || d.stat("build_waits") == 1), "the waiter waits");
    let (file, size, table) = segment(3, 5);
    let publisher = std::thread::spawn(move || (builder.publish("id-bad", &file, size, &table).map(|_| ()), builder));
    // In the index, its hash held: a client asking for verified entries waits for the hash.
    assert!(wait_until(Duration::from_secs(30), || d.stat("publishes") == 1), "published");
    let verified = {
        let c = d.client();
        std::thread::spawn(move || {
            c.acquire("id-bad", AcquireOptions { wait_seconds: 60, verified: true, ..AcquireOptions::default() })
        })
    };
    let (published, _builder) = publisher.join().unwrap();
    let err = published.unwrap_err();
    assert_eq!(err.code(), "INTERNAL", "{err}");
    assert!(err.to_string().contains("withdrawn"), "{err}");
    // The waiter served in the window keeps what it holds (sealed, it cannot have changed).
    let (_c, got) = waiter.join().unwrap();
    let Acquired::Segment(seg) = got.unwrap() else { panic!("served in the window") };
    let held = seg.map().unwrap();
    assert_eq!(held.len(), 3);
    // A client that asked for verified entries in the window is given the role to build.
    assert!(matches!(verified.join().unwrap().unwrap(), Acquired::Build { .. }));
    // New clients are not served it: the identity is free to be built again.
    assert_eq!(d.stat("publishes_withdrawn"), 1);
    assert!(matches!(d.client().acquire("id-bad", AcquireOptions::default()).unwrap(), Acquired::Build { .. }));
    let log = d.log();
    assert!(log.contains("a publication's hash failed: withdrawn from the index"), "{log}");
}

#[test]
fn a_build_under_a_provisional_name_serves_its_waiters_once_published_under_its_content_name() {
    let d = Daemon::start();
    // The first worker builds under the model file's provisional name, before its digest.
    let builder = d.client();
    assert!(matches!(builder.acquire("prov-1", AcquireOptions::default()).unwrap(), Acquired::Build { .. }));
    let waiter = {
        let c = d.client();
        std::thread::spawn(move || {
            let got = c.acquire("prov-1", AcquireOptions { wait_seconds: 60, ..AcquireOptions::default() });
            (c, got)
        })
    };
    assert!(wait_until(Duration::from_secs(30), || d.stat("build_waits") == 1), "the waiter waits");
    let (file, size, table) = segment(4, 3);
    let built = inode(&file);
    let published = builder.publish_aliased("content-1", &["prov-1".to_string()], &file, size, &table).unwrap();
    assert_eq!(inode(published.file()), built);
    // The waiter on the provisional name is served the publication; so is every later
    // acquire of either name.
    let (_c, got) = waiter.join().unwrap();
    let Acquired::Segment(seg) = got.unwrap() else { panic!("the waiter on the provisional name is served") };
    assert_eq!(inode(seg.file()), built);
    for name in ["prov-1", "content-1"] {
        let Acquired::Segment(s) = d.client().acquire(name, AcquireOptions::default()).unwrap() else {
            panic!("{name} is served")
        };
        assert_eq!(inode(s.file()), built, "{name}");
        assert_eq!(s.map().unwrap().tensors().count(), 4);
    }
    assert_eq!((d.stat("publishes"), d.stat("aliases_filed"), d.stat("builds")), (1, 1, 1));

    // A second copy of the model (another provisional name) built meanwhile: its
    // publication is refused as published already, and its provisional name now names the
    // first copy, so that its waiters are served that.
    let second = d.client();
    assert!(matches!(second.acquire("prov-2", AcquireOptions::default()).unwrap(), Acquired::Build { .. }));
    let waiter = {
        let c = d.client();
        std::thread::spawn(move || {
            c.acquire("prov-2", AcquireOptions { wait_seconds: 60, ..AcquireOptions::default() })
        })
    };
    assert!(wait_until(Duration::from_secs(30), || d.stat("build_waits") == 2), "the second waiter waits");
    let (file2, size2, table2) = segment(4, 3);
    let err = second.publish_aliased("content-1", &["prov-2".to_string()], &file2, size2, &table2).unwrap_err();
    assert_eq!(err.code(), "ALREADY_EXISTS", "{err}");
    let Acquired::Segment(s) = waiter.join().unwrap().unwrap() else { panic!("served the first copy") };
    assert_eq!(inode(s.file()), built);
    assert_eq!(d.stat("aliases_filed"), 2);

    // Bad aliases are refused with the reason, and nothing is indexed.
    let (file3, size3, table3) = segment(1, 9);
    for (aliases, want) in [
        (vec!["content-3".to_string()], "aliases"),
        (vec!["a".into(), "b".into(), "c".into(), "d".into(), "e".into()], "at most 4"),
        (vec!["x".into(), "x".into()], "aliases"),
        (vec!["bad\u{7}".into()], "alias 0"),
        (vec![String::new()], "alias 0"),
    ] {
        let err = d.client().publish_aliased("content-3", &aliases, &file3, size3, &table3).unwrap_err();
        assert_eq!(err.code(), "INVALID_ARGUMENT", "{aliases:?}: {err}");
        assert!(err.to_string().contains(want), "{aliases:?}: {err}");
    }
    assert_eq!(d.stat("publishes"), 1);
}
