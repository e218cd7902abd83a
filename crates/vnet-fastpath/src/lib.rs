//! VNET's kernel fast path: the eBPF programs (`bpf/fastpath.bpf.c`, built
//! by clang in `build.rs` and embedded here) and the Rust side that loads
//! them, attaches them (TCX) and programs their maps.
//!
//! What it owns: the programs, the maps' layout (mirrored here `#[repr(C)]`)
//! and their lifetime. What it does not: any routing decision. vnetd decides
//! with `vnet-core` and installs the answers (`Kernel::install`); this crate
//! never calls vnetd or vnet-core.
//!
//! Lifetime (`pin.rs`): programs, maps and attachments (TCX links) are
//! pinned in one folder, so the kernel datapath outlives the vnetd that
//! programs it: `Kernel::open` creates or adopts, dropping the `Kernel`
//! closes (everything stays), `Kernel::destroy` removes. An attachment or a
//! link entry goes when its handle is dropped only if vnetd said so (its
//! interface or link was deleted, or the request that made it failed).

pub mod guard;
mod layout;
mod neigh;
pub mod pin;

pub use layout::{Action, CounterKind, Flow, FlowKey, LinkPath, NextHop, LINK_BIT, STAT_NAMES};
use layout::*;

pub use pin::{LAYOUT, MAGIC};

use anyhow::{anyhow, bail, Context, Result};
use libbpf_rs::{MapCore, MapFlags, MapHandle, ObjectBuilder};
use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

static OBJECT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/fastpath.bpf.o"));

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Hook {
    FromGuest,
    FromNetwork,
    FromVnetd,
}

impl Hook {
    const ALL: [Hook; 3] = [Hook::FromGuest, Hook::FromNetwork, Hook::FromVnetd];

    /// The program's name, and its attachments' pin names' prefix.
    fn name(self) -> &'static str {
        match self {
            Hook::FromGuest => "from_guest",
            Hook::FromNetwork => "from_network",
            Hook::FromVnetd => "from_vnetd",
        }
    }

    fn of(name: &str) -> Option<Hook> {
        Hook::ALL.into_iter().find(|h| h.name() == name)
    }
}

/// The maps vnetd pins and adopts (the object's other maps, if any, are
/// the loader's own and made anew by each load).
const PINNED_MAPS: [&str; 12] =
    ["flows", "links", "link_addrs", "ports", "config", "counters", "stats", "meta", "ids", "next_hops", "neigh", "neigh6"];

/// Maps added since layout 1 without changing any other map's meaning: a
/// folder that lacks one is still adopted (the rest of it, entries and
/// all), and the map is made and pinned beside the adopted ones. An upgrade
/// from a build before it stays hitless.
const ADDED_MAPS: [&str; 3] = ["next_hops", "neigh", "neigh6"];

/// The kinds of object vnetd gives ids to (`Kernel::stored_id`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum IdKind {
    Iface = 0,
    Link = 1,
    Route = 2,
}

/// How `Kernel::open` found its folder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Opened {
    /// Nothing pinned there (or pinning is off): new maps.
    Fresh,
    /// The maps as a vnetd before this one left them, entries and all.
    Adopted { flows: usize, ports: usize, links: usize, attachments: usize },
    /// Maps of another layout (`layout`), or of another network namespace:
    /// new maps pinned in their place; the old programs keep running on
    /// the old maps until each attachment is claimed or swept.
    Replaced { layout: u32 },
}

/// What `Kernel::finish_adoption` removed: what the folder held that this
/// vnetd did not claim (its config no longer has them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Swept {
    pub attachments: usize,
    pub ports: usize,
    pub links: usize,
}

/// One attachment: a TCX link, and its pin when the datapath is pinned.
struct Attachment {
    /// The link lives while a descriptor or its pin does.
    fd: OwnedFd,
    pin: Option<PathBuf>,
}

