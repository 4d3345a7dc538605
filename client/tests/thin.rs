//! Depending on `packd-client` must stay cheap: no async runtime, no gRPC stack, no plotting
//! and no daemon code in its dependency tree (packctl, in its own crate, has those).

use std::process::Command;

#[test]
fn the_library_pulls_no_runtime_grpc_plotting_or_daemon() {
    let out = Command::new(env!("CARGO"))
        .args(["tree", "--offline", "-p", "packd-client", "-e", "normal", "--prefix", "none"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo tree");
    let tree = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && tree.contains("packd-client v"), "{tree}{}", String::from_utf8_lossy(&out.stderr));
    for banned in ["tokio ", "tonic ", "hyper ", "plotters ", "packd v"] {
        let found: Vec<&str> = tree.lines().filter(|l| l.starts_with(banned)).collect();
        assert!(found.is_empty(), "packd-client depends on {found:?}");
    }
}
