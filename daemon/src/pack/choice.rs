//! Which kernel family packs each GEMM kind on this CPU.
//!
//! The widest ISA is not always the fastest: on some CPUs AVX-512 packs f32 and f16 slower
//! than AVX2 (the packers are memory-bound and 512-bit stores can lower the clock). So,
//! unless `--isa` forces one, packd **measures**: each SIMD ISA the CPU has packs the same
//! f32 source (`CALIBRATION_BYTES`, larger than the caches) into each GEMM kind with the
//! default parameters (nr=16, kr=1, sr=1), alternating, best of `CALIBRATION_RUNS`, and the
//! fastest wins for that kind. A CPU with a single SIMD ISA needs no measurement (the
//! scalar reference is never a candidate next to SIMD: it is several times slower
//! everywhere). The result is kept in the cache directory with the CPU's identity and
//! packd's version (`persist::kernels`), so a restart on the same CPU measures nothing.

use std::fmt;
use std::time::{Duration, Instant};

use super::gemm::src_size;
use super::kernels::{Isa, IsaKind, pack_matrix};
use super::layout::{GemmKind, GemmParams};
use crate::source::Dtype;

/// f32 source bytes each calibration run packs: larger than the last-level cache of the
/// CPUs packd runs on, so the figure is the memory-bound one a real pack sees.
pub const CALIBRATION_BYTES: usize = 32 << 20;
/// Runs per (kind, ISA); the best counts.
pub const CALIBRATION_RUNS: usize = 3;
/// Input channels of the calibration matrix.
const CALIBRATION_K: usize = 4096;

/// The ISA each GEMM kind packs with (indexed like [`GemmKind::ALL`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kernels([Isa; 4]);

impl Kernels {
    /// One ISA for every kind.
    pub fn all(isa: Isa) -> Self {
        Kernels([isa; 4])
    }

    /// The ISA that packs `kind`.
    pub fn for_kind(self, kind: GemmKind) -> Isa {
        self.0[kind_index(kind)]
    }

    /// The ISA of every kind, in [`GemmKind::ALL`] order.
    pub fn each(self) -> impl Iterator<Item = (GemmKind, Isa)> {
        GemmKind::ALL.into_iter().zip(self.0)
    }
}

fn kind_index(kind: GemmKind) -> usize {
    GemmKind::ALL.iter().position(|k| *k == kind).unwrap_or(0)
}

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

/// How the kernels were chosen.
#[derive(Clone, Debug, PartialEq)]
pub enum How {
    /// `--isa` (or the config file's `isa`) named one.
    Forced,
    /// The CPU has one SIMD ISA (or none): nothing to measure.
    Only,
    /// Measured at this start, taking `took`.
    Measured {
        /// Every (kind, ISA) measured.
        table: Vec<Measurement>,
        /// How long the measurement took.
        took: Duration,
    },
    /// Measured at an earlier start on this CPU and read back.
    Cached {
        /// The measurements read back.
        table: Vec<Measurement>,
    },
}

/// The kernels pack jobs use and why.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelChoice {
    /// The ISA of each kind.
    pub kernels: Kernels,
    /// Why.
    pub how: How,
}

impl KernelChoice {
    /// `isa` for every kind, as `--isa` asks.
    pub fn forced(isa: Isa) -> Self {
        KernelChoice { kernels: Kernels::all(isa), how: How::Forced }
    }

    /// The ISAs a measurement compares: every SIMD ISA this CPU has, or the scalar
    /// reference alone when it has none.
    pub fn candidates() -> Vec<Isa> {
        let simd: Vec<Isa> = Isa::available().into_iter().filter(|i| i.kind() != IsaKind::Scalar).collect();
        if simd.is_empty() { vec![Isa::scalar()] } else { simd }
    }

    /// The choice when there is nothing to compare: the single candidate. `None` when
    /// the CPU has several SIMD ISAs (then measure, or read a cached measurement).
    pub fn without_measuring() -> Option<Self> {
        match Self::candidates().as_slice() {
            [only] => Some(KernelChoice { kernels: Kernels::all(*only), how: How::Only }),
            _ => None,
        }
    }

    /// What `isa = auto` picks on this CPU, without a kept measurement: the single
    /// candidate, or a new measurement (blocking, about a second).
    pub fn auto() -> Self {
        Self::without_measuring().unwrap_or_else(|| Self::measure(&Self::candidates()))
    }

