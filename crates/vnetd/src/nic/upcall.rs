//! How vnetd exchanges frames with a guest port the kernel fast path
//! attaches to (a veth's host end, a QEMU TAP), or, without the fast path,
//! with the same device through a packet socket.
//!
//! With the fast path, every frame the guest sends meets `from_guest` on
//! the device's ingress: a hit is carried in the kernel, a miss is
//! redirected to this port's *upcall TAP*, whose file side vnetd reads as it
//! reads any TAP (virtio-net headers, offloads and all). Frames vnetd sends
//! to the guest are written to the upcall TAP, and `from_vnetd` passes them
//! on (into the veth's peer, or out of QEMU's TAP). So vnetd sees exactly
//! the frames the fast path did not take, with their origin known: the TAP
//! is this port's alone. A packet socket cannot be used beside the fast
//! path: it sees every frame before TC ingress runs.

use super::tap::Tap;
use super::{parse_received, Received, VirtualNic};
use crate::sys::netdev::send_vnet;
use crate::sys::packet::PacketPort;
use crate::sys::rtnl;
use anyhow::{anyhow, Context, Result};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use vnet_core::offload::VnetHdr;
use vnet_core::Mac;
use vnet_fastpath::{Action, Attached, Kernel};

/// A short stable tag for device names derived from `key`.
pub fn tag(key: &str) -> String {
    format!("{:012x}", vnet_core::name_hash(key) & 0xffff_ffff_ffff)
}

pub enum GuestPort {
    /// The fast path's upcall TAP and the two attached programs.
    Upcall { tap: Tap, index: u32, target: Action, _attached: (Attached, Attached) },
    /// No fast path: a packet socket on the device.
    Packet(PacketPort),
}

impl GuestPort {
    /// Attaches to the device `dev` (index `dev_index`): to the fast path
    /// if `kernel` is loaded, with an upcall TAP named `upcall`, else
    /// through a packet socket. `veth`: the device is a veth's host end
    /// (frames for the guest go into its peer); else frames for the guest
    /// leave through it (a TAP whose file side QEMU holds).
    pub fn attach(kernel: Option<&Arc<Kernel>>, iface: u32, dev: &str, dev_index: u32, upcall: &str, mtu: u32, veth: bool) -> Result<GuestPort> {
        let Some(k) = kernel else {
            return Ok(GuestPort::Packet(PacketPort::bind(dev)?));
        };
        // Persistent, so that it outlives vnetd with the attachments that
        // name it: a vnetd started again takes it over, frames and all.
        let (tap, _) = Tap::create_persistent(upcall, mtu, Mac([0x02, 0, 0, 0, 0, 1])).with_context(|| format!("upcall TAP {upcall}"))?;
        // Nobody talks on it but vnetd (no IPv6 autoconf from the host).
        let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{upcall}/disable_ipv6"), "1");
        let up_index = rtnl::device(upcall)?.ok_or_else(|| anyhow!("TAP {upcall} vanished"))?.index;
        rtnl::set_up(up_index).with_context(|| format!("cannot bring {upcall} up"))?;
        let attached = k.attach_port(iface, dev_index, up_index, veth)?;
        let target = if veth { Action::Peer { ifindex: dev_index } } else { Action::Device { ifindex: dev_index } };
        Ok(GuestPort::Upcall { tap, index: up_index, target, _attached: attached })
    }

    /// Its request committed: the upcall TAP and the attachments stay
    /// when vnetd exits (the kernel keeps carrying the guest's flows, and
    /// the next vnetd takes them over).
    pub fn in_force(&self) {
        if let GuestPort::Upcall { tap, _attached: (a, b), .. } = self {
            tap.keep();
            a.keep(true);
            b.keep(true);
        }
    }

    /// Its interface was deleted or detached: the upcall TAP and the
    /// attachments go with it (a detached guest's device stays, outside
    /// VNET).
    pub fn deleted(&self) {
        if let GuestPort::Upcall { tap, _attached: (a, b), .. } = self {
            tap.remove_on_close();
            a.keep(false);
            b.keep(false);
        }
    }

    #[inline]
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<Received> {
        let n = match self {
            GuestPort::Upcall { tap, .. } => tap.recv(buf)?,
            GuestPort::Packet(p) => p.recv(buf)?,
        };
        parse_received(buf, n)
    }

    #[inline]
    pub fn send(&self, vnet: &VnetHdr, parts: &[&[u8]]) -> io::Result<usize> {
        send_vnet(self.fd(), vnet, parts)
    }

    pub fn fd(&self) -> RawFd {
        match self {
            GuestPort::Upcall { tap, .. } => tap.as_raw_fd(),
            GuestPort::Packet(p) => p.as_raw_fd(),
        }
    }

    pub fn fast_target(&self) -> Option<Action> {
        match self {
            GuestPort::Upcall { target, .. } => Some(*target),
            GuestPort::Packet(_) => None,
        }
    }

    pub fn describe(&self) -> &'static str {
        match self {
            GuestPort::Upcall { .. } => "path=kernel",
            GuestPort::Packet(_) => "path=user",
        }
    }

    /// Frames the fast path handed to vnetd that the upcall TAP's queue had
    /// no room for (the kernel's count).
    pub fn upcall_dropped(&self) -> u64 {
        match self {
            GuestPort::Upcall { index, .. } => rtnl::tx_dropped(*index).unwrap_or(0),
            GuestPort::Packet(_) => 0,
        }
    }
}

/// The device behind a guest port, as it lives and goes: what differs
/// between a veth guest and a QEMU TAP.
pub trait PortDevice: Send + Sync {
    /// Its request committed with the interface in force.
    fn in_force(&self);
    /// Its interface was deleted (`detach`: the device stays).
    fn deleted(&self, detach: bool);
    /// What `INTERFACE LIST` shows of it.
    fn describe(&self) -> String {
        String::new()
    }
    /// Its counters for `STATS` (` key=value` pairs).
    fn extra_stats(&self) -> String {
        String::new()
    }
}

/// A NIC met through a `GuestPort`. Fields drop in order: the port (its
/// upcall TAP and attachments kept or removed, as its request settled)
/// before the device.
pub struct PortNic<D> {
    pub port: GuestPort,
    pub device: D,
}

impl<D: PortDevice> VirtualNic for PortNic<D> {
    #[inline]
    fn recv(&self, buf: &mut [u8]) -> io::Result<Received> {
        self.port.recv(buf)
    }

    #[inline]
    fn send(&self, vnet: &VnetHdr, parts: &[&[u8]]) -> io::Result<usize> {
        self.port.send(vnet, parts)
    }

    fn event_fd(&self, _queue: usize) -> RawFd {
        self.port.fd()
    }

    fn in_force(&self) {
        self.port.in_force();
        self.device.in_force();
    }

    fn deleted(&self, detach: bool) {
        self.port.deleted();
        self.device.deleted(detach);
    }

    fn fast_target(&self) -> Option<Action> {
        self.port.fast_target()
    }

    fn describe(&self) -> String {
        let d = self.device.describe();
        if d.is_empty() {
            self.port.describe().to_string()
        } else {
            format!("{d} {}", self.port.describe())
        }
    }

    fn upcall_dropped(&self) -> u64 {
        self.port.upcall_dropped()
    }

    fn extra_stats(&self) -> String {
        self.device.extra_stats()
    }
}
