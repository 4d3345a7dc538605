//! Blocking framing on the client side: `u32` little-endian length + protobuf.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use packd_proto::v1::{Reply, Request};
use prost::Message;

use crate::Error;
use crate::sys::{recv_with_fds, send_with_fds};

/// Largest reply the client accepts (a segment table of a very large model fits easily).
pub const MAX_REPLY_BYTES: usize = 64 << 20;

/// Sends one request frame, with `fd` attached to its first byte.
pub fn send(stream: &UnixStream, req: &Request, fd: Option<BorrowedFd<'_>>) -> Result<(), Error> {
    let payload = req.encode_to_vec();
    let len = u32::try_from(payload.len()).map_err(|_| Error::Protocol("request too large".into()))?;
    let mut bytes = Vec::with_capacity(4 + payload.len());
    bytes.extend_from_slice(&len.to_le_bytes());
    bytes.extend_from_slice(&payload);
    let mut sent = 0;
    while sent < bytes.len() {
        let fds: Vec<BorrowedFd<'_>> = if sent == 0 { fd.into_iter().collect() } else { Vec::new() };
        match send_with_fds(stream.as_fd(), &bytes[sent..], &fds, false) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::Io(e)),
        }
    }
    Ok(())
}

/// Fills `buf`, collecting fds; records (rather than stops at) truncated control data, so
/// the frame is always read to its end and the stream stays in sync.
fn recv_exact(stream: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>, truncated: &mut bool) -> Result<(), Error> {
    let mut got = 0;
    while got < buf.len() {
        match recv_with_fds(stream.as_fd(), &mut buf[got..], false) {
            Ok(r) if r.bytes == 0 => return Err(Error::Disconnected),
            Ok(r) => {
                *truncated |= r.truncated;
                fds.extend(r.fds);
                got += r.bytes;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::Io(e)),
        }
    }
    Ok(())
}

/// One received reply frame.
pub struct Received {
    /// The reply.
    pub reply: Reply,
    /// The fds that came with it.
    pub fds: Vec<OwnedFd>,
    /// The kernel dropped fds meant for this reply (`MSG_CTRUNC`: this process is at its
    /// open-file limit); the frame itself was read to its end.
    pub fds_dropped: bool,
}

/// Receives one reply frame and the fds that came with it.
pub fn recv(stream: &UnixStream) -> Result<Received, Error> {
    let mut fds = Vec::new();
    let mut truncated = false;
    let mut header = [0u8; 4];
    recv_exact(stream, &mut header, &mut fds, &mut truncated)?;
    let len = u32::from_le_bytes(header) as usize;
    if len > MAX_REPLY_BYTES {
        return Err(Error::Protocol(format!("reply of {len} bytes exceeds the limit of {MAX_REPLY_BYTES}")));
    }
    let mut body = vec![0u8; len];
    recv_exact(stream, &mut body, &mut fds, &mut truncated)?;
    let reply = Reply::decode(body.as_slice()).map_err(|e| Error::Protocol(format!("undecodable reply: {e}")))?;
    Ok(Received { reply, fds, fds_dropped: truncated })
}
