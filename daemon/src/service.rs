//! Operations both planes share: pack a source (single flight, budget), wait for a
//! segment, classify failures.
#![forbid(unsafe_code)]

use std::os::fd::OwnedFd;
use std::sync::Arc;

use nix::errno::Errno;
use packd_proto::v1::{self, ErrorCode};

use crate::blocking::{OpError, SourceOps};
use crate::key::{FileFlight, SegmentKey};
use crate::pack::{self, JobConfig, PackError, Plan, PlanError};
use crate::source::{Digest, DigestCache, Progress, Source, SourceError};
use crate::store::{
    Finished, FlightAbort, FlightResult, JobError, Leader, Lookup, NewSource, QuotaError, Segment, Store,
};
use crate::sys::memfd::MemfdError;

/// Why a pack or get failed. [`Failure::code`] is the one place that maps a failure to
/// the wire's error code (and so to gRPC's, through `control::grpc_code`).
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    /// The pack job (this request's or the one it waited for) failed.
    #[error(transparent)]
    Job(Arc<JobError>),
    /// The source pool could not run the work (a stalled source, a full pool).
    #[error(transparent)]
    Op(#[from] OpError),
    /// The job's result was lost (a bug: the flight ended without an outcome).
    #[error("internal error: {0}")]
    Lost(&'static str),
}

impl From<JobError> for Failure {
    fn from(e: JobError) -> Self {
        Failure::Job(Arc::new(e))
    }
}

impl From<PackError> for Failure {
    fn from(e: PackError) -> Self {
        Failure::from(JobError::Pack(e))
    }
}

impl From<PlanError> for Failure {
    fn from(e: PlanError) -> Self {
        Failure::from(PackError::Plan(e))
    }
}

impl From<SourceError> for Failure {
    fn from(e: SourceError) -> Self {
        Failure::from(PackError::Source(e))
    }
}

impl From<QuotaError> for Failure {
    fn from(e: QuotaError) -> Self {
        Failure::from(JobError::Quota(e))
    }
}

impl Failure {
    /// The wire error code of this failure.
    pub fn code(&self) -> ErrorCode {
        match self {
            Failure::Job(job) => match job.as_ref() {
                JobError::Pack(e) => pack_code(e),
                // An abandoned job fails a request only after `MAX_LOOKUPS` rounds of looking again.
                JobError::Quota(_) | JobError::Abandoned => ErrorCode::ResourceExhausted,
            },
            Failure::Op(OpError::Stalled { .. }) => ErrorCode::BadSource,
            Failure::Op(OpError::PerUid { .. } | OpError::Busy(_)) => ErrorCode::ResourceExhausted,
            Failure::Op(OpError::Panicked(_)) | Failure::Lost(_) => ErrorCode::Internal,
        }
    }
}

/// What packing needs, and all it gets: the store, the digests of sources seen, the source
/// pool, and how segments are made. Both planes and persistence hold one.
pub struct Packer {
    /// Index, flights, leases, counters.
    pub store: Arc<Store>,
    /// Digests of recently seen source files.
    pub digests: Arc<DigestCache>,
    /// The bounded, watched pool for blocking work on sources.
    pub source_ops: SourceOps,
    /// The system page size; segment sizes are multiples of it.
    pub page_size: u64,
    /// The kernels pack jobs use (the ISA of each GEMM kind) and why.
    pub kernels: pack::choice::KernelsInUse,
    /// Whether segments ask for transparent huge pages.
    pub huge_pages: bool,
    /// Counters and histograms for the metrics.
    pub telemetry: Arc<crate::telemetry::Telemetry>,
    /// The spare memfd's keeper (`store::spare`).
    pub spare: Spare,
    /// Memfds allocated for engine builders while their model is hashed (`store::lend`).
    pub lends: Arc<crate::store::Lends>,
}

/// Keeps a spare memfd of `bytes` allocated for the next pack job (see `store::spare`):
/// a thread at nice 19 makes it once a pack job has run (a daemon that only serves
/// engines' publications never packs, and holds none) and again after a job took it, when
/// it fits beside everything resident and reserved.
pub struct Spare {
    bytes: u64,
    wake: std::sync::Mutex<Option<std::sync::mpsc::SyncSender<()>>>,
    /// Set by [`Spare::stop`]: a wake-up already queued makes no spare either.
    stopped: Arc<std::sync::atomic::AtomicBool>,
    /// Set once a pack job ran ([`Spare::job_done`]): until then no spare is made.
    wanted: std::sync::atomic::AtomicBool,
}

impl Spare {
    /// A keeper of `bytes` (0: no spare), not started.
    pub fn new(bytes: u64) -> Self {
        Self { bytes, wake: std::sync::Mutex::new(None), stopped: Arc::default(), wanted: Default::default() }
    }

    /// Starts the thread that keeps the spare made (once a pack job ran). Nothing when the
    /// spare is off or the thread cannot be started (jobs then allocate their memory).
    pub fn start(&self, store: &Arc<Store>, huge_pages: bool) {
        if self.bytes == 0 {
            return;
        }
        let (tx, rx) = std::sync::mpsc::sync_channel::<()>(1);
        let (store, bytes, stopped) = (Arc::downgrade(store), self.bytes, Arc::clone(&self.stopped));
        let started = std::thread::Builder::new().name("packd-spare".into()).spawn(move || {
            crate::sys::proc::lower_thread_priority();
            while rx.recv().is_ok() {
                if stopped.load(std::sync::atomic::Ordering::Acquire) {
                    return;
                }
                let Some(store) = store.upgrade() else { return };
                let Some(claim) = store.claim_spare(bytes) else { continue };
                let started = std::time::Instant::now();
                let memory = match crate::sys::memfd::Prepared::new("packd:b3:spare", claim.bytes(), huge_pages) {
                    Ok(p) => Some(p),
                    Err(e) => {
                        tracing::warn!(bytes, error = %e, "cannot allocate the spare memfd; pack jobs allocate their own");
                        None
                    }
                };
                // Always handed back: a failed allocation ends the claim too.
                if store.fill_spare(claim, memory) {
                    tracing::info!(bytes, ms = crate::telemetry::log_ms(started.elapsed()), "spare memfd ready");
                }
            }
        });
        if started.is_ok() {
            *self.wake.lock().unwrap_or_else(|p| p.into_inner()) = Some(tx);
            self.refill();
        }
    }

    /// A pack job ended: from now on the spare is kept, and made again now if it is gone.
    pub fn job_done(&self) {
        self.wanted.store(true, std::sync::atomic::Ordering::Relaxed);
        self.refill();
    }

    /// Ends the keeper (at shutdown): no spare is made after this, and its thread exits once
    /// a spare it is making, if any, is done.
    pub fn stop(&self) {
        self.stopped.store(true, std::sync::atomic::Ordering::Release);
        self.wake.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    /// Asks the keeper to make the spare again if it is gone (a job took it, or the budget
    /// needed its room and has it again), once a pack job ran. Never blocks.
    pub fn refill(&self) {
        if !self.wanted.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        if let Some(tx) = self.wake.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            let _ = tx.try_send(());
        }
    }
}

/// Takes ownership of a received fd and checks it (`fstat`, a first read) on the source
/// pool, within `limits.source_timeout`: a file on a hung file system fails this request
/// and stalls nothing else.
/// The source's file is closed off the runtime and the pool when the source goes
/// ([`crate::blocking::SourceOps::releaser`]).
pub async fn open_source(packer: &Packer, uid: u32, fd: OwnedFd) -> Result<Source, Failure> {
    let release = packer.source_ops.releaser(uid);
    packer
        .source_ops
        .run(uid, "the first read", None, move || Source::from_fd_releasing(fd, Some(release)))
        .await?
        .map_err(Failure::from)
}

/// What a running request is doing, as `Reply.progress` frames tell its client.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Stage {
    /// Accepted; not reading yet (e.g. waiting for a slot of the source pool).
    #[default]
    Accepted,
    /// Waiting for another request's pack job or another process's build.
    Waiting,
    /// Hashing a source or a publication.
    Hashing,
    /// Reading and packing a source.
    Packing,
}

