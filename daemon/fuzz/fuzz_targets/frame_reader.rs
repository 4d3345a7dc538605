//! The frame reader takes untrusted bytes in arbitrary chunks: it must never panic, must
//! yield the same frames however the stream is split, and must never ask for more bytes
//! than the frame in progress needs.
#![no_main]

use libfuzzer_sys::fuzz_target;
use packd_proto::v1;
use prost::Message;
use packd_proto::frame::{self, FrameReader, HEADER_LEN, MAX_FRAME_FDS, MAX_REQUEST_BYTES};

/// The frames read from `data` delivered in reads of at most `split` bytes, and whether
/// the stream ended with a frame that was too large.
fn frames(data: &[u8], split: usize) -> (Vec<Vec<u8>>, bool) {
    let mut r = FrameReader::new(MAX_REQUEST_BYTES, MAX_FRAME_FDS);
    let mut out = Vec::new();
    let mut rest = data;
    while !rest.is_empty() {
        let wanted = r.wanted();
        assert!(wanted > 0 && wanted <= HEADER_LEN.max(MAX_REQUEST_BYTES));
        let n = wanted.min(split).min(rest.len());
        r.buf()[..n].copy_from_slice(&rest[..n]);
        rest = &rest[n..];
        match r.advance(n, Vec::new(), false) {
            Ok(Some(f)) => out.push(f.payload),
            Ok(None) => assert!(r.in_frame()),
            Err(_) => return (out, true),
        }
    }
    (out, false)
}

fuzz_target!(|data: &[u8]| {
    let split = data.first().copied().unwrap_or(1).max(1) as usize;
    let (whole, too_large) = frames(data, data.len().max(1));
    assert_eq!((whole.clone(), too_large), frames(data, split));
    // Every frame read re-encodes to the bytes it came from, and any payload that decodes
    // as a request or a reply survives the one encoder both ends use.
    let mut at = 0;
    for payload in &whole {
        let again = frame::encode_payload(payload).expect("a read frame fits the prefix");
        assert_eq!(&data[at..at + again.len()], again.as_slice());
        at += again.len();
        if let Ok(req) = <v1::Request as Message>::decode(payload.as_slice()) {
            let bytes = frame::encode(&req).expect("encode");
            assert_eq!(<v1::Request as Message>::decode(&bytes[HEADER_LEN..]).ok(), Some(req));
        }
        if let Ok(reply) = <v1::Reply as Message>::decode(payload.as_slice()) {
            let bytes = frame::encode(&reply).expect("encode");
            assert_eq!(<v1::Reply as Message>::decode(&bytes[HEADER_LEN..]).ok(), Some(reply));
        }
    }
});
