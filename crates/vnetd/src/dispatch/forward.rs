//! Forwarding one frame: route it through the core, then deliver it to each
//! destination in the form that destination takes.
//!
//! - To a guest (TAP or QEMU NIC): as it is, offload metadata and all — a
//!   64 KiB TCP super-frame stays one write.
//! - To a link: cut to the link's frame size (TCP segmentation, sent with one
//!   UDP GSO call), partial checksums finished; plain frames are sent at once
//!   (guest-driven) or queued for one `sendmmsg` per pass (VMM-driven).
//! - From a link, runs of TCP segments bound for one guest are merged back
//!   into a super-frame (`TcpCoalescer`) before the write.

use super::Datapath;
use crate::link::tcp::MAX_TCP_FRAME;
use crate::link::udp::{TxBatch, UdpEndpoint, MAX_GSO_SEGMENTS};
use crate::nic::{send_vnet, MAX_PARTS};
use crate::stats::{Counters, Drop};
use crate::topology::{LinkKind, Slot, Snapshot};
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::io::{self, IoSlice};
use std::ops::Range;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use vnet_core::mac::frame_macs;
use vnet_core::offload::{self, Run, SegmentPlan, TcpCoalescer, VnetHdr, F_NEEDS_CSUM};
use vnet_core::table::{Hit, Port};
use vnet_core::{Mac, RouteCache};

/// Largest payload of one UDP GSO call we build (the kernel's limit is a
/// 64 KiB datagram).
const MAX_GSO_BYTES: usize = 65000;

pub struct Forwarder {
    dp: Arc<Datapath>,
    cache: RouteCache,
    /// The destinations of the last frame routed (rule index and the
    /// destination's slot), and for which table generation, origin and MACs:
    /// runs of frames of one flow skip even the cache's hash.
    hits: Vec<(u32, Slot)>,
    last: Option<(u64, Port, Mac, Mac)>,
    plan: SegmentPlan,
    /// One batch per UDP socket: VNET/P v4, v6; VXLAN v4, v6.
    tx: [TxBatch; 4],
    coalescer: TcpCoalescer,
    /// The id of the interface the pending run goes to (an id, not a slot:
    /// it is looked up again in the snapshot that ends the run).
    pending_dest: u32,
    /// Slots of TCP links given frames this pass, to write out at `flush`.
    tcp_dirty: Vec<u32>,
    /// Queue plain link sends for one `sendmmsg` per pass (VMM-driven).
    pub batching: bool,
}

impl Forwarder {
    pub fn new(dp: Arc<Datapath>) -> Forwarder {
        Forwarder {
            dp,
            cache: RouteCache::default(),
            hits: Vec::with_capacity(16),
            last: None,
            plan: SegmentPlan::default(),
            tx: Default::default(),
            coalescer: TcpCoalescer::default(),
            pending_dest: 0,
            tcp_dirty: Vec::new(),
            batching: false,
        }
    }

    /// Routes `frame` from the port at `origin`; false (counted as a drop)
    /// when it cannot be routed. The destinations are left in `self.hits`.
    #[inline]
    fn route(&mut self, snap: &Snapshot, origin: Slot, frame: &[u8]) -> bool {
        let (port, origin_stats) = match origin {
            Slot::Iface(s) => {
                let i = &snap.ifaces[s as usize];
                (Port::Interface(i.id), &i.stats)
            }
            Slot::Link(s) => {
                let l = &snap.links[s as usize];
                (Port::Link(l.id), &l.stats)
            }
        };
        origin_stats.received(frame.len());
        self.dp.global.received(frame.len());
        let Some((dst, src)) = frame_macs(frame) else {
            self.dp.drop_at(Some(origin_stats), Drop::Malformed);
            return false;
        };
        let key = Some((snap.table.generation(), port, src, dst));
        if self.last != key {
            let hits = self.cache.route(&snap.table, port, src, dst);
            self.hits.clear();
            // Every port a rule names is in the snapshot the table came from.
            self.hits.extend(hits.iter().filter_map(|h: &Hit| Some((h.rule, snap.slot_of(h.dst)?))));
            self.last = key;
        }
        if self.hits.is_empty() {
            self.dp.drop_at(Some(origin_stats), Drop::NoRoute);
            return false;
        }
        for &(rule, _) in &self.hits {
            snap.routes[rule as usize].stats.sent(frame.len());
        }
        if self.hits.len() > 1 {
            self.dp.dispatch.fanout_copies.fetch_add(self.hits.len() as u64 - 1, Relaxed);
        }
        true
    }

