//! Segment seals and SCM_RIGHTS fd passing over Unix sockets, shared by the daemon and the
//! client so both
//! ends follow one set of rules: at most [`MAX_FDS`] fds per message, every received fd
//! owned at once (close-on-exec via `MSG_CMSG_CLOEXEC`), truncated control data reported
//! instead of silently losing fds. The only module of this crate with `unsafe`.

use std::io::{self, IoSlice};
use std::mem::{size_of, zeroed};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::fcntl::{FcntlArg, SealFlag, fcntl};
use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};

/// The seals every shared segment carries: applied by the daemon before its fd leaves,
/// checked by clients before they map it.
pub fn required_seals() -> SealFlag {
    SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_WRITE | SealFlag::F_SEAL_SEAL
}

/// `seals` as the kernel's names joined by `|` (`F_SEAL_SEAL|F_SEAL_WRITE`), or `none`.
pub fn seal_names(seals: SealFlag) -> String {
    let names: Vec<&str> = seals.iter_names().map(|(n, _)| n).collect();
    if names.is_empty() { "none".to_string() } else { names.join("|") }
}

/// Returns the seals on `fd` (`F_GET_SEALS`); EINVAL for files that cannot be sealed.
pub fn seals(fd: BorrowedFd<'_>) -> io::Result<SealFlag> {
    fcntl(fd, FcntlArg::F_GET_SEALS).map(SealFlag::from_bits_truncate).map_err(io::Error::from)
}

/// The kernel's limit of fds in one `SCM_RIGHTS` message (`SCM_MAX_FD`).
pub const MAX_FDS: usize = 253;

