//! `packctl bench stress`: N client processes pack, get, map, verify and release at random,
//! send half frames, exit while holding leases, and are SIGKILLed at random points (and
//! replaced) while the control plane force-evicts under them. Every byte a client maps is
//! checked against the entry table and against a reference packed before the run; at the
//! end every client is killed and the daemon must come back to its starting leases, clients
//! and fds, and still serve every model correctly.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use packd_client::proto::{self as pb, ErrorCode};
use packd_client::{Client, DATA_SOCKET, Error, Model, Plan};
use packd_testkit::Rng;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// Options of `bench stress`.
#[derive(Debug, Args)]
pub struct StressArgs {
    /// Client processes running at once (each killed one is replaced).
    #[arg(long, value_name = "N", default_value_t = 8)]
    clients: usize,
    /// Length of the run.
    #[arg(long, value_name = "S", default_value_t = 10.0)]
    seconds: f64,
    /// Synthetic models to pack (each with several plans); the last one is 4 MiB so that
    /// kills land during its pack jobs.
    #[arg(long, value_name = "M", default_value_t = 3)]
    models: usize,
    /// Mean milliseconds between SIGKILLs of a random client (0: none).
    #[arg(long, value_name = "MS", default_value_t = 25)]
    kill_ms: u64,
    /// Mean milliseconds between forced evictions of everything over the control plane
    /// (needs an admin; 0: none). Readers keep their mappings; their bytes are re-checked.
    #[arg(long, value_name = "MS", default_value_t = 400)]
    evict_ms: u64,
    /// Seed of the random choices (the run is still timing-dependent).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print JSON: {"ops", "errors", "unexpected_errors", "checksum_failures", "kills",
    /// "leaked_leases", "leaked_fds", "final_check", …}.
    #[arg(long)]
    json: bool,
}

/// Options of the hidden worker process.
#[derive(Debug, Args)]
pub struct StressWorkerArgs {
    #[arg(long)]
    reference: PathBuf,
    #[arg(long)]
    seed: u64,
}

/// An exponentially distributed wait with the given mean.
fn exp_wait(rng: &mut Rng, mean_ms: u64) -> Duration {
    Duration::from_secs_f64(-(1.0 - rng.unit()).ln() * mean_ms as f64 / 1000.0)
}

/// Layouts of the plans each model is packed with.
const PLANS: [&str; 4] = ["", "identity", "f16-gemm:nr=8,kr=1,sr=1", "bf16-gemm:nr=4,kr=2,sr=1"];

