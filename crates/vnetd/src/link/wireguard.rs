//! WireGuard links (`LINK ADD <ip> [<port>] wireguard <peer-public-key>`):
//! frames encrypted and authenticated between hosts, by the WireGuard
//! protocol as `boringtun` implements it (Noise IK handshakes, cookies under
//! load, rekeying, the replay window; ChaCha20-Poly1305 from the
//! `chacha20poly1305` crate). No cryptography is written here.
//!
//! Inside the tunnel a frame travels as on a plain UDP link: an IPv4/UDP
//! datagram from this host's address toward the peer to the peer's address,
//! ports 9000 (vnetd's UDP port), holding the VNET/P frame. So a host running
//! any WireGuard (wireguard-go, the kernel's) with a plain vnetd UDP link over
//! the tunnel is a peer too.
//!
//! - `WgHub`: vnetd's side of WireGuard, made with the first link: its key
//!   pair, its UDP sockets (one per dispatcher on `--wireguard-port`), the
//!   rate limiter that answers handshakes with cookies under load, and a
//!   timer thread that runs every link's `update_timers` (handshake retries,
//!   rekeys, keepalives) every 100 ms.
//! - `WgLink`: one peer: its `Tunn` and the address it last spoke from
//!   (roaming: the last authenticated datagram's source, as WireGuard does).
//!   Received datagrams are told apart by receiver index (data, responses,
//!   cookies: our index) or, for a handshake initiation, by the initiator's
//!   static key, never by address.
//!
//! Everything that is not an authentic, fresh datagram of a link's session
//! is dropped and counted: per link (`wg_unauthenticated`, `wg_replays`,
//! `wg_no_session`; the frame drop reason `unauthenticated`) or, when no
//! link can be named, as `unknown_sender` / `malformed`.

use super::{Rx, Segments, Sent, Transport, TxCtx, TxQueue, SEG_PARTS};
use crate::stats::{Counters, DropReason, ThreadStats};
use crate::sys::udp::UdpEndpoint;
use arc_swap::ArcSwap;
use boringtun::noise::errors::WireGuardError;
use boringtun::noise::handshake::parse_handshake_anon;
use boringtun::noise::rate_limiter::RateLimiter;
use boringtun::noise::{Packet, Tunn, TunnResult};
use boringtun::x25519::{PublicKey, StaticSecret};
use std::io::IoSlice;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;
use vnet_core::offload::{csum_add, csum_fold, Pieces, VnetHdr};

/// Outer IPv4 + UDP, WireGuard's data header and tag, inner IPv4 + UDP:
/// what a WireGuard link takes from its MTU.
pub const OVERHEAD_V4: i64 = 20 + 8 + 32 + 20 + 8;
/// The inner IPv4 + UDP header before each frame.
const INNER: usize = 28;
/// WireGuard's data header (16) and AEAD tag (16).
const SEAL: usize = 32;
/// Room boringtun wants for a handshake message.
const MIN_OUT: usize = 148;
/// Handshake messages per second, over all peers, before cookies are asked
/// for (boringtun's own per-peer default is 10).
const HANDSHAKE_RATE: u64 = 100;
/// How often every link's timers run (WireGuard's timers are in seconds;
/// boringtun asks for "about every 100 ms").
const TICK: Duration = Duration::from_millis(100);
/// Frames that may wait in one link for its handshake; more are dropped
/// (`queue_full`) rather than lost in boringtun's own queue of 256.
const MAX_WAITING: u32 = 250;
/// Bytes one datagram can open to (a GRO segment is at most this).
pub const MAX_DATAGRAM: usize = 65536;

/// vnetd's WireGuard key pair.
pub struct WgKeys {
    secret: StaticSecret,
    pub public: PublicKey,
}

impl WgKeys {
    pub fn new(secret: [u8; 32]) -> WgKeys {
        let secret = StaticSecret::from(secret);
        let public = PublicKey::from(&secret);
        WgKeys { secret, public }
    }

