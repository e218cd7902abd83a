//! The daemon's state: interfaces, links and routes as the control plane
//! sees them (`Topology`), and the immutable view the datapath reads
//! (`Snapshot`).
//!
//! A control request is applied to a *copy* of the topology, command by
//! command, each checked against the state the previous ones left; only when
//! every command succeeded is the copy kept and a new snapshot published.
//! Resources (TAPs) made by a failed request are dropped with the copy, so a
//! bad request changes nothing.

use crate::nic::{tap, Nic, Tap};
use crate::stats::Counters;
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicU8};
use vnet_core::command::{Attach, Command, IfaceRef, LinkProto, LinkRef, Mode, RouteRef, Setting, YieldStrategy};
use vnet_core::rule::{DstSpec, RuleSpec, SrcSpec};
use vnet_core::table::{Port, Rule, RouteTable, SrcMatch};
use vnet_core::Mac;

pub struct Interface {
    pub idx: u32,
    pub name: String,
    pub mac: Mac,
    pub mtu: u32,
    pub attach: Attach,
    pub nic: Nic,
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
}

pub struct Link {
    pub idx: u32,
    pub name: String,
    pub remote: SocketAddr,
    /// Underlay MTU toward the peer: given, or the kernel's path MTU.
    pub mtu: u32,
    /// Largest frame that crosses the underlay in one unfragmented datagram;
    /// TCP super-frames are cut to fit it.
    pub max_frame: usize,
    pub stats: Counters,
}

/// Smallest frame a link is sized for: room for TCP headers and some data.
const ETH_MIN_FOR_TCP: usize = 256;

pub struct Route {
    pub idx: u32,
    pub spec: RuleSpec,
    pub stats: Counters,
}

/// Daemon-wide settings the control language consults.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Remote port of a link added without one (the daemon's own UDP port).
    pub default_link_port: u16,
    /// MTU of an interface added without one.
    pub default_mtu: u32,
    /// Whether the UDP endpoint is IPv4 (links must be of the same family).
    pub udp_is_ipv4: bool,
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
}

impl Default for DispatchSettings {
    fn default() -> Self {
        DispatchSettings {
            mode: Mode::Adaptive,
            yield_strategy: YieldStrategy::Adaptive,
            sleep_us: 1000,
            nowork_us: 1000,
            alpha_lower: 1_000,
            alpha_upper: 10_000,
            window_ms: 5,
            quota: 64,
        }
    }
}

impl DispatchSettings {
    pub fn render(&self) -> String {
        format!(
            "mode={} yield={} sleep-us={} nowork-us={} alpha-lower={} alpha-upper={} window-ms={} quota={}",
            self.mode.name(),
            self.yield_strategy.name(),
            self.sleep_us,
            self.nowork_us,
            self.alpha_lower,
            self.alpha_upper,
            self.window_ms,
            self.quota
        )
    }
}

#[derive(Clone, Default)]
pub struct Topology {
    pub dispatch: DispatchSettings,
    /// Interfaces (by index) whose mode is set apart from the global one.
    pub iface_modes: BTreeMap<u32, Mode>,
    pub ifaces: BTreeMap<u32, Arc<Interface>>,
    pub links: BTreeMap<u32, Arc<Link>>,
    pub routes: BTreeMap<u32, Arc<Route>>,
    next_iface: u32,
    next_link: u32,
    next_route: u32,
}

