//! The engine-neutral part of packd's engine adapters (`packd-xnnpack`, `packd-llama`,
//! `packd-litert`).
//!
//! An adapter makes packd an engine's store of packed weights without rebuilding the
//! engine: it finds the engine among the loaded objects, points the GOT slots through which
//! other objects call a few of the engine's functions at its own hooks, and backs what the
//! engine packs with memory packd shares. What does not depend on the engine is here:
//!
//! - [`sys`]: the loaded objects and their GOT slots, libraries held by handle, the
//!   address-space reservation with its sealed memfds, copying text out to C;
//! - [`maps`]: this process's mappings (`/proc/self/maps`);
//! - [`memo`]: the per-user memo of content names and the digest of a mapped model file;
//! - [`identity`]: the CPU and a library's build, for cache identities;
//! - [`scan`]: the scan that pins new objects, lets the adapter find its engine in them,
//!   and writes the adapter's hooks into their slots;
//! - [`entry`]: what every C entry point needs (panics caught, a registered handler for
//!   hooks to call, one line to stderr, the status written at exit);
//! - [`ledger`]: the counts every adapter's status holds ([`ledger::Ledger`]), the
//!   [`ledger::Journal`] that keeps them for the process, says and reports private work
//!   (typed: [`ledger::Private`]) and publishes a build aside; the connection reports use;
//! - [`status`]: the reasons counted, bounded, the JSON every status is written as, and
//!   the report packd counts.
//!
//! Nothing here imports an adapter: hooks reach their adapter through what it registered
//! ([`entry::Registered`]). `unsafe` lives in [`sys`], and in what `c_entry!` expands to in
//! an adapter's library: its C exports and the one copy into a C caller's buffer.

pub mod entry;
pub mod hold;
pub mod identity;
pub mod ledger;
pub mod memo;
pub mod scan;
pub mod status;
pub mod sys;

/// `/proc/self/maps`, read (it lives in `sys`, the bottom floor, which reads it too).
pub use sys::maps;
