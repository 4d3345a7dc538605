//! The bounded pool for blocking work on sources: checking a received fd, opening a file
//! under a model root, reading a header, hashing, pack jobs.
//!
//! The async runtime threads never make such calls: a source on a file system that stops
//! answering (a hung NFS or FUSE mount) would freeze every connection and the control plane.
//! Here each operation runs on tokio's blocking threads, at most `limits.max_source_ops` at
//! once and `limits.max_source_ops_per_uid` for one uid (more wait their turn, at most
//! `limits.source_timeout`), and is watched: an operation whose source makes no progress for
//! `limits.source_timeout` fails its request. A read stuck in the kernel cannot be
//! cancelled; its thread and its permits stay taken until the read returns, which is why
//! each uid can tie up only a few.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::source::Progress;

/// Why a blocking operation did not deliver its result.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum OpError {
    /// The uid's slots stayed taken for the whole timeout.
    #[error(
        "uid {uid}'s {limit} source operation slots stayed busy for the source timeout \
         (limits.max_source_ops_per_uid); are its sources on a hung file system?"
    )]
    PerUid {
        /// The uid.
        uid: u32,
        /// Its limit.
        limit: usize,
    },
    /// Every slot stayed taken for the whole timeout.
    #[error("all {0} source operation slots stayed busy for the source timeout (limits.max_source_ops)")]
    Busy(usize),
    /// The source made no progress for the timeout.
    #[error("the source did not answer {what} for {secs} s (limits.source_timeout); is it on a hung file system?")]
    Stalled {
        /// What was waited for ("a read", "the open").
        what: &'static str,
        /// The timeout in seconds.
        secs: f64,
    },
    /// The operation panicked (a bug).
    #[error("source operation failed: {0}")]
    Panicked(String),
}

/// The pool's accounting.
pub struct SourceOps {
    global: Arc<Semaphore>,
    max: usize,
    per_uid: Mutex<HashMap<u32, Arc<Semaphore>>>,
    max_per_uid: usize,
    timeout: Duration,
    disposer: Arc<Disposer>,
    /// The reads of operations running now (at most `max` live ones), for [`Self::stop_all`].
    running: Mutex<Vec<std::sync::Weak<Progress>>>,
}

impl SourceOps {
    /// A pool of `max` operations, `max_per_uid` per uid, each watched with `timeout`;
    /// what a uid's requests leave behind is closed on at most `max_per_uid` threads.
    pub fn new(max: usize, max_per_uid: usize, timeout: Duration) -> Self {
        Self {
            global: Arc::new(Semaphore::new(max)),
            max,
            per_uid: Mutex::new(HashMap::new()),
            max_per_uid,
            timeout,
            disposer: Disposer::new(max_per_uid, DISPOSALS_PER_UID),
            running: Mutex::new(Vec::new()),
        }
    }

    /// Stops the reads of every operation running now (a client's file being hashed, say):
    /// each fails at its next read. For the daemon's stop, once the drain is over: nothing
    /// then waits for their results, and the runtime's shutdown need not wait for them.
    pub fn stop_all(&self) {
        let running = self.running.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for progress in running.iter().filter_map(std::sync::Weak::upgrade) {
            progress.stop();
        }
    }

    /// Drops `item` (a client's fd, or something holding one) off the async runtime, for
    /// `uid`: see [`Disposer`]. Never waits.
    pub fn dispose(&self, uid: u32, item: impl Send + 'static) {
        self.disposer.dispose(uid, Box::new(item));
    }

    /// A [`crate::source::Release`] that hands a source's file to [`SourceOps::dispose`]
    /// for `uid`: a source dropped anywhere (at the end of its pack job on the pool, a
    /// result dropped on the runtime) neither closes a client's file there nor, on the
    /// pool, holds a slot while the close waits.
    pub fn releaser(&self, uid: u32) -> crate::source::Release {
        let disposer = Arc::clone(&self.disposer);
        Box::new(move |file| disposer.dispose(uid, Box::new(file)))
    }

