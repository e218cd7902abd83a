//! VTOE's two small protocols (no I/O): the handshake that opens a shadow
//! connection between two vnetd, and the messages between vnetd and the
//! `vtoe` runner that supervises a guest program. See docs/vtoe.md.
//!
//! **Shadow handshake** (TCP, vnetd's VTOE port), the TCP links' mutual
//! challenge and response under VTOE's own magic and labels
//! (`linkauth::VTOE`), keyed by the link's VTOE key. The initiator's proof
//! also covers its connection request, and the responder's verdict carries
//! a MAC over both, so neither can be altered or replayed:
//!
//! ```text
//! initiator -> responder  HELLO     (linkauth, 40 bytes)
//! responder -> initiator  CHALLENGE (linkauth, 72 bytes)
//! initiator -> responder  REQUEST   request (32) | HMAC(k, initiator label | n_i | n_r | request)   (64)
//! responder -> initiator  VERDICT   verdict (4)  | HMAC(k, "vnet-vtoe verdict" | n_i | n_r | request | verdict)  (36)
//! ```
//!
//! After an accepting verdict the connection belongs to the guests: not one
//! byte more is written by either vnetd, and each side reads exactly the
//! handshake's bytes, so nothing is added to or taken from the guests'
//! stream.
//!
//! **Guest messages** travel on a Unix SOCK_SEQPACKET socket, one message a
//! packet, a socket passed with `Connected` and `Incoming` (SCM_RIGHTS),
//! and from the runner with `Listen` (the listening socket, as proof).
//! vnetd parses what a guest sends as hostile input: exact lengths, known
//! types, reserved bytes zero.

use crate::linkauth::{self, Nonce, MAC_LEN, VTOE};
use crate::mac::Mac;
use std::net::{Ipv4Addr, SocketAddrV4};

/// Version of the shadow handshake.
pub const VERSION: u8 = 1;
/// Version of the runner's messages. 2: a Listen carries its listening
/// socket, and a refused one is answered `NotListening`.
pub const RUNNER_VERSION: u8 = 2;

/// Why a connection was not offloaded (then it takes the Ethernet path, as
/// without VTOE), or was refused: counted by name, carried as a byte.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
#[repr(u8)]
pub enum Reason {
    /// The destination is the guest itself (or its loopback).
    Local = 1,
    /// The guest reaches it through a gateway, not on the overlay's LAN.
    OffLink = 2,
    /// The guest's route leaves by a device vnetd does not serve.
    OtherDevice = 3,
    /// The rule table sends the guest's frames for it nowhere.
    NoRoute = 4,
    /// The rule table sends them to several places.
    FanOut = 5,
    /// The destination guest is on this host.
    SameHost = 6,
    /// The link toward it has no VTOE key.
    NoVtoeLink = 7,
    /// The link toward it runs over IPv6 (shadow connections are IPv4).
    Ipv6Underlay = 8,
    /// The peer vnetd's VTOE port did not answer.
    PeerUnreachable = 9,
    /// The handshake failed: the peer lacks the key, or is not VTOE.
    PeerAuth = 10,
    /// The peer: no program under `vtoe` listens there.
    NoListener = 11,
    /// The peer: its routes do not deliver such frames to that guest.
    PeerRoutes = 12,
    /// The peer: the destination address is not one of the addresses of the
    /// guest's interface that the frames go to.
    NotLocal = 13,
    /// Too many offloaded connections (this host's limit, or the peer's).
    Limit = 14,
    /// The guest's kernel could not resolve the destination's MAC.
    Unresolved = 15,
    /// The source address is not the guest's.
    SourceNotLocal = 16,
    /// The peer broke the protocol (bad message, timeout).
    Protocol = 17,
    /// The guest holds no interface of this vnetd (the peer's guest, for a
    /// decline).
    NotGuest = 18,
    /// The destination or the source is a loopback, unspecified, multicast
    /// or broadcast address: never a guest's connection on the overlay.
    BadAddress = 19,
}

