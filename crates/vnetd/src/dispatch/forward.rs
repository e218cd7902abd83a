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
use crate::topology::{LinkKind, Snapshot};
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
    /// The destinations of the last frame routed, and for which table
    /// generation, origin and MACs: runs of frames of one flow skip even the
    /// cache's hash.
    hits: Vec<Hit>,
    last: Option<(u64, Port, Mac, Mac)>,
    plan: SegmentPlan,
    /// One batch per UDP socket: VNET/P v4, v6; VXLAN v4, v6.
    tx: [TxBatch; 4],
    seg: Vec<u8>,
    coalescer: TcpCoalescer,
    pending_dest: u32,
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
            seg: Vec::new(),
            coalescer: TcpCoalescer::default(),
            pending_dest: 0,
            batching: false,
        }
    }

    /// Routes `frame` from `origin`; false (counted as a drop) when it cannot
    /// be routed. The destinations are left in `self.hits`.
    #[inline]
    fn route(&mut self, snap: &Snapshot, origin: Port, frame: &[u8]) -> bool {
        let origin_stats = snap.port_stats(origin);
        origin_stats.received(frame.len());
        self.dp.global.received(frame.len());
        let Some((dst, src)) = frame_macs(frame) else {
            self.dp.drop_at(Some(origin_stats), Drop::Malformed);
            return false;
        };
        let key = Some((snap.table.generation(), origin, src, dst));
        if self.last != key {
            let hits = self.cache.route(&snap.table, origin, src, dst);
            self.hits.clear();
            self.hits.extend_from_slice(hits);
            self.last = key;
        }
        if self.hits.is_empty() {
            self.dp.drop_at(Some(origin_stats), Drop::NoRoute);
            return false;
        }
        for h in &self.hits {
            snap.routes[h.rule as usize].stats.sent(frame.len());
        }
        if self.hits.len() > 1 {
            self.dp.dispatch.fanout_copies.fetch_add(self.hits.len() as u64 - 1, Relaxed);
        }
        true
    }

    /// A frame read from a guest's NIC or a direct link, with its offload
    /// metadata.
    pub fn from_port(&mut self, snap: &Snapshot, origin: Port, frame: &mut [u8], mut vnet: VnetHdr) {
        if !self.route(snap, origin, frame) {
            return;
        }
        let hits = std::mem::take(&mut self.hits);
        for h in &hits {
            self.deliver(snap, h.dst, frame, &mut vnet);
        }
        self.hits = hits;
    }

    /// The frame `buf[range]` received on link `slot`. Frames of one received
    /// run must be followed by `end_run` before `buf` changes.
    pub fn from_link(&mut self, snap: &Snapshot, slot: u32, buf: &mut [u8], range: Range<usize>) {
        if !self.route(snap, Port::Link(slot), &buf[range.clone()]) {
            return;
        }
        if let [Hit { dst: Port::Interface(s), .. }] = self.hits[..] {
            if self.coalescer.is_pending() && self.pending_dest == s && self.coalescer.offer(buf, range.clone()) {
                return;
            }
            self.end_run(snap, buf);
            if self.coalescer.offer(buf, range.clone()) {
                self.pending_dest = s;
                return;
            }
        } else {
            self.end_run(snap, buf);
        }
        let hits = std::mem::take(&mut self.hits);
        let mut vnet = VnetHdr::default();
        for h in &hits {
            self.deliver(snap, h.dst, &mut buf[range.clone()], &mut vnet);
        }
        self.hits = hits;
    }

    /// Delivers the pending run of merged TCP segments, if any.
    pub fn end_run(&mut self, snap: &Snapshot, buf: &[u8]) {
        let slot = self.pending_dest;
        let Some(iface) = snap.ifaces.get(slot as usize) else {
            let _ = self.coalescer.take();
            return;
        };
        let (result, frames, bytes) = match self.coalescer.take() {
            Run::Empty => return,
            Run::Single(r) => (iface.nic.send(&VnetHdr::default(), &[&buf[r.clone()]]), 1, r.len()),
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
    fn deliver(&mut self, snap: &Snapshot, to: Port, frame: &mut [u8], vnet: &mut VnetHdr) {
        match to {
            Port::Interface(s) => {
                let iface = &snap.ifaces[s as usize];
                if !vnet.is_gso() && frame.len() > iface.max_frame() {
                    self.dp.drop_at(Some(&iface.stats), Drop::Oversize);
                    return;
                }
                let r = iface.nic.send(vnet, &[frame]);
                self.account(&iface.stats, r.map(|_| frame.len()));
            }
            Port::Link(s) => {
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
                        } else if !t.enqueue(frame) {
                            self.dp.drop_at(Some(&link.stats), Drop::QueueFull);
                        }
                        // Counted as sent when the link's writer sends it.
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
                    self.seg.clear();
                    self.seg.extend_from_slice(self.plan.header(k));
                    self.seg.extend_from_slice(&frame[self.plan.payload[k].clone()]);
                    if !t.enqueue(&self.seg) {
                        self.dp.drop_at(Some(&link.stats), Drop::QueueFull);
                    }
                }
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
            let result = if end - i == 1 || !self.dp.gso_ok.load(Relaxed) {
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
                    // The underlay cannot do GSO (no checksum offload, say):
                    // send datagram by datagram from now on.
                    Err(e) if matches!(e.raw_os_error(), Some(libc::EIO) | Some(libc::EINVAL)) => {
                        tracing::info!("UDP GSO unavailable ({e}); sending segments one by one");
                        self.dp.gso_ok.store(false, Relaxed);
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

    /// Sends the queued link datagrams (one `sendmmsg` per socket).
    pub fn flush(&mut self, snap: &Snapshot) {
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
