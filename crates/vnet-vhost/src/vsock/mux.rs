//! The connection thread of one vsock device: the guest's stream
//! connections to its host, each carried by a host stream socket (a Unix
//! socket, or a shadow TCP connection: `HostSide` decides), bytes moved
//! straight between that socket and the guest's buffers (`readv`/`writev`
//! on the guest's memory; a copy only of what the socket would not take at
//! once, bounded by the credit vnetd gave).
//!
//! What a guest can make it do is bounded: chains per pass (the ring's
//! `Budget`), connections per device (`MAX_CONNS`), bytes held per
//! connection (`BUF_ALLOC`: a guest sending past its credit is reset),
//! resets owed (`MAX_OWED_RSTS`). A packet it had no right to send is
//! dropped and counted (`Counters`), answered with a reset where virtio
//! says so.

use super::conn::{Credit, Owed, Pending, State};
use super::device::{self, Device, RX, TX};
use super::packet::{Header, Op, Refusal, HDR_LEN, SHUTDOWN_RCV, SHUTDOWN_SEND};
use crate::protocol::Virtio;
use crate::chain::Chained;
use crate::queue::Ring;
use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::time::Duration;
use vm_memory::GuestAddress;
use vnet_sys::epoll::{self, Epoll};

/// Connections one VM may hold at once.
pub const MAX_CONNS: usize = 1024;
/// Bytes from the guest held for host sockets that would not take them,
/// over all of a device's connections: each may hold its credit
/// (`BUF_ALLOC`), but a guest with many connections to host programs that
/// do not read holds no more than this of vnetd's memory; past it, the
/// connection that needs more is reset (`vsock_held_full`).
pub const HELD_MAX: usize = 8 << 20;
/// Resets owed to the guest for connections already gone, at most.
const MAX_OWED_RSTS: usize = 1024;
/// Receive chains filled per pass (then the other connections' turn, and
/// the transmit ring's).
const RX_PER_PASS: usize = 256;
const TOKEN_DEVICE: u64 = 1;
const TOKEN_INCOMING: u64 = 2;
const TOKEN_CONN: u64 = 1 << 32;
/// Host ports given to connections the host side opens start here.
const FIRST_HOST_PORT: u32 = 1 << 30;

vnet_core::counter_set! {
    /// What one VM's vsock device did, for `STATS`.
    pub struct Counters {
        /// Connections the guest opened to its host, and those the host side
        /// refused (nothing listens there, or VTOE's rules say no: the guest
        /// got a reset).
        vsock_guest_connects,
        vsock_refused,
        /// Connections the host side opened to the guest, and those the
        /// guest refused.
        vsock_host_connects,
        vsock_guest_refused,
        /// Bytes from the guest to the host side, and back.
        vsock_bytes_to_host,
        vsock_bytes_to_guest,
        /// Packets refused: shorter than a header, not a stream packet, an
        /// address other than the guest's own CID to the host, a length past
        /// the chain (`vsock_bad_packets`); for no connection
        /// (`vsock_unknown_packets`, answered with a reset).
        vsock_bad_packets,
        vsock_unknown_packets,
        /// Connections reset because the guest sent past the credit vnetd
        /// gave it, or opened more than `MAX_CONNS`.
        vsock_credit_violations,
        vsock_over_limit,
        /// Connections reset because the device's connections together
        /// held `HELD_MAX` bytes their host sockets had not taken.
        vsock_held_full,
        /// Resets not sent because too many were owed (the guest's side
        /// times out instead).
        vsock_rsts_dropped,
        /// Connections reset by a host socket's error, or when the guest's
        /// device stopped (a reboot, the VM gone).
        vsock_host_errors,
        vsock_dropped_at_stop,
    }
}

/// Where the guest's connections go on the host.
pub trait HostSide: Send {
    /// The guest's port `from` connects to host port `port`: a non-blocking
    /// stream socket carrying it (connected or connecting: it becomes
    /// writable once connected), or why not (the guest gets a reset).
    fn connect(&mut self, from: u32, port: u32) -> io::Result<OwnedFd>;
}

/// A connection the host side opens to the guest's `port`; `announce`:
/// once the guest accepted, `OK <host port>\n` is written to `fd` first
/// (hybrid vsock's answer).
pub struct Incoming {
    pub fd: OwnedFd,
    pub port: u32,
    pub announce: bool,
}

