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
//! - `WgHub`: vnetd's side of WireGuard, made with the daemon: its key pair,
//!   its UDP sockets (one per dispatcher on `--wireguard-port`) and its
//!   handshake thread (`handshake.rs`).
//! - `WgLink`: one peer: its `Tunn` and the address it last sent
//!   authenticated data from.
//!
//! **Two paths.** A dispatcher opens data messages (type 4) itself, by the
//! receiver index they name: one AEAD and no public-key work per datagram.
//! Every handshake message (initiation, response, cookie reply) is copied
//! into a bounded queue and handled by the handshake thread, at normal
//! priority, which does all the public-key work (`handshake.rs`: MAC1,
//! cookies under load, a budget per source address, then the Diffie-Hellman);
//! it also runs every link's timers and sends the frames that waited for a
//! session, each into a buffer of its own. So no datagram makes a
//! real-time dispatcher do an X25519, and no flood of handshakes takes more
//! from the data path than a copy into the queue.
//!
//! **Roaming follows data.** A link sends to the address its last
//! authenticated *data* message (or keepalive) came from, as the WireGuard
//! paper has it; a handshake message moves nothing, so a recorded initiation
//! replayed from elsewhere cannot steer a link. Each peer key's newest
//! accepted initiation outlives its link (`WgHub::accepted`): a link made
//! again refuses every initiation not newer than it (boringtun's TAI64N
//! check), as the old one did.
//!
//! Everything that is not an authentic, fresh datagram of a link's session
//! is dropped and counted: per link (`wg_unauthenticated`, `wg_replays`,
//! `wg_no_session`; the frame drop reason `unauthenticated`) or, when no
//! link can be named, as `unknown_sender` / `malformed` / `rate_limited` /
//! `queue_full`.

mod handshake;

pub use handshake::{By, Found, Handshaker, Links};

use super::{Rx, Segments, Sent, Transport, TxCtx, TxQueue, SEG_PARTS};
use crate::stats::{counter_set, Counters, DropReason, ThreadStats};
use crate::sys::udp::UdpEndpoint;
use arc_swap::ArcSwap;
use boringtun::noise::errors::WireGuardError;
use boringtun::noise::rate_limiter::RateLimiter;
use boringtun::noise::{Tunn, TunnResult};
use boringtun::x25519::{PublicKey, StaticSecret};
use std::collections::HashMap;
use std::io::IoSlice;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Instant;
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
/// Frames that may wait in one link for its handshake; more are dropped
/// (`queue_full`) rather than lost in boringtun's own queue of 256.
const MAX_WAITING: u32 = 250;
/// Bytes one datagram can open to (a GRO segment is at most this).
pub const MAX_DATAGRAM: usize = 65536;
/// The sizes of WireGuard's messages: initiation, response, cookie reply;
/// a data message is at least its header and tag.
pub const INIT_LEN: usize = 148;
const RESPONSE_LEN: usize = 92;
const COOKIE_REPLY_LEN: usize = 64;
const DATA_MIN: usize = 32;
/// Peer keys whose newest initiation is remembered across their links
/// being made again (beyond it, those of keys no link has are forgotten).
const ACCEPTED_KEYS: usize = 16384;

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

counter_set! {
    /// vnetd's WireGuard side as a whole (`SHOW`'s `wireguard` line and
    /// `STATS wireguard`).
    pub struct HubCounters {
        /// Cookie replies sent: handshake messages taken only with a MAC2
        /// (under load) that had none valid.
        cookies_sent,
        /// Handshake initiations from keys no link has, or that did not open.
        unknown_initiations,
        /// Handshake messages that found the handshake queue full (dropped).
        handshake_queue_full,
        /// Handshake messages over their source address's budget, under
        /// load (dropped before any public-key work).
        rate_limited,
        /// Handshake messages that reached the Diffie-Hellman.
        handshakes_worked,
        /// Seconds the handshake thread has asked for cookies (under load).
        under_load_seconds,
    }
}

