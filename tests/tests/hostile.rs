//! One hostile client must never deny service to the others. Each test attacks a real
//! daemon the way a misbehaving local client would, while a bystander holds a mapped model;
//! the bystander must keep correct bytes and get answers, and the daemon must hold no more
//! than its limits allow (fds, connections, log lines).
#![allow(clippy::cast_possible_truncation)] // test data sizes are small

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use packd_client::proto::{self, ErrorCode};
use packd_proto::frame;
use packd_tests::{Bystander, Daemon, expect_error, pack_request, recv_reply, send_raw, send_request, wait_until};

fn get(id: u64, key: &str) -> proto::Request {
    proto::Request {
        progress: false,
        id,
        body: Some(proto::request::Body::Get(proto::GetRequest { key: key.into(), ..Default::default() })),
    }
}

/// Whether the daemon closed `conn` (EOF or reset) within a watchdog of 10 s.
fn closed_by_daemon(conn: &UnixStream) -> bool {
    conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    recv_reply(conn).is_none()
}

#[test]
fn connections_over_the_per_uid_limit_are_refused_and_slots_come_back() {
    let mut d = Daemon::start_config("[limits]\nmax_connections_per_uid = 4\n");
    let by = Bystander::new(&d); // one slot
    let held: Vec<UnixStream> = (0..3).map(|_| d.raw()).collect();
    // Each held connection is served (so all four slots are really taken).
    for (i, c) in held.iter().enumerate() {
        send_request(c, &get(i as u64 + 1, by.model.key()), &[]);
        assert_eq!(recv_reply(c).unwrap().1.len(), 1);
    }
    let over = d.raw();
    let (reply, _) = recv_reply(&over).expect("a refusal before the close");
    let (code, msg) = expect_error(&reply);
    assert_eq!(code, ErrorCode::ResourceExhausted, "{msg}");
    assert!(msg.contains("limits.max_connections_per_uid"), "{msg}");
    assert!(closed_by_daemon(&over));
    by.check(&mut d, "a refused connection");
    // A slot comes back when a connection closes.
    drop(held);
    assert!(wait_until(Duration::from_secs(10), || {
        let c = d.raw();
        send_request(&c, &get(9, by.model.key()), &[]);
        recv_reply(&c).is_some_and(|(r, fds)| r.id == 9 && fds.len() == 1)
    }));
}

#[test]
fn at_the_per_uid_limit_the_oldest_idle_connection_is_shed_for_a_newcomer() {
    let mut d = Daemon::start_config("[limits]\nmax_connections_per_uid = 4\n");
    let by = Bystander::new(&d); // 1: holds a lease
    let key = by.model.key().to_string();
    let idle_raw = d.raw(); // 2: idle, no lease (the oldest such)
    let idle_client = d.client(); // 3: idle, no lease
    let worker = d.raw(); // 4: holds a lease
    send_request(&worker, &get(1, &key), &[]);
    assert_eq!(recv_reply(&worker).unwrap().1.len(), 1);

    // A new worker of the same uid is admitted: the oldest idle connection makes room,
    // and is told why before it is closed.
    let newcomer = d.client();
    let held = newcomer.get(&key).expect("the newcomer is admitted at the per-uid limit");
    let (reply, _) = recv_reply(&idle_raw).expect("the shed connection is told why");
    let (code, msg) = expect_error(&reply);
    assert_eq!(code, ErrorCode::ResourceExhausted, "{msg}");
    assert!(msg.contains("limits.max_connections_per_uid") && msg.contains("no lease"), "{msg}");
    assert!(closed_by_daemon(&idle_raw));
    assert_eq!((d.stat("connections_shed"), d.stat("connections_refused")), (1, 0));

    // The next idle one goes for the next newcomer; the reference client whose connection
    // was shed reconnects on its next call (shedding in turn the newest idle connection).
    let newcomer2 = d.raw();
    assert!(wait_until(Duration::from_secs(10), || d.stat("connections_shed") == 2));
    let again = idle_client.get(&key).expect("a shed client reconnects on its next call");
    assert_eq!(again.key(), key);
    let (reply, _) = recv_reply(&newcomer2).expect("the idle newcomer made room in its turn");
    assert!(expect_error(&reply).1.contains("limits.max_connections_per_uid"));
    assert!(closed_by_daemon(&newcomer2));
    assert_eq!(d.stat("connections_shed"), 3);

    // Every connection holds a lease now: the next one is refused, and none is closed.
    let over = d.raw();
    let (reply, _) = recv_reply(&over).expect("a refusal");
    let (code, msg) = expect_error(&reply);
    assert_eq!(code, ErrorCode::ResourceExhausted, "{msg}");
    assert!(msg.contains("limits.max_connections_per_uid") && msg.contains("holds a lease or is busy"), "{msg}");
    assert_eq!((d.stat("connections_shed"), d.stat("connections_refused")), (3, 1));
    send_request(&worker, &get(2, &key), &[]);
    assert_eq!(recv_reply(&worker).expect("the leased worker stays").0.id, 2);
    assert_eq!(held.key(), key);
    by.check(&mut d, "shedding");
}

