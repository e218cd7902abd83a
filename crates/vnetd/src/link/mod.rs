//! Links (the papers' "edges"): how frames travel to and from other hosts.
//!
//! Every kind is one module behind `Transport`; the forwarder never asks
//! which kind a link is.
//!
//! - `udp`: VNET/P's encapsulation (the bare frame as a UDP datagram) and
//!   VXLAN (RFC 7348, an 8-byte header first), on the daemon's shared UDP
//!   sockets (`crate::sys::udp`: GSO, GRO, batches).
//! - `tcp`: frames over a TCP connection opened by a key handshake, for
//!   networks where UDP does not pass.
//! - `direct`: raw onto a host device's LAN, through a packet socket.
//! - `wireguard`: frames encrypted and authenticated by WireGuard, on
//!   vnetd's WireGuard port, each peer told apart by its key and index.
//!
//! A new kind is a new module implementing `Transport`: how it sends a frame
//! and a run of segments, and which of the three receive shapes (`Rx`) it
//! has, which decides how a dispatcher reads it.

pub mod direct;
pub mod dummy;
pub mod tcp;
pub mod udp;
pub mod wireguard;

use crate::sys::packet::PacketPort;
use crate::sys::udp::{TxBatch, UdpEndpoint};
use crate::stats::{DropReason, OffloadCounters};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vnet_core::offload::{Pieces, SegmentPlan, VnetHdr, MAX_PIECES};

/// How a link's frames arrive.
pub enum Rx<'a> {
    /// On a socket shared by many links, each datagram told apart by its
    /// sender's address and, for VXLAN, its VNI.
    Shared { vni: Option<u32> },
    /// On the link's own device (a packet socket): frames with virtio-net
    /// headers.
    Device(&'a PacketPort),
    /// On the link's own stream connection.
    Stream(&'a Arc<tcp::TcpLink>),
    /// On vnetd's WireGuard sockets, told apart by receiver index or, for a
    /// handshake initiation, by the peer's static key.
    Sealed(&'a wireguard::WgLink),
}

/// What became of frames handed to a link.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sent {
    /// Sent now: frames and bytes.
    pub frames: usize,
    pub bytes: usize,
    /// Dropped now, for `why`.
    pub dropped: usize,
    pub why: Option<DropReason>,
}

impl Sent {
    pub fn now(frames: usize, bytes: usize) -> Sent {
        Sent { frames, bytes, ..Sent::default() }
    }

    pub fn dropped(why: DropReason, frames: usize) -> Sent {
        Sent { dropped: frames, why: Some(why), ..Sent::default() }
    }

    /// Queued, to be counted later (`TxQueue::done`, or the link's
    /// `write_out` for the links in `TxQueue::buffered`).
    pub fn later() -> Sent {
        Sent::default()
    }

    pub fn add(&mut self, o: Sent) {
        self.frames += o.frames;
        self.bytes += o.bytes;
        self.dropped += o.dropped;
        self.why = o.why.or(self.why);
    }
}

/// What a link's send needs to know of the link and the daemon.
pub struct TxCtx<'a> {
    /// The link's slot in the snapshot being forwarded with (for the
    /// accounting of queued datagrams).
    pub slot: u32,
    /// Largest frame that crosses the underlay in one datagram.
    pub max_frame: usize,
    pub gso: &'a GsoState,
    pub offload: &'a OffloadCounters,
}

/// The segments cut from one super-frame: segment `k` is
/// `plan.header(k)` then the frame's bytes `plan.payload[k]`, each
/// `seg_size` bytes but the last. The frame may lie in pieces (a guest's
/// buffers, cut through), so a payload may be several slices.
pub struct Segments<'a> {
    pub plan: &'a SegmentPlan,
    pub frame: Pieces<'a>,
    pub seg_size: usize,
}

/// Most slices `Segments::parts` gives for one segment: its header, and
/// its payload in the frame's head and up to `MAX_PIECES` pieces.
pub const SEG_PARTS: usize = MAX_PIECES + 2;

impl<'a> Segments<'a> {
    pub fn len(&self) -> usize {
        self.plan.len()
    }

    pub fn bytes(&self, from: usize, to: usize) -> usize {
        (from..to).map(|k| self.plan.frame_len(k)).sum()
    }