/// vnetd's WireGuard side, shared by every WireGuard link.
pub struct WgHub {
    /// One socket per dispatcher on the WireGuard port (`SO_REUSEPORT`);
    /// the first also sends.
    pub group: Vec<Arc<UdpEndpoint>>,
    keys: ArcSwap<WgKeys>,
    /// Checks handshake messages' MAC1 (keyed by our public key) and never
    /// asks for a cookie: what every link's `Tunn` checks with, so that the
    /// only cookie secret is `cookies`'s.
    mac1: ArcSwap<RateLimiter>,
    /// Checks MAC1 and demands a valid MAC2 (answering a cookie reply when
    /// there is none): what the handshake thread checks with under load.
    cookies: ArcSwap<RateLimiter>,
    /// Handshake messages (and flushes) for the handshake thread.
    jobs: handshake::Queue,
    /// The links, for the timers.
    peers: Mutex<Vec<Weak<WgLink>>>,
    /// The newest initiation accepted from each peer key, given to the next
    /// link made to that key so it refuses every initiation not newer.
    accepted: Mutex<HashMap<[u8; 32], [u8; INIT_LEN]>>,
    next_index: AtomicU32,
    pub counters: HubCounters,
    /// The handshake thread's frame counts (frames it sent that waited for
    /// a session, drops of handshake messages), summed into `STATS global`.
    pub stats: ThreadStats,
    /// Where the key pair is kept (`WIREGUARD ROTATE` writes the new one).
    key_file: std::path::PathBuf,
}

impl WgHub {
    /// Binds the WireGuard sockets. The handshake thread starts with `spawn`.
    pub fn new(addr: SocketAddr, sockets: usize, keys: WgKeys, key_file: &Path) -> anyhow::Result<Arc<WgHub>> {
        let group = UdpEndpoint::bind_group(addr, sockets)?;
        let mut seed = [0u8; 4];
        let _ = getrandom::getrandom(&mut seed);
        Ok(Arc::new(WgHub {
            group,
            mac1: ArcSwap::from_pointee(RateLimiter::new(&keys.public, u64::MAX)),
            cookies: ArcSwap::from_pointee(RateLimiter::new(&keys.public, 0)),
            keys: ArcSwap::from_pointee(keys),
            jobs: handshake::Queue::default(),
            peers: Mutex::new(Vec::new()),
            accepted: Mutex::new(HashMap::new()),
            next_index: AtomicU32::new(u32::from_ne_bytes(seed)),
            counters: HubCounters::default(),
            stats: ThreadStats::default(),
            key_file: key_file.to_path_buf(),
        }))
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.group[0].local_addr()
    }

    pub fn public_text(&self) -> String {
        self.keys.load().public_text()
    }

    /// `SHOW`'s line.
    pub fn describe(&self) -> String {
        let mut s = format!("wireguard listen={} public_key={} peers={}", self.local_addr(), self.public_text(), self.live_peers().len());
        self.counters.render_into(&mut s);
        s
    }

    /// `STATS wireguard`'s counters (` name=value` each).
    pub fn stats_line(&self) -> String {
        let mut s = format!(" peers={} handshakes_waiting={}", self.live_peers().len(), self.jobs.len());
        self.counters.render_into(&mut s);
        s
    }