impl Topology {
    /// Applies one mutating command; returns a line saying what it did.
    /// `path_mtu` asks the kernel for the MTU toward an address.
    pub fn apply(
        &mut self,
        cmd: &Command,
        settings: &Settings,
        path_mtu: &dyn Fn(SocketAddr) -> Option<u32>,
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
                }
                if d.alpha_lower >= d.alpha_upper {
                    return Err(format!(
                        "alpha-lower ({}) must be below alpha-upper ({})",
                        d.alpha_lower, d.alpha_upper
                    ));
                }
                Ok(format!("set {}", d.render()))
            }
            Command::IfaceSetMode(r, mode) => {
                let iface = self.find_iface(r)?;
                let (idx, name) = (iface.idx, iface.name.clone());
                match mode {
                    Some(m) => self.iface_modes.insert(idx, *m),
                    None => self.iface_modes.remove(&idx),
                };
                let shown = mode.map_or("default".to_string(), |m| m.name().to_string());
                Ok(format!("interface {idx} {name} mode {shown}"))
            }
            Command::IfaceAdd { name, mac, mtu, attach } => {
                if let Some(i) = self.ifaces.values().find(|i| &i.name == name) {
                    return Err(format!("interface {name} exists (index {})", i.idx));
                }
                if let Some(i) = self.ifaces.values().find(|i| &i.mac == mac) {
                    return Err(format!("MAC {mac} is already interface {}", i.name));
                }
                // A QEMU TAP may be left from an earlier vnetd and is taken over.
                let reusable = *attach == Attach::Qemu && tap::is_tap(name);
                if tap::device_exists(name) && !reusable {
                    return Err(format!("a device named {name} already exists on this host"));
                }
                let mtu = mtu.unwrap_or(settings.default_mtu);
                let nic = match attach {
                    Attach::Netns => Tap::create(name, mtu, *mac).map(Nic::Tap),
                    Attach::Qemu => Nic::qemu(name, mtu),
                }
                .map_err(|e| format!("{e:#}"))?;
                let idx = self.next_iface;
                self.next_iface += 1;
                let attach = *attach;
                self.ifaces.insert(
                    idx,
                    Arc::new(Interface {
                        idx,
                        name: name.clone(),
                        mac: *mac,
                        mtu,
                        attach,
                        nic,
                        stats: Counters::default(),
                        running_mode: AtomicU8::new(Mode::GuestDriven as u8),
                        mode_switches: AtomicU64::new(0),
                    }),
                );
                Ok(format!("added interface {idx} {name} {mac} mtu {mtu}{}", if attach == Attach::Qemu { " qemu" } else { "" }))
            }
            Command::IfaceDel(r) => {
                let iface = self.find_iface(r)?;
                let users = self.routes_using(|s| {
                    s.dst == DstSpec::Interface(iface.mac) || s.src == SrcSpec::Interface(Some(iface.mac))
                });
                if !users.is_empty() {
                    return Err(format!("interface {} is used by routes {} (delete them first)", iface.name, users));
                }
                let (idx, name) = (iface.idx, iface.name.clone());
                self.ifaces.remove(&idx);
                self.iface_modes.remove(&idx);
                Ok(format!("deleted interface {idx} {name}"))
            }
            Command::LinkAdd { ip, port, proto, name, mtu } => {
                if *proto != LinkProto::Udp {
                    return Err("only udp links are supported by this vnetd".into());
                }
                if ip.is_ipv4() != settings.udp_is_ipv4 {
                    let fam = if settings.udp_is_ipv4 { "IPv4" } else { "IPv6" };
                    return Err(format!("link address {ip} is not {fam}, the family vnetd's UDP endpoint is bound to (--udp-bind)"));
                }
                if ip.is_unspecified() || ip.is_multicast() {
                    return Err(format!("{ip} is not a unicast address"));
                }
                let remote = SocketAddr::new(*ip, port.unwrap_or(settings.default_link_port));
                let name = name.clone().unwrap_or_else(|| ip.to_string());
                if let Some(l) = self.links.values().find(|l| l.name == name) {
                    return Err(format!("a link named {name} exists (index {})", l.idx));
                }
                if let Some(l) = self.links.values().find(|l| l.remote == remote) {
                    return Err(format!("link {} already goes to {remote}", l.name));
                }
                let mtu = mtu.or_else(|| path_mtu(remote)).unwrap_or(1500);
                let overhead = if ip.is_ipv4() { 28 } else { 48 };
                let max_frame = (mtu as usize).saturating_sub(overhead).max(ETH_MIN_FOR_TCP);
                let idx = self.next_link;
                self.next_link += 1;
                self.links.insert(
                    idx,
                    Arc::new(Link { idx, name: name.clone(), remote, mtu, max_frame, stats: Counters::default() }),
                );
                Ok(format!("added link {idx} {name} udp {remote} mtu {mtu}"))
            }
            Command::LinkDel(r) => {
                let link = self.find_link(r)?;
                let users = self.routes_using(|s| {
                    s.dst == DstSpec::Edge(link.name.clone()) || s.src == SrcSpec::Edge(Some(link.name.clone()))
                });
                if !users.is_empty() {
                    return Err(format!("link {} is used by routes {} (delete them first)", link.name, users));
                }
                let (idx, name) = (link.idx, link.name.clone());
                self.links.remove(&idx);
                Ok(format!("deleted link {idx} {name}"))
            }
            Command::RouteAdd(spec) => {
                self.resolve(spec)?;
                if let Some(r) = self.routes.values().find(|r| &r.spec == spec) {
                    return Err(format!("the same rule is already route {}", r.idx));
                }
                let idx = self.next_route;
                self.next_route += 1;
                self.routes.insert(idx, Arc::new(Route { idx, spec: spec.clone(), stats: Counters::default() }));
                Ok(format!("added route {idx} {spec}"))
            }
            Command::RouteDel(r) => {
                let idx = match r {
                    RouteRef::Index(i) => self.routes.get(i).map(|r| r.idx).ok_or_else(|| format!("no route {i}"))?,
                    RouteRef::Rule(spec) => self
                        .routes
                        .values()
                        .find(|r| &r.spec == spec)
                        .map(|r| r.idx)
                        .ok_or_else(|| format!("no route is {spec}"))?,
                };
                let route = self.routes.remove(&idx).expect("found above");
                Ok(format!("deleted route {idx} {}", route.spec))
            }
            _ => Err("not a state-changing command".into()),
        }
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

    fn routes_using(&self, uses: impl Fn(&RuleSpec) -> bool) -> String {
        let v: Vec<String> = self.routes.values().filter(|r| uses(&r.spec)).map(|r| r.idx.to_string()).collect();
        v.join(", ")
    }

    /// Checks that a rule's endpoints exist.
    fn resolve(&self, spec: &RuleSpec) -> Result<(), String> {
        let has_iface = |m: &Mac| self.ifaces.values().any(|i| &i.mac == m);
        let has_link = |n: &String| self.links.values().any(|l| &l.name == n);
        match &spec.dst {
            DstSpec::Interface(m) if !has_iface(m) => return Err(format!("no interface has MAC {m}")),
            DstSpec::Edge(n) if !has_link(n) => return Err(format!("no link named {n}")),
            _ => {}
        }
        match &spec.src {
            SrcSpec::Interface(Some(m)) if !has_iface(m) => Err(format!("no interface has MAC {m} (source)")),
            SrcSpec::Edge(Some(n)) if !has_link(n) => Err(format!("no link named {n} (source)")),
            _ => Ok(()),
        }
    }

    /// The datapath's view of this topology.
    pub fn snapshot(&self, generation: u64) -> Snapshot {
        let ifaces: Vec<Arc<Interface>> = self.ifaces.values().cloned().collect();
        let links: Vec<Arc<Link>> = self.links.values().cloned().collect();
        let routes: Vec<Arc<Route>> = self.routes.values().cloned().collect();
        let iface_slot: HashMap<Mac, u32> = ifaces.iter().enumerate().map(|(s, i)| (i.mac, s as u32)).collect();
        let link_slot: HashMap<&str, u32> = links.iter().enumerate().map(|(s, l)| (l.name.as_str(), s as u32)).collect();
        let rules = routes
            .iter()
            .map(|r| {
                let s = &r.spec;
                let dst = match &s.dst {
                    DstSpec::Interface(m) => Port::Interface(iface_slot[m]),
                    DstSpec::Edge(n) => Port::Link(link_slot[n.as_str()]),
                };
                let src = match &s.src {
                    SrcSpec::Any => SrcMatch::Any,
                    SrcSpec::Interface(None) => SrcMatch::AnyInterface,
                    SrcSpec::Edge(None) => SrcMatch::AnyLink,
                    SrcSpec::Interface(Some(m)) => SrcMatch::Exactly(Port::Interface(iface_slot[m])),
                    SrcSpec::Edge(Some(n)) => SrcMatch::Exactly(Port::Link(link_slot[n.as_str()])),
                };
                Rule { src_mac: s.src_mac, dst_mac: s.dst_mac, src, dst }
            })
            .collect();
        let mut by_addr = HashMap::new();
        let mut by_ip: HashMap<IpAddr, Option<u32>> = HashMap::new();
        for (slot, l) in links.iter().enumerate() {
            by_addr.insert(l.remote, slot as u32);
            by_ip.entry(l.remote.ip()).and_modify(|e| *e = None).or_insert(Some(slot as u32));
        }
        let modes = ifaces.iter().map(|i| self.iface_modes.get(&i.idx).copied().unwrap_or(self.dispatch.mode)).collect();
        Snapshot {
            generation,
            ifaces,
            links,
            routes,
            table: RouteTable::new(rules, generation),
            by_addr,
            by_ip,
            dispatch: self.dispatch,
            modes,
        }
    }
}

