//! Data-plane framing: `u32` little-endian length, then that many bytes of protobuf.
//!
//! Pure logic over bytes (no I/O), so it can be fuzzed. A `recvmsg` on a Unix stream socket
//! may return bytes of several `sendmsg` calls, but it ends with the first one that carried
//! fds (the kernel stops reading there), so fds belong to the frame that contains the *last*
//! byte of the read that delivered them. fds that belong to no complete frame are closed
//! when the reader is dropped.

use std::collections::VecDeque;
use std::os::fd::OwnedFd;

/// Length of the frame header.
pub const HEADER_LEN: usize = 4;
/// Largest request payload the daemon accepts.
pub const MAX_REQUEST_BYTES: usize = 1 << 20;

/// A complete frame.
#[derive(Debug)]
pub struct Frame {
    /// The protobuf payload.
    pub payload: Vec<u8>,
    /// fds that arrived with this frame.
    pub fds: Vec<OwnedFd>,
    /// The kernel dropped some fds meant for this frame (`MSG_CTRUNC`).
    pub fds_truncated: bool,
}

/// The stream cannot be framed any more; the connection must be closed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("frame of {len} bytes exceeds the limit of {max} bytes")]
pub struct FrameTooLarge {
    /// Length announced by the header.
    pub len: usize,
    /// The limit.
    pub max: usize,
}

/// Reassembles frames and their fds from stream reads.
pub struct FrameReader {
    buf: Vec<u8>,
    /// Stream offset of `buf[0]`.
    base: u64,
    fds: VecDeque<(u64, Vec<OwnedFd>, bool)>,
    max: usize,
}

impl FrameReader {
    /// A reader accepting payloads of at most `max` bytes.
    pub fn new(max: usize) -> Self {
        Self { buf: Vec::new(), base: 0, fds: VecDeque::new(), max }
    }

    /// Appends bytes read by one `recvmsg`, with the fds that came with them.
    pub fn push(&mut self, bytes: &[u8], fds: Vec<OwnedFd>, truncated: bool) {
        if !fds.is_empty() || truncated {
            let last = self.base + (self.buf.len() + bytes.len()).saturating_sub(1) as u64;
            self.fds.push_back((last, fds, truncated));
        }
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes buffered but not yet part of a returned frame.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Returns the next complete frame, if any.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameTooLarge> {
        if self.buf.len() < HEADER_LEN {
            return Ok(None);
        }
        let len = u32::from_le_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]) as usize;
        if len > self.max {
            return Err(FrameTooLarge { len, max: self.max });
        }
        let total = HEADER_LEN + len;
        if self.buf.len() < total {
            return Ok(None);
        }
        let payload = self.buf[HEADER_LEN..total].to_vec();
        self.buf.drain(..total);
        let end = self.base + total as u64;
        self.base = end;
        let mut fds = Vec::new();
        let mut fds_truncated = false;
        while self.fds.front().is_some_and(|(off, _, _)| *off < end) {
            if let Some((_, f, t)) = self.fds.pop_front() {
                fds.extend(f);
                fds_truncated |= t;
            }
        }
        Ok(Some(Frame { payload, fds, fds_truncated }))
    }
}

/// Frames a payload: 4-byte little-endian length, then the bytes.
pub fn encode(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&u32::try_from(payload.len()).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(payload);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fd() -> OwnedFd {
        std::fs::File::open("/dev/null").unwrap().into()
    }

    #[test]
    fn splits_frames_and_assigns_fds() {
        let mut r = FrameReader::new(100);
        let mut a = encode(b"one");
        a.extend(encode(b"")); // empty frame
        r.push(&a[..2], vec![], false);
        assert!(r.next_frame().unwrap().is_none());
        r.push(&a[2..], vec![], false);
        let b = encode(b"three");
        r.push(&b, vec![fd()], false);
        let f1 = r.next_frame().unwrap().unwrap();
        assert_eq!((f1.payload.as_slice(), f1.fds.len()), (&b"one"[..], 0));
        let f2 = r.next_frame().unwrap().unwrap();
        assert_eq!((f2.payload.len(), f2.fds.len()), (0, 0));
        let f3 = r.next_frame().unwrap().unwrap();
        assert_eq!((f3.payload.as_slice(), f3.fds.len()), (&b"three"[..], 1));
        assert!(r.next_frame().unwrap().is_none());
        assert_eq!(r.buffered(), 0);
    }

    #[test]
    fn fds_go_to_the_frame_of_the_last_byte_read() {
        // A release (no fds) and a pack (with an fd) arrive in one read.
        let mut r = FrameReader::new(100);
        let mut both = encode(b"release");
        both.extend(encode(b"pack"));
        r.push(&both, vec![fd()], false);
        let release = r.next_frame().unwrap().unwrap();
        let pack = r.next_frame().unwrap().unwrap();
        assert_eq!((release.payload.as_slice(), release.fds.len()), (&b"release"[..], 0));
        assert_eq!((pack.payload.as_slice(), pack.fds.len()), (&b"pack"[..], 1));
        // The first part of a frame carried the fd; the rest came later.
        let mut r = FrameReader::new(100);
        let f = encode(b"0123456789");
        r.push(&f[..6], vec![fd()], false);
        r.push(&f[6..], vec![], false);
        assert_eq!(r.next_frame().unwrap().unwrap().fds.len(), 1);
    }

    #[test]
    fn refuses_oversized() {
        let mut r = FrameReader::new(10);
        r.push(&encode(&[0; 11]), vec![], false);
        assert_eq!(r.next_frame().unwrap_err(), FrameTooLarge { len: 11, max: 10 });
    }
}

#[cfg(test)]
mod robustness {
    use super::*;
    use proptest::prelude::*;

    fn frames(data: &[u8], split: usize) -> (Vec<Vec<u8>>, bool) {
        let mut r = FrameReader::new(64);
        let mut out = Vec::new();
        for c in data.chunks(split) {
            r.push(c, Vec::new(), false);
            loop {
                match r.next_frame() {
                    Ok(Some(f)) => out.push(f.payload),
                    Ok(None) => break,
                    Err(_) => return (out, true),
                }
            }
        }
        (out, false)
    }

    proptest! {
        /// Any byte stream, split anywhere, yields the same frames and never panics
        /// (cargo-fuzz target `frame_reader` explores further).
        #[test]
        fn splitting_does_not_change_frames(data in proptest::collection::vec(any::<u8>(), 0..400), split in 1usize..50) {
            prop_assert_eq!(frames(&data, data.len().max(1)), frames(&data, split));
        }
    }
}
