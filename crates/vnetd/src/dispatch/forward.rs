//! Forwarding one frame: route it through the core, then deliver it to each
//! destination in the form that destination takes.
//!
//! - To a guest's NIC: as it is, offload metadata and all — a 64 KiB TCP
//!   super-frame stays one write — unless the guest's driver did not
//!   negotiate offloads: then cut and checksummed as for a link. Each NIC
//!   sent to is flushed once at the end of the pass (`VirtualNic::flush`).
//! - To a link: as it is if the link takes offloaded frames (a device);
//!   otherwise cut to the link's frame size (TCP segmentation) and partial
//!   checksums finished, then handed to the link's `Transport`, which queues
//!   it for the pass's `sendmmsg` (UDP: runs to one peer as GSO messages),
//!   sends it at once, or buffers it.
//! - From a link, runs of TCP segments bound for one guest are merged back
//!   into a super-frame (`TcpCoalescer`) before the write.
//!
//! Nothing here depends on which kind a NIC or a link is.

use super::home;
use crate::fast::{FastPath, InstallBudget};
use crate::link::{Segments, Sent, TxCtx, TxQueue, SEG_PARTS};
use crate::settings::irq_policy;
use crate::sys::netdev::MAX_PARTS;
use crate::stats::{Counters, DropReason, ThreadStats};
use crate::topology::{Link, Route, Slot, Snapshot};
use std::io;
use std::ops::Range;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use vnet_core::mac::frame_macs;
use vnet_core::offload::{self, Pieces, Run, SegmentPlan, TcpCoalescer, VnetHdr, F_NEEDS_CSUM, MAX_PIECES};
use vnet_core::table::{Hit, Port};
use vnet_core::{Mac, RouteCache};

/// Plain frames sent to a guest per `send_burst` at most: a TCP link's one
/// read (256 KiB) can hold thousands of small frames, and the guest's
/// receive ring is locked for a burst.
const BURST: usize = 64;

pub struct Forwarder {
    /// This thread's daemon-wide counters.
    st: Arc<ThreadStats>,
    cache: RouteCache,
    /// The destinations of the last frame routed (the route that chose
    /// each, and the destination's slot), and for which table generation, origin and MACs:
    /// runs of frames of one flow skip even the cache's hash.
    hits: Vec<(Arc<Route>, Slot)>,
    last: Option<(u64, Port, Mac, Mac)>,
    /// Frames (and bytes) `hits` routed from `run_origin` not yet counted:
    /// a run of one flow costs its port, route and total counters once
    /// (`settle`: when the flow changes, and at the end of each pass, so
    /// always within one snapshot), not frame by frame.
    run: (usize, usize),
    run_origin: Slot,
    /// Frames (and bytes) sent to the NIC at the first slot and not yet
    /// counted, settled as `run` is (`settle_nic`).
    to_nic: (u32, usize, usize),
    plan: SegmentPlan,
    coalescer: TcpCoalescer,
    /// Plain frames from a link, routed to one interface and sent to it as
    /// one burst by `end_run`: ranges of the received buffer.
    burst: Vec<Range<usize>>,
    /// The id of the interface the pending run (`coalescer`, `burst`) goes
    /// to (an id, not a slot: it is looked up again in the snapshot that
    /// ends the run).
    pending_dest: u32,
    /// Link sends queued or buffered this pass, sent at its end (`flush`).
    pub tx: TxQueue,
    /// The kernel fast path, if loaded, and this thread's budget of
    /// installs into it.
    fast: Option<Arc<FastPath>>,
    budget: InstallBudget,
    /// Slots of the interfaces sent to or read since the last flush, and
    /// of those holding an interrupt back until this thread is idle.
    touched: Vec<u32>,
    deferred: Vec<u32>,
    /// An answer to a guest's ARP or neighbour solicitation (`home`).
    reply: Vec<u8>,
}

impl Forwarder {
    pub fn new(st: Arc<ThreadStats>, fast: Option<Arc<FastPath>>) -> Forwarder {
        Forwarder {
            st,
            cache: RouteCache::default(),
            hits: Vec::with_capacity(16),
            last: None,
            run: (0, 0),
            run_origin: Slot::Iface(0),
            to_nic: (u32::MAX, 0, 0),
            plan: SegmentPlan::default(),
            coalescer: TcpCoalescer::default(),
            burst: Vec::with_capacity(BURST),
            pending_dest: 0,
            tx: TxQueue::default(),
            fast,
            budget: InstallBudget::default(),
            touched: Vec::with_capacity(8),
            deferred: Vec::with_capacity(8),
            reply: Vec::with_capacity(128),
        }
    }

