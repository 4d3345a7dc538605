//! Measuring the kernels: how fast each ISA packs each GEMM kind on this CPU.
//!
//! The widest ISA is not always the fastest: the packers are memory-bound and 512-bit
//! stores can lower the clock, so a daemon that has more than one SIMD ISA measures which
//! one packs each kind fastest. This crate is built as in release in every profile (the
//! workspace's `[profile.dev.package.packd-kernels]`), so a debug daemon measures the same
//! code a release daemon runs.

use std::time::Duration;

use crate::dtype::Dtype;
use crate::params::{GemmKind, GemmParams};
use crate::simd::{Isa, pack_matrix};

/// f32 source bytes each calibration run packs: larger than the last-level cache of the
/// CPUs packd runs on, so the figure is the memory-bound one a real pack sees.
pub const CALIBRATION_BYTES: usize = 32 << 20;
/// Runs per (kind, ISA); the best counts.
pub const CALIBRATION_RUNS: usize = 3;
/// Input channels of the calibration matrix.
const CALIBRATION_K: usize = 4096;

/// One measurement: `kind` packed with `isa` moved `gbps` GB/s of memory traffic (f32
/// source bytes read plus packed bytes written, per second).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Measurement {
    /// The GEMM kind.
    pub kind: GemmKind,
    /// The ISA.
    pub isa: Isa,
    /// Memory traffic, GB/s.
    pub gbps: f64,
}

/// `len` little-endian f32 values in ±[0.5, 1) from a xorshift seeded with `seed` (not 0):
/// varied, finite, no subnormals or NaNs. For speed measurements, not for bytes.
pub fn f32_source(len: usize, seed: u32) -> Vec<u8> {
    let mut x = seed;
    (0..len)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            f32::from_bits((x & 0x807F_FFFF) | 0x3F00_0000).to_le_bytes()
        })
        .collect()
}

/// Packs an f32 source of about `bytes` bytes into each GEMM kind with each of `isas`,
/// alternating the ISAs so all see the same machine; best of `runs`, each timed by
/// `clock` (the daemon passes the thread's CPU time, so time spent descheduled on a busy
/// host is not counted; memory stalls are). The destination is pre-faulted (page faults
/// would measure the kernel, not the ISA).
pub fn measure_table(isas: &[Isa], bytes: usize, runs: usize, clock: &dyn Fn() -> Duration) -> Vec<Measurement> {
    let k = CALIBRATION_K;
    let n = (bytes / (4 * k)).max(16);
    let src = f32_source(n * k, 0x2545_F491);
    let p = GemmParams::default();
    let mut table = Vec::new();
    for kind in GemmKind::ALL {
        let len = kind.block_len(p, k) * p.blocks(n);
        let mut dst = vec![0x11u8; len];
        let mut best = vec![f64::INFINITY; isas.len()];
        for _ in 0..runs {
            for (slot, &isa) in best.iter_mut().zip(isas) {
                let t = clock();
                pack_matrix(isa, kind, p, Dtype::F32, k, std::hint::black_box(&src), &mut dst);
                *slot = slot.min(clock().saturating_sub(t).as_secs_f64());
            }
        }
        let traffic = (src.len() + len) as f64;
        for (&isa, secs) in isas.iter().zip(best) {
            table.push(Measurement { kind, isa, gbps: traffic / secs.max(1e-9) / 1e9 });
        }
    }
    table
}
