//! Neighbours: which guest MAC holds an IP address, so that a guest's ARP
//! request or IPv6 neighbour solicitation for a known address is answered
//! on its own host and never crosses a link (ARP suppression, as EVPN and
//! flannel do it; Cilium answers in its eBPF program).
//!
//! The semantics, which every datapath obeys: a request from a guest at
//! port P with MAC S for address T is **answered** when T is bound to a MAC
//! M (`NEIGH ADD <ip> <mac>`, or learned from a local guest's own frames),
//! M is not S, and the rule table routes a unicast frame from P with source
//! S to M somewhere: the answer says only what the guest could learn by
//! asking, never a MAC of a network it cannot reach. Otherwise the request
//! is forwarded as any broadcast (flooded by the rules). A DAD probe (an
//! IPv6 solicitation from `::`) is never answered here.
//!
//! What a guest says of itself (`claims`): the sender of an ARP request or
//! reply (a gratuitous ARP too), the target of a neighbour advertisement,
//! the source of a neighbour solicitation (from a unicast address, with its
//! link-layer address); taken only when the frame's Ethernet source is the
//! claimed MAC.

use crate::mac::Mac;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// A binding: the MAC holding an address, and who manages it (`owner
/// <tag>`: vnet-agent's are `agent`).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Binding {
    pub mac: Mac,
    pub owner: Option<String>,
}

/// The bindings: each address to the MAC holding it. A persistent map: a
/// copy (a control request's working copy, a snapshot) shares it.
#[derive(Clone, Default, Debug, PartialEq, Eq)]
pub struct Neighbours {
    by_ip: imbl::HashMap<IpAddr, Binding>,
}

impl Neighbours {
    pub fn get(&self, ip: &IpAddr) -> Option<Mac> {
        self.by_ip.get(ip).map(|b| b.mac)
    }

    /// Binds `ip` to `mac` (managed by `owner`); the MAC it was bound to
    /// before, if another.
    pub fn insert(&mut self, ip: IpAddr, mac: Mac, owner: Option<String>) -> Option<Mac> {
        self.by_ip.insert(ip, Binding { mac, owner }).map(|b| b.mac).filter(|m| *m != mac)
    }

    pub fn remove(&mut self, ip: &IpAddr) -> Option<Mac> {
        self.by_ip.remove(ip).map(|b| b.mac)
    }

    pub fn len(&self) -> usize {
        self.by_ip.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_ip.is_empty()
    }

    /// The addresses bound to each of `macs` (one pass over the bindings),
    /// ordered: what a local guest holds by a binding (a CNI plugin's, from
    /// its IPAM), besides what it said of itself.
    pub fn bound_to(&self, macs: &[Mac]) -> Vec<(Mac, IpAddr)> {
        let mut v: Vec<(Mac, IpAddr)> = self.by_ip.iter().filter(|(_, b)| macs.contains(&b.mac)).map(|(i, b)| (b.mac, *i)).collect();
        v.sort();
        v
    }

    /// Removes the bindings to `mac` that have an owner (a manager that
    /// made them for the interface holding `mac`, gone now); how many.
    pub fn remove_owned_of(&mut self, mac: Mac) -> usize {
        let gone: Vec<IpAddr> = self.by_ip.iter().filter(|(_, b)| b.mac == mac && b.owner.is_some()).map(|(i, _)| *i).collect();
        for ip in &gone {
            self.by_ip.remove(ip);
        }
        gone.len()
    }

    /// Every binding, ordered by address.
    pub fn sorted(&self) -> Vec<(IpAddr, Binding)> {
        let mut v: Vec<(IpAddr, Binding)> = self.by_ip.iter().map(|(i, b)| (*i, b.clone())).collect();
        v.sort();
        v
    }
}

const ETH_ARP: [u8; 2] = [0x08, 0x06];
const ETH_IPV6: [u8; 2] = [0x86, 0xdd];
const ICMPV6: u8 = 58;
const NS: u8 = 135;
const NA: u8 = 136;
/// ND options: source and target link-layer address.
const OPT_SLLA: u8 = 1;
const OPT_TLLA: u8 = 2;

/// A request for an address's MAC, as a guest sent it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ask {
    /// Who asks: its MAC and address.
    pub mac: Mac,
    pub ip: IpAddr,
    /// The address asked for.
    pub target: IpAddr,
}

fn mac_at(b: &[u8], at: usize) -> Mac {
    let mut m = [0u8; 6];
    m.copy_from_slice(&b[at..at + 6]);
    Mac(m)
}

fn v4_at(b: &[u8], at: usize) -> Ipv4Addr {
    Ipv4Addr::new(b[at], b[at + 1], b[at + 2], b[at + 3])
}