    /// Reads the key file `wg genkey` writes (base64, 32 bytes) or, if there
    /// is none, makes one (mode 600) with a new key. The file must be a
    /// regular file owned by vnetd's user and readable by nobody else.
    pub fn load_or_create(path: &Path) -> Result<WgKeys, String> {
        if std::fs::symlink_metadata(path).is_err() {
            let keys = WgKeys::write_new(path)?;
            tracing::info!("made a new WireGuard key in {}", path.display());
            return Ok(keys);
        }
        let bytes = super::read_secret(path, 4096)?;
        let text = std::str::from_utf8(&bytes).map_err(|_| format!("{} is not a WireGuard key file (not text)", path.display()))?;
        let key = vnet_core::command::parse_wireguard_key(text).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(WgKeys::new(key))
    }

    pub fn public_text(&self) -> String {
        vnet_core::command::wireguard_key_text(self.public.as_bytes())
    }

    /// A new key pair, written to `path` (mode 600) in place of what it
    /// held: a new file renamed over it, so the file always holds a whole key.
    fn write_new(path: &Path) -> Result<WgKeys, String> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut key = [0u8; 32];
        getrandom::getrandom(&mut key).map_err(|e| format!("no randomness for a WireGuard key: {e}"))?;
        let text = vnet_core::command::wireguard_key_text(&key);
        let tmp = path.with_extension("new");
        let _ = std::fs::remove_file(&tmp);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)
            .map_err(|e| format!("cannot make WireGuard key file {}: {e}", tmp.display()))?;
        f.write_all(format!("{text}\n").as_bytes()).and_then(|_| f.sync_all()).map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, path).map_err(|e| format!("cannot replace {}: {e}", path.display()))?;
        Ok(WgKeys::new(key))
    }
}

/// vnetd's WireGuard side, shared by every WireGuard link.
pub struct WgHub {
    /// One socket per dispatcher on the WireGuard port (`SO_REUSEPORT`);
    /// the first also sends.
    pub group: Vec<Arc<UdpEndpoint>>,
    keys: ArcSwap<WgKeys>,
    /// Checks handshake messages' MAC1 and, under load, asks for cookies,
    /// before any public-key work (keyed by our public key).
    limiter: ArcSwap<RateLimiter>,
    /// The links, for the timer thread.
    peers: Mutex<Vec<Weak<WgLink>>>,
    next_index: AtomicU32,
    /// Cookie replies sent (handshakes asked to prove their address).
    pub cookies_sent: AtomicU64,
    /// Handshake initiations from keys no link has, or that did not open.
    pub unknown_initiations: AtomicU64,
    /// Where the key pair is kept (`WIREGUARD ROTATE` writes the new one).
    key_file: std::path::PathBuf,
}

impl WgHub {
    /// Binds the WireGuard sockets and starts the timer thread.
    pub fn start(addr: SocketAddr, sockets: usize, keys: WgKeys, key_file: &Path) -> anyhow::Result<Arc<WgHub>> {
        let group = UdpEndpoint::bind_group(addr, sockets)?;
        let mut seed = [0u8; 4];
        let _ = getrandom::getrandom(&mut seed);
        let hub = Arc::new(WgHub {
            group,
            limiter: ArcSwap::from_pointee(RateLimiter::new(&keys.public, HANDSHAKE_RATE)),
            keys: ArcSwap::from_pointee(keys),
            peers: Mutex::new(Vec::new()),
            next_index: AtomicU32::new(u32::from_ne_bytes(seed)),
            cookies_sent: AtomicU64::new(0),
            unknown_initiations: AtomicU64::new(0),
            key_file: key_file.to_path_buf(),
        });
        let weak = Arc::downgrade(&hub);
        std::thread::Builder::new().name("wireguard-timers".into()).spawn(move || timers(weak))?;
        Ok(hub)
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.group[0].local_addr()
    }

    pub fn public_text(&self) -> String {
        self.keys.load().public_text()
    }

    /// `SHOW`'s line.
    pub fn describe(&self) -> String {
        format!(
            "wireguard listen={} public_key={} peers={} cookies_sent={} unknown_initiations={}",
            self.local_addr(),
            self.public_text(),
            self.live_peers().len(),
            self.cookies_sent.load(Relaxed),
            self.unknown_initiations.load(Relaxed)
        )
    }

