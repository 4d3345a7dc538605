//! The frame reader takes untrusted bytes in arbitrary chunks: it must never panic and
//! must yield the same frames however the stream is split.
#![no_main]

use libfuzzer_sys::fuzz_target;
use packd::dataplane::frame::{FrameReader, MAX_REQUEST_BYTES};

fn frames(chunks: &mut dyn Iterator<Item = &[u8]>) -> Vec<Vec<u8>> {
    let mut r = FrameReader::new(MAX_REQUEST_BYTES);
    let mut out = Vec::new();
    for c in chunks {
        r.push(c, Vec::new(), false);
        while let Ok(Some(f)) = r.next_frame() {
            out.push(f.payload);
        }
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let split = data.first().copied().unwrap_or(1).max(1) as usize;
    let whole = frames(&mut std::iter::once(data));
    let pieces = frames(&mut data.chunks(split));
    assert_eq!(whole, pieces);
});
