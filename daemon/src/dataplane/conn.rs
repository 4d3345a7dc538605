//! One client connection: read frames, answer requests, keep the connection's leases.

use std::io;
use std::os::fd::AsFd;
use std::sync::Arc;

use packd_proto::sys::{recv_with_fds, send_with_fds};
use packd_proto::v1::{self, ErrorCode, Reply, reply};
use prost::Message;
use prost::encoding::WireType;
use tokio::io::Interest;
use tokio::net::UnixStream;

use super::frame::{self, FrameReader, MAX_REQUEST_BYTES};
use super::request::{self, Outcome};
use crate::Daemon;
use crate::store::Peer;

/// Serves one connection until the peer closes it or breaks the framing.
pub async fn serve(stream: UnixStream, daemon: Arc<Daemon>) {
    let peer = stream.peer_cred().map(|c| Peer { pid: c.pid(), uid: c.uid(), gid: c.gid() }).unwrap_or(Peer {
        pid: None,
        uid: u32::MAX,
        gid: u32::MAX,
    });
    let client = daemon.store.connect(peer);
    tracing::debug!(client, pid = ?peer.pid, uid = peer.uid, gid = peer.gid, "client connected");
    if let Err(e) = run(&stream, &daemon, client).await {
        tracing::debug!(client, error = %e, "connection ended with an error");
    }
    daemon.store.disconnect(client);
    tracing::debug!(client, "client disconnected");
}

async fn run(stream: &UnixStream, daemon: &Arc<Daemon>, client: u64) -> io::Result<()> {
    let mut reader = FrameReader::new(MAX_REQUEST_BYTES);
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        stream.readable().await?;
        let got = match stream.try_io(Interest::READABLE, || recv_with_fds(stream.as_fd(), &mut buf, true)) {
            Ok(got) => got,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        };
        if got.bytes == 0 {
            return Ok(());
        }
        reader.push(&buf[..got.bytes], got.fds, got.truncated);
        loop {
            let frame = match reader.next_frame() {
                Ok(Some(frame)) => frame,
                Ok(None) => break,
                Err(too_large) => {
                    daemon.store.count_error();
                    let reply = error_reply(0, ErrorCode::FrameTooLarge, too_large.to_string());
                    send_reply(stream, &reply, None).await?;
                    return Ok(());
                }
            };
            let req = match v1::Request::decode(frame.payload.as_slice()) {
                Ok(req) => req,
                Err(e) => {
                    daemon.store.count_error();
                    let reply =
                        error_reply(0, ErrorCode::MalformedFrame, format!("frame is not a packd.v1.Request: {e}"));
                    send_reply(stream, &reply, None).await?;
                    continue;
                }
            };
            match request::handle(daemon, client, req, frame.fds, frame.fds_truncated).await {
                Outcome::Segment(id, seg, omit) => {
                    // The frame of Reply { id = 1, segment = 2 } around the segment's cached
                    // encoding, written once into one buffer.
                    let segment = request::encoded_segment(daemon, &seg, omit);
                    let mut frame = vec![0u8; frame::HEADER_LEN];
                    frame.reserve(segment.len() + 24);
                    prost::encoding::encode_key(1, WireType::Varint, &mut frame);
                    prost::encoding::encode_varint(id, &mut frame);
                    prost::encoding::encode_key(2, WireType::LengthDelimited, &mut frame);
                    prost::encoding::encode_varint(segment.len() as u64, &mut frame);
                    frame.extend_from_slice(segment);
                    let body_len = u32::try_from(frame.len() - frame::HEADER_LEN).unwrap_or(u32::MAX);
                    frame[..frame::HEADER_LEN].copy_from_slice(&body_len.to_le_bytes());
                    // Lease first: the client may map and release before we return.
                    daemon.store.lease(client, &seg);
                    send_frame(stream, &frame, Some(&seg.file)).await?;
                }
                Outcome::Error(id, code, message) => {
                    daemon.store.count_error();
                    tracing::info!(client, code = code.as_str_name(), %message, "request failed");
                    send_reply(stream, &error_reply(id, code, message), None).await?;
                }
                Outcome::NoReply => {}
            }
        }
    }
}

fn error_reply(id: u64, code: ErrorCode, message: String) -> Reply {
    Reply { id, body: Some(reply::Body::Error(v1::Error { code: code.into(), message })) }
}

/// Sends one reply frame; `fd` travels with its first byte.
async fn send_reply(stream: &UnixStream, reply: &Reply, fd: Option<&std::fs::File>) -> io::Result<()> {
    send_frame(stream, &frame::encode(&reply.encode_to_vec()), fd).await
}

/// Sends framed bytes; `fd` travels with the first byte.
async fn send_frame(stream: &UnixStream, bytes: &[u8], fd: Option<&std::fs::File>) -> io::Result<()> {
    let mut sent = 0;
    while sent < bytes.len() {
        stream.writable().await?;
        let fds: Vec<_> = if sent == 0 { fd.map(|f| f.as_fd()).into_iter().collect() } else { Vec::new() };
        match stream.try_io(Interest::WRITABLE, || send_with_fds(stream.as_fd(), &bytes[sent..], &fds, true)) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
