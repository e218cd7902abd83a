//! Counters: frames and bytes in and out of every interface, link and route,
//! and drops by reason. Relaxed atomics: readers want totals, not ordering.
//!
//! The daemon-wide counters (totals, offload work, dispatch passes, route
//! cache size) are per thread (`ThreadStats`, one per dispatcher and one for
//! the control threads), each on its own cache lines, and summed when
//! `STATS` asks: no dispatcher writes a cache line another one writes.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Why a frame or datagram was dropped. Every drop has exactly one reason.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum DropReason {
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

impl DropReason {
    pub const ALL: [DropReason; 7] =
        [DropReason::NoRoute, DropReason::UnknownSender, DropReason::Oversize, DropReason::Malformed, DropReason::QueueFull, DropReason::Down, DropReason::TxError];

    pub fn name(self) -> &'static str {
        match self {
            DropReason::NoRoute => "no_route",
            DropReason::UnknownSender => "unknown_sender",
            DropReason::Oversize => "oversize",
            DropReason::Malformed => "malformed",
            DropReason::QueueFull => "queue_full",
            DropReason::Down => "down",
            DropReason::TxError => "tx_error",
        }
    }
}

#[derive(Default)]
pub struct Counters {
    pub in_frames: AtomicU64,
    pub in_bytes: AtomicU64,
    pub out_frames: AtomicU64,
    pub out_bytes: AtomicU64,
    drops: [AtomicU64; DropReason::ALL.len()],
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
    pub fn dropped(&self, why: DropReason) {
        self.drops[why as usize].fetch_add(1, Relaxed);
    }

    pub fn drops(&self, why: DropReason) -> u64 {
        self.drops[why as usize].load(Relaxed)
    }

    /// `in_frames=.. in_bytes=.. out_frames=.. out_bytes=.. fast_in_frames=..
    /// fast_out_frames=.. drop_<reason>=..`: the user-level datapath's
    /// counts with what the kernel fast path carried added in (and shown on
    /// its own).
    pub fn render_plus(&self, fast: Fast) -> String {
        let mut s = format!(
            "in_frames={} in_bytes={} out_frames={} out_bytes={} fast_in_frames={} fast_out_frames={}",
            self.in_frames.load(Relaxed) + fast.in_frames,
            self.in_bytes.load(Relaxed) + fast.in_bytes,
            self.out_frames.load(Relaxed) + fast.out_frames,
            self.out_bytes.load(Relaxed) + fast.out_bytes,
            fast.in_frames,
            fast.out_frames
        );
        for d in DropReason::ALL {
            s.push_str(&format!(" drop_{}={}", d.name(), self.drops(d)));
        }
        s
    }
}

/// Frames and bytes the kernel fast path carried in and out of one port.
#[derive(Clone, Copy, Default, Debug)]
pub struct Fast {
    pub in_frames: u64,
    pub in_bytes: u64,
    pub out_frames: u64,
    pub out_bytes: u64,
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
    fn values(&self) -> [(&'static str, u64); 8] {
        let v = |a: &AtomicU64| a.load(Relaxed);
        [
            ("segmented", v(&self.segmented)),
            ("segments", v(&self.segments)),
            ("gso_sends", v(&self.gso_sends)),
            ("checksums", v(&self.checksums)),
            ("coalesced", v(&self.coalesced)),
            ("coalesced_segments", v(&self.coalesced_segments)),
            ("gro_runs", v(&self.gro_runs)),
            ("fragmented", v(&self.fragmented)),
        ]
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
    /// Entries in the route cache (a gauge; summed over threads).
    pub cache_entries: AtomicU64,
}

impl DispatchCounters {
    fn values(&self) -> [(&'static str, u64); 11] {
        let v = |a: &AtomicU64| a.load(Relaxed);
        [
            ("busy_passes", v(&self.busy_passes)),
            ("idle_passes", v(&self.idle_passes)),
            ("yields", v(&self.yields)),
            ("sleeps", v(&self.sleeps)),
            ("wakeups", v(&self.wakeups)),
            ("tx_batches", v(&self.tx_batches)),
            ("tx_batched", v(&self.tx_batched)),
            ("rx_frames", v(&self.rx_frames)),
            ("rx_passes", v(&self.rx_passes)),
            ("fanout_copies", v(&self.fanout_copies)),
            ("cache_entries", v(&self.cache_entries)),
        ]
    }
}

/// One thread's daemon-wide counters, alone on its cache lines.
#[derive(Default)]
#[repr(align(128))]
pub struct ThreadStats {
    /// Totals over everything this thread handled, and drops no port can be
    /// blamed for.
    pub global: Counters,
    pub offload: OffloadCounters,
    pub dispatch: DispatchCounters,
}

impl ThreadStats {
    /// Counts a drop, on the port it happened at (if any) and in the totals.
    #[inline]
    pub fn drop_at(&self, port: Option<&Counters>, why: DropReason) {
        self.global.dropped(why);
        if let Some(s) = port {
            s.dropped(why);
        }
    }
}

/// The sums over threads, rendered: the `global`, `offload` and `dispatch`
/// lines of `STATS`.
pub fn render_totals(threads: &[&ThreadStats]) -> [String; 3] {
    let mut global = [0u64; 4 + DropReason::ALL.len()];
    let mut offload = [0u64; 8];
    let mut dispatch = [0u64; 11];
    let (mut onames, mut dnames) = ([""; 8], [""; 11]);
    for t in threads {
        let g = &t.global;
        for (i, v) in [&g.in_frames, &g.in_bytes, &g.out_frames, &g.out_bytes].iter().enumerate() {
            global[i] += v.load(Relaxed);
        }
        for (i, d) in DropReason::ALL.iter().enumerate() {
            global[4 + i] += g.drops(*d);
        }
        for (i, (n, v)) in t.offload.values().into_iter().enumerate() {
            onames[i] = n;
            offload[i] += v;
        }
        for (i, (n, v)) in t.dispatch.values().into_iter().enumerate() {
            dnames[i] = n;
            dispatch[i] += v;
        }
    }
    let mut g = format!("in_frames={} in_bytes={} out_frames={} out_bytes={}", global[0], global[1], global[2], global[3]);
    for (i, d) in DropReason::ALL.iter().enumerate() {
        g.push_str(&format!(" drop_{}={}", d.name(), global[4 + i]));
    }
    let o: Vec<String> = onames.iter().zip(offload).map(|(n, v)| format!("{n}={v}")).collect();
    let mut d = Vec::new();
    for (n, v) in dnames.iter().zip(dispatch) {
        match *n {
            "rx_frames" | "rx_passes" => {}
            _ => d.push(format!("{n}={v}")),
        }
        if *n == "tx_batched" {
            // The mean NIC read batch, where the old line had it.
            d.push(format!("rx_batch_mean={:.1}", dispatch[7] as f64 / dispatch[8].max(1) as f64));
        }
    }
    [g, o.join(" "), d.join(" ")]
}
