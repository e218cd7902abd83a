//! Broadcast kept at home: what a guest's broadcast or multicast frame
//! meets before it is routed (issue 44).
//!
//! - **Storm control**: each guest may send `SET storm-pps` such frames a
//!   second (a burst of as many); the rest are dropped and counted
//!   (`drop_storm`), so one guest's storm costs the others nothing.
//! - **Learning**: an ARP or neighbour advertisement in which a guest says
//!   it holds an address binds that address to it (`NEIGH LIST`'s
//!   `learned=`, `INTERFACE LIST`'s `ips=`; vnet-agent publishes them). A
//!   guest claiming an address another guest holds (bound by `NEIGH ADD`,
//!   or learned first from another local guest) is refused: the frame is
//!   dropped (`drop_spoofed`), so it poisons no other guest's ARP cache.
//! - **Answering**: an ARP request or neighbour solicitation for a bound
//!   address is answered here, to the asker alone, under
//!   `vnet_core::neigh`'s rule (the asker's rules must reach the holder's
//!   MAC), and goes nowhere else.
//!
//! All of it is on the cold side of one test (the destination MAC's group
//! bit): unicast frames never come here.

use crate::guest::{now_ns, Added};
use crate::stats::{DispatchCounters, DropReason};
use crate::topology::{Interface, Snapshot};
use std::net::IpAddr;
use std::sync::atomic::Ordering::Relaxed;
use vnet_core::neigh;
use vnet_core::Mac;

/// The MAC holding `ip`: bound by `NEIGH ADD`, else learned from a local
/// guest.
pub fn holder(snap: &Snapshot, ip: &IpAddr) -> Option<Mac> {
    snap.neighbours.get(ip).or_else(|| snap.ifaces.iter().find(|i| i.learned.holds(ip)).map(|i| i.mac))
}

/// What became of a guest's broadcast or multicast frame here.
pub enum Home {
    /// Nothing: route it as any frame.
    Route,
    /// Dropped (storm control, a spoofed claim): counted as this.
    Drop(DropReason),
    /// Answered: `reply` holds the frame for the asker.
    Answered,
}

/// The guest `iface`'s broadcast or multicast frame `head` (its headers:
/// an ARP or ND message lies whole in them); and whether it taught vnetd
/// an address of the guest's (the kernel fast path's answers follow).
pub fn meet(snap: &Snapshot, iface: &Interface, head: &[u8], counters: &DispatchCounters, reachable: impl FnOnce(Mac, Mac) -> bool, reply: &mut Vec<u8>) -> (Home, bool) {
    let pps = snap.dispatch.storm_pps;
    if pps > 0 && !iface.storm.take(pps, now_ns()) {
        return (Home::Drop(DropReason::Storm), false);
    }
    let mut learned = false;
    if let Some((mac, ip)) = neigh::claims(head) {
        if mac == iface.mac {
            match learn(snap, iface, ip, counters) {
                None => return (Home::Drop(DropReason::Spoofed), false),
                Some(new) => learned = new,
            }
        }
    }
    let Some(ask) = neigh::request(head) else { return (Home::Route, learned) };
    if ask.mac != iface.mac {
        return (Home::Route, learned);
    }
    match holder(snap, &ask.target) {
        Some(h) if h != ask.mac && reachable(ask.mac, h) => {
            neigh::answer(&ask, h, reply);
            counters.neigh_answered.fetch_add(1, Relaxed);
            (Home::Answered, learned)
        }
        _ => (Home::Route, learned),
    }
}

/// Binds `ip` to the guest `iface` if no other guest holds it: Some(true)
/// if that is new; None if another guest holds it (or the guest holds its
/// most already).
fn learn(snap: &Snapshot, iface: &Interface, ip: IpAddr, counters: &DispatchCounters) -> Option<bool> {
    if let Some(m) = snap.neighbours.get(&ip) {
        return (m == iface.mac).then_some(false);
    }
    if snap.ifaces.iter().any(|i| i.id != iface.id && i.learned.holds(&ip)) {
        return None;
    }
    match iface.learned.add(ip) {
        Added::Already => Some(false),
        Added::Full => None,
        Added::New => {
            counters.neigh_learned.fetch_add(1, Relaxed);
            tracing::info!(interface = %iface.name, %ip, "a guest's address learned");
            Some(true)
        }
    }
}
