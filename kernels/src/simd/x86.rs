//! x86_64 kernels: AVX-512 (16 lanes) and AVX2 + F16C (8 lanes) for `kr = 1`.
//!
//! One block is packed in groups of L rows (L = 16 or 8, `nr` a multiple of L). For each
//! tile of L columns, L row vectors are loaded (source elements widened to 32-bit lanes),
//! transposed so that each vector holds one column across the L rows, rotated per `sr`
//! (lane i of output column c takes column `c − c mod sr + (c + i) mod sr`), converted to
//! the layout's element type and stored. Conversions follow `convert` bit for bit.
//!
//! AVX2 with 16 whole rows, `sr = 1`, converts f16, bf16 and qc8w row by row instead: the
//! rows are read in memory order (one stream, prefetched ahead) and converted into a
//! staging tile of 16-bit or 8-bit values, which is transposed from cache. Sixteen rows
//! read side by side are sixteen streams that a core keeps too few loads in flight for;
//! one stream reads at nearly the speed of a read-only pass.

use std::arch::x86_64::*;

use super::isa::IsaKind;
use crate::convert::row_scale;
use crate::dtype::Dtype;
use crate::gemm::src_size;
use crate::params::{GemmKind, GemmParams};

/// Packs one block if the parameters have a SIMD path here; returns false otherwise.
/// `isa` must be `Avx2` or `Avx512` and available (the `Isa` type guarantees it).
#[allow(clippy::too_many_arguments)]
pub fn pack_block(
    isa: IsaKind,
    kind: GemmKind,
    p: GemmParams,
    src: Dtype,
    k: usize,
    rows: &[u8],
    nb: usize,
    out: &mut [u8],
) -> bool {
    if p.kr != 1 {
        return false;
    }
    let job = Job::new(kind, p, src, k, rows, nb, out);
    if isa == IsaKind::Avx512 && p.nr.is_multiple_of(16) {
        // SAFETY: `isa` is Avx512 only when `isa::avx512_available()` held (checked when the Isa
        // was made); `job` was validated by `Job::new` (buffer sizes match the block).
        unsafe { avx512::pack(job) };
        true
    } else if p.nr.is_multiple_of(8) {
        // SAFETY: Avx2 and Avx512 both imply `isa::avx2_available()`; `job` validated as above.
        unsafe { avx2::pack(job) };
        true
    } else {
        false
    }
}

/// How far ahead of the current tile each row is prefetched, in bytes.
const PREFETCH: usize = 2048;
/// How far ahead a pass that reads the source rows in memory order (one stream) prefetches,
/// in bytes. With conversion work interleaved the core has too few loads in flight to keep
/// memory busy on its own (measured for qc8w: 0.65 → 0.85–0.9 of a read-only pass's speed;
/// 2 to 12 KiB ahead all measure the same).
const STREAM_AHEAD: usize = 4096;

/// One packed column, ready to store: 64, 32, 16 or 8 bytes.
enum Out {
    Z(__m512i),
    Y(__m256i),
    X(__m128i),
    L(__m128i),
}

/// One block's geometry, checked once so the kernels may index without bounds checks.
struct Job<'a> {
    kind: GemmKind,
    src: Dtype,
    nr: usize,
    sr: usize,
    k: usize,
    kp: usize,
    nb: usize,
    rows: &'a [u8],
    out: &'a mut [u8],
}

impl<'a> Job<'a> {
    fn new(kind: GemmKind, p: GemmParams, src: Dtype, k: usize, rows: &'a [u8], nb: usize, out: &'a mut [u8]) -> Self {
        assert_eq!(rows.len(), nb * k * src_size(src));
        assert_eq!(out.len(), kind.block_len(p, k));
        assert!(nb <= p.nr as usize);
        Job { kind, src, nr: p.nr as usize, sr: p.sr as usize, k, kp: p.padded_k(k), nb, rows, out }
    }

    /// Byte offset of packed column `col`, lane group starting at row `r0`.
    fn weight_at(&self, col: usize, r0: usize) -> usize {
        self.nr * if self.kind == GemmKind::Qc8w { 4 } else { self.kind.elem_size() }
            + (col * self.nr + r0) * self.kind.elem_size()
    }

    fn scales_at(&self) -> usize {
        self.nr * 4 + self.nr * self.kp
    }

    /// Lane masks for the `sr` rotation: bit r of `masks[m][j]` is set when lane r of an
    /// output column with `col mod sr = m` takes column `j` of its group.
    fn rotation_masks(&self, lanes: usize) -> [[u16; 4]; 4] {
        let mut masks = [[0u16; 4]; 4];
        for (m, row) in masks.iter_mut().enumerate().take(self.sr) {
            for r in 0..lanes {
                row[(m + r) % self.sr] |= 1 << r;
            }
        }
        masks
    }

    /// qc8w: scale and reciprocal of row `row` (0 for absent rows), writing the scale slot.
    fn write_scale(&mut self, row: usize, amax: Option<f32>) -> f32 {
        let (scale, inv) = amax.map_or((0.0, 0.0), row_scale);
        let at = self.scales_at() + 4 * row;
        self.out[at..at + 4].copy_from_slice(&scale.to_le_bytes());
        inv
    }

    fn write_sum(&mut self, row: usize, sum: i32) {
        self.out[4 * row..4 * row + 4].copy_from_slice(&(-sum).to_le_bytes());
    }
}

mod avx512 {
    use super::*;

    type V = __m512i;

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c,fma")]
    fn transpose(r: &mut [V; 16]) {
        let mut t = [_mm512_setzero_si512(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        for i in 0..4 {
            let b = 4 * i;
            r[b] = _mm512_unpacklo_epi64(t[b], t[b + 2]);
            r[b + 1] = _mm512_unpackhi_epi64(t[b], t[b + 2]);
            r[b + 2] = _mm512_unpacklo_epi64(t[b + 1], t[b + 3]);
            r[b + 3] = _mm512_unpackhi_epi64(t[b + 1], t[b + 3]);
        }
        for h in 0..2 {
            let b = 8 * h;
            for i in 0..4 {
                t[b + i] = _mm512_shuffle_i32x4::<0x88>(r[b + i], r[b + i + 4]);
                t[b + i + 4] = _mm512_shuffle_i32x4::<0xdd>(r[b + i], r[b + i + 4]);
            }
        }
        for i in 0..8 {
            r[i] = _mm512_shuffle_i32x4::<0x88>(t[i], t[i + 8]);
            r[i + 8] = _mm512_shuffle_i32x4::<0xdd>(t[i], t[i + 8]);
        }
    }

    /// Loads `width` (≤ 16) elements of `src` at `ptr` into 32-bit lanes, zero elsewhere.
    ///
    /// # Safety
    /// `ptr` must be valid for reading `width` elements of `src`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c,fma")]
    unsafe fn load(src: Dtype, ptr: *const u8, width: usize) -> V {
        let mask: __mmask16 = if width >= 16 { 0xFFFF } else { (1u16 << width) - 1 };
        if src_size(src) == 4 {
            // SAFETY: masked-off lanes are not read; the first `width` f32 are valid (caller).
            _mm512_castps_si512(unsafe { _mm512_maskz_loadu_ps(mask, ptr.cast()) })
        } else {
            // SAFETY: as above, for `width` 16-bit elements.
            _mm512_cvtepu16_epi32(unsafe { _mm256_maskz_loadu_epi16(mask, ptr.cast()) })
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c,fma")]
    fn to_f32(src: Dtype, w: V) -> __m512 {
        match src {
            Dtype::F16 => _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w)),
            Dtype::Bf16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w)),
            _ => _mm512_castsi512_ps(w),
        }
    }

