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
}
