//! A TCP link's connection: connecting (with backoff), the key handshake
//! of both sides, which connection wins, and the send buffer the
//! dispatchers fill and write out.

use crate::link::LinkKey;
use crate::sys::eventfd::EventFd;
use anyhow::{Context, Result};
use socket2::{SockRef, TcpKeepalive};
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use vnet_core::linkauth::{self, Nonce, TCP_LINK};

pub use vnet_core::wire::MAX_TCP_FRAME;
/// Bytes (frames and their length prefixes) a link's send buffer holds at
/// most, while the link is down or the peer is slow.
pub const TX_BUDGET: usize = 4 << 20;
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// A handshake must finish within this, or the connection is closed.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Data unacknowledged this long ends the connection (`TCP_USER_TIMEOUT`).
pub const USER_TIMEOUT: Duration = Duration::from_secs(15);
/// Keepalive: first probe after this much silence, then every
/// `KEEPALIVE_INTERVAL`, `KEEPALIVE_PROBES` times.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(5);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
const KEEPALIVE_PROBES: u32 = 3;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum State {
    /// Trying to connect (or waiting for the peer to).
    Connecting,
    Up,
    /// Not connected, waiting before the next attempt.
    Down,
}

impl State {
    pub fn name(self) -> &'static str {
        match self {
            State::Connecting => "connecting",
            State::Up => "up",
            State::Down => "down",
        }
    }
}

/// The live connection, as the datapath sees it.
#[derive(Clone)]
pub struct Conn {
    pub stream: Arc<TcpStream>,
    /// Bumped for every connection, so a dispatcher knows when its is stale.
    pub id: u64,
}

struct Shared {
    /// Frames waiting: `buf[head..]`, each a length prefix and the frame.
    /// `buf[boundary..]` starts at a frame: the one `head` is in.
    buf: Vec<u8>,
    head: usize,
    boundary: usize,
    conn: Option<Conn>,
    /// Whether we initiated the live connection.
    outgoing: bool,
    state: State,
    since: Instant,
    next_id: u64,
    /// Our address on the last connection (for the tie-break).
    local_ip: Option<IpAddr>,
}

/// Frames and bytes a write took out of the send buffer.
#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Written {
    pub frames: usize,
    pub bytes: usize,
    /// The socket took less than was waiting: the rest waits for it to
    /// drain (the owning dispatcher watches for that).
    pub blocked: bool,
    /// The connection failed while writing (it is now forgotten).
    pub failed: bool,
}

pub struct TcpLink {
    pub remote: SocketAddr,
    key: LinkKey,
    shared: Mutex<Shared>,
    /// Wakes the connector (connection lost, link stopped).
    wake: Condvar,
    /// Tells the owning dispatcher: the connection changed, or the send
    /// buffer waits for the socket.
    event: EventFd,
    stop: AtomicBool,
    connector: Mutex<Option<JoinHandle<()>>>,
    /// Handshakes that failed (wrong key, not VNET, timeout).
    pub auth_failures: AtomicU64,
    /// Connections that came up.
    pub connects: AtomicU64,
}

