//! The portable tiled packer: converts a block's rows into a row-major tile of the layout's
//! element type (quantising for qc8w), then copies whole `kr`-element units into the
//! interleave. Safe Rust; used for parameter sets the SIMD transposes do not cover.

use std::cell::RefCell;

use crate::convert::{amax_step, f32_to_bf16, f32_to_f16, load_f32, quantize, row_scale};
use crate::dtype::Dtype;
use crate::gemm::src_size;
use crate::params::{GemmKind, GemmParams};

thread_local! {
    static TILE: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Converts row `i` (k elements of `src`) into `dst` (k elements of the kind's type).
/// For qc8w returns `(scale, Σq)`.
fn convert_row(kind: GemmKind, src: Dtype, row: &[u8], k: usize, dst: &mut [u8]) -> (f32, i32) {
    match (kind, src) {
        (GemmKind::F32, Dtype::F32) | (GemmKind::F16, Dtype::F16) | (GemmKind::Bf16, Dtype::Bf16) => {
            dst[..row.len()].copy_from_slice(row);
        }
        (GemmKind::F32, _) => {
            for (kk, d) in dst.chunks_exact_mut(4).take(k).enumerate() {
                d.copy_from_slice(&load_f32(src, row, kk).to_le_bytes());
            }
        }
        (GemmKind::F16, _) => {
            for (kk, d) in dst.chunks_exact_mut(2).take(k).enumerate() {
                d.copy_from_slice(&f32_to_f16(load_f32(src, row, kk)).to_le_bytes());
            }
        }
        (GemmKind::Bf16, _) => {
            for (kk, d) in dst.chunks_exact_mut(2).take(k).enumerate() {
                d.copy_from_slice(&f32_to_bf16(load_f32(src, row, kk)).to_le_bytes());
            }
        }
        (GemmKind::Qc8w, _) => {
            let amax = (0..k).fold(0f32, |m, kk| amax_step(m, load_f32(src, row, kk)));
            let (scale, inv) = row_scale(amax);
            let mut sum = 0i32;
            for (kk, d) in dst.iter_mut().take(k).enumerate() {
                let q = quantize(load_f32(src, row, kk), inv);
                sum += i32::from(q);
                *d = q.to_le_bytes()[0];
            }
            return (scale, sum);
        }
    }
    (0.0, 0)
}

/// Copies `U`-byte units from the tile into the interleave.
fn interleave<const U: usize>(tile: &[u8], nr: usize, sr: usize, units: usize, out: &mut [u8]) {
    let row_bytes = units * U;
    let mut o = 0;
    for c in 0..units {
        let base = c - c % sr;
        for i in 0..nr {
            let unit = base + (c + i) % sr;
            let s = i * row_bytes + unit * U;
            let src: &[u8; U] = tile[s..s + U].try_into().unwrap_or(&[0; U]);
            out[o..o + U].copy_from_slice(src);
            o += U;
        }
    }
}

/// Packs one block (see `gemm::pack_block_ref`); `nb` rows are present.
pub fn pack_block(kind: GemmKind, p: GemmParams, src: Dtype, k: usize, rows: &[u8], nb: usize, out: &mut [u8]) {
    let nr = p.nr as usize;
    let e = kind.elem_size();
    let kp = p.padded_k(k);
    let se = src_size(src);
    let scales_at = nr * 4 + nr * kp;
    TILE.with(|t| {
        let mut tile = t.borrow_mut();
        tile.clear();
        tile.resize(nr * kp * e, 0);
        for i in 0..nr {
            let (scale, sum) = if i < nb {
                convert_row(kind, src, &rows[i * k * se..(i + 1) * k * se], k, &mut tile[i * kp * e..(i + 1) * kp * e])
            } else {
                (0.0, 0)
            };
            if kind == GemmKind::Qc8w {
                out[4 * i..4 * i + 4].copy_from_slice(&(-sum).to_le_bytes());
                out[scales_at + 4 * i..scales_at + 4 * i + 4].copy_from_slice(&scale.to_le_bytes());
            }
        }
        let wo = kind.weights_offset(p);
        let weights = &mut out[wo..wo + nr * kp * e];
        let (sr, units) = (p.sr as usize, kp / p.kr as usize);
        match p.kr as usize * e {
            1 => interleave::<1>(&tile, nr, sr, units, weights),
            2 => interleave::<2>(&tile, nr, sr, units, weights),
            4 => interleave::<4>(&tile, nr, sr, units, weights),
            8 => interleave::<8>(&tile, nr, sr, units, weights),
            16 => interleave::<16>(&tile, nr, sr, units, weights),
            _ => interleave::<32>(&tile, nr, sr, units, weights),
        }
    });
}
