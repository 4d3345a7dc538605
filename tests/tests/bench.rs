//! `packctl bench attach | memory | scale` run end to end against the real daemon and report
//! every figure (no timing is asserted: speed is measured, not tested).

use packd_tests::{Daemon, small_model};

fn run(d: &Daemon, args: &[&str]) -> serde_json::Value {
    let out = d.packctl(args);
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

#[test]
fn attach_reports_packd_and_the_floor_and_plots() {
    let d = Daemon::start();
    let file = d.dir().join("small.safetensors");
    small_model(&file);
    let plots = d.dir().join("plots");
    let doc = run(
        &d,
        &[
            "bench",
            "attach",
            "--model",
            file.to_str().unwrap(),
            "--clients",
            "1,3",
            "--seconds",
            "0.3",
            "--json",
            "--plot",
            plots.to_str().unwrap(),
        ],
    );
    let rows = doc["results"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!((rows[0]["clients"].as_u64(), rows[1]["clients"].as_u64()), (Some(1), Some(3)));
    for r in rows {
        for k in [
            "p50_us",
            "p90_us",
            "p99_us",
            "max_us",
            "requests_per_s",
            "floor_p50_us",
            "floor_p99_us",
            "floor_requests_per_s",
        ] {
            assert!(r[k].as_f64().is_some_and(|v| v > 0.0), "{k} in {r}");
        }
        assert!(r["p50_us"].as_f64() <= r["p99_us"].as_f64());
    }
    assert!(doc["connect_us_median"].as_f64().unwrap() > 0.0);
    let svg = std::fs::read_to_string(plots.join("attach.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("floor p50"));
    // Every worker released its leases and hung up.
    assert!(
        packd_tests::wait_until(std::time::Duration::from_secs(10), || d.stat("clients") == 0 && d.stat("leases") == 0)
    );
}

#[test]
fn memory_compares_shared_and_private_copies() {
    let d = Daemon::start();
    let file = d.dir().join("small.safetensors");
    small_model(&file);
    let doc = run(&d, &["bench", "memory", "--model", file.to_str().unwrap(), "--procs", "1,3", "--json"]);
    let rows = doc["results"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for r in rows {
        assert_eq!(r["packed_bytes"], 4096);
        // At most one copy, however many holders (the MiniLM test checks ≈ 1.0 on a real model;
        // a one-page segment's Pss also depends on who else maps that page at the moment).
        let ratio = r["ratio"].as_f64().unwrap();
        assert!(ratio > 0.0 && ratio <= 1.01, "{r}");
        assert!(r["baseline_weights_pss_bytes"].as_u64().unwrap() > 0 && r["ready_ms_first"].as_f64().unwrap() > 0.0);
    }
    assert!(rows[1]["ready_ms_rest_median"].as_f64().unwrap() > 0.0);
    // The first holder packed (the bench evicted the model first), the rest were hits.
    assert_eq!(d.stat("pack_jobs"), 2);
}

#[test]
fn scale_grows_the_index() {
    let d = Daemon::start();
    let doc = run(&d, &["bench", "scale", "--entries", "10,500", "--seconds", "0.2", "--json"]);
    let rows = doc["results"].as_array().unwrap();
    assert_eq!((rows[0]["entries"].as_u64(), rows[1]["entries"].as_u64()), (Some(10), Some(500)));
    assert!(d.stat("entries") >= 500);
    assert!(rows.iter().all(|r| r["p50_us"].as_f64().unwrap() > 0.0));
}

#[test]
fn restart_reports_the_fd_store_the_cache_and_the_repack_baseline() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("small.safetensors");
    small_model(&file);
    let out = std::process::Command::new(packd_tests::packctl_bin())
        .args(["bench", "restart", "--model", file.to_str().unwrap(), "--starts", "2", "--keep-page-cache", "--json"])
        .arg("--dir")
        .arg(dir.path().join("scratch"))
        .arg("--packd")
        .arg(packd_tests::packd_bin())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["segments"], 1);
    assert_eq!(doc["ready_empty_ms"].as_array().map(Vec::len), Some(2));
    assert_eq!(doc["fd_store"]["pack_jobs"], 0, "{doc}");
    assert_eq!(doc["cache_dir"]["pack_jobs"], 0, "{doc}");
    assert_eq!(doc["repack"]["pack_jobs"], 1, "{doc}");
    for k in ["ready_empty_ms_median", "first_pack_s"] {
        assert!(doc[k].as_f64().is_some_and(|v| v > 0.0), "{k} in {doc}");
    }
    for k in ["fd_store", "cache_dir", "repack"] {
        assert!(doc[k]["serving_ms"].as_f64().is_some_and(|v| v > 0.0), "{k} in {doc}");
    }
    let s = &doc["cache_serving_strategies"];
    assert_eq!(s["bytes"], doc["segment_bytes"]);
    // Adoption's CPU time: every step measured, the ratio is adoption over the read.
    let c = &doc["adoption_cpu"];
    for k in ["read_s_per_gib", "read_blake3_s_per_gib", "read_copy_memfd_s_per_gib", "adopt_s_per_gib"] {
        assert!(c[k].as_f64().is_some_and(|v| v > 0.0), "{k} in {c}");
    }
    let cores = c["cores"].as_u64().unwrap();
    assert!(cores >= 1, "{c}");
    let floor = c["adopt_s_per_gib"].as_f64().unwrap() / cores as f64;
    assert!((c["cpu_floor_s_per_gib"].as_f64().unwrap() - floor).abs() <= 1e-9 * floor, "{c}");
}

#[test]
fn first_pack_reports_the_daemons_stages_against_in_process_packing_and_the_floor() {
    let d = Daemon::start(); // only for `run`'s socket dir: the bench starts its own daemons
    let file = d.dir().join("model.safetensors");
    packd_tests::SafeTensors::default()
        .f32("a.weight", &[64, 256], &packd_tests::values(64 * 256, 1))
        .f32("a.bias", &[64], &packd_tests::values(64, 2))
        .f32("b.weight", &[256, 64], &packd_tests::values(256 * 64, 3))
        .write(&file);
    let packd = packd_tests::packd_bin();
    let doc = run(
        &d,
        &[
            "bench",
            "first-pack",
            "--model",
            file.to_str().unwrap(),
            "--runs",
            "2",
            "--packd",
            packd.to_str().unwrap(),
            "--json",
        ],
    );
    assert_eq!(doc["runs"], 2);
    assert_eq!(doc["first_pack_runs_ms"].as_array().map(Vec::len), Some(2));
    for key in ["first_pack_ms", "daemon_job_ms", "in_process_ms", "floor_ms"] {
        assert!(doc[key].as_f64().is_some_and(|v| v > 0.0), "{key}: {doc}");
    }
    // A file the daemon never saw is read once: hashed by its pack job, not beforehand.
    assert_eq!(doc["daemon_source_hash_ms"].as_f64(), Some(0.0), "{doc}");
    let stages = doc["daemon_job_stages_ms"].as_object().expect("stages");
    for stage in ["populate", "read", "copy", "pack", "hash", "entry_hashes", "seal"] {
        assert!(stages.contains_key(stage), "{stage} missing: {doc}");
    }
    assert!(doc["segment_bytes"].as_u64().is_some_and(|b| b >= 4096));
    // Without $XNNPACK_ROOT (or --model's worker), (c) is left out, not made up.
    if std::env::var_os("XNNPACK_ROOT").is_none() {
        assert!(doc["xnnpack_fc_ms"].is_null());
    }
}
