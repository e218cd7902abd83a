//! VNET's kernel fast path: the eBPF programs (`bpf/fastpath.bpf.c`, built
//! by clang in `build.rs` and embedded here) and the Rust side that loads
//! them, attaches them (TCX) and programs their maps.
//!
//! What it owns: the programs, the maps' layout (mirrored here `#[repr(C)]`)
//! and their lifetime. What it does not: any routing decision. vnetd decides
//! with `vnet-core` and installs the answers (`Kernel::install`); this crate
//! never calls vnetd or vnet-core.
//!
//! Attachments (`Attached`) are TCX links held as file descriptors: closing
//! them (drop, or vnetd exiting) detaches the programs, so a kernel fast
//! path never outlives the vnetd that programs it.

pub mod guard;

use anyhow::{anyhow, bail, Context, Result};
use libbpf_rs::{MapCore, MapFlags, MapHandle, ObjectBuilder};
use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};

static OBJECT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/fastpath.bpf.o"));

/// Set in a port number that names a link (clear: an interface).
pub const LINK_BIT: u32 = 0x8000_0000;

/// A route-cache key, as VNET/P's cache is keyed: origin port, destination
/// and source MAC.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FlowKey {
    pub origin: u32,
    pub dst: [u8; 6],
    pub src: [u8; 6],
}

/// What the fast path does with a frame that hits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Into a veth guest (`ifindex`: the host end).
    Peer { ifindex: u32 },
    /// Out of a device (a QEMU TAP: QEMU reads it).
    Device { ifindex: u32 },
    /// Encapsulated for link `link`.
    Encap { link: u32 },
}

/// An entry: the action, and the port and route the frame is counted on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Flow {
    pub action: Action,
    /// Destination port (`LINK_BIT` set for a link).
    pub dest: u32,
    pub route: u32,
    /// Longest frame (unsegmented) the destination takes; 0: any. Longer
    /// ones go to vnetd, which drops and counts them.
    pub max_len: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RawAction {
    kind: u32,
    ifindex: u32,
    link: u32,
    dest: u32,
    route: u32,
    max_len: u32,
}

impl From<Flow> for RawAction {
    fn from(f: Flow) -> RawAction {
        let (kind, ifindex, link) = match f.action {
            Action::Peer { ifindex } => (1, ifindex, 0),
            Action::Device { ifindex } => (2, ifindex, 0),
            Action::Encap { link } => (3, 0, link),
        };
        RawAction { kind, ifindex, link, dest: f.dest, route: f.route, max_len: f.max_len }
    }
}

impl RawAction {
    fn flow(&self) -> Option<Flow> {
        let action = match self.kind {
            1 => Action::Peer { ifindex: self.ifindex },
            2 => Action::Device { ifindex: self.ifindex },
            3 => Action::Encap { link: self.link },
            _ => return None,
        };
        Some(Flow { action, dest: self.dest, route: self.route, max_len: self.max_len })
    }
}

/// How a link's frames leave: the outer IPv4/UDP header and where it goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkPath {
    /// This host's address the link's datagrams leave from; `from_network`
    /// takes the peer's datagrams only when sent to it.
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub sport: u16,
    pub dport: u16,
    /// Largest outer IPv4 packet (the link's MTU).
    pub mtu: u32,
    /// The underlay device toward the peer.
    pub ifindex: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct RawLink {
    hdr: [u8; 28],
    ip_sum: u32,
    mtu: u32,
    ifindex: u32,
    saddr: u32,
    daddr: u32,
}

