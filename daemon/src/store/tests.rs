use std::sync::Arc;

use super::*;
use crate::key::FileFlight;
use crate::pack::Packed;

/// The segment key a test calls `name`.
fn k(name: &str) -> SegmentKey {
    SegmentKey::new(&Digest(*blake3::hash(name.as_bytes()).as_bytes()), "p")
}

/// [`k`] as a key a client names.
fn q(name: &str) -> Key {
    Key::Segment(k(name))
}

fn finished(store: &Arc<Store>, size: u64) -> Result<Finished, JobError> {
    finished_for(store, None, size)
}

/// A finished job packed at the request of `owner`.
fn finished_for(store: &Arc<Store>, owner: Option<u32>, size: u64) -> Result<Finished, JobError> {
    let reservation = store.reserve(owner, size)?;
    let file = crate::sys::memfd::create("t").unwrap();
    file.set_len(size).unwrap();
    Ok(Finished {
        key: None,
        packed: Packed { file, size, entries: vec![], digest: Digest([7; 32]), stages: Default::default() },
        source: Digest([7; 32]),
        plan: "p".into(),
        pack_ms: 1.0,
        reservation,
        label: String::new(),
    })
}

fn pack(store: &Arc<Store>, key: &str, size: u64) -> FlightResult {
    let Lookup::Lead(leader) = store.lookup_or_lead(&k(key)) else { panic!("{key} must lead") };
    let done = finished(store, size);
    leader.finish(done)
}

#[test]
fn single_flight_then_hits() {
    let store = Store::new(9, 1 << 30);
    let Lookup::Lead(leader) = store.lookup_or_lead(&k("k")) else { panic!("first lookup must lead") };
    let Lookup::Wait(mut flight) = store.lookup_or_lead(&k("k")) else { panic!("second must wait") };
    let seg = leader.finish(finished(&store, 4096)).unwrap();
    assert_eq!(flight.borrow_and_update().as_ref().unwrap().as_ref().unwrap().id, seg.id);
    assert!(matches!(store.lookup_or_lead(&k("k")), Lookup::Ready(_)));
    let s = store.stats();
    assert_eq!((s.pack_jobs, s.misses, s.hits, s.segments, s.bytes_resident), (1, 1, 2, 1, 4096));
}

#[test]
fn abandoned_leader_fails_waiters_and_leaves_nothing() {
    let store = Store::new(1, 1 << 30);
    let Lookup::Lead(leader) = store.lookup_or_lead(&k("k")) else { panic!() };
    let Lookup::Wait(flight) = store.lookup_or_lead(&k("k")) else { panic!() };
    drop(leader);
    let outcome = flight.borrow().clone().unwrap();
    assert!(matches!(outcome.map(|_| ()).unwrap_err().as_ref(), JobError::Abandoned), "waiters are told to look again");
    // It never ran: not counted as a pack job, nor as a failure.
    let s = store.stats();
    assert_eq!((s.pack_jobs, s.pack_failures), (0, 0));
    assert_eq!(store.stats().segments, 0);
    assert!(matches!(store.lookup_or_lead(&k("k")), Lookup::Lead(_)));
}

#[test]
fn a_started_job_whose_leader_goes_unfinished_fails_its_waiters() {
    // A job that began and ended without a result (a panic unwinding through it) is a
    // failure for its waiters, not an abandoned flight they would each run again.
    let store = Store::new(1, 1 << 30);
    let Lookup::Lead(mut leader) = store.lookup_or_lead(&k("k")) else { panic!() };
    let Lookup::Wait(flight) = store.lookup_or_lead(&k("k")) else { panic!() };
    leader.start();
    drop(leader);
    let outcome = flight.borrow().clone().unwrap();
    let err = outcome.map(|_| ()).unwrap_err();
    assert!(matches!(err.as_ref(), JobError::Pack(_)), "{err}");
    let s = store.stats();
    assert_eq!((s.pack_jobs, s.pack_failures, s.segments), (1, 1, 0));
    assert!(matches!(store.lookup_or_lead(&k("k")), Lookup::Lead(_)));
}

