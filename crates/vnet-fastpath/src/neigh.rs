//! The `neigh` and `neigh6` maps: the IPv4 and IPv6 addresses each guest
//! port's ARP requests and neighbour solicitations are answered for by
//! `from_guest`, and the MAC each is answered with. vnetd decides what goes
//! in (crates/vnetd/src/fast/neigh.rs, by vnet-core's rule); the programs
//! only look up.

use crate::{bytes_of, from_bytes, Kernel};
use libbpf_rs::{MapCore, MapFlags, MapHandle};
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

#[repr(C)]
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash, Debug)]
struct NeighKey {
    origin: u32,
    /// Network order.
    addr: [u8; 4],
}

#[repr(C)]
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash, Debug)]
struct Neigh6Key {
    origin: u32,
    addr: [u8; 16],
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct NeighVal {
    mac: [u8; 6],
    _pad: u16,
}

/// (port's interface id, address) → the MAC it is answered with.
pub type NeighMap = HashMap<(u32, IpAddr), [u8; 6]>;

fn key_bytes(origin: u32, addr: &IpAddr) -> Vec<u8> {
    match addr {
        IpAddr::V4(a) => bytes_of(&NeighKey { origin, addr: a.octets() }).to_vec(),
        IpAddr::V6(a) => bytes_of(&Neigh6Key { origin, addr: a.octets() }).to_vec(),
    }
}

fn entries(map: &MapHandle, v6: bool, out: &mut NeighMap) {
    let keys: Vec<Vec<u8>> = map.keys().collect();
    for k in &keys {
        let Some(v) = map.lookup(k, MapFlags::ANY).ok().flatten() else { continue };
        let (origin, addr) = if v6 {
            let key = from_bytes::<Neigh6Key>(k);
            (key.origin, IpAddr::V6(Ipv6Addr::from(key.addr)))
        } else {
            let key = from_bytes::<NeighKey>(k);
            (key.origin, IpAddr::V4(Ipv4Addr::from(key.addr)))
        };
        out.insert((origin, addr), from_bytes::<NeighVal>(&v).mac);
    }
}

impl Kernel {
    fn neigh_map(&self, addr: &IpAddr) -> &MapHandle {
        match addr {
            IpAddr::V4(_) => &self.neigh,
            IpAddr::V6(_) => &self.neigh6,
        }
    }

    /// What the maps hold: (port's interface id, address) → MAC.
    pub fn neigh_entries(&self) -> NeighMap {
        let mut out = HashMap::new();
        entries(&self.neigh, false, &mut out);
        entries(&self.neigh6, true, &mut out);
        out
    }

    /// Makes the maps hold `want` exactly; the entries changed.
    pub fn set_neigh(&self, want: &NeighMap) -> usize {
        let have = self.neigh_entries();
        let mut changed = 0;
        for (origin, addr) in have.keys().filter(|k| !want.contains_key(k)) {
            let _ = self.neigh_map(addr).delete(&key_bytes(*origin, addr));
            changed += 1;
        }
        for ((origin, addr), mac) in want {
            if have.get(&(*origin, *addr)) != Some(mac) {
                let val = NeighVal { mac: *mac, _pad: 0 };
                if self.neigh_map(addr).update(&key_bytes(*origin, addr), bytes_of(&val), MapFlags::ANY).is_ok() {
                    changed += 1;
                }
            }
        }
        changed
    }
}