type Key = (u32, u32); // (guest port, host port)

struct Conn {
    key: Key,
    fd: OwnedFd,
    state: State,
    credit: Credit,
    owed: Owed,
    /// Bytes from the guest the socket has not taken yet.
    out: Pending,
    greeting: Vec<u8>,
    /// Bytes at the front of `out` that are the host side's (the greeting).
    ahead: usize,
    readable: bool,
    /// The host side said it sends no more (EOF), and the guest was told.
    host_done: bool,
    /// The guest said it sends no more, or receives no more.
    guest_shut: u32,
    write_shut: bool,
    queued: bool,
}

/// The thread's state.
pub struct Mux {
    dev: Arc<Device>,
    host: Box<dyn HostSide>,
    incoming: Receiver<Incoming>,
    /// Readable when something waits in `incoming`.
    incoming_fd: vnet_sys::eventfd::EventFd,
    pub counters: Arc<Counters>,
    conns: HashMap<u64, Conn>,
    ids: HashMap<Key, u64>,
    next_id: u64,
    next_host_port: u32,
    /// Connections with something for the guest.
    ready: VecDeque<u64>,
    rsts: VecDeque<Key>,
    epoll: Epoll,
    segs: Vec<(GuestAddress, usize)>,
    iov: Vec<libc::iovec>,
    was_running: bool,
    /// Bytes held in the connections' `out`, together.
    held: usize,
}

// SAFETY: the iovecs are scratch, rebuilt before each use by this thread.
unsafe impl Send for Mux {}

/// The sender half for connections the host side opens, and what wakes the
/// thread for them.
#[derive(Clone)]
pub struct Opener {
    tx: Sender<Incoming>,
    wake: Arc<OwnedFd>,
}

impl Opener {
    pub fn open(&self, i: Incoming) -> Result<(), Incoming> {
        self.tx.send(i).map_err(|e| e.0)?;
        let _ = vnet_sys::eventfd::write_one(self.wake.as_raw_fd());
        Ok(())
    }
}

fn errno() -> io::Error {
    io::Error::last_os_error()
}

