//! `packctl bench memory`: memory held by N processes that each obtain a model, touch every
//! page and hold it — through packd, and the baseline: each process parses the safetensors
//! and packs it privately with the same kernels, as inference runtimes do today.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use packd_client::{Client, Plan};
use serde_json::{Value, json};

/// Options of `bench memory`.
#[derive(Debug, Args)]
pub struct MemoryArgs {
    /// The safetensors model.
    #[arg(long, value_name = "FILE")]
    model: PathBuf,
    /// Process counts to measure, comma-separated.
    #[arg(long, value_name = "N,…", value_delimiter = ',', default_value = "1,2,4,8")]
    procs: Vec<usize>,
    /// Layout of the plan (the baseline packs with the same plan and kernels).
    #[arg(long, value_name = "SPEC", default_value = "", hide_default_value = true)]
    layout: String,
    /// Write memory.svg (weights memory vs N) into this directory.
    #[arg(long, value_name = "DIR")]
    plot: Option<PathBuf>,
    /// Print JSON: {"results": [{"procs","packed_bytes","pss_total_bytes","weights_pss_bytes","ratio",
    /// "baseline_pss_total_bytes","baseline_weights_pss_bytes","baseline_ratio","ready_ms_first",
    /// "ready_ms_rest_median","baseline_ready_ms_median","touch_ms_median","ready_speedup_rest",
    /// "daemon_spare_pss_bytes"}, …]}. Weights: the shared memory the workers and the daemon
    /// map read-only; the daemon's spare (memory kept for the next pack job) apart.
    /// Ready: from the process's start until the weights are usable (packd: mapped; baseline:
    /// packed). Touching every page afterwards is `touch_ms_median`.
    #[arg(long)]
    json: bool,
}

/// Options of the hidden worker process.
#[derive(Debug, Args)]
pub struct MemoryWorkerArgs {
    #[arg(long)]
    model: PathBuf,
    #[arg(long, default_value = "", hide_default_value = true)]
    layout: String,
    /// Pack privately in this process instead of asking packd.
    #[arg(long)]
    private: bool,
}

/// One process count's figures.
#[derive(Clone, Debug, Default)]
pub struct MemoryResult {
    pub procs: usize,
    pub packed_bytes: u64,
    pub pss_total: u64,
    pub weights_pss: u64,
    pub baseline_pss_total: u64,
    pub baseline_weights_pss: u64,
    pub ready_ms_first: f64,
    pub ready_ms_rest_median: f64,
    pub baseline_ready_ms_median: f64,
    pub touch_ms_median: f64,
    /// The daemon's writable shared memory: its spare (not counted in `weights_pss`).
    pub daemon_spare_pss: u64,
}

impl MemoryResult {
    pub fn ratio(&self) -> f64 {
        self.weights_pss as f64 / self.packed_bytes as f64
    }
    pub fn baseline_ratio(&self) -> f64 {
        self.baseline_weights_pss as f64 / self.packed_bytes as f64
    }
    fn json(&self) -> Value {
        json!({
            "procs": self.procs, "packed_bytes": self.packed_bytes, "pss_total_bytes": self.pss_total,
            "weights_pss_bytes": self.weights_pss, "ratio": self.ratio(),
            "baseline_pss_total_bytes": self.baseline_pss_total, "baseline_weights_pss_bytes": self.baseline_weights_pss,
            "baseline_ratio": self.baseline_ratio(), "ready_ms_first": self.ready_ms_first,
            "ready_ms_rest_median": self.ready_ms_rest_median, "baseline_ready_ms_median": self.baseline_ready_ms_median,
            "touch_ms_median": self.touch_ms_median, "daemon_spare_pss_bytes": self.daemon_spare_pss,
            "ready_speedup_rest": if self.ready_ms_rest_median > 0.0 { self.baseline_ready_ms_median / self.ready_ms_rest_median } else { 0.0 },
        })
    }
}

fn touch(bytes: &[u8]) -> u64 {
    bytes.chunks(4096).fold(0u64, |a, p| a.wrapping_add(u64::from(p[0])))
}

