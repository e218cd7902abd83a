//! One split virtqueue of a vhost-user NIC, worked from vnetd's side: the
//! guest's descriptors read and written in its shared memory, used entries
//! published in batches, notifications both ways.
//!
//! `virtio-queue` walks descriptor chains (loops and out-of-range addresses
//! are its to refuse); the used ring is written here, because a frame
//! spread over several receive buffers (mergeable buffers) must appear to
//! the guest at once, and because a batch of frames should cost the guest
//! one look at the ring and at most one interrupt.
//!
//! The work a guest can cause is bounded by one `Budget`: no chain longer
//! than the queue (indirect tables included), a number of descriptors per
//! pass, and a ring that keeps sending bad chains is marked broken
//! (`Health`) and left alone until the frontend resets it, as virtio's
//! DEVICE_NEEDS_RESET would. Every chain taken goes back to the guest,
//! read or not (a receive chain with no writable byte with length 0).

use crate::counters::Counters;
use crate::frame::{GuestFrame, MAX_HEAD, MIN_HEAD};
use crate::memory::{DirtyLog, GuestMemory};
use crate::notify::{Kick, Notifier, Signal};
use crate::walker::{self, Layout, Walk, Walked};
use std::io;
use std::sync::atomic::{fence, Ordering, Ordering::Relaxed};
use std::sync::Arc;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};
use vnet_core::offload::{VnetHdr, MAX_PIECES, VNET_HDR_LEN};

/// Largest queue the guest may make (QEMU's default is 256).
pub const MAX_QUEUE_SIZE: u16 = 1024;
/// Most receive buffers one frame may take (a 64 KiB super-frame in the
/// guest's smallest mergeable buffers).
const MAX_BUFFERS: usize = 64;
const VRING_AVAIL_F_NO_INTERRUPT: u16 = 1;
const VRING_USED_F_NO_NOTIFY: u16 = 1;

/// Every limit on the work one ring's guest can cause.
#[derive(Clone, Copy, Debug)]
pub struct Budget {
    /// Descriptors read per pass (between two publishes): a legitimate
    /// pass of 64 super-frames in 4 KiB buffers reads about 1200.
    pub descs_per_pass: u32,
    /// Bad chains in a row (unreadable, write-only on transmit, no room on
    /// receive) before the ring is marked broken.
    pub strikes: u16,
    // No chain may be longer than the queue (virtio 1.2, 2.7.5.2 and
    // 2.7.5.3.1): not a setting, the queue's size.
}

impl Default for Budget {
    fn default() -> Budget {
        Budget { descs_per_pass: 8192, strikes: 64 }
    }
}

/// Whether vnetd still works a ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Health {
    Ok,
    /// It broke the rules (why): nothing is read or written until the
    /// frontend resets the ring or reconnects.
    Broken(&'static str),
}

/// What taking one frame from the guest's transmit queue gave.
pub enum Popped {
    /// `len` bytes of frame in the caller's buffer, with their offload
    /// header; `copied`: although cut-through was asked for (small, or in
    /// too many pieces).
    Frame { len: usize, vnet: VnetHdr, copied: bool },
    /// The frame is in the caller's `GuestFrame`: its head copied, the
    /// rest in place.
    InPlace,
    /// Nothing waits.
    Empty,
    /// This pass's descriptor budget is spent: the rest waits for the next.
    Later,
    /// A chain that could not be read (an address outside the guest's
    /// memory, a write-only buffer, longer than the queue): returned to the
    /// guest unread.
    Bad,
    /// A frame larger than the caller's buffer: returned unread.
    TooBig,
}

pub struct Ring<B: DirtyLog = ()> {
    pub queue: Queue,
    pub mem: Option<Arc<GuestMemory<B>>>,
    pub kick: Option<Kick>,
    pub call: Option<Notifier>,
    /// Not disabled by `SET_VRING_ENABLE 0`. Rings start enabled: QEMU
    /// (7.2) enables a net device's rings before it acknowledges features,
    /// when the `vhost` crate still refuses `SET_VRING_ENABLE`, and never
    /// again, so enabled-until-disabled is what works with real frontends.
    pub enabled: bool,
    health: Health,
    budget: Budget,
    /// Descriptors read this pass, and bad chains in a row.
    spent: u32,
    pub(crate) strikes: u16,
    /// Used entries written since the last publish.
    unpublished: u16,
    /// The used index the guest was last considered for an interrupt at.
    signalled_used: u16,
    /// Scratch: the buffers (address, length) of a chain or frame, and the
    /// receive chains (head, capacity) one frame is written into.
    pub(crate) segs: Vec<(GuestAddress, usize)>,
    frame_segs: Vec<(GuestAddress, usize)>,
    chains: Vec<(u16, usize)>,
    pub(crate) counters: Arc<Counters>,
    /// Optimistic interrupts' state (the receive queue's).
    pub irq: crate::irq::IrqState,
    /// Frames for the guest held while the ring is not running (the
    /// receive queue's); kept across a reset: that is when they wait.
    pub held: crate::held::Held,
    /// Where the descriptor table and avail ring lie in vnetd's memory
    /// (`walker`), resolved at the first walk after any change.
    layout: Option<Layout<B>>,
}

impl<B: DirtyLog> Ring<B> {
    pub fn new(counters: Arc<Counters>) -> Ring<B> {
        Ring {
            queue: Queue::new(MAX_QUEUE_SIZE).expect("a valid queue size"),
            mem: None,
            kick: None,
            call: None,
            enabled: true,
            health: Health::Ok,
            budget: Budget::default(),
            spent: 0,
            strikes: 0,
            unpublished: 0,
            signalled_used: 0,
            segs: Vec::with_capacity(MAX_BUFFERS * 4),
            frame_segs: Vec::with_capacity(MAX_BUFFERS * 4),
            chains: Vec::with_capacity(MAX_BUFFERS),
            counters,
            irq: Default::default(),
            held: Default::default(),
            layout: None,
        }
    }

    /// Back to the state before the frontend set anything up (a reset, or
    /// the connection went): a broken ring is whole again.
    pub fn reset(&mut self) {
        self.queue.reset();
        self.kick = None;
        self.call = None;
        self.enabled = true;
        self.health = Health::Ok;
        self.spent = 0;
        self.strikes = 0;
        self.unpublished = 0;
        self.irq = Default::default();
        self.layout = None;
    }

    #[cfg(test)]
    fn reset_health_for_tests(&mut self) {
        self.health = Health::Ok;
        self.strikes = 0;
    }

    /// A ring laid out by a driver in `mem` (tests and fuzzing): `size`
    /// entries, its three parts at these guest addresses, started.
    pub fn with_layout(counters: Arc<Counters>, mem: Arc<GuestMemory<B>>, size: u16, desc: u64, avail: u64, used: u64, event_idx: bool) -> Option<Ring<B>> {
        let mut r = Ring::new(counters);
        r.queue.set_size(size);
        r.queue.try_set_desc_table_address(GuestAddress(desc)).ok()?;
        r.queue.try_set_avail_ring_address(GuestAddress(avail)).ok()?;
        r.queue.try_set_used_ring_address(GuestAddress(used)).ok()?;
        r.queue.set_event_idx(event_idx);
        r.mem = Some(mem);
        r.kick = Some(Kick::new(std::fs::File::from(vnet_sys::eventfd::EventFd::new().ok()?.into_owned())).ok()?);
        r.try_start().then_some(r)
    }

