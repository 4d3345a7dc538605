//! GEMM layout parameters and kinds: what a packed block looks like, in bytes.

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
