//! Invariant 4: every bad input gets a clear error and harms nothing else. A bystander
//! holds a mapped model throughout and must keep correct bytes and a working connection.
#![allow(clippy::cast_possible_truncation)] // test data sizes are small

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;

use packd_client::proto::{self, ErrorCode};
use packd_tests::{
    Bystander, Daemon, SafeTensors, expect_error, pack_request, recv_reply, send_raw, send_request, values,
};

/// Sends a pack request for `file` on a fresh raw connection and returns the error.
fn pack_error(d: &Daemon, file: &File, layout: &str, rules: &[&str]) -> (ErrorCode, String) {
    let conn = d.raw();
    send_request(&conn, &pack_request(7, layout, rules), &[file.as_fd()]);
    let (reply, fds) = recv_reply(&conn).expect("a reply");
    assert!(fds.is_empty(), "no fd travels with an error");
    assert_eq!(reply.id, 7);
    expect_error(&reply)
}

fn write(d: &Daemon, name: &str, bytes: &[u8]) -> File {
    let path = d.dir().join(name);
    std::fs::write(&path, bytes).unwrap();
    File::open(path).unwrap()
}

fn header(json: &str) -> Vec<u8> {
    let mut v = (json.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(json.as_bytes());
    v
}

#[test]
fn bad_sources_get_clear_errors() {
    let mut d = Daemon::start();
    let by = Bystander::new(&d);
    let good = SafeTensors::default().f32("a.weight", &[4, 4], &values(16, 1)).bytes();

    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "not safetensors",
            b"hello, this is a text file and not a model\n".to_vec(),
            "not a safetensors file: its first 8 bytes",
        ),
        ("empty file", Vec::new(), "shorter than the 8-byte header length"),
        ("truncated", good[..good.len() - 10].to_vec(), "out of range"),
        (
            "header beyond file",
            {
                let mut v = 5000u64.to_le_bytes().to_vec();
                v.extend_from_slice(b"{}");
                v
            },
            "beyond the end",
        ),
        (
            "overlap",
            {
                let mut v = header(
                    r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
                );
                v.extend([0u8; 12]);
                v
            },
            "overlaps",
        ),
        (
            "out of range",
            {
                let mut v = header(
                    r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}"#,
                );
                v.extend([0u8; 12]);
                v
            },
            "out of range",
        ),
        (
            "dtype × shape",
            {
                let mut v = header(r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#);
                v.extend([0u8; 8]);
                v
            },
            "needs 12 bytes",
        ),
        (
            "unsupported dtype",
            {
                let mut v = header(r#"{"a":{"dtype":"Q4_K","shape":[2],"data_offsets":[0,8]}}"#);
                v.extend([0u8; 8]);
                v
            },
            "unknown dtype",
        ),
        (
            "overflowing shape",
            {
                let mut v =
                    header(r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,8]}}"#);
                v.extend([0u8; 8]);
                v
            },
            "overflows",
        ),
        (
            "bad json",
            {
                let mut v = header(r#"{"a": {"dtype": "F32", "#);
                v.extend([0u8; 8]);
                v
            },
            "JSON",
        ),
    ];
    for (what, bytes, want) in cases {
        let file = write(&d, "bad.safetensors", &bytes);
        let (code, msg) = pack_error(&d, &file, "", &[]);
        assert_eq!(code, ErrorCode::BadSource, "{what}: {msg}");
        assert!(msg.contains(want), "{what}: {msg:?} lacks {want:?}");
        by.check(&mut d, what);
    }

    // GEMM layouts take F32, F16 and BF16 sources; a rule that gives one to an I64 tensor is
    // an error naming the tensor.
    let ids = SafeTensors::default().add("x.weight", "I64", &[2, 2], vec![0; 32]).bytes();
    let (code, msg) = pack_error(&d, &write(&d, "i64.safetensors", &ids), "", &["x.*=qc8w-gemm"]);
    assert_eq!(code, ErrorCode::InvalidArgument);
    assert!(msg.contains("x.weight") && msg.contains("I64") && msg.contains("qc8w-gemm"), "{msg}");
    // …and identity takes it (the default rule leaves non-float tensors alone).
    let conn = d.raw();
    send_request(&conn, &pack_request(1, "", &[]), &[write(&d, "i64b.safetensors", &ids).as_fd()]);
    let (reply, fds) = recv_reply(&conn).unwrap();
    assert!(matches!(reply.body, Some(proto::reply::Body::Segment(_))) && fds.len() == 1);

    let stats = d.stats();
    assert_eq!(stats["segments"], 2, "failed jobs leave nothing in the index: {stats}");
    assert!(stats["pack_failures"].as_u64().unwrap() >= 7, "{stats}");
    by.check(&mut d, "all bad sources");
}

