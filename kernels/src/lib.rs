//! packd's packing kernels: the byte layouts' parameters, the scalar reference packer (the
//! specification in code), the SIMD kernels that must equal it byte for byte, and the
//! measurement that says which ISA packs each kind fastest on this CPU.
//!
//! A crate of its own so that it is built as in release in every profile (the workspace's
//! `[profile.dev.package.packd-kernels]`): a debug daemon packs, and measures, with the
//! same machine code as a release one. It does no I/O and depends on no other packd crate.

pub mod convert;
pub mod dtype;
pub mod gemm;
pub mod measure;
pub mod params;
pub mod simd;

pub use dtype::Dtype;
pub use params::{GemmKind, GemmParams};
pub use simd::{Isa, IsaError, IsaKind};