    /// A frame read from a guest's NIC or a direct link, with its offload
    /// metadata.
    pub fn from_port(&mut self, snap: &Snapshot, origin: Slot, frame: &mut [u8], mut vnet: VnetHdr) {
        if !self.route(snap, origin, frame) {
            return;
        }
        let hits = std::mem::take(&mut self.hits);
        for &(_, to) in &hits {
            self.deliver(snap, to, frame, &mut vnet);
        }
        self.hits = hits;
    }

    /// The frame `buf[range]` received on the link at `slot`. Frames of one
    /// received run must be followed by `end_run`, with the same snapshot,
    /// before `buf` changes.
    pub fn from_link(&mut self, snap: &Snapshot, slot: u32, buf: &mut [u8], range: Range<usize>) {
        if !self.route(snap, Slot::Link(slot), &buf[range.clone()]) {
            return;
        }
        if let [(_, Slot::Iface(s))] = self.hits[..] {
            let id = snap.ifaces[s as usize].id;
            if self.coalescer.is_pending() && self.pending_dest == id && self.coalescer.offer(buf, range.clone()) {
                return;
            }
            self.end_run(snap, buf);
            if self.coalescer.offer(buf, range.clone()) {
                self.pending_dest = id;
                return;
            }
        } else {
            self.end_run(snap, buf);
        }
        let hits = std::mem::take(&mut self.hits);
        let mut vnet = VnetHdr::default();
        for &(_, to) in &hits {
            self.deliver(snap, to, &mut buf[range.clone()], &mut vnet);
        }
        self.hits = hits;
    }

    /// Delivers the pending run of merged TCP segments, if any, to the
    /// interface it was routed to (by id: if that interface is gone, the
    /// run is dropped and counted, never sent elsewhere).
    pub fn end_run(&mut self, snap: &Snapshot, buf: &[u8]) {
        let Some(slot) = snap.iface_slot(self.pending_dest) else {
            let frames = match self.coalescer.take() {
                Run::Empty => 0,
                Run::Single(_) => 1,
                Run::Merged { frames, .. } => frames,
            };
            for _ in 0..frames {
                self.dp.drop_at(None, Drop::NoRoute);
            }
            return;
        };
        let iface = &snap.ifaces[slot as usize];
        let (result, frames, bytes) = match self.coalescer.take() {
            Run::Empty => return,
            Run::Single(r) => {
                if r.len() > iface.max_frame() {
                    self.dp.drop_at(Some(&iface.stats), Drop::Oversize);
                    return;
                }
                (iface.nic.send(&VnetHdr::default(), &[&buf[r.clone()]]), 1, r.len())
            }
            Run::Merged { vnet, header, payloads, frames, frame_bytes } => {
                let mut parts: [&[u8]; MAX_PARTS] = [&[]; MAX_PARTS];
                parts[0] = header;
                for (p, r) in parts[1..].iter_mut().zip(payloads) {
                    *p = &buf[r.clone()];
                }
                self.dp.offload.coalesced.fetch_add(1, Relaxed);
                self.dp.offload.coalesced_segments.fetch_add(frames as u64, Relaxed);
                (iface.nic.send(&vnet, &parts[..1 + payloads.len()]), frames, frame_bytes)
            }
        };
        match result {
            Ok(_) => {
                iface.stats.sent_many(frames, bytes);
                self.dp.global.sent_many(frames, bytes);
            }
            Err(e) => {
                for _ in 0..frames {
                    self.dp.drop_at(Some(&iface.stats), classify(&e));
                }
            }
        }
    }

