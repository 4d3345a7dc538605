//! Every client call has a deadline: against a daemon that accepts and never answers, a
//! get, a pack and a connection's later calls fail with `TIMEOUT` naming what they waited
//! for; against one that never accepts, so does connecting; a release never waits behind
//! another thread's request; and a progress callback that panics gives its request up
//! without leaving it in flight.

use std::sync::mpsc::RecvTimeoutError;
use std::time::Duration;

use packd_client::proto::request::Body;
use packd_client::{Client, Error, Plan, Timeouts};
use packd_tests::{SilentDaemon, small_model};

/// Long enough for any machine to deliver a frame on a local socket.
const DELIVERY: Duration = Duration::from_secs(30);

fn short() -> Timeouts {
    Timeouts { connect: Duration::from_secs(5), get: Duration::from_millis(200), pack: Duration::from_millis(300) }
}

#[test]
fn calls_on_a_daemon_that_never_answers_time_out() {
    let silent = SilentDaemon::start();
    let client = Client::connect_with(silent.dir(), short()).expect("connect");
    for round in 0..2 {
        match client.get("b3:nothing@plan:0") {
            Err(e @ Error::Timeout { .. }) => {
                assert_eq!(e.code(), "TIMEOUT");
                let text = e.to_string();
                assert!(text.contains("a get request") && text.contains("200ms"), "{text}");
            }
            other => panic!("round {round}: expected a timeout, got {:?}", other.map(|m| m.key().to_string())),
        }
        let req = silent.requests.recv_timeout(DELIVERY).expect("the get reached the daemon");
        assert!(matches!(req.body, Some(Body::Get(_))), "{req:?}");
    }
    let model = tempfile::NamedTempFile::new().unwrap();
    small_model(model.path());
    match client.pack(model.path(), &Plan::default()) {
        Err(e @ Error::Timeout { .. }) => assert!(e.to_string().contains("a pack request"), "{e}"),
        other => panic!("expected a timeout, got {:?}", other.map(|m| m.key().to_string())),
    }
    let req = silent.requests.recv_timeout(DELIVERY).expect("the pack reached the daemon");
    assert!(matches!(req.body, Some(Body::Pack(_))), "{req:?}");
}

#[test]
fn a_release_does_not_wait_for_another_threads_request() {
    let silent = SilentDaemon::answer_first_get(4096);
    let timeouts = Timeouts { get: Duration::from_secs(600), ..Timeouts::default() };
    let client = Client::connect_with(silent.dir(), timeouts).expect("connect");
    let model = client.get("b3:silent@plan:0").expect("the first get is answered");
    assert_eq!(model.bytes().len(), 4096);
    assert!(matches!(silent.requests.recv_timeout(DELIVERY).unwrap().body, Some(Body::Get(_))));

    // Another thread's get that the daemon never answers: it waits (up to 600 s).
    let other = client.clone();
    let waiting = std::thread::spawn(move || other.get("b3:never@plan:0").map(|_| ()));
    assert!(matches!(silent.requests.recv_timeout(DELIVERY).unwrap().body, Some(Body::Get(_))));

    // Dropping the model sends its release now, while that request is still waiting.
    drop(model);
    let release = silent.requests.recv_timeout(DELIVERY).expect("the release was sent");
    match release.body {
        Some(Body::Release(r)) => assert_eq!((r.segment_id, r.generation), (1, 1)),
        other => panic!("expected a release, got {other:?}"),
    }
    assert!(!waiting.is_finished(), "the other thread's get is still waiting for its reply");
    assert_eq!(silent.requests.recv_timeout(Duration::from_millis(10)), Err(RecvTimeoutError::Timeout));
}

#[test]
fn connecting_to_a_daemon_that_never_accepts_times_out() {
    use nix::sys::socket::{AddressFamily, Backlog, SockFlag, SockType, UnixAddr, bind, listen, socket};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(packd_proto::DATA_SOCKET);
    // A listener with the shortest backlog that never accepts: once the backlog is full,
    // connecting waits for room that never comes.
    let listener = socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_CLOEXEC, None).unwrap();
    bind(std::os::fd::AsRawFd::as_raw_fd(&listener), &UnixAddr::new(&path).unwrap()).unwrap();
    listen(&listener, Backlog::new(0).unwrap()).unwrap();
    let timeouts = Timeouts { connect: Duration::from_millis(200), ..Timeouts::default() };
    let mut held = Vec::new();
    let err = loop {
        match Client::connect_with(dir.path(), timeouts) {
            Ok(client) => held.push(client),
            Err(e) => break e,
        }
        assert!(held.len() < 64, "the backlog never filled");
    };
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(err.to_string().contains("a connection within 200ms"), "{err}");
    assert!(!held.is_empty(), "the backlog took a connection before it was full");
}

