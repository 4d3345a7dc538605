//! The frame reader takes untrusted bytes in arbitrary chunks: it must never panic and
//! must yield the same frames however the stream is split.
#![no_main]

use libfuzzer_sys::fuzz_target;
use packd::dataplane::frame::{FrameReader, MAX_REQUEST_BYTES};

fn frames(data: &[u8], split: usize) -> (Vec<Vec<u8>>, bool) {
    let mut r = FrameReader::new(MAX_REQUEST_BYTES);
    let mut out = Vec::new();
    for c in data.chunks(split) {
        match r.feed(c, split) {
            Ok(f) => out.extend(f),
            Err(_) => return (out, true),
        }
    }
    (out, false)
}

fuzz_target!(|data: &[u8]| {
    let split = data.first().copied().unwrap_or(1).max(1) as usize;
    assert_eq!(frames(data, data.len().max(1)), frames(data, split));
});
