//! Blocking frame I/O on a Unix stream socket, for clients and tests: one frame out (with
//! its fd on the first byte), one frame in (read with a [`FrameReader`], within a deadline).
//! The daemon's asynchronous connection uses the same [`FrameReader`] and encoders.

use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use crate::frame::{Frame, FrameReader, FrameTooLarge};
use crate::sys::{recv_with_at_most, send_with_fds, wait_readable};

/// Sends the frame `bytes` (already encoded), with `fd` attached to its first byte. A
/// partial write's rest goes without the fd; interrupted writes are retried.
pub fn send_frame(sock: BorrowedFd<'_>, bytes: &[u8], fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
    let mut sent = 0;
    while sent < bytes.len() {
        let fds: Vec<BorrowedFd<'_>> = if sent == 0 { fd.into_iter().collect() } else { Vec::new() };
        match send_with_fds(sock, &bytes[sent..], &fds, false) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Why no frame was read.
#[derive(Debug, thiserror::Error)]
pub enum RecvError {
    /// The peer closed the connection (at a frame boundary or within a frame).
    #[error("the peer closed the connection")]
    Closed,
    /// The deadline passed first; what was read of the frame stays in the reader.
    #[error("no complete frame before the deadline")]
    TimedOut,
    /// The header announced more than the reader accepts.
    #[error(transparent)]
    TooLarge(#[from] FrameTooLarge),
    /// The socket failed.
    #[error(transparent)]
    Io(io::Error),
}

/// Longest receive timeout set on the socket while a deadline is far: a read wakes at least
/// this often to look at the deadline, and the same timeout serves every read until the
/// deadline is nearer than this, so a read costs no `setsockopt`.
const TIMEOUT_SLICE: Duration = Duration::from_secs(1);

/// Reads frames from one blocking socket: a [`FrameReader`], and the receive timeout
/// (`SO_RCVTIMEO`) last set on the socket, so that it is set again only when it must change.
pub struct Receiver {
    reader: FrameReader,
    /// `None`: not known (never set by this receiver); `Some(None)`: no timeout.
    timeout: Option<Option<Duration>>,
}

impl Receiver {
    /// A receiver reading with `reader` (the socket's timeout is set on the first read).
    pub fn new(reader: FrameReader) -> Self {
        Self { reader, timeout: None }
    }

    /// The frame reader (what is buffered of a frame in progress).
    pub fn reader(&self) -> &FrameReader {
        &self.reader
    }

    /// Reads one frame, blocking until it is complete, the peer closes, or `deadline`
    /// passes (`None`: no deadline). Reads never span frames, so fds are attributed to the
    /// frame whose bytes carried them; truncated control data is recorded in the frame,
    /// never a reason to stop reading it (the stream stays in sync). What was read of a
    /// frame when the deadline passes stays for the next call.
    pub fn recv(&mut self, stream: &UnixStream, deadline: Option<Instant>) -> Result<Frame, RecvError> {
        loop {
            let timeout = match deadline {
                None => None,
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(RecvError::TimedOut);
                    }
                    Some(left.min(TIMEOUT_SLICE))
                }
            };
            // A new frame is waited for with `poll`: a blocking read would also wake each
            // time the peer consumes what we sent (see `wait_readable`).
            if self.reader.buffered() == 0 && !wait_readable(stream.as_fd(), timeout).map_err(RecvError::Io)? {
                continue;
            }
            if self.timeout != Some(timeout) {
                stream.set_read_timeout(timeout).map_err(RecvError::Io)?;
                self.timeout = Some(timeout);
            }
            if let Some(frame) = read_once(stream, &mut self.reader)? {
                return Ok(frame);
            }
        }
    }
}

/// Reads one frame into `reader` with no deadline (for tests and tools; clients use a
/// [`Receiver`]).
pub fn recv_frame(stream: &UnixStream, reader: &mut FrameReader) -> Result<Frame, RecvError> {
    stream.set_read_timeout(None).map_err(RecvError::Io)?;
    loop {
        if let Some(frame) = read_once(stream, reader)? {
            return Ok(frame);
        }
    }
}

/// One read of what the reader wants (blocking, within the socket's receive timeout);
/// the frame if it is now complete. A timeout or an interruption reads nothing.
fn read_once(stream: &UnixStream, reader: &mut FrameReader) -> Result<Option<Frame>, RecvError> {
    // Room for one fd more than the reader keeps, so that extra fds are seen (and closed).
    let room = reader.max_fds() + 1;
    let got = match recv_with_at_most(stream.as_fd(), reader.buf(), room, false) {
        Ok(got) => got,
        Err(e) if e.kind() == io::ErrorKind::Interrupted => return Ok(None),
        Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => return Ok(None),
        Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return Err(RecvError::Closed),
        Err(e) => return Err(RecvError::Io(e)),
    };
    if got.bytes == 0 {
        return Err(RecvError::Closed);
    }
    Ok(reader.advance(got.bytes, got.fds, got.truncated)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{self, MAX_FRAME_FDS};
    use std::time::Duration;

    #[test]
    fn frames_and_fds_cross_a_socket_and_a_silent_peer_times_out() {
        let (a, b) = UnixStream::pair().unwrap();
        let file = std::fs::File::open("/dev/null").unwrap();
        send_frame(a.as_fd(), &frame::encode_payload(b"hello").unwrap(), Some(file.as_fd())).unwrap();
        send_frame(a.as_fd(), &frame::encode_payload(b"").unwrap(), None).unwrap();
        let mut r = Receiver::new(FrameReader::new(16, MAX_FRAME_FDS));
        let f = r.recv(&b, None).unwrap();
        assert_eq!((f.payload.as_slice(), f.fds.len()), (&b"hello"[..], 1));
        let f = r.recv(&b, Some(Instant::now() + Duration::from_secs(5))).unwrap();
        assert_eq!((f.payload.len(), f.fds.len()), (0, 0));
        // Half a header, then silence: the deadline ends the wait and the half stays.
        send_with_fds(a.as_fd(), &[3, 0], &[], false).unwrap();
        let e = r.recv(&b, Some(Instant::now() + Duration::from_millis(50))).unwrap_err();
        assert!(matches!(e, RecvError::TimedOut), "{e:?}");
        assert_eq!(r.reader().buffered(), 2);
        // A deadline longer than a slice: the read wakes each slice, and still returns
        // (at the deadline, not before) when nothing comes.
        let started = Instant::now();
        let e = r.recv(&b, Some(started + TIMEOUT_SLICE + Duration::from_millis(100))).unwrap_err();
        assert!(matches!(e, RecvError::TimedOut) && started.elapsed() >= TIMEOUT_SLICE, "{e:?}");
        send_with_fds(a.as_fd(), &[0, 0, b'a', b'b', b'c'], &[], false).unwrap();
        assert_eq!(r.recv(&b, None).unwrap().payload, b"abc");
        // Too large, then closed.
        send_frame(a.as_fd(), &frame::encode_payload(&[0; 17]).unwrap(), None).unwrap();
        assert!(matches!(r.recv(&b, None), Err(RecvError::TooLarge(_))));
        // A peer that closes, at a frame boundary and within a frame.
        let (a, b) = UnixStream::pair().unwrap();
        drop(a);
        let mut r = FrameReader::new(16, MAX_FRAME_FDS);
        assert!(matches!(recv_frame(&b, &mut r), Err(RecvError::Closed)));
        let (a, b) = UnixStream::pair().unwrap();
        send_with_fds(a.as_fd(), &[9, 0, 0, 0, 1], &[], false).unwrap();
        drop(a);
        assert!(matches!(recv_frame(&b, &mut r), Err(RecvError::Closed)));
    }
}
