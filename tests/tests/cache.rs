//! The cache directory: segments survive a crash (and a reboot) as files; corrupt,
//! truncated and foreign files are refused and repacked, never served.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use packd_tests::{Daemon, cache_files, seeded_model, small_model, wait_until};

fn cache_file(dir: &Path, key: &str) -> PathBuf {
    dir.join(format!("{}.pack", key.replace(':', "_")))
}

/// Offset of the segment's bytes in a cache file.
fn data_offset(path: &Path) -> u64 {
    let f = std::fs::File::open(path).unwrap();
    let mut fixed = [0u8; 16];
    f.read_exact_at(&mut fixed, 0).unwrap();
    assert_eq!(&fixed[..8], b"PACKDSEG");
    let hlen = u64::from(u32::from_le_bytes(fixed[12..16].try_into().unwrap()));
    (16 + hlen + 32).div_ceil(4096) * 4096
}

#[test]
fn cached_segments_survive_a_crash_and_bad_files_are_repacked() {
    let home = Arc::new(tempfile::tempdir().unwrap());
    let cache = home.path().join("cache");
    let args = ["--cache-dir", cache.to_str().unwrap()];
    let mut d = Daemon::start_in(Arc::clone(&home), &[], &args);
    let files: Vec<PathBuf> = (0..3).map(|i| home.path().join(format!("m{i}.safetensors"))).collect();
    small_model(&files[0]);
    seeded_model(&files[1], 7);
    seeded_model(&files[2], 9);
    let client = d.client();
    let models: Vec<_> = files.iter().map(|f| client.pack(f, &Default::default()).unwrap()).collect();
    let keys: Vec<String> = models.iter().map(|m| m.key().to_string()).collect();
    let bytes: Vec<Vec<u8>> = models.iter().map(|m| m.bytes().to_vec()).collect();
    assert!(wait_until(Duration::from_secs(20), || cache_files(&cache).len() == 3), "{}", d.log());
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&cache).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o700, "the cache directory is private");

    // A crash: every segment comes back from its file, nothing is packed.
    d.crash();
    let mut d = Daemon::start_in(Arc::clone(&home), &[], &args);
    assert_eq!((d.stat("segments"), d.stat("pack_jobs")), (3, 0), "{}", d.log());
    let client = d.client();
    for (i, f) in files.iter().enumerate() {
        let again = client.pack(f, &Default::default()).unwrap();
        again.verify().unwrap();
        assert_eq!(again.bytes(), &bytes[i][..], "model {i}");
        assert_eq!(client.get(&keys[i]).unwrap().bytes(), &bytes[i][..]);
    }
    assert_eq!(d.stat("pack_jobs"), 0);
    drop(client);
    d.crash();

    // One byte flipped inside an entry, a truncated file, a foreign file under a valid name.
    let corrupt = cache_file(&cache, &keys[0]);
    let at = data_offset(&corrupt);
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&corrupt).unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0x01], at).unwrap();
    let truncated = cache_file(&cache, &keys[1]);
    let len = std::fs::metadata(&truncated).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&truncated).unwrap().set_len(len - 100).unwrap();
    std::fs::write(cache_file(&cache, &keys[2]), b"GGUF this is some other program's file").unwrap();
    std::fs::write(cache.join(".leftover.tmp.1"), b"half a write").unwrap();

    let d = Daemon::start_in(Arc::clone(&home), &[], &args);
    let log = d.log();
    for why in ["BLAKE3 does not match", "truncated or extended", "foreign file"] {
        assert!(log.contains(why), "no {why:?} in the log:\n{log}");
    }
    assert_eq!(d.stat("segments"), 0, "nothing bad is served");
    assert!(!cache.join(".leftover.tmp.1").exists(), "interrupted writes are collected");
    let client = d.client();
    for (i, f) in files.iter().enumerate() {
        let m = client.pack(f, &Default::default()).unwrap();
        m.verify().unwrap();
        assert_eq!(m.bytes(), &bytes[i][..], "model {i} repacked");
    }
    assert_eq!(d.stat("pack_jobs"), 3);
    assert!(wait_until(Duration::from_secs(20), || cache_files(&cache).len() == 3), "rewritten");

    // Eviction collects the file.
    drop(client);
    assert!(wait_until(Duration::from_secs(10), || d.stat("leases") == 0));
    assert!(d.packctl(&["evict", &keys[1]]).status.success());
    assert!(wait_until(Duration::from_secs(10), || !cache_file(&cache, &keys[1]).exists()));
    for m in &models {
        m.verify().unwrap();
    }
}

