//! WireGuard links (`LINK ADD <ip> [<port>] wireguard <peer-public-key>`):
//! frames encrypted and authenticated between hosts, by the WireGuard
//! protocol as `boringtun` implements it (Noise IK handshakes, cookies under
//! load, rekeying, the replay window; ChaCha20-Poly1305 from the
//! `chacha20poly1305` crate). No cryptography is written here.
//!
//! Inside the tunnel a frame travels as on a plain UDP link (`inner.rs`), so
//! a host running any WireGuard (wireguard-go, the kernel's) with a plain
//! vnetd UDP link over the tunnel is a peer too. Over an IPv4 or an IPv6
//! underlay.
//!
//! - `Kind`: how `LINK ADD ... wireguard` makes a link, and what vnetd's
//!   start, `SHOW`, `STATS` and `WIREGUARD ROTATE` ask of WireGuard.
//! - `WgHub`: vnetd's side of WireGuard, made at start with a key file: its
//!   key pair (`keys.rs`), its UDP carriers (`--wireguard-port`, IPv4 and
//!   IPv6) and its handshake thread (`handshake.rs`).
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
mod inner;
mod kept;
mod keys;
mod kind;

pub use handshake::Handshaker;
pub use inner::{inner_frame, Inner};
pub use keys::WgKeys;
pub use kind::Kind;

use super::carriers::UdpCarrier;
use super::{CarrierKey, DemuxKey, LinkLookup, RunOpener, Segments, Sent, Transport, TxCtx, TxQueue, SEG_PARTS};
use crate::port::Intake;
use crate::stats::{counter_set, Counters, DropReason, ThreadStats};
use crate::sys::udp::UdpEndpoint;
use arc_swap::ArcSwap;
use boringtun::noise::errors::WireGuardError;
use boringtun::noise::rate_limiter::RateLimiter;
use boringtun::noise::{Tunn, TunnResult};
use boringtun::x25519::PublicKey;
use std::collections::HashMap;
use std::io::IoSlice;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Instant;
use vnet_core::offload::{Pieces, VnetHdr};

pub const WORD: &str = "wireguard";
/// WireGuard's data header (16) and AEAD tag (16).
const SEAL: usize = 32;
/// What a WireGuard link over an underlay of `mtu` bytes takes from it: the
/// outer IP + UDP, WireGuard's header and tag, the inner IP + UDP (each IPv4
/// or IPv6 as the underlay), and what padding the inner packet to 16 bytes
/// may add (none over a 1500-byte IPv4 underlay: 88 bytes there).
pub fn overhead(mtu: u32, v6: bool) -> i64 {
    let (outer, inner) = if v6 { (48, inner::INNER_V6 as i64) } else { (28, inner::INNER_V4 as i64) };
    let room = (mtu as i64 - outer - SEAL as i64).max(0);
    mtu as i64 - (room / inner::PAD as i64 * inner::PAD as i64 - inner)
}
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
        /// Links whose session a hand-over carried on (`kept.rs`): no new
        /// handshake.
        sessions_taken_over,
    }
}

/// vnetd's WireGuard side, shared by every WireGuard link.
pub struct WgHub {
    /// The WireGuard port's carriers, IPv4 and IPv6 (each a socket per
    /// dispatcher, `SO_REUSEPORT`; the first sends), once bound.
    /// (The carrier holds the hub as its opener: the hub keeps only its key
    /// and sending socket.)
    v4: OnceLock<(CarrierKey, Arc<UdpEndpoint>)>,
    v6: OnceLock<(CarrierKey, Arc<UdpEndpoint>)>,
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
    /// Sessions handed over by the vnetd this one took over from, by peer
    /// key, until a link to that peer is made (`kept.rs`).
    kept: Mutex<HashMap<[u8; 32], kept::KeptLink>>,
    /// This hub's state offered for a hand-over, for as long as it lives.
    offer: Mutex<Option<crate::sys::keep::Offer>>,
    pub counters: HubCounters,
    /// The handshake thread's frame counts (frames it sent that waited for
    /// a session, drops of handshake messages), summed into `STATS global`.
    pub stats: Arc<ThreadStats>,
    /// Where the key pair is kept (`WIREGUARD ROTATE` writes the new one).
    key_file: std::path::PathBuf,
}