    /// The fastest ISA of each kind in `table` (a kind the table does not name gets the
    /// best ISA the CPU has). Ties go to the ISA measured first.
    pub fn from_table(table: Vec<Measurement>, cached: bool) -> Self {
        let mut kernels = Kernels::all(Isa::best());
        for kind in GemmKind::ALL {
            let best =
                table.iter().filter(|m| m.kind == kind && m.gbps.is_finite()).fold(None::<&Measurement>, |best, m| {
                    match best {
                        Some(b) if b.gbps >= m.gbps => Some(b),
                        _ => Some(m),
                    }
                });
            if let Some(m) = best {
                kernels.0[kind_index(kind)] = m.isa;
            }
        }
        let how = if cached { How::Cached { table } } else { How::Measured { table, took: Duration::ZERO } };
        KernelChoice { kernels, how }
    }

    /// Measures `candidates` on every GEMM kind and picks the fastest of each. Blocking:
    /// allocates about `2 · CALIBRATION_BYTES` and packs for roughly a tenth of a second
    /// per candidate.
    pub fn measure(candidates: &[Isa]) -> Self {
        let started = Instant::now();
        let table = measure_table(candidates, CALIBRATION_BYTES, CALIBRATION_RUNS);
        let mut choice = Self::from_table(table, false);
        if let How::Measured { took, .. } = &mut choice.how {
            *took = started.elapsed();
        }
        choice
    }

    /// The measurements behind the choice, if any.
    pub fn table(&self) -> &[Measurement] {
        match &self.how {
            How::Measured { table, .. } | How::Cached { table } => table,
            How::Forced | How::Only => &[],
        }
    }

    /// Why these kernels, in a few words (`packctl stats`, `--check-config`, the log).
    pub fn reason(&self) -> String {
        match &self.how {
            How::Forced => "forced by the isa setting".to_string(),
            How::Only if self.kernels.for_kind(GemmKind::F32).kind() == IsaKind::Scalar => {
                "this CPU has no SIMD ISA packd has kernels for".to_string()
            }
            How::Only => "the only SIMD ISA this CPU has; nothing to measure".to_string(),
            How::Measured { took, .. } => {
                format!("fastest measured at start-up ({} ms): {}", took.as_millis(), self.figures())
            }
            How::Cached { .. } => format!("fastest measured on this CPU at an earlier start: {}", self.figures()),
        }
    }

    /// `f32-gemm avx2 9.8 vs avx512 7.7 GB/s, …`.
    fn figures(&self) -> String {
        GemmKind::ALL
            .iter()
            .map(|&kind| {
                let picked = self.kernels.for_kind(kind);
                let mine = self.table().iter().filter(|m| m.kind == kind);
                let mut parts: Vec<String> = Vec::new();
                for m in mine.clone().filter(|m| m.isa == picked).chain(mine.filter(|m| m.isa != picked)) {
                    parts.push(format!("{} {:.1}", m.isa, m.gbps));
                }
                format!("{} {} GB/s", kind.name(), parts.join(" vs "))
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl fmt::Display for KernelChoice {
    /// `avx2` when every kind uses one ISA, else `f32-gemm=avx2 f16-gemm=avx512 …`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let first = self.kernels.for_kind(GemmKind::F32);
        if self.kernels.each().all(|(_, i)| i == first) {
            return write!(f, "{first}");
        }
        let parts: Vec<String> = self.kernels.each().map(|(k, i)| format!("{}={i}", k.name())).collect();
        f.write_str(&parts.join(" "))
    }
}

/// Packs an f32 source of about `bytes` bytes into each GEMM kind with each of `isas`,
/// alternating the ISAs so all see the same machine; best of `runs`. The destination is
/// pre-faulted (page faults would measure the kernel, not the ISA).
pub fn measure_table(isas: &[Isa], bytes: usize, runs: usize) -> Vec<Measurement> {
    let k = CALIBRATION_K;
    let n = (bytes / (4 * k)).max(16);
    let mut x = 0x2545_F491u32;
    // Varied finite values in ±[0.5, 1): no subnormals or NaNs (speed, not bytes).
    let src: Vec<u8> = (0..n * k)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            f32::from_bits((x & 0x807F_FFFF) | 0x3F00_0000).to_le_bytes()
        })
        .collect();
    let p = GemmParams::default();
    let mut table = Vec::new();
    for kind in GemmKind::ALL {
        let len = kind.block_len(p, k) * p.blocks(n);
        let mut dst = vec![0x11u8; len];
        let mut best = vec![f64::INFINITY; isas.len()];
        for _ in 0..runs {
            for (slot, &isa) in best.iter_mut().zip(isas) {
                let t = Instant::now();
                pack_matrix(isa, kind, p, Dtype::F32, k, std::hint::black_box(&src), &mut dst);
                *slot = slot.min(t.elapsed().as_secs_f64());
            }
        }
        let traffic = (src.len() + len) as f64;
        for (&isa, secs) in isas.iter().zip(best) {
            table.push(Measurement { kind, isa, gbps: traffic / secs.max(1e-9) / 1e9 });
        }
    }
    debug_assert_eq!(src_size(Dtype::F32), 4);
    table
}

/// The calibration record as text: a line per measurement, `KIND ISA GBPS`.
pub fn encode_table(table: &[Measurement]) -> String {
    table.iter().map(|m| format!("{} {} {:.3}\n", m.kind.name(), m.isa, m.gbps)).collect()
}

/// Reads [`encode_table`]'s text back; `None` when a line does not parse or names an ISA
/// this CPU cannot run.
pub fn decode_table(text: &str) -> Option<Vec<Measurement>> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let mut f = line.split_whitespace();
            let name = f.next()?;
            let kind = GemmKind::ALL.into_iter().find(|k| k.name() == name)?;
            let isa = Isa::parse(f.next()?).ok()?;
            let gbps: f64 = f.next()?.parse().ok()?;
            (f.next().is_none() && gbps.is_finite() && gbps > 0.0).then_some(Measurement { kind, isa, gbps })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(kind: GemmKind, isa: Isa, gbps: f64) -> Measurement {
        Measurement { kind, isa, gbps }
    }

