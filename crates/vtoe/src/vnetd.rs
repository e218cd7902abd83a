//! The runner's session with its host's vnetd: a Unix SOCK_SEQPACKET
//! socket, one `vnet_core::vtoe` message a packet, sockets passed with
//! SCM_RIGHTS.

use anyhow::{anyhow, bail, Context, Result};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use vnet_core::vtoe::{FromVnetd, ToVnetd, MAX_MSG, RUNNER_VERSION};

pub struct Vnetd {
    sock: OwnedFd,
}

impl Vnetd {
    /// Connects and says hello; fails if vnetd is not there, does not offer
    /// VTOE to this namespace, or speaks another version.
    pub fn connect(path: &Path) -> Result<Vnetd> {
        // SAFETY: a plain socket(2), owned at once.
        let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error().into());
        }
        // SAFETY: fd is ours.
        let sock = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: sockaddr_un is plain old data.
        let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        sa.sun_family = libc::AF_UNIX as u16;
        let p = path.as_os_str().as_encoded_bytes();
        if p.len() >= sa.sun_path.len() {
            bail!("socket path {} is too long", path.display());
        }
        for (d, s) in sa.sun_path.iter_mut().zip(p) {
            *d = *s as libc::c_char;
        }
        // SAFETY: connect with the sockaddr_un above.
        let r = unsafe { libc::connect(sock.as_raw_fd(), (&sa as *const libc::sockaddr_un).cast(), std::mem::size_of::<libc::sockaddr_un>() as u32) };
        if r < 0 {
            return Err(io::Error::last_os_error()).with_context(|| format!("cannot reach vnetd's VTOE socket {}", path.display()));
        }
        let tv = libc::timeval { tv_sec: 1, tv_usec: 0 };
        // SAFETY: SO_RCVTIMEO with a timeval.
        unsafe {
            libc::setsockopt(sock.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVTIMEO, (&tv as *const libc::timeval).cast(), std::mem::size_of::<libc::timeval>() as u32)
        };
        let v = Vnetd { sock };
        v.send(&ToVnetd::Hello { version: RUNNER_VERSION })?;
        match v.recv()? {
            Some((FromVnetd::Welcome { version: RUNNER_VERSION }, _)) => {}
            Some((FromVnetd::NotGuest, _)) => bail!("vnetd serves no interface in this network namespace"),
            Some((m, _)) => bail!("vnetd answered {m:?}"),
            None => bail!("vnetd closed the session (another version of VTOE?)"),
        }
        // From now on the supervisor waits for it with poll.
        let tv = libc::timeval { tv_sec: 0, tv_usec: 0 };
        // SAFETY: as above.
        unsafe {
            libc::setsockopt(v.sock.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVTIMEO, (&tv as *const libc::timeval).cast(), std::mem::size_of::<libc::timeval>() as u32)
        };
        Ok(v)
    }

    pub fn fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }

    pub fn send(&self, m: &ToVnetd) -> io::Result<()> {
        let b = m.encode();
        // SAFETY: send from a buffer we own.
        let n = unsafe { libc::send(self.sock.as_raw_fd(), b.as_ptr().cast(), b.len(), libc::MSG_NOSIGNAL) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Sends a message with a socket (a Listen, with the listening socket
    /// that proves it).
    pub fn send_with(&self, m: &ToVnetd, fd: RawFd) -> io::Result<()> {
        let b = m.encode();
        let mut iov = libc::iovec { iov_base: b.as_ptr() as *mut libc::c_void, iov_len: b.len() };
        let mut space: vnet_sys::cmsg::Space = [0; 8];
        // SAFETY: msghdr is plain data; all-zero is valid.
        let mut h: libc::msghdr = unsafe { std::mem::zeroed() };
        h.msg_iov = &mut iov;
        h.msg_iovlen = 1;
        vnet_sys::cmsg::put(&mut h, &mut space, libc::SOL_SOCKET, libc::SCM_RIGHTS, &fd.to_ne_bytes());
        // SAFETY: h points at live buffers.
        if unsafe { libc::sendmsg(self.sock.as_raw_fd(), &h, libc::MSG_NOSIGNAL) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// The next message and the socket that came with it; None when vnetd
    /// closed the session.
    pub fn recv(&self) -> Result<Option<(FromVnetd, Option<OwnedFd>)>> {
        let mut buf = [0u8; 4 * MAX_MSG];
        let (n, fds) = vnet_sys::cmsg::recv_with_fds(self.sock.as_raw_fd(), &mut buf).context("vnetd session")?;
        // One socket comes with a message at most; any more are closed here.
        let fd = fds.into_iter().next();
        if n == 0 {
            return Ok(None);
        }
        let m = FromVnetd::decode(&buf[..n]).map_err(|e| anyhow!("vnetd sent a bad message: {e}"))?;
        Ok(Some((m, fd)))
    }
}
