//! A datapath on dummy ports: a topology of `DummyNic`s and `DummyLink`s,
//! the real rule table and the real forwarder, driven one frame at a time
//! with no namespace, socket or thread. Unit tests of the forwarder and the
//! `forward` fuzz target use it (as OVS's tests use `netdev-dummy`).

use super::forward::Forwarder;
use crate::link::dummy::DummyLink;
use crate::nic::DummyNic;
use crate::settings::Settings;
use crate::stats::{Counters, ThreadStats};
use crate::link::{CarrierKey, LinkEnv, LinksNow, RunOpener};
use crate::topology::{Slot, Snapshot, Topology};
use std::any::Any;
use std::net::SocketAddr;
use std::sync::Arc;
use vnet_core::command::{parse_request, Attach, LinkProto};
use vnet_core::offload::VnetHdr;
use vnet_core::Mac;

/// Adding links needs nothing from a daemon here.
struct NoEnv;

impl LinkEnv for NoEnv {
    fn path_mtu(&self, _: SocketAddr) -> Option<u32> {
        None
    }
    fn udp_carrier(&self, _: CarrierKey, _: &'static str, _: &dyn Fn() -> Arc<dyn RunOpener>) -> Result<Arc<crate::link::carriers::UdpCarrier>, String> {
        Err("no sockets on dummy ports".into())
    }
    fn shared(&self, _: &'static str, _: &mut dyn FnMut() -> Result<Arc<dyn Any + Send + Sync>, String>) -> Result<Arc<dyn Any + Send + Sync>, String> {
        Err("nothing shared on dummy ports".into())
    }
    fn shared_now(&self, _: &'static str) -> Option<Arc<dyn Any + Send + Sync>> {
        None
    }
    fn links_now(&self) -> LinksNow {
        LinksNow { now: Arc::new(|| None), unknown: Arc::new(|| {}) }
    }
}

pub struct Rig {
    pub topology: Topology,
    pub snap: Arc<Snapshot>,
    pub fwd: Forwarder,
    /// The thread's daemon-wide counters (what `STATS global` sums).
    pub st: Arc<ThreadStats>,
    /// The guests' NICs, by the index `guest` returned.
    pub nics: Vec<(u32, DummyNic)>,
    /// The links, by the index `link` returned.
    pub links: Vec<(u32, DummyLink)>,
    generation: u64,
    settings: Settings,
    buf: Vec<u8>,
}

impl Default for Rig {
    fn default() -> Rig {
        let st = Arc::new(ThreadStats::default());
        Rig {
            topology: Topology::default(),
            snap: Arc::new(Snapshot::empty()),
            fwd: Forwarder::new(st.clone(), None),
            st,
            nics: Vec::new(),
            links: Vec::new(),
            generation: 0,
            settings: Settings::default(),
            buf: vec![0; 65536 + 128],
        }
    }
}

impl Rig {
    /// Adds a guest with this MAC and MTU; its index among `nics`.
    pub fn guest(&mut self, name: &str, mac: Mac, mtu: u32, takes_offloads: bool) -> usize {
        let nic = DummyNic::new(takes_offloads).expect("eventfd");
        let id = self.topology.insert_interface(name, mac, mtu, Attach::default(), None, "default".into(), Box::new(nic.clone()));
        self.nics.push((id, nic));
        self.nics.len() - 1
    }

    /// Adds a link carrying datagrams of up to `mtu - 28` bytes (as a UDP
    /// link over IPv4 would); its index among `links`.
    pub fn link(&mut self, name: &str, mtu: u32) -> usize {
        let overhead = 28;
        let link = DummyLink::new(65507);
        let id = self.topology.insert_link(name, &LinkProto::default(), Arc::new(link.clone()), None, mtu, overhead, None, None);
        self.links.push((id, link));
        self.links.len() - 1
    }

    /// Applies a request of the control language (routes, settings), all or
    /// nothing, and publishes it.
    pub fn apply(&mut self, request: &str) -> Result<(), String> {
        let cmds = parse_request(request).map_err(|e| e.to_string())?;
        let mut work = self.topology.clone();
        for (_, c) in &cmds {
            work.apply(c, &self.settings, &NoEnv)?;
        }
        work.retired.clear();
        work.removed_routes.clear();
        self.topology = work;
        self.commit();
        Ok(())
    }

    /// Publishes the topology as it stands (after `guest`/`link`).
    pub fn commit(&mut self) {
        self.generation += 1;
        self.snap = Arc::new(self.topology.snapshot(self.generation));
    }

    fn slot_of_guest(&self, g: usize) -> u32 {
        self.snap.iface_slot(self.nics[g].0).expect("guest in the snapshot")
    }

    /// Guest `g` sends `frame` with offload metadata `vnet`: read from its
    /// NIC as a dispatcher reads it, forwarded, and the pass flushed.
    pub fn from_guest(&mut self, g: usize, vnet: VnetHdr, frame: &[u8]) {
        let nic = &self.nics[g].1;
        nic.inject(vnet, frame);
        let slot = self.slot_of_guest(g);
        let iface = self.snap.ifaces[slot as usize].clone();
        while let Ok(r) = iface.nic.recv(&mut self.buf) {
            self.fwd.touch(slot);
            self.fwd.from_port(&self.snap, Slot::Iface(slot), &mut self.buf[r.start..r.end], r.vnet);
        }
        self.fwd.flush(&self.snap);
    }

    /// Datagrams `frames` arrive on link `l` as one received run.
    pub fn from_link(&mut self, l: usize, frames: &[&[u8]]) {
        let id = self.links[l].0;
        let slot = self.snap.links.iter().position(|k| k.id == id).expect("link in the snapshot") as u32;
        let mut at = 0;
        let mut ranges = Vec::new();
        for f in frames {
            self.buf[at..at + f.len()].copy_from_slice(f);
            ranges.push(at..at + f.len());
            at += f.len();
        }
        for r in ranges {
            self.fwd.from_link(&self.snap, slot, &mut self.buf, r);
        }
        self.fwd.end_run(&self.snap, &self.buf);
        self.fwd.flush(&self.snap);
    }

    /// The counters of guest `g`'s interface.
    pub fn guest_stats(&self, g: usize) -> &Counters {
        &self.topology.ifaces[&self.nics[g].0].stats
    }

    /// The counters of link `l`.
    pub fn link_stats(&self, l: usize) -> &Counters {
        &self.topology.links[&self.links[l].0].stats
    }
}