/// The worker: obtain the model (packd or private), touch every page, report, hold until
/// stdin closes.
pub fn worker(dir: &Path, args: MemoryWorkerArgs) -> anyhow::Result<ExitCode> {
    let t = Instant::now();
    let plan = Plan::with_layout(args.layout.clone());
    let mut out = std::io::stdout().lock();
    if args.private {
        let file = std::fs::File::open(&args.model)?;
        let source = packd::source::Source::from_fd(file.into()).map_err(anyhow::Error::msg)?;
        let digest = source.digest().map_err(anyhow::Error::msg)?;
        let plan = packd::pack::Plan::new(&plan.rules, &plan.layout).map_err(anyhow::Error::msg)?;
        let (bytes, _) =
            packd::pack::pack_private(&source, &plan, &digest, packd::pack::Kernels::all(packd::pack::Isa::best()))
                .map_err(anyhow::Error::msg)?;
        std::hint::black_box(touch(&bytes));
        writeln!(out, "ready {} {} 0", t.elapsed().as_secs_f64() * 1e3, bytes.len())?;
        out.flush()?;
        let _ = std::io::stdin().lock().lines().count();
        drop(bytes);
    } else {
        // Ready = the weights are mapped and usable; touching every page (to make them
        // resident in this process's page tables) is timed separately.
        let model = Client::connect(dir)?.pack(&args.model, &plan)?;
        let ready = t.elapsed().as_secs_f64() * 1e3;
        std::hint::black_box(touch(model.bytes()));
        let touched = t.elapsed().as_secs_f64() * 1e3 - ready;
        writeln!(out, "ready {ready} {} {touched}", model.info().size)?;
        out.flush()?;
        let _ = std::io::stdin().lock().lines().count();
    }
    Ok(ExitCode::SUCCESS)
}

/// `Pss` of the read-only and of the writable mappings of memfds in `/proc/PID/smaps`, in
/// bytes.
fn memfd_pss(pid: u32) -> (u64, u64) {
    let pss = |writable: bool| {
        packd_testkit::smaps_sums(pid, |h| h.contains("/memfd:") && packd_testkit::writable_mapping(h) == writable)
            .get("Pss")
            .copied()
            .unwrap_or(0)
    };
    (pss(false), pss(true))
}

/// `/proc/PID/smaps_rollup` fields in bytes.
pub fn rollup(pid: u32) -> HashMap<String, u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let k = it.next()?.strip_suffix(':')?;
            let v: u64 = it.next()?.parse().ok()?;
            (it.next() == Some("kB")).then(|| (k.to_string(), v * 1024))
        })
        .collect()
}

fn spawn(dir: &Path, args: &MemoryArgs, private: bool) -> anyhow::Result<(Child, f64, u64, f64)> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.arg("--socket-dir")
        .arg(dir)
        .args(["bench", "memory-worker", "--layout", &args.layout])
        .arg("--model")
        .arg(&args.model);
    if private {
        cmd.arg("--private");
    }
    let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn()?;
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().context("stdout")?).read_line(&mut line)?;
    let f: Vec<&str> = line.split_whitespace().collect();
    if f.len() != 4 || f[0] != "ready" {
        bail!("memory worker failed: {line:?}");
    }
    Ok((child, f[1].parse()?, f[2].parse()?, f[3].parse()?))
}

use super::hist::median;

fn finish(children: Vec<Child>) {
    for mut c in children {
        drop(c.stdin.take());
        let _ = c.wait();
    }
}

/// Evicts the model's segment (if packed and unleased) so the first worker packs it.
fn evict_model(dir: &Path, args: &MemoryArgs) -> anyhow::Result<()> {
    let file = std::fs::File::open(&args.model)?;
    let source = packd::source::Source::from_fd(file.into()).map_err(anyhow::Error::msg)?;
    let digest = source.digest().map_err(anyhow::Error::msg)?;
    let plan = packd::pack::Plan::new(&[], &args.layout).map_err(anyhow::Error::msg)?;
    let key = packd::key::SegmentKey::new(&digest, &plan.canonical());
    super::super::control::evict_quietly(dir, key.as_str())
}

