//! One client connection: read frames, answer requests, keep the connection's leases.
//!
//! A frame's body is read only once all of it is queued in the socket (`FIONREAD`), so a
//! client that stops halfway holds buffer space on its own socket, not in the daemon; it
//! has `limits.frame_timeout` to finish. Reads never span frames, so a frame costs
//! O(frame). After `limits.frames_per_turn` frames in a row a connection yields to others.
//! A connection that holds no lease and stays silent for `limits.idle_timeout` is closed.
//! Every fd a client sends is closed off the runtime ([`crate::blocking::Disposer`]), and
//! a connection of a uid whose closes hang reads no further frame until they return.

use std::io::{self, IoSlice};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use packd_proto::frame::{self, Frame, FrameReader, FrameTooLarge, MAX_FRAME_FDS, error_reply};
use packd_proto::sys::{recv_with_at_most, send_vectored_with_fds};
use packd_proto::v1::{self, ErrorCode, Reply};
use prost::Message;
use tokio::io::Interest;
use tokio::net::UnixStream;
use tokio::time::Instant;

use super::admission::{ShedReason, Slot};
use super::outcome::Outcome;
use super::{DataPlane, request};
use crate::service::Track;
use crate::store::{ClientId, Peer};
use crate::sys::socket::queued_bytes;

/// Serves one admitted connection until the peer closes it, breaks the framing or hits a
/// deadline; then drops its leases and frees its slot.
pub async fn serve(stream: UnixStream, plane: Arc<DataPlane>, peer: Peer, slot: Slot) {
    let client = plane.store.connect(peer);
    slot.set_client(client);
    tracing::debug!(client, pid = ?peer.pid, uid = peer.uid, gid = peer.gid, "client connected");
    if let Err(e) = run(&stream, &plane, client, peer, &slot).await {
        tracing::debug!(client, error = %e, "connection ended with an error");
    }
    plane.store.disconnect(client);
    if let Some(lend) = plane.packer.lends.disconnected(client) {
        plane.packer.source_ops.dispose(peer.uid, lend);
    }
    drop(slot);
    tracing::debug!(client, "client disconnected");
}

/// How reading a frame ended.
enum Read {
    Frame(Frame),
    /// The peer closed the connection (perhaps mid-frame).
    Closed,
    /// No lease held and nothing sent for `limits.idle_timeout`.
    Idle,
    /// A frame begun and not finished within `limits.frame_timeout`.
    Slow,
    TooLarge(FrameTooLarge),
    /// Shed to admit a newer connection at a connection limit.
    Shed(ShedReason),
}

async fn run(stream: &UnixStream, plane: &Arc<DataPlane>, client: ClientId, peer: Peer, slot: &Slot) -> io::Result<()> {
    let mut reader = FrameReader::new(plane.limits.max_request_bytes, MAX_FRAME_FDS);
    let result = run_frames(stream, plane, client, peer, slot, &mut reader).await;
    // fds of a frame the peer never finished: closed off the runtime, like every fd a
    // client sent (a close can wait on a FUSE server for ever).
    plane.packer.source_ops.dispose_fds(peer.uid, reader.take_fds());
    result
}

async fn run_frames(
    stream: &UnixStream,
    plane: &Arc<DataPlane>,
    client: ClientId,
    peer: Peer,
    slot: &Slot,
    reader: &mut FrameReader,
) -> io::Result<()> {
    let limits = &plane.limits;
    let mut in_a_row = 0;
    loop {
        let frame = match read_frame(stream, reader, plane, client, peer.uid, slot).await? {
            Read::Frame(frame) => frame,
            Read::Closed => return Ok(()),
            Read::Idle => {
                tracing::debug!(client, "closing an idle connection that holds no lease (limits.idle_timeout)");
                return Ok(());
            }
            Read::Slow => {
                let message = format!(
                    "frame not finished within {:?} of its first byte (limits.frame_timeout); closing the connection",
                    limits.frame_timeout
                );
                fail(plane, client, ErrorCode::MalformedFrame, &message);
                try_send_last(stream, &error_reply(0, ErrorCode::MalformedFrame, message));
                return Ok(());
            }
            Read::TooLarge(too_large) => {
                let message = format!("{too_large} (limits.max_request_bytes); closing the connection");
                fail(plane, client, ErrorCode::FrameTooLarge, &message);
                send_reply(stream, &error_reply(0, ErrorCode::FrameTooLarge, message)).await?;
                return Ok(());
            }
            Read::Shed(reason) => {
                shed(stream, client, reason);
                return Ok(());
            }
        };
        if let Err(reason) = slot.begin_request() {
            plane.packer.source_ops.dispose_fds(peer.uid, frame.fds);
            shed(stream, client, reason);
            return Ok(());
        }
        let answered = answer(stream, plane, client, peer, frame).await;
        slot.end_request();
        answered?;
        in_a_row += 1;
        if in_a_row >= limits.frames_per_turn {
            in_a_row = 0;
            tokio::task::yield_now().await;
        }
    }
}

