//! Invariant 1: a received segment is sealed; no client can change shared weights.
#![allow(clippy::cast_possible_truncation)] // test data sizes are small

use std::fs::OpenOptions;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::FileExt;

use nix::errno::Errno;
use packd_client::{Error, Plan};
use packd_tests::{Daemon, SafeTensors, send_raw, small_model, sys};

#[test]
fn a_client_cannot_write_truncate_grow_or_map_writable() {
    let d = Daemon::start();
    let file = d.dir().join("small.safetensors");
    small_model(&file);
    let client = d.client();
    let src = std::fs::File::open(&file).unwrap();
    let seg = client.pack_segment(&src, &Plan::default()).unwrap();
    let f = seg.file();
    let size = seg.info().size;
    let before = {
        let mut v = vec![0u8; size as usize];
        f.read_exact_at(&mut v, 0).unwrap();
        v
    };

    let eperm = Some(libc::EPERM);
    assert_eq!((&*f).write(b"x").unwrap_err().raw_os_error(), eperm, "write");
    assert_eq!(f.write_at(b"x", 100).unwrap_err().raw_os_error(), eperm, "pwrite");
    assert_eq!(f.set_len(size / 2).unwrap_err().raw_os_error(), eperm, "shrink");
    assert_eq!(f.set_len(size * 2).unwrap_err().raw_os_error(), eperm, "grow");
    assert_eq!(sys::map_shared_writable(f, size as usize), Some(Errno::EPERM), "PROT_WRITE|MAP_SHARED");
    assert_eq!(sys::mprotect_to_writable(f, size as usize), Some(Errno::EACCES), "mprotect RO→RW");

    // Reopening through /proc gives a new open file description, but the seals are on the
    // inode: writes, truncation and writable shared maps still fail.
    let proc_path = format!("/proc/self/fd/{}", f.as_fd().as_raw_fd());
    match OpenOptions::new().read(true).write(true).open(&proc_path) {
        Ok(mut rw) => {
            assert_eq!(rw.write(b"x").unwrap_err().raw_os_error(), eperm, "write via /proc");
            assert_eq!(rw.set_len(1).unwrap_err().raw_os_error(), eperm, "truncate via /proc");
            assert_eq!(sys::map_shared_writable(&rw, size as usize), Some(Errno::EPERM), "map via /proc");
        }
        Err(e) => assert!(matches!(e.raw_os_error(), Some(libc::EPERM | libc::EACCES)), "{e}"),
    }

    let mut after = vec![0u8; size as usize];
    f.read_exact_at(&mut after, 0).unwrap();
    assert_eq!(before, after, "bytes unchanged");
    let model = seg.map().unwrap();
    model.verify().unwrap();
}

#[test]
fn the_client_refuses_an_unsealed_segment() {
    // A fake daemon that answers with an unsealed memfd: the client must not map it.
    let dir = tempfile::tempdir().unwrap();
    let listener = std::os::unix::net::UnixListener::bind(dir.path().join("packd.sock")).unwrap();
    let server = std::thread::spawn(move || {
        let (conn, _) = listener.accept().unwrap();
        let mut len = [0u8; 4];
        std::io::Read::read_exact(&mut &conn, &mut len).unwrap();
        let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
        std::io::Read::read_exact(&mut &conn, &mut body).unwrap();
        let memfd = packd::sys::memfd::create("unsealed").unwrap();
        memfd.set_len(4096).unwrap();
        let reply = packd_client::proto::Reply {
            id: 1,
            body: Some(packd_client::proto::reply::Body::Segment(packd_client::proto::SegmentReply {
                segment_id: 1,
                generation: 1,
                key: "fake".into(),
                size: 4096,
                ..Default::default()
            })),
        };
        let bytes = packd_proto::frame::encode(&reply).unwrap();
        send_raw(&conn, &bytes, &[memfd.as_fd()]);
        // Keep the connection until the client hangs up.
        let mut rest = Vec::new();
        let _ = std::io::Read::read_to_end(&mut &conn, &mut rest);
    });
    let file = dir.path().join("m.safetensors");
    SafeTensors::default().f32("a", &[1], &[1.0]).write(&file);
    let client = packd_client::Client::connect(dir.path()).unwrap();
    let err = client.pack(&file, &Plan::default()).err().expect("must refuse");
    assert!(matches!(err, Error::NotSealed { .. }), "{err}");
    drop(client);
    server.join().unwrap();
}