impl TcpLink {
    pub fn new(remote: SocketAddr, key: LinkKey) -> Result<Arc<TcpLink>, String> {
        let event = EventFd::new().map_err(|e| format!("eventfd: {e}"))?;
        Ok(Arc::new(TcpLink {
            remote,
            key,
            shared: Mutex::new(Shared {
                buf: Vec::new(),
                head: 0,
                boundary: 0,
                conn: None,
                outgoing: false,
                state: State::Connecting,
                since: Instant::now(),
                next_id: 0,
                local_ip: None,
            }),
            wake: Condvar::new(),
            event,
            stop: AtomicBool::new(false),
            connector: Mutex::new(None),
            auth_failures: AtomicU64::new(0),
            connects: AtomicU64::new(0),
        }))
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts the link's connector (once the link is in force).
    pub fn start(self: &Arc<TcpLink>) {
        let mut c = self.connector.lock().unwrap_or_else(|p| p.into_inner());
        if c.is_some() {
            return;
        }
        let me = self.clone();
        *c = std::thread::Builder::new().name("tcp-link".into()).spawn(move || me.connect_loop()).ok();
    }

    /// Retires the link: stops its connector, closes the
    /// connection, and returns how many frames were still waiting (the
    /// caller counts them as dropped). Called by the control plane once no
    /// dispatcher uses the link.
    pub fn stop(&self) -> usize {
        self.stop.store(true, Relaxed);
        let waiting = {
            let mut s = self.lock();
            if let Some(c) = s.conn.take() {
                let _ = c.stream.shutdown(Shutdown::Both);
            }
            let n = frames_in(&s.buf[s.boundary..]);
            s.buf = Vec::new();
            s.head = 0;
            s.boundary = 0;
            n
        };
        self.wake.notify_all();
        // The connector sees the flag at once, unless it is inside a connect
        // or a handshake (bounded by their timeouts): then it is left to end
        // by itself; it installs nothing once stopped.
        if let Some(h) = self.connector.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let deadline = Instant::now() + Duration::from_millis(200);
            while !h.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            if h.is_finished() {
                let _ = h.join();
            }
        }
        waiting
    }

    pub fn state(&self) -> (State, Duration) {
        let s = self.lock();
        (s.state, s.since.elapsed())
    }

    /// The event fd the owning dispatcher watches.
    pub fn event_fd(&self) -> RawFd {
        self.event.as_raw_fd()
    }

    /// Clears the event fd (the owning dispatcher, before looking).
    pub fn clear_event(&self) {
        self.event.drain();
    }

    fn signal(&self) {
        let _ = self.event.notify();
    }

    /// The live connection, if any.
    pub fn conn(&self) -> Option<Conn> {
        self.lock().conn.clone()
    }

    /// Whether frames wait to be written.
    pub fn has_pending(&self) -> bool {
        let s = self.lock();
        s.head < s.buf.len()
    }

    /// Appends a frame to the send buffer; false if it does not fit the
    /// budget (the caller counts the drop). Written by `write_out`.
    pub fn enqueue(&self, parts: &[&[u8]]) -> bool {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let mut s = self.lock();
        if s.buf.len() - s.boundary + 4 + len > TX_BUDGET {
            return false;
        }
        if s.head == s.buf.len() {
            s.buf.clear();
            s.head = 0;
            s.boundary = 0;
        } else if s.boundary > TX_BUDGET {
            // Drop what was written, so the buffer stays within twice the budget.
            let b = s.boundary;
            s.buf.drain(..b);
            s.head -= b;
            s.boundary = 0;
        }
        s.buf.extend_from_slice(&(len as u32).to_be_bytes());
        for p in parts {
            s.buf.extend_from_slice(p);
        }
        true
    }