    #[test]
    fn the_fastest_of_each_kind_wins() {
        let (s, b) = (Isa::scalar(), Isa::best());
        let table = vec![
            m(GemmKind::F32, s, 9.0),
            m(GemmKind::F32, b, 7.0),
            m(GemmKind::F16, s, 3.0),
            m(GemmKind::F16, b, 8.0),
            m(GemmKind::Bf16, s, f64::NAN),
            m(GemmKind::Bf16, b, 1.0),
        ];
        let c = KernelChoice::from_table(table, false);
        assert_eq!(c.kernels.for_kind(GemmKind::F32), s);
        assert_eq!(c.kernels.for_kind(GemmKind::F16), b);
        assert_eq!(c.kernels.for_kind(GemmKind::Bf16), b, "a NaN figure never wins");
        assert_eq!(c.kernels.for_kind(GemmKind::Qc8w), b, "an unmeasured kind gets the best ISA");
        if s != b {
            assert_eq!(c.to_string(), format!("f32-gemm=scalar f16-gemm={b} bf16-gemm={b} qc8w-gemm={b}"));
            assert!(c.reason().contains("f32-gemm scalar 9.0 vs"), "{}", c.reason());
        }
    }

    #[test]
    fn ties_go_to_the_first_measured() {
        let (s, b) = (Isa::scalar(), Isa::best());
        let c = KernelChoice::from_table(vec![m(GemmKind::F32, b, 5.0), m(GemmKind::F32, s, 5.0)], true);
        assert_eq!(c.kernels.for_kind(GemmKind::F32), b);
        assert!(matches!(c.how, How::Cached { .. }));
    }

    #[test]
    fn the_record_round_trips_and_rejects_garbage() {
        let table = vec![m(GemmKind::Qc8w, Isa::scalar(), 1.25), m(GemmKind::F16, Isa::best(), 12.5)];
        assert_eq!(decode_table(&encode_table(&table)), Some(table));
        for bad in ["f32-gemm", "f64-gemm scalar 1", "f32-gemm mmx 1", "f32-gemm scalar -1", "f32-gemm scalar 1 x"] {
            assert_eq!(decode_table(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_measurement_names_every_kind_and_candidate() {
        let isas = Isa::available();
        let table = measure_table(&isas, 1 << 20, 1);
        assert_eq!(table.len(), 4 * isas.len());
        for kind in GemmKind::ALL {
            for &isa in &isas {
                let hit = table.iter().find(|x| x.kind == kind && x.isa == isa).expect("measured");
                assert!(hit.gbps.is_finite() && hit.gbps > 0.0, "{hit:?}");
            }
        }
        let c = KernelChoice::from_table(table, false);
        assert!(c.kernels.each().all(|(_, i)| isas.contains(&i)));
    }

    #[test]
    fn one_candidate_needs_no_measurement() {
        let candidates = KernelChoice::candidates();
        assert!(!candidates.is_empty());
        assert!(candidates.iter().all(|i| i.kind() != IsaKind::Scalar) || candidates == [Isa::scalar()]);
        match KernelChoice::without_measuring() {
            Some(c) => {
                assert_eq!(candidates.len(), 1);
                assert_eq!(c.kernels, Kernels::all(candidates[0]));
                assert!(c.reason().contains("nothing to measure") || c.reason().contains("no SIMD"));
            }
            None => assert!(candidates.len() > 1),
        }
    }
}