impl WgHub {
    /// The hub of this key pair; its carriers are bound with `carry`, its
    /// handshake thread started with `spawn`.
    pub fn new(keys: WgKeys, key_file: &Path) -> Arc<WgHub> {
        let mut seed = [0u8; 4];
        let _ = getrandom::getrandom(&mut seed);
        Arc::new(WgHub {
            v4: OnceLock::new(),
            v6: OnceLock::new(),
            mac1: ArcSwap::from_pointee(RateLimiter::new(&keys.public, u64::MAX)),
            cookies: ArcSwap::from_pointee(RateLimiter::new(&keys.public, 0)),
            keys: ArcSwap::from_pointee(keys),
            jobs: handshake::Queue::default(),
            peers: Mutex::new(Vec::new()),
            accepted: Mutex::new(HashMap::new()),
            next_index: AtomicU32::new(u32::from_ne_bytes(seed)),
            kept: Mutex::new(HashMap::new()),
            offer: Mutex::new(None),
            counters: HubCounters::default(),
            stats: Arc::new(ThreadStats::default()),
            key_file: key_file.to_path_buf(),
        })
    }

    /// Takes on the sessions a predecessor handed over, and offers this
    /// hub's for a successor (`kept.rs`).
    pub fn keep_sessions(self: &Arc<Self>) {
        kept::take(self);
        let me = Arc::downgrade(self);
        let export: crate::sys::keep::Export =
            Arc::new(move || me.upgrade().map(|h| crate::sys::keep::Exported { state: kept::write(&h), fds: Vec::new() }));
        *self.offer.lock().unwrap_or_else(|p| p.into_inner()) = Some(crate::sys::keep::offer_export(kept::NAME.to_string(), export));
    }

    /// Takes a carrier of the WireGuard port (the IPv4 or IPv6 one).
    pub fn carry(&self, c: &UdpCarrier) {
        let CarrierKey::Udp { v6, .. } = c.key else { return };
        let held = (c.key, c.sender().clone());
        let _ = if v6 { self.v6.set(held) } else { self.v4.set(held) };
    }

    fn carrier(&self, v6: bool) -> Option<&(CarrierKey, Arc<UdpEndpoint>)> {
        if v6 {
            self.v6.get()
        } else {
            self.v4.get()
        }
    }

    /// Where it listens: each carrier's address.
    pub fn listen(&self) -> String {
        [self.v4.get(), self.v6.get()].iter().flatten().map(|c| c.1.local_addr().to_string()).collect::<Vec<_>>().join(",")
    }

    /// The socket a link to an address of this family sends from.
    fn sender(&self, v6: bool) -> Option<&Arc<UdpEndpoint>> {
        self.carrier(v6).map(|c| &c.1)
    }

    pub fn public_text(&self) -> String {
        self.keys.load().public_text()
    }