    /// Writes what the send buffer holds to the live connection, without
    /// blocking; returns the complete frames written.
    pub fn write_out(&self) -> Written {
        let mut s = self.lock();
        let mut w = Written::default();
        let Some(conn) = s.conn.clone() else { return w };
        while s.head < s.buf.len() {
            let r = (&*conn.stream).write(&s.buf[s.head..]);
            match r {
                Ok(0) => break,
                Ok(n) => s.head += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    w.blocked = true;
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::info!(remote = %self.remote, "TCP link write failed: {e}");
                    w.failed = true;
                    break;
                }
            }
        }
        // Count the frames now wholly written.
        while let Some(p) = s.buf.get(s.boundary..s.boundary + 4) {
            let n = u32::from_be_bytes(p.try_into().expect("4 bytes")) as usize;
            if s.boundary + 4 + n > s.head {
                break;
            }
            s.boundary += 4 + n;
            w.frames += 1;
            w.bytes += n;
        }
        if w.failed {
            Self::forget(&mut s, conn.id, &self.remote);
            drop(s);
            self.wake.notify_all();
            self.signal();
        } else if w.blocked {
            // The owning dispatcher waits for the socket to drain.
            drop(s);
            self.signal();
        }
        w
    }

    /// Connection `id` failed or ended (a dispatcher saw it): forget it; the
    /// connector reconnects.
    pub fn lost(&self, id: u64) {
        let mut s = self.lock();
        Self::forget(&mut s, id, &self.remote);
        drop(s);
        self.wake.notify_all();
        self.signal();
    }

    fn forget(s: &mut Shared, id: u64, remote: &SocketAddr) {
        if s.conn.as_ref().is_some_and(|c| c.id == id) {
            if let Some(c) = s.conn.take() {
                let _ = c.stream.shutdown(Shutdown::Both);
            }
            // The frame half written goes again, whole, on the next connection.
            s.head = s.boundary;
            set_state(s, State::Down);
            tracing::info!(%remote, "TCP link down");
        }
    }

    /// Installs an authenticated connection (`outgoing` if we initiated it)
    /// unless the live one is preferred; returns whether it was installed.
    fn install(&self, stream: TcpStream, outgoing: bool) -> bool {
        let local = stream.local_addr().ok().map(|a| a.ip().to_canonical());
        let mut s = self.lock();
        if self.stop.load(Relaxed) {
            return false;
        }
        s.local_ip = local.or(s.local_ip);
        let take = match (&s.conn, s.outgoing, outgoing) {
            (None, _, _) => true,
            // The peer's newer connection replaces its older one (it restarted).
            (Some(_), false, false) => true,
            // Ours again (cannot happen: we connect only when down).
            (Some(_), true, true) => true,
            // Both exist: keep the one the lower address initiated.
            (Some(_), _, _) => {
                let peer_lower = s.local_ip.is_some_and(|l| self.remote.ip().to_canonical() < l);
                if outgoing {
                    !peer_lower
                } else {
                    peer_lower
                }
            }
        };
        if !take {
            let _ = stream.shutdown(Shutdown::Both);
            return false;
        }
        if stream.set_nonblocking(true).is_err() {
            return false;
        }
        if let Some(old) = s.conn.take() {
            let _ = old.stream.shutdown(Shutdown::Both);
        }
        s.next_id += 1;
        s.conn = Some(Conn { stream: Arc::new(stream), id: s.next_id });
        s.outgoing = outgoing;
        s.head = s.boundary;
        set_state(&mut s, State::Up);
        drop(s);
        self.connects.fetch_add(1, Relaxed);
        tracing::info!(remote = %self.remote, outgoing, "TCP link up");
        self.signal();
        true
    }

    /// The connector: while the link has no connection, connect (with
    /// backoff) and run the handshake as initiator.
    fn connect_loop(self: Arc<TcpLink>) {
        let mut backoff = BACKOFF_MIN;
        while !self.stop.load(Relaxed) {
            {
                let mut s = self.lock();
                while s.conn.is_some() && !self.stop.load(Relaxed) {
                    s = self.wake.wait_timeout(s, Duration::from_secs(1)).unwrap_or_else(|p| p.into_inner()).0;
                    backoff = BACKOFF_MIN;
                }
                if self.stop.load(Relaxed) {
                    return;
                }
                set_state(&mut s, State::Connecting);
            }
            match self.connect_once() {
                Ok(stream) => {
                    self.install(stream, true);
                    continue;
                }
                Err(e) => {
                    tracing::debug!(remote = %self.remote, "TCP link connect failed: {e:#}");
                    let mut s = self.lock();
                    if s.conn.is_none() {
                        set_state(&mut s, State::Down);
                    }
                    // Wait out the backoff (or until stopped).
                    let until = Instant::now() + backoff;
                    while !self.stop.load(Relaxed) && s.conn.is_none() {
                        let left = until.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            break;
                        }
                        s = self.wake.wait_timeout(s, left).unwrap_or_else(|p| p.into_inner()).0;
                    }
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                }
            }
        }
    }

    fn connect_once(&self) -> Result<TcpStream> {
        let stream = TcpStream::connect_timeout(&self.remote, CONNECT_TIMEOUT).context("connect")?;
        tune(&stream);
        stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
        stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
        let nonce_i = nonce()?;
        let mut s = &stream;
        s.write_all(&linkauth::hello(&TCP_LINK, &nonce_i)).context("handshake")?;
        let mut ch = [0u8; linkauth::CHALLENGE_LEN];
        s.read_exact(&mut ch).context("handshake")?;
        let proof = match linkauth::answer(&TCP_LINK, self.key.bytes(), &nonce_i, &ch, &[]) {
            Ok((_, p)) => p,
            Err(e) => {
                self.auth_failures.fetch_add(1, Relaxed);
                tracing::warn!(remote = %self.remote, "TCP link handshake refused: {e}");
                anyhow::bail!("handshake: {e}");
            }
        };
        s.write_all(&proof).context("handshake")?;
        Ok(stream)
    }

    /// Runs the handshake as responder on an accepted connection; installs
    /// the connection if the peer proved it holds the key.
    pub(super) fn accept_from(&self, stream: TcpStream) -> Result<(), String> {
        let go = || -> Result<TcpStream, String> {
            tune(&stream);
            let io = |e: io::Error| format!("handshake: {e}");
            stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT)).map_err(io)?;
            stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT)).map_err(io)?;
            let mut s = &stream;
            let mut hello = [0u8; linkauth::HELLO_LEN];
            s.read_exact(&mut hello).map_err(io)?;
            let nonce_i = linkauth::read_hello(&TCP_LINK, &hello).map_err(|e| e.to_string())?;
            let nonce_r = nonce().map_err(|e| e.to_string())?;
            s.write_all(&linkauth::challenge(&TCP_LINK, self.key.bytes(), &nonce_i, &nonce_r)).map_err(io)?;
            let mut proof = [0u8; linkauth::PROOF_LEN];
            s.read_exact(&mut proof).map_err(io)?;
            linkauth::verify_proof(&TCP_LINK, self.key.bytes(), &nonce_i, &nonce_r, &proof, &[]).map_err(|e| e.to_string())?;
            stream.try_clone().map_err(io)
        };
        match go() {
            Ok(s) => {
                self.install(s, false);
                Ok(())
            }
            Err(e) => {
                self.auth_failures.fetch_add(1, Relaxed);
                let _ = stream.shutdown(Shutdown::Both);
                Err(e)
            }
        }
    }
}

