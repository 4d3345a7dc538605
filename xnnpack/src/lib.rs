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
mod hold;
mod maps;
mod names;
mod sys;

#[cfg(test)]
mod cache_tests;

pub use cache::{NOT_FOUND, XnnCache, XnnKey, XnnMode, XnnStats, identity};
pub use engine::{INTERFACES, cpu_identity, engine_identity, engine_interface};

/// Building blocks packd's other engine integrations share (`packd-llama`): the
/// address-space reservation and sealed memfds, the loaded objects and their GOT slots,
/// libraries held by handle, this process's mappings, and the memo of file digests.
pub mod shared {
    pub use crate::hold::hold_as;
    pub use crate::maps::{Mapping, at as mapping_at};
    pub use crate::names::{FileDigest, mapped_file_digest};
    pub use crate::sys::dl::Loaded;
    pub use crate::sys::got::{Import, Object, imports, objects, read_slot, write_slot};
    pub use crate::sys::vm::{Reservation, allocate_alongside, memfd, page, reopen_read_only, seal};
}