    /// `WIREGUARD ROTATE`: a new key pair, written to the key file, then
    /// taken by every link, each of which handshakes again at once with it
    /// (boringtun forgets a peer's sessions when its key changes; frames
    /// meanwhile wait for the new session). Peers must know the new public
    /// key (vnet-agent publishes it) for the handshakes to succeed.
    pub fn rotate(&self) -> Result<(), String> {
        let keys = WgKeys::write_new(&self.key_file)?;
        self.limiter.store(Arc::new(RateLimiter::new(&keys.public, HANDSHAKE_RATE)));
        let (secret, public) = (keys.secret.clone(), keys.public);
        self.keys.store(Arc::new(keys));
        let mut out = [0u8; MIN_OUT];
        for p in self.live_peers() {
            let mut g = p.lock();
            if let Err(e) = g.tunn.set_static_private(secret.clone(), public, None) {
                tracing::warn!("WireGuard peer {}: cannot take the new key: {e:?}", vnet_core::command::wireguard_key_text(&p.peer));
                continue;
            }
            let to = g.endpoint;
            if let TunnResult::WriteToNetwork(m) = g.tunn.format_handshake_initiation(&mut out, true) {
                p.counters.initiations.fetch_add(1, Relaxed);
                let _ = self.send(m, to);
            }
        }
        Ok(())
    }

    fn live_peers(&self) -> Vec<Arc<WgLink>> {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        peers.retain(|w| w.strong_count() > 0);
        peers.iter().filter_map(Weak::upgrade).collect()
    }

    /// A new link to the peer holding `peer` at `endpoint`; `inner` the
    /// inner header's addresses and ports.
    pub fn link(self: &Arc<Self>, peer: [u8; 32], endpoint: SocketAddr, inner: Inner) -> Result<Arc<WgLink>, String> {
        if !endpoint.is_ipv4() {
            return Err("wireguard links are IPv4 only for now".into());
        }
        let keys = self.keys.load();
        if peer == *keys.public.as_bytes() {
            return Err("that is this vnetd's own WireGuard key".into());
        }
        // A 24-bit index of our own (boringtun shifts it left by 8 and
        // counts sessions in the low byte): what the peer's datagrams name.
        let index = self.next_index.fetch_add(1, Relaxed) & 0x00ff_ffff;
        let tunn = Tunn::new(keys.secret.clone(), PublicKey::from(peer), None, None, index, None)
            .map_err(|e| format!("cannot make the WireGuard peer: {e}"))?;
        let link = Arc::new(WgLink {
            hub: self.clone(),
            peer,
            index,
            inner,
            state: Mutex::new(Peer { tunn, endpoint, waiting: 0, sessions: 0, fresh: true }),
            counters: WgCounters::default(),
        });
        // The timer thread makes the first handshake at its next tick, by
        // when the link is in the datapath's snapshot to take the answer.
        self.peers.lock().unwrap_or_else(|p| p.into_inner()).push(Arc::downgrade(&link));
        Ok(link)
    }

    fn send(&self, datagram: &[u8], to: SocketAddr) -> std::io::Result<usize> {
        self.group[0].send_iov(&[IoSlice::new(datagram)], to, None)
    }

    /// Which link a datagram that came to the WireGuard port from `from`
    /// is for: the receiver index it names or, for a handshake initiation
    /// (its MAC1 checked and, under load, a cookie asked for first), the
    /// initiator's static key. What names no link is counted here.
    pub fn address(&self, st: &ThreadStats, from: SocketAddr, dgram: &[u8]) -> Addressed {
        let dropped = |why| {
            st.global.received(dgram.len());
            st.drop_at(None, why);
            Addressed::Done
        };
        let Ok(packet) = Tunn::parse_incoming_packet(dgram) else { return dropped(DropReason::Malformed) };
        match &packet {
            Packet::HandshakeInit(h) => {
                // MAC1 (the sender knows our public key) and, under load, a
                // cookie (it owns its address) before the DH work.
                let mut cookie = [0u8; 64];
                match self.limiter.load().verify_packet(Some(from.ip()), dgram, &mut cookie) {
                    Ok(_) => {}
                    Err(TunnResult::WriteToNetwork(c)) => {
                        self.cookies_sent.fetch_add(1, Relaxed);
                        let _ = self.send(c, from);
                        return Addressed::Done;
                    }
                    Err(_) => return dropped(DropReason::Unauthenticated),
                }
                let keys = self.keys.load();
                match parse_handshake_anon(&keys.secret, &keys.public, h) {
                    Ok(hh) => Addressed::Key(hh.peer_static_public),
                    Err(_) => {
                        self.unknown_initiations.fetch_add(1, Relaxed);
                        dropped(DropReason::UnknownSender)
                    }
                }
            }
            Packet::HandshakeResponse(p) => Addressed::Index(p.receiver_idx >> 8),
            Packet::PacketCookieReply(p) => Addressed::Index(p.receiver_idx >> 8),
            Packet::PacketData(p) => Addressed::Index(p.receiver_idx >> 8),
        }
    }

