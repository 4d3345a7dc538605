//! Memory lent for builds, attacked as a hostile local client would: asks bigger than the
//! file can need, many connections at once, lends nobody claims, a builder of another uid,
//! and lends a pack needs the room of. Each against the real daemon: what it allocates
//! is read from its own fds, and the other clients' packs must go through.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

use packd_client::{AcquireOptions, Acquired, Client};
use packd_tests::{Bystander, Daemon, SafeTensors, values, wait_until};

/// The bound on a lend for a file of `size` bytes (PROTOCOL.md, "Memory lent for a build").
fn lend_bound(size: u64) -> u64 {
    size + size / 8 + (1 << 20)
}

/// A file of `len` bytes of a pattern seeded by `seed`, opened.
fn pattern_file(dir: &Path, name: &str, len: usize, seed: u8) -> std::fs::File {
    let path = dir.join(name);
    let bytes: Vec<u8> = (0..len).map(|i| seed.wrapping_add(i.to_le_bytes()[0] ^ (i >> 8).to_le_bytes()[0])).collect();
    std::fs::write(&path, bytes).unwrap();
    std::fs::File::open(&path).unwrap()
}

/// A sparse file of `len` bytes (hashed like any other), opened.
fn sparse_file(dir: &Path, name: &str, len: u64) -> std::fs::File {
    let path = dir.join(name);
    std::fs::File::create(&path).unwrap().set_len(len).unwrap();
    std::fs::File::open(&path).unwrap()
}

/// Bytes of pages the daemon holds in lent memfds (`memfd:packd-lent`), read from its fds.
fn lent_pages(d: &Daemon) -> u64 {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{}/fd", d.pid())) else { return 0 };
    fds.flatten()
        .filter(|fd| std::fs::read_link(fd.path()).is_ok_and(|l| l.to_string_lossy().contains("memfd:packd-lent")))
        .filter_map(|fd| std::fs::metadata(fd.path()).ok())
        .map(|m| m.blocks() * 512)
        .sum()
}