    #[inline]
    fn deliver(&mut self, snap: &Snapshot, to: Slot, frame: &mut [u8], vnet: &mut VnetHdr) {
        match to {
            Slot::Iface(s) => {
                let iface = &snap.ifaces[s as usize];
                if !vnet.is_gso() && frame.len() > iface.max_frame() {
                    self.dp.drop_at(Some(&iface.stats), Drop::Oversize);
                    return;
                }
                let r = iface.nic.send(vnet, &[frame]);
                self.account(&iface.stats, r.map(|_| frame.len()));
            }
            Slot::Link(s) => {
                let link = &snap.links[s as usize];
                if let LinkKind::Direct { port, .. } = &link.kind {
                    // Onto the LAN as it is; the kernel segments super-frames.
                    if !vnet.is_gso() && frame.len() > link.max_frame {
                        self.dp.drop_at(Some(&link.stats), Drop::Oversize);
                        return;
                    }
                    let r = send_vnet(port.as_raw_fd(), vnet, &[frame]);
                    self.account(&link.stats, r.map(|_| frame.len()));
                    return;
                }
                // TCP that does not fit the link is cut to fit it (a guest
                // with a big MTU sends big frames even without TSO).
                if vnet.is_gso() || (frame.len() > link.max_frame && offload::tcp_payload_offset(frame).is_some()) {
                    self.send_segmented(snap, s, frame, vnet);
                    return;
                }
                if vnet.flags & F_NEEDS_CSUM != 0 {
                    if offload::complete_checksum(frame, vnet.csum_start as usize, vnet.csum_offset as usize).is_err() {
                        self.dp.drop_at(Some(&link.stats), Drop::Malformed);
                        return;
                    }
                    self.dp.offload.checksums.fetch_add(1, Relaxed);
                    vnet.flags &= !F_NEEDS_CSUM;
                }
                let Some(remote) = link.remote else { return };
                let (ep, which, prefix) = match &link.kind {
                    LinkKind::Tcp(t) => {
                        if frame.len() > MAX_TCP_FRAME {
                            self.dp.drop_at(Some(&link.stats), Drop::Oversize);
                        } else if !t.enqueue(&[frame]) {
                            self.dp.drop_at(Some(&link.stats), Drop::QueueFull);
                        } else {
                            self.tcp_touched(s);
                        }
                        // Counted as sent when written to the connection.
                        return;
                    }
                    LinkKind::Udp => (self.dp.udp_for(&remote), if remote.is_ipv4() { 0 } else { 1 }, None),
                    LinkKind::Vxlan { vni } => {
                        (self.dp.vxlan_for(&remote), if remote.is_ipv4() { 2 } else { 3 }, Some(vnet_core::wire::vxlan_header(*vni)))
                    }
                    LinkKind::Direct { .. } => unreachable!(),
                };
                let Some(ep) = ep else {
                    self.dp.drop_at(Some(&link.stats), Drop::TxError);
                    return;
                };
                let plen = prefix.map_or(0, |p| p.len());
                if frame.len() + plen > ep.max_payload() {
                    self.dp.drop_at(Some(&link.stats), Drop::Oversize);
                    return;
                }
                if frame.len() > link.max_frame {
                    self.dp.offload.fragmented.fetch_add(1, Relaxed);
                }
                let pre = prefix.unwrap_or_default();
                let parts: [&[u8]; 2] = [&pre[..plen], frame];
                if self.batching {
                    if !self.tx[which].push(&parts, remote, s) {
                        self.flush(snap);
                        self.tx[which].push(&parts, remote, s);
                    }
                } else {
                    let iov = [IoSlice::new(parts[0]), IoSlice::new(parts[1])];
                    let r = ep.send_iov(&iov, remote, None);
                    self.account(&link.stats, r.map(|_| frame.len()));
                }
            }
        }
    }

    /// Cuts a TCP super-frame to the link's frame size and sends the
    /// segments: over UDP or VXLAN with UDP GSO (one call per up to 64
    /// segments), over TCP into the link's queue.
    fn send_segmented(&mut self, snap: &Snapshot, slot: u32, frame: &[u8], vnet: &VnetHdr) {
        let link = &snap.links[slot as usize];
        let Some(hl) = offload::tcp_payload_offset(frame) else {
            self.dp.drop_at(Some(&link.stats), Drop::Malformed);
            return;
        };
        let gso_size = if vnet.is_gso() { vnet.gso_size as usize } else { usize::MAX };
        if gso_size < offload::MIN_GSO_SIZE {
            self.dp.drop_at(Some(&link.stats), Drop::Malformed);
            return;
        }
        let mss = gso_size.min(link.max_frame.saturating_sub(hl)).max(8);
        if offload::plan_tcp_segments(frame, mss, &mut self.plan).is_err() {
            self.dp.drop_at(Some(&link.stats), Drop::Malformed);
            return;
        }
        let n = self.plan.len();
        self.dp.offload.segmented.fetch_add(1, Relaxed);
        self.dp.offload.segments.fetch_add(n as u64, Relaxed);
        let Some(remote) = link.remote else { return };
        let (ep, prefix) = match &link.kind {
            LinkKind::Tcp(t) => {
                for k in 0..n {
                    if !t.enqueue(&[self.plan.header(k), &frame[self.plan.payload[k].clone()]]) {
                        self.dp.drop_at(Some(&link.stats), Drop::QueueFull);
                    }
                }
                self.tcp_touched(slot);
                return;
            }
            LinkKind::Udp => (self.dp.udp_for(&remote), None),
            LinkKind::Vxlan { vni } => (self.dp.vxlan_for(&remote), Some(vnet_core::wire::vxlan_header(*vni))),
            LinkKind::Direct { .. } => return,
        };
        let Some(ep) = ep else {
            self.dp.drop_at(Some(&link.stats), Drop::TxError);
            return;
        };
        let pre = prefix.unwrap_or_default();
        let pre: &[u8] = if prefix.is_some() { &pre } else { &[] };
        let seg_size = pre.len() + hl + mss;
        let per_call = (MAX_GSO_BYTES / seg_size).clamp(1, MAX_GSO_SEGMENTS);
        let mut i = 0;
        while i < n {
            let end = (i + per_call).min(n);
            let bytes: usize = (i..end).map(|k| self.plan.frame_len(k)).sum();
            let result = if end - i == 1 || !link.gso_ok() {
                self.send_each(ep, pre, frame, i, end, remote)
            } else {
                let mut iov = [IoSlice::new(&[]); 3 * MAX_GSO_SEGMENTS];
                let mut m = 0;
                for seg in i..end {
                    if !pre.is_empty() {
                        iov[m] = IoSlice::new(pre);
                        m += 1;
                    }
                    iov[m] = IoSlice::new(self.plan.header(seg));
                    iov[m + 1] = IoSlice::new(&frame[self.plan.payload[seg].clone()]);
                    m += 2;
                }
                match ep.send_iov(&iov[..m], remote, Some(seg_size as u16)) {
                    Ok(_) => {
                        self.dp.offload.gso_sends.fetch_add(1, Relaxed);
                        Ok(())
                    }
                    // The kernel refused GSO toward this peer (no checksum
                    // offload, or segments above the path MTU): send this
                    // link's segments one by one for a while.
                    Err(e) if matches!(e.raw_os_error(), Some(libc::EIO) | Some(libc::EINVAL)) => {
                        tracing::info!(link = %link.name, "UDP GSO refused ({e}); sending segments one by one for a while");
                        link.gso_refused();
                        self.send_each(ep, pre, frame, i, end, remote)
                    }
                    Err(e) => Err(e),
                }
            };
            match result {
                Ok(()) => {
                    link.stats.sent_many(end - i, bytes);
                    self.dp.global.sent_many(end - i, bytes);
                }
                Err(e) => {
                    for _ in i..end {
                        self.dp.drop_at(Some(&link.stats), classify(&e));
                    }
                }
            }
            i = end;
        }
    }

