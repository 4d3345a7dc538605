//! `packd.v1.Control`: stats, listings, eviction, pins, the budget and prefetch.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use packd_proto::v1;
use packd_proto::v1::control_server::Control;
use tonic::{Request, Response, Status};

use super::access::{Caller, ControlAccess};
use super::plane::ControlPlane;
use super::prefetch;
use crate::key::Key;
use crate::store::{EvictError, Selector};

/// The `packd.v1.Control` service over the control plane's handle.
#[derive(Clone)]
pub struct ControlService {
    plane: Arc<ControlPlane>,
}

impl ControlService {
    /// The service over `plane`.
    pub fn new(plane: Arc<ControlPlane>) -> Self {
        Self { plane }
    }

    /// Whether `caller` (an admin if `admin`) may see a segment published by `publisher`
    /// (`None`: packed by packd, seen by all): others' publications are seen only where
    /// they would be served, as if they did not exist otherwise.
    fn may_see(&self, publisher: &Option<crate::store::Publisher>, caller: &Caller, admin: bool) -> bool {
        let trusted = &self.plane.trusted_publishers;
        match (publisher, caller) {
            (None, _) => true,
            _ if admin => true,
            (Some(p), Caller::Local { uid, .. }) => p.trusted_by(*uid, trusted),
            (Some(p), _) => p.trusted_by_everyone(trusted),
        }
    }
}

