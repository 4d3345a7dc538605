//! Requests and replies on the client's blocking socket, over the protocol crate's one
//! frame codec ([`packd_proto::frame`], [`packd_proto::stream`]).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Instant;

use packd_proto::frame::{self, FrameReader, MAX_FRAME_FDS, MAX_REPLY_BYTES};
use packd_proto::stream::{self, Receiver, RecvError};
use packd_proto::v1::{Reply, Request};
use prost::Message;

use crate::error::{Error, ProtocolError};

/// Sends one request frame, with `fd` attached to its first byte.
pub fn send(stream: &UnixStream, req: &Request, fd: Option<BorrowedFd<'_>>) -> Result<(), Error> {
    let bytes = frame::encode(req).map_err(ProtocolError::Request)?;
    stream::send_frame(stream.as_fd(), &bytes, fd).map_err(Error::Io)
}

/// Sends one small request frame in one write that does not wait; `Err` if the socket
/// could not take all of it at once (then part of it may be sent: the stream must be
/// given up).
pub fn try_send(stream: &UnixStream, req: &Request) -> Result<(), Error> {
    let bytes = frame::encode(req).map_err(ProtocolError::Request)?;
    match packd_proto::sys::send_with_fds(stream.as_fd(), &bytes, &[], true) {
        Ok(n) if n == bytes.len() => Ok(()),
        Ok(n) => Err(ProtocolError::ShortWrite { sent: n, len: bytes.len() }.into()),
        Err(e) => Err(Error::Io(e)),
    }
}

/// A receiver of reply frames: at most [`MAX_REPLY_BYTES`], one fd each.
pub fn reply_receiver() -> Receiver {
    Receiver::new(FrameReader::new(MAX_REPLY_BYTES, MAX_FRAME_FDS))
}

/// One received reply frame.
pub struct Received {
    /// The reply.
    pub reply: Reply,
    /// The fds that came with it.
    pub fds: Vec<OwnedFd>,
    /// The kernel dropped fds meant for this reply (`MSG_CTRUNC`: this process is at its
    /// open-file limit), or the daemon sent more than one; the frame itself was read to its
    /// end, so the stream stays in sync.
    pub fds_dropped: bool,
}

/// Why no reply was received.
pub enum RecvFailure {
    /// The deadline passed; the part of the frame read so far stays in the reader.
    TimedOut,
    /// The connection is unusable.
    Broken(Error),
}

/// Receives one reply frame and the fds that came with it, within `deadline`.
pub fn recv(stream: &UnixStream, receiver: &mut Receiver, deadline: Option<Instant>) -> Result<Received, RecvFailure> {
    let frame = match receiver.recv(stream, deadline) {
        Ok(frame) => frame,
        Err(RecvError::TimedOut) => return Err(RecvFailure::TimedOut),
        Err(RecvError::Closed) => return Err(RecvFailure::Broken(Error::Disconnected)),
        Err(RecvError::TooLarge(e)) => return Err(RecvFailure::Broken(ProtocolError::ReplyTooLarge(e).into())),
        Err(RecvError::Io(e)) => return Err(RecvFailure::Broken(Error::Io(e))),
    };
    let reply = Reply::decode(frame.payload.as_slice())
        .map_err(|e| RecvFailure::Broken(ProtocolError::Undecodable(e).into()))?;
    Ok(Received { reply, fds: frame.fds, fds_dropped: frame.fds_truncated || frame.extra_fds })
}
