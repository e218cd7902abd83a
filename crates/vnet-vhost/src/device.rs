//! One vhost-user virtio-net device: its queue pairs (up to `MAX_PAIRS`,
//! `VIRTIO_NET_F_MQ`), the features the frontend acknowledged, its
//! counters, and what a dispatcher does with it (take frames the guest sent
//! on one pair's transmit queue, put frames into its receive buffers,
//! interrupt it once per burst).
//!
//! A queue pair is the unit a dispatcher serves: it watches one descriptor
//! per pair (`event_fd(pair)`): an epoll set holding that pair's transmit
//! kick eventfd (which changes with each connection) and a poke the
//! protocol thread uses when a ring starts, and the device itself uses when
//! a pass stopped at its budget. A guest's driver picks the transmit queue
//! per flow (Linux: XPS), and one dispatcher drains each, so a flow's
//! frames stay in order. Frames for the guest go to the receive queue of
//! the pair their flow hashes to (`steer`), among the pairs the guest has
//! running. Receive-queue kicks are never asked for: a frame for a guest
//! with no posted buffers is dropped and counted (`queue_full`), as a full
//! TAP's is.

use crate::counters::Counters;
use crate::frame::{GuestFrame, MAX_HEAD};
use crate::irq::{IrqDecision, IrqPolicy};
use crate::memory::{DirtyLog, MemoryPolicy};
use crate::queue::{Health, Popped, Ring};
use crate::taken::TakenLog;
use virtio_queue::QueueT;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use vnet_core::offload::VnetHdr;
use vnet_sys::epoll::{self, Epoll};
use vnet_sys::eventfd::EventFd;

/// Feature bits (virtio 1.2, 5.1.3 and 6).
pub mod feature {
    pub const CSUM: u64 = 1 << 0;
    pub const GUEST_CSUM: u64 = 1 << 1;
    pub const GUEST_TSO4: u64 = 1 << 7;
    pub const GUEST_TSO6: u64 = 1 << 8;
    pub const GUEST_ECN: u64 = 1 << 9;
    pub const HOST_TSO4: u64 = 1 << 11;
    pub const HOST_TSO6: u64 = 1 << 12;
    pub const HOST_ECN: u64 = 1 << 13;
    pub const MRG_RXBUF: u64 = 1 << 15;
    /// `VHOST_F_LOG_ALL`: the frontend may ask for every write to be
    /// logged (live migration); offered only by a device whose memory logs.
    pub const LOG_ALL: u64 = 1 << 26;
    pub const INDIRECT_DESC: u64 = 1 << 28;
    pub const EVENT_IDX: u64 = 1 << 29;
    pub const PROTOCOL_FEATURES: u64 = 1 << 30;
    pub const VERSION_1: u64 = 1 << 32;
    /// Multi-queue: up to `MAX_PAIRS` queue pairs. The control queue that
    /// sets how many the guest uses is the VMM's (QEMU, DPDK's virtio-user
    /// answer it and enable or disable the pairs' rings with
    /// `SET_VRING_ENABLE`), never the backend's.
    pub const MQ: u64 = 1 << 22;
    /// What vnetd offers: what a modern guest uses. Offloads both ways, so
    /// that a guest's 64 KiB segments cross whole and merged runs reach it
    /// whole; several queue pairs, each served by a dispatcher.
    pub const OFFERED: u64 = CSUM
        | MQ
        | GUEST_CSUM
        | GUEST_TSO4
        | GUEST_TSO6
        | GUEST_ECN
        | HOST_TSO4
        | HOST_TSO6
        | HOST_ECN
        | MRG_RXBUF
        | INDIRECT_DESC
        | EVENT_IDX
        | PROTOCOL_FEATURES
        | VERSION_1;

    /// What a device whose guest memory is `B` offers.
    pub fn offered<B: crate::memory::DirtyLog>() -> u64 {
        OFFERED | if B::LOGS { LOG_ALL } else { 0 }
    }
}

/// Frames written into a guest's receive ring before they are made visible
/// to it, mid-burst.
pub const PUBLISH_EVERY: u16 = 64;

/// Queue 2k receives (vnetd → guest) and queue 2k+1 transmits, for pair k
/// (virtio-net's receiveq(k+1) and transmitq(k+1)); pair 0's are these.
pub const RX: usize = 0;
pub const TX: usize = 1;

/// Queue pairs a device serves at most (`GET_QUEUE_NUM` says twice as many
/// queues). Each pair costs an epoll set and an eventfd, and a watched
/// descriptor in its dispatcher, whether the guest uses it or not.
pub const MAX_PAIRS: usize = 8;

/// Which pair a queue is in, and whether it is that pair's receive queue.
#[inline]
pub fn pair_of(queue: usize) -> (usize, bool) {
    (queue / 2, queue % 2 == RX)
}

/// One queue pair: its rings, and the descriptor its dispatcher watches.
struct Pair<B: DirtyLog> {
    rings: [Mutex<Ring<B>>; 2],
    /// The transmit kick and `poke` in it.
    epoll: Epoll,
    poke: EventFd,
    /// Frames written into its receive ring, and taken from its transmit
    /// ring (`vhost_pair_frames` in `STATS`: which pairs carry traffic).
    rx_frames: AtomicU64,
    tx_frames: AtomicU64,
    /// Times either of its rings was locked (`vhost_ring_locks` in
    /// `STATS`: a burst is worked under one lock, not a frame).
    locks: AtomicU64,
    /// Its dispatcher wants kicks (guest-driven) or polls (VMM-driven).
    kicks_on: AtomicBool,
}