    /// f32 bits → bf16 bits in 32-bit lanes, round to nearest even, NaN quieted.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c,fma")]
    fn bf16_rne(b: V) -> V {
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)));
        let nan = _mm512_cmpgt_epu32_mask(
            _mm512_and_si512(b, _mm512_set1_epi32(0x7FFF_FFFF)),
            _mm512_set1_epi32(0x7F80_0000),
        );
        let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(0x40));
        _mm512_mask_mov_epi32(rounded, nan, quiet)
    }

    /// Narrows up to four columns of quantised lanes (i32, within ±127) to int8 and stores
    /// each column's 16 bytes at its destination. Four columns staged side by side go out
    /// as one 64-byte store.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c,fma")]
    fn flush_q(cols: &[(V, *mut u8)], staged: bool) {
        if cols.len() == 4 {
            let d = narrow4(&[cols[0].0, cols[1].0, cols[2].0, cols[3].0]);
            if staged {
                // SAFETY: staged columns are consecutive 16-byte slots of the stage, so the
                // first column's slot starts 64 bytes inside it (see the caller).
                unsafe { _mm512_storeu_si512(cols[0].1.cast(), d) };
            } else {
                let lanes = [
                    _mm512_extracti32x4_epi32::<0>(d),
                    _mm512_extracti32x4_epi32::<1>(d),
                    _mm512_extracti32x4_epi32::<2>(d),
                    _mm512_extracti32x4_epi32::<3>(d),
                ];
                for (lane, (_, dst)) in lanes.iter().zip(cols) {
                    // SAFETY: each `dst` is a column's 16-byte slot in the block (caller).
                    unsafe { _mm_storeu_si128(dst.cast(), *lane) };
                }
            }
        } else {
            for (q, dst) in cols {
                // SAFETY: each `dst` is a column's 16-byte slot (caller).
                unsafe { _mm_storeu_si128(dst.cast(), _mm512_cvtepi32_epi8(*q)) };
            }
        }
    }

    /// Packs columns `0..cols` (a multiple of 16) of row group `g` from an f32 source into
    /// f32-, f16- or bf16-gemm with `sr = 1`, all 16 rows present.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c,fma")]
    fn f32_tiles(job: &mut Job<'_>, g: usize, cols: usize, inv: __m512) -> V {
        let (k, nr, kind) = (job.k, job.nr, job.kind);
        let e = kind.elem_size();
        let mut sums = _mm512_setzero_si512();
        assert!((g + 16) * k * 4 <= job.rows.len() && cols <= k);
        let base = job.weight_at(0, g);
        assert!(cols == 0 || base + ((cols - 1) * nr + 16) * e <= job.out.len());
        let rows = job.rows.as_ptr();
        let out = job.out.as_mut_ptr();
        let aligned = (out as usize + base).is_multiple_of(64) && (nr * e).is_multiple_of(64);
        // nr = 16, 2-byte elements: columns are consecutive 32-byte slots; a column whose slot
        // starts a cache line waits for its neighbour and both go out as one streaming store.
        let mut carry: Option<(usize, __m256i)> = None;
        for c0 in (0..cols).step_by(16) {
            let mut v: [V; 16] = std::array::from_fn(|r| {
                let at = ((g + r) * k + c0) * 4;
                _mm_prefetch::<_MM_HINT_T0>(rows.wrapping_add(at + PREFETCH).cast());
                // SAFETY: row g + r < nb and c0 + 16 ≤ cols ≤ k (asserted above).
                unsafe { _mm512_loadu_si512(rows.add(at).cast()) }
            });
            transpose(&mut v);
            if kind == GemmKind::F32 {
                for (c, col) in v.iter().enumerate() {
                    let at = base + (c0 + c) * nr * 4;
                    // SAFETY: c0 + c < cols, so `at + 64` is within the block (asserted
                    // above); streaming stores only at 64-byte aligned addresses.
                    unsafe {
                        if aligned {
                            _mm512_stream_si512(out.add(at).cast(), *col);
                        } else {
                            _mm512_storeu_si512(out.add(at).cast(), *col);
                        }
                    }
                }
                continue;
            }
            if kind == GemmKind::Qc8w {
                let mut q = [_mm512_setzero_si512(); 16];
                for (qc, col) in q.iter_mut().zip(&v) {
                    let t = _mm512_mul_ps(_mm512_castsi512_ps(*col), inv);
                    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(t, t);
                    let r = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-127.0)), _mm512_set1_ps(127.0));
                    *qc = _mm512_maskz_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(!nan, r);
                    sums = _mm512_add_epi32(sums, *qc);
                }
                for quad in 0..4 {
                    let d = narrow4(&q[4 * quad..4 * quad + 4]);
                    let c = c0 + 4 * quad;
                    if nr == 16 {
                        // SAFETY: with nr = 16 columns c..c+4 are 64 consecutive bytes of
                        // the block (c + 4 ≤ cols, asserted above).
                        unsafe { _mm512_storeu_si512(out.add(base + c * 16).cast(), d) };
                    } else {
                        let lanes = [
                            _mm512_extracti32x4_epi32::<0>(d),
                            _mm512_extracti32x4_epi32::<1>(d),
                            _mm512_extracti32x4_epi32::<2>(d),
                            _mm512_extracti32x4_epi32::<3>(d),
                        ];
                        for (j, lane) in lanes.iter().enumerate() {
                            // SAFETY: column c + j < cols: 16 bytes inside the block.
                            unsafe { _mm_storeu_si128(out.add(base + (c + j) * nr).cast(), *lane) };
                        }
                    }
                }
                continue;
            }
            for (c, col) in v.iter().enumerate() {
                let f = _mm512_castsi512_ps(*col);
                let half = if kind == GemmKind::F16 {
                    _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(f)
                } else {
                    _mm512_cvtepi32_epi16(bf16_rne(*col))
                };
                let at = base + (c0 + c) * nr * 2;
                if nr != 16 {
                    // SAFETY: c0 + c < cols, so `at + 32` is within the block (asserted above).
                    unsafe { _mm256_storeu_si256(out.add(at).cast(), half) };
                } else if (out as usize + at).is_multiple_of(64) {
                    carry = Some((at, half));
                } else if let Some((first, prev)) = carry.take() {
                    let line = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(prev), half);
                    // SAFETY: `first` is the previous column's slot, 64-byte aligned, and the
                    // two slots (64 bytes) lie inside the block (asserted above).
                    unsafe { _mm512_stream_si512(out.add(first).cast(), line) };
                } else {
                    // SAFETY: as above, 32 bytes at `at` inside the block.
                    unsafe { _mm256_storeu_si256(out.add(at).cast(), half) };
                }
            }
        }
        if let Some((at, half)) = carry {
            // SAFETY: a column slot inside the block (asserted above).
            unsafe { _mm256_storeu_si256(out.add(at).cast(), half) };
        }
        sums
    }

    /// Narrows four columns of quantised lanes (i32 within ±127) to int8: column j's 16
    /// bytes land in 128-bit lane j.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c,fma")]
    fn narrow4(q: &[V]) -> V {
        let a = _mm512_packs_epi32(q[0], q[1]);
        let b = _mm512_packs_epi32(q[2], q[3]);
        let c = _mm512_packs_epi16(a, b);
        // 128-bit lane l holds 4 bytes of column j at dword 4l + j.
        _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), c)
    }

    /// max |x| over one row of `k` elements, ignoring NaNs (`max(|x|, m)` keeps `m` when
    /// `|x|` is NaN, signalling or not).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c,fma")]
    fn row_amax(src: Dtype, row: &[u8], k: usize) -> f32 {
        let se = src_size(src);
        assert!(row.len() >= k * se);
        let mut m = _mm512_setzero_ps();
        for c0 in (0..k).step_by(16) {
            _mm_prefetch::<_MM_HINT_T0>(row.as_ptr().wrapping_add(c0 * se + PREFETCH).cast());
            // SAFETY: the row holds k elements (asserted); the load reads min(16, k − c0).
            let x = to_f32(src, unsafe { load(src, row.as_ptr().add(c0 * se), k - c0) });
            m = _mm512_max_ps(_mm512_abs_ps(x), m);
        }
        _mm512_reduce_max_ps(m)
    }

    /// A tile's packed columns before they are streamed out.
    #[repr(C, align(64))]
    struct Stage([u8; 1024]);

    /// Copies `src` to `dst`, the cache-line-aligned middle with streaming stores.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c,fma")]
    fn stream_copy(dst: &mut [u8], src: &[u8]) {
        let n = dst.len().min(src.len());
        let head = dst.as_ptr().align_offset(64).min(n);
        dst[..head].copy_from_slice(&src[..head]);
        let mut i = head;
        while i + 64 <= n {
            // SAFETY: i + 64 ≤ n ≤ both lengths; dst + i is 64-byte aligned (head).
            unsafe {
                _mm512_stream_si512(dst.as_mut_ptr().add(i).cast(), _mm512_loadu_si512(src.as_ptr().add(i).cast()))
            };
            i += 64;
        }
        dst[i..n].copy_from_slice(&src[i..n]);
    }

    /// Packs one block.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/BW/VL, AVX2, F16C and FMA; `job` comes from `Job::new`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c,fma")]
    pub unsafe fn pack(mut job: Job<'_>) {
        let (kind, src, nr, sr, k, kp, nb) = (job.kind, job.src, job.nr, job.sr, job.k, job.kp, job.nb);
        let se = src_size(src);
        let e = kind.elem_size();
        let masks = job.rotation_masks(16);
        // Every lane group is whole (g + 16 ≤ nr), so with col < kp each column's 16
        // elements lie in the block's weight area: the stores below rely on it.
        assert!(nr.is_multiple_of(16), "the AVX-512 kernel takes nr a multiple of 16");
        for g in (0..nr).step_by(16) {
            // qc8w: per-row reciprocal scales, from a first pass over each row.
            let mut inv = [0f32; 16];
            if kind == GemmKind::Qc8w {
                for (r, slot) in inv.iter_mut().enumerate() {
                    let row = g + r;
                    let amax = if row < nb {
                        Some(row_amax(src, &job.rows[row * k * se..(row + 1) * k * se], k))
                    } else {
                        None
                    };
                    *slot = job.write_scale(row, amax);
                }
            }
            // SAFETY: `inv` holds 16 f32.
            let inv_v = unsafe { _mm512_loadu_ps(inv.as_ptr()) };
            let mut sums = _mm512_setzero_si512();
            // With nr = 16 consecutive columns are consecutive in the output: narrow
            // layouts (16 or 32 bytes a column) are staged per tile and streamed out as
            // whole cache lines.
            let staged = nr == 16 && e < 4;
            let mut stage = Stage([0; 1024]);
            let mut pending = [(_mm512_setzero_si512(), std::ptr::null_mut::<u8>()); 4];
            let mut npending = 0;
            // Fast path for the commonest case: f32 → f32-gemm, no rotation, a full group
            // of rows, whole tiles. Constant indices keep the tile in registers.
            let mut first = 0;
            if src == Dtype::F32 && sr == 1 && g + 16 <= nb {
                first = k - k % 16;
                sums = f32_tiles(&mut job, g, first, inv_v);
            }
            for c0 in (first..kp).step_by(16) {
                let width = k.saturating_sub(c0).min(16);
                let mut v = [_mm512_setzero_si512(); 16];
                for (r, slot) in v.iter_mut().enumerate() {
                    let row = g + r;
                    if row < nb && width > 0 {
                        let at = (row * k + c0) * se;
                        // Sixteen rows 4 KiB apart are more streams than the hardware
                        // prefetcher follows: fetch each row a few lines ahead.
                        _mm_prefetch::<_MM_HINT_T0>(job.rows.as_ptr().wrapping_add(at + PREFETCH).cast());
                        // SAFETY: row < nb and c0 + width ≤ k: the elements are in `rows`.
                        *slot = unsafe { load(src, job.rows.as_ptr().add(at), width) };
                    }
                }
                transpose(&mut v);
                for c in 0..16.min(kp - c0) {
                    let col = c0 + c;
                    let w = if sr == 1 {
                        v[c]
                    } else {
                        let (base, m) = (c - c % sr, col % sr);
                        let mut w = v[base];
                        for j in 1..sr {
                            w = _mm512_mask_mov_epi32(w, masks[m][j], v[base + j]);
                        }
                        w
                    };
                    let at = job.weight_at(col, g);
                    let dst = if staged {
                        stage.0.as_mut_ptr().wrapping_add(c * 16 * e)
                    } else {
                        job.out.as_mut_ptr().wrapping_add(at)
                    };
                    let packed = match (kind, src) {
                        (GemmKind::F32, _) => Out::Z(_mm512_castps_si512(to_f32(src, w))),
                        (GemmKind::F16, Dtype::F16) | (GemmKind::Bf16, Dtype::Bf16) => Out::Y(_mm512_cvtepi32_epi16(w)),
                        (GemmKind::F16, _) => {
                            Out::Y(_mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(to_f32(src, w)))
                        }
                        (GemmKind::Bf16, _) => {
                            Out::Y(_mm512_cvtepi32_epi16(bf16_rne(_mm512_castps_si512(to_f32(src, w)))))
                        }
                        (GemmKind::Qc8w, _) => {
                            let t = _mm512_mul_ps(to_f32(src, w), inv_v);
                            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(t, t);
                            // Clamp first (a NaN lane is zeroed below), then convert with
                            // round-to-nearest-even: the integers equal clamp(round(t)).
                            let r = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-127.0)), _mm512_set1_ps(127.0));
                            let q = _mm512_maskz_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                                !nan, r,
                            );
                            sums = _mm512_add_epi32(sums, q);
                            pending[npending] = (q, dst);
                            npending += 1;
                            if npending == 4 || c + 1 == 16.min(kp - c0) {
                                flush_q(&pending[..npending], staged);
                                npending = 0;
                            }
                            continue;
                        }
                    };
                    // SAFETY: the store writes 16·e bytes either at `at` = weights_offset +
                    // (col·nr + g)·e with col < kp and g + 16 ≤ nr (asserted at entry), so
                    // at + 16·e ≤ weights_offset + kp·nr·e ≤ block_len = out.len() (asserted
                    // by Job::new), or at c·16·e < 16·16·2 in the 1024-byte stage.
                    unsafe {
                        match packed {
                            // Whole aligned cache lines bypass the cache (no read for
                            // ownership); the block ends with an sfence.
                            Out::Z(v) if (dst as usize).is_multiple_of(64) => _mm512_stream_si512(dst.cast(), v),
                            Out::Z(v) => _mm512_storeu_si512(dst.cast(), v),
                            Out::Y(v) => _mm256_storeu_si256(dst.cast(), v),
                            Out::X(v) => _mm_storeu_si128(dst.cast(), v),
                            Out::L(v) => _mm_storel_epi64(dst.cast(), v),
                        }
                    }
                }
                if staged {
                    let len = 16.min(kp - c0) * 16 * e;
                    let at = job.weight_at(c0, g);
                    stream_copy(&mut job.out[at..at + len], &stage.0[..len]);
                }
            }
            if kind == GemmKind::Qc8w {
                let mut s = [0i32; 16];
                // SAFETY: `s` holds exactly 16 i32.
                unsafe { _mm512_storeu_si512(s.as_mut_ptr().cast(), sums) };
                for (r, sum) in s.iter().enumerate() {
                    job.write_sum(g + r, *sum);
                }
            }
        }
        // Order the streaming stores before anything that follows (sealing, hashing).
        _mm_sfence();
    }
}