#[test]
fn with_default_deadlines_every_call_gives_up_after_30_s_of_silence_not_10_minutes() {
    // The client's deadline bounds the daemon's silence (a running request reports
    // progress every second), not the whole request: packctl's pack, map and cat and the
    // library's get, pack and acquire all give up after 30 s of silence, not 10 minutes.
    // They run at once: the test takes about 30 s.
    let silent = SilentDaemon::start();
    let model = tempfile::NamedTempFile::new().unwrap();
    small_model(model.path());
    let started = std::time::Instant::now();
    let children: Vec<(&str, std::process::Child)> = [["pack", ""], ["map", ""], ["cat", "embed.weight"]]
        .iter()
        .map(|&[cmd, tensor]| {
            let child = std::process::Command::new(packd_tests::packctl_bin())
                .arg("--socket-dir")
                .arg(silent.dir())
                .arg(cmd)
                .arg(model.path())
                .args(if tensor.is_empty() { vec![] } else { vec!["--tensor", tensor] })
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("spawn packctl");
            (cmd, child)
        })
        .collect();
    let calls: Vec<std::thread::JoinHandle<Error>> = (0..3)
        .map(|call| {
            let (dir, path) = (silent.dir().to_path_buf(), model.path().to_path_buf());
            std::thread::spawn(move || {
                let client = Client::connect(&dir).expect("connect");
                match call {
                    0 => client.get("b3:nothing@plan:0").map(|_| ()).unwrap_err(),
                    1 => client.pack(&path, &Plan::default()).map(|_| ()).unwrap_err(),
                    _ => client.acquire("mute", packd_client::AcquireOptions::default()).map(|_| ()).unwrap_err(),
                }
            })
        })
        .collect();
    for (what, child) in children {
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "packctl {what} failed");
        assert!(stderr.contains("did not answer") && stderr.contains("within 30s"), "packctl {what}: {stderr}");
    }
    for call in calls {
        let e = call.join().unwrap();
        assert_eq!(e.code(), "TIMEOUT", "{e}");
        assert!(e.to_string().contains("within 30s"), "{e}");
    }
    // Each waited its whole 30 s deadline (none gave up early), and none the 600 s a
    // deadline on the whole request would have let it wait: bounds far from what a loaded
    // machine adds.
    let took = started.elapsed();
    assert!(took >= Duration::from_secs(30), "a call gave up before 30 s of silence (took {took:?})");
    assert!(took < Duration::from_secs(300), "a call waited far past 30 s of silence (took {took:?})");
}

#[test]
fn a_progress_callback_that_panics_gives_its_request_up_and_the_client_goes_on() {
    let mut d = packd_tests::Daemon::start();
    let path = d.dir().join("m.safetensors");
    small_model(&path);
    let client = Client::connect(d.dir()).unwrap();
    let file = std::fs::File::open(&path).unwrap();
    // The daemon reports ACCEPTED at once: the callback runs, and panics.
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        client.pack_with_progress(&file, &Plan::default(), "m", &|_| panic!("the caller's own bug"))
    }));
    assert!(panicked.is_err(), "the callback's panic reaches its caller");
    // The next call works, and reads (and drops) the answer nobody waits for any more.
    let model = client.pack(&path, &Plan::default()).unwrap();
    assert_eq!(client.live_leases(), 1);
    drop(model);
    // Nothing is left in flight: with the daemon gone, a check looks at the socket, finds it
    // closed and says the daemon is away (a request left waiting would make it answer
    // "fine" without looking).
    assert!(d.terminate().success());
    assert!(
        matches!(client.reconnect_if_lost(), Err(Error::Unavailable { .. })),
        "the connection still counts a request in flight"
    );
}
