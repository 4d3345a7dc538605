//! Sets `cfg(packd_llama)` when a llama.cpp root with ggml's private headers is available
//! (`LLAMA_ROOT`, or the one `.ci/run` makes in `.ci/cache/llama/0.3.36/root` with
//! examples/llama/fetch-llama): the test that checks `ggml.rs` against those headers is
//! ignored, with a reason, otherwise.

use std::path::PathBuf;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(packd_llama)");
    println!("cargo:rerun-if-env-changed=LLAMA_ROOT");
    let fallback = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.ci/cache/llama/0.3.36/root");
    let header = "include/ggml-private/ggml-backend-impl.h";
    println!("cargo:rerun-if-changed={}", fallback.join(header).display());
    let root = std::env::var_os("LLAMA_ROOT").map(PathBuf::from).unwrap_or(fallback);
    if root.join(header).is_file() {
        println!("cargo:rustc-cfg=packd_llama");
    } else if std::env::var_os("CI").is_some_and(|v| v == "true") {
        // .ci/run builds every root it tests: a missing one must not pass as an ignored test.
        panic!("CI: no llama.cpp root with ggml's private headers at {} (LLAMA_ROOT)", root.display());
    }
}