impl Reason {
    pub const ALL: [Reason; 19] = [
        Reason::Local,
        Reason::OffLink,
        Reason::OtherDevice,
        Reason::NoRoute,
        Reason::FanOut,
        Reason::SameHost,
        Reason::NoVtoeLink,
        Reason::Ipv6Underlay,
        Reason::PeerUnreachable,
        Reason::PeerAuth,
        Reason::NoListener,
        Reason::PeerRoutes,
        Reason::NotLocal,
        Reason::Limit,
        Reason::Unresolved,
        Reason::SourceNotLocal,
        Reason::Protocol,
        Reason::NotGuest,
        Reason::BadAddress,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Reason::Local => "local",
            Reason::OffLink => "off_link",
            Reason::OtherDevice => "other_device",
            Reason::NoRoute => "no_route",
            Reason::FanOut => "fan_out",
            Reason::SameHost => "same_host",
            Reason::NoVtoeLink => "no_vtoe_link",
            Reason::Ipv6Underlay => "ipv6_underlay",
            Reason::PeerUnreachable => "peer_unreachable",
            Reason::PeerAuth => "peer_auth",
            Reason::NoListener => "no_listener",
            Reason::PeerRoutes => "peer_routes",
            Reason::NotLocal => "not_local",
            Reason::Limit => "limit",
            Reason::Unresolved => "unresolved",
            Reason::SourceNotLocal => "source_not_local",
            Reason::Protocol => "protocol",
            Reason::NotGuest => "not_guest",
            Reason::BadAddress => "bad_address",
        }
    }

    pub fn from_u8(b: u8) -> Option<Reason> {
        Reason::ALL.into_iter().find(|r| *r as u8 == b)
    }

    /// Index in `ALL` (for counter arrays).
    pub fn index(self) -> usize {
        self as usize - 1
    }
}

// ---- the shadow handshake ----

pub const REQUEST_LEN: usize = 32;
pub const REQUEST_MSG_LEN: usize = REQUEST_LEN + MAC_LEN;
pub const VERDICT_LEN: usize = 4;
pub const VERDICT_MSG_LEN: usize = VERDICT_LEN + MAC_LEN;
const VERDICT_LABEL: &[u8] = b"vnet-vtoe verdict";

/// What the initiator asks: carry the guest connection `src` -> `dst`
/// whose frames would go from `src_mac` to `dst_mac`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Request {
    pub src_mac: Mac,
    pub dst_mac: Mac,
    pub src: SocketAddrV4,
    pub dst: SocketAddrV4,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum HandshakeError {
    Auth(linkauth::AuthError),
    /// A well-authenticated message that does not parse (version, reserved bytes).
    Malformed(&'static str),
}

impl std::fmt::Display for HandshakeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HandshakeError::Auth(e) => write!(f, "{e}"),
            HandshakeError::Malformed(m) => write!(f, "malformed: {m}"),
        }
    }
}

impl Request {
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[0] = VERSION;
        b[2..8].copy_from_slice(&self.src_mac.0);
        b[8..14].copy_from_slice(&self.dst_mac.0);
        b[14..18].copy_from_slice(&self.src.ip().octets());
        b[18..22].copy_from_slice(&self.dst.ip().octets());
        b[22..24].copy_from_slice(&self.src.port().to_be_bytes());
        b[24..26].copy_from_slice(&self.dst.port().to_be_bytes());
        b
    }

    pub fn decode(b: &[u8; REQUEST_LEN]) -> Result<Request, HandshakeError> {
        if b[0] != VERSION {
            return Err(HandshakeError::Malformed("unknown version"));
        }
        if b[1] != 0 || b[26..].iter().any(|&x| x != 0) {
            return Err(HandshakeError::Malformed("reserved bytes set"));
        }
        let ip = |o: usize| Ipv4Addr::new(b[o], b[o + 1], b[o + 2], b[o + 3]);
        let port = |o: usize| u16::from_be_bytes([b[o], b[o + 1]]);
        Ok(Request {
            src_mac: Mac(b[2..8].try_into().expect("6")),
            dst_mac: Mac(b[8..14].try_into().expect("6")),
            src: SocketAddrV4::new(ip(14), port(22)),
            dst: SocketAddrV4::new(ip(18), port(24)),
        })
    }
}

