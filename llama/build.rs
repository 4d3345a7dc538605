//! Sets `cfg(packd_llama)` when a llama.cpp root with ggml's private headers is available
//! (`LLAMA_ROOT`, or the one `.ci/run` makes in `.ci/cache/llama/root` with
//! examples/llama/fetch-llama): the test that checks `ggml.rs` against those headers is
//! ignored, with a reason, otherwise.

use std::path::PathBuf;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(packd_llama)");
    println!("cargo:rerun-if-env-changed=LLAMA_ROOT");
    let fallback = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.ci/cache/llama/root");
    let header = "include/ggml-private/ggml-backend-impl.h";
    println!("cargo:rerun-if-changed={}", fallback.join(header).display());
    let root = std::env::var_os("LLAMA_ROOT").map(PathBuf::from).unwrap_or(fallback);
    if root.join(header).is_file() {
        println!("cargo:rustc-cfg=packd_llama");
    }
}
