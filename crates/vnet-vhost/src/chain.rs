//! Chains for a device that reads and writes its buffers itself (the vsock
//! device): taken whole with the ring's budget and strikes, as frames are,
//! and given back with the bytes written.

use crate::memory::DirtyLog;
use crate::queue::Ring;
use crate::walker::Walk;
use std::sync::atomic::Ordering::Relaxed;
use virtio_queue::QueueT;
use vm_memory::GuestAddress;

/// What `Ring::pop_chain` gave.
pub enum Chained {
    /// A chain (its head), its buffers in the caller's list.
    Chain(u16),
    Empty,
    /// This pass's descriptor budget is spent.
    Later,
    /// A chain that could not be used (returned; the ring may be broken).
    Bad,
}

impl<B: DirtyLog> Ring<B> {
    /// Takes the next chain for a device that reads or writes its buffers
    /// itself (vsock): its head, its buffers of the direction asked for
    /// (`writable`: receive) in `segs`. A chain holding fewer than `min`
    /// bytes that way goes back unused and counts against the ring, as a
    /// bad frame does.
    pub fn pop_chain(&mut self, writable: bool, min: usize, segs: &mut Vec<(GuestAddress, usize)>) -> Chained {
        if !self.running() || !self.memory_sound() {
            return Chained::Empty;
        }
        if !self.budget_left() {
            return Chained::Later;
        }
        let (head, n) = match self.walk(writable) {
            None => return Chained::Empty,
            Some(Walk::TooLong(head, n)) => {
                self.spend(n);
                self.too_long(head);
                return Chained::Bad;
            }
            Some(Walk::WrongWay(head, n)) => {
                self.spend(n);
                self.push_used(head, 0);
                self.counters.bad_chains.fetch_add(1, Relaxed);
                self.strike();
                return Chained::Bad;
            }
            Some(Walk::Ok(head, n)) => (head, n),
        };
        self.spend(n);
        if self.segs.iter().map(|s| s.1).sum::<usize>() < min {
            self.push_used(head, 0);
            self.counters.bad_chains.fetch_add(1, Relaxed);
            self.strike();
            return Chained::Bad;
        }
        self.strikes = 0;
        segs.clear();
        segs.extend_from_slice(&self.segs);
        Chained::Chain(head)
    }

    /// The chain `pop_chain` just gave is left for later (nothing to put in
    /// it yet): the next pop gives it again.
    pub fn unpop(&mut self) {
        let next = self.queue.next_avail();
        self.queue.set_next_avail(next.wrapping_sub(1));
    }

    /// Returns chain `head` to the guest with `len` bytes written (visible
    /// at the next publish).
    pub fn give_back(&mut self, head: u16, len: u32) {
        self.push_used(head, len);
    }
}
