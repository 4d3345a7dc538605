//! Leases die with their connection: SIGKILLed holders leave nothing behind.
#![allow(clippy::cast_possible_truncation)] // test data sizes are small

use std::process::Child;
use std::time::Duration;

use packd_tests::{Daemon, small_model, wait_until};

#[test]
fn sigkill_of_holders_drops_leases_and_fds() {
    let d = Daemon::start();
    let file = d.dir().join("small.safetensors");
    small_model(&file);
    let path = file.to_str().unwrap();
    // Pack once and let every connection close, then take the fd baseline.
    assert!(d.packctl(&["pack", path]).status.success());
    assert!(wait_until(Duration::from_secs(10), || d.stat("clients") == 0));
    let baseline = d.settled_fd_count();

    for cycle in 0..5 {
        let mut holders: Vec<Child> = (0..4).map(|_| d.holder(path, &["--hold", "600"])).collect();
        assert!(
            wait_until(Duration::from_secs(10), || d.stat("leases") == 4 && d.stat("clients") == 4),
            "cycle {cycle}: {}",
            d.stats()
        );
        assert!(d.fd_count() > baseline, "connections hold fds in the daemon");
        for h in &mut holders {
            h.kill().unwrap(); // SIGKILL
            h.wait().unwrap();
        }
        assert!(
            wait_until(Duration::from_secs(10), || d.stat("leases") == 0 && d.stat("clients") == 0),
            "cycle {cycle}: {}",
            d.stats()
        );
        assert!(
            wait_until(Duration::from_secs(10), || d.fd_count() <= baseline),
            "cycle {cycle}: daemon holds {} fds, baseline {baseline}",
            d.fd_count()
        );
    }
    let stats = d.stats();
    assert_eq!(stats["segments"], 1, "the segment survives its holders");
    assert_eq!(stats["pack_jobs"], 1, "holders were served from the index");
}