#[derive(Debug, Default)]
struct TrackState {
    stage: Stage,
    /// The reads of this stage, and their count of bytes when it began.
    reads: Option<(Arc<Progress>, u64)>,
    total: u64,
}

/// Where a request stands, for a client that asked for progress (`Request.progress`);
/// a no-op handle otherwise. Cheap to clone; set from any thread.
#[derive(Clone, Debug, Default)]
pub struct Track(Option<Arc<std::sync::Mutex<TrackState>>>);

impl Track {
    /// A handle that records (for a request that asked for progress).
    pub fn new_recording() -> Self {
        Self(Some(Arc::default()))
    }

    /// Whether this handle records (the request asked for progress).
    pub fn recording(&self) -> bool {
        self.0.is_some()
    }

    fn with(&self, f: impl FnOnce(&mut TrackState)) {
        if let Some(state) = &self.0 {
            f(&mut state.lock().unwrap_or_else(|p| p.into_inner()));
        }
    }

    /// The request now does `stage`, reading nothing.
    pub fn stage(&self, stage: Stage) {
        self.with(|s| *s = TrackState { stage, reads: None, total: 0 });
    }

    /// The request now does `stage`, reading `total` bytes counted by `reads`.
    pub fn reading(&self, stage: Stage, reads: &Arc<Progress>, total: u64) {
        self.with(|s| *s = TrackState { stage, reads: Some((Arc::clone(reads), reads.bytes())), total });
    }

