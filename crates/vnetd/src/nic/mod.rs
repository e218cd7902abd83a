//! Virtual NICs: how guest frames enter and leave the daemon.
//!
//! A guest's NIC is a TAP device, attached one of two ways:
//! - `Nic::Tap`: vnetd holds the TAP's file side; the network device is the
//!   guest's NIC (moved into a guest namespace or container).
//! - `Nic::Qemu`: QEMU holds the file side (`-netdev tap,ifname=..`); vnetd
//!   reads and writes the TAP device through a packet socket.

pub mod packet;
pub mod tap;

use anyhow::Result;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use vnet_core::offload::{VnetHdr, VNET_HDR_LEN};

pub use packet::PacketPort;
pub use tap::Tap;

pub enum Nic {
    Tap(Tap),
    Qemu { port: PacketPort, device: String },
}

/// One received frame: `buf[start..end]`, and its offload metadata if any.
pub struct Received {
    pub start: usize,
    pub end: usize,
    pub vnet: Option<VnetHdr>,
}

impl Nic {
    pub fn qemu(device: &str, mtu: u32) -> Result<Nic> {
        Tap::create_for_qemu(device, mtu)?;
        match PacketPort::bind(device) {
            Ok(port) => Ok(Nic::Qemu { port, device: device.to_string() }),
            Err(e) => {
                let _ = tap::delete_device(device);
                Err(e)
            }
        }
    }

    #[inline]
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<Received> {
        match self {
            Nic::Tap(t) => t.recv(buf).map(|n| Received { start: 0, end: n, vnet: None }),
            Nic::Qemu { port, .. } => {
                let n = port.recv(buf)?;
                let vnet = VnetHdr::parse(&buf[..n]).ok_or_else(|| io::Error::from_raw_os_error(libc::EPROTO))?;
                Ok(Received { start: VNET_HDR_LEN, end: n, vnet: Some(vnet) })
            }
        }
    }

    #[inline]
    pub fn send(&self, frame: &[u8]) -> io::Result<usize> {
        match self {
            Nic::Tap(t) => t.send(frame),
            Nic::Qemu { port, .. } => port.send(frame),
        }
    }
}

impl AsRawFd for Nic {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Nic::Tap(t) => t.as_raw_fd(),
            Nic::Qemu { port, .. } => port.as_raw_fd(),
        }
    }
}

impl Drop for Nic {
    /// A TAP made for QEMU is persistent: remove it with its interface.
    fn drop(&mut self) {
        if let Nic::Qemu { device, .. } = self {
            if let Err(e) = tap::delete_device(device) {
                tracing::warn!("cannot delete TAP {device}: {e}");
            }
        }
    }
}