#[test]
fn a_leader_leaving_aborts_its_flight_only_when_nobody_else_waits() {
    let store = Store::new(1, 1 << 30);
    let stopped = || JobError::stopped("every requester left");
    // Somebody joined: the flight stays, and its result reaches the waiter.
    let Lookup::Lead(leader) = store.lookup_or_lead(&k("k")) else { panic!() };
    let abort = leader.abort_handle();
    let own = abort.subscribe().unwrap();
    let Lookup::Wait(flight) = store.get(&q("k"), |_| true).unwrap() else { panic!("a get joins the flight") };
    drop(own);
    assert!(!abort.abort_unless_waited(stopped()));
    let seg = leader.finish(finished(&store, 4096)).unwrap();
    assert_eq!(flight.borrow().as_ref().unwrap().as_ref().unwrap().id, seg.id);
    // Nobody else: the flight is failed and the key is free for the next requester.
    let Lookup::Lead(leader) = store.lookup_or_lead(&k("j")) else { panic!() };
    let abort = leader.abort_handle();
    drop(abort.subscribe().unwrap());
    assert!(abort.abort_unless_waited(stopped()));
    assert!(leader.finish(finished(&store, 4096)).is_err(), "a late result is discarded");
    assert!(matches!(store.lookup_or_lead(&k("j")), Lookup::Lead(_)));
    assert_eq!(store.stats().segments, 1);
}

#[test]
fn leases_follow_connections() {
    let store = Store::new(5, 1 << 30);
    let seg = pack(&store, "k", 4096).unwrap();
    let (a, b) = (store.connect(Peer::default()), store.connect(Peer::default()));
    store.lease(a, &seg).unwrap();
    store.lease(a, &seg).unwrap();
    store.lease(b, &seg).unwrap();
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
    assert!(matches!(store.lookup_or_lead(&k("a")), Lookup::Ready(_)));
    pack(&store, "d", 4096).unwrap();
    assert!(store.get(&q("b"), |_| true).is_none(), "b was LRU");
    assert!(store.get(&q("a"), |_| true).is_some() && store.get(&q("c"), |_| true).is_some());
    // Pin c and lease a: the next pack must evict d (the only candidate).
    store.pin(&Selector::Key(q("c")), true).unwrap();
    let client = store.connect(Peer { pid: Some(42), uid: 0, gid: 0 });
    store.lease(client, &a).unwrap();
    pack(&store, "e", 4096).unwrap();
    assert!(store.get(&q("d"), |_| true).is_none());
    // Now a is leased, c pinned, e the only unleased: e goes, then nothing more can.
    pack(&store, "f", 4096).unwrap();
    assert!(store.get(&q("e"), |_| true).is_none());
    store.lease(client, &store_get(&store, "f")).unwrap();
    let err = finished(&store, 4096).err().unwrap().to_string();
    assert!(err.contains("budget of 12288 bytes") && err.contains("1 lease(s)") && err.contains("pinned"), "{err}");
    // The refusal goes to any client: it names no holder's pid.
    assert!(!err.contains("pid 42"), "{err}");
    assert_eq!(store.stats().evictions, 3);
    assert!(store.stats().bytes_resident <= store.stats().budget_bytes);
}

fn store_get(store: &Arc<Store>, key: &str) -> Arc<Segment> {
    store_get_key(store, &q(key))
}

fn store_get_key(store: &Arc<Store>, key: &Key) -> Arc<Segment> {
    match store.get(key, |_| true) {
        Some(Lookup::Ready(s)) => s,
        _ => panic!("{key:?} not ready"),
    }
}

#[test]
fn forced_eviction_makes_zombies_until_released() {
    let store = Store::new(1, 1 << 30);
    let seg = pack(&store, "k", 8192).unwrap();
    let client = store.connect(Peer { pid: Some(7), uid: 0, gid: 0 });
    store.lease(client, &seg).unwrap();
    let err = store.evict(&Selector::Key(q("k")), false).unwrap_err().to_string();
    assert!(err.contains("pid 7"), "{err}");
    let report = store.evict(&Selector::Prefix(k("k").to_string()), true).unwrap();
    assert_eq!(report.zombies, vec![k("k").to_string()]);
    let s = store.stats();
    assert_eq!((s.segments, s.zombie_bytes, s.leases), (0, 8192, 1));
    store.release(client, seg.id, 1).unwrap();
    assert_eq!(store.stats().zombie_bytes, 0);
    assert!(matches!(store.evict(&Selector::Key(q("k")), false), Err(EvictError::NotFound(_))));
}

#[test]
fn lowering_the_budget_evicts() {
    let store = Store::new(1, 1 << 30);
    pack(&store, "a", 4096).unwrap();
    pack(&store, "b", 4096).unwrap();
    let change = store.set_budget(4096, false).unwrap();
    assert_eq!(change, BudgetChange { budget: 4096, fits: true, evicted_segments: 1, evicted_bytes: 4096 });
    assert_eq!(store.stats().segments, 1);
    assert!(store.get(&q("a"), |_| true).is_none(), "a was least recently used");
}

