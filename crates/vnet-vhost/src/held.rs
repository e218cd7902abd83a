//! Frames for a guest whose receive ring is not running yet — its
//! frontend reconnecting after vnetd restarted, its driver restarting the
//! queue after the link came back — held within bounds and written into
//! the ring once it starts, instead of dropped. The reply to a guest's
//! first ARP after a restart arrives while its ring is still down, and a
//! guest that misses it asks again only a second later (bench/restart.py:
//! the VMs' one-second tails). Bounded by count, bytes and age, so a ring
//! that never starts costs at most that; each frame is counted as held,
//! and then as delivered or expired.

use crate::counters::Counters;
use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};
use vnet_core::offload::VnetHdr;

/// At most this many frames, bytes, and this old.
pub const HOLD_FRAMES: usize = 256;
pub const HOLD_BYTES: usize = 1 << 20;
pub const HOLD_AGE: Duration = Duration::from_secs(1);

/// The frames held for one receive ring.
#[derive(Default)]
pub struct Held {
    frames: VecDeque<(Instant, VnetHdr, Vec<u8>)>,
    bytes: usize,
    /// The guest left this host (`leave`): nothing is held for it.
    left: bool,
}

impl Held {
    /// Holds a copy of the frame `parts` (with its offload header); false
    /// if it does not fit the bounds (the caller drops it).
    pub fn hold(&mut self, now: Instant, vnet: &VnetHdr, parts: &[&[u8]], c: &Counters) -> bool {
        self.expire(now, c);
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if self.left || self.frames.len() >= HOLD_FRAMES || self.bytes + len > HOLD_BYTES {
            return false;
        }
        self.frames.push_back((now, *vnet, parts.concat()));
        self.bytes += len;
        c.rx_held_frames.fetch_add(1, Relaxed);
        true
    }

    /// Frames older than `HOLD_AGE` go (counted).
    fn expire(&mut self, now: Instant, c: &Counters) {
        while let Some((at, _, f)) = self.frames.front() {
            if now.duration_since(*at) <= HOLD_AGE {
                break;
            }
            self.bytes -= f.len();
            self.frames.pop_front();
            c.rx_held_expired.fetch_add(1, Relaxed);
        }
    }

    /// Every frame still young enough, oldest first: the caller's to write.
    pub fn take(&mut self, now: Instant, c: &Counters) -> VecDeque<(Instant, VnetHdr, Vec<u8>)> {
        self.expire(now, c);
        self.bytes = 0;
        std::mem::take(&mut self.frames)
    }

    /// The guest left this host: its ring stopped at the end of a live
    /// migration (the frontend logging dirty pages), so it starts next on
    /// another host, and a frame held here would never reach it. Until the
    /// ring starts again (`resume`), frames for it are refused (the caller
    /// drops and counts them, as for a ring down); any held go, counted as
    /// expired.
    pub fn leave(&mut self, c: &Counters) {
        c.rx_held_expired.fetch_add(self.frames.len() as u64, Relaxed);
        self.frames.clear();
        self.bytes = 0;
        self.left = true;
    }

    /// The ring started again here (a migration that failed at its end, or
    /// the guest came back): frames are held for it again while it is
    /// down. (A frontend's reconnection alone does not: an incoming QEMU
    /// waiting here has no guest yet.)
    pub fn resume(&mut self) {
        self.left = false;
    }

    pub fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_held_within_count_bytes_and_age_and_each_is_counted() {
        let c = Counters::default();
        let mut h = Held::default();
        let t0 = Instant::now();
        let v = VnetHdr::default();
        for _ in 0..HOLD_FRAMES {
            assert!(h.hold(t0, &v, &[&[1u8; 60]], &c));
        }
        assert!(!h.hold(t0, &v, &[&[1u8; 60]], &c), "over the count");
        assert_eq!(c.rx_held_frames.load(Relaxed), HOLD_FRAMES as u64);
        // Older than the age: gone when the next arrives.
        let later = t0 + HOLD_AGE + Duration::from_millis(1);
        assert!(h.hold(later, &v, &[&[2u8; 100], &[3u8; 4]], &c));
        assert_eq!(c.rx_held_expired.load(Relaxed), HOLD_FRAMES as u64);
        let got = h.take(later, &c);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].2.len(), 104);
        assert!(h.is_empty());
        // Bytes: one frame too many for the budget is refused.
        assert!(h.hold(later, &v, &[&vec![0u8; HOLD_BYTES]], &c));
        assert!(!h.hold(later, &v, &[&[0u8; 1]], &c));
    }

    #[test]
    fn a_guest_that_left_has_nothing_held_until_its_ring_starts_again() {
        let c = Counters::default();
        let mut h = Held::default();
        let (t0, v) = (Instant::now(), VnetHdr::default());
        assert!(h.hold(t0, &v, &[&[1u8; 60]], &c));
        h.leave(&c);
        assert!(h.is_empty());
        assert_eq!(c.rx_held_expired.load(Relaxed), 1, "the one held, counted as it went");
        assert!(!h.hold(t0, &v, &[&[1u8; 60]], &c), "refused: the caller drops it, counted");
        assert_eq!(c.rx_held_frames.load(Relaxed), 1);
        h.resume();
        assert!(h.hold(t0, &v, &[&[1u8; 60]], &c));
    }
}
