//! Packing kernels and their runtime dispatch.
//!
//! Every kernel produces exactly the bytes of the scalar reference
//! ([`gemm::pack_block_ref`](crate::gemm::pack_block_ref)); property tests prove it for
//! every ISA this CPU has, over odd shapes, every parameter set, every source dtype and
//! NaN/Inf/subnormal/±0 values.
//!
//! * `scalar` — the reference, one element at a time, straight from the spec;
//! * `avx2` (x86_64, with F16C), `avx512` (x86_64, F+BW+VL) and `neon` (aarch64) — SIMD
//!   transposes for `kr = 1` (every `sr`, `nr` a multiple of the vector width); other
//!   parameter sets use the portable tiled packer, which converts a block's rows into a
//!   tile and copies whole `kr`-element units.
//!
//! The daemon picks an ISA per GEMM kind (`packd::pack::choice`); [`Isa::parse`] refuses
//! one the CPU lacks.

#[cfg(target_arch = "aarch64")]
mod neon;
mod portable;
#[cfg(target_arch = "x86_64")]
mod x86;

use std::fmt;

use crate::dtype::Dtype;
use crate::gemm;
use crate::params::{GemmKind, GemmParams};

/// Instruction sets a kernel can use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IsaKind {
    /// The scalar reference.
    Scalar,
    /// x86_64 AVX2 with F16C and FMA.
    Avx2,
    /// x86_64 AVX-512 F, BW, VL (with AVX2 and F16C).
    Avx512,
    /// aarch64 Advanced SIMD.
    Neon,
}

impl IsaKind {
    /// Every ISA, in order of preference (best last).
    pub const ALL: [IsaKind; 4] = [IsaKind::Scalar, IsaKind::Neon, IsaKind::Avx2, IsaKind::Avx512];

    /// Name as `PACKD_ISA` and stats spell it.
    pub fn name(self) -> &'static str {
        match self {
            IsaKind::Scalar => "scalar",
            IsaKind::Avx2 => "avx2",
            IsaKind::Avx512 => "avx512",
            IsaKind::Neon => "neon",
        }
    }

    /// Whether this CPU can run it.
    pub fn available(self) -> bool {
        match self {
            IsaKind::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            IsaKind::Avx2 => x86::avx2_available(),
            #[cfg(target_arch = "x86_64")]
            IsaKind::Avx512 => x86::avx512_available(),
            #[cfg(target_arch = "aarch64")]
            IsaKind::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }
}

/// An ISA this CPU is known to support. The only way to get one is through a check, so a
/// kernel handed an `Isa` may use its instructions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Isa(IsaKind);

impl Isa {
    /// The scalar reference (always available).
    pub fn scalar() -> Self {
        Isa(IsaKind::Scalar)
    }

    /// `kind` if this CPU supports it.
    pub fn get(kind: IsaKind) -> Option<Self> {
        kind.available().then_some(Isa(kind))
    }

    /// The best ISA this CPU supports.
    pub fn best() -> Self {
        Self::available().pop().unwrap_or(Isa(IsaKind::Scalar))
    }

    /// Every ISA this CPU supports, best last.
    pub fn available() -> Vec<Self> {
        IsaKind::ALL.into_iter().filter_map(Self::get).collect()
    }

    /// Parses an ISA name and checks the CPU has it.
    pub fn parse(name: &str) -> Result<Self, IsaError> {
        let kind = IsaKind::ALL
            .into_iter()
            .find(|k| k.name() == name.trim())
            .ok_or_else(|| IsaError::Unknown(name.to_string()))?;
        Self::get(kind).ok_or_else(|| IsaError::Unsupported {
            name: name.to_string(),
            have: Self::available().iter().map(|i| i.kind().name()).collect::<Vec<_>>().join(", "),
        })
    }

    /// Which ISA this is.
    pub fn kind(self) -> IsaKind {
        self.0
    }
}

/// An ISA name that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IsaError {
    /// Not an ISA packd has kernels for.
    #[error("unknown ISA {0:?} (known: auto, scalar, avx2, avx512, neon)")]
    Unknown(String),
    /// An ISA this CPU lacks.
    #[error("this CPU cannot run ISA {name:?} (it has: {have})")]
    Unsupported {
        /// The name asked for.
        name: String,
        /// What the CPU has.
        have: String,
    },
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.name())
    }
}

/// Packs one block with `isa`; same contract and bytes as
/// [`gemm::pack_block_ref`](super::gemm::pack_block_ref).
pub fn pack_block(isa: Isa, kind: GemmKind, p: GemmParams, src: Dtype, k: usize, rows: &[u8], out: &mut [u8]) {
    assert_eq!(out.len(), kind.block_len(p, k), "output is one block");
    let nb = if k == 0 { 0 } else { rows.len() / (k * gemm::src_size(src)) };
    assert!(nb <= p.nr as usize && rows.len() == nb * k * gemm::src_size(src), "rows are whole source rows");
    match isa.0 {
        IsaKind::Scalar => gemm::pack_block_ref(kind, p, src, k, rows, out),
        #[cfg(target_arch = "x86_64")]
        IsaKind::Avx2 | IsaKind::Avx512 => {
            if !x86::pack_block(isa.0, kind, p, src, k, rows, nb, out) {
                portable::pack_block(kind, p, src, k, rows, nb, out);
            }
        }
        #[cfg(target_arch = "aarch64")]
        IsaKind::Neon => {
            if !neon::pack_block(kind, p, src, k, rows, nb, out) {
                portable::pack_block(kind, p, src, k, rows, nb, out);
            }
        }
        #[allow(unreachable_patterns)]
        _ => portable::pack_block(kind, p, src, k, rows, nb, out),
    }
}

/// Packs consecutive whole blocks: `rows` holds the source rows of `out.len() / block_len`
/// blocks (the last one may be partial), `out` their packed bytes.
pub fn pack_matrix(isa: Isa, kind: GemmKind, p: GemmParams, src: Dtype, k: usize, rows: &[u8], out: &mut [u8]) {
    let bl = kind.block_len(p, k);
    let row_block = p.nr as usize * k * gemm::src_size(src);
    for (b, block) in out.chunks_exact_mut(bl).enumerate() {
        let end = ((b + 1) * row_block).min(rows.len());
        pack_block(isa, kind, p, src, k, &rows[(b * row_block).min(end)..end], block);
    }
}

#[cfg(test)]
mod tests;