/// Writes a safetensors model with odd shapes: GEMM weights with biases, an F16 embedding
/// and a BF16 vector; `big` adds a 4 MiB weight.
fn synthetic_model(path: &Path, seed: u64, big: bool) -> anyhow::Result<()> {
    let mut rng = Rng::new(seed);
    let mut tensors: Vec<(String, &str, Vec<u64>)> = Vec::new();
    for j in 0..3u64 {
        let n = 17 + rng.below(80) as u64;
        let k = 9 + rng.below(70) as u64;
        tensors.push((format!("enc.{j}.weight"), "F32", vec![n, k]));
        tensors.push((format!("enc.{j}.bias"), "F32", vec![n]));
    }
    tensors.push(("emb.weight".into(), "F16", vec![50, 12]));
    tensors.push(("norm".into(), "BF16", vec![12]));
    if big {
        tensors.push(("big.weight".into(), "F32", vec![1024, 1024]));
    }
    let mut data = Vec::new();
    let mut ranges = Vec::with_capacity(tensors.len());
    for (_, dtype, shape) in &tensors {
        let start = data.len() as u64;
        let elems: u64 = shape.iter().product();
        for _ in 0..elems {
            let v = (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            match *dtype {
                "F32" => data.extend_from_slice(&v.to_le_bytes()),
                // The top halves of f32 values are valid BF16; F16 takes small exact values.
                "BF16" => data.extend_from_slice(&v.to_bits().to_le_bytes()[2..]),
                _ => data.extend_from_slice(&((rng.next_u64() % 2048) as u16 | 0x3800).to_le_bytes()),
            }
        }
        ranges.push([start, data.len() as u64]);
    }
    let head = super::safetensors_head(tensors.into_iter().zip(ranges).map(|((n, d, s), r)| (n, d, s, r)));
    let mut f = File::create(path)?;
    f.write_all(&head)?;
    f.write_all(&data)?;
    Ok(())
}

/// The instructions every worker reads: each (model file, plan) the run packed, with what
/// a client must see for it.
#[derive(Serialize, Deserialize)]
struct Instructions {
    jobs: Vec<Job>,
}

/// One model file with one plan.
#[derive(Serialize, Deserialize)]
struct Job {
    path: PathBuf,
    layout: String,
    expect: Reference,
}

/// What a client must see for one (model, plan): the segment key and each entry's key and
/// BLAKE3, from a pack done before the run.
#[derive(Serialize, Deserialize, Clone)]
struct Reference {
    segment: String,
    entries: Vec<RefEntry>,
}

/// One entry of a [`Reference`].
#[derive(Serialize, Deserialize, Clone)]
struct RefEntry {
    name: String,
    key: String,
    blake3: String,
}

impl Reference {
    fn of(model: &Model) -> Self {
        let entries = model
            .tensors()
            .map(|t| RefEntry { name: t.name().into(), key: t.key().into(), blake3: t.entry().blake3.clone() })
            .collect();
        Self { segment: model.key().into(), entries }
    }
}

/// Checks `model` against its entry table (every byte) and against the reference.
fn check(model: &Model, reference: &[Reference]) -> Result<(), String> {
    model.verify().map_err(|e| e.to_string())?;
    let Some(r) = reference.iter().find(|r| r.segment == model.key()) else {
        return Err(format!("segment {} is not one the run packed", model.key()));
    };
    if model.tensors().count() != r.entries.len() {
        return Err(format!(
            "segment {} has {} entries, the reference {}",
            model.key(),
            model.tensors().count(),
            r.entries.len()
        ));
    }
    for (t, e) in model.tensors().zip(&r.entries) {
        if e.name != t.name() || e.key != t.key() || e.blake3 != t.entry().blake3 {
            return Err(format!("entry {} differs from the reference", t.name()));
        }
    }
    Ok(())
}

/// Error kinds a correct daemon gives a correct client under this load: a key evicted
/// before it was asked for, and a budget too small for one more segment while the rest is
/// leased.
fn expected(kind: &str) -> bool {
    kind == ErrorCode::NotFound.as_str_name() || kind == ErrorCode::ResourceExhausted.as_str_name()
}

/// One client process: random operations until killed; one line per finished operation.
pub fn worker(dir: &Path, args: StressWorkerArgs) -> anyhow::Result<ExitCode> {
    let instructions: Instructions = serde_json::from_slice(&std::fs::read(&args.reference)?)
        .with_context(|| format!("reading the instructions {}", args.reference.display()))?;
    if instructions.jobs.is_empty() {
        bail!("the instructions {} name no job", args.reference.display());
    }
    let refs: Vec<Reference> = instructions.jobs.iter().map(|j| j.expect.clone()).collect();
    let mut rng = Rng::new(args.seed);
    let client = Client::connect(dir)?;
    let mut held: Vec<Model> = Vec::new();
    let mut half_frames: Vec<UnixStream> = Vec::new();
    let mut out = std::io::stdout().lock();
    loop {
        let roll = rng.below(100);
        let (op, result): (&str, Result<(), String>) = match roll {
            0..25 => {
                let job = &instructions.jobs[rng.below(instructions.jobs.len())];
                let r = client.pack(&job.path, &Plan::with_layout(job.layout.clone()));
                ("pack", keep(r, &refs, &mut held))
            }
            25..50 => {
                let r = &refs[rng.below(refs.len())];
                let key = match r.entries.get(rng.below(r.entries.len())) {
                    Some(e) if rng.below(2) == 1 => e.key.clone(),
                    _ => r.segment.clone(),
                };
                ("get", keep(client.get(&key), &refs, &mut held))
            }
            50..70 => match held.get(rng.below(held.len())) {
                Some(m) => ("verify", check(m, &refs).map_err(|e| format!("corrupt {e}"))),
                None => continue,
            },
            70..92 => {
                if held.is_empty() {
                    continue;
                }
                held.swap_remove(rng.below(held.len()));
                ("release", Ok(()))
            }
            92..98 => {
                // Half a frame: a header promising 100 bytes and 10 of them, left open so
                // that a kill may land in the middle of it; at most four at a time.
                let s = UnixStream::connect(dir.join(DATA_SOCKET)).map_err(|e| e.to_string());
                let r = s.and_then(|mut s| {
                    let mut bytes = packd_proto::frame::header(100).map_err(|e| e.to_string())?.to_vec();
                    bytes.extend_from_slice(&[0x08; 10]);
                    s.write_all(&bytes).map_err(|e| e.to_string())?;
                    half_frames.push(s);
                    if half_frames.len() > 4 {
                        half_frames.remove(0);
                    }
                    Ok(())
                });
                ("half_frame", r.map_err(|e| format!("IO {e}")))
            }
            _ => {
                // Leave without releasing anything.
                writeln!(out, "ok exit")?;
                out.flush()?;
                std::process::exit(0);
            }
        };
        // One write per line: a kill can then cut a report only at a line's end, or leave
        // a last line without its newline, which the orchestrator ignores.
        let line = match result {
            Ok(()) => format!("ok {op}\n"),
            Err(e) => format!("err {op} {}\n", e.replace('\n', " ")),
        };
        out.write_all(line.as_bytes())?;
        out.flush()?;
        if held.len() > 8 {
            held.remove(0);
        }
    }
}

/// Keeps a model that passed its checks; the error line otherwise ("KIND message" or
/// "corrupt message").
fn keep(r: Result<Model, Error>, refs: &[Reference], held: &mut Vec<Model>) -> Result<(), String> {
    match r {
        Ok(m) => {
            check(&m, refs).map_err(|e| format!("corrupt {e}"))?;
            held.push(m);
            Ok(())
        }
        Err(Error::Corrupt { name, got, want }) => Err(format!("corrupt entry {name}: {got} vs {want}")),
        Err(e) => Err(format!("{} {e}", e.code())),
    }
}

/// Counts gathered from every worker's lines.
#[derive(Default)]
struct Tally {
    ops: BTreeMap<String, u64>,
    errors: BTreeMap<String, u64>,
    corrupt: Vec<String>,
    unexpected: u64,
    unexpected_examples: Vec<String>,
}

impl Tally {
    fn line(&mut self, line: &str) {
        let mut parts = line.splitn(4, ' ');
        let (status, op) = (parts.next().unwrap_or(""), parts.next().unwrap_or("?"));
        *self.ops.entry(op.to_string()).or_default() += 1;
        if status != "err" {
            return;
        }
        let kind = parts.next().unwrap_or("?").to_string();
        if kind == "corrupt" {
            self.corrupt.push(line.to_string());
        } else {
            if !expected(&kind) {
                self.unexpected += 1;
                if self.unexpected_examples.len() < 10 {
                    self.unexpected_examples.push(line.to_string());
                }
            }
            *self.errors.entry(kind).or_default() += 1;
        }
    }
}

fn spawn_worker(
    exe: &Path,
    dir: &Path,
    reference: &Path,
    seed: u64,
    tally: &Arc<Mutex<Tally>>,
) -> anyhow::Result<Child> {
    let mut child = Command::new(exe)
        .arg("--socket-dir")
        .arg(dir)
        .args(["bench", "stress-worker", "--seed", &seed.to_string(), "--reference"])
        .arg(reference)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("starting a stress client")?;
    let stdout = child.stdout.take().context("stdout")?;
    let tally = Arc::clone(tally);
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stdout);
        let mut line = Vec::new();
        // Only whole lines count: a worker SIGKILLed while it wrote its report leaves a last
        // line without its newline, which says nothing about the daemon.
        while reader.read_until(b'\n', &mut line).is_ok_and(|n| n > 0) && line.ends_with(b"\n") {
            let text = String::from_utf8_lossy(&line[..line.len() - 1]);
            tally.lock().unwrap_or_else(std::sync::PoisonError::into_inner).line(&text);
            line.clear();
        }
    });
    Ok(child)
}

