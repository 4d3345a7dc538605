use std::sync::Arc;

use super::*;
use crate::pack::Packed;

fn finished(store: &Arc<Store>, size: u64) -> Result<Finished, PackError> {
    let reservation = store.reserve(size).map_err(|e| PackError::Budget(e.to_string()))?;
    let file = crate::sys::memfd::create("t").unwrap();
    file.set_len(size).unwrap();
    Ok(Finished {
        packed: Packed { file, size, entries: vec![] },
        source: Digest([7; 32]),
        plan: "p".into(),
        pack_ms: 1.0,
        reservation,
    })
}

fn pack(store: &Arc<Store>, key: &str, size: u64) -> FlightResult {
    let Lookup::Lead(leader) = store.lookup_or_lead(key) else { panic!("{key} must lead") };
    let done = finished(store, size);
    leader.finish(done)
}

#[test]
fn single_flight_then_hits() {
    let store = Store::new(9, 1 << 30);
    let Lookup::Lead(leader) = store.lookup_or_lead("k") else { panic!("first lookup must lead") };
    let Lookup::Wait(mut flight) = store.lookup_or_lead("k") else { panic!("second must wait") };
    let seg = leader.finish(finished(&store, 4096)).unwrap();
    assert_eq!(flight.borrow_and_update().as_ref().unwrap().as_ref().unwrap().id, seg.id);
    assert!(matches!(store.lookup_or_lead("k"), Lookup::Ready(_)));
    let s = store.stats();
    assert_eq!((s.pack_jobs, s.misses, s.hits, s.segments, s.bytes_resident), (1, 1, 2, 1, 4096));
}

#[test]
fn abandoned_leader_fails_waiters_and_leaves_nothing() {
    let store = Store::new(1, 1 << 30);
    let Lookup::Lead(leader) = store.lookup_or_lead("k") else { panic!() };
    let Lookup::Wait(flight) = store.lookup_or_lead("k") else { panic!() };
    drop(leader);
    assert!(flight.borrow().as_ref().unwrap().is_err());
    assert_eq!(store.stats().segments, 0);
    assert!(matches!(store.lookup_or_lead("k"), Lookup::Lead(_)));
}

#[test]
fn leases_follow_connections() {
    let store = Store::new(5, 1 << 30);
    let seg = pack(&store, "k", 4096).unwrap();
    let (a, b) = (store.connect(Peer::default()), store.connect(Peer::default()));
    store.lease(a, &seg);
    store.lease(a, &seg);
    store.lease(b, &seg);
    assert_eq!(store.stats().leases, 3);
    assert_eq!(store.release(a, seg.id, 4), Err(ReleaseError::Generation { id: seg.id, got: 4, want: 5 }));
    store.release(a, seg.id, 5).unwrap();
    assert_eq!(store.stats().leases, 2);
    store.disconnect(a);
    assert_eq!(store.stats().leases, 1);
    assert_eq!(store.release(a, seg.id, 5), Err(ReleaseError::NotHeld(seg.id)));
    assert_eq!(store.stats().clients, 1);
    assert_eq!(store.list_clients()[0].bytes_mapped, 4096);
}

#[test]
fn the_budget_evicts_least_recently_used_unleased_unpinned() {
    let store = Store::new(1, 3 * 4096);
    let a = pack(&store, "a", 4096).unwrap();
    pack(&store, "b", 4096).unwrap();
    pack(&store, "c", 4096).unwrap();
    // Touch a: b is now least recently used.
    assert!(matches!(store.lookup_or_lead("a"), Lookup::Ready(_)));
    pack(&store, "d", 4096).unwrap();
    assert!(store.get("b").is_none(), "b was LRU");
    assert!(store.get("a").is_some() && store.get("c").is_some());
    // Pin c and lease a: the next pack must evict d (the only candidate).
    store.pin(&Selector::Key("c".into()), true).unwrap();
    let client = store.connect(Peer { pid: Some(42), uid: 0, gid: 0 });
    store.lease(client, &a);
    pack(&store, "e", 4096).unwrap();
    assert!(store.get("d").is_none());
    // Now a is leased, c pinned, e the only unleased: e goes, then nothing more can.
    pack(&store, "f", 4096).unwrap();
    assert!(store.get("e").is_none());
    store.lease(client, &store_get(&store, "f"));
    let err = finished(&store, 4096).err().unwrap().to_string();
    assert!(err.contains("budget of 12288 bytes") && err.contains("pid 42") && err.contains("pinned"), "{err}");
    assert_eq!(store.stats().evictions, 3);
    assert!(store.stats().bytes_resident <= store.stats().budget_bytes);
}

fn store_get(store: &Arc<Store>, key: &str) -> Arc<Segment> {
    match store.get(key) {
        Some(Lookup::Ready(s)) => s,
        _ => panic!("{key} not ready"),
    }
}

#[test]
fn forced_eviction_makes_zombies_until_released() {
    let store = Store::new(1, 1 << 30);
    let seg = pack(&store, "k", 8192).unwrap();
    let client = store.connect(Peer { pid: Some(7), uid: 0, gid: 0 });
    store.lease(client, &seg);
    let err = store.evict(&Selector::Key("k".into()), false).unwrap_err().to_string();
    assert!(err.contains("pid 7"), "{err}");
    let report = store.evict(&Selector::Prefix("k".into()), true).unwrap();
    assert_eq!(report.zombies, vec!["k".to_string()]);
    let s = store.stats();
    assert_eq!((s.segments, s.zombie_bytes, s.leases), (0, 8192, 1));
    store.release(client, seg.id, 1).unwrap();
    assert_eq!(store.stats().zombie_bytes, 0);
    assert!(matches!(store.evict(&Selector::Key("k".into()), false), Err(EvictError::NotFound(_))));
}

#[test]
fn lowering_the_budget_evicts() {
    let store = Store::new(1, 1 << 30);
    pack(&store, "a", 4096).unwrap();
    pack(&store, "b", 4096).unwrap();
    assert_eq!(store.set_budget(4096), (4096, true));
    assert_eq!(store.stats().segments, 1);
    assert!(store.get("a").is_none(), "a was least recently used");
}

#[test]
fn a_segment_that_cannot_fit_evicts_nothing() {
    let store = Store::new(1, 3 * 4096);
    let a = pack(&store, "a", 4096).unwrap();
    pack(&store, "b", 4096).unwrap();
    pack(&store, "c", 4096).unwrap();
    let client = store.connect(Peer { pid: Some(7), uid: 0, gid: 0 });
    store.lease(client, &a);
    // b and c could go, but even then 3 pages do not fit beside the leased a.
    let err = store.admit(3 * 4096).unwrap_err();
    assert_eq!((err.needed, err.budget), (3 * 4096, 3 * 4096));
    assert!(store.reserve(3 * 4096).is_err());
    assert_eq!((store.stats().segments, store.stats().evictions), (3, 0), "nothing was evicted");
    // Two pages fit once b and c go: admitted, and then the reservation evicts them.
    store.admit(2 * 4096).unwrap();
    let r = store.reserve(2 * 4096).unwrap();
    assert_eq!((store.stats().segments, store.stats().evictions), (1, 2));
    drop(r);
}
