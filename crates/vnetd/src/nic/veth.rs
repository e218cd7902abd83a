//! A veth guest NIC: the guest's end (`<name>`, with the guest's MAC) in
//! its network namespace, the host's end in vnetd's, where the kernel fast
//! path attaches.
//!
//! With the fast path loaded, every frame the guest sends meets
//! `from_guest` on the host end: a hit is carried in the kernel, a miss is
//! redirected to this port's *upcall TAP*, whose file side vnetd reads as
//! it reads any TAP. Frames vnetd sends to the guest are written to the
//! upcall TAP, and `from_vnetd` passes them into the guest's end. So the
//! slow path sees exactly the frames the fast path did not take, with their
//! origin known (the TAP is this port's alone), offloads and all. Without
//! the fast path, vnetd reads and writes the host end through a packet
//! socket, as it does a QEMU TAP.
//!
//! Names: the host end is `vh<hash>` and the upcall TAP `vu<hash>`, from a
//! hash of `<netns>/<name>`, so a vnetd started again finds the host end of
//! a guest it made (both ends carry vnetd's mark; an unmarked device of
//! that name is refused and left alone). The pair stays when vnetd exits
//! with the interface in force, like a namespace TAP; it goes with
//! `INTERFACE DEL` (not with `detach`).

use super::upcall::{tag, GuestPort, PortDevice, PortNic};
use crate::sys::{netdev, rtnl};
use anyhow::{anyhow, bail, Context, Result};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use vnet_core::Mac;
use vnet_fastpath::Kernel;

/// The names of a guest's host-side devices: (host end, upcall TAP).
pub fn host_names(netns: &str, name: &str) -> (String, String) {
    let t = tag(&format!("{netns}/{name}"));
    (format!("vh{t}"), format!("vu{t}"))
}

/// A veth guest's NIC.
pub type VethNic = PortNic<VethPair>;

/// The pair, seen from vnetd's side.
pub struct VethPair {
    /// The guest's end, in its namespace.
    guest: String,
    host: String,
    host_index: u32,
    /// Delete the pair when this goes (its request failed, or its interface
    /// was deleted without `detach`).
    remove: AtomicBool,
}

impl PortNic<VethPair> {
    /// Makes the pair (or takes over the one an earlier vnetd made) and
    /// attaches it: to the fast path if `kernel` is loaded (`iface` is the
    /// interface's id), else through a packet socket. `name` is the guest's
    /// end in `netns`.
    pub fn new(name: &str, mac: Mac, mtu: u32, netns: &str, iface: u32, kernel: Option<&Arc<Kernel>>) -> Result<VethNic> {
        let (host, upcall) = host_names(netns, name);
        let (host_index, made) = match rtnl::device(&host).with_context(|| format!("cannot look up {host}"))? {
            Some(d) if d.is_vnetds_veth() => (d.index, false),
            Some(_) => bail!("a device named {host} exists on this host and is not a veth vnetd made; vnetd leaves it alone"),
            None => {
                let ns = netdev::open_netns(netns)?;
                rtnl::create_veth(&host, name, ns.as_raw_fd(), mac.0, mtu).map_err(|e| match e.raw_os_error() {
                    Some(libc::EEXIST) => anyhow!("cannot make veth {name} in {netns}: a device named {name} exists there"),
                    _ => anyhow!("cannot make veth {name} in {netns}: {e}"),
                })?;
                let d = rtnl::device(&host)?.ok_or_else(|| anyhow!("veth {host} vanished as it was made"))?;
                (d.index, true)
            }
        };
        // From here on, a pair made now goes again if anything fails.
        let undo = Undo(made.then_some(host_index));
        // The host must not talk on the guest's wire (IPv6 autoconf etc.).
        let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{host}/disable_ipv6"), "1");
        if kernel.is_some() {
            merge_on_arrival(netns, name, &host);
        }
        rtnl::set_up(host_index).with_context(|| format!("cannot bring {host} up"))?;
        let port = GuestPort::attach(kernel, iface, &host, host_index, &upcall, mtu, true)?;
        std::mem::forget(undo);
        Ok(PortNic { port, device: VethPair { guest: name.to_string(), host, host_index, remove: AtomicBool::new(made) } })
    }
}

/// Lets the guest's kernel merge (GRO) the TCP segments the fast path
/// hands it one by one, as a NIC's driver would: a VM's stream crosses the
/// link a segment per datagram, and `from_network` sends each segment out
/// of the pair's host end, whose transmit feeds the guest end's NAPI (GRO
/// on) instead of the backlog, which veth does only for a sending end
/// without TSO (`veth_skb_is_eligible_for_gro`). The guest's TCP then
/// takes the stream in pieces of up to 64 KB, not a segment at a time.
/// Super-frames still go straight to the guest's side
/// (`bpf_redirect_peer`), so the host end never needs TSO. Best effort:
/// without it the segments arrive all the same, each on its own.
fn merge_on_arrival(netns: &str, guest: &str, host: &str) {
    let r = netdev::open_netns(netns)
        .and_then(|ns| netdev::set_feature_in(&ns, guest, netdev::ETHTOOL_SGRO, true))
        .and_then(|()| netdev::set_feature_here(host, netdev::ETHTOOL_STSO, false));
    if let Err(e) = r {
        tracing::warn!("veth {guest} in {netns}: frames from other hosts arrive unmerged (no GRO): {e:#}");
    }
}

/// Deletes a pair made by a request that then failed.
struct Undo(Option<u32>);

impl Drop for Undo {
    fn drop(&mut self) {
        if let Some(i) = self.0 {
            let _ = rtnl::delete(i);
        }
    }
}

impl PortDevice for VethPair {
    fn in_force(&self) {
        self.remove.store(false, Relaxed);
    }

    fn deleted(&self, detach: bool) {
        self.remove.store(!detach, Relaxed);
    }

    fn describe(&self) -> String {
        format!("ifname={} host={}", self.guest, self.host)
    }

    /// Frames the kernel lost on the way into the guest: the host end's
    /// transmit drops (the guest end's queue full, the guest behind; or its
    /// end down), the kernel's count.
    fn extra_stats(&self) -> String {
        format!(" drop_delivery_full={}", rtnl::tx_dropped(self.host_index).unwrap_or(0))
    }
}

impl Drop for VethPair {
    fn drop(&mut self) {
        // The programs detach and the upcall TAP goes with `io`; the pair
        // goes only when asked.
        if self.remove.load(Relaxed) {
            if let Err(e) = rtnl::delete(self.host_index) {
                if e.raw_os_error() != Some(libc::ENODEV) {
                    tracing::warn!("cannot delete veth {}: {e}", self.host);
                }
            }
        }
    }
}

/// Interfaces attached as `veth` (in a guest namespace).
pub struct Kind;

impl super::NicKind for Kind {
    fn takes(&self, attach: &vnet_core::command::Attach) -> bool {
        *attach == vnet_core::command::Attach::Veth
    }

    fn make(&self, spec: &super::NicSpec) -> std::result::Result<Box<dyn super::VirtualNic>, String> {
        let ns = spec.netns.ok_or("a veth interface needs netns <name>")?;
        VethNic::new(spec.ifname.unwrap_or(spec.name), spec.mac, spec.mtu, ns, spec.id, spec.kernel)
            .map(|n| Box::new(n) as Box<dyn super::VirtualNic>)
            .map_err(|e| format!("{e:#}"))
    }
}
