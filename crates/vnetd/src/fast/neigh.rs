//! ARP answered in the kernel for guests on the fast path (veth, QEMU
//! TAPs): what `from_guest` may answer each port's guest, by vnet-core's
//! rule (`vnet_core::neigh`), the same as `dispatch::home` answers in
//! vnetd. For each such port whose guest vnetd has heard say an address of
//! its own: that address (bound to the guest's MAC: the programs answer
//! only a guest whose own address they know, so a guest's first ARP comes
//! to vnetd, which learns it), and every IPv4 binding whose MAC its rules
//! reach; IPv6 neighbour solicitations likewise, for a guest whose own IPv6
//! address vnetd has heard (`neigh6`).

use super::FastPath;
use crate::topology::Snapshot;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use vnet_core::table::Port;
use vnet_core::Mac;

impl FastPath {
    /// Makes the kernel's `neigh` map what `snap`, the snapshot just
    /// published (the control plane's commit, vnetd's start), and what the
    /// guests said so far let it answer; none while the fast path is off.
    pub fn sync_neigh(&self, snap: Arc<Snapshot>) {
        let mut latest = self.neigh_at.lock().unwrap_or_else(|p| p.into_inner());
        self.write_neigh(&snap);
        *latest = Arc::downgrade(&snap);
    }

    /// A guest said an address of its own (a dispatcher learned it): the
    /// map again, by the newest snapshot the control plane published (the
    /// dispatcher's own may be older than one already synced). Held weakly
    /// (a snapshot held here would keep its interfaces, and their sockets
    /// and TAPs, past their end): if it is gone, a newer one was published,
    /// and the control plane's sync of it, right after, sees this guest's
    /// address too.
    pub fn resync_neigh(&self) {
        let latest = self.neigh_at.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(snap) = latest.upgrade() {
            self.write_neigh(&snap);
        }
    }

    fn write_neigh(&self, snap: &Snapshot) {
        let want = if snap.fast_on { wanted(snap) } else { HashMap::new() };
        let changed = self.kernel.set_neigh(&want);
        if changed > 0 {
            tracing::debug!("fast path: {changed} ARP answer(s) changed, {} in all", want.len());
        }
    }
}

/// (port's interface id, address) → the MAC to answer with.
fn wanted(snap: &Snapshot) -> HashMap<(u32, IpAddr), [u8; 6]> {
    // Every binding: given, then learned where nothing is given.
    let mut bindings: HashMap<IpAddr, Mac> = HashMap::new();
    for i in snap.ifaces.iter() {
        for ip in i.learned.list() {
            bindings.insert(ip, i.mac);
        }
    }
    for (ip, b) in snap.neighbours.sorted() {
        bindings.insert(ip, b.mac);
    }
    let mut out = HashMap::new();
    let mut hits = Vec::new();
    for i in snap.ifaces.iter().filter(|i| i.nic.fast_target().is_some()) {
        // A family is answered for a guest whose own address in it is known.
        let own: Vec<IpAddr> = i.learned.list().into_iter().filter(|a| bindings.get(a) == Some(&i.mac)).collect();
        let (v4, v6) = (own.iter().any(IpAddr::is_ipv4), own.iter().any(IpAddr::is_ipv6));
        if own.is_empty() {
            continue;
        }
        for a in own {
            out.insert((i.id, a), i.mac.0);
        }
        for (a, mac) in &bindings {
            if *mac == i.mac || !(if a.is_ipv4() { v4 } else { v6 }) {
                continue;
            }
            hits.clear();
            snap.table.lookup(Port::Interface(i.id), i.mac, *mac, &mut hits);
            if !hits.is_empty() {
                out.insert((i.id, *a), mac.0);
            }
        }
    }
    out
}
