//! Which kernel family packs each GEMM kind on this CPU.
//!
//! The widest ISA is not always the fastest: on some CPUs AVX-512 packs slower than AVX2
//! (the packers are memory-bound and 512-bit stores can lower the clock). So, unless
//! `--isa` forces one, packd **measures** among the candidates (every SIMD ISA the CPU has,
//! or the list `--isa` names): each packs the same f32 source
//! ([`CALIBRATION_BYTES`](packd_kernels::measure::CALIBRATION_BYTES), larger than the
//! caches) into each GEMM kind, alternating, best of three, and the fastest wins for that
//! kind. A single candidate needs no measurement.
//!
//! Choosing never delays a start: a start uses a measurement kept for this CPU (the
//! kernels file, `persist::kernels`), else the [default](KernelChoice::default_among)
//! (AVX2 when it is a candidate: never slower than AVX-512 on a CPU measured so far), and
//! measures off the start path, at low priority; pack jobs that start after the
//! measurement use its pick. Every ISA writes the same bytes, so a switch changes speed
//! only. The kernels crate is built as in release in every build profile, so debug and release
//! daemons measure the same code.

use std::fmt;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use super::kernels::{Isa, IsaError, IsaKind};
use super::layout::GemmKind;
pub use super::measure::Measurement;
use super::measure::{CALIBRATION_BYTES, CALIBRATION_RUNS, measure_table};

/// The `isa` setting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IsaSetting {
    /// `auto`: measure among every SIMD ISA the CPU has.
    Auto,
    /// One ISA for every kind, nothing measured.
    Forced(Isa),
    /// `ISA,ISA,…`: measure among these (say, `scalar,avx2` on a CPU with one SIMD ISA).
    Among(Vec<Isa>),
}

impl IsaSetting {
    /// Parses `auto`, an ISA's name, or a comma-separated list of two or more names; an ISA
    /// the CPU lacks is refused.
    pub fn parse(text: &str) -> Result<Self, IsaError> {
        let text = text.trim();
        if text == "auto" {
            return Ok(IsaSetting::Auto);
        }
        let mut isas = Vec::new();
        for name in text.split(',') {
            let isa = Isa::parse(name.trim())?;
            if !isas.contains(&isa) {
                isas.push(isa);
            }
        }
        Ok(match isas.as_slice() {
            [one] => IsaSetting::Forced(*one),
            _ => IsaSetting::Among(isas),
        })
    }

    /// The ISAs a measurement compares: the listed ones, else every SIMD ISA this CPU
    /// has, or the scalar reference alone when it has none. Empty when forced.
    pub fn candidates(&self) -> Vec<Isa> {
        match self {
            IsaSetting::Auto => KernelChoice::candidates(),
            IsaSetting::Among(isas) => isas.clone(),
            IsaSetting::Forced(_) => Vec::new(),
        }
    }
}

impl fmt::Display for IsaSetting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IsaSetting::Auto => f.write_str("auto"),
            IsaSetting::Forced(isa) => write!(f, "{isa}"),
            IsaSetting::Among(isas) => f.write_str(&isas.iter().map(ToString::to_string).collect::<Vec<_>>().join(",")),
        }
    }
}

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

/// [`KernelChoice::default_isa`] on ISA kinds: AVX2 when a candidate, else the best.
fn default_kind(candidates: &[IsaKind]) -> Option<IsaKind> {
    let avx2 = candidates.iter().find(|k| **k == IsaKind::Avx2);
    avx2.or_else(|| candidates.iter().max_by_key(|k| IsaKind::ALL.iter().position(|a| a == *k))).copied()
}

/// The fastest ISA of each kind among the rows `(kind, ISA, GB/s)` of a measurement (any
/// number of candidates), in [`GemmKind::ALL`] order. A kind no row measures with a finite
/// figure gets the default among the ISAs the rows name; ties go to the row first.
fn pick(rows: &[(GemmKind, IsaKind, f64)]) -> [IsaKind; 4] {
    let mut named: Vec<IsaKind> = Vec::new();
    for (_, isa, _) in rows {
        if !named.contains(isa) {
            named.push(*isa);
        }
    }
    let default = default_kind(&named).unwrap_or(IsaKind::Scalar);
    GemmKind::ALL.map(|kind| {
        rows.iter()
            .filter(|(k, _, gbps)| *k == kind && gbps.is_finite())
            .fold(None::<(IsaKind, f64)>, |best, &(_, isa, gbps)| match best {
                Some(b) if b.1 >= gbps => Some(b),
                _ => Some((isa, gbps)),
            })
            .map_or(default, |(isa, _)| isa)
    })
}

