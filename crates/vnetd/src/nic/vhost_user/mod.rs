//! A vhost-user virtio-net NIC: the VMM (QEMU, cloud-hypervisor) or a
//! userspace driver (DPDK's virtio-user) shares the guest's memory and rings
//! with vnetd over a Unix socket, and vnetd's dispatchers move frames
//! straight between the guest's buffers and the overlay — the virtio NIC
//! VNET/P put in the VMM, with no TAP and no host kernel between.
//!
//! - `frontend.rs`: the protocol (features, memory table, ring set-up), run
//!   on one thread per NIC that serves the socket (`server`) or keeps
//!   connecting to the VMM's (`client`), and starts over whenever either
//!   side restarts.
//! - `ring.rs`: the rings themselves, worked by the dispatcher that owns the
//!   interface.
//!
//! The dispatcher watches one descriptor per NIC (`event_fd`): an epoll set
//! holding the transmit queue's kick eventfd (which changes with each
//! connection) and a poke the protocol thread uses when a ring starts.
//! Receive-queue kicks are never asked for: a frame for a guest with no
//! posted buffers is dropped and counted (`queue_full`), as a full TAP's is.

mod frontend;
pub mod ring;

use super::{Frame, InPlace, Received, VirtualNic};
use crate::settings::IrqPolicy;
use crate::sys::epoll::{self, Epoll};
use crate::sys::eventfd::EventFd;
use anyhow::{bail, Context, Result};
use frontend::{feature, Frontend, RX, TX};
use ring::{Popped, Ring};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use vhost::vhost_user::{BackendReqHandler, Error as VhostError};
use vnet_core::offload::VnetHdr;

/// What the protocol thread and the dispatchers share.
pub struct Shared {
    rings: [Mutex<Ring>; 2],
    /// The features the frontend acknowledged.
    acked: AtomicU64,
    /// The dispatcher's descriptor: the transmit kick and `poke_fd` in it.
    epoll: Epoll,
    poke: EventFd,
    /// The dispatcher wants kicks (guest-driven) or polls (VMM-driven).
    kicks_on: AtomicBool,
    connected: AtomicBool,
    counters: Counters,
}

crate::stats::counter_set! {
    /// What a vhost-user NIC did, for `STATS`.
    struct Counters {
        connects as "vhost_connects",
        /// Chains the guest queued that could not be read (returned unread).
        bad_chains as "vhost_bad_chains",
        /// Interrupts sent to the guest, for frames received and for frames
        /// sent (transmit buffers returned).
        rx_interrupts as "vhost_rx_interrupts",
        tx_interrupts as "vhost_tx_interrupts",
        /// Frames written into the guest's receive buffers.
        rx_frames as "vhost_rx_frames",
        /// Optimistic interrupts: early virtual interrupts sent, and found the
        /// guest's interrupts off; end-of-coalescing decisions by reason.
        evi_sent,
        evi_suppressed,
        eoc_not_needed,
        eoc_masked,
        eoc_cold,
        eoc_density,
        eoc_hot,
        /// An EoC interrupt not sent because the last one was still unread.
        eoc_pending,
        idle_interrupts,
        /// Cut-through: frames from the guest sent from where they lay (bytes:
        /// those not copied).
        tx_in_place_frames,
        tx_in_place_bytes,
        /// Of those in place, frames spread over several buffers (gathered),
        /// and their header bytes copied.
        tx_gathered_frames,
        tx_head_copied_bytes,
        /// Copied although cut-through was on: frames in several buffers but
        /// no longer than `ring::MAX_HEAD` (an iovec would cost more), and
        /// frames that could not be gathered (more than `MAX_PIECES` buffers,
        /// a buffer across memory regions).
        tx_copied_small_frames,
        tx_copied_small_bytes,
        tx_copied_scattered_frames,
        tx_copied_scattered_bytes,
    }
}

