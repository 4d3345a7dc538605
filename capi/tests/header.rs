//! `include/packd.h` is generated from the C ABI (`src/ffi.rs`, `src/packd.rs`,
//! `src/xnnpack.rs`) by cbindgen; this test fails when the committed header differs from
//! what the source generates. Run with `PACKD_BLESS=1` to rewrite it.

use std::path::Path;

#[test]
fn the_committed_header_matches_the_source() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(crate_dir.join("src/ffi.rs"))
        .with_src(crate_dir.join("src/packd.rs"))
        .with_src(crate_dir.join("src/xnnpack.rs"))
        .generate()
        .expect("generate packd.h");
    let mut generated = Vec::new();
    bindings.write(&mut generated);
    let generated = String::from_utf8(generated).expect("utf-8 header");
    let path = crate_dir.join("include/packd.h");
    if std::env::var_os("PACKD_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("write include/packd.h");
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "include/packd.h is out of date with src/ffi.rs, packd.rs or xnnpack.rs; run PACKD_BLESS=1 cargo test -p packd-capi --test header"
    );
    for f in ["packd_connect", "packd_pack_path", "packd_pack_fd", "packd_get", "packd_model_entry", "packd_last_error"]
    {
        assert!(generated.contains(f), "{f} missing from the header");
    }
}
