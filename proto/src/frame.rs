//! Data-plane framing, for both ends: a `u32` little-endian length, then that many bytes of
//! protobuf (`packd.v1.Request` from clients, `packd.v1.Reply` from the daemon).
//!
//! Pure logic over bytes (no I/O), so it can be fuzzed. This is the only place that writes
//! a length prefix or a protobuf field number by hand ([`segment_reply_prefix`], tested
//! against prost's own encoding of the whole reply).
//!
//! The [`FrameReader`] asks for exactly the bytes that finish the current header or body
//! ([`FrameReader::wanted`]), so no read ever spans two frames and handling a frame costs
//! O(frame), never O(buffered bytes).
//!
//! fds: on a stream socket the kernel hands a `sendmsg`'s fds to the `recvmsg` that reads
//! its first byte. Since reads never span frames, **fds belong to the frame that contains
//! the first byte of the `sendmsg` that carried them**. A reader keeps at most the number
//! of fds it was built for; any further fd is closed the moment it arrives and the frame
//! is marked, so a frame in progress pins a bounded number of fds.

use std::os::fd::OwnedFd;

use prost::Message;
use prost::encoding::{WireType, encode_key, encode_varint};

use crate::v1::Reply;

/// Length of the frame header.
pub const HEADER_LEN: usize = 4;
/// Largest request payload the protocol allows; the daemon's `limits.max_request_bytes` may
/// lower it, never raise it.
pub const MAX_REQUEST_BYTES: usize = 1 << 20;
/// Largest reply payload a client accepts (the entry table of a very large model fits).
pub const MAX_REPLY_BYTES: usize = 64 << 20;
/// fds one request may carry (a pack's source file), and one reply (the segment).
pub const MAX_FRAME_FDS: usize = 1;

/// Field numbers of `packd.v1.Reply` that [`segment_reply_prefix`] writes by hand.
const REPLY_ID: u32 = 1;
const REPLY_SEGMENT: u32 = 2;
/// Field number of `SegmentReply.outcome`, appended by [`segment_outcome_suffix`].
const SEGMENT_OUTCOME: u32 = 12;

/// A complete frame.
#[derive(Debug)]
pub struct Frame {
    /// The protobuf payload.
    pub payload: Vec<u8>,
    /// fds that arrived with this frame (at most the reader's `max_fds`).
    pub fds: Vec<OwnedFd>,
    /// More fds than the reader keeps arrived with this frame; the rest were closed.
    pub extra_fds: bool,
    /// The kernel dropped fds meant for this frame (`MSG_CTRUNC`).
    pub fds_truncated: bool,
}

/// A frame larger than the limit: announced by a peer's header, or a payload too large to
/// announce at all. The stream cannot be framed any more.
#[derive(Debug, thiserror::Error, PartialEq, Eq, Clone, Copy)]
#[error("frame of {len} bytes exceeds the limit of {max} bytes")]
pub struct FrameTooLarge {
    /// Length announced by the header (or of the payload to send).
    pub len: usize,
    /// The limit.
    pub max: usize,
}

/// The header announcing a payload of `len` bytes; a payload the `u32` prefix cannot
/// announce is an error, never a truncated length.
pub fn header(len: usize) -> Result<[u8; HEADER_LEN], FrameTooLarge> {
    u32::try_from(len).map(u32::to_le_bytes).map_err(|_| FrameTooLarge { len, max: u32::MAX as usize })
}

/// The payload length a complete header announces.
pub fn announced(header: [u8; HEADER_LEN]) -> usize {
    u32::from_le_bytes(header) as usize
}

/// Frames raw payload bytes (a test's garbage, say): header, then the bytes.
pub fn encode_payload(payload: &[u8]) -> Result<Vec<u8>, FrameTooLarge> {
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&header(payload.len())?);
    out.extend_from_slice(payload);
    Ok(out)
}

/// Frames a message, encoded straight into the one buffer that is sent.
pub fn encode<M: Message>(msg: &M) -> Result<Vec<u8>, FrameTooLarge> {
    let len = msg.encoded_len();
    let mut out = Vec::with_capacity(HEADER_LEN + len);
    out.extend_from_slice(&header(len)?);
    // Cannot fail: the buffer grows as needed.
    msg.encode(&mut out).map_err(|_| FrameTooLarge { len, max: len })?;
    Ok(out)
}

/// The bytes that come before an already encoded `SegmentReply` of `segment_len` bytes in
/// the frame of `Reply { id, segment }`: the frame header, the id field and the segment
/// field's key and length. The daemon sends this prefix and the segment's cached encoding
/// as two slices of one `sendmsg`, so a table shared by every reply is never copied.
pub fn segment_reply_prefix(id: u64, segment_len: usize) -> Result<Vec<u8>, FrameTooLarge> {
    let mut head = Vec::with_capacity(24);
    // proto3 leaves a field at its default (id 0) out, and so does this prefix.
    if id != 0 {
        encode_key(REPLY_ID, WireType::Varint, &mut head);
        encode_varint(id, &mut head);
    }
    encode_key(REPLY_SEGMENT, WireType::LengthDelimited, &mut head);
    encode_varint(segment_len as u64, &mut head);
    let body = head.len().checked_add(segment_len).ok_or(FrameTooLarge { len: usize::MAX, max: u32::MAX as usize })?;
    let mut out = Vec::with_capacity(HEADER_LEN + head.len());
    out.extend_from_slice(&header(body)?);
    out.extend_from_slice(&head);
    Ok(out)
}