/// Reads exactly one frame.
async fn read_frame(
    stream: &UnixStream,
    reader: &mut FrameReader,
    plane: &DataPlane,
    client: ClientId,
    uid: u32,
    slot: &Slot,
) -> io::Result<Read> {
    let limits = &plane.limits;
    let mut frame_deadline: Option<Instant> = None;
    loop {
        // A uid whose fds wait to be closed (closes that hang) is read from, and so can
        // send fds, only once they are few again; it may still be shed, or hang up.
        if !plane.packer.source_ops.room_to_dispose(uid) {
            tokio::select! {
                biased;
                reason = slot.shed() => return Ok(Read::Shed(reason)),
                () = peer_gone(stream) => return Ok(Read::Closed),
                () = plane.packer.source_ops.wait_room_to_dispose(uid) => {}
            }
        }
        // Clear readiness first: bytes arriving after this point wake the wait below, and
        // bytes already queued are found by the look that follows (edge-triggered safe).
        let _ = stream.try_io(Interest::READABLE, || Err::<(), _>(io::ErrorKind::WouldBlock.into()));
        // A body is read only once all of it is queued.
        let short = reader.in_body() && queued_bytes(stream.as_fd())? < reader.wanted();
        let got = if short {
            Err(io::ErrorKind::WouldBlock.into())
        } else {
            recv_with_at_most(stream.as_fd(), reader.buf(), MAX_FRAME_FDS + 1, true)
        };
        let got = match got {
            Ok(got) => got,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                // Only now, with nothing to read, is the deadline needed (the lease count
                // takes the store's lock: kept off the path of a busy connection).
                let deadline = match frame_deadline {
                    Some(d) => Some(d),
                    None if !plane.store.holds_anything(client) => Some(Instant::now() + limits.idle_timeout),
                    None => None,
                };
                let readable = async {
                    match deadline {
                        Some(d) => tokio::time::timeout_at(d, stream.ready(Interest::READABLE)).await,
                        None => Ok(stream.ready(Interest::READABLE).await),
                    }
                };
                // Shedding first: a connection chosen to make room goes even if bytes wait.
                let ready = tokio::select! {
                    biased;
                    reason = slot.shed() => return Ok(Read::Shed(reason)),
                    ready = readable => ready,
                };
                match ready {
                    Ok(r) => {
                        if r?.is_read_closed() && short && queued_bytes(stream.as_fd())? < reader.wanted() {
                            return Ok(Read::Closed);
                        }
                    }
                    Err(_) if frame_deadline.is_some() => return Ok(Read::Slow),
                    Err(_) => return Ok(Read::Idle),
                }
                continue;
            }
            Err(e) => return Err(e),
        };
        let mut fds = got.fds;
        if got.bytes == 0 {
            // EOF; fds that came with nothing are closed (off the runtime).
            plane.packer.source_ops.dispose_fds(uid, fds);
            return Ok(Read::Closed);
        }
        if frame_deadline.is_none() {
            frame_deadline = Some(Instant::now() + limits.frame_timeout);
        }
        let room = reader.max_fds().saturating_sub(reader.held_fds());
        if fds.len() > room {
            // More than a frame keeps: the frame is refused for it, the extras closed.
            reader.mark_extra_fds();
            plane.packer.source_ops.dispose(uid, fds.split_off(room));
        }
        match reader.advance(got.bytes, fds, got.truncated) {
            Ok(Some(frame)) => return Ok(Read::Frame(frame)),
            Ok(None) => {}
            Err(too_large) => return Ok(Read::TooLarge(too_large)),
        }
    }
}