    /// The request now waits on work done elsewhere, `total` bytes of it, `reads` counting
    /// them from the start.
    pub fn following(&self, stage: Stage, reads: &Arc<Progress>, total: u64) {
        self.with(|s| *s = TrackState { stage, reads: Some((Arc::clone(reads), 0)), total });
    }

    /// The progress frame's body, if the request asked for progress.
    pub fn report(&self) -> Option<v1::Progress> {
        let state = self.0.as_ref()?.lock().unwrap_or_else(|p| p.into_inner());
        let stage = match state.stage {
            Stage::Accepted => v1::ProgressStage::Accepted,
            Stage::Waiting => v1::ProgressStage::Waiting,
            Stage::Hashing => v1::ProgressStage::Hashing,
            Stage::Packing => v1::ProgressStage::Packing,
        };
        let done = state.reads.as_ref().map_or(0, |(r, base)| r.bytes().saturating_sub(*base));
        Some(v1::Progress { stage: stage as i32, bytes_done: done.min(state.total), bytes_total: state.total })
    }
}

/// Who asked for a pack, for the source pool's accounting and for cancellation.
#[derive(Clone, Debug)]
pub struct Requester {
    /// The uid whose share of the source pool the work takes.
    pub uid: u32,
    /// Whether the job may be cancelled when this requester leaves and nobody else waits
    /// (a data-plane request); a prefetch runs to the end.
    pub cancellable: bool,
    /// Display label for a segment this request packs (already passed through
    /// [`crate::store::label`]).
    pub label: String,
    /// Where the request stands, for its progress frames.
    pub track: Track,
}

impl Requester {
    /// The uid whose quota of packed bytes a new segment counts against: a data-plane
    /// request's; a Prefetch (an admin's) counts against nobody's.
    pub fn owner(&self) -> Option<u32> {
        self.cancellable.then_some(self.uid)
    }
}

/// Stops a source's reads (and fails its job's flight) when the request that started them
/// is dropped, unless someone else still waits for the job.
struct CancelOnDrop {
    progress: Arc<crate::source::Progress>,
    /// The job's flight, and the leader's requester's own receiver of it (dropped before
    /// counting who else waits).
    flight: Option<(FlightAbort, crate::store::Flight)>,
    armed: bool,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        match self.flight.take() {
            Some((f, own)) => {
                drop(own);
                // Atomic with requests joining the flight: one that joined keeps it running.
                if f.abort_unless_waited(JobError::stopped("every requester left")) {
                    self.progress.stop();
                    tracing::info!("pack job cancelled: every requester left");
                }
            }
            None => self.progress.stop(),
        }
    }
}

/// How many times a request looks a key up again after the pack job it waited for was
/// abandoned before it ran ([`JobError::Abandoned`]); past that it fails with
/// `RESOURCE_EXHAUSTED`. Each round waits for another request's job, so this only bounds
/// a request whose key other requests keep starting and leaving.
pub const MAX_LOOKUPS: u32 = 16;

