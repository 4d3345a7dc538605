//! `packctl`: command-line client of packd.
//!
//! Data-plane commands (`pack`, `map`, `cat`) use the blocking client library; `stats`
//! speaks gRPC to the control plane.

mod bench;
mod control;
mod frame;
mod output;
mod progress;
mod stats;
mod top;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::{Args, Parser, Subcommand};
use packd_client::{Client, Model, Plan, default_socket_dir};
use serde_json::json;

use output::emit;

/// packctl — pack models with packd, map them, inspect the daemon.
///
/// Socket directory: --socket-dir, else $PACKD_SOCKET_DIR, else /run/packd or
/// $XDG_RUNTIME_DIR/packd (whichever holds a running daemon's socket).
#[derive(Debug, Parser)]
#[command(name = "packctl", version, about, long_about)]
struct Cli {
    /// Directory holding packd.sock and control.sock.
    #[arg(long, global = true, value_name = "DIR")]
    socket_dir: Option<PathBuf>,
    /// Seconds a control-plane command (stats, ls, clients, models, evict, pin, budget,
    /// prefetch, health; each refresh of top) waits for the daemon before giving up; `packctl prefetch` waits for its pack
    /// job, so give a large model more. pack, map and cat use the client library's deadlines
    /// instead: 30 seconds of silence (a running pack reports progress every second).
    #[arg(long, global = true, value_name = "SECS", default_value_t = 10.0)]
    timeout: f64,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Pack a safetensors model (or find it already packed) and print its entry table.
    Pack {
        /// The safetensors file; packctl opens it and passes the open fd.
        file: PathBuf,
        #[command(flatten)]
        plan: PlanArgs,
        /// Print JSON: {"key","size","entries":[{"name","key","layout","bytes","blake3"},…],"ms",
        /// "outcome"} (`size`: the segment's size, the memfd's length; `bytes`: an entry's
        /// payload; `outcome`: packed; found (packed by this run of the daemon);
        /// found_in_cache_dir or found_in_fd_store (packed by an earlier run, adopted at its
        /// start); or joined, when another request's pack job was running).
        #[arg(long)]
        json: bool,
        /// Print sizes in bytes instead of KiB/MiB/GiB.
        #[arg(long)]
        bytes: bool,
    },
    /// Pack (or find) a model and map it read-only, as an inference worker would.
    Map {
        /// The safetensors file.
        file: PathBuf,
        #[command(flatten)]
        plan: PlanArgs,
        /// Read every page of the mapping (so it counts as resident in this process).
        #[arg(long)]
        touch: bool,
        /// Check each entry's BLAKE3 after mapping and again after --hold; exit 1 on mismatch.
        #[arg(long)]
        verify: bool,
        /// Keep the mapping (and its lease) for SECS seconds before exiting. If the daemon
        /// goes away meanwhile, the mapping keeps working, packctl reconnects when the daemon
        /// is back and leases the model again; a lost daemon is then only a warning.
        #[arg(long, value_name = "SECS", default_value_t = 0.0, conflicts_with = "hold_stdin")]
        hold: f64,
        /// Keep the mapping (and its lease) until standard input closes (end of file: Ctrl-D,
        /// or the end of a pipe), instead of for a time: a script or test releases it exactly
        /// when it is done. Daemon restarts are met as with --hold.
        #[arg(long)]
        hold_stdin: bool,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Write the packed bytes of one entry to stdout.
    Cat {
        /// The safetensors file.
        file: PathBuf,
        /// Tensor name as in the source file.
        #[arg(long, value_name = "NAME")]
        tensor: String,
        #[command(flatten)]
        plan: PlanArgs,
    },
    /// Benchmarks that compare against a baseline measured in the same run.
    #[command(subcommand)]
    Bench(bench::Bench),
    /// A live view of what the host shares: totals (resident, mapped by workers, saved),
    /// models by bytes, and every worker with how it got its weights — served, built, or
    /// private with the reason it reported. Refreshes every --interval; `s` changes the
    /// models' sort order (resident, saved, workers, hits), `q` quits. Needs a terminal.
    Top {
        /// Seconds between refreshes.
        #[arg(long, default_value_t = 1.0, value_name = "SECONDS")]
        interval: f64,
    },
    /// Control-plane commands (gRPC on control.sock).
    #[command(flatten)]
    Control(control::ControlCmd),
    /// Data-plane frames as hex, for scripts that speak the protocol by hand.
    #[command(subcommand, hide = true)]
    Frame(frame::FrameCmd),
}

/// Which layout each tensor gets.
#[derive(Debug, Args)]
struct PlanArgs {
    /// Layout of 2-D float X.weight tensors (the default GEMM rule), e.g.
    /// "f32-gemm:nr=16,kr=1,sr=1" (the default) or "identity" (pack nothing, share as is).
    #[arg(long, value_name = "SPEC")]
    layout: Option<String>,
    /// A GLOB=LAYOUT rule tried before the defaults; repeatable, first match wins,
    /// e.g. --rule '*.attention.*.weight=identity'.
    #[arg(long = "rule", value_name = "GLOB=LAYOUT")]
    rules: Vec<String>,
}

impl PlanArgs {
    fn plan(&self) -> Plan {
        Plan { rules: self.rules.clone(), layout: self.layout.clone().unwrap_or_default() }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let dir = cli.socket_dir.clone().unwrap_or_else(default_socket_dir);
    match run(cli.command, dir, cli.timeout) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("packctl: {}", report(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes, each cause said once: libraries often repeat their cause's
/// text in their own message (an OS error would otherwise print two or three times).
fn report(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let said = cause.to_string();
        if !text.contains(&said) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&said);
        }
    }
    text
}

fn connect(dir: &std::path::Path) -> anyhow::Result<Client> {
    Ok(Client::connect(dir)?)
}

fn run(command: Command, dir: PathBuf, timeout: f64) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(timeout.is_finite() && timeout > 0.0, "--timeout {timeout} must be a positive number of seconds");
    match command {
        Command::Pack { file, plan, json, bytes } => {
            let started = Instant::now();
            let model = pack(&connect(&dir)?, &file, &plan.plan())?;
            let ms = started.elapsed().as_secs_f64() * 1e3;
            if json {
                print_table(&model, true, Some(ms), true);
            } else {
                emit(&format!("{}: {}\n", file.display(), outcome_line(model.info().outcome(), ms)));
                print_table(&model, false, None, bytes);
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Map { file, plan, touch, verify, hold, hold_stdin, json } => {
            if !(0.0..=1e9).contains(&hold) {
                anyhow::bail!("--hold {hold}: seconds from 0 to 1e9");
            }
            let hold = if hold_stdin { Hold::UntilStdinCloses } else { Hold::For(hold) };
            map(&dir, &file, &plan.plan(), touch, verify, hold, json)
        }
        Command::Cat { file, tensor, plan } => {
            if std::io::IsTerminal::is_terminal(&std::io::stdout()) {
                bail!("packctl cat writes the tensor's raw bytes: send them to a file or a pipe (… > q.bin, … | xxd)");
            }
            let model = pack(&connect(&dir)?, &file, &plan.plan())?;
            let Some(t) = model.tensor(&tensor) else {
                if let Some(owner) = model.tensors().find(|t| t.bias() == Some(tensor.as_str())) {
                    bail!("tensor {tensor} is folded into the entry of {} ({})", owner.name(), owner.layout());
                }
                bail!("no tensor {tensor} in {}", file.display());
            };
            let mut out = std::io::stdout().lock();
            match out.write_all(t.bytes()).and_then(|()| out.flush()) {
                // A reader that took what it wanted (`packctl cat … | head -c 64`).
                Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
                _ => Ok(ExitCode::SUCCESS),
            }
        }
        Command::Control(cmd) => control::run(&dir, cmd, Duration::from_secs_f64(timeout)),
        Command::Top { interval } => {
            if !(interval.is_finite() && (0.1..=3600.0).contains(&interval)) {
                bail!("--interval {interval}: give between 0.1 and 3600 seconds");
            }
            top::run(&dir, Duration::from_secs_f64(interval), Duration::from_secs_f64(timeout))
                .map(|()| ExitCode::SUCCESS)
        }
        Command::Bench(b) => bench::run(&dir, b),
        Command::Frame(f) => frame::run(f).map(|()| ExitCode::SUCCESS),
    }
}

/// Packs `file` (or finds it packed) and maps it, showing the pack's progress on stderr
/// when it takes more than a moment.
fn pack(client: &Client, file: &std::path::Path, plan: &Plan) -> Result<Model, packd_client::Error> {
    let (open, label) = packd_client::open_source(file)?;
    let reporter = progress::Reporter::new(&label);
    let packed = client.pack_with_progress(&open, plan, &label, &|p| reporter.report(p));
    reporter.finish();
    packed?.map()
}

/// What the daemon did for a pack request, in words, and how long the call took.
fn outcome_line(how: packd_client::proto::PackOutcome, ms: f64) -> String {
    use packd_client::proto::PackOutcome;
    let done = match how {
        PackOutcome::Packed => "packed",
        PackOutcome::Found => "found packed",
        PackOutcome::FoundInCacheDir | PackOutcome::FoundInFdStore => {
            let place = if how == PackOutcome::FoundInCacheDir {
                "the cache directory"
            } else {
                "the service manager's fd store"
            };
            return format!("found packed in {place}, by an earlier run of packd ({ms:.1} ms)");
        }
        PackOutcome::Joined => "packed by a request already running",
        PackOutcome::Unspecified => "ready",
    };
    format!("{done} in {ms:.1} ms")
}

/// The entry table; `ms` (JSON only): how long the call took.
fn print_table(model: &Model, json: bool, ms: Option<f64>, exact: bool) {
    let size = |n: u64| if exact { format!("{n} bytes") } else { packd_proto::units::format_size(n) };
    if json {
        let entries: Vec<_> = model
            .tensors()
            .map(|t| {
                json!({"name": t.name(), "key": t.key(), "layout": t.layout(), "dtype": t.dtype(),
                       "shape": t.shape(), "bytes": t.bytes().len(), "blake3": t.entry().blake3,
                       "offset": t.entry().offset, "bias": t.bias()})
            })
            .collect();
        let mut doc = json!({"key": model.key(), "size": model.info().size, "source_blake3": model.info().source_blake3,
                         "plan": model.info().plan, "entries": entries});
        if let (Some(ms), Some(d)) = (ms, doc.as_object_mut()) {
            d.insert("ms".into(), json!(ms));
            let how = match model.info().outcome() {
                packd_client::proto::PackOutcome::Packed => "packed",
                packd_client::proto::PackOutcome::Found => "found",
                packd_client::proto::PackOutcome::FoundInCacheDir => "found_in_cache_dir",
                packd_client::proto::PackOutcome::FoundInFdStore => "found_in_fd_store",
                packd_client::proto::PackOutcome::Joined => "joined",
                packd_client::proto::PackOutcome::Unspecified => "unknown",
            };
            d.insert("outcome".into(), json!(how));
        }
        emit(&format!("{doc}\n"));
        return;
    }
    let mut text = format!("segment {}  (size {}, plan {})\n", model.key(), size(model.info().size), model.info().plan);
    for t in model.tensors() {
        let bias = t.bias().map(|b| format!(" +bias {b}")).unwrap_or_default();
        let shape = format!("{:?}", t.shape());
        text.push_str(&format!(
            "  {:<56} {:<26} {:>5} {:<14} {:>14}{bias}\n",
            t.name(),
            t.layout(),
            t.dtype(),
            shape,
            size(t.bytes().len() as u64)
        ));
    }
    emit(&text);
}

/// How long `packctl map` keeps its mapping.
#[derive(Clone, Copy)]
enum Hold {
    /// Seconds (0: not at all).
    For(f64),
    /// Until standard input reaches its end.
    UntilStdinCloses,
}

impl Hold {
    fn holds(self) -> bool {
        matches!(self, Hold::UntilStdinCloses) || matches!(self, Hold::For(s) if s > 0.0)
    }

    /// How the hold ended, for the output line.
    fn said(self) -> String {
        match self {
            Hold::For(s) => format!("held {s} s"),
            Hold::UntilStdinCloses => "held until stdin closed".to_string(),
        }
    }
}

/// Holds as `hold` says, checking the connection every 100 ms: a daemon that goes away is
/// reported on stderr (the mapping keeps working) and its return is met by reconnecting,
/// which leases the model again.
fn hold_through_restarts(client: &Client, hold: Hold) {
    // The channel is disconnected when standard input ends (the reader thread drops its end).
    let (tx, ended) = std::sync::mpsc::channel::<()>();
    let end = match hold {
        Hold::For(secs) => Some(Instant::now() + Duration::from_secs_f64(secs.max(0.0))),
        Hold::UntilStdinCloses => {
            let tx = tx.clone();
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
                drop(tx);
            });
            None
        }
    };
    drop(tx);
    let mut lost = false;
    loop {
        let now = Instant::now();
        if end.is_some_and(|e| now >= e) {
            break;
        }
        let wait = end.map_or(Duration::from_millis(100), |e| (e - now).min(Duration::from_millis(100)));
        if end.is_none() && ended.recv_timeout(wait) == Err(std::sync::mpsc::RecvTimeoutError::Disconnected) {
            break;
        }
        if end.is_some() {
            std::thread::sleep(wait);
        }
        match client.reconnect_if_lost() {
            Ok(true) => {
                // Under socket activation the socket never refuses: the loss is found and
                // mended in one step, and said in two lines as anywhere else.
                if !lost {
                    eprintln!("packctl: warning: the connection to packd was lost (the mapping kept working)");
                }
                eprintln!("packctl: reconnected to packd; {} lease(s) held again", client.live_leases());
                lost = false;
            }
            Ok(false) => {}
            Err(e) if !lost => {
                eprintln!("packctl: warning: {e}");
                lost = true;
            }
            Err(_) => {}
        }
    }
}

fn map(
    dir: &std::path::Path,
    file: &std::path::Path,
    plan: &Plan,
    touch: bool,
    verify: bool,
    hold: Hold,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let started = Instant::now();
    let client = connect(dir)?;
    let model = pack(&client, file, plan)?;
    let ready = started.elapsed();
    let mut sum = 0u64;
    if touch {
        for page in model.bytes().chunks(4096) {
            sum = sum.wrapping_add(u64::from(page[0]));
        }
        std::hint::black_box(sum);
    }
    let first = if verify { Some(model.verify()) } else { None };
    let report = |stage: &str, check: &Option<Result<(), packd_client::Error>>| {
        let verified = check.as_ref().map(Result::is_ok);
        if json {
            emit(&format!(
                "{}\n",
                json!({"stage": stage, "key": model.key(), "bytes": model.info().size, "entries": model.info().entries.len(),
                       "ready_us": ready.as_secs_f64() * 1e6, "touched": touch, "verified": verified, "pid": std::process::id()})
            ));
        } else {
            let v = match check {
                None => String::new(),
                Some(Ok(())) => ", verified".into(),
                Some(Err(e)) => format!(", VERIFY FAILED: {e}"),
            };
            emit(&format!(
                "{stage}: {} ({} entries, {}) in {:.3} ms{v}\n",
                model.key(),
                model.info().entries.len(),
                packd_proto::units::format_size(model.info().size),
                ready.as_secs_f64() * 1e3
            ));
        }
    };
    report("mapped", &first);
    let mut ok = first.as_ref().is_none_or(Result::is_ok);
    if hold.holds() {
        hold_through_restarts(&client, hold);
        let held = hold.said();
        if verify {
            let second = model.verify();
            ok &= second.is_ok();
            if json {
                report("held", &Some(second));
            } else {
                emit(&match second {
                    Ok(()) => format!("{held}, verified again\n"),
                    Err(e) => format!("{held}, VERIFY FAILED: {e}\n"),
                });
            }
        } else if !json {
            emit(&format!("{held}\n"));
        }
    }
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
