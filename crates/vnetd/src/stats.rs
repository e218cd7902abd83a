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
    pub fn sent_many(&self, frames: usize, bytes: usize) {
        self.out_frames.fetch_add(frames as u64, Relaxed);
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
    /// Super-frames (TSO/GSO) cut into segments to fit a link.
    pub segmented: AtomicU64,
    /// Segments those produced.
    pub segments: AtomicU64,
    /// UDP GSO sends (many datagrams in one call).
    pub gso_sends: AtomicU64,
    /// Partial checksums finished in software.
    pub checksums: AtomicU64,
    /// Runs of received TCP segments merged into one super-frame for a guest.
    pub coalesced: AtomicU64,
    /// Segments merged into them.
    pub coalesced_segments: AtomicU64,
    /// GRO runs received (several datagrams in one buffer).
    pub gro_runs: AtomicU64,
    /// Frames larger than their link's MTU, left to IP fragmentation.
    pub fragmented: AtomicU64,
}

impl OffloadCounters {
    pub fn render(&self) -> String {
        let v = |a: &AtomicU64| a.load(Relaxed);
        format!(
            "segmented={} segments={} gso_sends={} checksums={} coalesced={} coalesced_segments={} gro_runs={} fragmented={}",
            v(&self.segmented),
            v(&self.segments),
            v(&self.gso_sends),
            v(&self.checksums),
            v(&self.coalesced),
            v(&self.coalesced_segments),
            v(&self.gro_runs),
            v(&self.fragmented)
        )
    }
}

/// How the dispatcher threads spent their passes.
#[derive(Default)]
pub struct DispatchCounters {
    /// Polling passes that found work / found none.
    pub busy_passes: AtomicU64,
    pub idle_passes: AtomicU64,
    /// Idle passes that yielded the CPU (immediate) / slept T_sleep (timed).
    pub yields: AtomicU64,
    pub sleeps: AtomicU64,
    /// Event waits that returned with work.
    pub wakeups: AtomicU64,
    /// `sendmmsg` batches and the datagrams in them.
    pub tx_batches: AtomicU64,
    pub tx_batched: AtomicU64,
    /// Frames read per NIC read pass: sum and count, for the mean batch.
    pub rx_frames: AtomicU64,
    pub rx_passes: AtomicU64,
    /// Extra copies made by fan-out (a frame to n destinations counts n-1).
    pub fanout_copies: AtomicU64,
}

impl DispatchCounters {
    pub fn render(&self) -> String {
        let v = |a: &AtomicU64| a.load(Relaxed);
        let passes = v(&self.rx_passes).max(1);
        format!(
            "busy_passes={} idle_passes={} yields={} sleeps={} wakeups={} tx_batches={} tx_batched={} rx_batch_mean={:.1} fanout_copies={}",
            v(&self.busy_passes),
            v(&self.idle_passes),
            v(&self.yields),
            v(&self.sleeps),
            v(&self.wakeups),
            v(&self.tx_batches),
            v(&self.tx_batched),
            v(&self.rx_frames) as f64 / passes as f64,
            v(&self.fanout_copies)
        )
    }
}
