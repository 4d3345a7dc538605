//! aarch64 Advanced SIMD kernel (4 lanes) for `kr = 1`, `nr` a multiple of 4.
//!
//! Same structure as the x86 kernels: load 4 rows × 4 columns as 32-bit lanes, transpose,
//! rotate per `sr`, convert, store. F16 conversions go through the bit-exact scalar helpers
//! lane by lane (Rust's f16 vector types are not stable yet); everything else is NEON.

use std::arch::aarch64::*;

use crate::convert::{self, row_scale};
use crate::dtype::Dtype;
use crate::gemm::src_size;
use crate::params::{GemmKind, GemmParams};

/// Packs one block if the parameters have a NEON path; returns false otherwise.
pub fn pack_block(kind: GemmKind, p: GemmParams, src: Dtype, k: usize, rows: &[u8], nb: usize, out: &mut [u8]) -> bool {
    if p.kr != 1 || !p.nr.is_multiple_of(4) {
        return false;
    }
    assert_eq!(rows.len(), nb * k * src_size(src));
    assert_eq!(out.len(), kind.block_len(p, k));
    // SAFETY: NEON is part of the aarch64 baseline; the buffer sizes were checked above.
    unsafe { pack(kind, p, src, k, rows, nb, out) };
    true
}

/// Loads `width` (≤ 4) elements of `src` into 32-bit lanes, zero elsewhere.
///
/// # Safety
/// `ptr` must be valid for reading `width` elements of `src`.
#[target_feature(enable = "neon")]
unsafe fn load(src: Dtype, ptr: *const u8, width: usize) -> uint32x4_t {
    let se = src_size(src);
    let mut buf = [0u8; 16];
    // SAFETY: the caller guarantees `width · se ≤ 16` readable bytes at `ptr`.
    unsafe { std::ptr::copy_nonoverlapping(ptr, buf.as_mut_ptr(), width.min(4) * se) };
    if se == 4 {
        // SAFETY: `buf` holds 16 bytes = 4 u32.
        unsafe { vld1q_u32(buf.as_ptr().cast()) }
    } else {
        // SAFETY: `buf` holds at least 8 bytes = 4 u16.
        vmovl_u16(unsafe { vld1_u16(buf.as_ptr().cast()) })
    }
}

#[target_feature(enable = "neon")]
fn lanes(v: uint32x4_t) -> [u32; 4] {
    let mut a = [0u32; 4];
    // SAFETY: `a` holds 4 u32.
    unsafe { vst1q_u32(a.as_mut_ptr(), v) };
    a
}

#[target_feature(enable = "neon")]
fn from_lanes(a: [u32; 4]) -> uint32x4_t {
    // SAFETY: `a` holds 4 u32.
    unsafe { vld1q_u32(a.as_ptr()) }
}

#[target_feature(enable = "neon")]
fn to_f32_bits(src: Dtype, w: uint32x4_t) -> uint32x4_t {
    match src {
        Dtype::F16 => from_lanes(lanes(w).map(|b| convert::f16_to_f32(u16::try_from(b).unwrap_or(0)).to_bits())),
        Dtype::Bf16 => vshlq_n_u32::<16>(w),
        _ => w,
    }
}

#[target_feature(enable = "neon")]
fn bf16_rne(b: uint32x4_t) -> uint32x4_t {
    let lsb = vandq_u32(vshrq_n_u32::<16>(b), vdupq_n_u32(1));
    let rounded = vshrq_n_u32::<16>(vaddq_u32(b, vaddq_u32(vdupq_n_u32(0x7FFF), lsb)));
    let nan = vcgtq_u32(vandq_u32(b, vdupq_n_u32(0x7FFF_FFFF)), vdupq_n_u32(0x7F80_0000));
    let quiet = vorrq_u32(vshrq_n_u32::<16>(b), vdupq_n_u32(0x40));
    vbslq_u32(nan, quiet, rounded)
}

#[target_feature(enable = "neon")]
fn transpose(r: &mut [uint32x4_t; 4]) {
    let t0 = vtrn1q_u32(r[0], r[1]);
    let t1 = vtrn2q_u32(r[0], r[1]);
    let t2 = vtrn1q_u32(r[2], r[3]);
    let t3 = vtrn2q_u32(r[2], r[3]);
    let q = |v: uint32x4_t| vreinterpretq_u64_u32(v);
    r[0] = vreinterpretq_u32_u64(vtrn1q_u64(q(t0), q(t2)));
    r[1] = vreinterpretq_u32_u64(vtrn1q_u64(q(t1), q(t3)));
    r[2] = vreinterpretq_u32_u64(vtrn2q_u64(q(t0), q(t2)));
    r[3] = vreinterpretq_u32_u64(vtrn2q_u64(q(t1), q(t3)));
}

