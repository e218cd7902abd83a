//! The next hop of every fast-path link, kept from the kernel's neighbour
//! table, so that `from_guest` writes a datagram's outer Ethernet header
//! itself and sends it straight out of the underlay device, instead of
//! asking the kernel to route it and look its neighbour up per packet
//! (`bpf_redirect_neigh`: the largest cost the fast path added to a frame,
//! docs/benchmarks.md).
//!
//! Once a second a thread asks the kernel, for each link the programs
//! know, which device and gateway reach its peer (RTM_GETROUTE) and what
//! the neighbour table holds for that hop (one RTM_GETNEIGH dump), and
//! writes the answer into `next_hops`, or removes it:
//!
//! - a usable entry (reachable, stale, being confirmed, permanent) gives
//!   the hop; the route leaving by another device than the link's, or no
//!   usable entry (not resolved yet, failed), removes it, and the
//!   programs fall back on `bpf_redirect_neigh`, which resolves as the
//!   stack would;
//! - a stale entry is confirmed as the stack confirms one it sends to
//!   (NTF_USE: delay, then unicast probes): the fast path's datagrams do
//!   not go through the neighbour entry, so without this it would never
//!   be re-checked. A peer that stops answering fails its probes and
//!   loses its hop; one that changes its MAC (and says so with a
//!   gratuitous ARP, as Linux does) is followed within a second.
//!
//! The programs take a hop only while its device and peer address are
//! still the link's, so an entry a moment old for a link replaced since
//! is never used.

use crate::sys::rtnl::{Neighbour, Rtnl};
use netlink_packet_route::neighbour::NeighbourState;
use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Weak};
use std::time::Duration;
use vnet_fastpath::{Kernel, NextHop};

/// How often the hops are read again.
pub const REFRESH: Duration = Duration::from_secs(1);

/// What the keeper did, for STATS.
#[derive(Default)]
pub struct Counters {
    /// Hops written or removed because the neighbour table changed.
    pub updates: AtomicU64,
    /// Stale neighbour entries the keeper asked the kernel to confirm.
    pub confirms: AtomicU64,
}

/// The keeper thread; stopped when dropped.
pub struct Keeper {
    stop: Option<Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Keeper {
    pub fn start(kernel: &Arc<Kernel>, counters: Arc<Counters>) -> std::io::Result<Keeper> {
        let (stop, stopped) = std::sync::mpsc::channel();
        let kernel = Arc::downgrade(kernel);
        let thread = std::thread::Builder::new().name("next-hops".into()).spawn(move || run(kernel, counters, stopped))?;
        Ok(Keeper { stop: Some(stop), thread: Some(thread) })
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        self.stop.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(kernel: Weak<Kernel>, counters: Arc<Counters>, stop: Receiver<()>) {
    let rtnl = match Rtnl::open() {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!("fast path: cannot open rtnetlink to keep links' next hops ({e}); the kernel resolves them per packet");
            return;
        }
    };
    loop {
        let Some(k) = kernel.upgrade() else { return };
        if let Err(e) = refresh(&k, &rtnl, &counters) {
            tracing::debug!("fast path: next hops not read this time: {e}");
        }
        drop(k);
        match stop.recv_timeout(REFRESH) {
            Err(RecvTimeoutError::Timeout) => continue,
            _ => return,
        }
    }
}

/// One pass over every link.
fn refresh(k: &Kernel, rtnl: &Rtnl, counters: &Counters) -> std::io::Result<()> {
    let links = k.link_paths();
    let table: HashMap<(u32, Ipv4Addr), Neighbour> =
        rtnl.neighbours()?.into_iter().map(|(dev, ip, n)| ((dev, ip), n)).collect();
    let mut macs: HashMap<u32, Option<[u8; 6]>> = HashMap::new();
    for &(id, ifindex, peer) in &links {
        let hop = (|| {
            let route = rtnl.route_get(peer).ok()?;
            if route.oif != Some(ifindex) {
                return None; // the route moved: the kernel's own way until the link is described again
            }
            let via = route.gateway.unwrap_or(peer);
            let n = table.get(&(ifindex, via))?;
            if n.state == NeighbourState::Stale && rtnl.resolve(ifindex, via).is_ok() {
                counters.confirms.fetch_add(1, Relaxed);
            }
            let dst = n.usable()?;
            let src = (*macs.entry(ifindex).or_insert_with(|| rtnl.mac_of(ifindex).ok().flatten()))?;
            Some(NextHop { dst, src, ifindex, daddr: u32::from_ne_bytes(peer.octets()) })
        })();
        match k.set_next_hop(id, hop) {
            Ok(true) => {
                counters.updates.fetch_add(1, Relaxed);
                tracing::debug!("fast path: link {id}'s next hop is now {hop:?}");
            }
            Ok(false) => {}
            Err(e) => tracing::debug!("fast path: cannot set link {id}'s next hop: {e:#}"),
        }
    }
    // Hops of links the programs no longer know.
    for id in k.next_hop_ids() {
        if !links.iter().any(|l| l.0 == id) {
            let _ = k.set_next_hop(id, None);
        }
    }
    Ok(())
}
