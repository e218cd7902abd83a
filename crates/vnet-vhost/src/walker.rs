//! The rings' own chain walker: a split virtqueue's avail ring and
//! descriptor table read through host pointers resolved once per ring
//! setup (`Layout`, each area inside one region of guest memory), so that
//! a chain costs no region lookup: only the buffers it names are looked up
//! (by whoever reads or writes them). rust-vmm's `virtio-queue` walks the
//! same chains with a lookup per read (the avail index, the ring entry and
//! each descriptor: three or more per frame), and it stays the walker for
//! a ring whose areas cross a region (`queue::Ring::walk`'s fallback).
//!
//! Every descriptor is read once, into a copy, and decided on from that
//! copy (the guest may rewrite the table meanwhile). The rules are
//! `virtio-queue`'s, which the unit tests hold this walker to chain by
//! chain on random rings: a chain ends at a descriptor without `NEXT`, at
//! an index past its table, after as many descriptors as its table holds,
//! at an indirect descriptor inside an indirect table or one whose table is
//! not a whole number of descriptors, or past 4 GiB of buffers; an indirect
//! table whose length says more descriptors than the queue holds is a chain
//! too long (`Step::TooLong`), as is any chain that reads more.

use crate::memory::{DirtyLog, GuestMemory};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddress, GuestMemoryBackend};

const VRING_DESC_F_NEXT: u16 = 1;
const VRING_DESC_F_WRITE: u16 = 2;
const VRING_DESC_F_INDIRECT: u16 = 4;

/// Where a ring's descriptor table and avail ring lie in vnetd's memory,
/// for the guest memory (`mem`, kept mapped by the layout itself) and
/// addresses it was resolved for.
pub(crate) struct Layout<B: DirtyLog> {
    mem: Arc<GuestMemory<B>>,
    size: u16,
    desc_gpa: u64,
    avail_gpa: u64,
    desc: *const u8,
    avail: *const u8,
}

// SAFETY: the pointers are into the mapping `mem` keeps alive.
unsafe impl<B: DirtyLog> Send for Layout<B> {}

/// One descriptor, as read (a copy: the guest's may change after).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Desc {
    pub addr: u64,
    pub len: u32,
    pub flags: u16,
    pub next: u16,
}

impl Desc {
    fn parse(b: [u8; 16]) -> Desc {
        Desc {
            addr: u64::from_le_bytes(b[..8].try_into().unwrap()),
            len: u32::from_le_bytes(b[8..12].try_into().unwrap()),
            flags: u16::from_le_bytes([b[12], b[13]]),
            next: u16::from_le_bytes([b[14], b[15]]),
        }
    }

    pub fn write_only(&self) -> bool {
        self.flags & VRING_DESC_F_WRITE != 0
    }
}

/// Reads 16 bytes from guest memory vnetd mapped, as one volatile copy.
///
/// SAFETY: `p` points at 16 mapped bytes.
#[inline]
unsafe fn read16(p: *const u8) -> [u8; 16] {
    std::ptr::read_volatile(p.cast::<[u8; 16]>())
}

/// One load of a 16-bit word the guest may be writing (its avail index):
/// atomic, never torn (two byte loads could see half an update, an index
/// far ahead of the ring).
///
/// SAFETY: `p` points at 2 mapped bytes, 2-aligned (`Layout::resolve`).
#[inline]
unsafe fn read_u16(p: *const u8) -> u16 {
    u16::from_le(std::sync::atomic::AtomicU16::from_ptr(p.cast_mut().cast::<u16>()).load(Ordering::Acquire))
}

/// Host pointer to `len` bytes at `at`, if they lie in one region.
fn host<B: DirtyLog>(mem: &GuestMemory<B>, at: u64, len: usize) -> Option<*const u8> {
    let s = mem.get_slice(GuestAddress(at), len).ok()?;
    Some(s.ptr_guard().as_ptr() as *const u8)
}

/// What one step of a walk found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// A buffer of the chain.
    Buf(Desc),
    /// The chain ended.
    End,
    /// More descriptors than the queue holds (an indirect table that says
    /// so, or a chain read that far).
    TooLong,
}

