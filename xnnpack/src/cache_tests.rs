//! packd's XNNPACK weights cache driven through its callbacks exactly as XNNPACK calls them
//! (look_up → reserve_space → fill → look_up_or_insert; offset_to_addr), against the real
//! daemon, with no XNNPACK: the cases XNNPACK's FC layers do not reach. Unnamed weights are
//! packed privately and never published; operators that never look up get scratch space;
//! identical bytes are deduplicated; a name that comes with other bytes is never served;
//! memory is 64-byte aligned and never moves; the second process is served.

use packd_client::{AcquireOptions, Plan};
use packd_tests::{Daemon, small_model};

use crate::cache::{NOT_FOUND, XnnCache, XnnKey, XnnMode};

/// What XNNPACK does between `reserve_space` and `look_up_or_insert`: takes a block of
/// `bytes.len()` bytes from `cache` and writes `bytes` into it. Returns the block's address.
fn fill_reserved(cache: &XnnCache, bytes: &[u8]) -> usize {
    let at = cache.reserve_space(bytes.len());
    assert_ne!(at, 0, "reserve_space failed");
    // SAFETY: `reserve_space` hands out (non-NULL, checked) `bytes.len()` writable bytes
    // at `at` that nothing else uses until `look_up_or_insert` files them.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), at as *mut u8, bytes.len()) };
    at
}

/// What XNNPACK does for one operator: look up; on a miss reserve, fill, insert.
fn pack(cache: &XnnCache, seed: u32, kernel: usize, bias: usize, bytes: &[u8]) -> usize {
    let key = XnnKey::new(seed, kernel, bias);
    let found = cache.look_up(&key);
    if found != NOT_FOUND {
        return found;
    }
    let at = fill_reserved(cache, bytes);
    assert_eq!(at % 64, 0, "64-byte aligned");
    cache.look_up_or_insert(&key, at, bytes.len())
}

/// What XNNPACK's convolutions do: on a hit, ask `look_up_or_insert` again with no block and
/// use its answer as the weights' offset.
fn pack_conv(cache: &XnnCache, seed: u32, kernel: usize, bias: usize, bytes: &[u8]) -> usize {
    let key = XnnKey::new(seed, kernel, bias);
    if cache.look_up(&key) == NOT_FOUND {
        let at = fill_reserved(cache, bytes);
        return cache.look_up_or_insert(&key, at, bytes.len());
    }
    cache.look_up_or_insert(&key, 0, bytes.len())
}

fn read(cache: &XnnCache, offset: usize, len: usize) -> Vec<u8> {
    assert_eq!(cache.offset_to_addr(offset), cache.offset_to_addr(0) + offset, "offsets are stable addresses");
    cache.read(offset, len).unwrap_or_else(|| panic!("the cache holds no [{offset}, +{len})"))
}

