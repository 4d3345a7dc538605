//! The C ABI of packd's client (`libpackd_client.so` / `.a`, `capi/include/packd.h`) and of
//! packd's XNNPACK weights-cache provider (`capi/include/packd_xnnpack.h`, over
//! `packd-xnnpack`), over the Rust client library (`packd-client`).
//!
//! Everything here hands raw memory to C or takes it from C: [`capi`] holds the
//! `extern "C"` functions (every pointer a caller passes is checked for NULL, every panic in
//! them is caught). The XNNPACK provider's callbacks, which XNNPACK calls while it builds a
//! runtime, are not guarded: a panic there (a bug) aborts the process rather than go on
//! with a weights cache in an unknown state. `packd-client` itself stays a plain Rust
//! library with no C ABI.

pub mod capi;
