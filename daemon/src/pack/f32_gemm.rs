//! `f32-gemm`: the scalar reference packer and consumer.
//!
//! Byte layout (docs/LAYOUTS.md is normative): for each block of `nr` output channels,
//! `nr` f32 bias values, then for `k0` in `(0..round_up(K, kr·sr)).step_by(kr)`, for each
//! lane `i` in `0..nr`, `kr` values `W[n0+i][kb+j]` with
//! `kb = round_down(k0, kr·sr) + ((k0 + i·kr) mod (kr·sr))`; zero where `kb+j ≥ K` or
//! `n0+i ≥ N`. All values little-endian.

use super::layout::GemmParams;

/// Bytes of one nr-block for K input channels.
pub fn block_len(p: GemmParams, k: usize) -> usize {
    p.nr as usize * 4 * (1 + p.padded_k(k))
}

/// Packs one block: `rows` holds `rows.len() / (4·k)` consecutive source rows (at most
/// nr) as little-endian f32 bytes; `out` is exactly [`block_len`] bytes. The block's `nr`
/// bias slots are left untouched (a fresh memfd is zero; [`write_bias`] fills them, before or
/// after this call), every weight slot is written, padding included.
pub fn pack_block(p: GemmParams, k: usize, rows: &[u8], out: &mut [u8]) {
    let nr = p.nr as usize;
    let kr = p.kr as usize;
    let skr = p.skr();
    let nb = if k == 0 { 0 } else { rows.len() / (4 * k) };
    debug_assert!(nb <= nr && out.len() == block_len(p, k));
    let mut o = nr * 4;
    for k0 in (0..p.padded_k(k)).step_by(kr) {
        let base = k0 - k0 % skr;
        for i in 0..nr {
            let kb = base + (k0 + i * kr) % skr;
            for j in 0..kr {
                let kk = kb + j;
                let dst = &mut out[o..o + 4];
                if i < nb && kk < k {
                    let s = (i * k + kk) * 4;
                    dst.copy_from_slice(&rows[s..s + 4]);
                } else {
                    dst.fill(0);
                }
                o += 4;
            }
        }
    }
}

/// Writes bias values (little-endian f32 bytes, N of them) into the bias slots of every
/// block of a packed `[n, k]` weight in `packed`.
pub fn write_bias(p: GemmParams, k: usize, bias: &[u8], packed: &mut [u8]) {
    let nr = p.nr as usize;
    let bl = block_len(p, k);
    for (b, chunk) in bias.chunks(nr * 4).enumerate() {
        packed[b * bl..b * bl + chunk.len()].copy_from_slice(chunk);
    }
}

/// Reference consumer: `y[m][n] = Σ_k x[m][k] · W[n][k] + b[n]` reading W and b from the
/// packed bytes of a `[n, k]` weight. `x` is `m × k`, row-major; returns `m × n`.
/// Accumulates in f64 so that it serves as an accuracy reference.
pub fn gemm(p: GemmParams, n: usize, k: usize, packed: &[u8], x: &[f32], m: usize) -> Vec<f32> {
    let nr = p.nr as usize;
    let kr = p.kr as usize;
    let skr = p.skr();
    let bl = block_len(p, k);
    let f = |off: usize| f32::from_le_bytes([packed[off], packed[off + 1], packed[off + 2], packed[off + 3]]);
    let mut y = vec![0f32; m * n];
    for blk in 0..p.blocks(n) {
        let base = blk * bl;
        for row in 0..m {
            let mut acc = [0f64; 64];
            for (i, a) in acc.iter_mut().enumerate().take(nr) {
                *a = f64::from(f(base + i * 4));
            }
            let mut o = base + nr * 4;
            for k0 in (0..p.padded_k(k)).step_by(kr) {
                let kb0 = k0 - k0 % skr;
                for (i, a) in acc.iter_mut().enumerate().take(nr) {
                    let kb = kb0 + (k0 + i * kr) % skr;
                    for j in 0..kr {
                        if kb + j < k {
                            *a += f64::from(f(o)) * f64::from(x[row * k + kb + j]);
                        }
                        o += 4;
                    }
                }
            }
            for (i, a) in acc.iter().enumerate().take(nr) {
                let col = blk * nr + i;
                if col < n {
                    #[allow(clippy::cast_possible_truncation)]
                    let v = *a as f32;
                    y[row * n + col] = v;
                }
            }
        }
    }
    y
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)]
mod tests {
    use super::*;
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
                        out.push(if n0 + i < n && kb + j < k {
                            w[(n0 + i) * k + kb + j]
                        } else {
                            0.0
                        });
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
        let bl = block_len(p, k);
        // Weight slots start as garbage (the packer must write padding); bias slots start
        // zeroed like a fresh memfd.
        let mut out = vec![0xAAu8; p.blocks(n) * bl];
        let nr = p.nr as usize;
        for blk in 0..p.blocks(n) {
            out[blk * bl..blk * bl + nr * 4].fill(0);
        }
        if let Some(b) = b {
            // Bias before weights, as when `X.bias` precedes `X.weight` in the file.
            let bb: Vec<u8> = b.iter().flat_map(|v| v.to_le_bytes()).collect();
            write_bias(p, k, &bb, &mut out);
        }
        for blk in 0..p.blocks(n) {
            let rows = &bytes[blk * nr * k * 4..((blk * nr + nr).min(n)) * k * 4];
            pack_block(p, k, rows, &mut out[blk * bl..(blk + 1) * bl]);
        }
        out
    }

    fn params() -> impl Strategy<Value = GemmParams> {
        (0..5usize, 0..4usize, 0..3usize)
            .prop_map(|(a, b, c)| GemmParams {
                nr: super::super::layout::NR_VALUES[a],
                kr: super::super::layout::KR_VALUES[b],
                sr: super::super::layout::SR_VALUES[c],
            })
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
                    assert_eq!(
                        pack_all(p, n, k, &w, None),
                        spec_reference(p, n, k, &w, None),
                        "{p:?} n={n} k={k}"
                    );
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
        let got: Vec<f32> = pack_all(p, 2, 4, &w, None)
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
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
            let y = gemm(p, n, k, &packed, &x, 2);
            for r in 0..2 {
                for c in 0..n {
                    let want: f64 = (0..k).map(|kk| f64::from(x[r * k + kk]) * f64::from(w[c * k + kk])).sum::<f64>() + f64::from(b[c]);
                    let got = f64::from(y[r * n + c]);
                    prop_assert!((got - want).abs() <= 1e-5 * want.abs().max(1.0), "{} vs {}", got, want);
                }
            }
        }
    }
}