fn v6_at(b: &[u8], at: usize) -> Ipv6Addr {
    let mut a = [0u8; 16];
    a.copy_from_slice(&b[at..at + 16]);
    Ipv6Addr::from(a)
}

/// An ARP packet for IPv4 over Ethernet at `b[14..]`: (op, sender MAC,
/// sender IP, target IP).
fn arp(b: &[u8]) -> Option<(u16, Mac, Ipv4Addr, Ipv4Addr)> {
    if b.len() < 42 || b[12..14] != ETH_ARP || b[14..20] != [0, 1, 8, 0, 6, 4] {
        return None;
    }
    Some((u16::from_be_bytes([b[20], b[21]]), mac_at(b, 22), v4_at(b, 28), v4_at(b, 38)))
}

/// An ICMPv6 neighbour message (solicitation or advertisement) at
/// `b[14..]`, whole and with a valid checksum, hop limit 255 (RFC 4861):
/// (type, IPv6 source, its target, its link-layer address option).
fn nd(b: &[u8]) -> Option<(u8, Ipv6Addr, Ipv6Addr, Option<Mac>)> {
    if b.len() < 14 + 40 + 24 || b[12..14] != ETH_IPV6 || b[14] >> 4 != 6 || b[20] != ICMPV6 || b[21] != 255 {
        return None;
    }
    let plen = u16::from_be_bytes([b[18], b[19]]) as usize;
    let icmp = b.get(54..54 + plen)?;
    if plen < 24 || !matches!(icmp[0], NS | NA) || icmp[1] != 0 {
        return None;
    }
    let (src, dst) = (v6_at(b, 22), v6_at(b, 38));
    if icmpv6_sum(&src, &dst, icmp) != 0 {
        return None;
    }
    let want = if icmp[0] == NS { OPT_SLLA } else { OPT_TLLA };
    let mut lla = None;
    let mut at = 24;
    while at + 2 <= icmp.len() {
        let len = icmp[at + 1] as usize * 8;
        if len == 0 || at + len > icmp.len() {
            return None;
        }
        if icmp[at] == want && len == 8 {
            lla = Some(mac_at(icmp, at + 2));
        }
        at += len;
    }
    Some((icmp[0], src, v6_at(icmp, 8), lla))
}

/// The ones' complement sum of ICMPv6 `msg` with its pseudo-header (0 when
/// its checksum is right; the checksum to write when its field is 0).
fn icmpv6_sum(src: &Ipv6Addr, dst: &Ipv6Addr, msg: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    let mut add = |b: &[u8]| {
        for c in b.chunks(2) {
            sum += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
        }
    };
    add(&src.octets());
    add(&dst.octets());
    add(&(msg.len() as u32).to_be_bytes());
    add(&[0, 0, 0, ICMPV6]);
    add(msg);
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// The request `frame` makes, if it is one this host may answer: an ARP
/// request, or a neighbour solicitation from a unicast address carrying its
/// source's link-layer address; the asker's MAC is the frame's source.
pub fn request(frame: &[u8]) -> Option<Ask> {
    if frame.len() < 14 || frame[0] & 1 == 0 {
        return None;
    }
    let src = mac_at(frame, 6);
    if let Some((op, sha, spa, tpa)) = arp(frame) {
        // A gratuitous ARP (sender = target) asks nothing.
        return (op == 1 && sha == src && spa != tpa).then_some(Ask { mac: src, ip: spa.into(), target: tpa.into() });
    }
    let (t, ip, target, lla) = nd(frame)?;
    (t == NS && !ip.is_unspecified() && lla == Some(src)).then_some(Ask { mac: src, ip: ip.into(), target: target.into() })
}

/// Writes into `out` the answer to `ask` from `holder` (the MAC bound to
/// its target): an ARP reply, or a solicited neighbour advertisement with
/// the target's link-layer address, to the asker.
pub fn answer(ask: &Ask, holder: Mac, out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(&ask.mac.0);
    out.extend_from_slice(&holder.0);
    match (ask.ip, ask.target) {
        (IpAddr::V4(ip), IpAddr::V4(target)) => {
            out.extend_from_slice(&ETH_ARP);
            out.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 2]);
            out.extend_from_slice(&holder.0);
            out.extend_from_slice(&target.octets());
            out.extend_from_slice(&ask.mac.0);
            out.extend_from_slice(&ip.octets());
            // Ethernet's minimum frame, as a NIC would pad it.
            out.resize(60, 0);
        }
        (IpAddr::V6(ip), IpAddr::V6(target)) => {
            out.extend_from_slice(&ETH_IPV6);
            let mut icmp = [0u8; 32];
            icmp[0] = NA;
            // Solicited, override.
            icmp[4] = 0x60;
            icmp[8..24].copy_from_slice(&target.octets());
            icmp[24] = OPT_TLLA;
            icmp[25] = 1;
            icmp[26..32].copy_from_slice(&holder.0);
            let sum = icmpv6_sum(&target, &ip, &icmp);
            icmp[2..4].copy_from_slice(&sum.to_be_bytes());
            out.extend_from_slice(&[0x60, 0, 0, 0, 0, 32, ICMPV6, 255]);
            out.extend_from_slice(&target.octets());
            out.extend_from_slice(&ip.octets());
            out.extend_from_slice(&icmp);
        }
        _ => out.clear(),
    }
}

