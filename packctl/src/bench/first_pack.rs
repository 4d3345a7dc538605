//! `packctl bench first-pack`: the first pack of a model through a fresh daemon — the whole
//! client call, and the daemon's own stage times from its log — against, in the same run:
//! (a) packing the same model in process with packd's packer (what the first worker would
//! do without packd), (b) the floor: one read of the file plus as many bytes of fresh shared
//! memory allocated and written on every core, and (c) with `$XNNPACK_ROOT`, XNNPACK packing
//! the model's fully-connected layers in process (`examples/xnnpack/minilm-fc --no-cache`).

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use packd_client::{Client, Plan};
use serde_json::{Value, json};

use super::hist::median;

/// Options of `bench first-pack`.
#[derive(Debug, Args)]
pub struct FirstPackArgs {
    /// The model. Without it, a synthetic f32 model of --gib GiB is written.
    #[arg(long, value_name = "FILE")]
    model: Option<PathBuf>,
    /// GiB of the synthetic model (without --model).
    #[arg(long, value_name = "GIB", default_value_t = 1.0)]
    gib: f64,
    /// Layout of the plan (empty: the default, f32-gemm).
    #[arg(long, value_name = "SPEC", default_value = "", hide_default_value = true)]
    layout: String,
    /// The daemons' spare (`packd --spare-bytes`): memory allocated ahead of the next
    /// job, made before the pack is timed (packd makes it once it has packed: each daemon
    /// first packs a tiny model of its own, as on a host where packd packed before); `off`
    /// for none (and no warm-up). Default: packd's default.
    #[arg(long, value_name = "BYTES")]
    spare_bytes: Option<String>,
    /// Runs; medians are reported.
    #[arg(long, value_name = "N", default_value_t = 5)]
    runs: usize,
    /// The packd binary. Default: `packd` beside this packctl.
    #[arg(long, value_name = "FILE")]
    packd: Option<PathBuf>,
    /// The XNNPACK worker for (c). Default: examples/xnnpack/minilm-fc under the current
    /// directory, used when $XNNPACK_ROOT is set and --model is given.
    #[arg(long, value_name = "FILE")]
    xnnpack_worker: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// A daemon of the bench, in a fresh directory; killed on drop.
struct Daemon {
    child: Child,
    /// A scratch directory (removed on drop).
    dir: Box<dyn AsRef<Path>>,
}

impl Daemon {
    /// Starts a daemon; `kernels` is the kernels file the bench's daemons share, so only the
    /// first measures, and it is waited for before any timed pack.
    fn start(packd: &Path, spare: Option<&str>, kernels: &Path) -> anyhow::Result<Self> {
        let dir: Box<dyn AsRef<Path>> = Box::new(packd_testkit::scratch_dir("packd-bench-first-", false)?);
        let log = File::create(dir.as_ref().as_ref().join("packd.log"))?;
        let mut cmd = Command::new(packd);
        if let Some(spare) = spare {
            cmd.args(["--spare-bytes", spare]);
        }
        let child = cmd
            .arg("--socket-dir")
            .arg(dir.as_ref().as_ref())
            .args(["--cache-dir", "off"])
            .arg("--kernels-file")
            .arg(kernels)
            .env_remove("PACKD_SPARE_BYTES")
            .env_remove("PACKD_ISA")
            .env("RUST_LOG", "packd=info")
            .env_remove("PACKD_CONFIG")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", packd.display()))?;
        let d = Self { child, dir };
        let sock = d.path().join(packd_proto::DATA_SOCKET);
        if !packd_testkit::wait_until(Duration::from_secs(60), || {
            d.log().contains("packd serving") && std::os::unix::net::UnixStream::connect(&sock).is_ok()
        }) {
            bail!("packd did not start; see its log in {}", d.path().display());
        }
        // A measurement of the kernels (a CPU with several SIMD ISAs and nothing kept yet)
        // runs after start: wait for it, so it neither competes with a timed pack nor leaves
        // the default kernels in use.
        if d.log().contains("measured off the start path")
            && !packd_testkit::wait_until(Duration::from_secs(60), || {
                let log = d.log();
                log.contains("kernels measured") || log.contains("kernels chosen")
            })
        {
            bail!("packd measured no kernels within 60 s; see its log in {}", d.path().display());
        }
        // The spare, unless off, is made in the background once packd has packed: pack a
        // tiny model of its own, then wait for it.
        let off = spare.is_some_and(|s| matches!(s.trim(), "off" | "0"));
        if !off {
            let tiny = d.path().join("warm-up.safetensors");
            std::fs::write(&tiny, tiny_safetensors())?;
            Client::connect(d.path())?.pack(&tiny, &Plan::default())?;
            if !packd_testkit::wait_until(Duration::from_secs(30), || d.log().contains("spare memfd ready")) {
                bail!("packd made no spare within 30 s; see its log in {}", d.path().display());
            }
        }
        Ok(d)
    }