/// What the protocol thread and the dispatchers share.
pub struct Device<B: DirtyLog = ()> {
    /// Lock order: a dispatcher holds a transmit ring for a whole burst
    /// (`take_burst`), forwarding each frame as it is taken, so it may lock
    /// any device's receive ring under it; nothing is ever locked under a
    /// receive ring, and the protocol thread holds one ring at a time.
    pairs: Box<[Pair<B>]>,
    /// The pairs whose receive ring runs (bit k: pair k), where frames for
    /// the guest may go; kept by the protocol thread as rings start and
    /// stop.
    rx_running: AtomicU32,
    /// The pairs whose transmit ring runs: a polled pair that does not is
    /// passed over without a lock.
    tx_running: AtomicU32,
    /// The pairs with receive entries not yet made visible (bit k), for
    /// the next `flush` by whichever dispatcher comes first.
    pending: AtomicU32,
    /// The features the frontend acknowledged.
    pub(crate) acked: AtomicU64,
    pub(crate) memory: MemoryPolicy,
    pub connected: AtomicBool,
    pub counters: Arc<Counters>,
    /// How far each transmit ring was taken, for the vnetd after a crash
    /// (`taken`); None where no memfd could be made (then a crash may
    /// send the frames in flight twice).
    pub(crate) taken: Option<TakenLog>,
}

/// A frame taken from the guest.
pub enum Taken {
    /// In the caller's buffer: `len` bytes, with their offload header.
    Copied { len: usize, vnet: VnetHdr },
    /// In the caller's `GuestFrame`.
    InPlace,
    /// Longer than the caller's buffer: returned to the guest unread (the
    /// caller counts the drop).
    TooBig,
}

/// How the guest's driver takes frames: its header's length, and whether
/// one frame may fill several of its buffers.
struct Receiving {
    mergeable: bool,
    hdr_len: usize,
}

/// Frames and bytes.
#[derive(Default)]
struct Count(u64, u64);

impl Count {
    fn add(&mut self, len: usize) {
        self.0 += 1;
        self.1 += len as u64;
    }
}

/// What one burst took, counted at its end.
#[derive(Default)]
struct Tally {
    small: Count,
    scattered: Count,
    in_place: Count,
    head_bytes: u64,
    gathered: u64,
    bad: u64,
}

impl Tally {
    fn in_place(&mut self, f: &GuestFrame) {
        let (head, all) = (f.head_len(), f.len());
        self.in_place.add(all - head);
        self.head_bytes += head as u64;
        self.gathered += (f.pieces.len() > 1) as u64;
    }

    fn add_to(&self, c: &Counters) {
        let add = |a: &AtomicU64, v: u64| {
            if v > 0 {
                a.fetch_add(v, Relaxed);
            }
        };
        add(&c.tx_copied_small_frames, self.small.0);
        add(&c.tx_copied_small_bytes, self.small.1);
        add(&c.tx_copied_scattered_frames, self.scattered.0);
        add(&c.tx_copied_scattered_bytes, self.scattered.1);
        add(&c.tx_in_place_frames, self.in_place.0);
        add(&c.tx_in_place_bytes, self.in_place.1);
        add(&c.tx_head_copied_bytes, self.head_bytes);
        add(&c.tx_gathered_frames, self.gathered);
        add(&c.bad_chains, self.bad);
    }
}

impl<B: DirtyLog> Pair<B> {
    fn new(counters: &Arc<Counters>) -> io::Result<Pair<B>> {
        let p = Pair {
            rings: [Mutex::new(Ring::new(counters.clone())), Mutex::new(Ring::new(counters.clone()))],
            epoll: Epoll::new(0)?,
            poke: EventFd::new()?,
            rx_frames: AtomicU64::new(0),
            tx_frames: AtomicU64::new(0),
            locks: AtomicU64::new(0),
            kicks_on: AtomicBool::new(true),
        };
        p.epoll.add(p.poke.as_raw_fd(), epoll::IN, 0)?;
        Ok(p)
    }

    fn ring(&self, i: usize) -> std::sync::MutexGuard<'_, Ring<B>> {
        self.locks.fetch_add(1, Relaxed);
        self.rings[i].lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The bits of `mask`, lowest first.
fn bits(mut mask: u32) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        (mask != 0).then(|| {
            let k = mask.trailing_zeros() as usize;
            mask &= mask - 1;
            k
        })
    })
}

impl<B: DirtyLog> Device<B> {
    pub fn new(memory: MemoryPolicy) -> io::Result<Device<B>> {
        let counters = Arc::new(Counters::default());
        let pairs = (0..MAX_PAIRS).map(|_| Pair::new(&counters)).collect::<io::Result<Vec<_>>>()?;
        Ok(Device {
            pairs: pairs.into_boxed_slice(),
            rx_running: AtomicU32::new(0),
            tx_running: AtomicU32::new(0),
            pending: AtomicU32::new(0),
            acked: AtomicU64::new(0),
            memory,
            connected: AtomicBool::new(false),
            counters,
            taken: TakenLog::new().ok(),
        })
    }

