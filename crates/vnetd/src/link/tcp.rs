//! TCP links: frames over a TCP connection between two vnetd, for networks
//! where UDP does not pass. Each frame is sent as a 4-byte big-endian length
//! and the frame.
//!
//! Either side may initiate: each side both connects to its peer (with
//! exponential backoff) and accepts from it (`TcpAcceptor`). If both
//! connections come up, both sides keep the one initiated by the peer with
//! the lower address, so they always agree. Frames sent while the link is not
//! up wait in a bounded queue; what does not fit is dropped and counted.

use crate::dispatch::{Datapath, Forwarder};
use crate::stats::Drop;
use crate::topology::Link;
use anyhow::{Context, Result};
use std::collections::VecDeque;
use std::io::{self, BufWriter, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

/// Frames waiting to be sent on one link, at most.
pub const QUEUE_FRAMES: usize = 4096;
pub use vnet_core::wire::MAX_TCP_FRAME;
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

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

struct Conn {
    stream: TcpStream,
    /// Whether we initiated it.
    outgoing: bool,
    /// Bumped for every connection, so a reader knows when it is stale.
    id: u64,
}

struct Shared {
    queue: VecDeque<Vec<u8>>,
    /// Buffers of frames already sent, reused for the next ones, so that
    /// queueing a frame does not allocate.
    free: Vec<Vec<u8>>,
    conn: Option<Conn>,
    state: State,
    since: Instant,
    next_id: u64,
}

pub struct TcpLink {
    remote: SocketAddr,
    local_ip: Mutex<Option<IpAddr>>,
    shared: Mutex<Shared>,
    wake: Condvar,
    stop: AtomicBool,
    started: AtomicBool,
}

impl TcpLink {
    pub fn new(remote: SocketAddr) -> Arc<TcpLink> {
        Arc::new(TcpLink {
            remote,
            local_ip: Mutex::new(None),
            shared: Mutex::new(Shared {
                queue: VecDeque::new(),
                free: Vec::new(),
                conn: None,
                state: State::Connecting,
                since: Instant::now(),
                next_id: 0,
            }),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            started: AtomicBool::new(false),
        })
    }

    /// Starts the link's connection manager (and so its readers). `link` is
    /// the topology's link object, for counters and to find its slot.
    pub fn start(self: &Arc<TcpLink>, dp: Arc<Datapath>, link: Weak<Link>) {
        if self.started.swap(true, Relaxed) {
            return;
        }
        let me = self.clone();
        let _ = std::thread::Builder::new()
            .name("tcp-link".into())
            .spawn(move || me.manage(dp, link));
    }

    /// Stops the link's threads and closes its connection.
    pub fn stop(&self) {
        self.stop.store(true, Relaxed);
        let mut s = self.shared.lock().unwrap();
        if let Some(c) = s.conn.take() {
            let _ = c.stream.shutdown(Shutdown::Both);
        }
        // The manager counts what is still queued as it exits.
        self.wake.notify_all();
    }

    pub fn state(&self) -> (State, Duration) {
        let s = self.shared.lock().unwrap();
        (s.state, s.since.elapsed())
    }

    /// Queues a frame; false if the queue is full (the caller counts the drop).
    pub fn enqueue(&self, frame: &[u8]) -> bool {
        let mut s = self.shared.lock().unwrap();
        if s.queue.len() >= QUEUE_FRAMES {
            return false;
        }
        let mut buf = s.free.pop().unwrap_or_default();
        buf.clear();
        buf.extend_from_slice(frame);
        s.queue.push_back(buf);
        drop(s);
        self.wake.notify_one();
        true
    }

    fn set_state(s: &mut Shared, state: State) {
        if s.state != state {
            s.state = state;
            s.since = Instant::now();
        }
    }

    /// An accepted connection from the peer: keep it unless we already have
    /// the connection the tie-break prefers.
    pub fn offer(&self, stream: TcpStream) {
        let ours = *self.local_ip.lock().unwrap();
        let mut s = self.shared.lock().unwrap();
        let prefer_incoming = match (&s.conn, ours) {
            (None, _) => true,
            (Some(c), _) if !c.outgoing => true, // a newer connection from the peer replaces its old one
            // Both exist: keep the one the lower address initiated.
            (Some(_), Some(local)) => self.remote.ip() < local,
            (Some(_), None) => false,
        };
        if !prefer_incoming {
            let _ = stream.shutdown(Shutdown::Both);
            return;
        }
        if let Some(old) = s.conn.take() {
            let _ = old.stream.shutdown(Shutdown::Both);
        }
        s.next_id += 1;
        let id = s.next_id;
        s.conn = Some(Conn { stream, outgoing: false, id });
        Self::set_state(&mut s, State::Up);
        drop(s);
        self.wake.notify_all();
    }

    /// The manager: keeps a connection up and writes queued frames to it.
    /// When the link is deleted, the frames it still held are counted as
    /// dropped (`down`, in the global counters: the link's go with it).
    fn manage(self: Arc<TcpLink>, dp: Arc<Datapath>, link: Weak<Link>) {
        self.manage_until_stopped(&dp, link);
        let left = std::mem::take(&mut self.shared.lock().unwrap().queue);
        for _ in &left {
            dp.drop_at(None, Drop::Down);
        }
    }

    fn manage_until_stopped(self: &Arc<TcpLink>, dp: &Arc<Datapath>, link: Weak<Link>) {
        let mut backoff = BACKOFF_MIN;
        let mut next_attempt = Instant::now();
        let mut reader_for = 0u64;
        let mut writer: Option<(u64, BufWriter<TcpStream>)> = None;
        while !self.stop.load(Relaxed) {
            let mut s = self.shared.lock().unwrap();
            // Start a reader for a new connection.
            if let Some(c) = &s.conn {
                if c.id != reader_for {
                    reader_for = c.id;
                    if let Ok(r) = c.stream.try_clone() {
                        let (me, dp, link, id) = (self.clone(), dp.clone(), link.clone(), c.id);
                        let _ = std::thread::Builder::new().name("tcp-link-rx".into()).spawn(move || me.read(r, id, dp, link));
                    }
                    writer = c.stream.try_clone().ok().map(|w| (c.id, BufWriter::with_capacity(256 << 10, w)));
                    backoff = BACKOFF_MIN;
                }
            }
            if s.conn.is_none() {
                writer = None;
                if Instant::now() >= next_attempt {
                    Self::set_state(&mut s, State::Connecting);
                    drop(s);
                    let attempt = TcpStream::connect_timeout(&self.remote, Duration::from_secs(2));
                    s = self.shared.lock().unwrap();
                    match attempt {
                        Ok(stream) if s.conn.is_none() => {
                            let _ = stream.set_nodelay(true);
                            *self.local_ip.lock().unwrap() = stream.local_addr().ok().map(|a| a.ip());
                            s.next_id += 1;
                            let id = s.next_id;
                            s.conn = Some(Conn { stream, outgoing: true, id });
                            Self::set_state(&mut s, State::Up);
                            tracing::info!(remote = %self.remote, "TCP link up");
                        }
                        Ok(stream) => {
                            // The peer connected meanwhile: keep one by the rule.
                            let local = stream.local_addr().ok().map(|a| a.ip());
                            *self.local_ip.lock().unwrap() = local;
                            if local.is_some_and(|l| l < self.remote.ip()) && s.conn.as_ref().is_some_and(|c| !c.outgoing) {
                                if let Some(old) = s.conn.take() {
                                    let _ = old.stream.shutdown(Shutdown::Both);
                                }
                                s.next_id += 1;
                                let id = s.next_id;
                                s.conn = Some(Conn { stream, outgoing: true, id });
                            } else {
                                let _ = stream.shutdown(Shutdown::Both);
                            }
                        }
                        Err(e) => {
                            tracing::debug!(remote = %self.remote, "TCP link connect failed: {e}");
                            Self::set_state(&mut s, State::Down);
                            next_attempt = Instant::now() + backoff;
                            backoff = (backoff * 2).min(BACKOFF_MAX);
                        }
                    }
                    continue;
                }
                let wait = next_attempt.saturating_duration_since(Instant::now()).min(Duration::from_millis(100));
                let _ = self.wake.wait_timeout(s, wait);
                continue;
            }
            // Connected: send what is queued.
            let Some(frame) = s.queue.pop_front() else {
                drop(s);
                if let Some((_, w)) = writer.as_mut() {
                    if w.flush().is_err() {
                        self.lost(reader_for);
                    }
                }
                let s = self.shared.lock().unwrap();
                if s.queue.is_empty() && !self.stop.load(Relaxed) {
                    let _ = self.wake.wait_timeout(s, Duration::from_millis(100));
                }
                continue;
            };
            drop(s);
            let Some((_, w)) = writer.as_mut() else { continue };
            let len = (frame.len() as u32).to_be_bytes();
            let ok = w.write_all(&len).and_then(|_| w.write_all(&frame)).is_ok();
            let n = frame.len();
            {
                let mut s = self.shared.lock().unwrap();
                if s.free.len() < 256 {
                    s.free.push(frame);
                }
            }
            let stats = link.upgrade();
            if ok {
                if let Some(l) = &stats {
                    l.stats.sent(n);
                    dp.global.sent(n);
                }
            } else {
                if let Some(l) = &stats {
                    dp.drop_at(Some(&l.stats), Drop::Down);
                }
                self.lost(reader_for);
            }
        }
    }

    /// The connection `id` broke: forget it (the manager reconnects).
    fn lost(&self, id: u64) {
        let mut s = self.shared.lock().unwrap();
        if s.conn.as_ref().is_some_and(|c| c.id == id) {
            if let Some(c) = s.conn.take() {
                let _ = c.stream.shutdown(Shutdown::Both);
            }
            Self::set_state(&mut s, State::Down);
            tracing::info!(remote = %self.remote, "TCP link down");
        }
        self.wake.notify_all();
    }

    /// Reads length-prefixed frames from one connection and routes them.
    /// Frames already buffered are routed as one run, so runs of TCP
    /// segments for one guest are merged as for UDP links.
    fn read(self: Arc<TcpLink>, stream: TcpStream, id: u64, dp: Arc<Datapath>, link: Weak<Link>) {
        const BATCH: usize = 256 << 10;
        let mut r = io::BufReader::with_capacity(BATCH, stream);
        let mut fwd = Forwarder::new(dp.clone());
        let mut batch = vec![0u8; BATCH + MAX_TCP_FRAME];
        let mut at = 0;
        let mut snap = dp.snapshot();
        let mut slot = None;
        loop {
            let mut len = [0u8; 4];
            if r.read_exact(&mut len).is_err() {
                break;
            }
            let Some(l) = link.upgrade() else { break };
            let Some(n) = vnet_core::wire::tcp_frame_len(len) else {
                // The stream is out of step: nothing after this can be trusted.
                dp.drop_at(Some(&l.stats), Drop::Malformed);
                tracing::warn!(remote = %self.remote, "bad frame length on TCP link; reconnecting");
                break;
            };
            if r.read_exact(&mut batch[at..at + n]).is_err() {
                break;
            }
            if slot.is_none() || snap.generation != dp.snapshot().generation {
                snap = dp.snapshot();
                slot = snap.links.iter().position(|x| Arc::ptr_eq(x, &l)).map(|s| s as u32);
            }
            let Some(s) = slot else { break };
            fwd.from_link(&snap, s, &mut batch, at..at + n);
            at += n;
            // Nothing more waiting (or the batch is full): end the run.
            if r.buffer().len() < 4 || at >= BATCH {
                fwd.end_run(&snap, &batch);
                fwd.flush(&snap);
                at = 0;
            }
        }
        fwd.end_run(&snap, &batch);
        self.lost(id);
    }
}

/// Accepts TCP link connections on the daemon's port and hands each to the
/// TCP link for the peer's address.
pub struct TcpAcceptor {
    pub local: SocketAddr,
}

impl TcpAcceptor {
    pub fn start(addr: SocketAddr, dp: Arc<Datapath>) -> Result<TcpAcceptor> {
        let listener = TcpListener::bind(addr).with_context(|| format!("cannot listen for TCP links on {addr}"))?;
        let local = listener.local_addr()?;
        std::thread::Builder::new().name("tcp-accept".into()).spawn(move || {
            for conn in listener.incoming().flatten() {
                let peer = match conn.peer_addr() {
                    Ok(p) => p.ip().to_canonical(),
                    Err(_) => continue,
                };
                let _ = conn.set_nodelay(true);
                let snap = dp.snapshot();
                match snap.tcp_link_for(peer) {
                    Some(t) => t.offer(conn),
                    None => {
                        dp.global.received(0);
                        dp.drop_at(None, Drop::UnknownSender);
                        tracing::debug!(%peer, "TCP connection from an address with no TCP link refused");
                    }
                }
            }
        })?;
        Ok(TcpAcceptor { local })
    }
}
