//! vnetd's side of the kernel fast path (`vnet-fastpath`): which routing
//! decisions the kernel may carry, installing them, and taking them back.
//!
//! - **Install.** When a dispatcher's route cache asks the rule table
//!   (a miss: the frame came up the slow path), it offers the answer here
//!   (`FastPath::offer`). A decision the kernel can carry as it is — one
//!   destination; from a fast port (a veth guest) or a UDP link the kernel
//!   knows; to a fast port, or to such a link from a guest — is written to
//!   the `flows` map under VNET/P's cache key (origin, destination MAC,
//!   source MAC). Installs are bounded (the map's size) and rate-limited
//!   per dispatcher.
//! - **Take back.** After every change the control plane, once every
//!   dispatcher runs the new rule table (so none can install an old
//!   answer), asks the table again for every installed key and removes the
//!   entries whose answer changed (`FastPath::revalidate`), before it
//!   replies.
//!
//! So the kernel only ever holds answers the rule table gives now; the rule
//! semantics stay in `vnet-core`. Beside the answers, the kernel holds each
//! link's next hop (`next_hops`), kept from the neighbour table.

mod neigh;
pub mod next_hops;

use crate::sys::rtnl;
use crate::topology::Snapshot;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;
use vnet_core::table::{Hit, Port};
use vnet_core::Mac;
use vnet_fastpath::{Action, CounterKind, Flow, FlowKey, Kernel, LINK_BIT};

/// The fast path as vnetd uses it: the loaded programs and what was done
/// with them.
pub struct FastPath {
    pub kernel: Arc<Kernel>,
    pub counters: InstallCounters,
    finisher: std::sync::Mutex<Option<Finisher>>,
    next_hops: Arc<next_hops::Counters>,
    keeper: std::sync::Mutex<Option<next_hops::Keeper>>,
    /// The snapshot the `neigh` map was last synced to (`neigh.rs`), held
    /// weakly.
    neigh_at: std::sync::Mutex<std::sync::Weak<Snapshot>>,
}

crate::stats::counter_set! {
    /// What vnetd did with the fast path's flow map.
    pub struct InstallCounters {
        /// Entries installed.
        installs,
        /// Installs the map refused (full).
        install_failures,
        /// Installs skipped by the rate limit (the frames went by the slow path).
        rate_limited,
        /// Entries taken back because a change altered their answer.
        revoked,
    }
}

/// Installs per second one dispatcher may make, and its burst.
const INSTALL_RATE: f64 = 20_000.0;
const INSTALL_BURST: f64 = 2_000.0;

/// One dispatcher's install budget (a token bucket).
pub struct InstallBudget {
    tokens: f64,
    at: Option<Instant>,
}

impl Default for InstallBudget {
    fn default() -> Self {
        InstallBudget { tokens: INSTALL_BURST, at: None }
    }
}

