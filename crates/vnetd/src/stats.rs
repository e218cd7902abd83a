//! Counters: frames and bytes in and out of every interface, link and route,
//! and drops by reason. Relaxed atomics: readers want totals, not ordering.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Why a frame or datagram was dropped. Every drop has exactly one reason.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Drop {
    /// No rule matched (or every match led back where it came from).
    NoRoute,
    /// A datagram from an address that is no link's.
    UnknownSender,
    /// Larger than the destination takes (interface MTU, link payload limit).
    Oversize,
    /// Not an Ethernet frame (shorter than its header).
    Malformed,
    /// The destination's queue or socket buffer was full.
    QueueFull,
    /// The destination interface is down (no guest has brought it up).
    Down,
    /// Any other send error, counted rather than lost.
    TxError,
}

impl Drop {
    pub const ALL: [Drop; 7] =
        [Drop::NoRoute, Drop::UnknownSender, Drop::Oversize, Drop::Malformed, Drop::QueueFull, Drop::Down, Drop::TxError];

    pub fn name(self) -> &'static str {
        match self {
            Drop::NoRoute => "no_route",
            Drop::UnknownSender => "unknown_sender",
            Drop::Oversize => "oversize",
            Drop::Malformed => "malformed",
            Drop::QueueFull => "queue_full",
            Drop::Down => "down",
            Drop::TxError => "tx_error",
        }
    }
}

#[derive(Default)]
pub struct Counters {
    pub in_frames: AtomicU64,
    pub in_bytes: AtomicU64,
    pub out_frames: AtomicU64,
    pub out_bytes: AtomicU64,
    drops: [AtomicU64; Drop::ALL.len()],
}

impl Counters {
    #[inline]
    pub fn received(&self, bytes: usize) {
        self.in_frames.fetch_add(1, Relaxed);
        self.in_bytes.fetch_add(bytes as u64, Relaxed);
    }

    #[inline]
    pub fn sent(&self, bytes: usize) {
        self.out_frames.fetch_add(1, Relaxed);
        self.out_bytes.fetch_add(bytes as u64, Relaxed);
    }

    #[inline]
    pub fn dropped(&self, why: Drop) {
        self.drops[why as usize].fetch_add(1, Relaxed);
    }

    pub fn drops(&self, why: Drop) -> u64 {
        self.drops[why as usize].load(Relaxed)
    }

    /// `in_frames=.. in_bytes=.. out_frames=.. out_bytes=.. drop_<reason>=..`
    pub fn render(&self) -> String {
        let mut s = format!(
            "in_frames={} in_bytes={} out_frames={} out_bytes={}",
            self.in_frames.load(Relaxed),
            self.in_bytes.load(Relaxed),
            self.out_frames.load(Relaxed),
            self.out_bytes.load(Relaxed)
        );
        for d in Drop::ALL {
            s.push_str(&format!(" drop_{}={}", d.name(), self.drops(d)));
        }
        s
    }
}

/// What software offload work the datapath did.
#[derive(Default)]
pub struct OffloadCounters {
    /// Super-frames (TSO/GSO) cut into segments.
    pub segmented: AtomicU64,
    /// Segments those produced.
    pub segments: AtomicU64,
    /// Partial checksums finished.
    pub checksums: AtomicU64,
}

impl OffloadCounters {
    pub fn render(&self) -> String {
        format!(
            "segmented={} segments={} checksums={}",
            self.segmented.load(Relaxed),
            self.segments.load(Relaxed),
            self.checksums.load(Relaxed)
        )
    }
}
