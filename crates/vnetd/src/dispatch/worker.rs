//! One dispatcher thread and its modes.
//!
//! The thread owns some interfaces, direct links and TCP links (id modulo
//! the number of threads), and its own socket of each UDP group (the kernel
//! spreads peers over them with `SO_REUSEPORT`). Each interface runs
//!
//! - **guest-driven**: its NIC is in the epoll set; the thread sleeps in
//!   `epoll_wait` and handles frames the moment they arrive;
//! - **VMM-driven**: its NIC is out of the epoll set ("notifications off")
//!   and polled every pass; an idle pass applies the yield strategy
//!   (immediate: `sched_yield`; timed: wait up to T_sleep; adaptive:
//!   immediate until idle for T_nowork, then timed);
//! - **adaptive**: guest-driven below α_l and VMM-driven above α_u packets
//!   per second, measured over windows of ω (hysteresis in between).
//!
//! Either way a pass takes up to `quota` frames from each source that is
//! ready, and what it sends to UDP links leaves at the pass's end in one
//! `sendmmsg` per socket, each run of frames to one peer as one GSO message
//! (`link::TxQueue`): no system call per frame.
//!
//! A TCP link's connection is a source like any other: the owning thread
//! reads frames from it, ends each received run before it next looks at the
//! snapshot, and writes out the link's send buffer when the socket drains.
//!
//! Epoll tokens carry the kind of source and its place in this thread's
//! lists, which are rebuilt (with the epoll set) on every snapshot.