    /// Queue `i` (2k receives, 2k+1 transmits, for pair k), locked.
    pub fn ring(&self, i: usize) -> std::sync::MutexGuard<'_, Ring<B>> {
        self.pairs[i / 2].ring(i % 2)
    }

    /// How many queues the device has (twice its pairs).
    pub fn queues(&self) -> usize {
        2 * self.pairs.len()
    }

    /// Whether the guest's driver works the device: pair 0's rings
    /// started. A VMM starts them when the VM runs (on a migration's
    /// destination, when it resumes there) and stops them when it stops
    /// (the source, at the switch-over).
    pub fn running(&self) -> bool {
        // One ring at a time (the lock order): a guard held to the end of
        // the `&&` would hold the receive ring while taking the transmit one.
        let rx = self.ring(RX).running();
        rx && self.ring(TX).running()
    }

    /// Queue `queue` is running or not (the protocol thread, after any
    /// message that may have started or stopped it): a receive queue
    /// joins or leaves the pairs frames for the guest go to.
    pub(crate) fn note_running(&self, queue: usize, running: bool) {
        let (k, rx) = pair_of(queue);
        if !running && !rx {
            if let Some(l) = &self.taken {
                l.clear(k);
            }
        }
        let mask = if rx { &self.rx_running } else { &self.tx_running };
        if running {
            mask.fetch_or(1 << k, Relaxed);
        } else {
            mask.fetch_and(!(1 << k), Relaxed);
        }
    }

    /// A running transmit queue `queue` takes from where its ring stands
    /// (started, or resumed after a crash): so the taken log says.
    pub(crate) fn mark_taken(&self, queue: usize, r: &Ring<B>) {
        let (k, rx) = pair_of(queue);
        if let (false, true, Some(l)) = (rx, r.running(), &self.taken) {
            l.set(k, r.queue.next_avail());
        }
    }

    /// The pairs whose receive ring runs, as a count (for `STATS`).
    pub fn pairs_running(&self) -> u32 {
        self.rx_running.load(Relaxed).count_ones()
    }

    /// The transmit queue `queue`'s kick descriptor changed from `old` to
    /// `new`.
    pub(crate) fn watch_kick(&self, queue: usize, old: Option<RawFd>, new: Option<RawFd>) {
        let ep = &self.pairs[queue / 2].epoll;
        if let Some(o) = old {
            ep.delete(o);
        }
        if let Some(n) = new {
            // A failure (already there) changes nothing.
            let _ = ep.add(n, epoll::IN, 0);
        }
    }

    /// Wakes the dispatcher of the pair queue `queue` is in (a ring started
    /// with frames perhaps waiting, or a pass stopped at its budget).
    pub(crate) fn poke(&self, queue: usize) {
        let _ = self.pairs[queue / 2].poke.notify();
    }

    fn hdr_len(&self) -> usize {
        if self.acked.load(Relaxed) & (feature::VERSION_1 | feature::MRG_RXBUF) != 0 {
            12
        } else {
            10
        }
    }

    /// The descriptor pair `pair`'s dispatcher watches while the device
    /// runs guest-driven.
    pub fn event_fd(&self, pair: usize) -> RawFd {
        self.pairs[pair].epoll.as_raw_fd()
    }

    /// Takes up to `max` frames from pair `pair`'s transmit queue, the ring
    /// held once for the whole burst and its counters added once at its
    /// end: each frame goes to `each` in `buf`, or, given `frame`
    /// (cut-through), with its head copied there and the rest in place
    /// (`each` must be done with it when it returns). How many frames
    /// `each` was given.
    pub fn take_burst(&self, pair: usize, buf: &mut [u8], mut frame: Option<&mut GuestFrame>, max: usize, mut each: impl FnMut(Taken, &mut [u8], Option<&mut GuestFrame>)) -> usize {
        let p = &self.pairs[pair];
        if !p.kicks_on.load(Relaxed) && self.tx_running.load(Relaxed) & (1 << pair) == 0 {
            // Polled, and not set up by the guest (a pair it does not use):
            // nothing to take, and no kick to clear.
            return 0;
        }
        let hdr_len = self.hdr_len();
        let mut tally = Tally::default();
        let mut tx = p.ring(TX);
        tx.share_budget(self.tx_running.load(Relaxed).count_ones());
        // Kicks re-armed and frames found waiting: look once more, never in a
        // loop (a guest whose avail index is nonsense would hold us there);
        // found waiting a second time, the next pass looks.
        let mut looked_again = false;
        let mut n = 0;
        while n < max {
            if !tx.running() {
                tx.clear_kick();
                p.poke.drain();
                break;
            }
            let taken = match tx.pop_frame(buf, hdr_len, frame.as_deref_mut()) {
                Popped::Frame { len, vnet, copied } => {
                    if copied && len <= MAX_HEAD {
                        tally.small.add(len);
                    } else if copied {
                        tally.scattered.add(len);
                    }
                    Taken::Copied { len, vnet }
                }
                Popped::InPlace => {
                    let f = frame.as_deref().expect("in place only when asked");
                    tally.in_place(f);
                    Taken::InPlace
                }
                Popped::Bad => {
                    tally.bad += 1;
                    continue;
                }
                Popped::TooBig => Taken::TooBig,
                Popped::Later => {
                    // Come back after the other NICs had their turn.
                    let _ = p.poke.notify();
                    break;
                }
                Popped::Empty => {
                    tx.clear_kick();
                    p.poke.drain();
                    // Re-armed at every empty ring, where the ring stands now:
                    // with event index the guest kicks only on crossing that
                    // point, so one left at an earlier empty ring (before the
                    // frames taken since) would never be crossed again.
                    if p.kicks_on.load(Relaxed) && tx.set_kicks(true) {
                        if !looked_again {
                            looked_again = true;
                            continue;
                        }
                        let _ = p.poke.notify();
                    }
                    break;
                }
            };
            n += 1;
            // Before it is sent: a vnetd started after a crash hands it
            // back, never sends it again.
            if let Some(l) = &self.taken {
                l.set(pair, tx.queue.next_avail());
            }
            each(taken, buf, frame.as_deref_mut());
        }
        // Its used entries are made visible (and its budget whole again) by
        // `release`, once what was taken has left.
        drop(tx);
        if n > 0 {
            p.tx_frames.fetch_add(n as u64, Relaxed);
        }
        tally.add_to(&self.counters);
        n
    }

    /// The pair a frame for the guest goes to: by its flow (`steer`) among
    /// the pairs whose receive ring runs; pair 0 if none or one does.
    #[inline]
    fn rx_pair(&self, frame: &[u8]) -> usize {
        let mask = self.rx_running.load(Relaxed);
        if mask & (mask.wrapping_sub(1)) == 0 {
            // None (frames are held for pair 0's start) or one.
            return if mask == 0 { 0 } else { mask.trailing_zeros() as usize };
        }
        let k = crate::steer::flow_hash(frame) % mask.count_ones();
        bits(mask).nth(k as usize).unwrap_or(0)
    }

    /// Writes one frame into the guest's receive buffers (the pair its
    /// flow goes to); its length.
    pub fn send(&self, vnet: &VnetHdr, parts: &[&[u8]]) -> io::Result<usize> {
        let to = self.receiving();
        let k = self.rx_pair(parts.first().copied().unwrap_or_default());
        let p = &self.pairs[k];
        let mut rx = p.ring(RX);
        rx.share_budget(self.rx_running.load(Relaxed).count_ones());
        let len = self.put(&mut rx, &to, vnet, parts);
        drop(rx);
        self.pending.fetch_or(1 << k, Relaxed);
        let len = len?;
        p.rx_frames.fetch_add(1, Relaxed);
        self.counters.rx_frames.fetch_add(1, Relaxed);
        Ok(len)
    }

    /// Writes a burst of plain frames (each one piece, all with offload
    /// header `vnet`) into the guest's receive buffers, each pair's ring
    /// held once per stretch of frames for it and the frames counted once;
    /// `done(its length or why it was dropped)` is told of each frame in
    /// turn.
    pub fn send_burst<'a>(&self, vnet: &VnetHdr, frames: impl Iterator<Item = &'a [u8]>, mut done: impl FnMut(io::Result<usize>)) {
        let to = self.receiving();
        // The pair held, its ring, and the frames written into it since it
        // was taken (counted once per stretch, not per frame).
        let mut held: Option<(usize, std::sync::MutexGuard<'_, Ring<B>>, u64)> = None;
        let mut sent = 0;
        let count = |held: Option<(usize, std::sync::MutexGuard<'_, Ring<B>>, u64)>| {
            if let Some((k, rx, n)) = held {
                drop(rx);
                if n > 0 {
                    self.pairs[k].rx_frames.fetch_add(n, Relaxed);
                }
            }
        };
        for f in frames {
            let k = self.rx_pair(f);
            if held.as_ref().is_none_or(|(at, _, _)| *at != k) {
                count(held.take());
                let mut rx = self.pairs[k].ring(RX);
                rx.share_budget(self.rx_running.load(Relaxed).count_ones());
                held = Some((k, rx, 0));
                self.pending.fetch_or(1 << k, Relaxed);
            }
            let (_, rx, n) = held.as_mut().expect("just locked");
            let r = self.put(rx, &to, vnet, &[f]);
            if r.is_ok() {
                sent += 1;
                *n += 1;
            }
            done(r);
        }
        count(held);
        if sent > 0 {
            self.counters.rx_frames.fetch_add(sent, Relaxed);
        }
    }

    /// How frames are written into the guest's receive buffers, as its
    /// driver negotiated.
    fn receiving(&self) -> Receiving {
        Receiving { mergeable: self.acked.load(Relaxed) & feature::MRG_RXBUF != 0, hdr_len: self.hdr_len() }
    }

    /// Writes one frame into a held receive ring; its length. (The caller
    /// marks the pair for the next flush.)
    fn put(&self, rx: &mut Ring<B>, to: &Receiving, vnet: &VnetHdr, parts: &[&[u8]]) -> io::Result<usize> {
        if !rx.running() {
            // Held for the ring's start, within bounds (`held`); a broken
            // ring is not starting, and holding for it would only fill the
            // buffers of the frontend's next connection with stale frames.
            if !rx.broken() && rx.held.hold(std::time::Instant::now(), vnet, parts, &self.counters) {
                return Ok(parts.iter().map(|p| p.len()).sum());
            }
            return Err(io::Error::from_raw_os_error(libc::ENETDOWN));
        }
        rx.put_frame(vnet, parts, to.hdr_len, to.mergeable)?;
        let len: usize = parts.iter().map(|p| p.len()).sum();
        rx.irq.bytes += len as u64;
        // A long burst is shown to the guest as it goes, a stretch at a
        // time (as vhost-net does every 64 frames), so that its driver
        // refills the ring while the rest arrives instead of finding it
        // full; the burst's own end still decides the last interrupt.
        if rx.unpublished() >= PUBLISH_EVERY && rx.publish_used() {
            self.counters.rx_mid_burst.fetch_add(1, Relaxed);
            if rx.guest_wants_interrupt() && rx.signal() {
                self.counters.rx_mid_burst_interrupts.fetch_add(1, Relaxed);
                self.counters.rx_interrupts.fetch_add(1, Relaxed);
            }
        }
        Ok(len)
    }

    /// The receive ring `rx` just started: the frames held for it are
    /// written (those not expired; one the guest has no room for is
    /// dropped, counted as expired), made visible, and the guest told.
    pub(crate) fn release_held(&self, rx: &mut Ring<B>) {
        if rx.held.is_empty() {
            return;
        }
        let to = self.receiving();
        let frames = rx.held.take(std::time::Instant::now(), &self.counters);
        let mut n = 0;
        for (_, vnet, bytes) in &frames {
            match rx.put_frame(vnet, &[bytes], to.hdr_len, to.mergeable) {
                Ok(()) => n += 1,
                Err(_) => {
                    self.counters.rx_held_expired.fetch_add(1, Relaxed);
                }
            }
        }
        if n > 0 {
            // (Counted in rx_frames when they were held.)
            self.counters.rx_held_delivered.fetch_add(n, Relaxed);
            rx.publish_used();
            if rx.guest_wants_interrupt() && rx.signal() {
                self.counters.rx_interrupts.fetch_add(1, Relaxed);
            }
        }
    }

    /// Pair `pair` guest-driven (kicks on) or VMM-driven (polled).
    pub fn set_notify(&self, pair: usize, on: bool) {
        let p = &self.pairs[pair];
        p.kicks_on.store(on, Relaxed);
        let mut tx = p.ring(TX);
        if tx.set_kicks(on) {
            let _ = p.poke.notify();
        }
    }

    /// Optimistic interrupts' early virtual interrupt: sent before the
    /// frames are copied in if the guest has interrupts on; if it has them
    /// off (it is polling its ring), the attempt fails and the end of
    /// coalescing will interrupt it. Only while the guest runs one pair: with
    /// several, which pairs a burst's frames go to is known only as each is
    /// written, and the end of coalescing alone decides.
    pub fn arriving(&self, irq: &IrqPolicy) {
        if !irq.optimistic || self.rx_running.load(Relaxed) != 1 {
            return;
        }
        let c = &*self.counters;
        let mut rx = self.ring(RX);
        if !rx.running() {
            return;
        }
        if rx.guest_armed() && rx.signal() {
            rx.signalled_now();
            rx.irq.evi_sent();
            c.evi_sent.fetch_add(1, Relaxed);
            c.rx_interrupts.fetch_add(1, Relaxed);
        } else {
            rx.irq.evi_failed = true;
            c.evi_suppressed.fetch_add(1, Relaxed);
        }
    }

    /// The end of a burst (the paper's end of coalescing): the frames
    /// written into any pair's receive queue since its last flush become
    /// visible and the guest is interrupted as `irq::IrqDecision` says. True
    /// if an interrupt was held back for `idle`.
    pub fn flush(&self, irq: &IrqPolicy) -> bool {
        let mut deferred = false;
        for k in bits(self.pending.swap(0, Relaxed)) {
            deferred |= self.flush_rx(k, irq);
        }
        deferred
    }

    /// The frames taken from pair `pair`'s transmit queue have left (the
    /// sends of the pass that took them are done): their buffers go back
    /// to the guest, and the queue's budget is whole again. Only the
    /// dispatcher that drained the queue calls this, after its sends: a
    /// frame sent from where it lay (cut-through) must not be handed back
    /// before (a flush by another dispatcher, sending to this guest, would
    /// have).
    pub fn release(&self, pair: usize) {
        let mut tx = self.pairs[pair].ring(TX);
        if tx.publish() && tx.guest_wants_interrupt() && tx.signal() {
            self.counters.tx_interrupts.fetch_add(1, Relaxed);
        }
    }

    fn flush_rx(&self, k: usize, irq: &IrqPolicy) -> bool {
        let c = &*self.counters;
        let p = &self.pairs[k];
        let mut deferred = false;
        {
            let mut rx = p.ring(RX);
            if rx.publish() {
                let wants = rx.guest_wants_interrupt();
                let d = rx.irq.end_of_coalescing(irq, wants);
                match d {
                    IrqDecision::Plain(_) => {}
                    IrqDecision::NotNeeded => _ = c.eoc_not_needed.fetch_add(1, Relaxed),
                    IrqDecision::Masked => _ = c.eoc_masked.fetch_add(1, Relaxed),
                    IrqDecision::Cold => _ = c.eoc_cold.fetch_add(1, Relaxed),
                    IrqDecision::Density => _ = c.eoc_density.fetch_add(1, Relaxed),
                    IrqDecision::Hot => {
                        deferred = true;
                        c.eoc_hot.fetch_add(1, Relaxed);
                    }
                }
                if d.now() && irq.optimistic && rx.signal_pending() {
                    // The early interrupt is not even taken yet: the guest's
                    // handler will run after these frames are visible.
                    c.eoc_pending.fetch_add(1, Relaxed);
                } else if d.now() && rx.signal() {
                    c.rx_interrupts.fetch_add(1, Relaxed);
                }
            }
        }
        deferred
    }

    /// The dispatcher that flushed this device has no more work: deliver
    /// the interrupts held back.
    pub fn idle(&self) {
        for k in bits(self.rx_running.load(Relaxed) | 1) {
            let mut rx = self.pairs[k].ring(RX);
            if std::mem::take(&mut rx.irq.deferred) && rx.signal() {
                self.counters.idle_interrupts.fetch_add(1, Relaxed);
                self.counters.rx_interrupts.fetch_add(1, Relaxed);
            }
        }
    }

    /// Whether the guest takes super-frames and partial checksums as they
    /// are.
    pub fn takes_offloads(&self) -> bool {
        let want = feature::GUEST_CSUM | feature::GUEST_TSO4 | feature::GUEST_TSO6;
        self.acked.load(Relaxed) & want == want
    }

    pub fn memory_policy(&self) -> MemoryPolicy {
        self.memory
    }

    /// Why the device is broken, if a ring is.
    pub fn broken(&self) -> Option<&'static str> {
        (0..self.queues()).find_map(|i| match self.ring(i).health() {
            Health::Broken(why) => Some(why),
            Health::Ok => None,
        })
    }

    /// ` key=value` pairs for `STATS`.
    pub fn render_stats(&self, s: &mut String) {
        let c = &*self.counters;
        let frames = c.rx_frames.load(Relaxed);
        let per_frame = if frames == 0 { 0.0 } else { c.rx_interrupts.load(Relaxed) as f64 / frames as f64 };
        s.push_str(&format!(" vhost_features={:#x}", self.acked.load(Relaxed)));
        c.render_into(s);
        s.push_str(&format!(" vhost_rx_interrupts_per_frame={per_frame:.3}"));
        // Per pair, up to the last that carried a frame: frames into the
        // guest's receive queue and out of its transmit queue.
        let per: Vec<(u64, u64)> = self.pairs.iter().map(|p| (p.rx_frames.load(Relaxed), p.tx_frames.load(Relaxed))).collect();
        let used = per.iter().rposition(|&(r, t)| r + t > 0).map_or(1, |i| i + 1);
        let list = |f: fn(&(u64, u64)) -> u64| per[..used].iter().map(|p| f(p).to_string()).collect::<Vec<_>>().join(",");
        s.push_str(&format!(" vhost_pairs_running={} vhost_pair_rx_frames={} vhost_pair_tx_frames={}", self.pairs_running(), list(|p| p.0), list(|p| p.1)));
        let locks: u64 = self.pairs.iter().map(|p| p.locks.load(Relaxed)).sum();
        s.push_str(&format!(" vhost_ring_locks={locks}"));
    }
}

