//! vnetd's WireGuard receive path (linked from the vnetd library): any
//! datagram or GRO run to the WireGuard port, any packet a real peer seals
//! in a real session, and runs of a peer's data ending in a handshake while
//! big frames wait for a session, through `WgHub::open_run` as a dispatcher
//! calls it and `WgHub::work_now` as the handshake thread works.
//!
//! Checked for every input:
//! - nothing panics, whatever the datagrams claim (type, index, counter,
//!   lengths), whatever the run's shape and whatever waits in the link
//!   (boringtun panics when handed a buffer shorter than what it writes:
//!   the review's F1 was a flush of waiting frames into a run's tail);
//! - a frame comes out only of a datagram sealed in the session, and is then
//!   exactly the bytes the peer sealed after their inner IPv4/UDP header;
//! - raw datagrams (no session key) never become frames;
//! - the frames that waited leave, sealed, once the peer's data makes its
//!   session current.
//!
//! Input: the first byte picks raw (0), sealed by the peer (1) or a run
//! ending in a handshake (2); the rest is the datagram, the packet, or the
//! run's shape (then: waiting frames, their size, data messages, their size).
#![no_main]
use boringtun::noise::{Tunn, TunnResult};
use boringtun::x25519::{PublicKey, StaticSecret};
use libfuzzer_sys::fuzz_target;
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use vnetd::link::carriers::UdpCarrier;
use vnetd::link::wireguard::{inner_frame, Handshaker, Inner, WgHub, WgKeys, WgLink, MAX_DATAGRAM};
use vnetd::link::{CarrierKey, DemuxKey, GsoState, LinkLookup, RunOpener, Transport, TxCtx, TxQueue};
use vnetd::port::{Intake, Slot};
use vnetd::stats::{Counters, OffloadCounters, ThreadStats};
use vnetd::sys::udp::UdpEndpoint;
use vnet_core::offload::{Pieces, VnetHdr};

struct World {
    hub: Arc<WgHub>,
    link: Arc<WgLink>,
    peer: Tunn,
    /// The peer's socket: where the hub answers.
    sock: UdpSocket,
    stats: Counters,
    st: ThreadStats,
    h: Handshaker,
}

impl LinkLookup for World {
    fn demux(&self, _carrier: &CarrierKey, key: &DemuxKey) -> Option<u32> {
        let ours = match key {
            DemuxKey::Index(i) => *i == self.link.index(),
            DemuxKey::Key(k) => k == self.link.peer(),
            _ => false,
        };
        ours.then_some(0)
    }
    fn link(&self, slot: u32) -> Option<(&dyn Transport, &Counters)> {
        (slot == 0).then(|| (&*self.link as &dyn Transport, &self.stats))
    }
    fn slot_of_link(&self, _id: u32) -> Option<u32> {
        Some(0)
    }
}

/// The frames a run gave the forwarder, copied.
#[derive(Default)]
struct Frames(Vec<Vec<u8>>);

impl Intake for Frames {
    fn port_frame(&mut self, _at: Slot, _frame: &mut [u8], _vnet: VnetHdr) {
        panic!("a WireGuard datagram is no device frame");
    }
    fn link_frame(&mut self, slot: u32, buf: &mut [u8], frame: Range<usize>) {
        assert_eq!(slot, 0);
        assert!(frame.end <= buf.len());
        self.0.push(buf[frame].to_vec());
    }
    fn end_run(&mut self, _buf: &[u8]) {}
}

const CARRIER: CarrierKey = CarrierKey::Udp { port: 51820, v6: false };

impl World {
    fn from(&self) -> SocketAddr {
        self.sock.local_addr().unwrap()
    }

