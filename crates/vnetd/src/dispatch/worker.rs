//! One dispatcher thread and its modes.
//!
//! The thread owns some interfaces (index modulo the number of threads;
//! thread 0 also owns the UDP socket). Each interface runs
//!
//! - **guest-driven**: its NIC is in the epoll set; the thread sleeps in
//!   `epoll_wait` and handles each frame the moment it arrives, sending it at
//!   once;
//! - **VMM-driven**: its NIC is out of the epoll set ("notifications off")
//!   and polled every pass, up to `quota` frames, its link sends batched into
//!   one `sendmmsg` a pass; an idle pass applies the yield strategy
//!   (immediate: `sched_yield`; timed: wait up to T_sleep; adaptive:
//!   immediate until idle for T_nowork, then timed);
//! - **adaptive**: guest-driven below α_l and VMM-driven above α_u packets
//!   per second, measured over windows of ω (hysteresis in between).

use super::forward::Forwarder;
use super::Datapath;
use crate::link::udp::{RxBatch, UdpEndpoint};
use vnet_core::wire::{gro_segments, parse_vxlan, VXLAN_HDR_LEN};
use crate::stats::Drop;
use crate::topology::{IfaceDispatch, LinkKind, Snapshot};
use vnet_core::offload::{VnetHdr, VNET_HDR_LEN};
use vnet_core::table::Port;
use anyhow::{bail, Result};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vnet_core::command::{Mode, YieldStrategy};

const TOKEN_WAKE: u64 = u64::MAX;
/// UDP sockets: `TOKEN_SOCKET + i` for VNET/P v4, v6, VXLAN v4, v6.
const TOKEN_SOCKET: u64 = u64::MAX - 8;
/// Direct links: `TOKEN_LINK + slot`; interfaces use their slot.
const TOKEN_LINK: u64 = 1 << 32;
/// Room for the largest frame plus its virtio-net header.
const BUF_LEN: usize = 65536 + 128;

/// Pins the calling thread to one CPU.
pub fn pin_to(cpu: usize) {
    // SAFETY: cpu_set_t is plain data; sched_setaffinity reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            tracing::warn!("cannot pin dispatcher to CPU {cpu}: {}", io::Error::last_os_error());
        }
    }
}

/// A minimal epoll with microsecond timeouts (`epoll_pwait2`).
struct Epoll {
    fd: RawFd,
    events: Vec<libc::epoll_event>,
}

impl Epoll {
    fn new() -> Result<Epoll> {
        // SAFETY: plain epoll_create1; closed in Drop.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            bail!("epoll_create1: {}", io::Error::last_os_error());
        }
        Ok(Epoll { fd, events: vec![libc::epoll_event { events: 0, u64: 0 }; 64] })
    }

    fn add(&self, fd: RawFd, token: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: token };
        // SAFETY: ev is a valid epoll_event.
        if unsafe { libc::epoll_ctl(self.fd, libc::EPOLL_CTL_ADD, fd, &mut ev) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn del(&self, fd: RawFd) {
        // SAFETY: a null event is allowed for EPOLL_CTL_DEL.
        unsafe { libc::epoll_ctl(self.fd, libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()) };
    }

    /// Waits up to `timeout` (None: forever); returns how many events.
    fn wait(&mut self, timeout: Option<Duration>) -> usize {
        let ts = timeout.map(|d| libc::timespec { tv_sec: d.as_secs() as _, tv_nsec: d.subsec_nanos() as _ });
        let tsp = ts.as_ref().map_or(std::ptr::null(), |t| t as *const libc::timespec);
        // SAFETY: events has room for len entries; tsp is null or valid.
        let n = unsafe {
            libc::syscall(
                libc::SYS_epoll_pwait2,
                self.fd,
                self.events.as_mut_ptr(),
                self.events.len() as libc::c_int,
                tsp,
                std::ptr::null::<libc::sigset_t>(),
                0usize,
            )
        };
        if n < 0 {
            0
        } else {
            n as usize
        }
    }
}

impl std::ops::Drop for Epoll {
    fn drop(&mut self) {
        // SAFETY: fd is ours.
        unsafe { libc::close(self.fd) };
    }
}

