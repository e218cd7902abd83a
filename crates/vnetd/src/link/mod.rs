//! Links (the papers' "edges"): how frames travel to and from other hosts.
//!
//! A link kind is one module behind `LinkKind` (how `LINK ADD` makes one),
//! listed once in `kinds.rs`; a link it makes is a `Transport` (how frames
//! leave, which carrier and demultiplexing keys its frames come back with,
//! and its own source, if it reads one). Nothing else of vnetd, the
//! forwarder, the dispatchers and the snapshot included, asks which kind a
//! link is.
//!
//! - **Carriers** carry datagrams for many links: a UDP socket group per
//!   port and family (`carriers.rs`), bound the first time a kind asks for
//!   it, read by every dispatcher, each received run opened by the kind that
//!   made the carrier (`RunOpener`). Links with a carrier of their own (a TCP
//!   stream, a device) read it as their own `LinkSource`.
//! - **Demultiplexing** is by keys a link declares (`Transport::demux`): the
//!   sender's address, a VNI, a receiver index or a public key, on its
//!   carrier. The snapshot keeps them in one map; a key two links declare
//!   names neither (and `LINK ADD` refuses a link whose exclusive key another
//!   link holds).
//!
//! The kinds: `vnetp` (VNET/P: the bare frame as a UDP datagram), `vxlan`
//! (RFC 7348), `geneve` (RFC 8926), `tcp` (frames over a TCP connection opened
//! by a key handshake), `direct` (raw onto a host device's LAN), `wireguard`
//! (frames encrypted and authenticated by WireGuard).

pub mod carriers;
pub mod direct;
pub mod dummy;
pub mod geneve;
pub mod key;
pub mod kinds;
pub mod tcp;
pub mod vnetp;
pub mod vxlan;
pub mod wireguard;

use crate::port::Intake;
use crate::settings::Settings;
use crate::stats::{Counters, DropReason, OffloadCounters, ThreadStats};
use crate::sys::udp::{RxBatch, TxBatch, UdpEndpoint};

pub use key::LinkKey;
use std::any::Any;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vnet_core::command::LinkProto;
use vnet_core::offload::{Pieces, SegmentPlan, VnetHdr, MAX_PIECES};

/// What carries a link's datagrams in: a UDP port of one family, or a
/// carrier of the link's own (a stream, a device: named for duplicates only).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CarrierKey {
    Udp { port: u16, v6: bool },
    Stream,
    Device,
}

impl CarrierKey {
    /// The UDP carrier on `port` of `addr`'s family.
    pub fn udp(port: u16, addr: &IpAddr) -> CarrierKey {
        CarrierKey::Udp { port, v6: addr.is_ipv6() }
    }
}

/// What tells a link's datagrams apart on its carrier (a plain value: a
/// lookup copies it, never allocates).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DemuxKey {
    /// The sender's address and port.
    Sender(SocketAddr),
    /// The sender's address alone: names a link only while exactly one link
    /// declares it (VNET/P's match by IP, for a peer behind NAT).
    SenderIp(IpAddr),
    /// The sender's address and a virtual network identifier.
    Vni(IpAddr, u32),
    /// A receiver index the datagrams name (24 bits).
    Index(u32),
    /// A public key a handshake names.
    Key([u8; 32]),
    /// The peer's address, for a link of one connection per peer.
    Peer(IpAddr),
    /// A host device, by name.
    Device(DeviceName),
}

/// A host device's name (at most 15 bytes, as the kernel's `IFNAMSIZ` less
/// its terminator allows), held inline.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeviceName([u8; 16]);

impl DeviceName {
    /// None if the name is longer than a device's can be.
    pub fn new(name: &str) -> Option<DeviceName> {
        let mut b = [0u8; 16];
        (name.len() < 16).then(|| {
            b[..name.len()].copy_from_slice(name.as_bytes());
            DeviceName(b)
        })
    }

    pub fn as_str(&self) -> &str {
        let n = self.0.iter().position(|&c| c == 0).unwrap_or(16);
        std::str::from_utf8(&self.0[..n]).unwrap_or("?")
    }
}

impl std::fmt::Display for DeviceName {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::fmt::Debug for DeviceName {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "{:?}", self.as_str())
    }
}

impl DemuxKey {
    /// Whether another link may declare it too (it then names neither).
    pub fn shared(&self) -> bool {
        matches!(self, DemuxKey::SenderIp(_))
    }

    /// What a second link with this key would collide on, for `LINK ADD`'s
    /// error: "link <name> already <this>".
    pub fn describe(&self, kind: &str) -> String {
        match self {
            DemuxKey::Sender(a) => format!("goes to {a} by {kind}"),
            DemuxKey::SenderIp(ip) => format!("goes to {ip} by {kind}"),
            DemuxKey::Vni(ip, v) => format!("goes to {ip} by {kind} with VNI {v}"),
            DemuxKey::Index(i) => format!("has receiver index {i}"),
            DemuxKey::Key(_) => "goes to the peer holding that key (a peer is told apart by its key)".into(),
            DemuxKey::Peer(ip) => format!("goes to {ip} by {kind} (the peer is told apart by its address)"),
            DemuxKey::Device(d) => format!("uses device {d}"),
        }
    }
}