#[test]
fn bad_fds_and_layouts_get_clear_errors() {
    let mut d = Daemon::start();
    let by = Bystander::new(&d);
    let model = d.dir().join("bystander.safetensors");
    let src = File::open(&model).unwrap();

    // A directory, a socket and a pipe are not sources.
    let dir = File::open(d.dir()).unwrap();
    let (code, msg) = pack_error(&d, &dir, "", &[]);
    assert_eq!((code, msg.contains("a directory")), (ErrorCode::BadFd, true), "{msg}");
    let (sock, _other) = UnixStream::pair().unwrap();
    let conn = d.raw();
    send_request(&conn, &pack_request(2, "", &[]), &[sock.as_fd()]);
    let (code, msg) = expect_error(&recv_reply(&conn).unwrap().0);
    assert_eq!((code, msg.contains("a socket")), (ErrorCode::BadFd, true), "{msg}");
    let (rd, _wr) = nix::unistd::pipe().unwrap();
    send_request(&conn, &pack_request(3, "", &[]), &[rd.as_fd()]);
    let (code, msg) = expect_error(&recv_reply(&conn).unwrap().0);
    assert_eq!((code, msg.contains("a pipe")), (ErrorCode::BadFd, true), "{msg}");
    by.check(&mut d, "non-file fds");

    // No fd, two fds, and fds on a get.
    send_request(&conn, &pack_request(4, "", &[]), &[]);
    let (code, msg) = expect_error(&recv_reply(&conn).unwrap().0);
    assert_eq!((code, msg.contains("no fd")), (ErrorCode::BadFd, true), "{msg}");
    send_request(&conn, &pack_request(5, "", &[]), &[src.as_fd(), src.as_fd()]);
    let (code, msg) = expect_error(&recv_reply(&conn).unwrap().0);
    assert_eq!((code, msg.contains("more than 1 fd")), (ErrorCode::BadFd, true), "{msg}");
    let get = proto::Request {
        progress: false,
        id: 6,
        body: Some(proto::request::Body::Get(proto::GetRequest { key: by.model.key().into(), ..Default::default() })),
    };
    send_request(&conn, &get, &[src.as_fd()]);
    assert_eq!(expect_error(&recv_reply(&conn).unwrap().0).0, ErrorCode::BadFd);
    by.check(&mut d, "fd count errors");

    // Unknown layouts and bad parameters.
    for (layout, rules, want) in [
        ("q4-gemm", vec![], "unknown layout"),
        ("f32-gemm:nr=3", vec![], "nr=3 is not one of"),
        ("f32-gemm:nr=4,sr=8", vec![], "sr=8"),
        ("f32-gemm:nr=4,kr=3", vec![], "kr=3 is not one of"),
        ("", vec!["no-equals-sign"], "not GLOB=LAYOUT"),
        ("", vec!["*.weight=f32-gemm:bogus=1"], "unknown parameter"),
        ("", vec!["*norm*=f32-gemm"], "needs a 2-D"),
    ] {
        let rules: Vec<&str> = rules;
        let (code, msg) = pack_error(&d, &src, layout, &rules);
        assert_eq!(code, ErrorCode::InvalidArgument, "{layout} {rules:?}: {msg}");
        assert!(msg.contains(want), "{layout} {rules:?}: {msg:?} lacks {want:?}");
    }
    // Good parameters in the same shape are accepted.
    let conn2 = d.raw();
    send_request(&conn2, &pack_request(8, "f32-gemm:nr=8,kr=2,sr=4", &[]), &[src.as_fd()]);
    assert!(matches!(recv_reply(&conn2).unwrap().0.body, Some(proto::reply::Body::Segment(_))));
    by.check(&mut d, "bad layouts");
}

