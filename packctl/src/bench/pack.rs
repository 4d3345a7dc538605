//! `packctl bench pack`: the packing kernels against memcpy, in-process.

use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::Args;
use packd::pack::{GemmKind, GemmParams, Isa, Layout};
use packd_testkit::pack_bench::{self as bench, BENCH_K};
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
    /// "speedup_vs_scalar","cold_gbps","source_bytes","source_gbps"}: `bytes` and the GB/s
    /// figures count packed bytes written; `source_gbps` counts f32 source bytes read.
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
    let results = bench::run(&layouts, &isas, args.bytes, args.runs).context("bench pack")?;
    if args.json {
        let list: Vec<_> = results
            .iter()
            .map(|r| {
                json!({"layout": r.layout, "isa": r.isa, "bytes": r.bytes, "gbps": r.gbps, "memcpy_gbps": r.memcpy_gbps,
                       "ratio_to_memcpy": r.ratio_to_memcpy, "speedup_vs_scalar": r.speedup_vs_scalar, "cold_gbps": r.cold_gbps,
                       "source_bytes": r.source_bytes, "source_gbps": r.source_gbps})
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
            "GB/s counts packed bytes written; memcpy copies the same number of bytes, alternating with the kernel"
        );
        println!(
            "{:<28} {:<8} {:>12} {:>8} {:>10} {:>8} {:>9} {:>9} {:>10}",
            "layout", "isa", "bytes", "GB/s", "memcpy", "ratio", "×scalar", "cold GB/s", "src GB/s"
        );
        for r in &results {
            println!(
                "{:<28} {:<8} {:>12} {:>8.2} {:>10.2} {:>8.2} {:>9.1} {:>9.2} {:>10.2}",
                r.layout,
                r.isa,
                r.bytes,
                r.gbps,
                r.memcpy_gbps,
                r.ratio_to_memcpy,
                r.speedup_vs_scalar,
                r.cold_gbps,
                r.source_gbps
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
