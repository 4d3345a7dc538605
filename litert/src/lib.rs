//! packd as LiteRT's XNNPACK weight cache.
//!
//! LiteRT's `CompiledModel` takes a weight-cache file path (`CpuOptions.xnnpack_weight_cache_path`):
//! XNNPACK's packed weights are written there by the first process and mapped by the next.
//! packd gives LiteRT that path. For a model packd serves it names the sealed memfd every
//! worker maps; for the first worker it names a memfd of its own, which packd seals and
//! publishes once the compile is over ([`cache::WeightCache`]). Workers that start
//! together meet at packd: one builds, the others wait for its publication (or build
//! privately when waiting would take longer), so no two processes write one file.
//!
//! Nothing is interposed: LiteRT's libraries export no XNNPACK symbol. The Python package
//! (`packd.litert.enable()`) wraps `CompiledModel.from_file` and `from_buffer` around
//! [`cache::WeightCache::open`] and [`cache::WeightCache::finish`]. What packd reads of the
//! cache file is in [`format`]. Sealing a build in place is `unsafe` and lives in `sys`;
//! [`cache::WeightCache::finish`], which calls it, is an `unsafe fn` whose contract is that
//! nothing maps LiteRT's cache meanwhile.

pub mod cache;
pub mod format;
mod sys;

pub use cache::{Model, Models, Outcome, Settings, Status, WeightCache, note_private, status};
