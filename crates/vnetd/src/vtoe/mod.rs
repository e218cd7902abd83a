//! VTOE, virtual TCP offload (docs/vtoe.md): a guest's TCP connection to
//! another host's guest is carried whole by a *shadow connection*, a TCP
//! connection between the two hosts, and the guest programs read and write
//! that connection's socket themselves, so TCP runs once (in the hosts'
//! kernels) and vnetd is off the per-byte path.
//!
//! The parts, as the VTOE paper names them:
//! - the guest side is the `vtoe` runner (crates/vtoe), which supervises an
//!   unmodified program and talks to vnetd on a Unix socket (`runners`);
//! - the *Core Connection Agent* is here: it decides which connections are
//!   offloaded, by the guest kernel's route and ARP entry and by the rule
//!   table (`offer`, `admit`), maps guest connections to shadow
//!   connections (`Registry`) and turns host events into socket results;
//! - the *Host Connection Agent* is `shadow` (the shadow connections and
//!   their authenticated handshake) and `diag` (what the kernel knows of
//!   them once handed over);
//! - the security line is the guard (`vnet_fastpath::guard`): cgroup eBPF
//!   programs on every shadow socket vnetd hands to a guest.
//!
//! Everything here runs on VTOE's own threads (the runner socket, the VTOE
//! port's acceptor, handshakes, the destruction watch): never on a
//! dispatcher. It reads the datapath's snapshot, as a dispatcher does.

pub mod diag;
pub mod netns;
mod runners;
pub mod shadow;
mod workers;

use crate::dispatch::Datapath;
use crate::topology::{Interface, Link, Slot, Snapshot};
use anyhow::{Context, Result};
use netlink_packet_route::route::RouteType;
use runners::Runner;
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;
use vnet_core::vtoe::{is_overlay_unicast, FromVnetd, ListenRefusal, Reason, Request};
use vnet_core::{Mac, Port};
use vnet_fastpath::guard::{self, Ends, Guard};

/// Offloaded connections one guest namespace may hold at once.
pub const MAX_CONNS_PER_GUEST: usize = 16384;
/// Listeners one runner may register.
pub const MAX_LISTENERS_PER_RUNNER: usize = 1024;
/// Handshakes of incoming shadow connections in progress at once.
const MAX_HANDSHAKES: usize = 64;
/// Guests' connects being decided at once, over all runners.
const MAX_OFFERS: usize = 256;

/// How vnetd offers VTOE (vnetd's options).
pub struct Config {
    /// The Unix socket `vtoe` runners connect to.
    pub socket: PathBuf,
    /// The TCP port of shadow connections (the same on every host).
    pub port: u16,
    /// The address the VTOE port binds (`--udp-bind`), else every IPv4 address.
    pub bind: Option<IpAddr>,
}

const N: usize = Reason::ALL.len();
const NL: usize = ListenRefusal::ALL.len();

crate::stats::counter_set! {
    /// What VTOE did, for `STATS vtoe`.
    pub struct Events {
        /// Connections guests asked to offload.
        offers,
        /// Offloaded: outgoing (ours connected), incoming (ours accepted).
        offloaded_out,
        offloaded_in,
        /// Offloaded connections aborted because a change made their decision
        /// untrue (the routes, the interface or the link's key went).
        revoked,
        /// Runners that connected (guests recognised), and those refused.
        runners,
        runners_not_guest,
        /// Runner messages that did not parse (the runner is dropped).
        bad_messages,
        /// Interface ioctls the runners refused on offloaded sockets.
        runner_refused_ioctl,
    }
}

#[derive(Default)]
pub struct Counters {
    pub events: Events,
    /// Not offloaded, by reason: the connection took the Ethernet path.
    pub fallback: [AtomicU64; N],
    /// Refused, by reason: the program's connect failed as the kernel's would.
    pub refused: [AtomicU64; N],
    /// Incoming shadow connections declined, by reason.
    pub declined: [AtomicU64; N],
    /// Runners' listeners not registered, by reason.
    pub listen_refused: [AtomicU64; NL],
}