impl<B: DirtyLog> Layout<B> {
    /// Resolves a ring of `size` entries at these addresses; None if an
    /// area is not inside one region (then `virtio-queue` walks it).
    pub fn resolve(mem: &Arc<GuestMemory<B>>, size: u16, desc_gpa: u64, avail_gpa: u64) -> Option<Layout<B>> {
        let n = usize::from(size);
        // flags, idx, ring[size], used_event
        let avail = host(mem, avail_gpa, 6 + 2 * n)?;
        // Read by 16-bit atomic loads: 2-aligned where vnetd maps it (as
        // virtio requires of the guest address, which `try_start` checks),
        // or not walked here.
        if avail as usize % 2 != 0 {
            return None;
        }
        Some(Layout { mem: mem.clone(), size, desc_gpa, avail_gpa, desc: host(mem, desc_gpa, 16 * n)?, avail })
    }

    /// Whether this layout is the one for that memory and these addresses.
    #[inline]
    pub fn fits(&self, mem: &Arc<GuestMemory<B>>, size: u16, desc_gpa: u64, avail_gpa: u64) -> bool {
        Arc::ptr_eq(&self.mem, mem) && self.size == size && self.desc_gpa == desc_gpa && self.avail_gpa == avail_gpa
    }

    /// The guest's avail index (read with acquire: the entries before it
    /// are then visible).
    #[inline]
    pub fn avail_idx(&self) -> u16 {
        // SAFETY: inside the avail area resolved, 2-aligned.
        unsafe { read_u16(self.avail.add(2)) }
    }

    /// The head the guest put at avail position `pos`.
    #[inline]
    pub fn head_at(&self, pos: u16) -> u16 {
        let slot = usize::from(pos % self.size);
        // SAFETY: slot < size, inside the avail area, 2-aligned.
        unsafe { read_u16(self.avail.add(4 + 2 * slot)) }
    }

    /// A walk of the chain whose head is `head`.
    #[inline]
    pub fn chain(&self, head: u16) -> Chain<'_, B> {
        Chain { layout: self, indirect: None, table_len: self.size, next: head, ttl: self.size, bytes: 0, n: 0, first: true, done: false }
    }
}

/// An indirect table: mapped whole (inside one region), or read one
/// descriptor at a time through guest memory (across regions, or past
/// the memory's end: the descriptors inside are read, as virtio-queue
/// reads them).
#[derive(Clone, Copy)]
enum Table {
    Mapped(*const u8),
    Guest(u64),
}

/// A chain being walked, descriptor by descriptor.
pub(crate) struct Chain<'a, B: DirtyLog> {
    layout: &'a Layout<B>,
    /// The indirect table the chain went on in.
    indirect: Option<Table>,
    table_len: u16,
    next: u16,
    ttl: u16,
    bytes: u32,
    /// Descriptors given (`Step::Buf`), or 1 for a head that is an
    /// indirect table longer than the queue.
    pub n: u32,
    first: bool,
    done: bool,
}

impl<B: DirtyLog> Chain<'_, B> {
    #[inline]
    pub fn step(&mut self) -> Step {
        loop {
            if self.done || self.ttl == 0 || self.next >= self.table_len {
                self.done = true;
                return Step::End;
            }
            let i = usize::from(self.next);
            let raw = match self.indirect {
                // SAFETY: i < the table's length, inside the area resolved
                // (the descriptor table, or an indirect table mapped whole).
                None => unsafe { read16(self.layout.desc.add(16 * i)) },
                Some(Table::Mapped(p)) => unsafe { read16(p.add(16 * i)) },
                Some(Table::Guest(at)) => {
                    let mut b = [0u8; 16];
                    if at.checked_add(16 * i as u64).is_none_or(|a| self.layout.mem.read(&mut b, GuestAddress(a)).is_err()) {
                        self.done = true;
                        return Step::End;
                    }
                    b
                }
            };
            let d = Desc::parse(raw);
            let first = std::mem::take(&mut self.first);
            if d.flags & VRING_DESC_F_INDIRECT != 0 {
                // A head that is a table longer than the queue is refused
                // before anything is read from it.
                if first && d.len / 16 > u32::from(self.layout.size) {
                    self.done = true;
                    self.n = 1;
                    return Step::TooLong;
                }
                if self.indirect.is_some() || d.len % 16 != 0 || d.len / 16 > u32::from(u16::MAX) {
                    self.done = true;
                    return Step::End;
                }
                let t = match host(&self.layout.mem, d.addr, d.len as usize) {
                    Some(p) if d.len > 0 => Table::Mapped(p),
                    _ => Table::Guest(d.addr),
                };
                self.indirect = Some(t);
                self.table_len = (d.len / 16) as u16;
                self.ttl = self.table_len;
                self.next = 0;
                continue;
            }
            let Some(b) = self.bytes.checked_add(d.len) else {
                self.done = true;
                return Step::End;
            };
            self.bytes = b;
            self.n += 1;
            if self.n > u32::from(self.layout.size) {
                self.done = true;
                return Step::TooLong;
            }
            if d.flags & VRING_DESC_F_NEXT != 0 {
                self.next = d.next;
                self.ttl -= 1;
            } else {
                self.done = true;
            }
            return Step::Buf(d);
        }
    }
}

