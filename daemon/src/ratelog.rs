//! Rate limiting of per-request log lines: a client sending 40 000 bad requests must not
//! write 40 000 lines to the journal. At most `limits.request_log_per_second` lines a
//! second are written; the rest are counted, summarised in one line when the next second
//! begins, and reported in the stats (`log_lines_suppressed`).
#![forbid(unsafe_code)]

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A per-second budget of log lines.
pub struct RateLog {
    per_second: u32,
    window: Mutex<(Instant, u32, u64)>,
    suppressed: AtomicU64,
}

/// The window `per_second` counts lines in.
const WINDOW: Duration = Duration::from_secs(1);

impl RateLog {
    /// At most `per_second` lines a second.
    pub fn new(per_second: u32) -> Self {
        Self { per_second, window: Mutex::new((Instant::now(), 0, 0)), suppressed: AtomicU64::new(0) }
    }

    /// Whether a line may be written now; if not, it is counted as suppressed.
    pub fn allow(&self) -> bool {
        let mut w = self.window.lock().unwrap_or_else(|p| p.into_inner());
        if w.0.elapsed() >= WINDOW {
            if w.2 > 0 {
                tracing::warn!(
                    suppressed = w.2,
                    "per-request log lines suppressed in the last second (limits.request_log_per_second)"
                );
            }
            *w = (Instant::now(), 0, 0);
        }
        if w.1 < self.per_second {
            w.1 += 1;
            true
        } else {
            w.2 += 1;
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            false
        }
    }

    /// Lines suppressed since start.
    pub fn suppressed(&self) -> u64 {
        self.suppressed.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn allows_a_budget_a_second_and_counts_the_rest() {
        let log = super::RateLog::new(3);
        let allowed = (0..100).filter(|_| log.allow()).count();
        assert_eq!((allowed, log.suppressed()), (3, 97));
    }
}