#[test]
fn a_frame_left_unfinished_is_closed_after_the_frame_timeout() {
    let mut d = Daemon::start_config("[limits]\nframe_timeout = 0.5\n");
    let by = Bystander::new(&d);
    let slow = d.raw();
    // A header announcing 100 bytes, then 10 of them, then nothing.
    let mut partial = frame::header(100).unwrap().to_vec();
    partial.extend([0u8; 10]);
    send_raw(&slow, &partial, &[]);
    // Meanwhile everyone else is served.
    by.check(&mut d, "a frame in progress");
    let (reply, _) = recv_reply(&slow).expect("an error before the close");
    let (code, msg) = expect_error(&reply);
    assert_eq!(code, ErrorCode::MalformedFrame, "{msg}");
    assert!(msg.contains("limits.frame_timeout"), "{msg}");
    assert!(closed_by_daemon(&slow));
    // A header sent byte by byte and never finished is cut off the same way.
    let slow = d.raw();
    send_raw(&slow, &[1], &[]);
    let (reply, _) = recv_reply(&slow).expect("an error before the close");
    assert!(expect_error(&reply).1.contains("limits.frame_timeout"));
    by.check(&mut d, "slow frames");
}

/// The idle timeout of the idle-connection test.
const IDLE: Duration = Duration::from_millis(500);

#[test]
fn idle_connections_without_leases_are_closed_and_workers_stay() {
    let mut d = Daemon::start_config(&format!("[limits]\nidle_timeout = {}\n", IDLE.as_secs_f64()));
    let by = Bystander::new(&d);
    let clients = d.stat("clients");
    let idle = d.raw();
    assert!(closed_by_daemon(&idle), "an idle connection holding nothing is closed");
    assert!(wait_until(Duration::from_secs(10), || d.stat("clients") == clients));
    // A connection holding a lease is a worker: it stays, however long it is silent.
    let worker = d.raw();
    let file = File::open(d.dir().join("bystander.safetensors")).unwrap();
    send_request(&worker, &pack_request(1, "", &[]), &[file.as_fd()]);
    assert_eq!(recv_reply(&worker).unwrap().1.len(), 1);
    // Three idle timeouts of silence: an idle connection would have been closed by now.
    std::thread::sleep(3 * IDLE);
    send_request(&worker, &get(2, by.model.key()), &[]);
    let (reply, fds) = recv_reply(&worker).expect("the worker's connection stays open");
    assert_eq!((reply.id, fds.len()), (2, 1));
    // The reference client rides out an idle close: its next call reconnects at once.
    let client = d.client();
    let model = client.get(by.model.key()).unwrap();
    drop(model); // released: the connection holds nothing now
    // The daemon closes it: the count of connected clients falls back.
    assert!(wait_until(Duration::from_secs(10), || d.stat("clients") == clients + 1));
    let again = client.get(by.model.key()).expect("the client reconnects after an idle close");
    assert_eq!(again.key(), by.model.key());
    assert_eq!(client.live_leases(), 1, "the new connection holds the lease");
    by.check(&mut d, "idle closes");
}