/// # Safety
/// Buffer sizes as checked by `pack_block`.
#[target_feature(enable = "neon")]
unsafe fn pack(kind: GemmKind, p: GemmParams, src: Dtype, k: usize, rows: &[u8], nb: usize, out: &mut [u8]) {
    let (nr, sr, kp) = (p.nr as usize, p.sr as usize, p.padded_k(k));
    let se = src_size(src);
    let e = kind.elem_size();
    let wo = kind.weights_offset(p);
    let scales_at = nr * 4 + nr * kp;
    // masks[m][j]: lane r takes column j of its group when col mod sr = m.
    let masks: [[uint32x4_t; 4]; 4] = std::array::from_fn(|m| {
        std::array::from_fn(|j| {
            from_lanes(std::array::from_fn(|r| if sr > 0 && (m + r) % sr == j { u32::MAX } else { 0 }))
        })
    });
    for g in (0..nr).step_by(4) {
        let mut inv = [0f32; 4];
        if kind == GemmKind::Qc8w {
            for (r, slot) in inv.iter_mut().enumerate() {
                let row = g + r;
                let amax = (row < nb).then(|| {
                    let mut m = vdupq_n_f32(0.0);
                    for c0 in (0..k).step_by(4) {
                        // SAFETY: row < nb: the row's k elements are in `rows`.
                        let w = unsafe { load(src, rows.as_ptr().add((row * k + c0) * se), (k - c0).min(4)) };
                        let a = vabsq_f32(vreinterpretq_f32_u32(to_f32_bits(src, w)));
                        // FMAXNM turns a signalling NaN into NaN, which would erase the lane's
                        // maximum so far: zero NaN lanes first (the reference ignores NaNs).
                        let a = vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(a), vceqq_f32(a, a)));
                        m = vmaxq_f32(a, m);
                    }
                    lanes(vreinterpretq_u32_f32(m)).iter().fold(0f32, |a, &b| convert::amax_step(a, f32::from_bits(b)))
                });
                let (scale, v) = amax.map_or((0.0, 0.0), row_scale);
                *slot = v;
                out[scales_at + 4 * row..scales_at + 4 * row + 4].copy_from_slice(&scale.to_le_bytes());
            }
        }
        // SAFETY: `inv` holds 4 f32.
        let inv_v = unsafe { vld1q_f32(inv.as_ptr()) };
        let mut sums = vdupq_n_s32(0);
        for c0 in (0..kp).step_by(4) {
            let width = k.saturating_sub(c0).min(4);
            let mut v = [vdupq_n_u32(0); 4];
            for (r, slot) in v.iter_mut().enumerate() {
                let row = g + r;
                if row < nb && width > 0 {
                    // SAFETY: row < nb and c0 + width ≤ k: the elements are in `rows`.
                    *slot = unsafe { load(src, rows.as_ptr().add((row * k + c0) * se), width) };
                }
            }
            transpose(&mut v);
            for c in 0..4.min(kp - c0) {
                let col = c0 + c;
                let w = if sr == 1 {
                    v[c]
                } else {
                    let (base, m) = (c - c % sr, col % sr);
                    let mut w = v[base];
                    for j in 1..sr {
                        w = vbslq_u32(masks[m][j], v[base + j], w);
                    }
                    w
                };
                let at = wo + (col * nr + g) * e;
                let dst = &mut out[at..at + 4 * e];
                match (kind, src) {
                    (GemmKind::F32, _) => {
                        for (d, b) in dst.chunks_exact_mut(4).zip(lanes(to_f32_bits(src, w))) {
                            d.copy_from_slice(&b.to_le_bytes());
                        }
                    }
                    (GemmKind::F16, Dtype::F16) | (GemmKind::Bf16, Dtype::Bf16) => {
                        // SAFETY: `dst` has 8 bytes = 4 u16.
                        unsafe { vst1_u16(dst.as_mut_ptr().cast(), vmovn_u32(w)) }
                    }
                    (GemmKind::F16, _) => {
                        let bits = lanes(to_f32_bits(src, w));
                        for (d, b) in dst.chunks_exact_mut(2).zip(bits) {
                            d.copy_from_slice(&convert::f32_to_f16(f32::from_bits(b)).to_le_bytes());
                        }
                    }
                    (GemmKind::Bf16, _) => {
                        // SAFETY: `dst` has 8 bytes = 4 u16.
                        unsafe { vst1_u16(dst.as_mut_ptr().cast(), vmovn_u32(bf16_rne(to_f32_bits(src, w)))) }
                    }
                    (GemmKind::Qc8w, _) => {
                        let t = vmulq_f32(vreinterpretq_f32_u32(to_f32_bits(src, w)), inv_v);
                        let r = vrndnq_f32(t);
                        let r = vminq_f32(vmaxq_f32(r, vdupq_n_f32(-127.0)), vdupq_n_f32(127.0));
                        // FCVTZS turns NaN into 0, as the reference does; r is integral.
                        let q = vcvtq_s32_f32(r);
                        sums = vaddq_s32(sums, q);
                        let n16 = vmovn_s32(q);
                        let n8 = vmovn_s16(vcombine_s16(n16, n16));
                        let mut b = [0i8; 8];
                        // SAFETY: `b` holds 8 i8.
                        unsafe { vst1_s8(b.as_mut_ptr(), n8) };
                        for (d, q) in dst.iter_mut().zip(b) {
                            *d = q.to_le_bytes()[0];
                        }
                    }
                }
            }
        }
        if kind == GemmKind::Qc8w {
            let mut s = [0i32; 4];
            // SAFETY: `s` holds 4 i32.
            unsafe { vst1q_s32(s.as_mut_ptr(), sums) };
            for (r, sum) in s.iter().enumerate() {
                out[4 * (g + r)..4 * (g + r) + 4].copy_from_slice(&(-sum).to_le_bytes());
            }
        }
    }
}