#[cfg(test)]
mod tests {
    //! The device against a driver on another thread, as a guest runs it.
    use super::*;
    use crate::memory::GuestMemory;
    use crate::queue::Budget;
    use std::sync::atomic::{fence, AtomicU64, Ordering};
    use std::time::Duration;
    use vm_memory::{Bytes, GuestAddress};

    const DESC: u64 = 0x1000;
    const AVAIL: u64 = 0x2000;
    const USED: u64 = 0x3000;
    const SIZE: u16 = 64;
    const BUFS: u64 = 0x10000;

    /// A guest's transmit path with event index, as Linux's virtio_net
    /// runs it: it queues frames as fast as buffers come back and kicks only
    /// when its new avail index crosses the avail_event vnetd left. vnetd's
    /// side waits on its descriptor as a guest-driven dispatcher does. A
    /// re-arm that leaves avail_event behind the frames taken since loses
    /// the kick for good: the guest waits for buffers, vnetd for a kick.
    #[test]
    fn a_guest_queuing_as_fast_as_it_can_is_never_left_without_a_wakeup() {
        const FRAMES: u64 = 200_000;
        let mem = GuestMemory::<()>::anonymous(&[(GuestAddress(0), 1 << 20)]);
        let d = Device::<()>::new(MemoryPolicy::default()).unwrap();
        let ring = Ring::with_layout(d.counters.clone(), mem.clone(), SIZE, DESC, AVAIL, USED, true).unwrap();
        let kick = ring.kick.as_ref().unwrap().as_raw_fd();
        d.watch_kick(TX, None, Some(kick));
        *d.ring(TX) = ring;
        // One 74-byte buffer per descriptor: a 10-byte header and a frame.
        for i in 0..SIZE {
            let mut e = [0u8; 16];
            e[..8].copy_from_slice(&(BUFS + 128 * u64::from(i)).to_le_bytes());
            e[8..12].copy_from_slice(&74u32.to_le_bytes());
            mem.write_slice(&e, GuestAddress(DESC + 16 * u64::from(i))).unwrap();
        }
        let taken = AtomicU64::new(0);
        std::thread::scope(|s| {
            s.spawn(|| {
                let (mut avail, mut reclaimed) = (0u16, 0u16);
                let (mut queued, mut rng) = (0u64, 0x9e37_79b9_7f4a_7c15u64);
                while queued < FRAMES {
                    // A little work between frames (xorshift): vnetd empties
                    // the ring often, and the guest queues while it re-arms.
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    for _ in 0..rng % 512 {
                        std::hint::spin_loop();
                    }
                    if avail.wrapping_sub(reclaimed) == SIZE {
                        let used: u16 = mem.load(GuestAddress(USED + 2), Ordering::Acquire).unwrap();
                        if used == reclaimed {
                            if taken.load(Relaxed) == u64::MAX {
                                return; // vnetd gave up
                            }
                            std::hint::spin_loop();
                            continue;
                        }
                        reclaimed = used;
                    }
                    let slot = GuestAddress(AVAIL + 4 + 2 * u64::from(avail % SIZE));
                    mem.store(avail % SIZE, slot, Ordering::Relaxed).unwrap();
                    let old = avail;
                    avail = avail.wrapping_add(1);
                    mem.store(avail, GuestAddress(AVAIL + 2), Ordering::Release).unwrap();
                    queued += 1;
                    // virtqueue_kick_prepare: a full barrier, then vring_need_event.
                    fence(Ordering::SeqCst);
                    let ev: u16 = mem.load(GuestAddress(USED + 4 + 8 * u64::from(SIZE)), Ordering::Acquire).unwrap();
                    if avail.wrapping_sub(ev).wrapping_sub(1) < avail.wrapping_sub(old) {
                        vnet_sys::eventfd::write_one(kick).unwrap();
                    }
                }
            });
            let mut ep = Epoll::new(4).unwrap();
            ep.add(d.event_fd(0), epoll::IN, 0).unwrap();
            let policy = IrqPolicy { optimistic: false, alpha: 0, beta: 0 };
            let mut buf = vec![0u8; 2048];
            while taken.load(Relaxed) < FRAMES {
                if ep.wait(Some(Duration::from_secs(2))).unwrap() == 0 {
                    // Quiet for 2 s: a fault only if frames wait (a guest
                    // thread merely descheduled has queued none).
                    let avail: u16 = mem.load(GuestAddress(AVAIL + 2), Ordering::Acquire).unwrap();
                    if avail != taken.load(Relaxed) as u16 {
                        let got = taken.swap(u64::MAX, Relaxed);
                        panic!("no wakeup for 2 s with frames waiting: {got} of {FRAMES} frames taken");
                    }
                    continue;
                }
                let n = d.take_burst(0, &mut buf, None, 256, |_, _, _| {});
                taken.fetch_add(n as u64, Relaxed);
                d.flush(&policy);
                d.release(0);
            }
        });
    }

