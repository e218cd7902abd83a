//! The daemon's state: interfaces, links and routes as the control plane
//! sees them (`Topology`), and the immutable view the datapath reads
//! (`Snapshot`).
//!
//! A control request is applied to a *copy* of the topology, command by
//! command, each checked against the state the previous ones left; only when
//! every command succeeded is the copy kept and a new snapshot published.
//! Resources (TAPs) made by a failed request are dropped with the copy, so a
//! bad request changes nothing. Building the snapshot to publish is the
//! request's commit point: only then are the fates of persistent TAPs
//! settled (`VirtualNic::in_force`, `VirtualNic::deleted`).
//!
//! **Ids.** Interfaces, links and routes have ids (`id`) given when added and
//! never changed or reused: the ports of the rule table (`Port`) are these
//! ids, and so are the keys of anything else that names a port. A
//! snapshot also lays its objects out in vectors for the datapath; those
//! positions ("slots") are private to one snapshot and never outlive it.
//!
//! **Lifecycle.** An object is *added* by a request, *in force* once the
//! snapshot holding it is published, *retired* by the request that deletes
//! it (it leaves the topology and goes to `retired`), and *torn down* by the
//! control plane, on its own thread, once every dispatcher runs a snapshot
//! without it (`control::Control`): never by whichever thread happens to let
//! go of it last.

use crate::link::direct::DirectLink;
use crate::link::tcp::{LinkKey, TcpLink, TcpTransport};
use crate::link::udp::UdpLink;
use crate::link::{GsoState, Rx, Transport, UdpEndpoint};
use crate::nic::{rtnl, tap, QemuNic, Tap, VethNic, VhostUserNic, VirtualNic};
use crate::stats::Counters;
use imbl::OrdMap;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicU8};
use vnet_core::command::{
    Attach, Command, Datapath, IfaceRef, IfaceSetting, Interrupts, LinkProto, LinkRef, Mode, RouteRef, Setting, YieldStrategy,
};
use vnet_core::rule::{DstSpec, RuleSpec, SrcSpec};
use vnet_core::table::{Port, Rule, RouteTable, SrcMatch};
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
const ETH_MIN_FOR_TCP: usize = 256;

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

/// What adding a link needs from the daemon.
pub trait LinkEnv {
    /// The kernel's path MTU toward an address.
    fn path_mtu(&self, to: SocketAddr) -> Option<u32>;
    /// vnetd's UDP socket of that family (IPv4 if `v4`), if it has one.
    fn udp(&self, v4: bool) -> Option<Arc<UdpEndpoint>>;
    /// The VXLAN socket of that family, made if needed.
    fn vxlan(&self, v4: bool) -> Result<Arc<UdpEndpoint>, String>;
    /// Makes sure TCP link connections are accepted.
    fn ensure_tcp_acceptor(&self) -> Result<(), String>;
    /// Describes a UDP link to the kernel fast path, if it is loaded and
    /// can carry it (IPv4 with a route to the peer); None otherwise.
    fn fast_link(&self, _id: u32, _remote: SocketAddr, _mtu: u32) -> Option<vnet_fastpath::LinkEntry> {
        None
    }
}

pub struct Route {
    pub id: u32,
    pub spec: RuleSpec,
    /// Who manages it (`owner <tag>`): vnet-agent's are `agent`.
    pub owner: Option<String>,
    pub stats: Counters,
}

/// Daemon-wide settings the control language consults.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Remote port of a link added without one (the daemon's own UDP port).
    pub default_link_port: u16,
    /// MTU of an interface added without one.
    pub default_mtu: u32,
    /// Host devices the administrator allowed direct links on
    /// (`--allow-direct`); no other device can be named by `LINK ADD direct`.
    pub direct_devices: Vec<String>,
    /// Where TCP links' key files are (`--link-key-dir`).
    pub link_key_dir: PathBuf,
}

