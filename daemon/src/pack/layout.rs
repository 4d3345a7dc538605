//! Layout specs: parsing, canonical names, versions and packed sizes.

use std::fmt;
use std::str::FromStr;

use crate::source::Dtype;
pub use packd_kernels::params::{GemmKind, GemmParams, KR_VALUES, NR_VALUES, SR_VALUES};

/// A packed layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Layout {
    /// The source bytes unchanged.
    Identity,
    /// A GEMM weight layout (XNNPACK-style interleave of a `[N, K]` weight with its bias).
    Gemm(GemmKind, GemmParams),
    /// Bytes an engine packed in its own layout and published ("engine"): opaque to packd.
    /// Never part of a plan (it does not parse); only published segments have it.
    Engine,
}

/// A layout spec that does not parse or has bad parameters.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("layout {spec:?}: {reason}")]
pub struct LayoutError {
    /// The spec as given.
    pub spec: String,
    /// What is wrong with it.
    pub reason: LayoutFault,
}

/// What is wrong with a layout spec.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum LayoutFault {
    /// `identity:…`.
    #[error("identity takes no parameters")]
    IdentityParams,
    /// A layout name packd does not know.
    #[error("unknown layout {0:?} (known: identity, f32-gemm, f16-gemm, bf16-gemm, qc8w-gemm)")]
    Unknown(String),
    /// A parameter that is not `KEY=VALUE`.
    #[error("parameter {0:?} is not KEY=VALUE")]
    NotKeyValue(String),
    /// A value that is not a number.
    #[error("{key}={value:?} is not a number")]
    NotANumber {
        /// Parameter.
        key: String,
        /// Value given.
        value: String,
    },
    /// A parameter other than nr, kr, sr.
    #[error("unknown parameter {0:?} (known: nr, kr, sr)")]
    UnknownParam(String),
    /// A parameter given twice.
    #[error("parameter {0} given twice")]
    Twice(String),
    /// A value the layout does not allow.
    #[error("{key}={value} is not one of {allowed:?}")]
    NotAllowed {
        /// Parameter.
        key: String,
        /// Value given.
        value: u32,
        /// Allowed values.
        allowed: &'static [u32],
    },
    /// nr not a multiple of sr.
    #[error("nr={nr} is not a multiple of sr={sr}")]
    NrSr {
        /// nr.
        nr: u32,
        /// sr.
        sr: u32,
    },
}

impl Layout {
    /// Version of the layout's byte format; part of every entry key.
    pub fn version(self) -> u32 {
        match self {
            Layout::Identity | Layout::Engine => 1,
            Layout::Gemm(kind, _) => kind.version(),
        }
    }

    /// Whether this is a GEMM layout (takes a 2-D weight and folds its bias).
    pub fn is_gemm(self) -> bool {
        matches!(self, Layout::Gemm(..))
    }

    /// Source dtypes this layout accepts.
    pub fn accepts(self, dtype: Dtype) -> bool {
        match self {
            Layout::Identity | Layout::Engine => true,
            Layout::Gemm(..) => dtype.is_gemm_float(),
        }
    }

    /// Packed size in bytes of a `[n, k]` weight (GEMM) or of `source_len` bytes (identity).
    pub fn packed_len(self, n: usize, k: usize, source_len: u64) -> Option<u64> {
        match self {
            Layout::Identity | Layout::Engine => Some(source_len),
            Layout::Gemm(kind, p) => {
                // Checked here once; `block_len` of the same (p, k) cannot overflow after.
                let nr = p.nr as usize;
                let kp = k.checked_add(p.skr())?;
                let per_block = match kind {
                    GemmKind::Qc8w => nr.checked_mul(kp.checked_add(12)?)?,
                    _ => nr.checked_mul(kind.elem_size())?.checked_mul(kp.checked_add(1)?)?,
                };
                u64::try_from(p.blocks(n).checked_mul(per_block)?).ok()?;
                u64::try_from(p.blocks(n) * kind.block_len(p, k)).ok()
            }
        }
    }
}

impl FromStr for Layout {
    type Err = LayoutError;

    /// Parses `identity` or `KIND-gemm[:nr=N,kr=K,sr=S]` with KIND one of f32, f16, bf16,
    /// qc8w (missing parameters take the defaults nr=16, kr=1, sr=1).
    fn from_str(spec: &str) -> Result<Self, LayoutError> {
        let err = |reason: LayoutFault| LayoutError { spec: spec.to_string(), reason };
        let (name, params) = spec.trim().split_once(':').unwrap_or((spec.trim(), ""));
        if name == "identity" {
            return if params.is_empty() { Ok(Layout::Identity) } else { Err(err(LayoutFault::IdentityParams)) };
        }
        let kind = GemmKind::ALL
            .into_iter()
            .find(|k| k.name() == name)
            .ok_or_else(|| err(LayoutFault::Unknown(name.into())))?;
        parse_gemm(params).map(|p| Layout::Gemm(kind, p)).map_err(err)
    }
}

fn parse_gemm(params: &str) -> Result<GemmParams, LayoutFault> {
    let mut p = GemmParams::default();
    let mut seen = Vec::new();
    for kv in params.split(',').filter(|s| !s.is_empty()) {
        let (k, v) = kv.split_once('=').ok_or_else(|| LayoutFault::NotKeyValue(kv.into()))?;
        let v: u32 = v.trim().parse().map_err(|_| LayoutFault::NotANumber { key: k.trim().into(), value: v.into() })?;
        let (slot, allowed): (&mut u32, &'static [u32]) = match k.trim() {
            "nr" => (&mut p.nr, &NR_VALUES),
            "kr" => (&mut p.kr, &KR_VALUES),
            "sr" => (&mut p.sr, &SR_VALUES),
            other => return Err(LayoutFault::UnknownParam(other.into())),
        };
        if seen.contains(&k.trim()) {
            return Err(LayoutFault::Twice(k.trim().into()));
        }
        seen.push(k.trim());
        if !allowed.contains(&v) {
            return Err(LayoutFault::NotAllowed { key: k.trim().into(), value: v, allowed });
        }
        *slot = v;
    }
    if p.nr % p.sr != 0 {
        return Err(LayoutFault::NrSr { nr: p.nr, sr: p.sr });
    }
    Ok(p)
}