fn kill(mut child: Child) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX)),
        nix::sys::signal::Signal::SIGKILL,
    );
    let _ = child.wait();
}

/// The daemon's pid, from the data socket's peer credentials.
fn daemon_pid(dir: &Path) -> anyhow::Result<i32> {
    let pid = packd_testkit::daemon_pid(dir).context("connecting to the data socket")?;
    Ok(i32::try_from(pid)?)
}

fn fd_count(pid: i32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64)
}

/// The daemon's open fds that are not segments (each resident or zombie segment holds its
/// memfd), so eviction during the run does not count as a leak.
fn fds_beyond_segments(pid: i32) -> i64 {
    let memfds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| {
        d.filter_map(Result::ok)
            .filter(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().starts_with("/memfd:packd")))
            .count()
    });
    fd_count(pid) as i64 - memfds as i64
}

/// The daemon's fds beyond its segments once they stop changing (it closes its side of a
/// probe connection asynchronously), within 2 s.
fn settled_fds(pid: i32) -> i64 {
    let settle = Instant::now() + Duration::from_secs(2);
    let mut fds = fds_beyond_segments(pid);
    loop {
        std::thread::sleep(Duration::from_millis(50));
        let now = fds_beyond_segments(pid);
        if now == fds || Instant::now() > settle {
            return fds.min(now);
        }
        fds = now;
    }
}

