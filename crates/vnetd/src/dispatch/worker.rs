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
//! Besides its NICs, the thread reads link sources, whatever their kind
//! (`link::LinkSource`): its socket of every UDP carrier, and the streams
//! and devices of the links it owns. A source says which descriptors to
//! watch (and when they change, as a TCP link's connection does); the thread
//! says when one is ready, and the source reads it into the forwarder.
//!
//! Epoll tokens carry the kind of source (NIC or link source) and its place
//! in this thread's lists, which are rebuilt (with the epoll set) on every
//! snapshot.

use super::forward::Forwarder;
use super::Datapath;
use crate::link::{LinkSource, RxCx};
use crate::port::Intake;
use crate::sys::epoll::{self, Epoll};
use crate::sys::thread::set_realtime;
use crate::sys::udp::RxBatch;
use crate::settings::{IfaceDispatch, Sched};
use crate::stats::{DropReason, ThreadStats};
use crate::nic::{GuestFrame, RxBuffers, RxFrame};
use crate::topology::{Slot, Snapshot};
use vnet_core::offload::{VnetHdr, MAX_PIECES};
use anyhow::{bail, Result};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::Ordering::{Acquire, Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vnet_core::command::{Mode, YieldStrategy};

const TOKEN_WAKE: u64 = u64::MAX;
/// Sources: NIC or link source in the high half, the place in this thread's
/// list of them (and, for a link source, which of its descriptors in the
/// low byte) in the low half.
const KIND_NIC: u64 = 1 << 32;
const KIND_LINK: u64 = 2 << 32;
const KIND_MASK: u64 = 0xff << 32;
/// Room for the largest frame plus its virtio-net header.
const BUF_LEN: usize = 65536 + 128;

/// This thread's view of one interface it owns.
#[derive(Clone)]
struct Owned {
    id: u32,
    slot: u32,
    /// Which of the NIC's queues (a multi-queue NIC's pairs are spread over
    /// the dispatchers, each owned by one).
    queue: u32,
    fd: RawFd,
    settings: IfaceDispatch,
    /// Running VMM-driven (polled) right now.
    polled: bool,
    /// Frames in + out at the start of the adaptive window, and when it began.
    window_count: u64,
    window_start: Instant,
}

/// A link source this thread reads, and what of it is in the epoll set.
struct Watched {
    src: Arc<dyn LinkSource>,
    generation: u64,
    fds: Vec<(RawFd, u32)>,
}

struct Worker {
    dp: Arc<Datapath>,
    /// This thread's daemon-wide counters (the forwarder's too).
    st: Arc<ThreadStats>,
    index: usize,
    epoll: Epoll,
    snap: Arc<Snapshot>,
    owned: Vec<Owned>,
    sources: Vec<Watched>,
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
    /// The NIC queues drained this pass (slot, queue), released after the
    /// pass's sends.
    drained: Vec<(u32, u32)>,
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
        sources: Vec::new(),
        buf: vec![0u8; BUF_LEN],
        in_place: GuestFrame::default(),
        rx: RxBatch::default(),
        last_work: Instant::now(),
        realtime: false,
        realtime_ok: true,
        drained: Vec::new(),
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
                let at = (token & 0xffff_ffff) as usize;
                match token & KIND_MASK {
                    KIND_NIC => {
                        if let Some(o) = self.owned.get(at) {
                            let (slot, queue) = (o.slot, o.queue);
                            self.drain_nic(slot, queue);
                        }
                    }
                    KIND_LINK => {
                        self.drain_source(at >> 8, at & 0xff, ev.events);
                    }
                    _ => {}
                }
            }
            self.flush();
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
                work += self.drain_nic(self.owned[i].slot, self.owned[i].queue);
            }
        }
        for k in 0..self.sources.len() {
            if self.sources[k].src.polled() {
                work += self.drain_source(k, 0, epoll::IN);
            }
        }
        self.flush();
        work
    }

    /// The pass ends: its sends go out, the frames it wrote into guests
    /// become visible, and then the transmit buffers it took go back to
    /// the guests they came from (`VirtualNic::release`).
    fn flush(&mut self) {
        self.fwd.flush(&self.snap);
        for (slot, queue) in self.drained.drain(..) {
            if let Some(iface) = self.snap.ifaces.get(slot as usize) {
                iface.nic.release(queue as usize);
            }
        }
    }

    /// Takes up to `quota` frames from queue `queue` of the NIC at `slot`;
    /// returns how many.
    fn drain_nic(&mut self, slot: u32, queue: u32) -> usize {
        let snap = &self.snap;
        let Some(iface) = snap.ifaces.get(slot as usize) else { return 0 };
        let quota = snap.dispatch.quota as usize;
        let (fwd, st) = (&mut self.fwd, &*self.st);
        let mut rx = RxBuffers { buf: &mut self.buf, in_place: snap.dispatch.cut_through.then_some(&mut self.in_place) };
        let mut n = 0;
        let r = iface.nic.recv_burst(queue as usize, &mut rx, quota, &mut |f| {
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
        if !self.drained.contains(&(slot, queue)) {
            self.drained.push((slot, queue));
        }
        n
    }

    /// Link source `k`'s descriptor `i` is ready with `events`: the source
    /// reads it into the forwarder; then its descriptors are watched anew if
    /// they changed (a TCP link's connection, its wish to write). Frames read.
    fn drain_source(&mut self, k: usize, i: usize, events: u32) -> usize {
        let Some(w) = self.sources.get(k) else { return 0 };
        let snap = &*self.snap;
        let quota = snap.dispatch.quota as usize;
        let mut intake = ToForwarder { fwd: &mut self.fwd, snap };
        let mut cx = RxCx { links: snap, st: &self.st, intake: &mut intake, buf: &mut self.buf, rx: &mut self.rx, quota };
        let n = w.src.ready(i, events, &mut cx);
        self.rewatch(k);
        n
    }

    /// Brings the epoll set in line with link source `k`'s descriptors, if
    /// they changed.
    fn rewatch(&mut self, k: usize) {
        let generation = self.sources[k].src.generation();
        if generation == self.sources[k].generation {
            return;
        }
        let fds = self.sources[k].src.watch();
        let w = &mut self.sources[k];
        for (fd, _) in &w.fds {
            self.epoll.delete(*fd);
        }
        w.generation = generation;
        w.fds = fds;
        for (j, &(fd, ev)) in w.fds.iter().enumerate() {
            if self.epoll.add(fd, ev, KIND_LINK | ((k as u64) << 8) | j as u64).is_err() {
                tracing::warn!("cannot watch a link source's descriptor");
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
        // Queue q of interface `id` is dispatcher (id + q)'s: a multi-queue
        // NIC's pairs go round the dispatchers.
        let mine = |id: u32, q: usize| (id as usize + q) % workers == me;
        let mut owned = Vec::new();
        let queues = next.ifaces.iter().enumerate().flat_map(|(slot, iface)| (0..iface.nic.queues()).map(move |q| (slot, iface, q)));
        for (slot, iface, queue) in queues.filter(|&(_, i, q)| mine(i.id, q)) {
            let settings = next.iface_dispatch[slot];
            // An interface keeps its running mode across unrelated changes.
            let was = self.owned.iter().find(|o| o.id == iface.id && o.queue as usize == queue);
            let was_polled = was.map(|o| o.polled);
            let polled = match settings.mode {
                Mode::GuestDriven => false,
                Mode::VmmDriven => true,
                Mode::Adaptive => was_polled.unwrap_or(false),
            };
            let fd = iface.nic.event_fd(queue);
            iface.nic.set_notify(queue, !polled);
            if !polled && self.epoll.add(fd, epoll::IN, KIND_NIC | owned.len() as u64).is_err() {
                tracing::warn!(iface = %iface.name, "cannot watch NIC");
            }
            iface.running_mode.store(if polled { Mode::VmmDriven } else { Mode::GuestDriven } as u8, Relaxed);
            let count = iface.stats.in_frames.load(Relaxed) + iface.stats.out_frames.load(Relaxed);
            let window_start = was.map_or_else(Instant::now, |o| o.window_start);
            owned.push(Owned { id: iface.id, slot: slot as u32, queue: queue as u32, fd, settings, polled, window_count: count, window_start });
        }
        self.owned = owned;
        // Link sources: this thread's socket of every carrier, the streams
        // and devices of the links it owns.
        for w in std::mem::take(&mut self.sources) {
            for (fd, _) in w.fds {
                self.epoll.delete(fd);
            }
        }
        self.sources = self.dp.link_sources(me, &next).into_iter().map(|src| Watched { src, generation: u64::MAX, fds: Vec::new() }).collect();
        for k in 0..self.sources.len() {
            self.rewatch(k);
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
            iface.nic.set_notify(o.queue as usize, !o.polled);
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

/// What link sources read, handed to the forwarder with the snapshot.
struct ToForwarder<'a> {
    fwd: &'a mut Forwarder,
    snap: &'a Snapshot,
}

impl Intake for ToForwarder<'_> {
    fn port_frame(&mut self, at: Slot, frame: &mut [u8], vnet: VnetHdr) {
        self.fwd.from_port(self.snap, at, frame, vnet);
    }

    fn link_frame(&mut self, slot: u32, buf: &mut [u8], frame: std::ops::Range<usize>) {
        self.fwd.from_link(self.snap, slot, buf, frame);
    }

    fn end_run(&mut self, buf: &[u8]) {
        self.fwd.end_run(self.snap, buf);
    }
}
