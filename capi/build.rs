//! Gives the C library its SONAME in every build (debug, release, `cargo build` or
//! `./install.sh`): `libpackd_client.so.X.Y` for 0.Y releases (a 0.Y release may break its
//! ABI at 0.Y+1), `libpackd_client.so.X` from 1.0. Programs linked against it record that
//! name; `./install.sh` installs the link of that name, and the build directory gets one from
//! whoever links there (the tests, `examples/xnnpack/build`).

fn main() {
    let major = std::env::var("CARGO_PKG_VERSION_MAJOR").unwrap_or_else(|_| "0".into());
    let minor = std::env::var("CARGO_PKG_VERSION_MINOR").unwrap_or_else(|_| "0".into());
    let sover = if major == "0" { format!("{major}.{minor}") } else { major };
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libpackd_client.so.{sover}");
    println!("cargo:rerun-if-changed=build.rs");
}
