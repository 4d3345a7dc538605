//! The control plane: `packd.v1.Control` over tonic on `control.sock` (and optionally a
//! loopback TCP port), with server reflection (v1 and v1alpha, for grpcurl) and
//! `grpc.health.v1.Health`.
//!
//! It reads and manages the store and may pack files under the configured model roots; it
//! never passes fds.
#![forbid(unsafe_code)]

mod prefetch;

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use packd_proto::v1::control_server::{Control, ControlServer};
use packd_proto::v1::{self, ErrorCode};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::watch;
use tokio_stream::wrappers::{TcpListenerStream, UnixListenerStream};
use tonic::service::Routes;
use tonic::{Code, Request, Response, Status};

use crate::Daemon;
use crate::store::{EvictError, Selector};

/// The gRPC service name operators see in `grpcurl list`.
pub const SERVICE_NAME: &str = "packd.v1.Control";

#[derive(Clone)]
struct ControlService {
    daemon: Arc<Daemon>,
}

fn epoch(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

fn selector(key: &str, prefix: &str) -> Result<Selector, Status> {
    match (key.is_empty(), prefix.is_empty()) {
        (false, true) => Ok(Selector::Key(key.to_string())),
        (true, false) => Ok(Selector::Prefix(prefix.to_string())),
        _ => Err(Status::invalid_argument("give exactly one of key or prefix")),
    }
}

fn evict_status(e: EvictError) -> Status {
    match e {
        EvictError::NotFound(_) => Status::not_found(e.to_string()),
        EvictError::Leased(_) => Status::failed_precondition(e.to_string()),
    }
}

/// Maps a data-plane error code to a gRPC status code.
/// The uid of a control-plane caller on the Unix socket (SO_PEERCRED); callers over TCP
/// count as packd's own uid.
fn peer_uid<T>(req: &Request<T>) -> u32 {
    req.extensions()
        .get::<tonic::transport::server::UdsConnectInfo>()
        .and_then(|info| info.peer_cred)
        .map_or_else(|| nix::unistd::getuid().as_raw(), |cred| cred.uid())
}

pub(crate) fn grpc_code(code: ErrorCode) -> Code {
    match code {
        ErrorCode::InvalidArgument | ErrorCode::BadSource | ErrorCode::BadFd => Code::InvalidArgument,
        ErrorCode::NotFound => Code::NotFound,
        ErrorCode::ResourceExhausted => Code::ResourceExhausted,
        ErrorCode::FrameTooLarge | ErrorCode::MalformedFrame => Code::InvalidArgument,
        ErrorCode::Internal | ErrorCode::Unspecified => Code::Internal,
    }
}

#[tonic::async_trait]
impl Control for ControlService {
    async fn get_stats(&self, _req: Request<v1::GetStatsRequest>) -> Result<Response<v1::Stats>, Status> {
        let s = self.daemon.store.stats();
        Ok(Response::new(v1::Stats {
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
            budget_bytes: s.budget_bytes,
            zombie_bytes: s.zombie_bytes,
            pack_seconds: s.pack_seconds,
            evictions: s.evictions,
            log_lines_suppressed: self.daemon.request_log.suppressed(),
            connections_refused: self.daemon.connections_refused.load(std::sync::atomic::Ordering::Relaxed),
        }))
    }

    async fn list_entries(
        &self,
        req: Request<v1::ListEntriesRequest>,
    ) -> Result<Response<v1::ListEntriesResponse>, Status> {
        let entries = self
            .daemon
            .store
            .list_entries(&req.get_ref().prefix)
            .into_iter()
            .map(|e| v1::EntryStatus {
                key: e.key,
                name: e.name,
                layout: e.layout,
                bytes: e.bytes,
                refcount: e.refcount,
                pinned: e.pinned,
                hits: e.hits,
                last_access: epoch(e.last_access),
                packed_at: epoch(e.packed_at),
                pack_ms: e.pack_ms,
                blake3: e.blake3,
                segment_key: e.segment_key,
            })
            .collect();
        Ok(Response::new(v1::ListEntriesResponse { entries }))
    }

    async fn list_clients(
        &self,
        _req: Request<v1::ListClientsRequest>,
    ) -> Result<Response<v1::ListClientsResponse>, Status> {
        let clients = self
            .daemon
            .store
            .list_clients()
            .into_iter()
            .map(|c| v1::ClientStatus {
                id: c.id,
                pid: c.peer.pid.unwrap_or(0),
                uid: c.peer.uid,
                gid: c.peer.gid,
                connected_since: epoch(c.connected_at),
                leases: c.leases,
                bytes_mapped: c.bytes_mapped,
            })
            .collect();
        Ok(Response::new(v1::ListClientsResponse { clients }))
    }

    async fn evict(&self, req: Request<v1::EvictRequest>) -> Result<Response<v1::EvictResponse>, Status> {
        let r = req.get_ref();
        let sel = selector(&r.key, &r.prefix)?;
        let report = self.daemon.store.evict(&sel, r.force).map_err(evict_status)?;
        tracing::info!(?sel, force = r.force, evicted = report.evicted.len(), zombies = report.zombies.len(), "evict");
        Ok(Response::new(v1::EvictResponse { evicted: report.evicted, zombies: report.zombies }))
    }

    async fn pin(&self, req: Request<v1::PinRequest>) -> Result<Response<v1::PinResponse>, Status> {
        let sel = selector(&req.get_ref().key, &req.get_ref().prefix)?;
        let segments = self.daemon.store.pin(&sel, true).map_err(evict_status)?;
        Ok(Response::new(v1::PinResponse { segments }))
    }

    async fn unpin(&self, req: Request<v1::PinRequest>) -> Result<Response<v1::PinResponse>, Status> {
        let sel = selector(&req.get_ref().key, &req.get_ref().prefix)?;
        let segments = self.daemon.store.pin(&sel, false).map_err(evict_status)?;
        Ok(Response::new(v1::PinResponse { segments }))
    }

    async fn set_budget(&self, req: Request<v1::SetBudgetRequest>) -> Result<Response<v1::SetBudgetResponse>, Status> {
        let bytes = req.get_ref().bytes;
        if bytes == 0 {
            return Err(Status::invalid_argument("the budget must be more than 0 bytes"));
        }
        let (budget_bytes, fits) = self.daemon.store.set_budget(bytes);
        tracing::info!(budget_bytes, fits, "budget set");
        let bytes_resident = self.daemon.store.stats().bytes_resident;
        Ok(Response::new(v1::SetBudgetResponse { budget_bytes, bytes_resident, fits }))
    }

    async fn prefetch(&self, req: Request<v1::PrefetchRequest>) -> Result<Response<v1::PrefetchResponse>, Status> {
        let uid = peer_uid(&req);
        let seg = prefetch::prefetch(&self.daemon, uid, req.into_inner()).await?;
        Ok(Response::new(v1::PrefetchResponse {
            key: seg.key.clone(),
            bytes: seg.size,
            entries: seg.entries.len() as u64,
        }))
    }
}

/// Serves the control plane on `listener` (and `tcp`, if given) until `shutdown` turns true.
pub async fn serve(
    listener: UnixListener,
    tcp: Option<TcpListener>,
    daemon: Arc<Daemon>,
    shutdown: watch::Receiver<bool>,
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
    let routes = Routes::new(ControlServer::new(ControlService { daemon }))
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha);

    let stop = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let unix = tonic::transport::Server::builder()
        .add_routes(routes.clone())
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), stop(shutdown.clone()));
    match tcp {
        None => unix.await?,
        Some(tcp) => {
            let tcp = tonic::transport::Server::builder()
                .add_routes(routes)
                .serve_with_incoming_shutdown(TcpListenerStream::new(tcp), stop(shutdown));
            let (a, b) = tokio::join!(unix, tcp);
            a?;
            b?;
        }
    }
    Ok(())
}