/// Decodes and answers one frame.
async fn answer(
    stream: &UnixStream,
    plane: &Arc<DataPlane>,
    client: ClientId,
    peer: Peer,
    frame: Frame,
) -> io::Result<()> {
    let req = match v1::Request::decode(frame.payload.as_slice()) {
        Ok(req) => req,
        Err(e) => {
            plane.packer.source_ops.dispose_fds(peer.uid, frame.fds);
            let message = format!("frame is not a packd.v1.Request: {e}");
            fail(plane, client, ErrorCode::MalformedFrame, &message);
            return send_reply(stream, &error_reply(0, ErrorCode::MalformedFrame, message)).await;
        }
    };
    drop(frame.payload);
    let (id, track) = (req.id, if req.progress { Track::new_recording() } else { Track::default() });
    // A pack is acknowledged before anything else happens: its client knows at once that
    // the daemon took it, however long it then runs.
    let acknowledged = req.progress && matches!(req.body, Some(v1::request::Body::Pack(_)));
    if let Some(progress) = track.report().filter(|_| acknowledged)
        && let Err(e) = send_reply(stream, &Reply { id, body: Some(v1::reply::Body::Progress(progress)) }).await
    {
        // The client is gone: its pack's fd is closed off the runtime, like any other.
        plane.packer.source_ops.dispose_fds(peer.uid, frame.fds);
        return Err(e);
    }
    let fds = request::Fds { fds: frame.fds, extra: frame.extra_fds, truncated: frame.fds_truncated };
    let (op, started) = (request::op_name(req.body.as_ref()), Instant::now());
    let handling = request::handle(plane, client, peer, stream.as_fd(), req, fds, track.clone());
    let mut handling = std::pin::pin!(handling);
    // Most requests (a get of a packed key) are answered at once: only one that waits
    // arms the hang-up watch and the progress timer.
    let first_poll = std::future::poll_fn(|cx| std::task::Poll::Ready(handling.as_mut().poll(cx))).await;
    let outcome = match first_poll {
        std::task::Poll::Ready(outcome) => outcome,
        std::task::Poll::Pending => match wait_answer(stream, handling, id, &track, acknowledged).await? {
            Some(outcome) => outcome,
            None => return Ok(()),
        },
    };
    plane.packer.telemetry.request(op, outcome.code_name(), started.elapsed());
    match outcome {
        Outcome::Segment { id, seg, omit_entries, how } => {
            // The reply's frame around the segment's cached encoding, which is shared by
            // every reply and never copied, and this request's outcome after it.
            let segment = seg.encoded(omit_entries);
            let told = frame::segment_outcome_suffix(how);
            let prefix = match frame::segment_reply_prefix(id, segment.len() + told.len()) {
                Ok(prefix) => prefix,
                Err(e) => {
                    let message = format!("segment {}: its entry table does not fit in a reply: {e}", seg.key);
                    fail(plane, client, ErrorCode::Internal, &message);
                    return send_reply(stream, &error_reply(id, ErrorCode::Internal, message)).await;
                }
            };
            // Lease first: the client may map and release before we return.
            if let Err(e) = plane.store.lease(client, &seg) {
                let message = e.to_string();
                fail(plane, client, ErrorCode::ResourceExhausted, &message);
                return send_reply(stream, &error_reply(id, ErrorCode::ResourceExhausted, message)).await;
            }
            send_parts(stream, &[&prefix, segment, &told], Some(&seg.file)).await
        }
        Outcome::Error { id, code, message } => {
            fail(plane, client, code, &message);
            send_reply(stream, &error_reply(id, code, message)).await
        }
        Outcome::Build { id, reply, lent } => {
            let reply = Reply { id, body: Some(v1::reply::Body::Build(reply)) };
            let Some(lent) = lent else { return send_reply(stream, &reply).await };
            let bytes = frame::encode(&reply).map_err(io::Error::other)?;
            let sent = send_parts(stream, &[&bytes], Some(&lent)).await;
            // Not sent, nobody else has it: its account goes after it (not before its pages).
            let held = match &sent {
                Err(_) => crate::store::inode_of(&lent).and_then(|i| plane.packer.lends.not_sent(peer.uid, i)),
                Ok(()) => None,
            };
            // Closed off the runtime: if the builder is gone, this frees its pages.
            plane.packer.source_ops.dispose(peer.uid, (lent, held));
            sent
        }
        Outcome::Digest { id, reply } => {
            send_reply(stream, &Reply { id, body: Some(v1::reply::Body::Digest(reply)) }).await
        }
        Outcome::NoReply => Ok(()),
    }
}