    /// Descriptors read this pass (bounded by the budget plus one chain).
    pub fn spent(&self) -> u32 {
        self.spent
    }

    /// The limits in force.
    pub fn budget(&self) -> Budget {
        self.budget
    }

    /// This ring's share of a pass's descriptor budget: the device's rings
    /// of one direction share one budget (`share` of them run), so that a
    /// guest running many queue pairs causes no more work per pass than one
    /// running a pair.
    #[inline]
    pub fn share_budget(&mut self, share: u32) {
        self.budget.descs_per_pass = Budget::default().descs_per_pass / share.max(1);
    }

    pub fn health(&self) -> Health {
        self.health
    }

    /// Marks the ring broken: nothing more is read or written.
    pub fn break_ring(&mut self, why: &'static str) {
        if self.health == Health::Ok {
            self.health = Health::Broken(why);
            self.counters.broken_rings.fetch_add(1, Relaxed);
            tracing::warn!("vhost-user ring broken: {why}; left alone until the frontend resets it");
        }
    }

    /// Marked broken (a hostile or faulty driver): until the frontend
    /// resets it, frames for it are dropped, not held.
    #[inline]
    pub fn broken(&self) -> bool {
        self.health != Health::Ok
    }

    /// Ready to move frames: addresses valid in the guest's memory, a kick
    /// descriptor given, enabled, and not broken.
    #[inline]
    pub fn running(&self) -> bool {
        self.enabled && self.health == Health::Ok && self.queue.ready() && self.mem.is_some()
    }

    /// Breaks the ring if its memory faulted (its file shrank); true if it
    /// may be worked.
    #[inline]
    pub(crate) fn memory_sound(&mut self) -> bool {
        if self.mem.as_ref().is_some_and(|m| m.faulted()) {
            if self.mem.as_ref().is_some_and(|m| m.take_fault()) {
                self.counters.memory_faults.fetch_add(1, Relaxed);
            }
            self.break_ring("a fault on guest memory (its file shrank)");
            return false;
        }
        true
    }

    /// Starts the ring if everything it needs is there; the used index is
    /// taken from the guest's memory (the frontend gives only the avail
    /// index, which is all a restarted backend needs to go on).
    pub fn try_start(&mut self) -> bool {
        let Some(mem) = &self.mem else { return false };
        if self.queue.ready() || self.kick.is_none() {
            return self.queue.ready();
        }
        // `is_valid` looks only at a ready queue.
        self.queue.set_ready(true);
        let valid = self.queue.is_valid(&***mem);
        self.queue.set_ready(false);
        if !valid {
            return false;
        }
        let used: u16 = match mem.load(GuestAddress(self.queue.used_ring() + 2), Ordering::Acquire) {
            Ok(v) => u16::from_le(v),
            Err(_) => return false,
        };
        self.queue.set_next_used(used);
        self.signalled_used = used;
        self.unpublished = 0;
        self.spent = 0;
        self.queue.set_ready(true);
        true
    }

    /// Pops the next chain and reads its descriptors into `segs` (the
    /// readable ones for transmit, the writable ones for receive), within
    /// the budget. `None`: nothing waits, or the pass's budget is spent.
    #[inline]
    pub(crate) fn walk(&mut self, writable: bool) -> Option<Walk> {
        let Ring { queue, mem, layout, segs, .. } = self;
        let mem = mem.as_ref()?;
        let (size, desc, avail) = (queue.size(), queue.desc_table(), queue.avail_ring());
        if !layout.as_ref().is_some_and(|l| l.fits(mem, size, desc, avail)) {
            *layout = Layout::resolve(mem, size, desc, avail);
        }
        let walked = match layout {
            Some(l) => walker::own(queue, l, segs, writable),
            None => walker::virtio_queue(queue, mem, segs, writable),
        };
        match walked {
            Walked::Chain(w) => Some(w),
            Walked::Empty => None,
            Walked::AheadTooFar => {
                // The guest's avail index is further ahead than the queue
                // holds (nonsense, refused every time): broken, rather
                // than refused again each pass.
                self.break_ring("an avail index further ahead than the queue holds");
                None
            }
        }
    }

    /// Counts `n` descriptors read against this pass's budget.
    #[inline]
    pub(crate) fn spend(&mut self, n: u32) {
        self.spent = self.spent.saturating_add(n);
    }

    #[inline]
    pub(crate) fn budget_left(&mut self) -> bool {
        if self.spent < self.budget.descs_per_pass {
            return true;
        }
        self.counters.budget_stops.fetch_add(1, Relaxed);
        false
    }

    /// One more bad chain; the ring breaks after too many in a row.
    pub(crate) fn strike(&mut self) {
        self.strikes += 1;
        if self.strikes >= self.budget.strikes {
            self.break_ring("too many bad chains in a row");
        }
    }

    /// A chain longer than the queue: returned, and the ring is broken.
    pub(crate) fn too_long(&mut self, head: u16) {
        self.counters.long_chains.fetch_add(1, Relaxed);
        self.push_used(head, 0);
        self.break_ring("a chain longer than the queue");
    }

    /// Takes the next frame the guest queued for sending: into `out`, or,
    /// given `frame` (cut-through) and a frame longer than `MAX_HEAD`, into
    /// `frame`: its head copied, the rest left where it lies. The
    /// virtio-net header (`hdr_len` bytes) is parsed, never kept.
    pub fn pop_frame(&mut self, out: &mut [u8], hdr_len: usize, frame: Option<&mut GuestFrame>) -> Popped {
        if !self.running() || !self.memory_sound() {
            return Popped::Empty;
        }
        if !self.budget_left() {
            return Popped::Later;
        }
        let (head, n) = match self.walk(false) {
            None => return Popped::Empty,
            Some(Walk::TooLong(head, n)) => {
                self.spend(n);
                self.too_long(head);
                return Popped::Bad;
            }
            Some(Walk::WrongWay(head, n)) => {
                self.spend(n);
                self.push_used(head, 0);
                self.strike();
                return Popped::Bad;
            }
            Some(Walk::Ok(head, n)) => (head, n),
        };
        self.spend(n);
        let mem = self.mem.as_ref().expect("a running ring has memory");
        let r = Self::read_frame(mem, &self.segs, out, hdr_len, frame);
        self.push_used(head, 0);
        match r {
            Popped::Bad => self.strike(),
            _ => self.strikes = 0,
        }
        r
    }