impl fmt::Display for Layout {
    /// The canonical spec, e.g. `f32-gemm:nr=16,kr=1,sr=1`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Layout::Identity => f.write_str("identity"),
            Layout::Engine => f.write_str("engine"),
            Layout::Gemm(kind, p) => write!(f, "{}:nr={},kr={},sr={}", kind.name(), p.nr, p.kr, p.sr),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_canonicalises() {
        let l: Layout = "f32-gemm:sr=2,nr=8".parse().unwrap();
        assert_eq!(l.to_string(), "f32-gemm:nr=8,kr=1,sr=2");
        assert_eq!("f32-gemm".parse::<Layout>().unwrap().to_string(), "f32-gemm:nr=16,kr=1,sr=1");
        assert_eq!("identity".parse::<Layout>().unwrap(), Layout::Identity);
    }

    #[test]
    fn rejects_bad_specs_with_reasons() {
        for (spec, want) in [
            ("q4-gemm", "unknown layout"),
            ("qc8w-gemm:nr=7", "not one of"),
            ("f32-gemm:nr=3", "not one of"),
            ("f32-gemm:nr=4,sr=8", "not one of"),
            ("f32-gemm:nr=x", "not a number"),
            ("f32-gemm:mr=4", "unknown parameter"),
            ("f32-gemm:nr", "KEY=VALUE"),
            ("f32-gemm:nr=4,nr=8", "twice"),
            ("identity:nr=4", "no parameters"),
        ] {
            let e = spec.parse::<Layout>().unwrap_err();
            assert!(e.to_string().contains(want), "{spec}: {e}");
        }
    }

    #[test]
    fn packed_len_follows_the_spec() {
        let l: Layout = "f32-gemm:nr=4,kr=2,sr=2".parse().unwrap();
        // 2 blocks × 4 lanes × 4 bytes × (1 + round_up(5, 4) = 9)
        assert_eq!(l.packed_len(5, 5, 0), Some(2 * 4 * 4 * 9));
        assert_eq!(Layout::Identity.packed_len(5, 5, 77), Some(77));
        let l: Layout = "bf16-gemm:nr=4,kr=2,sr=2".parse().unwrap();
        assert_eq!(l.packed_len(5, 5, 0), Some(2 * 4 * 2 * 9));
        // qc8w: nr × (i32 sum + Kp int8 + f32 scale + f32 bias)
        let l: Layout = "qc8w-gemm:nr=4,kr=2,sr=2".parse().unwrap();
        assert_eq!(l.packed_len(5, 5, 0), Some(2 * 4 * (4 + 8 + 4 + 4)));
        assert_eq!(l.to_string(), "qc8w-gemm:nr=4,kr=2,sr=2");
    }
}

#[cfg(test)]
mod layouts_md {
    //! The worked examples of docs/LAYOUTS.md, checked byte for byte against the reference
    //! and every ISA this CPU has. A block in the document reads
    //! `vector LAYOUT N K bias|nobias` followed by hex lines `OFFSET: BYTES…`, for
    //! `W[n][k] = 1 + n·K + k` and `b[n] = 10·(n + 1)`.
    use super::*;
    use crate::source::Dtype;
    use packd_kernels::gemm::write_bias;
    use packd_kernels::simd::{Isa, pack_block};

    const DOC: &str = include_str!("../../../docs/LAYOUTS.md");

    #[test]
    fn every_vector_in_layouts_md_matches() {
        let mut checked = 0;
        let mut lines = DOC.lines().peekable();
        while let Some(line) = lines.next() {
            let Some(spec) = line.strip_prefix("vector ") else { continue };
            let f: Vec<&str> = spec.split_whitespace().collect();
            let layout: Layout = f[0].parse().unwrap();
            let (n, k): (usize, usize) = (f[1].parse().unwrap(), f[2].parse().unwrap());
            let mut want = Vec::new();
            while let Some(hex) = lines.peek().and_then(|l| l.split_once(": ")) {
                want.extend(hex.1.split_whitespace().map(|b| u8::from_str_radix(b, 16).unwrap()));
                lines.next();
            }
            let Layout::Gemm(kind, p) = layout else { panic!("{spec}") };
            let w: Vec<u8> = (0..n * k).flat_map(|i| (1.0 + i as f32).to_le_bytes()).collect();
            let b: Vec<u8> = (0..n).flat_map(|i| (10.0 * (i + 1) as f32).to_le_bytes()).collect();
            for isa in Isa::available() {
                let mut out = vec![0u8; usize::try_from(layout.packed_len(n, k, 0).unwrap()).unwrap()];
                let bl = kind.block_len(p, k);
                let nr = p.nr as usize;
                if f[3] == "bias" {
                    write_bias(kind, p, k, Dtype::F32, &b, &mut out);
                }
                for (blk, block) in out.chunks_exact_mut(bl).enumerate() {
                    let rows = &w[blk * nr * k * 4..((blk + 1) * nr).min(n) * k * 4];
                    pack_block(isa, kind, p, Dtype::F32, k, rows, block);
                }
                assert_eq!(out, want, "{spec} on {isa}");
            }
            checked += 1;
        }
        assert!(checked >= 5, "only {checked} vectors found in LAYOUTS.md");
    }
}