#[test]
fn a_budget_that_would_evict_most_is_refused_unless_asked_for() {
    let store = Store::new(1, 1 << 30);
    for key in ["a", "b", "c"] {
        pack(&store, key, 4096).unwrap();
    }
    let refused = store.set_budget(10, false).unwrap_err();
    assert_eq!(refused, BudgetRefused { budget: 10, segments: 3, bytes: 12288, resident: 12288 });
    assert!(refused.to_string().contains("would evict 3 segment(s), 12.0 KiB of the 12.0 KiB resident"), "{refused}");
    let s = store.stats();
    assert_eq!((s.segments, s.budget_bytes), (3, 1 << 30), "a refused change changes nothing");
    let change = store.set_budget(10, true).unwrap();
    assert_eq!(change, BudgetChange { budget: 10, fits: true, evicted_segments: 3, evicted_bytes: 12288 });
    assert_eq!(store.stats().segments, 0);
}

#[test]
fn a_segment_that_cannot_fit_evicts_nothing() {
    let store = Store::new(1, 3 * 4096);
    let a = pack(&store, "a", 4096).unwrap();
    pack(&store, "b", 4096).unwrap();
    pack(&store, "c", 4096).unwrap();
    let client = store.connect(Peer { pid: Some(7), uid: 0, gid: 0 });
    store.lease(client, &a).unwrap();
    // b and c could go, but even then 3 pages do not fit beside the leased a.
    let Err(QuotaError::Budget(err)) = store.admit(None, 3 * 4096) else { panic!("admitted") };
    assert_eq!((err.needed, err.budget), (3 * 4096, 3 * 4096));
    assert!(store.reserve(None, 3 * 4096).is_err());
    assert_eq!((store.stats().segments, store.stats().evictions), (3, 0), "nothing was evicted");
    // Two pages fit once b and c go: admitted, and then the reservation evicts them.
    store.admit(None, 2 * 4096).unwrap();
    let r = store.reserve(None, 2 * 4096).unwrap();
    assert_eq!((store.stats().segments, store.stats().evictions), (1, 2));
    drop(r);
}

#[test]
fn quotas_count_leases_and_packed_bytes_per_uid() {
    let store = Store::new(3, 1 << 30);
    store.set_quotas(Quotas { leases_per_uid: 2, packed_bytes_per_uid: 8192, ..Quotas::default() });
    let seg = pack(&store, "k", 4096).unwrap();
    let peer = |uid| Peer { pid: None, uid, gid: 0 };
    let (a, b, other) = (store.connect(peer(7)), store.connect(peer(7)), store.connect(peer(8)));
    store.lease(a, &seg).unwrap();
    store.lease(b, &seg).unwrap();
    let err = store.lease(a, &seg).unwrap_err();
    assert!(err.to_string().contains("limits.max_leases_per_uid"), "{err}");
    store.lease(other, &seg).unwrap(); // another uid is not affected
    store.release(b, seg.id, 3).unwrap();
    store.lease(a, &seg).unwrap();
    store.disconnect(a);
    assert_eq!(store.leases_of(7), 0);
    assert_eq!(store.leases_of(8), 1);

    // Packed bytes: 4096 + 4096 fit uid 7's quota, a third segment does not; a prefetch
    // (no owner) is not charged; eviction gives the quota back.
    for key in ["p1", "p2"] {
        let Lookup::Lead(l) = store.lookup_or_lead(&k(key)) else { panic!() };
        l.finish(finished_for(&store, Some(7), 4096)).unwrap();
    }
    let err = store.reserve(Some(7), 4096).map(drop).unwrap_err();
    assert!(err.to_string().contains("limits.max_packed_bytes_per_uid"), "{err}");
    assert!(store.admit(Some(7), 4096).is_err());
    store.admit(Some(8), 4096).unwrap();
    store.admit(None, 4096).unwrap();
    store.evict(&Selector::Key(q("p1")), false).unwrap();
    store.admit(Some(7), 4096).unwrap();
}

#[test]
fn running_jobs_count_against_their_uids_packed_quota() {
    let store = Store::new(1, 1 << 30);
    store.set_quotas(Quotas { packed_bytes_per_uid: 2 * 4096, ..Quotas::default() });
    // Two jobs of uid 7 running at once: the second reservation sees the first.
    let first = store.reserve(Some(7), 4096).unwrap();
    let second = store.reserve(Some(7), 4096).unwrap();
    let err = store.reserve(Some(7), 4096).map(drop).unwrap_err();
    assert!(matches!(err, QuotaError::PackedBytes { used: 8192, .. }), "{err}");
    assert!(store.admit(Some(7), 4096).is_err());
    // A job that fails gives its share back; one whose segment enters the index hands it on.
    drop(first);
    store.admit(Some(7), 4096).unwrap();
    let Lookup::Lead(l) = store.lookup_or_lead(&k("s")) else { panic!() };
    let mut done = finished_for(&store, Some(7), 4096).unwrap();
    drop(std::mem::replace(&mut done.reservation, second));
    l.finish(Ok(done)).unwrap();
    assert!(store.reserve(Some(7), 4096).is_ok(), "one segment of 4096 bytes, one free share");
    assert!(store.reserve(Some(7), 2 * 4096).is_err());
    assert_eq!(store.stats().bytes_resident, 4096);
}

