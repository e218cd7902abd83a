//! The next hop of every fast-path link, kept from the kernel's neighbour
//! table, so that `from_guest` writes a datagram's outer Ethernet header
//! itself and sends it straight out of the underlay device, instead of
//! asking the kernel to route it and look its neighbour up per packet
//! (`bpf_redirect_neigh`: the largest cost the fast path added to a frame,
//! docs/benchmarks.md).
//!
//! When the neighbour table changes (its rtnetlink events) and at least
//! once a second, while any guest port has the programs attached, a thread
//! asks the kernel, for each link the programs know, which device and gateway reach its peer (RTM_GETROUTE) and what
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
//!   loses its hop; a MAC the table learns (from the peer's ARP) is taken
//!   as the table changes.
//!
//! The programs take a hop only while its device and peer address are
//! still the link's, so an entry a moment old for a link replaced since
//! is never used.

use crate::sys::rtnl::{Neighbour, Rtnl};
use netlink_packet_route::neighbour::NeighbourState;
use std::collections::{HashMap, HashSet};
use std::net::Ipv4Addr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Weak};
use std::time::Duration;
use vnet_fastpath::{Kernel, NextHop};
use crate::sys::eventfd::EventFd;

/// How often the hops are read again when the neighbour table is quiet.
pub const REFRESH: Duration = Duration::from_secs(1);
/// How long the keeper sleeps while no guest port has the programs (a
/// port attached wakes it at once).
const IDLE: Duration = Duration::from_secs(3600);
/// After a neighbour event, a pass at most this soon after the last (a
/// busy table is read at most 20 times a second).
const SETTLE: Duration = Duration::from_millis(50);
/// rtnetlink's multicast group of neighbour events (RTNLGRP_NEIGH).
const RTNLGRP_NEIGH: u32 = 3;

crate::stats::counter_set! {
    /// What the keeper did, for STATS.
    pub struct Counters {
        /// Hops written or removed because the neighbour table changed.
        updates as "next_hop_updates",
        /// Stale neighbour entries the keeper asked the kernel to confirm.
        confirms as "next_hop_confirms",
    }
}