impl InstallBudget {
    fn take(&mut self) -> bool {
        let now = Instant::now();
        if let Some(at) = self.at {
            self.tokens = (self.tokens + now.duration_since(at).as_secs_f64() * INSTALL_RATE).min(INSTALL_BURST);
        }
        self.at = Some(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// A port as the kernel names it: an interface id, or a link id with
/// `LINK_BIT`.
pub fn code(p: Port) -> u32 {
    match p {
        Port::Interface(id) => id,
        Port::Link(id) => id | LINK_BIT,
    }
}

fn port_of(code: u32) -> Port {
    if code & LINK_BIT != 0 {
        Port::Link(code & !LINK_BIT)
    } else {
        Port::Interface(code)
    }
}

/// The finishing pair: a veth pair in vnetd's namespace whose sending end
/// has no checksum offload, so that the kernel segments and checksums what
/// is sent out of it, as a NIC would (see `from_network`). With a pinned
/// datapath it is named after the pin folder (`vfx<tag>`, `vfy<tag>`) and
/// outlives vnetd with it; without, after vnetd's pid, and goes with it.
struct Finisher {
    send: u32,
    name: String,
    /// Delete it when this goes (unpinned: it is this process's alone).
    remove: bool,
}

impl Finisher {
    const MAC: [u8; 6] = [0x02, 0x76, 0x6e, 0x00, 0x00, 0x01];

    /// The pair's names for a datapath pinned at `dir`.
    fn names(dir: &std::path::Path) -> (String, String) {
        let t = crate::nic::upcall::tag(&dir.to_string_lossy());
        (format!("vfx{t}"), format!("vfy{t}"))
    }

    /// Deletes pairs left by an unpinned vnetd that was killed (SIGKILL: no
    /// clean exit): `vfa<pid>` carrying vnetd's mark, whose pid is no
    /// running vnetd.
    fn sweep() {
        let Ok(dir) = std::fs::read_dir("/sys/class/net") else { return };
        for e in dir.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(pid) = name.strip_prefix("vfa").and_then(|p| p.parse::<u32>().ok()) else { continue };
            let alive = std::fs::read_to_string(format!("/proc/{pid}/comm")).map(|c| c.trim() == "vnetd").unwrap_or(false);
            if alive {
                continue;
            }
            if let Ok(Some(d)) = rtnl::device(&name) {
                if d.is_vnetds_veth() {
                    tracing::info!("removing {name}, left by a vnetd that is gone");
                    let _ = rtnl::delete(d.index);
                }
            }
        }
    }

    fn make(kernel: &Kernel) -> anyhow::Result<Finisher> {
        use anyhow::Context;
        Self::sweep();
        let ((a, b), remove) = match kernel.pin_dir() {
            Some(dir) => (Self::names(dir), false),
            None => {
                let pid = std::process::id();
                ((format!("vfa{pid}"), format!("vfb{pid}")), true)
            }
        };
        let existing = match (rtnl::device(&a)?, rtnl::device(&b)?) {
            (Some(x), Some(y)) if x.is_vnetds_veth() && x.peer == Some(y.index) => Some((x.index, y.index)),
            (None, None) => None,
            _ => anyhow::bail!("devices named {a} or {b} exist and are not the finishing pair vnetd made; vnetd leaves them alone"),
        };
        let (send, recv) = match existing {
            Some(pair) => pair,
            None => {
                let ns = std::fs::File::open("/proc/self/ns/net").context("own network namespace")?;
                use std::os::fd::AsRawFd;
                rtnl::create_veth(&a, &b, ns.as_raw_fd(), Self::MAC, 65535).with_context(|| format!("cannot make veth pair {a}/{b}"))?;
                (rtnl::device(&a)?.context("vanished")?.index, rtnl::device(&b)?.context("vanished")?.index)
            }
        };
        let f = Finisher { send, name: a.clone(), remove };
        for dev in [&a, &b] {
            let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{dev}/disable_ipv6"), "1");
        }
        // Datagrams from a peer arrive on `b`, not on the device that routes
        // back to it: no reverse-path filter there.
        let _ = std::fs::write(format!("/proc/sys/net/ipv4/conf/{b}/rp_filter"), "0");
        if std::fs::read_to_string("/proc/sys/net/ipv4/conf/all/rp_filter").map(|s| s.trim() == "1").unwrap_or(false) {
            tracing::warn!("net.ipv4.conf.all.rp_filter is 1 (strict): unfinished datagrams from fast-path peers over a veth underlay will be dropped; set it to 0 or 2");
        }
        crate::sys::netdev::tx_checksum_off(&a).with_context(|| format!("cannot turn checksum offload off on {a}"))?;
        rtnl::set_up(f.send)?;
        rtnl::set_up(recv)?;
        kernel.set_finisher(f.send, recv, Self::MAC)?;
        Ok(f)
    }
}

impl Drop for Finisher {
    fn drop(&mut self) {
        if !self.remove {
            return;
        }
        if let Err(e) = rtnl::delete(self.send) {
            tracing::warn!("cannot delete {}: {e}", self.name);
        }
    }
}

/// `vnetd --cleanup`: removes the kernel datapath pinned at `dir` (every
/// program detached, every map freed) and the devices vnetd made for it
/// there (the upcall TAPs and the finishing pair). Guests' own devices
/// (veth pairs, TAPs) are left as they are.
pub fn destroy(dir: &std::path::Path) -> anyhow::Result<()> {
    let upcalls = Kernel::destroy(dir)?;
    let mut gone = 0;
    for index in upcalls {
        if let Ok(Some(d)) = rtnl::device_by_index(index) {
            if d.is_vnetds() && d.name.starts_with("vu") && rtnl::delete(index).is_ok() {
                gone += 1;
            }
        }
    }
    let (a, _) = Finisher::names(dir);
    if let Ok(Some(d)) = rtnl::device(&a) {
        if d.is_vnetds_veth() && rtnl::delete(d.index).is_ok() {
            gone += 1;
        }
    }
    tracing::info!("removed the kernel datapath pinned at {} and {gone} device(s) vnetd made for it", dir.display());
    Ok(())
}

impl FastPath {
    /// vnetd's fast path: the opened programs, and the finishing pair made
    /// (or, pinned, taken over).
    pub fn new(kernel: Arc<Kernel>) -> anyhow::Result<FastPath> {
        let finisher = Finisher::make(&kernel)?;
        let counters = Arc::new(next_hops::Counters::default());
        let keeper = match next_hops::Keeper::start(&kernel, counters.clone()) {
            Ok(k) => Some(k),
            Err(e) => {
                tracing::warn!("fast path: cannot start the next-hop keeper ({e}); the kernel resolves each datagram's next hop");
                None
            }
        };
        Ok(FastPath {
            kernel,
            counters: InstallCounters::default(),
            finisher: std::sync::Mutex::new(Some(finisher)),
            next_hops: counters,
            keeper: std::sync::Mutex::new(keeper),
            neigh_at: std::sync::Mutex::new(std::sync::Weak::new()),
        })
    }

    /// Closes what vnetd made for the fast path in its namespace (at exit):
    /// pinned, it all stays for the next vnetd; unpinned, it goes.
    pub fn shutdown(&self) {
        self.keeper.lock().unwrap().take();
        self.finisher.lock().unwrap().take();
    }

    /// Once the config is in force at start (before vnetd says it is
    /// ready): the fast path switched as `snap` says, every flow entry the
    /// vnetd before left that `snap`'s rule table would not install
    /// removed, and what the folder held that the config no longer has
    /// (attachments, ports, links) removed.
    pub fn finish_start(&self, snap: &Arc<Snapshot>, adopted_flows: usize) {
        if let Err(e) = self.kernel.set_enabled(snap.fast_on) {
            tracing::error!("fast path: cannot switch it: {e:#}");
        }
        if snap.fast_on {
            self.revalidate(snap);
        } else {
            self.kernel.clear_flows();
        }
        self.sync_neigh(snap.clone());
        let swept = self.kernel.finish_adoption();
        if self.kernel.pin_dir().is_some() {
            tracing::info!(
                "fast path in force: {} of the {adopted_flows} flow entries adopted kept, {} taken back; swept {} attachment(s), {} port(s), {} link(s) the config no longer has",
                self.kernel.flow_count().min(adopted_flows),
                adopted_flows.saturating_sub(self.kernel.flow_count()),
                swept.attachments,
                swept.ports,
                swept.links
            );
        }
    }

    /// Whether frames from `origin` meet the fast path at all.
    fn is_fast_origin(snap: &Snapshot, origin: Port) -> bool {
        match snap.slot_of(origin) {
            Some(crate::topology::Slot::Iface(s)) => snap.ifaces[s as usize].nic.fast_target().is_some(),
            Some(crate::topology::Slot::Link(s)) => snap.links[s as usize].fast.is_some(),
            None => false,
        }
    }

    /// The entry the kernel may hold for a frame from `origin` that the
    /// rule table sends to `hits`, if it can carry it.
    pub fn flow_for(snap: &Snapshot, origin: Port, dst: Mac, hits: &[Hit]) -> Option<Flow> {
        let [hit] = hits else { return None };
        if !Self::is_fast_origin(snap, origin) {
            return None;
        }
        let route = snap.routes.get(&hit.rule)?.id;
        let mut max_len = 0;
        let action = match (snap.slot_of(hit.dst)?, origin) {
            (crate::topology::Slot::Iface(s), _) => {
                let i = &snap.ifaces[s as usize];
                max_len = i.max_frame() as u32;
                match i.nic.fast_target()? {
                    // Into the guest's namespace directly only for frames
                    // addressed to it: the kernel then treats them as the
                    // guest's own. Others (broadcast, another MAC behind the
                    // guest) leave by the veth's host end, so the guest's
                    // side reads their header as a wire frame.
                    Action::Peer { ifindex } if dst != i.mac => Action::Device { ifindex },
                    a => a,
                }
            }
            // Link to link (a host relaying between links) stays in vnetd.
            (crate::topology::Slot::Link(_), Port::Link(_)) => return None,
            (crate::topology::Slot::Link(s), Port::Interface(_)) => {
                let l = &snap.links[s as usize];
                l.fast.as_ref()?;
                Action::Encap { link: l.id }
            }
        };
        Some(Flow { action, dest: code(hit.dst), route, max_len })
    }

    /// A dispatcher's route cache asked the table: install the answer if
    /// the kernel can carry it.
    pub fn offer(&self, budget: &mut InstallBudget, snap: &Snapshot, origin: Port, src: Mac, dst: Mac, hits: &[Hit]) {
        let Some(flow) = Self::flow_for(snap, origin, dst, hits) else { return };
        if !budget.take() {
            self.counters.rate_limited.fetch_add(1, Relaxed);
            return;
        }
        let key = FlowKey { origin: code(origin), dst: dst.0, src: src.0 };
        match self.kernel.install(&key, flow) {
            Ok(()) => self.counters.installs.fetch_add(1, Relaxed),
            Err(e) => {
                tracing::debug!("fast path: cannot install {key:?}: {e:#}");
                self.counters.install_failures.fetch_add(1, Relaxed)
            }
        };
    }

    /// Removes every entry whose answer under `snap`'s rule table differs
    /// from what the kernel holds. Called once every dispatcher runs `snap`.
    pub fn revalidate(&self, snap: &Snapshot) {
        let mut scratch = Vec::new();
        for (key, held) in self.kernel.flows() {
            let origin = port_of(key.origin);
            scratch.clear();
            snap.table.lookup(origin, Mac(key.src), Mac(key.dst), &mut scratch);
            if held.is_none() || Self::flow_for(snap, origin, Mac(key.dst), &scratch) != held {
                self.kernel.remove_flow(&key);
                self.counters.revoked.fetch_add(1, Relaxed);
            }
        }
    }

    /// The `STATS` line: whether it is on, what vnetd did with it and what
    /// the programs did with frames.
    pub fn render(&self, datapath: vnet_core::command::Datapath) -> String {
        let on = datapath != vnet_core::command::Datapath::User;
        let mut s = format!("fastpath loaded=yes enabled={} entries={}", if on { "yes" } else { "no" }, self.kernel.flow_count());
        self.counters.render_into(&mut s);
        s.push_str(&format!(" next_hops={}", self.kernel.next_hop_count()));
        self.next_hops.render_into(&mut s);
        for (name, v) in vnet_fastpath::STAT_NAMES.iter().zip(self.kernel.stats()) {
            s.push_str(&format!(" {name}={v}"));
        }
        // What the finishing pair lost (its receiving side's queue full, a
        // CPU behind with cutting trains; or that side down), the kernel's
        // count on the sending end: frames sent round it and never back.
        let send = self.finisher.lock().unwrap().as_ref().map(|f| f.send);
        let lost = send.and_then(|i| rtnl::tx_dropped(i).ok()).unwrap_or(0);
        s.push_str(&format!(" drop_finish={lost}"));
        s
    }

    /// What the kernel carried in and out of an interface (or a link).
    pub fn port(&self, id: u32, link: bool) -> crate::stats::Fast {
        let (i, o) = if link { (CounterKind::LinkIn, CounterKind::LinkOut) } else { (CounterKind::IfaceIn, CounterKind::IfaceOut) };
        let ((in_frames, in_bytes), (out_frames, out_bytes)) = (self.kernel.counter(i, id), self.kernel.counter(o, id));
        crate::stats::Fast { in_frames, in_bytes, out_frames, out_bytes }
    }

    /// The interface's ARP requests the kernel answered (`neigh.rs`).
    pub fn neigh_answered(&self, id: u32) -> u64 {
        self.kernel.counter(CounterKind::Neigh, id).0
    }

    /// Frames and bytes the kernel carried by a route.
    pub fn route(&self, id: u32) -> (u64, u64) {
        self.kernel.counter(CounterKind::Route, id)
    }

    /// Forgets the kernel's counters of objects that are gone.
    pub fn forget_iface(&self, id: u32) {
        self.kernel.forget(CounterKind::IfaceIn, id);
        self.kernel.forget(CounterKind::IfaceOut, id);
        self.kernel.forget(CounterKind::Neigh, id);
    }

    /// A link's frames the kernel sent resolving the next hop itself (the
    /// link's hop not known yet: see next_hops.rs).
    pub fn resolved(&self, id: u32) -> u64 {
        self.kernel.counter(CounterKind::LinkResolved, id).0
    }

    pub fn forget_link(&self, id: u32) {
        self.kernel.forget(CounterKind::LinkIn, id);
        self.kernel.forget(CounterKind::LinkOut, id);
        self.kernel.forget(CounterKind::LinkResolved, id);
    }

    pub fn forget_route(&self, id: u32) {
        self.kernel.forget(CounterKind::Route, id);
    }
}