mod avx2 {
    use super::*;

    type V = __m256i;

    /// Source dtypes, indexed by [`tiles16`]'s `SRC`.
    const SRCS: [Dtype; 3] = [Dtype::F32, Dtype::F16, Dtype::Bf16];

    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    fn transpose(r: &mut [V; 8]) {
        let f: [__m256; 8] = std::array::from_fn(|i| _mm256_castsi256_ps(r[i]));
        let t: [__m256; 8] = [
            _mm256_unpacklo_ps(f[0], f[1]),
            _mm256_unpackhi_ps(f[0], f[1]),
            _mm256_unpacklo_ps(f[2], f[3]),
            _mm256_unpackhi_ps(f[2], f[3]),
            _mm256_unpacklo_ps(f[4], f[5]),
            _mm256_unpackhi_ps(f[4], f[5]),
            _mm256_unpacklo_ps(f[6], f[7]),
            _mm256_unpackhi_ps(f[6], f[7]),
        ];
        let u: [__m256; 8] = [
            _mm256_shuffle_ps::<0x44>(t[0], t[2]),
            _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
            _mm256_shuffle_ps::<0x44>(t[1], t[3]),
            _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
            _mm256_shuffle_ps::<0x44>(t[4], t[6]),
            _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
            _mm256_shuffle_ps::<0x44>(t[5], t[7]),
            _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
        ];
        for i in 0..4 {
            r[i] = _mm256_castps_si256(_mm256_permute2f128_ps::<0x20>(u[i], u[i + 4]));
            r[i + 4] = _mm256_castps_si256(_mm256_permute2f128_ps::<0x31>(u[i], u[i + 4]));
        }
    }