/// Writes the models into `work`, packs every (model, plan) once as the reference, and
/// writes the workers' instructions; returns them and their file.
fn prepare(dir: &Path, args: &StressArgs, work: &Path) -> anyhow::Result<(Instructions, PathBuf)> {
    let client = Client::connect(dir)?;
    let mut jobs = Vec::new();
    for m in 0..args.models {
        let path = work.join(format!("model-{m}.safetensors"));
        synthetic_model(&path, args.seed.wrapping_add(m as u64), m + 1 == args.models)?;
        for layout in PLANS {
            let model = client
                .pack(&path, &Plan::with_layout(layout))
                .with_context(|| format!("packing the reference of {} with layout {layout:?}", path.display()))?;
            model.verify()?;
            jobs.push(Job { path: path.clone(), layout: layout.into(), expect: Reference::of(&model) });
        }
    }
    let file = work.join("reference.json");
    let instructions = Instructions { jobs };
    std::fs::write(&file, serde_json::to_vec(&instructions)?)?;
    Ok((instructions, file))
}

/// What the load did.
struct Load {
    kills: u64,
    respawns: u64,
    evictions: u64,
    evicted: u64,
}

/// Runs the clients for `args.seconds`, SIGKILLing one at random moments and forcing
/// evictions at others; every client is killed at the end, holding whatever it holds.
fn drive(
    dir: &Path,
    args: &StressArgs,
    reference: &Path,
    tally: &Arc<Mutex<Tally>>,
    rt: &tokio::runtime::Runtime,
    control: &mut pb::control_client::ControlClient<tonic::transport::Channel>,
) -> anyhow::Result<Load> {
    let exe = std::env::current_exe()?;
    let mut rng = Rng::new(args.seed);
    let mut seed = args.seed.wrapping_mul(1000);
    let mut next_seed = || {
        seed += 1;
        seed
    };
    let mut workers = Workers(Vec::new());
    for _ in 0..args.clients {
        workers.0.push(spawn_worker(&exe, dir, reference, next_seed(), tally)?);
    }
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(args.seconds);
    let mut load = Load { kills: 0, respawns: 0, evictions: 0, evicted: 0 };
    let mut next_kill = (args.kill_ms > 0).then(|| start + exp_wait(&mut rng, args.kill_ms));
    let mut next_evict = (args.evict_ms > 0).then(|| start + exp_wait(&mut rng, args.evict_ms));
    while Instant::now() < end {
        std::thread::sleep(Duration::from_millis(1));
        let now = Instant::now();
        if next_kill.is_some_and(|t| now >= t) {
            let i = rng.below(workers.0.len());
            let fresh = spawn_worker(&exe, dir, reference, next_seed(), tally)?;
            kill(std::mem::replace(&mut workers.0[i], fresh));
            load.kills += 1;
            next_kill = Some(now + exp_wait(&mut rng, args.kill_ms));
        }
        if next_evict.is_some_and(|t| now >= t) {
            let req = pb::EvictRequest { key: String::new(), prefix: "b3:".into(), force: true };
            match rt.block_on(control.evict(req)) {
                Ok(r) => load.evicted += r.into_inner().evicted.len() as u64,
                Err(s) if s.code() == tonic::Code::NotFound => {} // nothing resident right now
                Err(s) => bail!("Evict over the control plane (needs an admin): {}", s.message()),
            }
            load.evictions += 1;
            next_evict = Some(now + exp_wait(&mut rng, args.evict_ms));
        }
        // Replace clients that left on their own (the "exit holding leases" operation).
        for w in &mut workers.0 {
            if w.try_wait()?.is_some() {
                *w = spawn_worker(&exe, dir, reference, next_seed(), tally)?;
                load.respawns += 1;
            }
        }
    }
    Ok(load)
}

