//! The handshake thread: every WireGuard handshake message, every link's
//! timers, and the sending of frames that waited for a session, off the
//! real-time dispatchers.
//!
//! Dispatchers copy each handshake message (initiation, response, cookie
//! reply) into a bounded queue (`QUEUE_LEN`; a full queue drops, counted
//! `handshake_queue_full`) and go on. This thread takes them in turn:
//!
//! 1. **MAC1** (keyed by our public key; a few hundred nanoseconds), and
//!    **under load** also **MAC2**: a message without a valid one is answered
//!    by a cookie reply and goes no further. Under load means the queue holds
//!    an eighth of its room or more (the kernel's WireGuard decides by its
//!    queue the same way), or `LOAD_RATE` initiations and responses came in
//!    the current second; it lasts a second after either. One cookie
//!    secret for all links (`WgHub::cookies`): each link's `Tunn` checks
//!    MAC1 only, so a peer never has two cookies to satisfy.
//! 2. **A budget per source address** (under load: `PER_SOURCE` a second,
//!    bursts of `BURST`, as the kernel's ratelimiter; an IPv6 source by its
//!    /64). A MAC2 proves the address receives our packets, so a forger
//!    cannot spend another address's budget; an address over its budget is
//!    dropped (`rate_limited`) before any public-key work.
//! 3. Then the public-key work: the initiator's key (one X25519) names the
//!    link, and the link's `Tunn` does the rest.
//!
//! So what a flood costs is bounded: a dispatcher pays a copy per message;
//! this thread, which runs at normal priority (nice 10) and so yields to the
//! dispatchers, pays a MAC check and at most a cookie reply per message, and
//! Diffie-Hellman only for messages from addresses that answer cookies, at
//! `PER_SOURCE` a second each.
//!
//! A peer of ours that receives a cookie reply initiates again at once with
//! the cookie (at most once a second per link) instead of at the next 5-s
//! retry, so a handshake with a host under load takes one round trip more,
//! not five seconds.

use super::{find, refused, Found, Peer, WgHub, WgLink, INIT_LEN, MAX_DATAGRAM};
use crate::link::{CarrierKey, DemuxKey, LinkLookup, LinksNow};
use crate::stats::{Counters, DropReason};
use boringtun::noise::errors::WireGuardError;
use boringtun::noise::handshake::parse_handshake_anon;
use boringtun::noise::{Packet, Tunn, TunnResult};
use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Condvar, Mutex, Weak};

use std::time::{Duration, Instant};

/// Handshake messages that may wait for the thread (as the kernel's
/// WireGuard: `MAX_QUEUED_INCOMING_HANDSHAKES`).
const QUEUE_LEN: usize = 4096;
/// Messages taken per lock of the queue.
const BATCH: usize = 64;
/// Initiations and responses a second before cookies are asked for (each
/// that reaches the Diffie-Hellman costs two to four X25519s, some 50 µs
/// each here: this many are some 5% of a core; a host's real handshakes are
/// a few a minute per link).
const LOAD_RATE: u32 = 250;
/// How long load lasts after its last sign.
const LOAD_HOLD: Duration = Duration::from_secs(1);
/// Handshake messages a second per source address, under load, and the
/// burst allowed (the kernel's WireGuard: 20 and 5).
const PER_SOURCE: f64 = 20.0;
const BURST: f64 = 5.0;
/// Source addresses whose budget is tracked at once; a new one beyond is
/// refused until a second of quiet frees some.
const SOURCES: usize = 16384;
/// How often every link's timers run (WireGuard's timers are in seconds;
/// boringtun asks for "about every 100 ms").
const TICK: Duration = Duration::from_millis(100);

/// What a dispatcher hands the thread.
enum Work {
    /// A handshake message, as received on a carrier.
    Message { carrier: CarrierKey, from: SocketAddr, len: u8, bytes: [u8; INIT_LEN] },
    /// Send the frames waiting in the link with this index: its session
    /// became current.
    Flush(CarrierKey, u32),
}

/// The bounded queue between the dispatchers and the thread.
#[derive(Default)]
pub(super) struct Queue {
    q: Mutex<VecDeque<Work>>,
    ready: Condvar,
}

impl Queue {
    fn push(&self, w: Work) -> bool {
        let mut q = self.q.lock().unwrap_or_else(|p| p.into_inner());
        if q.len() >= QUEUE_LEN {
            return false;
        }
        if q.capacity() == 0 {
            q.reserve_exact(QUEUE_LEN);
        }
        let was_empty = q.is_empty();
        q.push_back(w);
        drop(q);
        // The thread waits only on an empty queue.
        if was_empty {
            self.ready.notify_one();
        }
        true
    }