/// Initiator: the REQUEST message, once the CHALLENGE checked out; also
/// returns the responder's nonce (for reading the verdict).
pub fn request_msg(
    key: &[u8],
    nonce_i: &Nonce,
    challenge: &[u8; linkauth::CHALLENGE_LEN],
    req: &Request,
) -> Result<(Nonce, [u8; REQUEST_MSG_LEN]), HandshakeError> {
    let r = req.encode();
    let (nonce_r, proof) = linkauth::answer(&VTOE, key, nonce_i, challenge, &r).map_err(HandshakeError::Auth)?;
    let mut out = [0u8; REQUEST_MSG_LEN];
    out[..REQUEST_LEN].copy_from_slice(&r);
    out[REQUEST_LEN..].copy_from_slice(&proof);
    Ok((nonce_r, out))
}

/// Responder: checks a REQUEST message and returns the request.
pub fn read_request(key: &[u8], nonce_i: &Nonce, nonce_r: &Nonce, msg: &[u8; REQUEST_MSG_LEN]) -> Result<Request, HandshakeError> {
    let r: &[u8; REQUEST_LEN] = msg[..REQUEST_LEN].try_into().expect("32");
    let proof: &[u8; MAC_LEN] = msg[REQUEST_LEN..].try_into().expect("32");
    linkauth::verify_proof(&VTOE, key, nonce_i, nonce_r, proof, r).map_err(HandshakeError::Auth)?;
    Request::decode(r)
}

/// The responder's answer: accepted, or declined (the initiator's guest then
/// takes the Ethernet path) for a reason.
pub type Verdict = Result<(), Reason>;

fn verdict_mac(key: &[u8], nonce_i: &Nonce, nonce_r: &Nonce, req: &Request, v: &[u8; VERDICT_LEN]) -> [u8; MAC_LEN] {
    let mut bound = [0u8; REQUEST_LEN + VERDICT_LEN];
    bound[..REQUEST_LEN].copy_from_slice(&req.encode());
    bound[REQUEST_LEN..].copy_from_slice(v);
    linkauth::mac(key, VERDICT_LABEL, nonce_i, nonce_r, &bound)
}

/// Responder: the VERDICT message.
pub fn verdict_msg(key: &[u8], nonce_i: &Nonce, nonce_r: &Nonce, req: &Request, v: Verdict) -> [u8; VERDICT_MSG_LEN] {
    let mut b = [0u8; VERDICT_LEN];
    if let Err(r) = v {
        b[0] = 1;
        b[1] = r as u8;
    }
    let mut out = [0u8; VERDICT_MSG_LEN];
    out[..VERDICT_LEN].copy_from_slice(&b);
    out[VERDICT_LEN..].copy_from_slice(&verdict_mac(key, nonce_i, nonce_r, req, &b));
    out
}

/// Initiator: checks a VERDICT message.
pub fn read_verdict(key: &[u8], nonce_i: &Nonce, nonce_r: &Nonce, req: &Request, msg: &[u8; VERDICT_MSG_LEN]) -> Result<Verdict, HandshakeError> {
    let b: &[u8; VERDICT_LEN] = msg[..VERDICT_LEN].try_into().expect("4");
    if !linkauth::mac_matches(&verdict_mac(key, nonce_i, nonce_r, req, b), &msg[VERDICT_LEN..]) {
        return Err(HandshakeError::Auth(linkauth::AuthError::BadKey));
    }
    match (b[0], b[2], b[3]) {
        (0, 0, 0) if b[1] == 0 => Ok(Ok(())),
        (1, 0, 0) => Reason::from_u8(b[1]).map(Err).ok_or(HandshakeError::Malformed("unknown reason")),
        _ => Err(HandshakeError::Malformed("bad verdict")),
    }
}

// ---- vnetd <-> the vtoe runner ----

/// Why vnetd did not register a listener (the program's listen still works,
/// for the guest kernel's own connections): counted by name.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
#[repr(u8)]
pub enum ListenRefusal {
    /// No socket came with the Listen.
    NoSocket = 1,
    /// What came is not an IPv4 TCP socket (or a dual-stack IPv6 one).
    NotTcp = 2,
    /// The socket is not listening.
    NotListening = 3,
    /// The socket is bound to another address or port than the one named.
    WrongAddress = 4,
    /// The socket belongs to another network namespace than the runner's.
    OtherNamespace = 5,
    /// A live listener of another socket holds the address (or, of another
    /// owner, the port on an overlapping address).
    Taken = 6,
    /// The runner holds `MAX_LISTENERS_PER_RUNNER` already.
    Limit = 7,
    /// A loopback, multicast or broadcast address: not for the overlay.
    BadAddress = 8,
}

