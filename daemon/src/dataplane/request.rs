//! Turns one decoded request into calls on the store and the pack job.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;

use packd_proto::v1::{self, ErrorCode, request};

use super::{DataPlane, Outcome};
use crate::pack::Plan;
use crate::service::{self, Failure, Track};
use crate::store::{Peer, Segment};
use packd_proto::frame::MAX_FRAME_FDS;

/// The fds that came with a request's frame.
pub struct Fds {
    /// The fds received (at most [`MAX_FRAME_FDS`]).
    pub fds: Vec<OwnedFd>,
    /// More came, and were closed.
    pub extra: bool,
    /// The kernel dropped some (`MSG_CTRUNC`: the daemon's open-file limit).
    pub truncated: bool,
}

/// Why a request's fds are refused before the request is looked at, if they are.
fn fd_refusal(body: Option<&request::Body>, fds: &Fds) -> Option<(ErrorCode, String)> {
    let takes_fd = matches!(body, Some(request::Body::Pack(_) | request::Body::Publish(_) | request::Body::Digest(_)));
    if fds.extra {
        return Some((
            ErrorCode::BadFd,
            format!("request carries more than {MAX_FRAME_FDS} fd; the extra fds were closed"),
        ));
    }
    if !takes_fd && (!fds.fds.is_empty() || fds.truncated) {
        return Some((ErrorCode::BadFd, "only pack, publish and digest requests carry an fd; it was closed".into()));
    }
    if fds.truncated {
        let why = "the request's fd was dropped by the kernel: packd is at its open-file limit; try again later";
        return Some((ErrorCode::ResourceExhausted, why.into()));
    }
    None
}

/// The operation a request body asks for, as the metrics name it.
pub fn op_name(body: Option<&request::Body>) -> &'static str {
    match body {
        None => "none",
        Some(request::Body::Pack(_)) => "pack",
        Some(request::Body::Get(_)) => "get",
        Some(request::Body::Release(_)) => "release",
        Some(request::Body::Acquire(_)) => "acquire",
        Some(request::Body::Publish(_)) => "publish",
        Some(request::Body::GiveUp(_)) => "give_up",
        Some(request::Body::PrivateReport(_) | request::Body::Report(_)) => "report",
        Some(request::Body::Digest(_)) => "digest",
        Some(request::Body::BuildProgress(_)) => "build_progress",
    }
}

/// Handles one request of connection `client`, whose peer is `peer` on socket `sock`.
pub async fn handle(
    plane: &Arc<DataPlane>,
    client: u64,
    peer: Peer,
    sock: BorrowedFd<'_>,
    req: v1::Request,
    received: Fds,
    track: Track,
) -> Outcome {
    let id = req.id;
    let uid = peer.uid;
    let err = |code, message: String| Outcome::Error { id, code, message };
    let publish = matches!(req.body, Some(request::Body::Publish(_)));
    if publish && (received.extra || received.truncated || received.fds.is_empty()) {
        // Refused below, before the publication's own checks: counted like them.
        plane.store.count_publish_refused();
    }
    if let Some((code, message)) = fd_refusal(req.body.as_ref(), &received) {
        // Closed off the runtime: a close can wait on a FUSE server for ever.
        plane.packer.source_ops.dispose_fds(uid, received.fds);
        return err(code, message);
    }
    let fds = received.fds;
    match req.body {
        None => err(
            ErrorCode::InvalidArgument,
            "request has no body (expected pack, get, release, acquire, publish, give_up, report, digest or build_progress)".into(),
        ),
        Some(request::Body::Acquire(a)) => super::publish::acquire(plane, client, uid, id, a, &track).await,
        Some(request::Body::Publish(p)) => {
            let Some(fd) = fds.into_iter().next() else {
                return err(
                    ErrorCode::BadFd,
                    "publish request carries no fd: send the sealed memfd with SCM_RIGHTS".into(),
                );
            };
            super::publish::publish(plane, peer, sock, id, p, fd, &track).await
        }
        Some(request::Body::Pack(p)) => {
            let Some(fd) = fds.into_iter().next() else {
                return err(
                    ErrorCode::BadFd,
                    "pack request carries no fd: send the open model file with SCM_RIGHTS".into(),
                );
            };
            let plan = p.plan.unwrap_or_default();
            match pack_request(plane, uid, fd, &plan, &p.label, track).await {
                Ok((seg, how)) => Outcome::Segment { id, seg, omit_entries: false, how },
                Err(failure) => err(failure.code(), failure.to_string()),
            }
        }
        Some(request::Body::Get(g)) => get(plane, uid, id, &g, &track).await,
        Some(request::Body::Digest(d)) => {
            let Some(fd) = fds.into_iter().next() else {
                return err(
                    ErrorCode::BadFd,
                    "digest request carries no fd: send the open model file with SCM_RIGHTS".into(),
                );
            };
            super::digest::file_digest(plane, client, uid, id, fd, (d.build_bytes, d.background), &track).await
        }
        Some(request::Body::BuildProgress(p)) => {
            super::publish::build_progress(plane, client, uid, &p);
            Outcome::NoReply
        }
        Some(request::Body::GiveUp(g)) => {
            super::publish::give_up(plane, client, uid, &g);
            Outcome::NoReply
        }
        Some(request::Body::PrivateReport(r)) => {
            let report = v1::WorkerReport {
                obtained: v1::Obtained::Private as i32,
                fallback: v1::Fallback::Other as i32,
                detail: r.reason,
                ..Default::default()
            };
            worker_report(plane, client, peer, report);
            Outcome::NoReply
        }
        Some(request::Body::Report(r)) => {
            worker_report(plane, client, peer, r);
            Outcome::NoReply
        }
        Some(request::Body::Release(r)) => {
            if let Err(e) = plane.store.release(client, r.segment_id, r.generation) {
                plane.store.count_error();
                if plane.request_log.allow() {
                    tracing::info!(client, error = %e, "release refused");
                }
            }
            Outcome::NoReply
        }
    }
}