/// How the kernels were chosen.
#[derive(Clone, Debug, PartialEq)]
pub enum How {
    /// `--isa` (or the config file's `isa`) named one.
    Forced,
    /// The CPU has one SIMD ISA (or none): nothing to measure.
    Only,
    /// The default among `candidates`, used until a measurement off the start path says
    /// which is fastest.
    Pending {
        /// What is being measured.
        candidates: Vec<Isa>,
    },
    /// The default among `candidates`, with no measurement coming (none could be made).
    Default {
        /// The candidates.
        candidates: Vec<Isa>,
    },
    /// Measured by this daemon, taking `took`.
    Measured {
        /// Every (kind, ISA) measured.
        table: Vec<Measurement>,
        /// How long the measurement took.
        took: Duration,
    },
    /// Measured on this CPU earlier (by this packd version) and read back.
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

    /// The ISAs `auto` compares: every SIMD ISA this CPU has, or the scalar reference
    /// alone when it has none (it is several times slower than any SIMD ISA).
    pub fn candidates() -> Vec<Isa> {
        let simd: Vec<Isa> = Isa::available().into_iter().filter(|i| i.kind() != IsaKind::Scalar).collect();
        if simd.is_empty() { vec![Isa::scalar()] } else { simd }
    }

    /// The choice when `setting` leaves nothing to measure (forced, or one candidate).
    pub fn without_measuring(setting: &IsaSetting) -> Option<Self> {
        if let IsaSetting::Forced(isa) = setting {
            return Some(Self::forced(*isa));
        }
        match setting.candidates().as_slice() {
            [only] => Some(KernelChoice { kernels: Kernels::all(*only), how: How::Only }),
            _ => None,
        }
    }

    /// The ISA used among `candidates` before (or without) a measurement: AVX2 when it is
    /// one (on the AVX-512 CPUs measured it packs every kind as fast or faster), else the
    /// best of them.
    pub fn default_isa(candidates: &[Isa]) -> Isa {
        let kinds: Vec<IsaKind> = candidates.iter().map(|i| i.kind()).collect();
        default_kind(&kinds)
            .and_then(|k| candidates.iter().find(|i| i.kind() == k))
            .copied()
            .unwrap_or_else(Isa::scalar)
    }

    /// The default among `candidates` while a measurement runs.
    pub fn default_among(candidates: &[Isa], pending: bool) -> Self {
        let kernels = Kernels::all(Self::default_isa(candidates));
        let candidates = candidates.to_vec();
        let how = if pending { How::Pending { candidates } } else { How::Default { candidates } };
        KernelChoice { kernels, how }
    }

    /// What `isa = auto` picks on this CPU without a kept measurement: the single
    /// candidate, or a new measurement (blocking, a fraction of a second).
    pub fn auto() -> Self {
        Self::without_measuring(&IsaSetting::Auto).unwrap_or_else(|| Self::measure(&Self::candidates()))
    }

    /// The fastest ISA of each kind in `table` (a kind the table does not name gets the
    /// default among the ISAs it names). Ties go to the ISA measured first.
    pub fn from_table(table: Vec<Measurement>, cached: bool) -> Self {
        let rows: Vec<(GemmKind, IsaKind, f64)> = table.iter().map(|m| (m.kind, m.isa.kind(), m.gbps)).collect();
        // Every kind picked is one of the table's ISAs, which are this CPU's (an `Isa`).
        let isa_of = |k: IsaKind| table.iter().find(|m| m.isa.kind() == k).map_or_else(Isa::scalar, |m| m.isa);
        let kernels = Kernels(pick(&rows).map(isa_of));
        let how = if cached { How::Cached { table } } else { How::Measured { table, took: Duration::ZERO } };
        KernelChoice { kernels, how }
    }