impl ListenRefusal {
    pub const ALL: [ListenRefusal; 8] = [
        ListenRefusal::NoSocket,
        ListenRefusal::NotTcp,
        ListenRefusal::NotListening,
        ListenRefusal::WrongAddress,
        ListenRefusal::OtherNamespace,
        ListenRefusal::Taken,
        ListenRefusal::Limit,
        ListenRefusal::BadAddress,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ListenRefusal::NoSocket => "no_socket",
            ListenRefusal::NotTcp => "not_tcp",
            ListenRefusal::NotListening => "not_listening",
            ListenRefusal::WrongAddress => "wrong_address",
            ListenRefusal::OtherNamespace => "other_namespace",
            ListenRefusal::Taken => "taken",
            ListenRefusal::Limit => "limit",
            ListenRefusal::BadAddress => "bad_address",
        }
    }

    pub fn from_u8(b: u8) -> Option<ListenRefusal> {
        ListenRefusal::ALL.into_iter().find(|r| *r as u8 == b)
    }

    /// Index in `ALL` (for counter arrays).
    pub fn index(self) -> usize {
        self as usize - 1
    }
}

/// Whether an address can be a guest's end of a connection on the overlay:
/// not loopback, unspecified, multicast or broadcast (the limited one; a
/// subnet's broadcast address is the guest kernel's to know).
pub fn is_overlay_unicast(ip: Ipv4Addr) -> bool {
    !(ip.is_loopback() || ip.is_unspecified() || ip.is_multicast() || ip.is_broadcast())
}

/// Longest message either side sends.
pub const MAX_MSG: usize = 32;

/// What the runner sends vnetd.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum ToVnetd {
    /// First message: the protocol version the runner speaks.
    Hello { version: u8 },
    /// Offload the guest's connection `src` -> `dst` (request `id`).
    Connect { id: u32, src: SocketAddrV4, dst: SocketAddrV4 },
    /// A program listens on `addr` (0.0.0.0: every address of the guest);
    /// the listening socket comes with it (SCM_RIGHTS), as its proof.
    Listen { addr: SocketAddrV4 },
    /// It no longer does.
    Unlisten { addr: SocketAddrV4 },
    /// The runner refused a program's attempt on an offloaded socket (an
    /// interface ioctl), for vnetd's counters.
    RefusedIoctl,
}

/// What vnetd sends the runner.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum FromVnetd {
    /// The answer to Hello: this is a guest of this vnetd.
    Welcome { version: u8 },
    /// The runner's namespace holds no interface of this vnetd.
    NotGuest,
    /// Request `id` is offloaded: the shadow socket comes with this message.
    /// `cookie` is its kernel socket cookie; `local`/`peer` the overlay's ends.
    Connected { id: u32, cookie: u64, local: SocketAddrV4, peer: SocketAddrV4 },
    /// Request `id` is not offloaded: connect as without VTOE.
    Fallback { id: u32, reason: Reason },
    /// Request `id` fails with `errno`, as the kernel's connect would.
    Failed { id: u32, errno: i32, reason: Reason },
    /// The answer to a Listen that vnetd registered.
    Listening { addr: SocketAddrV4 },
    /// The answer to a Listen that vnetd did not register, and why: the
    /// listener takes the guest kernel's own connections only.
    NotListening { addr: SocketAddrV4, why: ListenRefusal },
    /// An offloaded connection for the listener on `listener`; the socket
    /// comes with this message.
    Incoming { listener: SocketAddrV4, cookie: u64, local: SocketAddrV4, peer: SocketAddrV4 },
    /// The shadow connection with this cookie is gone.
    Closed { cookie: u64 },
}

fn put_addr(b: &mut Vec<u8>, a: SocketAddrV4) {
    b.extend_from_slice(&a.ip().octets());
    b.extend_from_slice(&a.port().to_be_bytes());
}