impl RawLink {
    fn new(p: &LinkPath) -> RawLink {
        let mut hdr = [0u8; 28];
        hdr[0] = 0x45;
        hdr[6] = 0x40; // DF, as vnetd's UDP socket sends (path MTU discovery)
        hdr[8] = 64; // TTL
        hdr[9] = 17; // UDP
        hdr[12..16].copy_from_slice(&p.src.octets());
        hdr[16..20].copy_from_slice(&p.dst.octets());
        hdr[20..22].copy_from_slice(&p.sport.to_be_bytes());
        hdr[22..24].copy_from_slice(&p.dport.to_be_bytes());
        // Sum of the IPv4 header's 16-bit words as they are (length and
        // checksum zero): the program adds the length and folds. The
        // program adds words in memory order, so sum them that way too.
        let mut sum: u32 = 0;
        for w in hdr[..20].chunks(2) {
            sum += u16::from_ne_bytes([w[0], w[1]]) as u32;
        }
        let sum = (sum & 0xffff) + (sum >> 16);
        RawLink {
            hdr,
            ip_sum: sum,
            mtu: p.mtu,
            ifindex: p.ifindex,
            saddr: u32::from_ne_bytes(p.src.octets()),
            daddr: u32::from_ne_bytes(p.dst.octets()),
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy)]
struct AddrKey {
    addr: u32,
    port: u16,
    _pad: u16,
}

/// `link_addrs`' value: the link, and the address this host sends its
/// datagrams from (the one the peer's must be sent to).
#[repr(C)]
#[derive(Clone, Copy, Default, PartialEq, Eq)]
struct LinkAddr {
    link: u32,
    local: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct PortInfo {
    origin: u32,
    ifindex: u32,
    peer: u32,
    _pad: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Config {
    enabled: u32,
    port: u16,
    finish_mac: [u8; 6],
    finish_ifindex: u32,
    finish_recv: u32,
}

/// Counter kinds in the `counters` map.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum CounterKind {
    IfaceIn = 1,
    IfaceOut = 2,
    LinkIn = 3,
    LinkOut = 4,
    Route = 5,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CounterKey {
    kind: u32,
    id: u32,
}

/// What the programs did with frames, summed over CPUs (the `stats` map;
/// the order is the program's `enum stat`).
pub const STAT_NAMES: [&str; 16] = [
    "hit_guest",
    "hit_net",
    "miss_guest",
    "miss_net",
    "from_vnetd",
    "slow_big",
    "slow_not_ip",
    "slow_route",
    "slow_gso",
    "drop_encap",
    "drop_decap",
    "drop_no_port",
    "disabled",
    "finish",
    "not_for_us",
    "slow_csum",
];

fn bytes_of<T: Copy>(v: &T) -> &[u8] {
    // SAFETY: T is a plain #[repr(C)] value type with no padding we read back.
    unsafe { std::slice::from_raw_parts(v as *const T as *const u8, std::mem::size_of::<T>()) }
}

fn from_bytes<T: Copy + Default>(b: &[u8]) -> T {
    let mut v = T::default();
    let n = std::mem::size_of::<T>().min(b.len());
    // SAFETY: as above; every bit pattern is a valid T (integers only).
    unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), &mut v as *mut T as *mut u8, n) };
    v
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Hook {
    FromGuest,
    FromNetwork,
    FromVnetd,
}

/// The loaded programs and their maps.
pub struct Kernel {
    flows: MapHandle,
    links: MapHandle,
    link_addrs: MapHandle,
    ports: MapHandle,
    config: MapHandle,
    counters: MapHandle,
    stats: MapHandle,
    progs: HashMap<Hook, OwnedFd>,
    /// What `config` holds (the programs' switch and settings).
    config_now: Mutex<Config>,
    /// Underlay devices with `from_network` attached, and how many links
    /// leave through each.
    underlays: Mutex<HashMap<u32, (OwnedFd, usize)>>,
    /// `from_network` on the finishing pair's receiving end.
    finisher: Mutex<Option<OwnedFd>>,
}

/// A program attached to a device (a TCX link), with the map entry that
/// describes the device to it; both go when this is dropped.
pub struct Attached {
    kernel: Arc<Kernel>,
    link: Option<OwnedFd>,
    ifindex: u32,
}

impl Drop for Attached {
    fn drop(&mut self) {
        drop(self.link.take());
        let _ = self.kernel.ports.delete(bytes_of(&self.ifindex));
    }
}

/// A link's place in the fast path: its header entry, its sender address
/// entry and a hold on its underlay device's program; all go on drop.
pub struct LinkEntry {
    kernel: Arc<Kernel>,
    id: u32,
    addr: AddrKey,
    underlay: u32,
}

impl Drop for LinkEntry {
    fn drop(&mut self) {
        let _ = self.kernel.links.delete(bytes_of(&self.id));
        // The address is this link's only if no later link took it: a link
        // replaced by one to the same peer (in one request, or while a
        // dispatcher still held the old one) must not lose the new link's
        // entry, or its datagrams reach vnetd's socket with their checksums
        // unfinished instead of going round the finishing pair.
        if let Ok(Some(v)) = self.kernel.link_addrs.lookup(bytes_of(&self.addr), MapFlags::ANY) {
            if from_bytes::<LinkAddr>(&v).link == self.id {
                let _ = self.kernel.link_addrs.delete(bytes_of(&self.addr));
            }
        }
        self.kernel.release_underlay(self.underlay);
    }
}

impl Kernel {
    /// Loads the programs. `udp_port` is vnetd's UDP port (what links
    /// send to). The fast path starts disabled: see `set_enabled`.
    pub fn load(udp_port: u16) -> Result<Arc<Kernel>> {
        let open = ObjectBuilder::default().open_memory(OBJECT).context("cannot open the eBPF object")?;
        let obj = open.load().context("the kernel refused the fast path's eBPF programs")?;
        let map = |name: &str| -> Result<MapHandle> {
            let m = obj.maps().find(|m| m.name() == name).ok_or_else(|| anyhow!("no map {name}"))?;
            MapHandle::try_from(&m).with_context(|| format!("map {name}"))
        };
        let mut progs = HashMap::new();
        for (hook, name) in [(Hook::FromGuest, "from_guest"), (Hook::FromNetwork, "from_network"), (Hook::FromVnetd, "from_vnetd")] {
            let p = obj.progs().find(|p| p.name() == name).ok_or_else(|| anyhow!("no program {name}"))?;
            progs.insert(hook, p.as_fd().try_clone_to_owned()?);
        }
        let k = Kernel {
            flows: map("flows")?,
            links: map("links")?,
            link_addrs: map("link_addrs")?,
            ports: map("ports")?,
            config: map("config")?,
            counters: map("counters")?,
            stats: map("stats")?,
            progs,
            config_now: Mutex::new(Config { port: udp_port.to_be(), ..Config::default() }),
            underlays: Mutex::new(HashMap::new()),
            finisher: Mutex::new(None),
        };
        k.set_enabled(false)?;
        Ok(Arc::new(k))
    }