/// An offloaded connection vnetd handed over.
pub struct Conn {
    pub iface: String,
    pub outgoing: bool,
    pub ends: Ends,
    /// What it was offloaded by: frames from `origin` with these MACs go to
    /// `dest` alone (the guest's interface and the link, one way or the
    /// other), over a link with a VTOE key. It stays while that holds.
    decision: Decision,
    /// The guest namespace (cookie) it counts against.
    netns: u64,
    /// The runner to tell when it is gone.
    owner: Weak<Runner>,
    since: Instant,
}

/// A registered listener: the runner of the program listening, and the
/// listening socket it proved it with (vnetd keeps no descriptor of it: the
/// program's close must close it; it is found again by its cookie).
struct Registered {
    runner: Weak<Runner>,
    proof: runners::Proof,
}

impl Registered {
    /// Whether its runner is there and its socket still listens, as the
    /// guest's kernel says.
    fn live(&self) -> Option<Arc<Runner>> {
        let r = self.runner.upgrade()?;
        r.ns.listens(self.proof.family, self.proof.port, self.proof.cookie).then_some(r)
    }
}

#[derive(Default)]
struct Registry {
    /// Listeners: (guest namespace cookie, address) -> the one registered
    /// there.
    listeners: HashMap<(u64, SocketAddrV4), Registered>,
    /// Offloaded connections by socket cookie.
    conns: HashMap<u64, Conn>,
    /// Offloaded connections per guest namespace.
    per_guest: HashMap<u64, usize>,
}

pub struct Vtoe {
    dp: Arc<Datapath>,
    guard: Guard,
    port: u16,
    namespaces: netns::Namespaces,
    reg: Mutex<Registry>,
    pub counters: Counters,
    /// Where the runner socket and the VTOE port are.
    socket: PathBuf,
    local: SocketAddr,
    /// Threads for incoming handshakes and for guests' connects.
    handshakes: workers::Workers,
    offers: workers::Workers,
    /// The cgroup vnetd made for its shadow sockets (removed at exit).
    made_cgroup: Option<(PathBuf, PathBuf)>,
}