/// This thread's view of one interface it owns.
#[derive(Clone)]
struct Owned {
    slot: u32,
    fd: RawFd,
    settings: IfaceDispatch,
    /// Running VMM-driven (polled) right now.
    polled: bool,
    /// Frames in + out at the start of the adaptive window, and when it began.
    window_count: u64,
    window_start: Instant,
}

struct Worker {
    dp: Arc<Datapath>,
    index: usize,
    epoll: Epoll,
    snap: Arc<Snapshot>,
    owned: Vec<Owned>,
    /// Direct links this thread reads: (slot, fd).
    direct: Vec<(u32, RawFd)>,
    /// Which of the four UDP sockets are in the epoll set.
    sockets: [bool; 4],
    fwd: Forwarder,
    buf: Vec<u8>,
    rx: RxBatch,
    last_work: Instant,
}

pub fn run(dp: Arc<Datapath>, index: usize) -> Result<()> {
    let epoll = Epoll::new()?;
    epoll.add(dp.workers[index].wake.as_raw_fd(), TOKEN_WAKE)?;
    let snap = Arc::new(Snapshot::empty());
    let mut w = Worker {
        fwd: Forwarder::new(dp.clone()),
        dp,
        index,
        epoll,
        snap,
        owned: Vec::new(),
        direct: Vec::new(),
        sockets: [false; 4],
        buf: vec![0u8; BUF_LEN],
        rx: RxBatch::default(),
        last_work: Instant::now(),
    };
    w.reload();
    w.run();
    Ok(())
}

impl Worker {
    fn run(&mut self) {
        loop {
            if self.dp.stop.load(Acquire) {
                return;
            }
            let d = self.snap.dispatch;
            let polling = self.owned.iter().any(|o| o.polled);
            let mut timeout = None;
            if polling {
                let work = self.poll_pass();
                let now = Instant::now();
                if work > 0 {
                    self.dp.dispatch.busy_passes.fetch_add(1, Relaxed);
                    self.last_work = now;
                    timeout = Some(Duration::ZERO);
                } else {
                    self.dp.dispatch.idle_passes.fetch_add(1, Relaxed);
                    let sleep = Duration::from_micros(d.sleep_us as u64);
                    let immediate = match d.yield_strategy {
                        YieldStrategy::Immediate => true,
                        YieldStrategy::Timed => false,
                        YieldStrategy::Adaptive => now.duration_since(self.last_work) < Duration::from_micros(d.nowork_us as u64),
                    };
                    if immediate {
                        self.dp.dispatch.yields.fetch_add(1, Relaxed);
                        // SAFETY: plain sched_yield.
                        unsafe { libc::sched_yield() };
                        timeout = Some(Duration::ZERO);
                    } else {
                        self.dp.dispatch.sleeps.fetch_add(1, Relaxed);
                        timeout = Some(sleep);
                    }
                }
            }
            let n = self.epoll.wait(timeout);
            if n > 0 {
                self.dp.dispatch.wakeups.fetch_add(1, Relaxed);
            }
            let mut woken = false;
            for i in 0..n {
                let token = self.epoll.events[i].u64;
                match token {
                    TOKEN_WAKE => woken = true,
                    t if t >= TOKEN_SOCKET => {
                        self.fwd.batching = polling;
                        self.drain_socket((t - TOKEN_SOCKET) as usize);
                    }
                    t if t >= TOKEN_LINK => {
                        self.fwd.batching = false;
                        self.drain_direct((t - TOKEN_LINK) as u32);
                    }
                    slot => {
                        self.fwd.batching = false;
                        self.drain_nic(slot as u32);
                    }
                }
            }
            self.fwd.flush(&self.snap);
            if woken {
                let mut v = [0u8; 8];
                // SAFETY: reading the eventfd's 8-byte counter.
                unsafe { libc::read(self.dp.workers[self.index].wake.as_raw_fd(), v.as_mut_ptr().cast(), 8) };
                self.reload();
            }
            self.adapt();
        }
    }