    fn update_config(&self, f: impl FnOnce(&mut Config)) -> Result<()> {
        let mut c = self.config_now.lock().unwrap();
        f(&mut c);
        self.config.update(bytes_of(&0u32), bytes_of(&*c), MapFlags::ANY).context("config map")?;
        Ok(())
    }

    /// Fast path on (hits are carried in the kernel) or off (every frame
    /// goes to vnetd; the programs stay attached as the guests' way in).
    pub fn set_enabled(&self, on: bool) -> Result<()> {
        self.update_config(|c| c.enabled = on as u32)
    }

    /// Names the finishing pair: datagrams for vnetd that are still
    /// unsegmented or carry unfinished checksums (a veth's artifacts) are
    /// sent out of `send` (a device with no offloads) and come back on
    /// `recv` (its veth peer, MAC `recv_mac`) as a wire would carry them;
    /// `from_network` runs there too.
    pub fn set_finisher(&self, send: u32, recv: u32, recv_mac: [u8; 6]) -> Result<()> {
        let fd = self.attach(Hook::FromNetwork, recv)?;
        *self.finisher.lock().unwrap() = Some(fd);
        self.update_config(|c| {
            c.finish_ifindex = send;
            c.finish_recv = recv;
            c.finish_mac = recv_mac;
        })
    }