    /// Holds `item` in async code so that however it is dropped — a return, an error, the
    /// request's future dropped when its client hangs up — it is disposed of off the
    /// runtime ([`SourceOps::dispose`]).
    pub fn guard<T: Send + 'static>(&self, uid: u32, item: T) -> Disposing<T> {
        Disposing { item: Some(item), uid, disposer: Arc::clone(&self.disposer) }
    }

    /// [`SourceOps::dispose`] of the fds a client sent, if there are any (nothing to do,
    /// and no thread to start, for the usual empty list).
    pub fn dispose_fds(&self, uid: u32, fds: Vec<std::os::fd::OwnedFd>) {
        if !fds.is_empty() {
            self.dispose(uid, fds);
        }
    }

    /// Whether `uid` has fewer than [`DISPOSALS_PER_UID`] disposals not done: a connection
    /// reads from its socket (which may bring fds) only then, so a uid whose closes hang
    /// cannot make the daemon hold more of its fds.
    pub fn room_to_dispose(&self, uid: u32) -> bool {
        self.disposer.has_room(uid)
    }

    /// Returns once [`SourceOps::room_to_dispose`] holds.
    pub async fn wait_room_to_dispose(&self, uid: u32) {
        self.disposer.room(uid).await;
    }

    /// Waits (up to the timeout) for one of `uid`'s slots. The permit travels with the
    /// operation's thread, so a hung read keeps its slot until it returns.
    async fn take_uid(&self, uid: u32) -> Result<OwnedSemaphorePermit, OpError> {
        let sem = {
            let mut map = self.per_uid.lock().unwrap_or_else(|p| p.into_inner());
            if map.len() > 256 {
                // Forget uids with nothing running, so the map stays as small as the set of
                // uids with work in flight.
                let full = self.max_per_uid;
                map.retain(|_, s| Arc::strong_count(s) > 1 || s.available_permits() < full);
            }
            Arc::clone(map.entry(uid).or_insert_with(|| Arc::new(Semaphore::new(self.max_per_uid))))
        };
        match tokio::time::timeout(self.timeout, sem.acquire_owned()).await {
            Ok(Ok(permit)) => Ok(permit),
            _ => Err(OpError::PerUid { uid, limit: self.max_per_uid }),
        }
    }

    async fn take_global(&self) -> Result<OwnedSemaphorePermit, OpError> {
        match tokio::time::timeout(self.timeout, Arc::clone(&self.global).acquire_owned()).await {
            Ok(Ok(permit)) => Ok(permit),
            _ => Err(OpError::Busy(self.max)),
        }
    }

    /// Runs `op` for `uid` on a blocking thread. With `progress`, the operation fails once
    /// `progress` stands still for the timeout (a long hash that keeps reading is fine);
    /// without, once the whole operation takes longer than the timeout.
    pub async fn run<T: Send + 'static>(
        &self,
        uid: u32,
        what: &'static str,
        progress: Option<Arc<Progress>>,
        op: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, OpError> {
        // Until it runs, `op` (holding a client's fd, say) is never dropped here: not when
        // no slot comes, nor when the caller goes while it waits for one.
        let op = self.guard(uid, op);
        let uid_permit = self.take_uid(uid).await?;
        let global = self.take_global().await?;
        let op = op.into_inner();
        if let Some(p) = &progress {
            let mut running = self.running.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            running.retain(|w| w.strong_count() > 0);
            running.push(Arc::downgrade(p));
        }
        let mut handle = tokio::task::spawn_blocking(move || {
            let _permits = (uid_permit, global);
            op()
        });
        let stalled = OpError::Stalled { what, secs: self.timeout.as_secs_f64() };
        let Some(progress) = progress else {
            return match tokio::time::timeout(self.timeout, &mut handle).await {
                Ok(Ok(v)) => Ok(v),
                Ok(Err(e)) => Err(OpError::Panicked(e.to_string())),
                Err(_) => Err(stalled),
            };
        };
        // Check progress a few times per timeout; fail after a whole timeout without any.
        let step = (self.timeout / 4).max(Duration::from_millis(10));
        let mut last = progress.reads();
        let mut still = Duration::ZERO;
        loop {
            match tokio::time::timeout(step, &mut handle).await {
                Ok(Ok(v)) => return Ok(v),
                Ok(Err(e)) => return Err(OpError::Panicked(e.to_string())),
                Err(_) => {
                    let now = progress.reads();
                    if now == last {
                        still += step;
                        if still >= self.timeout {
                            progress.stop();
                            return Err(stalled);
                        }
                    } else {
                        last = now;
                        still = Duration::ZERO;
                    }
                }
            }
        }
    }
}

