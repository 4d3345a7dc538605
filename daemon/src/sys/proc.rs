//! Facts about this process read from `/proc` (no unsafe needed, kept beside the syscalls).

use std::fs;

/// Number of open fds of this process.
pub fn open_fd_count() -> usize {
    fs::read_dir("/proc/self/fd").map(|d| d.count().saturating_sub(1)).unwrap_or(0)
}

/// The system page size.
pub fn page_size() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .and_then(|v| u64::try_from(v).ok())
        .unwrap_or(4096)
}