fn epoch(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

fn selector(key: &str, prefix: &str) -> Result<Selector, Status> {
    match (key.is_empty(), prefix.is_empty()) {
        // Parsed once, here: text of neither form is no segment's or entry's key.
        (false, true) => Key::parse(key)
            .map(Selector::Key)
            .ok_or_else(|| Status::not_found(format!("nothing matches key {key:?} (not a segment or entry key)"))),
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

#[tonic::async_trait]
impl Control for ControlService {
    async fn get_stats(&self, _req: Request<v1::GetStatsRequest>) -> Result<Response<v1::Stats>, Status> {
        let s = self.plane.packer.store.stats();
        let kernels = self.plane.packer.kernels.get();
        let lends = self.plane.packer.lends.stats();
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
            isa: kernels.to_string(),
            kernels: kernels.kernels.each().map(|(k, i)| (k.name().to_string(), i.to_string())).collect(),
            kernels_reason: kernels.reason(),
            budget_bytes: s.budget_bytes,
            zombie_bytes: s.zombie_bytes,
            spare_bytes: s.spare_bytes,
            spare_takes: s.spare_takes,
            pack_seconds: s.pack_seconds,
            evictions: s.evictions,
            log_lines_suppressed: self.plane.request_log.suppressed(),
            connections_refused: self.plane.admission.refused_count(),
            connections_shed: self.plane.admission.shed_count(),
            control_connections: self.plane.connections.open() as u64,
            control_connections_refused: self.plane.connections.refused_count(),
            published_segments: s.published_segments,
            published_bytes: s.published_bytes,
            builds: s.builds,
            build_waits: s.build_waits,
            builds_abandoned: s.builds_abandoned,
            builds_given_up: s.builds_given_up,
            build_waits_slow: s.build_waits_slow,
            lent_bytes: lends.bytes,
            builds_lent: lends.handed,
            lends_refused: lends.refused,
            lends_revoked: s.lends_revoked,
            lends_expired: lends.expired,
            reserved_bytes: s.reserved_bytes,
            private_reports: s.private_reports,
            builds_active: s.builds_active,
            builds_refused: s.builds_refused,
            builds_expired: s.builds_expired,
            publishes: s.publishes,
            publishes_refused: s.publishes_refused,
            publishes_withdrawn: s.publishes_withdrawn,
            aliases_filed: s.aliases_filed,
            source_hashes: self.plane.packer.digests.computed(),
            duplicates_dropped: s.duplicates_dropped,
            bytes_mapped: s.sharing.bytes_mapped,
            bytes_saved: s.sharing.bytes_saved,
            workers_served: s.sharing.workers_served,
            workers_building: s.sharing.workers_building,
            workers_private: s.sharing.workers_private,
            private_bytes: s.sharing.private_bytes,
            private_fallbacks: s.reports.by_reason().map(|(k, v)| (k.to_string(), v)).collect(),
            worker_reports: s.reports.received,
            worker_reports_dropped: s.reports.dropped,
        }))
    }

    async fn list_entries(
        &self,
        req: Request<v1::ListEntriesRequest>,
    ) -> Result<Response<v1::ListEntriesResponse>, Status> {
        // Admins see every entry; others not the publications they would not be served
        // (another uid's, unless its publisher is trusted), which do not exist for them.
        let caller = Caller::of(&req);
        let admin = self.plane.policy.is_admin(&caller);
        let may_see = |p: &Option<crate::store::Publisher>| self.may_see(p, &caller, admin);
        let entries = self
            .plane
            .packer
            .store
            .list_entries(&req.get_ref().prefix)
            .into_iter()
            .filter(|e| may_see(&e.publisher))
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
                segment_bytes: e.segment_bytes,
                resident_bytes: e.resident_bytes,
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
        let admin = self.plane.policy.is_admin(&caller);
        let own_uid = match caller {
            Caller::Local { uid, .. } => Some(uid),
            _ => None,
        };
        let clients = self
            .plane
            .packer
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
                builds: c.builds,
                reports: c
                    .reports
                    .into_iter()
                    .map(|r| v1::WorkerStatus {
                        report: Some(v1::WorkerReport {
                            engine: r.engine,
                            model: r.model,
                            obtained: r.obtained as i32,
                            fallback: r.fallback as i32,
                            detail: r.detail,
                            private_bytes: r.private_bytes,
                            shared_bytes: r.shared_bytes,
                        }),
                        reported_at: epoch(r.at),
                    })
                    .collect(),
            })
            .collect();
        Ok(Response::new(v1::ListClientsResponse { clients }))
    }

    async fn list_models(
        &self,
        req: Request<v1::ListModelsRequest>,
    ) -> Result<Response<v1::ListModelsResponse>, Status> {
        // Admins see every model; others what ListEntries and ListClients show them: no
        // publication they would not be served, no other uid's workers' reports or roles.
        let caller = Caller::of(&req);
        let admin = self.plane.policy.is_admin(&caller);
        let own_uid = match caller {
            Caller::Local { uid, .. } => Some(uid),
            _ => None,
        };
        let segment_visible = |seg: &crate::store::Segment| self.may_see(&seg.publisher, &caller, admin);
        let models = self
            .plane
            .packer
            .store
            .models_seen_by(segment_visible, |uid| admin || Some(uid) == own_uid)
            .into_iter()
            .map(|m| v1::ModelStatus {
                model: m.model,
                label: m.label,
                segments: m.segments,
                bytes_resident: m.bytes_resident,
                bytes_mapped: m.sharing.bytes_mapped,
                bytes_saved: m.sharing.bytes_saved,
                workers_served: m.sharing.workers_served,
                workers_building: m.sharing.workers_building,
                workers_private: m.sharing.workers_private,
                private_bytes: m.sharing.private_bytes,
                hits: m.hits,
            })
            .collect();
        Ok(Response::new(v1::ListModelsResponse { models }))
    }

    async fn evict(&self, req: Request<v1::EvictRequest>) -> Result<Response<v1::EvictResponse>, Status> {
        self.plane.policy.require_admin(&Caller::of(&req), "Evict")?;
        let r = req.get_ref();
        let sel = selector(&r.key, &r.prefix)?;
        let report = self.plane.packer.store.evict(&sel, r.force).map_err(evict_status)?;
        // Room again, maybe, for a spare that had given way.
        self.plane.packer.spare.refill();
        tracing::info!(?sel, force = r.force, evicted = report.evicted.len(), zombies = report.zombies.len(), "evict");
        Ok(Response::new(v1::EvictResponse { evicted: report.evicted, zombies: report.zombies }))
    }

    async fn pin(&self, req: Request<v1::PinRequest>) -> Result<Response<v1::PinResponse>, Status> {
        self.plane.policy.require_admin(&Caller::of(&req), "Pin")?;
        let sel = selector(&req.get_ref().key, &req.get_ref().prefix)?;
        let segments = self.plane.packer.store.pin(&sel, true).map_err(evict_status)?;
        Ok(Response::new(v1::PinResponse { segments }))
    }

    async fn unpin(&self, req: Request<v1::PinRequest>) -> Result<Response<v1::PinResponse>, Status> {
        self.plane.policy.require_admin(&Caller::of(&req), "Unpin")?;
        let sel = selector(&req.get_ref().key, &req.get_ref().prefix)?;
        let segments = self.plane.packer.store.pin(&sel, false).map_err(evict_status)?;
        Ok(Response::new(v1::PinResponse { segments }))
    }

    async fn set_budget(&self, req: Request<v1::SetBudgetRequest>) -> Result<Response<v1::SetBudgetResponse>, Status> {
        self.plane.policy.require_admin(&Caller::of(&req), "SetBudget")?;
        let bytes = req.get_ref().bytes;
        if bytes == 0 {
            return Err(Status::invalid_argument("the budget must be more than 0 bytes"));
        }
        let change = self
            .plane
            .packer
            .store
            .set_budget(bytes, req.get_ref().evict_most)
            .map_err(|e| Status::failed_precondition(e.to_string()))?;
        self.plane.packer.spare.refill();
        tracing::info!(
            budget_bytes = change.budget,
            fits = change.fits,
            evicted_segments = change.evicted_segments,
            evicted_bytes = change.evicted_bytes,
            "budget set"
        );
        let bytes_resident = self.plane.packer.store.stats().bytes_resident;
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
        self.plane.policy.require_admin(&caller, "Prefetch")?;
        let seg = prefetch::prefetch(&self.plane, caller.uid(), req.into_inner()).await?;
        Ok(Response::new(v1::PrefetchResponse {
            key: seg.key.to_string(),
            bytes: seg.size,
            entries: seg.entries.len() as u64,
        }))
    }
}