impl Shared {
    fn new() -> Result<Shared> {
        let epoll = Epoll::new(0).context("epoll")?;
        let poke = EventFd::new().context("eventfd")?;
        let s = Shared {
            rings: [Mutex::new(Ring::new()), Mutex::new(Ring::new())],
            acked: AtomicU64::new(0),
            epoll,
            poke,
            kicks_on: AtomicBool::new(true),
            connected: AtomicBool::new(false),
            counters: Counters::default(),
        };
        s.epoll.add(s.poke.as_raw_fd(), epoll::IN, 0).context("epoll")?;
        Ok(s)
    }

    fn ring(&self, i: usize) -> &Mutex<Ring> {
        &self.rings[i]
    }

    /// The transmit queue's kick descriptor changed from `old` to `new`.
    fn watch_kick(&self, old: Option<&File>, new: Option<&File>) {
        if let Some(o) = old {
            self.epoll.delete(o.as_raw_fd());
        }
        if let Some(n) = new {
            // A failure (already there) changes nothing.
            let _ = self.epoll.add(n.as_raw_fd(), epoll::IN, 0);
        }
    }

    /// Wakes the dispatcher (a ring started with frames perhaps waiting).
    fn poke(&self) {
        let _ = self.poke.notify();
    }

    fn clear_poke(&self) {
        self.poke.drain();
    }

    fn hdr_len(&self) -> usize {
        if self.acked.load(Relaxed) & (feature::VERSION_1 | feature::MRG_RXBUF) != 0 {
            12
        } else {
            10
        }
    }

    /// Publishes `ring`'s used entries and interrupts the guest if it asked.
    fn complete(&self, i: usize, counter: &AtomicU64) {
        let mut r = self.rings[i].lock().unwrap();
        if r.publish() && r.guest_wants_interrupt() && r.signal() {
            counter.fetch_add(1, Relaxed);
        }
    }
}

/// How the socket's other end is met.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    /// vnetd listens; the VMM connects (QEMU's `reconnect=1` comes back
    /// after a vnetd restart).
    Server,
    /// The VMM listens (`server=on`); vnetd connects, and again whenever
    /// the connection drops.
    Client,
}

/// The protocol thread's stop signal and what to shut down to wake it.
struct Control {
    stop: AtomicBool,
    /// The live connection (shut down to end it) and the listener.
    conn: Mutex<Option<UnixStream>>,
    listener: Option<RawFd>,
}

pub struct VhostUserNic {
    shared: Arc<Shared>,
    control: Arc<Control>,
    path: PathBuf,
    role: Role,
    /// The socket file this NIC made (device and inode), removed when the
    /// NIC goes if it is still the same file.
    made: Option<(u64, u64)>,
    _listener: Option<UnixListener>,
}

impl VhostUserNic {
    /// Serves a vhost-user-net device on `path` (`client`: connects to the
    /// VMM's socket there instead).
    pub fn new(name: &str, path: &str, client: bool) -> Result<VhostUserNic> {
        let path = PathBuf::from(path);
        let shared = Arc::new(Shared::new()?);
        let (role, listener, made) = if client {
            (Role::Client, None, None)
        } else {
            let l = bind(&path)?;
            let m = std::fs::metadata(&path).with_context(|| format!("{}", path.display()))?;
            (Role::Server, Some(l), Some((m.dev(), m.ino())))
        };
        let control = Arc::new(Control {
            stop: AtomicBool::new(false),
            conn: Mutex::new(None),
            listener: listener.as_ref().map(|l| l.as_raw_fd()),
        });
        let (s, c, p) = (shared.clone(), control.clone(), path.clone());
        let l = listener.as_ref().map(|l| l.try_clone()).transpose().context("listener")?;
        std::thread::Builder::new()
            .name(format!("vhost-{name}"))
            .spawn(move || match l {
                Some(l) => serve(&s, &c, &l),
                None => connect_loop(&s, &c, &p),
            })
            .context("cannot start the vhost-user thread")?;
        Ok(VhostUserNic { shared, control, path, role, made, _listener: listener })
    }
}