    /// Measures `candidates` on every GEMM kind and picks the fastest of each. Blocking:
    /// allocates about `2 · CALIBRATION_BYTES` and packs for a few hundredths of a second
    /// per candidate and kind (the scalar reference several times longer).
    pub fn measure(candidates: &[Isa]) -> Self {
        let started = Instant::now();
        let table = measure_table(candidates, CALIBRATION_BYTES, CALIBRATION_RUNS, &crate::sys::proc::thread_cpu_time);
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
            How::Forced | How::Only | How::Pending { .. } | How::Default { .. } => &[],
        }
    }

    /// Why these kernels, in a few words (`packctl stats`, `--check-config`, the log).
    pub fn reason(&self) -> String {
        let names = |isas: &[Isa]| isas.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
        match &self.how {
            How::Forced => "forced by the isa setting".to_string(),
            How::Only if self.kernels.for_kind(GemmKind::F32).kind() == IsaKind::Scalar => {
                "this CPU has no SIMD ISA packd has kernels for".to_string()
            }
            How::Only => "the only SIMD ISA this CPU has; nothing to measure".to_string(),
            How::Pending { candidates } => format!(
                "the default while {} are measured off the start path (pack jobs started after it use the fastest)",
                names(candidates)
            ),
            How::Default { candidates } => {
                format!("the default among {}: no measurement could be made", names(candidates))
            }
            How::Measured { took, .. } => {
                format!("fastest measured by this daemon ({} ms): {}", took.as_millis(), self.figures())
            }
            How::Cached { .. } => format!("fastest measured on this CPU earlier: {}", self.figures()),
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

/// The kernels in use: set at start, replaced once a measurement off the start path is
/// done. Pack jobs read it when they start.
#[derive(Debug)]
pub struct KernelsInUse(RwLock<Arc<KernelChoice>>);

impl KernelsInUse {
    /// Starts with `choice`.
    pub fn new(choice: KernelChoice) -> Self {
        Self(RwLock::new(Arc::new(choice)))
    }

    /// The choice now.
    pub fn get(&self) -> Arc<KernelChoice> {
        Arc::clone(&self.0.read().unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    /// Replaces the choice (pack jobs already running keep theirs).
    pub fn set(&self, choice: KernelChoice) {
        *self.0.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(choice);
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
        let default = KernelChoice::default_isa(&[s, b]);
        assert_eq!(c.kernels.for_kind(GemmKind::Qc8w), default, "an unmeasured kind gets the default");
        if s != b {
            assert_eq!(c.to_string(), format!("f32-gemm=scalar f16-gemm={b} bf16-gemm={b} qc8w-gemm={b}"));
            assert!(c.reason().contains("f32-gemm scalar 9.0 vs"), "{}", c.reason());
        }
    }

    /// More candidates than this machine may have (the table is synthetic: no kernel runs):
    /// each kind goes to its own fastest of four, NaN and missing figures never win, and a
    /// kind measured by none gets the default (AVX2 among them).
    #[test]
    fn the_fastest_of_each_kind_wins_among_any_number_of_candidates() {
        use GemmKind::{Bf16, F16, F32, Qc8w};
        use IsaKind::{Avx2, Avx512, Neon, Scalar};
        let rows = [
            (F32, Scalar, 1.0),
            (F32, Neon, 2.0),
            (F32, Avx2, 3.0),
            (F32, Avx512, 4.0),
            (F16, Scalar, 5.0),
            (F16, Neon, 1.0),
            (F16, Avx2, 1.0),
            (F16, Avx512, f64::NAN),
            (Bf16, Scalar, 1.0),
            (Bf16, Neon, 9.0),
            (Bf16, Avx2, 9.0),
            (Bf16, Avx512, 2.0),
        ];
        assert_eq!(pick(&rows), [Avx512, Scalar, Neon, Avx2], "qc8w is measured by none: the default, AVX2");
        let without_avx2: Vec<_> = rows.iter().copied().filter(|r| r.1 != Avx2).collect();
        assert_eq!(pick(&without_avx2)[3], Avx512, "without AVX2 the default is the best named");
        let three = [(Qc8w, Avx2, 7.0), (Qc8w, Avx512, 7.5), (Qc8w, Scalar, 1.0), (F32, Avx512, f64::NAN)];
        assert_eq!(pick(&three), [Avx2, Avx2, Avx2, Avx512]);
        assert_eq!(pick(&[]), [Scalar; 4]);
    }

    /// On this CPU: every SIMD ISA it has is a candidate (which ISAs those are, from its
    /// flags, is `packd-kernels`' `isas_tested`), and a measurement among all of them picks
    /// one of them per kind.
    #[test]
    fn every_isa_of_this_cpu_is_a_candidate() {
        let simd: Vec<Isa> = Isa::available().into_iter().filter(|i| i.kind() != IsaKind::Scalar).collect();
        assert_eq!(KernelChoice::candidates(), simd);
        let all = Isa::available();
        let c = KernelChoice::from_table(measure_table(&all, 1 << 20, 1, &crate::sys::proc::thread_cpu_time), false);
        assert!(c.kernels.each().all(|(_, i)| all.contains(&i)), "{c}");
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
        let table = measure_table(&isas, 1 << 20, 1, &crate::sys::proc::thread_cpu_time);
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
        match KernelChoice::without_measuring(&IsaSetting::Auto) {
            Some(c) => {
                assert_eq!(candidates.len(), 1);
                assert_eq!(c.kernels, Kernels::all(candidates[0]));
                assert!(c.reason().contains("nothing to measure") || c.reason().contains("no SIMD"));
            }
            None => assert!(candidates.len() > 1),
        }
    }

    #[test]
    fn the_isa_setting_parses_auto_one_or_a_list() {
        assert_eq!(IsaSetting::parse(" auto ").unwrap(), IsaSetting::Auto);
        assert_eq!(IsaSetting::parse("scalar").unwrap(), IsaSetting::Forced(Isa::scalar()));
        assert_eq!(IsaSetting::parse("scalar, scalar").unwrap(), IsaSetting::Forced(Isa::scalar()));
        let best = Isa::best();
        if best != Isa::scalar() {
            let among = IsaSetting::parse(&format!("scalar,{best}")).unwrap();
            assert_eq!(among, IsaSetting::Among(vec![Isa::scalar(), best]));
            assert_eq!(among.to_string(), format!("scalar,{best}"));
            assert_eq!(among.candidates(), vec![Isa::scalar(), best]);
            assert!(KernelChoice::without_measuring(&among).is_none());
        }
        assert!(matches!(IsaSetting::parse("scalar,mmx"), Err(IsaError::Unknown(_))));
        assert!(IsaSetting::parse("").is_err());
        assert_eq!(IsaSetting::Forced(Isa::scalar()).candidates(), Vec::<Isa>::new());
    }

    #[test]
    fn the_default_is_avx2_when_a_candidate_else_the_best() {
        assert_eq!(KernelChoice::default_isa(&[Isa::scalar()]), Isa::scalar());
        if let Some(avx2) = Isa::get(IsaKind::Avx2) {
            assert_eq!(KernelChoice::default_isa(&[Isa::scalar(), avx2]), avx2);
            if let Some(avx512) = Isa::get(IsaKind::Avx512) {
                assert_eq!(KernelChoice::default_isa(&[avx512, avx2]), avx2);
                assert_eq!(KernelChoice::default_isa(&[Isa::scalar(), avx512]), avx512);
            }
        }
        let c = KernelChoice::default_among(&[Isa::scalar(), Isa::best()], true);
        assert!(c.reason().contains("measured off the start path"), "{}", c.reason());
        assert!(c.table().is_empty());
    }

    #[test]
    fn kernels_in_use_are_replaced_whole() {
        let k = KernelsInUse::new(KernelChoice::forced(Isa::scalar()));
        let before = k.get();
        k.set(KernelChoice::forced(Isa::best()));
        assert_eq!(before.kernels, Kernels::all(Isa::scalar()), "a job's copy is its own");
        assert_eq!(k.get().kernels, Kernels::all(Isa::best()));
    }
}