    /// `WIREGUARD ROTATE`: a new key pair, written to the key file, then
    /// taken by every link, each of which handshakes again at once with it
    /// (boringtun forgets a peer's sessions when its key changes; frames
    /// meanwhile wait for the new session). Peers must know the new public
    /// key (vnet-agent publishes it) for the handshakes to succeed.
    pub fn rotate(&self) -> Result<(), String> {
        let keys = WgKeys::write_new(&self.key_file)?;
        let mac1 = Arc::new(RateLimiter::new(&keys.public, u64::MAX));
        self.mac1.store(mac1.clone());
        self.cookies.store(Arc::new(RateLimiter::new(&keys.public, 0)));
        let (secret, public) = (keys.secret.clone(), keys.public);
        self.keys.store(Arc::new(keys));
        // Initiations made to the old key fail MAC1 now: none to remember.
        self.accepted.lock().unwrap_or_else(|p| p.into_inner()).clear();
        let mut out = [0u8; MIN_OUT];
        for p in self.live_peers() {
            let mut g = p.lock();
            if let Err(e) = g.tunn.set_static_private(secret.clone(), public, Some(mac1.clone())) {
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
        let mut tunn = Tunn::new(keys.secret.clone(), PublicKey::from(peer), None, None, index, Some(self.mac1.load_full()))
            .map_err(|e| format!("cannot make the WireGuard peer: {e}"))?;
        self.restore_newest_initiation(&mut tunn, &peer);
        let link = Arc::new(WgLink {
            hub: self.clone(),
            peer,
            index,
            inner,
            state: Mutex::new(Peer {
                tunn,
                endpoint,
                waiting: 0,
                sessions: 0,
                fresh: true,
                flush_asked: false,
                cookie_retry: None,
            }),
            counters: WgCounters::default(),
        });
        // The handshake thread makes the first handshake at its next tick,
        // by when the link is in the datapath's snapshot to take the answer.
        self.peers.lock().unwrap_or_else(|p| p.into_inner()).push(Arc::downgrade(&link));
        Ok(link)
    }

    /// A link made again to a key must refuse what its predecessor refused:
    /// every initiation no newer than the newest it accepted. boringtun keeps
    /// that timestamp in its handshake state with no way to set it, so the
    /// new `Tunn` is shown that initiation once (as its first): it takes its
    /// timestamp and answers with a response that is never sent (the session
    /// that response would open is one nobody holds the keys of).
    fn restore_newest_initiation(&self, tunn: &mut Tunn, peer: &[u8; 32]) {
        let Some(init) = self.accepted.lock().unwrap_or_else(|p| p.into_inner()).get(peer).copied() else { return };
        let mut out = [0u8; MIN_OUT];
        if !matches!(tunn.decapsulate(None, &init, &mut out), TunnResult::WriteToNetwork(_)) {
            tracing::warn!(
                "WireGuard peer {}: its newest initiation did not restore: an older one may be accepted once",
                vnet_core::command::wireguard_key_text(peer)
            );
        }
    }

    /// Remembers `init` as the newest initiation accepted from `peer`.
    fn accepted_from(&self, peer: &[u8; 32], init: &[u8]) {
        let Ok(init) = <[u8; INIT_LEN]>::try_from(init) else { return };
        let mut a = self.accepted.lock().unwrap_or_else(|p| p.into_inner());
        if a.len() >= ACCEPTED_KEYS && !a.contains_key(peer) {
            // Keep the keys that have links; forget the others.
            let live: std::collections::HashSet<[u8; 32]> = self.live_peers().iter().map(|p| p.peer).collect();
            a.retain(|k, _| live.contains(k));
        }
        a.insert(*peer, init);
    }

    fn send(&self, datagram: &[u8], to: SocketAddr) -> std::io::Result<usize> {
        self.group[0].send_iov(&[IoSlice::new(datagram)], to, None)
    }

    /// A datagram a dispatcher received on the WireGuard port that is not a
    /// data message: queued whole for the handshake thread if it has the
    /// size of a handshake message (dropped, counted, if the queue is
    /// full), else dropped as malformed.
    pub fn enqueue(&self, st: &ThreadStats, from: SocketAddr, dgram: &[u8]) {
        let size_ok = matches!((dgram[0], dgram.len()), (1, INIT_LEN) | (2, RESPONSE_LEN) | (3, COOKIE_REPLY_LEN));
        if !size_ok || dgram[1..4] != [0, 0, 0] {
            st.global.received(dgram.len());
            st.drop_at(None, DropReason::Malformed);
            return;
        }
        if !self.jobs.push_message(from, dgram) {
            self.counters.handshake_queue_full.fetch_add(1, Relaxed);
            st.global.received(dgram.len());
            st.drop_at(None, DropReason::QueueFull);
        }
    }

    /// Whether a datagram on the WireGuard port is a data message (which a
    /// dispatcher opens itself), and the receiver index (24 bits) it names.
    #[inline]
    pub fn data_index(dgram: &[u8]) -> Option<u32> {
        if dgram.len() >= DATA_MIN && dgram[0] == 4 && dgram[1..4] == [0, 0, 0] {
            Some(u32::from_le_bytes([dgram[4], dgram[5], dgram[6], dgram[7]]) >> 8)
        } else {
            None
        }
    }

    /// A datagram for a key or index no link has.
    pub fn unknown(&self, st: &ThreadStats, dgram: &[u8], by_key: bool) {
        if by_key {
            self.counters.unknown_initiations.fetch_add(1, Relaxed);
        }
        st.global.received(dgram.len());
        st.drop_at(None, DropReason::UnknownSender);
    }

    /// Opens a data message (or keepalive) of `link` (whose frame counters
    /// are `stats`) into `out`, which holds at least the datagram's length:
    /// a frame for the forwarder, or a drop counted. An authentic datagram
    /// from a new address moves the link's endpoint there (roaming).
    pub fn open_data(&self, link: &WgLink, stats: &Counters, st: &ThreadStats, from: SocketAddr, dgram: &[u8], out: &mut [u8]) -> Opened {
        let c = &link.counters;
        let mut g = link.lock();
        let base = out.as_ptr() as usize;
        match g.tunn.decapsulate(Some(from.ip()), dgram, out) {
            TunnResult::WriteToTunnelV4(pkt, _) => {
                let at = pkt.as_ptr() as usize - base;
                let frame = inner_frame(pkt);
                g.roam(from, c);
                self.ask_flush(link, &mut g);
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
            TunnResult::Done => {
                // An authentic keepalive: the initiator's confirmation of a
                // session we answered, or a peer's sign of life.
                g.roam(from, c);
                self.ask_flush(link, &mut g);
                Opened::Handled
            }
            // boringtun answers nothing to data; nothing is sent.
            TunnResult::WriteToNetwork(_) => Opened::Handled,
            TunnResult::Err(e) => {
                drop(g);
                refused(link, stats, st, from, dgram, e);
                Opened::Dropped
            }
        }
    }

    /// One buffer a dispatcher received from `from` on the WireGuard port:
    /// a datagram, or a GRO run of them `seg` bytes apart. Each data message
    /// is opened into `buf` after the frames before it (the run given to
    /// `sink` and `buf` started again when the next might not fit) and its
    /// frame handed to `sink`; each other message is queued for the
    /// handshake thread. The run ends with the buffer.
    pub fn open_run<L: Links, S: RunSink>(&self, links: &L, st: &ThreadStats, from: SocketAddr, run: &[u8], seg: usize, buf: &mut [u8], sink: &mut S) {
        let mut at = 0;
        for r in vnet_core::wire::gro_segments(run.len(), seg) {
            let dgram = &run[r];
            let Some(index) = WgHub::data_index(dgram) else {
                self.enqueue(st, from, dgram);
                continue;
            };
            // A data message opens to fewer bytes than it has.
            if at + dgram.len() > buf.len() {
                sink.end(buf);
                at = 0;
            }
            let Some(f) = links.wireguard(By::Index(index)) else {
                self.unknown(st, dgram, false);
                continue;
            };
            if let Opened::Frame(r) = self.open_data(f.link, f.stats, st, from, dgram, &mut buf[at..]) {
                let r = at + r.start..at + r.end;
                at = r.end;
                sink.frame(f.slot, buf, r);
            }
        }
        sink.end(buf);
    }

    /// Frames wait in `link` and its data just came in (a session made by
    /// the peer's handshake is current from its first data): the handshake
    /// thread sends them.
    fn ask_flush(&self, link: &WgLink, g: &mut Peer) {
        if g.waiting > 0 && !g.flush_asked && self.jobs.push_flush(link.index) {
            g.flush_asked = true;
        }
    }
}

/// Where the frames of a received run go: the forwarder, routing them as
/// one run.
pub trait RunSink {
    /// A frame of the link at `slot`: `buf[frame]`.
    fn frame(&mut self, slot: u32, buf: &mut [u8], frame: Range<usize>);
    /// The run (so far) ends: the frames handed over are done with `buf`.
    fn end(&mut self, buf: &[u8]);
}

/// Counts a datagram of `link` that boringtun refused, by why.
fn refused(link: &WgLink, stats: &Counters, st: &ThreadStats, from: SocketAddr, dgram: &[u8], e: WireGuardError) {
    let c = &link.counters;
    let counter = match e {
        WireGuardError::DuplicateCounter | WireGuardError::InvalidCounter | WireGuardError::WrongTai64nTimestamp => &c.replays,
        WireGuardError::NoCurrentSession | WireGuardError::WrongIndex | WireGuardError::ConnectionExpired => &c.no_session,
        _ => &c.unauthenticated,
    };
    counter.fetch_add(1, Relaxed);
    tracing::debug!(peer = %vnet_core::command::wireguard_key_text(&link.peer), %from, "WireGuard datagram refused: {e:?}");
    st.global.received(dgram.len());
    st.drop_at(Some(stats), DropReason::Unauthenticated);
}

/// What a link's datagram came to.
pub enum Opened {
    /// A frame, at this range of the output.
    Frame(Range<usize>),
    /// A keepalive, taken.
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
    /// Where its datagrams go: configured, then the last source of its
    /// authentic data.
    endpoint: SocketAddr,
    /// Frames boringtun holds until a session exists.
    waiting: u32,
    /// Sessions made (the first handshake, then rekeys).
    sessions: u64,
    /// No handshake tried or made yet: the timers make one at their next tick.
    fresh: bool,
    /// A flush of the waiting frames is queued for the handshake thread.
    flush_asked: bool,
    /// When a cookie reply may next make us initiate again at once (rather
    /// than at the 5-s retry): at most once a second.
    cookie_retry: Option<Instant>,
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
        self.fresh = false;
        self.sessions += 1;
        c.handshakes.fetch_add(1, Relaxed);
        if self.sessions > 1 {
            c.rekeys.fetch_add(1, Relaxed);
        }
    }
}

counter_set! {
    /// A WireGuard link's own counters (STATS and /metrics, `wg_*`).
    pub struct WgCounters {
        /// Sessions made, by either side's handshake.
        handshakes as "wg_handshakes",
        /// Of those, after the first (rekeys, and new sessions after expiry).
        rekeys as "wg_rekeys",
        /// Handshake initiations sent.
        initiations as "wg_initiations",
        /// Datagrams whose authentication failed (forged, or under another key).
        unauthenticated as "wg_unauthenticated",
        /// Datagrams whose counter was seen or is too old, and initiations
        /// no newer than the last one taken: replays.
        replays as "wg_replays",
        /// Data for a session this end does not have (expired, or made with an
        /// old key).
        no_session as "wg_no_session",
        /// Cookie replies the peer sent us (it was under load).
        cookies_received as "wg_cookies_received",
        /// The peer sent authentic data from a new address, and is followed there.
        roams as "wg_roams",
        /// Handshakes given up after 90 s of retries: the frames that
        /// waited for them were dropped (`unreachable`).
        gave_up as "wg_handshakes_given_up",
    }
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

    /// Where the link sends now.
    pub fn endpoint(&self) -> SocketAddr {
        self.lock().endpoint
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
            if out > 0 {
                g.fresh = false;
            }
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
            " peer_key={} index={} endpoint={} handshake_age_s={} tunnel_tx_bytes={tx} tunnel_rx_bytes={rx}{}",
            vnet_core::command::wireguard_key_text(&self.peer),
            self.index,
            g.endpoint,
            since.map_or("never".to_string(), |d| d.as_secs().to_string()),
            rtt.map_or(String::new(), |r| format!(" handshake_rtt_ms={r}"))
        )
    }

    fn extra_stats(&self) -> String {
        let mut s = String::new();
        self.counters.render_into(&mut s);
        s
    }

    fn teardown(&self) -> usize {
        std::mem::take(&mut self.lock().waiting) as usize
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
