//! UDP carriers: the sockets that carry many links' datagrams, one group per
//! port and family (a socket per dispatcher on the same port,
//! `SO_REUSEPORT`: the kernel spreads peers over them), bound the first time
//! a kind asks for one (VNET/P's at start, VXLAN's and Geneve's with their
//! first link), read by every dispatcher, and each received run opened by
//! the kind that made the carrier (`RunOpener`).
//!
//! Also the link that UDP-encapsulated kinds share (`PrefixedLink`): a remote
//! address on a carrier and a fixed header before each frame (none for
//! VNET/P, VXLAN's 8 bytes, Geneve's 8), sent in the pass's `sendmmsg`.

use super::{sent_now, CarrierKey, DemuxKey, LinkSource, RunOpener, RxCx, Segments, Sent, TxCtx, TxQueue, SEG_PARTS};
use crate::stats::DropReason;
use crate::sys::udp::{gso_refusal, UdpEndpoint, MAX_GSO_SEGMENTS};
use arc_swap::ArcSwap;
use std::io::{self, IoSlice};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use vnet_core::offload::{Pieces, MAX_PIECES};
use vnet_core::wire::gro_segments;

/// One UDP port of one family: a socket per dispatcher.
pub struct UdpCarrier {
    pub key: CarrierKey,
    /// The kind that made it (what `SHOW` and the start line prefix its
    /// address with).
    pub word: &'static str,
    pub group: Vec<Arc<UdpEndpoint>>,
    opener: Arc<dyn RunOpener>,
}

impl UdpCarrier {
    pub fn new(key: CarrierKey, word: &'static str, group: Vec<Arc<UdpEndpoint>>, opener: Arc<dyn RunOpener>) -> UdpCarrier {
        UdpCarrier { key, word, group, opener }
    }

    /// The socket its links send from.
    pub fn sender(&self) -> &Arc<UdpEndpoint> {
        &self.group[0]
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.group[0].local_addr()
    }

    /// One source per socket: dispatcher `i` reads socket `i`.
    pub fn sources(self: &Arc<Self>) -> Vec<Arc<dyn LinkSource>> {
        (0..self.group.len()).map(|i| Arc::new(UdpSource { carrier: self.clone(), i }) as Arc<dyn LinkSource>).collect()
    }
}

/// One socket of a carrier, as its dispatcher reads it.
struct UdpSource {
    carrier: Arc<UdpCarrier>,
    i: usize,
}

impl LinkSource for UdpSource {
    fn watch(&self) -> Vec<(RawFd, u32)> {
        vec![(self.carrier.group[self.i].as_raw_fd(), libc::EPOLLIN as u32)]
    }

    fn owner(&self, n: usize) -> usize {
        self.i % n.max(1)
    }

    fn polled(&self) -> bool {
        true
    }

    /// Takes up to `quota` datagrams (GRO runs count as their datagrams),
    /// each run opened by the carrier's kind.
    fn ready(&self, _i: usize, _events: u32, cx: &mut RxCx) -> usize {
        let ep = &self.carrier.group[self.i];
        let mut frames = 0;
        while frames < cx.quota {
            let n = match ep.recv_batch(cx.rx) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                // ICMP errors for earlier sends surface here; they concern
                // those sends, not this receive.
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => continue,
                Err(e) => {
                    tracing::warn!(local = %ep.local_addr(), "UDP receive failed: {e}");
                    break;
                }
            };
            for m in 0..n {
                let (len, seg) = (cx.rx.lens[m], cx.rx.seg[m]);
                frames += gro_segments(len, seg).count();
                let Some(from) = cx.rx.from[m] else { continue };
                if cx.rx.truncated[m] {
                    cx.st.global.received(len);
                    cx.st.drop_at(None, DropReason::Oversize);
                    continue;
                }
                if seg > 0 && len > seg {
                    cx.st.offload.gro_runs.fetch_add(1, Relaxed);
                }
                let run = cx.rx.buf_mut(m);
                self.carrier.opener.open_run(&self.carrier.key, cx.links, cx.st, from, run, seg, cx.buf, cx.intake);
            }
        }
        frames
    }
}

/// Every UDP carrier vnetd has.
pub struct Carriers {
    list: ArcSwap<Vec<Arc<UdpCarrier>>>,
    /// Serialises binding.
    binding: Mutex<()>,
    /// The one address carriers bind (`--udp-bind`), if given.
    bind_ip: Option<IpAddr>,
    /// Sockets per carrier: one per dispatcher.
    sockets: usize,
}

