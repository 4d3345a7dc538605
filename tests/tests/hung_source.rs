//! A source that never answers a read (a file on a hung FUSE mount, as on a hung NFS
//! server) fails its own request within `limits.source_timeout` and stalls nothing else:
//! the bystander and the control plane are answered meanwhile, a uid whose reads hang holds
//! at most `limits.max_source_ops_per_uid` threads, and a pack job whose source stops
//! answering mid-job frees its key for a good copy.
//!
//! Needs root, /dev/fuse and the fusepy package with libfuse2; `.ci/run` installs them and
//! runs it (`cargo test -p packd-tests --test hung_source -- --ignored`).

use std::fs::File;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use packd_client::proto::ErrorCode;
use packd_tests::{Bystander, Daemon, expect_error, pack_request, recv_reply, seeded_model, send_request, wait_until};

/// What the daemon logs when a file may be a copy of one being packed.
const SIBLING_WAIT: &str = "waiting for the pack job of another file of this size";

/// A mounted hung file system; unmounted (releasing every hung read) on drop.
struct HungFs {
    server: Child,
    mnt: PathBuf,
    /// The file whose creation answers the hung reads.
    release: PathBuf,
}

impl HungFs {
    /// Mounts `source`'s bytes as `mnt/model.safetensors`, answering `answer` bytes of
    /// reads; the next read waits until [`HungFs::release`].
    fn mount(dir: &Path, name: &str, source: &Path, answer: u64) -> Self {
        Self::mount_with(dir, name, source, answer, false)
    }

    /// [`HungFs::mount`]; with `hang_flush`, every close of an fd of the file also waits
    /// until [`HungFs::release`] (the kernel waits for the server's answer to its flush).
    fn mount_with(dir: &Path, name: &str, source: &Path, answer: u64, hang_flush: bool) -> Self {
        let mnt = dir.join(name);
        std::fs::create_dir_all(&mnt).unwrap();
        let release = dir.join(format!("{name}.release"));
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuse/hung_fs.py");
        // The interpreter with fusepy: .ci/run sets PACKD_FUSE_PYTHON to its venv's.
        let python = std::env::var("PACKD_FUSE_PYTHON").unwrap_or_else(|_| "python3".into());
        let server = Command::new(python)
            .arg(script)
            .arg(&mnt)
            .arg(source)
            .arg(answer.to_string())
            .arg(&release)
            .args(hang_flush.then_some("flush"))
            .spawn()
            .expect("python3 hung_fs.py");
        let fs = Self { server, mnt, release };
        assert!(
            wait_until(Duration::from_secs(20), || fs.file().metadata().is_ok_and(|m| m.is_file())),
            "the FUSE file system did not come up (root, /dev/fuse and fusepy are needed)"
        );
        fs
    }

    fn file(&self) -> PathBuf {
        self.mnt.join("model.safetensors")
    }

    /// Answers the hung read and every read after it.
    fn release(&self) {
        std::fs::write(&self.release, b"").unwrap();
    }
}

/// Bytes of `model` the daemon reads before its pack job's own reads: the probe byte, the
/// header's length and the header (admission). A file never seen is not hashed before its
/// job: the job hashes it as it packs it.
fn bytes_before_the_job(model: &Path) -> u64 {
    let bytes = std::fs::read(model).unwrap();
    let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap());
    1 + 8 + header
}

impl Drop for HungFs {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
        let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
    }
}

/// Sends a pack of `file` on a fresh connection and returns the reply's error.
fn pack_error(d: &Daemon, file: &File) -> (ErrorCode, String) {
    let conn = d.raw();
    send_request(&conn, &pack_request(1, "", &[]), &[file.as_fd()]);
    let (reply, _) = recv_reply(&conn).expect("a reply");
    expect_error(&reply)
}