    /// A datagram for a key or index no link has.
    pub fn unknown(&self, st: &ThreadStats, dgram: &[u8], by_key: bool) {
        if by_key {
            self.unknown_initiations.fetch_add(1, Relaxed);
        }
        st.global.received(dgram.len());
        st.drop_at(None, DropReason::UnknownSender);
    }

    /// Opens a datagram of `link` (whose frame counters are `stats`) into
    /// `out`: a frame for the forwarder, a handshake answered, or a drop
    /// counted.
    pub fn open(&self, link: &WgLink, stats: &Counters, st: &ThreadStats, from: SocketAddr, dgram: &[u8], out: &mut [u8]) -> Opened {
        let kind = dgram[0];
        let c = &link.counters;
        let mut g = link.lock();
        let base = out.as_ptr() as usize;
        match g.tunn.decapsulate(Some(from.ip()), dgram, out) {
            TunnResult::WriteToTunnelV4(pkt, _) => {
                let at = pkt.as_ptr() as usize - base;
                let frame = inner_frame(pkt);
                g.roam(from, c);
                drop(g);
                match frame {
                    Some(r) => Opened::Frame(at + r.start..at + r.end),
                    None => {
                        st.global.received(dgram.len());
                        st.drop_at(Some(stats), DropReason::Malformed);
                        Opened::Dropped
                    }
                }
            }
            TunnResult::WriteToTunnelV6(..) => {
                g.roam(from, c);
                st.global.received(dgram.len());
                st.drop_at(Some(stats), DropReason::Malformed);
                Opened::Dropped
            }
            TunnResult::WriteToNetwork(p) => {
                // Our handshake response to an initiation that opened (the
                // peer proved its key), or the keepalive that completes our
                // own handshake; or a cookie reply (the peer's rate limit is
                // reached: nothing was proved, so no session, no roam).
                let reply = p[0];
                let _ = self.send(p, from);
                if reply == 3 {
                    c.cookies_sent.fetch_add(1, Relaxed);
                    return Opened::Handled;
                }
                if (kind, reply) == (1, 2) || (kind, reply) == (2, 4) {
                    g.established(c);
                    g.roam(from, c);
                }
                // Frames that waited for the session leave now.
                let (mut frames, mut bytes) = (0, 0);
                let to = g.endpoint;
                while let TunnResult::WriteToNetwork(p) = g.tunn.decapsulate(None, &[], out) {
                    // (A handshake of ours may come out among them: not a frame.)
                    if self.send(p, to).is_ok() && p[0] == 4 {
                        (frames, bytes) = (frames + 1, bytes + p.len());
                    }
                }
                g.waiting = g.waiting.saturating_sub(frames as u32);
                drop(g);
                if frames > 0 {
                    st.sent_at(stats, frames, bytes);
                }
                Opened::Handled
            }
            TunnResult::Done => {
                match kind {
                    // An authentic keepalive.
                    4 => g.roam(from, c),
                    3 => {
                        c.cookies_received.fetch_add(1, Relaxed);
                    }
                    _ => {}
                }
                Opened::Handled
            }
            TunnResult::Err(e) => {
                drop(g);
                let counter = match e {
                    WireGuardError::DuplicateCounter | WireGuardError::InvalidCounter => &c.replays,
                    WireGuardError::NoCurrentSession | WireGuardError::WrongIndex | WireGuardError::ConnectionExpired => &c.no_session,
                    _ => &c.unauthenticated,
                };
                counter.fetch_add(1, Relaxed);
                tracing::debug!(peer = %vnet_core::command::wireguard_key_text(&link.peer), %from, "WireGuard datagram refused: {e:?}");
                st.global.received(dgram.len());
                st.drop_at(Some(stats), DropReason::Unauthenticated);
                Opened::Dropped
            }
        }
    }
}

