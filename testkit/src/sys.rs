//! The only `unsafe` of the test kit: starting a process the way systemd does, with fds in
//! place from 3 on (`LISTEN_FDS`).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;

use nix::fcntl::{FcntlArg, fcntl};

/// Makes `cmd`'s child receive `fds` as fds 3, 4, … in order. Each is first duplicated
/// to a high close-on-exec number in this process, so moving one into place in the child
/// cannot clobber another; the duplicates live as long as `cmd`.
pub fn pass_fds(cmd: &mut Command, fds: &[OwnedFd]) -> io::Result<()> {
    let mut high = Vec::with_capacity(fds.len());
    for fd in fds {
        let n = fcntl(fd, FcntlArg::F_DUPFD_CLOEXEC(1000)).map_err(io::Error::from)?;
        // SAFETY: F_DUPFD_CLOEXEC just created fd `n` for this process; nothing else owns it.
        high.push(unsafe { OwnedFd::from_raw_fd(n) });
    }
    let moves: Vec<(RawFd, RawFd)> = high.iter().map(AsRawFd::as_raw_fd).zip(3..).collect();
    // SAFETY: the closure runs in the forked child before exec and only calls dup2, which is
    // async-signal-safe; `moves` was built before the fork and is only read. The duplicates
    // in `high` stay open while the closure (owned by `cmd`) exists.
    unsafe {
        cmd.pre_exec(move || {
            let _keep = &high;
            for &(from, to) in &moves {
                if libc::dup2(from, to) < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    Ok(())
}
