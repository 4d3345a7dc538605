//! Where the workspace's binaries are.

use std::path::PathBuf;

/// Directory holding the workspace's binaries (`target/<profile>`).
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let deps = exe.parent().expect("deps dir");
    deps.parent().expect("profile dir").to_path_buf()
}

fn bin(name: &str) -> PathBuf {
    let path = bin_dir().join(name);
    assert!(
        path.is_file(),
        "{} is missing: run the tests with `cargo test --workspace` (which builds it) or `cargo build --workspace` first",
        path.display()
    );
    path
}

/// Path of the `packd` binary.
pub fn packd_bin() -> PathBuf {
    bin("packd")
}

/// Path of the `packctl` binary.
pub fn packctl_bin() -> PathBuf {
    bin("packctl")
}