/// Which link a datagram on the WireGuard port is for.
pub enum Addressed {
    /// The link with this receiver index (24 bits).
    Index(u32),
    /// The link to the peer with this static key (a handshake initiation).
    Key([u8; 32]),
    /// Handled or dropped (and counted) already.
    Done,
}

/// What a link's datagram came to.
pub enum Opened {
    /// A frame, at this range of the output.
    Frame(Range<usize>),
    /// A handshake or keepalive, handled.
    Handled,
    /// Dropped and counted.
    Dropped,
}

/// The inner header's addresses and ports (IPv4).
#[derive(Clone, Copy, Debug)]
pub struct Inner {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub sport: u16,
    pub dport: u16,
}

impl Inner {
    /// The local address the kernel would send to `to` from.
    pub fn toward(to: SocketAddr, port: u16) -> Result<Inner, String> {
        let probe = std::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).map_err(|e| format!("{e}"))?;
        probe.connect(to).map_err(|e| format!("no route to {to}: {e}"))?;
        let (IpAddr::V4(src), IpAddr::V4(dst)) = (probe.local_addr().map_err(|e| format!("{e}"))?.ip(), to.ip()) else {
            return Err("wireguard links are IPv4 only for now".into());
        };
        Ok(Inner { src, dst, sport: port, dport: port })
    }

    /// Writes the IPv4 + UDP header for a frame of `len` bytes.
    fn write(&self, len: usize, h: &mut [u8; INNER]) {
        let total = (INNER + len) as u16;
        h[0] = 0x45;
        h[1] = 0;
        h[2..4].copy_from_slice(&total.to_be_bytes());
        h[4..6].copy_from_slice(&[0, 0]);
        h[6..8].copy_from_slice(&0x4000u16.to_be_bytes()); // DF: never fragmented inside
        h[8] = 64;
        h[9] = 17;
        h[10..12].copy_from_slice(&[0, 0]);
        h[12..16].copy_from_slice(&self.src.octets());
        h[16..20].copy_from_slice(&self.dst.octets());
        let sum = csum_fold(csum_add(0, &h[..20]));
        h[10..12].copy_from_slice(&sum.to_be_bytes());
        h[20..22].copy_from_slice(&self.sport.to_be_bytes());
        h[22..24].copy_from_slice(&self.dport.to_be_bytes());
        h[24..26].copy_from_slice(&((8 + len) as u16).to_be_bytes());
        // No UDP checksum (IPv4 allows it): the AEAD tag covers every byte.
        h[26..28].copy_from_slice(&[0, 0]);
    }
}

/// The VNET/P frame inside a decrypted packet: IPv4, not a fragment, UDP.
pub fn inner_frame(p: &[u8]) -> Option<Range<usize>> {
    if p.len() < INNER || p[0] >> 4 != 4 {
        return None;
    }
    let ihl = (p[0] & 0x0f) as usize * 4;
    let total = u16::from_be_bytes([p[2], p[3]]) as usize;
    let frag = u16::from_be_bytes([p[6], p[7]]) & 0x3fff;
    if ihl < 20 || total > p.len() || total < ihl + 8 || frag != 0 || p[9] != 17 {
        return None;
    }
    let udp_len = u16::from_be_bytes([p[ihl + 4], p[ihl + 5]]) as usize;
    if udp_len < 8 || ihl + udp_len > total {
        return None;
    }
    Some(ihl + 8..ihl + udp_len)
}

/// One peer's protocol state.
struct Peer {
    tunn: Tunn,
    /// Where its datagrams go: configured, then the last authentic source.
    endpoint: SocketAddr,
    /// Frames boringtun holds until a session exists.
    waiting: u32,
    /// Sessions made (the first handshake, then rekeys).
    sessions: u64,
    /// No handshake tried yet.
    fresh: bool,
}

impl Peer {
    fn roam(&mut self, from: SocketAddr, c: &WgCounters) {
        if from != self.endpoint {
            tracing::info!(old = %self.endpoint, new = %from, "WireGuard peer roamed");
            self.endpoint = from;
            c.roams.fetch_add(1, Relaxed);
        }
    }

    fn established(&mut self, c: &WgCounters) {
        self.sessions += 1;
        c.handshakes.fetch_add(1, Relaxed);
        if self.sessions > 1 {
            c.rekeys.fetch_add(1, Relaxed);
        }
    }
}

