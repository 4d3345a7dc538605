//! Finds the capabilities the end-to-end tests need beyond the workspace, and sets a cfg for
//! each one found; tests that need a missing one are ignored, with a reason. Under CI
//! (`CI=true`), where `.ci/run` installs every one of them, a capability not found fails the
//! build, naming it and what was looked for: a fetch that leaves an incomplete root can never
//! turn into tests quietly ignored.
//!
//! - `packd_model`: the MiniLM model (`PACKD_TEST_MODEL`, or `.ci/cache/minilm/`);
//! - `packd_grpcurl`: grpcurl (`PACKD_GRPCURL`, or `.ci/cache/venv/bin/grpcurl`);
//! - `packd_xnnpack`: an XNNPACK root (`XNNPACK_ROOT`, or `.ci/cache/xnnpack/root`, made by
//!   examples/xnnpack/fetch-xnnpack);
//! - `packd_xnnpack_current`: the current XNNPACK's root (`XNNPACK_CURRENT_ROOT`, or
//!   `.ci/cache/xnnpack-current/root`, made by examples/xnnpack/fetch-xnnpack-current);
//! - `packd_llama`: a llama.cpp root (`LLAMA_ROOT`, or `.ci/cache/llama/0.3.36/root`, made by
//!   examples/llama/fetch-llama) and a test GGUF (`PACKD_LLAMA_MODEL`, or
//!   `.ci/cache/llama/test.gguf`, made by examples/llama/make-model.py);
//! - `packd_systemd_analyze`, `packd_socket_activate`: systemd's tools (Debian's `systemd`);
//! - `packd_c_tools`: `cc`, `readelf` and `pkg-config` (the documented C install commands).

use std::path::{Path, PathBuf};

/// A capability: its cfg name, and whether it was found (else what is missing and how to
/// get it).
struct Capability {
    cfg: &'static str,
    found: Result<(), String>,
}

fn cache() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.ci/cache")
}

/// `var`'s path, else `fallback`; tells cargo to look again when either changes.
fn path_from(var: &str, fallback: PathBuf) -> PathBuf {
    println!("cargo:rerun-if-env-changed={var}");
    std::env::var_os(var).map(PathBuf::from).unwrap_or(fallback)
}

/// Ok when every file in `files` (relative to `root`) is a file.
fn files(what: &str, root: &Path, files: &[&str], how: &str) -> Result<(), String> {
    for f in files {
        let p = root.join(f);
        println!("cargo:rerun-if-changed={}", p.display());
        if !p.is_file() {
            return Err(format!("{what}: {} is missing ({how})", p.display()));
        }
    }
    Ok(())
}

/// Ok when every tool in `tools` is on PATH.
fn tools(tools: &[&str], how: &str) -> Result<(), String> {
    println!("cargo:rerun-if-env-changed=PATH");
    let path = std::env::var_os("PATH").unwrap_or_default();
    for t in tools {
        if !std::env::split_paths(&path).any(|d| d.join(t).is_file()) {
            return Err(format!("{t} is not on PATH ({how})"));
        }
    }
    Ok(())
}

fn main() {
    let run_ci = "run .ci/run";
    let model = path_from("PACKD_TEST_MODEL", cache().join("minilm/model.safetensors"));
    let grpcurl = path_from("PACKD_GRPCURL", cache().join("venv/bin/grpcurl"));
    let xnnpack = path_from("XNNPACK_ROOT", cache().join("xnnpack/root"));
    let current = path_from("XNNPACK_CURRENT_ROOT", cache().join("xnnpack-current/root"));
    let llama = path_from("LLAMA_ROOT", cache().join("llama/0.3.36/root"));
    let gguf = path_from("PACKD_LLAMA_MODEL", cache().join("llama/test.gguf"));
    // Single files as given (a relative path from the working directory, as before).
    let root = Path::new("");
    let caps = [
        Capability {
            cfg: "packd_model",
            found: files(
                "the MiniLM model",
                root,
                &[&model.to_string_lossy()],
                &format!("{run_ci} or set PACKD_TEST_MODEL"),
            ),
        },
        Capability {
            cfg: "packd_grpcurl",
            found: files("grpcurl", root, &[&grpcurl.to_string_lossy()], &format!("{run_ci} or set PACKD_GRPCURL")),
        },
        Capability {
            cfg: "packd_xnnpack",
            found: files(
                "the XNNPACK root",
                &xnnpack,
                &["usr/include/xnnpack.h", "usr/lib/x86_64-linux-gnu/libXNNPACK.so"],
                "examples/xnnpack/fetch-xnnpack DIR, then XNNPACK_ROOT=DIR/root",
            ),
        },
        Capability {
            cfg: "packd_xnnpack_current",
            found: files(
                "the current XNNPACK root",
                &current,
                &["usr/lib/x86_64-linux-gnu/libexecutorch_backend_xnnpack.so", "usr/include/xnnpack.h"],
                "examples/xnnpack/fetch-xnnpack-current DIR, then XNNPACK_CURRENT_ROOT=DIR/root",
            ),
        },
        Capability {
            cfg: "packd_llama",
            found: files(
                "the llama.cpp root",
                &llama,
                &["lib/libllama.so", "lib/libggml.so", "include/llama.h", "bin/llama-server"],
                "examples/llama/fetch-llama [--version V] DIR, then LLAMA_ROOT=DIR/root",
            )
            .and_then(|()| {
                files(
                    "the test GGUF",
                    root,
                    &[&gguf.to_string_lossy()],
                    "examples/llama/make-model.py FILE, then PACKD_LLAMA_MODEL=FILE",
                )
            }),
        },
        Capability { cfg: "packd_systemd_analyze", found: tools(&["systemd-analyze"], "apt-get install systemd") },
        Capability {
            cfg: "packd_socket_activate",
            found: tools(&["systemd-socket-activate"], "apt-get install systemd"),
        },
        Capability {
            cfg: "packd_c_tools",
            found: tools(&["cc", "readelf", "pkg-config"], "apt-get install gcc binutils pkg-config"),
        },
    ];
    println!("cargo:rerun-if-env-changed=CI");
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    let mut missing = Vec::new();
    for cap in &caps {
        println!("cargo::rustc-check-cfg=cfg({})", cap.cfg);
        match &cap.found {
            Ok(()) => println!("cargo:rustc-cfg={}", cap.cfg),
            Err(why) => missing.push(format!("{}: {why}", cap.cfg)),
        }
    }
    if ci && !missing.is_empty() {
        panic!(
            "CI=true, and .ci/run installs every capability the tests use, but these were not found \
             (their tests would be ignored):\n  {}",
            missing.join("\n  ")
        );
    }
}