/// Binds the server socket at `path`: a path that exists is replaced only
/// if it is a socket nobody listens on (left by a vnetd that died).
fn bind(path: &Path) -> Result<UnixListener> {
    if !path.is_absolute() {
        bail!("vhost-user socket {} is not an absolute path", path.display());
    }
    if let Ok(m) = std::fs::symlink_metadata(path) {
        if !m.file_type().is_socket() {
            bail!("{} exists and is not a socket: not replaced", path.display());
        }
        if UnixStream::connect(path).is_ok() {
            bail!("{} is a socket something listens on: not replaced", path.display());
        }
        std::fs::remove_file(path).with_context(|| format!("cannot replace stale socket {}", path.display()))?;
    }
    let l = UnixListener::bind(path).with_context(|| format!("cannot listen on {}", path.display()))?;
    // Whoever connects gets to map memory into vnetd and feed it descriptors:
    // vnetd's own user only, unless the admin opens it (or uses `client`).
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .with_context(|| format!("cannot restrict {}", path.display()))?;
    Ok(l)
}

/// Serves one frontend connection until it ends (or vnetd stops it).
fn run_connection(shared: &Arc<Shared>, control: &Control, stream: UnixStream) {
    if let Ok(c) = stream.try_clone() {
        *control.conn.lock().unwrap() = Some(c);
    }
    if control.stop.load(Relaxed) {
        return;
    }
    let fe = Arc::new(Mutex::new(Frontend::new(shared.clone())));
    let mut handler = BackendReqHandler::from_stream(stream, fe.clone());
    shared.counters.connects.fetch_add(1, Relaxed);
    shared.connected.store(true, Relaxed);
    tracing::info!("vhost-user frontend connected");
    loop {
        match handler.handle_request() {
            Ok(()) => {}
            // The device refused one request; the frontend was told.
            Err(e @ (VhostError::InvalidParam | VhostError::InvalidOperation(_) | VhostError::InactiveFeature(_) | VhostError::InactiveOperation(_) | VhostError::ReqHandlerError(_))) => {
                tracing::debug!("vhost-user request refused: {e}");
            }
            Err(e) => {
                if !control.stop.load(Relaxed) {
                    tracing::info!("vhost-user frontend gone: {e}");
                }
                break;
            }
        }
    }
    shared.connected.store(false, Relaxed);
    fe.lock().unwrap().reset();
    *control.conn.lock().unwrap() = None;
}

