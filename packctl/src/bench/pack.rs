//! `packctl bench pack`: the packing kernels against memcpy, in-process.

use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::Args;
use packd::pack::{GemmKind, GemmParams, Isa, KernelChoice, Layout};
use packd_testkit::pack_bench::{self as bench, BENCH_K, PackBench};
use serde_json::json;

/// Options of `bench pack`.
#[derive(Debug, Args)]
pub struct PackArgs {
    /// Layout to measure; repeatable. Default: f32-gemm, f16-gemm, bf16-gemm and qc8w-gemm
    /// with nr=16, kr=1, sr=1.
    #[arg(long = "layout", value_name = "SPEC")]
    layouts: Vec<String>,
    /// Size of the f32 source matrix in bytes ([N, 4096]).
    #[arg(long, value_name = "N", default_value_t = 64 << 20)]
    bytes: usize,
    /// ISA to measure; repeatable. Default: every ISA this CPU has. The scalar reference
    /// always runs as the baseline of the speed-ups.
    #[arg(long = "isa", value_name = "ISA")]
    isas: Vec<String>,
    /// Runs per measurement; the best is reported.
    #[arg(long, value_name = "R", default_value_t = 5)]
    runs: usize,
    /// Print a JSON list of {"layout","isa","bytes","gbps","memcpy_gbps","ratio_to_memcpy",
    /// "speedup_vs_scalar","cold_gbps","source_bytes","source_gbps","traffic_gbps",
    /// "traffic_ratio","read_gbps","source_vs_read","picked","picked_vs_best"}: `bytes`,
    /// `gbps` and `cold_gbps` count
    /// packed bytes written; `source_gbps` f32 source bytes read; `memcpy_gbps` bytes copied
    /// by a memcpy of the source's size; `traffic_gbps` bytes read + written, and
    /// `traffic_ratio` that over memcpy's traffic (1.0 = the memory's speed); `read_gbps` a
    /// read-only pass over the source and `source_vs_read` `source_gbps` over it (how close
    /// the kernel comes to one thread's read speed, its ceiling); `picked` marks
    /// the ISA packd uses for the layout's kind by default (measured as the daemon does),
    /// `picked_vs_best` (on the picked row only) its traffic over the best measured here.
    #[arg(long)]
    json: bool,
}

/// Runs `packctl bench pack`.
pub fn pack(args: PackArgs) -> anyhow::Result<ExitCode> {
    if args.bytes < 4 * BENCH_K || args.runs == 0 {
        bail!("--bytes must be at least {} and --runs at least 1", 4 * BENCH_K);
    }
    let layouts: Vec<Layout> = if args.layouts.is_empty() {
        GemmKind::ALL.into_iter().map(|k| Layout::Gemm(k, GemmParams::default())).collect()
    } else {
        args.layouts.iter().map(|s| s.parse::<Layout>()).collect::<Result<_, _>>()?
    };
    let isas: Vec<Isa> = if args.isas.is_empty() {
        Isa::available()
    } else {
        args.isas.iter().map(|s| Isa::parse(s).map_err(anyhow::Error::msg)).collect::<Result<_, _>>()?
    };
    // What the daemon would pick by default (no --isa): measured the same way.
    let choice = KernelChoice::auto();
    let results = bench::run(&layouts, &isas, args.bytes, args.runs).context("bench pack")?;
    let picked = |r: &PackBench| {
        let kind = match r.layout.parse::<Layout>() {
            Ok(Layout::Gemm(kind, _)) => kind,
            _ => return (false, f64::NAN),
        };
        let is = choice.kernels.for_kind(kind).to_string() == r.isa;
        let same = results.iter().filter(|o| o.layout == r.layout);
        let best = same.clone().map(|o| o.traffic_gbps).fold(0f64, f64::max);
        let mine = same.filter(|o| o.isa == choice.kernels.for_kind(kind).to_string()).map(|o| o.traffic_gbps).next();
        (is, mine.filter(|_| is).map_or(f64::NAN, |m| m / best))
    };
    if args.json {
        let list: Vec<_> = results
            .iter()
            .map(|r| {
                let (is, vs_best) = picked(r);
                json!({"layout": r.layout, "isa": r.isa, "bytes": r.bytes, "gbps": r.gbps, "memcpy_gbps": r.memcpy_gbps,
                       "ratio_to_memcpy": r.ratio_to_memcpy, "speedup_vs_scalar": r.speedup_vs_scalar, "cold_gbps": r.cold_gbps,
                       "source_bytes": r.source_bytes, "source_gbps": r.source_gbps,
                       "traffic_gbps": r.traffic_gbps, "traffic_ratio": r.traffic_ratio,
                       "read_gbps": r.read_gbps, "source_vs_read": r.source_vs_read, "picked": is, "picked_vs_best": vs_best})
            })
            .collect();
        println!("{}", serde_json::Value::Array(list));
    } else {
        println!(
            "f32 source {} bytes ([{}, {BENCH_K}]), single thread, best of {} runs",
            args.bytes,
            args.bytes / (4 * BENCH_K),
            args.runs
        );
        println!(
            "traffic = source bytes read + packed bytes written, per second; floor = memcpy of the source \
             (read + written), alternating with the kernel; 1.00 is the memory's speed; ÷read = source \
             bytes read per second over a read-only pass's (one thread's ceiling)"
        );
        println!("packd picks by default: {choice} ({})", choice.reason());
        println!(
            "{:<26} {:<7} {:>12} {:>9} {:>8} {:>8} {:>6} {:>8} {:>10}  picked",
            "layout", "isa", "packed", "traffic", "floor", "ratio", "÷read", "×scalar", "cold GB/s"
        );
        for r in &results {
            let (is, vs_best) = picked(r);
            println!(
                "{:<26} {:<7} {:>12} {:>9.2} {:>8.2} {:>8.2} {:>6.2} {:>8.1} {:>10.2}  {}",
                r.layout,
                r.isa,
                r.bytes,
                r.traffic_gbps,
                2.0 * r.memcpy_gbps,
                r.traffic_ratio,
                r.source_vs_read,
                r.speedup_vs_scalar,
                r.cold_gbps,
                if is { format!("yes ({:.2} of the best)", vs_best) } else { String::new() }
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
