//! safetensors element types.

use std::fmt;
use std::str::FromStr;

/// A safetensors dtype. Every dtype the format defines is accepted (for `identity`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(missing_docs)]
pub enum Dtype {
    Bool,
    F4,
    F6E2M3,
    F6E3M2,
    U8,
    I8,
    F8E5M2,
    F8E4M3,
    F8E8M0,
    I16,
    U16,
    F16,
    Bf16,
    I32,
    U32,
    F32,
    C64,
    F64,
    I64,
    U64,
}

const NAMES: [(Dtype, &str, u64); 20] = [
    (Dtype::Bool, "BOOL", 8),
    (Dtype::F4, "F4", 4),
    (Dtype::F6E2M3, "F6_E2M3", 6),
    (Dtype::F6E3M2, "F6_E3M2", 6),
    (Dtype::U8, "U8", 8),
    (Dtype::I8, "I8", 8),
    (Dtype::F8E5M2, "F8_E5M2", 8),
    (Dtype::F8E4M3, "F8_E4M3", 8),
    (Dtype::F8E8M0, "F8_E8M0", 8),
    (Dtype::I16, "I16", 16),
    (Dtype::U16, "U16", 16),
    (Dtype::F16, "F16", 16),
    (Dtype::Bf16, "BF16", 16),
    (Dtype::I32, "I32", 32),
    (Dtype::U32, "U32", 32),
    (Dtype::F32, "F32", 32),
    (Dtype::C64, "C64", 64),
    (Dtype::F64, "F64", 64),
    (Dtype::I64, "I64", 64),
    (Dtype::U64, "U64", 64),
];

impl Dtype {
    /// Bits per element.
    pub fn bits(self) -> u64 {
        NAMES.iter().find(|(d, _, _)| *d == self).map_or(8, |e| e.2)
    }

    /// The name safetensors uses ("F32", "BF16", …).
    pub fn name(self) -> &'static str {
        NAMES.iter().find(|(d, _, _)| *d == self).map_or("?", |e| e.1)
    }

    /// Whether this is one of the float types a GEMM layout can take (F32, F16, BF16).
    pub fn is_gemm_float(self) -> bool {
        matches!(self, Dtype::F32 | Dtype::F16 | Dtype::Bf16)
    }
}

impl FromStr for Dtype {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        NAMES.iter().find(|(_, n, _)| *n == s).map(|e| e.0).ok_or(())
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