impl Carriers {
    pub fn new(bind_ip: Option<IpAddr>, sockets: usize) -> Carriers {
        Carriers { list: ArcSwap::from_pointee(Vec::new()), binding: Mutex::new(()), bind_ip, sockets: sockets.max(1) }
    }

    /// Every carrier, as bound so far.
    pub fn all(&self) -> Arc<Vec<Arc<UdpCarrier>>> {
        self.list.load_full()
    }

    pub fn get(&self, key: &CarrierKey) -> Option<Arc<UdpCarrier>> {
        self.list.load().iter().find(|c| c.key == *key).cloned()
    }

    /// The carrier `key`, bound now (on `--udp-bind`'s address if given, or
    /// the family's any-address) if it is not yet.
    pub fn get_or_bind(&self, key: CarrierKey, word: &'static str, opener: &dyn Fn() -> Arc<dyn RunOpener>) -> Result<Arc<UdpCarrier>, String> {
        if let Some(c) = self.get(&key) {
            return Ok(c);
        }
        let _b = self.binding.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = self.get(&key) {
            return Ok(c);
        }
        let CarrierKey::Udp { port, v6 } = key else { return Err(format!("{key:?} is not a UDP carrier")) };
        let ip = match self.bind_ip {
            Some(b) if b.is_ipv6() == v6 => b,
            Some(b) => return Err(format!("vnetd binds only {b} (--udp-bind): no {} socket for {word}", if v6 { "IPv6" } else { "IPv4" })),
            None if v6 => Ipv6Addr::UNSPECIFIED.into(),
            None => Ipv4Addr::UNSPECIFIED.into(),
        };
        let group = UdpEndpoint::bind_group(SocketAddr::new(ip, port), self.sockets).map_err(|e| format!("{e:#}"))?;
        let c = Arc::new(UdpCarrier::new(key, word, group, opener()));
        self.add_locked(c.clone());
        Ok(c)
    }

    /// A carrier a kind bound itself (WireGuard's, from the start).
    pub fn add(&self, c: Arc<UdpCarrier>) {
        let _b = self.binding.lock().unwrap_or_else(|p| p.into_inner());
        self.add_locked(c);
    }

    fn add_locked(&self, c: Arc<UdpCarrier>) {
        let mut v = (**self.list.load()).clone();
        v.push(c);
        self.list.store(Arc::new(v));
    }

    /// Where the carriers listen, for `SHOW` and the start line:
    /// `<kind>:<address>` each.
    pub fn describe(&self) -> Vec<String> {
        self.list.load().iter().map(|c| format!("{}:{}", c.word, c.local_addr())).collect()
    }
}

/// Largest payload of one UDP GSO call we build (the kernel's limit is a
/// 64 KiB datagram).
const MAX_GSO_BYTES: usize = 65000;
/// Slices in one UDP GSO call's iovec.
const GSO_IOV: usize = 4 * MAX_GSO_SEGMENTS;
/// The longest header a prefixed link puts before its frames.
pub const MAX_PREFIX: usize = 16;

/// A link of a UDP-encapsulated kind: a remote address on a carrier's
/// socket, and a fixed header before each frame.
/// Opens a run of datagrams that each carry a VNI before their frame
/// (VXLAN, Geneve): `parse` gives a datagram's VNI and where its frame
/// starts, or None (malformed); the datagram is the link's whose peer IP
/// and VNI it carries, or dropped and counted.
#[allow(clippy::too_many_arguments)]
#[inline]
pub fn open_vni_run(
    carrier: &CarrierKey,
    links: &dyn super::LinkLookup,
    st: &crate::stats::ThreadStats,
    from: SocketAddr,
    run: &mut [u8],
    seg: usize,
    intake: &mut dyn crate::port::Intake,
    parse: impl Fn(&[u8]) -> Option<(u32, usize)>,
) {
    for r in gro_segments(run.len(), seg) {
        let h = parse(&run[r.clone()]);
        match h.and_then(|(vni, at)| links.demux(carrier, &DemuxKey::Vni(from.ip(), vni)).map(|s| (s, at))) {
            Some((slot, at)) => intake.link_frame(slot, run, r.start + at..r.end),
            None => {
                st.global.received(r.len());
                st.drop_at(None, if h.is_some() { DropReason::UnknownSender } else { DropReason::Malformed });
            }
        }
    }
    intake.end_run(run);
}

