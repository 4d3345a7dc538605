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
}

impl SourceOps {
    /// A pool of `max` operations, `max_per_uid` per uid, each watched with `timeout`.
    pub fn new(max: usize, max_per_uid: usize, timeout: Duration) -> Self {
        Self { global: Arc::new(Semaphore::new(max)), max, per_uid: Mutex::new(HashMap::new()), max_per_uid, timeout }
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
        let uid_permit = self.take_uid(uid).await?;
        let global = self.take_global().await?;
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

#[cfg(test)]
mod tests {
    use super::*;

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
        // The operation runs for 2.5 × the timeout, reading a byte each time the test says
        // so — every timeout / 3: never a whole timeout without progress.
        let timeout = Duration::from_millis(600);
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
            for at in 0..8u64 {
                tokio::time::sleep(timeout / 3).await;
                go.send(at).unwrap();
            }
        };
        let (result, ()) = tokio::join!(long, driver);
        assert_eq!(result, Ok((7, 8)), "alive past its timeout while it made progress");
    }
}