/// The dispatcher's tunables (`SET ...`), with the papers' and the original
/// code's defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DispatchSettings {
    pub mode: Mode,
    pub yield_strategy: YieldStrategy,
    pub sleep_us: u32,
    pub nowork_us: u32,
    pub alpha_lower: u32,
    pub alpha_upper: u32,
    pub window_ms: u32,
    pub quota: u32,
    pub datapath: Datapath,
    pub interrupts: Interrupts,
    /// Optimistic interrupts' α and β (receive density, kB/s).
    pub eoc_alpha: u32,
    pub eoc_beta: u32,
    /// Frames sent from guests' shared memory uncopied.
    pub cut_through: bool,
}

impl Default for DispatchSettings {
    fn default() -> Self {
        DispatchSettings {
            // Event-driven, woken at once (a real-time dispatcher, see
            // worker::Sched): measured better than adaptive for applications
            // that keep the CPUs busy (MPI), and no worse for bulk TCP.
            mode: Mode::GuestDriven,
            yield_strategy: YieldStrategy::Adaptive,
            sleep_us: 1000,
            nowork_us: 1000,
            alpha_lower: 1_000,
            alpha_upper: 10_000,
            window_ms: 5,
            quota: 64,
            datapath: Datapath::Auto,
            interrupts: Interrupts::Plain,
            // Below 1 MB/s a stream is cold; above 200 MB/s (1.6 Gbit/s)
            // early interrupts drive it (docs/vhost-user.md).
            eoc_alpha: 1_000,
            eoc_beta: 200_000,
            cut_through: true,
        }
    }
}

impl DispatchSettings {
    pub fn render(&self) -> String {
        format!(
            "mode={} yield={} sleep-us={} nowork-us={} alpha-lower={} alpha-upper={} window-ms={} quota={} datapath={} interrupts={} eoc-alpha={} eoc-beta={} cut-through={}",
            self.mode.name(),
            self.yield_strategy.name(),
            self.sleep_us,
            self.nowork_us,
            self.alpha_lower,
            self.alpha_upper,
            self.window_ms,
            self.quota,
            self.datapath.name(),
            self.interrupts.name(),
            self.eoc_alpha,
            self.eoc_beta,
            if self.cut_through { "on" } else { "off" }
        )
    }
}

/// An interface's own dispatch settings (`INTERFACE SET`); `None` follows
/// the global one.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct IfaceOverrides {
    pub mode: Option<Mode>,
    pub alpha_lower: Option<u32>,
    pub alpha_upper: Option<u32>,
    pub window_ms: Option<u32>,
}

/// What an interface's dispatch runs by: its overrides over the globals.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IfaceDispatch {
    pub mode: Mode,
    pub alpha_lower: u32,
    pub alpha_upper: u32,
    pub window_ms: u32,
}

impl IfaceOverrides {
    pub fn effective(&self, d: &DispatchSettings) -> IfaceDispatch {
        IfaceDispatch {
            mode: self.mode.unwrap_or(d.mode),
            alpha_lower: self.alpha_lower.unwrap_or(d.alpha_lower),
            alpha_upper: self.alpha_upper.unwrap_or(d.alpha_upper),
            window_ms: self.window_ms.unwrap_or(d.window_ms),
        }
    }

    /// `mode=.. alpha-lower=.. alpha-upper=.. window-ms=..`, "default" where
    /// the interface follows the global value.
    pub fn render(&self) -> String {
        let n = |v: Option<u32>| v.map_or("default".to_string(), |v| v.to_string());
        format!(
            "mode={} alpha-lower={} alpha-upper={} window-ms={}",
            self.mode.map_or("default", |m| m.name()),
            n(self.alpha_lower),
            n(self.alpha_upper),
            n(self.window_ms)
        )
    }
}