    fn send_each(&self, ep: &UdpEndpoint, pre: &[u8], frame: &[u8], from: usize, to: usize, remote: SocketAddr) -> io::Result<()> {
        for k in from..to {
            let iov = [IoSlice::new(pre), IoSlice::new(self.plan.header(k)), IoSlice::new(&frame[self.plan.payload[k].clone()])];
            ep.send_iov(&iov, remote, None)?;
        }
        Ok(())
    }

    #[inline]
    fn account(&self, stats: &Counters, r: io::Result<usize>) {
        match r {
            Ok(n) => {
                stats.sent(n);
                self.dp.global.sent(n);
            }
            Err(e) => {
                let why = classify(&e);
                if why == Drop::TxError {
                    tracing::debug!("send failed: {e}");
                }
                self.dp.drop_at(Some(stats), why);
            }
        }
    }

    /// The TCP link at `slot` was given frames: write them out at `flush`.
    #[inline]
    fn tcp_touched(&mut self, slot: u32) {
        if self.tcp_dirty.last() != Some(&slot) && !self.tcp_dirty.contains(&slot) {
            self.tcp_dirty.push(slot);
        }
    }

    /// Sends the queued link datagrams (one `sendmmsg` per socket) and
    /// writes out the TCP links given frames (one `write` each).
    pub fn flush(&mut self, snap: &Snapshot) {
        for slot in self.tcp_dirty.drain(..) {
            let Some(link) = snap.links.get(slot as usize) else { continue };
            if let LinkKind::Tcp(t) = &link.kind {
                let w = t.write_out();
                super::account_tcp(&self.dp, link, w);
            }
        }
        let dp = &self.dp;
        let eps = [dp.udp4.as_ref(), dp.udp6.as_ref(), dp.vxlan4.get(), dp.vxlan6.get()];
        for (tx, ep) in self.tx.iter_mut().zip(eps) {
            if tx.is_empty() {
                continue;
            }
            let Some(ep) = ep else { continue };
            let mut n = 0u64;
            ep.flush(tx, |slot, len, err| {
                n += 1;
                let Some(link) = snap.links.get(slot as usize) else { return };
                match err {
                    None => {
                        link.stats.sent(len);
                        dp.global.sent(len);
                    }
                    Some(e) => dp.drop_at(Some(&link.stats), classify(&e)),
                }
            });
            dp.dispatch.tx_batches.fetch_add(1, Relaxed);
            dp.dispatch.tx_batched.fetch_add(n, Relaxed);
        }
    }
}

fn classify(e: &io::Error) -> Drop {
    match e.raw_os_error() {
        Some(libc::EAGAIN) | Some(libc::ENOBUFS) => Drop::QueueFull,
        Some(libc::EIO) | Some(libc::ENETDOWN) => Drop::Down,
        Some(libc::EMSGSIZE) => Drop::Oversize,
        _ => Drop::TxError,
    }
}
