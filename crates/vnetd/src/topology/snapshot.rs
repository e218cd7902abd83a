//! What the datapath reads: an immutable snapshot of the topology, swapped
//! whole on every change (`Datapath::publish`), with the lookups a
//! dispatcher needs (ports by id, links by sender address, VNI, stream or
//! WireGuard index and key).
//! Built by the topology when a request commits; read by dispatchers with
//! no lock.

use super::objects::{Interface, Link, Route};
use crate::link::tcp::TcpLink;
use crate::link::{wireguard, Rx};
use crate::settings::{DispatchSettings, IfaceDispatch};
use imbl::OrdMap;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use vnet_core::table::{Port, RouteTable};

/// What the dispatcher reads: immutable, swapped whole on every change.
/// The rule table's ports are ids; `slot_of` turns one into the object's
/// position (slot) in this snapshot's vectors. Slots are only valid with the
/// snapshot they came from.
pub struct Snapshot {
    pub generation: u64,
    pub ifaces: Vec<Arc<Interface>>,
    pub links: Vec<Arc<Link>>,
    /// The routes by id: rule `i` of `table` is `routes[&i]`.
    pub routes: OrdMap<u32, Arc<Route>>,
    pub table: RouteTable,
    pub dispatch: DispatchSettings,
    /// What each interface's dispatch runs by (by slot).
    pub iface_dispatch: Vec<IfaceDispatch>,
    /// Interfaces' and links' slots by id.
    iface_slot: HashMap<u32, u32>,
    link_slot: HashMap<u32, u32>,
    /// UDP links' slots by remote address.
    by_addr: HashMap<SocketAddr, u32>,
    /// UDP links by remote IP alone, when exactly one has that IP.
    by_ip: HashMap<IpAddr, Option<u32>>,
    /// VXLAN links by remote IP and VNI.
    vxlan: HashMap<(IpAddr, u32), u32>,
    /// TCP links by remote IP.
    tcp: HashMap<IpAddr, Arc<TcpLink>>,
    /// WireGuard links by our receiver index, and by the peer's public key.
    wg_index: HashMap<u32, u32>,
    wg_key: HashMap<[u8; 32], u32>,
    /// The kernel fast path is on: dispatchers install the answers it can
    /// carry.
    pub fast_on: bool,
}

/// Where a port is in one snapshot.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Slot {
    Iface(u32),
    Link(u32),
}

impl Snapshot {
    /// The snapshot of an empty topology (what dispatchers start with).
    pub fn empty() -> Snapshot {
        Snapshot::build(0, Vec::new(), Vec::new(), OrdMap::new(), RouteTable::default(), DispatchSettings::default(), Vec::new(), false)
    }

    /// A snapshot of these objects, with the per-kind lookups a dispatcher
    /// needs to tell which link a received datagram or connection belongs
    /// to. `iface_dispatch` is by position in `ifaces`.
    #[allow(clippy::too_many_arguments)]
    pub fn build(
        generation: u64,
        ifaces: Vec<Arc<Interface>>,
        links: Vec<Arc<Link>>,
        routes: OrdMap<u32, Arc<Route>>,
        mut table: RouteTable,
        dispatch: DispatchSettings,
        iface_dispatch: Vec<IfaceDispatch>,
        fast_on: bool,
    ) -> Snapshot {
        let mut by_addr = HashMap::new();
        let mut by_ip: HashMap<IpAddr, Option<u32>> = HashMap::new();
        let mut vxlan = HashMap::new();
        let mut tcp = HashMap::new();
        let (mut wg_index, mut wg_key) = (HashMap::new(), HashMap::new());
        for (slot, l) in links.iter().enumerate() {
            let Some(remote) = l.remote else { continue };
            match l.transport.rx() {
                Rx::Shared { vni: None } => {
                    by_addr.insert(remote, slot as u32);
                    by_ip.entry(remote.ip()).and_modify(|e| *e = None).or_insert(Some(slot as u32));
                }
                Rx::Shared { vni: Some(vni) } => {
                    vxlan.insert((remote.ip(), vni), slot as u32);
                }
                Rx::Stream(t) => {
                    tcp.insert(remote.ip().to_canonical(), t.clone());
                }
                Rx::Sealed(w) => {
                    wg_index.insert(w.index(), slot as u32);
                    wg_key.insert(*w.peer(), slot as u32);
                }
                Rx::Device(_) => {}
            }
        }
        table.set_generation(generation);
        Snapshot {
            generation,
            iface_slot: ifaces.iter().enumerate().map(|(s, i)| (i.id, s as u32)).collect(),
            link_slot: links.iter().enumerate().map(|(s, l)| (l.id, s as u32)).collect(),
            ifaces,
            links,
            routes,
            table,
            by_addr,
            by_ip,
            vxlan,
            tcp,
            wg_index,
            wg_key,
            dispatch,
            iface_dispatch,
            fast_on,
        }
    }

    /// The slot of the port with this id, if it is in this snapshot.
    #[inline]
    pub fn slot_of(&self, port: Port) -> Option<Slot> {
        match port {
            Port::Interface(id) => self.iface_slot.get(&id).map(|&s| Slot::Iface(s)),
            Port::Link(id) => self.link_slot.get(&id).map(|&s| Slot::Link(s)),
        }
    }

    /// The slot of the interface with this id.
    #[inline]
    pub fn iface_slot(&self, id: u32) -> Option<u32> {
        self.iface_slot.get(&id).copied()
    }

    /// The UDP link (slot) a datagram belongs to: the link whose remote
    /// address is the sender's, or else the only link to the sender's IP
    /// (VNET/P matched by IP alone; a peer behind NAT sends from another port).
    #[inline]
    pub fn link_for_sender(&self, from: SocketAddr) -> Option<u32> {
        if let Some(&slot) = self.by_addr.get(&from) {
            return Some(slot);
        }
        self.by_ip.get(&from.ip()).copied().flatten()
    }

    /// The VXLAN link (slot) for a datagram from `from` carrying `vni`.
    #[inline]
    pub fn vxlan_link_for(&self, from: IpAddr, vni: u32) -> Option<u32> {
        self.vxlan.get(&(from, vni)).copied()
    }

    /// The TCP link whose peer has this address.
    pub fn tcp_link_for(&self, from: IpAddr) -> Option<&Arc<TcpLink>> {
        self.tcp.get(&from.to_canonical())
    }
}

impl wireguard::Links for Snapshot {
    /// The WireGuard link with this receiver index (24 bits), or to the
    /// peer holding this public key.
    #[inline]
    fn wireguard(&self, by: wireguard::By) -> Option<wireguard::Found<'_>> {
        let slot = match by {
            wireguard::By::Index(i) => self.wg_index.get(&i),
            wireguard::By::Key(k) => self.wg_key.get(k),
        }
        .copied()?;
        let l = &self.links[slot as usize];
        let Rx::Sealed(link) = l.transport.rx() else { return None };
        Some(wireguard::Found { slot, link, stats: &l.stats })
    }
}