/// Packs `source` with `plan`, or finds it packed, or joins the pack job running for it,
/// and says which. Every blocking step runs on the source pool, watched for progress.
pub async fn pack_source(
    packer: &Arc<Packer>,
    who: Requester,
    source: Source,
    plan: Plan,
) -> Result<(Arc<Segment>, packd_proto::v1::PackOutcome), Failure> {
    use packd_proto::v1::PackOutcome;
    let canonical = plan.canonical();
    let progress = source.progress();
    let mut guard = CancelOnDrop { progress: Arc::clone(&progress), flight: None, armed: who.cancellable };
    let (source, mut plan, mut digest) = digest_of(packer, &who, source, plan, &canonical, false).await?;
    // The client's file, however this ends while it is held here (found packed, an error,
    // the client hanging up), is closed off the runtime: a close can wait on a FUSE server
    // for ever.
    let mut source = packer.source_ops.guard(who.uid, source);

    // Single flight by segment key, or, while the digest is unknown, by file and plan. A
    // flight whose leader left before its job ran ends `Abandoned`: look again (and lead).
    let mut rounds = 0;
    let leader = loop {
        let lookup = match &digest {
            Some(digest) => packer.store.lookup_or_lead(&SegmentKey::new(digest, &canonical)),
            None => {
                let (flight, siblings) = unknown_source_flight(&source, &canonical);
                match packer.store.lookup_or_lead_new(&flight, &siblings) {
                    NewSource::Lead(leader) => Lookup::Lead(leader),
                    NewSource::Wait(flight) => Lookup::Wait(flight),
                    NewSource::Sibling(mut other) => {
                        // Another file of this size is being packed for the first time: this
                        // one may be a copy of it (workers each holding their own copy of a
                        // model). Wait for that job, then go by digest: a copy is found, not
                        // packed twice.
                        tracing::info!(
                            flight = %flight,
                            "waiting for the pack job of another file of this size: it may hold the same bytes"
                        );
                        who.track.stage(Stage::Waiting);
                        let _ = other.wait_for(Option::is_some).await;
                        let again = digest_of(packer, &who, source.into_inner(), plan, &canonical, true).await?;
                        let hashed;
                        (hashed, plan, digest) = again;
                        source = packer.source_ops.guard(who.uid, hashed);
                        let key = SegmentKey::new(
                            digest.as_ref().ok_or(Failure::Lost("no digest after hashing"))?,
                            &canonical,
                        );
                        packer.store.lookup_or_lead(&key)
                    }
                }
            }
        };
        let lookup = match lookup {
            Lookup::Lead(leader) => break leader,
            other => other,
        };
        guard.armed = false;
        let how = match &lookup {
            Lookup::Ready(seg) => match seg.kept {
                Some(crate::store::KeptIn::CacheDir) => PackOutcome::FoundInCacheDir,
                Some(crate::store::KeptIn::FdStore) => PackOutcome::FoundInFdStore,
                None => PackOutcome::Found,
            },
            _ => PackOutcome::Joined,
        };
        who.track.stage(Stage::Waiting);
        match resolve(lookup).await {
            done if look_again(&done, &mut rounds) => guard.armed = who.cancellable,
            done => return done.map(|seg| (seg, how)),
        }
    };
    let abort = leader.abort_handle();
    // The leader's requester waits on the flight like any other; when it leaves, the job
    // is cancelled only if nobody else waits (see `abort_unless_waited`).
    let Some(waiting) = abort.subscribe() else {
        return Err(Failure::Lost("pack job ended before it started"));
    };
    guard.flight = Some((abort.clone(), waiting));
    who.track.reading(Stage::Packing, &progress, source.len());
    let d = Arc::clone(packer);
    // The leader stays here until the job takes it, so that a pool that cannot run the job
    // fails the flight with its own reason before the leader goes. However this ends before
    // the job took it (no slot, the client gone), it goes with `slot`, ending the flight:
    // not with the job's closure, which may wait in the queue of fds to close.
    let slot = LeaderLeaves(Arc::new(std::sync::Mutex::new(Some(leader))));
    let taken = Arc::clone(&slot.0);
    let source = source.into_inner();
    let job = packer
        .source_ops
        .run(who.uid, "a read", Some(progress), move || {
            // Taken in a statement of its own: the lock is not held while the job runs
            // (the requester's side takes it when it leaves).
            let leader = taken.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
            match leader {
                Some(leader) => run_job(&d, leader, &source, &plan, digest, canonical, &who),
                None => Err(Arc::new(JobError::stopped("the pack job's flight ended before it ran"))),
            }
        })
        .await;
    guard.armed = false;
    match job {
        Ok(outcome) => outcome.map(|seg| (seg, PackOutcome::Packed)).map_err(Failure::Job),
        Err(e) => {
            // Fail the flight so that waiters and later requests do not wait on a source
            // that does not answer or a pool that has no room; but this uid's slots
            // staying busy says nothing of a waiter of another uid: the leader that goes
            // with `slot` abandons the flight, and its waiters lead a job of their own.
            let why = match &e {
                OpError::PerUid { .. } => None,
                OpError::Busy(_) => Some("every source operation slot stayed busy (limits.max_source_ops)"),
                OpError::Stalled { .. } => Some("its source stopped answering"),
                OpError::Panicked(_) => Some("the pack job failed inside packd"),
            };
            if let Some(why) = why {
                abort.abort(JobError::stopped(why));
            }
            drop(slot);
            Err(Failure::Op(e))
        }
    }
}