    /// Two pairs set up as a multi-queue guest's driver lays them out: pair
    /// k's rings at `0x10000 * (k + 1)`, 64 receive buffers of 2 KiB posted
    /// on each receive ring.
    fn two_pairs() -> (Device<()>, Arc<GuestMemory<()>>) {
        let mem = GuestMemory::<()>::anonymous(&[(GuestAddress(0), 4 << 20)]);
        let d = Device::<()>::new(MemoryPolicy::default()).unwrap();
        d.acked.store(feature::VERSION_1 | feature::MRG_RXBUF, Relaxed);
        for q in 0..4 {
            let base = 0x10000 * (q as u64 + 1);
            let ring = Ring::with_layout(d.counters.clone(), mem.clone(), SIZE, base, base + 0x1000, base + 0x2000, false).unwrap();
            if q % 2 == RX {
                for i in 0..SIZE {
                    let mut e = [0u8; 16];
                    e[..8].copy_from_slice(&(0x100000 + 0x80000 * q as u64 + 2048 * u64::from(i)).to_le_bytes());
                    e[8..12].copy_from_slice(&2048u32.to_le_bytes());
                    e[12..14].copy_from_slice(&2u16.to_le_bytes()); // write-only
                    mem.write_slice(&e, GuestAddress(base + 16 * u64::from(i))).unwrap();
                    mem.store(i, GuestAddress(base + 0x1000 + 4 + 2 * u64::from(i)), Ordering::Relaxed).unwrap();
                }
                mem.store(SIZE, GuestAddress(base + 0x1000 + 2), Ordering::Release).unwrap();
            } else {
                d.watch_kick(q, None, Some(ring.kick.as_ref().unwrap().as_raw_fd()));
            }
            *d.ring(q) = ring;
            d.note_running(q, true);
        }
        (d, mem)
    }