    /// A run through the dispatcher's path, then what it queued through the
    /// handshake thread's.
    fn run(&mut self, run: &[u8], seg: usize) -> Vec<Vec<u8>> {
        let mut frames = Frames::default();
        let mut buf = vec![0u8; MAX_DATAGRAM + 128];
        let (hub, from) = (self.hub.clone(), self.from());
        let mut run = run.to_vec();
        hub.open_run(&CARRIER, &*self, &self.st, from, &mut run, seg, &mut buf, &mut frames);
        let mut h = std::mem::take(&mut self.h);
        hub.work_now(&*self, &mut h, false);
        self.h = h;
        frames.0
    }

    /// The next datagram of type `kind` the hub sent the peer.
    fn recv(&self, kind: u8) -> Vec<u8> {
        let mut buf = vec![0u8; MAX_DATAGRAM];
        loop {
            let n = self.sock.recv(&mut buf).expect("the hub's answer");
            if buf[0] == kind {
                return buf[..n].to_vec();
            }
        }
    }

    /// The peer initiates; the hub answers; the peer confirms with a
    /// keepalive (which makes the session current at the hub).
    fn handshake(&mut self, confirm: bool) {
        let (mut buf, mut out) = (vec![0u8; 2048], vec![0u8; 2048]);
        let TunnResult::WriteToNetwork(init) = self.peer.format_handshake_initiation(&mut buf, true) else { panic!("no initiation") };
        let init = init.to_vec();
        self.run(&init, init.len());
        let resp = self.recv(2);
        let TunnResult::WriteToNetwork(ka) = self.peer.decapsulate(None, &resp, &mut out) else { panic!("response refused") };
        let ka = ka.to_vec();
        if confirm {
            self.run(&ka, ka.len());
        }
    }

    /// A frame of `len` bytes the guest side sends to the peer (waits for a
    /// session if there is none).
    fn send_frame(&self, len: usize) {
        let frame = vec![0x5au8; len];
        let parts = [&frame[..]];
        let (gso, offload) = (GsoState::default(), OffloadCounters::default());
        let cx = TxCtx { slot: 0, max_frame: 1412, gso: &gso, offload: &offload };
        let mut q = TxQueue::default();
        let _ = self.link.send(&mut q, &cx, &VnetHdr::default(), Pieces::new(&parts));
    }
}

fn world() -> World {
    let hub_secret = [7u8; 32];
    let peer_secret = StaticSecret::from([9u8; 32]);
    let hub_public = PublicKey::from(&StaticSecret::from(hub_secret));
    let hub = WgHub::new(WgKeys::new(hub_secret), std::path::Path::new("/nonexistent"));
    let ep = Arc::new(UdpEndpoint::bind("127.0.0.1:0".parse().unwrap()).unwrap());
    hub.carry(&UdpCarrier::new(CARRIER, "wireguard", vec![ep], hub.clone() as Arc<dyn RunOpener>));
    let sock = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    // Room for every frame that waited (24 of up to 60 KB).
    let size: libc::c_int = 8 << 20;
    // SAFETY: setsockopt on a socket we own, with an int.
    unsafe {
        use std::os::fd::AsRawFd;
        libc::setsockopt(sock.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, &size as *const _ as *const libc::c_void, 4);
    }
    let at = sock.local_addr().unwrap();
    let peer_public = *PublicKey::from(&peer_secret).as_bytes();
    let inner = Inner { src: Ipv4Addr::LOCALHOST.into(), dst: Ipv4Addr::LOCALHOST.into(), sport: 9000, dport: 9000 };
    let link = hub.link(peer_public, SocketAddr::from(at), inner).unwrap();
    let peer = Tunn::new(peer_secret, hub_public, None, None, 1, None).unwrap();
    World { hub, link, peer, sock, stats: Counters::default(), st: ThreadStats::default(), h: Handshaker::default() }
}