/// Runs `packctl bench stress`.
pub fn run(dir: &Path, args: StressArgs) -> anyhow::Result<ExitCode> {
    if args.clients == 0 || args.models == 0 || args.seconds <= 0.0 {
        bail!("--clients and --models must be at least 1 and --seconds positive");
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let mut control = rt.block_on(super::super::control::connect(dir))?;
    let stats = |rt: &tokio::runtime::Runtime, c: &mut pb::control_client::ControlClient<_>| {
        rt.block_on(c.get_stats(pb::GetStatsRequest {})).map(tonic::Response::into_inner).map_err(anyhow::Error::from)
    };
    let before = stats(&rt, &mut control)?;
    let pid = daemon_pid(dir)?;
    let fds_before = settled_fds(pid);

    let scratch = packd_testkit::scratch_dir("packctl-stress-", false)?;
    let (instructions, reference) = prepare(dir, &args, scratch.path())?;
    let tally = Arc::new(Mutex::new(Tally::default()));
    let start = Instant::now();
    let load = drive(dir, &args, &reference, &tally, &rt, &mut control)?;
    let (kills, respawns, evictions, evicted) = (load.kills, load.respawns, load.evictions, load.evicted);
    let elapsed = start.elapsed().as_secs_f64();

    // The daemon must give back every lease and fd of the killed clients.
    let settle = Instant::now() + Duration::from_secs(10);
    let mut after = stats(&rt, &mut control)?;
    while (after.leases != before.leases || after.clients != before.clients) && Instant::now() < settle {
        std::thread::sleep(Duration::from_millis(20));
        after = stats(&rt, &mut control)?;
    }
    let mut fds_after = fds_beyond_segments(pid);
    while fds_after > fds_before && Instant::now() < settle {
        std::thread::sleep(Duration::from_millis(20));
        fds_after = fds_beyond_segments(pid);
    }
    let daemon_alive = daemon_pid(dir).is_ok_and(|p| p == pid);

    // And still serve every model correctly.
    let final_check = final_check(dir, &instructions);

    let t = tally.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let ops_total: u64 = t.ops.values().sum();
    let errors_total: u64 = t.errors.values().sum();
    let leaked_leases = after.leases.saturating_sub(before.leases);
    let leaked_fds = fds_after - fds_before;
    let doc = json!({
        "clients": args.clients, "seconds": elapsed, "models": args.models, "plans": PLANS.len(),
        "ops_total": ops_total, "ops_per_s": ops_total as f64 / elapsed, "ops": t.ops,
        "errors_total": errors_total, "errors": t.errors,
        "unexpected_errors": t.unexpected, "unexpected_examples": t.unexpected_examples,
        "checksum_failures": t.corrupt.len(), "checksum_examples": t.corrupt.iter().take(10).collect::<Vec<_>>(),
        "kills": kills, "exits": respawns, "forced_evictions": evictions, "segments_evicted": evicted,
        "leaked_leases": leaked_leases, "leaked_fds": leaked_fds,
        "daemon_alive": daemon_alive,
        "final_check": final_check.as_ref().err().cloned().unwrap_or_else(|| "ok".into()),
        "daemon_pack_jobs": after.pack_jobs - before.pack_jobs,
    });
    let failed = !t.corrupt.is_empty()
        || t.unexpected != 0
        || leaked_leases != 0
        || leaked_fds > 0
        || !daemon_alive
        || final_check.is_err();
    if args.json {
        println!("{doc}");
    } else {
        println!(
            "{} clients, {elapsed:.1} s: {ops_total} operations ({:.0}/s), {kills} SIGKILLs, {respawns} exits holding \
             leases, {evictions} forced evictions ({evicted} segments), {} pack jobs",
            args.clients,
            ops_total as f64 / elapsed,
            after.pack_jobs - before.pack_jobs
        );
        println!("operations:        {}", kv(&doc["ops"]));
        println!("errors by kind:    {}", if errors_total == 0 { "none".into() } else { kv(&doc["errors"]) });
        println!("unexpected errors: {}", t.unexpected);
        for l in &t.unexpected_examples {
            println!("  {l}");
        }
        println!("checksum failures: {}", t.corrupt.len());
        for l in t.corrupt.iter().take(10) {
            println!("  {l}");
        }
        println!("leaked leases:     {leaked_leases}");
        println!("leaked fds:        {leaked_fds}");
        println!("daemon alive:      {daemon_alive}");
        println!("final check:       {}", doc["final_check"].as_str().unwrap_or_default());
        println!("{}", if failed { "FAILED" } else { "passed" });
    }
    Ok(if failed { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}

/// Packs every job again (each is packed already: a hit) and checks what comes back.
fn final_check(dir: &Path, instructions: &Instructions) -> Result<(), String> {
    let refs: Vec<Reference> = instructions.jobs.iter().map(|j| j.expect.clone()).collect();
    let client = Client::connect(dir).map_err(|e| e.to_string())?;
    for j in &instructions.jobs {
        let m = client
            .pack(&j.path, &Plan::with_layout(j.layout.clone()))
            .map_err(|e| format!("{}: {e}", j.path.display()))?;
        check(&m, &refs)?;
    }
    Ok(())
}

fn kv(v: &Value) -> String {
    v.as_object().map_or(String::new(), |m| m.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join(", "))
}

/// The client processes; killed when dropped, also when the run fails half-way.
struct Workers(Vec<Child>);

impl Drop for Workers {
    fn drop(&mut self) {
        for w in self.0.drain(..) {
            kill(w);
        }
    }
}
