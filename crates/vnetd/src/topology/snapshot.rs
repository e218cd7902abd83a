//! What the datapath reads: an immutable snapshot of the topology, swapped
//! whole on every change (`Datapath::publish`), with the lookups a
//! dispatcher needs: ports by id, and links by the keys they declared on
//! their carriers (`link::LinkLookup`), whatever their kind.
//! Built by the topology when a request commits; read by dispatchers with
//! no lock.

use super::objects::{Interface, Link, Route};
use crate::link::{CarrierKey, DemuxKey, LinkLookup, Transport};
use crate::settings::{DispatchSettings, IfaceDispatch};
use crate::stats::Counters;
use imbl::OrdMap;
use std::collections::HashMap;
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
    /// Links' slots by the keys they declared on their carriers; None where
    /// two declared one (it names neither).
    demux: HashMap<(CarrierKey, DemuxKey), Option<u32>, ahash::RandomState>,
    /// The kernel fast path is on: dispatchers install the answers it can
    /// carry.
    pub fast_on: bool,
    /// Addresses bound to guests' MACs (`NEIGH ADD`; `dispatch::home`).
    pub neighbours: vnet_core::neigh::Neighbours,
}

pub use crate::port::Slot;

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
        let mut demux: HashMap<(CarrierKey, DemuxKey), Option<u32>, ahash::RandomState> = HashMap::default();
        for (slot, l) in links.iter().enumerate() {
            for key in l.transport.demux() {
                demux.entry(key).and_modify(|e| *e = None).or_insert(Some(slot as u32));
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
            demux,
            dispatch,
            iface_dispatch,
            fast_on,
            neighbours: Default::default(),
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
}

impl LinkLookup for Snapshot {
    #[inline]
    fn demux(&self, carrier: &CarrierKey, key: &DemuxKey) -> Option<u32> {
        self.demux.get(&(*carrier, *key)).copied().flatten()
    }

    #[inline]
    fn link(&self, slot: u32) -> Option<(&dyn Transport, &Counters)> {
        self.links.get(slot as usize).map(|l| (&*l.transport, &l.stats))
    }

    fn slot_of_link(&self, id: u32) -> Option<u32> {
        self.link_slot.get(&id).copied()
    }
}