/// A packet the peer seals as a frame of vnetd's (inner IPv4/UDP header,
/// then the frame).
fn packet(frame: &[u8]) -> Vec<u8> {
    let mut p = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, 17, 0, 0, 127, 0, 0, 1, 127, 0, 0, 1, 0x23, 0x28, 0x23, 0x28, 0, 0, 0, 0];
    let total = (28 + frame.len()) as u16;
    p[2..4].copy_from_slice(&total.to_be_bytes());
    p[24..26].copy_from_slice(&((8 + frame.len()) as u16).to_be_bytes());
    p.extend_from_slice(frame);
    p
}

/// Data messages the peer seals, `size` bytes each, ending in a fresh
/// initiation, sent as one GRO run while big frames wait for a session
/// (the review's F1). The peer's data makes its session current at the hub;
/// the frames that waited then leave, into the handshake thread's own buffer.
fn handshake_tail(rest: &[u8]) {
    let [waiting, wsize_hi, wsize_lo, count, size_hi, size_lo, ..] = *rest else { return };
    let mut w = world();
    // Nothing answers the hub's own initiations: frames wait.
    let waiting = waiting as usize % 24;
    let wsize = (u16::from_be_bytes([wsize_hi, wsize_lo]) as usize % 60_000).max(60);
    for _ in 0..waiting {
        w.send_frame(wsize);
    }
    // The peer's handshake, answered; not yet confirmed.
    w.handshake(false);
    // A run: `count` data messages of `size` bytes, then an initiation.
    let size = (u16::from_be_bytes([size_hi, size_lo]) as usize % 1500).max(32 + 28 + 14);
    let frame_len = size - 32 - 28;
    let count = count as usize % 60 + 1;
    let mut run = Vec::new();
    let mut sent = Vec::new();
    let mut out = vec![0u8; MAX_DATAGRAM];
    for k in 0..count {
        let frame: Vec<u8> = (0..frame_len).map(|i| (i + k) as u8).collect();
        let TunnResult::WriteToNetwork(p) = w.peer.encapsulate(&packet(&frame), &mut out) else { panic!("no session at the peer") };
        assert_eq!(p.len(), size);
        run.extend_from_slice(p);
        sent.push(frame);
    }
    let TunnResult::WriteToNetwork(init) = w.peer.format_handshake_initiation(&mut out, true) else { panic!("no initiation") };
    run.extend_from_slice(init);
    let got = w.run(&run, size);
    assert_eq!(got, sent, "every data message of the run opens to its frame");
    if waiting > 0 {
        // They left, sealed for the peer, as many as waited.
        for _ in 0..waiting {
            let d = w.recv(4);
            let TunnResult::WriteToTunnelV4(p, _) = w.peer.decapsulate(None, &d, &mut out) else { panic!("a waiting frame did not open") };
            assert_eq!(p.len(), 28 + wsize);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    static W: OnceLock<Mutex<World>> = OnceLock::new();
    let Some((&mode, rest)) = data.split_first() else { return };
    if mode % 3 == 2 {
        return handshake_tail(rest);
    }
    let mut w = W
        .get_or_init(|| {
            let mut w = world();
            w.handshake(true);
            Mutex::new(w)
        })
        .lock()
        .unwrap();
    if mode % 3 == 0 {
        // Raw: as one datagram, and as a run of 100-byte datagrams.
        for seg in [rest.len(), 100] {
            if !rest.is_empty() && !w.run(rest, seg).is_empty() {
                panic!("a datagram nobody sealed became a frame");
            }
        }
        return;
    }
    let mut sealed = vec![0u8; rest.len() + 200];
    let TunnResult::WriteToNetwork(p) = w.peer.encapsulate(rest, &mut sealed) else { return };
    let p = p.to_vec();
    let got = w.run(&p, p.len());
    // boringtun opens only IP packets of a consistent length; vnetd takes
    // only unfragmented IPv4/UDP among them.
    match inner_frame(rest) {
        Some(want) if !got.is_empty() => assert_eq!(got, vec![rest[want].to_vec()]),
        None => assert!(got.is_empty(), "a frame from a packet that is no frame"),
        _ => {}
    }
});