/// A WireGuard link's own counters (STATS and /metrics, `wg_*`).
#[derive(Default)]
pub struct WgCounters {
    /// Sessions made, by either side's handshake.
    pub handshakes: AtomicU64,
    /// Of those, after the first (rekeys, and new sessions after expiry).
    pub rekeys: AtomicU64,
    /// Handshake initiations sent.
    pub initiations: AtomicU64,
    /// Datagrams whose authentication failed (forged, or under another key).
    pub unauthenticated: AtomicU64,
    /// Datagrams whose counter was seen or is too old: replays.
    pub replays: AtomicU64,
    /// Data for a session this end does not have (expired, or made with an
    /// old key).
    pub no_session: AtomicU64,
    pub cookies_received: AtomicU64,
    /// Cookie replies sent to initiations for this link (over its own rate).
    pub cookies_sent: AtomicU64,
    /// The peer spoke from a new address, and is followed there.
    pub roams: AtomicU64,
}

/// A WireGuard link: one peer.
pub struct WgLink {
    hub: Arc<WgHub>,
    peer: [u8; 32],
    /// Our receiver index (24 bits).
    index: u32,
    inner: Inner,
    state: Mutex<Peer>,
    pub counters: WgCounters,
}

impl WgLink {
    pub fn index(&self) -> u32 {
        self.index
    }

    pub fn peer(&self) -> &[u8; 32] {
        &self.peer
    }

    fn lock(&self) -> MutexGuard<'_, Peer> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Seals one frame (as `parts`) and queues it; `gso`: it may share a GSO
    /// message with its neighbours.
    fn seal(&self, q: &mut TxQueue, slot: u32, parts: &[&[u8]], len: usize, gso: bool) -> Sent {
        let mut h = [0u8; INNER];
        self.inner.write(len, &mut h);
        // The pass's buffers, lent out while `q` queues.
        let (mut plain, mut sealed) = (std::mem::take(&mut q.plain), std::mem::take(&mut q.sealed));
        plain.clear();
        plain.extend_from_slice(&h);
        for p in parts {
            plain.extend_from_slice(p);
        }
        let need = (plain.len() + SEAL).max(MIN_OUT);
        if sealed.len() < need {
            sealed.resize(need, 0);
        }
        let sent = self.seal_into(q, slot, &plain, &mut sealed, gso);
        (q.plain, q.sealed) = (plain, sealed);
        sent
    }

    fn seal_into(&self, q: &mut TxQueue, slot: u32, plain: &[u8], sealed: &mut [u8], gso: bool) -> Sent {
        let mut g = self.lock();
        let to = g.endpoint;
        if g.waiting >= MAX_WAITING {
            return Sent::dropped(DropReason::QueueFull, 1);
        }
        let (out, data) = match g.tunn.encapsulate(plain, sealed) {
            TunnResult::WriteToNetwork(p) => (p.len(), p[0] == 4),
            TunnResult::Done => (0, false),
            _ => return Sent::dropped(DropReason::TxError, 1),
        };
        if !data {
            // No session yet: boringtun keeps the frame for the handshake it
            // started (`out` bytes of initiation), or one in progress.
            g.waiting += 1;
            drop(g);
            if out > 0 {
                self.counters.initiations.fetch_add(1, Relaxed);
                let _ = self.hub.send(&sealed[..out], to);
            }
            return Sent::later();
        }
        drop(g);
        q.push(&self.hub.group[0], &[&sealed[..out]], to, slot, gso);
        Sent::later()
    }

    /// Runs the link's timers (from the timer thread).
    fn tick(&self, out: &mut [u8]) {
        let mut g = self.lock();
        let to = g.endpoint;
        let r = if std::mem::take(&mut g.fresh) { g.tunn.format_handshake_initiation(out, false) } else { g.tunn.update_timers(out) };
        match r {
            TunnResult::WriteToNetwork(p) => {
                if p[0] == 1 {
                    self.counters.initiations.fetch_add(1, Relaxed);
                }
                let _ = self.hub.send(p, to);
            }
            TunnResult::Err(WireGuardError::ConnectionExpired) => {
                // boringtun gave up the handshake and the frames it held.
                g.waiting = 0;
            }
            _ => {}
        }
    }
}

