//! `packctl bench attach`: get + map + release latency of an already packed model, against
//! the floor — a bare server that answers each 1-byte request with the same pre-created
//! memfd over SCM_RIGHTS, which the client maps and unmaps — measured by the same client
//! processes in the same run.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use packd_client::{Client, Plan, sys};
use serde_json::{Value, json};

use super::hist::Hist;

/// Options of `bench attach`.
#[derive(Debug, Args)]
pub struct AttachArgs {
    /// The safetensors model (packed first if it is not yet).
    #[arg(long, value_name = "FILE")]
    model: PathBuf,
    /// Client process counts to measure, comma-separated.
    #[arg(long, value_name = "N,…", value_delimiter = ',', default_value = "1,4,16,64")]
    clients: Vec<usize>,
    /// Seconds each client spends on packd, and again on the floor, per count.
    #[arg(long, value_name = "S", default_value_t = 2.0)]
    seconds: f64,
    /// Layout of the model's plan.
    #[arg(long, value_name = "SPEC", default_value = "", hide_default_value = true)]
    layout: String,
    /// Write attach.svg (latency vs clients) into this directory.
    #[arg(long, value_name = "DIR")]
    plot: Option<PathBuf>,
    /// Print JSON: {"connect_us_median", "results": [{"clients","p50_us","p90_us","p99_us","max_us",
    /// "requests_per_s","floor_p50_us","floor_p99_us","floor_requests_per_s"}, …]}.
    #[arg(long)]
    json: bool,
}

/// Options of the hidden worker process.
#[derive(Debug, Args)]
pub struct AttachWorkerArgs {
    #[arg(long)]
    key: String,
    #[arg(long)]
    floor: PathBuf,
    #[arg(long)]
    size: u64,
    #[arg(long)]
    seconds: f64,
}

/// One client count's figures.
#[derive(Clone, Debug)]
pub struct AttachResult {
    pub clients: usize,
    pub packd: Hist,
    pub floor: Hist,
    pub seconds: f64,
}

impl AttachResult {
    fn json(&self) -> Value {
        json!({
            "clients": self.clients,
            "p50_us": self.packd.quantile_us(0.5), "p90_us": self.packd.quantile_us(0.9),
            "p99_us": self.packd.quantile_us(0.99), "max_us": self.packd.quantile_us(1.0),
            "requests_per_s": self.packd.count() as f64 / self.seconds,
            "floor_p50_us": self.floor.quantile_us(0.5), "floor_p99_us": self.floor.quantile_us(0.99),
            "floor_requests_per_s": self.floor.count() as f64 / self.seconds,
        })
    }
}

/// The floor server: one thread per connection; each byte read is answered with one byte
/// and the memfd.
fn floor_server(listener: UnixListener, memfd: Arc<std::fs::File>) {
    for conn in listener.incoming() {
        let Ok(conn) = conn else { break };
        let memfd = Arc::clone(&memfd);
        std::thread::spawn(move || {
            let mut b = [0u8; 1];
            while matches!((&conn).read(&mut b), Ok(1)) {
                if sys::send_with_fds(conn.as_fd(), &b, &[memfd.as_fd()], false).is_err() {
                    break;
                }
            }
        });
    }
}

/// The worker: times packd get+map+release, then the floor, when told to on stdin.
pub fn worker(dir: &Path, args: AttachWorkerArgs) -> anyhow::Result<ExitCode> {
    let t = Instant::now();
    let client = Client::connect(dir)?;
    let floor = UnixStream::connect(&args.floor).context("floor socket")?;
    let connect_us = t.elapsed().as_secs_f64() * 1e6;
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready {connect_us}")?;
    out.flush()?;
    let mut lines = std::io::stdin().lock().lines();
    while let Some(Ok(phase)) = lines.next() {
        let mut h = Hist::default();
        let end = Instant::now() + Duration::from_secs_f64(args.seconds);
        match phase.as_str() {
            "packd" => {
                while Instant::now() < end {
                    let t = Instant::now();
                    let model = client.get(&args.key)?;
                    drop(model);
                    h.record(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX));
                }
            }
            "floor" => {
                let mut b = [0u8; 1];
                while Instant::now() < end {
                    let t = Instant::now();
                    sys::send_with_fds(floor.as_fd(), b"x", &[], false)?;
                    let got = sys::recv_with_fds(floor.as_fd(), &mut b, false)?;
                    let Some(fd) = got.fds.into_iter().next() else { bail!("the floor server sent no fd") };
                    let file = std::fs::File::from(fd);
                    let map = sys::map_sealed(&file, args.size, false)?;
                    drop(file);
                    drop(map);
                    h.record(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX));
                }
            }
            _ => break,
        }
        writeln!(out, "hist {}", h.encode())?;
        out.flush()?;
    }
    Ok(ExitCode::SUCCESS)
}

struct Worker {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Worker {
    fn line(&mut self) -> anyhow::Result<String> {
        let mut l = String::new();
        if self.stdout.read_line(&mut l)? == 0 {
            bail!("a worker exited early");
        }
        Ok(l.trim().to_string())
    }

    fn phase(&mut self, name: &str) -> anyhow::Result<()> {
        writeln!(self.stdin, "{name}")?;
        Ok(())
    }