/// The keeper thread; stopped when dropped (woken at once: vnetd's stop
/// waits for it).
pub struct Keeper {
    stop: Option<Sender<()>>,
    wake: Arc<EventFd>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Keeper {
    pub fn start(kernel: &Arc<Kernel>, counters: Arc<Counters>) -> std::io::Result<Keeper> {
        let (stop, stopped) = std::sync::mpsc::channel();
        let wake = Arc::new(EventFd::new()?);
        let w = wake.clone();
        // A guest port attached wakes a keeper that had none to serve.
        let on_port = Arc::downgrade(&wake);
        kernel.on_port_attached(Box::new(move || {
            if let Some(w) = on_port.upgrade() {
                let _ = w.notify();
            }
        }));
        let kernel = Arc::downgrade(kernel);
        let thread = std::thread::Builder::new().name("next-hops".into()).spawn(move || run(kernel, counters, stopped, &w))?;
        Ok(Keeper { stop: Some(stop), wake, thread: Some(thread) })
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        self.stop.take();
        let _ = self.wake.notify();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(kernel: Weak<Kernel>, counters: Arc<Counters>, stop: Receiver<()>, wake: &EventFd) {
    let rtnl = match Rtnl::open() {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!("fast path: cannot open rtnetlink to keep links' next hops ({e}); the kernel resolves them per packet");
            return;
        }
    };
    // Neighbour events wake the keeper at once; without them it reads the
    // table once a second all the same.
    let events = neighbour_events()
        .map_err(|e| tracing::info!("fast path: no neighbour events ({e}); next hops read once a second"))
        .ok();
    let mut watched = Watch { hops: HashSet::new(), open: true, idle: false };
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let Some(k) = kernel.upgrade() else { return };
        match refresh(&k, &rtnl, &counters) {
            Ok(w) => watched = w,
            Err(e) => tracing::debug!("fast path: next hops not read this time: {e}"),
        }
        drop(k);
        match stop.recv_timeout(SETTLE) {
            Err(RecvTimeoutError::Timeout) => {}
            _ => return,
        }
        // No guest port: nothing to keep until one is attached (which
        // wakes the keeper), however long that is.
        let most = if watched.idle { IDLE } else { REFRESH - SETTLE };
        if !wait(events.as_ref(), &watched, &stop, wake, most, &mut buf) {
            return;
        }
    }
}

/// A socket that receives the neighbour table's changes, non-blocking.
fn neighbour_events() -> std::io::Result<netlink_sys::Socket> {
    let mut s = netlink_sys::Socket::new(netlink_sys::protocols::NETLINK_ROUTE)?;
    s.bind_auto()?;
    s.add_membership(RTNLGRP_NEIGH)?;
    s.set_non_blocking(true)?;
    Ok(s)
}

/// The neighbours whose events call for a pass.
struct Watch {
    /// The hops the links go by (device, address).
    hops: HashSet<(u32, Ipv4Addr)>,
    /// Some link has no hop yet (or there is no link yet): any neighbour
    /// event may be the one that resolves it.
    open: bool,
    /// No guest port has the programs: no hop is used.
    idle: bool,
}

/// Waits until an event about a watched neighbour, `most` passing, or the
/// stop (false: `wake` tells it at once).
fn wait(events: Option<&netlink_sys::Socket>, watched: &Watch, stop: &Receiver<()>, wake: &EventFd, most: Duration, buf: &mut [u8]) -> bool {
    use std::os::fd::AsFd;
    let deadline = std::time::Instant::now() + most;
    loop {
        match stop.try_recv() {
            Err(std::sync::mpsc::TryRecvError::Empty) => {}
            _ => return false,
        }
        let now = std::time::Instant::now();
        if now >= deadline {
            return true;
        }
        // `wake` ends the wait at once at a stop: no slicing needed.
        let slice = deadline - now;
        let ms = nix::poll::PollTimeout::try_from(slice.as_millis() as i32).unwrap_or(nix::poll::PollTimeout::NONE);
        let woken = |fd: &nix::poll::PollFd| fd.revents().is_some_and(|r| r.contains(nix::poll::PollFlags::POLLIN));
        let Some(s) = events else {
            let mut fds = [nix::poll::PollFd::new(wake.as_fd(), nix::poll::PollFlags::POLLIN)];
            let _ = nix::poll::poll(&mut fds, ms);
            if woken(&fds[0]) {
                // A stop (seen above, next time round) or a port attached.
                wake.drain();
                if stop_or_port(stop) {
                    return false;
                }
                return true;
            }
            continue;
        };
        let mut fds = [nix::poll::PollFd::new(s.as_fd(), nix::poll::PollFlags::POLLIN), nix::poll::PollFd::new(wake.as_fd(), nix::poll::PollFlags::POLLIN)];
        let ready = nix::poll::poll(&mut fds, ms);
        if woken(&fds[1]) {
            wake.drain();
            if stop_or_port(stop) {
                return false;
            }
            return true;
        }
        let socket_ready = woken(&fds[0]);
        if matches!(ready, Ok(n) if n > 0) && socket_ready {
            // Drain: one pass answers every event so far.
            let mut any = false;
            loop {
                match s.recv(&mut &mut buf[..], 0) {
                    Ok(n) => any |= concerns(&buf[..n], watched),
                    // Events were lost (the socket overflowed): any of them
                    // may have been a hop's.
                    Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => any = true,
                    Err(_) => break,
                }
            }
            if any {
                return true;
            }
        }
    }
}

/// After `wake`: true if it was the stop, false if a port was attached.
fn stop_or_port(stop: &Receiver<()>) -> bool {
    !matches!(stop.try_recv(), Err(std::sync::mpsc::TryRecvError::Empty))
}

/// Whether a datagram of neighbour events names a watched neighbour (or
/// cannot be read: then it might).
fn concerns(mut buf: &[u8], watched: &Watch) -> bool {
    if watched.open {
        return true;
    }
    use netlink_packet_core::{NetlinkMessage, NetlinkPayload};
    use netlink_packet_route::neighbour::{NeighbourAddress, NeighbourAttribute};
    use netlink_packet_route::RouteNetlinkMessage;
    while !buf.is_empty() {
        let Ok(m) = NetlinkMessage::<RouteNetlinkMessage>::deserialize(buf) else { return true };
        let len = (m.header.length as usize).next_multiple_of(4);
        if let NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewNeighbour(n) | RouteNetlinkMessage::DelNeighbour(n)) =
            m.payload
        {
            let ip = n.attributes.iter().find_map(|a| match a {
                NeighbourAttribute::Destination(NeighbourAddress::Inet(ip)) => Some(*ip),
                _ => None,
            });
            if ip.is_some_and(|ip| watched.hops.contains(&(n.header.ifindex, ip))) {
                return true;
            }
        }
        if len == 0 || len >= buf.len() {
            break;
        }
        buf = &buf[len..];
    }
    false
}

