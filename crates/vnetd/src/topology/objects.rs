//! The objects a topology holds: interfaces (a guest's NIC), links (a peer
//! host's vnetd, or a LAN), routes (rules of the table), and what a request
//! retired. Each carries its stable id and its counters.

use crate::link::{GsoState, LinkKey, Transport};
use crate::nic::VirtualNic;
use crate::stats::Counters;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicU8};
use std::sync::Arc;
use vnet_core::command::{Attach, LinkProto};
use vnet_core::rule::RuleSpec;
use vnet_core::Mac;

pub struct Interface {
    /// Stable id (the rule table's port): never changed or reused.
    pub id: u32,
    pub name: String,
    pub mac: Mac,
    pub mtu: u32,
    pub attach: Attach,
    /// The guest's network namespace, when vnetd made the TAP there.
    pub netns: Option<String>,
    /// The overlay network the guest is in (`network <name>`).
    pub network: String,
    pub nic: Box<dyn VirtualNic>,
    pub stats: Counters,
    /// The mode the dispatcher runs the interface in now (`Mode as u8`):
    /// guest- or VMM-driven, whatever the configured mode.
    pub running_mode: AtomicU8,
    /// Switches between guest- and VMM-driven so far.
    pub mode_switches: AtomicU64,
    /// Its broadcast budget, and the addresses it said it holds
    /// (`guest`; `dispatch::home` uses them).
    pub storm: crate::guest::StormBucket,
    pub learned: crate::guest::Learned,
}

impl Interface {
    /// Largest frame the guest can take: MTU plus Ethernet and 802.1Q headers.
    pub fn max_frame(&self) -> usize {
        self.mtu as usize + 18
    }

    /// Tears the interface down (the control plane, once no dispatcher uses
    /// it): closes its NIC, so its TAP goes or stays as its request settled
    /// (`VirtualNic::in_force`, `VirtualNic::deleted`).
    pub fn teardown(self) {
        drop(self.nic);
    }
}

pub struct Link {
    /// Stable id (the rule table's port): never changed or reused.
    pub id: u32,
    pub name: String,
    /// How it was asked for (kind, VNI, device, key name): what the
    /// control plane checks duplicates against.
    pub proto: LinkProto,
    /// How it carries frames: what the datapath uses.
    pub transport: Arc<dyn Transport>,
    /// The peer's address (none for a direct link).
    pub remote: Option<SocketAddr>,
    /// Underlay MTU toward the peer: given, or the kernel's path MTU (for a
    /// direct link: its device's MTU).
    pub mtu: u32,
    /// Largest frame that crosses the underlay in one unfragmented datagram;
    /// TCP super-frames are cut to fit it.
    pub max_frame: usize,
    pub stats: Counters,
    pub gso: GsoState,
    /// The link as the kernel fast path knows it (a UDP link over IPv4
    /// while the fast path is loaded): its outer header and address.
    pub fast: Option<vnet_fastpath::LinkEntry>,
    /// The key of VTOE shadow connections with the peer (`vtoe <key-name>`):
    /// guests' TCP connections to the peer's guests may be offloaded.
    pub vtoe: Option<(String, LinkKey)>,
}

/// Smallest frame a link is sized for: room for TCP headers and some data.
pub const ETH_MIN_FOR_TCP: usize = 256;

impl Link {
    /// Tears the link down (the control plane, once no dispatcher uses it);
    /// returns the frames it still held, to be counted as dropped.
    pub fn teardown(self) -> usize {
        self.transport.teardown()
    }
}

/// An object a request took out of the topology, to be torn down once no
/// dispatcher uses it.
#[derive(Clone)]
pub enum Retired {
    /// An interface, and whether only detached (its TAP stays).
    Iface(Arc<Interface>, bool),
    Link(Arc<Link>),
}

pub struct Route {
    pub id: u32,
    pub spec: RuleSpec,
    /// Who manages it (`owner <tag>`): vnet-agent's are `agent`.
    pub owner: Option<String>,
    pub stats: Counters,
}
