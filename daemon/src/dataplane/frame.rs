//! Data-plane framing: `u32` little-endian length, then that many bytes of protobuf.
//!
//! Pure logic over bytes (no I/O), so it can be fuzzed. The reader asks for exactly the
//! bytes that finish the current header or body ([`FrameReader::wanted`]), so no read ever
//! spans two frames and handling a frame costs O(frame), never O(buffered bytes).
//!
//! fds: on a stream socket the kernel hands a `sendmsg`'s fds to the `recvmsg` that reads
//! its first byte. Since reads never span frames, **fds belong to the frame that contains
//! the first byte of the `sendmsg` that carried them**. A frame may carry at most
//! [`MAX_FRAME_FDS`] fd; any further fd is closed the moment it arrives and the frame is
//! marked, so a frame in progress pins at most one fd.

use std::os::fd::OwnedFd;

/// Length of the frame header.
pub const HEADER_LEN: usize = 4;
/// Largest request payload the protocol allows; `limits.max_request_bytes` may lower it.
pub const MAX_REQUEST_BYTES: usize = crate::limits::REQUEST_BYTES_CEILING;
/// fds one request may carry (a pack's source file).
pub const MAX_FRAME_FDS: usize = 1;

/// A complete frame.
#[derive(Debug)]
pub struct Frame {
    /// The protobuf payload.
    pub payload: Vec<u8>,
    /// fds that arrived with this frame (at most [`MAX_FRAME_FDS`]).
    pub fds: Vec<OwnedFd>,
    /// More than [`MAX_FRAME_FDS`] fds arrived with this frame; the rest were closed.
    pub extra_fds: bool,
    /// The kernel dropped fds meant for this frame (`MSG_CTRUNC`).
    pub fds_truncated: bool,
}

/// The stream cannot be framed any more; the connection must be closed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("frame of {len} bytes exceeds the limit of {max} bytes (limits.max_request_bytes)")]
pub struct FrameTooLarge {
    /// Length announced by the header.
    pub len: usize,
    /// The limit.
    pub max: usize,
}

/// Reassembles one frame at a time from exact reads.
pub struct FrameReader {
    header: [u8; HEADER_LEN],
    have_header: usize,
    /// Payload length announced by the complete header.
    body_len: usize,
    /// The payload buffer, allocated only when the first payload byte is read (the
    /// connection reads a payload only once all of it is queued), so a half-sent frame
    /// costs the daemon no buffer.
    body: Vec<u8>,
    have_body: usize,
    fds: Vec<OwnedFd>,
    extra_fds: bool,
    truncated: bool,
    max: usize,
}

impl FrameReader {
    /// A reader accepting payloads of at most `max` bytes.
    pub fn new(max: usize) -> Self {
        Self {
            header: [0; HEADER_LEN],
            have_header: 0,
            body_len: 0,
            body: Vec::new(),
            have_body: 0,
            fds: Vec::new(),
            extra_fds: false,
            truncated: false,
            max,
        }
    }

    /// Whether some bytes of a frame arrived and the rest did not yet.
    pub fn in_frame(&self) -> bool {
        self.have_header > 0
    }

    /// Whether the header is complete, so the rest of the frame has a known size.
    pub fn in_body(&self) -> bool {
        self.have_header == HEADER_LEN
    }

    /// Bytes the next read must ask for: the rest of the header, else the rest of the body.
    pub fn wanted(&self) -> usize {
        if self.in_body() { self.body_len - self.have_body } else { HEADER_LEN - self.have_header }
    }

    /// The buffer the next read fills; exactly [`FrameReader::wanted`] bytes long.
    pub fn buf(&mut self) -> &mut [u8] {
        if !self.in_body() {
            return &mut self.header[self.have_header..];
        }
        if self.body.len() != self.body_len {
            self.body = vec![0; self.body_len];
        }
        &mut self.body[self.have_body..]
    }

    /// Bytes held for the frame in progress.
    pub fn buffered(&self) -> usize {
        self.have_header + self.have_body
    }

    /// Records that the last read put `n` bytes (at most [`FrameReader::wanted`]) into
    /// [`FrameReader::buf`], with `fds`; returns the frame if it is now complete.
    pub fn advance(&mut self, n: usize, fds: Vec<OwnedFd>, truncated: bool) -> Result<Option<Frame>, FrameTooLarge> {
        let n = n.min(self.wanted());
        for fd in fds {
            if self.fds.len() < MAX_FRAME_FDS {
                self.fds.push(fd);
            } else {
                self.extra_fds = true; // dropped here: closed at once
            }
        }
        self.truncated |= truncated;
        if self.in_body() {
            self.have_body += n;
        } else {
            self.have_header += n;
            if self.in_body() {
                let len = u32::from_le_bytes(self.header) as usize;
                if len > self.max {
                    return Err(FrameTooLarge { len, max: self.max });
                }
                self.body_len = len;
                self.body = Vec::new();
                self.have_body = 0;
            }
        }
        if !self.in_body() || self.have_body < self.body_len {
            return Ok(None);
        }
        let frame = Frame {
            payload: std::mem::take(&mut self.body),
            fds: std::mem::take(&mut self.fds),
            extra_fds: std::mem::take(&mut self.extra_fds),
            fds_truncated: std::mem::take(&mut self.truncated),
        };
        self.have_header = 0;
        self.have_body = 0;
        self.body_len = 0;
        Ok(Some(frame))
    }

