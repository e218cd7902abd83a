//! The `neigh` map: the IPv4 addresses each guest port's ARP requests are
//! answered for by `from_guest`, and the MAC each is answered with. vnetd
//! decides what goes in (crates/vnetd/src/fast/neigh.rs, by vnet-core's
//! rule); the programs only look up.

use crate::{bytes_of, from_bytes, Kernel};
use libbpf_rs::{MapCore, MapFlags};
use std::collections::HashMap;
use std::net::Ipv4Addr;

#[repr(C)]
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash, Debug)]
struct NeighKey {
    origin: u32,
    /// Network order.
    addr: [u8; 4],
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct NeighVal {
    mac: [u8; 6],
    _pad: u16,
}

impl Kernel {
    /// What the map holds: (port's interface id, address) → MAC.
    pub fn neigh_entries(&self) -> HashMap<(u32, Ipv4Addr), [u8; 6]> {
        let keys: Vec<Vec<u8>> = self.neigh.keys().collect();
        keys.iter()
            .filter_map(|k| {
                let key = from_bytes::<NeighKey>(k);
                let v = self.neigh.lookup(k, MapFlags::ANY).ok().flatten()?;
                Some(((key.origin, Ipv4Addr::from(key.addr)), from_bytes::<NeighVal>(&v).mac))
            })
            .collect()
    }

    /// Makes the map hold `want` exactly; the entries changed.
    pub fn set_neigh(&self, want: &HashMap<(u32, Ipv4Addr), [u8; 6]>) -> usize {
        let have = self.neigh_entries();
        let mut changed = 0;
        for (origin, addr) in have.keys().filter(|k| !want.contains_key(k)) {
            let _ = self.neigh.delete(bytes_of(&NeighKey { origin: *origin, addr: addr.octets() }));
            changed += 1;
        }
        for ((origin, addr), mac) in want {
            if have.get(&(*origin, *addr)) != Some(mac) {
                let key = NeighKey { origin: *origin, addr: addr.octets() };
                let val = NeighVal { mac: *mac, _pad: 0 };
                if self.neigh.update(bytes_of(&key), bytes_of(&val), MapFlags::ANY).is_ok() {
                    changed += 1;
                }
            }
        }
        changed
    }
}
