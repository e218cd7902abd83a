//! A packet socket on a network device: frames the device receives are read
//! here, frames written here leave through the device. Used for a TAP whose
//! file side belongs to QEMU: what QEMU writes, the TAP device receives.
//!
//! The socket carries a `virtio_net_hdr` before every frame
//! (`PACKET_VNET_HDR`), so a guest's TSO super-frames and partial checksums
//! arrive labelled and can be finished in software.

use super::netdev::setsockopt_int;
use anyhow::{bail, Result};
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

const PACKET_VNET_HDR: libc::c_int = 15;
const PACKET_IGNORE_OUTGOING: libc::c_int = 23;

pub struct PacketPort {
    fd: OwnedFd,
}

impl PacketPort {
    pub fn bind(device: &str) -> Result<PacketPort> {
        let c = CString::new(device)?;
        // SAFETY: c is a valid C string.
        let index = unsafe { libc::if_nametoindex(c.as_ptr()) };
        if index == 0 {
            bail!("no device {device}: {}", io::Error::last_os_error());
        }
        // Protocol 0 until bound, so no frame of another device is queued.
        // SAFETY: plain socket(2), owned below.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            bail!("cannot open a packet socket: {}", io::Error::last_os_error());
        }
        // SAFETY: fd was just opened.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let raw = fd.as_raw_fd();
        setsockopt_int(raw, libc::SOL_PACKET, PACKET_VNET_HDR, 1).map_err(|e| anyhow::anyhow!("PACKET_VNET_HDR: {e}"))?;
        // Our own transmissions are not input.
        setsockopt_int(raw, libc::SOL_PACKET, PACKET_IGNORE_OUTGOING, 1).map_err(|e| anyhow::anyhow!("PACKET_IGNORE_OUTGOING: {e}"))?;
        // Past the sysctl caps: vnetd is root (SO_RCVBUFFORCE).
        if setsockopt_int(raw, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, 8 << 20).is_err() {
            let _ = setsockopt_int(raw, libc::SOL_SOCKET, libc::SO_RCVBUF, 8 << 20);
        }
        if setsockopt_int(raw, libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, 8 << 20).is_err() {
            let _ = setsockopt_int(raw, libc::SOL_SOCKET, libc::SO_SNDBUF, 8 << 20);
        }
        // SAFETY: sockaddr_ll is plain data; zeroed is valid.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = (libc::ETH_P_ALL as u16).to_be();
        sll.sll_ifindex = index as i32;
        // SAFETY: sll is a sockaddr_ll of the size given.
        let r = unsafe {
            libc::bind(raw, (&sll as *const libc::sockaddr_ll).cast(), std::mem::size_of::<libc::sockaddr_ll>() as u32)
        };
        if r < 0 {
            bail!("cannot bind a packet socket to {device}: {}", io::Error::last_os_error());
        }
        // Every frame, whatever its destination MAC.
        // SAFETY: packet_mreq is plain data; zeroed is valid.
        let mut mreq: libc::packet_mreq = unsafe { std::mem::zeroed() };
        mreq.mr_ifindex = index as i32;
        mreq.mr_type = libc::PACKET_MR_PROMISC as u16;
        // SAFETY: mreq is a packet_mreq of the size given.
        unsafe {
            libc::setsockopt(
                raw,
                libc::SOL_PACKET,
                libc::PACKET_ADD_MEMBERSHIP,
                (&mreq as *const libc::packet_mreq).cast(),
                std::mem::size_of::<libc::packet_mreq>() as u32,
            )
        };
        Ok(PacketPort { fd })
    }

    /// Reads one frame preceded by its `virtio_net_hdr`.
    #[inline]
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: buf is valid for writes of its length.
        let n = unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_TRUNC) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n as usize > buf.len() {
            return Err(io::Error::from_raw_os_error(libc::EMSGSIZE));
        }
        Ok(n as usize)
    }

}

impl AsRawFd for PacketPort {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}