    /// Routes `frame` from the port at `origin`; false (counted as a drop)
    /// when it cannot be routed. The destinations are left in `self.hits`.
    #[inline]
    fn route(&mut self, snap: &Snapshot, origin: Slot, head: &[u8], len: usize) -> bool {
        let port = match origin {
            Slot::Iface(s) => Port::Interface(snap.ifaces[s as usize].id),
            Slot::Link(s) => Port::Link(snap.links[s as usize].id),
        };
        let Some((dst, src)) = frame_macs(head) else {
            self.refuse(snap, origin, len, DropReason::Malformed);
            return false;
        };
        let key = Some((snap.table.generation(), port, src, dst));
        if self.last != key {
            self.settle(snap);
            let misses = self.cache.misses;
            let hits = self.cache.route(&snap.table, port, src, dst);
            self.hits.clear();
            // Every port a rule names is in the snapshot the table came from.
            self.hits.extend(hits.iter().filter_map(|h: &Hit| Some((snap.routes.get(&h.rule)?.clone(), snap.slot_of(h.dst)?))));
            self.last = key;
            self.run_origin = origin;
            if self.cache.misses != misses {
                if let (true, Some(fast)) = (snap.fast_on, &self.fast) {
                    // The table was asked: the kernel may take this flow's next frames.
                    let hits = self.cache.route(&snap.table, port, src, dst);
                    fast.offer(&mut self.budget, snap, port, src, dst, hits);
                }
            }
        }
        if self.hits.is_empty() {
            self.refuse(snap, origin, len, DropReason::NoRoute);
            return false;
        }
        self.run.0 += 1;
        self.run.1 += len;
        true
    }

    /// Notes `frames` frames (`bytes`) sent to the NIC at `slot`, counted
    /// with the rest of the run to it (`settle_nic`).
    #[inline]
    fn sent_to_nic(&mut self, snap: &Snapshot, slot: u32, frames: usize, bytes: usize) {
        if self.to_nic.0 != slot {
            self.settle_nic(snap);
            self.to_nic.0 = slot;
        }
        self.to_nic.1 += frames;
        self.to_nic.2 += bytes;
    }

    /// Counts the frames sent to one NIC since the last settling (`snap`
    /// as for `settle`).
    fn settle_nic(&mut self, snap: &Snapshot) {
        let (slot, frames, bytes) = std::mem::replace(&mut self.to_nic, (u32::MAX, 0, 0));
        if frames > 0 {
            self.st.sent_at(&snap.ifaces[slot as usize].stats, frames, bytes);
        }
    }

    /// A frame received at `origin` and dropped before it was routed.
    #[cold]
    fn refuse(&self, snap: &Snapshot, origin: Slot, len: usize, why: DropReason) {
        let stats = stats_of(snap, origin);
        self.st.received_at(stats, 1, len);
        self.st.drop_at(Some(stats), why);
    }

    /// Counts the frames routed by `hits` since the last settling: in on
    /// their origin and in the totals, out on each route (and fan-out's
    /// extra copies). `snap` must be the one they were routed in.
    fn settle(&mut self, snap: &Snapshot) {
        let (frames, bytes) = std::mem::take(&mut self.run);
        if frames == 0 {
            return;
        }
        self.st.received_at(stats_of(snap, self.run_origin), frames, bytes);
        for (route, _) in &self.hits {
            route.stats.sent_many(frames, bytes);
        }
        if self.hits.len() > 1 {
            self.st.dispatch.fanout_copies.fetch_add((frames * (self.hits.len() - 1)) as u64, Relaxed);
        }
    }

    /// A frame read from a guest's NIC or a direct link, with its offload
    /// metadata.
    pub fn from_port(&mut self, snap: &Snapshot, origin: Slot, frame: &mut [u8], vnet: VnetHdr) {
        self.from_port_pieces(snap, origin, frame, &[], vnet);
    }

