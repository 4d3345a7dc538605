//! Clients ride out daemon restarts: mappings keep their bytes while the daemon is gone,
//! requests fail fast with "unavailable", and the next call reconnects and leases the held
//! models again, as ListClients shows.

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::Duration;

use packd_tests::{Daemon, cache_files, model_path, small_model, wait_until};

fn clients_with_leases(d: &Daemon) -> Vec<u64> {
    let out = d.packctl(&["clients", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let list = v["clients"].as_array().cloned().or_else(|| v.as_array().cloned()).unwrap_or_default();
    list.iter().map(|c| c["leases"].as_u64().unwrap_or(0)).collect()
}

#[test]
fn a_client_fails_fast_while_the_daemon_is_away_and_leases_again_after() {
    let home = Arc::new(tempfile::tempdir().unwrap());
    let cache = home.path().join("cache");
    let args = ["--cache-dir", cache.to_str().unwrap()];
    let mut d = Daemon::start_in(Arc::clone(&home), &[], &args);
    let file = home.path().join("m.safetensors");
    small_model(&file);
    let client = d.client();
    let model = client.pack(&file, &Default::default()).unwrap();
    let bytes = model.bytes().to_vec();
    assert!(wait_until(Duration::from_secs(10), || cache_files(&cache).len() == 1));
    assert_eq!(client.live_leases(), 1);

    d.crash();
    assert_eq!(model.bytes(), &bytes[..], "the mapping outlives the daemon");
    model.verify().unwrap();
    let err = client.get(model.key()).err().expect("no daemon");
    assert!(matches!(err, packd_client::Error::Unavailable { .. }), "{err}");
    assert!(err.to_string().contains("unavailable"), "{err}");
    // While it stays away, calls keep failing fast (backoff), never hanging.
    for _ in 0..20 {
        assert!(matches!(client.reconnect_if_lost(), Err(packd_client::Error::Unavailable { .. })));
    }
    assert_eq!(client.live_leases(), 0);

    let d = Daemon::start_in(Arc::clone(&home), &[], &args);
    let mut reconnected = false;
    assert!(wait_until(Duration::from_secs(10), || {
        reconnected |= client.reconnect_if_lost().unwrap_or(false);
        reconnected
    }));
    assert_eq!(client.live_leases(), 1, "{}", d.log());
    assert_eq!(clients_with_leases(&d), vec![1], "the held model is leased again");
    assert_eq!(d.stat("pack_jobs"), 0, "served from the cache directory");
    let again = client.get(model.key()).unwrap();
    assert_eq!(again.bytes(), &bytes[..]);
    drop((model, again));
    assert!(wait_until(Duration::from_secs(10), || d.stat("leases") == 0), "releases reach the new daemon");
}

fn holder(d: &Daemon, file: &str) -> (Child, BufReader<std::process::ChildStdout>) {
    let mut child = d
        .packctl_cmd(&["map", file, "--touch", "--verify", "--hold-stdin"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert!(line.starts_with("mapped:") && line.contains("verified"), "{line}");
    (child, out)
}

#[test]
fn eight_readers_survive_a_daemon_crash_and_hold_leases_again() {
    let model = model_path();
    let small = !model.exists();
    let home = Arc::new(tempfile::tempdir().unwrap());
    let file = if small {
        let f = home.path().join("m.safetensors");
        small_model(&f);
        f
    } else {
        model
    };
    let cache = home.path().join("cache");
    let args = ["--cache-dir", cache.to_str().unwrap()];
    let mut d = Daemon::start_in(Arc::clone(&home), &[], &args);
    let path = file.to_str().unwrap();
    let mut holders: Vec<_> = (0..8).map(|_| holder(&d, path)).collect();
    assert!(wait_until(Duration::from_secs(20), || d.stat("leases") == 8), "{}", d.stats());
    assert!(wait_until(Duration::from_secs(30), || cache_files(&cache).len() == 1));

    d.crash();
    // Every holder notices the daemon is gone (its next check reports it on stderr) before
    // the new daemon starts.
    let mut errs: Vec<_> = holders.iter_mut().map(|(c, _)| BufReader::new(c.stderr.take().unwrap())).collect();
    for err in &mut errs {
        // Progress lines of a pack that took over a second (a busy machine) may come first.
        let mut seen = String::new();
        loop {
            let mut line = String::new();
            let n = err.read_line(&mut line).unwrap();
            seen.push_str(&line);
            if n == 0 || !line.contains(": packing: ") {
                break;
            }
        }
        let last = seen.lines().last().unwrap_or_default();
        assert!(last.contains("warning") && last.contains("unavailable"), "{seen}\n{}", d.log());
    }
    let d = Daemon::start_in(Arc::clone(&home), &[], &args);
    assert!(
        wait_until(Duration::from_secs(10), || clients_with_leases(&d) == vec![1; 8]),
        "clients: {:?}\n{}",
        clients_with_leases(&d),
        d.log()
    );
    assert_eq!(d.stat("pack_jobs"), 0, "served from the cache directory, not repacked");
    for ((child, out), err_out) in holders.iter_mut().zip(&mut errs) {
        packd_tests::release(child);
        let status = child.wait().unwrap();
        let mut rest = String::new();
        std::io::Read::read_to_string(out, &mut rest).unwrap();
        let mut err = String::new();
        std::io::Read::read_to_string(err_out, &mut err).unwrap();
        assert!(status.success(), "{status}: {rest}{err}");
        assert!(rest.starts_with("held ") && rest.contains("verified again"), "{rest}");
        assert!(err.contains("reconnected"), "{err}");
    }
    assert!(wait_until(Duration::from_secs(10), || d.stat("leases") == 0));
}
