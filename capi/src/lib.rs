//! The C ABI of packd's client (`libpackd_client.so` / `.a`, `capi/include/packd.h`) and of
//! packd's XNNPACK weights-cache provider (`capi/include/packd_xnnpack.h`, over
//! `packd-xnnpack`), over the Rust client library (`packd-client`). One module per header:
//! [`packd`] (`packd.h`'s client), [`xnnpack`] (the provider `packd_xnnpack.h` fills), and
//! what both share in `ffi` (the status, the last error, the NULL check).
//!
//! Every pointer a caller passes is checked for NULL, every panic in an entry point is
//! caught. `packd-client` itself stays a plain Rust library with no C ABI.

mod ffi;
pub mod packd;
pub mod xnnpack;