    fn path(&self) -> &Path {
        self.dir.as_ref().as_ref()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.path().join("packd.log")).unwrap_or_default()
    }
}

/// A safetensors file of one 16×16 f32 weight (the spare's warm-up).
fn tiny_safetensors() -> Vec<u8> {
    let mut out = super::safetensors_head([("w.weight", "F32", [16, 16], [0, 1024])]);
    out.extend((0..256).flat_map(|i| (i as f32 / 256.0).to_le_bytes()));
    out
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `key=value` fields of the log line that contains `marker` (the last such line).
fn log_fields(log: &str, marker: &str) -> Vec<(String, f64)> {
    let Some(line) = log.lines().rev().find(|l| l.contains(marker)) else { return Vec::new() };
    let mut out = Vec::new();
    // `ms=129.2` and the stage summary `populate 47.8 ms, read 8.8 ms, ...`.
    for word in line.split_whitespace() {
        if let Some(v) = word.strip_prefix("ms=").and_then(|v| v.parse().ok()) {
            out.push(("ms".into(), v));
        }
        if let Some(v) = word.strip_prefix("bytes=").and_then(|v| v.parse().ok()) {
            out.push(("bytes".into(), v));
        }
    }
    if let Some(stages) = line.split("stages=").nth(1) {
        for part in stages.split(',') {
            let w: Vec<&str> = part.split_whitespace().collect();
            if let [name @ .., value, "ms"] = w.as_slice()
                && let Ok(v) = value.parse()
            {
                out.push((name.join("_"), v));
            }
        }
    }
    out
}

/// The text after `key` in the last log line containing `marker`, up to a space.
fn log_word(log: &str, marker: &str, key: &str) -> Option<String> {
    let line = log.lines().rev().find(|l| l.contains(marker))?;
    let rest = &line[line.find(key)? + key.len()..];
    Some(rest.split_whitespace().next().unwrap_or("").to_string())
}

/// Writes a synthetic f32 model of about `gib` GiB: 128 MiB layers `layer.{i}.weight`.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // `gib` is a small positive count
fn synthetic_model(path: &Path, gib: f64) -> anyhow::Result<()> {
    const N: u64 = 4096;
    const K: usize = 8192;
    let layers = ((gib * 8.0).round().max(1.0)) as u64;
    let bytes = N * K as u64 * 4;
    let names: Vec<String> = (0..layers).map(|i| format!("layer.{i}.weight")).collect();
    let head = super::safetensors_head(
        names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.as_str(), "F32", [N, K as u64], [i as u64 * bytes, (i as u64 + 1) * bytes])),
    );
    let mut f = std::io::BufWriter::with_capacity(8 << 20, File::create(path)?);
    f.write_all(&head)?;
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut row = vec![0u8; K * 4];
    for _ in 0..layers * N {
        for v in row.chunks_exact_mut(4) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            v.copy_from_slice(&(((x >> 40) as f32 / (1u64 << 24) as f32) - 0.5).to_le_bytes());
        }
        f.write_all(&row)?;
    }
    f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    Ok(())
}