    fn attach(&self, hook: Hook, ifindex: u32) -> Result<OwnedFd> {
        let prog = &self.progs[&hook];
        // SAFETY: plain FFI call with valid fds; NULL options are allowed.
        let fd = unsafe {
            libbpf_rs::libbpf_sys::bpf_link_create(
                prog.as_raw_fd(),
                ifindex as i32,
                libbpf_rs::libbpf_sys::BPF_TCX_INGRESS,
                std::ptr::null(),
            )
        };
        if fd < 0 {
            bail!("cannot attach the fast path (TCX ingress) to device {ifindex}: {}", std::io::Error::from_raw_os_error(-fd));
        }
        // SAFETY: a new descriptor we own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Attaches the fast path to a guest port: `from_guest` on `dev` (where
    /// the guest's frames arrive: a veth's host end or QEMU's TAP), misses
    /// to the upcall TAP `upcall`; `from_vnetd` on `upcall`, frames vnetd
    /// writes there going to the guest (into the veth's peer if `veth`,
    /// else out of `dev`). `iface` is the interface's id.
    pub fn attach_port(self: &Arc<Self>, iface: u32, dev: u32, upcall: u32, veth: bool) -> Result<(Attached, Attached)> {
        let guest = PortInfo { origin: iface, ifindex: upcall, peer: 0, _pad: 0 };
        self.ports.update(bytes_of(&dev), bytes_of(&guest), MapFlags::ANY)?;
        let mut a = Attached { kernel: self.clone(), link: None, ifindex: dev };
        let back = PortInfo { origin: iface, ifindex: dev, peer: veth as u32, _pad: 0 };
        self.ports.update(bytes_of(&upcall), bytes_of(&back), MapFlags::ANY)?;
        let mut b = Attached { kernel: self.clone(), link: None, ifindex: upcall };
        b.link = Some(self.attach(Hook::FromVnetd, upcall)?);
        a.link = Some(self.attach(Hook::FromGuest, dev)?);
        Ok((a, b))
    }

    /// Describes link `id` to the programs and attaches `from_network` to
    /// its underlay device (once per device). The peer's datagrams are
    /// carried only from `path.dst`:`path.dport` to `path.src`.
    pub fn add_link(self: &Arc<Self>, id: u32, path: &LinkPath) -> Result<LinkEntry> {
        {
            let mut u = self.underlays.lock().unwrap();
            if let Some(e) = u.get_mut(&path.ifindex) {
                e.1 += 1;
            } else {
                let fd = self.attach(Hook::FromNetwork, path.ifindex)?;
                u.insert(path.ifindex, (fd, 1));
            }
        }
        let addr = AddrKey { addr: u32::from_ne_bytes(path.dst.octets()), port: path.dport.to_be(), _pad: 0 };
        let entry = LinkEntry { kernel: self.clone(), id, addr, underlay: path.ifindex };
        self.links.update(bytes_of(&id), bytes_of(&RawLink::new(path)), MapFlags::ANY)?;
        let value = LinkAddr { link: id, local: u32::from_ne_bytes(path.src.octets()) };
        self.link_addrs.update(bytes_of(&addr), bytes_of(&value), MapFlags::ANY)?;
        Ok(entry)
    }

    fn release_underlay(&self, ifindex: u32) {
        let mut u = self.underlays.lock().unwrap();
        if let Some(e) = u.get_mut(&ifindex) {
            e.1 -= 1;
            if e.1 == 0 {
                u.remove(&ifindex);
            }
        }
    }

    /// Installs (or replaces) one route-cache entry. Fails when the map is
    /// full.
    pub fn install(&self, key: &FlowKey, flow: Flow) -> Result<()> {
        self.flows.update(bytes_of(key), bytes_of(&RawAction::from(flow)), MapFlags::ANY)?;
        Ok(())
    }

    /// Every entry installed now.
    pub fn flows(&self) -> Vec<(FlowKey, Option<Flow>)> {
        let mut out = Vec::new();
        for k in self.flows.keys() {
            let key: FlowKey = from_bytes_key(&k);
            if let Ok(Some(v)) = self.flows.lookup(&k, MapFlags::ANY) {
                out.push((key, from_bytes::<RawAction>(&v).flow()));
            }
        }
        out
    }

    /// How many entries are installed (keys only: no value is read).
    pub fn flow_count(&self) -> usize {
        self.flows.keys().count()
    }

    pub fn remove_flow(&self, key: &FlowKey) {
        let _ = self.flows.delete(bytes_of(key));
    }

    /// Removes every entry.
    pub fn clear_flows(&self) {
        let keys: Vec<Vec<u8>> = self.flows.keys().collect();
        for k in keys {
            let _ = self.flows.delete(&k);
        }
    }

    /// Frames and bytes the programs counted for (kind, id), over all CPUs.
    pub fn counter(&self, kind: CounterKind, id: u32) -> (u64, u64) {
        let key = CounterKey { kind: kind as u32, id };
        match self.counters.lookup_percpu(bytes_of(&key), MapFlags::ANY) {
            Ok(Some(per_cpu)) => per_cpu.iter().fold((0, 0), |(f, b), v| {
                let (cf, cb): (u64, u64) = (from_bytes(&v[..8]), from_bytes(&v[8..16]));
                (f + cf, b + cb)
            }),
            _ => (0, 0),
        }
    }

    /// Forgets the counters of an object that is gone.
    pub fn forget(&self, kind: CounterKind, id: u32) {
        let _ = self.counters.delete(bytes_of(&CounterKey { kind: kind as u32, id }));
    }

    /// The `stats` counters, summed over CPUs, in `STAT_NAMES` order.
    pub fn stats(&self) -> [u64; STAT_NAMES.len()] {
        let mut out = [0u64; STAT_NAMES.len()];
        for (i, o) in out.iter_mut().enumerate() {
            if let Ok(Some(per_cpu)) = self.stats.lookup_percpu(bytes_of(&(i as u32)), MapFlags::ANY) {
                *o = per_cpu.iter().map(|v| from_bytes::<u64>(v)).sum();
            }
        }
        out
    }
}

fn from_bytes_key(b: &[u8]) -> FlowKey {
    let mut k = FlowKey { origin: 0, dst: [0; 6], src: [0; 6] };
    if b.len() >= 16 {
        k.origin = u32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
        k.dst.copy_from_slice(&b[4..10]);
        k.src.copy_from_slice(&b[10..16]);
    }
    k
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outer_header_checksum_is_right_once_the_length_is_added() {
        let p = LinkPath { src: "10.0.0.1".parse().unwrap(), dst: "10.0.0.2".parse().unwrap(), sport: 5000, dport: 5000, mtu: 1500, ifindex: 1 };
        let r = RawLink::new(&p);
        let tot: u16 = 1400;
        let mut hdr = r.hdr;
        hdr[2..4].copy_from_slice(&tot.to_be_bytes());
        // As the program computes it: sum + length in memory order, folded.
        let mut s = r.ip_sum + u16::from_ne_bytes(tot.to_be_bytes()) as u32;
        s = (s & 0xffff) + (s >> 16);
        s = (s & 0xffff) + (s >> 16);
        let check = !(s as u16);
        hdr[10..12].copy_from_slice(&check.to_ne_bytes());
        // A correct header sums to 0xffff.
        let mut v: u32 = hdr[..20].chunks(2).map(|w| u16::from_be_bytes([w[0], w[1]]) as u32).sum();
        v = (v & 0xffff) + (v >> 16);
        v = (v & 0xffff) + (v >> 16);
        assert_eq!(v, 0xffff);
    }
}
