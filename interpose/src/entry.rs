//! What every C entry point of an adapter needs: panics kept inside (a panic must not leave
//! a function C calls: it would abort the host process), the handler a hook calls (an
//! adapter registers it, so that the module holding the hooks imports nothing above it),
//! one line to stderr, and the status line written at exit.

#![forbid(unsafe_code)]

use std::io::Write;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::OnceLock;

/// Runs `f`, giving `default` if it panics.
pub fn caught<R>(default: R, f: impl FnOnce() -> R) -> R {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(default)
}

/// Runs packd's part of a hook; a panic there (a bug) is caught and leaves the engine's
/// call as it would be without packd.
pub fn quiet<T>(f: impl FnOnce() -> T) -> Option<T> {
    catch_unwind(AssertUnwindSafe(f)).ok()
}

/// Writes one line to stderr, ignoring a failure: `eprintln!` panics when stderr is a
/// closed pipe (Python ignores SIGPIPE), and a panic cannot leave an engine's callbacks.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// The handler hooks call: set once by the adapter (before any slot points at a hook),
/// read by the hooks without a lock.
pub struct Registered<T: ?Sized + 'static>(OnceLock<&'static T>);

impl<T: ?Sized + 'static> Registered<T> {
    pub const fn new() -> Self {
        Self(OnceLock::new())
    }

    /// Registers `handler`; the first registration stays.
    pub fn register(&self, handler: &'static T) {
        let _ = self.0.set(handler);
    }

    /// The handler, once registered.
    pub fn get(&self) -> Option<&'static T> {
        self.0.get().copied()
    }
}

impl<T: ?Sized + 'static> Default for Registered<T> {
    fn default() -> Self {
        Self::new()
    }
}

/// Writes `line` where the environment variable `var` says: `stderr`, or a path to append
/// it to (one line per process); nothing when it is unset.
pub fn write_status_line(var: &str, line: &str) {
    let line = format!("{line}\n");
    match std::env::var_os(var) {
        Some(v) if v == "stderr" => {
            let _ = std::io::stderr().write_all(line.as_bytes());
        }
        Some(path) => {
            if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
                let _ = f.write_all(line.as_bytes());
            }
        }
        None => {}
    }
}

/// Whether the environment variable `var` turns an adapter off (`off`).
pub fn turned_off(var: &str) -> bool {
    std::env::var_os(var).is_some_and(|v| v == "off")
}