#[test]
fn garbage_and_oversized_frames() {
    let mut d = Daemon::start();
    let by = Bystander::new(&d);

    // Garbage inside a well-formed frame: error reply, the connection stays usable.
    let conn = d.raw();
    send_raw(&conn, &packd_proto::frame::encode_payload(&[0xFFu8; 16]).unwrap(), &[]);
    let (reply, _) = recv_reply(&conn).unwrap();
    let (code, msg) = expect_error(&reply);
    assert_eq!(code, ErrorCode::MalformedFrame, "{msg}");
    send_request(&conn, &proto::Request { id: 9, body: None, progress: false }, &[]);
    let (reply, _) = recv_reply(&conn).unwrap();
    assert_eq!((reply.id, expect_error(&reply).0), (9, ErrorCode::InvalidArgument));
    let get = proto::Request {
        progress: false,
        id: 10,
        body: Some(proto::request::Body::Get(proto::GetRequest { key: by.model.key().into(), ..Default::default() })),
    };
    send_request(&conn, &get, &[]);
    let (reply, fds) = recv_reply(&conn).unwrap();
    assert_eq!((reply.id, fds.len()), (10, 1));
    by.check(&mut d, "garbage frame");

    // An oversized frame: error, then the daemon closes that connection only.
    let conn = d.raw();
    send_raw(&conn, &packd_proto::frame::header(u32::MAX as usize).unwrap(), &[]);
    let (reply, _) = recv_reply(&conn).unwrap();
    let (code, msg) = expect_error(&reply);
    assert_eq!(code, ErrorCode::FrameTooLarge);
    assert!(msg.contains("4294967295"), "{msg}");
    assert!(recv_reply(&conn).is_none(), "connection closed after an oversized frame");
    by.check(&mut d, "oversized frame");

    // Random bytes and abrupt hang-ups mid-frame, many times.
    for i in 0..50u32 {
        let conn = d.raw();
        let junk: Vec<u8> = values(64, i).iter().flat_map(|v| v.to_le_bytes()).collect();
        send_raw(&conn, &junk, &[]);
        drop(conn);
    }
    by.check(&mut d, "random bytes");
    // Releases of segments never held are ignored (and counted), never fatal.
    let conn = d.raw();
    let rel = proto::Request {
        progress: false,
        id: 0,
        body: Some(proto::request::Body::Release(proto::ReleaseRequest { segment_id: 999, generation: 1 })),
    };
    send_request(&conn, &rel, &[]);
    send_request(&conn, &get, &[]);
    assert_eq!(recv_reply(&conn).unwrap().1.len(), 1);
    by.check(&mut d, "bogus release");
}

#[test]
fn a_tensor_of_no_rows_and_any_number_of_columns_packs_to_nothing_in_every_gemm_kind() {
    let mut d = Daemon::start();
    let by = Bystander::new(&d);
    // No bytes, so no size bounds its columns: 2^58 of them.
    let empty = SafeTensors::default()
        .add("x.weight", "F32", &[0, 1 << 58], vec![])
        .add("y.weight", "F32", &[2, 16], vec![0; 128])
        .bytes();
    let mut packed = 0;
    for kind in ["f32-gemm", "f16-gemm", "bf16-gemm", "qc8w-gemm"] {
        let rule = format!("*.weight={kind}:nr=16,kr=1,sr=1");
        let conn = d.raw();
        let file = write(&d, &format!("empty-{kind}.safetensors"), &empty);
        send_request(&conn, &pack_request(1, "", &[rule.as_str()]), &[file.as_fd()]);
        let (reply, fds) = recv_reply(&conn).unwrap();
        match reply.body {
            Some(proto::reply::Body::Segment(seg)) => {
                assert_eq!(fds.len(), 1, "{kind}");
                let x = seg.entries.iter().find(|e| e.name == "x.weight").unwrap_or_else(|| panic!("{kind}: {seg:?}"));
                assert_eq!(x.length, 0, "{kind}: a tensor of no rows packs to no bytes");
                packed += 1;
            }
            // f32's packed block of 2^58 columns is 2^64 bytes: its size overflows, said so.
            Some(proto::reply::Body::Error(e)) if kind == "f32-gemm" => {
                assert!(e.code() == ErrorCode::BadSource && e.message.contains("x.weight overflows"), "{e:?}");
            }
            other => panic!("{kind}: {other:?}"),
        }
    }
    assert!(packed >= 3, "f16, bf16 and qc8w pack it");
    by.check(&mut d, "tensors of no rows");
}
