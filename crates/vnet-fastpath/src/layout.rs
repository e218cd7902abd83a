//! The maps' layout, mirrored from `bpf/fastpath.bpf.c` (`#[repr(C)]`, the
//! same fields in the same order): what vnetd writes into the maps and reads
//! back. A change here that changes a map's meaning bumps `pin::LAYOUT`.

use std::net::Ipv4Addr;

/// Set in a port number that names a link (clear: an interface).
pub const LINK_BIT: u32 = 0x8000_0000;

/// A route-cache key, as VNET/P's cache is keyed: origin port, destination
/// and source MAC.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FlowKey {
    pub origin: u32,
    pub dst: [u8; 6],
    pub src: [u8; 6],
}

/// What the fast path does with a frame that hits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Into a veth guest (`ifindex`: the host end).
    Peer { ifindex: u32 },
    /// Out of a device (a QEMU TAP: QEMU reads it).
    Device { ifindex: u32 },
    /// Encapsulated for link `link`.
    Encap { link: u32 },
}

/// An entry: the action, and the port and route the frame is counted on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Flow {
    pub action: Action,
    /// Destination port (`LINK_BIT` set for a link).
    pub dest: u32,
    pub route: u32,
    /// Longest frame (unsegmented) the destination takes; 0: any. Longer
    /// ones go to vnetd, which drops and counts them.
    pub max_len: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct RawAction {
    pub(crate) kind: u32,
    pub(crate) ifindex: u32,
    pub(crate) link: u32,
    pub(crate) dest: u32,
    pub(crate) route: u32,
    pub(crate) max_len: u32,
}

impl From<Flow> for RawAction {
    fn from(f: Flow) -> RawAction {
        let (kind, ifindex, link) = match f.action {
            Action::Peer { ifindex } => (1, ifindex, 0),
            Action::Device { ifindex } => (2, ifindex, 0),
            Action::Encap { link } => (3, 0, link),
        };
        RawAction { kind, ifindex, link, dest: f.dest, route: f.route, max_len: f.max_len }
    }
}

impl RawAction {
    pub(crate) fn flow(&self) -> Option<Flow> {
        let action = match self.kind {
            1 => Action::Peer { ifindex: self.ifindex },
            2 => Action::Device { ifindex: self.ifindex },
            3 => Action::Encap { link: self.link },
            _ => return None,
        };
        Some(Flow { action, dest: self.dest, route: self.route, max_len: self.max_len })
    }
}

/// How a link's frames leave: the outer IPv4/UDP header and where it goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkPath {
    /// This host's address the link's datagrams leave from; `from_network`
    /// takes the peer's datagrams only when sent to it.
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub sport: u16,
    pub dport: u16,
    /// Largest outer IPv4 packet (the link's MTU).
    pub mtu: u32,
    /// The underlay device toward the peer.
    pub ifindex: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct RawLink {
    pub(crate) hdr: [u8; 28],
    pub(crate) ip_sum: u32,
    pub(crate) mtu: u32,
    pub(crate) ifindex: u32,
    pub(crate) saddr: u32,
    pub(crate) daddr: u32,
}

impl RawLink {
    pub(crate) fn new(p: &LinkPath) -> RawLink {
        let mut hdr = [0u8; 28];
        hdr[0] = 0x45;
        hdr[6] = 0x40; // DF, as vnetd's UDP socket sends (path MTU discovery)
        hdr[8] = 64; // TTL
        hdr[9] = 17; // UDP
        hdr[12..16].copy_from_slice(&p.src.octets());
        hdr[16..20].copy_from_slice(&p.dst.octets());
        hdr[20..22].copy_from_slice(&p.sport.to_be_bytes());
        hdr[22..24].copy_from_slice(&p.dport.to_be_bytes());
        // Sum of the IPv4 header's 16-bit words as they are (length and
        // checksum zero): the program adds the length and folds. The
        // program adds words in memory order, so sum them that way too.
        let mut sum: u32 = 0;
        for w in hdr[..20].chunks(2) {
            sum += u16::from_ne_bytes([w[0], w[1]]) as u32;
        }
        let sum = (sum & 0xffff) + (sum >> 16);
        RawLink {
            hdr,
            ip_sum: sum,
            mtu: p.mtu,
            ifindex: p.ifindex,
            saddr: u32::from_ne_bytes(p.src.octets()),
            daddr: u32::from_ne_bytes(p.dst.octets()),
        }
    }
}