    /// Segment `k` as slices, into `out`; how many.
    #[inline]
    pub fn parts(&self, k: usize, out: &mut [&'a [u8]; SEG_PARTS]) -> usize {
        out[0] = self.plan.header(k);
        let mut n = 1;
        self.frame.each(self.plan.payload[k].clone(), |s| {
            out[n] = s;
            n += 1;
        });
        n
    }
}

/// A link kind.
pub trait Transport: Send + Sync {
    /// `udp`, `vxlan`, `tcp`, `direct`: what `LINK LIST` shows.
    fn kind(&self) -> &'static str;
    /// How its frames arrive.
    fn rx(&self) -> Rx<'_>;
    /// Whether it takes offloaded frames as they are (super-frames, partial
    /// checksums), as a device does; otherwise the forwarder finishes
    /// checksums and cuts super-frames to `max_frame` first.
    fn takes_offloads(&self) -> bool {
        false
    }
    /// Sends one frame (perhaps in pieces): whole, its checksums complete
    /// unless `takes_offloads`.
    fn send(&self, q: &mut TxQueue, cx: &TxCtx, vnet: &VnetHdr, frame: Pieces) -> Sent;
    /// Sends the segments of one super-frame.
    fn send_segments(&self, q: &mut TxQueue, cx: &TxCtx, segs: &Segments) -> Sent;
    /// Writes out what `send` buffered (it then marked the link in
    /// `TxQueue::buffered`): complete frames and bytes written.
    fn write_out(&self) -> (usize, usize) {
        (0, 0)
    }
    /// Extra `LINK LIST` fields, each starting with a space.
    fn describe(&self) -> String {
        String::new()
    }
    /// The kind's own counters for `STATS links` (and so `/metrics`), each
    /// ` name=value`.
    fn extra_stats(&self) -> String {
        String::new()
    }
    /// Retires the link's resources (connections, threads); returns the
    /// frames still waiting, to be counted as dropped.
    fn teardown(&self) -> usize {
        0
    }
}

/// A dispatcher's queued link sends: every datagram a pass sends goes out
/// in one `sendmmsg` per UDP socket at the end of the pass (its runs to one
/// peer as GSO messages), and the links that buffered frames this pass are
/// written out then. Outcomes of queued datagrams land in `done` for the
/// forwarder to count.
#[derive(Default)]
pub struct TxQueue {
    batches: Vec<(Arc<UdpEndpoint>, TxBatch)>,
    /// Slots of links that buffered frames, to `write_out` at the end of the pass.
    pub buffered: Vec<u32>,
    /// Queued datagrams sent or failed: (link slot, bytes, the drop reason
    /// if it failed).
    pub done: Vec<(u32, usize, Option<DropReason>)>,
    /// Slots of links whose GSO the kernel refused in this flush.
    pub gso_refused: Vec<u32>,
    /// `sendmmsg` calls made, datagrams in them, and GSO messages among
    /// their messages.
    pub batches_sent: u64,
    pub batched: u64,
    pub gso_messages: u64,
    /// Room a link may build a datagram in before queueing it (a sealed
    /// link: the plain packet, then the sealed one).
    pub plain: Vec<u8>,
    pub sealed: Vec<u8>,
}

impl TxQueue {
    /// Queues a datagram made of `parts` for `ep`; `gso`: it may share a
    /// GSO message with its neighbours. A full batch is sent first.
    pub fn push(&mut self, ep: &Arc<UdpEndpoint>, parts: &[&[u8]], to: SocketAddr, slot: u32, gso: bool) {
        let i = match self.batches.iter().position(|(e, _)| Arc::ptr_eq(e, ep)) {
            Some(i) => i,
            None => {
                self.batches.push((ep.clone(), TxBatch::default()));
                self.batches.len() - 1
            }
        };
        if !self.batches[i].1.push(parts, to, slot, gso) {
            self.flush_one(i);
            self.batches[i].1.push(parts, to, slot, gso);
        }
    }

    fn flush_one(&mut self, i: usize) {
        let (ep, tx) = &mut self.batches[i];
        if tx.is_empty() {
            return;
        }
        let (done, refused) = (&mut self.done, &mut self.gso_refused);
        self.batched += tx.len() as u64;
        self.gso_messages += ep.flush(tx, |slot, len, err| done.push((slot, len, err.map(|e| classify(&e)))), |slot| refused.push(slot));
        self.batches_sent += 1;
    }

    /// Sends every queued datagram.
    pub fn flush(&mut self) {
        for i in 0..self.batches.len() {
            self.flush_one(i);
        }
    }

