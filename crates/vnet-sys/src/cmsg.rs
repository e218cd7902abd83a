//! Control messages (ancillary data), walked and written in one place: the
//! UDP GRO segment size vnetd receives, the UDP GSO segment size it sends,
//! and descriptors passed over Unix sockets (SCM_RIGHTS).

use std::io;
use std::mem::size_of;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// Room for a few control messages, aligned as `cmsghdr` needs.
pub type Space = [u64; 8];

/// Calls `f(level, type, data)` for each control message `recvmsg` left in
/// `h`. `data` is the message's payload as the kernel wrote it.
///
/// # Safety
/// `h.msg_control`/`h.msg_controllen` describe a buffer that `recvmsg` (or
/// `recvmmsg`) filled, still alive and unchanged.
pub unsafe fn each(h: &libc::msghdr, mut f: impl FnMut(i32, i32, &[u8])) {
    if h.msg_control.is_null() {
        return;
    }
    // SAFETY: the caller's contract: the CMSG_* walk stays inside the buffer.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(h);
        while !c.is_null() {
            let data = libc::CMSG_DATA(c);
            let len = ((*c).cmsg_len as usize).saturating_sub(data.offset_from(c.cast::<u8>()) as usize);
            f((*c).cmsg_level, (*c).cmsg_type, std::slice::from_raw_parts(data, len));
            c = libc::CMSG_NXTHDR(h, c);
        }
    }
}

/// The `int` carried by the control message (`level`, `ty`) in `h`, if any.
///
/// # Safety
/// As for `each`.
pub unsafe fn find_int(h: &libc::msghdr, level: i32, ty: i32) -> Option<i32> {
    let mut found = None;
    // SAFETY: the caller's contract.
    unsafe {
        each(h, |l, t, d| {
            if l == level && t == ty && d.len() >= size_of::<i32>() {
                found = Some(i32::from_ne_bytes([d[0], d[1], d[2], d[3]]));
            }
        })
    };
    found
}

/// The descriptors received in `h` (every SCM_RIGHTS one, so none leaks),
/// owned by the caller from here on.
///
/// # Safety
/// As for `each`; and the descriptors in it were received by this process
/// (not yet owned by anything else).
pub unsafe fn fds(h: &libc::msghdr) -> Vec<OwnedFd> {
    let mut out = Vec::new();
    // SAFETY: the caller's contract.
    unsafe {
        each(h, |l, t, d| {
            if l == libc::SOL_SOCKET && t == libc::SCM_RIGHTS {
                for c in d.chunks_exact(size_of::<RawFd>()) {
                    let fd = RawFd::from_ne_bytes([c[0], c[1], c[2], c[3]]);
                    out.push(OwnedFd::from_raw_fd(fd));
                }
            }
        })
    };
    out
}

/// Writes one control message (`level`, `ty`, `data`) into `space` and
/// points `h` at it.
///
/// # Panics
/// If `data` does not fit `space` (a programming error: the callers send a
/// `u16` or one descriptor).
pub fn put(h: &mut libc::msghdr, space: &mut Space, level: i32, ty: i32, data: &[u8]) {
    // SAFETY: CMSG_SPACE and CMSG_LEN are pure computations.
    let (room, len) = unsafe { (libc::CMSG_SPACE(data.len() as u32) as usize, libc::CMSG_LEN(data.len() as u32) as usize) };
    assert!(room <= size_of::<Space>(), "control message too large");
    h.msg_control = space.as_mut_ptr().cast();
    h.msg_controllen = room;
    // SAFETY: `space` is aligned for cmsghdr and has `room` bytes, so the
    // header CMSG_FIRSTHDR returns and its `data.len()` bytes are inside it.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(h);
        (*c).cmsg_level = level;
        (*c).cmsg_type = ty;
        (*c).cmsg_len = len;
        std::ptr::copy_nonoverlapping(data.as_ptr(), libc::CMSG_DATA(c), data.len());
    }
}

