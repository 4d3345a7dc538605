//! The guard that keeps tests off the host's packd directories.
//!
//! Every process that links this crate (each test binary, and the helper binaries tests
//! start) watches, from before `main` to its exit, the directories a packd or a packd
//! worker uses by default: `/run/packd`, `/var/cache/packd`, `$XDG_RUNTIME_DIR/packd` and
//! the user's cache directory (`$XDG_CACHE_HOME/packd` or `~/.cache/packd`, where the
//! adapters' names memos live) with those memos' directories; a directory that does not
//! exist yet is watched for its creation. Any open, read, write, creation, removal or
//! change of attributes there while the process runs makes it exit 1 with the list of what
//! was touched, so `cargo test` fails.
//!
//! inotify cannot tell which process touched a file, so a daemon of the user's that is busy
//! while the tests run is reported too: an idle one is not (it touches nothing). It cannot
//! see a connection to a socket either; tests keep off the default sockets by passing
//! `--socket-dir` (or `PACKD_SOCKET_DIR`) to everything they start.
//!
//! `PACKD_TESTS_HOST_DIRS` (colon-separated) replaces the list (the guard's own test plants
//! a touch under a directory of its own); `PACKD_TESTS_HOST_GUARD=off` turns the guard off.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, InotifyEvent, WatchDescriptor};

struct Guard {
    inotify: Inotify,
    /// Each watch: the directory, and the one name in it that matters when the directory
    /// watched is the parent of one that does not exist yet.
    watches: BTreeMap<WatchDescriptor, (PathBuf, Option<OsString>)>,
    /// What was touched so far, by path: the kinds of access.
    touched: Mutex<BTreeMap<PathBuf, Vec<&'static str>>>,
}

static GUARD: OnceLock<Option<Guard>> = OnceLock::new();

/// The directories watched: the host's defaults, or `PACKD_TESTS_HOST_DIRS`.
pub fn host_dirs() -> Vec<PathBuf> {
    if let Some(list) = std::env::var_os("PACKD_TESTS_HOST_DIRS") {
        return std::env::split_paths(&list).filter(|p| p.is_absolute()).collect();
    }
    let mut dirs = vec![PathBuf::from("/run/packd"), PathBuf::from("/var/cache/packd")];
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(run) = var("XDG_RUNTIME_DIR") {
        dirs.push(run.join("packd"));
    }
    match (var("XDG_CACHE_HOME"), var("HOME")) {
        (Some(cache), _) => dirs.push(cache.join("packd")),
        (None, Some(home)) => dirs.push(home.join(".cache/packd")),
        (None, None) => {}
    }
    dirs
}

/// Subdirectories watched where they exist (a stat adds no event; a listing would).
const SUBDIRS: &[&str] = &["names", "xnnpack-names"];

const EVENTS: AddWatchFlags = AddWatchFlags::IN_OPEN
    .union(AddWatchFlags::IN_ACCESS)
    .union(AddWatchFlags::IN_MODIFY)
    .union(AddWatchFlags::IN_ATTRIB)
    .union(AddWatchFlags::IN_CREATE)
    .union(AddWatchFlags::IN_DELETE)
    .union(AddWatchFlags::IN_MOVED_FROM)
    .union(AddWatchFlags::IN_MOVED_TO)
    .union(AddWatchFlags::IN_DELETE_SELF)
    .union(AddWatchFlags::IN_MOVE_SELF);

/// Starts watching (called once, before `main`). Does nothing when turned off or when
/// inotify is not available.
pub(crate) fn start() {
    GUARD.get_or_init(|| {
        if std::env::var_os("PACKD_TESTS_HOST_GUARD").is_some_and(|v| v == "off") {
            return None;
        }
        let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC).ok()?;
        let mut watches = BTreeMap::new();
        for dir in host_dirs() {
            if dir.is_dir() {
                // The adapters' names memos, by name: listing the directory would open it
                // under the watch of every other test process's guard.
                let subdirs = SUBDIRS.iter().map(|s| dir.join(s)).filter(|d| d.is_dir()).collect::<Vec<_>>();
                for d in std::iter::once(dir).chain(subdirs) {
                    if let Ok(wd) = inotify.add_watch(&d, EVENTS) {
                        watches.insert(wd, (d, None));
                    }
                }
            } else if let (Some(parent), Some(name)) = (dir.parent(), dir.file_name())
                && parent.is_dir()
                && let Ok(wd) = inotify.add_watch(parent, AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO)
            {
                watches.entry(wd).or_insert((parent.to_path_buf(), Some(name.to_os_string())));
            }
        }
        Some(Guard { inotify, watches, touched: Mutex::new(BTreeMap::new()) })
    });
}

fn kind(mask: AddWatchFlags) -> &'static str {
    for (flag, word) in [
        (AddWatchFlags::IN_CREATE, "created"),
        (AddWatchFlags::IN_DELETE, "removed"),
        (AddWatchFlags::IN_DELETE_SELF, "removed"),
        (AddWatchFlags::IN_MOVED_FROM, "moved"),
        (AddWatchFlags::IN_MOVED_TO, "moved"),
        (AddWatchFlags::IN_MOVE_SELF, "moved"),
        (AddWatchFlags::IN_MODIFY, "written"),
        (AddWatchFlags::IN_ATTRIB, "attributes changed"),
        (AddWatchFlags::IN_ACCESS, "read"),
        (AddWatchFlags::IN_OPEN, "opened"),
    ] {
        if mask.contains(flag) {
            return word;
        }
    }
    "touched"
}

impl Guard {
    fn record(&self, events: Vec<InotifyEvent>) {
        let mut touched = self.touched.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for e in events {
            if e.mask.contains(AddWatchFlags::IN_Q_OVERFLOW) {
                touched.entry(PathBuf::from("(more events than the kernel queues)")).or_default().push("touched");
                continue;
            }
            let Some((dir, only)) = self.watches.get(&e.wd) else { continue };
            if only.is_some() && only != &e.name {
                continue;
            }
            let path = e.name.map_or_else(|| dir.clone(), |n| dir.join(n));
            let kinds = touched.entry(path).or_default();
            let k = kind(e.mask);
            if !kinds.contains(&k) {
                kinds.push(k);
            }
        }
    }

    /// Reads what the kernel queued so far.
    fn drain(&self) {
        while let Ok(events) = self.inotify.read_events() {
            if events.is_empty() {
                break;
            }
            self.record(events);
        }
    }
}

/// What this process's guard saw touched so far, one line per path (empty: nothing).
pub fn touched() -> Vec<String> {
    let Some(Some(guard)) = GUARD.get() else { return Vec::new() };
    guard.drain();
    let touched = guard.touched.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    touched.iter().map(|(path, kinds)| format!("{} ({})", path.display(), kinds.join(", "))).collect()
}

/// The report printed at exit when something was touched.
pub(crate) fn report() -> Option<String> {
    let lines = touched();
    if lines.is_empty() {
        return None;
    }
    let watched: Vec<String> = host_dirs().iter().map(|d| d.display().to_string()).collect();
    Some(format!(
        "packd-tests: while these tests ran, something touched the host's packd directories ({}):\n  {}\n\
         Every daemon, packctl and worker a test starts needs directories of its own (--socket-dir, \
         --cache-dir or PACKD_CACHE_DIR=off, PACKD_NAMES). If a daemon of yours was busy during the \
         run, run the tests again while it is idle, or set PACKD_TESTS_HOST_GUARD=off.",
        watched.join(", "),
        lines.join("\n  ")
    ))
}
