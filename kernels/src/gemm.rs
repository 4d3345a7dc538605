//! GEMM layouts: the scalar reference packer, the bias writer and the reference consumer.
//!
//! Byte layout (docs/LAYOUTS.md is normative). For each block of `nr` output channels:
//! float kinds: `nr` bias values, then the interleaved weights; `qc8w`: `nr` × i32 `−Σq`,
//! the interleaved int8 weights, `nr` × f32 scale, `nr` × f32 bias. The interleave: for `k0`
//! in `(0..round_up(K, kr·sr)).step_by(kr)`, for each lane `i` in `0..nr`, `kr` values
//! `W[n0+i][kb+j]` with `kb = round_down(k0, kr·sr) + ((k0 + i·kr) mod (kr·sr))`; zero where
//! `kb+j ≥ K` or `n0+i ≥ N`. All values little-endian.
//!
//! This module is the specification in code: the SIMD kernels must produce the same bytes.

use crate::convert::{self, amax_step, f32_to_bf16, f32_to_f16, load_f32, quantize, row_scale};
use crate::dtype::Dtype;
use crate::params::{GemmKind, GemmParams};

/// Bytes per source element (F32, F16 or BF16).
pub fn src_size(dtype: Dtype) -> usize {
    if dtype == Dtype::F32 { 4 } else { 2 }
}

/// Raw little-endian bits of source element `i`, widened to u32.
fn raw_bits(dtype: Dtype, rows: &[u8], i: usize) -> u32 {
    match src_size(dtype) {
        4 => u32::from_le_bytes([rows[4 * i], rows[4 * i + 1], rows[4 * i + 2], rows[4 * i + 3]]),
        _ => u32::from(u16::from_le_bytes([rows[2 * i], rows[2 * i + 1]])),
    }
}

/// The packed bits of one weight (before quantisation for qc8w).
#[inline]
fn convert_bits(kind: GemmKind, src: Dtype, rows: &[u8], i: usize) -> u32 {
    match (kind, src) {
        (GemmKind::F32, Dtype::F32) | (GemmKind::F16, Dtype::F16) | (GemmKind::Bf16, Dtype::Bf16) => {
            raw_bits(src, rows, i)
        }
        (GemmKind::F32, _) => load_f32(src, rows, i).to_bits(),
        (GemmKind::F16, _) => u32::from(f32_to_f16(load_f32(src, rows, i))),
        (GemmKind::Bf16, _) => u32::from(f32_to_bf16(load_f32(src, rows, i))),
        (GemmKind::Qc8w, _) => 0,
    }
}

/// Scalar reference: packs one block. `rows` holds the block's `rows.len() / (K · size)`
/// source rows (at most nr) in dtype `src`; `out` is exactly `kind.block_len(p, k)` bytes.
/// Every byte of the block is written except the bias slots, which [`write_bias`] fills
/// (a fresh memfd is zero, so a model without bias needs nothing more).
pub fn pack_block_ref(kind: GemmKind, p: GemmParams, src: Dtype, k: usize, rows: &[u8], out: &mut [u8]) {
    let nr = p.nr as usize;
    let kr = p.kr as usize;
    let skr = p.skr();
    let e = kind.elem_size();
    let nb = if k == 0 { 0 } else { rows.len() / (k * src_size(src)) };
    debug_assert!(nb <= nr && out.len() == kind.block_len(p, k));

    let mut inv = [0f32; 64];
    let mut sums = [0i32; 64];
    let scales_at = nr * 4 + nr * p.padded_k(k);
    if kind == GemmKind::Qc8w {
        for i in 0..nr {
            let scale = if i < nb {
                let amax = (0..k).fold(0f32, |m, kk| amax_step(m, load_f32(src, rows, i * k + kk)));
                let (scale, v) = row_scale(amax);
                inv[i] = v;
                scale
            } else {
                0.0
            };
            out[scales_at + 4 * i..scales_at + 4 * i + 4].copy_from_slice(&scale.to_le_bytes());
        }
    }
    let mut o = kind.weights_offset(p);
    for k0 in (0..p.padded_k(k)).step_by(kr) {
        let base = k0 - k0 % skr;
        for i in 0..nr {
            let kb = base + (k0 + i * kr) % skr;
            for j in 0..kr {
                let kk = kb + j;
                let valid = i < nb && kk < k;
                let at = i * k + kk;
                if kind == GemmKind::Qc8w {
                    let q = if valid { quantize(load_f32(src, rows, at), inv[i]) } else { 0 };
                    sums[i] += i32::from(q);
                    out[o] = q.to_le_bytes()[0];
                } else {
                    let bits = if valid { convert_bits(kind, src, rows, at) } else { 0 };
                    out[o..o + e].copy_from_slice(&bits.to_le_bytes()[..e]);
                }
                o += e;
            }
        }
    }
    if kind == GemmKind::Qc8w {
        for (i, s) in sums.iter().take(nr).enumerate() {
            out[4 * i..4 * i + 4].copy_from_slice(&(-s).to_le_bytes());
        }
    }
}

