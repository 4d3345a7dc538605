//! Packing: layouts, plans, the scalar reference kernels and the pack job.
//!
//! Packed bytes are a pure function of (source tensor bytes, dtype, shape, layout,
//! parameters, layout version). Nothing here talks to clients.

pub mod choice;
pub mod job;
pub mod layout;
pub mod plan;

pub use packd_kernels::simd as kernels;
pub use packd_kernels::{convert, gemm, measure};

pub use choice::{KernelChoice, Kernels};
pub use job::{
    JobConfig, PackError, Packed, PackedEntry, charged_bytes, entry_key, metadata_bytes, pack, pack_private,
    packed_size,
};
pub use kernels::{Isa, IsaError, IsaKind};
pub use layout::{GemmKind, GemmParams, Layout, LayoutError, LayoutFault};
pub use plan::{Misfit, Plan, PlanError};