/// Drops a pack job's leader that its job never took, when dropped.
struct LeaderLeaves(Arc<std::sync::Mutex<Option<Leader>>>);

impl Drop for LeaderLeaves {
    fn drop(&mut self) {
        drop(self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take());
    }
}

/// Admits `source` to the budget (by its size, from the header) unless its segment is
/// known, then finds its digest: recalled; or hashed, when the file may be a copy of one
/// whose segment is served (a recorded file of the same size) or when `hash` says so, so
/// that a copy costs a hash, not a pack; or else `None`, left to the pack job, which
/// learns it from the bytes it packs: the first pack of a new file reads it once.
async fn digest_of(
    packer: &Arc<Packer>,
    who: &Requester,
    source: Source,
    plan: Plan,
    canonical: &str,
    hash: bool,
) -> Result<(Source, Plan, Option<Digest>), Failure> {
    let (d, canonical, owner, track) = (Arc::clone(packer), canonical.to_string(), who.owner(), who.track.clone());
    let found = packer
        .source_ops
        .run(who.uid, "a read", Some(source.progress()), move || {
            let identity = source.identity().clone();
            let recalled = d.digests.get(&identity);
            let known = recalled.is_some_and(|digest| d.store.known(&SegmentKey::new(&digest, &canonical)));
            if !known {
                let size = pack::packed_size(&source, &plan, d.page_size).map_err(JobError::Pack)?;
                d.store.admit(owner, size)?;
            }
            // A copy of a served model: a recorded file of this size whose segment with this
            // plan is served, or a segment with this plan whose file is not recorded (as
            // after a restart without the cache directory) and might be this one.
            let maybe_copy = || {
                d.digests.of_size(source.len()).iter().any(|c| d.store.known(&SegmentKey::new(c, &canonical))) || {
                    let recorded = d.digests.digests();
                    d.store.sources_with_plan(&canonical).iter().any(|s| !recorded.contains(s))
                }
            };
            if recalled.is_none() && !hash && !maybe_copy() {
                return Ok::<_, JobError>((source, plan, None));
            }
            let digest = d
                .digests
                .get_or_compute(&identity, || hash_whole(&source, &track, "source hashed"))
                .map_err(|e| JobError::Pack(e.into()))?;
            Ok((source, plan, Some(digest)))
        })
        .await?;
    found.map_err(|e| {
        if !matches!(e, JobError::Pack(PackError::Source(SourceError::NotAFile(_) | SourceError::Unreadable(_)))) {
            packer.store.count_pack_failure();
        }
        Failure::from(e)
    })
}

/// The BLAKE3 of the whole of `source` (on every core), which must not have changed since
/// it was received; `track` shows the hashing, the log line says `what` and how long.
/// Blocking: call it on the source pool.
pub fn hash_whole(source: &Source, track: &Track, what: &'static str) -> Result<Digest, SourceError> {
    hash_whole_on(source, track, what, std::thread::available_parallelism().map_or(1, usize::from))
}

/// [`hash_whole`] on `threads` threads.
pub fn hash_whole_on(
    source: &Source,
    track: &Track,
    what: &'static str,
    threads: usize,
) -> Result<Digest, SourceError> {
    let started = std::time::Instant::now();
    track.reading(Stage::Hashing, &source.progress(), source.len());
    let digest = source.digest_on(threads)?;
    source.check_unchanged()?;
    let ms = crate::telemetry::log_ms(started.elapsed());
    tracing::info!(bytes = source.len(), ms, "{what}");
    Ok(digest)
}

/// The flight of a pack job for a source whose digest is not known yet, and the prefix of
/// the flights of other files of its size with the same plan: its size, the plan's hash
/// as in segment keys, then the rest of the file's identity. Never the form of a segment
/// key (which starts `b3:`); short enough for a memfd name.
fn unknown_source_flight(source: &Source, canonical: &str) -> (FileFlight, String) {
    let [dev, ino, _, rest @ ..] = source.identity().to_fields();
    let rest: Vec<String> = rest.iter().map(u64::to_string).collect();
    let file = format!("{dev}.{ino}.{}", rest.join("."));
    (FileFlight::new(source.len(), canonical, &file), FileFlight::siblings(source.len(), canonical))
}