/// Sends `data` with `fds` attached as one `SCM_RIGHTS` message. Returns the bytes sent,
/// which on a stream socket may be fewer than `data.len()`: send the rest *without* fds.
/// `data` must not be empty (the kernel drops fds that travel without data).
pub fn send_with_fds(
    sock: BorrowedFd<'_>,
    data: &[u8],
    fds: &[BorrowedFd<'_>],
    nonblocking: bool,
) -> io::Result<usize> {
    send_vectored_with_fds(sock, &[IoSlice::new(data)], fds, nonblocking)
}

/// Like [`send_with_fds`], gathering the data from several buffers (one `sendmsg`, no
/// copy into one buffer first).
pub fn send_vectored_with_fds(
    sock: BorrowedFd<'_>,
    data: &[IoSlice<'_>],
    fds: &[BorrowedFd<'_>],
    nonblocking: bool,
) -> io::Result<usize> {
    if data.iter().all(|d| d.is_empty()) || fds.len() > MAX_FDS {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let cmsg = [ControlMessage::ScmRights(&raw)];
    let cmsgs: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &cmsg };
    let mut flags = MsgFlags::MSG_NOSIGNAL;
    if nonblocking {
        flags |= MsgFlags::MSG_DONTWAIT;
    }
    sendmsg::<()>(sock.as_raw_fd(), data, cmsgs, flags, None).map_err(io::Error::from)
}

/// Waits until `sock` has something to read, at most `timeout` (`None`: no limit).
/// Returns `true` when a read would not block: bytes are queued, or the peer closed its
/// end (the read then returns 0) or the socket has an error (the read reports it).
/// Returns `false` when the timeout passed or a signal interrupted the wait (also with no
/// limit): the caller looks at its deadline and waits again. Other `poll` failures
/// (`EINVAL`, `ENOMEM`) are returned as errors.
///
/// A thread blocked in `recvmsg` on a Unix stream socket is woken by every event on the
/// socket's wait queue, including the peer consuming what this side sent (the queue is
/// shared with writers waiting for room): a client waiting for a reply would wake once for
/// nothing per request. `poll` for `POLLIN` filters that wake-up out.
pub fn wait_readable(sock: BorrowedFd<'_>, timeout: Option<std::time::Duration>) -> io::Result<bool> {
    let ms = timeout.map_or(-1, |t| {
        // Round up, so a short timeout does not become a busy loop of zero-length polls.
        let ms = t.as_nanos().div_ceil(1_000_000);
        i32::try_from(ms).unwrap_or(i32::MAX)
    });
    let mut pfd = libc::pollfd { fd: sock.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: `pfd` is one valid pollfd on this frame, and the count passed is 1.
    let n = unsafe { libc::poll(&mut pfd, 1, ms) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted { Ok(false) } else { Err(e) };
    }
    Ok(n > 0)
}

/// What one `recvmsg` delivered.
#[derive(Debug)]
pub struct Received {
    /// Data bytes written to the buffer; 0 means the peer closed the connection.
    pub bytes: usize,
    /// The fds that arrived with these bytes, owned and close-on-exec.
    pub fds: Vec<OwnedFd>,
    /// The kernel dropped control data (`MSG_CTRUNC`): some fds were lost.
    pub truncated: bool,
}

/// Bytes of control buffer for [`MAX_FDS`] fds: `CMSG_SPACE(253 × 4)` = 16 bytes of
/// `cmsghdr` + 1 012 bytes of fds, rounded up to 8 = 1 032; 1 088 leaves room to spare
/// (checked against `CMSG_SPACE` by a unit test).
const CMSG_BYTES: usize = 1088;

/// Control buffer large enough for [`MAX_FDS`] fds, aligned for `cmsghdr`.
#[repr(C, align(8))]
struct CmsgBuf([u8; CMSG_BYTES]);

/// Receives into `buf` with close-on-exec for any fds. Every fd the kernel installed is
/// returned owned, even when the control data was truncated (at the open-file limit the
/// kernel installs some and drops the rest).
pub fn recv_with_fds(sock: BorrowedFd<'_>, buf: &mut [u8], nonblocking: bool) -> io::Result<Received> {
    recv_with_at_most(sock, buf, MAX_FDS, nonblocking)
}

/// Like [`recv_with_fds`], with a control buffer that has room for only `max_fds` fds
/// (at most [`MAX_FDS`]): the kernel installs no more than that and drops the rest,
/// setting `truncated`, so a peer cannot make this process hold more fds than it expects.
pub fn recv_with_at_most(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    max_fds: usize,
    nonblocking: bool,
) -> io::Result<Received> {
    let mut cbuf = CmsgBuf([0; CMSG_BYTES]);
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: an all-zero msghdr is a valid value (null name, no iov yet).
    let mut msg: libc::msghdr = unsafe { zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.0.as_mut_ptr().cast();
    let room = u32::try_from(max_fds.min(MAX_FDS) * size_of::<RawFd>()).unwrap_or(0);
    // SAFETY: CMSG_SPACE is a pure computation; for at most MAX_FDS fds it is at most 1032,
    // within `cbuf`.
    msg.msg_controllen = (unsafe { libc::CMSG_SPACE(room) } as usize).min(cbuf.0.len());
    let mut flags = libc::MSG_CMSG_CLOEXEC;
    if nonblocking {
        flags |= libc::MSG_DONTWAIT;
    }
    // SAFETY: `msg` points at `iov` (which covers exactly `buf`) and at `cbuf`, all of which
    // live on this frame for the duration of the call; lengths match the buffers.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, flags) };
    let bytes = usize::try_from(n).map_err(|_| io::Error::last_os_error())?;
    let mut fds = Vec::new();
    // SAFETY: `msg` was filled by a successful recvmsg; CMSG_FIRSTHDR/CMSG_NXTHDR only walk
    // within `msg_control[..msg_controllen]`, which the kernel set to what it wrote.
    let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !cmsg.is_null() {
        // SAFETY: `cmsg` is non-null and was produced by CMSG_FIRSTHDR/NXTHDR for `msg`, so
        // it points at a complete cmsghdr inside `cbuf`.
        let hdr = unsafe { &*cmsg };
        if hdr.cmsg_level == libc::SOL_SOCKET && hdr.cmsg_type == libc::SCM_RIGHTS {
            // SAFETY: CMSG_LEN(0) is a pure computation of the header size.
            let header = unsafe { libc::CMSG_LEN(0) } as usize;
            let count = (hdr.cmsg_len as usize).saturating_sub(header) / size_of::<RawFd>();
            // SAFETY: CMSG_DATA points just past the header inside the same message; the
            // kernel wrote `count` fds there (cmsg_len covers them). The data may be
            // unaligned for i32, so read it unaligned.
            let data = unsafe { libc::CMSG_DATA(cmsg) }.cast::<RawFd>();
            for i in 0..count {
                // SAFETY: `i < count`, so the read stays within the fds the kernel wrote.
                let fd = unsafe { data.add(i).read_unaligned() };
                if fd >= 0 {
                    // SAFETY: the kernel just installed `fd` in this process for us; nothing
                    // else owns it.
                    fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
        }
        // SAFETY: `cmsg` belongs to `msg` (see above); NXTHDR returns null past the end.
        cmsg = unsafe { libc::CMSG_NXTHDR(&msg, cmsg) };
    }
    Ok(Received { bytes, fds, truncated: msg.msg_flags & libc::MSG_CTRUNC != 0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_control_buffer_holds_max_fds() {
        let fds = u32::try_from(MAX_FDS * size_of::<RawFd>()).unwrap();
        // SAFETY: CMSG_SPACE only computes a size from its argument.
        let need = unsafe { libc::CMSG_SPACE(fds) } as usize;
        assert!(need <= CMSG_BYTES, "{MAX_FDS} fds need {need} bytes of control buffer");
    }
}
