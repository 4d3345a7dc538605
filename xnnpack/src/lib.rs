//! packd's XNNPACK weights cache: the provider's state ([`cache`]: blocks handed to
//! XNNPACK, read back only where this cache reserved them), the engine's identity and
//! interface told from the loaded library ([`engine`]), and the address-space reservation
//! the provider hands out (`sys::vm`, whose `MAP_FIXED` calls are `unsafe` with their
//! contract). `unsafe` lives in `sys` and in `cache` (the blocks it hands out).
//!
//! `packd-capi` puts a C ABI over it (`packd_xnnpack.h`); the library is Rust so that
//! other front ends (the preload library, the Python module) share the one provider.

pub mod adopt;
pub mod cache;
pub mod engine;
mod maps;
mod names;
mod sys;

#[cfg(test)]
mod cache_tests;

pub use cache::{NOT_FOUND, XnnCache, XnnKey, XnnMode, XnnStats, identity};
pub use engine::{INTERFACES, cpu_identity, engine_identity, engine_interface};