/// The host's `Shmem` in KiB.
fn shmem_kib() -> i64 {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap();
    let line = text.lines().find(|l| l.starts_with("Shmem:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn opts(build_bytes: u64) -> AcquireOptions {
    AcquireOptions { build_bytes, ..AcquireOptions::default() }
}

/// A model of about `mib` MiB to pack.
fn model_of(path: &Path, mib: usize, seed: u32) {
    let n = mib << 18;
    SafeTensors::default().f32("w.weight", &[(n / 256) as u64, 256], &values(n, seed)).write(path);
}

#[test]
fn asks_bigger_than_the_file_and_sixteen_connections_cannot_take_the_budget() {
    // The default config: the budget is half the machine's memory.
    let mut d = Daemon::start();
    let by = Bystander::new(&d);
    let budget = d.stat("budget_bytes");
    let shmem = shmem_kib();
    // Sixteen connections, each hashing a 1 MiB file of its own and asking for 800 MiB
    // (one 50 MiB), kept open, never acquiring: nothing is lent.
    let conns: Vec<Client> = (0..16u8)
        .map(|i| {
            let c = d.client();
            let f = pattern_file(d.dir(), &format!("f{i}"), 1 << 20, i);
            let bytes = if i == 15 { 50 << 20 } else { 800 << 20 };
            assert!(c.file_digest_for_build(&f, bytes).unwrap().hashed);
            c
        })
        .collect();
    assert_eq!((d.stat("lent_bytes"), d.stat("lends_refused")), (0, 16), "{}", d.stats());
    assert_eq!(lent_pages(&d), 0);
    // The host's shared memory, for the record (other tests run beside this one).
    eprintln!("host Shmem after the oversized asks: {:+} KiB", shmem_kib() - shmem);
    // Their acquires build in their own memory.
    let Acquired::Build { memory, .. } = conns[0].acquire("big", opts(800 << 20)).unwrap() else { panic!() };
    assert!(memory.is_none());

    // Within the bound, sixteen more: each is lent what its file can need, and that is all.
    let asked = lend_bound(1 << 20) / 4096 * 4096;
    let within: Vec<Client> = (0..16u8)
        .map(|i| {
            let c = d.client();
            let f = pattern_file(d.dir(), &format!("g{i}"), 1 << 20, 100 + i);
            c.file_digest_for_build(&f, asked).unwrap();
            c
        })
        .collect();
    assert!(wait_until(Duration::from_secs(10), || lent_pages(&d) == 16 * asked), "{}", lent_pages(&d));
    assert_eq!(d.stat("lent_bytes"), 16 * asked);
    assert!(16 * asked < 64 << 20 && 16 * asked <= budget / 4);
    // A seventeenth lend of the uid is refused (16 at most).
    let c = d.client();
    c.file_digest_for_build(&pattern_file(d.dir(), "h", 1 << 20, 7), asked).unwrap();
    assert_eq!(d.stat("lends_refused"), 17);
    // Another client's pack goes through, and the bystander is unharmed.
    let model = d.dir().join("m.safetensors");
    model_of(&model, 8, 3);
    d.client().pack(&model, &packd_client::Plan::default()).expect("a pack beside the lends");
    by.check(&mut d, "lends asked for by sixteen connections");
    drop((conns, within, c));
    assert!(wait_until(Duration::from_secs(10), || d.stat("lent_bytes") == 0), "{}", d.stats());
    assert!(wait_until(Duration::from_secs(10), || lent_pages(&d) == 0));
}

#[test]
fn lent_memory_nobody_claims_is_freed_after_the_claim_timeout() {
    let d = Daemon::start_config("[limits]\nlend_claim_timeout = 0.5\n");
    let c = d.client();
    c.file_digest_for_build(&pattern_file(d.dir(), "m", 1 << 20, 1), 1 << 20).unwrap();
    assert_eq!(d.stat("lent_bytes"), 1 << 20);
    assert!(wait_until(Duration::from_secs(10), || d.stat("lent_bytes") == 0), "{}", d.stats());
    assert_eq!(d.stat("lends_expired"), 1);
    assert!(wait_until(Duration::from_secs(10), || lent_pages(&d) == 0));
    // The connection is still open: its late acquire builds in its own memory.
    let Acquired::Build { memory, .. } = c.acquire("late", opts(1 << 20)).unwrap() else { panic!() };
    assert!(memory.is_none());
    assert_eq!(d.stat("builds_lent"), 0);
    // Its next model's digest is lent memory again, claimed in time.
    c.file_digest_for_build(&pattern_file(d.dir(), "n", 1 << 20, 2), 1 << 20).unwrap();
    let Acquired::Build { memory, .. } = c.acquire("next", opts(1 << 20)).unwrap() else { panic!() };
    assert_eq!(memory.map(|m| m.metadata().unwrap().len()), Some(1 << 20));
}

#[test]
fn a_pack_that_needs_the_room_takes_it_from_a_lend_nobody_claimed() {
    // A 1 GiB budget, all of it lendable; a 768 MiB lend, taken back while it is allocated
    // or waits.
    let mut d = Daemon::start_config(
        "max_bytes = \"1G\"\n[limits]\nmax_lent_bytes_per_uid = \"1G\"\nlend_claim_timeout = 120\n",
    );
    let by = Bystander::new(&d);
    let model = d.dir().join("m.safetensors");
    model_of(&model, 300, 5);
    let file = sparse_file(d.dir(), "big.gguf", 768 << 20);
    let lender = d.client();
    let (tx, rx) = std::sync::mpsc::channel();
    let dir = d.dir().to_path_buf();
    let hashing = std::thread::spawn(move || {
        let c = Client::connect(&dir).unwrap();
        c.file_digest_for_build(&file, 768 << 20).unwrap();
        tx.send(c).unwrap();
    });
    assert!(wait_until(Duration::from_secs(30), || d.stat("lent_bytes") > 0), "{}", d.stats());
    d.client().pack(&model, &packd_client::Plan::default()).expect("the pack takes the lend's room");
    assert_eq!(d.stat("lends_revoked"), 1, "{}", d.stats());
    hashing.join().unwrap();
    let asker = rx.recv().unwrap();
    assert!(wait_until(Duration::from_secs(10), || d.stat("lent_bytes") == 0 && lent_pages(&d) == 0));
    // Its asker (and any other worker of the uid) builds in its own memory.
    let Acquired::Build { memory, .. } = asker.acquire("big", opts(768 << 20)).unwrap() else { panic!() };
    assert!(memory.is_none());
    drop(lender);
    assert!(d.stat("bytes_resident") <= d.stat("budget_bytes"));
    by.check(&mut d, "a lend taken back");
}

#[test]
fn a_lend_its_builder_never_publishes_gives_its_room_back_at_the_builds_deadline() {
    let d = Daemon::start_config("max_bytes = \"64M\"\n[limits]\nmax_lent_bytes_per_uid = \"64M\"\n");
    let model = d.dir().join("m.safetensors");
    model_of(&model, 30, 6);
    let c = d.client();
    c.file_digest_for_build(&sparse_file(d.dir(), "m.gguf", 40 << 20), 40 << 20).unwrap();
    let ask = AcquireOptions { build_bytes: 40 << 20, build_seconds: 1, ..AcquireOptions::default() };
    let Acquired::Build { memory: Some(memory), .. } = c.acquire("never", ask).unwrap() else { panic!("lent") };
    // Claimed and within its deadline, the lend keeps its room: a 30 MiB pack does not fit.
    let packer = d.client();
    let err = packer.pack(&model, &packd_client::Plan::default()).map(drop).unwrap_err().to_string();
    assert!(err.contains("lent to builders that have not published yet"), "{err}");
    // Past the deadline, unpublished: the pages are the builder's, the room is the budget's.
    assert!(wait_until(Duration::from_secs(30), || d.stat("builds_expired") == 1), "{}", d.stats());
    packer.pack(&model, &packd_client::Plan::default()).expect("the room came back");
    assert_eq!(memory.metadata().unwrap().len(), 40 << 20, "the builder keeps its memory");
    assert_eq!(d.stat("lent_bytes"), 40 << 20, "still counted against its uid");
}

#[test]
#[ignore = "root-only, run with --ignored (as .ci/run does): runs a builder as another uid (setpriv)"]
fn a_lend_is_never_handed_to_a_builder_of_another_uid() {
    use std::os::unix::fs::PermissionsExt;
    let d = Daemon::start();
    for p in [d.dir().to_path_buf(), d.dir().join("packd.sock"), d.dir().join("control.sock")] {
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o777)).unwrap();
    }
    let path = d.dir().join("shared.gguf");
    let file = pattern_file(d.dir(), "shared.gguf", 1 << 20, 9);
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mine = d.client();
    assert!(mine.file_digest_for_build(&file, 1 << 20).unwrap().hashed);
    assert_eq!(d.stat("lent_bytes"), 1 << 20);
    // uid 4242 asks for the same file's digest with the same bytes (so it opts in), and
    // becomes a builder first: it builds in its own memory.
    let out = std::process::Command::new("setpriv")
        .args(["--reuid", "4242", "--regid", "4242", "--clear-groups"])
        .arg(env!("CARGO_BIN_EXE_publisher"))
        .arg(d.dir())
        .arg("other")
        .args(["--lend", path.to_str().unwrap(), &(1u64 << 20).to_string()])
        .output()
        .expect("setpriv publisher");
    let text = String::from_utf8_lossy(&out.stdout);
    let line: serde_json::Value = serde_json::from_str(text.lines().next().unwrap_or_default())
        .unwrap_or_else(|e| panic!("{text} {}: {e}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!((line["got"].as_str(), line["lent"].as_u64()), (Some("built"), Some(0)), "{line}");
    // The lend waits for its own uid's builder.
    assert_eq!(d.stat("lent_bytes"), 1 << 20);
    let Acquired::Build { memory, .. } = mine.acquire("mine", opts(1 << 20)).unwrap() else { panic!() };
    assert_eq!(memory.map(|m| m.metadata().unwrap().len()), Some(1 << 20));
    assert_eq!(d.stat("builds_lent"), 1);
}

/// A digest asked beside a build (`background`) is the file's BLAKE3, hashed once for every
/// asker, and lends nothing.
#[test]
fn a_digest_asked_beside_a_build_is_hashed_once_for_every_asker() {
    let d = Daemon::start();
    let path = d.dir().join("big");
    let len = 64usize << 20;
    let bytes: Vec<u8> = (0..len).map(|i| u8::try_from(i % 251).unwrap()).collect();
    std::fs::write(&path, &bytes).unwrap();
    let want = *blake3::hash(&bytes).as_bytes();
    drop(bytes);
    let askers: Vec<_> = (0..3)
        .map(|_| {
            let (c, f) = (d.client(), std::fs::File::open(&path).unwrap());
            std::thread::spawn(move || c.file_digest_beside_build(&f).unwrap())
        })
        .collect();
    let digests: Vec<_> = askers.into_iter().map(|h| h.join().unwrap()).collect();
    for got in &digests {
        assert_eq!((got.blake3, got.size), (want, len as u64));
    }
    assert_eq!(digests.iter().filter(|g| g.hashed).count(), 1, "one hash for the three askers");
    assert_eq!(d.stat("source_hashes"), 1);
    assert_eq!((d.stat("lent_bytes"), d.stat("builds_lent")), (0, 0));
    assert!(d.log().contains("model file hashed beside a build"), "{}", d.log());
}