    pub(super) fn push_message(&self, carrier: CarrierKey, from: SocketAddr, dgram: &[u8]) -> bool {
        let mut bytes = [0u8; INIT_LEN];
        bytes[..dgram.len()].copy_from_slice(dgram);
        self.push(Work::Message { carrier, from, len: dgram.len() as u8, bytes })
    }

    pub(super) fn push_flush(&self, carrier: CarrierKey, index: u32) -> bool {
        self.push(Work::Flush(carrier, index))
    }

    pub(super) fn len(&self) -> usize {
        self.q.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Up to `BATCH` items into `into`, waiting until `until` for the first;
    /// how many remain queued.
    fn take(&self, into: &mut Vec<Work>, until: Instant) -> usize {
        let mut q = self.q.lock().unwrap_or_else(|p| p.into_inner());
        while q.is_empty() {
            let now = Instant::now();
            if now >= until {
                return 0;
            }
            q = self.ready.wait_timeout(q, until - now).unwrap_or_else(|p| p.into_inner()).0;
        }
        let n = q.len().min(BATCH);
        into.extend(q.drain(..n));
        q.len()
    }
}

/// The thread's own state.
pub struct Handshaker {
    out: Vec<u8>,
    batch: Vec<Work>,
    /// Under load until then.
    load_until: Option<Instant>,
    /// Initiations and responses taken this second.
    arrivals: u32,
    second: Instant,
    sources: HashMap<IpAddr, (f64, Instant)>,
    next_tick: Instant,
}

impl Default for Handshaker {
    fn default() -> Self {
        let now = Instant::now();
        Handshaker {
            out: vec![0u8; MAX_DATAGRAM + 64],
            batch: Vec::with_capacity(BATCH),
            load_until: None,
            arrivals: 0,
            second: now,
            sources: HashMap::new(),
            next_tick: now + TICK,
        }
    }
}

impl WgHub {
    /// Starts the handshake thread; `links` gives the current links each
    /// time it is asked, and None once the datapath is gone (the thread
    /// then ends, as it does when the hub is dropped).
    pub fn spawn(self: &Arc<Self>, links: LinksNow) -> std::io::Result<()> {
        let hub = Arc::downgrade(self);
        std::thread::Builder::new().name("wireguard".into()).spawn(move || run(hub, links))?;
        Ok(())
    }

    /// Handles everything queued now (tests and fuzzing: what the thread
    /// does, on the caller's thread), then runs the timers if `tick`.
    pub fn work_now(&self, links: &dyn LinkLookup, h: &mut Handshaker, tick: bool) {
        loop {
            let left = self.jobs.take(&mut h.batch, Instant::now());
            if h.batch.is_empty() {
                break;
            }
            h.handle_batch(self, links, left);
            if left == 0 {
                break;
            }
        }
        if tick {
            h.tick(self, links);
        }
    }
}

fn run(hub: Weak<WgHub>, links: LinksNow) {
    // Normal priority, below the other threads of vnetd: the dispatchers
    // (real-time when they may be) always go first.
    // SAFETY: plain system calls on this thread.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 10);
    }
    let mut h = Handshaker::default();
    loop {
        let Some(hub) = hub.upgrade() else { return };
        let left = hub.jobs.take(&mut h.batch, h.next_tick);
        let Some(links) = (links.now)() else { return };
        if !h.batch.is_empty() {
            h.handle_batch(&hub, &*links, left);
        }
        if Instant::now() >= h.next_tick {
            h.tick(&hub, &*links);
        }
    }
}

impl Handshaker {
    fn handle_batch(&mut self, hub: &WgHub, links: &dyn LinkLookup, left: usize) {
        let mut batch = std::mem::take(&mut self.batch);
        let n = batch.len();
        for (k, w) in batch.drain(..).enumerate() {
            match w {
                Work::Message { carrier, from, len, bytes } => {
                    // What waits behind this message.
                    let depth = left + (n - k - 1);
                    self.message(hub, links, &carrier, from, &bytes[..len as usize], depth);
                }
                Work::Flush(carrier, index) => {
                    if let Some(f) = find(links, &carrier, &DemuxKey::Index(index)) {
                        let mut g = f.link.lock();
                        g.flush_asked = false;
                        self.flush(hub, f.link, f.stats, &mut g);
                    }
                }
            }
        }
        self.batch = batch;
    }

