//! The packet dispatcher: moves frames between virtual NICs, the routing core
//! and the links, on one or more threads (`worker.rs`), each frame through
//! `forward.rs`.
//!
//! Workers read the topology from an immutable snapshot that the control
//! plane swaps whole, so the hot path takes no lock; each has its own route
//! cache, buffers and batches.

pub mod forward;
pub mod rig;
pub mod worker;


use crate::link::tcp::TcpAcceptor;
use crate::sys::udp::UdpEndpoint;
use crate::settings::Sched;
use crate::topology::LinkEnv;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::OnceLock;
use crate::stats::{render_totals, DropReason, ThreadStats};
use crate::topology::Snapshot;
use anyhow::{Context, Result};
use arc_swap::ArcSwap;
use crate::sys::eventfd::EventFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What the control plane and the dispatcher threads share.
pub struct Datapath {
    snapshot: ArcSwap<Snapshot>,
    /// Daemon-wide counters of the threads that are not dispatchers (TCP
    /// acceptor, control); each dispatcher has its own (`WorkerLink`).
    pub control: ThreadStats,
    /// The VNET/P UDP sockets, IPv4 and IPv6 (either may be absent).
    /// One socket per dispatcher on the same port (`SO_REUSEPORT`); empty
    /// if vnetd has none of that family. The first one sends.
    pub udp4: Vec<Arc<UdpEndpoint>>,
    pub udp6: Vec<Arc<UdpEndpoint>>,
    /// VXLAN sockets (a group as above), made when the first VXLAN link of
    /// a family is added.
    pub vxlan4: OnceLock<Vec<Arc<UdpEndpoint>>>,
    pub vxlan6: OnceLock<Vec<Arc<UdpEndpoint>>>,
    /// The one address vnetd's link sockets bind (`--udp-bind`), if given.
    bind_ip: Option<IpAddr>,
    vxlan_port: u16,
    /// Accepts TCP link connections, once a TCP link exists.
    tcp_acceptor: OnceLock<TcpAcceptor>,
    tcp_port: u16,
    workers: Vec<WorkerLink>,
    /// The control thread waiting in `publish` for the dispatchers to run
    /// its snapshot: each dispatcher unparks it once it does.
    publisher: std::sync::Mutex<Option<std::thread::Thread>>,
    stop: AtomicBool,
    /// The kernel fast path, if it loaded.
    pub fast: Option<Arc<crate::fast::FastPath>>,
    /// How dispatcher threads are scheduled.
    pub sched: Sched,
    /// vnetd's WireGuard side (`--wireguard-key-file`), if it has one.
    pub wireguard: Option<Arc<crate::link::wireguard::WgHub>>,
}

/// The control plane's handle on one dispatcher thread.
struct WorkerLink {
    wake: EventFd,
    stats: Arc<ThreadStats>,
    /// Generation of the snapshot the worker is running.
    running: AtomicU64,
    cpu: Option<usize>,
}