#[derive(Clone, Default)]
pub struct Topology {
    pub dispatch: DispatchSettings,
    /// Interfaces (by index) with dispatch settings of their own.
    pub iface_settings: BTreeMap<u32, IfaceOverrides>,
    pub ifaces: BTreeMap<u32, Arc<Interface>>,
    pub links: BTreeMap<u32, Arc<Link>>,
    /// Routes by id. This, the index below and the rule table are
    /// persistent maps: the copy a request works on shares them with the
    /// topology in force, and a route added or deleted copies only what it
    /// touches, so a change costs the same in a table of any size.
    pub routes: OrdMap<u32, Arc<Route>>,
    /// Routes by rule, to refuse a second copy without a scan.
    route_by_spec: imbl::HashMap<RuleSpec, u32>,
    /// The routes resolved to ports: what snapshots route by.
    table: RouteTable,
    /// How many routes name each port (as destination or source), so that
    /// deleting an unused interface or link needs no scan of the routes.
    port_uses: HashMap<Port, u32>,
    /// Routes the request being applied deleted (the fast path forgets
    /// their counters when it commits).
    pub removed_routes: Vec<u32>,
    /// What the request being applied took out (a deleted interface's TAP
    /// has its fate settled when the request commits).
    pub retired: Vec<Retired>,
    next_iface: u32,
    next_link: u32,
    next_route: u32,
    /// The kernel fast path's programs, if they loaded (whether or not the
    /// fast path is on): guest ports attach to them.
    pub kernel: Option<Arc<vnet_fastpath::Kernel>>,
}

