//! A client at its own open-file limit: the kernel drops the segment fd of a reply
//! (`MSG_CTRUNC`). The reference client must read the reply to its end (so the stream
//! stays in sync), give the lease back and report `FdDropped`; once fds are free again the
//! same connection keeps working. One test in its own binary: it lowers this process's
//! `RLIMIT_NOFILE`, which would disturb tests running beside it.

use nix::sys::resource::{Resource, getrlimit, setrlimit};
use packd_client::{Error, Plan};
use packd_tests::{Daemon, small_model};

#[test]
fn a_reply_whose_fd_was_dropped_keeps_the_stream_in_sync_and_releases_its_lease() {
    let d = Daemon::start();
    let file = d.dir().join("m.safetensors");
    small_model(&file);
    let client = d.client();
    let model = client.pack(&file, &Plan::default()).unwrap();
    let key = model.key().to_string();
    assert_eq!(d.stat("leases"), 1);

    // The lowest free fd number is n: with a soft limit of n no new fd can be installed.
    let probe = std::fs::File::open("/dev/null").unwrap();
    let n = std::os::fd::AsRawFd::as_raw_fd(&probe) as u64;
    drop(probe);
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    setrlimit(Resource::RLIMIT_NOFILE, n, hard).unwrap();
    let refused = client.get(&key);
    setrlimit(Resource::RLIMIT_NOFILE, soft, hard).unwrap();
    match refused {
        Err(Error::FdDropped(k)) => assert_eq!(k, key),
        other => panic!("expected FdDropped, got {:?}", other.map(|m| m.key().to_string())),
    }

    // The stream is in sync: the next request on the same connection gets its own reply.
    let again = client.get(&key).expect("the connection still works");
    again.verify().unwrap();
    // The dropped reply's lease was given back: the first model's and this one's remain.
    assert_eq!(d.stat("leases"), 2);
    assert_eq!(d.stat("clients"), 1, "one connection throughout");
}