/// Writes a bias (N values of dtype `src`, little endian) into the bias slots of every block
/// of a packed `[N, K]` weight, converted to the layout's bias type (the element type; f32
/// for qc8w).
pub fn write_bias(kind: GemmKind, p: GemmParams, k: usize, src: Dtype, bias: &[u8], packed: &mut [u8]) {
    let nr = p.nr as usize;
    let bl = kind.block_len(p, k);
    let at = kind.bias_offset(p, k);
    let n = bias.len() / src_size(src);
    let e = if kind == GemmKind::Qc8w { 4 } else { kind.elem_size() };
    for i in 0..n {
        let bits = match kind {
            GemmKind::Qc8w => load_f32(src, bias, i).to_bits(),
            _ => convert_bits(kind, src, bias, i),
        };
        let o = (i / nr) * bl + at + (i % nr) * e;
        packed[o..o + e].copy_from_slice(&bits.to_le_bytes()[..e]);
    }
}

/// Reads packed element `idx` of the weight area as f32 (not for qc8w).
fn packed_f32(kind: GemmKind, packed: &[u8], off: usize) -> f32 {
    match kind {
        GemmKind::F32 => f32::from_le_bytes([packed[off], packed[off + 1], packed[off + 2], packed[off + 3]]),
        GemmKind::F16 => convert::f16_to_f32(u16::from_le_bytes([packed[off], packed[off + 1]])),
        GemmKind::Bf16 => convert::bf16_to_f32(u16::from_le_bytes([packed[off], packed[off + 1]])),
        GemmKind::Qc8w => f32::from(i8::from_le_bytes([packed[off]])),
    }
}

/// Reference consumer: `y[m][n] = Σ_k x[m][k] · W[n][k] + b[n]` reading W and b from the
/// packed bytes of a `[n, k]` weight (for qc8w, `W[n][k] = q[n][k] · scale[n]`). `x` is
/// `m × k`, row-major; returns `m × n`. Accumulates in f64 to serve as an accuracy reference;
/// a real kernel walks the same addresses.
pub fn gemm(kind: GemmKind, p: GemmParams, n: usize, k: usize, packed: &[u8], x: &[f32], m: usize) -> Vec<f32> {
    let nr = p.nr as usize;
    let kr = p.kr as usize;
    let skr = p.skr();
    let e = kind.elem_size();
    let bl = kind.block_len(p, k);
    let kp = p.padded_k(k);
    let f32_at = |off: usize| f32::from_le_bytes([packed[off], packed[off + 1], packed[off + 2], packed[off + 3]]);
    let mut y = vec![0f32; m * n];
    for blk in 0..p.blocks(n) {
        let base = blk * bl;
        let (bias_at, bias_e) = (base + kind.bias_offset(p, k), if kind == GemmKind::Qc8w { 4 } else { e });
        for row in 0..m {
            let mut acc = [0f64; 64];
            let mut o = base + kind.weights_offset(p);
            for k0 in (0..kp).step_by(kr) {
                let kb0 = k0 - k0 % skr;
                for (i, a) in acc.iter_mut().enumerate().take(nr) {
                    let kb = kb0 + (k0 + i * kr) % skr;
                    for j in 0..kr {
                        if kb + j < k {
                            *a += f64::from(packed_f32(kind, packed, o)) * f64::from(x[row * k + kb + j]);
                        }
                        o += e;
                    }
                }
            }
            for (i, a) in acc.iter().enumerate().take(nr) {
                let col = blk * nr + i;
                if col >= n {
                    continue;
                }
                let bias = match kind {
                    GemmKind::Qc8w | GemmKind::F32 => f64::from(f32_at(bias_at + i * bias_e)),
                    _ => f64::from(packed_f32(kind, packed, bias_at + i * bias_e)),
                };
                let scaled = if kind == GemmKind::Qc8w {
                    let scales_at = base + nr * 4 + nr * kp;
                    *a * f64::from(f32_at(scales_at + 4 * i))
                } else {
                    *a
                };
                #[allow(clippy::cast_possible_truncation)]
                let v = (scaled + bias) as f32;
                y[row * n + col] = v;
            }
        }
    }
    y
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)]
mod tests {
    use super::*;
    use crate::params::{KR_VALUES, NR_VALUES, SR_VALUES};
    use proptest::prelude::*;