#[test]
#[ignore = "root-only, run with --ignored (as .ci/run does): needs /dev/fuse and fusepy (libfuse2), which .ci/run installs"]
fn a_source_that_never_answers_fails_its_request_and_stalls_nobody() {
    let mut d = Daemon::start_config("[limits]\nsource_timeout = 1\nmax_source_ops_per_uid = 2\n");
    let by = Bystander::new(&d);
    let model = d.dir().join("model.safetensors");
    seeded_model(&model, 7);

    // 1. Not even the first read is answered: the request fails, others are served while
    //    it waits.
    let silent = HungFs::mount(d.dir(), "silent", &model, 0);
    let file = File::open(silent.file()).unwrap();
    let waiting = {
        let conn = d.raw();
        send_request(&conn, &pack_request(1, "", &[]), &[file.as_fd()]);
        std::thread::spawn(move || recv_reply(&conn).expect("a reply"))
    };
    by.check(&mut d, "a source hanging in its first read");
    assert!(d.stats()["segments"].as_u64().is_some(), "the control plane answers meanwhile");
    let (code, msg) = expect_error(&waiting.join().unwrap().0);
    assert_eq!(code, ErrorCode::BadSource, "{msg}");
    assert!(msg.contains("did not answer the first read") && msg.contains("limits.source_timeout"), "{msg}");

    // 2. The header is answered, the pack job's reads hang.
    let header_then_silence = HungFs::mount(d.dir(), "hash", &model, 1 + 8 + 512);
    let (code, msg) = pack_error(&d, &File::open(header_then_silence.file()).unwrap());
    assert_eq!(code, ErrorCode::BadSource, "{msg}");
    assert!(msg.contains("did not answer a read"), "{msg}");
    by.check(&mut d, "a source hanging while packed");

    // 3. Both of this uid's slots are held by hung reads: a third request waits its turn
    //    for the source timeout, then fails.
    let (code, msg) = pack_error(&d, &File::open(&model).unwrap());
    assert_eq!(code, ErrorCode::ResourceExhausted, "{msg}");
    assert!(msg.contains("limits.max_source_ops_per_uid"), "{msg}");

    // Unmounting answers the hung reads with an error: the slots come back.
    drop(silent);
    drop(header_then_silence);
    assert!(
        wait_until(Duration::from_secs(20), || d.client().pack(&model, &packd_client::Plan::default()).is_ok()),
        "the uid's slots came back; log:\n{}",
        d.log()
    );
    let good = d.client().pack(&model, &packd_client::Plan::default()).unwrap();
    good.verify().unwrap();
    by.check(&mut d, "hung sources");
}

#[test]
#[ignore = "root-only, run with --ignored (as .ci/run does): needs /dev/fuse and fusepy (libfuse2), which .ci/run installs"]
fn a_pack_job_whose_source_stops_answering_frees_its_key() {
    let mut d = Daemon::start_config("[limits]\nsource_timeout = 1\n");
    let by = Bystander::new(&d);
    let model = d.dir().join("model.safetensors");
    seeded_model(&model, 9);
    // Everything the admission check reads is answered; the pack job's own reads hang.
    let fs = HungFs::mount(d.dir(), "job", &model, bytes_before_the_job(&model));
    let (code, msg) = pack_error(&d, &File::open(fs.file()).unwrap());
    assert_eq!(code, ErrorCode::BadSource, "{msg}");
    assert!(msg.contains("did not answer a read"), "{msg}");
    // The same content from a good file is packed at once: the stalled job's flight was
    // failed, so nobody waits on it.
    let good = d.client().pack(&model, &packd_client::Plan::default()).expect("a good copy packs");
    good.verify().unwrap();
    assert_eq!(d.stat("segments"), 2, "the bystander's and the good copy's");
    by.check(&mut d, "a pack job that stalled");
}