impl Topology {
    /// Applies one mutating command; returns a line saying what it did.
    /// `env` gives what adding a link needs (sockets, path MTUs).
    pub fn apply(
        &mut self,
        cmd: &Command,
        settings: &Settings,
        env: &dyn LinkEnv,
    ) -> Result<String, String> {
        match cmd {
            Command::Set(s) => {
                let d = &mut self.dispatch;
                match *s {
                    Setting::Mode(m) => d.mode = m,
                    Setting::Yield(y) => d.yield_strategy = y,
                    Setting::SleepUs(v) => d.sleep_us = v,
                    Setting::NoworkUs(v) => d.nowork_us = v,
                    Setting::AlphaLower(v) => d.alpha_lower = v,
                    Setting::AlphaUpper(v) => d.alpha_upper = v,
                    Setting::WindowMs(v) => d.window_ms = v,
                    Setting::Quota(v) => d.quota = v,
                    Setting::Datapath(v) => {
                        if v == Datapath::Kernel && self.kernel.is_none() {
                            return Err("the kernel fast path is not loaded on this host (see vnetd's log); datapath auto or user".into());
                        }
                        d.datapath = v
                    }
                    Setting::Interrupts(v) => d.interrupts = v,
                    Setting::EocAlpha(v) => d.eoc_alpha = v,
                    Setting::EocBeta(v) => d.eoc_beta = v,
                    Setting::CutThrough(v) => d.cut_through = v,
                }
                self.check_thresholds()?;
                Ok(format!("set {}", self.dispatch.render()))
            }
            Command::IfaceSet(r, setting) => {
                let iface = self.find_iface(r)?;
                let (idx, name) = (iface.id, iface.name.clone());
                let o = self.iface_settings.entry(idx).or_default();
                match *setting {
                    IfaceSetting::Mode(v) => o.mode = v,
                    IfaceSetting::AlphaLower(v) => o.alpha_lower = v,
                    IfaceSetting::AlphaUpper(v) => o.alpha_upper = v,
                    IfaceSetting::WindowMs(v) => o.window_ms = v,
                }
                let shown = o.render();
                if *o == IfaceOverrides::default() {
                    self.iface_settings.remove(&idx);
                }
                self.check_thresholds()?;
                Ok(format!("interface {idx} {name} {shown}"))
            }
            Command::IfaceAdd { name, mac, mtu, attach, netns, socket, network, ifname } => {
                if let Some(i) = self.ifaces.values().find(|i| &i.name == name) {
                    return Err(format!("interface {name} exists (index {})", i.id));
                }
                if let Some(i) = self.ifaces.values().find(|i| &i.mac == mac) {
                    return Err(format!("MAC {mac} is already interface {}", i.name));
                }
                if self.retired.iter().any(|r| matches!(r, Retired::Iface(i, detach) if &i.name == name && !detach)) {
                    // Its TAP goes when this request commits: it cannot also be taken over.
                    return Err(format!("interface {name} is deleted by this request; add it again in another one"));
                }
                // A QEMU TAP or a netns TAP that vnetd made may be taken over
                // (Tap::create_for_qemu, Tap::create_in_netns); a plain TAP is
                // always new.
                if *attach == Attach::Netns && netns.is_none() {
                    match rtnl::device(name).map_err(|e| format!("cannot look up {name}: {e}"))? {
                        Some(d) if d.is_vnetds() => return Err(format!("a device named {name} already exists on this host")),
                        Some(_) => return Err(tap::not_vnetds(name)),
                        None => {}
                    }
                }
                let mtu = mtu.unwrap_or(settings.default_mtu);
                let nic: Box<dyn VirtualNic> = match (attach, netns) {
                    (Attach::Netns, None) => Tap::create(name, mtu, *mac).map(|t| Box::new(t) as Box<dyn VirtualNic>),
                    (Attach::Netns, Some(ns)) => Tap::create_in_netns(name, mtu, *mac, ns).map(|(t, _)| Box::new(t) as Box<dyn VirtualNic>),
                    (Attach::Qemu, _) => QemuNic::new(name, mtu, self.next_iface, self.kernel.as_ref()).map(|n| Box::new(n) as Box<dyn VirtualNic>),
                    (Attach::Veth, Some(ns)) => {
                        let kernel = self.kernel.as_ref();
                        VethNic::new(ifname.as_deref().unwrap_or(name), *mac, mtu, ns, self.next_iface, kernel).map(|n| Box::new(n) as Box<dyn VirtualNic>)
                    }
                    (Attach::Veth, None) => return Err("a veth interface needs netns <name>".into()),
                    (Attach::VhostUser { client }, _) => {
                        let Some(path) = socket else { return Err("a vhost-user interface needs a socket path".into()) };
                        VhostUserNic::new(name, path, *client).map(|n| Box::new(n) as Box<dyn VirtualNic>)
                    }
                }
                .map_err(|e| format!("{e:#}"))?;
                let idx = self.next_iface;
                self.next_iface += 1;
                let attach = *attach;
                self.ifaces.insert(
                    idx,
                    Arc::new(Interface {
                        id: idx,
                        name: name.clone(),
                        mac: *mac,
                        mtu,
                        attach,
                        netns: netns.clone(),
                        network: network.clone(),
                        nic,
                        stats: Counters::default(),
                        running_mode: AtomicU8::new(Mode::GuestDriven as u8),
                        mode_switches: AtomicU64::new(0),
                    }),
                );
                let how = match attach {
                    Attach::Qemu => " qemu",
                    Attach::Veth => " veth",
                    Attach::Netns => "",
                    Attach::VhostUser { .. } => " vhost-user",
                };
                Ok(format!("added interface {idx} {name} {mac} mtu {mtu}{how}"))
            }
            Command::IfaceDel(r, detach) => {
                let (idx, name) = self.find_iface(r).map(|i| (i.id, i.name.clone()))?;
                let managed = self
                    .clear_routes_using(Port::Interface(idx))
                    .map_err(|users| format!("interface {name} is used by routes {users} (delete them first)"))?;
                let iface = self.ifaces.remove(&idx).expect("found above");
                self.iface_settings.remove(&idx);
                self.retired.push(Retired::Iface(iface, *detach));
                Ok(format!("{} interface {idx} {name}{managed}", if *detach { "detached" } else { "deleted" }))
            }
            Command::LinkAdd { ip, port, proto, name, mtu, vtoe } => {
                self.add_link(*ip, *port, proto, name.clone(), *mtu, vtoe.as_deref(), settings, env)
            }
            Command::LinkDel(r) => {
                let (idx, name) = self.find_link(r).map(|l| (l.id, l.name.clone()))?;
                let managed = self
                    .clear_routes_using(Port::Link(idx))
                    .map_err(|users| format!("link {name} is used by routes {users} (delete them first)"))?;
                let link = self.links.remove(&idx).expect("found above");
                self.retired.push(Retired::Link(link));
                Ok(format!("deleted link {idx} {name}{managed}"))
            }
            Command::RouteAdd(spec, owner) => {
                let rule = self.resolve(spec)?;
                if let Some(r) = self.route_by_spec.get(spec) {
                    return Err(format!("the same rule is already route {r}"));
                }
                let idx = self.next_route;
                self.next_route += 1;
                self.routes.insert(
                    idx,
                    Arc::new(Route { id: idx, spec: spec.clone(), owner: owner.clone(), stats: Counters::default() }),
                );
                self.route_by_spec.insert(spec.clone(), idx);
                self.table.insert(idx, rule);
                for p in ports_named(&rule) {
                    *self.port_uses.entry(p).or_default() += 1;
                }
                Ok(format!("added route {idx} {spec}"))
            }
            Command::RouteDel(r) => {
                let idx = match r {
                    RouteRef::Index(i) => self.routes.get(i).map(|r| r.id).ok_or_else(|| format!("no route {i}"))?,
                    RouteRef::Rule(spec) => *self.route_by_spec.get(spec).ok_or_else(|| format!("no route is {spec}"))?,
                };
                let route = self.remove_route(idx);
                Ok(format!("deleted route {idx} {}", route.spec))
            }
            _ => Err("not a state-changing command".into()),
        }
    }