impl Datapath {
    /// A datapath with `workers` dispatcher threads, thread `i` pinned to
    /// `cpus[i]` when given. VXLAN sockets bind `vxlan_port`; TCP links
    /// listen on `tcp_port`.
    pub fn new(
        udp4: Vec<Arc<UdpEndpoint>>,
        udp6: Vec<Arc<UdpEndpoint>>,
        bind_ip: Option<IpAddr>,
        vxlan_port: u16,
        tcp_port: u16,
        workers: usize,
        cpus: &[usize],
    ) -> Result<Datapath> {
        let workers = (0..workers.max(1))
            .map(|i| {
                Ok(WorkerLink {
                    wake: EventFd::new().context("eventfd")?,
                    stats: Arc::new(ThreadStats::default()),
                    running: AtomicU64::new(0),
                    cpu: cpus.get(i).copied(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Datapath {
            snapshot: ArcSwap::from_pointee(Snapshot::empty()),
            control: ThreadStats::default(),
            udp4,
            udp6,
            vxlan4: OnceLock::new(),
            vxlan6: OnceLock::new(),
            bind_ip,
            vxlan_port,
            tcp_acceptor: OnceLock::new(),
            tcp_port,
            workers,
            publisher: std::sync::Mutex::new(None),
            stop: AtomicBool::new(false),
            fast: None,
            sched: Sched::Realtime,
            wireguard: None,
        })
    }

    /// Where the UDP sockets listen (for SHOW).
    pub fn udp_addrs(&self) -> String {
        let mut v: Vec<String> = [&self.udp4, &self.udp6].iter().filter_map(|u| u.first()).map(|u| u.local_addr().to_string()).collect();
        v.extend(
            [&self.vxlan4, &self.vxlan6].iter().filter_map(|u| u.get().and_then(|g| g.first())).map(|u| format!("vxlan:{}", u.local_addr())),
        );
        if let Some(t) = self.tcp_acceptor.get() {
            v.push(format!("tcp:{}", t.local));
        }
        if let Some(w) = &self.wireguard {
            v.push(format!("wireguard:{}", w.local_addr()));
        }
        v.join(",")
    }

    pub fn worker_count(&self) -> usize {
        self.workers.len()
    }

    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.snapshot.load_full()
    }

    /// Publishes a new topology and waits (briefly) until every dispatcher
    /// thread runs it, so that when a control request returns its change is
    /// in force.
    pub fn publish(&self, snap: Snapshot) {
        let generation = snap.generation;
        *self.publisher.lock().unwrap_or_else(|p| p.into_inner()) = Some(std::thread::current());
        self.snapshot.store(Arc::new(snap));
        for w in &self.workers {
            let _ = w.wake.notify();
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        while self.workers.iter().any(|w| w.running.load(Ordering::Acquire) < generation) {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            std::thread::park_timeout(deadline - now);
        }
        *self.publisher.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// A dispatcher runs a new snapshot: the control thread waiting for it
    /// in `publish`, if any, looks again.
    pub(crate) fn ran(&self, worker: usize, generation: u64) {
        self.workers[worker].running.store(generation, Ordering::Release);
        if let Some(t) = self.publisher.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            t.unpark();
        }
    }

    /// The oldest generation a dispatcher still runs: objects retired
    /// before it are used by no dispatcher.
    pub fn acknowledged(&self) -> u64 {
        self.workers.iter().map(|w| w.running.load(Ordering::Acquire)).min().unwrap_or(0)
    }

    /// Forgets the topology (after the dispatchers stopped): they use none
    /// of its objects any more.
    pub fn clear(&self) {
        self.snapshot.store(Arc::new(Snapshot::empty()));
        for w in &self.workers {
            w.running.store(u64::MAX, Ordering::Release);
        }
    }

    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::Release);
        for w in &self.workers {
            let _ = w.wake.notify();
        }
    }

    /// The `global`, `offload` and `dispatch` lines of `STATS`: sums over
    /// every thread.
    pub fn totals(&self) -> [String; 3] {
        render_totals(&self.all_stats())
    }

    /// Every thread's counters: the dispatchers', the control threads' and
    /// WireGuard's handshake thread's.
    fn all_stats(&self) -> Vec<&ThreadStats> {
        let mut all: Vec<&ThreadStats> = self.workers.iter().map(|w| &*w.stats).collect();
        all.push(&self.control);
        if let Some(w) = &self.wireguard {
            all.push(&w.stats);
        }
        all
    }

    /// Frames the user-level datapath received (every thread).
    pub fn user_frames(&self) -> u64 {
        self.all_stats().iter().map(|t| t.global.in_frames.load(Ordering::Relaxed)).sum()
    }

    /// Drops of one reason over the whole daemon.
    pub fn total_drops(&self, why: DropReason) -> u64 {
        self.all_stats().iter().map(|t| t.global.drops(why)).sum()
    }

    /// Dispatcher `i`'s counters.
    pub(crate) fn worker_stats(&self, i: usize) -> Arc<ThreadStats> {
        self.workers[i].stats.clone()
    }
}

/// Starts every dispatcher thread; `on_failure` runs if one fails.
pub fn spawn(dp: &Arc<Datapath>, on_failure: fn()) -> Result<Vec<JoinHandle<Result<()>>>> {
    (0..dp.workers.len())
        .map(|i| {
            let dp = dp.clone();
            std::thread::Builder::new()
                .name(format!("dispatcher-{i}"))
                .spawn(move || {
                    if let Some(cpu) = dp.workers[i].cpu {
                        crate::sys::thread::pin_to(cpu);
                    }
                    let r = worker::run(dp, i);
                    if let Err(e) = &r {
                        tracing::error!("dispatcher {i} failed: {e:#}");
                        on_failure();
                    }
                    r
                })
                .context("cannot start a dispatcher thread")
        })
        .collect()
}

impl LinkEnv for Arc<Datapath> {
    fn path_mtu(&self, to: SocketAddr) -> Option<u32> {
        self.udp(to.is_ipv4()).and_then(|u| u.path_mtu(to))
    }

    fn udp(&self, v4: bool) -> Option<Arc<UdpEndpoint>> {
        if v4 {
            self.udp4.first().cloned()
        } else {
            self.udp6.first().cloned()
        }
    }

    fn vxlan(&self, v4: bool) -> Result<Arc<UdpEndpoint>, String> {
        let (cell, mut ip): (&OnceLock<Vec<Arc<UdpEndpoint>>>, IpAddr) =
            if v4 { (&self.vxlan4, Ipv4Addr::UNSPECIFIED.into()) } else { (&self.vxlan6, Ipv6Addr::UNSPECIFIED.into()) };
        if let Some(b) = self.bind_ip {
            if b.is_ipv4() != v4 {
                return Err(format!("vnetd binds only {b} (--udp-bind): no {} VXLAN socket", if v4 { "IPv4" } else { "IPv6" }));
            }
            ip = b;
        }
        if let Some(g) = cell.get() {
            return Ok(g[0].clone());
        }
        let group = UdpEndpoint::bind_group(SocketAddr::new(ip, self.vxlan_port), self.workers.len()).map_err(|e| format!("{e:#}"))?;
        // Each dispatcher watches its socket from its next snapshot on.
        Ok(cell.get_or_init(|| group)[0].clone())
    }

    fn wireguard(&self) -> Result<Arc<crate::link::wireguard::WgHub>, String> {
        self.wireguard.clone().ok_or_else(|| "vnetd has no WireGuard key: start it with --wireguard-key-file <file>".to_string())
    }

    fn ensure_tcp_acceptor(&self) -> Result<(), String> {
        if self.tcp_acceptor.get().is_some() {
            return Ok(());
        }
        // Connections from addresses with no TCP link count as datagrams
        // from unknown senders do.
        let dp = Arc::downgrade(self);
        let lookup: crate::link::tcp::LinkLookup = Arc::new(move |peer| {
            let dp = dp.upgrade()?;
            let found = dp.snapshot().tcp_link_for(peer).cloned();
            if found.is_none() {
                dp.control.global.received(0);
                dp.control.drop_at(None, DropReason::UnknownSender);
            }
            found
        });
        // On --udp-bind's address if given; else one dual-stack listener
        // (IPv4 peers arrive as mapped addresses).
        let a = match self.bind_ip {
            Some(ip) => TcpAcceptor::start(SocketAddr::new(ip, self.tcp_port), lookup),
            None => TcpAcceptor::start(SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), self.tcp_port), lookup.clone())
                .or_else(|_| TcpAcceptor::start(SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), self.tcp_port), lookup)),
        }
        .map_err(|e| format!("{e:#}"))?;
        let _ = self.tcp_acceptor.set(a);
        Ok(())
    }

    fn fast_link(&self, id: u32, remote: SocketAddr, mtu: u32) -> Option<vnet_fastpath::LinkEntry> {
        let fast = self.fast.as_ref()?;
        let IpAddr::V4(dst) = remote.ip() else {
            return None; // IPv6 links take the slow path (see docs/datapath.md)
        };
        let sport = self.udp4.first()?.local_addr().port();
        let (ifindex, src) = match crate::sys::rtnl::route_to(dst) {
            Ok(r) => r,
            Err(e) => {
                tracing::info!("link {id} to {remote}: no route for the fast path ({e}); it takes the slow path");
                return None;
            }
        };
        let src = match self.bind_ip {
            Some(IpAddr::V4(b)) if !b.is_unspecified() => b,
            _ => src,
        };
        let path = vnet_fastpath::LinkPath { src, dst, sport, dport: remote.port(), mtu, ifindex };
        match fast.kernel.add_link(id, &path) {
            Ok(e) => Some(e),
            Err(e) => {
                tracing::warn!("link {id} to {remote}: the fast path cannot take it ({e:#}); it takes the slow path");
                None
            }
        }
    }
}
