//! packd for ONNX Runtime: the optimized form of a model, with its weights and MLAS's
//! prepacked weights as external data, built once per host into a sealed memfd that every
//! worker's session maps.
//!
//! ONNX Runtime can write a session's optimized model with its initializers, and the blobs
//! its kernels prepacked, in an external data file (`session.save_external_prepacked_constant_initializers`),
//! and a session over that model maps the file and prepacks nothing. packd has the first
//! worker on the host write it into memory packd publishes, and every other worker's session
//! map packd's copy ([`session::Share`]). ONNX Runtime opens external data by path: a served
//! worker's placeholder path reads as the memfd through hooks on ONNX Runtime's `open` and
//! `readlink` calls (`sys`, this crate's `unsafe`). What packd reads of a model (the external
//! files its tensors name) is in [`onnx`].
//!
//! The Python package (`packd.onnxruntime.enable()`) wraps `InferenceSession` around
//! [`session::Share`].

pub mod onnx;
pub mod session;
mod sys;

pub use session::{BUILD_ENTRIES, DATA_FILE, ENGINE, KEYED_ENTRIES, Model, Role, Sessions, Share, Status, status};