    fn read_frame(mem: &Arc<GuestMemory<B>>, segs: &[(GuestAddress, usize)], out: &mut [u8], hdr_len: usize, frame: Option<&mut GuestFrame>) -> Popped {
        // The common case, copied: the header and the frame in one buffer,
        // its region looked up once.
        if let ([(addr, len)], None) = (segs, &frame) {
            if let (true, Ok(v)) = (*len >= hdr_len, mem.get_slice(*addr, *len)) {
                let n = len - hdr_len;
                if n > out.len() {
                    return Popped::TooBig;
                }
                let mut hdr = [0u8; 12];
                if let (Ok(h), Ok(f)) = (v.subslice(0, hdr_len), v.subslice(hdr_len, n)) {
                    h.copy_to(&mut hdr[..hdr_len]);
                    f.copy_to(&mut out[..n]);
                    let vnet = VnetHdr::parse(&hdr[..VNET_HDR_LEN]).unwrap_or_default();
                    return Popped::Frame { len: n, vnet, copied: false };
                }
            }
        }
        // The header, from the first buffer(s).
        let mut hdr = [0u8; 12];
        let mut got = 0;
        let mut at = 0; // next segment
        let mut skip = 0; // bytes of segs[at] already taken
        while got < hdr_len {
            let Some(&(addr, len)) = segs.get(at) else { return Popped::Bad };
            let n = (len - skip).min(hdr_len - got);
            if mem.read(&mut hdr[got..got + n], GuestAddress(addr.0.wrapping_add(skip as u64))).is_err() {
                return Popped::Bad;
            }
            got += n;
            skip += n;
            if skip == len {
                at += 1;
                skip = 0;
            }
        }
        let vnet = VnetHdr::parse(&hdr[..VNET_HDR_LEN]).unwrap_or_default();
        let rest = &segs[at..];
        let total = rest.iter().map(|s| s.1).sum::<usize>() - skip;
        if total > out.len() {
            return Popped::TooBig;
        }
        let in_place = frame.is_some();
        if let Some(f) = frame {
            if total > MAX_HEAD {
                if Self::gather(mem, rest, skip, f) {
                    f.vnet = vnet;
                    return Popped::InPlace;
                }
                f.release();
            }
        }
        let mut len = 0;
        for &(addr, l) in rest {
            let (a, n) = (GuestAddress(addr.0.wrapping_add(skip as u64)), l - skip);
            skip = 0;
            if mem.read(&mut out[len..len + n], a).is_err() {
                return Popped::Bad;
            }
            len += n;
        }
        Popped::Frame { len, vnet, copied: in_place }
    }

    /// Copies the head of the frame in `rest` (its first buffer starting
    /// `skip` bytes in) into `f` and notes the rest's pieces there; false if
    /// the frame cannot be gathered (too many pieces, a buffer across
    /// memory regions, an address outside).
    fn gather(mem: &Arc<GuestMemory<B>>, rest: &[(GuestAddress, usize)], mut skip: usize, f: &mut GuestFrame) -> bool {
        f.release();
        let mut i = 0;
        // Whole buffers while the head is short and the next fits it; then
        // what the head still lacks from the next. A first buffer that
        // holds the TCP headers is enough.
        while f.head.len() < MIN_HEAD && i < rest.len() {
            if i == 1 && vnet_core::offload::tcp_payload_offset(f.head.as_slice()).is_some() {
                break;
            }
            let (addr, len) = rest[i];
            let avail = len - skip;
            let take = if f.head.len() + avail <= MAX_HEAD { avail } else { MIN_HEAD - f.head.len() };
            let Some(dst) = f.head.extend(take) else { return false };
            if mem.read(dst, GuestAddress(addr.0.wrapping_add(skip as u64))).is_err() {
                return false;
            }
            if take == avail {
                i += 1;
                skip = 0;
            } else {
                skip += take;
            }
        }
        for &(addr, len) in &rest[i..] {
            let n = len - skip;
            let a = GuestAddress(addr.0.wrapping_add(skip as u64));
            skip = 0;
            if f.pieces.len() == MAX_PIECES {
                return false;
            }
            let Ok(slice) = mem.get_slice(a, n) else { return false };
            f.pieces.push((slice.ptr_guard_mut().as_ptr() as usize, n));
        }
        let mapping: Arc<dyn Send + Sync> = mem.clone();
        f.mapping = Some(mapping);
        true
    }

