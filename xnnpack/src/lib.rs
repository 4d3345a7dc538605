//! packd's XNNPACK adapter: the weights-cache provider's state ([`cache`]: blocks handed to
//! XNNPACK, read back only where this cache reserved them), the engine's identity and
//! interface told from the loaded library ([`engine`]), and the adoption of an engine that
//! exports XNNPACK's C API without a rebuild ([`adopt`], with the hooks and the provider's
//! callbacks in `sys`). It stands on `packd-interpose`, the engine-neutral kit (GOT slots,
//! the address-space reservation, the memo of names); `unsafe` lives in `sys` and in `cache`
//! (the blocks it hands out).
//!
//! `packd-capi` puts a C ABI over it (`packd_xnnpack.h`); its preload library
//! (`preload/`, `libpackd_xnnpack_preload.so`) and the Python module turn the adoption on.
//! A build under provisional names renames its entries through the table in `names`.

pub mod adopt;
pub mod cache;
pub mod engine;
mod names;
mod sys;

#[cfg(test)]
mod cache_tests;

pub use cache::{NOT_FOUND, XnnCache, XnnKey, XnnMode, XnnStats, identity};
pub use engine::{INTERFACES, InterfaceError, cpu_identity, engine_identity, engine_interface};
