//! The runner's session with its host's vnetd: a Unix SOCK_SEQPACKET
//! socket, one `vnet_core::vtoe` message a packet, sockets passed with
//! SCM_RIGHTS.

use anyhow::{anyhow, bail, Context, Result};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use vnet_core::vtoe::{FromVnetd, ToVnetd, MAX_MSG, VERSION};

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
        v.send(&ToVnetd::Hello { version: VERSION })?;
        match v.recv()? {
            Some((FromVnetd::Welcome { version: VERSION }, _)) => {}
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

    /// The next message and the socket that came with it; None when vnetd
    /// closed the session.
    pub fn recv(&self) -> Result<Option<(FromVnetd, Option<OwnedFd>)>> {
        let mut buf = [0u8; 4 * MAX_MSG];
        let mut cbuf = [0u64; 8];
        let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
        // SAFETY: msghdr is plain old data.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&cbuf);
        let n = loop {
            // SAFETY: recvmsg into the buffers above.
            let n = unsafe { libc::recvmsg(self.sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
            if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            break n;
        };
        if n < 0 {
            return Err(io::Error::last_os_error()).context("vnetd session");
        }
        let mut fd = None;
        // SAFETY: walking the control messages recvmsg filled in.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let got = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const RawFd);
                    fd = Some(OwnedFd::from_raw_fd(got));
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        if n == 0 {
            return Ok(None);
        }
        let m = FromVnetd::decode(&buf[..n as usize]).map_err(|e| anyhow!("vnetd sent a bad message: {e}"))?;
        Ok(Some((m, fd)))
    }
}