    /// Loads `width` (≤ 8) elements of `src` at `ptr` into 32-bit lanes, zero elsewhere.
    ///
    /// # Safety
    /// `ptr` must be valid for reading `width` elements of `src`.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn load(src: Dtype, ptr: *const u8, width: usize) -> V {
        if width >= 8 {
            // SAFETY: the caller guarantees 8 readable elements.
            return unsafe { load8(src, ptr) };
        }
        let mut buf = [0u8; 32];
        // SAFETY: the caller guarantees `width · se` readable bytes; `buf` has 32.
        unsafe { std::ptr::copy_nonoverlapping(ptr, buf.as_mut_ptr(), width * src_size(src)) };
        // SAFETY: `buf` holds 8 elements of any source dtype (32 bytes).
        unsafe { load8(src, buf.as_ptr()) }
    }

    /// Low 16 bits of each 32-bit lane, packed into 8 × u16.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    fn narrow16(w: V) -> __m128i {
        let lo = _mm256_and_si256(w, _mm256_set1_epi32(0xFFFF));
        let packed = _mm256_packus_epi32(lo, lo);
        _mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b1000>(packed))
    }

    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    fn to_f32(src: Dtype, w: V) -> __m256 {
        match src {
            Dtype::F16 => _mm256_cvtph_ps(narrow16(w)),
            Dtype::Bf16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w)),
            _ => _mm256_castsi256_ps(w),
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    fn bf16_rne(b: V) -> V {
        let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
        let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)));
        // |b| > 0x7F800000 as signed compare is safe: the sign bit is cleared.
        let nan =
            _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7FFF_FFFF)), _mm256_set1_epi32(0x7F80_0000));
        let quiet = _mm256_or_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(0x40));
        _mm256_blendv_epi8(rounded, quiet, nan)
    }

    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    fn mask_vec(mask: u16) -> V {
        let bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        let m = _mm256_set1_epi32(i32::from(mask));
        _mm256_cmpeq_epi32(_mm256_and_si256(m, bits), bits)
    }

    /// Loads 8 elements of `src` at `ptr` into 32-bit lanes.
    ///
    /// # Safety
    /// `ptr` must be valid for reading 8 elements of `src`.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn load8(src: Dtype, ptr: *const u8) -> V {
        if src_size(src) == 4 {
            // SAFETY: 32 readable bytes at `ptr` (caller).
            unsafe { _mm256_loadu_si256(ptr.cast()) }
        } else {
            // SAFETY: 16 readable bytes at `ptr` (caller).
            _mm256_cvtepu16_epi32(unsafe { _mm_loadu_si128(ptr.cast()) })
        }
    }

    /// max |x| over one row of `k` elements, ignoring NaNs (`max(|x|, m)` keeps `m` when
    /// `|x|` is NaN), with four accumulators so the loads are not serialised.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    fn row_amax(src: Dtype, row: &[u8], k: usize) -> f32 {
        let se = src_size(src);
        assert!(row.len() >= k * se);
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
        let p = row.as_ptr();
        let mut m = [_mm256_setzero_ps(); 4];
        let whole = k - k % 32;
        for c0 in (0..whole).step_by(32) {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(c0 * se + PREFETCH).cast());
            for (j, acc) in m.iter_mut().enumerate() {
                // SAFETY: c0 + 8j + 8 ≤ whole ≤ k elements of the row (asserted above).
                let x = to_f32(src, unsafe { load8(src, p.add((c0 + 8 * j) * se)) });
                *acc = _mm256_max_ps(_mm256_and_ps(x, abs), *acc);
            }
        }
        for c0 in (whole..k).step_by(8) {
            // SAFETY: the row holds k elements; the load reads min(8, k − c0) of them.
            let x = to_f32(src, unsafe { load(src, p.add(c0 * se), k - c0) });
            m[0] = _mm256_max_ps(_mm256_and_ps(x, abs), m[0]);
        }
        hmax(m)
    }

    /// The largest lane of four accumulators of `max(|x|, m)` (none holds a NaN, so the
    /// order of these maxima does not matter).
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    fn hmax(m: [__m256; 4]) -> f32 {
        let all = _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3]));
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` holds 8 f32.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), all) };
        lanes.iter().fold(0f32, |a, &b| if b > a { b } else { a })
    }

    /// u16 values in the 32-bit lanes of `lo` (rows 0..8) and `hi` (rows 8..16), packed
    /// into 16 × u16 in row order.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    fn pack16(lo: V, hi: V) -> V {
        _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(lo, hi))
    }

    /// qc8w: `round(x · inv)` clamped to ±127, NaN → 0, as i32 lanes (the reference's
    /// `quantize`, bit for bit).
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    fn quantize(x: __m256, inv: __m256) -> V {
        let t = _mm256_mul_ps(x, inv);
        let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(t, t);
        // Clamp first, then convert: the conversion rounds to nearest even (the default
        // MXCSR mode, which Rust code may assume), and clamp(round(t)) = round(clamp(t))
        // for bounds that are integers. A NaN lane clamps to −127 and is zeroed.
        let r = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-127.0)), _mm256_set1_ps(127.0));
        _mm256_cvtps_epi32(_mm256_andnot_ps(nan, r))
    }

    /// Stores 32 bytes, bypassing the cache when `stream` (then `dst` is 32-byte aligned).
    ///
    /// # Safety
    /// `dst` must be valid for writing 32 bytes, and 32-byte aligned when `stream`.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn put32(dst: *mut u8, v: V, stream: bool) {
        // SAFETY: 32 writable bytes (caller); aligned when streaming (caller).
        unsafe {
            if stream {
                _mm256_stream_si256(dst.cast(), v);
            } else {
                _mm256_storeu_si256(dst.cast(), v);
            }
        }
    }

    /// f32: packs columns `0..cols` (a multiple of 8, at most `k`) of the 16 rows starting
    /// at `g`, all present, for `sr = 1` and `nr` a multiple of 16: two 8 × 8 transposes
    /// per tile, so each packed column's 16 rows (a whole cache line) are written together,
    /// bypassing the cache when the block is aligned. `SRC` indexes [`SRCS`] so each source
    /// dtype compiles to its own loop.
    #[target_feature(enable = "avx2,f16c,fma")]
    fn f32_tiles16<const SRC: usize>(job: &mut Job<'_>, g: usize, cols: usize) {
        let src = SRCS[SRC];
        let (k, nr) = (job.k, job.nr);
        let se = src_size(src);
        assert!((g + 16) * k * se <= job.rows.len() && cols <= k && cols.is_multiple_of(8));
        assert!(nr.is_multiple_of(16) && g + 16 <= nr && job.sr == 1 && job.kind == GemmKind::F32 && job.src == src);
        let base = job.weight_at(0, g);
        assert!(cols == 0 || base + ((cols - 1) * nr + 16) * 4 <= job.out.len());
        let rows = job.rows.as_ptr();
        let out = job.out.as_mut_ptr();
        let stream = (out as usize + base).is_multiple_of(32);
        for c0 in (0..cols).step_by(8) {
            let mut t = [[_mm256_setzero_si256(); 8]; 2];
            for (h, half) in t.iter_mut().enumerate() {
                for (r, v) in half.iter_mut().enumerate() {
                    let at = ((g + 8 * h + r) * k + c0) * se;
                    // Sixteen rows a row apart are more streams than the hardware
                    // prefetcher follows: fetch each row a few lines ahead.
                    _mm_prefetch::<_MM_HINT_T0>(rows.wrapping_add(at + PREFETCH).cast());
                    // SAFETY: row g + 8h + r < g + 16 ≤ nb and c0 + 8 ≤ cols ≤ k (asserted).
                    *v = unsafe { load8(src, rows.add(at)) };
                }
                transpose(half);
            }
            let [lo, hi] = &t;
            for c in 0..8 {
                let at = base + (c0 + c) * nr * 4;
                // SAFETY: column c0 + c < cols: its 64 bytes for these rows are in the block
                // (asserted above); 32-byte aligned when streaming.
                unsafe {
                    put32(out.add(at), _mm256_castps_si256(to_f32(src, lo[c])), stream);
                    put32(out.add(at + 32), _mm256_castps_si256(to_f32(src, hi[c])), stream);
                }
            }
        }
    }

    /// qc8w for the 16 rows starting at `g`, all present, `sr = 1`, `nr` a multiple of 16:
    /// writes the 16 scales and packs columns `0..k − k mod 32`. Each row is read from
    /// memory once, in memory order and prefetched ahead: its max |x| is taken in the loop
    /// that quantises the row before it, and it is quantised in the next loop, from L1
    /// (its scale is one broadcast), into an int8 staging tile; the tile (a quarter of the
    /// source's bytes) is then transposed 16 rows × 32 columns at a time. Returns the
    /// reciprocal scales (for the remaining columns) and the row sums of rows `g..g+8` and
    /// `g+8..g+16` in 32-bit lanes.
    #[target_feature(enable = "avx2,f16c,fma")]
    fn qc8w_rows16<const SRC: usize>(job: &mut Job<'_>, g: usize) -> ([f32; 16], [V; 2]) {
        let src = SRCS[SRC];
        let (k, nr) = (job.k, job.nr);
        let se = src_size(src);
        let cols = k - k % 32;
        assert!((g + 16) * k * se <= job.rows.len() && job.sr == 1 && job.kind == GemmKind::Qc8w && job.src == src);
        assert!(nr.is_multiple_of(16) && g + 16 <= nr);
        let base = job.weight_at(0, g);
        assert!(cols == 0 || base + (cols - 1) * nr + 16 <= job.out.len());
        // Rows of the staging tile are a line longer than a multiple of 64 bytes, so the
        // 16 rows do not all fall in one L1 set.
        let stride = cols + 64;
        // Every byte read back below is written first: no need to zero it.
        let mut stage: Vec<u8> = Vec::with_capacity(16 * stride);
        let tile = stage.as_mut_ptr();
        let mut inv = [0f32; 16];
        let mut s = [0i32; 16];
        let ones16 = _mm256_set1_epi16(1);
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
        // max |x| of row `r`, columns 0..cols, in four accumulators.
        let rows = job.rows.as_ptr();
        let row_at = |r: usize| rows.wrapping_add((g + r) * k * se);
        // Columns c0..c0 + 32 of row r of the group.
        let amax32 = |r: usize, c0: usize, m: &mut [__m256; 4]| {
            assert!(r < 16 && c0 + 32 <= cols);
            let p = row_at(r);
            let ahead = p.wrapping_add(c0 * se + STREAM_AHEAD);
            _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64).cast());
            for (j, acc) in m.iter_mut().enumerate() {
                // SAFETY: rows g..g+16 are in `rows` (asserted above) and r < 16; c0 + 32 ≤
                // cols ≤ k (asserted here).
                let x = to_f32(src, unsafe { load8(src, p.add((c0 + 8 * j) * se)) });
                *acc = _mm256_max_ps(_mm256_and_ps(x, abs), *acc);
            }
        };
        // Columns cols..k of row r of the group.
        let amax_tail = |r: usize, m: &mut [__m256; 4]| {
            assert!(r < 16);
            let p = row_at(r);
            for c0 in (cols..k).step_by(8) {
                // SAFETY: row r < 16 of the group is in `rows` (asserted above) and holds k
                // elements; the load reads min(8, k − c0) of them.
                let x = to_f32(src, unsafe { load(src, p.add(c0 * se), k - c0) });
                m[0] = _mm256_max_ps(_mm256_and_ps(x, abs), m[0]);
            }
        };
        let mut m = [_mm256_setzero_ps(); 4];
        for c0 in (0..cols).step_by(32) {
            amax32(0, c0, &mut m);
        }
        amax_tail(0, &mut m);
        // Row r is quantised (from L1: its max pass just read it) in the same loop that
        // takes the max of row r + 1 from memory, so the loads from memory never wait on a
        // pass that has none.
        for r in 0..16 {
            inv[r] = job.write_scale(g + r, Some(hmax(m)));
            m = [_mm256_setzero_ps(); 4];
            let inv_v = _mm256_set1_ps(inv[r]);
            let p = row_at(r);
            let staged = tile.wrapping_add(r * stride);
            let mut sum = _mm256_setzero_si256();
            for c0 in (0..cols).step_by(32) {
                if r < 15 {
                    amax32(r + 1, c0, &mut m);
                }
                let q: [V; 4] = std::array::from_fn(|j| {
                    // SAFETY: rows g..g+16 are in `rows` and c0 + 32 ≤ cols ≤ k (asserted above).
                    let x = unsafe { load8(src, p.add((c0 + 8 * j) * se)) };
                    quantize(to_f32(src, x), inv_v)
                });
                let ab = _mm256_packs_epi32(q[0], q[1]);
                let cd = _mm256_packs_epi32(q[2], q[3]);
                sum = _mm256_add_epi32(
                    sum,
                    _mm256_add_epi32(_mm256_madd_epi16(ab, ones16), _mm256_madd_epi16(cd, ones16)),
                );
                let bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), order);
                // SAFETY: c0 + 32 ≤ cols: 32 bytes of row r < 16 of the staging tile, which has
                // room for 16 rows of `stride` ≥ cols bytes.
                unsafe { _mm256_storeu_si256(staged.add(c0).cast(), bytes) };
            }
            if r < 15 {
                amax_tail(r + 1, &mut m);
            }
            let mut d = [0i32; 8];
            // SAFETY: `d` holds 8 i32.
            unsafe { _mm256_storeu_si256(d.as_mut_ptr().cast(), sum) };
            s[r] = d.iter().sum();
        }
        let out = job.out.as_mut_ptr();
        let stream = nr == 16 && (out as usize + base).is_multiple_of(32);
        // The next group's first row (the rows are consecutive in memory) is fetched while
        // this tile is transposed.
        let ahead = row_at(16);
        for c0 in (0..cols).step_by(32) {
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(c0 * se).cast());
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(c0 * se + 64).cast());
            // SAFETY: row r < 16 of the staging tile has `cols` ≥ c0 + 32 bytes, all written
            // by the pass above.
            let rw: [V; 16] = std::array::from_fn(|r| unsafe { _mm256_loadu_si256(tile.add(r * stride + c0).cast()) });
            // Per 128-bit lane (columns c0..c0+16, and c0+16..c0+32 in the high lane):
            // pairs of rows byte-interleaved, then quads, octets and all 16 rows.
            let p1: [[V; 2]; 8] = std::array::from_fn(|i| {
                [_mm256_unpacklo_epi8(rw[2 * i], rw[2 * i + 1]), _mm256_unpackhi_epi8(rw[2 * i], rw[2 * i + 1])]
            });
            // p2[q][cq]: rows 4q..4q+4, columns 4cq..4cq+4 (one column's 4 rows per dword).
            let p2: [[V; 4]; 4] = std::array::from_fn(|q| {
                let (a, b) = (p1[2 * q], p1[2 * q + 1]);
                [
                    _mm256_unpacklo_epi16(a[0], b[0]),
                    _mm256_unpackhi_epi16(a[0], b[0]),
                    _mm256_unpacklo_epi16(a[1], b[1]),
                    _mm256_unpackhi_epi16(a[1], b[1]),
                ]
            });
            // p3[o][cq][x]: rows 8o..8o+8, columns 4cq + 2x and 4cq + 2x + 1 (a qword each).
            let p3: [[[V; 2]; 4]; 2] = std::array::from_fn(|o| {
                std::array::from_fn(|cq| {
                    let (a, b) = (p2[2 * o][cq], p2[2 * o + 1][cq]);
                    [_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b)]
                })
            });
            // col[c]: column c (low lane) and c + 16 (high lane), 16 rows each.
            let mut col = [_mm256_setzero_si256(); 16];
            for cq in 0..4 {
                for x in 0..2 {
                    let (a, b) = (p3[0][cq][x], p3[1][cq][x]);
                    col[4 * cq + 2 * x] = _mm256_unpacklo_epi64(a, b);
                    col[4 * cq + 2 * x + 1] = _mm256_unpackhi_epi64(a, b);
                }
            }
            let col_at = |c: usize| base + (c0 + c) * nr;
            if nr == 16 {
                for c in (0..16).step_by(2) {
                    // SAFETY: with nr = 16 columns c0..c0+32 (c0 + 32 ≤ cols, asserted above) are
                    // 512 consecutive bytes of the block; 32-byte aligned when streaming.
                    unsafe {
                        put32(out.add(col_at(c)), _mm256_permute2x128_si256::<0x20>(col[c], col[c + 1]), stream);
                        put32(out.add(col_at(c + 16)), _mm256_permute2x128_si256::<0x31>(col[c], col[c + 1]), stream);
                    }
                }
            } else {
                for (c, v) in col.iter().enumerate() {
                    // SAFETY: columns c0 + c and c0 + c + 16 are < cols: 16 bytes each in
                    // the block (asserted above).
                    unsafe {
                        _mm_storeu_si128(out.add(col_at(c)).cast(), _mm256_castsi256_si128(*v));
                        _mm_storeu_si128(out.add(col_at(c + 16)).cast(), _mm256_extracti128_si256::<1>(*v));
                    }
                }
            }
        }
        // SAFETY: `s` holds 16 i32.
        let sums = unsafe { [_mm256_loadu_si256(s.as_ptr().cast()), _mm256_loadu_si256(s.as_ptr().add(8).cast())] };
        (inv, sums)
    }

    /// f16 and bf16 for the 16 rows starting at `g`, all present, `sr = 1`, `nr` a
    /// multiple of 16: packs columns `0..k − k mod 16`. The rows are converted in memory
    /// order (one stream from memory, prefetched ahead) into a 16-bit staging tile, which
    /// is then transposed 16 × 16 at a time from L2 while the next group's first rows are
    /// fetched. `KIND` and `SRC` index [`GemmKind::ALL`] and [`SRCS`].
    #[target_feature(enable = "avx2,f16c,fma")]
    fn half_rows16<const KIND: usize, const SRC: usize>(job: &mut Job<'_>, g: usize) {
        let (kind, src) = (GemmKind::ALL[KIND], SRCS[SRC]);
        let (k, nr) = (job.k, job.nr);
        let se = src_size(src);
        let cols = k - k % 16;
        assert!((kind == GemmKind::F16 || kind == GemmKind::Bf16) && job.kind == kind && job.src == src);
        assert!((g + 16) * k * se <= job.rows.len() && job.sr == 1);
        assert!(nr.is_multiple_of(16) && g + 16 <= nr);
        let base = job.weight_at(0, g);
        assert!(cols == 0 || base + ((cols - 1) * nr + 16) * 2 <= job.out.len());
        // Staging rows a line longer than a multiple of 64 bytes: the 16 rows do not all
        // fall in one L1 set.
        let stride = 2 * cols + 64;
        // Every byte read back below is written first: no need to zero it.
        let mut stage: Vec<u8> = Vec::with_capacity(16 * stride);
        let tile = stage.as_mut_ptr();
        let rows = job.rows.as_ptr();
        let row_at = |r: usize| rows.wrapping_add((g + r) * k * se);
        for r in 0..16 {
            let p = row_at(r);
            let staged = tile.wrapping_add(r * stride);
            for c0 in (0..cols).step_by(16) {
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(c0 * se + STREAM_AHEAD).cast());
                // SAFETY: rows g..g+16 are in `rows` and c0 + 16 ≤ cols ≤ k (asserted above).
                let (lo, hi) = unsafe { (load8(src, p.add(c0 * se)), load8(src, p.add((c0 + 8) * se))) };
                let v = match (kind, src) {
                    (GemmKind::F16, Dtype::F16) | (GemmKind::Bf16, Dtype::Bf16) => pack16(lo, hi),
                    (GemmKind::F16, _) => _mm256_set_m128i(
                        _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(to_f32(src, hi)),
                        _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(to_f32(src, lo)),
                    ),
                    _ => pack16(
                        bf16_rne(_mm256_castps_si256(to_f32(src, lo))),
                        bf16_rne(_mm256_castps_si256(to_f32(src, hi))),
                    ),
                };
                // SAFETY: c0 + 16 ≤ cols: 32 bytes of row r < 16 of the staging tile, which has
                // room for 16 rows of `stride` ≥ 2·cols bytes.
                unsafe { _mm256_storeu_si256(staged.add(2 * c0).cast(), v) };
            }
        }
        let out = job.out.as_mut_ptr();
        let stream = nr == 16 && (out as usize + base).is_multiple_of(32);
        let ahead = row_at(16);
        for c0 in (0..cols).step_by(16) {
            // The next group's first rows (consecutive in memory), while this one is
            // transposed.
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(c0 * se).cast());
            // SAFETY: row r < 16 of the staging tile has 2·cols ≥ 2·(c0 + 16) bytes, all
            // written by the pass above.
            let rw: [V; 16] =
                std::array::from_fn(|r| unsafe { _mm256_loadu_si256(tile.add(r * stride + 2 * c0).cast()) });
            // Per 128-bit lane (columns c0..c0+8, and c0+8..c0+16 in the high lane): pairs
            // of rows interleaved, then quads and octets; then the lanes of the two
            // octets make whole columns.
            let p1: [[V; 2]; 8] = std::array::from_fn(|i| {
                [_mm256_unpacklo_epi16(rw[2 * i], rw[2 * i + 1]), _mm256_unpackhi_epi16(rw[2 * i], rw[2 * i + 1])]
            });
            // p2[q][h][x]: rows 4q..4q+4, columns 4h + 2x and 4h + 2x + 1 (a qword each).
            let p2: [[[V; 2]; 2]; 4] = std::array::from_fn(|q| {
                std::array::from_fn(|h| {
                    let (a, b) = (p1[2 * q][h], p1[2 * q + 1][h]);
                    [_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b)]
                })
            });
            // Column pair j = 2h + x: columns 2j and 2j + 1 (low lane), + 8 (high lane).
            for j in 0..4 {
                let (h, x) = (j / 2, j % 2);
                // Rows 8o..8o+8 of columns 2j + y (low lane) and 2j + y + 8 (high lane).
                let oct: [[V; 2]; 2] = std::array::from_fn(|o| {
                    let (a, b) = (p2[2 * o][h][x], p2[2 * o + 1][h][x]);
                    [_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b)]
                });
                let col_at = |c: usize| base + (c0 + c) * nr * 2;
                for (y, (lo, hi)) in oct[0].iter().zip(&oct[1]).enumerate() {
                    let c = 2 * j + y;
                    // SAFETY: columns c0 + c and c0 + c + 8 are < cols: 32 bytes each in the
                    // block (asserted above); 32-byte aligned when streaming.
                    unsafe {
                        put32(out.add(col_at(c)), _mm256_permute2x128_si256::<0x20>(*lo, *hi), stream);
                        put32(out.add(col_at(c + 8)), _mm256_permute2x128_si256::<0x31>(*lo, *hi), stream);
                    }
                }
            }
        }
    }

    /// Packs columns `first..kp` of the 8 rows starting at `g` (any of them absent, any
    /// `sr`), adding qc8w values to `sums`.
    #[target_feature(enable = "avx2,f16c,fma")]
    fn group8(job: &mut Job<'_>, g: usize, first: usize, inv_v: __m256, mut sums: V, mvec: &[[V; 4]; 4]) -> V {
        let (kind, src, sr, k, kp, nb) = (job.kind, job.src, job.sr, job.k, job.kp, job.nb);
        let se = src_size(src);
        // The group is whole: with col < kp each column's 8 elements lie in the block's
        // weight area (the stores below rely on it).
        assert!(g + 8 <= job.nr, "a group of 8 rows inside nr");
        for c0 in (first..kp).step_by(8) {
            let width = k.saturating_sub(c0).min(8);
            let mut v = [_mm256_setzero_si256(); 8];
            for (r, slot) in v.iter_mut().enumerate() {
                let row = g + r;
                if row < nb && width > 0 {
                    // SAFETY: row < nb and c0 + width ≤ k: the elements are in `rows`.
                    *slot = unsafe { load(src, job.rows.as_ptr().add((row * k + c0) * se), width) };
                }
            }
            transpose(&mut v);
            for c in 0..8.min(kp - c0) {
                let col = c0 + c;
                let w = if sr == 1 {
                    v[c]
                } else {
                    let (base, m) = (c - c % sr, col % sr);
                    let mut w = v[base];
                    for j in 1..sr {
                        w = _mm256_blendv_epi8(w, v[base + j], mvec[m][j]);
                    }
                    w
                };
                let at = job.weight_at(col, g);
                let dst = job.out.as_mut_ptr().wrapping_add(at);
                let packed = match (kind, src) {
                    (GemmKind::F32, _) => Out::Y(_mm256_castps_si256(to_f32(src, w))),
                    (GemmKind::F16, Dtype::F16) | (GemmKind::Bf16, Dtype::Bf16) => Out::X(narrow16(w)),
                    (GemmKind::F16, _) => Out::X(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(to_f32(src, w))),
                    (GemmKind::Bf16, _) => Out::X(narrow16(bf16_rne(_mm256_castps_si256(to_f32(src, w))))),
                    (GemmKind::Qc8w, _) => {
                        let q = quantize(to_f32(src, w), inv_v);
                        sums = _mm256_add_epi32(sums, q);
                        let w16 = _mm256_packs_epi32(q, q);
                        let w8 = _mm256_packs_epi16(w16, w16);
                        let bytes = _mm256_permutevar8x32_epi32(w8, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
                        Out::L(_mm256_castsi256_si128(bytes))
                    }
                };
                // SAFETY: the store writes 8·e bytes at `at` = weights_offset + (col·nr + g)·e
                // with col < kp and g + 8 ≤ nr (asserted above), so at + 8·e ≤
                // weights_offset + kp·nr·e ≤ block_len = out.len() (asserted by Job::new).
                unsafe {
                    match packed {
                        Out::Y(v) => _mm256_storeu_si256(dst.cast(), v),
                        Out::X(v) => _mm_storeu_si128(dst.cast(), v),
                        Out::L(v) => _mm_storel_epi64(dst.cast(), v),
                        Out::Z(_) => {}
                    }
                }
            }
        }
        sums
    }

    /// Packs one block: 16-row groups through [`f32_tiles16`], [`half_rows16`] or
    /// [`qc8w_rows16`] where the parameters allow (`sr = 1`, `nr` a multiple of 16, all 16
    /// rows present), the rest (the last `k mod 8`, 16 or 32 columns, partial groups,
    /// `sr > 1`) 8 rows at a time through [`group8`].
    ///
    /// # Safety
    /// The CPU must support AVX2, F16C and FMA; `job` comes from `Job::new`.
    #[target_feature(enable = "avx2,f16c,fma")]
    pub unsafe fn pack(mut job: Job<'_>) {
        let (kind, src, nr, sr, k, nb) = (job.kind, job.src, job.nr, job.sr, job.k, job.nb);
        let se = src_size(src);
        let masks = job.rotation_masks(8);
        let mvec: [[V; 4]; 4] = std::array::from_fn(|m| std::array::from_fn(|j| mask_vec(masks[m][j])));
        let mut g = 0;
        while g < nr {
            let span = if sr == 1 && nr.is_multiple_of(16) && g + 16 <= nb { 16 } else { 8 };
            // qc8w: per-row reciprocal scales, from a first pass over each row (for 16 whole
            // rows, taken row by row as they are quantised).
            let mut inv = [0f32; 16];
            let mut sums = [_mm256_setzero_si256(); 2];
            let mut first = 0;
            if span == 16 {
                first = match kind {
                    GemmKind::F32 => k - k % 8,
                    GemmKind::F16 | GemmKind::Bf16 => k - k % 16,
                    GemmKind::Qc8w => k - k % 32,
                };
                match (kind, src) {
                    (GemmKind::F32, Dtype::F32) => f32_tiles16::<0>(&mut job, g, first),
                    (GemmKind::F32, Dtype::F16) => f32_tiles16::<1>(&mut job, g, first),
                    (GemmKind::F32, _) => f32_tiles16::<2>(&mut job, g, first),
                    (GemmKind::F16, Dtype::F32) => half_rows16::<1, 0>(&mut job, g),
                    (GemmKind::F16, Dtype::F16) => half_rows16::<1, 1>(&mut job, g),
                    (GemmKind::F16, _) => half_rows16::<1, 2>(&mut job, g),
                    (GemmKind::Bf16, Dtype::F32) => half_rows16::<2, 0>(&mut job, g),
                    (GemmKind::Bf16, Dtype::F16) => half_rows16::<2, 1>(&mut job, g),
                    (GemmKind::Bf16, _) => half_rows16::<2, 2>(&mut job, g),
                    (GemmKind::Qc8w, Dtype::F32) => (inv, sums) = qc8w_rows16::<0>(&mut job, g),
                    (GemmKind::Qc8w, Dtype::F16) => (inv, sums) = qc8w_rows16::<1>(&mut job, g),
                    (GemmKind::Qc8w, _) => (inv, sums) = qc8w_rows16::<2>(&mut job, g),
                }
            } else if kind == GemmKind::Qc8w {
                for (r, slot) in inv.iter_mut().enumerate().take(span) {
                    let row = g + r;
                    let amax = (row < nb).then(|| row_amax(src, &job.rows[row * k * se..(row + 1) * k * se], k));
                    *slot = job.write_scale(row, amax);
                }
            }
            // SAFETY: `inv` holds 16 f32.
            let inv_v = unsafe { [_mm256_loadu_ps(inv.as_ptr()), _mm256_loadu_ps(inv.as_ptr().add(8))] };
            for h in 0..span / 8 {
                sums[h] = group8(&mut job, g + 8 * h, first, inv_v[h], sums[h], &mvec);
            }
            if kind == GemmKind::Qc8w {
                let mut s = [0i32; 16];
                // SAFETY: `s` holds exactly 16 i32.
                unsafe {
                    _mm256_storeu_si256(s.as_mut_ptr().cast(), sums[0]);
                    _mm256_storeu_si256(s.as_mut_ptr().add(8).cast(), sums[1]);
                }
                for (r, sum) in s.iter().enumerate().take(span) {
                    job.write_sum(g + r, *sum);
                }
            }
            g += span;
        }
        // Order the streaming stores before anything that follows (sealing, hashing).
        _mm_sfence();
    }
}