#[test]
fn unnamed_scratch_deduplicated_and_conflicting_weights_are_handled_and_the_next_process_is_served() {
    let d = Daemon::start();
    let file = d.dir().join("m.safetensors");
    small_model(&file);
    let client = d.client();
    let model = client.pack(&file, &Plan::with_layout("identity")).unwrap();
    let tensor = |i: usize| model.tensor_at(i).unwrap().bytes().as_ptr() as usize;
    let (w0, w1) = (tensor(0), tensor(1));
    let private_weight = [7u8; 100];
    let identity = "test-provider".to_string();

    let builder = XnnCache::new(d.client(), identity.clone(), AcquireOptions::default(), false).unwrap();
    assert_eq!(builder.stats().mode, Some(XnnMode::Building));
    let a: Vec<u8> = (0..1000u32).map(|i| (i * 7).to_le_bytes()[0]).collect();
    let b: Vec<u8> = (0..333u32).map(|i| (i * 3).to_le_bytes()[0]).collect();
    let named_a = pack(&builder, 1, w0, 0, &a);
    let named_b = pack(&builder, 2, w1, w0 + 4, &b);
    // The same key again (another node with the same weights): a hit on the first copy.
    assert_eq!(pack(&builder, 1, w0, 0, &a), named_a);
    // An address nobody named: packed privately, counted, deduplicated by content.
    let unnamed = pack(&builder, 3, private_weight.as_ptr() as usize, 0, &b);
    assert_eq!(pack(&builder, 4, private_weight.as_ptr() as usize, 0, &b), unnamed, "same bytes, one copy");
    // An operator that never looks up (depthwise convolution): scratch space.
    let at = fill_reserved(&builder, &[9; 64]);
    let scratch = builder.look_up_or_insert(&XnnKey::new(5, 0, 0), at, 64);
    // A name that comes back with other bytes: kept, never filed under the name.
    let other: Vec<u8> = a.iter().map(|x| x ^ 0xff).collect();
    let at = fill_reserved(&builder, &other);
    let conflict = builder.look_up_or_insert(&XnnKey::new(1, w0, 0), at, other.len());
    assert_ne!(conflict, named_a);
    assert_eq!(read(&builder, conflict, other.len()), other, "the conflicting bytes are kept for their operator");
    let s = builder.stats();
    assert_eq!((s.hits, s.misses), (1, 4), "{s:?}");
    assert_eq!((s.unnamed, s.conflicts, s.deduplicated), (3, 1, 1), "{s:?}");

    builder.finalize().unwrap();
    builder.wait_published();
    let s = builder.stats();
    assert_eq!(s.mode, Some(XnnMode::Published), "{s:?}");
    // The built weights are where they were, read-only now (sealed on the publication's
    // thread, after finalize returned).
    let mapped = packd_interpose::maps::at(builder.offset_to_addr(named_a)).unwrap();
    assert_eq!(mapped.perms, "r--s", "{mapped:?}");
    assert_eq!(read(&builder, named_a, a.len()), a);
    assert_eq!(read(&builder, named_b, b.len()), b);
    assert_eq!(read(&builder, scratch, 64), vec![9; 64]);
    assert_eq!(d.stat("publishes"), 1);

    // Another process: served; only the named keys hit, with the same bytes.
    let served = XnnCache::new(d.client(), identity, AcquireOptions::default(), false).unwrap();
    assert_eq!(served.stats().mode, Some(XnnMode::Served));
    let hit_a = served.look_up(&XnnKey::new(1, w0, 0));
    let hit_b = served.look_up(&XnnKey::new(2, w1, w0 + 4));
    assert_ne!(hit_a, NOT_FOUND);
    assert_eq!(read(&served, hit_a, a.len()), a);
    assert_eq!(read(&served, hit_b, b.len()), b);
    assert_eq!(served.look_up(&XnnKey::new(2, w1, w0 + 8)), NOT_FOUND, "another bias address is another key");
    let unnamed_key = XnnKey::new(3, private_weight.as_ptr() as usize, 0);
    assert_eq!(served.look_up(&unnamed_key), NOT_FOUND, "unnamed keys never hit");
    let s = served.stats();
    assert_eq!((s.hits, s.misses, s.reserve_space, s.bytes_packed), (2, 2, 0, 0), "{s:?}");
    // Finalizing a served cache (after each runtime creation) keeps the segment mapped,
    // leased and looked up.
    let leases = d.stat("leases");
    served.finalize().unwrap();
    assert_eq!(served.look_up(&XnnKey::new(1, w0, 0)), hit_a);
    assert_eq!(read(&served, hit_a, a.len()), a);
    let s = served.stats();
    assert_eq!((s.mode, s.bytes_shared > 0), (Some(XnnMode::Served), true), "{s:?}");
    assert_eq!(d.stat("leases"), leases, "the served segment's lease is kept");
}

