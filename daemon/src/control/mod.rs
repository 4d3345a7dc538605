//! The control plane: `packd.v1.Control` over tonic on `control.sock` (and optionally a
//! loopback TCP port), with server reflection (v1 and v1alpha, for grpcurl) and
//! `grpc.health.v1.Health`.
//!
//! It reads and manages the store and may pack files under the configured model roots; it
//! never passes fds.
#![forbid(unsafe_code)]

mod access;
mod peer;
mod prefetch;

pub use access::{Caller, ControlAccess, Policy};

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
pub const SERVICE_NAME: &str = packd_proto::CONTROL_SERVICE;

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
pub(crate) fn grpc_code(code: ErrorCode) -> Code {
    match code {
        ErrorCode::InvalidArgument | ErrorCode::BadSource | ErrorCode::BadFd => Code::InvalidArgument,
        ErrorCode::NotFound => Code::NotFound,
        ErrorCode::ResourceExhausted => Code::ResourceExhausted,
        ErrorCode::PermissionDenied => Code::PermissionDenied,
        ErrorCode::AlreadyExists => Code::AlreadyExists,
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
            connections_shed: self.daemon.admission.shed_count(),
            published_segments: s.published_segments,
            published_bytes: s.published_bytes,
            builds: s.builds,
            build_waits: s.build_waits,
            builds_abandoned: s.builds_abandoned,
            builds_given_up: s.builds_given_up,
            private_reports: s.private_reports,
            builds_active: s.builds_active,
            builds_refused: s.builds_refused,
            builds_expired: s.builds_expired,
            publishes: s.publishes,
            publishes_refused: s.publishes_refused,
            source_hashes: self.daemon.digests.computed(),
            duplicates_dropped: s.duplicates_dropped,
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
                publisher_uid: e.publisher.as_ref().map(|p| p.uid),
                identity: e.publisher.map(|p| p.identity).unwrap_or_default(),
                label: e.label,
            })
            .collect();
        Ok(Response::new(v1::ListEntriesResponse { entries }))
    }

    async fn list_clients(
        &self,
        req: Request<v1::ListClientsRequest>,
    ) -> Result<Response<v1::ListClientsResponse>, Status> {
        // Admins see every client; others only the connections of their own uid.
        let caller = Caller::of(&req);
        let admin = self.daemon.control_policy.is_admin(&caller);
        let own_uid = match caller {
            Caller::Local { uid, .. } => Some(uid),
            _ => None,
        };
        let clients = self
            .daemon
            .store
            .list_clients()
            .into_iter()
            .filter(|c| admin || Some(c.peer.uid) == own_uid)
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
        self.daemon.control_policy.require_admin(&Caller::of(&req), "Evict")?;
        let r = req.get_ref();
        let sel = selector(&r.key, &r.prefix)?;
        let report = self.daemon.store.evict(&sel, r.force).map_err(evict_status)?;
        tracing::info!(?sel, force = r.force, evicted = report.evicted.len(), zombies = report.zombies.len(), "evict");
        Ok(Response::new(v1::EvictResponse { evicted: report.evicted, zombies: report.zombies }))
    }

    async fn pin(&self, req: Request<v1::PinRequest>) -> Result<Response<v1::PinResponse>, Status> {
        self.daemon.control_policy.require_admin(&Caller::of(&req), "Pin")?;
        let sel = selector(&req.get_ref().key, &req.get_ref().prefix)?;
        let segments = self.daemon.store.pin(&sel, true).map_err(evict_status)?;
        Ok(Response::new(v1::PinResponse { segments }))
    }

    async fn unpin(&self, req: Request<v1::PinRequest>) -> Result<Response<v1::PinResponse>, Status> {
        self.daemon.control_policy.require_admin(&Caller::of(&req), "Unpin")?;
        let sel = selector(&req.get_ref().key, &req.get_ref().prefix)?;
        let segments = self.daemon.store.pin(&sel, false).map_err(evict_status)?;
        Ok(Response::new(v1::PinResponse { segments }))
    }

    async fn set_budget(&self, req: Request<v1::SetBudgetRequest>) -> Result<Response<v1::SetBudgetResponse>, Status> {
        self.daemon.control_policy.require_admin(&Caller::of(&req), "SetBudget")?;
        let bytes = req.get_ref().bytes;
        if bytes == 0 {
            return Err(Status::invalid_argument("the budget must be more than 0 bytes"));
        }
        let change = self
            .daemon
            .store
            .set_budget(bytes, req.get_ref().evict_most)
            .map_err(|e| Status::failed_precondition(e.to_string()))?;
        tracing::info!(
            budget_bytes = change.budget,
            fits = change.fits,
            evicted_segments = change.evicted_segments,
            evicted_bytes = change.evicted_bytes,
            "budget set"
        );
        let bytes_resident = self.daemon.store.stats().bytes_resident;
        Ok(Response::new(v1::SetBudgetResponse {
            budget_bytes: change.budget,
            bytes_resident,
            fits: change.fits,
            evicted_segments: change.evicted_segments,
            evicted_bytes: change.evicted_bytes,
        }))
    }

    async fn prefetch(&self, req: Request<v1::PrefetchRequest>) -> Result<Response<v1::PrefetchResponse>, Status> {
        let caller = Caller::of(&req);
        self.daemon.control_policy.require_admin(&caller, "Prefetch")?;
        let seg = prefetch::prefetch(&self.daemon, caller.uid(), req.into_inner()).await?;
        Ok(Response::new(v1::PrefetchResponse {
            key: seg.key.clone(),
            bytes: seg.size,
            entries: seg.entries.len() as u64,
        }))
    }
}

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
    let daemon_policy = daemon.control_policy.clone();
    let routes = Routes::new(ControlServer::new(ControlService { daemon }))
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha);

    let stop = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    if daemon_policy.tcp_mutations && tcp.is_some() {
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
