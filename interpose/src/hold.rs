//! `PACKD_XNNPACK_HOLD_BUILD` and `PACKD_LLAMA_HOLD_BUILD`: a builder that holds its build,
//! for tests and demonstrations of the single flight (other workers wait for it; one killed
//! meanwhile hands the role on).
#![forbid(unsafe_code)]

use std::path::Path;
use std::time::{Duration, Instant};

/// The longest hold.
const MAX: Duration = Duration::from_secs(3600);

/// Holds as the environment variable `var` says: `SECONDS`, or an absolute path: until that
/// file exists (so a test releases the builder exactly when the others are waiting). At most
/// an hour either way; nothing when `var` is unset or says neither.
pub fn hold_as(var: &str) {
    let Some(value) = std::env::var_os(var) else { return };
    let text = value.to_string_lossy();
    if let Ok(secs) = text.trim().parse::<f64>() {
        if secs.is_finite() && secs > 0.0 {
            std::thread::sleep(Duration::from_secs_f64(secs.min(MAX.as_secs_f64())));
        }
        return;
    }
    let path = Path::new(&value);
    if path.is_absolute() {
        let end = Instant::now() + MAX;
        while !path.exists() && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}