    /// A frame in pieces (a guest's buffers, cut through): `head`, which
    /// holds its headers and may be written (checksums are finished
    /// there), then `rest`, which stays where it lies and goes out by
    /// iovec to every kind of destination.
    pub fn from_port_pieces(&mut self, snap: &Snapshot, origin: Slot, head: &mut [u8], rest: &[&[u8]], mut vnet: VnetHdr) {
        let len = head.len() + rest.iter().map(|p| p.len()).sum::<usize>();
        // A guest's broadcast or multicast: storm control, learning and
        // local answers first (`home`).
        if let (Some(b), Slot::Iface(s)) = (head.first(), origin) {
            if b & 1 != 0 && self.kept_home(snap, s, head, len) {
                return;
            }
        }
        if !self.route(snap, origin, head, len) {
            return;
        }
        let hits = std::mem::take(&mut self.hits);
        for &(_, to) in &hits {
            self.deliver(snap, to, head, rest, len, &mut vnet);
        }
        self.hits = hits;
    }

    /// The guest at `slot`'s broadcast or multicast frame `head` (`len`
    /// bytes in all), met by `home`: true if it stops here (dropped and
    /// counted, or answered).
    #[cold]
    #[inline(never)]
    fn kept_home(&mut self, snap: &Snapshot, slot: u32, head: &[u8], len: usize) -> bool {
        let iface = &snap.ifaces[slot as usize];
        let port = Port::Interface(iface.id);
        let cache = &mut self.cache;
        let reachable = |src: Mac, dst: Mac| !cache.route(&snap.table, port, src, dst).is_empty();
        let mut reply = std::mem::take(&mut self.reply);
        let (home, learned) = home::meet(snap, iface, head, &self.st.dispatch, reachable, &mut reply);
        if let (true, Some(fast)) = (learned, &self.fast) {
            // The kernel may answer this guest's ARP now.
            fast.resync_neigh();
        }
        let done = match home {
            home::Home::Route => false,
            home::Home::Drop(why) => {
                self.refuse(snap, Slot::Iface(slot), len, why);
                true
            }
            home::Home::Answered => {
                self.st.received_at(&iface.stats, 1, len);
                let n = reply.len();
                self.deliver(snap, Slot::Iface(slot), &mut reply, &[], n, &mut VnetHdr::default());
                true
            }
        };
        self.reply = reply;
        done
    }

    /// The frame `buf[range]` received on the link at `slot`. Frames of one
    /// received run must be followed by `end_run`, with the same snapshot,
    /// before `buf` changes.
    pub fn from_link(&mut self, snap: &Snapshot, slot: u32, buf: &mut [u8], range: Range<usize>) {
        if !self.route(snap, Slot::Link(slot), &buf[range.clone()], range.len()) {
            return;
        }
        if let [(_, Slot::Iface(s))] = self.hits[..] {
            let iface = &snap.ifaces[s as usize];
            if !iface.nic.takes_offloads() {
                self.end_run(snap, buf);
                let mut vnet = VnetHdr::default();
                let len = range.len();
                self.deliver(snap, Slot::Iface(s), &mut buf[range], &[], len, &mut vnet);
                return;
            }
            // One pending run at a time, to one interface: TCP segments
            // merged (the coalescer), after plain frames (`burst`).
            if self.pending_dest != iface.id {
                self.end_run(snap, buf);
                self.pending_dest = iface.id;
            }
            if self.coalescer.is_pending() {
                if self.coalescer.offer(buf, range.clone()) {
                    return;
                }
                self.end_run(snap, buf);
            }
            if self.coalescer.offer(buf, range.clone()) {
                return;
            }
            if range.len() > iface.max_frame() {
                self.st.drop_at(Some(&iface.stats), DropReason::Oversize);
                return;
            }
            self.burst.push(range);
            if self.burst.len() == BURST {
                self.end_run(snap, buf);
            }
            return;
        }
        self.end_run(snap, buf);
        let hits = std::mem::take(&mut self.hits);
        let mut vnet = VnetHdr::default();
        for &(_, to) in &hits {
            self.deliver(snap, to, &mut buf[range.clone()], &[], range.len(), &mut vnet);
        }
        self.hits = hits;
    }

