//! `packctl bench pack`: packing throughput of each layout on each ISA, against memcpy of
//! the same size measured in the same run (these machines are noisy; ratios are what to
//! compare).
//!
//! Single-threaded. The source is an f32 `[N, K]` matrix (K = 4096) of `bytes` bytes.
//! *Warm*: the destination is pre-faulted memory; best of several runs. *Cold*: a fresh
//! memfd each run, sized and mapped the way a pack job does, page faults included.

use std::time::Instant;

use packd::pack::kernels::{Isa, pack_matrix};
use packd::pack::{IsaKind, Layout};
use packd::source::Dtype;
use packd::sys::memfd::{self, FillMap, MemfdError};

/// Why the benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum PackBenchError {
    /// A layout that is not a GEMM layout.
    #[error("{0} is not a GEMM layout; bench pack measures GEMM packing")]
    NotGemm(Layout),
    /// The packed size does not fit this machine's address space.
    #[error("the packed size of {0} overflows")]
    TooLarge(Layout),
    /// A fresh memfd for a cold run could not be made.
    #[error("cold run of {layout} on {isa}: {source}")]
    Cold {
        /// The layout.
        layout: Layout,
        /// The ISA.
        isa: Isa,
        /// The memfd's error.
        #[source]
        source: MemfdError,
    },
}

/// One measured (layout, ISA) pair.
#[derive(Clone, Debug)]
pub struct PackBench {
    /// Canonical layout spec.
    pub layout: String,
    /// ISA name.
    pub isa: String,
    /// Packed bytes written per run.
    pub bytes: u64,
    /// Warm packing throughput, packed bytes per second / 1e9.
    pub gbps: f64,
    /// memcpy of `source_bytes` bytes (bytes copied per second / 1e9), same run.
    pub memcpy_gbps: f64,
    /// `gbps / memcpy_gbps`.
    pub ratio_to_memcpy: f64,
    /// `gbps` / the scalar reference's `gbps` for the same layout.
    pub speedup_vs_scalar: f64,
    /// Throughput into a fresh memfd, page faults included.
    pub cold_gbps: f64,
    /// Source bytes read per run.
    pub source_bytes: u64,
    /// Warm throughput counted in source bytes consumed, GB/s.
    pub source_gbps: f64,
    /// Memory traffic of the warm run: (source bytes read + packed bytes written) per
    /// second / 1e9.
    pub traffic_gbps: f64,
    /// `traffic_gbps` / memcpy's traffic (2 × `memcpy_gbps`: it reads and writes every byte):
    /// 1.0 is the memory's speed, for every layout.
    pub traffic_ratio: f64,
    /// A read-only pass over the source (bytes read per second / 1e9), same run: how fast
    /// one thread can read, the ceiling of `source_gbps`.
    pub read_gbps: f64,
    /// `source_gbps / read_gbps`: the share of one thread's read speed the kernel reaches.
    pub source_vs_read: f64,
}

/// One read-only pass over `bytes` (an xor of every 8-byte word).
fn read_pass(bytes: &[u8]) -> u64 {
    std::hint::black_box(bytes)
        .chunks_exact(8)
        .map(|w| u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]))
        .fold(0, |a, b| a ^ b)
}

/// Input channels of the benchmark matrix.
pub const BENCH_K: usize = 4096;