#[test]
fn oversized_requests_are_refused_by_the_configured_limit() {
    let mut d = Daemon::start_config("[limits]\nmax_request_bytes = 1000\n");
    let by = Bystander::new(&d);
    let conn = d.raw();
    send_raw(&conn, &frame::header(1001).unwrap(), &[]);
    let (reply, _) = recv_reply(&conn).unwrap();
    let (code, msg) = expect_error(&reply);
    assert_eq!(code, ErrorCode::FrameTooLarge, "{msg}");
    assert!(msg.contains("1001") && msg.contains("limits.max_request_bytes"), "{msg}");
    assert!(closed_by_daemon(&conn));
    // A NOT_FOUND for a long key does not echo all of it.
    let conn = d.raw();
    send_request(&conn, &get(3, &"k".repeat(900)), &[]);
    let (code, msg) = expect_error(&recv_reply(&conn).unwrap().0);
    assert_eq!(code, ErrorCode::NotFound);
    assert!(msg.len() < 400, "{} bytes", msg.len());
    by.check(&mut d, "oversized requests");
}

/// dup()s of /dev/null to send as junk fds.
fn junk_fds(n: usize) -> Vec<OwnedFd> {
    let null = File::open("/dev/null").unwrap();
    (0..n).map(|_| null.as_fd().try_clone_to_owned().unwrap()).collect()
}

#[test]
fn fds_beyond_one_per_frame_are_never_held() {
    let mut d = Daemon::start();
    let by = Bystander::new(&d);
    let baseline = d.settled_fd_count();
    // A header with 200 fds, then thousands more fds with single bytes, never finishing
    // the frame: the daemon keeps at most the frame's one fd.
    let attacker = d.raw();
    let junk = junk_fds(200);
    let borrowed: Vec<_> = junk.iter().map(|f| f.as_fd()).collect();
    send_raw(&attacker, &frame::header(60_000).unwrap(), &borrowed);
    for _ in 0..20 {
        send_raw(&attacker, &[0], &borrowed);
    }
    by.check(&mut d, "fd flood in progress");
    let held = d.fd_count();
    assert!(held <= baseline + 3, "daemon fds {baseline} → {held} during an fd flood");
    drop(attacker);
    // A complete frame with many fds is refused and its fds closed.
    let conn = d.raw();
    let model = File::open(d.dir().join("bystander.safetensors")).unwrap();
    let mut fds = vec![model.as_fd()];
    fds.extend(borrowed.iter().take(50).copied());
    send_request(&conn, &pack_request(4, "", &[]), &fds);
    let (code, msg) = expect_error(&recv_reply(&conn).unwrap().0);
    assert_eq!(code, ErrorCode::BadFd, "{msg}");
    assert!(msg.contains("more than 1 fd"), "{msg}");
    // A release carrying an fd is refused, not honoured.
    let release = proto::Request {
        progress: false,
        id: 5,
        body: Some(proto::request::Body::Release(proto::ReleaseRequest {
            segment_id: by.model.info().segment_id,
            generation: by.model.info().generation,
        })),
    };
    send_request(&conn, &release, &[model.as_fd()]);
    let (reply, _) = recv_reply(&conn).unwrap();
    assert_eq!((reply.id, expect_error(&reply).0), (5, ErrorCode::BadFd));
    assert!(
        wait_until(Duration::from_secs(10), || d.fd_count() <= baseline + 1),
        "daemon fds {baseline} → {}",
        d.fd_count()
    );
    by.check(&mut d, "fd floods");
}

#[test]
fn bad_request_floods_are_logged_within_the_budget() {
    let mut d = Daemon::start_config("[limits]\nrequest_log_per_second = 5\n");
    let by = Bystander::new(&d);
    let before = d.stat("request_errors");
    let conn = d.raw();
    let n = 3000;
    let started = std::time::Instant::now();
    // A frame whose payload is not a Request.
    let garbage = frame::encode_payload(&[0xFF; 4]).unwrap();
    for _ in 0..n {
        send_raw(&conn, &garbage, &[]);
        assert_eq!(expect_error(&recv_reply(&conn).unwrap().0).0, ErrorCode::MalformedFrame);
    }
    let seconds = started.elapsed().as_secs() + 2;
    by.check(&mut d, "a flood of bad requests");
    assert_eq!(d.stat("request_errors") - before, n);
    let lines = d.log().lines().filter(|l| l.contains("request failed")).count() as u64;
    assert!(lines <= 5 * seconds, "{lines} request lines in about {seconds} s");
    assert!(d.stat("log_lines_suppressed") >= n - 5 * seconds);
}