    /// Delivers the pending run of merged TCP segments, if any, to the
    /// interface it was routed to (by id: if that interface is gone, the
    /// run is dropped and counted, never sent elsewhere).
    pub fn end_run(&mut self, snap: &Snapshot, buf: &[u8]) {
        // Called after every received batch: nothing pending costs nothing.
        if !self.coalescer.is_pending() && self.burst.is_empty() {
            return;
        }
        let Some(slot) = snap.iface_slot(self.pending_dest) else {
            let frames = self.burst.len()
                + match self.coalescer.take() {
                    Run::Empty => 0,
                    Run::Single(_) => 1,
                    Run::Merged { frames, .. } => frames,
                };
            self.burst.clear();
            for _ in 0..frames {
                self.st.drop_at(None, DropReason::NoRoute);
            }
            return;
        };
        let iface = &snap.ifaces[slot as usize];
        self.arriving(snap, slot);
        if !self.burst.is_empty() {
            // The plain frames first: they came before the merged run.
            let (st, mut frames, mut bytes) = (&*self.st, 0, 0);
            iface.nic.send_burst(&VnetHdr::default(), &mut self.burst.iter().map(|r| &buf[r.clone()]), &mut |r| match r {
                Ok(n) => (frames, bytes) = (frames + 1, bytes + n),
                Err(e) => st.drop_at(Some(&iface.stats), crate::link::classify(&e)),
            });
            self.burst.clear();
            self.sent_to_nic(snap, slot, frames, bytes);
        }
        let (result, frames, bytes) = match self.coalescer.take() {
            Run::Empty => return,
            Run::Single(r) => {
                if r.len() > iface.max_frame() {
                    self.st.drop_at(Some(&iface.stats), DropReason::Oversize);
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
                self.st.offload.coalesced.fetch_add(1, Relaxed);
                self.st.offload.coalesced_segments.fetch_add(frames as u64, Relaxed);
                (iface.nic.send(&vnet, &parts[..1 + payloads.len()]), frames, frame_bytes)
            }
        };
        match result {
            Ok(_) => self.st.sent_at(&iface.stats, frames, bytes),
            Err(e) => {
                for _ in 0..frames {
                    self.st.drop_at(Some(&iface.stats), crate::link::classify(&e));
                }
            }
        }
    }

    /// Delivers the frame `head` then `rest` (`len` bytes) to one
    /// destination.
    #[inline]
    fn deliver(&mut self, snap: &Snapshot, to: Slot, head: &mut [u8], rest: &[&[u8]], len: usize, vnet: &mut VnetHdr) {
        match to {
            Slot::Iface(s) => {
                let iface = &snap.ifaces[s as usize];
                self.arriving(snap, s);
                if (vnet.is_gso() || vnet.flags & F_NEEDS_CSUM != 0) && !iface.nic.takes_offloads() {
                    self.finish_for_nic(snap, s, head, rest, vnet);
                    return;
                }
                if !vnet.is_gso() && len > iface.max_frame() {
                    self.st.drop_at(Some(&iface.stats), DropReason::Oversize);
                    return;
                }
                match with_pieces(head, rest, |p| iface.nic.send(vnet, p.parts())) {
                    Ok(_) => self.sent_to_nic(snap, s, 1, len),
                    Err(e) => self.account(&iface.stats, Err(e)),
                }
            }
            Slot::Link(s) => {
                let link = &snap.links[s as usize];
                let t = &*link.transport;
                if !t.takes_offloads() {
                    // TCP that does not fit the link is cut to fit it (a guest
                    // with a big MTU sends big frames even without TSO).
                    if vnet.is_gso() || (len > link.max_frame && offload::tcp_payload_offset(head).is_some()) {
                        self.send_segmented(link, s, head, rest, vnet);
                        return;
                    }
                    if vnet.flags & F_NEEDS_CSUM != 0 {
                        if offload::complete_checksum_pieces(head, rest, vnet.csum_start as usize, vnet.csum_offset as usize).is_err() {
                            self.st.drop_at(Some(&link.stats), DropReason::Malformed);
                            return;
                        }
                        self.st.offload.checksums.fetch_add(1, Relaxed);
                        vnet.flags &= !F_NEEDS_CSUM;
                    }
                }
                let cx = TxCtx { slot: s, max_frame: link.max_frame, gso: &link.gso, offload: &self.st.offload };
                let sent = with_pieces(head, rest, |p| t.send(&mut self.tx, &cx, vnet, p));
                self.count(link, sent);
            }
        }
    }

    /// Notes that the interface at `slot` is to be flushed this pass (its
    /// frames were read); true the first time.
    #[inline]
    pub fn touch(&mut self, slot: u32) -> bool {
        if self.touched.last() == Some(&slot) || self.touched.contains(&slot) {
            return false;
        }
        self.touched.push(slot);
        true
    }

    /// Frames are about to be sent to the interface at `slot`: the first
    /// time this pass, its NIC hears of their arrival (early interrupts).
    #[inline]
    fn arriving(&mut self, snap: &Snapshot, slot: u32) {
        if self.touch(slot) {
            snap.ifaces[slot as usize].nic.arriving(&irq_policy(&snap.dispatch));
        }
    }

    pub fn has_deferred(&self) -> bool {
        !self.deferred.is_empty()
    }

    /// This thread has no more work: the interrupts NICs held back go now.
    pub fn idle(&mut self, snap: &Snapshot) {
        for slot in self.deferred.drain(..) {
            if let Some(i) = snap.ifaces.get(slot as usize) {
                i.nic.idle();
            }
        }
    }

    /// Delivers an offloaded frame to a NIC whose guest did not negotiate
    /// offloads: a super-frame cut to segments of its size, a partial
    /// checksum finished.
    fn finish_for_nic(&mut self, snap: &Snapshot, slot: u32, head: &mut [u8], rest: &[&[u8]], vnet: &mut VnetHdr) {
        let iface = &snap.ifaces[slot as usize];
        let plain = VnetHdr::default();
        if !vnet.is_gso() {
            if offload::complete_checksum_pieces(head, rest, vnet.csum_start as usize, vnet.csum_offset as usize).is_err() {
                self.st.drop_at(Some(&iface.stats), DropReason::Malformed);
                return;
            }
            self.st.offload.checksums.fetch_add(1, Relaxed);
            let r = with_pieces(head, rest, |p| {
                if p.len() > iface.max_frame() {
                    return Err(io::Error::from_raw_os_error(libc::EMSGSIZE));
                }
                iface.nic.send(&plain, p.parts())
            });
            self.account(&iface.stats, r);
            return;
        }
        let (Some(hl), true) = (offload::tcp_payload_offset(head), vnet.gso_size as usize >= offload::MIN_GSO_SIZE) else {
            self.st.drop_at(Some(&iface.stats), DropReason::Malformed);
            return;
        };
        let mss = (vnet.gso_size as usize).min(iface.max_frame().saturating_sub(hl)).max(8);
        let (plan, st) = (&mut self.plan, &*self.st);
        let planned: Result<(), offload::OffloadError> = with_pieces(head, rest, |frame| {
            offload::plan_tcp_segments_in(&frame, mss, plan)?;
            st.offload.segmented.fetch_add(1, Relaxed);
            st.offload.segments.fetch_add(plan.len() as u64, Relaxed);
            let segs = Segments { plan, frame, seg_size: hl + mss };
            let mut parts = [&[][..]; SEG_PARTS];
            for k in 0..segs.len() {
                let n = segs.parts(k, &mut parts);
                account(st, &iface.stats, iface.nic.send(&plain, &parts[..n]).map(|_| segs.plan.frame_len(k)));
            }
            Ok(())
        });
        if planned.is_err() {
            self.st.drop_at(Some(&iface.stats), DropReason::Malformed);
        }
    }

    /// Cuts a TCP super-frame to the link's frame size and hands the
    /// segments to the link.
    fn send_segmented(&mut self, link: &Link, slot: u32, head: &[u8], rest: &[&[u8]], vnet: &VnetHdr) {
        let Some(hl) = offload::tcp_payload_offset(head) else {
            self.st.drop_at(Some(&link.stats), DropReason::Malformed);
            return;
        };
        let gso_size = if vnet.is_gso() { vnet.gso_size as usize } else { usize::MAX };
        if gso_size < offload::MIN_GSO_SIZE {
            self.st.drop_at(Some(&link.stats), DropReason::Malformed);
            return;
        }
        let mss = gso_size.min(link.max_frame.saturating_sub(hl)).max(8);
        let (plan, tx, st) = (&mut self.plan, &mut self.tx, &self.st);
        let sent = with_pieces(head, rest, |frame| {
            offload::plan_tcp_segments_in(&frame, mss, plan).ok()?;
            st.offload.segmented.fetch_add(1, Relaxed);
            st.offload.segments.fetch_add(plan.len() as u64, Relaxed);
            let segs = Segments { plan, frame, seg_size: hl + mss };
            let cx = TxCtx { slot, max_frame: link.max_frame, gso: &link.gso, offload: &st.offload };
            Some(link.transport.send_segments(tx, &cx, &segs))
        });
        match sent {
            Some(sent) => self.count(link, sent),
            None => self.st.drop_at(Some(&link.stats), DropReason::Malformed),
        }
    }

    /// Counts what a link did with frames now (queued ones are counted when
    /// written out).
    #[inline]
    fn count(&self, link: &Link, sent: Sent) {
        if sent.frames > 0 {
            self.st.sent_at(&link.stats, sent.frames, sent.bytes);
        }
        if let Some(why) = sent.why {
            for _ in 0..sent.dropped {
                self.st.drop_at(Some(&link.stats), why);
            }
        }
    }

    #[inline]
    fn account(&self, stats: &Counters, r: io::Result<usize>) {
        account(&self.st, stats, r)
    }

    /// Sends what this pass queued (one `sendmmsg` per UDP socket), writes
    /// out the links that buffered frames, and counts it all.
    pub fn flush(&mut self, snap: &Snapshot) {
        self.settle(snap);
        self.settle_nic(snap);
        self.tx.flush();
        for slot in self.tx.gso_refused.drain(..) {
            if let Some(link) = snap.links.get(slot as usize) {
                tracing::info!(link = %link.name, "UDP GSO refused; sending its datagrams one by one for a while");
                link.gso.refused();
            }
        }
        // Datagrams sent, counted per run to one link; refusals one by one.
        let (mut at, mut frames, mut bytes) = (u32::MAX, 0, 0);
        for (slot, len, err) in self.tx.done.drain(..) {
            if let Some(why) = err {
                if let Some(link) = snap.links.get(slot as usize) {
                    self.st.drop_at(Some(&link.stats), why);
                }
                continue;
            }
            if slot != at {
                sent_on(&self.st, snap, at, frames, bytes);
                (at, frames, bytes) = (slot, 0, 0);
            }
            (frames, bytes) = (frames + 1, bytes + len);
        }
        sent_on(&self.st, snap, at, frames, bytes);
        for slot in self.tx.buffered.drain(..) {
            let Some(link) = snap.links.get(slot as usize) else { continue };
            let (frames, bytes) = link.transport.write_out();
            if frames > 0 {
                self.st.sent_at(&link.stats, frames, bytes);
            }
        }
        // NICs last: the frames written into guests become visible (the
        // transmit buffers this pass took go back to their guests after
        // this, from the dispatcher that drained them: `release`).
        if !self.touched.is_empty() {
            let irq = irq_policy(&snap.dispatch);
            for slot in self.touched.drain(..) {
                if let Some(i) = snap.ifaces.get(slot as usize) {
                    if i.nic.flush(&irq) && !self.deferred.contains(&slot) {
                        self.deferred.push(slot);
                    }
                }
            }
        }
        let d = &self.st.dispatch;
        d.cache_entries.store(self.cache.len() as u64, Relaxed);
        if self.tx.batches_sent > 0 {
            d.tx_batches.fetch_add(std::mem::take(&mut self.tx.batches_sent), Relaxed);
            d.tx_batched.fetch_add(std::mem::take(&mut self.tx.batched), Relaxed);
            self.st.offload.gso_sends.fetch_add(std::mem::take(&mut self.tx.gso_messages), Relaxed);
        }
    }
}

/// The counters of the port at `slot`.
#[inline]
fn stats_of(snap: &Snapshot, slot: Slot) -> &Counters {
    match slot {
        Slot::Iface(s) => &snap.ifaces[s as usize].stats,
        Slot::Link(s) => &snap.links[s as usize].stats,
    }
}

/// `frames` datagrams of `bytes` sent on the link at `slot` (none: nothing).
fn sent_on(st: &ThreadStats, snap: &Snapshot, slot: u32, frames: usize, bytes: usize) {
    if let (true, Some(link)) = (frames > 0, snap.links.get(slot as usize)) {
        st.sent_at(&link.stats, frames, bytes);
    }
}

/// Calls `f` with the frame `head` then `rest` as one `Pieces`.
#[inline]
fn with_pieces<R>(head: &[u8], rest: &[&[u8]], f: impl FnOnce(Pieces) -> R) -> R {
    if rest.is_empty() {
        return f(Pieces::new(std::slice::from_ref(&head)));
    }
    let mut parts = [&[][..]; MAX_PIECES + 1];
    parts[0] = head;
    let n = rest.len().min(MAX_PIECES);
    parts[1..=n].copy_from_slice(&rest[..n]);
    f(Pieces::new(&parts[..=n]))
}

/// Counts a frame of `r` bytes sent, or dropped for the reason `r`'s error
/// gives.
#[inline]
fn account(st: &ThreadStats, stats: &Counters, r: io::Result<usize>) {
    match r {
        Ok(n) => st.sent_at(stats, 1, n),
        Err(e) => {
            let why = crate::link::classify(&e);
            if why == DropReason::TxError {
                tracing::debug!("send failed: {e}");
            }
            st.drop_at(Some(stats), why);
        }
    }
}

#[cfg(test)]
#[path = "forward_tests.rs"]
mod tests;
