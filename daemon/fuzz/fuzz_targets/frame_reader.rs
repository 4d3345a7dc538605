//! The frame reader takes untrusted bytes in arbitrary chunks: it must never panic, must
//! yield the same frames however the stream is split, and must never ask for more bytes
//! than the frame in progress needs.
#![no_main]

use libfuzzer_sys::fuzz_target;
use packd::dataplane::frame::{FrameReader, HEADER_LEN, MAX_REQUEST_BYTES};

/// The frames read from `data` delivered in reads of at most `split` bytes, and whether
/// the stream ended with a frame that was too large.
fn frames(data: &[u8], split: usize) -> (Vec<Vec<u8>>, bool) {
    let mut r = FrameReader::new(MAX_REQUEST_BYTES);
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
    assert_eq!(frames(data, data.len().max(1)), frames(data, split));
});