#[test]
fn a_flood_of_releases_does_not_starve_others() {
    let mut d = Daemon::start_config("[limits]\nframes_per_turn = 4\n");
    let by = Bystander::new(&d);
    let flood = d.raw();
    // Releases of a segment nobody holds: each is refused and counted as a request error.
    let release = proto::Request {
        progress: false,
        id: 0,
        body: Some(proto::request::Body::Release(proto::ReleaseRequest { segment_id: 999, generation: 1 })),
    };
    let one = frame::encode(&release).unwrap();
    let batch: Vec<u8> = one.iter().copied().cycle().take(one.len() * 2000).collect();
    // The flood goes on, its socket buffer full, until the test has seen enough.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flooding = std::sync::Arc::clone(&stop);
    let sender = std::thread::spawn(move || {
        let mut batches = 0u64;
        while !flooding.load(std::sync::atomic::Ordering::Relaxed) {
            send_raw(&flood, &batch, &[]);
            batches += 1;
        }
        batches
    });
    // While the flood is pending, the daemon handles it (its error count keeps rising)
    // and still answers the bystander between two of its turns.
    let mut seen = d.stat("request_errors");
    for round in 0..5 {
        by.check(&mut d, "a release flood");
        assert!(!sender.is_finished(), "the flood is still being sent (round {round})");
        // On a loaded host the flood's turn may not have come yet: wait for it (bounded).
        assert!(
            wait_until(Duration::from_secs(10), || d.stat("request_errors") > seen),
            "the flood is being handled (round {round}: still {seen} errors)"
        );
        seen = d.stat("request_errors");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let batches = sender.join().unwrap();
    assert!(batches >= 1);
    by.check(&mut d, "the end of a release flood");
}

/// A safetensors file of `n` one-byte tensors: a tiny memfd, a large table.
fn many_tiny_tensors(path: &std::path::Path, n: usize) {
    let mut st = packd_tests::SafeTensors::default();
    for i in 0..n {
        st = st.add(&format!("t{i}"), "U8", &[1], vec![i as u8]);
    }
    st.write(path);
}

#[test]
fn a_model_of_many_tiny_tensors_is_charged_for_its_table() {
    // 20 000 one-byte tensors: 1.3 MB of segment (64-byte entries), ~14 MB of table in the
    // index and in the cached reply encoding.
    let d = Daemon::start_args(&[], &["--max-bytes", "4M"]);
    let file = d.dir().join("tiny.safetensors");
    many_tiny_tensors(&file, 20_000);
    let client = d.client();
    let err = client.pack(&file, &packd_client::Plan::default()).map(|_| ()).unwrap_err();
    let packd_client::Error::Daemon { code, message } = err else { panic!("{err}") };
    assert_eq!(code, ErrorCode::ResourceExhausted, "{message}");
    assert!(message.contains("budget of 4194304 bytes"), "{message}");
    assert_eq!((d.stat("pack_jobs"), d.stat("segments")), (0, 0), "refused before any work");

    // With room for it, the segment is charged its table as well as its bytes.
    let d = Daemon::start_args(&[], &["--max-bytes", "64M"]);
    let file = d.dir().join("tiny.safetensors");
    many_tiny_tensors(&file, 20_000);
    let model = d.client().pack(&file, &packd_client::Plan::default()).unwrap();
    let size = model.info().size;
    assert!(size <= 20_000 * 64 + 8192, "{size}");
    let charged = d.stat("bytes_resident");
    assert!(charged >= 5 * size, "charged {charged} for a {size}-byte segment");
    assert!(charged < 64 << 20);
}

#[test]
fn per_uid_quotas_on_leases_and_packed_bytes_name_the_quota() {
    // What one segment of this shape is charged.
    let probe = Daemon::start();
    let m1 = probe.dir().join("m1.safetensors");
    packd_tests::seeded_model(&m1, 1);
    drop(probe.client().pack(&m1, &packd_client::Plan::default()).unwrap());
    let charged = probe.stat("bytes_resident");
    drop(probe);

    let config = format!("[limits]\nmax_leases_per_uid = 3\nmax_packed_bytes_per_uid = {}\n", charged + charged / 2);
    let d = Daemon::start_config(&config);
    let models: Vec<_> = (1..=2)
        .map(|seed| {
            let p = d.dir().join(format!("m{seed}.safetensors"));
            packd_tests::seeded_model(&p, seed);
            p
        })
        .collect();
    let client = d.client();
    let first = client.pack(&models[0], &packd_client::Plan::default()).unwrap();
    // The second model would take this uid over its share: refused before any work,
    // nothing evicted.
    let jobs = d.stat("pack_jobs");
    let err = client.pack(&models[1], &packd_client::Plan::default()).map(drop).unwrap_err();
    let packd_client::Error::Daemon { code, message } = err else { panic!("{err}") };
    assert_eq!(code, ErrorCode::ResourceExhausted, "{message}");
    assert!(message.contains("limits.max_packed_bytes_per_uid"), "{message}");
    assert_eq!((d.stat("pack_jobs"), d.stat("segments")), (jobs, 1));

    // Leases: three at once over two connections, the fourth refused with the quota's name
    // (no fd sent); a release makes room again.
    let other = d.client();
    let a = client.get(first.key()).unwrap();
    let b = other.get(first.key()).unwrap();
    let err = other.get(first.key()).map(drop).unwrap_err();
    let packd_client::Error::Daemon { code, message } = err else { panic!("{err}") };
    assert_eq!(code, ErrorCode::ResourceExhausted, "{message}");
    assert!(message.contains("limits.max_leases_per_uid"), "{message}");
    assert_eq!(d.stat("leases"), 3);
    drop(a); // the release travels on another connection, without a reply: wait for it
    assert!(wait_until(Duration::from_secs(10), || d.stat("leases") == 2));
    let c = other.get(first.key()).unwrap();
    c.verify().unwrap();
    drop((b, c, first));
    assert!(wait_until(Duration::from_secs(10), || d.stat("leases") == 0));

    // Evicting the uid's segment gives its share back.
    assert!(d.packctl(&["evict", "--prefix", "b3:"]).status.success());
    client.pack(&models[1], &packd_client::Plan::default()).unwrap().verify().unwrap();
}

/// What the daemon does first on a control-plane connection: `Some(true)` if it sent its
/// HTTP/2 settings (admitted), `Some(false)` if it closed the connection (refused), within a
/// watchdog of 10 s.
fn admitted(conn: &mut impl std::io::Read) -> Option<bool> {
    let mut first = [0u8; 9];
    let mut got = 0;
    while got < first.len() {
        match conn.read(&mut first[got..]) {
            Ok(0) => return Some(false),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Some(false),
            Err(_) => return None,
        }
    }
    // An HTTP/2 frame header whose type (byte 3) is SETTINGS (4).
    Some(first[3] == 4)
}

/// An HTTP/2 client's connection preface and its (empty) SETTINGS frame.
const H2_HELLO: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";

/// An HTTP/2 frame: 24-bit length, type, flags, stream id.
fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
    let mut f = vec![len[1], len[2], len[3], kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// A unary gRPC call of `path` with an empty request message on `stream`: HEADERS
/// (literal fields, no Huffman) and one DATA frame that ends the stream.
fn grpc_call(stream: u32, path: &str) -> Vec<u8> {
    let mut block = Vec::new();
    for (name, value) in [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "localhost"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ] {
        assert!(name.len() < 127 && value.len() < 127, "one-byte HPACK lengths");
        block.push(0); // literal without indexing, new name
        block.push(u8::try_from(name.len()).unwrap());
        block.extend_from_slice(name.as_bytes());
        block.push(u8::try_from(value.len()).unwrap());
        block.extend_from_slice(value.as_bytes());
    }
    let mut call = h2_frame(1, 0x4, stream, &block); // END_HEADERS
    call.extend(h2_frame(0, 0x1, stream, &[0, 0, 0, 0, 0])); // END_STREAM; message of 0 bytes
    call
}

#[test]
fn control_connections_past_their_limits_are_closed_at_once_and_disturb_nothing() {
    let port = packd_tests::free_port();
    let mut d = Daemon::start_config(&format!(
        "control_tcp = \"127.0.0.1:{port}\"\n[limits]\nmax_control_connections = 8\nmax_control_connections_per_uid = 5\n"
    ));
    let by = Bystander::new(&d); // the data plane: not counted
    // The test's own stats connection holds one of this uid's five slots (once the start-up
    // probe's connection, closed at once, has been seen closed).
    assert!(wait_until(Duration::from_secs(10), || d.stat("control_connections") == 1));
    // Each sends the HTTP/2 preface, as a client does (a silent one is closed in 10 s).
    let local = || {
        let mut c = UnixStream::connect(d.dir().join("control.sock")).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = std::io::Write::write_all(&mut c, H2_HELLO); // a refused one may be closed already
        c
    };
    let tcp = || {
        let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = std::io::Write::write_all(&mut c, H2_HELLO);
        c
    };
    // (They answer no pings: the keepalive would close them after 80 s; the test takes ~1 s.)
    let mut held: Vec<UnixStream> = (0..4).map(|_| local()).collect();
    for c in &mut held {
        assert_eq!(admitted(c), Some(true));
    }
    assert_eq!(d.stat("control_connections"), 5);

    // This uid is at its limit: its next connection is closed before a byte, packctl says why.
    assert_eq!(admitted(&mut local()), Some(false));
    let out = d.packctl(&["--timeout", "10", "stats"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("limits.max_control_connections_per_uid"), "{err}");
    let out = d.packctl(&["--timeout", "10", "health"]);
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success() && said.contains("limits.max_control_connections_per_uid"), "{said}");
    // packctl's channel may try a second connection before it gives up.
    let refused = d.stat("control_connections_refused");
    assert!(refused >= 2, "{refused}");
    let me = format!("peer=uid {}", nix::unistd::getuid());
    assert!(d.log().contains(&me) && d.log().contains("limit=\"limits.max_control_connections_per_uid\""));

    // TCP callers count apart from this uid: three are admitted, up to the global limit of 8.
    let mut held_tcp: Vec<std::net::TcpStream> = (0..3).map(|_| tcp()).collect();
    for c in &mut held_tcp {
        assert_eq!(admitted(c), Some(true));
    }
    assert_eq!(admitted(&mut tcp()), Some(false), "the global limit");
    assert!(d.log().contains("peer=TCP") && d.log().contains("limit=\"limits.max_control_connections\""));
    // (At least: packctl's channel may have its second try refused only now.)
    assert_eq!(d.stat("control_connections"), 8);
    assert!(d.stat("control_connections_refused") > refused);
    by.check(&mut d, "control connections at their limits");

    // A slot comes back when a connection closes: TCP takes it, and the global limit is
    // reached again.
    drop(held.pop());
    assert!(wait_until(Duration::from_secs(10), || d.stat("control_connections") == 7));
    held_tcp.push(tcp());
    assert_eq!(admitted(held_tcp.last_mut().unwrap()), Some(true));
    assert_eq!(admitted(&mut tcp()), Some(false), "the global limit again");
    // This uid is an admin (packd's own): held to its own limit only, it still gets in.
    let out = d.packctl(&["--timeout", "10", "stats", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(stats["control_connections"].as_u64(), Some(9));
    assert!(stats["control_connections_refused"].as_u64() > Some(refused + 1));
}

#[test]
fn an_oversized_control_request_is_refused_by_size() {
    // The limit follows limits.max_request_bytes (plus 4 KiB for a Prefetch's path).
    let d = Daemon::start_config("[limits]\nmax_request_bytes = 16000\n");
    let out = d.packctl(&["ls", "--prefix", &format!("b3:{}", "a".repeat(19_000))]);
    assert!(out.status.success(), "under the limit: {}", String::from_utf8_lossy(&out.stderr));
    let out = d.packctl(&["ls", "--prefix", &format!("b3:{}", "a".repeat(21_000))]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("OUT_OF_RANGE") && err.contains("20096"), "{err}");
    // The connection limit is untouched and the daemon answers the next request.
    assert_eq!(d.stat("control_connections_refused"), 0);
    let out = d.packctl(&["ls", "--prefix", "b3:"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn control_connections_advertise_their_per_connection_bounds() {
    let d = Daemon::start();
    let mut c = UnixStream::connect(d.dir().join("control.sock")).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // The daemon's first frame: SETTINGS (type 4) on stream 0, six bytes per setting.
    let mut head = [0u8; 9];
    std::io::Read::read_exact(&mut c, &mut head).unwrap();
    assert_eq!((head[3], &head[5..9]), (4, &[0u8; 4][..]), "{head:?}");
    let mut body = vec![0u8; usize::from(head[1]) << 8 | usize::from(head[2])];
    std::io::Read::read_exact(&mut c, &mut body).unwrap();
    let settings: std::collections::HashMap<u16, u32> = body
        .chunks_exact(6)
        .map(|s| (u16::from_be_bytes([s[0], s[1]]), u32::from_be_bytes([s[2], s[3], s[4], s[5]])))
        .collect();
    // MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_HEADER_LIST_SIZE.
    assert_eq!((settings.get(&3), settings.get(&4), settings.get(&6)), (Some(&4), Some(&65_536), Some(&16_384)));
}

/// Waits until the daemon has closed `conn`, its one control connection besides the
/// test's own, and given its slot back; asserts that took at least `at_least` after `since`
/// (a deadline, not an early close for another reason) and that the socket was closed.
fn closed_no_sooner_than(d: &Daemon, conn: &mut UnixStream, since: std::time::Instant, at_least: Duration) {
    assert!(wait_until(Duration::from_secs(150), || d.stat("control_connections") == 1), "{}", d.log());
    assert!(since.elapsed() >= at_least, "closed after {:?}, before {at_least:?}", since.elapsed());
    conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut rest = Vec::new();
    assert!(std::io::Read::read_to_end(conn, &mut rest).is_ok(), "closed by the daemon");
}

#[test]
fn a_control_connection_that_never_answers_a_ping_is_closed_by_the_keepalive() {
    let d = Daemon::start();
    assert!(wait_until(Duration::from_secs(10), || d.stat("control_connections") == 1));
    // An HTTP/2 client preface and empty SETTINGS, then nothing: never reads, never acks.
    let mut mute = UnixStream::connect(d.dir().join("control.sock")).unwrap();
    std::io::Write::write_all(&mut mute, H2_HELLO).unwrap();
    let sent = std::time::Instant::now();
    assert!(wait_until(Duration::from_secs(10), || d.stat("control_connections") == 2));
    // Pinged after 60 s of silence, closed 20 s later: its slot comes back.
    closed_no_sooner_than(&d, &mut mute, sent, Duration::from_secs(75));
}

#[test]
fn a_control_connection_that_sends_no_preface_is_closed_after_the_hello_timeout() {
    let d = Daemon::start();
    assert!(wait_until(Duration::from_secs(10), || d.stat("control_connections") == 1));
    let mut silent = UnixStream::connect(d.dir().join("control.sock")).unwrap();
    let connected = std::time::Instant::now();
    assert!(wait_until(Duration::from_secs(10), || d.stat("control_connections") == 2));
    // 10 s without the HTTP/2 preface: closed, its slot given back, the reason logged.
    closed_no_sooner_than(&d, &mut silent, connected, Duration::from_secs(9));
    let me = format!("peer=uid {}", nix::unistd::getuid());
    let log = d.log();
    assert!(log.contains("no HTTP/2 preface within 10 s of connecting") && log.contains(&me), "{log}");
}

#[test]
fn a_control_connection_that_stops_reading_its_answers_is_closed_after_the_write_stall_timeout() {
    let d = Daemon::start();
    // An index whose listing (~0.4 MB) overflows a socket buffer.
    let file = d.dir().join("tiny.safetensors");
    many_tiny_tensors(&file, 4_000);
    let _model = d.client().pack(&file, &packd_client::Plan::default()).unwrap();
    assert!(wait_until(Duration::from_secs(10), || d.stat("control_connections") == 1));
    // A client that grants all the flow-control credit there is, asks for the whole
    // listing on four streams, and never reads a byte.
    let mut greedy = UnixStream::connect(d.dir().join("control.sock")).unwrap();
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend(h2_frame(4, 0, 0, &[0, 4, 0x7f, 0xff, 0xff, 0xff])); // INITIAL_WINDOW_SIZE
    hello.extend(h2_frame(8, 0, 0, &(0x7fff_ffff_u32 - 65_535).to_be_bytes())); // WINDOW_UPDATE
    for stream in [1, 3, 5, 7] {
        hello.extend(grpc_call(stream, "/packd.v1.Control/ListEntries"));
    }
    std::io::Write::write_all(&mut greedy, &hello).unwrap();
    let sent = std::time::Instant::now();
    assert!(wait_until(Duration::from_secs(10), || d.stat("control_connections") == 2));
    // Its writes block once the socket is full; 60 s later it is closed, by that deadline
    // (the keepalive's close, due 20 s later, could not get through the full socket).
    closed_no_sooner_than(&d, &mut greedy, sent, Duration::from_secs(55));
    assert!(d.log().contains("no write progressed for 60 s"), "{}", d.log());
    // Others were answered meanwhile, and are now.
    assert_eq!(d.stat("entries"), 4_000);
}