/// An item held in async code that is disposed of off the runtime when dropped
/// ([`SourceOps::guard`]).
pub struct Disposing<T: Send + 'static> {
    item: Option<T>,
    uid: u32,
    disposer: Arc<Disposer>,
}

impl<T: Send + 'static> Disposing<T> {
    /// The item, to be dropped by whoever takes it (a closure on a blocking thread).
    pub fn into_inner(mut self) -> T {
        self.item.take().expect("a Disposing holds its item until taken")
    }
}

impl<T: Send + 'static> std::ops::Deref for Disposing<T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.item.as_ref().expect("a Disposing holds its item until taken")
    }
}

impl<T: Send + 'static> Drop for Disposing<T> {
    fn drop(&mut self) {
        if let Some(item) = self.item.take() {
            self.disposer.dispose(self.uid, Box::new(item));
        }
    }
}

/// Disposals of one uid not done before its connections wait ([`SourceOps::room_to_dispose`]).
pub const DISPOSALS_PER_UID: usize = 64;

/// Something whose drop may block: a client's fd, or what holds one.
type Item = Box<dyn Send>;

/// Closes what clients sent off the async runtime.
///
/// Closing an fd can block: `close` of a file on a FUSE mount waits for the mount's server
/// to answer its flush, for ever if that server (which may be the client) never does, and
/// so can a close on a hung network file system. Each uid's items are dropped in order on at
/// most `threads_per_uid` threads of their own (made when needed, gone when its queue is
/// empty), so a uid whose closes hang ties up only its own threads; its connections stop
/// reading once it has `max_pending` items not done, so it cannot make the daemon hold
/// more of its fds than that plus one read's (2) per connection.
pub struct Disposer {
    uids: Mutex<HashMap<u32, Queue>>,
    /// Items not done, all uids: the fast path of [`Disposer::room`].
    pending: std::sync::atomic::AtomicUsize,
    done: tokio::sync::Notify,
    threads_per_uid: usize,
    max_pending: usize,
}

#[derive(Default)]
struct Queue {
    items: std::collections::VecDeque<Item>,
    /// Items queued or being dropped.
    pending: usize,
    threads: usize,
}

