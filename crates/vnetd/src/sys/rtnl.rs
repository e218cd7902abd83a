//! rtnetlink requests on network devices, through the maintained
//! netlink-packet-route crates: look a device up (is it a TAP or a veth?
//! does it carry vnetd's mark?), mark a device as vnetd's, set its
//! `gso_max_size`, bring it up, make a veth pair, delete it; and ask the
//! kernel which device and source address reach an address. `Rtnl` keeps
//! one socket for the questions VTOE asks inside a guest's namespace (its
//! route to an address, its neighbour entry, resolving one).
//!
//! vnetd's mark is the device's ifalias (IFLA_IFALIAS) set to [`MARK`]. It
//! moves with the device across network namespaces and shows in `ip link`
//! ("alias vnetd"). Every request opens its own netlink socket, so it acts
//! in the network namespace of the calling thread (unlike /sys, which
//! follows the mount namespace).

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, Nla, NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST,
};
use netlink_packet_route::link::{
    InfoData, InfoKind, InfoVeth, LinkAttribute, LinkExtentMask, LinkFlags, LinkInfo, LinkLayerType, LinkMessage,
};
use netlink_packet_route::neighbour::{NeighbourAddress, NeighbourAttribute, NeighbourFlags, NeighbourMessage, NeighbourState};
use netlink_packet_route::route::{RouteAddress, RouteAttribute, RouteMessage, RouteType};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::RawFd;

/// The ifalias of every persistent TAP vnetd makes: only devices carrying it
/// are taken over, un-persisted or deleted.
pub const MARK: &str = "vnetd";

/// IFLA_TUN_TYPE inside a tun device's IFLA_INFO_DATA: IFF_TUN or IFF_TAP.
const IFLA_TUN_TYPE: u16 = 3;
const IFF_TUN: u8 = 0x0001;
const IFF_TAP: u8 = 0x0002;

/// What kind of device a name is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Tap,
    Tun,
    Veth,
    /// Anything else (bridge, dummy, ...).
    Other,
}

/// A network device as rtnetlink reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    pub index: u32,
    pub name: String,
    pub kind: Kind,
    pub alias: Option<String>,
    /// A veth's peer (its index in the peer's namespace).
    pub peer: Option<u32>,
}

impl Device {
    /// A TAP carrying vnetd's mark: one vnetd made.
    pub fn is_vnetds(&self) -> bool {
        self.kind == Kind::Tap && self.alias.as_deref() == Some(MARK)
    }

    /// A veth carrying vnetd's mark: a host end vnetd made.
    pub fn is_vnetds_veth(&self) -> bool {
        self.kind == Kind::Veth && self.alias.as_deref() == Some(MARK)
    }
}

/// The device named `name` in this thread's network namespace, if any.
pub fn device(name: &str) -> io::Result<Option<Device>> {
    get(get_link(Some(name), 0))
}

/// The device with this index in this thread's network namespace, if any.
pub fn device_by_index(index: u32) -> io::Result<Option<Device>> {
    get(get_link(None, index))
}

/// RTM_GETLINK of one device, by name or by index.
fn get_link(name: Option<&str>, index: u32) -> RouteNetlinkMessage {
    let mut msg = LinkMessage::default();
    msg.header.index = index;
    if let Some(n) = name {
        msg.attributes.push(LinkAttribute::IfName(n.to_string()));
    }
    // Counters are of no use here.
    msg.attributes.push(LinkAttribute::ExtMask(vec![LinkExtentMask::SkipStats]));
    RouteNetlinkMessage::GetLink(msg)
}

