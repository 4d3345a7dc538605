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

use packd_proto::v1::control_server::ControlServer;
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::watch;
use tokio_stream::wrappers::{TcpListenerStream, UnixListenerStream};
use tonic::service::Routes;

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
    use tokio_stream::StreamExt;
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
        .build_v1()?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(packd_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()?;
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_service_status(SERVICE_NAME, tonic_health::ServingStatus::Serving).await;
    health.set_service_status("", tonic_health::ServingStatus::Serving).await;
    let tcp_mutations = plane.policy.tcp_mutations;
    let routes = Routes::new(ControlServer::new(ControlService::new(plane)))
        .add_service(health_service)
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
    let unix = tonic::transport::Server::builder().add_routes(routes.clone()).serve_with_incoming_shutdown(
        tokio_stream::StreamExt::map(backoff_on_error(UnixListenerStream::new(listener)), |s| {
            s.map(peer::CredStream::new)
        }),
        stop(shutdown.clone()),
    );
    match tcp {
        None => unix.await?,
        Some(tcp) => {
            let tcp = tonic::transport::Server::builder()
                .add_routes(routes)
                .serve_with_incoming_shutdown(backoff_on_error(TcpListenerStream::new(tcp)), stop(shutdown));
            let (a, b) = tokio::join!(unix, tcp);
            a?;
            b?;
        }
    }
    Ok(())
}
