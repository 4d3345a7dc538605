//! Operations both planes share: pack a source (single flight, budget), wait for a
//! segment, classify failures.
#![forbid(unsafe_code)]

use std::sync::Arc;

use packd_proto::v1::ErrorCode;

use crate::Daemon;
use crate::pack::{self, JobConfig, PackError, Plan, PlanError};
use crate::source::{Digest, Source, SourceError};
use crate::store::{Finished, FlightResult, Leader, Lookup, Segment, segment_key};
use crate::sys::memfd::MemfdError;

/// A failed operation: the wire error code and the message.
pub type Failure = (ErrorCode, String);

/// Packs `source` with `plan`, or finds it packed, or joins the pack job running for it.
pub async fn pack_source(daemon: &Arc<Daemon>, source: Source, plan: Plan) -> Result<Arc<Segment>, Failure> {
    let d = Arc::clone(daemon);
    let canonical = plan.canonical();
    // Off the async threads. A source whose segment is not known to be packed or packing
    // is admitted to the budget by its size (from the header) before any hashing; then the
    // source is hashed (or its digest recalled).
    let (source, plan, canonical, digest) = tokio::task::spawn_blocking(move || {
        let identity = source.identity().clone();
        let known = d.digests.get(&identity).is_some_and(|digest| d.store.known(&segment_key(&digest, &canonical)));
        if !known {
            let size = pack::packed_size(&source, &plan, d.page_size)?;
            d.store.admit(size).map_err(|e| PackError::Budget(e.to_string()))?;
        }
        let digest = d.digests.get_or_compute(&identity, || {
            let digest = source.digest()?;
            source.check_unchanged()?;
            Ok::<_, SourceError>(digest)
        })?;
        Ok::<_, PackError>((source, plan, canonical, digest))
    })
    .await
    .map_err(|e| (ErrorCode::Internal, format!("hashing task failed: {e}")))?
    .map_err(|e| {
        if !matches!(e, PackError::Source(SourceError::NotAFile(_) | SourceError::Unreadable(_))) {
            daemon.store.count_pack_failure();
        }
        classify(&e)
    })?;

    let key = segment_key(&digest, &canonical);
    let lookup = daemon.store.lookup_or_lead(&key);
    if let Lookup::Lead(leader) = lookup {
        let d = Arc::clone(daemon);
        let job = tokio::task::spawn_blocking(move || run_job(&d, leader, &source, &plan, digest, canonical));
        let outcome = job.await.map_err(|e| (ErrorCode::Internal, format!("pack job panicked: {e}")))?;
        return outcome.map_err(|e| classify(&e));
    }
    resolve(lookup).await
}

/// Runs a pack job as its leader and publishes the result (blocking).
pub fn run_job(
    daemon: &Daemon,
    leader: Leader,
    source: &Source,
    plan: &Plan,
    digest: Digest,
    canonical: String,
) -> FlightResult {
    let started = std::time::Instant::now();
    let name = format!("packd:{}", leader.key());
    let config = JobConfig { name: &name, page: daemon.page_size, isa: daemon.isa };
    let store = Arc::clone(leader.store());
    let result = pack::pack(source, plan, &digest, &config, |size| {
        store.reserve(size).map_err(|e| PackError::Budget(e.to_string()))
    });
    let pack_ms = started.elapsed().as_secs_f64() * 1e3;
    match &result {
        Ok((p, _)) => {
            tracing::info!(key = leader.key(), entries = p.entries.len(), bytes = p.size, ms = pack_ms, "packed")
        }
        Err(e) => tracing::info!(key = leader.key(), error = %e, "pack job failed"),
    }
    leader.finish(result.map(|(packed, reservation)| Finished {
        packed,
        source: digest,
        plan: canonical,
        pack_ms,
        reservation,
    }))
}

/// Waits for a lookup's segment.
pub async fn resolve(lookup: Lookup) -> Result<Arc<Segment>, Failure> {
    let outcome: FlightResult = match lookup {
        Lookup::Ready(seg) => Ok(seg),
        Lookup::Wait(mut flight) => {
            let done = flight
                .wait_for(Option::is_some)
                .await
                .map_err(|_| (ErrorCode::Internal, "pack job vanished".to_string()))?;
            done.clone().ok_or((ErrorCode::Internal, "pack job vanished".to_string()))?
        }
        Lookup::Lead(_) => return Err((ErrorCode::Internal, "unexpected leadership".into())),
    };
    outcome.map_err(|e| classify(&e))
}

/// Maps a pack error to a wire error code and message.
pub fn classify(e: &PackError) -> Failure {
    let code = match e {
        PackError::Source(SourceError::NotAFile(_) | SourceError::Unreadable(_)) => ErrorCode::BadFd,
        PackError::Source(_) | PackError::TooLarge(_) => ErrorCode::BadSource,
        PackError::Plan(
            PlanError::Tensor { .. } | PlanError::Layout(_) | PlanError::RuleSyntax(_) | PlanError::Glob { .. },
        ) => ErrorCode::InvalidArgument,
        PackError::Memfd(MemfdError::Size { .. } | MemfdError::Map { .. }) | PackError::Budget(_) => {
            ErrorCode::ResourceExhausted
        }
        PackError::Memfd(_) => ErrorCode::Internal,
    };
    (code, e.to_string())
}