    /// A second, independent reading of the spec: index arithmetic straight from the text,
    /// producing f32 values (then bytes), one output position at a time.
    fn spec_reference(p: GemmParams, n: usize, k: usize, w: &[f32], b: Option<&[f32]>) -> Vec<u8> {
        let (nr, kr, sr) = (p.nr as usize, p.kr as usize, p.sr as usize);
        let kpad = k.div_ceil(kr * sr) * (kr * sr);
        let mut out: Vec<f32> = Vec::new();
        let mut n0 = 0;
        while n0 < n {
            for i in 0..nr {
                out.push(match b {
                    Some(b) if n0 + i < n => b[n0 + i],
                    _ => 0.0,
                });
            }
            let mut k0 = 0;
            while k0 < kpad {
                for i in 0..nr {
                    let kb = (k0 / (kr * sr)) * (kr * sr) + ((k0 + i * kr) % (kr * sr));
                    for j in 0..kr {
                        out.push(if n0 + i < n && kb + j < k { w[(n0 + i) * k + kb + j] } else { 0.0 });
                    }
                }
                k0 += kr;
            }
            n0 += nr;
        }
        out.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    fn pack_all(p: GemmParams, n: usize, k: usize, w: &[f32], b: Option<&[f32]>) -> Vec<u8> {
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let bb: Option<Vec<u8>> = b.map(|b| b.iter().flat_map(|v| v.to_le_bytes()).collect());
        pack_kind(GemmKind::F32, p, Dtype::F32, n, k, &bytes, bb.as_deref())
    }

    /// Packs a whole `[n, k]` weight of dtype `src` the way the pack job does.
    pub(crate) fn pack_kind(
        kind: GemmKind,
        p: GemmParams,
        src: Dtype,
        n: usize,
        k: usize,
        bytes: &[u8],
        b: Option<&[u8]>,
    ) -> Vec<u8> {
        let bl = kind.block_len(p, k);
        let se = src_size(src);
        // Weight slots start as garbage (the packer must write padding); bias slots start
        // zeroed like a fresh memfd.
        let mut out = vec![0xAAu8; p.blocks(n) * bl];
        let nr = p.nr as usize;
        let (at, be) = (kind.bias_offset(p, k), if kind == GemmKind::Qc8w { 4 } else { kind.elem_size() });
        for blk in 0..p.blocks(n) {
            out[blk * bl + at..blk * bl + at + nr * be].fill(0);
        }
        if let Some(b) = b {
            // Bias before weights, as when `X.bias` precedes `X.weight` in the file.
            write_bias(kind, p, k, src, b, &mut out);
        }
        for blk in 0..p.blocks(n) {
            let rows = &bytes[blk * nr * k * se..((blk * nr + nr).min(n)) * k * se];
            pack_block_ref(kind, p, src, k, rows, &mut out[blk * bl..(blk + 1) * bl]);
        }
        out
    }

    pub(crate) fn params() -> impl Strategy<Value = GemmParams> {
        (0..5usize, 0..4usize, 0..3usize)
            .prop_map(|(a, b, c)| GemmParams { nr: NR_VALUES[a], kr: KR_VALUES[b], sr: SR_VALUES[c] })
            .prop_filter("nr multiple of sr", |p| p.nr % p.sr == 0)
    }

    #[test]
    fn odd_shapes_match_the_spec() {
        let dims = [1usize, 3, 17, 64, 129];
        for p in [
            GemmParams { nr: 16, kr: 1, sr: 1 },
            GemmParams { nr: 8, kr: 2, sr: 4 },
            GemmParams { nr: 4, kr: 4, sr: 1 },
            GemmParams { nr: 32, kr: 8, sr: 2 },
            GemmParams { nr: 64, kr: 1, sr: 4 },
        ] {
            for &n in &dims {
                for &k in &dims {
                    let w: Vec<f32> = (0..n * k).map(|i| i as f32 + 0.5).collect();
                    let b: Vec<f32> = (0..n).map(|i| -(i as f32) - 1.0).collect();
                    assert_eq!(
                        pack_all(p, n, k, &w, Some(&b)),
                        spec_reference(p, n, k, &w, Some(&b)),
                        "{p:?} n={n} k={k}"
                    );
                    assert_eq!(pack_all(p, n, k, &w, None), spec_reference(p, n, k, &w, None), "{p:?} n={n} k={k}");
                }
            }
        }
    }

    #[test]
    fn tiny_example_bytes() {
        // N=3, K=3, nr=4, kr=2, sr=1: one block, K padded to 4.
        let p = GemmParams { nr: 4, kr: 2, sr: 1 };
        let w = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0];
        let got: Vec<f32> = pack_all(p, 3, 3, &w, Some(&[10.0, 20.0, 30.0]))
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        #[rustfmt::skip]
        let want = [10.0, 20.0, 30.0, 0.0,
                    1.0, 2.0, 4.0, 5.0, 7.0, 8.0, 0.0, 0.0,
                    3.0, 0.0, 6.0, 0.0, 9.0, 0.0, 0.0, 0.0];
        assert_eq!(got, want);
    }

