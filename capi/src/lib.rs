//! The C ABI of packd's client (`libpackd_client.so` / `.a`, `capi/include/packd.h`) and
//! packd's XNNPACK weights-cache provider (`capi/include/packd_xnnpack.h`), over the Rust
//! client library (`packd-client`).
//!
//! Everything here hands raw memory to C or takes it from C, so this crate is where the
//! client side's `unsafe` lives: [`capi`] (the `extern "C"` functions: every pointer a caller
//! passes is checked for NULL, every panic is caught), [`xnn`] (the provider's state: blocks
//! handed to XNNPACK, read back only where this cache reserved them) and [`vm`] (an
//! address-space reservation whose `MAP_FIXED` calls are `unsafe` with their contract).
//! `packd-client` itself stays a plain Rust library with no C ABI.

pub mod capi;
mod vm;
pub mod xnn;

#[cfg(test)]
mod xnn_tests;
