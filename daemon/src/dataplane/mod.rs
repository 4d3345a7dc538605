//! The data plane: `packd.sock`, framed protobuf requests, fd passing and leases.
//!
//! One task per connection; requests on a connection are answered in order. Any error on
//! one connection (bad frame, bad source, a peer that vanishes) ends at most that
//! connection and never touches another.
#![forbid(unsafe_code)]

mod admission;
mod conn;
mod digest;
mod hasher;
mod outcome;
mod plane;
pub mod publish;
pub mod request;

pub use admission::{Admission, Refusal, Slot};
pub use outcome::Outcome;
pub use plane::DataPlane;

use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;

use packd_proto::frame;
use packd_proto::v1::ErrorCode;

use crate::store::Peer;

/// First wait after a failed accept (EMFILE, ENFILE); it doubles with each failure in a row.
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
/// Longest wait between accepts that fail: pending connections wait in the backlog.
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Accepts connections on `listener` until `shutdown` turns true, admitting each within
/// `limits.max_connections` and `limits.max_connections_per_uid` (shedding the oldest idle,
/// lease-free connection at a limit; see [`admission`]).
pub async fn serve(listener: UnixListener, plane: Arc<DataPlane>, mut shutdown: watch::Receiver<bool>) {
    let admission = Arc::clone(&plane.admission);
    let mut failures = 0u32;
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    failures = 0;
                    let peer = peer_of(&stream);
                    let groups = || crate::sys::socket::peer_groups(stream.as_fd()).unwrap_or_default();
                    if !plane.allow.admits(peer.uid, peer.gid, groups) {
                        let message = format!(
                            "uid {} (gid {}) is not allowed on packd's data plane (allow_uids, allow_gids)",
                            peer.uid, peer.gid
                        );
                        refuse(&plane, &stream, peer, ErrorCode::PermissionDenied, message);
                        continue;
                    }
                    match admission.admit(peer.uid, |client| plane.store.holds_anything(client)) {
                        Ok(slot) => {
                            tokio::spawn(conn::serve(stream, Arc::clone(&plane), peer, slot));
                        }
                        Err(refusal) => {
                            refuse(&plane, &stream, peer, ErrorCode::ResourceExhausted, refusal.to_string());
                        }
                    }
                }
                Err(e) => {
                    // EMFILE/ENFILE and the like: back off (up to 1 s) instead of spinning;
                    // the listener stays and pending connections wait in the backlog.
                    failures = failures.saturating_add(1);
                    if failures == 1 || failures.is_power_of_two() {
                        tracing::warn!(error = %e, failures, "data plane: accept failed; backing off");
                    }
                    let backoff = (ACCEPT_BACKOFF_MIN * (1u32 << failures.min(7))).min(ACCEPT_BACKOFF_MAX);
                    tokio::time::sleep(backoff).await;
                }
            },
            _ = shutdown.changed() => break,
        }
    }
}

/// The connection's peer credentials (SO_PEERCRED); an unknown peer gets uid `u32::MAX`.
fn peer_of(stream: &UnixStream) -> Peer {
    stream.peer_cred().map(|c| Peer { pid: c.pid(), uid: c.uid(), gid: c.gid() }).unwrap_or(Peer {
        pid: None,
        uid: u32::MAX,
        gid: u32::MAX,
    })
}

/// Answers a refused connection with `code` (without waiting) and closes it.
fn refuse(plane: &DataPlane, stream: &UnixStream, peer: Peer, code: ErrorCode, message: String) {
    plane.admission.count_refused();
    if plane.request_log.allow() {
        tracing::info!(uid = peer.uid, pid = ?peer.pid, %message, "connection refused");
    }
    if let Ok(bytes) = frame::encode(&frame::error_reply(0, code, message)) {
        let _ = stream.try_write(&bytes);
    }
}