/// One chain, read.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Walk {
    /// Its head and how many descriptors it had.
    Ok(u16, u32),
    /// Longer than the queue.
    TooLong(u16, u32),
    /// A descriptor of the wrong direction (transmit: write-only).
    WrongWay(u16, u32),
}

/// What a walk of the next chain the guest made available found.
pub(crate) enum Walked {
    Chain(Walk),
    /// Nothing waits.
    Empty,
    /// The guest's avail index is further ahead than the queue holds.
    AheadTooFar,
}

/// Pops the next chain through the ring's `Layout` and puts its buffers
/// of the direction asked for (`writable`: the guest's receive buffers) in
/// `segs`: no region lookup for the ring itself.
#[inline]
pub(crate) fn own<B: DirtyLog>(queue: &mut Queue, l: &Layout<B>, segs: &mut Vec<(GuestAddress, usize)>, writable: bool) -> Walked {
    let next = queue.next_avail();
    let ahead = l.avail_idx().wrapping_sub(next);
    if ahead == 0 {
        return Walked::Empty;
    }
    if ahead > queue.size() {
        return Walked::AheadTooFar;
    }
    let head = l.head_at(next);
    queue.set_next_avail(next.wrapping_add(1));
    segs.clear();
    let mut chain = l.chain(head);
    loop {
        match chain.step() {
            Step::End => return Walked::Chain(Walk::Ok(head, chain.n)),
            Step::TooLong => return Walked::Chain(Walk::TooLong(head, chain.n)),
            Step::Buf(d) => {
                if d.write_only() != writable {
                    if !writable {
                        return Walked::Chain(Walk::WrongWay(head, chain.n));
                    }
                    continue; // receive: device-readable buffers before the writable ones
                }
                if d.len > 0 {
                    segs.push((GuestAddress(d.addr), d.len as usize));
                }
            }
        }
    }
}

/// `own`, by rust-vmm's `virtio-queue`: for a ring with an area across
/// regions, and the reference the own walker is tested against.
pub(crate) fn virtio_queue<B: DirtyLog>(queue: &mut Queue, mem: &Arc<GuestMemory<B>>, segs: &mut Vec<(GuestAddress, usize)>, writable: bool) -> Walked {
    let size = queue.size();
    let Some(chain) = queue.pop_descriptor_chain(&***mem) else {
        // Nothing waits, or the avail index is nonsense, which virtio-queue
        // refuses.
        let ahead = queue.avail_idx(&***mem, Ordering::Acquire).map(|i| i.0.wrapping_sub(queue.next_avail()));
        return if ahead.is_ok_and(|n| n > size) { Walked::AheadTooFar } else { Walked::Empty };
    };
    let head = chain.head_index();
    segs.clear();
    // An indirect table longer than the queue is refused before it is
    // walked (a chain continued into one is cut by the count below).
    let mut d = [0u8; 16];
    if mem.read(&mut d, GuestAddress(queue.desc_table().wrapping_add(16 * u64::from(head)))).is_ok() {
        let (len, flags) = (u32::from_le_bytes([d[8], d[9], d[10], d[11]]), u16::from_le_bytes([d[12], d[13]]));
        if flags & VRING_DESC_F_INDIRECT != 0 && len / 16 > u32::from(size) {
            return Walked::Chain(Walk::TooLong(head, 1));
        }
    }
    let mut n = 0u32;
    for d in chain {
        n += 1;
        if n > u32::from(size) {
            return Walked::Chain(Walk::TooLong(head, n));
        }
        if d.is_write_only() != writable {
            if !writable {
                return Walked::Chain(Walk::WrongWay(head, n));
            }
            continue;
        }
        if d.len() > 0 {
            segs.push((d.addr(), d.len() as usize));
        }
    }
    Walked::Chain(Walk::Ok(head, n))
}