/// The bytes of `SegmentReply.outcome` to append to a segment's cached encoding (empty for
/// `Unspecified`, which proto3 leaves out). It is the message's last field, so the result
/// is what prost writes for the whole message; its length goes into
/// [`segment_reply_prefix`]'s `segment_len`.
pub fn segment_outcome_suffix(outcome: crate::v1::PackOutcome) -> Vec<u8> {
    let mut out = Vec::new();
    if outcome != crate::v1::PackOutcome::Unspecified {
        encode_key(SEGMENT_OUTCOME, WireType::Varint, &mut out);
        encode_varint(outcome as u64, &mut out);
    }
    out
}

/// An error reply frame's message, for a refusal sent on the way out.
pub fn error_reply(id: u64, code: crate::v1::ErrorCode, message: String) -> Reply {
    Reply { id, body: Some(crate::v1::reply::Body::Error(crate::v1::Error { code: code.into(), message })) }
}

/// Reassembles one frame at a time from exact reads.
pub struct FrameReader {
    header: [u8; HEADER_LEN],
    have_header: usize,
    /// Payload length announced by the complete header.
    body_len: usize,
    /// The payload buffer, allocated only when the first payload byte is read, so a
    /// half-sent frame costs the reader no buffer.
    body: Vec<u8>,
    have_body: usize,
    fds: Vec<OwnedFd>,
    extra_fds: bool,
    truncated: bool,
    max: usize,
    max_fds: usize,
}