impl Vtoe {
    /// Sets VTOE up: vnetd joins a cgroup of its own (shadow sockets are
    /// made in it), the guard's programs are attached there, the VTOE port
    /// and the runner socket listen, and the threads start. Call after
    /// vnetd's datapath sockets exist (they stay out of the cgroup).
    pub fn start(dp: Arc<Datapath>, cfg: Config) -> Result<Arc<Vtoe>> {
        let (cgroup, made_cgroup) = join_cgroup()?;
        let guard = Guard::load(&cgroup).with_context(|| format!("VTOE's guard on cgroup {}", cgroup.display()))?;
        let bind = match cfg.bind {
            Some(IpAddr::V4(ip)) => SocketAddr::new(ip.into(), cfg.port),
            Some(IpAddr::V6(_)) => anyhow::bail!("VTOE's shadow connections are IPv4: --udp-bind is IPv6"),
            None => SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), cfg.port),
        };
        let acceptor = TcpListener::bind(bind).with_context(|| format!("cannot listen on the VTOE port {bind}"))?;
        let runner_socket = runners::bind(&cfg.socket)?;
        let v = Arc::new(Vtoe {
            dp,
            guard,
            port: cfg.port,
            namespaces: netns::Namespaces::default(),
            reg: Mutex::new(Registry::default()),
            counters: Counters::default(),
            socket: cfg.socket,
            local: acceptor.local_addr()?,
            handshakes: workers::Workers::new("vtoe-handshake", MAX_HANDSHAKES),
            offers: workers::Workers::new("vtoe-connect", MAX_OFFERS),
            made_cgroup,
        });
        let me = v.clone();
        std::thread::Builder::new().name("vtoe-accept".into()).spawn(move || me.accept_loop(acceptor))?;
        let me = v.clone();
        std::thread::Builder::new().name("vtoe-runners".into()).spawn(move || runners::serve(me, runner_socket))?;
        let me = Arc::downgrade(&v);
        std::thread::Builder::new().name("vtoe-diag".into()).spawn(move || {
            let e = diag::watch_destroyed(|cookie| match me.upgrade() {
                Some(v) if cookie == 0 => drop(v.sweep()),
                Some(v) => v.gone(cookie),
                None => {}
            });
            tracing::warn!("VTOE: cannot follow shadow connections' ends (sock_diag: {e}); STATS sweeps them");
        })?;
        tracing::info!("VTOE on: runners on {}, shadow connections on {}", v.socket.display(), v.local);
        Ok(v)
    }

    /// At exit: the runner socket goes; vnetd leaves its cgroup and removes
    /// it (the guard stays with the offloaded sockets still open).
    pub fn shutdown(&self) {
        let _ = std::fs::remove_file(&self.socket);
        if let Some((root, made)) = &self.made_cgroup {
            let _ = std::fs::write(root.join("cgroup.procs"), std::process::id().to_string());
            let _ = std::fs::remove_dir(made);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.reg.lock().unwrap_or_else(|p| p.into_inner())
    }

    // ---- the connecting guest's side ----

    /// A guest (`runner`'s namespace) asks to offload its connection
    /// `src` -> `dst`: decide, and open the shadow connection. Returns the
    /// answer and, when offloaded, the socket to hand over.
    fn offer(&self, runner: &Arc<Runner>, id: u32, src: SocketAddrV4, dst: SocketAddrV4) -> (FromVnetd, Option<OwnedFd>) {
        self.counters.events.offers.fetch_add(1, Relaxed);
        match self.try_offer(runner, src, dst) {
            Ok(Offloaded { shadow, ends, iface, decision }) => {
                let fd: OwnedFd = shadow.stream.into();
                let cookie = self.record(&fd, ends, iface, true, runner, runner.ns.cookie, decision);
                self.counters.events.offloaded_out.fetch_add(1, Relaxed);
                (FromVnetd::Connected { id, cookie, local: ends.overlay_local, peer: ends.overlay_peer }, Some(fd))
            }
            Err(Outcome::Fallback(reason)) => {
                self.counters.fallback[reason.index()].fetch_add(1, Relaxed);
                (FromVnetd::Fallback { id, reason }, None)
            }
            Err(Outcome::Refused(errno, reason)) => {
                self.counters.refused[reason.index()].fetch_add(1, Relaxed);
                (FromVnetd::Failed { id, errno, reason }, None)
            }
        }
    }

    fn try_offer(&self, runner: &Runner, src: SocketAddrV4, dst: SocketAddrV4) -> Result<Offloaded, Outcome> {
        use Outcome::{Fallback, Refused};
        let ns = &runner.ns;
        // Never a loopback, unspecified, multicast or broadcast destination,
        // whatever the guest's routes say (a guest may route 127.0.0.1 to
        // another guest's MAC; its runner does not offer such a connect,
        // but anyone in the guest can speak to vnetd).
        if !is_overlay_unicast(*dst.ip()) || dst.port() == 0 {
            return Err(Fallback(Reason::BadAddress));
        }
        // The guest kernel's own view: where its packets for dst would go.
        let route = ns.route(*dst.ip()).map_err(|_| Fallback(Reason::OtherDevice))?;
        match route.kind {
            RouteType::Local => return Err(Fallback(Reason::Local)),
            RouteType::Unicast if route.gateway.is_none() => {}
            RouteType::Unicast => return Err(Fallback(Reason::OffLink)),
            // Unreachable, prohibited, ...: the kernel answers that itself.
            _ => return Err(Fallback(Reason::OtherDevice)),
        }
        let snap = self.dp.snapshot();
        let iface = self.guest_iface(&snap, runner, route.oif).ok_or(Fallback(Reason::OtherDevice))?;
        let src_ip = match (*src.ip(), route.src) {
            (ip, _) if !ip.is_unspecified() => ip,
            (_, Some(ip)) => ip,
            _ => return Err(Refused(libc::EADDRNOTAVAIL, Reason::SourceNotLocal)),
        };
        if !is_overlay_unicast(src_ip) {
            // A loopback source: the far program would see its own loopback
            // as its peer. The guest's kernel refuses such a connect itself.
            return Err(Fallback(Reason::BadAddress));
        }
        if src.port() == 0 || (Some(src_ip) != route.src && !ns.is_local(src_ip)) {
            return Err(Refused(libc::EADDRNOTAVAIL, Reason::SourceNotLocal));
        }
        let oif = route.oif.expect("guest_iface found it");
        let mac = match ns.resolve(oif, *dst.ip()) {
            Ok(Some(m)) => Mac(m),
            Ok(None) => return Err(Refused(libc::EHOSTUNREACH, Reason::Unresolved)),
            Err(e) => {
                tracing::info!(ns = %ns.name, "VTOE: neighbour lookup failed: {e}");
                return Err(Fallback(Reason::OtherDevice));
            }
        };
        let link = match route_one(&snap, Port::Interface(iface.id), iface.mac, mac)? {
            Port::Interface(_) => return Err(Fallback(Reason::SameHost)),
            port => match snap.slot_of(port) {
                Some(Slot::Link(s)) => snap.links[s as usize].clone(),
                _ => return Err(Fallback(Reason::NoRoute)),
            },
        };
        let (peer, key) = vtoe_peer(&link)?;
        if self.lock().per_guest.get(&ns.cookie).copied().unwrap_or(0) >= MAX_CONNS_PER_GUEST {
            return Err(Fallback(Reason::Limit));
        }
        let req = Request { src_mac: iface.mac, dst_mac: mac, src: SocketAddrV4::new(src_ip, src.port()), dst };
        let shadow = shadow::open(SocketAddrV4::new(peer, self.port), key, &req).map_err(Fallback)?;
        let ends = Ends { overlay_local: req.src, overlay_peer: dst, host_local: shadow.local, host_peer: shadow.peer };
        self.guard.seal(shadow.stream.as_fd(), &ends).map_err(|e| {
            tracing::error!("VTOE: cannot seal a shadow socket: {e:#}");
            Fallback(Reason::Protocol)
        })?;
        let decision = Decision { origin: Port::Interface(iface.id), src: iface.mac, dst: mac, dest: Port::Link(link.id) };
        Ok(Offloaded { shadow, ends, iface: iface.name.clone(), decision })
    }

    /// The interface of the runner's guest that the guest's kernel sends by
    /// (device `oif` in the guest's namespace).
    fn guest_iface(&self, snap: &Snapshot, runner: &Runner, oif: Option<u32>) -> Option<Arc<Interface>> {
        let mine = snap.ifaces.iter().filter(|i| i.netns.as_deref() == Some(runner.ns.name.as_str()));
        let name = runner.ns.device_with_index(mine.clone().map(|i| i.name.as_str()), oif?)?;
        mine.into_iter().find(|i| i.name == name).cloned()
    }

    // ---- the listening guest's side ----

    fn accept_loop(self: Arc<Self>, l: TcpListener) {
        for s in l.incoming() {
            let Ok(stream) = s else { continue };
            let me = self.clone();
            if !self.handshakes.run(move || me.serve_incoming(stream)) {
                self.counters.declined[Reason::Limit.index()].fetch_add(1, Relaxed);
            }
        }
    }

    /// A shadow connection arrived: authenticate it by the key of the link
    /// at its source, decide, and hand it to the listening program's runner.
    fn serve_incoming(&self, stream: std::net::TcpStream) {
        let declined = |r: Reason| {
            self.counters.declined[r.index()].fetch_add(1, Relaxed);
        };
        let Ok(from) = stream.peer_addr() else { return };
        let snap = self.dp.snapshot();
        let Some(link) = snap
            .links
            .iter()
            .find(|l| l.vtoe.is_some() && l.remote.map(|r| r.ip().to_canonical()) == Some(from.ip().to_canonical()))
            .cloned()
        else {
            tracing::info!(%from, "VTOE: shadow connection from an address with no VTOE link: closed");
            return declined(Reason::PeerAuth);
        };
        let key = link.vtoe.as_ref().expect("found by it").1.clone();
        let incoming = match shadow::Incoming::read(stream, key.bytes()) {
            Ok(i) => i,
            Err(r) => return declined(r),
        };
        let req = incoming.req;
        let verdict = self.admit(&snap, &link, &req);
        let (runner, listener, iface, netns, iface_id) = match verdict {
            Ok(v) => v,
            Err(r) => {
                declined(r);
                let _ = incoming.answer(key.bytes(), Err(r));
                return;
            }
        };
        // The verdict goes before the socket does: once the program has it,
        // only the guests write on it.
        let shadow = match incoming.answer(key.bytes(), Ok(())) {
            Ok(s) => s,
            Err(e) => {
                tracing::info!(%from, "VTOE: cannot answer a shadow connection: {e}");
                return declined(Reason::Protocol);
            }
        };
        let ends = Ends { overlay_local: req.dst, overlay_peer: req.src, host_local: shadow.local, host_peer: shadow.peer };
        if let Err(e) = self.guard.seal(shadow.stream.as_fd(), &ends) {
            tracing::error!("VTOE: cannot seal a shadow socket: {e:#}");
            return declined(Reason::Protocol);
        }
        let fd: OwnedFd = shadow.stream.into();
        let decision = Decision { origin: Port::Link(link.id), src: req.src_mac, dst: req.dst_mac, dest: Port::Interface(iface_id) };
        let cookie = self.record(&fd, ends, iface, false, &runner, netns, decision);
        self.counters.events.offloaded_in.fetch_add(1, Relaxed);
        let msg = FromVnetd::Incoming { listener, cookie, local: ends.overlay_local, peer: ends.overlay_peer };
        if let Err(e) = runner.send(&msg, Some(fd.as_fd())) {
            // The program stopped listening as it arrived: its peer sees the
            // connection closed, as a listener's queue is when it closes.
            tracing::info!("VTOE: the listening runner is gone ({e}); connection closed");
        }
    }

    /// The responder's decision: both ends must be unicast addresses (no
    /// loopback, unspecified, multicast or broadcast), frames from the
    /// link's side with these MACs must go to exactly one interface, a
    /// namespace guest of ours, whose device in the guest holds the
    /// destination address, where a program under `vtoe` listens on it (its
    /// listening socket still listening).
    #[allow(clippy::type_complexity)]
    fn admit(&self, snap: &Snapshot, link: &Link, req: &Request) -> Result<(Arc<Runner>, SocketAddrV4, String, u64, u32), Reason> {
        if !is_overlay_unicast(*req.dst.ip()) || !is_overlay_unicast(*req.src.ip()) || req.dst.port() == 0 || req.src.port() == 0 {
            return Err(Reason::BadAddress);
        }
        let iface = match route_one(snap, Port::Link(link.id), req.src_mac, req.dst_mac) {
            Ok(Port::Interface(id)) => snap.iface_slot(id).map(|s| snap.ifaces[s as usize].clone()).ok_or(Reason::PeerRoutes)?,
            _ => return Err(Reason::PeerRoutes),
        };
        let name = iface.netns.as_deref().ok_or(Reason::NotGuest)?;
        let ns = self.namespaces.get(name).map_err(|_| Reason::NotGuest)?;
        // The destination must be an address of the device the frames go
        // to: not the guest's loopback, nor an address of another device.
        let on_iface = match ns.index_of(&iface.name) {
            Some(i) => ns.addresses(i).is_ok_and(|a| a.contains(req.dst.ip())),
            None => false,
        };
        if !on_iface {
            return Err(Reason::NotLocal);
        }
        let wildcard = SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, req.dst.port());
        let (runner, listener) = {
            let mut reg = self.lock();
            if reg.per_guest.get(&ns.cookie).copied().unwrap_or(0) >= MAX_CONNS_PER_GUEST {
                return Err(Reason::Limit);
            }
            let mut found = None;
            for a in [req.dst, wildcard] {
                let key = (ns.cookie, a);
                let Some(l) = reg.listeners.get(&key) else { continue };
                match l.live() {
                    Some(r) => {
                        found = Some((r, a));
                        break;
                    }
                    // Closed, or no longer listening: the registration ends.
                    None => drop(reg.listeners.remove(&key)),
                }
            }
            found.ok_or(Reason::NoListener)?
        };
        Ok((runner, listener, iface.name.clone(), ns.cookie, iface.id))
    }

    // ---- the registry ----

    #[allow(clippy::too_many_arguments)]
    fn record(&self, fd: &OwnedFd, ends: Ends, iface: String, outgoing: bool, owner: &Arc<Runner>, netns: u64, decision: Decision) -> u64 {
        let cookie = diag::socket_cookie(fd.as_raw_fd()).unwrap_or(0);
        let mut reg = self.lock();
        *reg.per_guest.entry(netns).or_default() += 1;
        let conn = Conn { iface, outgoing, ends, decision, netns, owner: Arc::downgrade(owner), since: Instant::now() };
        reg.conns.insert(cookie, conn);
        cookie
    }

    /// After a change is in force (every dispatcher runs `snap`): aborts the
    /// offloaded connections whose decision it made untrue, as the fast path
    /// takes back its changed entries, before the change's reply. Their
    /// programs get ECONNABORTED and their peers a reset: a route deleted
    /// stops an offloaded connection as it stops frames.
    pub fn revalidate(&self, snap: &Snapshot) {
        let stale: Vec<(u64, Ends)> =
            self.lock().conns.iter().filter(|(_, c)| !c.decision.holds(snap)).map(|(k, c)| (*k, c.ends)).collect();
        for (cookie, e) in stale {
            match diag::destroy(cookie, e.host_local, e.host_peer) {
                Ok(()) => {
                    self.counters.events.revoked.fetch_add(1, Relaxed);
                    tracing::info!("VTOE: connection {}->{} aborted: the change no longer carries it", e.overlay_local, e.overlay_peer);
                }
                Err(e) => tracing::warn!("VTOE: cannot abort connection {cookie}: {e}"),
            }
            self.gone(cookie);
        }
    }

    /// The shadow socket with this cookie is destroyed.
    fn gone(&self, cookie: u64) {
        let conn = {
            let mut reg = self.lock();
            let Some(c) = reg.conns.remove(&cookie) else { return };
            if let Some(n) = reg.per_guest.get_mut(&c.netns) {
                *n = n.saturating_sub(1);
            }
            c
        };
        if let Some(r) = conn.owner.upgrade() {
            let _ = r.send(&FromVnetd::Closed { cookie }, None);
        }
    }

    /// Forgets connections the kernel no longer has (after a missed
    /// destruction notice); returns what the kernel says of the others.
    fn sweep(&self) -> HashMap<u64, diag::TcpDiag> {
        let Ok(live) = diag::tcp_sockets() else { return HashMap::new() };
        let dead: Vec<u64> = self.lock().conns.keys().filter(|c| !live.contains_key(c)).copied().collect();
        for c in dead {
            self.gone(c);
        }
        live
    }

    /// Registers the listener `addr` of `runner`'s program, proved by its
    /// listening socket (`runners::prove`). A live registration is never
    /// replaced: another socket on the same address, or another owner's on
    /// an overlapping one (a specific address and the wildcard, on one
    /// port), is refused while the first still listens.
    fn listen(&self, runner: &Arc<Runner>, addr: SocketAddrV4, proof: runners::Proof) -> Result<(), ListenRefusal> {
        let ns = runner.ns.cookie;
        let mut reg = self.lock();
        let overlapping: Vec<SocketAddrV4> = reg
            .listeners
            .iter()
            .filter(|((n, a), l)| {
                *n == ns
                    && a.port() == addr.port()
                    && if *a == addr {
                        l.proof.cookie != proof.cookie
                    } else {
                        (a.ip().is_unspecified() || addr.ip().is_unspecified()) && l.proof.owner != proof.owner
                    }
            })
            .map(|((_, a), _)| *a)
            .collect();
        for a in overlapping {
            if reg.listeners[&(ns, a)].live().is_some() {
                let holder = &reg.listeners[&(ns, a)].proof;
                tracing::warn!(
                    ns = %runner.ns.name,
                    "VTOE: listener {addr} of uid {} (runner pid {}, uid {}) refused: {a} is held by uid {}",
                    proof.owner, runner.cred.0, runner.cred.1, holder.owner
                );
                return Err(ListenRefusal::Taken);
            }
            reg.listeners.remove(&(ns, a));
        }
        let again = reg.listeners.get(&(ns, addr)).is_some_and(|l| l.runner.as_ptr() == Arc::as_ptr(runner));
        let mine = reg.listeners.values().filter(|l| l.runner.as_ptr() == Arc::as_ptr(runner)).count();
        if !again && mine >= MAX_LISTENERS_PER_RUNNER {
            return Err(ListenRefusal::Limit);
        }
        tracing::debug!(
            ns = %runner.ns.name,
            "VTOE: listener {addr} registered (socket {} of uid {}, runner pid {}, uid {})",
            proof.cookie, proof.owner, runner.cred.0, runner.cred.1
        );
        reg.listeners.insert((ns, addr), Registered { runner: Arc::downgrade(runner), proof });
        Ok(())
    }

    fn unlisten(&self, runner: &Arc<Runner>, addr: SocketAddrV4) {
        let mut reg = self.lock();
        let key = (runner.ns.cookie, addr);
        if reg.listeners.get(&key).is_some_and(|l| l.runner.as_ptr() == Arc::as_ptr(runner)) {
            reg.listeners.remove(&key);
        }
    }

    /// A runner went away: its listeners go with it.
    fn runner_gone(&self, runner: &Arc<Runner>) {
        self.lock().listeners.retain(|_, l| l.runner.as_ptr() != Arc::as_ptr(runner) && l.runner.strong_count() > 0);
    }

    // ---- reporting ----

    /// `STATS vtoe`: the counters, then the offloaded connections.
    pub fn render(&self, out: &mut Vec<String>) {
        let live = self.sweep();
        let c = &self.counters;
        let mut reg = self.lock();
        // Listeners whose socket closed or stopped listening end here too.
        reg.listeners.retain(|_, l| l.live().is_some());
        let mut line = String::from("vtoe");
        c.events.render_into(&mut line);
        line.push_str(&format!(" open={} listeners={}", reg.conns.len(), reg.listeners.len()));
        for (name, v) in guard::COUNTER_NAMES.iter().zip(self.guard.counters()) {
            line.push_str(&format!(" guard_{name}={v}"));
        }
        for (what, arr) in [("fallback", &c.fallback), ("refused", &c.refused), ("declined", &c.declined)] {
            for r in Reason::ALL {
                let v = arr[r.index()].load(Relaxed);
                if v > 0 {
                    line.push_str(&format!(" {what}_{}={v}", r.name()));
                }
            }
        }
        for r in ListenRefusal::ALL {
            let v = c.listen_refused[r.index()].load(Relaxed);
            if v > 0 {
                line.push_str(&format!(" listen_refused_{}={v}", r.name()));
            }
        }
        out.push(line);
        drop(reg);
        self.conn_lines(&live, out);
    }

    /// One line per offloaded connection, with what the kernel says of it now
    /// (SHOW's).
    pub fn render_conns(&self, out: &mut Vec<String>) {
        let live = self.sweep();
        self.conn_lines(&live, out);
    }

    fn conn_lines(&self, live: &HashMap<u64, diag::TcpDiag>, out: &mut Vec<String>) {
        let reg = self.lock();
        let mut conns: Vec<(&u64, &Conn)> = reg.conns.iter().collect();
        conns.sort_by_key(|(_, c)| c.since);
        for (cookie, c) in conns {
            let d = live.get(cookie).copied().unwrap_or_default();
            let e = &c.ends;
            out.push(format!(
                "vtoe_conn cookie={cookie} iface={} dir={} guest={}->{} shadow={}->{} state={} bytes_sent={} bytes_received={} rtt_us={} age_s={}",
                c.iface,
                if c.outgoing { "out" } else { "in" },
                e.overlay_local,
                e.overlay_peer,
                e.host_local,
                e.host_peer,
                diag::state_name(d.state),
                d.bytes_acked,
                d.bytes_received,
                d.rtt_us,
                c.since.elapsed().as_secs()
            ));
        }
    }

    /// `SHOW`'s line.
    pub fn describe(&self) -> String {
        format!("vtoe enabled=yes socket={} port={} cgroup={}", self.socket.display(), self.local, self.guard.cgroup().display())
    }
}