/// One read of the whole file into a buffer that is already faulted in.
fn read_once(path: &Path) -> anyhow::Result<Duration> {
    let file = File::open(path)?;
    let len = usize::try_from(file.metadata()?.len())?;
    let mut buf = vec![1u8; len.min(64 << 20)];
    let started = Instant::now();
    let mut off = 0usize;
    while off < len {
        let n = (len - off).min(buf.len());
        file.read_exact_at(&mut buf[..n], off as u64)?;
        off += n;
    }
    Ok(started.elapsed())
}

/// XNNPACK packing the model's FC layers in process: the worker's `ready_ms` with no cache.
fn xnnpack_ms(worker: &Path, dir: &Path, model: &Path) -> anyhow::Result<f64> {
    let out = Command::new(worker)
        .arg("--socket-dir")
        .arg(dir)
        .arg("--model")
        .arg(model)
        .args(["--dtype", "f32", "--no-cache"])
        .output()
        .with_context(|| format!("running {}", worker.display()))?;
    if !out.status.success() {
        bail!("{} failed: {}", worker.display(), String::from_utf8_lossy(&out.stderr));
    }
    let v: Value = serde_json::from_slice(&out.stdout)?;
    v["ready_ms"].as_f64().context("no ready_ms in the worker's output")
}

/// Runs the benchmark.
pub fn run(args: FirstPackArgs) -> anyhow::Result<ExitCode> {
    let packd = match args.packd.clone() {
        Some(p) => p,
        None => std::env::current_exe()?.with_file_name("packd"),
    };
    let scratch = packd_testkit::scratch_dir("packd-bench-model-", true)?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => {
            let p = scratch.path().join("synthetic.safetensors");
            synthetic_model(&p, args.gib)?;
            p
        }
    };
    let worker = args.xnnpack_worker.clone().unwrap_or_else(|| PathBuf::from("examples/xnnpack/minilm-fc"));
    let with_xnnpack = args.model.is_some() && std::env::var_os("XNNPACK_ROOT").is_some() && worker.is_file();
    let plan = Plan::with_layout(args.layout.clone());
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    let (mut first, mut digest, mut job, mut private, mut floor, mut xnn) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut stages: std::collections::BTreeMap<String, Vec<f64>> = Default::default();
    let mut size = 0u64;
    let (mut kernels_used, mut spare) = (String::new(), 0.0);
    // The kernels packd picks by default, for (a): chosen once, outside the timed runs.
    let kernels = packd::pack::KernelChoice::auto().kernels;
    for _ in 0..args.runs.max(1) {
        // The first pack through a fresh daemon.
        let d = Daemon::start(&packd, args.spare_bytes.as_deref(), &scratch.path().join("kernels"))?;
        let client = Client::connect(d.path())?;
        let started = Instant::now();
        let packed = client.pack(&model, &plan)?;
        first.push(started.elapsed().as_secs_f64() * 1e3);
        size = packed.bytes().len() as u64;
        drop(packed);
        let log = d.log();
        kernels_used = log_word(&log, "packd serving", "kernels=").unwrap_or_default();
        spare = log_fields(&log, "spare memfd ready").iter().find(|(k, _)| k == "bytes").map_or(0.0, |f| f.1);
        if with_xnnpack {
            // The first run maps the model's raw weights (packd packs them as identity);
            // the second measures XNNPACK's packing with the weights mapped already.
            xnnpack_ms(&worker, d.path(), &model)?;
            xnn.push(xnnpack_ms(&worker, d.path(), &model)?);
        }
        drop(client);
        drop(d);
        for (k, v) in log_fields(&log, "source hashed") {
            if k == "ms" {
                digest.push(v);
            }
        }
        for (k, v) in log_fields(&log, " packed ") {
            match k.as_str() {
                "ms" => job.push(v),
                "bytes" => {}
                _ => stages.entry(k).or_default().push(v),
            }
        }
        // (a) In process with packd's packer (the digest computed beforehand, untimed).
        let source = packd::source::Source::from_fd(File::open(&model)?.into()).map_err(anyhow::Error::msg)?;
        let expected = source.digest().map_err(anyhow::Error::msg)?;
        let p = packd::pack::Plan::new(&[], &args.layout).map_err(anyhow::Error::msg)?;
        let started = Instant::now();
        let privately = packd::pack::pack_private(&source, &p, &expected, kernels).map_err(anyhow::Error::msg)?;
        private.push(started.elapsed().as_secs_f64() * 1e3);
        drop(privately);
        // (b) The floor.
        let read = read_once(&model)?;
        let fill = packd_testkit::pack_bench::fresh_shared_memory(size.max(1), false)?;
        floor.push((read + fill).as_secs_f64() * 1e3);
    }
    let stage_medians: serde_json::Map<String, Value> =
        stages.into_iter().map(|(k, v)| (k, json!(median(v)))).collect();
    let m_first = median(first.clone());
    let doc = json!({
        "model": model.display().to_string(),
        "segment_bytes": size,
        "kernels": kernels_used,
        "spare_bytes": spare,
        "cores": threads,
        "runs": args.runs.max(1),
        "first_pack_ms": m_first,
        "first_pack_runs_ms": first,
        "daemon_source_hash_ms": median(digest),
        "daemon_job_ms": median(job),
        "daemon_job_stages_ms": stage_medians,
        "in_process_ms": median(private.clone()),
        "floor_ms": median(floor.clone()),
        "xnnpack_fc_ms": if with_xnnpack { json!(median(xnn.clone())) } else { Value::Null },
        "first_over_in_process": m_first / median(private),
        "first_over_floor": m_first / median(floor),
        "first_over_xnnpack": if with_xnnpack { json!(m_first / median(xnn)) } else { Value::Null },
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print_table(&doc);
    }
    Ok(ExitCode::SUCCESS)
}