#[test]
#[ignore = "root-only, run with --ignored (as .ci/run does): needs /dev/fuse and fusepy (libfuse2), which .ci/run installs"]
fn a_pack_job_whose_requester_left_is_cancelled() {
    let mut d = Daemon::start();
    let by = Bystander::new(&d);
    let model = d.dir().join("model.safetensors");
    seeded_model(&model, 11);
    // The job's reads hang until released: it is running, for sure, when its requester leaves.
    let fs = HungFs::mount(d.dir(), "left", &model, bytes_before_the_job(&model));
    let (segments, failures) = (d.stat("segments"), d.stat("pack_failures"));
    let started = |d: &Daemon| d.log().matches("pack job started").count();
    let before = started(&d);
    let conn = d.raw();
    let source = File::open(fs.file()).unwrap();
    send_request(&conn, &pack_request(1, "", &[]), &[source.as_fd()]);
    assert!(wait_until(Duration::from_secs(20), || started(&d) > before), "log:\n{}", d.log());
    drop(conn);
    assert!(
        wait_until(Duration::from_secs(30), || d.log().contains("pack job cancelled: every requester left")),
        "log:\n{}",
        d.log()
    );
    // Nothing entered the index, and the key is free: the same bytes from a good file pack.
    assert!(wait_until(Duration::from_secs(30), || d.stat("pack_failures") > failures));
    assert_eq!(d.stat("segments"), segments);
    fs.release();
    let good = d.client().pack(&model, &packd_client::Plan::default()).expect("the key is free for a good copy");
    good.verify().unwrap();
    by.check(&mut d, "a cancelled pack job");
}

#[test]
#[ignore = "root-only, run with --ignored (as .ci/run does): needs /dev/fuse and fusepy (libfuse2), which .ci/run installs"]
fn the_leader_of_a_single_flight_killed_mid_pack_leaves_the_job_to_its_waiter() {
    let d = Daemon::start();
    let model = d.dir().join("model.safetensors");
    seeded_model(&model, 12);
    // The job's reads hang until released: it is running when its leader dies.
    let fs = HungFs::mount(d.dir(), "leader", &model, bytes_before_the_job(&model));
    let path = fs.file().to_str().unwrap().to_string();
    let (jobs, failures) = (d.stat("pack_jobs"), d.stat("pack_failures"));
    let started = |d: &Daemon| d.log().matches("pack job started").count();
    let before = started(&d);
    let mut leader = d.packctl_cmd(&["pack", &path]).stdout(std::process::Stdio::null()).spawn().unwrap();
    assert!(wait_until(Duration::from_secs(30), || started(&d) > before), "log:\n{}", d.log());
    // A waiter with a copy of the model (another file of the same size, never seen) waits
    // for the running job before hashing its own file.
    let dir = d.dir().to_path_buf();
    let waiter_path = model.clone();
    let waiter = std::thread::spawn(move || {
        let client = packd_client::Client::connect(&dir).unwrap();
        let model = client.pack(&waiter_path, &packd_client::Plan::default())?;
        model.verify()?;
        Ok::<_, packd_client::Error>(model.key().to_string())
    });
    assert!(
        wait_until(Duration::from_secs(30), || d.log().contains(SIBLING_WAIT)),
        "the waiter waits; log:\n{}",
        d.log()
    );
    leader.kill().unwrap(); // SIGKILL, mid-pack
    leader.wait().unwrap();
    // The job goes on for its waiter: it is not cancelled, and finishes once its reads are
    // answered.
    assert_eq!(d.stat("pack_failures"), failures, "the job was not cancelled");
    fs.release();
    let key = waiter.join().unwrap().expect("the waiter gets the segment");
    assert!(key.contains("@plan:"), "{key}");
    assert_eq!(d.stat("pack_jobs"), jobs + 1, "one job served both requests");
    assert!(!d.log().contains("every requester left"), "log:\n{}", d.log());
    assert_eq!(d.stat("segments"), 1);
}