struct Offloaded {
    shadow: shadow::Shadow,
    ends: Ends,
    iface: String,
    decision: Decision,
}

#[derive(Clone, Copy)]
struct Decision {
    origin: Port,
    src: Mac,
    dst: Mac,
    dest: Port,
}

impl Decision {
    /// Whether the rule table (and the link's key) still say the same.
    fn holds(&self, snap: &Snapshot) -> bool {
        let link = match (self.origin, self.dest) {
            (Port::Link(l), _) | (_, Port::Link(l)) => l,
            _ => return false,
        };
        let has_key = matches!(snap.slot_of(Port::Link(link)), Some(Slot::Link(s)) if snap.links[s as usize].vtoe.is_some());
        has_key && matches!(route_one(snap, self.origin, self.src, self.dst), Ok(p) if p == self.dest)
    }
}

enum Outcome {
    Fallback(Reason),
    Refused(i32, Reason),
}

/// Where the rule table sends a frame from `origin`, when it goes to exactly
/// one place (as a TCP connection must).
fn route_one(snap: &Snapshot, origin: Port, src: Mac, dst: Mac) -> Result<Port, Outcome> {
    let mut hits = Vec::new();
    snap.table.lookup(origin, src, dst, &mut hits);
    match hits.as_slice() {
        [] => Err(Outcome::Fallback(Reason::NoRoute)),
        [one] => Ok(one.dst),
        _ => Err(Outcome::Fallback(Reason::FanOut)),
    }
}