    /// Whether the thread is under load now, given the queue's depth.
    fn under_load(&mut self, depth: usize, now: Instant) -> bool {
        self.arrivals += 1;
        if depth >= QUEUE_LEN / 8 || self.arrivals >= LOAD_RATE {
            if !self.load_until.is_some_and(|t| now < t) {
                tracing::info!(depth, arrivals = self.arrivals, "WireGuard handshakes under load: asking for cookies");
            }
            self.load_until = Some(now + LOAD_HOLD);
        }
        let under = self.load_until.is_some_and(|t| now < t);
        if !under && self.load_until.take().is_some() {
            tracing::info!("WireGuard handshakes no longer under load");
        }
        under
    }

    /// Whether `ip` may have one more handshake message worked now.
    fn budget(&mut self, ip: IpAddr, now: Instant) -> bool {
        let key = match ip {
            IpAddr::V6(a) => {
                let mut o = a.octets();
                o[8..].fill(0);
                IpAddr::from(o)
            }
            v4 => v4,
        };
        if !self.sources.contains_key(&key) && self.sources.len() >= SOURCES {
            return false;
        }
        let (tokens, last) = self.sources.entry(key).or_insert((BURST, now));
        *tokens = (*tokens + now.duration_since(*last).as_secs_f64() * PER_SOURCE).min(BURST);
        *last = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// One handshake message from `from`.
    fn message(&mut self, hub: &WgHub, links: &dyn LinkLookup, carrier: &CarrierKey, from: SocketAddr, dgram: &[u8], depth: usize) {
        let st = &hub.stats;
        let drop = |why| {
            st.global.received(dgram.len());
            st.drop_at(None, why);
        };
        let Ok(packet) = Tunn::parse_incoming_packet(dgram) else { return drop(DropReason::Malformed) };
        if let Packet::PacketCookieReply(p) = packet {
            // No public-key work: opened by the link it names, if any.
            let Some(f) = find(links, carrier, &DemuxKey::Index(p.receiver_idx >> 8)) else { return hub.unknown(st, dgram, false) };
            return self.open(hub, f, from, dgram);
        }
        let now = Instant::now();
        let under_load = self.under_load(depth, now);
        // MAC1 always; MAC2 under load, a cookie reply where it is missing.
        let check = if under_load { hub.cookies.load() } else { hub.mac1.load() };
        let mut reply = [0u8; 64];
        match check.verify_packet(Some(from.ip()), dgram, &mut reply) {
            Ok(_) => {}
            Err(TunnResult::WriteToNetwork(c)) => {
                hub.counters.cookies_sent.fetch_add(1, Relaxed);
                let _ = hub.send(c, from);
                return;
            }
            Err(_) => return drop(DropReason::Unauthenticated),
        }
        if under_load && !self.budget(from.ip(), now) {
            hub.counters.rate_limited.fetch_add(1, Relaxed);
            return drop(DropReason::RateLimited);
        }
        hub.counters.handshakes_worked.fetch_add(1, Relaxed);
        let found = match packet {
            Packet::HandshakeInit(h) => {
                let keys = hub.keys.load();
                match parse_handshake_anon(&keys.secret, &keys.public, &h) {
                    Ok(hh) => match find(links, carrier, &DemuxKey::Key(hh.peer_static_public)) {
                        Some(f) => f,
                        None => return hub.unknown(st, dgram, true),
                    },
                    Err(_) => return hub.unknown(st, dgram, true),
                }
            }
            Packet::HandshakeResponse(p) => match find(links, carrier, &DemuxKey::Index(p.receiver_idx >> 8)) {
                Some(f) => f,
                None => return hub.unknown(st, dgram, false),
            },
            _ => return drop(DropReason::Malformed),
        };
        self.open(hub, found, from, dgram);
    }

    /// A handshake message of the link `f`, through its `Tunn`.
    fn open(&mut self, hub: &WgHub, f: Found, from: SocketAddr, dgram: &[u8]) {
        let (link, c) = (f.link, &f.link.counters);
        let kind = dgram[0];
        let mut g = link.lock();
        if g.handed_over {
            return;
        }
        match g.tunn.decapsulate(Some(from.ip()), dgram, &mut self.out) {
            TunnResult::WriteToNetwork(p) => {
                // Our response to an initiation that opened (the peer proved
                // its key), or the keepalive that completes our own
                // handshake. Neither moves the endpoint: the peer's data will.
                let reply = p[0];
                let _ = hub.send(p, from);
                if (kind, reply) == (1, 2) || (kind, reply) == (2, 4) {
                    g.established(c);
                    if kind == 1 {
                        hub.accepted_from(&link.peer, dgram);
                    }
                }
                self.flush(hub, link, f.stats, &mut g);
            }
            TunnResult::Done => {
                if kind == 3 {
                    c.cookies_received.fetch_add(1, Relaxed);
                    // The peer is under load and asked for a cookie: ask
                    // again with it now rather than in 5 s.
                    let now = Instant::now();
                    if !g.cookie_retry.is_some_and(|t| now < t) {
                        g.cookie_retry = Some(now + Duration::from_secs(1));
                        let to = g.endpoint;
                        if let TunnResult::WriteToNetwork(m) = g.tunn.format_handshake_initiation(&mut self.out, true) {
                            c.initiations.fetch_add(1, Relaxed);
                            let _ = hub.send(m, to);
                        }
                    }
                }
            }
            TunnResult::Err(e) => {
                drop(g);
                refused(link, f.stats, &hub.stats, from, dgram, e);
            }
            // A handshake message never opens to a packet.
            TunnResult::WriteToTunnelV4(..) | TunnResult::WriteToTunnelV6(..) => {}
        }
    }

    /// Sends what waits in `link` for a session, if it has one now, each
    /// frame sealed into this thread's own buffer.
    fn flush(&mut self, hub: &WgHub, link: &WgLink, stats: &Counters, g: &mut Peer) {
        if g.waiting == 0 || g.handed_over {
            return;
        }
        let (mut frames, mut bytes) = (0, 0);
        let to = g.endpoint;
        // boringtun gives a queued frame back sealed, or queues it again and
        // answers with a handshake of ours (at most once: then one is in
        // progress) or nothing when there is still no session.
        while let TunnResult::WriteToNetwork(p) = g.tunn.decapsulate(None, &[], &mut self.out) {
            if p[0] == 1 {
                link.counters.initiations.fetch_add(1, Relaxed);
            }
            if hub.send(p, to).is_ok() && p[0] == 4 {
                (frames, bytes) = (frames + 1, bytes + p.len());
            }
        }
        g.waiting = g.waiting.saturating_sub(frames as u32);
        if frames > 0 {
            hub.stats.sent_at(stats, frames, bytes);
        }
    }

    /// Every link's timers; once a second, the budgets and the load.
    fn tick(&mut self, hub: &WgHub, links: &dyn LinkLookup) {
        let now = Instant::now();
        self.next_tick = now + TICK;
        if now.duration_since(self.second) >= Duration::from_secs(1) {
            self.second = now;
            self.arrivals = 0;
            if self.load_until.is_some() {
                hub.counters.under_load_seconds.fetch_add(1, Relaxed);
            }
            // A source quiet for a second has its whole burst back: forget it.
            self.sources.retain(|_, (_, last)| now.duration_since(*last) < Duration::from_secs(1));
        }
        for p in hub.live_peers() {
            self.tick_link(hub, links, &p);
        }
    }

    fn tick_link(&mut self, hub: &WgHub, links: &dyn LinkLookup, link: &WgLink) {
        let mut g = link.lock();
        if g.handed_over {
            return;
        }
        let to = g.endpoint;
        let r = if std::mem::take(&mut g.fresh) {
            // The first handshake, unless a frame started one already.
            g.tunn.format_handshake_initiation(&mut self.out, false)
        } else {
            g.tunn.update_timers(&mut self.out)
        };
        match r {
            TunnResult::WriteToNetwork(p) => {
                if p[0] == 1 {
                    link.counters.initiations.fetch_add(1, Relaxed);
                }
                let _ = hub.send(p, to);
            }
            TunnResult::Err(WireGuardError::ConnectionExpired) => {
                // boringtun gave up the handshake (90 s of retries) or a
                // session 9 minutes old, and forgot the frames it held.
                let lost = std::mem::take(&mut g.waiting);
                if lost > 0 {
                    link.counters.gave_up.fetch_add(1, Relaxed);
                    let f = find(links, &link.carrier, &DemuxKey::Index(link.index));
                    for _ in 0..lost {
                        hub.stats.drop_at(f.as_ref().map(|f| f.stats), DropReason::Unreachable);
                    }
                    tracing::info!(peer = %vnet_core::command::wireguard_key_text(&link.peer), lost, "WireGuard handshake given up: the frames that waited for it are dropped");
                }
            }
            _ => {}
        }
    }
}