/// Reads fixed fields off the front of a message.
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err("message too short".into());
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_be_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn i32(&mut self) -> Result<i32, String> {
        Ok(i32::from_be_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_be_bytes(self.take(8)?.try_into().expect("8")))
    }
    fn addr(&mut self) -> Result<SocketAddrV4, String> {
        let b = self.take(6)?;
        Ok(SocketAddrV4::new(Ipv4Addr::new(b[0], b[1], b[2], b[3]), u16::from_be_bytes([b[4], b[5]])))
    }
    fn reason(&mut self) -> Result<Reason, String> {
        let b = self.u8()?;
        Reason::from_u8(b).ok_or_else(|| format!("unknown reason {b}"))
    }
    fn listen_refusal(&mut self) -> Result<ListenRefusal, String> {
        let b = self.u8()?;
        ListenRefusal::from_u8(b).ok_or_else(|| format!("unknown listen refusal {b}"))
    }
    fn end(self) -> Result<(), String> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(format!("{} bytes too many", self.0.len()))
        }
    }
}

impl ToVnetd {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(MAX_MSG);
        match *self {
            ToVnetd::Hello { version } => b.extend_from_slice(&[1, version]),
            ToVnetd::Connect { id, src, dst } => {
                b.push(2);
                b.extend_from_slice(&id.to_be_bytes());
                put_addr(&mut b, src);
                put_addr(&mut b, dst);
            }
            ToVnetd::Listen { addr } => {
                b.push(3);
                put_addr(&mut b, addr);
            }
            ToVnetd::Unlisten { addr } => {
                b.push(4);
                put_addr(&mut b, addr);
            }
            ToVnetd::RefusedIoctl => b.push(5),
        }
        b
    }

    /// Parses one message from a guest: anything but an exact, known
    /// message is an error naming what is wrong.
    pub fn decode(b: &[u8]) -> Result<ToVnetd, String> {
        let mut f = Fields(b);
        let m = match f.u8()? {
            1 => ToVnetd::Hello { version: f.u8()? },
            2 => ToVnetd::Connect { id: f.u32()?, src: f.addr()?, dst: f.addr()? },
            3 => ToVnetd::Listen { addr: f.addr()? },
            4 => ToVnetd::Unlisten { addr: f.addr()? },
            5 => ToVnetd::RefusedIoctl,
            t => return Err(format!("unknown message type {t}")),
        };
        f.end()?;
        Ok(m)
    }
}

