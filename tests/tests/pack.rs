//! Packing end to end: real daemon, real packctl processes, real fds.
#![allow(clippy::cast_possible_truncation)] // test data sizes are small

use std::process::Stdio;

use packd::pack::{Layout, gemm};
use packd_client::Plan;
use packd_tests::{Daemon, SafeTensors, f32_bytes, small_model, values};

#[test]
fn concurrent_clients_share_one_pack_job_and_identical_bytes() {
    let d = Daemon::start();
    let file = d.dir().join("m.safetensors");
    // Big enough that the pack job is still running when the other clients arrive.
    let mut st = SafeTensors::default();
    for i in 0..24 {
        st = st.f32(&format!("l.{i}.weight"), &[256, 512], &values(256 * 512, i));
    }
    st.write(&file);
    let path = file.to_str().unwrap();
    let children: Vec<_> =
        (0..6).map(|_| d.packctl_cmd(&["pack", path, "--json"]).stdout(Stdio::piped()).spawn().unwrap()).collect();
    let outputs: Vec<_> = children.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    for o in &outputs {
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let docs: Vec<serde_json::Value> = outputs.iter().map(|o| serde_json::from_slice(&o.stdout).unwrap()).collect();
    for doc in &docs[1..] {
        assert_eq!(doc["entries"], docs[0]["entries"], "every client sees the same table and digests");
        assert_eq!(doc["key"], docs[0]["key"]);
    }
    assert_eq!(docs[0]["entries"].as_array().unwrap().len(), 24);
    let stats = d.stats();
    assert_eq!(stats["pack_jobs"], 1, "{stats}");
    assert_eq!(stats["misses"], 1);
    assert_eq!(stats["hits"], 5);
    assert_eq!(stats["segments"], 1);
}

#[test]
fn packed_bytes_follow_the_layouts_and_biases_fold() {
    let d = Daemon::start();
    let file = d.dir().join("small.safetensors");
    small_model(&file);
    let client = d.client();
    let model = client.pack(&file, &Plan::default()).unwrap();
    model.verify().unwrap();
    let names: Vec<_> = model.tensors().map(|t| (t.name().to_string(), t.layout().to_string())).collect();
    let gemm = "f32-gemm:nr=16,kr=1,sr=1".to_string();
    assert_eq!(
        names,
        vec![
            ("embeddings.word_embeddings.weight".into(), "identity".into()),
            ("embeddings.position_ids".into(), "identity".into()),
            ("layer.0.dense.weight".into(), gemm.clone()),
            ("layer.1.proj.weight".into(), gemm),
            ("layer.1.norm.weight".into(), "identity".into()),
        ]
    );
    // identity is the source bytes; I64 kept as is.
    assert_eq!(model.tensor("embeddings.word_embeddings.weight").unwrap().bytes(), f32_bytes(&values(80, 1)));
    let ids: Vec<u8> = (0i64..4).flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(model.tensor("embeddings.position_ids").unwrap().bytes(), ids);
    // GEMM entry with its bias folded in: the reference consumer multiplies correctly.
    let t = model.tensor("layer.0.dense.weight").unwrap();
    assert_eq!(t.bias(), Some("layer.0.dense.bias"));
    let Layout::Gemm(kind, p) = t.layout().parse::<Layout>().unwrap() else { panic!() };
    let (w, b, x) = (values(17 * 8, 3), values(17, 2), values(8, 9));
    let y = gemm::gemm(kind, p, 17, 8, t.bytes(), &x, 1);
    for n in 0..17 {
        let want: f32 = (0..8).map(|k| x[k] * w[n * 8 + k]).sum::<f32>() + b[n];
        assert!((y[n] - want).abs() < 1e-5, "row {n}: {} vs {want}", y[n]);
    }
    // Offsets are 64-byte aligned and the segment a page multiple.
    assert!(model.tensors().all(|t| t.entry().offset % 64 == 0));
    assert_eq!(model.info().size % 4096, 0);
    assert!(model.tensor("layer.0.dense.bias").is_none(), "a folded bias has no entry of its own");
    // Lookups by position and by name agree with the table's order.
    assert_eq!(model.len(), 5);
    for (i, t) in model.tensors().enumerate() {
        assert_eq!(model.position(t.name()), Some(i));
        assert_eq!(model.tensor_at(i).unwrap().bytes(), t.bytes());
    }
    assert!(model.tensor_at(5).is_none() && model.position("layer.0.dense.bias").is_none());

    // A different plan is a different segment; the same plan is a hit.
    let ident = client.pack(&file, &Plan::with_layout("identity")).unwrap();
    assert_ne!(ident.key(), model.key());
    assert_eq!(ident.tensors().count(), 6);
    assert!(ident.tensors().all(|t| t.layout() == "identity"));
    let again = client.pack(&file, &Plan::default()).unwrap();
    assert_eq!(again.key(), model.key());
    assert_eq!(d.stat("pack_jobs"), 2);
}

#[test]
fn get_by_entry_or_segment_key_and_release_on_drop() {
    let d = Daemon::start();
    let file = d.dir().join("small.safetensors");
    small_model(&file);
    let a = d.client();
    let model = a.pack(&file, &Plan::default().rule("layer.1.proj.*=f32-gemm:nr=4,kr=2,sr=2")).unwrap();
    assert_eq!(model.tensor("layer.1.proj.weight").unwrap().layout(), "f32-gemm:nr=4,kr=2,sr=2");
    let entry_key = model.tensor("layer.0.dense.weight").unwrap().key().to_string();
    assert!(entry_key.starts_with("b3:") && entry_key.ends_with("#f32-gemm:nr=16,kr=1,sr=1@v1"), "{entry_key}");

    let b = d.client();
    let by_entry = b.get(&entry_key).unwrap();
    let by_segment = b.get(model.key()).unwrap();
    assert_eq!(by_entry.bytes(), model.bytes());
    assert_eq!(by_segment.key(), model.key());
    assert!(packd_tests::wait_until(std::time::Duration::from_secs(10), || d.stat("leases") == 3));
    drop(by_entry);
    drop(by_segment);
    assert!(packd_tests::wait_until(std::time::Duration::from_secs(10), || d.stat("leases") == 1));
    let err = b.get("b3:nope").err().unwrap().to_string();
    assert!(err.contains("NOT_FOUND") && err.contains("b3:nope"), "{err}");
    drop(model);
    assert!(packd_tests::wait_until(std::time::Duration::from_secs(10), || d.stat("leases") == 0));
    assert_eq!(d.stat("segments"), 1, "an unleased segment stays packed for the next worker");
}

#[test]
fn packctl_cat_map_and_help() {
    let d = Daemon::start();
    let file = d.dir().join("small.safetensors");
    small_model(&file);
    let path = file.to_str().unwrap();
    let out = d.packctl(&["cat", path, "--tensor", "layer.1.norm.weight"]);
    assert!(out.status.success());
    assert_eq!(out.stdout, f32_bytes(&values(3, 5)));
    let out = d.packctl(&["cat", path, "--tensor", "layer.0.dense.bias"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("folded into the entry of layer.0.dense.weight"));
    let out = d.packctl(&["cat", path, "--tensor", "layer.1.proj.weight", "--layout", "identity"]);
    assert_eq!(out.stdout, f32_bytes(&values(51, 4)));

    let out = d.packctl(&["map", path, "--touch", "--verify", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["verified"], true);
    assert_eq!(doc["entries"], 5);

    for bin in [packd_tests::packd_bin(), packd_tests::packctl_bin()] {
        let out = std::process::Command::new(bin).arg("--help").output().unwrap();
        assert!(out.status.success());
        assert!(String::from_utf8_lossy(&out.stdout).contains("--socket-dir"));
    }
    // No empty defaults in help; --timeout says which commands it bounds.
    for sub in ["pack", "map", "cat", "prefetch", "ls"] {
        let out = std::process::Command::new(packd_tests::packctl_bin()).args([sub, "--help"]).output().unwrap();
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && !help.contains("[default: \"\"]"), "{sub}: {help}");
        assert!(help.contains("pack, map and cat use the client library's deadlines"), "{sub}: {help}");
    }
}

#[test]
fn a_pack_right_after_a_release_keeps_its_fd() {
    // The release and the next pack often arrive in one read on the daemon's side; the fd
    // must still go to the pack.
    let d = Daemon::start();
    let (a, b) = (d.dir().join("a.safetensors"), d.dir().join("b.safetensors"));
    packd_tests::seeded_model(&a, 1);
    packd_tests::seeded_model(&b, 2);
    let client = d.client();
    for i in 0..50 {
        let file = if i % 2 == 0 { &a } else { &b };
        let model = client.pack(file, &Plan::default()).unwrap_or_else(|e| panic!("round {i}: {e}"));
        drop(model);
    }
    assert_eq!(d.stat("pack_jobs"), 2);
    assert_eq!(d.stat("request_errors"), 0);
}

#[test]
fn a_pack_reply_says_whether_it_packed_or_found_the_segment() {
    use packd_client::proto::PackOutcome;
    let d = Daemon::start();
    let file = d.dir().join("small.safetensors");
    small_model(&file);
    let client = d.client();
    let first = client.pack(&file, &Plan::default()).unwrap();
    assert_eq!(first.info().outcome(), PackOutcome::Packed);
    let again = client.pack(&file, &Plan::default()).unwrap();
    assert_eq!(again.info().outcome(), PackOutcome::Found);
    // A get is not a pack request: nothing to tell.
    assert_eq!(client.get(again.key()).unwrap().info().outcome(), PackOutcome::Unspecified);
    // packctl says it in words, with the time; --json as a field.
    let out = d.packctl(&["pack", file.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with(&format!("{}: found packed in ", file.display())), "{text}");
    let out = d.packctl(&["pack", file.to_str().unwrap(), "--layout", "identity", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["outcome"], "packed", "a new plan is a new segment: {doc}");
}

#[test]
fn a_directory_given_as_the_model_is_refused_by_the_client_as_open_refuses_it() {
    let d = Daemon::start();
    let Err(err) = d.client().pack(d.dir(), &Plan::default()) else { panic!("a directory was packed") };
    assert!(
        matches!(&err, packd_client::Error::Open { source, .. } if source.raw_os_error() == Some(libc::EISDIR)),
        "{err}"
    );
    let out = d.packctl(&["pack", d.dir().to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Is a directory"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Nothing reached the daemon.
    assert_eq!(d.stat("request_errors"), 0);
}
