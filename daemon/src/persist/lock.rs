//! File `lock` in the cache directory: a daemon that writes the directory holds an
//! exclusive `flock` on it for its whole life, so a second daemon pointed at the same
//! directory (a manual `packd` beside the service, two units with one `cache_dir`) is
//! refused at start instead of deleting the first one's temp files and evicting its files.
//! The kernel drops the lock when the process ends, however it ends (no stale lock after a
//! crash); the file keeps the holder's pid, for the error message only.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// The file's name in the cache directory.
pub const NAME: &str = "lock";

/// The cache directory is locked by another process.
#[derive(Debug, thiserror::Error)]
#[error(
    "cache directory {dir} is in use by another running packd{holder}: each daemon needs a cache_dir of its own \
     (--cache-dir, PACKD_CACHE_DIR), or none (cache_dir = \"off\")"
)]
pub struct InUse {
    /// The directory.
    pub dir: String,
    /// " (pid N)" when the lock file names the holder.
    pub holder: String,
}

/// Takes the lock of the cache directory `dir` (creating the directory, 0700, if it is
/// missing). `Ok(Some(file))`: held until `file` is dropped. `Ok(None)`: no lock needed or
/// possible — the directory cannot be created or written (the daemon then only reads it,
/// or runs memory-only; see `prepare_cache_dir`), or its file system has no `flock`.
/// `Err`: another process holds it. Blocking (file system calls).
pub fn acquire(dir: &Path) -> Result<Option<File>, InUse> {
    if !dir.is_dir() && super::files::create_private_dir(dir).is_err() {
        return Ok(None);
    }
    let path = dir.join(NAME);
    let file = match open(&path) {
        Ok(file) => file,
        Err(e) => {
            if !matches!(e.raw_os_error(), Some(libc::EACCES | libc::EROFS | libc::EPERM)) {
                tracing::warn!(file = %path.display(), error = %e, "cache: cannot open the lock file; the directory is not locked");
            }
            return Ok(None);
        }
    };
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => {
            let holder = holder_pid(&file).map_or_else(String::new, |pid| format!(" (pid {pid})"));
            return Err(InUse { dir: dir.display().to_string(), holder });
        }
        Err(TryLockError::Error(e)) => {
            tracing::warn!(file = %path.display(), error = %e, "cache: cannot lock the directory (no flock on its file system?); not locked");
            return Ok(None);
        }
    }
    // The pid through a write-only fd of its own, closed at once: the fd that holds the
    // lock is read-only, so it does not keep the file system from being remounted
    // read-only (which refuses while a file is open for writing).
    let pid = OpenOptions::new()
        .write(true)
        .truncate(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(&path)
        .and_then(|mut f| f.write_all(format!("{}\n", std::process::id()).as_bytes()));
    if let Err(e) = pid {
        tracing::debug!(file = %path.display(), error = %e, "cache: cannot write the pid into the lock file");
    }
    Ok(Some(file))
}

/// Opens (creating it, 0600) the lock file read-only, never through a symlink and never
/// blocking on a FIFO; anything but a regular file in its place is removed and replaced.
/// Creating it needs the directory to be writable.
fn open(path: &Path) -> io::Result<File> {
    let once = || {
        let file = OpenOptions::new()
            .read(true)
            .mode(0o600)
            .custom_flags(libc::O_CREAT | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
            .open(path)?;
        if file.metadata()?.file_type().is_file() { Ok(file) } else { Err(io::Error::from_raw_os_error(libc::ELOOP)) }
    };
    match once() {
        // A symlink (O_NOFOLLOW) or a FIFO, device or socket: not packd's.
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) || e.raw_os_error() == Some(libc::ENXIO) => {
            std::fs::remove_file(path)?;
            once()
        }
        other => other,
    }
}

/// The pid the lock file names, if it names one.
fn holder_pid(file: &File) -> Option<u32> {
    let mut text = String::new();
    file.take(32).read_to_string(&mut text).ok()?;
    text.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_with_the_first_ones_pid_and_a_dropped_lock_is_free() {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("a/cache");
        let first = acquire(&cache).unwrap().expect("locked");
        let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&cache).unwrap().permissions());
        assert_eq!(mode & 0o777, 0o700, "the directory is created private");
        let err = acquire(&cache).expect_err("a second lock of the same directory");
        assert_eq!(err.holder, format!(" (pid {})", std::process::id()));
        assert!(err.to_string().contains(cache.to_str().unwrap()), "{err}");
        drop(first);
        let again = acquire(&cache).unwrap();
        assert!(again.is_some(), "a dropped lock can be taken again");
    }

    #[test]
    fn a_fifo_or_a_symlink_in_place_of_the_lock_file_is_replaced_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, b"keep me").unwrap();
        std::os::unix::fs::symlink(&target, dir.path().join(NAME)).unwrap();
        let lock = acquire(dir.path()).unwrap().expect("locked");
        assert_eq!(std::fs::read(&target).unwrap(), b"keep me", "the symlink's target is untouched");
        assert!(std::fs::symlink_metadata(dir.path().join(NAME)).unwrap().file_type().is_file());
        drop(lock);

        std::fs::remove_file(dir.path().join(NAME)).unwrap();
        nix::unistd::mkfifo(&dir.path().join(NAME), nix::sys::stat::Mode::S_IRWXU).unwrap();
        let lock = acquire(dir.path()).unwrap().expect("locked, without blocking on the FIFO");
        assert!(std::fs::symlink_metadata(dir.path().join(NAME)).unwrap().file_type().is_file());
        drop(lock);
    }
}