impl Disposer {
    /// A disposer with at most `threads_per_uid` threads and `max_pending` items per uid.
    pub fn new(threads_per_uid: usize, max_pending: usize) -> Arc<Self> {
        Arc::new(Self {
            uids: Mutex::new(HashMap::new()),
            pending: std::sync::atomic::AtomicUsize::new(0),
            done: tokio::sync::Notify::new(),
            threads_per_uid: threads_per_uid.max(1),
            max_pending,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Queue>> {
        self.uids.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `item` to be dropped on one of `uid`'s threads. Never waits.
    pub fn dispose(self: &Arc<Self>, uid: u32, item: Item) {
        let mut uids = self.lock();
        let q = uids.entry(uid).or_default();
        q.items.push_back(item);
        q.pending += 1;
        self.pending.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if q.threads >= self.threads_per_uid {
            return; // a running thread takes it next
        }
        let me = Arc::clone(self);
        let spawned = std::thread::Builder::new().name("packd-close".into()).spawn(move || me.drain(uid));
        match spawned {
            Ok(_) => q.threads += 1,
            // No thread to be had (a thread limit): the next disposal of this uid tries
            // again; the item waits in the queue meanwhile.
            Err(e) => tracing::warn!(uid, error = %e, "cannot start a thread to close a client's fds"),
        }
    }

    /// Drops `uid`'s items until its queue is empty.
    fn drain(&self, uid: u32) {
        loop {
            let item = {
                let mut uids = self.lock();
                let Some(q) = uids.get_mut(&uid) else { return };
                match q.items.pop_front() {
                    Some(item) => item,
                    None => {
                        q.threads -= 1;
                        if q.threads == 0 && q.pending == 0 {
                            uids.remove(&uid);
                        }
                        return;
                    }
                }
            };
            drop(item);
            if let Some(q) = self.lock().get_mut(&uid) {
                q.pending -= 1;
            }
            self.pending.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            self.done.notify_waiters();
        }
    }

    /// Items of `uid` queued or being dropped.
    pub fn pending(&self, uid: u32) -> usize {
        self.lock().get(&uid).map_or(0, |q| q.pending)
    }

    /// Whether `uid` has fewer than `max_pending` items not done.
    pub fn has_room(&self, uid: u32) -> bool {
        self.pending.load(std::sync::atomic::Ordering::Relaxed) < self.max_pending
            || self.pending(uid) < self.max_pending
    }

    /// Returns once `uid` has fewer than `max_pending` items not done.
    pub async fn room(&self, uid: u32) {
        loop {
            if self.pending.load(std::sync::atomic::Ordering::Relaxed) < self.max_pending {
                return; // nobody's can be over the limit
            }
            let done = self.done.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            if self.pending(uid) < self.max_pending {
                return;
            }
            done.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An item whose drop blocks until told, counting drops running and done.
    struct Stuck {
        go: Arc<(Mutex<bool>, std::sync::Condvar)>,
        running: Arc<std::sync::atomic::AtomicUsize>,
        most: Arc<std::sync::atomic::AtomicUsize>,
        done: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl Drop for Stuck {
        fn drop(&mut self) {
            use std::sync::atomic::Ordering::SeqCst;
            let now = self.running.fetch_add(1, SeqCst) + 1;
            self.most.fetch_max(now, SeqCst);
            let (lock, cv) = &*self.go;
            let mut go = lock.lock().unwrap();
            while !*go {
                go = cv.wait(go).unwrap();
            }
            self.running.fetch_sub(1, SeqCst);
            self.done.fetch_add(1, SeqCst);
        }
    }

    #[tokio::test]
    async fn disposals_never_wait_use_a_few_threads_per_uid_and_hold_back_only_that_uid() {
        use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
        let d = Disposer::new(2, 5);
        let go = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
        let (running, most, done) =
            (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let stuck = || Stuck {
            go: Arc::clone(&go),
            running: Arc::clone(&running),
            most: Arc::clone(&most),
            done: Arc::clone(&done),
        };
        // Uid 7's drops hang: seven disposals return at once, two threads take them.
        for _ in 0..7 {
            d.dispose(7, Box::new(stuck()));
        }
        let wait = |n: usize| {
            let t = std::time::Instant::now();
            while running.load(SeqCst) != n && t.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(1));
            }
            running.load(SeqCst)
        };
        assert_eq!(wait(2), 2, "two of uid 7's drops run at once");
        assert_eq!(d.pending(7), 7);
        // Uid 7 is over its 5: its connections wait; uid 8 is not held back, and its own
        // items are dropped on threads of its own.
        let mut room7 = std::pin::pin!(d.room(7));
        assert!(futures_poll(room7.as_mut()).is_pending(), "uid 7 waits for room");
        assert!(futures_poll(std::pin::pin!(d.room(8))).is_ready(), "uid 8 does not");
        let (tx, rx) = std::sync::mpsc::channel();
        d.dispose(8, Box::new(DropSends(tx)));
        rx.recv_timeout(Duration::from_secs(10)).expect("uid 8's item dropped while uid 7's hang");
        // The hang ends: every item is dropped, never more than two at once; room again.
        *go.0.lock().unwrap() = true;
        go.1.notify_all();
        tokio::time::timeout(Duration::from_secs(10), room7).await.expect("room once the drops are done");
        let t = std::time::Instant::now();
        while done.load(SeqCst) != 7 && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!((done.load(SeqCst), most.load(SeqCst)), (7, 2));
        let t = std::time::Instant::now();
        // (An item's drop runs before its count goes down, and a thread leaves its queue
        // after: wait for the queues to go.)
        while !d.lock().is_empty() && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!((d.pending(7), d.pending(8)), (0, 0));
        assert!(d.lock().is_empty(), "no queue is kept for a uid with nothing to drop");
    }

    /// Sends on drop.
    struct DropSends(std::sync::mpsc::Sender<()>);

    impl Drop for DropSends {
        fn drop(&mut self) {
            let _ = self.0.send(());
        }
    }

    /// Polls `f` once.
    fn futures_poll<F: std::future::Future>(f: std::pin::Pin<&mut F>) -> std::task::Poll<F::Output> {
        let waker = std::task::Waker::noop();
        f.poll(&mut std::task::Context::from_waker(waker))
    }

    #[tokio::test]
    async fn a_stuck_operation_fails_its_caller_and_keeps_its_uid_slot_until_it_returns() {
        let ops = SourceOps::new(4, 1, Duration::from_millis(100));
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let progress = Arc::new(Progress::default());
        let stuck = ops.run(7, "a read", Some(Arc::clone(&progress)), move || rx.recv().is_ok());
        assert!(matches!(stuck.await, Err(OpError::Stalled { .. })));
        assert!(progress.stopped(), "further reads of a stalled source are stopped");
        // Still blocked: uid 7's one slot is taken (its next operation waits the timeout,
        // then fails), other uids run.
        assert_eq!(ops.run(7, "a read", None, || 1).await, Err(OpError::PerUid { uid: 7, limit: 1 }));
        assert_eq!(ops.run(8, "a read", None, || 2).await, Ok(2));
        tx.send(()).unwrap();
        let freed = async {
            loop {
                if ops.run(7, "a read", None, || 3).await == Ok(3) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), freed).await.expect("uid 7's slot came back");
    }

    #[tokio::test]
    async fn progress_keeps_a_long_read_alive() {
        // The operation runs for 1.2 × the timeout, reading a byte each time the test says
        // so — every timeout / 10: never a whole timeout without progress, with nine tenths
        // of it to spare for a loaded machine.
        let timeout = Duration::from_secs(3);
        let ops = SourceOps::new(2, 2, timeout);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, vec![7u8; 64]).unwrap();
        let source = crate::source::Source::from_fd(std::fs::File::open(&path).unwrap().into()).unwrap();
        let (go, reads) = std::sync::mpsc::channel::<u64>();
        let long = ops.run(1, "a read", Some(source.progress()), move || {
            let mut b = [0u8; 1];
            let mut n = 0;
            while let Ok(at) = reads.recv() {
                source.read_exact_at(&mut b, at).unwrap();
                n += 1;
            }
            (b[0], n)
        });
        let driver = async move {
            for at in 0..12u64 {
                tokio::time::sleep(timeout / 10).await;
                go.send(at).unwrap();
            }
        };
        let (result, ()) = tokio::join!(long, driver);
        assert_eq!(result, Ok((7, 12)), "alive past its timeout while it made progress");
    }
}