fn set_state(s: &mut Shared, state: State) {
    if s.state != state {
        s.state = state;
        s.since = Instant::now();
    }
}

/// Complete frames in a send buffer's bytes.
fn frames_in(mut b: &[u8]) -> usize {
    let mut n = 0;
    while let Some(p) = b.get(..4) {
        let len = u32::from_be_bytes(p.try_into().expect("4 bytes")) as usize;
        n += 1;
        b = b.get(4 + len..).unwrap_or(&[]);
    }
    n
}

fn nonce() -> Result<Nonce> {
    let mut n = [0u8; linkauth::NONCE_LEN];
    getrandom::getrandom(&mut n).map_err(|e| anyhow::anyhow!("no randomness for the handshake: {e}"))?;
    Ok(n)
}

/// Options of every link connection: no Nagle, bounded unacknowledged data,
/// keepalive.
fn tune(stream: &TcpStream) {
    let _ = stream.set_nodelay(true);
    let s = SockRef::from(stream);
    let _ = s.set_tcp_user_timeout(Some(USER_TIMEOUT));
    let ka = TcpKeepalive::new().with_time(KEEPALIVE_IDLE).with_interval(KEEPALIVE_INTERVAL).with_retries(KEEPALIVE_PROBES);
    let _ = s.set_tcp_keepalive(&ka);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn key() -> LinkKey {
        LinkKey::test_key(b"0123456789abcdef0123456789abcdef")
    }

    /// A connected pair: (ours, the peer's end).
    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    #[test]
    fn the_send_buffer_is_bounded_in_bytes_and_counts_what_it_held() {
        let t = TcpLink::new("127.0.0.1:1".parse().unwrap(), key()).unwrap();
        let frame = vec![0u8; 60_000];
        let mut queued = 0;
        while t.enqueue(&[&frame]) {
            queued += 1;
        }
        assert_eq!(queued, TX_BUDGET / 60_004);
        // A small frame still fits in what is left.
        assert!(t.enqueue(&[&frame[..100]]));
        assert_eq!(t.stop(), queued + 1, "what was waiting is reported, to be counted");
    }

    #[test]
    fn frames_are_written_whole_and_a_half_written_frame_goes_again_on_the_next_connection() {
        let t = TcpLink::new("127.0.0.1:1".parse().unwrap(), key()).unwrap();
        let (a, mut peer) = pair();
        assert!(t.install(a, true));
        assert!(t.enqueue(&[b"0123456789abcd", b"ef"]));
        let w = t.write_out();
        assert_eq!((w.frames, w.bytes, w.blocked, w.failed), (1, 16, false, false));
        let mut got = [0u8; 20];
        peer.read_exact(&mut got).unwrap();
        assert_eq!(&got[..4], &16u32.to_be_bytes());
        assert_eq!(&got[4..], b"0123456789abcdef");
        // Pretend the connection died mid-frame: the frame restarts whole.
        {
            let mut s = t.lock();
            s.buf.extend_from_slice(&14u32.to_be_bytes());
            s.buf.extend_from_slice(b"ABCDEFGHIJKLMN");
            s.head += 6;
        }
        let id = t.conn().unwrap().id;
        t.lost(id);
        assert!(t.conn().is_none());
        let (a2, mut peer2) = pair();
        assert!(t.install(a2, true));
        let w = t.write_out();
        assert_eq!((w.frames, w.bytes), (1, 14));
        let mut got = [0u8; 18];
        peer2.read_exact(&mut got).unwrap();
        assert_eq!(&got[4..], b"ABCDEFGHIJKLMN");
        t.stop();
    }

    #[test]
    fn a_peer_without_the_key_never_replaces_the_live_connection() {
        let t = TcpLink::new("127.0.0.1:1".parse().unwrap(), key()).unwrap();
        let (a, _peer) = pair();
        assert!(t.install(a, false));
        let live = t.conn().unwrap().id;
        // A stranger connects and sends a HELLO, then a wrong proof.
        let (ours, mut stranger) = pair();
        let h = std::thread::spawn(move || {
            stranger.write_all(&linkauth::hello(&TCP_LINK, &[5u8; 32])).unwrap();
            let mut ch = [0u8; linkauth::CHALLENGE_LEN];
            stranger.read_exact(&mut ch).unwrap();
            stranger.write_all(&[0u8; linkauth::PROOF_LEN]).unwrap();
            let mut rest = Vec::new();
            let _ = stranger.read_to_end(&mut rest);
            rest
        });
        assert_eq!(t.accept_from(ours), Err("the peer does not hold this link's key".into()));
        assert!(h.join().unwrap().is_empty(), "the stranger got nothing but the challenge");
        assert_eq!(t.conn().unwrap().id, live);
        assert_eq!(t.auth_failures.load(Relaxed), 1);
        t.stop();
    }

    #[test]
    fn the_peer_with_the_key_gets_in() {
        let t = TcpLink::new("127.0.0.1:1".parse().unwrap(), key()).unwrap();
        let (ours, mut peer) = pair();
        let h = std::thread::spawn(move || {
            let ni = [5u8; 32];
            peer.write_all(&linkauth::hello(&TCP_LINK, &ni)).unwrap();
            let mut ch = [0u8; linkauth::CHALLENGE_LEN];
            peer.read_exact(&mut ch).unwrap();
            let (_, proof) = linkauth::answer(&TCP_LINK, key().bytes(), &ni, &ch, &[]).unwrap();
            peer.write_all(&proof).unwrap();
            peer
        });
        assert_eq!(t.accept_from(ours), Ok(()));
        let _peer = h.join().unwrap();
        assert!(t.conn().is_some());
        assert_eq!(t.state().0, State::Up);
        t.stop();
    }

    #[test]
    fn frames_in_counts_whole_frames() {
        let mut b = Vec::new();
        for n in [14u32, 100, 60] {
            b.extend_from_slice(&n.to_be_bytes());
            b.extend(std::iter::repeat_n(0u8, n as usize));
        }
        assert_eq!(frames_in(&b), 3);
        assert_eq!(frames_in(&[]), 0);
    }
}