#[test]
fn the_cache_cap_holds_and_an_unusable_directory_means_memory_only() {
    let home = Arc::new(tempfile::tempdir().unwrap());
    let cache = home.path().join("cache");
    // Room for about one small segment's file (a header page plus one data page).
    let args = ["--cache-dir", cache.to_str().unwrap(), "--cache-max-bytes", "12K"];
    let d = Daemon::start_in(Arc::clone(&home), &[], &args);
    let client = d.client();
    for seed in 0..4 {
        let f = home.path().join(format!("s{seed}.safetensors"));
        seeded_model(&f, seed * 10);
        client.pack(&f, &Default::default()).unwrap().verify().unwrap();
    }
    // Four files written, each after the first pushing the oldest out.
    assert!(
        wait_until(Duration::from_secs(10), || d.log().matches("over cache_max_bytes").count() == 3),
        "{}",
        d.log()
    );
    let total: u64 = cache_files(&cache).iter().map(|p| std::fs::metadata(p).unwrap().len()).sum();
    assert!(total <= 12 << 10 && !cache_files(&cache).is_empty(), "{total} bytes in {:?}", cache_files(&cache));
    drop(d);

    let d = Daemon::start_args(&[], &["--cache-dir", "/proc/self/no-such-cache"]);
    let f = d.dir().join("m.safetensors");
    small_model(&f);
    d.client().pack(&f, &Default::default()).unwrap().verify().unwrap();
    assert!(d.log().contains("memory only"), "{}", d.log());
    // The start line says the directory is not used, not just its path.
    let start = d.log().lines().find(|l| l.contains("packd serving")).unwrap_or_default().to_string();
    assert!(start.contains("/proc/self/no-such-cache (unusable: memory only)"), "{start}");
}

#[test]
#[ignore = "root-only, run with --ignored (as .ci/run does): remounts a tmpfs read-only and back"]
fn a_directory_that_turns_read_only_for_a_while_takes_files_again_afterwards() {
    let home = Arc::new(tempfile::tempdir().unwrap());
    let cache = home.path().join("cache");
    std::fs::create_dir(&cache).unwrap();
    let mount = |opts: &str| {
        let mut cmd = std::process::Command::new("mount");
        cmd.args(["-t", "tmpfs", "-o", opts, "tmpfs"]).arg(&cache);
        if opts.starts_with("remount") {
            cmd = std::process::Command::new("mount");
            cmd.args(["-o", opts]).arg(&cache);
        }
        assert!(cmd.status().unwrap().success(), "mount -o {opts} needs root");
    };
    mount("size=16m,mode=0700");
    let _mount = Mount(cache.clone());
    let d = Daemon::start_in(Arc::clone(&home), &[], &["--cache-dir", cache.to_str().unwrap()]);
    let client = d.client();
    let pack = |seed: u32| {
        let f = home.path().join(format!("m{seed}.safetensors"));
        seeded_model(&f, seed);
        client.pack(&f, &Default::default()).unwrap().key().to_string()
    };
    let a = pack(1);
    assert!(wait_until(Duration::from_secs(10), || cache_file(&cache, &a).exists()), "{}", d.log());

    mount("remount,ro");
    let (b, c) = (pack(2), pack(3));
    let refused = "cache: directory not writable";
    assert!(wait_until(Duration::from_secs(10), || d.log().contains(refused)), "{}", d.log());
    assert!(!cache_file(&cache, &b).exists() && !cache_file(&cache, &c).exists());

    mount("remount,rw");
    let e = pack(4);
    assert!(
        wait_until(Duration::from_secs(10), || cache_file(&cache, &e).exists()),
        "a file is written once the directory takes files again; log:\n{}",
        d.log()
    );
    // Said once the write (rename, then the directory's fsync) is done.
    let again = "cache: the directory takes files again";
    assert!(wait_until(Duration::from_secs(10), || d.log().contains(again)), "{}", d.log());
    let log = d.log();
    assert_eq!(log.matches(refused).count(), 1, "said once, not per segment:\n{log}");
    // Eviction still removes files.
    drop(client);
    assert!(wait_until(Duration::from_secs(10), || d.stat("leases") == 0));
    assert!(d.packctl(&["evict", &a]).status.success());
    assert!(wait_until(Duration::from_secs(10), || !cache_file(&cache, &a).exists()), "{}", d.log());
    assert_eq!(d.stat("segments"), 3);
}