    /// `SHOW`'s line.
    pub fn describe(&self) -> String {
        let mut s = format!("wireguard listen={} public_key={} peers={}", self.listen(), self.public_text(), self.live_peers().len());
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
            if g.handed_over {
                continue;
            }
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
        let v6 = endpoint.is_ipv6();
        let Some(carrier) = self.carrier(v6).map(|c| c.0) else {
            return Err(format!("vnetd has no {} WireGuard socket (see --udp-bind)", if v6 { "IPv6" } else { "IPv4" }));
        };
        let keys = self.keys.load();
        if peer == *keys.public.as_bytes() {
            return Err("that is this vnetd's own WireGuard key".into());
        }
        // A 24-bit index of our own (boringtun shifts it left by 8 and
        // counts sessions in the low byte): what the peer's datagrams name;
        // a session handed over keeps its link's.
        let mut kept = kept::for_link(self, &peer);
        let index = kept.as_ref().map_or_else(|| self.next_index.fetch_add(1, Relaxed) & 0x00ff_ffff, |k| k.index);
        let mut tunn = Tunn::new(keys.secret.clone(), PublicKey::from(peer), None, None, index, Some(self.mac1.load_full()))
            .map_err(|e| format!("cannot make the WireGuard peer: {e}"))?;
        if kept.as_ref().is_some_and(|k| !tunn.import_state(&k.tunn)) {
            tracing::warn!(peer = %vnet_core::command::wireguard_key_text(&peer), "hand-over: the WireGuard session does not fit this build: a new handshake");
            kept = None;
        }
        if kept.is_none() {
            self.restore_newest_initiation(&mut tunn, &peer);
        }
        let link = Arc::new(WgLink {
            hub: self.clone(),
            peer,
            index,
            carrier,
            v6,
            inner,
            state: Mutex::new(Peer {
                tunn,
                endpoint: kept.as_ref().map_or(endpoint, |k| k.endpoint),
                waiting: 0,
                sessions: kept.as_ref().map_or(0, |k| k.sessions),
                fresh: kept.is_none(),
                flush_asked: false,
                cookie_retry: None,
                handed_over: false,
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
        match self.sender(to.is_ipv6()) {
            Some(ep) => ep.send_iov(&[IoSlice::new(datagram)], to, None),
            None => Err(std::io::Error::from(std::io::ErrorKind::AddrNotAvailable)),
        }
    }

    /// A datagram a dispatcher received on the WireGuard port that is not a
    /// data message: queued whole for the handshake thread if it has the
    /// size of a handshake message (dropped, counted, if the queue is
    /// full), else dropped as malformed.
    pub fn enqueue(&self, st: &ThreadStats, carrier: &CarrierKey, from: SocketAddr, dgram: &[u8]) {
        let size_ok = matches!((dgram[0], dgram.len()), (1, INIT_LEN) | (2, RESPONSE_LEN) | (3, COOKIE_REPLY_LEN));
        if !size_ok || dgram[1..4] != [0, 0, 0] {
            st.global.received(dgram.len());
            st.drop_at(None, DropReason::Malformed);
            return;
        }
        if !self.jobs.push_message(*carrier, from, dgram) {
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
            TunnResult::WriteToTunnelV4(pkt, _) | TunnResult::WriteToTunnelV6(pkt, _) => {
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

    /// Frames wait in `link` and its data just came in (a session made by
    /// the peer's handshake is current from its first data): the handshake
    /// thread sends them.
    fn ask_flush(&self, link: &WgLink, g: &mut Peer) {
        if g.waiting > 0 && !g.flush_asked && self.jobs.push_flush(link.carrier, link.index) {
            g.flush_asked = true;
        }
    }
}

/// A WireGuard link named by `key` on `carrier`, with its slot and frame
/// counters.
pub struct Found<'a> {
    pub slot: u32,
    pub link: &'a WgLink,
    pub stats: &'a Counters,
}

/// The WireGuard link `key` names on `carrier`, if one does.
pub fn find<'a>(links: &'a dyn LinkLookup, carrier: &CarrierKey, key: &DemuxKey) -> Option<Found<'a>> {
    let slot = links.demux(carrier, key)?;
    let (t, stats) = links.link(slot)?;
    let link = t.as_any().downcast_ref::<WgLink>()?;
    Some(Found { slot, link, stats })
}

impl RunOpener for WgHub {
    /// One buffer a dispatcher received from `from` on the WireGuard port:
    /// a datagram, or a GRO run of them `seg` bytes apart. Each data message
    /// is opened into `buf` after the frames before it (the run handed to
    /// `intake` and `buf` started again when the next might not fit) and its
    /// frame handed to `intake`; each other message is queued for the
    /// handshake thread. The run ends with the buffer.
    fn open_run(
        &self,
        carrier: &CarrierKey,
        links: &dyn LinkLookup,
        st: &ThreadStats,
        from: SocketAddr,
        run: &mut [u8],
        seg: usize,
        buf: &mut [u8],
        intake: &mut dyn Intake,
    ) {
        let mut at = 0;
        for r in vnet_core::wire::gro_segments(run.len(), seg) {
            let dgram = &run[r];
            let Some(index) = WgHub::data_index(dgram) else {
                self.enqueue(st, carrier, from, dgram);
                continue;
            };
            // A data message opens to fewer bytes than it has.
            if at + dgram.len() > buf.len() {
                intake.end_run(buf);
                at = 0;
            }
            let Some(f) = find(links, carrier, &DemuxKey::Index(index)) else {
                self.unknown(st, dgram, false);
                continue;
            };
            if let Opened::Frame(r) = self.open_data(f.link, f.stats, st, from, dgram, &mut buf[at..]) {
                let r = at + r.start..at + r.end;
                at = r.end;
                intake.link_frame(f.slot, buf, r);
            }
        }
        intake.end_run(buf);
    }
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
    /// Its tunnel was written out for a successor (`kept.rs`): nothing
    /// more is sealed or sent through it here.
    handed_over: bool,
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
    /// The carrier its datagrams come on, and whether over IPv6.
    carrier: CarrierKey,
    v6: bool,
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

    /// Seals `count` frames and queues them, holding the peer's lock once
    /// for all: `frame(k, plain)` appends frame `k`'s bytes to `plain` and
    /// says how many. Each is sealed straight into the send batch (the
    /// plain packet is the one copy of the frame); `gso`: they may share
    /// GSO messages.
    fn seal(&self, q: &mut TxQueue, slot: u32, count: usize, gso: bool, mut frame: impl FnMut(usize, &mut Vec<u8>) -> usize) -> Sent {
        let Some(ep) = self.hub.sender(self.v6) else { return Sent::dropped(DropReason::TxError, count) };
        let hl = self.inner.len();
        // The pass's buffer, lent out while `q` queues.
        let mut plain = std::mem::take(&mut q.plain);
        let mut out = Sent::later();
        let mut g = self.lock();
        let to = g.endpoint;
        if g.handed_over {
            drop(g);
            q.plain = plain;
            return Sent::dropped(DropReason::TxError, count);
        }
        for k in 0..count {
            if g.waiting >= MAX_WAITING {
                out.add(Sent::dropped(DropReason::QueueFull, 1));
                continue;
            }
            plain.clear();
            plain.resize(hl, 0);
            let len = frame(k, &mut plain);
            self.inner.write(len, &mut plain[..hl]);
            if self.v6 {
                Inner::finish_v6(&mut plain);
            }
            // Padded to 16 bytes (the inner packet's own length says where
            // it ends), so that a frame's size shows only to 16 bytes.
            plain.resize(plain.len().div_ceil(inner::PAD) * inner::PAD, 0);
            let mut sealed = Sealed::Data;
            let peer = &mut *g;
            q.push_with(ep, (plain.len() + SEAL).max(MIN_OUT), to, slot, gso, |room| match peer.tunn.encapsulate(&plain, room) {
                TunnResult::WriteToNetwork(p) if p[0] == 4 => p.len(),
                TunnResult::WriteToNetwork(p) => {
                    // No session yet: boringtun keeps the frame for the
                    // handshake it started (this initiation).
                    sealed = Sealed::Started;
                    self.counters.initiations.fetch_add(1, Relaxed);
                    let _ = self.hub.send(p, to);
                    0
                }
                // Kept for a handshake in progress.
                TunnResult::Done => {
                    sealed = Sealed::Waits;
                    0
                }
                _ => {
                    sealed = Sealed::Failed;
                    0
                }
            });
            match sealed {
                Sealed::Data => {}
                Sealed::Waits => g.waiting += 1,
                Sealed::Started => {
                    g.waiting += 1;
                    g.fresh = false;
                }
                Sealed::Failed => out.add(Sent::dropped(DropReason::TxError, 1)),
            }
        }
        drop(g);
        q.plain = plain;
        out
    }
}

/// What became of one frame `WgLink::seal` handed boringtun.
enum Sealed {
    /// Sealed into the batch.
    Data,
    /// Kept for the session a handshake in progress makes.
    Waits,
    /// Kept for the session of the handshake it started.
    Started,
    Failed,
}

impl Transport for WgLink {
    fn kind(&self) -> &'static str {
        WORD
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn demux(&self) -> Vec<(CarrierKey, DemuxKey)> {
        vec![(self.carrier, DemuxKey::Index(self.index)), (self.carrier, DemuxKey::Key(self.peer))]
    }

    fn send(&self, q: &mut TxQueue, cx: &TxCtx, _vnet: &VnetHdr, frame: Pieces) -> Sent {
        let len = frame.len();
        let max = self.hub.sender(self.v6).map_or(0, |e| e.max_payload());
        if (len + self.inner.len()).div_ceil(inner::PAD) * inner::PAD + SEAL > max {
            return Sent::dropped(DropReason::Oversize, 1);
        }
        if len > cx.max_frame {
            cx.offload.fragmented.fetch_add(1, Relaxed);
        }
        let gso = len <= cx.max_frame && cx.gso.ok();
        self.seal(q, cx.slot, 1, gso, |_, plain| {
            for p in frame.parts() {
                plain.extend_from_slice(p);
            }
            len
        })
    }

    fn send_segments(&self, q: &mut TxQueue, cx: &TxCtx, segs: &Segments) -> Sent {
        let mut parts = [&[][..]; SEG_PARTS];
        self.seal(q, cx.slot, segs.len(), cx.gso.ok(), |k, plain| {
            let n = segs.parts(k, &mut parts);
            for p in &parts[..n] {
                plain.extend_from_slice(p);
            }
            segs.plan.frame_len(k)
        })
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