/// Sends one byte with the descriptor `fd` over the Unix socket `sock`.
pub fn send_fd(sock: RawFd, fd: RawFd) -> io::Result<()> {
    send_with_fd(sock, &[0u8], fd)
}

/// Sends `bytes` (one message on a SOCK_SEQPACKET socket) with the
/// descriptor `fd` over the Unix socket `sock`.
pub fn send_with_fd(sock: RawFd, bytes: &[u8], fd: RawFd) -> io::Result<()> {
    let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() };
    let mut space: Space = [0; 8];
    // SAFETY: msghdr is plain data; all-zero is valid.
    let mut h: libc::msghdr = unsafe { std::mem::zeroed() };
    h.msg_iov = &mut iov;
    h.msg_iovlen = 1;
    put(&mut h, &mut space, libc::SOL_SOCKET, libc::SCM_RIGHTS, &fd.to_ne_bytes());
    // SAFETY: h points at live buffers.
    if unsafe { libc::sendmsg(sock, &h, libc::MSG_NOSIGNAL) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Receives up to `buf.len()` bytes and the descriptors sent with them from
/// the Unix socket `sock` (close-on-exec): (bytes, descriptors). Retried on
/// EINTR; 0 bytes and no descriptor when the peer closed.
pub fn recv_with_fds(sock: RawFd, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    let mut space: Space = [0; 8];
    // SAFETY: msghdr is plain data; all-zero is valid.
    let mut h: libc::msghdr = unsafe { std::mem::zeroed() };
    h.msg_iov = &mut iov;
    h.msg_iovlen = 1;
    h.msg_control = space.as_mut_ptr().cast();
    h.msg_controllen = size_of::<Space>();
    let n = loop {
        // SAFETY: recvmsg into the buffers above.
        let n = unsafe { libc::recvmsg(sock, &mut h, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        }
        break n;
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: recvmsg just filled the control buffer with what this
    // process received.
    let fds = unsafe { fds(&h) };
    Ok((n as usize, fds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_descriptor_crosses_a_unix_socket_and_every_one_received_is_owned() {
        let (a, b) = UnixStream::pair().unwrap();
        let file = std::fs::File::open("/dev/null").unwrap();
        send_fd(a.as_raw_fd(), file.as_raw_fd()).unwrap();
        let mut buf = [0u8; 4];
        let (n, fds) = recv_with_fds(b.as_raw_fd(), &mut buf).unwrap();
        assert_eq!((n, fds.len()), (1, 1));
        assert_ne!(fds[0].as_raw_fd(), file.as_raw_fd(), "a new descriptor of the same file");
        // No descriptor: none returned.
        use std::io::Write;
        (&a).write_all(b"x").unwrap();
        let (n, fds) = recv_with_fds(b.as_raw_fd(), &mut buf).unwrap();
        assert_eq!((n, fds.len()), (1, 0));
    }

    #[test]
    fn put_then_walk_gives_the_message_back() {
        let mut space: Space = [0; 8];
        // SAFETY: msghdr is plain data.
        let mut h: libc::msghdr = unsafe { std::mem::zeroed() };
        put(&mut h, &mut space, libc::SOL_UDP, 103, &1400u16.to_ne_bytes());
        let mut seen = Vec::new();
        // SAFETY: h points at `space`, which put just wrote.
        unsafe { each(&h, |l, t, d| seen.push((l, t, d.to_vec()))) };
        assert_eq!(seen, vec![(libc::SOL_UDP, 103, 1400u16.to_ne_bytes().to_vec())]);
        put(&mut h, &mut space, libc::SOL_UDP, 104, &9000i32.to_ne_bytes());
        // SAFETY: as above.
        assert_eq!(unsafe { find_int(&h, libc::SOL_UDP, 104) }, Some(9000));
        assert_eq!(unsafe { find_int(&h, libc::SOL_UDP, 103) }, None);
    }
}