impl Mux {
    pub fn new(dev: Arc<Device>, host: Box<dyn HostSide>) -> io::Result<(Mux, Opener)> {
        let (tx, rx) = std::sync::mpsc::channel();
        let incoming_fd = vnet_sys::eventfd::EventFd::new()?;
        // SAFETY: dup of a descriptor this function holds.
        let wake = unsafe { libc::dup(incoming_fd.as_raw_fd()) };
        if wake < 0 {
            return Err(errno());
        }
        // SAFETY: a fresh descriptor, owned from here.
        let wake = Arc::new(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(wake) });
        let epoll = Epoll::new(64)?;
        epoll.add(dev.event_fd(), epoll::IN, TOKEN_DEVICE)?;
        epoll.add(incoming_fd.as_raw_fd(), epoll::IN, TOKEN_INCOMING)?;
        let mux = Mux {
            dev,
            host,
            incoming: rx,
            incoming_fd,
            counters: Arc::new(Counters::default()),
            conns: HashMap::new(),
            ids: HashMap::new(),
            next_id: 0,
            next_host_port: FIRST_HOST_PORT,
            ready: VecDeque::new(),
            rsts: VecDeque::new(),
            epoll,
            segs: Vec::with_capacity(64),
            iov: Vec::with_capacity(64),
            was_running: false,
            held: 0,
        };
        Ok((mux, Opener { tx, wake }))
    }

    /// Runs until `stop`.
    pub fn run(mut self, stop: &AtomicBool) {
        while !stop.load(Relaxed) {
            self.turn(Some(Duration::from_millis(200)));
        }
    }

    /// One wait and what it brought.
    pub fn turn(&mut self, timeout: Option<Duration>) {
        let n = match self.epoll.wait(timeout) {
            Ok(n) => n,
            Err(_) => {
                std::thread::sleep(Duration::from_millis(10));
                0
            }
        };
        let mut again = false;
        for i in 0..n {
            let ev = self.epoll.event(i);
            match ev.token {
                TOKEN_DEVICE => {
                    self.dev.drain_poke();
                    self.dev.clear_kicks();
                }
                TOKEN_INCOMING => {
                    self.incoming_fd.drain();
                    while let Ok(inc) = self.incoming.try_recv() {
                        self.open_to_guest(inc);
                    }
                }
                t if t >= TOKEN_CONN => self.conn_event(t - TOKEN_CONN, ev.events),
                _ => {}
            }
        }
        let running = self.dev.running();
        if self.was_running && !running {
            self.drop_all();
        }
        self.was_running = running;
        if !running {
            return;
        }
        again |= self.transmit();
        again |= self.receive();
        if again {
            self.dev.poke();
        }
    }

    fn drop_all(&mut self) {
        let n = self.conns.len() as u64;
        for (_, c) in self.conns.drain() {
            self.epoll.delete(c.fd.as_raw_fd());
        }
        self.ids.clear();
        self.ready.clear();
        self.rsts.clear();
        self.held = 0;
        self.counters.vsock_dropped_at_stop.fetch_add(n, Relaxed);
    }

    fn add(&mut self, key: Key, fd: OwnedFd, state: State, greeting: Vec<u8>) -> Option<u64> {
        let id = self.next_id;
        self.next_id += 1;
        let ev = epoll::IN | epoll::OUT | epoll::RDHUP | libc::EPOLLET as u32;
        if self.epoll.add(fd.as_raw_fd(), ev, TOKEN_CONN + id).is_err() {
            return None;
        }
        let c = Conn { key, fd, state, credit: Credit::default(), owed: Owed::default(), out: Pending::default(), greeting, ahead: 0, readable: false, host_done: false, guest_shut: 0, write_shut: false, queued: false };
        self.conns.insert(id, c);
        self.ids.insert(key, id);
        Some(id)
    }

    fn remove(&mut self, id: u64) {
        if let Some(c) = self.conns.remove(&id) {
            self.epoll.delete(c.fd.as_raw_fd());
            self.ids.remove(&c.key);
            self.held -= c.out.bytes().len();
        }
    }

    /// Removes the connection and owes the guest a reset for it.
    fn reset(&mut self, id: u64) {
        if let Some(c) = self.conns.get(&id) {
            let key = c.key;
            self.remove(id);
            self.owe_rst(key);
        }
    }

    fn owe_rst(&mut self, key: Key) {
        if self.rsts.len() >= MAX_OWED_RSTS {
            self.counters.vsock_rsts_dropped.fetch_add(1, Relaxed);
        } else {
            self.rsts.push_back(key);
        }
    }

    fn wake(&mut self, id: u64) {
        if let Some(c) = self.conns.get_mut(&id) {
            if !c.queued {
                c.queued = true;
                self.ready.push_back(id);
            }
        }
    }

    fn open_to_guest(&mut self, inc: Incoming) {
        if self.conns.len() >= MAX_CONNS || !self.dev.running() {
            self.counters.vsock_over_limit.fetch_add(1, Relaxed);
            return; // dropping the socket tells the host side
        }
        // A host port no connection to this guest port uses.
        let mut port = self.next_host_port;
        while self.ids.contains_key(&(inc.port, port)) {
            port = port.wrapping_add(1).max(FIRST_HOST_PORT);
        }
        self.next_host_port = port.wrapping_add(1).max(FIRST_HOST_PORT);
        let greeting = if inc.announce { format!("OK {port}\n").into_bytes() } else { Vec::new() };
        if let Some(id) = self.add((inc.port, port), inc.fd, State::Requesting, greeting) {
            self.counters.vsock_host_connects.fetch_add(1, Relaxed);
            self.conns.get_mut(&id).unwrap().owed.request = true;
            self.wake(id);
        }
    }

    fn conn_event(&mut self, id: u64, events: u32) {
        let Some(c) = self.conns.get_mut(&id) else { return };
        if events & (epoll::IN | epoll::RDHUP | epoll::HUP | epoll::ERR) != 0 {
            c.readable = true;
        }
        if events & (epoll::OUT | epoll::ERR | epoll::HUP) != 0 {
            if c.state == State::Connecting {
                let mut err: libc::c_int = 0;
                let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
                // SAFETY: getsockopt into a c_int this frame holds.
                let r = unsafe { libc::getsockopt(c.fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_ERROR, (&mut err as *mut libc::c_int).cast(), &mut len) };
                if r < 0 || err != 0 {
                    self.counters.vsock_refused.fetch_add(1, Relaxed);
                    self.reset(id);
                    return;
                }
                if events & epoll::OUT == 0 {
                    return;
                }
                c.state = State::Established;
                c.owed.response = true;
            }
            if !self.flush(id) {
                return;
            }
        }
        self.wake(id);
    }

    /// Writes what the guest sent that waits; false if the connection went.
    fn flush(&mut self, id: u64) -> bool {
        let Some(c) = self.conns.get_mut(&id) else { return false };
        if c.state != State::Established {
            return true;
        }
        while !c.out.is_empty() {
            let b = c.out.bytes();
            // SAFETY: writing bytes this thread owns.
            let n = unsafe { libc::send(c.fd.as_raw_fd(), b.as_ptr().cast(), b.len(), libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
            if n < 0 {
                let e = errno();
                if e.kind() == io::ErrorKind::WouldBlock {
                    return true;
                }
                self.counters.vsock_host_errors.fetch_add(1, Relaxed);
                self.reset(id);
                return false;
            }
            let n = n as usize;
            c.out.consumed(n);
            self.held -= n;
            // The greeting, ahead of the guest's bytes, took no credit.
            let g = n.min(c.ahead);
            c.ahead -= g;
            c.credit.forwarded((n - g) as u32);
        }
        self.after_forward(id);
        true
    }

    fn after_forward(&mut self, id: u64) {
        let Some(c) = self.conns.get_mut(&id) else { return };
        if c.out.is_empty() && c.guest_shut == SHUTDOWN_RCV | SHUTDOWN_SEND {
            return self.reset(id);
        }
        if c.out.is_empty() && c.guest_shut & SHUTDOWN_SEND != 0 && !c.write_shut {
            c.write_shut = true;
            // SAFETY: shutdown(2) on a socket the connection holds.
            unsafe { libc::shutdown(c.fd.as_raw_fd(), libc::SHUT_WR) };
        }
        if c.credit.update_due() {
            c.owed.credit_update = true;
            self.wake(id);
        }
    }

    /// Works the transmit ring: packets from the guest. True if the pass
    /// stopped at its budget.
    fn transmit(&mut self) -> bool {
        let dev = self.dev.clone();
        let mut r = dev.ring(TX);
        let mut later = false;
        let mut head = [0u8; HDR_LEN];
        loop {
            let chain = match device::pop(&mut r, false, &mut self.segs) {
                Chained::Chain(h) => h,
                Chained::Bad => continue,
                Chained::Empty => break,
                Chained::Later => {
                    later = true;
                    break;
                }
            };
            let total = self.segs.iter().map(|s| s.1).sum::<usize>();
            if !device::read_head(&r, &self.segs, &mut head) {
                self.counters.vsock_bad_packets.fetch_add(1, Relaxed);
                r.give_back(chain, 0);
                continue;
            }
            match Header::parse(&head, dev.cid(), total - HDR_LEN) {
                Ok(h) => self.from_guest(&r, h),
                Err(Refusal::Short | Refusal::Kind | Refusal::Address | Refusal::Length) => {
                    self.counters.vsock_bad_packets.fetch_add(1, Relaxed);
                }
            }
            r.give_back(chain, 0);
        }
        if r.publish() && r.guest_wants_interrupt() {
            r.signal();
        }
        later
    }

    /// One packet from the guest (its payload still in `r`'s chain).
    fn from_guest(&mut self, r: &Ring, h: Header) {
        let key = (h.src_port, h.dst_port);
        let id = self.ids.get(&key).copied();
        if h.op == Op::Request {
            if id.is_some() {
                self.counters.vsock_unknown_packets.fetch_add(1, Relaxed);
                return self.owe_rst(key);
            }
            return self.connect(key, &h);
        }
        let Some(id) = id else {
            if h.op != Op::Rst {
                self.counters.vsock_unknown_packets.fetch_add(1, Relaxed);
                self.owe_rst(key);
            }
            return;
        };
        let c = self.conns.get_mut(&id).expect("an id names a connection");
        c.credit.heard(&h);
        if c.readable {
            // Its header may have made room for more.
            self.wake(id);
        }
        let c = self.conns.get_mut(&id).expect("an id names a connection");
        match h.op {
            Op::Request => unreachable!(),
            Op::Rst => {
                if c.state == State::Requesting {
                    self.counters.vsock_guest_refused.fetch_add(1, Relaxed);
                }
                self.remove(id);
            }
            Op::Response => {
                if c.state != State::Requesting {
                    self.counters.vsock_unknown_packets.fetch_add(1, Relaxed);
                    return self.reset(id);
                }
                c.state = State::Established;
                // The host side's greeting goes first; it takes no credit.
                c.ahead = c.greeting.len();
                self.held += c.ahead;
                c.out.start_with(std::mem::take(&mut c.greeting));
                self.flush(id);
                self.wake(id);
            }
            Op::Rw => {
                if c.state != State::Established || c.guest_shut & SHUTDOWN_SEND != 0 {
                    self.counters.vsock_unknown_packets.fetch_add(1, Relaxed);
                    return self.reset(id);
                }
                if !c.credit.accept(h.len) {
                    self.counters.vsock_credit_violations.fetch_add(1, Relaxed);
                    return self.reset(id);
                }
                self.counters.vsock_bytes_to_host.fetch_add(u64::from(h.len), Relaxed);
                self.forward(r, id, h.len as usize);
            }
            Op::Shutdown => {
                c.guest_shut |= h.flags & (SHUTDOWN_RCV | SHUTDOWN_SEND);
                // Closed both ways: once what it sent is written, the guest
                // hears the reset that ends its close (`after_forward`).
                self.after_forward(id);
            }
            Op::CreditUpdate => self.wake(id),
            Op::CreditRequest => {
                c.owed.credit_update = true;
                self.wake(id);
            }
        }
    }

    fn connect(&mut self, key: Key, h: &Header) {
        self.counters.vsock_guest_connects.fetch_add(1, Relaxed);
        if self.conns.len() >= MAX_CONNS {
            self.counters.vsock_over_limit.fetch_add(1, Relaxed);
            return self.owe_rst(key);
        }
        match self.host.connect(key.0, key.1) {
            Ok(fd) => match self.add(key, fd, State::Connecting, Vec::new()) {
                Some(id) => self.conns.get_mut(&id).unwrap().credit.heard(h),
                None => self.owe_rst(key),
            },
            Err(e) => {
                tracing::debug!(port = key.1, "vsock connect from the guest refused: {e}");
                self.counters.vsock_refused.fetch_add(1, Relaxed);
                self.owe_rst(key);
            }
        }
    }

    /// Hands `len` payload bytes of the chain in `segs` to the socket:
    /// straight from the guest's memory, what it does not take copied.
    fn forward(&mut self, r: &Ring, id: u64, len: usize) {
        let c = self.conns.get_mut(&id).expect("a connection");
        if len == 0 {
            return;
        }
        let mut sent = 0;
        if c.out.is_empty() && device::host_iovecs(r, &self.segs, HDR_LEN, len, &mut self.iov) {
            let msg = libc::msghdr { msg_iov: self.iov.as_mut_ptr(), msg_iovlen: self.iov.len(), ..unsafe { std::mem::zeroed() } };
            // SAFETY: the iovecs point into guest memory `r` keeps mapped.
            let n = unsafe { libc::sendmsg(c.fd.as_raw_fd(), &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
            if n < 0 {
                let e = errno();
                if e.kind() != io::ErrorKind::WouldBlock {
                    self.counters.vsock_host_errors.fetch_add(1, Relaxed);
                    return self.reset(id);
                }
            } else {
                sent = n as usize;
                c.credit.forwarded(sent as u32);
            }
        }
        if sent < len {
            // The rest waits in vnetd (bounded by the credit).
            let rest = len - sent;
            if self.held + rest > HELD_MAX {
                self.counters.vsock_held_full.fetch_add(1, Relaxed);
                return self.reset(id);
            }
            self.held += rest;
            if !device::copy_out(r, &self.segs, HDR_LEN + sent, c.out.grow(rest)) {
                self.counters.vsock_bad_packets.fetch_add(1, Relaxed);
                return self.reset(id);
            }
        }
        self.after_forward(id);
    }

    /// Fills receive chains: resets owed, then each ready connection's
    /// control packets and data in turn. True if the pass stopped at its
    /// limit with more to send.
    fn receive(&mut self) -> bool {
        let dev = self.dev.clone();
        let mut r = dev.ring(RX);
        let cid = dev.cid();
        let mut filled = 0;
        let mut more = false;
        'pass: while filled < RX_PER_PASS {
            if let Some(&key) = self.rsts.front() {
                let Chained::Chain(head) = self.pop_rx(&mut r) else { break };
                let mut h = Header::to_guest(cid, key.1, key.0, Op::Rst);
                Credit::default().stamp(&mut h);
                device::write_head(&r, &self.segs, &h.encode());
                r.give_back(head, HDR_LEN as u32);
                self.rsts.pop_front();
                filled += 1;
                continue;
            }
            let Some(id) = self.ready.pop_front() else { break };
            let Some(c) = self.conns.get_mut(&id) else { continue };
            c.queued = false;
            // A few chains for this connection, then the next one's turn.
            for _ in 0..8 {
                let c = self.conns.get_mut(&id).expect("a connection");
                let data = c.state == State::Established && c.readable && !c.host_done && c.guest_shut & SHUTDOWN_RCV == 0 && c.credit.peer_free() > 0;
                if !c.owed.any() && !data {
                    continue 'pass;
                }
                let head = match self.pop_rx(&mut r) {
                    Chained::Chain(h) => h,
                    _ => {
                        self.wake(id);
                        break 'pass;
                    }
                };
                filled += 1;
                let c = self.conns.get_mut(&id).expect("a connection");
                let (src, dst) = (c.key.1, c.key.0);
                if let Some((op, flags)) = c.owed.take() {
                    let mut h = Header::to_guest(cid, src, dst, op);
                    h.flags = flags;
                    c.credit.stamp(&mut h);
                    device::write_head(&r, &self.segs, &h.encode());
                    r.give_back(head, HDR_LEN as u32);
                    continue;
                }
                let max = (c.credit.peer_free() as usize).min(device::room(&self.segs));
                let n = if device::host_iovecs(&r, &self.segs, HDR_LEN, max, &mut self.iov) {
                    // SAFETY: the iovecs point into guest memory `r` keeps
                    // mapped, writable buffers the guest posted.
                    unsafe { libc::readv(c.fd.as_raw_fd(), self.iov.as_ptr(), self.iov.len() as libc::c_int) }
                } else {
                    -2
                };
                match n {
                    n if n > 0 => {
                        let mut h = Header::to_guest(cid, src, dst, Op::Rw);
                        h.len = n as u32;
                        c.credit.stamp(&mut h);
                        c.credit.sent(n as u32);
                        device::write_head(&r, &self.segs, &h.encode());
                        r.give_back(head, (HDR_LEN + n as usize) as u32);
                        self.counters.vsock_bytes_to_guest.fetch_add(n as u64, Relaxed);
                    }
                    0 => {
                        // The host side sends no more.
                        c.host_done = true;
                        let mut h = Header::to_guest(cid, src, dst, Op::Shutdown);
                        h.flags = SHUTDOWN_SEND;
                        c.credit.stamp(&mut h);
                        device::write_head(&r, &self.segs, &h.encode());
                        r.give_back(head, HDR_LEN as u32);
                    }
                    -1 if errno().kind() == io::ErrorKind::WouldBlock => {
                        c.readable = false;
                        r.unpop();
                        filled -= 1;
                    }
                    _ => {
                        // A broken socket (or a buffer outside guest
                        // memory): the guest's connection is reset.
                        let mut h = Header::to_guest(cid, src, dst, Op::Rst);
                        c.credit.stamp(&mut h);
                        device::write_head(&r, &self.segs, &h.encode());
                        r.give_back(head, HDR_LEN as u32);
                        self.counters.vsock_host_errors.fetch_add(1, Relaxed);
                        self.remove(id);
                        continue 'pass;
                    }
                }
            }
            // Its turn is over with work left: to the back of the line.
            self.wake(id);
            more = true;
        }
        if r.publish() && r.guest_wants_interrupt() {
            r.signal();
        }
        more && filled >= RX_PER_PASS
    }

    fn pop_rx(&mut self, r: &mut Ring) -> Chained {
        loop {
            match device::pop(r, true, &mut self.segs) {
                Chained::Bad => continue,
                other => return other,
            }
        }
    }
}