pub struct PrefixedLink {
    ep: Arc<UdpEndpoint>,
    pub remote: SocketAddr,
    prefix: [u8; MAX_PREFIX],
    plen: usize,
    word: &'static str,
    demux: Vec<(CarrierKey, DemuxKey)>,
    shown: String,
    fast: bool,
}

impl PrefixedLink {
    /// A link to `remote` by `ep`, each frame after `prefix`; `demux` its
    /// keys, `shown` its extra `LINK LIST` fields, `fast` whether the kernel
    /// fast path may carry it.
    pub fn new(word: &'static str, ep: Arc<UdpEndpoint>, remote: SocketAddr, prefix: &[u8], demux: Vec<(CarrierKey, DemuxKey)>, shown: String, fast: bool) -> PrefixedLink {
        let mut p = [0u8; MAX_PREFIX];
        p[..prefix.len()].copy_from_slice(prefix);
        PrefixedLink { ep, remote, prefix: p, plen: prefix.len(), word, demux, shown, fast }
    }

    fn prefix(&self) -> &[u8] {
        &self.prefix[..self.plen]
    }

    /// Sends segments `from..to` one datagram each; how many went.
    fn send_each(&self, segs: &Segments, from: usize, to: usize) -> (usize, io::Result<()>) {
        let mut parts = [&[][..]; SEG_PARTS];
        for k in from..to {
            let n = segs.parts(k, &mut parts);
            let mut iov = [IoSlice::new(&[]); SEG_PARTS + 1];
            iov[0] = IoSlice::new(self.prefix());
            for (v, p) in iov[1..].iter_mut().zip(&parts[..n]) {
                *v = IoSlice::new(p);
            }
            if let Err(e) = self.ep.send_iov(&iov[..n + 1], self.remote, None) {
                return (k - from, Err(e));
            }
        }
        (to - from, Ok(()))
    }
}

impl super::Transport for PrefixedLink {
    fn kind(&self) -> &'static str {
        self.word
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn demux(&self) -> Vec<(CarrierKey, DemuxKey)> {
        self.demux.clone()
    }

    fn fast_path(&self) -> Option<u16> {
        self.fast.then(|| self.ep.local_addr().port())
    }

    fn send(&self, q: &mut TxQueue, cx: &TxCtx, _vnet: &vnet_core::offload::VnetHdr, frame: Pieces) -> Sent {
        if frame.len() + self.plen > self.ep.max_payload() {
            return Sent::dropped(DropReason::Oversize, 1);
        }
        if frame.len() > cx.max_frame {
            cx.offload.fragmented.fetch_add(1, Relaxed);
        }
        let n = frame.parts().len().min(MAX_PIECES + 1);
        let mut parts = [&[][..]; MAX_PIECES + 2];
        parts[0] = self.prefix();
        parts[1..=n].copy_from_slice(&frame.parts()[..n]);
        // Frames that fit the underlay may share a GSO message with their
        // neighbours; bigger ones go as IP fragments, one datagram each.
        let gso = frame.len() <= cx.max_frame && cx.gso.ok();
        q.push(&self.ep, &parts[..=n], self.remote, cx.slot, gso);
        Sent::later()
    }

