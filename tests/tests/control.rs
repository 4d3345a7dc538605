//! The control plane and memory management: grpcurl against the real daemon, the byte
//! budget with LRU eviction and pinning, forced eviction under readers, refcounts that
//! follow live holder processes.

use std::process::{Child, Command, Output};
use std::time::Duration;

use packd_client::Plan;
use packd_tests::{Daemon, grpcurl_path, seeded_model, small_model, wait_until};

fn ok(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

fn keys(d: &Daemon) -> Vec<String> {
    let doc = ok(&d.packctl(&["ls", "--json"]));
    let mut k: Vec<String> =
        doc["entries"].as_array().unwrap().iter().map(|e| e["segment_key"].as_str().unwrap().to_string()).collect();
    k.dedup();
    k
}

fn pack_seed(d: &Daemon, seed: u32) -> Result<String, String> {
    let file = d.dir().join(format!("m{seed}.safetensors"));
    seeded_model(&file, seed);
    d.client().pack(&file, &Plan::default()).map(|m| m.key().to_string()).map_err(|e| e.to_string())
}

#[test]
fn budget_evicts_lru_and_respects_pins_and_leases() {
    // Each seeded model packs into one 4 KiB segment; the budget holds three.
    let d = Daemon::start_args(&[], &["--max-bytes", "12288"]);
    assert_eq!(d.stat("budget_bytes"), 12288);
    let a = pack_seed(&d, 1).unwrap();
    let b = pack_seed(&d, 2).unwrap();
    let c = pack_seed(&d, 3).unwrap();
    // Using a again makes b the least recently used.
    d.client().get(&a).unwrap();
    let e = pack_seed(&d, 4).unwrap();
    assert_eq!(keys(&d).len(), 3);
    assert!(!keys(&d).contains(&b), "b was least recently used");
    assert_eq!(d.stat("evictions"), 1);

    // Pin a, hold c: the next pack must evict e, the only candidate.
    ok(&d.packctl(&["pin", &a, "--json"]));
    let client = d.client();
    let held_c = client.get(&c).unwrap();
    let f = pack_seed(&d, 5).unwrap();
    let now = keys(&d);
    assert!(now.contains(&a) && now.contains(&c) && now.contains(&f) && !now.contains(&e), "{now:?}");

    // Hold f too: nothing can go, so a new model is refused, naming the budget and holders.
    let held_f = client.get(&f).unwrap();
    let err = pack_seed(&d, 6).unwrap_err();
    assert!(err.contains("RESOURCE_EXHAUSTED") && err.contains("budget of 12288 bytes"), "{err}");
    assert!(err.contains("pinned") && err.contains("1 lease(s)"), "{err}");
    // The refusal may go to any client: it names no holder's pid.
    assert!(!err.contains(&format!("pid {}", std::process::id())), "{err}");
    assert!(d.stat("bytes_resident") <= 12288);

    // Unpin a: it can go now.
    ok(&d.packctl(&["unpin", &a, "--json"]));
    pack_seed(&d, 6).unwrap();
    assert!(!keys(&d).contains(&a));
    drop((held_c, held_f));

    // Lowering the budget evicts down to it once the leases are gone.
    assert!(wait_until(Duration::from_secs(10), || d.stat("leases") == 0));
    // Evicting two of the three segments is most of them: refused unless asked for.
    let out = d.packctl(&["budget", "4KiB"]);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("would evict 2 segment(s), 8.0 KiB of the 12.0 KiB resident; nothing was changed"), "{err}");
    assert!(err.contains("--evict-most") && err.contains("FAILED_PRECONDITION"), "{err}");
    assert_eq!((keys(&d).len(), d.stat("budget_bytes")), (3, 12288));
    let doc = ok(&d.packctl(&["budget", "4KiB", "--evict-most", "--json"]));
    assert_eq!((doc["budget_bytes"].as_u64(), doc["fits"].as_bool()), (Some(4096), Some(true)));
    assert_eq!((doc["evicted_segments"].as_u64(), doc["evicted_bytes"].as_u64()), (Some(2), Some(8192)));
    assert_eq!(keys(&d).len(), 1);
    // A change that evicts less than half goes through and says what it evicted.
    let doc = ok(&d.packctl(&["budget", "1MiB", "--json"]));
    assert_eq!((doc["evicted_segments"].as_u64(), doc["fits"].as_bool()), (Some(0), Some(true)));
    // Its text prints sizes as people read them (and takes decimals).
    let out = d.packctl(&["budget", "1.5M"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("1.5 MiB") && text.contains("4.0 KiB"), "{text}");
}

#[test]
fn forced_eviction_keeps_readers_bytes_and_counts_zombies() {
    let d = Daemon::start();
    let file = d.dir().join("small.safetensors");
    small_model(&file);
    let path = file.to_str().unwrap();
    let mut holders: Vec<Child> = (0..3).map(|_| d.holder_until_released(path, &["--verify"])).collect();
    let key = keys(&d)[0].clone();
    let ls = ok(&d.packctl(&["ls", "--json"]));
    assert!(ls["entries"].as_array().unwrap().iter().all(|e| e["refcount"] == 3), "{ls}");

    let refused = d.packctl(&["evict", &key]);
    assert!(!refused.status.success());
    let msg = String::from_utf8_lossy(&refused.stderr);
    assert!(msg.contains("FAILED_PRECONDITION") && msg.contains("3 lease(s)"), "{msg}");
    for h in &holders {
        assert!(msg.contains(&h.id().to_string()), "holders named: {msg}");
    }

    let doc = ok(&d.packctl(&["evict", &key, "--force", "--json"]));
    assert_eq!(doc["zombies"][0], key.as_str());
    let stats = d.stats();
    assert_eq!((stats["segments"].as_u64(), stats["leases"].as_u64()), (Some(0), Some(3)));
    assert!(stats["zombie_bytes"].as_u64().unwrap() > 0);
    // The holders verify their bytes after the hold: exit 0 means every BLAKE3 matched.
    for h in &mut holders {
        packd_tests::release(h);
        assert!(h.wait().unwrap().success(), "a reader saw changed bytes after a forced eviction");
    }
    assert!(wait_until(Duration::from_secs(10), || d.stat("zombie_bytes") == 0 && d.stat("leases") == 0));
    // A new request packs it again.
    assert!(d.packctl(&["pack", path]).status.success());
    assert_eq!(d.stat("pack_jobs"), 2);
}

#[test]
fn refcounts_follow_live_holders_and_sigkill() {
    let d = Daemon::start();
    let file = d.dir().join("small.safetensors");
    small_model(&file);
    let path = file.to_str().unwrap();
    let mut holders: Vec<Child> = (0..4).map(|_| d.holder(path, &["--hold", "600"])).collect();
    let refcount = |d: &Daemon| ok(&d.packctl(&["ls", "--json"]))["entries"][0]["refcount"].as_u64().unwrap();
    assert_eq!(refcount(&d), 4);
    let clients = ok(&d.packctl(&["clients", "--json"]));
    let mut pids: Vec<u64> =
        clients["clients"].as_array().unwrap().iter().map(|c| c["pid"].as_u64().unwrap()).collect();
    pids.sort_unstable();
    let mut want: Vec<u64> = holders.iter().map(|h| u64::from(h.id())).collect();
    want.sort_unstable();
    assert_eq!(pids, want, "ListClients names the holders");
    assert!(clients["clients"].as_array().unwrap().iter().all(|c| c["leases"] == 1 && c["bytes_mapped"] == 4096));
    for (i, h) in holders.iter_mut().enumerate() {
        h.kill().unwrap();
        h.wait().unwrap();
        let left = 3 - i as u64;
        assert!(
            wait_until(Duration::from_secs(10), || refcount(&d) == left),
            "after {} kills: {}",
            i + 1,
            refcount(&d)
        );
    }
    let s = d.stats();
    assert_eq!((s["leases"].as_u64(), s["clients"].as_u64(), s["zombie_bytes"].as_u64()), (Some(0), Some(0), Some(0)));
    assert_eq!(s["segments"], 1);
}

#[test]
fn prefetch_packs_only_under_model_roots() {
    let roots = tempfile::tempdir().unwrap();
    let models = roots.path().join("models");
    std::fs::create_dir(&models).unwrap();
    small_model(&models.join("m.safetensors"));
    small_model(&roots.path().join("outside.safetensors"));
    std::os::unix::fs::symlink(roots.path().join("outside.safetensors"), models.join("link.safetensors")).unwrap();
    let d = Daemon::start_args(&[], &["--model-root", models.to_str().unwrap()]);
    let doc = ok(&d.packctl(&["prefetch", "m.safetensors", "--json"]));
    assert_eq!(doc["entries"], 5);
    assert_eq!(d.stat("segments"), 1);
    assert_eq!(d.stat("leases"), 0, "a prefetch holds no lease");
    for bad in
        ["../outside.safetensors", "link.safetensors", roots.path().join("outside.safetensors").to_str().unwrap()]
    {
        let out = d.packctl(&["prefetch", bad]);
        assert!(!out.status.success(), "{bad}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("PERMISSION_DENIED"),
            "{bad}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // A worker that then packs the same file is served from the index.
    let m = d.client().pack(models.join("m.safetensors"), &Plan::default()).unwrap();
    assert_eq!(m.key(), doc["key"].as_str().unwrap());
    assert_eq!(d.stat("pack_jobs"), 1);
    let d2 = Daemon::start();
    let out = d2.packctl(&["prefetch", "m.safetensors"]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no model roots"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `grpcurl -plaintext -authority localhost -unix [-d JSON] SOCKET ARGS…` (grpcurl wants its
/// flags before the address), with a connect deadline of 120 s instead of its 10 s: a loaded
/// machine can take longer to start it and dial.
fn grpcurl(d: &Daemon, args: &[&str]) -> Output {
    let sock = d.dir().join("control.sock");
    let (flags, rest) = if args.first() == Some(&"-d") { args.split_at(2) } else { args.split_at(0) };
    Command::new(grpcurl_path())
        .args(["-plaintext", "-authority", "localhost", "-connect-timeout", "120", "-unix"])
        .args(flags)
        .arg(sock)
        .args(rest)
        .output()
        .expect("run grpcurl")
}

fn text(out: &Output) -> String {
    assert!(out.status.success(), "grpcurl: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
#[cfg_attr(
    not(packd_grpcurl),
    ignore = "needs grpcurl: run .ci/run (it installs it in .ci/cache/venv) or set PACKD_GRPCURL"
)]
fn grpcurl_lists_describes_checks_and_evicts() {
    let port = packd_tests::free_port();
    let tcp = format!("127.0.0.1:{port}");
    let d = Daemon::start_args(&[], &["--control-tcp", &tcp]);
    let list = text(&grpcurl(&d, &["list"]));
    for svc in ["packd.v1.Control", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"] {
        assert!(list.contains(svc), "{list}");
    }
    let describe = text(&grpcurl(&d, &["describe", "packd.v1.Control"]));
    for rpc in
        ["GetStats", "ListEntries", "ListClients", "Evict", "Pin", "Unpin", "SetBudget", "Prefetch", "zombie bytes"]
    {
        assert!(describe.contains(rpc), "{rpc} missing from:\n{describe}");
    }
    let health = text(&grpcurl(&d, &["-d", r#"{"service":"packd.v1.Control"}"#, "grpc.health.v1.Health/Check"]));
    assert!(health.contains("SERVING"), "{health}");

    let file = d.dir().join("small.safetensors");
    small_model(&file);
    let model = d.client().pack(&file, &Plan::default()).unwrap();
    let stats: serde_json::Value = serde_json::from_str(&text(&grpcurl(&d, &["packd.v1.Control/GetStats"]))).unwrap();
    // grpcurl prints 64-bit integers as JSON strings (proto3 JSON mapping).
    assert_eq!(
        (&stats["segments"], &stats["entries"], &stats["leases"]),
        (&"1".into(), &"5".into(), &"1".into()),
        "{stats}"
    );
    // 4096 bytes of memfd, plus one page for the 5-entry table in the index (≈ 5 KB).
    assert_eq!(stats["bytesResident"].as_str(), Some("8192"), "{stats}");
    let entries: serde_json::Value =
        serde_json::from_str(&text(&grpcurl(&d, &["-d", r#"{"prefix":"b3:"}"#, "packd.v1.Control/ListEntries"])))
            .unwrap();
    assert_eq!(entries["entries"].as_array().unwrap().len(), 5);
    assert_eq!(entries["entries"][0]["refcount"], "1");

    // Evict over grpcurl: refused while leased, done once released.
    let key = model.key().to_string();
    let req = format!(r#"{{"key":"{key}"}}"#);
    let refused = grpcurl(&d, &["-d", &req, "packd.v1.Control/Evict"]);
    assert!(!refused.status.success());
    // grpcurl spells the code its own way.
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("FailedPrecondition"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    drop(model);
    assert!(wait_until(Duration::from_secs(10), || d.stat("leases") == 0));
    let evicted: serde_json::Value =
        serde_json::from_str(&text(&grpcurl(&d, &["-d", &req, "packd.v1.Control/Evict"]))).unwrap();
    assert_eq!(evicted["evicted"][0], key.as_str());
    assert_eq!(d.stat("segments"), 0);

    // The same service on the loopback TCP port.
    let out = Command::new(grpcurl_path())
        .args(["-plaintext", "-connect-timeout", "120", &tcp, "packd.v1.Control/GetStats"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("evictions"), "{}", String::from_utf8_lossy(&out.stderr));
    // TCP callers carry no credentials: mutating RPCs are refused there by default.
    let out = Command::new(grpcurl_path())
        .args(["-plaintext", "-connect-timeout", "120", "-d", &req, &tcp, "packd.v1.Control/Evict"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("PermissionDenied") && err.contains("TCP"), "{err}");
}

#[test]
fn a_source_too_big_for_the_budget_is_refused_before_work_and_evicts_nothing() {
    let d = Daemon::start_args(&[], &["--max-bytes", "12288"]);
    let a = pack_seed(&d, 1).unwrap();
    let b = pack_seed(&d, 2).unwrap();
    let client = d.client();
    let held = client.get(&a).unwrap();
    // 16 KiB of f32 weights: a 20 KiB segment, more than the budget minus the leased a.
    let big = d.dir().join("big.safetensors");
    packd_tests::SafeTensors::default().f32("w.weight", &[32, 128], &packd_tests::values(32 * 128, 9)).write(&big);
    let jobs = d.stat("pack_jobs");
    let err = client.pack(&big, &Plan::default()).err().expect("refused").to_string();
    assert!(err.contains("RESOURCE_EXHAUSTED") && err.contains("budget of 12288 bytes"), "{err}");
    assert_eq!(d.stat("pack_jobs"), jobs, "no pack job started");
    assert_eq!(d.stat("evictions"), 0, "nothing evicted for a job that cannot fit");
    let now = keys(&d);
    assert!(now.contains(&a) && now.contains(&b), "{now:?}");
    drop(held);
}

#[test]
fn a_model_already_packed_is_served_even_when_a_second_copy_would_not_fit() {
    // One 8 KiB segment in a 12 KiB budget: held by one client, it leaves no room for a
    // second copy, but a second worker packing it needs none.
    let d = Daemon::start_args(&[], &["--max-bytes", "12288"]);
    let file = d.dir().join("m.safetensors");
    packd_tests::SafeTensors::default().f32("w", &[1250], &packd_tests::values(1250, 3)).write(&file);
    let plan = Plan::with_layout("identity");
    let first = d.client().pack(&file, &plan).unwrap();
    assert_eq!(first.info().size, 8192);
    let second = d.client().pack(&file, &plan).expect("a hit needs no room");
    assert_eq!(second.bytes(), first.bytes());
    assert_eq!((d.stat("pack_jobs"), d.stat("pack_failures")), (1, 0));
}

#[test]
fn ls_prints_one_row_per_segment_and_stats_align_their_values() {
    let d = Daemon::start();
    let file = d.dir().join("small.safetensors");
    small_model(&file);
    let client = d.client();
    let gemm = client.pack(&file, &Plan::default()).unwrap();
    let identity = client.pack(&file, &Plan::with_layout("identity")).unwrap();
    let text = |args: &[&str]| {
        let out = d.packctl(args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let ls = text(&["ls", "--wide", "--bytes"]);
    let rows: Vec<&str> = ls.lines().skip(1).collect();
    assert_eq!(rows.len(), 2, "one row per segment:\n{ls}");
    for (model, layout) in [(&gemm, "f32-gemm:nr=16,kr=1,sr=1"), (&identity, "identity")] {
        let row = rows.iter().find(|r| r.ends_with(model.key())).unwrap_or_else(|| panic!("{ls}"));
        let fields: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(fields[0], model.len().to_string(), "{row}");
        // The segment's size: the number `packctl pack` prints for it.
        assert_eq!(fields[1], model.info().size.to_string(), "{row}");
        assert_eq!(fields[5], layout, "the two plans of one file told apart: {row}");
        assert_eq!(fields[6], "small.safetensors", "the file name is the label: {row}");
    }
    // By default: sizes in KiB/MiB, keys cut, every line within 100 columns.
    let narrow = text(&["ls"]);
    assert!(narrow.lines().all(|l| l.chars().count() <= 100), "{narrow}");
    assert!(narrow.contains(" KiB ") && narrow.contains('…'), "{narrow}");
    // The JSON has each entry's payload and its segment's size and resident bytes.
    let doc = ok(&d.packctl(&["ls", "--json"]));
    let e = &doc["entries"][0];
    assert!(e["bytes"].as_u64().unwrap() <= e["segment_bytes"].as_u64().unwrap(), "{e}");
    assert!(e["segment_bytes"].as_u64().unwrap() <= e["resident_bytes"].as_u64().unwrap(), "{e}");
    let detailed = text(&["ls", "--entries"]);
    assert_eq!(detailed.lines().count(), 1 + 2 + gemm.len() + identity.len(), "{detailed}");
    // `packctl stats`: groups, one fact a line, every value in one column.
    let stats = text(&["stats"]);
    let heads: Vec<&str> = stats.lines().filter(|l| !l.starts_with(' ')).collect();
    assert_eq!(heads, ["service", "memory", "packing", "workers", "engines' sharing"], "{stats}");
    let value_at = |l: &str| l.len() - l[2..].split_once("  ").map_or(0, |(_, v)| v.trim_start().len());
    let columns: std::collections::HashSet<usize> =
        stats.lines().filter(|l| l.starts_with("  ")).map(value_at).collect();
    assert_eq!(columns.len(), 1, "{stats}");
    // Text for people: no JSON quotes or braces; the kernels on one line, no `isa` besides.
    assert!(!stats.contains('"') && !stats.contains('{'), "{stats}");
    let kernels: Vec<&str> = stats.lines().filter(|l| l.trim_start().starts_with("kernels ")).collect();
    // Grouped by ISA as the JSON has them; one ISA for all (a measured choice) reads as such.
    let chosen = ok(&d.packctl(&["stats", "--json"]))["kernels"].clone();
    let isas: std::collections::BTreeSet<&str> =
        chosen.as_object().expect("kernels by layout kind").values().filter_map(|v| v.as_str()).collect();
    assert!(kernels.len() == 1 && !isas.is_empty(), "{stats}\n{chosen}");
    if isas.len() == 1 {
        assert!(kernels[0].ends_with(&format!("{} for every layout kind", isas.first().unwrap())), "{stats}");
    } else {
        assert!(chosen.as_object().unwrap().keys().all(|kind| kernels[0].contains(kind.as_str())), "{stats}");
    }
    assert!(!stats.lines().any(|l| l.trim_start().starts_with("isa")), "{stats}");
    let resident = stats.lines().find(|l| l.trim_start().starts_with("resident ")).unwrap_or_default();
    assert!(resident.contains("iB of a ") && resident.ends_with("iB budget"), "{stats}");
    let uptime = stats.lines().find(|l| l.trim_start().starts_with("uptime ")).unwrap_or_default();
    assert!(uptime.ends_with(" ms") || uptime.ends_with(" s"), "a duration: {stats}");
    // A segment packed from an fd with no label shows one of its tensors instead; a label
    // is display text: control characters are replaced, and it is cut at 128 bytes.
    let other = d.dir().join("other.safetensors");
    packd_tests::seeded_model(&other, 9);
    let unlabeled = client.pack_file(&std::fs::File::open(&other).unwrap(), &Plan::default()).unwrap();
    let ls = text(&["ls", "--wide"]);
    let row = ls.lines().find(|r| r.ends_with(unlabeled.key())).unwrap_or_else(|| panic!("{ls}"));
    assert!(row.contains("[tensor "), "{row}");
    let odd = d.dir().join("odd.safetensors");
    packd_tests::seeded_model(&odd, 10);
    let label = format!("evil\x1b[2Jname{}", "x".repeat(300));
    let labeled = client.pack_labeled(&std::fs::File::open(&odd).unwrap(), &Plan::default(), &label).unwrap();
    let doc = ok(&d.packctl(&["ls", "--json"]));
    let kept = doc["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["segment_key"] == labeled.info().key.as_str())
        .map(|e| e["label"].as_str().unwrap().to_string())
        .unwrap();
    assert!(kept.starts_with("evil?[2Jname") && kept.len() == 128, "{kept:?}");
    // Labels are for operators: clients are not sent another client's label.
    assert_eq!(labeled.info().label, "");
}

#[test]
fn packctl_whose_reader_went_away_ends_quietly() {
    let d = Daemon::start();
    let model = d.dir().join("m.safetensors");
    small_model(&model);
    d.client().pack(&model, &Default::default()).unwrap();
    // stdout a pipe whose reading end is closed before packctl starts: every write fails
    // with EPIPE (`packctl ls | head` once head has what it wants).
    for args in [
        &["ls", "--json"][..],
        &["ls"],
        &["stats"],
        &["cat", model.to_str().unwrap(), "--tensor", "embeddings.word_embeddings.weight"],
    ] {
        let (read, write) = nix::unistd::pipe().unwrap();
        drop(read);
        let out = d.packctl_cmd(args).stdout(std::process::Stdio::from(write)).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && stderr.is_empty(), "{args:?}: {:?} {stderr}", out.status);
    }
}

#[test]
fn the_index_holds_at_most_max_segments_each_an_open_fd() {
    let d = Daemon::start_config("[limits]\nmax_segments = 3\n");
    let c = d.client();
    let files: Vec<_> = (0..5)
        .map(|i| {
            let f = d.dir().join(format!("m{i}.safetensors"));
            seeded_model(&f, 100 + i);
            f
        })
        .collect();
    // Four packs, three places: the least recently used unheld segment made room.
    for f in &files[..4] {
        drop(c.pack(f, &Default::default()).unwrap());
    }
    assert_eq!((d.stat("segments"), d.stat("evictions")), (3, 1));
    // Three held: a fifth is refused, naming the limit; nothing is evicted.
    let held: Vec<_> = files[1..4].iter().map(|f| c.pack(f, &Default::default()).unwrap()).collect();
    let Err(err) = c.pack(&files[4], &Default::default()) else { panic!("a fourth held segment") };
    assert!(err.code() == "RESOURCE_EXHAUSTED" && err.to_string().contains("limits.max_segments"), "{err}");
    assert_eq!((d.stat("segments"), d.stat("evictions")), (3, 1));
    // One let go: the fifth takes its place.
    drop(held);
    c.pack(&files[4], &Default::default()).unwrap();
    assert_eq!((d.stat("segments"), d.stat("evictions")), (3, 2));
}

#[test]
fn ls_prefix_selects_by_segment_or_entry_key_as_pin_and_evict_do() {
    let d = Daemon::start();
    let (a, b) = (pack_seed(&d, 1).unwrap(), pack_seed(&d, 2).unwrap());
    let listed = |prefix: &str| -> Vec<(String, String)> {
        let doc = ok(&d.packctl(&["ls", "--json", "--prefix", prefix]));
        doc["entries"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e["segment_key"].as_str().unwrap().to_string(), e["key"].as_str().unwrap().to_string()))
            .collect()
    };
    let all = listed("");
    let of_a: Vec<_> = all.iter().filter(|(s, _)| *s == a).cloned().collect();
    assert!(!of_a.is_empty() && of_a.len() < all.len(), "{all:?}");
    // A segment key's prefix lists that segment's entries, all of them.
    assert_eq!(listed(&a[..a.len() - 4]), of_a);
    // An entry key's prefix lists that entry.
    let entry = &of_a[0].1;
    assert_eq!(listed(entry), vec![of_a[0].clone()]);
    assert!(listed(&b).iter().all(|(s, _)| *s == b));
    // A target is a key or --prefix, and the error for neither says so.
    let out = d.packctl(&["pin"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("<KEY|--prefix <PREFIX>>"), "{err}");
}

/// The columns a table's `--help` names after "Columns:": each `;`-separated item, the
/// names before its parenthesis, `,`-separated.
fn columns_named(help: &str) -> Vec<String> {
    let at = help.find("Columns:").unwrap_or_else(|| panic!("no Columns: in\n{help}"));
    let para = help[at + "Columns:".len()..].split("\n\n").next().unwrap_or_default();
    let flat = para.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut names = Vec::new();
    let mut depth = 0;
    let mut item = String::new();
    // Only the text outside parentheses names columns.
    for c in flat.chars().chain([';']) {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ';' | '.' if depth == 0 => {
                names.extend(item.split(',').map(|n| n.trim().to_string()).filter(|n| !n.is_empty()));
                item.clear();
            }
            c if depth == 0 => item.push(c),
            _ => {}
        }
    }
    names
}

#[test]
fn every_column_a_help_text_names_is_in_its_tables_header() {
    let d = Daemon::start();
    let file = d.dir().join("m.safetensors");
    small_model(&file);
    let _held = d.client().pack(&file, &Plan::default()).unwrap();
    for cmd in ["ls", "clients", "models"] {
        let help = text(&d.packctl(&[cmd, "--help"]));
        let names = columns_named(&help);
        assert!(names.len() >= 5, "{cmd}: {names:?}");
        let table = text(&d.packctl(&[cmd]));
        let header: Vec<&str> = table.lines().next().unwrap_or_default().split_whitespace().collect();
        assert_eq!(names, header, "{cmd}: --help names these columns, the header shows those");
    }
}