    /// The guest queues `n` frames of 64 bytes (after a 10-byte header) on
    /// pair 0's transmit queue (queue 1, at 0x20000), frame i's last byte
    /// i + 1; the queue's base address.
    fn queue_tx_frames(mem: &GuestMemory<()>, n: u16) -> u64 {
        let base = 0x20000u64;
        for i in 0..n {
            let at = 0x300000 + 0x100 * u64::from(i);
            let mut e = [0u8; 16];
            e[..8].copy_from_slice(&at.to_le_bytes());
            e[8..12].copy_from_slice(&74u32.to_le_bytes());
            mem.write_slice(&e, GuestAddress(base + 16 * u64::from(i))).unwrap();
            mem.store(i, GuestAddress(base + 0x1000 + 4 + 2 * u64::from(i)), Ordering::Relaxed).unwrap();
            mem.write_slice(&[i as u8 + 1], GuestAddress(at + 73)).unwrap();
        }
        mem.store(n, GuestAddress(base + 0x1000 + 2), Ordering::Release).unwrap();
        base
    }

    fn used_idx(mem: &GuestMemory<()>, q: usize) -> u16 {
        mem.load(GuestAddress(0x10000 * (q as u64 + 1) + 0x2002), Ordering::Acquire).unwrap()
    }