    #[test]
    fn shuffled_example_from_layouts_md() {
        // N=2, K=4, nr=4, kr=1, sr=2: lanes rotate within groups of kr·sr = 2 columns.
        let p = GemmParams { nr: 4, kr: 1, sr: 2 };
        let w = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        let got: Vec<f32> =
            pack_all(p, 2, 4, &w, None).chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        #[rustfmt::skip]
        let want = [0.0, 0.0, 0.0, 0.0,
                    1.0, 6.0, 0.0, 0.0,  2.0, 5.0, 0.0, 0.0,  3.0, 8.0, 0.0, 0.0,  4.0, 7.0, 0.0, 0.0];
        assert_eq!(got, want);
    }

    proptest! {
        #[test]
        fn any_shape_matches_the_spec_and_the_consumer_multiplies(p in params(), n in 1usize..80, k in 1usize..80, seed in any::<u32>()) {
            let w: Vec<f32> = (0..n * k).map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / 1e9 - 2.0).collect();
            let b: Vec<f32> = (0..n).map(|i| i as f32 * 0.25).collect();
            let packed = pack_all(p, n, k, &w, Some(&b));
            prop_assert_eq!(&packed, &spec_reference(p, n, k, &w, Some(&b)));
            let x: Vec<f32> = (0..2 * k).map(|i| (i % 7) as f32 - 3.0).collect();
            let y = gemm(GemmKind::F32, p, n, k, &packed, &x, 2);
            for r in 0..2 {
                for c in 0..n {
                    let want: f64 = (0..k).map(|kk| f64::from(x[r * k + kk]) * f64::from(w[c * k + kk])).sum::<f64>() + f64::from(b[c]);
                    let got = f64::from(y[r * n + c]);
                    prop_assert!((got - want).abs() <= 1e-5 * want.abs().max(1.0), "{} vs {}", got, want);
                }
            }
        }
    }

    /// Per-element error bound of a kind relative to |W| (unit roundoff), and whether the
    /// bound is per-row absolute (qc8w: half a quantisation step).
    fn check_accuracy(
        kind: GemmKind,
        n: usize,
        k: usize,
        w: &[f32],
        b: &[f32],
        packed: &[u8],
        p: GemmParams,
    ) -> Result<(), TestCaseError> {
        let x: Vec<f32> = (0..k).map(|i| ((i * 7919) % 13) as f32 / 6.0 - 1.0).collect();
        let y = gemm(kind, p, n, k, packed, &x, 1);
        for c in 0..n {
            let row = &w[c * k..(c + 1) * k];
            let exact: f64 =
                row.iter().zip(&x).map(|(w, x)| f64::from(*w) * f64::from(*x)).sum::<f64>() + f64::from(b[c]);
            let sum_abs: f64 = row.iter().zip(&x).map(|(w, x)| (f64::from(*w) * f64::from(*x)).abs()).sum();
            let xabs: f64 = x.iter().map(|v| f64::from(v.abs())).sum();
            let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            let bound = match kind {
                GemmKind::F32 => 1e-6 * (sum_abs + f64::from(b[c].abs())),
                GemmKind::F16 => 2f64.powi(-11) * (sum_abs + f64::from(b[c].abs())) + 2f64.powi(-24) * (xabs + 1.0),
                GemmKind::Bf16 => 2f64.powi(-8) * (sum_abs + f64::from(b[c].abs())),
                GemmKind::Qc8w => f64::from(amax) / 254.0 * xabs * (1.0 + 1e-6) + 1e-6 * sum_abs,
            } + 1e-6;
            let err = (f64::from(y[c]) - exact).abs();
            prop_assert!(err <= bound, "{:?} col {}: err {} > bound {}", kind, c, err, bound);
        }
        Ok(())
    }

    proptest! {
        #[test]
        fn every_kind_multiplies_within_its_bound(p in params(), n in 1usize..40, k in 1usize..70, kind in 0usize..4, src in 0usize..3, seed in any::<u32>()) {
            let kind = GemmKind::ALL[kind];
            let src = [Dtype::F32, Dtype::F16, Dtype::Bf16][src];
            let raw: Vec<f32> = (0..n * k).map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / 2e9 - 1.0).collect();
            let bias: Vec<f32> = (0..n).map(|i| i as f32 * 0.125 - 1.0).collect();
            // Express the source in its dtype; the exact values are what that dtype holds.
            let enc = |v: &[f32]| -> (Vec<u8>, Vec<f32>) {
                match src {
                    Dtype::F32 => (v.iter().flat_map(|x| x.to_le_bytes()).collect(), v.to_vec()),
                    Dtype::F16 => (v.iter().flat_map(|x| f32_to_f16(*x).to_le_bytes()).collect(), v.iter().map(|x| convert::f16_to_f32(f32_to_f16(*x))).collect()),
                    _ => (v.iter().flat_map(|x| f32_to_bf16(*x).to_le_bytes()).collect(), v.iter().map(|x| convert::bf16_to_f32(f32_to_bf16(*x))).collect()),
                }
            };
            let (wb, w) = enc(&raw);
            let (bb, b) = enc(&bias);
            let packed = pack_kind(kind, p, src, n, k, &wb, Some(&bb));
            prop_assert_eq!(packed.len() as u64, (kind.block_len(p, k) * p.blocks(n)) as u64);
            check_accuracy(kind, n, k, &w, &b, &packed, p)?;
        }
    }

    #[test]
    fn qc8w_block_layout_by_hand() {
        // N=2, K=3, nr=4, kr=1, sr=1: rows [1, -2, 0.5] and [0, 0, 0].
        let p = GemmParams { nr: 4, kr: 1, sr: 1 };
        let w = [1.0f32, -2.0, 0.5, 0.0, 0.0, 0.0];
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let bias: Vec<u8> = [0.5f32, -0.5].iter().flat_map(|v| v.to_le_bytes()).collect();
        let out = pack_kind(GemmKind::Qc8w, p, Dtype::F32, 2, 3, &bytes, Some(&bias));
        // q row 0 = round_even([1, -2, 0.5] · 63.5) = [64 (63.5 → even), -127, 32 (31.75)]
        let sums: Vec<i32> = out[..16].chunks(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(sums, [-(64 - 127 + 32), 0, 0, 0]);
        let q: Vec<i8> = out[16..28].iter().map(|b| *b as i8).collect();
        assert_eq!(q, [64, 0, 0, 0, -127, 0, 0, 0, 32, 0, 0, 0]);
        let f = |o: usize| f32::from_le_bytes(out[o..o + 4].try_into().unwrap());
        assert_eq!((f(28), f(32), f(36), f(40)), (2.0 / 127.0, 0.0, 0.0, 0.0));
        assert_eq!((f(44), f(48), f(52), f(56)), (0.5, -0.5, 0.0, 0.0));
        assert_eq!(out.len(), 60);
    }
}