fn get(req: RouteNetlinkMessage) -> io::Result<Option<Device>> {
    match transact(req) {
        Ok(replies) => Ok(replies.first().map(describe)),
        Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Marks the device as vnetd's (its ifalias becomes [`MARK`]).
pub fn set_mark(index: u32) -> io::Result<()> {
    transact(set_link(index, LinkAttribute::IfAlias(MARK.to_string()))).map(drop)
}

/// Sets a device's `gso_max_size` (IFLA_GSO_MAX_SIZE).
pub fn set_gso_max_size(index: u32, size: u32) -> io::Result<()> {
    transact(set_link(index, LinkAttribute::GsoMaxSize(size))).map(drop)
}

/// Deletes a device (RTM_DELLINK), even one another program holds open.
pub fn delete(index: u32) -> io::Result<()> {
    let mut msg = LinkMessage::default();
    msg.header.index = index;
    transact(RouteNetlinkMessage::DelLink(msg)).map(drop)
}

/// Frames a device dropped on transmit (its queue full): for an upcall
/// TAP, frames the fast path handed to vnetd that vnetd could not take.
pub fn tx_dropped(index: u32) -> io::Result<u64> {
    let mut msg = LinkMessage::default();
    msg.header.index = index;
    for m in transact(RouteNetlinkMessage::GetLink(msg))? {
        for a in m.attributes {
            if let LinkAttribute::Stats64(s) = a {
                return Ok(s.tx_dropped);
            }
        }
    }
    Err(io::Error::other("no statistics for the device"))
}

/// Brings a device up.
pub fn set_up(index: u32) -> io::Result<()> {
    let mut msg = LinkMessage::default();
    msg.header.index = index;
    msg.header.flags = LinkFlags::Up;
    msg.header.change_mask = LinkFlags::Up;
    transact(RouteNetlinkMessage::SetLink(msg)).map(drop)
}

/// Makes a veth pair in one request: `host` here, marked as vnetd's, and
/// `guest` in the network namespace `netns` (an open namespace file), with
/// the guest's MAC, both marked and with MTU `mtu`. Fails if either name
/// is taken.
pub fn create_veth(host: &str, guest: &str, netns: RawFd, mac: [u8; 6], mtu: u32) -> io::Result<()> {
    let mut peer = LinkMessage::default();
    peer.attributes.push(LinkAttribute::IfName(guest.to_string()));
    peer.attributes.push(LinkAttribute::NetNsFd(netns));
    peer.attributes.push(LinkAttribute::Address(mac.to_vec()));
    peer.attributes.push(LinkAttribute::Mtu(mtu));
    peer.attributes.push(LinkAttribute::IfAlias(MARK.to_string()));
    let mut msg = LinkMessage::default();
    msg.attributes.push(LinkAttribute::IfName(host.to_string()));
    msg.attributes.push(LinkAttribute::Mtu(mtu));
    msg.attributes.push(LinkAttribute::LinkInfo(vec![
        LinkInfo::Kind(InfoKind::Veth),
        LinkInfo::Data(InfoData::Veth(InfoVeth::Peer(peer))),
    ]));
    let req = encode_flags(RouteNetlinkMessage::NewLink(msg), 1, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL);
    transact_bytes(&req).map(drop)?;
    // IFLA_IFALIAS is not taken at creation: set it now.
    let d = device(host)?.ok_or_else(|| io::Error::other(format!("veth {host} vanished as it was made")))?;
    set_mark(d.index)
}

/// The device and the source address the kernel would use toward `dst`
/// (RTM_GETROUTE, as `ip route get` asks).
pub fn route_to(dst: Ipv4Addr) -> io::Result<(u32, Ipv4Addr)> {
    let mut msg = RouteMessage::default();
    msg.header.address_family = AddressFamily::Inet;
    msg.header.destination_prefix_length = 32;
    msg.attributes.push(RouteAttribute::Destination(RouteAddress::Inet(dst)));
    let req = encode(RouteNetlinkMessage::GetRoute(msg), 1);
    let (mut oif, mut src) = (None, None);
    for m in transact_bytes(&req)? {
        if let RouteNetlinkMessage::NewRoute(r) = m {
            for a in r.attributes {
                match a {
                    RouteAttribute::Oif(i) => oif = Some(i),
                    RouteAttribute::PrefSource(RouteAddress::Inet(a)) => src = Some(a),
                    _ => {}
                }
            }
        }
    }
    match (oif, src) {
        (Some(o), Some(s)) => Ok((o, s)),
        _ => Err(io::Error::other(format!("the kernel gave no device and source address toward {dst}"))),
    }
}

/// The kernel's route toward an address, as a guest's VTOE needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouteTo {
    /// Unicast, or Local (the address is the namespace's own), ...
    pub kind: RouteType,
    pub oif: Option<u32>,
    pub gateway: Option<Ipv4Addr>,
    pub src: Option<Ipv4Addr>,
}

/// A neighbour entry: its state and MAC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Neighbour {
    pub state: NeighbourState,
    pub mac: Option<[u8; 6]>,
}

impl Neighbour {
    /// A MAC the kernel would send to now (the entry is usable).
    pub fn usable(&self) -> Option<[u8; 6]> {
        match self.state {
            NeighbourState::Reachable
            | NeighbourState::Stale
            | NeighbourState::Delay
            | NeighbourState::Probe
            | NeighbourState::Permanent
            | NeighbourState::Noarp => self.mac,
            _ => None,
        }
    }
}