    fn hist(&mut self) -> anyhow::Result<Hist> {
        let l = self.line()?;
        Hist::decode(l.strip_prefix("hist ").context("worker output")?)
    }
}

/// Runs `packctl bench attach`.
pub fn run(dir: &Path, args: AttachArgs) -> anyhow::Result<ExitCode> {
    if args.clients.is_empty() || args.clients.contains(&0) || args.seconds <= 0.0 {
        bail!("--clients needs counts ≥ 1 and --seconds must be positive");
    }
    let client = Client::connect(dir)?;
    let model = client.pack(&args.model, &Plan::with_layout(args.layout.clone()))?;
    let (key, size) = (model.key().to_string(), model.info().size);
    drop(model);

    let floor_dir = packd_testkit::scratch_dir("packctl-floor-", false)?;
    let floor_path = floor_dir.path().join("floor.sock");
    let listener = UnixListener::bind(&floor_path)?;
    let memfd = memfd::MemfdOptions::default().allow_sealing(true).close_on_exec(true).create("packd-floor")?;
    memfd.as_file().set_len(size)?;
    memfd.add_seals(&[
        memfd::FileSeal::SealShrink,
        memfd::FileSeal::SealGrow,
        memfd::FileSeal::SealWrite,
        memfd::FileSeal::SealSeal,
    ])?;
    let memfd = Arc::new(memfd.into_file());
    std::thread::spawn(move || floor_server(listener, memfd));

    let exe = std::env::current_exe()?;
    let mut results = Vec::new();
    let mut connects = Vec::new();
    for &n in &args.clients {
        let mut workers = (0..n)
            .map(|_| {
                let mut child = Command::new(&exe)
                    .arg("--socket-dir")
                    .arg(dir)
                    .args(["bench", "attach-worker", "--key", &key, "--size", &size.to_string()])
                    .arg("--floor")
                    .arg(&floor_path)
                    .args(["--seconds", &args.seconds.to_string()])
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .spawn()?;
                let stdin = child.stdin.take().context("stdin")?;
                let stdout = BufReader::new(child.stdout.take().context("stdout")?);
                Ok(Worker { child, stdin, stdout })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        for w in &mut workers {
            let l = w.line()?;
            connects.push(l.strip_prefix("ready ").context("worker ready")?.parse::<f64>()?);
        }
        let mut result =
            AttachResult { clients: n, packd: Hist::default(), floor: Hist::default(), seconds: args.seconds };
        for (phase, into) in [("packd", 0), ("floor", 1)] {
            for w in &mut workers {
                w.phase(phase)?;
            }
            for w in &mut workers {
                let h = w.hist()?;
                if into == 0 { result.packd.merge(&h) } else { result.floor.merge(&h) }
            }
        }
        for mut w in workers {
            drop(w.stdin);
            w.child.wait()?;
        }
        if !args.json {
            eprintln!("{n} client(s): done");
        }
        results.push(result);
    }
    let _ = std::fs::remove_dir_all(&floor_dir);
    connects.sort_by(f64::total_cmp);
    let connect_median = connects.get(connects.len() / 2).copied().unwrap_or(0.0);
    if let Some(plot_dir) = &args.plot {
        let clients: Vec<usize> = results.iter().map(|r| r.clients).collect();
        let line =
            |name, f: &dyn Fn(&AttachResult) -> f64| super::plot::Line { name, ys: results.iter().map(f).collect() };
        super::plot::attach(
            plot_dir,
            &clients,
            &[
                line("packd p50", &|r| r.packd.quantile_us(0.5)),
                line("packd p99", &|r| r.packd.quantile_us(0.99)),
                line("floor p50", &|r| r.floor.quantile_us(0.5)),
                line("floor p99", &|r| r.floor.quantile_us(0.99)),
            ],
        )?;
    }
    if args.json {
        let list: Vec<Value> = results.iter().map(AttachResult::json).collect();
        // The kernels that packed the model (null when the control socket is not there).
        let kernels = super::super::control::stats(dir).ok().map(|s| s.isa);
        println!(
            "{}",
            json!({"model": args.model, "segment_bytes": size, "kernels": kernels,
                   "connect_us_median": connect_median, "results": list})
        );
    } else {
        println!(
            "model {} ({size} bytes), {} s per count; connect (excluded) median {connect_median:.1} µs",
            args.model.display(),
            args.seconds
        );
        println!(
            "{:>7} {:>9} {:>9} {:>9} {:>9} {:>11} {:>11} {:>11} {:>11} {:>7} {:>7} {:>7}",
            "clients",
            "p50 µs",
            "p90 µs",
            "p99 µs",
            "max µs",
            "req/s",
            "floor p50",
            "floor p99",
            "floor req/s",
            "p50 ×",
            "p99 ×",
            "rps ×"
        );
        for r in &results {
            let j = r.json();
            let f = |k: &str| j[k].as_f64().unwrap_or(0.0);
            println!(
                "{:>7} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>11.0} {:>11.1} {:>11.1} {:>11.0} {:>7.2} {:>7.2} {:>7.2}",
                r.clients,
                f("p50_us"),
                f("p90_us"),
                f("p99_us"),
                f("max_us"),
                f("requests_per_s"),
                f("floor_p50_us"),
                f("floor_p99_us"),
                f("floor_requests_per_s"),
                f("p50_us") / f("floor_p50_us"),
                f("p99_us") / f("floor_p99_us"),
                f("requests_per_s") / f("floor_requests_per_s"),
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