/// Runs a pack job as its leader and publishes the result (blocking). Without `digest`
/// the job learns it from the bytes it packs, checks the file did not change meanwhile,
/// records it, and enters the segment under the key it derives.
pub fn run_job(
    packer: &Packer,
    mut leader: Leader,
    source: &Source,
    plan: &Plan,
    digest: Option<Digest>,
    canonical: String,
    who: &Requester,
) -> FlightResult {
    leader.start();
    let owner = who.owner();
    let started = std::time::Instant::now();
    tracing::debug!(flight = %leader.key(), "pack job started");
    // The memfd's name (in /proc/PID/maps) is the segment key, or, while the digest is
    // unknown, `b3:` and the file's flight.
    let name = match digest {
        Some(_) => format!("packd:{}", leader.key()),
        None => format!("packd:b3:{}", leader.key()),
    };
    let store = Arc::clone(leader.store());
    let take_spare = || store.take_spare();
    let config = JobConfig {
        name: &name,
        page: packer.page_size,
        kernels: packer.kernels.get().kernels,
        huge_pages: packer.huge_pages,
        spare: Some(&take_spare),
    };
    let mut result =
        pack::pack(source, plan, digest.as_ref(), &config, |size| store.reserve(owner, size).map_err(JobError::Quota));
    packer.spare.job_done();
    if let (None, Ok((p, _))) = (digest, &result) {
        // The digest describes the bytes packed; it names this file only if the file is
        // still the version it was when received.
        match source.check_unchanged() {
            Ok(()) => packer.digests.learned(source.identity(), p.digest),
            Err(e) => result = Err(JobError::Pack(e.into())),
        }
    }
    let pack_ms = started.elapsed().as_secs_f64() * 1e3;
    if let Ok((p, _)) = &result {
        packer.telemetry.packed(p.size, started.elapsed());
    }
    match &result {
        Ok((p, _)) => tracing::info!(
            key = %SegmentKey::new(&p.digest, &canonical),
            entries = p.entries.len(),
            bytes = p.size,
            ms = (pack_ms * 10.0).round() / 10.0,
            stages = %p.stages.summary(),
            "packed"
        ),
        Err(e) => {
            tracing::info!(key = %leader.key(), error = %e, "pack job failed");
            if matches!(e, JobError::Pack(PackError::Source(SourceError::Changed(_)))) {
                // The bytes did not match the recalled digest: hash the file again next time.
                packer.digests.forget(source.identity());
            }
        }
    }
    leader.finish(result.map(|(packed, reservation)| Finished {
        key: digest.is_none().then(|| SegmentKey::new(&packed.digest, &canonical)),
        source: packed.digest,
        packed,
        plan: canonical,
        pack_ms,
        reservation,
        label: who.label.clone(),
    }))
}

/// The segment holding `key` (a segment's or an entry's key), once packed: waits for its
/// pack job; `None` if there is neither. A job abandoned before it ran leaves nothing, so
/// the key is looked up again (another request may lead a job for it meanwhile).
pub async fn get(
    store: &Store,
    key: &crate::key::Key,
    visible: impl Fn(&Segment) -> bool,
    track: &Track,
) -> Option<Result<Arc<Segment>, Failure>> {
    let mut rounds = 0;
    loop {
        let lookup = store.get(key, &visible)?;
        if matches!(lookup, Lookup::Wait(_)) {
            track.stage(Stage::Waiting);
        }
        match resolve(lookup).await {
            done if look_again(&done, &mut rounds) => {}
            done => return Some(done),
        }
    }
}

/// Whether a request whose wait ended with `done` looks its key up again: the job it
/// waited for was abandoned before it ran, and it has looked fewer than [`MAX_LOOKUPS`]
/// times (`rounds`, counted here).
fn look_again(done: &Result<Arc<Segment>, Failure>, rounds: &mut u32) -> bool {
    let abandoned = matches!(done, Err(Failure::Job(e)) if matches!(**e, JobError::Abandoned));
    if !abandoned || *rounds >= MAX_LOOKUPS {
        return false;
    }
    *rounds += 1;
    tracing::debug!(rounds = *rounds, "the pack job a request waited for was abandoned: looking again");
    true
}

/// Waits for a lookup's segment.
pub async fn resolve(lookup: Lookup) -> Result<Arc<Segment>, Failure> {
    let outcome: FlightResult = match lookup {
        Lookup::Ready(seg) => Ok(seg),
        Lookup::Wait(mut flight) => {
            let done = flight.wait_for(Option::is_some).await.map_err(|_| Failure::Lost("pack job vanished"))?;
            done.clone().ok_or(Failure::Lost("pack job vanished"))?
        }
        Lookup::Lead(_) => return Err(Failure::Lost("unexpected leadership")),
    };
    outcome.map_err(Failure::Job)
}