/// A link's next hop (`next_hops`' value): with it the programs write the
/// outer Ethernet header themselves instead of asking the kernel to route
/// and resolve each datagram. Taken only while `ifindex` and `daddr` are
/// still the link's.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NextHop {
    /// The next hop's MAC.
    pub dst: [u8; 6],
    /// The underlay device's MAC.
    pub src: [u8; 6],
    /// The device it was resolved on.
    pub ifindex: u32,
    /// The link's peer it was resolved for (network order, as `links`).
    pub daddr: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct AddrKey {
    pub(crate) addr: u32,
    pub(crate) port: u16,
    pub(crate) _pad: u16,
}

/// `link_addrs`' value: the link, and the address this host sends its
/// datagrams from (the one the peer's must be sent to).
#[repr(C)]
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct LinkAddr {
    pub(crate) link: u32,
    pub(crate) local: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct PortInfo {
    pub(crate) origin: u32,
    pub(crate) ifindex: u32,
    pub(crate) peer: u32,
    pub(crate) _pad: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct Config {
    pub(crate) enabled: u32,
    pub(crate) port: u16,
    pub(crate) finish_mac: [u8; 6],
    pub(crate) finish_ifindex: u32,
    pub(crate) finish_recv: u32,
}

/// Counter kinds in the `counters` map.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum CounterKind {
    IfaceIn = 1,
    IfaceOut = 2,
    LinkIn = 3,
    LinkOut = 4,
    Route = 5,
    /// A link's frames sent with the kernel resolving the next hop.
    LinkResolved = 6,
    /// A port's ARP requests answered by the programs (`neigh`).
    Neigh = 7,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct CounterKey {
    pub(crate) kind: u32,
    pub(crate) id: u32,
}

/// What the programs did with frames, summed over CPUs (the `stats` map;
/// the order is the program's `enum stat`).
pub const STAT_NAMES: [&str; 16] = [
    "hit_guest",
    "hit_net",
    "miss_guest",
    "miss_net",
    "from_vnetd",
    "slow_big",
    "slow_not_ip",
    "slow_route",
    "slow_gso",
    "drop_encap",
    "drop_decap",
    "drop_no_port",
    "disabled",
    "finish",
    "not_for_us",
    "slow_csum",
];

pub(crate) fn bytes_of<T: Copy>(v: &T) -> &[u8] {
    // SAFETY: T is a plain #[repr(C)] value type with no padding we read back.
    unsafe { std::slice::from_raw_parts(v as *const T as *const u8, std::mem::size_of::<T>()) }
}

pub(crate) fn from_bytes<T: Copy + Default>(b: &[u8]) -> T {
    let mut v = T::default();
    let n = std::mem::size_of::<T>().min(b.len());
    // SAFETY: as above; every bit pattern is a valid T (integers only).
    unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), &mut v as *mut T as *mut u8, n) };
    v
}

/// `meta`'s value: the layout, the namespace, the next ids.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct Meta {
    pub(crate) magic: u32,
    pub(crate) layout: u32,
    pub(crate) netns: u64,
    pub(crate) next: [u32; 3],
    pub(crate) _pad: u32,
}

/// `ids`' key: an object's kind and a hash of its name.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct IdKey {
    pub(crate) kind: u32,
    pub(crate) _pad: u32,
    pub(crate) hash: u64,
}

pub(crate) fn from_bytes_key(b: &[u8]) -> FlowKey {
    let mut k = FlowKey { origin: 0, dst: [0; 6], src: [0; 6] };
    if b.len() >= 16 {
        k.origin = u32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
        k.dst.copy_from_slice(&b[4..10]);
        k.src.copy_from_slice(&b[10..16]);
    }
    k
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outer_header_checksum_is_right_once_the_length_is_added() {
        let p = LinkPath { src: "10.0.0.1".parse().unwrap(), dst: "10.0.0.2".parse().unwrap(), sport: 5000, dport: 5000, mtu: 1500, ifindex: 1 };
        let r = RawLink::new(&p);
        let tot: u16 = 1400;
        let mut hdr = r.hdr;
        hdr[2..4].copy_from_slice(&tot.to_be_bytes());
        // As the program computes it: sum + length in memory order, folded.
        let mut s = r.ip_sum + u16::from_ne_bytes(tot.to_be_bytes()) as u32;
        s = (s & 0xffff) + (s >> 16);
        s = (s & 0xffff) + (s >> 16);
        let check = !(s as u16);
        hdr[10..12].copy_from_slice(&check.to_ne_bytes());
        // A correct header sums to 0xffff.
        let mut v: u32 = hdr[..20].chunks(2).map(|w| u16::from_be_bytes([w[0], w[1]]) as u32).sum();
        v = (v & 0xffff) + (v >> 16);
        v = (v & 0xffff) + (v >> 16);
        assert_eq!(v, 0xffff);
    }
}