    /// One VMM-driven pass: every polled NIC, and the UDP socket on thread 0.
    fn poll_pass(&mut self) -> usize {
        self.fwd.batching = true;
        let mut work = 0;
        for i in 0..self.owned.len() {
            if self.owned[i].polled {
                work += self.drain_nic(self.owned[i].slot);
            }
        }
        if self.index == 0 {
            for i in 0..4 {
                if self.sockets[i] {
                    work += self.drain_socket(i);
                }
            }
        }
        self.fwd.flush(&self.snap);
        work
    }

    /// Takes up to `quota` frames from a NIC; returns how many.
    fn drain_nic(&mut self, slot: u32) -> usize {
        let snap = &self.snap;
        let Some(iface) = snap.ifaces.get(slot as usize) else { return 0 };
        let quota = snap.dispatch.quota as usize;
        let mut n = 0;
        while n < quota {
            match iface.nic.recv(&mut self.buf) {
                Ok(rx) => {
                    n += 1;
                    self.fwd.from_port(snap, Port::Interface(slot), &mut self.buf[rx.start..rx.end], rx.vnet);
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
        if n > 0 {
            self.dp.dispatch.rx_frames.fetch_add(n as u64, Relaxed);
            self.dp.dispatch.rx_passes.fetch_add(1, Relaxed);
        }
        n
    }


    /// Takes up to `quota` datagrams from UDP socket `i` (GRO runs count as
    /// their datagrams); returns how many.
    fn drain_socket(&mut self, i: usize) -> usize {
        let dp = self.dp.clone();
        let Some(ep) = socket(&dp, i) else { return 0 };
        let is_vxlan = i >= 2;
        let snap = &self.snap;
        let quota = snap.dispatch.quota as usize;
        let mut frames = 0;
        while frames < quota {
            let n = match ep.recv_batch(&mut self.rx) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                // ICMP errors for earlier sends surface here; they concern
                // those sends, not this receive.
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => continue,
                Err(e) => {
                    tracing::warn!("UDP receive failed: {e}");
                    break;
                }
            };
            for m in 0..n {
                let len = self.rx.lens[m];
                let seg = self.rx.seg[m];
                let count = gro_segments(len, seg).count();
                frames += count;
                let Some(from) = self.rx.from[m] else { continue };
                let udp_link = if is_vxlan { None } else { snap.link_for_sender(from) };
                if !is_vxlan && udp_link.is_none() {
                    for r in gro_segments(len, seg) {
                        dp.global.received(r.len());
                        dp.drop_at(None, Drop::UnknownSender);
                    }
                    tracing::debug!(%from, "datagram from an address with no link dropped");
                    continue;
                }
                if count > 1 {
                    dp.offload.gro_runs.fetch_add(1, Relaxed);
                }
                let truncated = self.rx.truncated[m];
                let buf = self.rx.buf_mut(m);
                for r in gro_segments(len, seg) {
                    let (link, start) = if is_vxlan {
                        let vni = parse_vxlan(&buf[r.clone()]);
                        match vni.and_then(|vni| snap.vxlan_link_for(from.ip(), vni)) {
                            Some(l) => (l, r.start + VXLAN_HDR_LEN),
                            None => {
                                dp.global.received(r.len());
                                dp.drop_at(None, if vni.is_some() { Drop::UnknownSender } else { Drop::Malformed });
                                continue;
                            }
                        }
                    } else {
                        (udp_link.unwrap(), r.start)
                    };
                    if truncated {
                        dp.drop_at(Some(&snap.links[link as usize].stats), Drop::Oversize);
                        break;
                    }
                    self.fwd.from_link(snap, link, buf, start..r.end);
                }
                self.fwd.end_run(snap, buf);
            }
        }
        frames
    }

    /// Takes up to `quota` frames from a direct link's device.
    fn drain_direct(&mut self, slot: u32) -> usize {
        let snap = &self.snap;
        let Some(link) = snap.links.get(slot as usize) else { return 0 };
        let LinkKind::Direct { port, .. } = &link.kind else { return 0 };
        let quota = snap.dispatch.quota as usize;
        let mut n = 0;
        while n < quota {
            match port.recv(&mut self.buf) {
                Ok(len) => {
                    n += 1;
                    let Some(vnet) = VnetHdr::parse(&self.buf[..len]) else { continue };
                    self.fwd.from_port(snap, Port::Link(slot), &mut self.buf[VNET_HDR_LEN..len], vnet);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.raw_os_error() == Some(libc::EMSGSIZE) => {
                    self.dp.drop_at(Some(&link.stats), Drop::Oversize);
                }
                Err(e) => {
                    tracing::warn!(link = %link.name, "read from device failed: {e}");
                    break;
                }
            }
        }
        n
    }

    /// Picks up a new snapshot: which interfaces this thread owns, in which
    /// mode, and the epoll set to match.
    fn reload(&mut self) {
        let next = self.dp.snapshot();
        for o in &self.owned {
            if !o.polled {
                self.epoll.del(o.fd);
            }
        }
        let workers = self.dp.worker_count();
        let mut owned = Vec::new();
        for (slot, iface) in next.ifaces.iter().enumerate() {
            if iface.idx as usize % workers != self.index {
                continue;
            }
            let settings = next.iface_dispatch[slot];
            // An interface keeps its running mode across unrelated changes.
            let was = self.owned.iter().find(|o| std::ptr::eq(&*self.snap.ifaces[o.slot as usize], &**iface));
            let was_polled = was.map(|o| o.polled);
            let polled = match settings.mode {
                Mode::GuestDriven => false,
                Mode::VmmDriven => true,
                Mode::Adaptive => was_polled.unwrap_or(false),
            };
            let fd = iface.nic.as_raw_fd();
            if !polled && self.epoll.add(fd, slot as u64).is_err() {
                tracing::warn!(iface = %iface.name, "cannot watch NIC");
            }
            iface.running_mode.store(if polled { Mode::VmmDriven } else { Mode::GuestDriven } as u8, Relaxed);
            let count = iface.stats.in_frames.load(Relaxed) + iface.stats.out_frames.load(Relaxed);
            let window_start = was.map_or_else(Instant::now, |o| o.window_start);
            owned.push(Owned { slot: slot as u32, fd, settings, polled, window_count: count, window_start });
        }
        self.owned = owned;
        // Direct links, spread over threads like interfaces.
        for &(_, fd) in &self.direct {
            self.epoll.del(fd);
        }
        self.direct.clear();
        for (slot, link) in next.links.iter().enumerate() {
            if let LinkKind::Direct { port, .. } = &link.kind {
                if link.idx as usize % workers == self.index {
                    let fd = port.as_raw_fd();
                    if self.epoll.add(fd, TOKEN_LINK + slot as u64).is_ok() {
                        self.direct.push((slot as u32, fd));
                    }
                }
            }
        }
        // Thread 0 serves the UDP sockets, VXLAN's once they exist.
        if self.index == 0 {
            for i in 0..4 {
                if !self.sockets[i] {
                    if let Some(fd) = socket(&self.dp, i).map(|e| e.as_raw_fd()) {
                        self.sockets[i] = self.epoll.add(fd, TOKEN_SOCKET + i as u64).is_ok();
                    }
                }
            }
        }
        self.snap = next;
        self.dp.workers[self.index].running.store(self.snap.generation, Release);
    }

    /// Adaptive mode: at the end of each interface's window ω, switch it if
    /// its packet rate crossed α_u (up) or α_l (down).
    fn adapt(&mut self) {
        let now = Instant::now();
        for o in &mut self.owned {
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
            if o.polled {
                self.epoll.del(o.fd);
            } else if self.epoll.add(o.fd, o.slot as u64).is_err() {
                tracing::warn!(iface = %iface.name, "cannot watch NIC");
            }
            iface.running_mode.store(if o.polled { Mode::VmmDriven } else { Mode::GuestDriven } as u8, Relaxed);
            iface.mode_switches.fetch_add(1, Relaxed);
            tracing::debug!(iface = %iface.name, rate, polled = o.polled, "adaptive mode switch");
        }
    }
}

/// The UDP socket `i`: VNET/P IPv4, IPv6, VXLAN IPv4, IPv6.
fn socket(dp: &Datapath, i: usize) -> Option<&UdpEndpoint> {
    match i {
        0 => dp.udp4.as_ref(),
        1 => dp.udp6.as_ref(),
        2 => dp.vxlan4.get(),
        _ => dp.vxlan6.get(),
    }
}