#[test]
#[ignore = "root-only, run with --ignored (as .ci/run does): needs /dev/fuse and fusepy (libfuse2), which .ci/run installs"]
fn a_pack_that_pauses_reports_progress_and_outlives_the_clients_silence_deadline() {
    // The pack's reads stop for longer than the client's silence deadline (2 s): the pack
    // still completes, because the daemon reports its progress every second meanwhile.
    let d = Daemon::start_config("[limits]\nsource_timeout = 20\n");
    let model = d.dir().join("model.safetensors");
    // 4 MiB: the job's reads pause after its first kibibyte.
    packd_tests::SafeTensors::default()
        .f32("big.weight", &[1024, 1024], &packd_tests::values(1 << 20, 11))
        .write(&model);
    let size = std::fs::metadata(&model).unwrap().len();
    let before_job = bytes_before_the_job(&model);
    let fs = HungFs::mount(d.dir(), "pausing", &model, before_job + 1024);
    let timeouts = packd_client::Timeouts { get: Duration::from_secs(2), ..packd_client::Timeouts::default() };
    let client = packd_client::Client::connect_with(d.dir(), timeouts).unwrap();
    let reports = std::sync::Arc::new(std::sync::Mutex::new(Vec::<packd_client::proto::Progress>::new()));
    let (file, seen) = (File::open(fs.file()).unwrap(), std::sync::Arc::clone(&reports));
    let packing = std::thread::spawn(move || {
        let record = |p: &packd_client::proto::Progress| seen.lock().unwrap().push(*p);
        client.pack_with_progress(&file, &packd_client::Plan::default(), "pausing", &record).map(|s| s.map())
    });
    let count = || reports.lock().unwrap().len();
    // The acknowledgement, then one report a second: five reports span more than twice the
    // client's silence deadline.
    assert!(
        wait_until(Duration::from_secs(20), || count() >= 5),
        "progress reports came: {:?}\n{}",
        reports.lock().unwrap(),
        d.log()
    );
    fs.release();
    let model_map = packing.join().unwrap().expect("the pack completed").expect("mapped");
    model_map.verify().unwrap();
    let reports = reports.lock().unwrap();
    use packd_client::proto::ProgressStage;
    assert_eq!(reports[0].stage(), ProgressStage::Accepted, "the first report acknowledges the pack: {reports:?}");
    let packing: Vec<_> = reports.iter().filter(|p| p.stage() == ProgressStage::Packing).collect();
    assert!(packing.len() >= 3, "reports while the reads paused: {reports:?}");
    assert!(packing.iter().all(|p| p.bytes_total == size && p.bytes_done < size), "{reports:?}");
    assert!(packing.windows(2).all(|w| w[0].bytes_done <= w[1].bytes_done), "bytes only grow: {reports:?}");
}

/// Releases a hung file system when dropped.
struct ReleaseOnDrop<'a>(&'a HungFs);

impl Drop for ReleaseOnDrop<'_> {
    fn drop(&mut self) {
        self.0.release();
    }
}

/// The next reply on `conn`, within 20 s: a daemon whose runtime threads hang in a close
/// would never answer, and the test fails instead of waiting for ever.
fn reply_within(conn: &std::os::unix::net::UnixStream) -> (packd_client::proto::Reply, Vec<std::os::fd::OwnedFd>) {
    use packd_proto::frame::{FrameReader, MAX_FRAME_FDS, MAX_REPLY_BYTES};
    use prost::Message;
    let mut receiver = packd_proto::stream::Receiver::new(FrameReader::new(MAX_REPLY_BYTES, MAX_FRAME_FDS));
    match receiver.recv(conn, Some(std::time::Instant::now() + Duration::from_secs(20))) {
        Ok(frame) => (packd_client::proto::Reply::decode(frame.payload.as_slice()).unwrap(), frame.fds),
        Err(e) => panic!("no reply within 20 s: {e:?}"),
    }
}

/// Closes `file`, of the mount `fs` whose flushes hang, on a thread of its own, and waits
/// until the fd has left this process's table (its flush pending): a process started here
/// afterwards does not inherit it (it would wait in its exec).
fn close_aside(file: File, fs: &HungFs) -> std::thread::JoinHandle<()> {
    let own = std::os::fd::AsRawFd::as_raw_fd(&file);
    let closing = std::thread::spawn(move || drop(file));
    assert!(wait_until(Duration::from_secs(10), || std::fs::read_link(format!("/proc/self/fd/{own}"))
        .map_or(true, |t| !t.starts_with(&fs.mnt))));
    closing
}