/// A finished job whose segment holds identity entries named `names` from source `[7; 32]`.
fn with_entries(store: &Arc<Store>, key: &str, names: &[&str]) -> Arc<Segment> {
    let Lookup::Lead(leader) = store.lookup_or_lead(&k(key)) else { panic!("{key} must lead") };
    let mut done = finished(store, 4096).unwrap();
    let source = Digest([7; 32]);
    done.packed.entries = names
        .iter()
        .enumerate()
        .map(|(i, name)| crate::pack::PackedEntry {
            name: (*name).to_string(),
            key: crate::pack::entry_key(&source, name, crate::pack::Layout::Identity),
            layout: crate::pack::Layout::Identity,
            dtype: crate::source::Dtype::U8,
            shape: vec![1],
            offset: 64 * i as u64,
            length: 1,
            blake3: [0; 32],
            bias: None,
        })
        .collect();
    leader.finish(Ok(done)).unwrap()
}

#[test]
fn entry_keys_are_found_in_every_segment_that_holds_them() {
    let store = Store::new(1, 1 << 30);
    let entry = |name: &str| crate::pack::entry_key(&Digest([7; 32]), name, crate::pack::Layout::Identity);
    let key = |name: &str| Key::Entry(entry(name));
    // Two plans of one source share the entry "b"; the newer segment answers.
    let first = with_entries(&store, "s1", &["c", "a", "b"]);
    let second = with_entries(&store, "s2", &["b", "d"]);
    assert_eq!(store_get_key(&store, &key("a")).id, first.id);
    assert_eq!(store_get_key(&store, &key("b")).id, second.id);
    assert_eq!(store_get_key(&store, &key("d")).id, second.id);
    assert_eq!(first.entry(&entry("c")).map(|e| e.offset), Some(0));
    assert!(store.get(&key("e"), |_| true).is_none() && Key::parse("b3:07/x").is_none() && Key::parse("b3:").is_none());
    // Evicting the newer one leaves "b" served by the older one, "d" by nobody.
    store.evict(&Selector::Key(q("s2")), false).unwrap();
    assert_eq!(store_get_key(&store, &key("b")).id, first.id);
    assert!(store.get(&key("d"), |_| true).is_none());
    // Eviction by entry key picks the segment that holds it.
    let report = store.evict(&Selector::Key(key("a")), false).unwrap();
    assert_eq!(report.evicted, vec![k("s1").to_string()]);
    assert!(store.get(&key("b"), |_| true).is_none());
}

#[test]
fn a_budget_refusal_names_at_most_eight_holders_largest_first() {
    let store = Store::new(1, 20 * 4096);
    let client = store.connect(Peer { pid: Some(4242), uid: 1000, gid: 1000 });
    for (i, size) in [4096u64, 8192, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096].iter().enumerate() {
        pack(&store, &format!("s{i:02}"), *size).unwrap();
        store.lease(client, &store_get(&store, &format!("s{i:02}"))).unwrap();
    }
    let err = finished(&store, 16 * 4096).err().unwrap().to_string();
    assert_eq!(err.matches("lease(s)").count(), 8, "{err}");
    assert!(err.contains("and 4 more held segment(s)"), "{err}");
    let held = err.split(": ").nth(1).unwrap();
    // The largest first.
    let s01 = k("s01").to_string();
    assert!(held.contains(&format!("{s01} (8192 bytes)")) && held.find("b3:") == held.find(&s01), "{err}");
    assert!(!err.contains("pid 4242"), "{err}");
}

#[test]
fn a_new_source_flight_sees_siblings_and_enters_the_index_under_its_learned_key() {
    let store = Store::new(9, 1 << 30);
    let NewSource::Lead(leader) =
        store.lookup_or_lead_new(&FileFlight::new(100, "p", "1"), &FileFlight::siblings(100, "p"))
    else {
        panic!("the first file leads")
    };
    // The same file joins; another file of its size and plan is told to wait for it; a
    // file of another size leads its own job.
    assert!(matches!(
        store.lookup_or_lead_new(&FileFlight::new(100, "p", "1"), &FileFlight::siblings(100, "p")),
        NewSource::Wait(_)
    ));
    let NewSource::Sibling(mut sibling) =
        store.lookup_or_lead_new(&FileFlight::new(100, "p", "2"), &FileFlight::siblings(100, "p"))
    else {
        panic!("a file of the same size waits")
    };
    assert!(matches!(
        store.lookup_or_lead_new(&FileFlight::new(200, "p", "3"), &FileFlight::siblings(200, "p")),
        NewSource::Lead(_)
    ));
    let mut done = finished(&store, 4096);
    done.as_mut().unwrap().key = Some(k("learned"));
    let seg = leader.finish(done).unwrap();
    assert_eq!(seg.key, k("learned"));
    assert!(sibling.borrow_and_update().is_some(), "the sibling is woken");
    assert!(matches!(store.lookup_or_lead(&k("learned")), Lookup::Ready(_)));
    assert_eq!(store.flights_in_progress(), 0, "the file's flight is gone (and the other size's, abandoned)");
}

