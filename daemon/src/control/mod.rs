//! The control plane: `packd.v1.Control` over tonic on `control.sock` (and optionally a
//! loopback TCP port), with server reflection (v1 and v1alpha, for grpcurl) and
//! `grpc.health.v1.Health`.
//!
//! It reads and manages the store and may pack files under the configured model roots; it
//! never passes fds.
#![forbid(unsafe_code)]

mod access;
mod codes;
mod peer;
mod plane;
mod prefetch;
mod service;

pub use access::{Caller, ControlAccess, Policy};
pub use codes::grpc_code;
pub use plane::{ControlPlane, ModelRoots};

use std::sync::Arc;
use std::time::Duration;

use packd_proto::v1::control_server::ControlServer;
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::watch;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::{TcpListenerStream, UnixListenerStream};
use tonic::service::Routes;

use crate::dataplane::Refusal;
use peer::{Accepted, TCP_PEER, describe, groups_of};
use service::ControlService;

/// Why the control plane could not be set up or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// Server reflection could not be built from the compiled descriptors.
    #[error("control plane: server reflection: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    /// The gRPC server failed.
    #[error("control plane: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// The gRPC service name operators see in `grpcurl list`.
pub const SERVICE_NAME: &str = packd_proto::CONTROL_SERVICE;

/// Passes accepted connections through; a failed accept (EMFILE, ENFILE) is logged and
/// followed by a 100 ms pause instead of an immediate retry, so a daemon at its fd limit does
/// not spin. Pending connections wait in the listen backlog.
fn backoff_on_error<S, T>(incoming: S) -> impl tokio_stream::Stream<Item = std::io::Result<T>>
where
    S: tokio_stream::Stream<Item = std::io::Result<T>>,
{
    incoming
        .then(|accepted| async move {
            if let Err(e) = &accepted {
                tracing::warn!(error = %e, "control plane: accept failed; backing off");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            accepted
        })
        .filter(Result::is_ok)
}

/// Requests in flight at once on one control-plane connection (HTTP/2
/// `SETTINGS_MAX_CONCURRENT_STREAMS`; a client queues the rest). grpcurl uses two (its
/// reflection stream and the call), `packctl` one.
pub const STREAMS_PER_CONNECTION: u32 = 4;

/// Largest request message of the health and reflection services (a service or symbol
/// name). `packd.v1.Control`'s is `ControlPlane::max_request_bytes`.
const SMALL_REQUEST_BYTES: usize = 16 << 10;

/// HTTP/2 flow-control window of a connection and of each of its streams: request bytes
/// a client may send ahead of the daemon reading them.
const WINDOW_BYTES: u32 = 64 << 10;

/// Largest block of request headers (HTTP/2 `SETTINGS_MAX_HEADER_LIST_SIZE`).
const MAX_HEADER_BYTES: u32 = 16 << 10;

/// How often the daemon pings a control-plane connection that sent nothing, and how long
/// it waits for the answer before closing it: a peer that went away without closing (a
/// hung network, a stopped process with nothing queued for it) gives back its slot after
/// 80 s. Client libraries answer pings on their own, idle or not. A peer that stops
/// reading while answers are queued is closed by `peer::WRITE_STALL_TIMEOUT` instead, and
/// one that never sends the HTTP/2 preface by `peer::HELLO_TIMEOUT`.
const KEEPALIVE: (Duration, Duration) = (Duration::from_secs(60), Duration::from_secs(20));

/// Gives an accepted connection of `uid` (an admin's if `admin`: held to its uid's limit
/// only) a slot of the control plane's connection limits, or closes it (logged at most
/// `limits.request_log_per_second` times a second, counted in `control_connections_refused`).
fn admit<S>(plane: &ControlPlane, (uid, admin): (u32, bool), groups: Arc<[u32]>, stream: S) -> Option<Accepted<S>> {
    match plane.connections.admit_if_room(uid, admin) {
        Ok(slot) => Some(Accepted::new(stream, slot, uid, groups, Arc::clone(&plane.request_log))),
        Err(refusal) => {
            plane.connections.count_refused();
            if plane.request_log.allow() {
                let (limit, open) = match refusal {
                    Refusal::PerUid { open, .. } => ("limits.max_control_connections_per_uid", open),
                    Refusal::Global { open } => ("limits.max_control_connections", open),
                };
                let peer = describe(uid);
                tracing::warn!(%peer, open, limit, "control plane: connection closed at once: at its connection limit");
            }
            None
        }
    }
}

/// A gRPC server with the per-connection bounds above.
fn server() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .max_concurrent_streams(STREAMS_PER_CONNECTION)
        .initial_connection_window_size(WINDOW_BYTES)
        .initial_stream_window_size(WINDOW_BYTES)
        .http2_max_header_list_size(MAX_HEADER_BYTES)
        .http2_keepalive_interval(Some(KEEPALIVE.0))
        .http2_keepalive_timeout(Some(KEEPALIVE.1))
}

/// Serves the control plane on `listener` (and `tcp`, if given) until `shutdown` turns true.
pub async fn serve(
    listener: UnixListener,
    tcp: Option<TcpListener>,
    plane: Arc<ControlPlane>,
    shutdown: watch::Receiver<bool>,
) -> Result<(), ControlError> {
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(packd_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?
        .max_decoding_message_size(SMALL_REQUEST_BYTES);
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(packd_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()?
        .max_decoding_message_size(SMALL_REQUEST_BYTES);
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_service_status(SERVICE_NAME, tonic_health::ServingStatus::Serving).await;
    health.set_service_status("", tonic_health::ServingStatus::Serving).await;
    let tcp_mutations = plane.policy.tcp_mutations;
    let routes = Routes::new(
        ControlServer::new(ControlService::new(Arc::clone(&plane))).max_decoding_message_size(plane.max_request_bytes),
    )
    .add_service(health_service.max_decoding_message_size(SMALL_REQUEST_BYTES))
    .add_service(reflection_v1)
    .add_service(reflection_v1alpha);

    let stop = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    if tcp_mutations && tcp.is_some() {
        tracing::warn!(
            "control_tcp_allow_mutations is on: EVERY process that can reach the TCP control port may evict, \
             pin, set the budget and prefetch"
        );
    }
    let local = Arc::clone(&plane);
    let unix = server().add_routes(routes.clone()).serve_with_incoming_shutdown(
        backoff_on_error(UnixListenerStream::new(listener)).filter_map(move |accepted| {
            let stream = accepted.ok()?;
            let groups = groups_of(&stream);
            // A peer the kernel cannot name counts with the TCP callers.
            let peer = stream
                .peer_cred()
                .map_or((TCP_PEER, false), |c| (c.uid(), local.policy.admits_local(c.uid(), c.gid(), &groups)));
            admit(&local, peer, groups, stream).map(Ok::<_, std::io::Error>)
        }),
        stop(shutdown.clone()),
    );
    match tcp {
        None => unix.await?,
        Some(tcp) => {
            let tcp = server().add_routes(routes).serve_with_incoming_shutdown(
                backoff_on_error(TcpListenerStream::new(tcp)).filter_map(move |accepted| {
                    admit(&plane, (TCP_PEER, false), Arc::new([]), accepted.ok()?).map(Ok::<_, std::io::Error>)
                }),
                stop(shutdown),
            );
            let (a, b) = tokio::join!(unix, tcp);
            a?;
            b?;
        }
    }
    Ok(())
}