impl Attachment {
    /// Detaches it: the pin goes (if it is still this link's, not a later
    /// one's on the same device), then the last descriptor.
    fn remove(self) {
        if let Some(p) = &self.pin {
            let pinned = pin::obj_get(p).ok().and_then(|fd| pin::link_id(fd.as_raw_fd()));
            if pinned.is_some() && pinned == pin::link_id(self.fd.as_raw_fd()) {
                let _ = std::fs::remove_file(p);
            }
        }
    }
}

/// What the folder held when it was adopted and nobody has claimed since.
#[derive(Default)]
struct Leftovers {
    attachments: HashMap<(Hook, u32), OwnedFd>,
    ports: HashSet<u32>,
    links: HashSet<u32>,
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
    meta: MapHandle,
    ids: MapHandle,
    next_hops: MapHandle,
    /// ARP answers per port (`neigh.rs`).
    neigh: MapHandle,
    /// Neighbour solicitations' answers per port (`neigh.rs`).
    neigh6: MapHandle,
    progs: HashMap<Hook, OwnedFd>,
    /// What `config` holds (the programs' switch and settings).
    config_now: Mutex<Config>,
    /// Underlay devices with `from_network` attached, and how many links
    /// leave through each.
    underlays: Mutex<HashMap<u32, (Attachment, usize)>>,
    /// `from_network` on the finishing pair's receiving end.
    finisher: Mutex<Option<Attachment>>,
    /// The folder (None: pinning off; everything goes with this process).
    pins: Option<pin::Pins>,
    leftovers: Mutex<Leftovers>,
    /// What `meta` holds now.
    meta_now: Mutex<Meta>,
    /// `ids` had records when the folder was opened.
    had_ids: bool,
    /// How many programs this process has attached to guest ports.
    attached_ports: AtomicUsize,
    /// Called when a guest port is attached (the next-hop keeper, which
    /// sleeps while there is none).
    on_port: Mutex<Option<Box<dyn Fn() + Send + Sync>>>,
}

/// A program attached to a device (a TCX link), with the map entry that
/// describes the device to it. Dropped, it stays (pinned: it outlives
/// vnetd) or goes (detached, entry deleted), as `keep` last said: a new
/// one goes until its request commits, one adopted from a vnetd before
/// stays.
pub struct Attached {
    kernel: Arc<Kernel>,
    link: Option<Attachment>,
    ifindex: u32,
    /// The interface's id, as its `ports` entry holds it.
    origin: u32,
    keep: AtomicBool,
}

impl Attached {
    /// Whether it stays when dropped.
    pub fn keep(&self, keep: bool) {
        self.keep.store(keep, Relaxed);
    }
}

impl Drop for Attached {
    fn drop(&mut self) {
        let Some(link) = self.link.take() else { return };
        self.kernel.attached_ports.fetch_sub(1, Relaxed);
        if !self.keep.load(Relaxed) {
            link.remove();
            // The entry is this port's only if no later port on the device
            // (the interface added again) took it.
            if let Ok(Some(v)) = self.kernel.ports.lookup(bytes_of(&self.ifindex), MapFlags::ANY) {
                if from_bytes::<PortInfo>(&v).origin == self.origin {
                    let _ = self.kernel.ports.delete(bytes_of(&self.ifindex));
                }
            }
        }
    }
}

/// A link's place in the fast path: its header entry, its sender address
/// entry and a hold on its underlay device's program. Dropped, they stay
/// or go as `keep` last said (as `Attached`).
pub struct LinkEntry {
    kernel: Arc<Kernel>,
    id: u32,
    addr: AddrKey,
    underlay: u32,
    keep: AtomicBool,
}

impl LinkEntry {
    /// Whether its entries stay when it is dropped.
    pub fn keep(&self, keep: bool) {
        self.keep.store(keep, Relaxed);
    }
}