/// The links as a reader of datagrams sees them (the snapshot).
pub trait LinkLookup {
    /// The link (slot) that declared `key` on `carrier`, if exactly one did.
    fn demux(&self, carrier: &CarrierKey, key: &DemuxKey) -> Option<u32>;
    /// The link at `slot`: how it carries frames, and its frame counters.
    fn link(&self, slot: u32) -> Option<(&dyn Transport, &Counters)>;
    /// The slot of the link with this id, if it is in force.
    fn slot_of_link(&self, id: u32) -> Option<u32>;
}

/// What a source reads with: the links in force, the dispatcher's counters,
/// where frames go, and its buffers.
pub struct RxCx<'a> {
    pub links: &'a dyn LinkLookup,
    pub st: &'a ThreadStats,
    pub intake: &'a mut dyn Intake,
    /// Room for the largest frame plus its virtio-net header.
    pub buf: &'a mut [u8],
    pub rx: &'a mut RxBatch,
    /// Frames (datagrams) to read at most before the others get a turn.
    pub quota: usize,
}

/// Something a dispatcher reads frames from: one socket of a carrier, or a
/// link's own stream or device.
pub trait LinkSource: Send + Sync {
    /// A number that changes whenever `watch` would answer otherwise (asked
    /// after every read: cheap, and never allocating).
    fn generation(&self) -> u64 {
        0
    }
    /// The descriptors to watch, with their epoll events.
    fn watch(&self) -> Vec<(RawFd, u32)>;
    /// Which of `n` dispatchers reads it.
    fn owner(&self, n: usize) -> usize;
    /// Whether a VMM-driven pass reads it without waiting for its event
    /// (a socket many links share).
    fn polled(&self) -> bool {
        false
    }
    /// `watch()`'s descriptor `i` is ready with `events`: reads what it
    /// has (up to `cx.quota` frames) into `cx.intake`; the frames read.
    fn ready(&self, i: usize, events: u32, cx: &mut RxCx) -> usize;
}

/// Opens the runs a UDP carrier receives, for the kind that made it: finds
/// each datagram's link (`LinkLookup::demux`) and hands its frame to
/// `intake`, in `run` itself (a plain header) or in `buf` (sealed).
pub trait RunOpener: Send + Sync {
    #[allow(clippy::too_many_arguments)]
    fn open_run(
        &self,
        carrier: &CarrierKey,
        links: &dyn LinkLookup,
        st: &ThreadStats,
        from: SocketAddr,
        run: &mut [u8],
        seg: usize,
        buf: &mut [u8],
        intake: &mut dyn Intake,
    );
}

