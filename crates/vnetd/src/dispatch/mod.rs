//! The packet dispatcher: moves frames between virtual NICs, the routing core
//! and the links.
//!
//! One thread waits on every TAP and the UDP socket with epoll and forwards
//! each frame as soon as it arrives (the papers' guest-driven mode). It reads
//! the topology from an immutable snapshot that the control plane swaps
//! whole, so the hot path takes no lock; its route cache is its own.

use crate::link::UdpEndpoint;
use crate::stats::{Counters, Drop, OffloadCounters};
use crate::topology::Snapshot;
use anyhow::{Context, Result};
use arc_swap::ArcSwap;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vnet_core::mac::frame_macs;
use vnet_core::table::Port;
use vnet_core::{offload, RouteCache};

/// Frames taken from one source before looking at the others, so one busy
/// source cannot starve the rest (the papers' quota of 64 per pass).
const QUOTA: usize = 64;
/// Room for the largest frame: 64 KiB of payload plus headers.
const BUF_LEN: usize = 65536 + 128;

const TOKEN_WAKE: u64 = u64::MAX;
const TOKEN_UDP: u64 = u64::MAX - 1;

/// What the control plane and the dispatcher share.
pub struct Datapath {
    snapshot: ArcSwap<Snapshot>,
    /// Totals over everything, and drops no port can be blamed for.
    pub global: Counters,
    pub offload: OffloadCounters,
    pub udp: UdpEndpoint,
    wake: EventFd,
    /// Generation of the snapshot the dispatcher is running.
    running: AtomicU64,
    stop: AtomicBool,
}

impl Datapath {
    pub fn new(udp: UdpEndpoint) -> Result<Datapath> {
        Ok(Datapath {
            snapshot: ArcSwap::from_pointee(Snapshot::empty()),
            global: Counters::default(),
            offload: OffloadCounters::default(),
            udp,
            wake: EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
                .context("eventfd")?,
            running: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        })
    }

    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.snapshot.load_full()
    }

    /// Publishes a new topology and waits (briefly) until the dispatcher runs
    /// it, so that when a control request returns its change is in force.
    pub fn publish(&self, snap: Snapshot) {
        let generation = snap.generation;
        self.snapshot.store(Arc::new(snap));
        let _ = self.wake.write(1);
        let deadline = Instant::now() + Duration::from_secs(2);
        while self.running.load(Ordering::Acquire) < generation && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Forgets the topology (after the dispatcher stopped), releasing its
    /// interfaces and links.
    pub fn clear(&self) {
        self.snapshot.store(Arc::new(Snapshot::empty()));
    }

    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.wake.write(1);
    }

    #[inline]
    fn drop_at(&self, port_stats: Option<&Counters>, why: Drop) {
        self.global.dropped(why);
        if let Some(s) = port_stats {
            s.dropped(why);
        }
    }
}

/// Runs the dispatcher until `Datapath::shutdown`.
pub fn run(dp: Arc<Datapath>) -> Result<()> {
    let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).context("epoll")?;
    epoll.add(dp.wake.as_fd(), EpollEvent::new(EpollFlags::EPOLLIN, TOKEN_WAKE))?;
    // SAFETY: the UDP socket lives in `dp`, which outlives this function.
    let udp_fd = unsafe { BorrowedFd::borrow_raw(dp.udp.as_raw_fd()) };
    epoll.add(udp_fd, EpollEvent::new(EpollFlags::EPOLLIN, TOKEN_UDP))?;

    let mut d = Dispatcher { dp: dp.clone(), cache: RouteCache::default(), buf: vec![0u8; BUF_LEN], scratch: Vec::with_capacity(BUF_LEN) };
    let mut snap = dp.snapshot();
    register(&epoll, &snap, true)?;
    dp.running.store(snap.generation, Ordering::Release);

    let mut events = vec![EpollEvent::empty(); 64];
    while !dp.stop.load(Ordering::Acquire) {
        let n = match epoll.wait(&mut events, EpollTimeout::NONE) {
            Ok(n) => n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e).context("epoll_wait"),
        };
        let mut woken = false;
        for ev in &events[..n] {
            match ev.data() {
                TOKEN_WAKE => woken = true,
                TOKEN_UDP => d.drain_udp(&snap),
                slot => d.drain_nic(&snap, slot as u32),
            }
        }
        if woken {
            let _ = dp.wake.read();
            let next = dp.snapshot();
            if next.generation != snap.generation {
                register(&epoll, &snap, false)?;
                register(&epoll, &next, true)?;
                snap = next;
                dp.running.store(snap.generation, Ordering::Release);
            }
        }
    }
    Ok(())
}

/// Adds (or removes) every TAP of a snapshot to (from) the epoll set; the
/// token is the interface's slot.
fn register(epoll: &Epoll, snap: &Snapshot, add: bool) -> Result<()> {
    for (slot, iface) in snap.ifaces.iter().enumerate() {
        // SAFETY: the NIC is kept open by `snap` while registered.
        let fd = unsafe { BorrowedFd::borrow_raw(iface.nic.as_raw_fd()) };
        if add {
            epoll.add(fd, EpollEvent::new(EpollFlags::EPOLLIN, slot as u64))?;
        } else {
            epoll.delete(fd)?;
        }
    }
    Ok(())
}