/// The peer vnetd's address and VTOE key, for a link that carries VTOE.
fn vtoe_peer(link: &Link) -> Result<(Ipv4Addr, &[u8]), Outcome> {
    let Some((_, key)) = &link.vtoe else { return Err(Outcome::Fallback(Reason::NoVtoeLink)) };
    match link.remote.map(|r| r.ip().to_canonical()) {
        Some(IpAddr::V4(ip)) => Ok((ip, key.bytes())),
        _ => Err(Outcome::Fallback(Reason::Ipv6Underlay)),
    }
}

/// Puts vnetd in a cgroup (v2) of its own, `vnet-vtoe-<pid>` under the one
/// it was in, where its shadow sockets are made and the guard is attached.
/// Such cgroups left by vnetds that are gone (no process in them) are
/// removed first; their programs stay with their sockets (see the guard).
/// Returns it, and (where vnetd was, it) for `shutdown`.
fn join_cgroup() -> Result<(PathBuf, Option<(PathBuf, PathBuf)>)> {
    let (_, own) = guard::cgroup_of_self(Path::new("/run/vnetd/cgroup2")).context("VTOE needs cgroup v2")?;
    if let Ok(entries) = std::fs::read_dir(&own) {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with("vnet-vtoe-") {
                // Fails (EBUSY) while its vnetd lives.
                let _ = std::fs::remove_dir(e.path());
            }
        }
    }
    let dir = own.join(format!("vnet-vtoe-{}", std::process::id()));
    match std::fs::create_dir(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e).with_context(|| format!("cannot make cgroup {}", dir.display())),
    }
    std::fs::write(dir.join("cgroup.procs"), std::process::id().to_string())
        .with_context(|| format!("cannot join cgroup {}", dir.display()))?;
    Ok((dir.clone(), Some((own, dir))))
}