    /// Writes one frame (`parts` after its header) into buffers the guest
    /// posted: several if `mergeable`, else one that holds it all. The
    /// used entries wait for `publish`. `ENOBUFS` if the guest has not
    /// posted room enough (nothing is taken then, unless it posted chains
    /// with no writable byte: those go back with length 0, and so does
    /// what was taken with them).
    #[inline]
    pub fn put_frame(&mut self, vnet: &VnetHdr, parts: &[&[u8]], hdr_len: usize, mergeable: bool) -> io::Result<()> {
        if !self.running() || !self.memory_sound() {
            return Err(io::Error::from_raw_os_error(libc::ENETDOWN));
        }
        let total = hdr_len + parts.iter().map(|p| p.len()).sum::<usize>();
        let room = if mergeable { MAX_BUFFERS } else { 1 };
        self.chains.clear();
        let mut segs = std::mem::take(&mut self.frame_segs);
        segs.clear();
        let mut cap = 0usize;
        let mut empties = false;
        let mut short = false;
        while cap < total {
            if self.chains.len() >= room || !self.budget_left() {
                short = true;
                break;
            }
            match self.walk(true) {
                None => {
                    short = true;
                    break;
                }
                Some(Walk::TooLong(head, n)) => {
                    self.spend(n);
                    self.too_long(head);
                    self.return_chains();
                    self.frame_segs = segs;
                    return Err(io::Error::from_raw_os_error(libc::ENETDOWN));
                }
                Some(Walk::WrongWay(..)) => unreachable!("receive chains take both directions"),
                Some(Walk::Ok(head, n)) => {
                    self.spend(n);
                    let c: usize = self.segs.iter().map(|s| s.1).sum();
                    if c == 0 {
                        // Nothing to write into: back to the guest, empty.
                        self.push_used(head, 0);
                        self.counters.empty_rx_chains.fetch_add(1, Relaxed);
                        self.strike();
                        empties = true;
                        if !self.running() {
                            short = true;
                            break;
                        }
                        continue;
                    }
                    self.strikes = 0;
                    segs.extend_from_slice(&self.segs);
                    self.chains.push((head, c));
                    cap += c;
                }
            }
        }
        if short {
            if empties || !self.running() {
                // Chains were used up around the empty ones: they cannot be
                // put back in order, so they go back unwritten.
                self.return_chains();
            } else {
                for _ in 0..self.chains.len() {
                    self.queue.go_to_previous_position();
                }
            }
            self.frame_segs = segs;
            return Err(io::Error::from_raw_os_error(libc::ENOBUFS));
        }
        let mem = self.mem.as_deref().expect("a running ring has memory");
        let mut hdr = [0u8; 12];
        vnet.write(&mut hdr[..VNET_HDR_LEN]);
        hdr[10..12].copy_from_slice(&(self.chains.len() as u16).to_le_bytes());
        let mut seg = 0;
        let mut off = 0;
        let mut ok = true;
        // Each buffer's region looked up once, for the header and every
        // piece written into it (a slice logs its writes as any write).
        let mut slice = None;
        'copy: for src in std::iter::once(&hdr[..hdr_len]).chain(parts.iter().copied()) {
            let mut s = src;
            while !s.is_empty() {
                let (addr, len) = segs[seg];
                if off == len {
                    seg += 1;
                    off = 0;
                    slice = None;
                    continue;
                }
                let n = (len - off).min(s.len());
                let v = slice.get_or_insert_with(|| mem.get_slice(addr, len).ok());
                let wrote = match v {
                    Some(v) => v.subslice(off, n).map(|d| d.copy_from(&s[..n])).is_ok(),
                    None => mem.write(&s[..n], GuestAddress(addr.0.wrapping_add(off as u64))).is_ok(),
                };
                if !wrote {
                    ok = false;
                    break 'copy;
                }
                off += n;
                s = &s[n..];
            }
        }
        drop(slice);
        let mut left = if ok { total } else { 0 };
        for i in 0..self.chains.len() {
            let (head, c) = self.chains[i];
            let n = left.min(c);
            left -= n;
            self.push_used(head, n as u32);
        }
        self.frame_segs = segs;
        if ok {
            Ok(())
        } else {
            Err(io::Error::from_raw_os_error(libc::EFAULT))
        }
    }

    /// The receive chains taken for a frame go back unwritten.
    fn return_chains(&mut self) {
        for i in 0..self.chains.len() {
            let head = self.chains[i].0;
            self.push_used(head, 0);
        }
        self.chains.clear();
    }

    /// Writes a used entry (not yet visible to the guest).
    pub(crate) fn push_used(&mut self, head: u16, len: u32) {
        let Some(mem) = self.mem.as_deref() else { return };
        let next = self.queue.next_used();
        let at = self.queue.used_ring() + 4 + u64::from(next % self.queue.size()) * 8;
        let mut e = [0u8; 8];
        e[..4].copy_from_slice(&u32::from(head).to_le_bytes());
        e[4..].copy_from_slice(&len.to_le_bytes());
        // An address the guest made invalid fails here; the ring is the
        // guest's to break.
        let _ = mem.write(&e, GuestAddress(at));
        self.queue.set_next_used(next.wrapping_add(1));
        self.unpublished = self.unpublished.wrapping_add(1);
    }

    /// After a crash (a transmit ring, just started on the used index read
    /// back from guest memory): the chains from there up to `to` were taken
    /// by the vnetd that died (sent, or being sent: `taken`), and go back
    /// to the guest unsent, published; `to` is taken next. How many.
    /// Nothing if `to` is not between the used index and the guest's avail
    /// index (a log left by another setup of the ring, or a guest that
    /// moved its avail index back), or a head is out of the queue (the
    /// chains from that one on are taken again).
    pub fn resume_after_crash(&mut self, to: u16) -> u16 {
        let Some(mem) = self.mem.clone() else { return 0 };
        let (used, size, ring) = (self.queue.next_used(), self.queue.size(), self.queue.avail_ring());
        let Ok(avail) = mem.load::<u16>(GuestAddress(ring + 2), Ordering::Acquire) else { return 0 };
        let n = to.wrapping_sub(used);
        if n == 0 || n > size || n > u16::from_le(avail).wrapping_sub(used) {
            return 0;
        }
        let mut done = 0;
        while done < n {
            let slot = u64::from(used.wrapping_add(done) % size);
            match mem.load::<u16>(GuestAddress(ring + 4 + 2 * slot), Ordering::Acquire) {
                Ok(head) if u16::from_le(head) < size => self.push_used(u16::from_le(head), 0),
                _ => break,
            }
            done += 1;
        }
        self.queue.set_next_avail(used.wrapping_add(done));
        self.publish_used();
        done
    }

    /// Makes the used entries written so far visible to the guest; true if
    /// there were any. A new pass begins: the descriptor budget is whole
    /// again.
    pub fn publish(&mut self) -> bool {
        self.spent = 0;
        self.publish_used()
    }

    /// Used entries written and not yet visible to the guest.
    pub fn unpublished(&self) -> u16 {
        self.unpublished
    }

    /// Makes the used entries written so far visible to the guest, within
    /// a pass (its budget goes on); true if there were any.
    pub fn publish_used(&mut self) -> bool {
        if self.unpublished == 0 {
            return false;
        }
        self.unpublished = 0;
        let Some(mem) = self.mem.as_deref() else { return false };
        let idx = self.queue.next_used();
        let _ = mem.store(idx.to_le(), GuestAddress(self.queue.used_ring() + 2), Ordering::Release);
        true
    }

    /// Whether the guest asked to be interrupted for the entries published
    /// since it was last considered (event index, or the avail ring's
    /// NO_INTERRUPT flag without it).
    pub fn guest_wants_interrupt(&mut self) -> bool {
        let Some(mem) = self.mem.as_deref() else { return false };
        fence(Ordering::SeqCst);
        let new = self.queue.next_used();
        let old = std::mem::replace(&mut self.signalled_used, new);
        if new == old {
            return false;
        }
        let avail = self.queue.avail_ring();
        if self.queue.event_idx_enabled() {
            let at = GuestAddress(avail + 4 + 2 * u64::from(self.queue.size()));
            let Ok(ev) = mem.load::<u16>(at, Ordering::Acquire) else { return true };
            // vring_need_event: the guest's used_event lies in (old, new].
            new.wrapping_sub(u16::from_le(ev)).wrapping_sub(1) < new.wrapping_sub(old)
        } else {
            let Ok(flags) = mem.load::<u16>(GuestAddress(avail), Ordering::Acquire) else { return true };
            u16::from_le(flags) & VRING_AVAIL_F_NO_INTERRUPT == 0
        }
    }

    /// Whether the guest has interrupts on right now: it would want one for
    /// the next used entry (its used_event is where the ring stands, or no
    /// NO_INTERRUPT flag without event index). Off while it polls (NAPI).
    pub fn guest_armed(&self) -> bool {
        let Some(mem) = self.mem.as_deref() else { return false };
        fence(Ordering::SeqCst);
        let avail = self.queue.avail_ring();
        if self.queue.event_idx_enabled() {
            let at = GuestAddress(avail + 4 + 2 * u64::from(self.queue.size()));
            mem.load::<u16>(at, Ordering::Acquire).is_ok_and(|ev| u16::from_le(ev) == self.queue.next_used())
        } else {
            mem.load::<u16>(GuestAddress(avail), Ordering::Acquire).is_ok_and(|f| u16::from_le(f) & VRING_AVAIL_F_NO_INTERRUPT == 0)
        }
    }

    /// An early interrupt was sent: entries from here on are what the
    /// guest is next considered for.
    pub fn signalled_now(&mut self) {
        self.signalled_used = self.queue.next_used();
    }

    /// Interrupts the guest (its call eventfd); true if an interrupt is now
    /// pending for it. Never blocks: a call descriptor the frontend made
    /// blocking again breaks the ring.
    pub fn signal(&mut self) -> bool {
        let Some(call) = &self.call else { return false };
        match call.try_signal() {
            Signal::Signalled => true,
            Signal::AlreadyPending => {
                self.counters.interrupts_pending.fetch_add(1, Relaxed);
                false
            }
            Signal::Blocking => {
                self.call = None;
                self.break_ring("a call descriptor made blocking again");
                false
            }
            Signal::Failed => false,
        }
    }

    /// Whether the last interrupt is still unread by the frontend.
    pub fn signal_pending(&self) -> bool {
        self.call.as_ref().is_some_and(|c| c.pending())
    }

    /// Consumes pending kicks.
    pub fn clear_kick(&self) {
        if let Some(k) = &self.kick {
            k.clear();
        }
    }

    /// Asks the guest to kick (`on`) or not to, for new frames; with `on`,
    /// true if frames came while notifications were off (look again).
    pub fn set_kicks(&mut self, on: bool) -> bool {
        let Some(mem) = self.mem.as_deref() else { return false };
        if !self.queue.ready() || self.health != Health::Ok {
            return false;
        }
        let used = GuestAddress(self.queue.used_ring());
        if self.queue.event_idx_enabled() {
            if !on {
                return false; // a stale avail_event asks for nothing new
            }
            let at = GuestAddress(used.0 + 4 + 8 * u64::from(self.queue.size()));
            let _ = mem.store(self.queue.next_avail().to_le(), at, Ordering::Relaxed);
        } else {
            let flags: u16 = if on { 0 } else { VRING_USED_F_NO_NOTIFY };
            let _ = mem.store(flags.to_le(), used, Ordering::Relaxed);
        }
        fence(Ordering::SeqCst);
        on && self.queue.avail_idx(&**mem, Ordering::Acquire).map(|i| i.0 != self.queue.next_avail()).unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    //! The ring against a split virtqueue laid out by hand in anonymous
    //! memory, as a driver would: what the guest sees in its used ring.
    use super::*;
    use crate::frame::GuestFrame;
    type Memory = GuestMemory<()>;

    const DESC: u64 = 0x1000;
    const AVAIL: u64 = 0x2000;
    const USED: u64 = 0x3000;
    const SIZE: u16 = 64;
    const BUFS: u64 = 0x10000;

    fn ring(event_idx: bool) -> (Ring, Arc<Memory>) {
        let mem = Memory::anonymous(&[(GuestAddress(0), 1 << 20)]);
        let r = Ring::with_layout(Arc::new(Counters::default()), mem.clone(), SIZE, DESC, AVAIL, USED, event_idx).expect("a valid ring");
        assert!(r.running());
        (r, mem)
    }

    /// Descriptor `i`: `len` bytes at `addr`, `flags` (1 NEXT, 2 WRITE), `next`.
    fn desc(mem: &Memory, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let mut d = [0u8; 16];
        d[..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&flags.to_le_bytes());
        d[14..].copy_from_slice(&next.to_le_bytes());
        mem.write_slice(&d, GuestAddress(DESC + 16 * u64::from(i))).unwrap();
    }

    /// Makes chains with these heads available.
    fn offer(mem: &Memory, heads: &[u16]) {
        let idx: u16 = mem.read_obj(GuestAddress(AVAIL + 2)).unwrap();
        for (k, &h) in heads.iter().enumerate() {
            let slot = (idx as usize + k) % SIZE as usize;
            mem.write_obj(h, GuestAddress(AVAIL + 4 + 2 * slot as u64)).unwrap();
        }
        mem.write_obj(idx.wrapping_add(heads.len() as u16), GuestAddress(AVAIL + 2)).unwrap();
    }

    fn used_idx(mem: &Memory) -> u16 {
        mem.read_obj(GuestAddress(USED + 2)).unwrap()
    }

    fn used(mem: &Memory, k: u16) -> (u32, u32) {
        let at = USED + 4 + 8 * u64::from(k % SIZE);
        (mem.read_obj(GuestAddress(at)).unwrap(), mem.read_obj(GuestAddress(at + 4)).unwrap())
    }

    #[test]
    fn a_frame_spreads_over_mergeable_buffers_and_appears_at_once() {
        let (mut r, mem) = ring(true);
        for i in 0..4 {
            desc(&mem, i, BUFS + 0x1000 * u64::from(i), 1000, 2, 0);
        }
        offer(&mem, &[0, 1, 2, 3]);
        let frame: Vec<u8> = (0..2500u32).map(|i| i as u8).collect();
        let vnet = VnetHdr { flags: 1, csum_start: 34, csum_offset: 16, ..VnetHdr::default() };
        r.put_frame(&vnet, &[&frame[..100], &frame[100..]], 12, true).unwrap();
        // Nothing visible before the publish; then three buffers at once.
        assert_eq!(used_idx(&mem), 0);
        assert!(r.publish());
        assert_eq!(used_idx(&mem), 3);
        assert_eq!([used(&mem, 0), used(&mem, 1), used(&mem, 2)], [(0, 1000), (1, 1000), (2, 512)]);
        let mut got = vec![0u8; 3000];
        for i in 0..3u64 {
            mem.read_slice(&mut got[i as usize * 1000..i as usize * 1000 + 1000], GuestAddress(BUFS + 0x1000 * i)).unwrap();
        }
        assert_eq!(VnetHdr::parse(&got).unwrap(), vnet);
        assert_eq!(u16::from_le_bytes([got[10], got[11]]), 3, "num_buffers");
        assert_eq!(&got[12..2512], &frame[..]);
    }

    #[test]
    fn a_long_burst_into_the_guest_becomes_visible_every_64_frames() {
        use crate::device::{Device, PUBLISH_EVERY, RX};
        let (r, mem) = ring(true);
        assert_eq!(PUBLISH_EVERY, SIZE);
        for i in 0..SIZE {
            desc(&mem, i, BUFS + 0x100 * u64::from(i), 0x100, 2, 0);
        }
        offer(&mem, &(0..SIZE).collect::<Vec<_>>());
        let d: Device = Device::new(crate::MemoryPolicy::default()).unwrap();
        *d.ring(RX) = r;
        let frame = [7u8; 60];
        for k in 1..SIZE {
            d.send(&VnetHdr::default(), &[&frame]).unwrap();
            assert_eq!(used_idx(&mem), 0, "frame {k} visible before its stretch ended");
        }
        // The 64th frame ends a stretch: the guest sees all 64 before the
        // pass ends (no flush here), and the budget of the pass goes on.
        d.send(&VnetHdr::default(), &[&frame]).unwrap();
        assert_eq!(used_idx(&mem), SIZE);
        assert_eq!(d.counters.rx_mid_burst.load(Relaxed), 1);
        assert_eq!(used(&mem, 63), (63, 70), "the frame and a legacy 10-byte header");
        assert!(d.ring(RX).spent() > 0, "a mid-burst publish does not start a new pass");
    }

    #[test]
    fn too_little_room_takes_nothing() {
        let (mut r, mem) = ring(false);
        desc(&mem, 0, BUFS, 1000, 2, 0);
        offer(&mem, &[0]);
        let e = r.put_frame(&VnetHdr::default(), &[&[0u8; 1500]], 12, true).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOBUFS));
        assert!(!r.publish());
        // The buffer is still the guest's to fill: a small frame takes it.
        r.put_frame(&VnetHdr::default(), &[&[7u8; 60]], 12, true).unwrap();
        assert!(r.publish());
        assert_eq!(used(&mem, 0), (0, 72));
        // Without mergeable buffers one buffer must hold the whole frame.
        desc(&mem, 1, BUFS, 40, 2, 0);
        desc(&mem, 2, BUFS + 0x1000, 40, 2, 0);
        offer(&mem, &[1, 2]);
        assert!(r.put_frame(&VnetHdr::default(), &[&[0u8; 60]], 12, false).is_err());
    }

    #[test]
    fn a_frame_in_one_buffer_has_its_head_copied_and_the_rest_in_place() {
        let (mut r, mem) = ring(false);
        let mut hdr = [0u8; 12];
        VnetHdr { flags: 1, ..VnetHdr::default() }.write(&mut hdr);
        mem.write_slice(&hdr, GuestAddress(BUFS)).unwrap();
        let frame: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
        mem.write_slice(&frame, GuestAddress(BUFS + 12)).unwrap();
        // Header and frame in one buffer.
        desc(&mem, 0, BUFS, 1012, 0, 0);
        // A small frame (no longer than MAX_HEAD) in two buffers: copied.
        desc(&mem, 1, BUFS, 12, 1, 2);
        desc(&mem, 2, BUFS + 12, 30, 1, 3);
        desc(&mem, 3, BUFS + 42, 30, 0, 0);
        offer(&mem, &[0, 1]);
        let mut out = [0u8; 2048];
        let mut f = GuestFrame::default();
        assert!(matches!(r.pop_frame(&mut out, 12, Some(&mut f)), Popped::InPlace));
        assert_eq!(f.vnet.flags, 1);
        assert_eq!(f.head_len(), MIN_HEAD);
        let host = mem.get_slice(GuestAddress(BUFS + 12 + MIN_HEAD as u64), 1).unwrap().ptr_guard_mut().as_ptr() as usize;
        assert_eq!(f.pieces, [(host, 1000 - MIN_HEAD)]);
        // The guest rewrites its buffer: the head vnetd routes on stays.
        mem.write_slice(&[0xff; 64], GuestAddress(BUFS + 12)).unwrap();
        let mut rest = [&[][..]; MAX_PIECES];
        let (head, k) = f.parts(&mut rest);
        assert_eq!(head, &frame[..MIN_HEAD]);
        assert_eq!((k, rest[0]), (1, &frame[MIN_HEAD..]));
        f.release();
        match r.pop_frame(&mut out, 12, Some(&mut f)) {
            Popped::Frame { len: 60, copied: true, .. } => assert_eq!(out[..60], [0xff; 60]),
            _ => panic!("not copied"),
        }
        assert!(matches!(r.pop_frame(&mut out, 12, Some(&mut f)), Popped::Empty));
        assert!(r.publish());
        assert_eq!((used_idx(&mem), used(&mem, 0), used(&mem, 1)), (2, (0, 0), (1, 0)));
    }

    #[test]
    fn a_frame_in_several_buffers_is_gathered_with_its_headers_copied() {
        let (mut r, mem) = ring(false);
        for tcp in [true, false] {
            let mut frame: Vec<u8> = (0..3066u32).map(|i| (i % 251) as u8).collect();
            if tcp {
                // Ethernet, IPv4 (20 bytes), TCP with options (32 bytes): 66.
                frame[12..14].copy_from_slice(&[0x08, 0x00]);
                frame[14] = 0x45;
                frame[23] = 6;
                frame[46] = 8 << 4;
            }
            // As Linux sends TSO: the virtio header and the 66 bytes of
            // headers in one buffer, then the payload in pages.
            let mut first = [0u8; 78];
            VnetHdr { gso_type: 1, gso_size: 1448, ..VnetHdr::default() }.write(&mut first);
            first[12..].copy_from_slice(&frame[..66]);
            mem.write_slice(&first, GuestAddress(BUFS)).unwrap();
            for (i, chunk) in frame[66..].chunks(1000).enumerate() {
                mem.write_slice(chunk, GuestAddress(BUFS + 0x1000 * (i as u64 + 1))).unwrap();
            }
            desc(&mem, 0, BUFS, 78, 1, 1);
            desc(&mem, 1, BUFS + 0x1000, 1000, 1, 2);
            desc(&mem, 2, BUFS + 0x2000, 1000, 1, 3);
            desc(&mem, 3, BUFS + 0x3000, 1000, 0, 0);
            offer(&mem, &[0]);
            let mut out = [0u8; 4096];
            let mut f = GuestFrame::default();
            let Popped::InPlace = r.pop_frame(&mut out, 12, Some(&mut f)) else { panic!("not gathered") };
            assert_eq!(f.vnet.gso_size, 1448);
            let head = f.head_len();
            let pieces = f.pieces.clone();
            let mut rest = [&[][..]; MAX_PIECES];
            let (h, k) = f.parts(&mut rest);
            let mut got = h.to_vec();
            for p in &rest[..k] {
                got.extend_from_slice(p);
            }
            assert_eq!(got, frame);
            assert_eq!(k, 3);
            let first_piece = |skip: u64| mem.get_slice(GuestAddress(BUFS + 0x1000 + skip), 1).unwrap().ptr_guard_mut().as_ptr() as usize;
            if tcp {
                // The first buffer holds the headers: it alone is copied.
                assert_eq!(head, 66);
                assert_eq!(pieces[0], (first_piece(0), 1000));
            } else {
                // Headers unknown: the head takes MIN_HEAD bytes, its last
                // 62 from the second buffer; the pieces start after them.
                assert_eq!(head, MIN_HEAD);
                assert_eq!(pieces[0], (first_piece(62), 938));
            }
        }
    }

    #[test]
    fn a_frame_in_more_pieces_than_an_iovec_takes_is_copied() {
        let (mut r, mem) = ring(false);
        let mut hdr = [0u8; 12];
        VnetHdr::default().write(&mut hdr);
        mem.write_slice(&hdr, GuestAddress(BUFS)).unwrap();
        let n = MAX_PIECES as u16 + 3;
        desc(&mem, 0, BUFS, 12, 1, 1);
        for i in 1..=n {
            mem.write_slice(&[i as u8; 100], GuestAddress(BUFS + 0x100 * u64::from(i))).unwrap();
            desc(&mem, i, BUFS + 0x100 * u64::from(i), 100, if i < n { 1 } else { 0 }, i + 1);
        }
        offer(&mem, &[0]);
        let mut out = vec![0u8; 8192];
        let Popped::Frame { len, copied: true, .. } = r.pop_frame(&mut out, 12, Some(&mut GuestFrame::default())) else { panic!("not copied") };
        assert_eq!(len, 100 * usize::from(n));
        assert!(out[..len].chunks(100).enumerate().all(|(i, c)| c.iter().all(|&b| b == i as u8 + 1)));
    }

    #[test]
    fn broken_chains_are_returned_unread() {
        let (mut r, mem) = ring(false);
        desc(&mem, 0, BUFS, 72, 2, 0); // write-only on the transmit queue
        desc(&mem, 1, 1 << 40, 72, 0, 0); // outside guest memory
        desc(&mem, 2, BUFS, 8, 0, 0); // shorter than the header
        desc(&mem, 3, BUFS, 200, 0, 0); // larger than the caller's buffer
        offer(&mem, &[0, 1, 2, 3]);
        let mut out = [0u8; 100];
        for want in ["bad", "bad", "bad", "big"] {
            let got = match r.pop_frame(&mut out, 12, None) {
                Popped::Bad => "bad",
                Popped::TooBig => "big",
                _ => "other",
            };
            assert_eq!(got, want);
        }
        assert!(r.publish());
        assert_eq!(used_idx(&mem), 4, "every chain goes back to the guest");
    }

    #[test]
    fn interrupts_follow_the_guests_event_index() {
        let (mut r, mem) = ring(true);
        for i in 0..4 {
            desc(&mem, i, BUFS + 0x1000 * u64::from(i), 1000, 2, 0);
        }
        offer(&mem, &[0, 1, 2, 3]);
        let used_event = GuestAddress(AVAIL + 4 + 2 * u64::from(SIZE));
        // The guest wants an interrupt once entry 0 is used: armed.
        mem.write_obj(0u16, used_event).unwrap();
        assert!(r.guest_armed());
        r.put_frame(&VnetHdr::default(), &[&[1u8; 60]], 12, true).unwrap();
        r.publish();
        assert!(r.guest_wants_interrupt());
        // It is polling (used_event left behind): no interrupt, not armed.
        r.put_frame(&VnetHdr::default(), &[&[1u8; 60]], 12, true).unwrap();
        r.publish();
        assert!(!r.guest_wants_interrupt() && !r.guest_armed());
        // It re-armed at entry 2 before we published it.
        mem.write_obj(2u16, used_event).unwrap();
        assert!(r.guest_armed());
        r.put_frame(&VnetHdr::default(), &[&[1u8; 60]], 12, true).unwrap();
        r.publish();
        assert!(r.guest_wants_interrupt());
    }

    /// A small deterministic generator (xorshift), so the test is the same
    /// every run.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    #[test]
    fn random_rings_never_panic_nor_write_outside_posted_buffers() {
        // Rings below 0x4000, buffers in [0x10000, 0x30000); everything else
        // holds a sentinel that must survive whatever the descriptors say.
        const AREA: (u64, u64) = (0x10000, 0x30000);
        let (mut tx, mem) = ring(false);
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let sentinel = vec![0xa5u8; (1 << 20) - AREA.1 as usize];
        mem.write_slice(&sentinel, GuestAddress(AREA.1)).unwrap();
        mem.write_slice(&[0xa5u8; 0xc000], GuestAddress(0x4000)).unwrap();
        let mut out = vec![0u8; 65536];
        let payload = vec![0x5au8; 9000];
        let mut gathered = 0;
        let mut f = GuestFrame::default();
        for round in 0..3000 {
            for i in 0..SIZE {
                let (addr, len) = if rng.below(8) == 0 {
                    (rng.next() | (1 << 40), rng.below(5000) as u32) // outside memory
                } else {
                    let a = AREA.0 + rng.below(AREA.1 - AREA.0);
                    (a, rng.below((AREA.1 - a).min(5000)) as u32) // inside the buffer area
                };
                let flags = (rng.below(4) as u16) & (1 | 2); // NEXT, WRITE; never INDIRECT
                desc(&mem, i, addr, len, flags, rng.below(u64::from(SIZE) + 4) as u16);
            }
            tx.reset_health_for_tests();
            let heads: Vec<u16> = (0..rng.below(20)).map(|_| rng.below(u64::from(SIZE) + 4) as u16).collect();
            offer(&mem, &heads);
            for _ in 0..heads.len() + 1 {
                let fr = if round % 2 == 0 { Some(&mut f) } else { None };
                if let Popped::InPlace = tx.pop_frame(&mut out, 12, fr) {
                    // Gathered pieces lie inside the buffer area the
                    // descriptors point into, past a head of whole headers.
                    assert!(f.head_len() <= MAX_HEAD && f.head_len() > 0);
                    assert!(!f.pieces.is_empty() && f.pieces.len() <= MAX_PIECES);
                    let area = mem.get_slice(GuestAddress(AREA.0), (AREA.1 - AREA.0) as usize).unwrap().ptr_guard_mut().as_ptr() as usize;
                    for &(a, l) in &f.pieces {
                        assert!(l > 0 && a >= area && a + l <= area + (AREA.1 - AREA.0) as usize, "a piece outside the buffers");
                    }
                    gathered += 1;
                }
            }
            let n = rng.below(9000) as usize;
            let vnet = VnetHdr::default();
            let _ = tx.put_frame(&vnet, &[&payload[..n / 2], &payload[n / 2..n]], 12, round % 3 != 0);
            tx.publish();
            let _ = tx.guest_wants_interrupt();
        }
        assert!(gathered > 50, "only {gathered} frames gathered: the test hardly tried");
        let mut after = vec![0u8; sentinel.len()];
        mem.read_slice(&mut after, GuestAddress(AREA.1)).unwrap();
        assert!(after == sentinel, "a write landed past the buffer area");
        let mut gap = [0u8; 0xc000];
        mem.read_slice(&mut gap, GuestAddress(0x4000)).unwrap();
        assert!(gap.iter().all(|&b| b == 0xa5), "a write landed between the rings and the buffers");
    }

    #[test]
    fn an_indirect_table_longer_than_the_queue_breaks_the_ring() {
        let (mut r, mem) = ring(false);
        desc(&mem, 0, BUFS, 16 * (u32::from(SIZE) + 1), 4, 0); // INDIRECT, SIZE + 1 entries
        desc(&mem, 1, BUFS, 72, 0, 0);
        offer(&mem, &[0, 1]);
        let mut out = [0u8; 2048];
        assert!(matches!(r.pop_frame(&mut out, 12, None), Popped::Bad));
        assert_eq!(r.health(), Health::Broken("a chain longer than the queue"));
        assert!(matches!(r.pop_frame(&mut out, 12, None), Popped::Empty), "a broken ring is left alone");
        assert!(r.publish());
        assert_eq!((used_idx(&mem), used(&mem, 0)), (1, (0, 0)), "the bad chain went back");
        assert_eq!((r.counters.long_chains.load(Relaxed), r.counters.broken_rings.load(Relaxed)), (1, 1));
        // The frontend resets the ring: it is whole again.
        r.reset();
        assert_eq!(r.health(), Health::Ok);
    }

    #[test]
    fn receive_chains_with_no_writable_byte_go_back_empty_and_too_many_break_the_ring() {
        let (mut r, mem) = ring(false);
        for i in 0..4 {
            desc(&mem, i, BUFS, 0, 2, 0); // writable, but zero bytes
        }
        desc(&mem, 4, BUFS + 0x1000, 2000, 2, 0);
        offer(&mem, &[0, 1, 2, 3, 4]);
        r.put_frame(&VnetHdr::default(), &[&[3u8; 100]], 12, true).unwrap();
        assert!(r.publish());
        assert_eq!(used_idx(&mem), 5);
        assert_eq!([used(&mem, 0), used(&mem, 3), used(&mem, 4)], [(0, 0), (3, 0), (4, 112)]);
        assert_eq!(r.counters.empty_rx_chains.load(Relaxed), 4);
        // A guest that posts nothing but such chains: the ring breaks after
        // `strikes` of them in a row, each returned, none walked twice.
        for i in 0..SIZE {
            desc(&mem, i, BUFS, 0, 0, 0); // read-only: nothing to write into
        }
        offer(&mem, &(0..SIZE).collect::<Vec<_>>());
        for _ in 0..3 {
            assert!(r.put_frame(&VnetHdr::default(), &[&[3u8; 100]], 12, true).is_err());
        }
        assert_eq!(r.health(), Health::Broken("too many bad chains in a row"));
        assert_eq!(r.counters.empty_rx_chains.load(Relaxed), 4 + u64::from(Budget::default().strikes));
        assert!(r.publish());
        assert_eq!(used_idx(&mem), 5 + Budget::default().strikes);
    }

    #[test]
    fn an_avail_index_further_ahead_than_the_queue_breaks_the_ring() {
        let (mut r, mem) = ring(false);
        mem.write_obj(SIZE + 1, GuestAddress(AVAIL + 2)).unwrap();
        let mut out = [0u8; 128];
        assert!(matches!(r.pop_frame(&mut out, 12, None), Popped::Empty));
        assert_eq!(r.health(), Health::Broken("an avail index further ahead than the queue holds"));
        assert_eq!(r.counters.broken_rings.load(Relaxed), 1);
    }

    #[test]
    fn a_pass_reads_no_more_descriptors_than_its_budget() {
        let (mut r, mem) = ring(false);
        r.budget.descs_per_pass = 10;
        for i in 0..20 {
            desc(&mem, i, BUFS, 72, 0, 0);
        }
        offer(&mem, &(0..20).collect::<Vec<_>>());
        let mut out = [0u8; 2048];
        let mut n = 0;
        while let Popped::Frame { .. } = r.pop_frame(&mut out, 12, None) {
            n += 1;
        }
        assert_eq!(n, 10);
        assert!(matches!(r.pop_frame(&mut out, 12, None), Popped::Later));
        assert_eq!(r.counters.budget_stops.load(Relaxed), 2);
        // The next pass goes on where this one stopped.
        r.publish();
        while let Popped::Frame { .. } = r.pop_frame(&mut out, 12, None) {
            n += 1;
        }
        assert_eq!(n, 20);
    }

    /// The own walker (`walker`) against rust-vmm's `virtio-queue` on
    /// 20,000 random rings: chains of random descriptors (any flags, next
    /// indexes in and past the table, indirect tables of good and bad
    /// lengths, inside and past guest memory), random heads and avail
    /// indexes. Each pop gives the same verdict (a chain, too long, wrong
    /// way), head, descriptor count and buffers, both ways (transmit and
    /// receive), and the same ring state after. Catches: any rule of the
    /// chain walk the own walker has otherwise (a chain cut short or let
    /// run on, an indirect table taken that virtio-queue refuses, the
    /// count the budget spends off by one).
    #[test]
    fn the_own_walker_reads_every_chain_as_virtio_queue_does() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let (mut chains, mut long, mut wrong) = (0, 0, 0);
        for trial in 0..20_000u32 {
            let size = 1u16 << (1 + rnd(6)); // 2 .. 64
            let writable = trial % 2 == 1;
            let mem = Memory::anonymous(&[(GuestAddress(0), 1 << 20)]);
            let table = |rnd: &mut dyn FnMut(u64) -> u64, base: u64, n: u64| {
                for i in 0..n {
                    let flags = (rnd(8) as u16) & if rnd(4) == 0 { 7 } else { 3 };
                    let next = if rnd(8) == 0 { rnd(200) as u16 } else { rnd(u64::from(size)) as u16 };
                    let (addr, len) = match rnd(6) {
                        0 => (0x80000 + 0x1000 * rnd(8), 16 * rnd(2 * u64::from(size) + 2) as u32),
                        1 => (0x80000 + 0x1000 * rnd(8), rnd(100) as u32),
                        2 => ((1 << 20) - 16 * rnd(4), 16 * (1 + rnd(8)) as u32), // across memory's end
                        3 => (rnd(1 << 21), u32::MAX - rnd(4) as u32),
                        _ => (BUFS + rnd(0x10000), rnd(2000) as u32),
                    };
                    let mut d = [0u8; 16];
                    d[..8].copy_from_slice(&addr.to_le_bytes());
                    d[8..12].copy_from_slice(&len.to_le_bytes());
                    d[12..14].copy_from_slice(&flags.to_le_bytes());
                    d[14..].copy_from_slice(&next.to_le_bytes());
                    mem.write_slice(&d, GuestAddress(base + 16 * i)).unwrap();
                }
            };
            table(&mut rnd, DESC, u64::from(size));
            for t in 0..8 {
                let n = 1 + rnd(2 * u64::from(size) + 2);
                table(&mut rnd, 0x80000 + 0x1000 * t, n);
            }
            let pending = if rnd(20) == 0 { u16::from(size) + 1 + rnd(10) as u16 } else { rnd(u64::from(size) + 1) as u16 };
            for k in 0..u64::from(size) {
                let head = if rnd(10) == 0 { rnd(300) as u16 } else { rnd(u64::from(size)) as u16 };
                mem.write_obj(head, GuestAddress(AVAIL + 4 + 2 * k)).unwrap();
            }
            mem.write_obj(pending, GuestAddress(AVAIL + 2)).unwrap();
            let counters = Arc::new(Counters::default());
            let mut own = Ring::with_layout(counters.clone(), mem.clone(), size, DESC, AVAIL, USED, false).unwrap();
            let mut theirs = Ring::with_layout(counters, mem.clone(), size, DESC, AVAIL, USED, false).unwrap();
            for _ in 0..=size {
                let a = own.walk(writable);
                assert!(own.layout.is_some(), "a ring inside one region has a layout");
                let b = match walker::virtio_queue(&mut theirs.queue, theirs.mem.as_ref().unwrap(), &mut theirs.segs, writable) {
                    Walked::Chain(w) => Some(w),
                    Walked::Empty => None,
                    Walked::AheadTooFar => {
                        theirs.break_ring("an avail index further ahead than the queue holds");
                        None
                    }
                };
                let head_past = matches!(b, Some(Walk::TooLong(h, 1)) if h >= size);
                if !head_past {
                    assert_eq!(a, b, "trial {trial}: size {size}, writable {writable}");
                    assert_eq!(own.segs, theirs.segs, "trial {trial}");
                }
                assert_eq!((own.queue.next_avail(), own.health()), (theirs.queue.next_avail(), theirs.health()), "trial {trial}");
                match a {
                    None => break,
                    Some(Walk::Ok(..)) => chains += 1,
                    Some(Walk::TooLong(..)) => long += 1,
                    Some(Walk::WrongWay(..)) => wrong += 1,
                }
            }
        }
        // The rings made reach every verdict often.
        assert!(chains > 20_000 && long > 500 && wrong > 5_000, "{chains} chains, {long} too long, {wrong} the wrong way");
    }
}