#[test]
fn a_job_whose_key_is_served_already_is_dropped_and_its_reservation_given_back() {
    let store = Store::new(9, 1 << 30);
    let served = pack(&store, "same", 4096).unwrap();
    let NewSource::Lead(leader) =
        store.lookup_or_lead_new(&FileFlight::new(1, "p", "1"), &FileFlight::siblings(1, "p"))
    else {
        panic!()
    };
    let mut done = finished(&store, 8192);
    done.as_mut().unwrap().key = Some(k("same"));
    assert_eq!(store.stats().bytes_resident, 4096);
    let got = leader.finish(done).unwrap();
    assert_eq!(got.id, served.id, "the served segment is the answer");
    let s = store.stats();
    assert_eq!((s.segments, s.bytes_resident, s.duplicates_dropped), (1, 4096, 1));
    // Nothing stays reserved: the whole budget minus the one segment is free.
    assert!(store.reserve(None, (1 << 30) - 4096).is_ok());
}

fn private_report(model: &str, fallback: packd_proto::v1::Fallback, bytes: u64) -> Report {
    Report {
        engine: "e".into(),
        model: model.into(),
        obtained: packd_proto::v1::Obtained::Private,
        fallback,
        detail: String::new(),
        private_bytes: bytes,
        shared_bytes: 0,
        at: std::time::SystemTime::now(),
    }
}

#[test]
fn sharing_counts_each_holder_and_saves_all_but_one_copy() {
    use packd_proto::v1::Fallback;
    let store = Store::new(5, 1 << 30);
    let seg = pack(&store, "k", 8192).unwrap();
    let clients: Vec<ClientId> = (0..3).map(|_| store.connect(Peer::default())).collect();
    for &c in &clients {
        store.lease(c, &seg).unwrap();
    }
    // A second lease of one holder maps nothing more.
    store.lease(clients[0], &seg).unwrap();
    let private = store.connect(Peer::default());
    assert_eq!(store.report(private, private_report("other", Fallback::BuildTimeout, 1000)), Kept::Yes);
    let s = store.sharing();
    assert_eq!(
        (s.bytes_mapped, s.bytes_saved, s.workers_served, s.workers_private, s.private_bytes),
        (3 * 8192, 2 * 8192, 3, 1, 1000)
    );
    let models = store.models();
    let m = models.iter().find(|m| m.segments == 1).expect("the packed model");
    assert_eq!((m.sharing.bytes_mapped, m.sharing.bytes_saved, m.sharing.workers_served), (3 * 8192, 2 * 8192, 3));
    let other = models.iter().find(|m| m.model == "other").expect("a model only a report names");
    assert_eq!((other.sharing.workers_private, other.sharing.private_bytes, other.bytes_resident), (1, 1000, 0));
    store.disconnect(private);
    assert_eq!(store.sharing().workers_private, 0);
    // A holder stays one while it holds any lease; a connection that goes holds nothing.
    store.release(clients[0], seg.id, 5).unwrap();
    assert_eq!(store.sharing().bytes_mapped, 3 * 8192);
    store.release(clients[0], seg.id, 5).unwrap();
    assert_eq!((store.sharing().bytes_mapped, store.sharing().workers_served), (2 * 8192, 2));
    store.disconnect(clients[1]);
    assert_eq!((store.sharing().bytes_mapped, store.sharing().bytes_saved), (8192, 0));
    assert_eq!(store.report_counters().fallbacks_of(Fallback::BuildTimeout), 1, "counted since start");
}