/// Runs `packctl bench memory`.
pub fn run(dir: &Path, args: MemoryArgs) -> anyhow::Result<ExitCode> {
    if args.procs.is_empty() || args.procs.contains(&0) {
        bail!("--procs needs counts ≥ 1");
    }
    let daemon = packd_testkit::daemon_pid(dir)?;
    let mut results = Vec::new();
    for &n in &args.procs {
        let mut r = MemoryResult { procs: n, ..MemoryResult::default() };
        // packd: the first process packs, the others find it packed.
        evict_model(dir, &args)?;
        let (first, first_ms, size, first_touch) = spawn(dir, &args, false)?;
        r.packed_bytes = size;
        r.ready_ms_first = first_ms;
        let mut children = vec![first];
        let (mut rest, mut touches) = (Vec::new(), vec![first_touch]);
        for _ in 1..n {
            let (c, ms, _, touch) = spawn(dir, &args, false)?;
            children.push(c);
            rest.push(ms);
            touches.push(touch);
        }
        r.ready_ms_rest_median = median(rest);
        r.touch_ms_median = median(touches);
        for pid in children.iter().map(Child::id) {
            let m = rollup(pid);
            r.pss_total += m.get("Pss").copied().unwrap_or(0);
            r.weights_pss += m.get("Pss_Shmem").copied().unwrap_or(0);
        }
        // The daemon maps segments read-only; its writable memfd mapping is its spare
        // (memory for the next pack job), not weights: counted apart.
        r.pss_total += rollup(daemon).get("Pss").copied().unwrap_or(0);
        let (read_only, writable) = memfd_pss(daemon);
        r.weights_pss += read_only;
        r.daemon_spare_pss = writable;
        finish(children);
        // Baseline: each process packs privately.
        let mut children = Vec::new();
        let mut ready = Vec::new();
        for _ in 0..n {
            let (c, ms, _, _) = spawn(dir, &args, true)?;
            children.push(c);
            ready.push(ms);
        }
        r.baseline_ready_ms_median = median(ready);
        for c in &children {
            let m = rollup(c.id());
            r.baseline_pss_total += m.get("Pss").copied().unwrap_or(0);
            r.baseline_weights_pss += m.get("Pss_Anon").copied().unwrap_or(0);
        }
        finish(children);
        if !args.json {
            eprintln!("{n} process(es): done");
        }
        results.push(r);
    }
    if let Some(plot_dir) = &args.plot {
        let procs: Vec<usize> = results.iter().map(|r| r.procs).collect();
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        let line = |name, f: &dyn Fn(&MemoryResult) -> u64| super::plot::Line {
            name,
            ys: results.iter().map(|r| mib(f(r))).collect(),
        };
        super::plot::memory(
            plot_dir,
            &procs,
            &[
                line("packd weights (Pss_Shmem)", &|r| r.weights_pss),
                line("packd total", &|r| r.pss_total),
                line("baseline weights (Pss_Anon)", &|r| r.baseline_weights_pss),
                line("baseline total", &|r| r.baseline_pss_total),
            ],
        )?;
    }
    if args.json {
        let list: Vec<Value> = results.iter().map(MemoryResult::json).collect();
        println!("{}", json!({"model": args.model, "results": list}));
    } else {
        println!(
            "model {}; weights memory = Σ Pss_Shmem (packd: holders + daemon) / Σ Pss_Anon (baseline)",
            args.model.display()
        );
        println!(
            "{:>5} {:>12} {:>14} {:>7} {:>14} {:>14} {:>7} {:>14} {:>10} {:>10} {:>10} {:>9}",
            "procs",
            "packed",
            "weights Pss",
            "ratio",
            "total Pss",
            "base weights",
            "ratio",
            "base total",
            "ready 1st",
            "ready rest",
            "base ready",
            "touch"
        );
        for r in &results {
            println!(
                "{:>5} {:>12} {:>14} {:>7.3} {:>14} {:>14} {:>7.3} {:>14} {:>8.1}ms {:>8.2}ms {:>8.1}ms {:>7.1}ms",
                r.procs,
                r.packed_bytes,
                r.weights_pss,
                r.ratio(),
                r.pss_total,
                r.baseline_weights_pss,
                r.baseline_ratio(),
                r.baseline_pss_total,
                r.ready_ms_first,
                r.ready_ms_rest_median,
                r.baseline_ready_ms_median,
                r.touch_ms_median
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
