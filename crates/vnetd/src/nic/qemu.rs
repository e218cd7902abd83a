//! A TAP that QEMU opens by name (`-netdev tap,ifname=..`): QEMU holds the
//! file side; vnetd makes (or takes over) the device and meets it through
//! the fast path's upcall TAP, or without the fast path through a packet
//! socket (`upcall.rs`).

use super::tap::{QemuTap, Tap};
use super::upcall::{tag, GuestPort, PortDevice, PortNic};
use anyhow::Result;
use std::sync::Arc;

/// QEMU holds the TAP's file side (`-netdev tap,ifname=..`); vnetd meets
/// the TAP device through the fast path's upcall TAP, or without the fast
/// path through a packet socket (`upcall.rs`).
pub type QemuNic = PortNic<QemuTap>;

impl PortNic<QemuTap> {
    /// A QEMU TAP: made (or, if vnetd made it earlier, taken over) and
    /// attached. If attaching fails, a TAP made here goes again and one
    /// taken over stays.
    pub fn new(device: &str, mtu: u32, iface: u32, kernel: Option<&Arc<vnet_fastpath::Kernel>>) -> Result<QemuNic> {
        let tap = Tap::create_for_qemu(device, mtu)?;
        let upcall = format!("vu{}", tag(&format!("qemu/{device}")));
        let port = GuestPort::attach(kernel, iface, device, tap.index(), &upcall, mtu, false)?;
        Ok(PortNic { port, device: tap })
    }
}

/// A QEMU TAP in force stays when vnetd exits, as a veth guest's pair does:
/// QEMU keeps its NIC, the kernel fast path keeps carrying its flows, and
/// the next vnetd takes the TAP over. It goes with `INTERFACE DEL`.
impl PortDevice for QemuTap {
    fn in_force(&self) {
        self.remove_on_drop(false);
    }

    fn deleted(&self, detach: bool) {
        self.remove_on_drop(!detach);
    }
}

/// Interfaces attached as `qemu`: a TAP whose file side QEMU holds.
pub struct Kind;

impl super::NicKind for Kind {
    fn takes(&self, attach: &vnet_core::command::Attach) -> bool {
        *attach == vnet_core::command::Attach::Qemu
    }

    fn make(&self, spec: &super::NicSpec) -> std::result::Result<Box<dyn super::VirtualNic>, String> {
        QemuNic::new(spec.name, spec.mtu, spec.id, spec.kernel).map(|n| Box::new(n) as Box<dyn super::VirtualNic>).map_err(|e| format!("{e:#}"))
    }
}