#[test]
fn callbacks_from_many_threads_at_once_file_every_weight_once() {
    let d = Daemon::start();
    let file = d.dir().join("m.safetensors");
    small_model(&file);
    let model = d.client().pack(&file, &Plan::with_layout("identity")).unwrap();
    let base = model.tensor_at(0).unwrap().bytes().as_ptr() as usize;
    let cache = XnnCache::new(d.client(), "threads".into(), AcquireOptions::default(), false).unwrap();
    // Eight threads pack the same 16 operators (distinct seeds, one named kernel) at once,
    // as XNNPACK may call its provider from several threads.
    let offsets: Vec<Vec<usize>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|_| {
                s.spawn(|| {
                    (0..16u32)
                        .map(|op| {
                            let bytes: Vec<u8> = (0..200 + op).map(|i| (i + op).to_le_bytes()[0]).collect();
                            let offset = pack(&cache, op, base, 0, &bytes);
                            assert_eq!(read(&cache, offset, bytes.len()), bytes, "operator {op}");
                            offset
                        })
                        .collect()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for other in &offsets[1..] {
        assert_eq!(other, &offsets[0], "every thread got the one filed copy of each operator");
    }
    cache.finalize().unwrap();
    cache.wait_published();
    let served = XnnCache::new(d.client(), "threads".into(), AcquireOptions::default(), false).unwrap();
    for op in 0..16u32 {
        let offset = served.look_up(&XnnKey::new(op, base, 0));
        assert_ne!(offset, NOT_FOUND, "operator {op}");
        let want: Vec<u8> = (0..200 + op).map(|i| (i + op).to_le_bytes()[0]).collect();
        assert_eq!(read(&served, offset, want.len()), want);
    }
}

#[test]
fn convolutions_asking_again_after_a_hit_get_the_hit_and_bad_blocks_are_refused_unread() {
    let d = Daemon::start();
    let file = d.dir().join("m.safetensors");
    small_model(&file);
    let model = d.client().pack(&file, &Plan::with_layout("identity")).unwrap();
    let w = model.tensor_at(0).unwrap().bytes().as_ptr() as usize;
    let bytes: Vec<u8> = (0..500u32).map(|i| (i * 11).to_le_bytes()[0]).collect();
    let builder = XnnCache::new(d.client(), "conv".into(), AcquireOptions::default(), false).unwrap();
    let first = pack_conv(&builder, 7, w, 0, &bytes);
    // The same convolution again in this process: a hit, then the no-block insert answers it.
    assert_eq!(pack_conv(&builder, 7, w, 0, &bytes), first);
    assert_eq!(builder.look_up_or_insert(&XnnKey::new(8, w, 0), 0, 64), NOT_FOUND, "no block, no name filed");
    // A block this cache never handed out, and one larger than reserved: refused, not read.
    let foreign = vec![1u8; 4096];
    assert_eq!(builder.look_up_or_insert(&XnnKey::new(9, w, 0), foreign.as_ptr() as usize, 4096), NOT_FOUND);
    let at = fill_reserved(&builder, &[3; 64]);
    assert_eq!(builder.look_up_or_insert(&XnnKey::new(9, w, 0), at, 1 << 20), NOT_FOUND, "larger than reserved");
    // A thread that reserves twice without filing gives its first block up (no deadlock).
    let _ = builder.reserve_space(64);
    let again = fill_reserved(&builder, &[4; 64]);
    assert_ne!(builder.look_up_or_insert(&XnnKey::new(10, 0, 0), again, 64), NOT_FOUND);
    // A size no reservation can hold: NULL, and the slot stays free for the next one.
    assert_eq!(builder.reserve_space(usize::MAX - 3), 0);
    // Reading while this thread holds a block gives the block back instead of waiting for
    // itself; the block is then refused.
    let held = builder.reserve_space(64);
    assert_ne!(held, 0);
    assert_eq!(read(&builder, first, bytes.len()), bytes);
    assert_eq!(builder.look_up_or_insert(&XnnKey::new(11, w, 0), held, 64), NOT_FOUND, "given back");
    let s = builder.stats();
    assert_eq!((s.reinserts, s.bad_inserts), (2, 3), "{s:?}");
    // Finalizing with a block held by this thread: the same, no deadlock.
    assert_ne!(builder.reserve_space(64), 0);
    builder.finalize().unwrap();
    builder.wait_published();
    assert_eq!(builder.stats().mode, Some(XnnMode::Published));

    let served = XnnCache::new(d.client(), "conv".into(), AcquireOptions::default(), false).unwrap();
    let hit = pack_conv(&served, 7, w, 0, &bytes);
    assert_ne!(hit, NOT_FOUND, "the no-block insert after a hit answers the hit, never NOT_FOUND");
    assert_eq!(read(&served, hit, bytes.len()), bytes);
    let s = served.stats();
    assert_eq!((s.hits, s.reserve_space, s.reinserts), (1, 0, 1), "{s:?}");
}

#[test]
fn a_fingerprint_is_part_of_the_name() {
    let d = Daemon::start();
    let file = d.dir().join("m.safetensors");
    small_model(&file);
    let model = d.client().pack(&file, &Plan::with_layout("identity")).unwrap();
    let w = model.tensor_at(0).unwrap().bytes().as_ptr() as usize;
    let cache = XnnCache::new(d.client(), "fingerprints".into(), AcquireOptions::default(), false).unwrap();
    let key = XnnKey { fingerprint: Some(1), ..XnnKey::new(1, w, 0) };
    assert_eq!(cache.look_up(&key), NOT_FOUND);
    let at = fill_reserved(&cache, &[5; 128]);
    let filed = cache.look_up_or_insert(&key, at, 128);
    assert_eq!(cache.look_up(&key), filed);
    assert_eq!(cache.look_up(&XnnKey { fingerprint: Some(2), ..key }), NOT_FOUND, "another fingerprint");
    assert_eq!(cache.look_up(&XnnKey::new(1, w, 0)), NOT_FOUND, "no fingerprint (another interface)");
    // An alias (f16 weights XNNPACK converted to f32 into a buffer of its own) is named as
    // its original until finalize; then the buffer is freed and its address names nothing.
    let converted = [0u8; 64];
    let alias_key = XnnKey { kernel: converted.as_ptr() as usize, ..key };
    assert_eq!(cache.look_up(&alias_key), NOT_FOUND, "an unnamed buffer");
    assert!(cache.alias_data(converted.as_ptr() as usize, w));
    assert_eq!(cache.look_up(&alias_key), filed, "the alias is named as its original");
    cache.finalize().unwrap();
    assert_eq!(cache.look_up(&alias_key), NOT_FOUND, "aliases end at finalize");
    assert_eq!(cache.stats().aliases, 1);
}

#[test]
fn a_builder_with_nothing_to_publish_gives_its_role_up_and_its_waiter_goes_private_at_once() {
    let d = Daemon::start();
    let builder = XnnCache::new(d.client(), "unnamed".into(), AcquireOptions::default(), false).unwrap();
    assert_eq!(builder.stats().mode, Some(XnnMode::Building));
    let private_weight = [7u8; 256];
    let waiter = std::thread::spawn({
        let client = d.client();
        move || XnnCache::new(client, "unnamed".into(), AcquireOptions::default(), false).unwrap().stats()
    });
    assert!(packd_tests::wait_until(std::time::Duration::from_secs(30), || d.stat("build_waits") == 1));
    pack(&builder, 1, private_weight.as_ptr() as usize, 0, &private_weight);
    builder.finalize().unwrap();
    // The builder's process (this one) lives on; the waiter is answered now.
    let s = waiter.join().unwrap();
    assert_eq!(s.mode, Some(XnnMode::Private), "{s:?}");
    assert!(s.reason.contains("gave its role up") && s.reason.contains("no weight could be named"), "{s:?}");
    assert_eq!(s.fallback, Some(packd_client::Fallback::BuilderGaveUp), "{s:?}");
    assert_eq!((d.stat("builds_given_up"), d.stat("builds_expired")), (1, 0));
    let s = builder.stats();
    assert_eq!((s.mode, s.unnamed), (Some(XnnMode::Private), 1), "{s:?}");
    assert_eq!(s.fallback, Some(packd_client::Fallback::UnnamedWeights), "{s:?}");
    // Both went to packd, each with its reason: the builder's (unnamed weights) and the
    // waiter's (the builder gave up).
    let f = || d.stats()["private_fallbacks"].clone();
    assert!(
        packd_tests::wait_until(std::time::Duration::from_secs(5), || {
            f()["unnamed_weights"] == 1 && f()["builder_gave_up"] == 1
        }),
        "{}",
        f()
    );

    // A builder dropped before it finalized gives its role up too.
    let again = XnnCache::new(d.client(), "dropped".into(), AcquireOptions::default(), false).unwrap();
    assert_eq!(again.stats().mode, Some(XnnMode::Building));
    drop(again);
    assert!(packd_tests::wait_until(std::time::Duration::from_secs(10), || d.stat("builds_given_up") == 2));
}

#[test]
fn a_build_stays_inside_what_the_daemon_accepts_and_the_rest_is_packed_privately() {
    let d = Daemon::start_config("[limits]\nmax_publish_bytes = 8192\nmax_publish_entries = 2\n");
    let file = d.dir().join("m.safetensors");
    small_model(&file);
    let model = d.client().pack(&file, &Plan::with_layout("identity")).unwrap();
    let w = model.tensor_at(0).unwrap().bytes().as_ptr() as usize;
    let weight = |n: u32, k: u32| -> Vec<u8> { (0..n).map(|i| (i * k).to_le_bytes()[0]).collect() };
    let (a, b, c, big) = (weight(3000, 3), weight(3000, 5), weight(100, 7), weight(9000, 11));
    let builder = XnnCache::new(d.client(), "limits".into(), AcquireOptions::default(), false).unwrap();
    // 9000 bytes cannot fit a publication of 8192: private. Two fit; a third is one entry
    // too many: private.
    let offsets = [pack(&builder, 1, w, 0, &big), pack(&builder, 2, w, 0, &a), pack(&builder, 3, w, 0, &b)];
    let third = pack(&builder, 4, w, 0, &c);
    for (o, bytes) in offsets.iter().zip([&big, &a, &b]).chain([(&third, &c)]) {
        assert_eq!(read(&builder, *o, bytes.len()), *bytes);
    }
    builder.finalize().unwrap();
    builder.wait_published();
    let s = builder.stats();
    assert_eq!(s.mode, Some(XnnMode::Published), "{s:?}");
    assert_eq!(s.bytes_private, (9024 + 128) as u64, "{s:?}");

    let served = XnnCache::new(d.client(), "limits".into(), AcquireOptions::default(), false).unwrap();
    let again = pack(&served, 1, w, 0, &big);
    assert_eq!(read(&served, again, big.len()), big, "not published: packed here again");
    for (seed, bytes) in [(2, &a), (3, &b)] {
        let hit = pack(&served, seed, w, 0, bytes);
        assert_eq!(read(&served, hit, bytes.len()), *bytes);
    }
    let s = served.stats();
    assert_eq!((s.hits, s.misses, s.reserve_space), (2, 1, 1), "{s:?}");
}

#[test]
fn pages_allocated_ahead_never_change_what_is_published() {
    let d = Daemon::start();
    let file = d.dir().join("m.safetensors");
    small_model(&file);
    let model = d.client().pack(&file, &Plan::with_layout("identity")).unwrap();
    let w = model.tensor_at(0).unwrap().bytes().as_ptr() as usize;
    let weight = |n: usize, k: usize| -> Vec<u8> { (0..n).map(|i| (i * k).to_le_bytes()[0]).collect() };
    // Told more than it writes (its pages allocated ahead are given back), and less than
    // it writes (it grows past them): the publication is what was written, page-rounded.
    for (name, expected, written) in [("more", 64 << 20, 5000), ("less", 9 << 20, (12 << 20) + 100)] {
        let options = AcquireOptions { build_bytes: expected, ..AcquireOptions::default() };
        let builder = XnnCache::new(d.client(), name.into(), options, false).unwrap();
        let bytes = weight(written, 7);
        let at = pack(&builder, 1, w, 0, &bytes);
        builder.finalize().unwrap();
        builder.wait_published();
        assert_eq!(builder.stats().mode, Some(XnnMode::Published), "{name}");
        assert_eq!(read(&builder, at, bytes.len()), bytes, "{name}");
        let served = XnnCache::new(d.client(), name.into(), AcquireOptions::default(), false).unwrap();
        let s = served.stats();
        assert_eq!((s.mode, s.bytes_shared), (Some(XnnMode::Served), written.next_multiple_of(4096) as u64), "{name}");
        let hit = served.look_up(&XnnKey::new(1, w, 0));
        assert_eq!(read(&served, hit, bytes.len()), bytes, "{name}");
    }
}