use super::forward::Forwarder;
use super::Datapath;
use crate::link::tcp::{Conn, TcpLink};
use crate::sys::epoll::{self, Epoll};
use crate::sys::thread::set_realtime;
use crate::sys::udp::{RxBatch, UdpEndpoint};
use crate::settings::{IfaceDispatch, Sched};
use vnet_core::wire::{gro_segments, parse_vxlan, TcpFramer, VXLAN_HDR_LEN};
use crate::stats::{DropReason, ThreadStats};
use crate::link::wireguard::RunSink;
use crate::link::Rx;
use crate::nic::{GuestFrame, RxBuffers, RxFrame};
use crate::topology::{Slot, Snapshot};
use vnet_core::offload::{VnetHdr, MAX_PIECES, VNET_HDR_LEN};
use anyhow::{bail, Result};
use std::io::{self, Read};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::Ordering::{Acquire, Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vnet_core::command::{Mode, YieldStrategy};

const TOKEN_WAKE: u64 = u64::MAX;
/// UDP sockets: `TOKEN_SOCKET + i` for VNET/P v4, v6, VXLAN v4, v6,
/// WireGuard.
const TOKEN_SOCKET: u64 = u64::MAX - 8;
/// Other sources: kind in the high half, index into the thread's list of
/// that kind in the low half.
const KIND_NIC: u64 = 1 << 32;
const KIND_DIRECT: u64 = 2 << 32;
const KIND_TCP: u64 = 3 << 32;
const KIND_TCP_EVENT: u64 = 4 << 32;
const KIND_MASK: u64 = 0xff << 32;
/// Room for the largest frame plus its virtio-net header.
const BUF_LEN: usize = 65536 + 128;
/// Bytes read from one TCP link per event (then the other sources get a turn).
const TCP_READ_BATCH: usize = 256 << 10;

/// This thread's view of one interface it owns.
#[derive(Clone)]
struct Owned {
    id: u32,
    slot: u32,
    fd: RawFd,
    settings: IfaceDispatch,
    /// Running VMM-driven (polled) right now.
    polled: bool,
    /// Frames in + out at the start of the adaptive window, and when it began.
    window_count: u64,
    window_start: Instant,
}

/// This thread's side of one TCP link it owns: the connection it watches
/// and the stream's partial frame. Kept across snapshots while the link is.
struct TcpPort {
    id: u32,
    slot: u32,
    link: Arc<TcpLink>,
    conn: Option<Conn>,
    /// Watching for the socket to drain (EPOLLOUT).
    want_out: bool,
    framer: TcpFramer,
}

struct Worker {
    dp: Arc<Datapath>,
    /// This thread's daemon-wide counters (the forwarder's too).
    st: Arc<ThreadStats>,
    index: usize,
    epoll: Epoll,
    snap: Arc<Snapshot>,
    owned: Vec<Owned>,
    /// Direct links this thread reads: (slot, fd).
    direct: Vec<(u32, RawFd)>,
    tcp: Vec<TcpPort>,
    /// Which of the UDP sockets are in the epoll set.
    sockets: [bool; SOCKETS],
    fwd: Forwarder,
    buf: Vec<u8>,
    /// The frame a NIC left in its guest's memory (cut-through).
    in_place: GuestFrame,
    rx: RxBatch,
    last_work: Instant,
    /// In the real-time class now; whether the kernel allows it.
    realtime: bool,
    realtime_ok: bool,
    /// The last poll pass found no work.
    idle_pass: bool,
}

pub fn run(dp: Arc<Datapath>, index: usize) -> Result<()> {
    let epoll = Epoll::new(64)?;
    epoll.add(dp.workers[index].wake.as_raw_fd(), epoll::IN, TOKEN_WAKE)?;
    let snap = Arc::new(Snapshot::empty());
    let st = dp.worker_stats(index);
    let mut w = Worker {
        fwd: Forwarder::new(st.clone(), dp.fast.clone()),
        st,
        dp,
        index,
        epoll,
        snap,
        owned: Vec::new(),
        direct: Vec::new(),
        tcp: Vec::new(),
        sockets: [false; SOCKETS],
        buf: vec![0u8; BUF_LEN],
        in_place: GuestFrame::default(),
        rx: RxBatch::default(),
        last_work: Instant::now(),
        realtime: false,
        realtime_ok: true,
        idle_pass: false,
    };
    w.reload();
    w.run()
}

impl Worker {
    fn run(&mut self) -> Result<()> {
        loop {
            if self.dp.stop.load(Acquire) {
                return Ok(());
            }
            let d = self.snap.dispatch;
            let polling = self.owned.iter().any(|o| o.polled);
            let realtime = self.dp.sched == Sched::Realtime && !polling && self.realtime_ok;
            if realtime != self.realtime {
                self.realtime_ok = set_realtime(realtime) || !realtime;
                self.realtime = realtime && self.realtime_ok;
            }
            let mut timeout = None;
            if polling {
                let work = self.poll_pass();
                let now = Instant::now();
                self.idle_pass = work == 0;
                if work > 0 {
                    self.st.dispatch.busy_passes.fetch_add(1, Relaxed);
                    self.last_work = now;
                    timeout = Some(Duration::ZERO);
                } else {
                    self.st.dispatch.idle_passes.fetch_add(1, Relaxed);
                    let sleep = Duration::from_micros(d.sleep_us as u64);
                    let immediate = match d.yield_strategy {
                        YieldStrategy::Immediate => true,
                        YieldStrategy::Timed => false,
                        YieldStrategy::Adaptive => now.duration_since(self.last_work) < Duration::from_micros(d.nowork_us as u64),
                    };
                    if immediate {
                        self.st.dispatch.yields.fetch_add(1, Relaxed);
                        // SAFETY: plain sched_yield.
                        unsafe { libc::sched_yield() };
                        timeout = Some(Duration::ZERO);
                    } else {
                        self.st.dispatch.sleeps.fetch_add(1, Relaxed);
                        timeout = Some(sleep);
                    }
                }
            }
            // Interrupts held back (optimistic interrupts, "too hot") go at
            // the end of the busy period: a poll pass that found nothing, or
            // nothing ready when the thread would sleep.
            let mut ready = None;
            if self.fwd.has_deferred() {
                if self.idle_pass {
                    self.fwd.idle(&self.snap);
                } else if timeout != Some(Duration::ZERO) {
                    match self.epoll.wait(Some(Duration::ZERO)) {
                        Ok(0) => self.fwd.idle(&self.snap),
                        Ok(n) => ready = Some(n),
                        Err(e) => bail!("epoll wait failed: {e}"),
                    }
                }
            }
            let n = match ready.map_or_else(|| self.epoll.wait(timeout), Ok) {
                Ok(n) => n,
                Err(e) => bail!("epoll wait failed: {e}"),
            };
            if let Some(e) = self.epoll.take_fallback() {
                tracing::info!("epoll_pwait2 unavailable ({e}); waiting with epoll_wait (millisecond timeouts)");
            }
            if n > 0 {
                self.st.dispatch.wakeups.fetch_add(1, Relaxed);
            }
            let mut woken = false;
            for i in 0..n {
                let ev = self.epoll.event(i);
                let token = ev.token;
                if token == TOKEN_WAKE {
                    woken = true;
                    continue;
                }
                if token >= TOKEN_SOCKET {
                    self.drain_socket((token - TOKEN_SOCKET) as usize);
                    continue;
                }
                let at = (token & 0xffff_ffff) as usize;
                match token & KIND_MASK {
                    KIND_NIC => {
                        if let Some(o) = self.owned.get(at) {
                            let slot = o.slot;
                            self.drain_nic(slot);
                        }
                    }
                    KIND_DIRECT => {
                        if let Some(&(slot, _)) = self.direct.get(at) {
                            self.drain_direct(slot);
                        }
                    }
                    KIND_TCP => {
                        if ev.events & epoll::OUT != 0 {
                            self.tcp_writable(at);
                        }
                        if ev.events & (epoll::IN | epoll::HUP | epoll::ERR | epoll::RDHUP) != 0 {
                            self.drain_tcp(at);
                        }
                    }
                    KIND_TCP_EVENT => self.tcp_event(at),
                    _ => {}
                }
            }
            self.fwd.flush(&self.snap);
            if woken {
                self.dp.workers[self.index].wake.drain();
                self.reload();
            }
            self.adapt();
        }
    }

    /// One VMM-driven pass: every polled NIC, and this thread's UDP sockets.
    fn poll_pass(&mut self) -> usize {
        let mut work = 0;
        for i in 0..self.owned.len() {
            if self.owned[i].polled {
                work += self.drain_nic(self.owned[i].slot);
            }
        }
        for i in 0..SOCKETS {
            if self.sockets[i] {
                work += self.drain_socket(i);
            }
        }
        self.fwd.flush(&self.snap);
        work
    }

    /// Takes up to `quota` frames from the NIC at `slot`; returns how many.
    fn drain_nic(&mut self, slot: u32) -> usize {
        let snap = &self.snap;
        let Some(iface) = snap.ifaces.get(slot as usize) else { return 0 };
        let quota = snap.dispatch.quota as usize;
        let (fwd, st) = (&mut self.fwd, &*self.st);
        let mut rx = RxBuffers { buf: &mut self.buf, in_place: snap.dispatch.cut_through.then_some(&mut self.in_place) };
        let mut n = 0;
        let r = iface.nic.recv_burst(&mut rx, quota, &mut |f| {
            match f {
                RxFrame::Copied(frame, vnet) => {
                    n += 1;
                    fwd.from_port(snap, Slot::Iface(slot), frame, vnet);
                }
                RxFrame::InPlace(g) => {
                    n += 1;
                    // Routed on the head vnetd copied, sent with the rest
                    // from where it lies.
                    let vnet = g.vnet;
                    let mut rest = [&[][..]; MAX_PIECES];
                    let (head, k) = g.parts(&mut rest);
                    fwd.from_port_pieces(snap, Slot::Iface(slot), head, &rest[..k], vnet);
                    g.release();
                }
                RxFrame::Oversize => {
                    st.drop_at(Some(&iface.stats), DropReason::Oversize);
                }
            }
        });
        if let Err(e) = r {
            tracing::warn!(iface = %iface.name, "read from NIC failed: {e}");
        }
        if n > 0 {
            self.st.dispatch.rx_frames.fetch_add(n as u64, Relaxed);
            self.st.dispatch.rx_passes.fetch_add(1, Relaxed);
        }
        // The buffers read go back to the guest at the end of the pass.
        self.fwd.touch(slot);
        n
    }

    /// Takes up to `quota` datagrams from UDP socket `i` (GRO runs count as
    /// their datagrams); returns how many.
    fn drain_socket(&mut self, i: usize) -> usize {
        if i == WIREGUARD {
            return self.drain_wireguard();
        }
        let dp = &*self.dp;
        let st = &*self.st;
        let Some(ep) = socket(dp, i, self.index) else { return 0 };
        let is_vxlan = i >= 2;
        let snap = &self.snap;
        let quota = snap.dispatch.quota as usize;
        let mut frames = 0;
        while frames < quota {
            let Some(n) = receive(ep, &mut self.rx) else { break };
            for m in 0..n {
                let len = self.rx.lens[m];
                let seg = self.rx.seg[m];
                let count = gro_segments(len, seg).count();
                frames += count;
                let Some(from) = self.rx.from[m] else { continue };
                let udp_link = if is_vxlan { None } else { snap.link_for_sender(from) };
                if !is_vxlan && udp_link.is_none() {
                    for r in gro_segments(len, seg) {
                        st.global.received(r.len());
                        st.drop_at(None, DropReason::UnknownSender);
                    }
                    tracing::debug!(%from, "datagram from an address with no link dropped");
                    continue;
                }
                if count > 1 {
                    st.offload.gro_runs.fetch_add(1, Relaxed);
                }
                let truncated = self.rx.truncated[m];
                let buf = self.rx.buf_mut(m);
                for r in gro_segments(len, seg) {
                    let (link, start) = if is_vxlan {
                        let vni = parse_vxlan(&buf[r.clone()]);
                        match vni.and_then(|vni| snap.vxlan_link_for(from.ip(), vni)) {
                            Some(l) => (l, r.start + VXLAN_HDR_LEN),
                            None => {
                                st.global.received(r.len());
                                st.drop_at(None, if vni.is_some() { DropReason::UnknownSender } else { DropReason::Malformed });
                                continue;
                            }
                        }
                    } else {
                        (udp_link.unwrap(), r.start)
                    };
                    if truncated {
                        st.drop_at(Some(&snap.links[link as usize].stats), DropReason::Oversize);
                        break;
                    }
                    self.fwd.from_link(snap, link, buf, start..r.end);
                }
                self.fwd.end_run(snap, buf);
            }
        }
        frames
    }

    /// Takes up to `quota` datagrams from this thread's WireGuard socket:
    /// each data message opened (decrypted and checked) into `buf`, a GRO
    /// run's frames one after another, then routed as one run; each
    /// handshake message queued for the handshake thread (no public-key
    /// work here).
    fn drain_wireguard(&mut self) -> usize {
        let Some(hub) = self.dp.wireguard.clone() else { return 0 };
        let Some(ep) = hub.group.get(self.index) else { return 0 };
        let (st, snap) = (&*self.st, &self.snap);
        let quota = snap.dispatch.quota as usize;
        let mut frames = 0;
        while frames < quota {
            let Some(n) = receive(ep, &mut self.rx) else { break };
            for m in 0..n {
                let (len, seg) = (self.rx.lens[m], self.rx.seg[m]);
                frames += gro_segments(len, seg).count();
                let Some(from) = self.rx.from[m] else { continue };
                if self.rx.truncated[m] {
                    st.global.received(len);
                    st.drop_at(None, DropReason::Oversize);
                    continue;
                }
                let run = &self.rx.buf_mut(m)[..len];
                let mut sink = RunToForwarder { fwd: &mut self.fwd, snap };
                hub.open_run(&**snap, st, from, run, seg, &mut self.buf, &mut sink);
            }
        }
        frames
    }

    /// Takes up to `quota` frames from the direct link at `slot`.
    fn drain_direct(&mut self, slot: u32) -> usize {
        let snap = &self.snap;
        let Some(link) = snap.links.get(slot as usize) else { return 0 };
        let Rx::Device(port) = link.transport.rx() else { return 0 };
        let quota = snap.dispatch.quota as usize;
        let mut n = 0;
        while n < quota {
            match port.recv(&mut self.buf) {
                Ok(len) => {
                    n += 1;
                    let Some(vnet) = VnetHdr::parse(&self.buf[..len]) else { continue };
                    self.fwd.from_port(snap, Slot::Link(slot), &mut self.buf[VNET_HDR_LEN..len], vnet);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.raw_os_error() == Some(libc::EMSGSIZE) => {
                    self.st.drop_at(Some(&link.stats), DropReason::Oversize);
                }
                Err(e) => {
                    tracing::warn!(link = %link.name, "read from device failed: {e}");
                    break;
                }
            }
        }
        n
    }

    /// Reads what the TCP link `tcp[at]`'s connection has (up to
    /// `TCP_READ_BATCH` bytes) and routes the complete frames as one run.
    fn drain_tcp(&mut self, at: usize) {
        let snap = &self.snap;
        let Some(port) = self.tcp.get_mut(at) else { return };
        let Some(conn) = port.conn.clone() else { return };
        let link = &snap.links[port.slot as usize];
        let mut read = 0;
        let mut ended = false;
        while read < TCP_READ_BATCH {
            port.framer.compact();
            let r = (&*conn.stream).read(port.framer.spare());
            let n = match r {
                Ok(0) => {
                    ended = true;
                    break;
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::info!(link = %link.name, "TCP link read failed: {e}");
                    ended = true;
                    break;
                }
            };
            read += n;
            port.framer.filled(n);
            let mut bad = None;
            while let Some(f) = port.framer.next_frame() {
                match f {
                    Ok(r) => self.fwd.from_link(snap, port.slot, port.framer.buf_mut(), r),
                    Err(b) => {
                        bad = Some(b);
                        break;
                    }
                }
            }
            // The run ends with what this read brought: a complete frame
            // never waits for the next one, nor for another snapshot.
            self.fwd.end_run(snap, port.framer.buf());
            if let Some(b) = bad {
                // The stream is out of step: nothing after this can be trusted.
                self.st.drop_at(Some(&link.stats), DropReason::Malformed);
                tracing::warn!(link = %link.name, len = b.0, "bad frame length on TCP link; reconnecting");
                ended = true;
                break;
            }
        }
        if ended {
            port.link.lost(conn.id);
            self.sync_tcp(at);
        }
    }

    /// The TCP link `tcp[at]`'s socket drained: write out what waits.
    fn tcp_writable(&mut self, at: usize) {
        let Some(port) = self.tcp.get(at) else { return };
        let link = &self.snap.links[port.slot as usize];
        let w = port.link.write_out();
        if w.frames > 0 {
            self.st.sent_at(&link.stats, w.frames, w.bytes);
        }
        if !w.blocked {
            self.sync_tcp(at);
        }
    }

    /// The TCP link `tcp[at]` signalled: its connection changed, or frames
    /// wait for the socket.
    fn tcp_event(&mut self, at: usize) {
        if let Some(port) = self.tcp.get(at) {
            port.link.clear_event();
            self.sync_tcp(at);
        }
    }

    /// Brings this thread's watch of `tcp[at]` in line with the link: the
    /// live connection in the epoll set, with EPOLLOUT while frames wait.
    fn sync_tcp(&mut self, at: usize) {
        let Some(port) = self.tcp.get_mut(at) else { return };
        let live = port.link.conn();
        let same = matches!((&port.conn, &live), (Some(a), Some(b)) if a.id == b.id);
        if !same {
            if let Some(old) = port.conn.take() {
                self.epoll.delete(old.stream.as_raw_fd());
            }
            port.framer.reset();
            port.want_out = false;
            if let Some(c) = live {
                let ev = epoll::IN | epoll::RDHUP;
                if self.epoll.add(c.stream.as_raw_fd(), ev, KIND_TCP | at as u64).is_ok() {
                    port.conn = Some(c);
                }
            }
        }
        let Some(c) = &port.conn else { return };
        let want_out = port.link.has_pending();
        if want_out != port.want_out {
            let mut ev = epoll::IN | epoll::RDHUP;
            if want_out {
                ev |= epoll::OUT;
            }
            if self.epoll.modify(c.stream.as_raw_fd(), ev, KIND_TCP | at as u64).is_ok() {
                port.want_out = want_out;
            }
        }
    }

    /// Picks up a new snapshot: which interfaces and links this thread
    /// owns, in which mode, and the epoll set to match.
    fn reload(&mut self) {
        let next = self.dp.snapshot();
        for o in &self.owned {
            if !o.polled {
                self.epoll.delete(o.fd);
            }
        }
        let workers = self.dp.worker_count();
        let me = self.index;
        let mine = |id: u32| id as usize % workers == me;
        let mut owned = Vec::new();
        for (slot, iface) in next.ifaces.iter().enumerate() {
            if !mine(iface.id) {
                continue;
            }
            let settings = next.iface_dispatch[slot];
            // An interface keeps its running mode across unrelated changes.
            let was = self.owned.iter().find(|o| o.id == iface.id);
            let was_polled = was.map(|o| o.polled);
            let polled = match settings.mode {
                Mode::GuestDriven => false,
                Mode::VmmDriven => true,
                Mode::Adaptive => was_polled.unwrap_or(false),
            };
            let fd = iface.nic.event_fd();
            iface.nic.set_notify(!polled);
            if !polled && self.epoll.add(fd, epoll::IN, KIND_NIC | owned.len() as u64).is_err() {
                tracing::warn!(iface = %iface.name, "cannot watch NIC");
            }
            iface.running_mode.store(if polled { Mode::VmmDriven } else { Mode::GuestDriven } as u8, Relaxed);
            let count = iface.stats.in_frames.load(Relaxed) + iface.stats.out_frames.load(Relaxed);
            let window_start = was.map_or_else(Instant::now, |o| o.window_start);
            owned.push(Owned { id: iface.id, slot: slot as u32, fd, settings, polled, window_count: count, window_start });
        }
        self.owned = owned;
        // Direct links, spread over threads like interfaces.
        for &(_, fd) in &self.direct {
            self.epoll.delete(fd);
        }
        self.direct.clear();
        for (slot, link) in next.links.iter().enumerate() {
            if let Rx::Device(port) = link.transport.rx() {
                if mine(link.id) {
                    let fd = port.as_raw_fd();
                    if self.epoll.add(fd, epoll::IN, KIND_DIRECT | self.direct.len() as u64).is_ok() {
                        self.direct.push((slot as u32, fd));
                    }
                }
            }
        }
        // TCP links: keep each one's stream state while the link stays.
        let mut old = std::mem::take(&mut self.tcp);
        for p in &old {
            self.epoll.delete(p.link.event_fd());
            if let Some(c) = &p.conn {
                self.epoll.delete(c.stream.as_raw_fd());
            }
        }
        for (slot, link) in next.links.iter().enumerate() {
            let Rx::Stream(t) = link.transport.rx() else { continue };
            if !mine(link.id) {
                continue;
            }
            let at = self.tcp.len();
            let mut port = match old.iter().position(|p| p.id == link.id && Arc::ptr_eq(&p.link, t)) {
                Some(i) => old.swap_remove(i),
                None => TcpPort {
                    id: link.id,
                    slot: 0,
                    link: t.clone(),
                    conn: None,
                    want_out: false,
                    framer: TcpFramer::new(TCP_READ_BATCH),
                },
            };
            port.slot = slot as u32;
            // Re-added below with this thread's new token.
            let conn = port.conn.take();
            port.want_out = false;
            if self.epoll.add(t.event_fd(), epoll::IN, KIND_TCP_EVENT | at as u64).is_err() {
                tracing::warn!(link = %link.name, "cannot watch TCP link");
            }
            self.tcp.push(port);
            if let Some(c) = conn {
                // Same connection: keep its partial frame.
                let ev = epoll::IN | epoll::RDHUP;
                if self.epoll.add(c.stream.as_raw_fd(), ev, KIND_TCP | at as u64).is_ok() {
                    self.tcp[at].conn = Some(c);
                }
            }
            self.sync_tcp(at);
        }
        // Each thread reads its own socket of each UDP group (VXLAN's once
        // they exist).
        for i in 0..SOCKETS {
            if !self.sockets[i] {
                if let Some(fd) = socket(&self.dp, i, self.index).map(|e| e.as_raw_fd()) {
                    self.sockets[i] = self.epoll.add(fd, epoll::IN, TOKEN_SOCKET + i as u64).is_ok();
                }
            }
        }
        self.snap = next;
        self.dp.ran(self.index, self.snap.generation);
    }

    /// Adaptive mode: at the end of each interface's window ω, switch it if
    /// its packet rate crossed α_u (up) or α_l (down).
    fn adapt(&mut self) {
        let now = Instant::now();
        for (at, o) in self.owned.iter_mut().enumerate() {
            let d = o.settings;
            let elapsed = now.duration_since(o.window_start);
            if elapsed < Duration::from_millis(d.window_ms as u64) {
                continue;
            }
            o.window_start = now;
            let iface = &self.snap.ifaces[o.slot as usize];
            let count = iface.stats.in_frames.load(Relaxed) + iface.stats.out_frames.load(Relaxed);
            let rate = (count - o.window_count) as f64 / elapsed.as_secs_f64();
            o.window_count = count;
            if d.mode != Mode::Adaptive {
                continue;
            }
            let switch = if o.polled { rate < d.alpha_lower as f64 } else { rate > d.alpha_upper as f64 };
            if !switch {
                continue;
            }
            o.polled = !o.polled;
            iface.nic.set_notify(!o.polled);
            if o.polled {
                self.epoll.delete(o.fd);
            } else if self.epoll.add(o.fd, epoll::IN, KIND_NIC | at as u64).is_err() {
                tracing::warn!(iface = %iface.name, "cannot watch NIC");
            }
            iface.running_mode.store(if o.polled { Mode::VmmDriven } else { Mode::GuestDriven } as u8, Relaxed);
            iface.mode_switches.fetch_add(1, Relaxed);
            tracing::debug!(iface = %iface.name, rate, polled = o.polled, "adaptive mode switch");
        }
    }
}

/// One `recvmmsg` on `ep` into `rx`: how many datagrams, or None when
/// there are none (or it failed, logged).
fn receive(ep: &UdpEndpoint, rx: &mut RxBatch) -> Option<usize> {
    loop {
        match ep.recv_batch(rx) {
            Ok(n) => return Some(n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return None,
            // ICMP errors for earlier sends surface here; they concern
            // those sends, not this receive.
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => continue,
            Err(e) => {
                tracing::warn!(local = %ep.local_addr(), "UDP receive failed: {e}");
                return None;
            }
        }
    }
}

/// UDP socket groups a thread reads, and WireGuard's place among them.
const SOCKETS: usize = 5;
const WIREGUARD: usize = 4;

/// Thread `t`'s socket of UDP group `i`: VNET/P IPv4, IPv6, VXLAN IPv4, IPv6,
/// WireGuard.
fn socket(dp: &Datapath, i: usize, t: usize) -> Option<&UdpEndpoint> {
    let group: &[Arc<UdpEndpoint>] = match i {
        0 => &dp.udp4,
        1 => &dp.udp6,
        2 => dp.vxlan4.get().map_or(&[], |g| &g[..]),
        3 => dp.vxlan6.get().map_or(&[], |g| &g[..]),
        _ => dp.wireguard.as_ref().map_or(&[], |w| &w.group[..]),
    };
    group.get(t).map(|e| &**e)
}

/// A WireGuard run's frames, routed by the forwarder as one run.
struct RunToForwarder<'a> {
    fwd: &'a mut Forwarder,
    snap: &'a Snapshot,
}

impl RunSink for RunToForwarder<'_> {
    fn frame(&mut self, slot: u32, buf: &mut [u8], frame: std::ops::Range<usize>) {
        self.fwd.from_link(self.snap, slot, buf, frame);
    }

    fn end(&mut self, buf: &[u8]) {
        self.fwd.end_run(self.snap, buf);
    }
}