impl FrameReader {
    /// A reader accepting payloads of at most `max` bytes and keeping at most `max_fds` fds
    /// per frame.
    pub fn new(max: usize, max_fds: usize) -> Self {
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
            max_fds,
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

    /// fds this reader keeps per frame.
    pub fn max_fds(&self) -> usize {
        self.max_fds
    }

    /// fds held for the frame in progress.
    pub fn held_fds(&self) -> usize {
        self.fds.len()
    }

    /// Records that the frame in progress came with more fds than it keeps, which its
    /// reader closed itself (the frame's `extra_fds`).
    pub fn mark_extra_fds(&mut self) {
        self.extra_fds = true;
    }

    /// Gives up the fds held for the frame in progress (a connection that ends mid-frame),
    /// for the caller to close where it chooses.
    pub fn take_fds(&mut self) -> Vec<OwnedFd> {
        std::mem::take(&mut self.fds)
    }

    /// Records that the last read put `n` bytes (at most [`FrameReader::wanted`]) into
    /// [`FrameReader::buf`], with `fds`; returns the frame if it is now complete.
    pub fn advance(&mut self, n: usize, fds: Vec<OwnedFd>, truncated: bool) -> Result<Option<Frame>, FrameTooLarge> {
        let n = n.min(self.wanted());
        for fd in fds {
            if self.fds.len() < self.max_fds {
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
                let len = announced(self.header);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{Entry, ErrorCode, Request, SegmentReply, reply, request};

    fn fd() -> OwnedFd {
        std::fs::File::open("/dev/null").unwrap().into()
    }

    fn enc(payload: &[u8]) -> Vec<u8> {
        encode_payload(payload).unwrap()
    }

    /// Reads `bytes` into `r` with one read per call, as the connection does.
    fn read(r: &mut FrameReader, bytes: &[u8], fds: Vec<OwnedFd>) -> Option<Frame> {
        assert!(bytes.len() <= r.wanted(), "a read never asks past the current frame part");
        r.buf()[..bytes.len()].copy_from_slice(bytes);
        r.advance(bytes.len(), fds, false).unwrap()
    }

    #[test]
    fn splits_frames_and_assigns_fds() {
        let mut r = FrameReader::new(100, 1);
        assert_eq!((r.wanted(), r.in_frame()), (4, false));
        let a = enc(b"one");
        assert!(read(&mut r, &a[..2], vec![]).is_none());
        assert!(r.in_frame() && !r.in_body());
        assert!(read(&mut r, &a[2..4], vec![]).is_none());
        assert_eq!(r.wanted(), 3);
        assert_eq!(r.body.capacity(), 0, "no payload buffer before the payload is read");
        let f = read(&mut r, &a[4..], vec![]).unwrap();
        assert_eq!((f.payload.as_slice(), f.fds.len()), (&b"one"[..], 0));
        // An empty frame completes with its header.
        let f = read(&mut r, &enc(b"")[..], vec![]).unwrap();
        assert_eq!(f.payload.len(), 0);
        // The fd arrives with the header; the frame keeps it.
        let b = enc(b"three");
        assert!(read(&mut r, &b[..4], vec![fd()]).is_none());
        let f = read(&mut r, &b[4..], vec![]).unwrap();
        assert_eq!((f.payload.as_slice(), f.fds.len(), f.extra_fds), (&b"three"[..], 1, false));
        assert_eq!(r.buffered(), 0);
    }

    #[test]
    fn a_frame_pins_at_most_max_fds() {
        let mut r = FrameReader::new(100, 1);
        let f = enc(b"0123456789");
        assert!(read(&mut r, &f[..4], vec![fd(), fd()]).is_none());
        assert!(read(&mut r, &f[4..6], vec![fd(), fd()]).is_none());
        assert_eq!(r.held_fds(), 1, "extra fds are closed as they arrive");
        let frame = read(&mut r, &f[6..], vec![]).unwrap();
        assert_eq!((frame.fds.len(), frame.extra_fds), (1, true));
        // The next frame starts clean.
        let frame = read(&mut r, &enc(b"")[..], vec![]).unwrap();
        assert_eq!((frame.fds.len(), frame.extra_fds, frame.fds_truncated), (0, false, false));
    }

    #[test]
    fn refuses_oversized_from_the_header_alone() {
        let mut r = FrameReader::new(10, 1);
        r.buf().copy_from_slice(&11u32.to_le_bytes());
        assert_eq!(r.advance(4, vec![], false).unwrap_err(), FrameTooLarge { len: 11, max: 10 });
        let mut r = FrameReader::new(10, 1);
        r.buf().copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(r.advance(4, vec![], false).is_err(), "no 4 GiB buffer is allocated");
    }

    #[test]
    fn a_length_the_prefix_cannot_hold_is_an_error() {
        let too_big = u32::MAX as usize + 1;
        assert_eq!(header(too_big).unwrap_err(), FrameTooLarge { len: too_big, max: u32::MAX as usize });
        assert_eq!(header(u32::MAX as usize).unwrap(), [0xff; 4]);
        assert!(segment_reply_prefix(1, too_big).is_err());
    }

    #[test]
    fn messages_round_trip_through_the_reader() {
        let req = Request {
            id: 42,
            progress: true,
            body: Some(request::Body::Get(crate::v1::GetRequest { key: "b3:ab/x".into(), ..Default::default() })),
        };
        let bytes = encode(&req).unwrap();
        assert_eq!(announced(bytes[..4].try_into().unwrap()), bytes.len() - 4);
        let mut r = FrameReader::new(MAX_REQUEST_BYTES, MAX_FRAME_FDS);
        let frames = r.feed(&bytes, 3).unwrap();
        assert_eq!(Request::decode(frames[0].as_slice()).unwrap(), req);
    }

    /// The hand-written prefix plus prost's encoding of the segment is byte for byte
    /// prost's encoding of the whole `Reply`.
    #[test]
    fn the_segment_reply_prefix_matches_prost() {
        for (id, entries) in [(0u64, 0usize), (1, 1), (300, 3), (u64::MAX, 200)] {
            let segment = SegmentReply {
                key: "b3:00/k".into(),
                size: 4096,
                entries: (0..entries)
                    .map(|i| Entry { name: format!("t{i}"), offset: 64 * i as u64, ..Default::default() })
                    .collect(),
                ..Default::default()
            };
            let seg = segment.encode_to_vec();
            let mut ours = segment_reply_prefix(id, seg.len()).unwrap();
            ours.extend_from_slice(&seg);
            let whole = encode(&Reply { id, body: Some(reply::Body::Segment(segment.clone())) }).unwrap();
            assert_eq!(ours, whole, "id {id}, {entries} entries");
            for outcome in [
                crate::v1::PackOutcome::Found,
                crate::v1::PackOutcome::Joined,
                crate::v1::PackOutcome::Packed,
                crate::v1::PackOutcome::FoundInCacheDir,
                crate::v1::PackOutcome::FoundInFdStore,
            ] {
                let suffix = segment_outcome_suffix(outcome);
                let mut ours = segment_reply_prefix(id, seg.len() + suffix.len()).unwrap();
                ours.extend_from_slice(&seg);
                ours.extend_from_slice(&suffix);
                let told = SegmentReply { outcome: outcome as i32, ..segment.clone() };
                let whole = encode(&Reply { id, body: Some(reply::Body::Segment(told)) }).unwrap();
                assert_eq!(ours, whole, "id {id}, {entries} entries, {outcome:?}");
            }
            assert!(segment_outcome_suffix(crate::v1::PackOutcome::Unspecified).is_empty());
        }
        let e = encode(&error_reply(7, ErrorCode::NotFound, "no".into())).unwrap();
        let back = Reply::decode(&e[HEADER_LEN..]).unwrap();
        assert_eq!((back.id, matches!(back.body, Some(reply::Body::Error(_)))), (7, true));
    }
}

#[cfg(test)]
mod robustness {
    use super::*;
    use proptest::prelude::*;

    fn frames(data: &[u8], split: usize) -> (Vec<Vec<u8>>, bool) {
        let mut r = FrameReader::new(64, MAX_FRAME_FDS);
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
