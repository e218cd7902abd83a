//! vnetd's WireGuard receive path (linked from the vnetd library): any
//! datagram to the WireGuard port, and any packet sealed by a real peer in a
//! real session, through `WgHub::address` and `WgHub::open` as a dispatcher
//! calls them.
//!
//! Checked for every input:
//! - nothing panics, whatever the datagram claims (type, index, counter,
//!   lengths) or the sealed packet holds;
//! - a frame comes out only of a datagram sealed in the session, and is then
//!   exactly the bytes the peer sealed after their inner IPv4/UDP header,
//!   inside the output buffer;
//! - raw datagrams (no session key) never become frames.
//!
//! Input: the first byte picks raw (even) or sealed by the peer (odd); the
//! rest is the datagram or the packet.
#![no_main]
use boringtun::noise::{Tunn, TunnResult};
use boringtun::x25519::{PublicKey, StaticSecret};
use libfuzzer_sys::fuzz_target;
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use vnetd::link::wireguard::{inner_frame, Addressed, Inner, Opened, WgHub, WgKeys, WgLink, MAX_DATAGRAM};
use vnetd::stats::{Counters, ThreadStats};

struct World {
    hub: Arc<WgHub>,
    link: Arc<WgLink>,
    peer: Tunn,
    /// The peer's socket: where the hub answers.
    sock: UdpSocket,
    stats: Counters,
    st: ThreadStats,
}

fn open(w: &World, dgram: &[u8], out: &mut [u8]) -> Option<Opened> {
    let from = w.sock.local_addr().unwrap();
    let ours = match w.hub.address(&w.st, from, dgram) {
        Addressed::Index(i) => i == w.link.index(),
        Addressed::Key(k) => k == *w.link.peer(),
        Addressed::Done => false,
    };
    ours.then(|| w.hub.open(&w.link, &w.stats, &w.st, from, dgram, out))
}

fn world() -> World {
    let hub_secret = [7u8; 32];
    let peer_secret = StaticSecret::from([9u8; 32]);
    let hub_public = PublicKey::from(&StaticSecret::from(hub_secret));
    let hub = WgHub::start("127.0.0.1:0".parse().unwrap(), 1, WgKeys::new(hub_secret), std::path::Path::new("/nonexistent")).unwrap();
    let sock = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let at = sock.local_addr().unwrap();
    let peer_public = *PublicKey::from(&peer_secret).as_bytes();
    let inner = Inner { src: Ipv4Addr::LOCALHOST, dst: Ipv4Addr::LOCALHOST, sport: 9000, dport: 9000 };
    let link = hub.link(peer_public, SocketAddr::from(at), inner).unwrap();
    let peer = Tunn::new(peer_secret, hub_public, None, None, 1, None).unwrap();
    let mut w = World { hub, link, peer, sock, stats: Counters::default(), st: ThreadStats::default() };
    // The peer's handshake, answered by the hub (to the peer's socket), and
    // the peer's keepalive that confirms it.
    let (mut buf, mut out) = (vec![0u8; MAX_DATAGRAM], vec![0u8; MAX_DATAGRAM]);
    let TunnResult::WriteToNetwork(init) = w.peer.format_handshake_initiation(&mut buf, false) else { panic!("no initiation") };
    let init = init.to_vec();
    assert!(matches!(open(&w, &init, &mut out), Some(Opened::Handled)));
    loop {
        let n = w.sock.recv(&mut buf).expect("the hub's handshake response");
        // The link's own first initiation may come first: not the answer.
        if buf[0] == 2 {
            let resp = buf[..n].to_vec();
            let TunnResult::WriteToNetwork(ka) = w.peer.decapsulate(None, &resp, &mut out) else { panic!("response refused") };
            let ka = ka.to_vec();
            assert!(matches!(open(&w, &ka, &mut buf), Some(Opened::Handled)));
            break;
        }
    }
    w
}

fuzz_target!(|data: &[u8]| {
    static W: OnceLock<Mutex<World>> = OnceLock::new();
    let mut w = W.get_or_init(|| Mutex::new(world())).lock().unwrap();
    let Some((&mode, rest)) = data.split_first() else { return };
    let mut out = vec![0u8; MAX_DATAGRAM];
    if mode % 2 == 0 {
        if let Some(Opened::Frame(_)) = open(&w, rest, &mut out) {
            panic!("a datagram nobody sealed became a frame");
        }
        return;
    }
    let mut sealed = vec![0u8; rest.len() + 200];
    let TunnResult::WriteToNetwork(p) = w.peer.encapsulate(rest, &mut sealed) else { return };
    let p = p.to_vec();
    let got = open(&w, &p, &mut out);
    // boringtun opens only IP packets of a consistent length; vnetd takes
    // only unfragmented IPv4/UDP among them.
    if let Some(Opened::Frame(r)) = got {
        assert!(r.end <= out.len());
        let want = inner_frame(rest).expect("a frame from a packet that is no frame");
        assert_eq!(&out[r], &rest[want]);
    }
    drop(w);
});