/// Rewrites the header of the cache file at `path` through `edit` (keeping its digest
/// right, as a packer of another version would have written it).
fn rewrite_header(path: &Path, format: u32, edit: impl FnOnce(&mut packd_proto::v1::CacheFileHeader)) {
    use prost::Message;
    let mut file = std::fs::read(path).unwrap();
    let hlen = u32::from_le_bytes(file[12..16].try_into().unwrap()) as usize;
    let mut header = packd_proto::v1::CacheFileHeader::decode(&file[16..16 + hlen]).unwrap();
    edit(&mut header);
    let encoded = header.encode_to_vec();
    assert_eq!(encoded.len(), hlen, "the edit keeps the header's length");
    file[8..12].copy_from_slice(&format.to_le_bytes());
    file[16..16 + hlen].copy_from_slice(&encoded);
    let digest = blake3::hash(&file[..16 + hlen]);
    file[16 + hlen..16 + hlen + 32].copy_from_slice(digest.as_bytes());
    std::fs::write(path, file).unwrap();
}

#[test]
fn files_of_another_format_or_layout_version_are_repacked_not_misread() {
    let home = Arc::new(tempfile::tempdir().unwrap());
    let cache = home.path().join("cache");
    let args = ["--cache-dir", cache.to_str().unwrap()];
    let mut d = Daemon::start_in(Arc::clone(&home), &[], &args);
    let files: Vec<PathBuf> = (0..2).map(|i| home.path().join(format!("m{i}.safetensors"))).collect();
    seeded_model(&files[0], 3);
    seeded_model(&files[1], 5);
    let client = d.client();
    let keys: Vec<String> =
        files.iter().map(|f| client.pack(f, &Default::default()).unwrap().key().to_string()).collect();
    drop(client);
    assert!(wait_until(Duration::from_secs(20), || cache_files(&cache).len() == 2));
    assert!(d.terminate().success());

    // An "upgrade": one file from a packer whose f32-gemm layout had another version, one
    // in another file format.
    rewrite_header(&cache_file(&cache, &keys[0]), 1, |h| {
        let e = h.segment.as_mut().unwrap().entries.iter_mut().find(|e| e.layout.starts_with("f32-gemm")).unwrap();
        e.layout_version = 9;
    });
    rewrite_header(&cache_file(&cache, &keys[1]), 2, |_| {});
    let d = Daemon::start_in(Arc::clone(&home), &[], &args);
    // The sockets accept (in the backlog) before adoption has finished: wait for its lines.
    let adopted = wait_until(Duration::from_secs(20), || {
        let log = d.log();
        log.contains("version 9 is outdated") && log.contains("format 2 is not this daemon's 1")
    });
    assert!(adopted, "{}", d.log());
    assert_eq!(d.stat("segments"), 0);
    let client = d.client();
    for f in &files {
        client.pack(f, &Default::default()).unwrap().verify().unwrap();
    }
    assert_eq!(d.stat("pack_jobs"), 2, "both repacked");
}

