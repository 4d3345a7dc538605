//! Publications hashed after they are served: one thread at nice 19 hashes each publication's
//! entries in turn (on every core, its helper threads at the same priority) and hands the
//! store their digests; a publication whose hash fails is withdrawn from the index.
//!
//! The queue holds weak references: a publication evicted before its turn costs nothing and
//! is skipped. It is bounded by the index (`limits.max_segments`).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use crate::source::Progress;
use crate::store::{Segment, Store};

struct Job {
    store: Weak<Store>,
    seg: Weak<Segment>,
    /// Told the segment with its digests (the one in the index, or, evicted meanwhile, the
    /// one hashed); dropped when the hash failed.
    done: tokio::sync::oneshot::Sender<Arc<Segment>>,
    /// Advanced by each entry hashed (the publisher's request reports it).
    progress: Arc<Progress>,
}

static QUEUE: OnceLock<Mutex<Sender<Job>>> = OnceLock::new();

/// Queues `seg` (indexed with its digests pending) to be hashed; the receiver gets the
/// segment with its digests, or nothing when its hash failed (it was withdrawn).
pub fn hash_later(
    store: &Arc<Store>,
    seg: &Arc<Segment>,
    progress: Arc<Progress>,
) -> tokio::sync::oneshot::Receiver<Arc<Segment>> {
    let queue = QUEUE.get_or_init(|| {
        let (tx, rx) = channel::<Job>();
        let spawned = std::thread::Builder::new().name("packd-hash".into()).spawn(move || {
            crate::sys::proc::lower_thread_priority();
            for job in rx {
                hash(job);
            }
        });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start the publication hasher: publications stay unhashed");
        }
        Mutex::new(tx)
    });
    let (done, told) = tokio::sync::oneshot::channel();
    let job = Job { store: Arc::downgrade(store), seg: Arc::downgrade(seg), done, progress };
    let _ = queue.lock().unwrap_or_else(std::sync::PoisonError::into_inner).send(job);
    told
}

fn hash(job: Job) {
    let (Some(store), Some(seg)) = (job.store.upgrade(), job.seg.upgrade()) else { return };
    let digests = fault(&seg).map_or_else(|| entry_digests(&seg.file, seg.size, &seg.entries, &job.progress), Err);
    match digests {
        Ok(d) => {
            let _ = job.done.send(store.hashed(&seg, &d));
        }
        Err(e) => {
            if store.withdraw(&seg) {
                tracing::warn!(key = %seg.key, error = %e, "a publication's hash failed: withdrawn from the index");
            }
        }
    }
}

/// Bytes read per call when a segment cannot be mapped.
const READ_CHUNK: usize = 1 << 20;

/// The entries' digests of a sealed segment of `size` bytes, from its mapping on every core,
/// or by reading it when it cannot be mapped.
pub(super) fn entry_digests(
    file: &File,
    size: u64,
    entries: &[crate::pack::PackedEntry],
    progress: &Progress,
) -> std::io::Result<Vec<[u8; 32]>> {
    match crate::sys::memfd::map_sealed(file, size) {
        Some(map) => Ok(digests_mapped(&map, entries, progress)),
        None => digests_read(file, size, entries, progress),
    }
}

/// The entries' digests from the segment's mapping, on every core.
pub(super) fn digests_mapped(map: &[u8], entries: &[crate::pack::PackedEntry], progress: &Progress) -> Vec<[u8; 32]> {
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    entries
        .iter()
        .map(|e| {
            let from = usize::try_from(e.offset).unwrap_or(usize::MAX);
            let to = usize::try_from(e.offset.saturating_add(e.length)).unwrap_or(usize::MAX);
            // In bounds: check_table kept every entry inside the segment.
            let digest = *crate::source::tree::hash_slice(map.get(from..to).unwrap_or(&[]), threads).as_bytes();
            progress.advance(e.length);
            digest
        })
        .collect()
}

/// [`digests_mapped`] by reading the file.
pub(super) fn digests_read(
    file: &File,
    size: u64,
    entries: &[crate::pack::PackedEntry],
    progress: &Progress,
) -> std::io::Result<Vec<[u8; 32]>> {
    let mut buf = vec![0u8; READ_CHUNK.min(usize::try_from(size).unwrap_or(usize::MAX))];
    entries
        .iter()
        .map(|e| {
            let digest = hash_range(file, e.offset, e.length, &mut buf);
            progress.advance(e.length);
            digest
        })
        .collect()
}

/// BLAKE3 of `[offset, offset + length)` of `file`.
fn hash_range(file: &File, offset: u64, length: u64, buf: &mut [u8]) -> std::io::Result<[u8; 32]> {
    let mut h = blake3::Hasher::new();
    let mut done = 0u64;
    while done < length {
        let n = usize::try_from(length - done).unwrap_or(usize::MAX).min(buf.len());
        file.read_exact_at(&mut buf[..n], offset + done)?;
        h.update(&buf[..n]);
        done += n as u64;
    }
    Ok(*h.finalize().as_bytes())
}

/// Test faults, in debug builds only: `PACKD_TEST_HASH_DELAY_MS` holds every hash that long;
/// `PACKD_TEST_HASH_FAIL=IDENTITY` fails the hash of that identity's publications (`*`: of
/// every publication).
#[cfg(debug_assertions)]
fn fault(seg: &Segment) -> Option<std::io::Error> {
    if let Some(ms) = std::env::var("PACKD_TEST_HASH_DELAY_MS").ok().and_then(|v| v.parse::<u64>().ok()) {
        std::thread::sleep(std::time::Duration::from_millis(ms.min(60_000)));
    }
    let fail = std::env::var("PACKD_TEST_HASH_FAIL").ok()?;
    let identity = &seg.publisher.as_ref()?.identity;
    (*identity == fail || fail == "*").then(|| std::io::Error::other("test fault: PACKD_TEST_HASH_FAIL"))
}

#[cfg(not(debug_assertions))]
fn fault(_: &Segment) -> Option<std::io::Error> {
    None
}
