//! Element conversions, bit-exact and shared by every kernel.
//!
//! * widening F16/BF16 → f32 is exact (F16 signalling NaNs come out quiet, as the F16C and
//!   NEON instructions do; BF16 is a plain shift);
//! * narrowing f32 → F16/BF16 rounds to nearest, ties to even; NaNs stay NaN (quiet, with
//!   the top payload bits kept); overflow gives ±inf; F16 subnormals are produced, never
//!   flushed;
//! * a source already in the layout's element type is copied bit for bit.

use crate::dtype::Dtype;

/// f16 bits → f32.
#[inline]
pub fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// bf16 bits → f32 (exact: the bits shifted into the high half).
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// f32 → f16 bits, round to nearest even.
#[inline]
pub fn f32_to_f16(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

/// f32 → bf16 bits, round to nearest even; NaN → quiet NaN with the top payload bits.
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    let r = if x.is_nan() { (b >> 16) | 0x0040 } else { (b + 0x7FFF + ((b >> 16) & 1)) >> 16 };
    // The result fits: r ≤ 0xFFFF for every f32 bit pattern handled above.
    u16::try_from(r).unwrap_or(u16::MAX)
}

/// Element `i` of a little-endian F32/F16/BF16 buffer as f32.
#[inline]
pub fn load_f32(dtype: Dtype, bytes: &[u8], i: usize) -> f32 {
    match dtype {
        Dtype::F16 => f16_to_f32(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])),
        Dtype::Bf16 => bf16_to_f32(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])),
        _ => f32::from_le_bytes([bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]]),
    }
}

/// Quantises `x` with the row's reciprocal scale `inv = 127 / amax` (0 for an all-zero row):
/// `clamp(round_ties_even(x · inv), −127, 127)`, NaN → 0.
#[inline]
pub fn quantize(x: f32, inv: f32) -> i8 {
    let v = (x * inv).round_ties_even();
    if v.is_nan() {
        0
    } else {
        // Clamped into i8 range, so the cast is exact.
        #[allow(clippy::cast_possible_truncation)]
        let q = v.clamp(-127.0, 127.0) as i8;
        q
    }
}

/// A row's `(amax, scale, inv)`: `amax = max |x|` ignoring NaNs, `scale = amax / 127`,
/// `inv = 127 / amax` (both 0 when amax is 0), all in f32.
#[inline]
pub fn row_scale(amax: f32) -> (f32, f32) {
    if amax == 0.0 { (0.0, 0.0) } else { (amax / 127.0, 127.0 / amax) }
}

/// `max(m, |x|)` that ignores a NaN `x` (the SIMD `max(|x|, m)` does the same).
#[inline]
pub fn amax_step(m: f32, x: f32) -> f32 {
    let a = x.abs();
    if a > m { a } else { m }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_round_to_nearest_even() {
        assert_eq!(f32_to_bf16(1.0), 0x3F80);
        // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: rounds to even (1.0).
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F80_8000)), 0x3F80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F81_8000)), 0x3F82);
        assert_eq!(f32_to_bf16(f32::MAX), 0x7F80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x7F80_0001)), 0x7FC0);
        assert_eq!(f32_to_f16(65520.0), 0x7C00);
        assert_eq!(f32_to_f16(1.0 + f32::EPSILON), 0x3C00);
        assert_eq!(f32_to_f16(5.960_464_5e-8), 0x0001); // smallest f16 subnormal
        assert_eq!(bf16_to_f32(0x3F80), 1.0);
        assert_eq!(f16_to_f32(0x3C00), 1.0);
    }

    #[test]
    fn quantisation_rules() {
        let (scale, inv) = row_scale(2.0);
        assert_eq!(scale, 2.0 / 127.0);
        assert_eq!(quantize(2.0, inv), 127);
        assert_eq!(quantize(-2.0, inv), -127);
        assert_eq!(quantize(f32::NAN, inv), 0);
        assert_eq!(quantize(f32::INFINITY, inv), 127);
        assert_eq!(row_scale(0.0), (0.0, 0.0));
        assert_eq!(quantize(5.0, 0.0), 0);
        assert_eq!(amax_step(1.0, f32::NAN), 1.0);
        assert_eq!(amax_step(1.0, -3.0), 3.0);
    }
}