fn serve(shared: &Arc<Shared>, control: &Control, listener: &UnixListener) {
    while !control.stop.load(Relaxed) {
        match listener.accept() {
            Ok((s, _)) => run_connection(shared, control, s),
            Err(e) => {
                if control.stop.load(Relaxed) {
                    return;
                }
                tracing::warn!("vhost-user accept failed: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

fn connect_loop(shared: &Arc<Shared>, control: &Control, path: &Path) {
    let mut logged = false;
    while !control.stop.load(Relaxed) {
        match UnixStream::connect(path) {
            Ok(s) => {
                logged = false;
                run_connection(shared, control, s);
            }
            Err(e) => {
                if !logged {
                    tracing::info!(path = %path.display(), "vhost-user: cannot connect yet ({e}); retrying");
                    logged = true;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

impl Drop for VhostUserNic {
    fn drop(&mut self) {
        self.control.stop.store(true, Relaxed);
        if let Some(c) = self.control.conn.lock().unwrap().take() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        if let Some(l) = self.control.listener {
            // SAFETY: shutdown(2) on our listening socket wakes its accept.
            unsafe { libc::shutdown(l, libc::SHUT_RDWR) };
        }
        if let Some((dev, ino)) = self.made {
            if std::fs::metadata(&self.path).is_ok_and(|m| m.dev() == dev && m.ino() == ino) {
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }
}

impl VhostUserNic {
    /// The next frame from the guest's transmit queue (`in_place`: left in
    /// its memory if it lies in one buffer).
    fn take(&self, buf: &mut [u8], in_place: Option<&mut InPlace>) -> io::Result<Frame> {
        let hdr_len = self.shared.hdr_len();
        let c = &self.shared.counters;
        let mut tx = self.shared.rings[TX].lock().unwrap();
        // Kicks re-armed and frames found waiting: look once more, never in a
        // loop (a guest whose avail index is nonsense would hold us there).
        let mut looked_again = false;
        loop {
            if !tx.running() {
                tx.clear_kick();
                self.shared.clear_poke();
                return Err(io::ErrorKind::WouldBlock.into());
            }
            match tx.pop_frame(buf, hdr_len, in_place.is_some()) {
                Popped::Frame { len, vnet, copied } => {
                    if copied && len <= ring::MAX_HEAD {
                        c.tx_copied_small_frames.fetch_add(1, Relaxed);
                        c.tx_copied_small_bytes.fetch_add(len as u64, Relaxed);
                    } else if copied {
                        c.tx_copied_scattered_frames.fetch_add(1, Relaxed);
                        c.tx_copied_scattered_bytes.fetch_add(len as u64, Relaxed);
                    }
                    return Ok(Frame::Copied(Received { start: 0, end: len, vnet }));
                }
                Popped::InPlace { head, vnet } => {
                    let pieces = tx.gathered();
                    c.tx_in_place_frames.fetch_add(1, Relaxed);
                    c.tx_in_place_bytes.fetch_add(pieces.iter().map(|p| p.1 as u64).sum(), Relaxed);
                    if head > 0 {
                        c.tx_gathered_frames.fetch_add(1, Relaxed);
                        c.tx_head_copied_bytes.fetch_add(head as u64, Relaxed);
                    }
                    let mapping: Arc<dyn Send + Sync> = tx.mem.clone().expect("a running ring has memory");
                    let at = in_place.expect("in place only when asked");
                    // SAFETY: pop_frame found each piece inside this mapping.
                    unsafe { at.set(head, pieces, vnet, mapping) };
                    return Ok(Frame::InPlace);
                }
                Popped::Bad => {
                    c.bad_chains.fetch_add(1, Relaxed);
                }
                Popped::TooBig => return Err(io::Error::from_raw_os_error(libc::EMSGSIZE)),
                Popped::Empty => {
                    tx.clear_kick();
                    self.shared.clear_poke();
                    if !looked_again && self.shared.kicks_on.load(Relaxed) && tx.set_kicks(true) {
                        looked_again = true;
                        continue;
                    }
                    return Err(io::ErrorKind::WouldBlock.into());
                }
            }
        }
    }
}

impl VirtualNic for VhostUserNic {
    fn recv(&self, buf: &mut [u8]) -> io::Result<Received> {
        match self.take(buf, None)? {
            Frame::Copied(r) => Ok(r),
            Frame::InPlace => unreachable!("in place only when asked"),
        }
    }

    fn recv_in_place(&self, buf: &mut [u8], at: &mut InPlace) -> io::Result<Frame> {
        self.take(buf, Some(at))
    }

    fn send(&self, vnet: &VnetHdr, parts: &[&[u8]]) -> io::Result<usize> {
        let acked = self.shared.acked.load(Relaxed);
        let hdr_len = self.shared.hdr_len();
        let mut rx = self.shared.rings[RX].lock().unwrap();
        if !rx.running() {
            return Err(io::Error::from_raw_os_error(libc::ENETDOWN));
        }
        rx.put_frame(vnet, parts, hdr_len, acked & feature::MRG_RXBUF != 0)?;
        let len: usize = parts.iter().map(|p| p.len()).sum();
        rx.irq.bytes += len as u64;
        self.shared.counters.rx_frames.fetch_add(1, Relaxed);
        Ok(len)
    }

    fn event_fd(&self) -> RawFd {
        self.shared.epoll.as_raw_fd()
    }

    fn set_notify(&self, on: bool) {
        self.shared.kicks_on.store(on, Relaxed);
        let mut tx = self.shared.rings[TX].lock().unwrap();
        if tx.set_kicks(on) {
            self.shared.poke();
        }
    }

    /// Optimistic interrupts' early virtual interrupt: sent before the
    /// frames are copied in if the guest has interrupts on; if it has them
    /// off (it is polling its ring), the attempt fails and the end of
    /// coalescing will interrupt it.
    fn arriving(&self, irq: &IrqPolicy) {
        if !irq.optimistic {
            return;
        }
        let c = &self.shared.counters;
        let mut rx = self.shared.rings[RX].lock().unwrap();
        if !rx.running() {
            return;
        }
        if rx.guest_armed() && rx.signal() {
            rx.signalled_now();
            rx.irq.evi_at = Some(Instant::now());
            rx.irq.bytes = 0;
            rx.irq.evi_failed = false;
            rx.irq.deferred = false;
            c.evi_sent.fetch_add(1, Relaxed);
            c.rx_interrupts.fetch_add(1, Relaxed);
        } else {
            rx.irq.evi_failed = true;
            c.evi_suppressed.fetch_add(1, Relaxed);
        }
    }

    /// The end of a burst (the paper's end of coalescing): the frames
    /// become visible; the guest is interrupted if it asked (event index)
    /// and, with optimistic interrupts, by the receive density RD since the
    /// last EVI: after a failed EVI always; RD > β ("too hot": EVIs drive
    /// the stream) held back to the dispatcher's idle point; otherwise now
    /// (below α the paper skipped it, guessing the guest had taken the
    /// frames; virtio's event index says it has not, and skipping would
    /// stall it: counted as `cold`).
    fn flush(&self, irq: &IrqPolicy) -> bool {
        let c = &self.shared.counters;
        let mut deferred = false;
        {
            let mut rx = self.shared.rings[RX].lock().unwrap();
            if rx.publish() {
                let wants = rx.guest_wants_interrupt();
                let send = if !irq.optimistic {
                    wants
                } else if !wants {
                    c.eoc_not_needed.fetch_add(1, Relaxed);
                    false
                } else if std::mem::take(&mut rx.irq.evi_failed) {
                    c.eoc_masked.fetch_add(1, Relaxed);
                    true
                } else {
                    let rd = rx.irq.evi_at.map_or(u64::MAX / 2, |t| {
                        let ns = t.elapsed().as_nanos().max(1) as u64;
                        rx.irq.bytes.saturating_mul(1_000_000_000) / ns
                    });
                    if rd > irq.beta {
                        rx.irq.deferred = true;
                        deferred = true;
                        c.eoc_hot.fetch_add(1, Relaxed);
                        false
                    } else {
                        let reason = if rd < irq.alpha { &c.eoc_cold } else { &c.eoc_density };
                        reason.fetch_add(1, Relaxed);
                        true
                    }
                };
                if send && irq.optimistic && rx.signal_pending() {
                    // The early interrupt is not even taken yet: the guest's
                    // handler will run after these frames are visible.
                    c.eoc_pending.fetch_add(1, Relaxed);
                } else if send && rx.signal() {
                    c.rx_interrupts.fetch_add(1, Relaxed);
                }
            }
        }
        self.shared.complete(TX, &c.tx_interrupts);
        deferred
    }

    fn idle(&self) {
        let mut rx = self.shared.rings[RX].lock().unwrap();
        if std::mem::take(&mut rx.irq.deferred) && rx.signal() {
            self.shared.counters.idle_interrupts.fetch_add(1, Relaxed);
            self.shared.counters.rx_interrupts.fetch_add(1, Relaxed);
        }
    }

    fn takes_offloads(&self) -> bool {
        let want = feature::GUEST_CSUM | feature::GUEST_TSO4 | feature::GUEST_TSO6;
        self.shared.acked.load(Relaxed) & want == want
    }

    fn describe(&self) -> String {
        let role = if self.role == Role::Client { " client" } else { "" };
        let up = if self.shared.connected.load(Relaxed) { "yes" } else { "no" };
        format!("vhost-user={}{role} connected={up}", self.path.display())
    }

    fn extra_stats(&self) -> String {
        let c = &self.shared.counters;
        let frames = c.rx_frames.load(Relaxed);
        let per_frame = if frames == 0 { 0.0 } else { c.rx_interrupts.load(Relaxed) as f64 / frames as f64 };
        let mut s = format!(" vhost_features={:#x}", self.shared.acked.load(Relaxed));
        c.render_into(&mut s);
        s.push_str(&format!(" vhost_rx_interrupts_per_frame={per_frame:.3}"));
        s
    }

}