    /// Feeds `bytes` as a peer would deliver them, in reads of at most `chunk` bytes, and
    /// returns the frames they complete (for tests and fuzzing: no fds).
    pub fn feed(&mut self, mut bytes: &[u8], chunk: usize) -> Result<Vec<Vec<u8>>, FrameTooLarge> {
        let mut out = Vec::new();
        while !bytes.is_empty() {
            let n = self.wanted().min(chunk.max(1)).min(bytes.len());
            self.buf()[..n].copy_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
            if let Some(f) = self.advance(n, Vec::new(), false)? {
                out.push(f.payload);
            }
        }
        Ok(out)
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

    /// Reads `bytes` into `r` with one read per call, as the connection does.
    fn read(r: &mut FrameReader, bytes: &[u8], fds: Vec<OwnedFd>) -> Option<Frame> {
        assert!(bytes.len() <= r.wanted(), "a read never asks past the current frame part");
        r.buf()[..bytes.len()].copy_from_slice(bytes);
        r.advance(bytes.len(), fds, false).unwrap()
    }

    #[test]
    fn splits_frames_and_assigns_fds() {
        let mut r = FrameReader::new(100);
        assert_eq!((r.wanted(), r.in_frame()), (4, false));
        let a = encode(b"one");
        assert!(read(&mut r, &a[..2], vec![]).is_none());
        assert!(r.in_frame() && !r.in_body());
        assert!(read(&mut r, &a[2..4], vec![]).is_none());
        assert_eq!(r.wanted(), 3);
        assert_eq!(r.body.capacity(), 0, "no payload buffer before the payload is read");
        let f = read(&mut r, &a[4..], vec![]).unwrap();
        assert_eq!((f.payload.as_slice(), f.fds.len()), (&b"one"[..], 0));
        // An empty frame completes with its header.
        let f = read(&mut r, &encode(b"")[..], vec![]).unwrap();
        assert_eq!(f.payload.len(), 0);
        // The fd arrives with the header; the frame keeps it.
        let b = encode(b"three");
        assert!(read(&mut r, &b[..4], vec![fd()]).is_none());
        let f = read(&mut r, &b[4..], vec![]).unwrap();
        assert_eq!((f.payload.as_slice(), f.fds.len(), f.extra_fds), (&b"three"[..], 1, false));
        assert_eq!(r.buffered(), 0);
    }

    #[test]
    fn a_frame_pins_at_most_one_fd() {
        let mut r = FrameReader::new(100);
        let f = encode(b"0123456789");
        assert!(read(&mut r, &f[..4], vec![fd(), fd()]).is_none());
        assert!(read(&mut r, &f[4..6], vec![fd(), fd()]).is_none());
        assert_eq!(r.fds.len(), 1, "extra fds are closed as they arrive");
        let frame = read(&mut r, &f[6..], vec![]).unwrap();
        assert_eq!((frame.fds.len(), frame.extra_fds), (1, true));
        // The next frame starts clean.
        let frame = read(&mut r, &encode(b"")[..], vec![]).unwrap();
        assert_eq!((frame.fds.len(), frame.extra_fds, frame.fds_truncated), (0, false, false));
    }

    #[test]
    fn refuses_oversized_from_the_header_alone() {
        let mut r = FrameReader::new(10);
        r.buf().copy_from_slice(&11u32.to_le_bytes());
        assert_eq!(r.advance(4, vec![], false).unwrap_err(), FrameTooLarge { len: 11, max: 10 });
        let mut r = FrameReader::new(10);
        r.buf().copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(r.advance(4, vec![], false).is_err(), "no 4 GiB buffer is allocated");
    }
}

#[cfg(test)]
mod robustness {
    use super::*;
    use proptest::prelude::*;

    fn frames(data: &[u8], split: usize) -> (Vec<Vec<u8>>, bool) {
        let mut r = FrameReader::new(64);
        // Feed piecewise so frames completed before an error are kept.
        let mut out = Vec::new();
        for c in data.chunks(split) {
            match r.feed(c, split) {
                Ok(f) => out.extend(f),
                Err(_) => return (out, true),
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