/// What the dispatcher reads: immutable, swapped whole on every change.
/// Slots (indexes into `ifaces` / `links`) are the ports of the rule table.
pub struct Snapshot {
    pub generation: u64,
    pub ifaces: Vec<Arc<Interface>>,
    pub links: Vec<Arc<Link>>,
    /// `routes[i]` is rule `i` of `table`.
    pub routes: Vec<Arc<Route>>,
    pub table: RouteTable,
    pub dispatch: DispatchSettings,
    /// The configured mode of each interface (by slot).
    pub modes: Vec<Mode>,
    by_addr: HashMap<SocketAddr, u32>,
    /// Links by remote IP alone, when exactly one link has that IP.
    by_ip: HashMap<IpAddr, Option<u32>>,
}

impl Snapshot {
    pub fn empty() -> Snapshot {
        Topology::default().snapshot(0)
    }

    /// The link a datagram belongs to: the link whose remote address is the
    /// sender's, or else the only link to the sender's IP (VNET/P matched by
    /// IP alone; a peer behind NAT sends from another port).
    #[inline]
    pub fn link_for_sender(&self, from: SocketAddr) -> Option<u32> {
        if let Some(&slot) = self.by_addr.get(&from) {
            return Some(slot);
        }
        self.by_ip.get(&from.ip()).copied().flatten()
    }

    #[inline]
    pub fn port_stats(&self, port: Port) -> &Counters {
        match port {
            Port::Interface(s) => &self.ifaces[s as usize].stats,
            Port::Link(s) => &self.links[s as usize].stats,
        }
    }
}
