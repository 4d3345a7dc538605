//! Compiles `proto/packd.proto` with protox (pure Rust, no system `protoc`).

use std::{env, fs, path::PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let out = PathBuf::from(env::var("OUT_DIR")?);

    let mut compiler = protox::Compiler::new(["proto"])?;
    compiler.include_source_info(true).include_imports(true).open_files(["packd.proto"])?;
    fs::write(out.join("packd_descriptor.bin"), compiler.encode_file_descriptor_set())?;

    // Service stubs are gated behind the crate's `grpc` feature, so the data-plane
    // messages compile without tonic.
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .build_transport(false)
        .server_mod_attribute("packd.v1", "#[cfg(feature = \"grpc\")]")
        .client_mod_attribute("packd.v1", "#[cfg(feature = \"grpc\")]")
        .compile_fds(compiler.file_descriptor_set())?;
    Ok(())
}