impl Transport for WgLink {
    fn kind(&self) -> &'static str {
        "wireguard"
    }

    fn rx(&self) -> Rx<'_> {
        Rx::Sealed(self)
    }

    fn send(&self, q: &mut TxQueue, cx: &TxCtx, _vnet: &VnetHdr, frame: Pieces) -> Sent {
        let len = frame.len();
        if len + INNER + SEAL > self.hub.group[0].max_payload() {
            return Sent::dropped(DropReason::Oversize, 1);
        }
        if len > cx.max_frame {
            cx.offload.fragmented.fetch_add(1, Relaxed);
        }
        let gso = len <= cx.max_frame && cx.gso.ok();
        self.seal(q, cx.slot, frame.parts(), len, gso)
    }

    fn send_segments(&self, q: &mut TxQueue, cx: &TxCtx, segs: &Segments) -> Sent {
        let mut out = Sent::default();
        let mut parts = [&[][..]; SEG_PARTS];
        for k in 0..segs.len() {
            let n = segs.parts(k, &mut parts);
            let len = segs.plan.frame_len(k);
            out.add(self.seal(q, cx.slot, &parts[..n], len, cx.gso.ok()));
        }
        out
    }

    fn describe(&self) -> String {
        let g = self.lock();
        let (since, tx, rx, _, rtt) = g.tunn.stats();
        format!(
            " peer_key={} endpoint={} handshake_age_s={} tunnel_tx_bytes={tx} tunnel_rx_bytes={rx}{}",
            vnet_core::command::wireguard_key_text(&self.peer),
            g.endpoint,
            since.map_or("never".to_string(), |d| d.as_secs().to_string()),
            rtt.map_or(String::new(), |r| format!(" handshake_rtt_ms={r}"))
        )
    }

    fn extra_stats(&self) -> String {
        let c = &self.counters;
        format!(
            " wg_handshakes={} wg_rekeys={} wg_initiations={} wg_unauthenticated={} wg_replays={} wg_no_session={} wg_cookies_received={} wg_cookies_sent={} wg_roams={}",
            c.handshakes.load(Relaxed),
            c.rekeys.load(Relaxed),
            c.initiations.load(Relaxed),
            c.unauthenticated.load(Relaxed),
            c.replays.load(Relaxed),
            c.no_session.load(Relaxed),
            c.cookies_received.load(Relaxed),
            c.cookies_sent.load(Relaxed),
            c.roams.load(Relaxed)
        )
    }

    fn teardown(&self) -> usize {
        std::mem::take(&mut self.lock().waiting) as usize
    }
}

/// The timer thread: every link's `update_timers` each `TICK`, until the hub
/// is gone.
fn timers(hub: Weak<WgHub>) {
    let mut out = vec![0u8; MAX_DATAGRAM];
    for n in 1u64.. {
        std::thread::sleep(TICK);
        let Some(hub) = hub.upgrade() else { return };
        // The shared limiter counts handshake messages per second.
        if n % 10 == 0 {
            hub.limiter.load().reset_count();
        }
        for p in hub.live_peers() {
            p.tick(&mut out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_inner_header_is_valid_ipv4_udp_and_opens_back_to_the_frame() {
        let inner = Inner { src: Ipv4Addr::new(198, 18, 0, 1), dst: Ipv4Addr::new(198, 18, 0, 2), sport: 9000, dport: 9000 };
        let frame: Vec<u8> = (0..100u8).collect();
        let mut h = [0u8; INNER];
        inner.write(frame.len(), &mut h);
        let mut p = h.to_vec();
        p.extend_from_slice(&frame);
        assert_eq!(csum_fold(csum_add(0, &p[..20])), 0, "header checksum verifies");
        assert_eq!(&p[p.len() - 100..], &frame[..]);
        assert_eq!(inner_frame(&p), Some(28..128));
        // A fragment, a non-UDP packet, a lying length: not frames.
        let mut frag = p.clone();
        frag[6] = 0x20;
        assert_eq!(inner_frame(&frag), None);
        let mut tcp = p.clone();
        tcp[9] = 6;
        assert_eq!(inner_frame(&tcp), None);
        let mut long = p.clone();
        long[24..26].copy_from_slice(&200u16.to_be_bytes());
        assert_eq!(inner_frame(&long), None);
        assert_eq!(inner_frame(&p[..20]), None);
    }
}
