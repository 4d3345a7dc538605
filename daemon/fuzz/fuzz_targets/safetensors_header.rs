//! The safetensors header parser takes untrusted bytes: it must never panic, and whatever
//! it accepts must tile the file exactly.
#![no_main]

use libfuzzer_sys::fuzz_target;
use packd::source::safetensors::{header_len, parse_header};

fuzz_target!(|data: &[u8]| {
    let file_len = data.len() as u64;
    let Ok(n) = header_len(data, file_len) else { return };
    let Some(json) = data.get(8..8 + n as usize) else { return };
    if let Ok(h) = parse_header(json, file_len) {
        let mut cursor = h.data_start;
        for t in &h.tensors {
            assert_eq!(t.start, cursor);
            cursor += t.len;
        }
        assert_eq!(cursor, file_len);
    }
});
