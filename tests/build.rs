//! Sets `cfg(packd_model)` when the MiniLM test model is available (`PACKD_TEST_MODEL`, or
//! the copy `.ci/run` keeps in `.ci/cache/minilm/`) and `cfg(packd_grpcurl)` when grpcurl is
//! (`PACKD_GRPCURL`, or the venv `.ci/run` makes in `.ci/cache/venv/`), and
//! `cfg(packd_xnnpack)` when an XNNPACK root is (`XNNPACK_ROOT`, or the one `.ci/run` makes
//! in `.ci/cache/xnnpack/root` with examples/xnnpack/fetch-xnnpack), and
//! `cfg(packd_xnnpack_current)` when the current XNNPACK's root is (`XNNPACK_CURRENT_ROOT`,
//! or `.ci/cache/xnnpack-current/root`, made by examples/xnnpack/fetch-xnnpack-current), and
//! `cfg(packd_llama)` when a llama.cpp root (`LLAMA_ROOT`, or `.ci/cache/llama/root`, made by
//! examples/llama/fetch-llama) and a test GGUF (`PACKD_LLAMA_MODEL`, or
//! `.ci/cache/llama/test.gguf`, made by examples/llama/make-model.py) are.
//! Tests that need them
//! are ignored, with a reason, otherwise.

use std::path::PathBuf;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(packd_model)");
    println!("cargo::rustc-check-cfg=cfg(packd_grpcurl)");
    println!("cargo::rustc-check-cfg=cfg(packd_xnnpack)");
    println!("cargo::rustc-check-cfg=cfg(packd_xnnpack_current)");
    println!("cargo::rustc-check-cfg=cfg(packd_llama)");
    println!("cargo:rerun-if-env-changed=LLAMA_ROOT");
    println!("cargo:rerun-if-env-changed=PACKD_LLAMA_MODEL");
    let llama = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.ci/cache/llama");
    println!("cargo:rerun-if-changed={}", llama.join("root/lib/libllama.so").display());
    println!("cargo:rerun-if-changed={}", llama.join("test.gguf").display());
    let root = std::env::var_os("LLAMA_ROOT").map(PathBuf::from).unwrap_or_else(|| llama.join("root"));
    let model = std::env::var_os("PACKD_LLAMA_MODEL").map(PathBuf::from).unwrap_or_else(|| llama.join("test.gguf"));
    if root.join("lib/libllama.so").exists() && root.join("include/llama.h").is_file() && model.is_file() {
        println!("cargo:rustc-cfg=packd_llama");
    }
    println!("cargo:rerun-if-env-changed=XNNPACK_ROOT");
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.ci/cache/xnnpack/root");
    println!("cargo:rerun-if-changed={}", root.join("usr/include/xnnpack.h").display());
    let root = std::env::var_os("XNNPACK_ROOT").map(PathBuf::from).unwrap_or(root);
    if root.join("usr/include/xnnpack.h").is_file() {
        println!("cargo:rustc-cfg=packd_xnnpack");
    }
    println!("cargo:rerun-if-env-changed=XNNPACK_CURRENT_ROOT");
    let current = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.ci/cache/xnnpack-current/root");
    let lib = "usr/lib/x86_64-linux-gnu/libexecutorch_backend_xnnpack.so";
    println!("cargo:rerun-if-changed={}", current.join(lib).display());
    let current = std::env::var_os("XNNPACK_CURRENT_ROOT").map(PathBuf::from).unwrap_or(current);
    if current.join(lib).is_file() && current.join("usr/include/xnnpack.h").is_file() {
        println!("cargo:rustc-cfg=packd_xnnpack_current");
    }
    println!("cargo:rerun-if-env-changed=PACKD_GRPCURL");
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.ci/cache/venv/bin/grpcurl");
    println!("cargo:rerun-if-changed={}", venv.display());
    let grpcurl = std::env::var_os("PACKD_GRPCURL").map(PathBuf::from).unwrap_or(venv);
    if grpcurl.is_file() {
        println!("cargo:rustc-cfg=packd_grpcurl");
    }
    println!("cargo:rerun-if-env-changed=PACKD_TEST_MODEL");
    let fallback = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.ci/cache/minilm/model.safetensors");
    println!("cargo:rerun-if-changed={}", fallback.display());
    let path = std::env::var_os("PACKD_TEST_MODEL").map(PathBuf::from).unwrap_or(fallback);
    if path.is_file() {
        println!("cargo:rustc-cfg=packd_model");
    }
}