impl FromVnetd {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(MAX_MSG);
        match *self {
            FromVnetd::Welcome { version } => b.extend_from_slice(&[1, version]),
            FromVnetd::NotGuest => b.push(2),
            FromVnetd::Connected { id, cookie, local, peer } => {
                b.push(3);
                b.extend_from_slice(&id.to_be_bytes());
                b.extend_from_slice(&cookie.to_be_bytes());
                put_addr(&mut b, local);
                put_addr(&mut b, peer);
            }
            FromVnetd::Fallback { id, reason } => {
                b.push(4);
                b.extend_from_slice(&id.to_be_bytes());
                b.push(reason as u8);
            }
            FromVnetd::Failed { id, errno, reason } => {
                b.push(5);
                b.extend_from_slice(&id.to_be_bytes());
                b.extend_from_slice(&errno.to_be_bytes());
                b.push(reason as u8);
            }
            FromVnetd::Listening { addr } => {
                b.push(6);
                put_addr(&mut b, addr);
            }
            FromVnetd::Incoming { listener, cookie, local, peer } => {
                b.push(7);
                put_addr(&mut b, listener);
                b.extend_from_slice(&cookie.to_be_bytes());
                put_addr(&mut b, local);
                put_addr(&mut b, peer);
            }
            FromVnetd::Closed { cookie } => {
                b.push(8);
                b.extend_from_slice(&cookie.to_be_bytes());
            }
            FromVnetd::NotListening { addr, why } => {
                b.push(9);
                put_addr(&mut b, addr);
                b.push(why as u8);
            }
        }
        b
    }

    pub fn decode(b: &[u8]) -> Result<FromVnetd, String> {
        let mut f = Fields(b);
        let m = match f.u8()? {
            1 => FromVnetd::Welcome { version: f.u8()? },
            2 => FromVnetd::NotGuest,
            3 => FromVnetd::Connected { id: f.u32()?, cookie: f.u64()?, local: f.addr()?, peer: f.addr()? },
            4 => FromVnetd::Fallback { id: f.u32()?, reason: f.reason()? },
            5 => FromVnetd::Failed { id: f.u32()?, errno: f.i32()?, reason: f.reason()? },
            6 => FromVnetd::Listening { addr: f.addr()? },
            7 => FromVnetd::Incoming { listener: f.addr()?, cookie: f.u64()?, local: f.addr()?, peer: f.addr()? },
            8 => FromVnetd::Closed { cookie: f.u64()? },
            9 => FromVnetd::NotListening { addr: f.addr()?, why: f.listen_refusal()? },
            t => return Err(format!("unknown message type {t}")),
        };
        f.end()?;
        Ok(m)
    }

    /// Whether a socket travels with this message.
    pub fn carries_socket(&self) -> bool {
        matches!(self, FromVnetd::Connected { .. } | FromVnetd::Incoming { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const K: &[u8] = b"0123456789abcdef0123456789abcdef";

    fn req() -> Request {
        Request {
            src_mac: Mac([2, 0, 0, 0, 0, 1]),
            dst_mac: Mac([2, 0, 0, 0, 0, 3]),
            src: "198.19.0.1:40000".parse().unwrap(),
            dst: "198.19.0.3:5201".parse().unwrap(),
        }
    }

    /// Both ends' view of one handshake: (nonce_r, request message).
    fn handshake(key_i: &[u8], key_r: &[u8]) -> (Nonce, Nonce, Result<(Nonce, [u8; REQUEST_MSG_LEN]), HandshakeError>) {
        let (ni, nr) = ([1u8; 32], [2u8; 32]);
        let ch = linkauth::challenge(&VTOE, key_r, &ni, &nr);
        (ni, nr, request_msg(key_i, &ni, &ch, &req()))
    }

    #[test]
    fn a_request_and_its_verdict_go_through_with_the_key() {
        let (ni, nr, r) = handshake(K, K);
        let (got_nr, msg) = r.unwrap();
        assert_eq!(got_nr, nr);
        assert_eq!(read_request(K, &ni, &nr, &msg), Ok(req()));
        for v in [Ok(()), Err(Reason::NoListener), Err(Reason::PeerRoutes)] {
            let vm = verdict_msg(K, &ni, &nr, &req(), v);
            assert_eq!(read_verdict(K, &ni, &nr, &req(), &vm), Ok(v));
        }
    }

    #[test]
    fn a_stranger_cannot_answer_or_inject_a_request() {
        let other = b"not the key but long enough.....";
        // Responder without the key: the initiator refuses its challenge.
        let (_, _, r) = handshake(K, other);
        assert_eq!(r.unwrap_err(), HandshakeError::Auth(linkauth::AuthError::BadKey));
        // Initiator without the key: the responder refuses its request.
        let (ni, nr) = ([1u8; 32], [2u8; 32]);
        let ch = linkauth::challenge(&VTOE, other, &ni, &nr);
        let (_, forged) = request_msg(other, &ni, &ch, &req()).unwrap();
        assert!(read_request(K, &ni, &nr, &forged).is_err());
    }

    #[test]
    fn a_request_altered_on_the_way_is_refused() {
        let (ni, nr, r) = handshake(K, K);
        let (_, msg) = r.unwrap();
        for byte in 0..REQUEST_LEN {
            let mut bad = msg;
            bad[byte] ^= 0x40;
            assert!(read_request(K, &ni, &nr, &bad).is_err(), "byte {byte}");
        }
    }

    #[test]
    fn a_verdict_for_another_request_or_altered_is_refused() {
        let (ni, nr) = ([1u8; 32], [2u8; 32]);
        let vm = verdict_msg(K, &ni, &nr, &req(), Ok(()));
        let mut other = req();
        other.dst = "198.19.0.4:5201".parse().unwrap();
        assert!(read_verdict(K, &ni, &nr, &other, &vm).is_err());
        let mut bad = verdict_msg(K, &ni, &nr, &req(), Err(Reason::NoListener));
        bad[0] = 0; // "accepted", but the MAC says otherwise
        assert!(read_verdict(K, &ni, &nr, &req(), &bad).is_err());
        // A replay into another handshake (new nonce) fails too.
        assert!(read_verdict(K, &ni, &[3u8; 32], &req(), &vm).is_err());
    }

    #[test]
    fn reserved_bytes_and_versions_are_checked() {
        let mut r = req().encode();
        r[31] = 1;
        assert_eq!(Request::decode(&r), Err(HandshakeError::Malformed("reserved bytes set")));
        let mut r = req().encode();
        r[0] = 9;
        assert_eq!(Request::decode(&r), Err(HandshakeError::Malformed("unknown version")));
    }

    #[test]
    fn guest_messages_round_trip() {
        let a: SocketAddrV4 = "198.19.0.1:40000".parse().unwrap();
        let b: SocketAddrV4 = "198.19.0.3:5201".parse().unwrap();
        for m in [
            ToVnetd::Hello { version: RUNNER_VERSION },
            ToVnetd::Connect { id: 7, src: a, dst: b },
            ToVnetd::Listen { addr: b },
            ToVnetd::Unlisten { addr: b },
            ToVnetd::RefusedIoctl,
        ] {
            let e = m.encode();
            assert!(e.len() <= MAX_MSG);
            assert_eq!(ToVnetd::decode(&e), Ok(m));
        }
        for m in [
            FromVnetd::Welcome { version: RUNNER_VERSION },
            FromVnetd::NotGuest,
            FromVnetd::Connected { id: 7, cookie: 1 << 40, local: a, peer: b },
            FromVnetd::Fallback { id: 7, reason: Reason::OffLink },
            FromVnetd::Failed { id: 7, errno: 113, reason: Reason::Unresolved },
            FromVnetd::Listening { addr: b },
            FromVnetd::Incoming { listener: b, cookie: 9, local: b, peer: a },
            FromVnetd::Closed { cookie: 9 },
            FromVnetd::NotListening { addr: b, why: ListenRefusal::Taken },
        ] {
            let e = m.encode();
            assert!(e.len() <= MAX_MSG);
            assert_eq!(FromVnetd::decode(&e), Ok(m));
        }
    }

    #[test]
    fn guest_messages_of_the_wrong_length_or_type_are_refused() {
        let ok = ToVnetd::Connect { id: 1, src: "1.2.3.4:5".parse().unwrap(), dst: "5.6.7.8:9".parse().unwrap() }.encode();
        for n in 0..ok.len() {
            assert!(ToVnetd::decode(&ok[..n]).is_err(), "{n} bytes");
        }
        let mut long = ok.clone();
        long.push(0);
        assert_eq!(ToVnetd::decode(&long), Err("1 bytes too many".into()));
        assert_eq!(ToVnetd::decode(&[99]), Err("unknown message type 99".into()));
        assert_eq!(FromVnetd::decode(&[4, 0, 0, 0, 1, 200]), Err("unknown reason 200".into()));
    }

    #[test]
    fn reasons_have_distinct_bytes_names_and_indices() {
        let mut seen = std::collections::HashSet::new();
        for (i, r) in Reason::ALL.iter().enumerate() {
            assert_eq!(r.index(), i);
            assert_eq!(Reason::from_u8(*r as u8), Some(*r));
            assert!(seen.insert(r.name()));
        }
        assert_eq!(Reason::from_u8(0), None);
        let mut seen = std::collections::HashSet::new();
        for (i, r) in ListenRefusal::ALL.iter().enumerate() {
            assert_eq!(r.index(), i);
            assert_eq!(ListenRefusal::from_u8(*r as u8), Some(*r));
            assert!(seen.insert(r.name()));
        }
        assert_eq!(ListenRefusal::from_u8(0), None);
        assert_eq!(FromVnetd::decode(&[9, 1, 2, 3, 4, 0, 5, 99]), Err("unknown listen refusal 99".into()));
    }

    #[test]
    fn only_unicast_addresses_are_overlay_ends() {
        for bad in ["127.0.0.1", "127.1.2.3", "0.0.0.0", "224.0.0.1", "239.255.255.250", "255.255.255.255"] {
            assert!(!is_overlay_unicast(bad.parse().unwrap()), "{bad}");
        }
        for good in ["198.19.0.2", "10.0.0.1", "192.168.1.255"] {
            assert!(is_overlay_unicast(good.parse().unwrap()), "{good}");
        }
    }
}
