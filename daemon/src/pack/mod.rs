//! Packing: layouts, plans, the scalar reference kernels and the pack job.
//!
//! Packed bytes are a pure function of (source tensor bytes, dtype, shape, layout,
//! parameters, layout version). Nothing here talks to clients.

pub mod choice;
pub mod convert;
pub mod gemm;
pub mod job;
pub mod kernels;
pub mod layout;
pub mod plan;

pub use choice::{KernelChoice, Kernels};
pub use job::{
    JobConfig, PackError, Packed, PackedEntry, charged_bytes, entry_key, metadata_bytes, pack, pack_private,
    packed_size,
};
pub use kernels::{Isa, IsaError, IsaKind};
pub use layout::{GemmKind, GemmParams, Layout, LayoutError, LayoutFault};
pub use plan::{Plan, PlanError};
