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
    /// Nothing registered yet (a `static`'s initial value).
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

/// The C entry points of an adapter's library, the same in each:
///
/// - a constructor, run when the library is loaded (before `main` with `LD_PRELOAD`), unless
///   the environment variable named by `off` is set to `off`: it runs `enable`, then
///   `at_load` with the address of `enable_fn` (to find this library among the loaded
///   ones), and has libc run, at exit, `at_exit` and then write the line `status` gives
///   where the variable named by `status_var` says (`stderr`, or a path to append to);
///   `status` gives `None` when there is nothing to say (a process without the engine);
/// - `size_t status_fn(char *buf, size_t len)`: the JSON `json` gives, NUL-terminated and
///   cut to `len`; returns its whole length;
/// - `void enable_fn(void)`: `enable` again (after the program loaded its engine).
///
/// Panics are caught in each. The arguments, in this order: `off` and `status_var`
/// (string literals), `enable: Fn()`, `json: FnOnce() -> String` (the status as
/// `status::to_json` writes it), `status: FnOnce() -> Option<String>`,
/// `at_load: FnOnce(usize)`, `at_exit: FnOnce()`, and the two exports' names:
///
/// ```ignore
/// packd_interpose::c_entry! {
///     off: "PACKD_TOY",
///     status_var: "PACKD_TOY_STATUS",
///     enable: || { toy::enable(); },
///     json: || packd_interpose::status::to_json(&*toy::JOURNAL.lock()),
///     status: || Some(packd_interpose::status::to_json(&*toy::JOURNAL.lock())),
///     at_load: |_| {},
///     at_exit: || {},
///     status_fn: packd_toy_status,
///     enable_fn: packd_toy_enable,
/// }
/// ```
///
/// The constructor runs in every binary the library is linked into, its own unit tests
/// included: build the adapter's C library as a `cdylib` of its own (as `packd-llama` and
/// `packd-xnnpack-preload` are), or keep `enable` harmless there.
#[macro_export]
macro_rules! c_entry {
    (
        off: $off:literal,
        status_var: $status_var:literal,
        enable: $enable:expr,
        json: $json:expr,
        status: $status:expr,
        at_load: $at_load:expr,
        at_exit: $at_exit:expr,
        status_fn: $status_fn:ident,
        enable_fn: $enable_fn:ident $(,)?
    ) => {
        extern "C" fn __packd_init() {
            $crate::entry::caught((), || {
                if $crate::entry::turned_off($off) {
                    return;
                }
                ($enable)();
                ($at_load)($enable_fn as extern "C" fn() as usize);
                $crate::sys::at_exit(__packd_at_exit);
            });
        }

        #[used]
        #[unsafe(link_section = ".init_array")]
        static __PACKD_INIT: extern "C" fn() = __packd_init;

        extern "C" fn __packd_at_exit() {
            $crate::entry::caught((), || {
                ($at_exit)();
                if std::env::var_os($status_var).is_some()
                    && let Some(line) = ($status)()
                {
                    $crate::entry::write_status_line($status_var, &line);
                }
            });
        }

        /// Copies the status JSON (NUL-terminated, cut to `len`) into `buf`; returns the
        /// length of the whole JSON (without the NUL): call again with a larger buffer when
        /// it is `len` or more.
        ///
        /// # Safety
        /// `buf` is NULL or points at `len` writable bytes.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $status_fn(buf: *mut std::ffi::c_char, len: usize) -> usize {
            let json: String = $crate::entry::caught(String::from("{}"), $json);
            // SAFETY: the caller's promise, passed on.
            unsafe { $crate::sys::copy_to_c(&json, buf, len) }
        }

        /// Looks at the loaded objects again (after the program loaded its engine with
        /// `dlopen`).
        #[unsafe(no_mangle)]
        pub extern "C" fn $enable_fn() {
            $crate::entry::caught((), || {
                ($enable)();
            });
        }
    };
}