/// What a kind making a link needs from the daemon.
pub trait LinkEnv {
    /// The kernel's path MTU toward an address.
    fn path_mtu(&self, to: SocketAddr) -> Option<u32>;
    /// The UDP carrier `key` (a socket per dispatcher), bound now if it is
    /// not yet, its runs opened by what `opener` makes.
    fn udp_carrier(&self, key: CarrierKey, word: &'static str, opener: &dyn Fn() -> Arc<dyn RunOpener>) -> Result<Arc<carriers::UdpCarrier>, String>;
    /// The state a kind shares between its links (made once, by `make`),
    /// or what `start` put there.
    fn shared(&self, kind: &'static str, make: &mut dyn FnMut() -> Result<Arc<dyn Any + Send + Sync>, String>) -> Result<Arc<dyn Any + Send + Sync>, String>;
    /// The state a kind shares, if it has made it.
    fn shared_now(&self, kind: &'static str) -> Option<Arc<dyn Any + Send + Sync>>;
    /// The links in force now (for a kind's own threads: an acceptor), and
    /// where a connection or datagram no link takes is counted.
    fn links_now(&self) -> LinksNow;
    /// Describes a link to the kernel fast path, if it is loaded and can
    /// carry it (over IPv4 with a route to the peer), its datagrams leaving
    /// from local port `sport`; None otherwise.
    fn fast_link(&self, _id: u32, _remote: SocketAddr, _sport: u16, _mtu: u32) -> Option<vnet_fastpath::LinkEntry> {
        None
    }
}

/// The links in force, for a kind's own threads: the current snapshot (None
/// once the daemon is gone), and a counter of what no link took.
#[derive(Clone)]
pub struct LinksNow {
    pub now: Arc<dyn Fn() -> Option<Arc<dyn LinkLookup + Send + Sync>> + Send + Sync>,
    pub unknown: Arc<dyn Fn() + Send + Sync>,
}

/// What `LINK ADD` asks for, as a kind sees it. `ip` is canonical (an
/// IPv4-mapped address is the IPv4 peer).
pub struct LinkSpec<'a> {
    pub proto: &'a LinkProto,
    pub ip: Option<IpAddr>,
    pub port: Option<u16>,
    pub name: Option<String>,
    pub mtu: Option<u32>,
}

/// A link as its kind made it, before the topology names and sizes it.
pub struct Made {
    pub transport: Arc<dyn Transport>,
    pub remote: Option<SocketAddr>,
    pub name: String,
    pub mtu: u32,
    /// What the link's encapsulation takes from its MTU (IPv4 + UDP = 28,
    /// + VXLAN 36, TCP 40, WireGuard 88, + 20 over IPv6); negative for a
    /// direct link, which carries frames without their 14-byte Ethernet
    /// header counted.
    pub overhead: i64,
}

/// A kind of link: one module, one line in `kinds::ALL`.
pub trait LinkKind: Sync {
    /// The word `LINK LIST` shows (`proto=`).
    fn word(&self) -> &'static str;
    /// Whether it makes links of this `LINK ADD` protocol.
    fn takes(&self, proto: &LinkProto) -> bool;
    /// Makes one.
    fn make(&self, spec: &LinkSpec, settings: &Settings, env: &dyn LinkEnv) -> Result<Made, String>;
    /// What the kind does as vnetd starts (before any link): bind what must
    /// be bound from the start, make what `settings` asks for.
    fn start(&self, _settings: &Settings, _env: &dyn LinkEnv) -> Result<(), String> {
        Ok(())
    }
    /// Lines of its own for `SHOW` (the kind as a whole).
    fn show(&self, _env: &dyn LinkEnv) -> Vec<String> {
        Vec::new()
    }
    /// Where it listens, besides its UDP carriers (`<word>:<address>`).
    fn listens(&self, _env: &dyn LinkEnv) -> Vec<String> {
        Vec::new()
    }
    /// Its `STATS global` line's fields, each ` name=value`, if it has one.
    fn stats(&self, _env: &dyn LinkEnv) -> Option<String> {
        None
    }
    /// A request of its own (`<KIND> <verb>`, e.g. `WIREGUARD ROTATE`):
    /// its answer.
    fn command(&self, verb: &str, _env: &dyn LinkEnv) -> Result<Vec<String>, String> {
        Err(format!("{} has no command {verb}", self.word()))
    }
    /// The counters of a thread of the kind's own, summed into `STATS
    /// global` with the dispatchers'.
    fn thread_stats(&self, _env: &dyn LinkEnv) -> Option<Arc<ThreadStats>> {
        None
    }
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

/// A link, as its kind made it.
pub trait Transport: Send + Sync {
    /// Its kind's word (`LinkKind::word`): what `LINK LIST` shows.
    fn kind(&self) -> &'static str;
    /// The link as its own type (for its kind's code: a handshake thread).
    fn as_any(&self) -> &dyn Any;
    /// The keys its datagrams are told apart by, on their carrier.
    fn demux(&self) -> Vec<(CarrierKey, DemuxKey)> {
        Vec::new()
    }
    /// What it reads itself (a stream, a device), if anything.
    fn source(&self) -> Option<Arc<dyn LinkSource>> {
        None
    }
    /// The link is in force (in the dispatchers' snapshot): start what it
    /// runs (a connector).
    fn in_force(&self) {}
    /// Its id in the topology, given when it is added (its own source finds
    /// its slot in a snapshot by it).
    fn identify(&self, _id: u32) {}
    /// If the kernel fast path may carry it (VNET/P over UDP): the local
    /// port its datagrams leave from.
    fn fast_path(&self) -> Option<u16> {
        None
    }
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
        let i = self.batch_of(ep);
        if !self.batches[i].1.push(parts, to, slot, gso) {
            self.flush_one(i);
            self.batches[i].1.push(parts, to, slot, gso);
        }
    }

    /// Queues a datagram of up to `max` bytes for `ep` that `make` writes in
    /// place (a sealed link seals straight into the batch); `make` says its
    /// length, 0 if it queued nothing. The length.
    pub fn push_with(&mut self, ep: &Arc<UdpEndpoint>, max: usize, to: SocketAddr, slot: u32, gso: bool, make: impl FnOnce(&mut [u8]) -> usize) -> usize {
        let i = self.batch_of(ep);
        if !self.batches[i].1.room(max) {
            self.flush_one(i);
        }
        self.batches[i].1.push_with(max, to, slot, gso, make)
    }

    /// The batch of `ep`'s datagrams.
    fn batch_of(&mut self, ep: &Arc<UdpEndpoint>) -> usize {
        match self.batches.iter().position(|(e, _)| Arc::ptr_eq(e, ep)) {
            Some(i) => i,
            None => {
                self.batches.push((ep.clone(), TxBatch::default()));
                self.batches.len() - 1
            }
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
