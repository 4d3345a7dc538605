//! `packctl bench scale`: attach latency for one entry while the index holds more and more
//! entries, and the daemon's memory per entry.

use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Args;
use packd_client::{Client, Plan};
use serde_json::{Value, json};

use super::hist::Hist;

/// Options of `bench scale`.
#[derive(Debug, Args)]
pub struct ScaleArgs {
    /// Index sizes to measure at, comma-separated, increasing.
    #[arg(long, value_name = "N,…", value_delimiter = ',', default_value = "10,1000,100000")]
    entries: Vec<u64>,
    /// Seconds of get + map + release per size.
    #[arg(long, value_name = "S", default_value_t = 2.0)]
    seconds: f64,
    /// Print JSON: {"results": [{"entries","p50_us","p99_us","daemon_bytes_per_entry"}, …]}.
    #[arg(long)]
    json: bool,
}

fn rss_anon(pid: u32) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Writes a safetensors file with `n` one-element F32 tensors, distinct per `seed`.
fn many_tensors(path: &Path, n: u64, seed: u64) -> anyhow::Result<()> {
    let mut bytes = super::safetensors_head((0..n).map(|i| (format!("s{seed}.t{i}"), "F32", [1], [4 * i, 4 * i + 4])));
    for i in 0..n {
        bytes.extend_from_slice(&((seed * 1_000_003 + i) as f32).to_le_bytes());
    }
    std::fs::write(path, bytes)?;
    Ok(())
}

/// Runs `packctl bench scale`.
pub fn run(dir: &Path, args: ScaleArgs) -> anyhow::Result<ExitCode> {
    if args.entries.is_empty() || args.seconds <= 0.0 {
        bail!("--entries needs sizes and --seconds must be positive");
    }
    let daemon = packd_testkit::daemon_pid(dir)?;
    let scratch = packd_testkit::scratch_dir("packctl-scale-", false)?;
    let tmp = scratch.path();
    let client = Client::connect(dir)?;
    // The probe: one small model whose entry every measurement gets.
    let probe = tmp.join("probe.safetensors");
    many_tensors(&probe, 1, u64::from(std::process::id()))?;
    let probe_key =
        client.pack(&probe, &Plan::default())?.tensors().next().map(|t| t.key().to_string()).unwrap_or_default();
    let rss_start = rss_anon(daemon);
    let mut added = 0u64;
    let mut results = Vec::new();
    for (round, &target) in args.entries.iter().enumerate() {
        let have = 1 + added;
        if target > have {
            let file = tmp.join(format!("bulk{round}.safetensors"));
            many_tensors(&file, target - have, 1000 + round as u64 + u64::from(std::process::id()) * 7)?;
            drop(client.pack(&file, &Plan::default())?);
            let _ = std::fs::remove_file(&file);
            added += target - have;
        }
        let mut h = Hist::default();
        let end = Instant::now() + Duration::from_secs_f64(args.seconds);
        while Instant::now() < end {
            let t = Instant::now();
            drop(client.get(&probe_key)?);
            h.record(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX));
        }
        let per_entry = if added > 0 { rss_anon(daemon).saturating_sub(rss_start) as f64 / added as f64 } else { 0.0 };
        results.push(json!({"entries": 1 + added, "p50_us": h.quantile_us(0.5), "p99_us": h.quantile_us(0.99),
                            "daemon_bytes_per_entry": per_entry}));
    }
    drop(scratch);
    if args.json {
        println!("{}", json!({ "results": results }));
    } else {
        println!("{:>9} {:>9} {:>9} {:>22}", "entries", "p50 µs", "p99 µs", "daemon bytes/entry");
        for r in &results {
            let f = |k: &str| r[k].as_f64().unwrap_or(0.0);
            println!(
                "{:>9} {:>9.1} {:>9.1} {:>22.0}",
                r["entries"],
                f("p50_us"),
                f("p99_us"),
                f("daemon_bytes_per_entry")
            );
        }
        let p = |r: &Value| r["p50_us"].as_f64().unwrap_or(0.0);
        if let (Some(a), Some(b)) = (results.first(), results.last()) {
            println!("p50 ratio {} → {} entries: {:.2}", a["entries"], b["entries"], p(b) / p(a));
        }
    }
    Ok(ExitCode::SUCCESS)
}
