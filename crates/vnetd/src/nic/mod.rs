//! Virtual NICs: how guest frames enter and leave the daemon.
//!
//! A guest's NIC is a TAP device, attached one of two ways:
//! - `Nic::Tap`: vnetd holds the TAP's file side; the network device is the
//!   guest's NIC (moved into a guest namespace or container).
//! - `Nic::Qemu`: QEMU holds the file side (`-netdev tap,ifname=..`); vnetd
//!   reads and writes the TAP device through a packet socket.
//!
//! Persistent TAPs (`netns` and `qemu` kinds) carry vnetd's mark (`rtnl`);
//! only marked ones are taken over, un-persisted or deleted.

pub mod packet;
pub mod rtnl;
pub mod tap;

use anyhow::Result;
use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, RawFd};
use vnet_core::offload::{VnetHdr, VNET_HDR_LEN};

pub use packet::PacketPort;

/// Most pieces one frame is sent in (a merged super-frame: its headers and
/// up to `vnet_core::offload::MAX_RUN` payloads).
pub const MAX_PARTS: usize = 64;
pub use tap::{QemuTap, Tap};

pub enum Nic {
    Tap(Tap),
    Qemu { port: PacketPort, tap: QemuTap },
}

/// One received frame: `buf[start..end]`, and its offload metadata.
pub struct Received {
    pub start: usize,
    pub end: usize,
    pub vnet: VnetHdr,
}

impl Nic {
    /// A QEMU TAP: made (or, if vnetd made it earlier, taken over) and
    /// read through a packet socket. If the socket cannot be bound, a TAP
    /// made here goes again and one taken over stays.
    pub fn qemu(device: &str, mtu: u32) -> Result<Nic> {
        let tap = Tap::create_for_qemu(device, mtu)?;
        let port = PacketPort::bind(device)?;
        Ok(Nic::Qemu { port, tap })
    }

    /// The request that holds this NIC committed with it in force: a
    /// persistent TAP stays when vnetd exits (a QEMU TAP goes with vnetd,
    /// as it goes with its interface).
    pub fn in_force(&self) {
        match self {
            Nic::Tap(t) => t.keep(),
            Nic::Qemu { tap, .. } => tap.remove_on_drop(true),
        }
    }

    /// The request that deleted this NIC's interface committed: its
    /// persistent TAP goes with it, unless only detached (the device stays
    /// for another vnetd, e.g. after a migration).
    pub fn deleted(&self, detach: bool) {
        match self {
            Nic::Tap(t) if !detach => t.remove_on_close(),
            Nic::Tap(_) => {}
            Nic::Qemu { tap, .. } => tap.remove_on_drop(!detach),
        }
    }

    /// Reads one frame: `buf[start..end]`, with its offload metadata.
    #[inline]
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<Received> {
        let n = match self {
            Nic::Tap(t) => t.recv(buf)?,
            Nic::Qemu { port, .. } => port.recv(buf)?,
        };
        let vnet = VnetHdr::parse(&buf[..n]).ok_or_else(|| io::Error::from_raw_os_error(libc::EPROTO))?;
        Ok(Received { start: VNET_HDR_LEN, end: n, vnet })
    }

    /// Sends one frame made of `parts`, with offload metadata `vnet` (all
    /// zero for a plain frame); returns the frame's length.
    #[inline]
    pub fn send(&self, vnet: &VnetHdr, parts: &[&[u8]]) -> io::Result<usize> {
        let fd = match self {
            Nic::Tap(t) => t.as_raw_fd(),
            Nic::Qemu { port, .. } => port.as_raw_fd(),
        };
        send_vnet(fd, vnet, parts)
    }
}

/// Writes one frame made of `parts`, preceded by its virtio-net header, to a
/// TAP or packet socket `fd`; returns the frame's length.
#[inline]
pub fn send_vnet(fd: RawFd, vnet: &VnetHdr, parts: &[&[u8]]) -> io::Result<usize> {
    let mut hdr = [0u8; VNET_HDR_LEN];
    vnet.write(&mut hdr);
    let mut iov = [IoSlice::new(&[]); MAX_PARTS + 1];
    iov[0] = IoSlice::new(&hdr);
    let n_parts = parts.len().min(MAX_PARTS);
    for (slot, p) in iov[1..].iter_mut().zip(&parts[..n_parts]) {
        *slot = IoSlice::new(p);
    }
    let n = tap::writev(fd, &iov[..1 + n_parts])?;
    Ok(n.saturating_sub(VNET_HDR_LEN))
}

impl AsRawFd for Nic {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Nic::Tap(t) => t.as_raw_fd(),
            Nic::Qemu { port, .. } => port.as_raw_fd(),
        }
    }
}