    fn udp(port: u16, seq: u8) -> Vec<u8> {
        let mut f = vec![0u8; 60];
        f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
        f[14] = 0x45;
        f[23] = 17;
        f[26..34].copy_from_slice(&[198, 19, 0, 1, 198, 19, 0, 2]);
        f[34..36].copy_from_slice(&port.to_be_bytes());
        f[36..38].copy_from_slice(&5201u16.to_be_bytes());
        f[59] = seq;
        f
    }

    #[test]
    fn each_flow_reaches_the_guest_on_one_pair_and_flows_use_every_pair_running() {
        let (d, mem) = two_pairs();
        let policy = IrqPolicy { optimistic: false, alpha: 0, beta: 0 };
        let mut on = [0u32; 2];
        for port in 40000..40024u16 {
            let mut pair = None;
            for seq in 0..2 {
                let before = [used_idx(&mem, 0), used_idx(&mem, 2)];
                let f = udp(port, seq);
                d.send_burst(&VnetHdr::default(), std::iter::once(&f[..]), |r| assert_eq!(r.unwrap(), 60));
                d.flush(&policy);
                let grew: Vec<usize> = (0..2).filter(|&k| used_idx(&mem, 2 * k) != before[k]).collect();
                assert_eq!(grew.len(), 1, "one frame, one pair: {grew:?}");
                assert!(pair.is_none_or(|p| p == grew[0]), "flow {port}: its frames went to pairs {pair:?} and {}", grew[0]);
                pair = Some(grew[0]);
            }
            on[pair.unwrap()] += 1;
        }
        assert!(on.iter().all(|&n| n >= 4), "24 flows over 2 pairs: {on:?}");
        let mut st = String::new();
        d.render_stats(&mut st);
        assert!(st.contains(&format!("vhost_pair_rx_frames={},{}", 2 * on[0], 2 * on[1])), "{st}");
        assert!(st.contains("vhost_pairs_running=2"), "{st}");
        // The guest disables pair 1 (fewer combined channels): everything
        // goes to pair 0.
        d.note_running(2, false);
        let before = used_idx(&mem, 0);
        for port in 50000..50010u16 {
            let f = udp(port, 0);
            d.send(&VnetHdr::default(), &[&f]).unwrap();
        }
        d.flush(&policy);
        assert_eq!(used_idx(&mem, 0).wrapping_sub(before), 10);
    }

    /// vnetd killed after sending 4 of the 10 frames a guest queued and
    /// before handing their buffers back (the used index still 0): the
    /// vnetd after it, on the same guest memory and the taken log the
    /// store kept, hands those 4 back unsent and sends the 6 others once.
    /// Catches: a restart that resumes from the used index alone (the 4
    /// sent twice: a ping answered twice), or a log written after the send.
    #[test]
    fn after_a_crash_the_frames_sent_are_handed_back_never_sent_twice() {
        let (d, mem) = two_pairs();
        let base = queue_tx_frames(&mem, 10);
        d.mark_taken(TX, &d.ring(TX));
        let mut buf = vec![0u8; 2048];
        let mut sent = Vec::new();
        let mut log_before_send = Vec::new();
        let log = d.taken.as_ref().unwrap().fd().try_clone_to_owned().unwrap();
        d.take_burst(0, &mut buf, None, 4, |t, b, _| {
            // What the store holds when this frame goes out.
            log_before_send.push(crate::taken::TakenLog::read::<1>(&log)[0]);
            if let Taken::Copied { len, .. } = t {
                sent.push(b[len - 1]);
            }
        });
        assert_eq!(sent, [1, 2, 3, 4]);
        assert_eq!(log_before_send, [Some(1), Some(2), Some(3), Some(4)], "the log says a frame was taken before it is sent");
        assert_eq!(used_idx(&mem, 1), 0, "killed before the release");
        drop(d);
        // The next vnetd: the ring as the store describes it, started on
        // the used index read back from guest memory.
        let d2 = Device::<()>::new(MemoryPolicy::default()).unwrap();
        d2.acked.store(feature::VERSION_1 | feature::MRG_RXBUF, Relaxed);
        let mut ring = Ring::with_layout(d2.counters.clone(), mem.clone(), SIZE, base, base + 0x1000, base + 0x2000, false).unwrap();
        let was = crate::taken::TakenLog::read::<1>(&log)[0].unwrap();
        assert_eq!(ring.resume_after_crash(was), 4);
        assert_eq!(used_idx(&mem, 1), 4, "the 4 sent are the guest's again");
        *d2.ring(TX) = ring;
        d2.note_running(TX, true);
        let mut again = Vec::new();
        d2.take_burst(0, &mut buf, None, 64, |t, b, _| {
            if let Taken::Copied { len, .. } = t {
                again.push(b[len - 1]);
            }
        });
        assert_eq!(again, [5, 6, 7, 8, 9, 10], "each frame sent once");
        d2.release(0);
        assert_eq!(used_idx(&mem, 1), 10);
        // A log that does not fit the ring (another setup's, or past what
        // the guest queued) changes nothing.
        let mut r = d2.ring(TX);
        assert_eq!(r.resume_after_crash(12), 0);
        assert_eq!(r.resume_after_crash(10), 0);
        assert_eq!(r.resume_after_crash(3), 0);
        assert_eq!(used_idx(&mem, 1), 10);
    }