/// The binding `frame` states of its own sender: (its MAC, an address it
/// holds), if the frame is an ARP request or reply whose sender is the
/// frame's source (a gratuitous ARP among them), a neighbour advertisement
/// of a unicast address by its own source with that source as its target
/// link-layer address, or a neighbour solicitation from a unicast address
/// with the frame's source as its source link-layer address.
pub fn claims(frame: &[u8]) -> Option<(Mac, IpAddr)> {
    if frame.len() < 14 {
        return None;
    }
    let src = mac_at(frame, 6);
    if let Some((op, sha, spa, _)) = arp(frame) {
        let usable = !spa.is_unspecified() && !spa.is_broadcast() && !spa.is_multicast();
        return (matches!(op, 1 | 2) && sha == src && usable).then_some((src, spa.into()));
    }
    // An advertisement says its target is its source's; a solicitation,
    // like an ARP request, says its source address is (RFC 4861 7.2.3: its
    // receivers take that binding from it).
    let (t, ip, target, lla) = nd(frame)?;
    let said = if t == NA { target } else { ip };
    let usable = !said.is_unspecified() && !said.is_multicast() && !said.is_loopback();
    (lla == Some(src) && usable).then_some((src, said.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const G1: Mac = Mac([2, 0, 0, 0, 0, 1]);
    const G2: Mac = Mac([2, 0, 0, 0, 0, 2]);

    fn arp_frame(dst: Mac, src: Mac, op: u16, sha: Mac, spa: [u8; 4], tpa: [u8; 4]) -> Vec<u8> {
        let mut f = Vec::new();
        f.extend_from_slice(&dst.0);
        f.extend_from_slice(&src.0);
        f.extend_from_slice(&ETH_ARP);
        f.extend_from_slice(&[0, 1, 8, 0, 6, 4]);
        f.extend_from_slice(&op.to_be_bytes());
        f.extend_from_slice(&sha.0);
        f.extend_from_slice(&spa);
        f.extend_from_slice(&[0; 6]);
        f.extend_from_slice(&tpa);
        f
    }

    /// A neighbour solicitation from `src` (MAC, address) for `target`, to
    /// the target's solicited-node group, with a source link-layer option.
    fn ns_frame(mac: Mac, ip: Ipv6Addr, target: Ipv6Addr, lla: Mac) -> Vec<u8> {
        let t = target.octets();
        let group = Ipv6Addr::from([0xff02, 0, 0, 0, 0, 1, 0xff00 | t[13] as u16, u16::from_be_bytes([t[14], t[15]])]);
        let mut icmp = vec![NS, 0, 0, 0, 0, 0, 0, 0];
        icmp.extend_from_slice(&t);
        icmp.extend_from_slice(&[OPT_SLLA, 1]);
        icmp.extend_from_slice(&lla.0);
        let sum = icmpv6_sum(&ip, &group, &icmp);
        icmp[2..4].copy_from_slice(&sum.to_be_bytes());
        let mut f = vec![0x33, 0x33, 0xff, t[13], t[14], t[15]];
        f.extend_from_slice(&mac.0);
        f.extend_from_slice(&ETH_IPV6);
        f.extend_from_slice(&[0x60, 0, 0, 0, 0, icmp.len() as u8, ICMPV6, 255]);
        f.extend_from_slice(&ip.octets());
        f.extend_from_slice(&group.octets());
        f.extend_from_slice(&icmp);
        f
    }

    #[test]
    fn an_arp_request_is_asked_and_answered_as_the_holder_would() {
        let f = arp_frame(Mac::BROADCAST, G1, 1, G1, [10, 0, 0, 1], [10, 0, 0, 2]);
        let ask = request(&f).unwrap();
        assert_eq!(ask, Ask { mac: G1, ip: "10.0.0.1".parse().unwrap(), target: "10.0.0.2".parse().unwrap() });
        let mut out = Vec::new();
        answer(&ask, G2, &mut out);
        assert_eq!(out.len(), 60);
        assert_eq!(&out[..6], &G1.0, "to the asker");
        assert_eq!(&out[6..12], &G2.0, "from the holder");
        let (op, sha, spa, tpa) = arp(&out).unwrap();
        assert_eq!((op, sha, spa, tpa), (2, G2, Ipv4Addr::new(10, 0, 0, 2), Ipv4Addr::new(10, 0, 0, 1)));
        assert_eq!(&out[32..38], &G1.0, "the target hardware address is the asker's");
        // The reply states the holder's binding.
        assert_eq!(claims(&out), Some((G2, "10.0.0.2".parse().unwrap())));
    }

    #[test]
    fn what_is_not_a_request_is_not_answered() {
        // A reply, a gratuitous ARP, a unicast request, a lying sender, a truncated frame.
        assert!(request(&arp_frame(Mac::BROADCAST, G1, 2, G1, [10, 0, 0, 1], [10, 0, 0, 2])).is_none());
        assert!(request(&arp_frame(Mac::BROADCAST, G1, 1, G1, [10, 0, 0, 1], [10, 0, 0, 1])).is_none());
        assert!(request(&arp_frame(G2, G1, 1, G1, [10, 0, 0, 1], [10, 0, 0, 2])).is_none());
        assert!(request(&arp_frame(Mac::BROADCAST, G1, 1, G2, [10, 0, 0, 1], [10, 0, 0, 2])).is_none());
        assert!(request(&arp_frame(Mac::BROADCAST, G1, 1, G1, [10, 0, 0, 1], [10, 0, 0, 2])[..40]).is_none());
        // IPv6: DAD (from ::), no or another link-layer option, a bad checksum.
        let (a, b) = ("fd00::1".parse().unwrap(), "fd00::2".parse().unwrap());
        assert!(request(&ns_frame(G1, Ipv6Addr::UNSPECIFIED, b, G1)).is_none());
        assert!(request(&ns_frame(G1, a, b, G2)).is_none());
        let mut f = ns_frame(G1, a, b, G1);
        let last = f.len() - 1;
        f[last] ^= 1;
        assert!(request(&f).is_none());
    }

    #[test]
    fn a_neighbour_solicitation_is_answered_with_a_valid_advertisement() {
        let (a, b): (Ipv6Addr, Ipv6Addr) = ("fd00::1".parse().unwrap(), "fd00::2".parse().unwrap());
        let ask = request(&ns_frame(G1, a, b, G1)).unwrap();
        assert_eq!(ask, Ask { mac: G1, ip: a.into(), target: b.into() });
        let mut out = Vec::new();
        answer(&ask, G2, &mut out);
        assert_eq!((&out[..6], &out[6..12]), (&G1.0[..], &G2.0[..]));
        // It parses as a whole, checksummed advertisement of b by G2.
        let (t, src, target, lla) = nd(&out).unwrap();
        assert_eq!((t, src, target, lla), (NA, b, b, Some(G2)));
        assert_eq!(out[54 + 4] & 0x40, 0x40, "solicited");
        assert_eq!(claims(&out), Some((G2, b.into())));
    }

    #[test]
    fn a_guest_claims_only_for_its_own_mac() {
        let garp = arp_frame(Mac::BROADCAST, G1, 1, G1, [10, 0, 0, 1], [10, 0, 0, 1]);
        assert_eq!(claims(&garp), Some((G1, "10.0.0.1".parse().unwrap())));
        assert_eq!(claims(&arp_frame(Mac::BROADCAST, G1, 1, G2, [10, 0, 0, 9], [10, 0, 0, 1])), None);
        // An ARP probe (sender 0.0.0.0) claims nothing.
        assert_eq!(claims(&arp_frame(Mac::BROADCAST, G1, 1, G1, [0, 0, 0, 0], [10, 0, 0, 1])), None);
        // A neighbour solicitation claims its source address, as an ARP
        // request does; not from :: (DAD), nor with another's link-layer
        // address, nor from another MAC's frame.
        let (a, b): (Ipv6Addr, Ipv6Addr) = ("fd00::1".parse().unwrap(), "fd00::2".parse().unwrap());
        assert_eq!(claims(&ns_frame(G1, a, b, G1)), Some((G1, a.into())));
        assert_eq!(claims(&ns_frame(G1, Ipv6Addr::UNSPECIFIED, b, G1)), None);
        assert_eq!(claims(&ns_frame(G1, a, b, G2)), None);
    }

    #[test]
    fn bindings_are_shared_by_copies_and_say_what_they_replaced() {
        let mut n = Neighbours::default();
        assert_eq!(n.insert("10.0.0.2".parse().unwrap(), G2, None), None);
        let copy = n.clone();
        assert_eq!(n.insert("10.0.0.2".parse().unwrap(), G1, Some("agent".into())), Some(G2));
        assert_eq!(copy.get(&"10.0.0.2".parse().unwrap()), Some(G2));
        assert_eq!(n.sorted(), vec![("10.0.0.2".parse().unwrap(), Binding { mac: G1, owner: Some("agent".into()) })]);
    }
}