/// The daemon's open fds on files under `dir`.
fn fds_under(pid: u32, dir: &Path) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|fds| fds.flatten().filter(|e| std::fs::read_link(e.path()).is_ok_and(|t| t.starts_with(dir))).count())
        .unwrap_or(0)
}

#[test]
#[ignore = "root-only, run with --ignored (as .ci/run does): needs /dev/fuse and fusepy (libfuse2), which .ci/run installs"]
fn fds_whose_close_never_returns_are_closed_off_the_runtime_and_stall_nobody() {
    use packd_client::proto::{self, request};
    let mut d = Daemon::start_config("[limits]\nmax_source_ops_per_uid = 2\n");
    let by = Bystander::new(&d);
    let model = d.dir().join("model.safetensors");
    seeded_model(&model, 11);
    let packed = d.client().pack(&model, &Default::default()).unwrap();
    let (key, bytes) = (packed.key().to_string(), packed.bytes().to_vec());
    // The same bytes on a FUSE mount whose every close waits for the mount's server, which
    // never answers (until released): as a client's own FUSE server can do.
    let fs = HungFs::mount_with(d.dir(), "close", &model, u64::MAX, true);
    let file = File::open(fs.file()).unwrap();
    // Dropped before `file`, also on a failed assertion: this test's own close would wait.
    let release = ReleaseOnDrop(&fs);

    // 1. Gets that carry the fd (refused: only pack, publish and digest carry one), more of them
    //    than the runtime has threads: each is answered at once.
    let get = |id| proto::Request {
        id,
        body: Some(request::Body::Get(proto::GetRequest { key: key.clone(), ..Default::default() })),
        progress: false,
    };
    let mut conns = Vec::new();
    for id in 1..=4 {
        let conn = d.raw();
        send_request(&conn, &get(id), &[file.as_fd()]);
        let (code, msg) = expect_error(&reply_within(&conn).0);
        assert!(code == ErrorCode::BadFd && msg.contains("only pack, publish and digest"), "{code:?} {msg}");
        conns.push(conn);
    }
    // Packs that ask for progress from clients gone before their acknowledgement could
    // be written: the fds are closed off the runtime too.
    for id in 10..13 {
        let conn = d.raw();
        let mut req = pack_request(id, "", &[]);
        req.progress = true;
        send_request(&conn, &req, &[file.as_fd()]);
    }
    // 2. A pack of the same bytes through the mount: hashed, found packed, answered; its
    //    file's close hangs too.
    let conn = d.raw();
    send_request(&conn, &pack_request(9, "", &[]), &[file.as_fd()]);
    let (reply, fds) = reply_within(&conn);
    let Some(proto::reply::Body::Segment(seg)) = reply.body else { panic!("{reply:?}: {}", d.log()) };
    assert_eq!((seg.key.as_str(), fds.len()), (key.as_str(), 1), "found packed");

    // This process's own close of the file waits too.
    let closing = close_aside(file, &fs);
    // Five closes hang in the daemon; every other client and the control plane are served.
    assert!(fds_under(d.pid(), &fs.mnt) >= 1, "the hung closes still hold their files");
    by.check(&mut d, "closes that never return");
    assert!(d.stats()["segments"].as_u64().is_some(), "the control plane answers meanwhile");
    assert_eq!(d.client().get(&key).unwrap().bytes(), &bytes[..]);

    // Released, every close returns: the daemon holds no fd of the mount.
    drop(release);
    assert!(
        wait_until(Duration::from_secs(20), || fds_under(d.pid(), &fs.mnt) == 0),
        "{} fds of the mount still open",
        fds_under(d.pid(), &fs.mnt)
    );
    closing.join().unwrap();
    by.check(&mut d, "after the closes returned");
}