/// How often a request that asked for progress hears of it while it runs: the client's
/// deadline bounds silence, so this must stay well below any sensible deadline.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// Waits for a pending request's answer: `None` if the peer hung up first. Progress frames,
/// for a request that asked: the first at once (unless the request was acknowledged
/// already), then one every [`PROGRESS_EVERY`].
///
/// A client that hangs up while its request waits (a pack job, a hash) drops the request:
/// a pack job nobody else waits for is cancelled. The request is polled first, so one that
/// completes still takes effect when the peer has hung up right after sending it (a give-up
/// sent just before exiting must end the role as a give-up, not as an abandoned build whose
/// waiters then build again).
async fn wait_answer(
    stream: &UnixStream,
    mut handling: std::pin::Pin<&mut impl std::future::Future<Output = Outcome>>,
    id: u64,
    track: &Track,
    acknowledged: bool,
) -> io::Result<Option<Outcome>> {
    let first = tokio::time::Instant::now() + if acknowledged { PROGRESS_EVERY } else { Duration::ZERO };
    let mut ticks = tokio::time::interval_at(first, PROGRESS_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            outcome = &mut handling => return Ok(Some(outcome)),
            () = peer_gone(stream) => return Ok(None),
            _ = ticks.tick(), if track.recording() => {
                if let Some(progress) = track.report() {
                    // A client that asked for progress and does not read it fills only its
                    // own socket: this write then waits, its request with it.
                    send_reply(stream, &Reply { id, body: Some(v1::reply::Body::Progress(progress)) }).await?;
                }
            }
        }
    }
}

/// Resolves when the peer has closed its end (read side closed). Pipelined bytes from a
/// live peer are left for the next read: then this waits forever.
async fn peer_gone(stream: &UnixStream) {
    match stream.ready(Interest::READABLE).await {
        Ok(r) if !r.is_read_closed() => std::future::pending().await,
        _ => {}
    }
}

/// Tells a shed connection why it is closed (without waiting: it holds nothing).
fn shed(stream: &UnixStream, client: ClientId, reason: ShedReason) {
    tracing::debug!(client, %reason, "shedding an idle connection that holds no lease");
    try_send_last(stream, &error_reply(0, ErrorCode::ResourceExhausted, reason.to_string()));
}

/// Characters of a failed request's message a log line keeps: messages may echo client
/// bytes (a key), and a log line stays one screen line or two.
const LOGGED_MESSAGE_CHARS: usize = 300;

/// Counts a failed request and logs it within the per-second log budget.
fn fail(plane: &DataPlane, client: ClientId, code: ErrorCode, message: &str) {
    plane.store.count_error();
    if plane.request_log.allow() {
        // The message may echo client bytes; keep the line short.
        let short: String = message.chars().take(LOGGED_MESSAGE_CHARS).collect();
        tracing::info!(client, code = code.as_str_name(), message = %short, "request failed");
    }
}

/// Sends one reply frame.
async fn send_reply(stream: &UnixStream, reply: &Reply) -> io::Result<()> {
    let bytes = frame::encode(reply).map_err(io::Error::other)?;
    send_parts(stream, &[&bytes], None).await
}

/// Tries once, without waiting, to send a last reply before the connection is closed.
fn try_send_last(stream: &UnixStream, reply: &Reply) {
    let Ok(bytes) = frame::encode(reply) else { return };
    let _ = stream
        .try_io(Interest::WRITABLE, || send_vectored_with_fds(stream.as_fd(), &[IoSlice::new(&bytes)], &[], true));
}

/// Sends the concatenation of `parts`; `fd` travels with the first byte.
async fn send_parts(stream: &UnixStream, parts: &[&[u8]], fd: Option<&std::fs::File>) -> io::Result<()> {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let mut sent = 0;
    while sent < total {
        stream.writable().await?;
        let fds: Vec<_> = if sent == 0 { fd.map(|f| f.as_fd()).into_iter().collect() } else { Vec::new() };
        let mut skip = sent;
        let slices: Vec<IoSlice<'_>> = parts
            .iter()
            .filter_map(|p| {
                if skip >= p.len() {
                    skip -= p.len();
                    None
                } else {
                    let s = IoSlice::new(&p[skip..]);
                    skip = 0;
                    Some(s)
                }
            })
            .collect();
        match stream.try_io(Interest::WRITABLE, || send_vectored_with_fds(stream.as_fd(), &slices, &fds, true)) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
