//! Where this crate's `unsafe` lives, and nothing else: ggml's structures as each supported
//! version lays them out ([`ggml`]); the functions put in llama.cpp's GOT slots and in the
//! `CPU_REPACK` buffers' function tables ([`hooks`]), which read what ggml hands them and
//! call the handler the adapter registered ([`handler`]); the memory packd puts under a buffer and the
//! model file's pages ([`buffer`]); ggml's exported functions packd calls, found by name
//! ([`ggml_api`]); the buffers of types packd does not share, watched ([`unshared`]).
//! Nothing here imports the rest of the crate.

pub(crate) mod buffer;
pub mod ggml;
pub(crate) mod ggml_api;
pub(crate) mod handler;
pub(crate) mod hooks;
pub(crate) mod unshared;
