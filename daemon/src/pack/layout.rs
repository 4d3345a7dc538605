//! Layout specs: parsing, canonical names, versions and packed sizes.

use std::fmt;
use std::str::FromStr;

use crate::source::Dtype;

/// Allowed `nr` (output channels per block).
pub const NR_VALUES: [u32; 5] = [4, 8, 16, 32, 64];
/// Allowed `kr` (consecutive K values per lane).
pub const KR_VALUES: [u32; 4] = [1, 2, 4, 8];
/// Allowed `sr` (K shuffle factor).
pub const SR_VALUES: [u32; 3] = [1, 2, 4];

/// Interleave parameters of a GEMM layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmParams {
    /// Output channels per block.
    pub nr: u32,
    /// Consecutive K values per lane.
    pub kr: u32,
    /// Shuffle factor: K is processed in groups of kr·sr.
    pub sr: u32,
}

impl Default for GemmParams {
    fn default() -> Self {
        Self { nr: 16, kr: 1, sr: 1 }
    }
}

impl GemmParams {
    /// kr·sr: K is padded to a multiple of it.
    pub fn skr(self) -> usize {
        (self.kr * self.sr) as usize
    }

    /// K rounded up to a multiple of kr·sr.
    pub fn padded_k(self, k: usize) -> usize {
        k.div_ceil(self.skr()) * self.skr()
    }

    /// Number of nr-blocks for N output channels.
    pub fn blocks(self, n: usize) -> usize {
        n.div_ceil(self.nr as usize)
    }
}

/// The element format of a GEMM layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmKind {
    /// f32 weights and bias.
    F32,
    /// IEEE half weights and bias.
    F16,
    /// bfloat16 weights and bias.
    Bf16,
    /// Per-output-channel symmetric int8 weights with f32 scales and bias.
    Qc8w,
}

impl GemmKind {
    /// All kinds, in catalogue order.
    pub const ALL: [GemmKind; 4] = [GemmKind::F32, GemmKind::F16, GemmKind::Bf16, GemmKind::Qc8w];

    /// Layout name (`f32-gemm`, …).
    pub fn name(self) -> &'static str {
        match self {
            GemmKind::F32 => "f32-gemm",
            GemmKind::F16 => "f16-gemm",
            GemmKind::Bf16 => "bf16-gemm",
            GemmKind::Qc8w => "qc8w-gemm",
        }
    }

    /// Bytes per packed weight.
    pub fn elem_size(self) -> usize {
        match self {
            GemmKind::F32 => 4,
            GemmKind::F16 | GemmKind::Bf16 => 2,
            GemmKind::Qc8w => 1,
        }
    }

    /// Version of the byte format.
    pub fn version(self) -> u32 {
        1
    }

    /// Bytes of one nr-block for K input channels.
    pub fn block_len(self, p: GemmParams, k: usize) -> usize {
        let nr = p.nr as usize;
        match self {
            GemmKind::Qc8w => nr * (4 + p.padded_k(k) + 4 + 4),
            _ => nr * self.elem_size() * (1 + p.padded_k(k)),
        }
    }

    /// Offset of the weights inside a block.
    pub fn weights_offset(self, p: GemmParams) -> usize {
        p.nr as usize * if self == GemmKind::Qc8w { 4 } else { self.elem_size() }
    }

    /// Offset of the bias slots inside a block (`nr` values of the bias element type).
    pub fn bias_offset(self, p: GemmParams, k: usize) -> usize {
        match self {
            GemmKind::Qc8w => p.nr as usize * (4 + p.padded_k(k) + 4),
            _ => 0,
        }
    }
}

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