/// One rtnetlink socket, in the network namespace of the thread that opened
/// it, for requests made from any thread (one at a time).
pub struct Rtnl {
    socket: std::sync::Mutex<(Socket, u32)>,
}

impl Rtnl {
    pub fn open() -> io::Result<Rtnl> {
        let socket = Socket::new(NETLINK_ROUTE)?;
        socket.connect(&SocketAddr::new(0, 0))?;
        Ok(Rtnl { socket: std::sync::Mutex::new((socket, 0)) })
    }

    fn transact(&self, msg: RouteNetlinkMessage, flags: u16) -> io::Result<Vec<RouteNetlinkMessage>> {
        let mut g = self.socket.lock().unwrap_or_else(|p| p.into_inner());
        g.1 = g.1.wrapping_add(1);
        let seq = g.1;
        transact_on(&g.0, &encode_flags(msg, seq, flags), seq)
    }

    /// RTM_GETROUTE toward `dst` (as `ip route get` asks).
    pub fn route_get(&self, dst: Ipv4Addr) -> io::Result<RouteTo> {
        let mut msg = RouteMessage::default();
        msg.header.address_family = AddressFamily::Inet;
        msg.header.destination_prefix_length = 32;
        msg.attributes.push(RouteAttribute::Destination(RouteAddress::Inet(dst)));
        for m in self.transact(RouteNetlinkMessage::GetRoute(msg), NLM_F_REQUEST)? {
            if let RouteNetlinkMessage::NewRoute(r) = m {
                let mut to = RouteTo { kind: r.header.kind, oif: None, gateway: None, src: None };
                for a in r.attributes {
                    match a {
                        RouteAttribute::Oif(i) => to.oif = Some(i),
                        RouteAttribute::Gateway(RouteAddress::Inet(g)) => to.gateway = Some(g),
                        RouteAttribute::PrefSource(RouteAddress::Inet(a)) => to.src = Some(a),
                        _ => {}
                    }
                }
                return Ok(to);
            }
        }
        Err(io::Error::other(format!("the kernel gave no route toward {dst}")))
    }

    /// The neighbour entry for `ip` on device `ifindex`, if there is one.
    pub fn neighbour(&self, ifindex: u32, ip: Ipv4Addr) -> io::Result<Option<Neighbour>> {
        let mut msg = NeighbourMessage::default();
        msg.header.family = AddressFamily::Inet;
        msg.header.ifindex = ifindex;
        msg.attributes.push(NeighbourAttribute::Destination(NeighbourAddress::Inet(ip)));
        let replies = match self.transact(RouteNetlinkMessage::GetNeighbour(msg), NLM_F_REQUEST) {
            Ok(r) => r,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(None),
            Err(e) => return Err(e),
        };
        for m in replies {
            if let RouteNetlinkMessage::NewNeighbour(n) = m {
                let mac = n.attributes.iter().find_map(|a| match a {
                    NeighbourAttribute::LinkLayerAddress(b) if b.len() == 6 => Some(<[u8; 6]>::try_from(&b[..]).expect("6")),
                    _ => None,
                });
                return Ok(Some(Neighbour { state: n.header.state, mac }));
            }
        }
        Ok(None)
    }

