//! The spare memfd: a pack job writes into memory allocated ahead of it. Real daemons,
//! real clients, the segments' bytes compared with a daemon that has no spare.

use std::time::Duration;

use packd_client::Plan;
use packd_tests::{Daemon, SafeTensors, values, wait_until};

/// A model of about `mib` MiB: f32 GEMM weights (packed by the kernels), a bias and an
/// odd-sized identity tensor (padding in the segment).
fn model(d: &Daemon, name: &str, mib: usize) -> std::path::PathBuf {
    let file = d.dir().join(name);
    let mut st = SafeTensors::default();
    let layers = u32::try_from(mib * 4).unwrap().max(1);
    for i in 0..layers {
        st = st.f32(&format!("l.{i}.weight"), &[256, 256], &values(256 * 256, i));
    }
    st = st.f32("l.0.bias", &[256], &values(256, 99)).f32("norm.weight", &[13, 7], &values(91, 7));
    st.write(&file);
    file
}

/// Waits until the daemon keeps a spare of `bytes`.
fn spare_ready(d: &Daemon, bytes: u64) {
    assert!(
        wait_until(Duration::from_secs(20), || d.stat("spare_bytes") == bytes),
        "spare_bytes {} (want {bytes}); log:\n{}",
        d.stat("spare_bytes"),
        d.log()
    );
}

/// A first pack job, after which the daemon keeps its spare (none is made before one).
fn first_job(d: &Daemon) {
    let warm = model(d, "warm.safetensors", 0);
    d.client().pack(&warm, &Plan::default()).unwrap().verify().unwrap();
}

/// A pack through a daemon with a spare gives the bytes a daemon without one gives: a
/// spare larger than the segment (shrunk), smaller (grown), and the spare made again after.
#[test]
fn a_pack_into_the_spare_gives_the_bytes_of_a_pack_into_fresh_memory() {
    let plain = Daemon::start_with(&[("PACKD_SPARE_BYTES", "off")]);
    first_job(&plain);
    let file = model(&plain, "m.safetensors", 3);
    let reference = plain.client().pack(&file, &Plan::default()).unwrap();
    assert_eq!(plain.stat("spare_bytes"), 0, "spare off");
    assert_eq!(plain.stat("spare_takes"), 0);
    let size = reference.bytes().len() as u64;
    assert!(size > 3 << 20, "{size}");

    for (spare, how) in [("16MiB", "larger than the segment"), ("1MiB", "smaller than the segment")] {
        let d = Daemon::start_with(&[("PACKD_SPARE_BYTES", spare)]);
        let bytes = packd_proto::units::parse_size(spare).unwrap();
        first_job(&d);
        spare_ready(&d, bytes);
        let model = d.client().pack(&file, &Plan::default()).unwrap();
        model.verify().unwrap();
        assert_eq!(d.stat("spare_takes"), 1, "the job took the spare ({how})");
        assert_eq!(model.key(), reference.key());
        assert_eq!(model.bytes().len(), reference.bytes().len(), "{how}");
        assert!(model.bytes() == reference.bytes(), "the segment's bytes differ from a pack into fresh memory ({how})");
        assert_eq!(d.stat("bytes_resident"), plain.stat("bytes_resident"), "{how}");
        // Made again for the next job, beside the segment.
        spare_ready(&d, bytes);
        let log = d.log();
        assert!(!log.lines().any(|l| l.contains("spare") && (l.contains("WARN") || l.contains("ERROR"))), "{log}");
    }
}

/// The spare never costs a segment: a pack that needs its room drops it (nothing is
/// evicted), and it is not made again while it does not fit.
#[test]
fn the_spare_gives_way_to_segments_and_evicts_nothing() {
    // Budget 8 MiB, spare 4 MiB: a model of ~5 MiB fits beside the first job's only if the
    // spare goes.
    let d = Daemon::start_with(&[("PACKD_MAX_BYTES", "8MiB"), ("PACKD_SPARE_BYTES", "4MiB")]);
    first_job(&d);
    spare_ready(&d, 4 << 20);
    let first = model(&d, "a.safetensors", 5);
    let a = d.client().pack(&first, &Plan::default()).unwrap();
    a.verify().unwrap();
    assert_eq!(d.stat("evictions"), 0);
    assert_eq!(d.stat("segments"), 2);
    // The job's reservation needed the spare's room: the spare went, the job allocated its
    // own memory, and there is no room for another spare beside the segment.
    assert_eq!(d.stat("spare_takes"), 0);
    let resident = d.stat("bytes_resident");
    assert!(resident <= 8 << 20 && (8 << 20) - resident < 4 << 20, "{resident}: a spare would fit");
    assert_eq!(d.stat("spare_bytes"), 0, "a spare was made without room for it");

    // A budget change that needs the spare's room drops it (and evicts nothing).
    let d = Daemon::start_with(&[("PACKD_MAX_BYTES", "12MiB"), ("PACKD_SPARE_BYTES", "6MiB")]);
    first_job(&d);
    spare_ready(&d, 6 << 20);
    let small = model(&d, "s.safetensors", 1);
    d.client().pack(&small, &Plan::default()).unwrap();
    spare_ready(&d, 6 << 20);
    let resident = d.stat("bytes_resident");
    let out = d.packctl(&["budget", "4MiB"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(d.stat("spare_bytes"), 0, "the spare gave way to the budget");
    assert_eq!((d.stat("evictions"), d.stat("bytes_resident")), (0, resident));
    // The next job finds no spare and allocates its own memory; no spare fits after it.
    let next = model(&d, "n.safetensors", 1);
    d.client().pack(&next, &Plan::default()).unwrap().verify().unwrap();
    assert_eq!((d.stat("spare_takes"), d.stat("evictions")), (1, 0));
    assert_eq!(d.stat("spare_bytes"), 0, "the 4 MiB budget has no room for a 6 MiB spare");
    // A larger budget has room again: the spare is made without waiting for a job.
    let out = d.packctl(&["budget", "64MiB"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    spare_ready(&d, 6 << 20);
    assert_eq!(d.stat("evictions"), 0);
}