    /// One UDP GSO call per up to 64 segments; segment by segment while the
    /// kernel refuses GSO toward this peer. The segments go by reference (an
    /// iovec of their headers and slices of the frame, which may be the
    /// guest's buffers: no copy), so they cannot wait in the pass's batch,
    /// which copies what it holds; they leave at once, after what the batch
    /// held (a flow keeps its order).
    fn send_segments(&self, q: &mut TxQueue, cx: &TxCtx, segs: &Segments) -> Sent {
        // Frames queued before this one leave first: a flow's order holds.
        q.flush();
        let pre = self.prefix();
        let seg_size = self.plen + segs.seg_size;
        let per_call = (MAX_GSO_BYTES / seg_size).clamp(1, MAX_GSO_SEGMENTS);
        let n = segs.len();
        let mut out = Sent::default();
        let mut i = 0;
        while i < n {
            let mut end = (i + per_call).min(n);
            let (went, r) = if end - i == 1 || !cx.gso.ok() {
                self.send_each(segs, i, end)
            } else {
                // Each segment is its prefix, header and payload slices; a
                // call ends early when the iovec is full (a frame in many
                // pieces).
                let mut iov = [IoSlice::new(&[]); GSO_IOV];
                let mut parts = [&[][..]; SEG_PARTS];
                let mut m = 0;
                for k in i..end {
                    if m + 1 + SEG_PARTS > GSO_IOV {
                        end = k;
                        break;
                    }
                    if !pre.is_empty() {
                        iov[m] = IoSlice::new(pre);
                        m += 1;
                    }
                    let n = segs.parts(k, &mut parts);
                    for p in &parts[..n] {
                        iov[m] = IoSlice::new(p);
                        m += 1;
                    }
                }
                match self.ep.send_iov(&iov[..m], self.remote, Some(seg_size as u16)) {
                    Ok(_) => {
                        cx.offload.gso_sends.fetch_add(1, Relaxed);
                        (end - i, Ok(()))
                    }
                    Err(e) if gso_refusal(&e) => {
                        tracing::info!(remote = %self.remote, "UDP GSO refused ({e}); sending segments one by one for a while");
                        cx.gso.refused();
                        self.send_each(segs, i, end)
                    }
                    Err(e) => (0, Err(e)),
                }
            };
            out.add(Sent::now(went, segs.bytes(i, i + went)));
            if let Err(e) = r {
                out.add(sent_now(Err(e), end - i - went, 0));
            }
            i = end;
        }
        out
    }

    fn describe(&self) -> String {
        self.shown.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::{GsoState, Transport};
    use crate::stats::OffloadCounters;
    use std::net::UdpSocket;
    use vnet_core::offload::{plan_tcp_segments, SegmentPlan, VnetHdr};

    /// An Ethernet + IPv4 + TCP frame with `payload` bytes of `tag`.
    fn tcp_frame(payload: usize, tag: u8) -> Vec<u8> {
        let mut f = vec![0u8; 14 + 20 + 20];
        f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
        f[14] = 0x45;
        f[16..18].copy_from_slice(&((40 + payload) as u16).to_be_bytes());
        f[22] = 64;
        f[23] = 6;
        f[26..30].copy_from_slice(&[10, 0, 0, 1]);
        f[30..34].copy_from_slice(&[10, 0, 0, 2]);
        f[46] = 0x50; // data offset 5
        f[47] = 0x18; // PSH, ACK
        f.extend(std::iter::repeat_n(tag, payload));
        f
    }

    #[test]
    fn a_super_frames_segments_leave_after_the_frames_queued_before_it() {
        let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
        rx.set_read_timeout(Some(std::time::Duration::from_secs(2))).unwrap();
        let ep = Arc::new(UdpEndpoint::bind("127.0.0.1:0".parse().unwrap()).unwrap());
        let link = PrefixedLink::new("udp", ep, rx.local_addr().unwrap(), &[], Vec::new(), String::new(), false);
        let (gso, offload) = (GsoState::default(), OffloadCounters::default());
        let cx = TxCtx { slot: 0, max_frame: 1500, gso: &gso, offload: &offload };
        let mut q = TxQueue::default();
        // Three small frames of the flow, queued for the pass's batch.
        let small: Vec<Vec<u8>> = (1..=3).map(|i| tcp_frame(10, i)).collect();
        for f in &small {
            let parts = [&f[..]];
            assert_eq!(link.send(&mut q, &cx, &VnetHdr::default(), Pieces::new(&parts)).frames, 0);
        }
        // Then a super-frame of the same flow, cut into three segments.
        let big = tcp_frame(3000, 9);
        let mut plan = SegmentPlan::default();
        plan_tcp_segments(&big, 1000, &mut plan).unwrap();
        let parts = [&big[..]];
        let segs = Segments { plan: &plan, frame: Pieces::new(&parts), seg_size: 54 + 1000 };
        assert_eq!(link.send_segments(&mut q, &cx, &segs).frames, 3);
        q.flush();
        let mut buf = [0u8; 2048];
        let mut got = Vec::new();
        for _ in 0..6 {
            let n = rx.recv(&mut buf).unwrap();
            got.push((n, buf[n - 1]));
        }
        assert_eq!(got, vec![(64, 1), (64, 2), (64, 3), (1054, 9), (1054, 9), (1054, 9)]);
    }
}