#[test]
fn a_fallback_is_counted_once_per_connection_model_and_reason_and_reports_are_bounded() {
    use packd_proto::v1::Fallback;
    let store = Store::new(5, 1 << 30);
    store.set_quotas(Quotas { reports_per_connection: 2, ..Quotas::default() });
    let c = store.connect(Peer::default());
    store.report(c, private_report("m", Fallback::DaemonAway, 0));
    // Again, now with its bytes: the same fallback.
    store.report(c, private_report("m", Fallback::DaemonAway, 4096));
    assert_eq!(store.report_counters().fallbacks_of(Fallback::DaemonAway), 1);
    assert_eq!(store.sharing().private_bytes, 4096, "the latest report replaces the earlier one");
    // Another reason for the same model is a new fallback.
    store.report(c, private_report("m", Fallback::OverQuota, 4096));
    assert_eq!(store.report_counters().fallbacks_of(Fallback::OverQuota), 1);
    store.report(c, private_report("n", Fallback::Other, 1));
    assert_eq!(store.report(c, private_report("o", Fallback::Other, 1)), Kept::OverLimit);
    let counters = store.report_counters();
    assert_eq!((counters.received, counters.dropped, counters.fallbacks_of(Fallback::Other)), (5, 1, 2));
    assert_eq!(store.list_clients()[0].reports.len(), 2);
    assert!(store.holds_anything(c), "a private worker's connection is kept like a lease");
    assert_eq!(store.report(999, private_report("m", Fallback::Other, 1)), Kept::NoConnection);
}

/// The spare counts against the budget, is made only where it fits, gives way to a
/// reservation before anything is evicted, and a refill whose claim was dropped keeps
/// nothing.
#[test]
fn the_spare_counts_in_the_budget_and_gives_way_first() {
    use crate::sys::memfd::Prepared;
    let page = 4096;
    let store = Store::new(1, 10 * page);
    pack(&store, "a", 4 * page).unwrap();
    assert!(store.claim_spare(7 * page).is_none(), "no room beside the segment");
    let claim = store.claim_spare(6 * page).unwrap();
    assert!(store.claim_spare(page).is_none(), "one spare at a time");
    assert!(store.take_spare().is_none(), "nothing ready while it is being made");
    assert!(store.fill_spare(claim, Some(Prepared::new("t", 6 * page, false).unwrap())));
    assert_eq!(store.stats().spare_bytes, 6 * page);

    // A reservation that needs the spare's room drops it; the segment stays.
    let r = store.reserve(None, 5 * page).unwrap();
    assert_eq!((store.stats().spare_bytes, store.stats().evictions, store.stats().segments), (0, 0, 1));
    drop(r);

    // A refill whose claim a reservation dropped keeps nothing.
    let claim = store.claim_spare(6 * page).unwrap();
    let r = store.reserve(None, 5 * page).unwrap();
    assert!(!store.fill_spare(claim, Some(Prepared::new("t", 6 * page, false).unwrap())));
    assert_eq!(store.stats().spare_bytes, 0);
    drop(r);

    // Taken by a job: its bytes leave the count, and it is counted as taken.
    let claim = store.claim_spare(6 * page).unwrap();
    assert!(store.fill_spare(claim, Some(Prepared::new("t", 6 * page, false).unwrap())));
    let spare = store.take_spare().unwrap();
    assert_eq!(spare.size(), 6 * page);
    let s = store.stats();
    assert_eq!((s.spare_bytes, s.spare_takes, s.evictions), (0, 1, 0));

    // A refill that failed ends its claim: the next may try again.
    let claim = store.claim_spare(6 * page).expect("room again once taken");
    assert!(!store.fill_spare(claim, None));
    let claim = store.claim_spare(6 * page).expect("a failed refill ends its claim");
    assert!(store.fill_spare(claim, Some(Prepared::new("t", 6 * page, false).unwrap())));

    // A budget change refused (it would evict most of what is resident) keeps the spare;
    // one that goes through gives it up before evicting, and evicts only what it must.
    assert!(store.set_budget(page, false).is_err());
    assert_eq!(store.stats().spare_bytes, 6 * page);
    let change = store.set_budget(5 * page, false).unwrap();
    assert_eq!((change.evicted_segments, store.stats().spare_bytes, store.stats().segments), (0, 0, 1));
}

#[test]
fn events_waiting_to_be_persisted_keep_no_evicted_segment_alive() {
    let store = Store::new(3, 1 << 30);
    let (tx, rx) = std::sync::mpsc::channel();
    store.set_events(Some(tx));
    // Packed, then evicted before anyone reads the events (a cache directory slow to
    // write): the queued events must not hold the segment's memfd.
    let seg = pack(&store, "a", 4096).unwrap();
    let weak = Arc::downgrade(&seg);
    drop(seg);
    store.evict(&Selector::Key(q("a")), false).unwrap();
    assert!(weak.upgrade().is_none(), "the segment is gone while its events wait");
    let events: Vec<StoreEvent> = rx.try_iter().collect();
    assert!(matches!(&events[..], [StoreEvent::Indexed { seg, key: indexed, .. }, StoreEvent::Unindexed(key)]
        if seg.upgrade().is_none() && *key == k("a") && *indexed == k("a")));
}