    /// Every IPv4 neighbour entry (RTM_GETNEIGH, dumped): device, address,
    /// entry.
    pub fn neighbours(&self) -> io::Result<Vec<(u32, Ipv4Addr, Neighbour)>> {
        let mut msg = NeighbourMessage::default();
        msg.header.family = AddressFamily::Inet;
        let replies = self.transact(RouteNetlinkMessage::GetNeighbour(msg), NLM_F_REQUEST | libc::NLM_F_DUMP as u16)?;
        Ok(replies
            .into_iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewNeighbour(n) => {
                    let (mut ip, mut mac) = (None, None);
                    for a in &n.attributes {
                        match a {
                            NeighbourAttribute::Destination(NeighbourAddress::Inet(a)) => ip = Some(*a),
                            NeighbourAttribute::LinkLayerAddress(b) if b.len() == 6 => {
                                mac = Some(<[u8; 6]>::try_from(&b[..]).expect("6"))
                            }
                            _ => {}
                        }
                    }
                    Some((n.header.ifindex, ip?, Neighbour { state: n.header.state, mac }))
                }
                _ => None,
            })
            .collect())
    }

    /// Device `index`'s MAC (IFLA_ADDRESS), if it has one.
    pub fn mac_of(&self, index: u32) -> io::Result<Option<[u8; 6]>> {
        let replies = self.transact(get_link(None, index), NLM_F_REQUEST | NLM_F_ACK)?;
        Ok(replies.into_iter().find_map(|m| match m {
            RouteNetlinkMessage::NewLink(l) => l.attributes.into_iter().find_map(|a| match a {
                LinkAttribute::Address(b) if b.len() == 6 => Some(<[u8; 6]>::try_from(&b[..]).expect("6")),
                _ => None,
            }),
            _ => None,
        }))
    }

    /// Asks the kernel to resolve `ip` on `ifindex` now (NTF_USE: an ARP
    /// request goes out as if a packet waited for it).
    pub fn resolve(&self, ifindex: u32, ip: Ipv4Addr) -> io::Result<()> {
        let mut msg = NeighbourMessage::default();
        msg.header.family = AddressFamily::Inet;
        msg.header.ifindex = ifindex;
        msg.header.flags = NeighbourFlags::Use;
        msg.attributes.push(NeighbourAttribute::Destination(NeighbourAddress::Inet(ip)));
        self.transact(RouteNetlinkMessage::NewNeighbour(msg), NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE).map(|_| ())
    }

    /// The IPv4 addresses of device `ifindex` (RTM_GETADDR, dumped).
    pub fn addresses(&self, ifindex: u32) -> io::Result<Vec<Ipv4Addr>> {
        use netlink_packet_route::address::{AddressAttribute, AddressMessage};
        let mut msg = AddressMessage::default();
        msg.header.family = AddressFamily::Inet;
        msg.header.index = ifindex;
        let replies = self.transact(RouteNetlinkMessage::GetAddress(msg), NLM_F_REQUEST | libc::NLM_F_DUMP as u16)?;
        Ok(replies
            .into_iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewAddress(a) if a.header.index == ifindex => {
                    // IFA_LOCAL is the device's own address (IFA_ADDRESS the
                    // peer's, on point-to-point devices).
                    let v4 = |want_local: bool| {
                        a.attributes.iter().find_map(|x| match x {
                            AddressAttribute::Local(std::net::IpAddr::V4(ip)) if want_local => Some(*ip),
                            AddressAttribute::Address(std::net::IpAddr::V4(ip)) if !want_local => Some(*ip),
                            _ => None,
                        })
                    };
                    v4(true).or_else(|| v4(false))
                }
                _ => None,
            })
            .collect())
    }

    /// The index of device `name`.
    pub fn index_of(&self, name: &str) -> io::Result<Option<u32>> {
        match self.transact(get_link(Some(name), 0), NLM_F_REQUEST | NLM_F_ACK) {
            Ok(replies) => Ok(replies.into_iter().find_map(|m| match m {
                RouteNetlinkMessage::NewLink(l) => Some(l.header.index),
                _ => None,
            })),
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// RTM_SETLINK of one attribute on the device with this index.
fn set_link(index: u32, attr: LinkAttribute) -> RouteNetlinkMessage {
    let mut msg = LinkMessage::default();
    msg.header.index = index;
    msg.attributes.push(attr);
    RouteNetlinkMessage::SetLink(msg)
}

/// The request as bytes: asking for an acknowledgement.
fn encode(msg: RouteNetlinkMessage, seq: u32) -> Vec<u8> {
    encode_flags(msg, seq, NLM_F_REQUEST | NLM_F_ACK)
}

fn encode_flags(msg: RouteNetlinkMessage, seq: u32, flags: u16) -> Vec<u8> {
    let mut packet = NetlinkMessage::new(NetlinkHeader::default(), NetlinkPayload::from(msg));
    packet.header.flags = flags;
    packet.header.sequence_number = seq;
    packet.finalize();
    let mut buf = vec![0; packet.buffer_len()];
    packet.serialize(&mut buf);
    buf
}

/// What a link message says about its device.
fn describe(msg: &LinkMessage) -> Device {
    let mut name = String::new();
    let mut alias = None;
    let mut is_tun = false;
    let mut is_veth = false;
    let mut peer = None;
    let mut tun_type = None;
    for a in &msg.attributes {
        match a {
            LinkAttribute::IfName(n) => name = n.clone(),
            LinkAttribute::Link(i) => peer = Some(*i),
            LinkAttribute::IfAlias(s) => alias = Some(s.clone()),
            LinkAttribute::LinkInfo(infos) => {
                for i in infos {
                    match i {
                        LinkInfo::Kind(InfoKind::Tun) => is_tun = true,
                        LinkInfo::Kind(InfoKind::Veth) => is_veth = true,
                        LinkInfo::Data(InfoData::Tun(data)) => {
                            for nla in data {
                                if nla.kind() == IFLA_TUN_TYPE && nla.value_len() == 1 {
                                    let mut v = [0u8; 1];
                                    nla.emit_value(&mut v);
                                    tun_type = Some(v[0]);
                                }
                            }
                        }
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    let kind = match (is_tun, tun_type) {
        (false, _) if is_veth => Kind::Veth,
        (false, _) => Kind::Other,
        (true, Some(IFF_TAP)) => Kind::Tap,
        (true, Some(IFF_TUN)) => Kind::Tun,
        // Kernels without IFLA_INFO_DATA for tun: a TAP is Ethernet, a TUN is not.
        (true, _) if msg.header.link_layer_type == LinkLayerType::Ether => Kind::Tap,
        (true, _) => Kind::Tun,
    };
    Device { index: msg.header.index, name, kind, alias, peer: if is_veth { peer } else { None } }
}

/// Sends one request on a fresh socket and collects the link messages that
/// answer it, until the kernel's acknowledgement (or its error).
fn transact(msg: RouteNetlinkMessage) -> io::Result<Vec<LinkMessage>> {
    Ok(transact_bytes(&encode(msg, 1))?
        .into_iter()
        .filter_map(|m| match m {
            RouteNetlinkMessage::NewLink(l) => Some(l),
            _ => None,
        })
        .collect())
}

/// Sends one encoded request (sequence number 1) on a fresh socket and
/// collects the messages that answer it.
fn transact_bytes(req: &[u8]) -> io::Result<Vec<RouteNetlinkMessage>> {
    let socket = Socket::new(NETLINK_ROUTE)?;
    socket.connect(&SocketAddr::new(0, 0))?;
    transact_on(&socket, req, 1)
}

/// Sends an encoded request with sequence number `seq` and collects the
/// messages that answer it: up to the acknowledgement, the end of a dump,
/// or the one reply of a request that asked for neither.
fn transact_on(socket: &Socket, req: &[u8], seq: u32) -> io::Result<Vec<RouteNetlinkMessage>> {
    let wants_ack = req.len() >= 8 && u16::from_ne_bytes([req[6], req[7]]) & (NLM_F_ACK | libc::NLM_F_DUMP as u16) != 0;
    socket.send(req, 0)?;
    let mut replies = Vec::new();
    loop {
        let (buf, _) = socket.recv_from_full()?;
        let mut at = 0;
        while at < buf.len() {
            let m = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&buf[at..])
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("rtnetlink reply: {e}")))?;
            let len = m.header.length as usize;
            if m.header.sequence_number == seq {
                match m.payload {
                    NetlinkPayload::Error(e) => {
                        return match e.code {
                            None => Ok(replies),
                            Some(_) => Err(e.to_io()),
                        };
                    }
                    NetlinkPayload::Done(_) => return Ok(replies),
                    NetlinkPayload::InnerMessage(m) => {
                        replies.push(m);
                        if !wants_ack {
                            return Ok(replies);
                        }
                    }
                    _ => {}
                }
            }
            if len == 0 {
                break;
            }
            at += len.next_multiple_of(4);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use netlink_packet_core::DefaultNla;

    fn tun_link(tun_type: Option<u8>, layer: LinkLayerType, alias: Option<&str>) -> LinkMessage {
        let mut msg = LinkMessage::default();
        msg.header.index = 7;
        msg.header.link_layer_type = layer;
        msg.attributes.push(LinkAttribute::IfName("vm1".into()));
        if let Some(a) = alias {
            msg.attributes.push(LinkAttribute::IfAlias(a.into()));
        }
        let mut info = vec![LinkInfo::Kind(InfoKind::Tun)];
        if let Some(t) = tun_type {
            info.push(LinkInfo::Data(InfoData::Tun(vec![netlink_packet_route::link::InfoTun::Other(
                DefaultNla::new(IFLA_TUN_TYPE, vec![t]),
            )])));
        }
        msg.attributes.push(LinkAttribute::LinkInfo(info));
        msg
    }

    /// A link message as the kernel sends it, parsed back by the crate.
    fn round_trip(msg: LinkMessage) -> LinkMessage {
        let bytes = encode(RouteNetlinkMessage::NewLink(msg), 9);
        match NetlinkMessage::<RouteNetlinkMessage>::deserialize(&bytes).unwrap().payload {
            NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(l)) => l,
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn a_marked_tap_is_vnetds() {
        let d = describe(&round_trip(tun_link(Some(IFF_TAP), LinkLayerType::Ether, Some(MARK))));
        assert_eq!(d, Device { index: 7, name: "vm1".into(), kind: Kind::Tap, alias: Some(MARK.into()), peer: None });
        assert!(d.is_vnetds());
    }

    #[test]
    fn unmarked_or_other_marks_or_tuns_are_not_vnetds() {
        let tap = describe(&round_trip(tun_link(Some(IFF_TAP), LinkLayerType::Ether, None)));
        assert_eq!((tap.kind, tap.is_vnetds()), (Kind::Tap, false));
        let other_alias = describe(&round_trip(tun_link(Some(IFF_TAP), LinkLayerType::Ether, Some("vnetd2"))));
        assert!(!other_alias.is_vnetds());
        // A TUN carrying the mark is still not a TAP vnetd made.
        let tun = describe(&round_trip(tun_link(Some(IFF_TUN), LinkLayerType::None, Some(MARK))));
        assert_eq!((tun.kind, tun.is_vnetds()), (Kind::Tun, false));
    }

    #[test]
    fn tun_kind_falls_back_to_the_link_layer_without_info_data() {
        assert_eq!(describe(&round_trip(tun_link(None, LinkLayerType::Ether, None))).kind, Kind::Tap);
        assert_eq!(describe(&round_trip(tun_link(None, LinkLayerType::None, None))).kind, Kind::Tun);
    }

    #[test]
    fn a_device_without_tun_link_info_is_other() {
        let mut msg = LinkMessage::default();
        msg.header.link_layer_type = LinkLayerType::Ether;
        msg.attributes.push(LinkAttribute::IfName("eth0".into()));
        msg.attributes.push(LinkAttribute::IfAlias(MARK.into()));
        msg.attributes.push(LinkAttribute::LinkInfo(vec![LinkInfo::Kind(InfoKind::Bridge)]));
        let d = describe(&round_trip(msg));
        assert_eq!((d.kind, d.is_vnetds()), (Kind::Other, false));
    }

    #[test]
    fn the_mark_request_is_setlink_of_ifalias_on_the_index() {
        let bytes = encode(set_link(42, LinkAttribute::IfAlias(MARK.into())), 1);
        // nlmsghdr: length, RTM_SETLINK (19), REQUEST|ACK.
        assert_eq!(u32::from_ne_bytes(bytes[0..4].try_into().unwrap()) as usize, bytes.len());
        assert_eq!(u16::from_ne_bytes(bytes[4..6].try_into().unwrap()), libc::RTM_SETLINK);
        assert_eq!(u16::from_ne_bytes(bytes[6..8].try_into().unwrap()), NLM_F_REQUEST | NLM_F_ACK);
        // ifinfomsg: the device's index.
        assert_eq!(i32::from_ne_bytes(bytes[20..24].try_into().unwrap()), 42);
        // One attribute: IFLA_IFALIAS (20) = "vnetd\0", padded to 4 bytes.
        let attr = &bytes[32..];
        assert_eq!(u16::from_ne_bytes(attr[0..2].try_into().unwrap()), 4 + 6);
        assert_eq!(u16::from_ne_bytes(attr[2..4].try_into().unwrap()), libc::IFLA_IFALIAS);
        assert_eq!(&attr[4..10], b"vnetd\0");
        assert_eq!(attr.len(), 12);
    }

    #[test]
    fn a_lookup_by_name_carries_the_name_and_skips_counters() {
        let bytes = encode(get_link(Some("g1"), 0), 1);
        match NetlinkMessage::<RouteNetlinkMessage>::deserialize(&bytes).unwrap().payload {
            NetlinkPayload::InnerMessage(RouteNetlinkMessage::GetLink(l)) => {
                assert_eq!(l.header.index, 0);
                assert_eq!(
                    l.attributes,
                    vec![LinkAttribute::IfName("g1".into()), LinkAttribute::ExtMask(vec![LinkExtentMask::SkipStats])]
                );
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}