    /// Rings are worked a burst per lock (docs/architecture.md): 10 frames
    /// taken from a transmit queue and handed back lock it twice (the
    /// burst, the release), and 10 frames of one flow written into the
    /// guest and made visible lock its receive ring twice (the burst, the
    /// flush), as `vhost_ring_locks` shows. Catches a ring locked per
    /// frame (20 and more).
    #[test]
    fn a_burst_of_ten_frames_locks_each_ring_it_works_twice() {
        let (d, mem) = two_pairs();
        let locks = |d: &Device<()>| -> u64 {
            let mut st = String::new();
            d.render_stats(&mut st);
            st.split_whitespace().find_map(|kv| kv.strip_prefix("vhost_ring_locks=")).unwrap().parse().unwrap()
        };
        queue_tx_frames(&mem, 10);
        let mut buf = vec![0u8; 2048];
        let before = locks(&d);
        assert_eq!(d.take_burst(0, &mut buf, None, 64, |_, _, _| {}), 10);
        d.release(0);
        assert_eq!(used_idx(&mem, 1), 10);
        assert_eq!(locks(&d) - before, 2, "10 frames taken and handed back");
        let policy = IrqPolicy { optimistic: false, alpha: 0, beta: 0 };
        let frames: Vec<Vec<u8>> = (0..10).map(|seq| udp(40000, seq)).collect();
        let rx = used_idx(&mem, 0) + used_idx(&mem, 2);
        let before = locks(&d);
        d.send_burst(&VnetHdr::default(), frames.iter().map(|f| &f[..]), |r| assert_eq!(r.unwrap(), 60));
        d.flush(&policy);
        assert_eq!(used_idx(&mem, 0) + used_idx(&mem, 2) - rx, 10);
        assert_eq!(locks(&d) - before, 2, "10 frames written into the guest and made visible");
    }

    #[test]
    fn each_pairs_transmit_queue_is_taken_by_its_own_burst() {
        let (d, mem) = two_pairs();
        // One 74-byte frame queued on pair 1's transmit queue (queue 3).
        let base = 0x40000u64;
        let mut e = [0u8; 16];
        e[..8].copy_from_slice(&0x300000u64.to_le_bytes());
        e[8..12].copy_from_slice(&74u32.to_le_bytes());
        mem.write_slice(&e, GuestAddress(base)).unwrap();
        mem.store(0u16, GuestAddress(base + 0x1000 + 4), Ordering::Relaxed).unwrap();
        mem.store(1u16, GuestAddress(base + 0x1000 + 2), Ordering::Release).unwrap();
        let mut buf = vec![0u8; 2048];
        assert_eq!(d.take_burst(0, &mut buf, None, 64, |_, _, _| {}), 0, "pair 0's queue is empty");
        let mut got = Vec::new();
        assert_eq!(d.take_burst(1, &mut buf, None, 64, |t, _, _| if let Taken::Copied { len, .. } = t { got.push(len) }), 1);
        assert_eq!(got, vec![62]);
        // Its buffer goes back when its dispatcher says it has left.
        assert_eq!(used_idx(&mem, 3), 0);
        d.flush(&IrqPolicy { optimistic: false, alpha: 0, beta: 0 });
        assert_eq!(used_idx(&mem, 3), 0, "a flush (any dispatcher's) leaves the transmit queue alone");
        d.release(1);
        assert_eq!(used_idx(&mem, 3), 1);
    }

    /// A guest running two pairs gets no more work per pass out of vnetd
    /// than one running a pair: the transmit rings share one descriptor
    /// budget. Each ring holds 256 chains of 256 one-byte descriptors (an
    /// indirect table each), far more than a pass may read.
    #[test]
    fn pairs_share_one_pass_budget() {
        const Q: u16 = 256;
        let mem = GuestMemory::<()>::anonymous(&[(GuestAddress(0), 8 << 20)]);
        let d = Device::<()>::new(MemoryPolicy::default()).unwrap();
        d.acked.store(feature::VERSION_1 | feature::INDIRECT_DESC, Relaxed);
        let table = 0x400000u64; // one indirect table, shared by every chain
        for j in 0..Q {
            let mut e = [0u8; 16];
            e[..8].copy_from_slice(&(0x600000 + u64::from(j)).to_le_bytes());
            e[8..12].copy_from_slice(&1u32.to_le_bytes());
            let next = if j + 1 < Q { 1u16 } else { 0 };
            e[12..14].copy_from_slice(&next.to_le_bytes());
            e[14..16].copy_from_slice(&(j + 1).to_le_bytes());
            mem.write_slice(&e, GuestAddress(table + 16 * u64::from(j))).unwrap();
        }
        for pair in 0..2usize {
            let base = 0x20000 * (pair as u64 + 1);
            let ring = Ring::with_layout(d.counters.clone(), mem.clone(), Q, base, base + 0x8000, base + 0x10000, false).unwrap();
            for i in 0..Q {
                let mut e = [0u8; 16];
                e[..8].copy_from_slice(&table.to_le_bytes());
                e[8..12].copy_from_slice(&(16 * u32::from(Q)).to_le_bytes());
                e[12..14].copy_from_slice(&4u16.to_le_bytes()); // indirect
                mem.write_slice(&e, GuestAddress(base + 16 * u64::from(i))).unwrap();
                mem.store(i, GuestAddress(base + 0x8000 + 4 + 2 * u64::from(i)), Ordering::Relaxed).unwrap();
            }
            mem.store(Q, GuestAddress(base + 0x8000 + 2), Ordering::Release).unwrap();
            *d.ring(2 * pair + 1) = ring;
        }
        let mut buf = vec![0u8; 4096];
        let pass = |d: &Device<()>, pair: usize, buf: &mut Vec<u8>| {
            d.take_burst(pair, buf, None, 1 << 20, |_, _, _| {});
            let spent = d.ring(2 * pair + 1).spent();
            d.release(pair);
            spent
        };
        let full = Budget::default().descs_per_pass;
        // One pair running: one budget (plus the chain that crossed it).
        d.note_running(TX, true);
        let one = pass(&d, 0, &mut buf);
        assert!(one >= full && one <= full + u32::from(Q), "one pair: {one} descriptors in a pass");
        // Two: half each, one budget between them.
        d.note_running(3, true);
        let (a, b) = (pass(&d, 0, &mut buf), pass(&d, 1, &mut buf));
        assert!(a <= full / 2 + u32::from(Q) && b <= full / 2 + u32::from(Q), "two pairs: {a} and {b} descriptors in a pass");
        assert!(a + b <= full + 2 * u32::from(Q), "{a} + {b}");
    }
}
