//! Waiting for a condition, by polling.

use std::time::Duration;

/// Polls `cond` every 5 ms until it holds or `timeout` passes; returns whether it held.
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = std::time::Instant::now() + timeout;
    while !cond() {
        if std::time::Instant::now() > end {
            return false;
        }
        std::thread::sleep(POLL);
    }
    true
}

/// How often [`wait_until`] asks: short next to any deadline a test sets, long enough not
/// to load a 2-core machine.
const POLL: Duration = Duration::from_millis(5);
