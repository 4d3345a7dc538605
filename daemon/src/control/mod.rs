//! The control plane: `packd.v1.Control` over tonic on `control.sock`, with server
//! reflection (v1 and v1alpha, for grpcurl) and `grpc.health.v1.Health`.
//!
//! It only reads and manages the store; it never packs and never passes fds.
#![forbid(unsafe_code)]

use std::sync::Arc;

use packd_proto::v1::control_server::{Control, ControlServer};
use packd_proto::v1::{GetStatsRequest, Stats};
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

use crate::Daemon;

/// The gRPC service name operators see in `grpcurl list`.
pub const SERVICE_NAME: &str = "packd.v1.Control";

struct ControlService {
    daemon: Arc<Daemon>,
}

#[tonic::async_trait]
impl Control for ControlService {
    async fn get_stats(&self, _req: Request<GetStatsRequest>) -> Result<Response<Stats>, Status> {
        let s = self.daemon.store.stats();
        Ok(Response::new(Stats {
            entries: s.entries,
            segments: s.segments,
            leases: s.leases,
            clients: s.clients,
            pack_jobs: s.pack_jobs,
            hits: s.hits,
            misses: s.misses,
            bytes_resident: s.bytes_resident,
            pack_failures: s.pack_failures,
            request_errors: s.request_errors,
            uptime_seconds: s.uptime_seconds,
            isa: self.daemon.isa.to_string(),
        }))
    }
}

/// Serves the control plane on `listener` until `shutdown` turns true.
pub async fn serve(
    listener: UnixListener,
    daemon: Arc<Daemon>,
    mut shutdown: watch::Receiver<bool>,
) -> anyhow::Result<()> {
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

    tonic::transport::Server::builder()
        .add_service(ControlServer::new(ControlService { daemon }))
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async move {
            let _ = shutdown.wait_for(|stop| *stop).await;
        })
        .await?;
    Ok(())
}
