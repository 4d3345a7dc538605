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

mod isa;
#[cfg(target_arch = "aarch64")]
mod neon;
mod portable;
#[cfg(target_arch = "x86_64")]
mod x86;

use crate::dtype::Dtype;
use crate::gemm;
use crate::params::{GemmKind, GemmParams};

pub use isa::{Isa, IsaError, IsaKind};

/// Packs one block with `isa`; same contract and bytes as
/// [`gemm::pack_block_ref`](super::gemm::pack_block_ref).
pub fn pack_block(isa: Isa, kind: GemmKind, p: GemmParams, src: Dtype, k: usize, rows: &[u8], out: &mut [u8]) {
    assert_eq!(out.len(), kind.block_len(p, k), "output is one block");
    let nb = if k == 0 { 0 } else { rows.len() / (k * gemm::src_size(src)) };
    assert!(nb <= p.nr as usize && rows.len() == nb * k * gemm::src_size(src), "rows are whole source rows");
    match isa.kind() {
        IsaKind::Scalar => gemm::pack_block_ref(kind, p, src, k, rows, out),
        #[cfg(target_arch = "x86_64")]
        IsaKind::Avx2 | IsaKind::Avx512 => {
            if !x86::pack_block(isa.kind(), kind, p, src, k, rows, nb, out) {
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