/// Keeps a worker's report on its connection (bounded) and logs a private one
/// (rate-limited). Reports are untrusted display text, attributed to the peer.
fn worker_report(plane: &DataPlane, client: u64, peer: Peer, r: v1::WorkerReport) {
    use crate::store::{REPORT_DETAIL_BYTES, REPORT_NAME_BYTES, untrusted_text};
    // An empty name would show as a blank row.
    let named = |text: String| if text.is_empty() { "(unnamed)".to_string() } else { text };
    let report = crate::store::Report {
        engine: named(untrusted_text(&r.engine, REPORT_NAME_BYTES)),
        model: named(untrusted_text(&r.model, REPORT_NAME_BYTES)),
        obtained: v1::Obtained::try_from(r.obtained).unwrap_or(v1::Obtained::Unspecified),
        fallback: v1::Fallback::try_from(r.fallback).unwrap_or(v1::Fallback::Other),
        detail: untrusted_text(&r.detail, REPORT_DETAIL_BYTES),
        private_bytes: r.private_bytes,
        shared_bytes: r.shared_bytes,
        at: std::time::SystemTime::now(),
    };
    let private = report.is_private();
    let (engine, model, fallback, detail) =
        (report.engine.clone(), report.model.clone(), report.fallback, report.detail.clone());
    let kept = plane.store.report(client, report);
    if private && plane.request_log.allow() {
        tracing::info!(
            client,
            pid = peer.pid.unwrap_or(0),
            uid = peer.uid,
            // Debug-quoted: a client's text cannot pose as further fields of the line.
            engine = ?engine,
            model = ?model,
            reason = crate::store::fallback_name(fallback),
            detail = ?detail,
            bytes = r.private_bytes,
            kept = ?kept,
            "a worker holds a model's weights privately"
        );
    }
}

/// Handles a get: the segment holding the key, once packed (waiting for its pack job).
async fn get(plane: &DataPlane, uid: u32, id: u64, g: &v1::GetRequest, track: &Track) -> Outcome {
    let not_found = || Outcome::Error {
        id,
        code: ErrorCode::NotFound,
        message: format!("no segment or entry with key {:?}", shorten(&g.key)),
    };
    // Parsed once, here: text of neither form cannot be any segment's or entry's key.
    let Some(key) = crate::key::Key::parse(&g.key) else { return not_found() };
    let visible = |seg: &crate::store::Segment| seg.visible_to(uid, &plane.trusted_publishers);
    let Some(resolved) = service::get(&plane.store, &key, visible, track).await else { return not_found() };
    match resolved {
        // A published segment is served only to whom it is visible; to anyone else it
        // does not exist.
        Ok(seg) if !seg.visible_to(uid, &plane.trusted_publishers) => not_found(),
        Ok(seg) => {
            let known = g.known_segment_id == seg.id && g.known_generation == plane.store.generation();
            Outcome::Segment { id, seg, omit_entries: known, how: v1::PackOutcome::Unspecified }
        }
        Err(failure) => Outcome::Error { id, code: failure.code(), message: failure.to_string() },
    }
}

async fn pack_request(
    plane: &Arc<DataPlane>,
    uid: u32,
    fd: OwnedFd,
    plan: &v1::Plan,
    label: &str,
    track: Track,
) -> Result<(Arc<Segment>, v1::PackOutcome), Failure> {
    let plan = match Plan::new(&plan.rules, &plan.layout) {
        Ok(plan) => plan,
        Err(e) => {
            plane.packer.source_ops.dispose(uid, fd);
            return Err(e.into());
        }
    };
    let source = service::open_source(&plane.packer, uid, fd).await?;
    let who = service::Requester { uid, cancellable: true, label: crate::store::label(label), track };
    service::pack_source(&plane.packer, who, source, plan).await
}

/// Characters of a client-supplied string an error message echoes: a key is named, a
/// 64 KiB one is not sent back.
const ECHOED_CHARS: usize = 200;

/// At most the first [`ECHOED_CHARS`] characters of a client-supplied string.
fn shorten(s: &str) -> String {
    if s.chars().count() <= ECHOED_CHARS {
        s.to_string()
    } else {
        format!("{}…", s.chars().take(ECHOED_CHARS).collect::<String>())
    }
}
