//! Socket queries the data plane needs beyond what tokio offers.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// Bytes waiting in the receive queue of a stream socket (`FIONREAD`). The data plane reads
/// a frame's body only once all of it is queued, so a client that stops halfway holds
/// kernel buffer space on its own socket, never daemon memory.
pub fn queued_bytes(sock: BorrowedFd<'_>) -> io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one c_int through the pointer, which points at `n`, alive and
    // writable for the duration of the call; `sock` is an open fd for the call's duration.
    let r = unsafe { libc::ioctl(sock.as_raw_fd(), libc::FIONREAD, &mut n) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(usize::try_from(n).unwrap_or(0))
}

/// The supplementary groups of the process that connected a Unix socket, as the kernel
/// recorded them at `connect` (`SO_PEERGROUPS`, Linux 4.13+): unlike reading
/// `/proc/PID/status` later, nothing the peer does afterwards can change the answer.
pub fn peer_groups(sock: BorrowedFd<'_>) -> io::Result<Vec<u32>> {
    // NGROUPS_MAX is 65536; start with room for 64 and grow to what the kernel asks for.
    let mut groups: Vec<libc::gid_t> = vec![0; 64];
    loop {
        let mut len = libc::socklen_t::try_from(groups.len() * std::mem::size_of::<libc::gid_t>())
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: the kernel writes at most `len` bytes into `groups`' buffer, which is
        // alive, writable and `len` bytes long; it writes the needed length into `len`.
        let r = unsafe {
            libc::getsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let needed = len as usize / std::mem::size_of::<libc::gid_t>();
        if r == 0 {
            groups.truncate(needed);
            return Ok(groups);
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::ERANGE) || needed <= groups.len() || needed > 65_536 {
            return Err(err);
        }
        groups.resize(needed, 0);
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::fd::AsFd;

    #[test]
    fn counts_queued_bytes() {
        let (mut a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        assert_eq!(super::queued_bytes(b.as_fd()).unwrap(), 0);
        a.write_all(b"hello").unwrap();
        a.write_all(b", world").unwrap();
        assert_eq!(super::queued_bytes(b.as_fd()).unwrap(), 12);
    }

    #[test]
    fn peer_groups_are_this_process_groups() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut got = super::peer_groups(a.as_fd()).unwrap();
        let mut want: Vec<u32> = nix::unistd::getgroups().unwrap().iter().map(|g| g.as_raw()).collect();
        got.sort_unstable();
        want.sort_unstable();
        want.dedup();
        got.dedup();
        assert_eq!(got, want);
    }
}