fn print_table(d: &Value) {
    let ms = |k: &str| d[k].as_f64().map_or("—".to_string(), |v| format!("{v:.1} ms"));
    let x = |k: &str| d[k].as_f64().map_or("—".to_string(), |v| format!("{v:.2} ×"));
    println!(
        "model {} ({} bytes packed), kernels {}, spare {} bytes, {} runs, {} cores, medians",
        d["model"].as_str().unwrap_or(""),
        d["segment_bytes"],
        d["kernels"].as_str().unwrap_or("?"),
        d["spare_bytes"],
        d["runs"],
        d["cores"]
    );
    println!("first pack through a fresh daemon (whole client call)  {}", ms("first_pack_ms"));
    match d["daemon_source_hash_ms"].as_f64() {
        Some(v) if v > 0.0 => println!("  daemon: hashing the source                           {v:.1} ms"),
        _ => println!("  daemon: hashing the source                           none (hashed while packing)"),
    }
    println!("  daemon: the pack job                                 {}", ms("daemon_job_ms"));
    if let Some(stages) = d["daemon_job_stages_ms"].as_object() {
        for (k, v) in stages {
            println!("    {k:<48} {:.1} ms", v.as_f64().unwrap_or(0.0));
        }
    }
    println!(
        "(a) packed in process with packd's packer              {}  first / (a) {}",
        ms("in_process_ms"),
        x("first_over_in_process")
    );
    println!(
        "(b) floor: one read + fresh shared memory written      {}  first / (b) {}",
        ms("floor_ms"),
        x("first_over_floor")
    );
    println!(
        "(c) XNNPACK packing the FC layers in process           {}  first / (c) {}",
        ms("xnnpack_fc_ms"),
        x("first_over_xnnpack")
    );
}