/// The wire error code of a pack error.
fn pack_code(e: &PackError) -> ErrorCode {
    match e {
        PackError::Source(SourceError::NotAFile(_) | SourceError::Unreadable(_)) => ErrorCode::BadFd,
        PackError::Source(_) | PackError::TooLarge(_) => ErrorCode::BadSource,
        PackError::Plan(
            PlanError::Tensor { .. } | PlanError::Layout(_) | PlanError::RuleSyntax(_) | PlanError::Glob { .. },
        ) => ErrorCode::InvalidArgument,
        PackError::Memfd(MemfdError::Size { .. } | MemfdError::Map { .. }) => ErrorCode::ResourceExhausted,
        // At the open-file limit (the process's or the system's) or out of memory: a limit,
        // not a bug.
        PackError::Memfd(MemfdError::Create(Errno::EMFILE | Errno::ENFILE | Errno::ENOMEM)) => {
            ErrorCode::ResourceExhausted
        }
        PackError::Memfd(_) => ErrorCode::Internal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use std::time::Duration;

    /// A safetensors file of one 16 × 16 f32 tensor.
    fn model(path: &std::path::Path) {
        let header = br#"{"w":{"dtype":"F32","shape":[16,16],"data_offsets":[0,1024]}}"#;
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header);
        bytes.extend((0..256u32).flat_map(|i| (i as f32 * 0.5).to_le_bytes()));
        std::fs::write(path, bytes).unwrap();
    }

    /// Polls `cond` (yielding to the runtime) until it holds, for at most a minute.
    async fn until(what: &str, mut cond: impl FnMut() -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while !cond() {
            assert!(tokio::time::Instant::now() < deadline, "timed out waiting until {what}");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Takes one of `uid`'s source-pool slots until `release` is sent to; says when it has it.
    fn hold_slot(packer: &Arc<Packer>, uid: u32) -> (std::sync::mpsc::Sender<()>, tokio::sync::oneshot::Receiver<()>) {
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let (has, holding) = tokio::sync::oneshot::channel();
        let p = Arc::clone(packer);
        tokio::spawn(async move {
            p.source_ops
                .run(uid, "a read", None, move || {
                    let _ = has.send(());
                    let _ = wait.recv();
                })
                .await
        });
        (release, holding)
    }

    fn requester(uid: u32) -> Requester {
        Requester { uid, cancellable: true, label: "test".into(), track: Track::new_recording() }
    }

    /// A packer whose uid has one source-pool slot, and a model file in `dir`.
    fn packer_with_one_slot(dir: &std::path::Path) -> (Arc<Packer>, std::path::PathBuf) {
        let conf = dir.join("packd.toml");
        std::fs::write(&conf, "[limits]\nmax_source_ops_per_uid = 1\nsource_timeout = 600\n").unwrap();
        let args = crate::config::Args::try_parse_from([
            "packd".as_ref(),
            "--socket-dir".as_ref(),
            dir.as_os_str(),
            "--config".as_ref(),
            conf.as_os_str(),
        ])
        .unwrap();
        let packer = crate::server::Parts::wire(&crate::config::Config::from_args(args).unwrap()).packer;
        let file = dir.join("m.safetensors");
        model(&file);
        (packer, file)
    }

    fn open(file: &std::path::Path) -> Source {
        Source::from_fd(std::fs::File::open(file).unwrap().into()).unwrap()
    }

    /// Starts a pack of `file` by uid 0 that leads its flight and then waits for uid 0's one
    /// slot, held by another operation until the returned sender is sent to.
    async fn leader_waiting_for_a_slot(
        packer: &Arc<Packer>,
        file: &std::path::Path,
    ) -> (tokio::task::JoinHandle<Result<(), Failure>>, std::sync::mpsc::Sender<()>) {
        // uid 0's one slot is taken; the leader-to-be queues for it, then another holder.
        let (release_first, first) = hold_slot(packer, 0);
        first.await.unwrap();
        let p = Arc::clone(packer);
        let source = open(file);
        let leader = tokio::spawn(async move {
            pack_source(&p, requester(0), source, Plan::new(&[], "").unwrap()).await.map(|_| ())
        });
        // `#[tokio::test]` runs one thread: the leader-to-be runs until it waits for the
        // slot, which queues it first (the pool's semaphores are fair).
        for _ in 0..16 {
            tokio::task::yield_now().await;
        }
        let (release_second, second) = hold_slot(packer, 0);
        // The first holder goes: the leader-to-be reads the header and leads, and its job
        // queues behind the second holder, which now has the slot.
        release_first.send(()).unwrap();
        second.await.unwrap();
        until("the leader leads", || packer.store.flights_in_progress() == 1).await;
        assert!(!leader.is_finished());
        (leader, release_second)
    }

    /// A request whose pack job was abandoned before it ran (its leader's request dropped
    /// while it waited for a source-pool slot) makes the request waiting on it lead a job
    /// of its own; it used to fail with "source changed".
    #[tokio::test]
    async fn a_waiter_leads_again_when_its_leader_left_before_the_job_ran() {
        let dir = tempfile::tempdir().unwrap();
        let (packer, file) = packer_with_one_slot(dir.path());
        let (leader, release_second) = leader_waiting_for_a_slot(&packer, &file).await;

        // A request for the same file from another uid joins the flight.
        let who = requester(1);
        let track = who.track.clone();
        let p = Arc::clone(&packer);
        let source = open(&file);
        let waiter = tokio::spawn(async move { pack_source(&p, who, source, Plan::new(&[], "").unwrap()).await });
        let waiting = || track.report().is_some_and(|r| r.stage == v1::ProgressStage::Waiting as i32);
        until("the second request waits on the flight", waiting).await;
        assert_eq!(packer.store.stats().pack_jobs, 1);

        // The leader's request goes before its job ran: the waiter leads a job of its own.
        leader.abort();
        assert!(leader.await.unwrap_err().is_cancelled());
        let (seg, how) = tokio::time::timeout(Duration::from_secs(60), waiter)
            .await
            .expect("the waiter is answered")
            .unwrap()
            .expect("the waiter packs the file");
        assert_eq!(how, v1::PackOutcome::Packed);
        assert_eq!(seg.size % packer.page_size, 0);
        // The abandoned flight never ran: one pack job, no failure.
        let s = packer.store.stats();
        assert_eq!((s.pack_jobs, s.pack_failures, s.segments, packer.store.flights_in_progress()), (1, 0, 1, 0));
        release_second.send(()).unwrap();
    }

    /// A get waiting on a job abandoned before it ran looks again: with no job left for
    /// the key, it is not found (it used to fail with "source changed").
    #[tokio::test]
    async fn a_get_waiting_on_an_abandoned_job_looks_again() {
        let dir = tempfile::tempdir().unwrap();
        let (packer, file) = packer_with_one_slot(dir.path());
        // Packed once and evicted: the file's digest is known, so the next pack's flight is
        // named by the segment key, which a get can wait on.
        let (seg, _) = pack_source(&packer, requester(1), open(&file), Plan::new(&[], "").unwrap()).await.unwrap();
        let key = crate::key::Key::parse(seg.key.as_str()).unwrap();
        drop(seg);
        packer.store.evict(&crate::store::Selector::Key(key.clone()), false).unwrap();
        assert_eq!(packer.store.stats().segments, 0);

        let (leader, release_second) = leader_waiting_for_a_slot(&packer, &file).await;
        let track = Track::new_recording();
        let (p, k, t) = (Arc::clone(&packer), key.clone(), track.clone());
        let getter = tokio::spawn(async move { get(&p.store, &k, |_| true, &t).await.map(|r| r.map(|_| ())) });
        let waiting = || track.report().is_some_and(|r| r.stage == v1::ProgressStage::Waiting as i32);
        until("the get waits on the flight", waiting).await;

        leader.abort();
        let found = tokio::time::timeout(Duration::from_secs(60), getter).await.expect("the get is answered").unwrap();
        assert!(found.is_none(), "no segment and no job: not found, got {found:?}");
        assert_eq!(packer.store.flights_in_progress(), 0);
        release_second.send(()).unwrap();
    }

    #[test]
    fn running_out_of_fds_or_memory_is_resource_exhausted_not_internal() {
        for errno in [Errno::EMFILE, Errno::ENFILE, Errno::ENOMEM] {
            assert_eq!(Failure::from(PackError::Memfd(MemfdError::Create(errno))).code(), ErrorCode::ResourceExhausted);
        }
        assert_eq!(Failure::from(PackError::Memfd(MemfdError::Create(Errno::EINVAL))).code(), ErrorCode::Internal);
    }
}