/// Threads of `pid` in a close that waits for a FUSE server's answer to its flush (the fd
/// has left the table by then: only the kernel stack shows it).
fn closes_waiting(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|tasks| {
            tasks
                .flatten()
                .filter(|t| std::fs::read_to_string(t.path().join("stack")).is_ok_and(|s| s.contains("fuse_flush")))
                .count()
        })
        .unwrap_or(0)
}

#[test]
#[ignore = "root-only, run with --ignored (as .ci/run does): needs /dev/fuse and fusepy (libfuse2), which .ci/run installs"]
fn a_source_whose_close_never_returns_holds_no_slot_of_the_source_pool() {
    use packd_client::proto;
    // One slot per uid: a close that hung on the pool, at the end of a pack job, would hold
    // it and every later request of the uid would wait for it, then fail.
    let mut d = Daemon::start_config("[limits]\nmax_source_ops_per_uid = 1\nsource_timeout = 2\n");
    let by = Bystander::new(&d);
    let model = d.dir().join("model.safetensors");
    seeded_model(&model, 21);
    let fs = HungFs::mount_with(d.dir(), "job-close", &model, u64::MAX, true);
    let file = File::open(fs.file()).unwrap();
    let release = ReleaseOnDrop(&fs);

    // 1. A model never seen, through the mount: packed (every read is answered), and its
    //    source's close at the end of the job hangs.
    let conn = d.raw();
    send_request(&conn, &pack_request(1, "", &[]), &[file.as_fd()]);
    let (reply, fds) = reply_within(&conn);
    let Some(proto::reply::Body::Segment(seg)) = reply.body else { panic!("{reply:?}: {}", d.log()) };
    assert_eq!(fds.len(), 1);
    let closing = close_aside(file, &fs);
    assert!(
        wait_until(Duration::from_secs(10), || closes_waiting(d.pid()) >= 1),
        "the daemon's close of the source hangs in the mount's flush"
    );

    // 2. The same uid packs another model: the uid's one slot is free.
    let other = d.dir().join("other.safetensors");
    seeded_model(&other, 22);
    let packed = d.client().pack(&other, &Default::default());
    let packed = packed.unwrap_or_else(|e| panic!("the uid's slot is held by a hung close: {e}; log:\n{}", d.log()));
    packed.verify().unwrap();
    assert_ne!(packed.key(), seg.key);
    by.check(&mut d, "a source's close that never returns");

    // 3. A publication of the FUSE file (refused on the pool: not a sealed memfd), whose
    //    close hangs too: the uid's slot is free again right after.
    let file = File::open(fs.file()).unwrap();
    // Dropped before this `file`, also on a failed assertion (the first one is dropped after).
    let _release_first = ReleaseOnDrop(&fs);
    let conn = d.raw();
    let entries = vec![proto::PublishedEntry { key: "a".into(), offset: 0, length: 64 }];
    let publish = proto::PublishRequest { identity: "fuse".into(), size: 4096, entries, ..Default::default() };
    let req = proto::Request { id: 2, body: Some(proto::request::Body::Publish(publish)), progress: false };
    send_request(&conn, &req, &[file.as_fd()]);
    let (code, msg) = expect_error(&reply_within(&conn).0);
    assert_eq!(code, ErrorCode::BadFd, "{msg}");
    let closing_too = close_aside(file, &fs);
    let third = d.dir().join("third.safetensors");
    seeded_model(&third, 23);
    let packed = d.client().pack(&third, &Default::default());
    packed
        .unwrap_or_else(|e| panic!("the uid's slot is held by a hung close: {e}; log:\n{}", d.log()))
        .verify()
        .unwrap();

    // Released: the closes return, the daemon holds no fd of the mount.
    drop(release);
    assert!(wait_until(Duration::from_secs(20), || fds_under(d.pid(), &fs.mnt) == 0));
    closing.join().unwrap();
    closing_too.join().unwrap();
}