    /// Marks the link at `slot` as holding buffered frames.
    pub fn buffered(&mut self, slot: u32) {
        if self.buffered.last() != Some(&slot) && !self.buffered.contains(&slot) {
            self.buffered.push(slot);
        }
    }
}

/// Whether UDP GSO works toward a link's peer. The kernel refuses it (EIO,
/// EINVAL) without checksum offload or when segments exceed the path MTU
/// (e.g. a link `mtu` above the real path): that link then sends segment
/// by segment for `GSO_RETRY`, then tries again. Other links are unaffected.
#[derive(Default)]
pub struct GsoState {
    /// Off until this time (ms since `epoch()`); 0 while it works.
    off_until_ms: AtomicU64,
}

const GSO_RETRY: Duration = Duration::from_secs(30);

fn epoch() -> Instant {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *START.get_or_init(Instant::now)
}

impl GsoState {
    /// Asked for every frame: the clock is read only while GSO is off.
    #[inline]
    pub fn ok(&self) -> bool {
        self.off_until_ms.load(Relaxed) == 0 || self.ok_at(epoch().elapsed())
    }

    pub fn refused(&self) {
        self.refused_at(epoch().elapsed())
    }

    #[inline]
    fn ok_at(&self, now: Duration) -> bool {
        let until = self.off_until_ms.load(Relaxed);
        until == 0 || now.as_millis() as u64 >= until
    }

    fn refused_at(&self, now: Duration) {
        let until = (now + GSO_RETRY).as_millis() as u64;
        self.off_until_ms.store(until.max(1), Relaxed);
    }
}

/// Reads a secret file (a key): a regular file, not a link, owned by
/// vnetd's user and readable by nobody else, at most `max` bytes; its bytes
/// less one trailing newline.
pub fn read_secret(path: &std::path::Path, max: usize) -> Result<Vec<u8>, String> {
    use std::io::Read;
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let shown = path.display();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| format!("cannot open key file {shown}: {e}"))?;
    let meta = f.metadata().map_err(|e| format!("key file {shown}: {e}"))?;
    if !meta.file_type().is_file() {
        return Err(format!("key file {shown} is not a regular file"));
    }
    let me = nix::unistd::geteuid().as_raw();
    if meta.uid() != me {
        return Err(format!("key file {shown} is owned by uid {}, not vnetd's uid {me}", meta.uid()));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(format!("key file {shown} is mode {:o}: others may read it (chmod 600)", meta.mode() & 0o777));
    }
    let mut key = Vec::new();
    f.take(max as u64 + 1).read_to_end(&mut key).map_err(|e| format!("cannot read key file {shown}: {e}"))?;
    if key.len() > max {
        return Err(format!("key file {shown} is longer than {max} bytes"));
    }
    if key.last() == Some(&b'\n') {
        key.pop();
    }
    Ok(key)
}

/// The drop reason for a send error.
pub fn classify(e: &std::io::Error) -> DropReason {
    match e.raw_os_error() {
        Some(libc::EAGAIN) | Some(libc::ENOBUFS) => DropReason::QueueFull,
        Some(libc::EIO) | Some(libc::ENETDOWN) => DropReason::Down,
        Some(libc::EMSGSIZE) => DropReason::Oversize,
        _ => DropReason::TxError,
    }
}

/// `Sent` for the result of sending `frames` frames of `bytes` bytes at once.
pub fn sent_now(r: std::io::Result<()>, frames: usize, bytes: usize) -> Sent {
    match r {
        Ok(()) => Sent::now(frames, bytes),
        Err(e) => {
            let why = classify(&e);
            if why == DropReason::TxError {
                tracing::debug!("send failed: {e}");
            }
            Sent::dropped(why, frames)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_whose_gso_was_refused_sends_datagram_by_datagram_for_30_s_then_tries_again() {
        let g = GsoState::default();
        let t = Duration::from_secs(100);
        assert!(g.ok_at(Duration::ZERO) && g.ok_at(t));
        g.refused_at(t);
        assert!(!g.ok_at(t));
        assert!(!g.ok_at(t + GSO_RETRY - Duration::from_millis(1)));
        assert!(g.ok_at(t + GSO_RETRY));
        // Refused again on the retry: another 30 s.
        g.refused_at(t + GSO_RETRY);
        assert!(!g.ok_at(t + GSO_RETRY + Duration::from_secs(29)));
        assert!(g.ok_at(t + GSO_RETRY * 2));
    }
}