struct Dispatcher {
    dp: Arc<Datapath>,
    cache: RouteCache,
    buf: Vec<u8>,
    /// Where software segmentation builds each segment.
    scratch: Vec<u8>,
}

impl Dispatcher {
    fn drain_nic(&mut self, snap: &Snapshot, slot: u32) {
        let Some(iface) = snap.ifaces.get(slot as usize) else { return };
        let origin = Port::Interface(slot);
        for _ in 0..QUOTA {
            match iface.nic.recv(&mut self.buf) {
                Ok(rx) => {
                    let frame = &mut self.buf[rx.start..rx.end];
                    match rx.vnet {
                        // A super-frame or a partial checksum: finish it in
                        // software, then route each resulting frame.
                        Some(h) if h.is_gso() || h.flags & offload::F_NEEDS_CSUM != 0 => {
                            let (dp, cache) = (&self.dp, &mut self.cache);
                            let r = offload::resolve(&h, frame, &mut self.scratch, |f| forward(dp, cache, snap, origin, f));
                            match r {
                                Ok(n) if h.is_gso() => {
                                    dp.offload.segmented.fetch_add(1, Ordering::Relaxed);
                                    dp.offload.segments.fetch_add(n as u64, Ordering::Relaxed);
                                }
                                Ok(_) => {
                                    dp.offload.checksums.fetch_add(1, Ordering::Relaxed);
                                }
                                Err(e) => {
                                iface.stats.received(frame.len());
                                dp.global.received(frame.len());
                                dp.drop_at(Some(&iface.stats), Drop::Malformed);
                                tracing::debug!(iface = %iface.name, ?h, "cannot resolve offload: {e:?}");
                                }
                            }
                        }
                        _ => forward(&self.dp, &mut self.cache, snap, origin, frame),
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.raw_os_error() == Some(libc::EMSGSIZE) => {
                    self.dp.drop_at(Some(&iface.stats), Drop::Oversize);
                }
                Err(e) => {
                    tracing::warn!(iface = %iface.name, "read from NIC failed: {e}");
                    break;
                }
            }
        }
    }

    fn drain_udp(&mut self, snap: &Snapshot) {
        for _ in 0..QUOTA {
            match self.dp.udp.recv(&mut self.buf) {
                Ok((n, from)) => {
                    let Some(slot) = snap.link_for_sender(from) else {
                        self.dp.global.received(n);
                        self.dp.drop_at(None, Drop::UnknownSender);
                        tracing::debug!(%from, "datagram from an address with no link dropped");
                        continue;
                    };
                    let frame = &self.buf[..n];
                    forward(&self.dp, &mut self.cache, snap, Port::Link(slot), frame);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                // ICMP errors for earlier sends surface here; they concern
                // those sends, not this receive.
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => continue,
                Err(e) => {
                    tracing::warn!("UDP receive failed: {e}");
                    break;
                }
            }
        }
    }
}

/// Routes one frame from `origin` and delivers it to every destination.
#[inline]
fn forward(dp: &Datapath, cache: &mut RouteCache, snap: &Snapshot, origin: Port, frame: &[u8]) {
    let origin_stats = snap.port_stats(origin);
    origin_stats.received(frame.len());
    dp.global.received(frame.len());
    let Some((dst, src)) = frame_macs(frame) else {
        dp.drop_at(Some(origin_stats), Drop::Malformed);
        return;
    };
    let hits = cache.route(&snap.table, origin, src, dst);
    if hits.is_empty() {
        dp.drop_at(Some(origin_stats), Drop::NoRoute);
        return;
    }
    for hit in hits {
        snap.routes[hit.rule as usize].stats.sent(frame.len());
        deliver(dp, snap, hit.dst, frame);
    }
}

#[inline]
fn deliver(dp: &Datapath, snap: &Snapshot, to: Port, frame: &[u8]) {
    let (stats, result) = match to {
        Port::Interface(s) => {
            let iface = &snap.ifaces[s as usize];
            if frame.len() > iface.max_frame() {
                dp.drop_at(Some(&iface.stats), Drop::Oversize);
                return;
            }
            (&iface.stats, iface.nic.send(frame))
        }
        Port::Link(s) => {
            let link = &snap.links[s as usize];
            if frame.len() > dp.udp.max_payload() {
                dp.drop_at(Some(&link.stats), Drop::Oversize);
                return;
            }
            (&link.stats, dp.udp.send(frame, link.remote))
        }
    };
    match result {
        Ok(_) => {
            stats.sent(frame.len());
            dp.global.sent(frame.len());
        }
        Err(e) => {
            let why = match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::ENOBUFS) => Drop::QueueFull,
                Some(libc::EIO) | Some(libc::ENETDOWN) => Drop::Down,
                Some(libc::EMSGSIZE) => Drop::Oversize,
                _ => Drop::TxError,
            };
            if why == Drop::TxError {
                tracing::debug!(?to, "send failed: {e}");
            }
            dp.drop_at(Some(stats), why);
        }
    }
}