#[test]
fn at_max_segments_the_lru_unheld_segment_goes_and_held_ones_refuse_the_next() {
    let store = Store::new(5, 1 << 30);
    store.set_max_segments(2);
    pack(&store, "a", 4096).unwrap();
    pack(&store, "b", 4096).unwrap();
    let client = store.connect(Peer { pid: None, uid: 1, gid: 1 });
    store.lease(client, &store_get(&store, "b")).unwrap();
    // A third: "a" (least recently used, unheld) goes, bytes to spare or not.
    pack(&store, "c", 4096).unwrap();
    assert!(store.get(&q("a"), |_| true).is_none() && store.stats().segments == 2);
    // Both held: the next is refused, naming the limit, and nothing is evicted.
    store.lease(client, &store_get(&store, "c")).unwrap();
    let Err(e) = store.reserve(None, 4096) else { panic!("over max_segments") };
    assert!(e.to_string().contains("limits.max_segments") && e.to_string().contains("2 leased or pinned"), "{e}");
    assert_eq!(store.stats().segments, 2);
    // A reservation holds a place until it ends.
    store.disconnect(client);
    let held = store.reserve(None, 4096).unwrap();
    pack(&store, "d", 4096).unwrap();
    assert_eq!(store.stats().segments, 1, "two places: one reserved, one for d");
    drop(held);
    pack(&store, "e", 4096).unwrap();
    assert_eq!(store.stats().segments, 2);
    // A budget change at the limit takes no place for a segment nobody asked for.
    let change = store.set_budget(1 << 30, false).unwrap();
    assert!(change.fits && change.evicted_segments == 0, "{change:?}");
    assert_eq!(store.stats().segments, 2, "nothing evicted by a budget change");
}

fn persisted(key: &str, size: u64) -> Adopted {
    let file = crate::sys::memfd::create("t").unwrap();
    file.set_len(size).unwrap();
    Adopted {
        file,
        key: k(key),
        size,
        source: Digest([9; 32]),
        plan: "p".into(),
        entries: vec![],
        publisher: None,
        label: String::new(),
    }
}

#[test]
fn adoptions_in_progress_hold_their_room_and_a_dropped_one_gives_it_back() {
    let page = crate::sys::proc::page_size();
    let store = Store::new(6, 4 * page);
    let a = persisted("a", 2 * page);
    let room_a = store.reserve_adoption(&a).expect("a fits");
    // b fits beside what is resident (nothing) but not beside a's copy in progress.
    let b = persisted("b", 3 * page);
    assert!(store.reserve_adoption(&b).is_none(), "b would pass the budget together with a");
    let c = persisted("c", 2 * page);
    let room_c = store.reserve_adoption(&c).expect("c fits beside a");
    drop(room_c); // c's file failed its checks
    let room_c = store.reserve_adoption(&persisted("c", 2 * page)).expect("its room came back");
    assert!(store.adopt_reserved(a, room_a, false, true).is_some());
    assert_eq!(store.stats().bytes_resident, 2 * page, "a's room became resident bytes");
    assert!(store.reserve_adoption(&persisted("d", page)).is_none(), "a resident, c reserved: full");
    drop(room_c);
    assert!(store.reserve_adoption(&persisted("a", page)).is_none(), "a key in the index is not adopted twice");
    let room_d = store.reserve_adoption(&persisted("d", 2 * page)).expect("d fits once c gave up");
    assert!(store.adopt_reserved(persisted("d", 2 * page), room_d, false, true).is_some());
    assert_eq!(store.stats().bytes_resident, 4 * page);
}

#[test]
fn a_reservation_taken_instead_of_another_gives_it_back_or_keeps_it_whole() {
    let store = Store::new(1, 4 * 4096);
    store.set_quotas(Quotas { packed_bytes_per_uid: 3 * 4096, ..Quotas::default() });
    // Lent memory of 2 pages; its publication needs 3: the lend's room and quota make way.
    let lent = store.reserve(Some(7), 2 * 4096).unwrap();
    let publication = store.reserve_instead(Some(7), 3 * 4096, lent).map_err(|(e, _)| e).unwrap();
    assert!(store.reserve(Some(7), 4096).is_err(), "3 pages of the uid's 3 are taken");
    drop(publication);
    // Refused (over the quota): the old reservation is whole again, bytes and quota.
    let lent = store.reserve(Some(7), 2 * 4096).unwrap();
    let (err, lent) = store.reserve_instead(Some(7), 4 * 4096, lent).map(drop).unwrap_err();
    assert!(matches!(err, QuotaError::PackedBytes { .. }), "{err}");
    let err = store.reserve(Some(7), 2 * 4096).map(drop).unwrap_err();
    assert!(matches!(err, QuotaError::PackedBytes { used: 8192, .. }), "the lend still counts: {err}");
    drop(lent);
    assert!(store.reserve(Some(7), 3 * 4096).is_ok(), "and is given back when dropped");
}