/// One pass over every link; returns what to watch until the next.
fn refresh(k: &Kernel, rtnl: &Rtnl, counters: &Counters) -> std::io::Result<Watch> {
    // Only frames from fast-path guests (veth, QEMU's TAP) go by a hop:
    // a host without one asks the kernel nothing (a host of 800 links
    // would ask 800 routes a second; docs/controller.md, "At scale").
    if !k.has_ports() {
        return Ok(Watch { hops: HashSet::new(), open: false, idle: true });
    }
    let links = k.link_paths();
    if links.is_empty() {
        return Ok(Watch { hops: HashSet::new(), open: true, idle: false });
    }
    let table: HashMap<(u32, Ipv4Addr), Neighbour> =
        rtnl.neighbours()?.into_iter().map(|(dev, ip, n)| ((dev, ip), n)).collect();
    let mut macs: HashMap<u32, Option<[u8; 6]>> = HashMap::new();
    let mut watched = Watch { hops: HashSet::new(), open: false, idle: false };
    for &(id, ifindex, peer) in &links {
        let hop = (|| {
            let route = rtnl.route_get(peer).ok()?;
            if route.oif != Some(ifindex) {
                return None; // the route moved: the kernel's own way until the link is described again
            }
            let via = route.gateway.unwrap_or(peer);
            watched.hops.insert((ifindex, via));
            let n = table.get(&(ifindex, via))?;
            if n.state == NeighbourState::Stale && rtnl.resolve(ifindex, via).is_ok() {
                counters.confirms.fetch_add(1, Relaxed);
            }
            let dst = n.usable()?;
            let src = (*macs.entry(ifindex).or_insert_with(|| rtnl.mac_of(ifindex).ok().flatten()))?;
            Some(NextHop { dst, src, ifindex, daddr: u32::from_ne_bytes(peer.octets()) })
        })();
        watched.open |= hop.is_none();
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
    Ok(watched)
}

#[cfg(test)]
mod tests {
    use super::*;
    use netlink_packet_core::{NetlinkHeader, NetlinkMessage, NetlinkPayload};
    use netlink_packet_route::neighbour::{NeighbourAddress, NeighbourAttribute, NeighbourMessage};
    use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};

    /// A neighbour event as the kernel sends it: device, address.
    fn event(ifindex: u32, ip: Ipv4Addr, new: bool) -> Vec<u8> {
        let mut n = NeighbourMessage::default();
        n.header.family = AddressFamily::Inet;
        n.header.ifindex = ifindex;
        n.attributes.push(NeighbourAttribute::Destination(NeighbourAddress::Inet(ip)));
        let msg = if new { RouteNetlinkMessage::NewNeighbour(n) } else { RouteNetlinkMessage::DelNeighbour(n) };
        let mut m = NetlinkMessage::new(NetlinkHeader::default(), NetlinkPayload::from(msg));
        m.finalize();
        let mut buf = vec![0; m.buffer_len()];
        m.serialize(&mut buf);
        buf
    }

    #[test]
    fn only_events_about_a_hop_a_link_goes_by_wake_the_keeper_unless_one_has_none() {
        let hop: Ipv4Addr = "198.18.0.2".parse().unwrap();
        let other: Ipv4Addr = "198.18.0.9".parse().unwrap();
        let w = Watch { hops: HashSet::from([(2, hop)]), open: false, idle: false };
        assert!(concerns(&event(2, hop, true), &w));
        assert!(concerns(&event(2, hop, false), &w), "a deleted entry");
        assert!(!concerns(&event(2, other, true), &w));
        assert!(!concerns(&event(3, hop, true), &w), "same address, another device");
        // Several events in one datagram: the last one is the hop's.
        let mut two = event(2, other, true);
        two.extend(event(2, hop, true));
        assert!(concerns(&two, &w));
        // A link still without a hop: any event may resolve it.
        let open = Watch { hops: HashSet::new(), open: true, idle: false };
        assert!(concerns(&event(7, other, true), &open));
        // What cannot be read might be the hop's.
        assert!(concerns(&[1, 2, 3], &w));
    }
}
