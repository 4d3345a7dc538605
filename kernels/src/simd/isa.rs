//! Which instruction sets exist, and which this CPU has.

use std::fmt;

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
            IsaKind::Avx2 => avx2_available(),
            #[cfg(target_arch = "x86_64")]
            IsaKind::Avx512 => avx512_available(),
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

/// AVX2 with F16C and FMA.
#[cfg(target_arch = "x86_64")]
pub fn avx2_available() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c") && is_x86_feature_detected!("fma")
}

/// AVX-512 F, BW and VL, plus everything AVX2 needs.
#[cfg(target_arch = "x86_64")]
pub fn avx512_available() -> bool {
    avx2_available()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
}