/// A lend's room as `Lends::park` reserves it, and the signal its thread would be told on.
fn lend(store: &Arc<Store>, uid: u32, bytes: u64) -> (Reservation, Arc<signal::Signal>) {
    let signal = Arc::new(signal::Signal::default());
    (store.reserve_lend(Some(uid), bytes, Arc::clone(&signal)).unwrap(), signal)
}

#[test]
fn unclaimed_lends_give_their_room_to_a_pack_before_anything_is_evicted() {
    let store = Store::new(1, 16 * 4096);
    pack(&store, "old", 4 * 4096).unwrap();
    let (small, small_signal) = lend(&store, 7, 2 * 4096);
    let (big, big_signal) = lend(&store, 7, 8 * 4096);
    assert_eq!(store.stats().reserved_bytes, 0, "lends are not pack jobs");
    // 4 resident + 10 lent of 16: a pack of 4 pages takes the biggest lend's room, and
    // evicts nothing.
    store.admit(Some(8), 4 * 4096).unwrap();
    let job = store.reserve(Some(8), 4 * 4096).unwrap();
    assert!(big_signal.is_revoked() && !small_signal.is_revoked());
    assert!(store.get(&q("old"), |_| true).is_some(), "nothing evicted");
    assert_eq!((store.stats().reserved_bytes, store.stats().lends_revoked), (4 * 4096, 1));
    // The revoked lend's reservation going later gives back nothing twice.
    drop(big);
    assert_eq!(store.stats().reserved_bytes, 4 * 4096);
    let later = std::time::Instant::now() + std::time::Duration::from_secs(600);
    assert!(!store.claim_lend(&big_signal, later), "taken back: nobody claims it");
    // A claimed lend is not taken back: the refusal names it apart from the jobs.
    assert!(store.claim_lend(&small_signal, later));
    store.pin(&Selector::Key(q("old")), true).unwrap();
    let err = store.reserve(Some(8), 8 * 4096).map(drop).unwrap_err().to_string();
    assert!(!small_signal.is_revoked());
    assert!(err.contains("16384 reserved by running pack jobs and publications, 8192 lent to builders"), "{err}");
    drop((job, small));
    let free = store.reserve(None, 12 * 4096).expect("all room but the pinned segment's is back");
    drop(free);
}

#[test]
fn a_uid_over_its_quota_takes_back_its_own_unclaimed_lends_only() {
    let store = Store::new(1, 1 << 30);
    store.set_quotas(Quotas { packed_bytes_per_uid: 8 * 4096, ..Quotas::default() });
    let (_mine, mine) = lend(&store, 7, 6 * 4096);
    let (_theirs, theirs) = lend(&store, 9, 6 * 4096);
    store.admit(Some(7), 4 * 4096).unwrap();
    let _job = store.reserve(Some(7), 4 * 4096).unwrap();
    assert!(mine.is_revoked() && !theirs.is_revoked());
    // Over the quota by more than its lends: refused, and they stay.
    let (_again, again) = lend(&store, 7, 2 * 4096);
    assert!(store.reserve(Some(7), 8 * 4096).is_err());
    assert!(!again.is_revoked());
}

#[test]
fn a_lower_budget_takes_back_unclaimed_lends_before_evicting() {
    let store = Store::new(1, 16 * 4096);
    pack(&store, "kept", 4 * 4096).unwrap();
    let (_r, signal) = lend(&store, 7, 8 * 4096);
    let change = store.set_budget(8 * 4096, false).unwrap();
    assert!(signal.is_revoked());
    assert_eq!((change.evicted_segments, change.fits), (0, true));
    assert!(store.get(&q("kept"), |_| true).is_some());
}

#[test]
fn a_claimed_lend_unpublished_past_its_builds_deadline_gives_its_room_back() {
    let store = Store::new(1, 16 * 4096);
    let (kept, kept_signal) = lend(&store, 7, 8 * 4096);
    let (late, late_signal) = lend(&store, 7, 4 * 4096);
    let now = std::time::Instant::now();
    assert!(store.claim_lend(&kept_signal, now + std::time::Duration::from_secs(600)));
    assert!(store.claim_lend(&late_signal, now));
    // 12 of 16 pages lent, both claimed: the one past its deadline gives its room.
    let job = store.reserve(None, 8 * 4096).unwrap();
    assert!(!late_signal.is_revoked(), "its pages are the builder's: nothing to tell");
    assert!(store.reserve(None, 4096).is_err(), "the claimed lend in time keeps its room");
    // Its reservation going later (published, say) gives back nothing twice.
    drop(late);
    assert_eq!(store.stats().reserved_bytes, 8 * 4096);
    drop((job, kept));
    assert!(store.reserve(None, 16 * 4096).is_ok());
}
