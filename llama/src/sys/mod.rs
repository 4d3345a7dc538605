//! Where this crate's `unsafe` lives: the functions put in llama.cpp's GOT slots and in the
//! `CPU_REPACK` buffers' function tables ([`hooks`]), which read ggml's structures and map
//! packd's segments under the buffers; and ggml's exported functions packd calls, found by
//! name ([`ggml_api`]); the counting of weights in buffer types packd does not share
//! ([`unshared`]).

pub(crate) mod ggml_api;
pub(crate) mod hooks;
pub(crate) mod unshared;