/// Unmounts on drop.
struct Mount(PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

#[test]
#[ignore = "root-only, run with --ignored (as .ci/run does): mounts a 64 KiB tmpfs as a full disk"]
fn a_full_disk_means_memory_only_and_nothing_is_lost() {
    let home = Arc::new(tempfile::tempdir().unwrap());
    let cache = home.path().join("cache");
    std::fs::create_dir(&cache).unwrap();
    let status = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs"])
        .arg(&cache)
        .status()
        .unwrap();
    assert!(status.success(), "mounting a tmpfs needs root");
    let _mount = Mount(cache.clone());
    let d = Daemon::start_in(Arc::clone(&home), &[], &["--cache-dir", cache.to_str().unwrap()]);
    let small = home.path().join("small.safetensors");
    small_model(&small);
    let big = home.path().join("big.safetensors");
    packd_tests::SafeTensors::default().f32("w.weight", &[64, 1024], &packd_tests::values(64 * 1024, 11)).write(&big);
    let client = d.client();
    let small_model = client.pack(&small, &Default::default()).unwrap();
    let big_model = client.pack(&big, &Default::default()).unwrap();
    assert!(wait_until(Duration::from_secs(10), || d.log().contains("write failed")), "{}", d.log());
    big_model.verify().unwrap();
    assert_eq!(client.get(big_model.key()).unwrap().bytes(), big_model.bytes(), "served from memory");
    assert_eq!(cache_files(&cache).len(), 1, "the small one fit; nothing half-written is left");
    let names: Vec<String> =
        std::fs::read_dir(&cache).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(
        names.iter().all(|n| n.ends_with(".pack") || ["digests", "lock", "kernels"].contains(&n.as_str())),
        "no temporary file is left: {names:?}"
    );
    small_model.verify().unwrap();
    assert_eq!(d.stat("segments"), 2);
}

#[test]
fn after_a_restart_a_known_file_is_recalled_not_hashed_and_a_changed_one_is_packed_again() {
    let home = std::sync::Arc::new(tempfile::tempdir().unwrap());
    let cache = home.path().join("cache");
    let cache_arg = cache.to_str().unwrap().to_string();
    let file = home.path().join("m.safetensors");
    small_model(&file);
    let mut d = Daemon::start_in(std::sync::Arc::clone(&home), &[], &["--cache-dir", &cache_arg]);
    let first = d.client().pack(&file, &Default::default()).unwrap();
    // A file never seen is hashed by its pack job, as it is packed: no hashing pass.
    assert_eq!((d.stat("source_hashes"), d.stat("pack_jobs")), (0, 1));
    let bytes = first.bytes().to_vec();
    assert!(wait_until(Duration::from_secs(10), || cache.join("digests").is_file()), "the digest file is written");
    drop(first);
    d.terminate();

    // The same file after a restart: its digest is recalled, the cached segment served.
    let d = Daemon::start_in(std::sync::Arc::clone(&home), &[], &["--cache-dir", &cache_arg]);
    let again = d.client().pack(&file, &Default::default()).unwrap();
    assert_eq!(again.bytes(), bytes.as_slice());
    assert_eq!((d.stat("source_hashes"), d.stat("pack_jobs")), (0, 0), "a lookup, not a hash or a pack");
    // The reply says where it came from, and packctl says it in words.
    assert_eq!(again.info().outcome(), packd_client::proto::PackOutcome::FoundInCacheDir);
    let said = d.packctl(&["pack", file.to_str().unwrap()]);
    let said = String::from_utf8_lossy(&said.stdout);
    assert!(said.contains(": found packed in the cache directory, by an earlier run of packd ("), "{said}");
    // Another layout of it: packed, still without hashing the file first.
    d.client().pack(&file, &packd_client::Plan::with_layout("identity")).unwrap();
    assert_eq!((d.stat("source_hashes"), d.stat("pack_jobs")), (0, 1));
    // A changed file is a new identity: packed again (and hashed as it is).
    seeded_model(&file, 5);
    let changed = d.client().pack(&file, &Default::default()).unwrap();
    assert_ne!(changed.bytes(), bytes.as_slice());
    assert_eq!((d.stat("source_hashes"), d.stat("pack_jobs")), (0, 2));
}

/// A copy of a model (another inode, the same bytes).
fn copy_of(file: &Path, name: &str) -> PathBuf {
    let copy = file.with_file_name(name);
    std::fs::copy(file, &copy).unwrap();
    copy
}

#[test]
fn a_copy_of_a_served_model_is_hashed_and_served_not_packed_again() {
    let d = Daemon::start();
    let file = d.dir().join("m.safetensors");
    seeded_model(&file, 11);
    let client = d.client();
    let first = client.pack(&file, &Default::default()).unwrap();
    // A file of the same size as one whose segment is served may be a copy of it: it is
    // hashed first (a hash, not a pack) and found.
    let copy = copy_of(&file, "copy.safetensors");
    let again = client.pack(&copy, &Default::default()).unwrap();
    assert_eq!(again.key(), first.key());
    assert_eq!((d.stat("pack_jobs"), d.stat("source_hashes"), d.stat("segments")), (1, 1, 1));
    // Of the same size but other bytes: hashed, then packed under its own key.
    let other = d.dir().join("other.safetensors");
    seeded_model(&other, 12);
    assert_eq!(std::fs::metadata(&other).unwrap().len(), std::fs::metadata(&file).unwrap().len());
    let third = client.pack(&other, &Default::default()).unwrap();
    assert_ne!(third.key(), first.key());
    assert_eq!((d.stat("pack_jobs"), d.stat("source_hashes"), d.stat("segments")), (2, 2, 2));
    assert_eq!(d.stat("duplicates_dropped"), 0);
}

#[test]
fn copies_of_a_new_model_requested_at_once_are_packed_once() {
    let d = Daemon::start();
    let file = d.dir().join("m.safetensors");
    // Large enough (16 MiB) that the requests overlap the first one's pack job.
    packd_tests::SafeTensors::default()
        .f32("w.weight", &[1024, 4096], &packd_tests::values(1024 * 4096, 5))
        .write(&file);
    let copies: Vec<PathBuf> = (0..4).map(|i| copy_of(&file, &format!("copy{i}.safetensors"))).collect();
    let keys: Vec<String> = std::thread::scope(|s| {
        let workers: Vec<_> = copies
            .iter()
            .map(|c| {
                let dir = d.dir().to_path_buf();
                s.spawn(move || {
                    let client = packd_client::Client::connect(&dir).unwrap();
                    client.pack(c, &Default::default()).unwrap().key().to_string()
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    assert!(keys.iter().all(|k| *k == keys[0]), "{keys:?}");
    // One file is packed (hashed as it is); each other copy waits for it or finds its
    // segment, and is hashed to be found: never packed twice.
    assert_eq!((d.stat("pack_jobs"), d.stat("duplicates_dropped"), d.stat("segments")), (1, 0, 1), "{}", d.log());
    assert_eq!(d.stat("source_hashes"), 3);
}

#[test]
fn a_served_segment_whose_file_is_forgotten_is_found_by_hashing_not_packed() {
    let home = Arc::new(tempfile::tempdir().unwrap());
    let cache = home.path().join("cache");
    let args = ["--cache-dir", cache.to_str().unwrap()];
    let mut d = Daemon::start_in(Arc::clone(&home), &[], &args);
    let file = home.path().join("m.safetensors");
    small_model(&file);
    let first = d.client().pack(&file, &Default::default()).unwrap();
    let (key, bytes) = (first.key().to_string(), first.bytes().to_vec());
    drop(first);
    assert!(wait_until(Duration::from_secs(20), || cache_files(&cache).len() == 1), "{}", d.log());
    assert!(wait_until(Duration::from_secs(10), || cache.join("digests").is_file()));
    d.terminate();
    // The segment comes back from its file, but no digest is remembered: a file never
    // seen might be its source, so it is hashed first (a hash, not a pack).
    std::fs::remove_file(cache.join("digests")).unwrap();
    let d = Daemon::start_in(Arc::clone(&home), &[], &args);
    assert_eq!(d.stat("segments"), 1, "{}", d.log());
    let resident = d.stat("bytes_resident");
    let copy = copy_of(&file, "copy.safetensors");
    let client = d.client();
    let served = client.pack(&copy, &Default::default()).unwrap();
    assert_eq!((served.key(), served.bytes()), (key.as_str(), bytes.as_slice()));
    assert_eq!((d.stat("pack_jobs"), d.stat("source_hashes"), d.stat("duplicates_dropped")), (0, 1, 0));
    assert_eq!(d.stat("bytes_resident"), resident);
    // Recorded now: the next request for it is a lookup.
    client.pack(&copy, &Default::default()).unwrap();
    assert_eq!((d.stat("pack_jobs"), d.stat("source_hashes")), (0, 1));
}

#[test]
fn adopting_a_cache_file_leaves_no_second_copy_in_the_page_cache() {
    // On a disk: tmpfs files are their own page cache and cannot be dropped.
    let home = Arc::new(packd_testkit::scratch_dir("packd-cache-pc-", true).unwrap());
    let magic = nix::sys::statfs::statfs(home.path()).unwrap().filesystem_type();
    assert!(
        magic != nix::sys::statfs::TMPFS_MAGIC,
        "this test needs /var/tmp on a disk, not tmpfs ({})",
        home.path().display()
    );
    let cache = home.path().join("cache");
    let args = ["--cache-dir", cache.to_str().unwrap()];
    let d = Daemon::start_in(Arc::clone(&home), &[], &args);
    // 24 MiB, in page cache folios larger than the chunks the file is read in.
    let model = home.path().join("big.safetensors");
    packd_tests::SafeTensors::default()
        .f32("w.weight", &[1536, 4096], &packd_tests::values(1536 * 4096, 3))
        .write(&model);
    let bytes = d.client().pack(&model, &Default::default()).unwrap().bytes().to_vec();
    assert!(wait_until(Duration::from_secs(20), || cache_files(&cache).len() == 1), "{}", d.log());
    drop(d);
    let file = std::fs::File::open(&cache_files(&cache)[0]).unwrap();
    let pages = packd_tests::sys::resident_pages(&file);
    assert!(pages > 1000, "the file just written is in the page cache ({pages} pages)");

    let d = Daemon::start_in(Arc::clone(&home), &[], &args);
    assert_eq!((d.stat("segments"), d.stat("pack_jobs")), (1, 0), "{}", d.log());
    let left = packd_tests::sys::resident_pages(&file);
    assert!(left <= 1, "{left} pages of the adopted file are still in the page cache (the header's may stay)");
    let client = d.client();
    assert_eq!(client.pack(&model, &Default::default()).unwrap().bytes(), &bytes[..], "served from the memfd");
}

#[test]
fn adopting_a_cache_file_with_or_without_huge_pages_gives_the_same_sealed_bytes() {
    // The host's shmem_enabled decides whether huge pages are granted; the bytes, the size
    // and the seals must not depend on it, nor on the number of threads.
    let home = Arc::new(tempfile::tempdir().unwrap());
    let cache = home.path().join("cache");
    let d = Daemon::start_in(Arc::clone(&home), &[], &["--cache-dir", cache.to_str().unwrap()]);
    let file = home.path().join("m.safetensors");
    seeded_model(&file, 21);
    let model = d.client().pack(&file, &Default::default()).unwrap();
    let (key, bytes) = (model.key().to_string(), model.bytes().to_vec());
    assert!(wait_until(Duration::from_secs(20), || cache_files(&cache).len() == 1), "{}", d.log());
    let path = cache_file(&cache, &key);
    let page = 4096;
    for huge in [false, true] {
        for threads in [1, 3] {
            let a = packd::persist::cache::read(&path, page, threads, huge, |_| true).unwrap();
            assert_eq!(a.key.as_str(), key);
            assert_eq!(a.size, a.file.metadata().unwrap().len());
            let mut got = vec![0u8; bytes.len()];
            a.file.read_exact_at(&mut got, 0).unwrap();
            assert!(got == bytes, "huge pages {huge}, {threads} threads: the bytes differ");
            let seals = nix::fcntl::fcntl(&a.file, nix::fcntl::FcntlArg::F_GET_SEALS).unwrap();
            assert_eq!(seals & libc::F_SEAL_WRITE, libc::F_SEAL_WRITE, "sealed");
        }
    }
    // A flipped byte is refused either way.
    let at = data_offset(&path) + 100;
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0x01], at).unwrap();
    for huge in [false, true] {
        assert!(packd::persist::cache::read(&path, page, 1, huge, |_| true).is_err(), "huge pages {huge}");
    }
}

/// Starts packd on `home` with its cache directory under an open-file limit of `limit`.
fn start_with_fd_limit(home: &Arc<tempfile::TempDir>, cache: &Path, limit: usize) -> Daemon {
    let mut cmd = std::process::Command::new("sh");
    cmd.arg("-c")
        .arg(format!("ulimit -n {limit} && exec \"$0\" --socket-dir \"$1\" --cache-dir \"$2\""))
        .arg(packd_tests::packd_bin())
        .arg(home.path())
        .arg(cache);
    Daemon::start_cmd(Arc::clone(home), cmd)
}

#[test]
fn cache_files_the_daemon_cannot_take_at_its_open_file_limit_stay_for_the_next_start() {
    const MODELS: usize = 12;
    let home = Arc::new(tempfile::tempdir().unwrap());
    let cache = home.path().join("cache");
    let mut d = Daemon::start_in(Arc::clone(&home), &[], &["--cache-dir", cache.to_str().unwrap()]);
    let client = d.client();
    let mut bytes = Vec::new();
    for (i, seed) in (100..).take(MODELS).enumerate() {
        let f = home.path().join(format!("m{i}.safetensors"));
        seeded_model(&f, seed);
        bytes.push(client.pack(&f, &Default::default()).unwrap().bytes().to_vec());
    }
    drop(client);
    assert!(wait_until(Duration::from_secs(30), || cache_files(&cache).len() == MODELS), "{}", d.log());
    let files = cache_files(&cache);
    d.terminate();

    // The daemon's own fds with an empty cache directory, then a limit that leaves room
    // for a few segments only: the other files fail to open or to get a memfd.
    let empty = home.path().join("empty-cache");
    let mut probe = start_with_fd_limit(&home, &empty, 1024);
    let base = probe.settled_fd_count();
    probe.terminate();
    let mut d = start_with_fd_limit(&home, &cache, base + 4);
    // The control plane cannot accept at the limit: the start log says what was adopted.
    let log = d.log();
    let adopted = log.lines().rev().find(|l| l.contains("warm state adopted")).expect("the adoption's line");
    let count = |field: &str| -> usize {
        let at = adopted.find(field).unwrap_or_else(|| panic!("{field} in {adopted}")) + field.len();
        adopted[at..].split(' ').next().unwrap().parse().unwrap()
    };
    let (taken, deferred) = (count("cache_adopted="), count("cache_deferred="));
    assert!(taken + deferred == MODELS && deferred > 0, "under a limit of {}: {adopted}", base + 4);
    assert!(log.contains("cache: file kept but not adopted"), "{log}");
    assert!(!d.log().contains("cache: file discarded"), "{}", d.log());
    assert_eq!(cache_files(&cache), files, "no cache file was deleted");
    d.terminate();

    // With room again, every segment comes back from its file: nothing is packed.
    let d = Daemon::start_in(Arc::clone(&home), &[], &["--cache-dir", cache.to_str().unwrap()]);
    assert_eq!((d.stat("segments"), d.stat("pack_jobs")), (MODELS as u64, 0), "{}", d.log());
    let client = d.client();
    for (i, want) in bytes.iter().enumerate() {
        let f = home.path().join(format!("m{i}.safetensors"));
        let again = client.pack(&f, &Default::default()).unwrap();
        assert!(again.bytes() == &want[..], "model {i}");
    }
    assert_eq!(d.stat("pack_jobs"), 0);
}

#[test]
fn fifos_and_devices_in_the_cache_directory_neither_hang_nor_feed_the_start() {
    let home = Arc::new(tempfile::tempdir().unwrap());
    let cache = home.path().join("cache");
    let args = ["--cache-dir", cache.to_str().unwrap()];
    let mut d = Daemon::start_in(Arc::clone(&home), &[], &args);
    let model = home.path().join("m.safetensors");
    small_model(&model);
    let bytes = d.client().pack(&model, &Default::default()).unwrap().bytes().to_vec();
    assert!(wait_until(Duration::from_secs(20), || cache_files(&cache).len() == 1), "{}", d.log());
    assert!(wait_until(Duration::from_secs(20), || cache.join("digests").exists()), "{}", d.log());
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(cache.join("digests")).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600, "the kept digests are private");
    d.terminate();
    // A FIFO under a cache file's name and as the kept digests and kernel measurement (an
    // open without O_NONBLOCK waits for a writer for ever), then the digests as a link to
    // a device that reads without end.
    let fifo = |name: &str| {
        let path = cache.join(name);
        let _ = std::fs::remove_file(&path);
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    };
    for name in ["seg_fifo.pack", "digests", "kernels"] {
        fifo(name);
    }
    let d = Daemon::start_in(Arc::clone(&home), &[], &args);
    assert_eq!((d.stat("segments"), d.stat("pack_jobs")), (1, 0), "{}", d.log());
    assert!(!cache.join("seg_fifo.pack").exists(), "a FIFO under a cache file's name is deleted");
    assert_eq!(d.client().pack(&model, &Default::default()).unwrap().bytes(), &bytes[..]);
    drop(d);
    std::fs::remove_file(cache.join("digests")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", cache.join("digests")).unwrap();
    let d = Daemon::start_in(home, &[], &args);
    assert_eq!((d.stat("segments"), d.stat("pack_jobs")), (1, 0), "{}", d.log());
    assert_eq!(d.client().pack(&model, &Default::default()).unwrap().bytes(), &bytes[..]);
}

#[test]
fn a_second_daemon_on_the_same_cache_directory_is_refused_and_harms_nothing() {
    let home = Arc::new(tempfile::tempdir().unwrap());
    let cache = home.path().join("cache");
    let args = ["--cache-dir", cache.to_str().unwrap()];
    let mut first = Daemon::start_in(Arc::clone(&home), &[], &args);
    let model = home.path().join("m.safetensors");
    seeded_model(&model, 3);
    let client = first.client();
    let packed = client.pack(&model, &Default::default()).unwrap();
    let key = packed.key().to_string();
    assert!(wait_until(Duration::from_secs(20), || cache_files(&cache).len() == 1), "{}", first.log());
    let file = cache_file(&cache, &key);
    let written = std::fs::read(&file).unwrap();
    // A leftover of a write in progress, as the first daemon would have it.
    std::fs::write(cache.join(".x.pack.tmp.1"), b"in progress").unwrap();

    // The same cache directory, a socket directory of its own: refused, exit status 64,
    // and the message names the directory and the daemon that holds it.
    let second_home = Arc::new(tempfile::tempdir().unwrap());
    let mut second = Daemon::spawn(Arc::clone(&second_home), {
        let mut cmd = std::process::Command::new(packd_tests::packd_bin());
        cmd.args(args).arg("--socket-dir").arg(second_home.path());
        cmd
    });
    let status = second.wait_exit();
    assert_eq!(status.code(), Some(64), "{}", second.log());
    let log = second.log();
    assert!(log.contains("is in use by another running packd"), "{log}");
    assert!(log.contains(&format!("(pid {})", first.pid())), "{log}");
    assert!(log.contains(cache.to_str().unwrap()), "{log}");
    assert!(!second_home.path().join("packd.sock").exists(), "the refused daemon bound no socket");

    // Nothing of the first daemon's was touched, and it serves on.
    assert_eq!(std::fs::read(&file).unwrap(), written);
    assert!(cache.join(".x.pack.tmp.1").exists(), "another daemon's temp file is left alone");
    assert_eq!(client.get(&key).unwrap().bytes(), packed.bytes());
    assert!(first.alive());

    // Once the first has stopped, the directory is free: a new daemon adopts its file.
    drop((client, packed));
    assert!(first.terminate().success());
    let d = Daemon::start_in(second_home, &[], &args);
    assert_eq!((d.stat("segments"), d.stat("pack_jobs")), (1, 0), "{}", d.log());
    assert!(!cache.join(".x.pack.tmp.1").exists(), "leftovers are collected by the directory's one daemon");
}

#[test]
fn files_beyond_the_budget_at_start_leave_the_newest_adopted_and_the_rest_refused_before_read() {
    // Six 4 MiB segments on disk, a budget for two: adoption runs on several threads, and
    // each file's room is reserved before its bytes are read, so exactly the two newest are
    // adopted (whatever order the threads finish in) and the others are refused unread.
    let home = Arc::new(tempfile::tempdir().unwrap());
    let cache = home.path().join("cache");
    let args = ["--cache-dir", cache.to_str().unwrap(), "--spare-bytes", "off"];
    let mut d = Daemon::start_in(Arc::clone(&home), &[], &args);
    let client = d.client();
    let mut keys = Vec::new();
    for seed in 0..6u32 {
        let f = home.path().join(format!("m{seed}.safetensors"));
        packd_tests::SafeTensors::default()
            .f32("w.weight", &[128, 8192], &packd_tests::values(128 * 8192, seed * 7 + 1))
            .write(&f);
        keys.push(client.pack(&f, &Default::default()).unwrap().key().to_string());
    }
    assert!(wait_until(Duration::from_secs(30), || cache_files(&cache).len() == 6), "{}", d.log());
    drop(client);
    assert!(d.terminate().success());
    // Newest first: keys[5], then keys[4], … (an hour apart).
    let now = std::time::SystemTime::now();
    for (i, key) in keys.iter().enumerate() {
        let age = Duration::from_secs(3600 * (6 - i as u64));
        let f = std::fs::OpenOptions::new().write(true).open(cache_file(&cache, key)).unwrap();
        f.set_modified(now - age).unwrap();
    }

    let budget_args = [&args[..], &["--max-bytes", "9M"]].concat();
    let d = Daemon::start_in(Arc::clone(&home), &[], &budget_args);
    assert_eq!((d.stat("segments"), d.stat("pack_jobs")), (2, 0), "{}", d.log());
    assert!(d.stat("bytes_resident") <= 9 << 20);
    for (i, key) in keys.iter().enumerate() {
        let served = d.client().get(key).is_ok();
        assert_eq!(served, i >= 4, "segment {i} (newest is 5) served: {served}; log:\n{}", d.log());
        assert_eq!(cache_file(&cache, key).exists(), i >= 4, "segment {i}'s file");
    }
    let log = d.log();
    assert_eq!(log.matches("do not fit in the budget").count(), 4, "{log}");
}