    /// α_l must stay below α_u, globally and for every interface.
    fn check_thresholds(&self) -> Result<(), String> {
        let d = &self.dispatch;
        if d.alpha_lower >= d.alpha_upper {
            return Err(format!("alpha-lower ({}) must be below alpha-upper ({})", d.alpha_lower, d.alpha_upper));
        }
        if d.eoc_alpha >= d.eoc_beta {
            return Err(format!("eoc-alpha ({}) must be below eoc-beta ({})", d.eoc_alpha, d.eoc_beta));
        }
        for (idx, o) in &self.iface_settings {
            let e = o.effective(d);
            if e.alpha_lower >= e.alpha_upper {
                return Err(format!(
                    "interface {idx}: alpha-lower ({}) must be below alpha-upper ({})",
                    e.alpha_lower, e.alpha_upper
                ));
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn add_link(
        &mut self,
        ip: Option<IpAddr>,
        port: Option<u16>,
        proto: &LinkProto,
        name: Option<String>,
        mtu: Option<u32>,
        vtoe: Option<&str>,
        settings: &Settings,
        env: &dyn LinkEnv,
    ) -> Result<String, String> {
        // An IPv4-mapped IPv6 address is the IPv4 peer: one link per peer,
        // sent from and matched on the IPv4 socket.
        let ip = ip.map(|ip| ip.to_canonical());
        if let Some(ip) = ip {
            if ip.is_unspecified() || ip.is_multicast() {
                return Err(format!("{ip} is not a unicast address"));
            }
        }
        let (transport, remote, name, mtu, overhead): (Arc<dyn Transport>, _, _, _, _) = match (proto, ip) {
            (LinkProto::Direct { device }, _) => {
                direct_allowed(settings, device)?;
                let dev_mtu = tap::device_mtu(device).map_err(|e| format!("no device {device} on this host ({e})"))?;
                if self.links.values().any(|l| matches!(&l.proto, LinkProto::Direct { device: d } if d == device)) {
                    return Err(format!("device {device} already has a direct link"));
                }
                let link = DirectLink::bind(device).map_err(|e| format!("{e:#}"))?;
                // A direct link's MTU is its device's; frames carry only Ethernet.
                (Arc::new(link), None, name.unwrap_or_else(|| device.clone()), mtu.unwrap_or(dev_mtu), -14i64)
            }
            (_, None) => return Err("this link needs a remote address".into()),
            (proto, Some(ip)) => {
                let v4 = ip.is_ipv4();
                let family = if v4 { 0 } else { 20 };
                let default_port = match proto {
                    LinkProto::Vxlan { .. } => vnet_core::command::VXLAN_PORT,
                    _ => settings.default_link_port,
                };
                let remote = SocketAddr::new(ip, port.unwrap_or(default_port));
                let (transport, overhead): (Arc<dyn Transport>, i64) = match proto {
                    LinkProto::Udp => {
                        let Some(ep) = env.udp(v4) else {
                            return Err(format!("vnetd has no UDP socket for {} (see --udp-bind)", if v4 { "IPv4" } else { "IPv6" }));
                        };
                        (Arc::new(UdpLink::new(ep, remote, None)), 28 + family)
                    }
                    LinkProto::Vxlan { vni } => (Arc::new(UdpLink::new(env.vxlan(v4)?, remote, Some(*vni))), 36 + family),
                    LinkProto::Tcp { key } => {
                        let key = LinkKey::load(&settings.link_key_dir, key)?;
                        env.ensure_tcp_acceptor()?;
                        (Arc::new(TcpTransport(TcpLink::new(remote, key)?)), 40 + family)
                    }
                    LinkProto::Direct { .. } => unreachable!("matched above"),
                };
                let mtu = mtu.or_else(|| env.path_mtu(remote)).unwrap_or(1500);
                (transport, Some(remote), name.unwrap_or_else(|| ip.to_string()), mtu, overhead)
            }
        };
        if let Some(l) = self.links.values().find(|l| l.name == name) {
            return Err(format!("a link named {name} exists (index {})", l.id));
        }
        let kind = transport.kind();
        if let (Some(r), Some(l)) = (remote, self.links.values().find(|l| l.remote == remote && l.transport.kind() == kind)) {
            let same_vni = match (&l.proto, proto) {
                (LinkProto::Vxlan { vni: a }, LinkProto::Vxlan { vni: b }) => a == b,
                _ => true,
            };
            if same_vni {
                return Err(format!("link {} already goes to {r} by {kind}", l.name));
            }
        }
        if let (LinkProto::Tcp { .. }, Some(r)) = (proto, remote) {
            if self.links.values().any(|l| matches!(l.proto, LinkProto::Tcp { .. }) && l.remote.map(|x| x.ip()) == Some(r.ip())) {
                return Err(format!("a TCP link to {} exists (the peer is told apart by its address)", r.ip()));
            }
        }
        let vtoe = match (vtoe, remote) {
            (None, _) => None,
            (Some(_), None) => return Err("a link without a peer vnetd takes no vtoe key".into()),
            (Some(k), Some(r)) => {
                if let Some(l) = self.links.values().find(|l| l.vtoe.is_some() && l.remote.map(|x| x.ip()) == Some(r.ip())) {
                    return Err(format!("link {} already carries VTOE with {} (the peer is told apart by its address)", l.name, r.ip()));
                }
                Some((k.to_string(), LinkKey::load(&settings.link_key_dir, k)?))
            }
        };
        let max_frame = ((mtu as i64 - overhead).max(ETH_MIN_FOR_TCP as i64)) as usize;
        let idx = self.next_link;
        let fast = match (proto, remote) {
            (LinkProto::Udp, Some(r)) => env.fast_link(idx, r, mtu),
            _ => None,
        };
        self.next_link += 1;
        let shown = remote.map_or(String::new(), |r| format!(" {r}"));
        let shown_vtoe = if vtoe.is_some() { " vtoe" } else { "" };
        self.links.insert(
            idx,
            Arc::new(Link {
                id: idx,
                name: name.clone(),
                proto: proto.clone(),
                transport,
                remote,
                mtu,
                max_frame,
                stats: Counters::default(),
                gso: GsoState::default(),
                fast,
                vtoe,
            }),
        );
        Ok(format!("added link {idx} {name} {kind}{shown} mtu {mtu}{shown_vtoe}"))
    }

    fn find_iface(&self, r: &IfaceRef) -> Result<&Arc<Interface>, String> {
        self.ifaces
            .values()
            .find(|i| match r {
                IfaceRef::Name(n) => &i.name == n,
                IfaceRef::Mac(m) => &i.mac == m,
            })
            .ok_or_else(|| match r {
                IfaceRef::Name(n) => format!("no interface {n}"),
                IfaceRef::Mac(m) => format!("no interface has MAC {m}"),
            })
    }

    fn find_link(&self, r: &LinkRef) -> Result<&Arc<Link>, String> {
        match r {
            LinkRef::Index(i) => self.links.get(i).ok_or_else(|| format!("no link {i}")),
            LinkRef::Name(n) => self.links.values().find(|l| &l.name == n).ok_or_else(|| format!("no link {n}")),
        }
    }

    fn remove_route(&mut self, idx: u32) -> Arc<Route> {
        let route = self.routes.remove(&idx).expect("the caller found it");
        self.route_by_spec.remove(&route.spec);
        let rule = self.table.remove(idx).expect("every route is in the table");
        for p in ports_named(&rule) {
            match self.port_uses.get_mut(&p) {
                Some(n) if *n > 1 => *n -= 1,
                _ => {
                    self.port_uses.remove(&p);
                }
            }
        }
        self.removed_routes.push(idx);
        route
    }

    /// Before `port` goes: the routes that name it. A user's (no owner)
    /// keep it: their ids are the error. Routes with an owner (an agent
    /// that derives them, and will derive them again) go with it; the
    /// result says which. No scan when no route names the port.
    fn clear_routes_using(&mut self, port: Port) -> Result<String, String> {
        if !self.port_uses.contains_key(&port) {
            return Ok(String::new());
        }
        let users: Vec<(u32, bool)> = self
            .table
            .rules()
            .filter(|(_, rule)| ports_named(rule).any(|p| p == port))
            .map(|(id, _)| (id, self.routes[&id].owner.is_some()))
            .collect();
        let by_hand: Vec<String> = users.iter().filter(|(_, owned)| !owned).map(|(id, _)| id.to_string()).collect();
        if !by_hand.is_empty() {
            return Err(by_hand.join(", "));
        }
        for (id, _) in &users {
            self.remove_route(*id);
        }
        Ok(match users.len() {
            0 => String::new(),
            n => format!(" and its {n} managed route(s)"),
        })
    }

    /// The rule a route's spec comes to: its endpoints' names resolved to
    /// ports, or why they cannot be.
    fn resolve(&self, spec: &RuleSpec) -> Result<Rule, String> {
        let iface = |m: &Mac, what: &str| {
            self.ifaces.values().find(|i| &i.mac == m).map(|i| i.id).ok_or_else(|| format!("no interface has MAC {m}{what}"))
        };
        let link = |n: &String, what: &str| {
            self.links.values().find(|l| &l.name == n).map(|l| l.id).ok_or_else(|| format!("no link named {n}{what}"))
        };
        let dst = match &spec.dst {
            DstSpec::Interface(m) => Port::Interface(iface(m, "")?),
            DstSpec::Edge(n) => Port::Link(link(n, "")?),
        };
        let src = match &spec.src {
            SrcSpec::Any => SrcMatch::Any,
            SrcSpec::Interface(None) => SrcMatch::AnyInterface,
            SrcSpec::Edge(None) => SrcMatch::AnyLink,
            SrcSpec::Interface(Some(m)) => SrcMatch::Exactly(Port::Interface(iface(m, " (source)")?)),
            SrcSpec::Edge(Some(n)) => SrcMatch::Exactly(Port::Link(link(n, " (source)")?)),
        };
        Ok(Rule { src_mac: spec.src_mac, dst_mac: spec.dst_mac, src, dst })
    }

    /// The datapath's view of this topology, to publish: the request that
    /// made it commits. Persistent TAPs' fates are settled here: those of
    /// interfaces in force stay with them, those of deleted interfaces go,
    /// unless only detached.
    pub fn snapshot(&self, generation: u64) -> Snapshot {
        for i in self.ifaces.values() {
            i.nic.in_force();
        }
        for r in &self.retired {
            if let Retired::Iface(i, detach) = r {
                i.nic.deleted(*detach);
            }
        }
        let ifaces: Vec<Arc<Interface>> = self.ifaces.values().cloned().collect();
        let links: Vec<Arc<Link>> = self.links.values().cloned().collect();
        let mut by_addr = HashMap::new();
        let mut by_ip: HashMap<IpAddr, Option<u32>> = HashMap::new();
        let mut vxlan = HashMap::new();
        let mut tcp = HashMap::new();
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
                Rx::Device(_) => {}
            }
        }
        let iface_dispatch = ifaces
            .iter()
            .map(|i| self.iface_settings.get(&i.id).copied().unwrap_or_default().effective(&self.dispatch))
            .collect();
        Snapshot {
            generation,
            iface_slot: ifaces.iter().enumerate().map(|(s, i)| (i.id, s as u32)).collect(),
            link_slot: links.iter().enumerate().map(|(s, l)| (l.id, s as u32)).collect(),
            ifaces,
            links,
            routes: self.routes.clone(),
            table: {
                let mut t = self.table.clone();
                t.set_generation(generation);
                t
            },
            by_addr,
            by_ip,
            vxlan,
            tcp,
            dispatch: self.dispatch,
            iface_dispatch,
            fast_on: self.kernel.is_some() && self.dispatch.datapath != Datapath::User,
        }
    }
}

/// The ports a rule names: its destination, and its source if exact.
fn ports_named(r: &Rule) -> impl Iterator<Item = Port> {
    let src = match r.src {
        SrcMatch::Exactly(p) if p != r.dst => Some(p),
        _ => None,
    };
    std::iter::once(r.dst).chain(src)
}

/// Direct links put frames raw onto a host device: only onto the devices the
/// administrator named with `--allow-direct`.
fn direct_allowed(settings: &Settings, device: &str) -> Result<(), String> {
    if settings.direct_devices.iter().any(|d| d == device) {
        Ok(())
    } else {
        Err(format!("device {device} is not allowed for direct links (start vnetd with --allow-direct {device})"))
    }
}

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
    pub fn empty() -> Snapshot {
        Topology::default().snapshot(0)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(direct: &[&str]) -> Settings {
        Settings {
            default_link_port: 9000,
            default_mtu: 1500,
            direct_devices: direct.iter().map(|d| d.to_string()).collect(),
            link_key_dir: PathBuf::from("/nonexistent"),
        }
    }

    struct NoEnv;

    impl LinkEnv for NoEnv {
        fn path_mtu(&self, _: SocketAddr) -> Option<u32> {
            None
        }
        fn udp(&self, _: bool) -> Option<Arc<UdpEndpoint>> {
            None
        }
        fn vxlan(&self, _: bool) -> Result<Arc<UdpEndpoint>, String> {
            Err("no VXLAN here".into())
        }
        fn ensure_tcp_acceptor(&self) -> Result<(), String> {
            Ok(())
        }
    }

    #[test]
    fn only_allowed_devices_take_direct_links() {
        let s = settings(&["eth1", "lan0"]);
        assert_eq!(direct_allowed(&s, "eth1"), Ok(()));
        assert_eq!(direct_allowed(&s, "lan0"), Ok(()));
        assert_eq!(
            direct_allowed(&s, "eth0"),
            Err("device eth0 is not allowed for direct links (start vnetd with --allow-direct eth0)".into())
        );
        // Exact names only: no prefixes, no case folding.
        assert!(direct_allowed(&s, "eth").is_err());
        assert!(direct_allowed(&s, "ETH1").is_err());
        assert!(direct_allowed(&settings(&[]), "lo").is_err());
    }

    #[test]
    fn a_direct_link_to_a_device_not_allowed_is_refused_before_the_device_is_touched() {
        let mut t = Topology::default();
        // "lo" exists everywhere: the refusal must come from the allow-list.
        let cmd = Command::LinkAdd {
            ip: None,
            port: None,
            proto: LinkProto::Direct { device: "lo".into() },
            name: None,
            mtu: None,
            vtoe: None,
        };
        let err = t.apply(&cmd, &settings(&["eth1"]), &NoEnv).expect_err("refused");
        assert_eq!(err, "device lo is not allowed for direct links (start vnetd with --allow-direct lo)");
        assert!(t.links.is_empty());
    }
}
#[cfg(test)]
#[path = "topology_tests.rs"]
mod apply_tests;