impl Drop for LinkEntry {
    fn drop(&mut self) {
        if self.keep.load(Relaxed) {
            return;
        }
        let _ = self.kernel.links.delete(bytes_of(&self.id));
        let _ = self.kernel.next_hops.delete(bytes_of(&self.id));
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

fn map_count(m: &MapHandle) -> usize {
    m.keys().count()
}

impl Kernel {
    /// Opens the kernel datapath: with `pins`, the folder's maps and
    /// attachments are adopted if they are this build's layout and this
    /// network namespace's (entries, counters and all, and the programs
    /// carry on until each attachment is claimed and switched to this
    /// build's program), else made anew and pinned there; without, it is
    /// this process's alone. `udp_port` is vnetd's UDP port (what links
    /// send to). New maps start with the fast path disabled (see
    /// `set_enabled`); adopted ones as they were.
    pub fn open(pins: Option<&Path>, udp_port: u16) -> Result<(Arc<Kernel>, Opened)> {
        let pins = pins.map(pin::Pins::open).transpose()?;
        let netns = pin::netns_inode();
        let mut open = ObjectBuilder::default().open_memory(OBJECT).context("cannot open the eBPF object")?;

        // What is pinned, and whether it is ours to adopt.
        let mut pinned: Vec<(&str, MapHandle)> = Vec::new();
        // Maps of ADDED_MAPS the folder lacks (made and pinned if the rest
        // is adopted).
        let mut added: Vec<&str> = Vec::new();
        let mut opened = Opened::Fresh;
        // The folder describes another network namespace's devices (its
        // ifindexes mean other devices here).
        let mut foreign = false;
        if let Some(p) = &pins {
            let mut fits = true;
            for name in PINNED_MAPS {
                let path = p.map_path(name);
                if !path.exists() {
                    if ADDED_MAPS.contains(&name) {
                        added.push(name);
                    } else {
                        fits = false;
                    }
                    continue;
                }
                opened = Opened::Replaced { layout: 0 };
                let m = open.maps().find(|m| m.name() == name).ok_or_else(|| anyhow!("no map {name}"))?;
                match MapHandle::from_pinned_path(&path) {
                    Ok(h) if h.map_type() == m.map_type()
                        && h.key_size() == m.key_size()
                        && h.value_size() == m.value_size()
                        && h.max_entries() == m.max_entries() =>
                    {
                        pinned.push((name, h))
                    }
                    _ => fits = false,
                }
            }
            let meta = pinned
                .iter()
                .find(|(n, _)| *n == "meta")
                .and_then(|(_, h)| h.lookup(bytes_of(&0u32), MapFlags::ANY).ok().flatten())
                .map(|v| from_bytes::<Meta>(&v));
            if let Some(m) = meta {
                foreign = m.netns != netns;
                opened = Opened::Replaced { layout: if m.magic == MAGIC { m.layout } else { 0 } };
                if fits && m.magic == MAGIC && m.layout == LAYOUT && m.netns == netns {
                    opened = Opened::Adopted { flows: 0, ports: 0, links: 0, attachments: 0 };
                }
            }
        }
        let adopt = matches!(opened, Opened::Adopted { .. });
        if adopt {
            for (name, h) in &pinned {
                let mut m = open.maps_mut().find(|m| m.name() == *name).ok_or_else(|| anyhow!("no map {name}"))?;
                m.reuse_fd(h.as_fd()).with_context(|| format!("cannot adopt map {name}"))?;
            }
        }
        drop(pinned);
        let obj = open.load().context("the kernel refused the fast path's eBPF programs")?;
        let map = |name: &str| -> Result<MapHandle> {
            let m = obj.maps().find(|m| m.name() == name).ok_or_else(|| anyhow!("no map {name}"))?;
            MapHandle::try_from(&m).with_context(|| format!("map {name}"))
        };
        let mut progs = HashMap::new();
        for hook in Hook::ALL {
            let p = obj.progs().find(|p| p.name() == hook.name()).ok_or_else(|| anyhow!("no program {}", hook.name()))?;
            progs.insert(hook, p.as_fd().try_clone_to_owned()?);
        }
        if let Some(p) = &pins {
            // New maps, pinned in the old ones' place: renamed over them,
            // so that the folder always has a map of each name. Adopting,
            // only the maps the folder lacked.
            let new: &[&str] = if adopt { &added } else { &PINNED_MAPS };
            for &name in new {
                let m = obj.maps().find(|m| m.name() == name).ok_or_else(|| anyhow!("no map {name}"))?;
                let (tmp, path) = (p.new_map_path(name), p.map_path(name));
                pin::obj_pin(m.as_fd().as_raw_fd(), &tmp)?;
                std::fs::rename(&tmp, &path).with_context(|| format!("cannot pin {}", path.display()))?;
            }
        }
        let mut leftovers = Leftovers::default();
        if let Some(p) = &pins {
            for (hook, ifindex, fd) in p.links() {
                match Hook::of(&hook) {
                    // Another namespace's attachment: not ours to switch or
                    // keep; its pin goes (the folder is this vnetd's now).
                    Some(_) if foreign => {
                        tracing::warn!("fast path: {} was another network namespace's; removing it", p.link_path(&hook, ifindex).display());
                        let _ = std::fs::remove_file(p.link_path(&hook, ifindex));
                    }
                    Some(h) => {
                        leftovers.attachments.insert((h, ifindex), fd);
                    }
                    None => {
                        let _ = std::fs::remove_file(p.link_path(&hook, ifindex));
                    }
                }
            }
        }
        let mut k = Kernel {
            flows: map("flows")?,
            links: map("links")?,
            link_addrs: map("link_addrs")?,
            ports: map("ports")?,
            config: map("config")?,
            counters: map("counters")?,
            stats: map("stats")?,
            meta: map("meta")?,
            ids: map("ids")?,
            next_hops: map("next_hops")?,
            neigh: map("neigh")?,
            neigh6: map("neigh6")?,
            progs,
            config_now: Mutex::new(Config::default()),
            underlays: Mutex::new(HashMap::new()),
            finisher: Mutex::new(None),
            pins,
            leftovers: Mutex::new(Leftovers::default()),
            meta_now: Mutex::new(Meta { magic: MAGIC, layout: LAYOUT, netns, ..Meta::default() }),
            had_ids: false,
            attached_ports: AtomicUsize::new(0),
            on_port: Mutex::new(None),
        };
        if adopt {
            let read = |m: &MapHandle| m.lookup(bytes_of(&0u32), MapFlags::ANY).ok().flatten();
            let mut c: Config = read(&k.config).map(|v| from_bytes(&v)).unwrap_or_default();
            c.port = udp_port.to_be();
            *k.config_now.lock().unwrap() = c;
            let meta: Meta = read(&k.meta).map(|v| from_bytes(&v)).unwrap_or_default();
            k.meta_now.lock().unwrap().next = meta.next;
            for key in k.ports.keys() {
                leftovers.ports.insert(from_bytes::<u32>(&key));
            }
            for key in k.links.keys() {
                leftovers.links.insert(from_bytes::<u32>(&key));
            }
            k.had_ids = k.ids.keys().next().is_some();
            opened = Opened::Adopted {
                flows: map_count(&k.flows),
                ports: leftovers.ports.len(),
                links: leftovers.links.len(),
                attachments: leftovers.attachments.len(),
            };
            k.update_config(|_| {})?;
        } else {
            *k.config_now.lock().unwrap() = Config { port: udp_port.to_be(), ..Config::default() };
            k.set_enabled(false)?;
        }
        k.write_meta()?;
        *k.leftovers.lock().unwrap() = leftovers;
        Ok((Arc::new(k), opened))
    }

    /// Removes the pinned datapath at `dir`: every attachment detached
    /// (frames then meet no program), every map freed. Refused while a
    /// vnetd holds the folder. Returns the devices the fast path handed
    /// frames to vnetd through (the upcall TAPs), for the caller to delete.
    pub fn destroy(dir: &Path) -> Result<Vec<u32>> {
        let pins = pin::Pins::open(dir)?;
        let upcalls = pins.links().into_iter().filter(|(h, _, _)| h == Hook::FromVnetd.name()).map(|(_, i, _)| i).collect();
        pins.destroy()?;
        Ok(upcalls)
    }

    /// The folder, when pinned.
    pub fn pin_dir(&self) -> Option<&Path> {
        self.pins.as_ref().map(|p| p.dir())
    }

    /// Removes what the folder held that this vnetd has not claimed since
    /// `open` (attachments, ports, links its config no longer has): called
    /// once its config is in force. Flow entries are the caller's to
    /// revalidate.
    pub fn finish_adoption(&self) -> Swept {
        let left = std::mem::take(&mut *self.leftovers.lock().unwrap());
        let swept = Swept { attachments: left.attachments.len(), ports: left.ports.len(), links: left.links.len() };
        for ((hook, ifindex), fd) in left.attachments {
            Attachment { fd, pin: self.pins.as_ref().map(|p| p.link_path(hook.name(), ifindex)) }.remove();
        }
        for ifindex in &left.ports {
            let _ = self.ports.delete(bytes_of(ifindex));
        }
        for id in &left.links {
            let _ = self.links.delete(bytes_of(id));
            let _ = self.next_hops.delete(bytes_of(id));
        }
        let stale: Vec<Vec<u8>> = self
            .link_addrs
            .keys()
            .filter(|k| {
                let v = self.link_addrs.lookup(k, MapFlags::ANY).ok().flatten();
                v.is_some_and(|v| left.links.contains(&from_bytes::<LinkAddr>(&v).link))
            })
            .collect();
        for k in stale {
            let _ = self.link_addrs.delete(&k);
        }
        swept
    }

    fn write_meta(&self) -> Result<()> {
        let m = *self.meta_now.lock().unwrap();
        self.meta.update(bytes_of(&0u32), bytes_of(&m), MapFlags::ANY).context("meta map")?;
        Ok(())
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
        let (a, _) = self.attach(Hook::FromNetwork, recv)?;
        *self.finisher.lock().unwrap() = Some(a);
        self.update_config(|c| {
            c.finish_ifindex = send;
            c.finish_recv = recv;
            c.finish_mac = recv_mac;
        })
    }

    /// Attaches `hook`'s program to `ifindex`'s ingress: by switching the
    /// attachment a vnetd before this one left there to this build's
    /// program (one `bpf_link_update`: no frame meets no program), or by a
    /// new TCX link, pinned. Returns it and whether it was adopted.
    fn attach(&self, hook: Hook, ifindex: u32) -> Result<(Attachment, bool)> {
        let prog = self.progs[&hook].as_raw_fd();
        let pin = self.pins.as_ref().map(|p| p.link_path(hook.name(), ifindex));
        let left = self.leftovers.lock().unwrap().attachments.remove(&(hook, ifindex));
        if let Some(fd) = left {
            match pin::link_update(fd.as_raw_fd(), prog) {
                Ok(()) => return Ok((Attachment { fd, pin }, true)),
                Err(e) => {
                    tracing::warn!("fast path: cannot switch {} on device {ifindex} to this build's program ({e}); attaching it anew", hook.name());
                    Attachment { fd, pin: pin.clone() }.remove();
                }
            }
        }
        // SAFETY: plain FFI call with valid fds; NULL options are allowed.
        let fd = unsafe {
            libbpf_rs::libbpf_sys::bpf_link_create(prog, ifindex as i32, libbpf_rs::libbpf_sys::BPF_TCX_INGRESS, std::ptr::null())
        };
        if fd < 0 {
            bail!("cannot attach the fast path (TCX ingress) to device {ifindex}: {}", std::io::Error::from_raw_os_error(-fd));
        }
        // SAFETY: a new descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        if let Some(p) = &pin {
            pin::obj_pin(fd.as_raw_fd(), p)?;
        }
        Ok((Attachment { fd, pin }, false))
    }

    /// Attaches the fast path to a guest port: `from_guest` on `dev` (where
    /// the guest's frames arrive: a veth's host end or QEMU's TAP), misses
    /// to the upcall TAP `upcall`; `from_vnetd` on `upcall`, frames vnetd
    /// writes there going to the guest (into the veth's peer if `veth`,
    /// else out of `dev`). `iface` is the interface's id. Both stay when
    /// dropped if both were adopted, else go (see `Attached::keep`).
    pub fn attach_port(self: &Arc<Self>, iface: u32, dev: u32, upcall: u32, veth: bool) -> Result<(Attached, Attached)> {
        {
            let mut left = self.leftovers.lock().unwrap();
            left.ports.remove(&dev);
            left.ports.remove(&upcall);
        }
        let guest = PortInfo { origin: iface, ifindex: upcall, peer: 0, _pad: 0 };
        self.ports.update(bytes_of(&dev), bytes_of(&guest), MapFlags::ANY)?;
        let mut a = Attached { kernel: self.clone(), link: None, ifindex: dev, origin: iface, keep: AtomicBool::new(false) };
        let back = PortInfo { origin: iface, ifindex: dev, peer: veth as u32, _pad: 0 };
        self.ports.update(bytes_of(&upcall), bytes_of(&back), MapFlags::ANY)?;
        let mut b = Attached { kernel: self.clone(), link: None, ifindex: upcall, origin: iface, keep: AtomicBool::new(false) };
        let (lb, adopted_b) = self.attach(Hook::FromVnetd, upcall)?;
        b.link = Some(lb);
        self.attached_ports.fetch_add(1, Relaxed);
        let (la, adopted_a) = self.attach(Hook::FromGuest, dev)?;
        a.link = Some(la);
        self.attached_ports.fetch_add(1, Relaxed);
        if let Some(f) = &*self.on_port.lock().unwrap() {
            f();
        }
        a.keep(adopted_a && adopted_b);
        b.keep(adopted_a && adopted_b);
        Ok((a, b))
    }

    /// Describes link `id` to the programs and attaches `from_network` to
    /// its underlay device (once per device). The peer's datagrams are
    /// carried only from `path.dst`:`path.dport` to `path.src`. It stays
    /// when dropped if a vnetd before this one had it, else goes (see
    /// `LinkEntry::keep`).
    pub fn add_link(self: &Arc<Self>, id: u32, path: &LinkPath) -> Result<LinkEntry> {
        {
            let mut u = self.underlays.lock().unwrap();
            if let Some(e) = u.get_mut(&path.ifindex) {
                e.1 += 1;
            } else {
                let (a, _) = self.attach(Hook::FromNetwork, path.ifindex)?;
                u.insert(path.ifindex, (a, 1));
            }
        }
        let adopted = self.leftovers.lock().unwrap().links.remove(&id);
        let addr = AddrKey { addr: u32::from_ne_bytes(path.dst.octets()), port: path.dport.to_be(), _pad: 0 };
        let entry = LinkEntry { kernel: self.clone(), id, addr, underlay: path.ifindex, keep: AtomicBool::new(adopted) };
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
                if let Some((a, _)) = u.remove(&ifindex) {
                    a.remove();
                }
            }
        }
    }

    /// The id a vnetd before this one gave the object of `kind` whose name
    /// hashes to `hash`, if it was in force when that vnetd last committed.
    pub fn stored_id(&self, kind: IdKind, hash: u64) -> Option<u32> {
        let key = IdKey { kind: kind as u32, _pad: 0, hash };
        self.ids.lookup(bytes_of(&key), MapFlags::ANY).ok().flatten().map(|v| from_bytes::<u32>(&v))
    }

    /// Whether any id was recorded when the folder was opened: if not, no
    /// name can have one this process did not give (and forget) itself,
    /// and `stored_id` need not be asked.
    pub fn had_ids(&self) -> bool {
        self.had_ids
    }

    /// Records (`Some`) or forgets (`None`) objects' ids: the records go
    /// in batches (one system call per 4096; a config of 100,000 routes
    /// commits its ids in 25).
    pub fn store_ids(&self, records: &[(IdKind, u64, Option<u32>)]) {
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        let flush = |keys: &mut Vec<u8>, values: &mut Vec<u8>| {
            let n = (keys.len() / std::mem::size_of::<IdKey>()) as u32;
            if n > 0 {
                if let Err(e) = self.ids.update_batch(keys, values, n, MapFlags::ANY, MapFlags::ANY) {
                    tracing::debug!("fast path: cannot record {n} ids: {e}");
                }
            }
            keys.clear();
            values.clear();
        };
        for &(kind, hash, id) in records {
            let key = IdKey { kind: kind as u32, _pad: 0, hash };
            match id {
                Some(id) => {
                    keys.extend_from_slice(bytes_of(&key));
                    values.extend_from_slice(bytes_of(&id));
                    if keys.len() >= 4096 * std::mem::size_of::<IdKey>() {
                        flush(&mut keys, &mut values);
                    }
                }
                None => {
                    // In order: a record made earlier in the list goes first.
                    flush(&mut keys, &mut values);
                    let _ = self.ids.delete(bytes_of(&key));
                }
            }
        }
        flush(&mut keys, &mut values);
    }

    /// The next id of each kind (interfaces, links, routes) not yet given.
    pub fn next_ids(&self) -> [u32; 3] {
        self.meta_now.lock().unwrap().next
    }

    pub fn set_next_ids(&self, next: [u32; 3]) {
        self.meta_now.lock().unwrap().next = next;
        if let Err(e) = self.write_meta() {
            tracing::debug!("fast path: {e:#}");
        }
    }

    /// Every link the programs know: (id, underlay device, peer address).
    pub fn link_paths(&self) -> Vec<(u32, u32, std::net::Ipv4Addr)> {
        let mut out = Vec::new();
        for k in self.links.keys() {
            if let Ok(Some(v)) = self.links.lookup(&k, MapFlags::ANY) {
                let l: RawLink = from_bytes(&v);
                out.push((from_bytes::<u32>(&k), l.ifindex, std::net::Ipv4Addr::from(l.daddr.to_ne_bytes())));
            }
        }
        out
    }

    /// Calls `f` whenever a guest port is attached from now on.
    pub fn on_port_attached(&self, f: Box<dyn Fn() + Send + Sync>) {
        *self.on_port.lock().unwrap() = Some(f);
    }

    /// Whether this process has the programs attached to any guest port
    /// (counted as they attach and detach: asking the hash map for its
    /// first key walks all its buckets in the kernel).
    pub fn has_ports(&self) -> bool {
        self.attached_ports.load(Relaxed) > 0
    }

    /// Sets (`Some`) or removes (`None`) link `id`'s next hop. Returns
    /// whether that changed the map.
    pub fn set_next_hop(&self, id: u32, hop: Option<NextHop>) -> Result<bool> {
        let held = self.next_hop(id);
        if held == hop {
            return Ok(false);
        }
        match hop {
            Some(h) => self.next_hops.update(bytes_of(&id), bytes_of(&h), MapFlags::ANY)?,
            None => self.next_hops.delete(bytes_of(&id))?,
        }
        Ok(true)
    }

    /// Link `id`'s next hop, if the programs have one.
    pub fn next_hop(&self, id: u32) -> Option<NextHop> {
        self.next_hops.lookup(bytes_of(&id), MapFlags::ANY).ok().flatten().map(|v| from_bytes::<NextHop>(&v))
    }

    /// The links that have a next hop.
    pub fn next_hop_ids(&self) -> Vec<u32> {
        self.next_hops.keys().map(|k| from_bytes::<u32>(&k)).collect()
    }

    /// How many links have a next hop (keys only: no value is read).
    pub fn next_hop_count(&self) -> usize {
        map_count(&self.next_hops)
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