fn best_of(runs: usize, mut f: impl FnMut()) -> f64 {
    (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// Runs the benchmark for `layouts` on `isas` with a source of about `bytes` bytes.
pub fn run(layouts: &[Layout], isas: &[Isa], bytes: usize, runs: usize) -> Result<Vec<PackBench>, PackBenchError> {
    let n = (bytes / (4 * BENCH_K)).max(1);
    let k = BENCH_K;
    // Deterministic, varied values (no NaNs: this measures speed, the tests measure bytes).
    let src = packd::pack::measure::f32_source(n * k, 0x9E37_79B9);
    let mut results = Vec::new();
    for &layout in layouts {
        let Layout::Gemm(kind, p) = layout else {
            return Err(PackBenchError::NotGemm(layout));
        };
        let len =
            layout.packed_len(n, k, 0).and_then(|l| usize::try_from(l).ok()).ok_or(PackBenchError::TooLarge(layout))?;
        // Destinations start on a cache line, like entries in a segment.
        let mut dst_buf = vec![0u8; len + 64];
        let skip = dst_buf.as_ptr().align_offset(64);
        let dst = &mut dst_buf[skip..skip + len];
        // memcpy moves the source's size (read + written): the traffic floor.
        let copy_from = vec![1u8; src.len()];
        let mut copy_to = vec![0u8; src.len()];
        let mut scalar_gbps = None;
        // The scalar reference always runs first: it is the baseline of the speed-ups.
        let mut order: Vec<Isa> = vec![Isa::scalar()];
        order.extend(isas.iter().copied().filter(|i| i.kind() != IsaKind::Scalar));
        for isa in order {
            // memcpy and the kernel alternate, so both see the same machine; best of each.
            let (mut memcpy, mut read, mut warm) = (f64::INFINITY, f64::INFINITY, f64::INFINITY);
            for _ in 0..runs {
                memcpy = memcpy.min(best_of(1, || copy_to.copy_from_slice(std::hint::black_box(&copy_from))));
                read = read.min(best_of(1, || {
                    std::hint::black_box(read_pass(&src));
                }));
                warm = warm.min(best_of(1, || pack_matrix(isa, kind, p, Dtype::F32, k, &src, dst)));
            }
            let memcpy_gbps = src.len() as f64 / memcpy / 1e9;
            let gbps = len as f64 / warm / 1e9;
            let mut failure: Option<MemfdError> = None;
            let cold = best_of(runs.min(3), || {
                let filled = memfd::create("packd-bench").and_then(|file| {
                    let mut map = FillMap::new(&file, len as u64, false)?;
                    pack_matrix(isa, kind, p, Dtype::F32, k, &src, map.bytes_mut());
                    Ok(())
                });
                if let Err(e) = filled {
                    failure = Some(e);
                }
            });
            if let Some(source) = failure {
                return Err(PackBenchError::Cold { layout, isa, source });
            }
            if isa.kind() == IsaKind::Scalar {
                scalar_gbps = Some(gbps);
            }
            results.push(PackBench {
                layout: layout.to_string(),
                isa: isa.to_string(),
                bytes: len as u64,
                gbps,
                memcpy_gbps,
                ratio_to_memcpy: gbps / memcpy_gbps,
                speedup_vs_scalar: scalar_gbps.map_or(f64::NAN, |s| gbps / s),
                cold_gbps: len as f64 / cold / 1e9,
                source_bytes: src.len() as u64,
                source_gbps: src.len() as f64 / warm / 1e9,
                traffic_gbps: (src.len() + len) as f64 / warm / 1e9,
                traffic_ratio: (src.len() + len) as f64 / warm / (2.0 * memcpy_gbps * 1e9),
                read_gbps: src.len() as f64 / read / 1e9,
                source_vs_read: read / warm,
            });
        }
    }
    Ok(results)
}

/// The floor of a first pack's memory work: a fresh memfd of `bytes` bytes, its pages
/// allocated and mapped on every core the way a pack job does, then every byte written once
/// (on every core). Returns how long that took.
pub fn fresh_shared_memory(bytes: u64, huge_pages: bool) -> Result<std::time::Duration, MemfdError> {
    let file = memfd::create("packd-bench-floor")?;
    let started = Instant::now();
    let mut map = FillMap::new(&file, bytes, huge_pages)?;
    let dest = map.bytes_mut();
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    let part = dest.len().div_ceil(threads).max(1);
    std::thread::scope(|s| {
        for chunk in dest.chunks_mut(part) {
            s.spawn(move || chunk.fill(0x5a));
        }
    });
    Ok(started.elapsed())
}
