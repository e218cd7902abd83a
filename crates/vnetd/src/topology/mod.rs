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

mod factory;
mod ids;
mod objects;
mod script;
mod snapshot;

use crate::nic::NicSpec;
pub use ids::Ids;
pub use objects::{Interface, Link, Retired, Route};
pub use snapshot::{Slot, Snapshot};

use crate::link::{GsoState, LinkEnv, LinkKey, LinkSpec, Transport};
use crate::nic::VirtualNic;
use crate::settings::{DispatchSettings, IfaceOverrides, Settings};
use crate::stats::Counters;
use imbl::OrdMap;
use objects::ETH_MIN_FOR_TCP;
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicU8};
use std::sync::Arc;
use vnet_core::command::{Attach, Command, Datapath, IfaceRef, IfaceSetting, LinkProto, LinkRef, Mode, RouteRef, Setting};
use vnet_core::rule::{DstSpec, RuleSpec, SrcSpec};
use vnet_core::table::{Port, Rule, RouteTable, SrcMatch};
use vnet_core::neigh::Neighbours;
use vnet_core::Mac;
use vnet_fastpath::IdKind;

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
    /// Ids given and to give (kept across restarts with a pinned fast path).
    pub ids: Ids,
    /// The `INTERFACE ADD` or `LINK ADD` that made each interface and link
    /// (canonical): what the state file's snapshot says (`script`).
    made_by: HashMap<Port, Command>,
    /// The kernel fast path's programs, if they loaded (whether or not the
    /// fast path is on): guest ports attach to them.
    pub kernel: Option<Arc<vnet_fastpath::Kernel>>,
    /// Addresses bound to guests' MACs (`NEIGH ADD`): ARP and neighbour
    /// solicitations for them are answered on the asker's host.
    pub neighbours: Neighbours,
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
                    Setting::StormPps(v) => d.storm_pps = v,
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
                let mtu = mtu.unwrap_or(settings.default_mtu);
                let ifaces = &self.ifaces;
                let id = self.ids.take(IdKind::Iface, name, |id| ifaces.contains_key(&id));
                let spec = NicSpec {
                    name,
                    mac: *mac,
                    mtu,
                    attach: *attach,
                    netns: netns.as_deref(),
                    socket: socket.as_deref(),
                    vhost_dir: &settings.vhost_user_dir,
                    ifname: ifname.as_deref(),
                    id,
                    changes: &settings.changes,
                    kernel: self.kernel.as_ref(),
                };
                let nic = factory::nic(&spec)?;
                let idx = self.insert_interface_as(id, name, *mac, mtu, *attach, netns.clone(), network.clone(), nic);
                self.ifaces[&idx].learned.tell(settings.changes.clone());
                // As made: the MTU it has now, whatever --default-mtu is next time.
                let made = Command::IfaceAdd {
                    name: name.clone(),
                    mac: *mac,
                    mtu: Some(mtu),
                    attach: *attach,
                    netns: netns.clone(),
                    socket: socket.clone(),
                    network: network.clone(),
                    ifname: ifname.clone(),
                };
                self.made_by.insert(Port::Interface(idx), made);
                let how = if *attach == Attach::default() { String::new() } else { format!(" {}", attach.word()) };
                Ok(format!("added interface {idx} {name} {mac} mtu {mtu}{how}"))
            }
            Command::IfaceDel(r, detach) => {
                let (idx, name) = self.find_iface(r).map(|i| (i.id, i.name.clone()))?;
                let managed = self
                    .clear_routes_using(Port::Interface(idx))
                    .map_err(|users| format!("interface {name} is used by routes {users} (delete them first)"))?;
                let iface = self.ifaces.remove(&idx).expect("found above");
                // Addresses a manager bound to its MAC go with it, as its
                // managed routes do.
                let bindings = match self.neighbours.remove_owned_of(iface.mac) {
                    0 => String::new(),
                    n => format!(" and its {n} managed address binding(s)"),
                };
                let managed = managed + &bindings;
                self.made_by.remove(&Port::Interface(idx));
                self.ids.forget(IdKind::Iface, &iface.name);
                self.iface_settings.remove(&idx);
                self.retired.push(Retired::Iface(iface, *detach));
                Ok(format!("{} interface {idx} {name}{managed}", if *detach { "detached" } else { "deleted" }))
            }
            Command::LinkAdd { ip, port, proto, name, mtu, vtoe } => {
                let (idx, msg) = self.add_link(*ip, *port, proto, name.clone(), *mtu, vtoe.as_deref(), settings, env)?;
                self.made_by.insert(Port::Link(idx), cmd.clone());
                Ok(msg)
            }
            Command::LinkDel(r) => {
                let (idx, name) = self.find_link(r).map(|l| (l.id, l.name.clone()))?;
                let managed = self
                    .clear_routes_using(Port::Link(idx))
                    .map_err(|users| format!("link {name} is used by routes {users} (delete them first)"))?;
                let link = self.links.remove(&idx).expect("found above");
                self.made_by.remove(&Port::Link(idx));
                self.ids.forget(IdKind::Link, &link.name);
                self.retired.push(Retired::Link(link));
                Ok(format!("deleted link {idx} {name}{managed}"))
            }
            Command::RouteAdd(spec, owner) => {
                let rule = self.resolve(spec)?;
                if let Some(r) = self.route_by_spec.get(spec) {
                    return Err(format!("the same rule is already route {r}"));
                }
                let routes = &self.routes;
                let idx = self.ids.take(IdKind::Route, &spec.to_string(), |id| routes.contains_key(&id));
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
            Command::NeighAdd { ip, mac, owner } => match self.neighbours.insert(*ip, *mac, owner.clone()) {
                Some(old) => Ok(format!("neighbour {ip} {mac} (was {old})")),
                None => Ok(format!("neighbour {ip} {mac}")),
            },
            Command::NeighDel(ip) => match self.neighbours.remove(ip) {
                Some(mac) => Ok(format!("deleted neighbour {ip} {mac}")),
                None => Err(format!("no neighbour {ip}")),
            },
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
    ) -> Result<(u32, String), String> {
        // An IPv4-mapped IPv6 address is the IPv4 peer: one link per peer,
        // sent from and matched on the IPv4 socket.
        let ip = ip.map(|ip| ip.to_canonical());
        if let Some(ip) = ip {
            if ip.is_unspecified() || ip.is_multicast() {
                return Err(format!("{ip} is not a unicast address"));
            }
        }
        let spec = LinkSpec { proto, ip, port, name, mtu };
        let crate::link::Made { transport, remote, name, mtu, overhead } = factory::link(&spec, settings, env)?;
        if let Some(l) = self.links.values().find(|l| l.name == name) {
            return Err(format!("a link named {name} exists (index {})", l.id));
        }
        let kind = transport.kind();
        // A link is told apart by its keys on its carrier: one that another
        // link holds (but for a shared one: a VNET/P peer's IP) is refused.
        let mine = transport.demux();
        for l in self.links.values() {
            if let Some((_, k)) = l.transport.demux().into_iter().find(|c| !c.1.shared() && mine.contains(c)) {
                return Err(format!("link {} already {}", l.name, k.describe(kind)));
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
        let links = &self.links;
        let id = self.ids.take(IdKind::Link, &name, |id| links.contains_key(&id));
        let fast = match (remote, transport.fast_path()) {
            (Some(r), Some(sport)) => env.fast_link(id, r, sport, mtu),
            _ => None,
        };
        let shown = remote.map_or(String::new(), |r| format!(" {r}"));
        let shown_vtoe = if vtoe.is_some() { " vtoe" } else { "" };
        let idx = self.insert_link_as(id, &name, proto, transport, remote, mtu, overhead, fast, vtoe);
        Ok((idx, format!("added link {idx} {name} {kind}{shown} mtu {mtu}{shown_vtoe}")))
    }

    /// Adds an interface whose NIC is made, under the next id; the checks
    /// (name, MAC, the NIC's own) are the caller's: `apply`'s for
    /// `INTERFACE ADD`, and tests and fuzz targets that give a `DummyNic`.
    #[allow(clippy::too_many_arguments)]
    pub fn insert_interface(
        &mut self,
        name: &str,
        mac: Mac,
        mtu: u32,
        attach: Attach,
        netns: Option<String>,
        network: String,
        nic: Box<dyn VirtualNic>,
    ) -> u32 {
        let ifaces = &self.ifaces;
        let id = self.ids.take(IdKind::Iface, name, |id| ifaces.contains_key(&id));
        self.insert_interface_as(id, name, mac, mtu, attach, netns, network, nic)
    }

    #[allow(clippy::too_many_arguments)]
    fn insert_interface_as(
        &mut self,
        idx: u32,
        name: &str,
        mac: Mac,
        mtu: u32,
        attach: Attach,
        netns: Option<String>,
        network: String,
        nic: Box<dyn VirtualNic>,
    ) -> u32 {
        self.ifaces.insert(
            idx,
            Arc::new(Interface {
                id: idx,
                name: name.to_string(),
                mac,
                mtu,
                attach,
                netns,
                network,
                nic,
                stats: Counters::default(),
                running_mode: AtomicU8::new(Mode::GuestDriven as u8),
                mode_switches: AtomicU64::new(0),
                storm: Default::default(),
                learned: Default::default(),
            }),
        );
        idx
    }

    /// Adds a link whose transport is made, under the next id, sized for
    /// its MTU less the encapsulation's `overhead`; the checks are the
    /// caller's (`apply`'s for `LINK ADD`; tests and fuzz targets that give
    /// a `DummyLink`).
    #[allow(clippy::too_many_arguments)]
    pub fn insert_link(
        &mut self,
        name: &str,
        proto: &LinkProto,
        transport: Arc<dyn Transport>,
        remote: Option<SocketAddr>,
        mtu: u32,
        overhead: i64,
        fast: Option<vnet_fastpath::LinkEntry>,
        vtoe: Option<(String, LinkKey)>,
    ) -> u32 {
        let links = &self.links;
        let id = self.ids.take(IdKind::Link, name, |id| links.contains_key(&id));
        self.insert_link_as(id, name, proto, transport, remote, mtu, overhead, fast, vtoe)
    }

    #[allow(clippy::too_many_arguments)]
    fn insert_link_as(
        &mut self,
        idx: u32,
        name: &str,
        proto: &LinkProto,
        transport: Arc<dyn Transport>,
        remote: Option<SocketAddr>,
        mtu: u32,
        overhead: i64,
        fast: Option<vnet_fastpath::LinkEntry>,
        vtoe: Option<(String, LinkKey)>,
    ) -> u32 {
        let max_frame = ((mtu as i64 - overhead).max(ETH_MIN_FOR_TCP as i64)) as usize;
        transport.identify(idx);
        self.links.insert(
            idx,
            Arc::new(Link {
                id: idx,
                name: name.to_string(),
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
        idx
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
        self.ids.forget(IdKind::Route, &route.spec.to_string());
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
    /// made it commits. Persistent TAPs' and the fast path's attachments and
    /// link entries' fates are settled here: those of interfaces and links
    /// in force stay with them (past vnetd's exit), those of deleted ones
    /// go (a detached interface's device stays).
    pub fn snapshot(&self, generation: u64) -> Snapshot {
        for i in self.ifaces.values() {
            i.nic.in_force();
        }
        for l in self.links.values() {
            if let Some(f) = &l.fast {
                f.keep(true);
            }
        }
        for r in &self.retired {
            match r {
                Retired::Iface(i, detach) => i.nic.deleted(*detach),
                Retired::Link(l) => {
                    if let Some(f) = &l.fast {
                        f.keep(false);
                    }
                }
            }
        }
        let ifaces: Vec<Arc<Interface>> = self.ifaces.values().cloned().collect();
        let links: Vec<Arc<Link>> = self.links.values().cloned().collect();
        let iface_dispatch = ifaces
            .iter()
            .map(|i| self.iface_settings.get(&i.id).copied().unwrap_or_default().effective(&self.dispatch))
            .collect();
        let fast_on = self.kernel.is_some() && self.dispatch.datapath != Datapath::User;
        let mut snap = Snapshot::build(generation, ifaces, links, self.routes.clone(), self.table.clone(), self.dispatch, iface_dispatch, fast_on);
        snap.neighbours = self.neighbours.clone();
        snap
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

#[cfg(test)]
mod tests;
