//! The packet dispatcher: moves frames between virtual NICs, the routing core
//! and the links, on one or more threads (`worker.rs`), each frame through
//! `forward.rs`.
//!
//! Workers read the topology from an immutable snapshot that the control
//! plane swaps whole, so the hot path takes no lock; each has its own route
//! cache, buffers and batches.

pub mod forward;
pub mod home;
pub mod rig;
pub mod worker;


use crate::link::carriers::Carriers;
use crate::link::{kinds, CarrierKey, LinkEnv, LinkLookup, LinkSource, LinksNow, RunOpener};
use crate::settings::Sched;
use crate::stats::{render_totals, DropReason, ThreadStats};
use crate::topology::Snapshot;
use anyhow::{Context, Result};
use arc_swap::ArcSwap;
use crate::sys::eventfd::EventFd;
use std::any::Any;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What the control plane and the dispatcher threads share.
pub struct Datapath {
    snapshot: ArcSwap<Snapshot>,
    /// Daemon-wide counters of the threads that are not dispatchers (TCP
    /// acceptor, control); each dispatcher has its own (`WorkerLink`).
    pub control: ThreadStats,
    /// The UDP carriers link kinds bound (a socket per dispatcher each).
    pub carriers: Carriers,
    /// What each link kind shares between its links (a TCP acceptor, the
    /// WireGuard hub), by kind.
    shared: Mutex<HashMap<&'static str, Arc<dyn Any + Send + Sync>>>,
    /// The one address link sockets bind (`--udp-bind`), if given.
    bind_ip: Option<IpAddr>,
    workers: Vec<WorkerLink>,
    /// The control thread waiting in `publish` for the dispatchers to run
    /// its snapshot: each dispatcher unparks it once it does.
    publisher: std::sync::Mutex<Option<std::thread::Thread>>,
    stop: AtomicBool,
    /// Link sockets are read (`link_sources`): not while vnetd starts, until
    /// its links are in force (`open_links`), so that what waited in a
    /// socket kept from the vnetd before is not taken for unknown senders.
    links_open: AtomicBool,
    /// The kernel fast path, if it loaded.
    pub fast: Option<Arc<crate::fast::FastPath>>,
    /// How dispatcher threads are scheduled.
    pub sched: Sched,
    /// Itself, for the threads of link kinds that look at the links in
    /// force (set once it is shared).
    me: OnceLock<Weak<Datapath>>,
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
    /// `cpus[i]` when given; link sockets on `bind_ip` (`--udp-bind`) if
    /// given. Link kinds bind their carriers once it is shared (`shared`).
    pub fn new(bind_ip: Option<IpAddr>, workers: usize, cpus: &[usize]) -> Result<Datapath> {
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
            carriers: Carriers::new(bind_ip, workers.len()),
            shared: Mutex::new(HashMap::new()),
            bind_ip,
            workers,
            publisher: std::sync::Mutex::new(None),
            stop: AtomicBool::new(false),
            links_open: AtomicBool::new(true),
            fast: None,
            sched: Sched::Realtime,
            me: OnceLock::new(),
        })
    }

    /// Shares the datapath: link kinds' threads may look at it from now on.
    pub fn shared(dp: Datapath) -> Arc<Datapath> {
        let dp = Arc::new(dp);
        let _ = dp.me.set(Arc::downgrade(&dp));
        dp
    }

    /// Where the link sockets listen (for SHOW and the start line): every
    /// carrier, then what link kinds listen on of their own (TCP).
    pub fn udp_addrs(&self) -> String {
        let mut v = self.carriers.describe();
        for k in kinds::ALL {
            v.extend(k.listens(self));
        }
        v.join(",")
    }

    /// Lines link kinds add to `SHOW` (their state as a whole).
    pub fn kinds_show(&self) -> Vec<String> {
        kinds::ALL.iter().flat_map(|k| k.show(self)).collect()
    }

    /// The link sources dispatcher `me` reads: its socket of every carrier,
    /// and the own sources of the links it owns.
    pub(crate) fn link_sources(&self, me: usize, snap: &Snapshot) -> Vec<Arc<dyn LinkSource>> {
        let n = self.workers.len();
        let mut v: Vec<Arc<dyn LinkSource>> = Vec::new();
        if !self.links_open.load(Ordering::Acquire) {
            return v;
        }
        for c in self.carriers.all().iter() {
            v.extend(c.sources().into_iter().filter(|s| s.owner(n) == me));
        }
        for l in &snap.links {
            if let Some(s) = l.transport.source() {
                if s.owner(n) == me {
                    v.push(s);
                }
            }
        }
        v
    }

    /// Link sockets are not read until `open_links` (vnetd's start).
    pub fn close_links(&mut self) {
        *self.links_open.get_mut() = false;
    }

    /// Link sockets are read from the next snapshot on.
    pub fn open_links(&self) {
        self.links_open.store(true, Ordering::Release);
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
        let kinds = self.kinds_stats();
        let mut all = self.all_stats();
        all.extend(kinds.iter().map(|t| &**t));
        render_totals(&all)
    }

    /// Every thread's counters but the link kinds' own threads'.
    fn all_stats(&self) -> Vec<&ThreadStats> {
        let mut all: Vec<&ThreadStats> = self.workers.iter().map(|w| &*w.stats).collect();
        all.push(&self.control);
        all
    }

    /// The counters of link kinds' own threads (WireGuard's handshakes).
    fn kinds_stats(&self) -> Vec<Arc<ThreadStats>> {
        kinds::ALL.iter().filter_map(|k| k.thread_stats(self)).collect()
    }

    /// Frames the user-level datapath received (every thread).
    pub fn user_frames(&self) -> u64 {
        let kinds = self.kinds_stats();
        self.all_stats().into_iter().chain(kinds.iter().map(|t| &**t)).map(|t| t.global.in_frames.load(Ordering::Relaxed)).sum()
    }

    /// Drops of one reason over the whole daemon.
    pub fn total_drops(&self, why: DropReason) -> u64 {
        let kinds = self.kinds_stats();
        self.all_stats().into_iter().chain(kinds.iter().map(|t| &**t)).map(|t| t.global.drops(why)).sum()
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

impl LinkEnv for Datapath {
    fn path_mtu(&self, to: SocketAddr) -> Option<u32> {
        let c = self.carriers.all().iter().find(|c| matches!(c.key, CarrierKey::Udp { v6, .. } if v6 == to.is_ipv6())).cloned()?;
        c.sender().path_mtu(to)
    }

    fn udp_carrier(&self, key: CarrierKey, word: &'static str, opener: &dyn Fn() -> Arc<dyn RunOpener>) -> Result<Arc<crate::link::carriers::UdpCarrier>, String> {
        // Each dispatcher watches its socket from its next snapshot on.
        self.carriers.get_or_bind(key, word, opener)
    }

    fn shared(&self, kind: &'static str, make: &mut dyn FnMut() -> Result<Arc<dyn Any + Send + Sync>, String>) -> Result<Arc<dyn Any + Send + Sync>, String> {
        let mut m = self.shared.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = m.get(kind) {
            return Ok(s.clone());
        }
        let s = make()?;
        m.insert(kind, s.clone());
        Ok(s)
    }

    fn shared_now(&self, kind: &'static str) -> Option<Arc<dyn Any + Send + Sync>> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner()).get(kind).cloned()
    }

    fn links_now(&self) -> LinksNow {
        let me = self.me.get().cloned().unwrap_or_default();
        let counted = me.clone();
        LinksNow {
            now: Arc::new(move || me.upgrade().map(|dp| dp.snapshot() as Arc<dyn LinkLookup + Send + Sync>)),
            // Connections or datagrams from addresses with no link count as
            // datagrams from unknown senders do.
            unknown: Arc::new(move || {
                if let Some(dp) = counted.upgrade() {
                    dp.control.global.received(0);
                    dp.control.drop_at(None, DropReason::UnknownSender);
                }
            }),
        }
    }

    fn fast_link(&self, id: u32, remote: SocketAddr, sport: u16, mtu: u32) -> Option<vnet_fastpath::LinkEntry> {
        let fast = self.fast.as_ref()?;
        let IpAddr::V4(dst) = remote.ip() else {
            return None; // IPv6 links take the slow path (see docs/datapath.md)
        };
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
