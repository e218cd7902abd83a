//! Counters: frames and bytes in and out of every interface, link and route,
//! and drops by reason. Relaxed atomics: readers want totals, not ordering.
//!
//! The daemon-wide counters (totals, offload work, dispatch passes, route
//! cache size) are per thread (`ThreadStats`, one per dispatcher and one for
//! the control threads), each on its own cache lines, and summed when
//! `STATS` asks: no dispatcher writes a cache line another one writes.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// How many times what a control client lists changed: a request that
/// changed interfaces, links, routes or settings committed, or a NIC's guest
/// started or stopped working it (a VM's rings, `VirtualNic::running`). A
/// client waits for the next change with `WAIT` (vnet-agent does, so that a
/// migrated VM's claim moves the moment its rings start, not at a poll).
#[derive(Debug, Default)]
pub struct Changes {
    count: std::sync::Mutex<u64>,
    changed: std::sync::Condvar,
}

impl Changes {
    /// One more change; wakes every waiter.
    pub fn bump(&self) {
        *self.count.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        self.changed.notify_all();
    }

    pub fn count(&self) -> u64 {
        *self.count.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until the count is no longer `seen`, or `limit` passed; the
    /// count then.
    pub fn wait_past(&self, seen: u64, limit: std::time::Duration) -> u64 {
        let guard = self.count.lock().unwrap_or_else(|p| p.into_inner());
        let (guard, _) = self.changed.wait_timeout_while(guard, limit, |c| *c == seen).unwrap_or_else(|p| p.into_inner());
        *guard
    }
}

/// Counter sets whose names are written once (see `vnet_core::counter_set!`).
pub(crate) use vnet_core::counter_set;

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
    /// A sealed link's datagram that failed its authentication: forged,
    /// replayed, or of a session this end does not have.
    Unauthenticated,
    /// A WireGuard handshake message over its source address's budget,
    /// under load (before any public-key work).
    RateLimited,
    /// Frames that waited for a link's handshake, dropped when it was given
    /// up (its peer never answered).
    Unreachable,
    /// A guest's broadcast or multicast frame over its budget (`SET
    /// storm-pps`: storm control).
    Storm,
    /// A guest's ARP or neighbour advertisement claiming an address another
    /// guest holds (`NEIGH`, or learned first from another local guest).
    Spoofed,
}

impl DropReason {
    pub const ALL: [DropReason; 12] = [
        DropReason::NoRoute,
        DropReason::UnknownSender,
        DropReason::Oversize,
        DropReason::Malformed,
        DropReason::QueueFull,
        DropReason::Down,
        DropReason::TxError,
        DropReason::Unauthenticated,
        DropReason::RateLimited,
        DropReason::Unreachable,
        DropReason::Storm,
        DropReason::Spoofed,
    ];

    pub fn name(self) -> &'static str {
        match self {
            DropReason::NoRoute => "no_route",
            DropReason::UnknownSender => "unknown_sender",
            DropReason::Oversize => "oversize",
            DropReason::Malformed => "malformed",
            DropReason::QueueFull => "queue_full",
            DropReason::Down => "down",
            DropReason::TxError => "tx_error",
            DropReason::Unauthenticated => "unauthenticated",
            DropReason::RateLimited => "rate_limited",
            DropReason::Unreachable => "unreachable",
            DropReason::Storm => "storm",
            DropReason::Spoofed => "spoofed",
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
    pub fn received_many(&self, frames: usize, bytes: usize) {
        self.in_frames.fetch_add(frames as u64, Relaxed);
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

counter_set! {
    /// What software offload work the datapath did.
    pub struct OffloadCounters {
        /// Super-frames (TSO/GSO) cut into segments to fit a link.
        segmented,
        /// Segments those produced.
        segments,
        /// UDP GSO sends (many datagrams in one call).
        gso_sends,
        /// Partial checksums finished in software.
        checksums,
        /// Runs of received TCP segments merged into one super-frame for a guest.
        coalesced,
        /// Segments merged into them.
        coalesced_segments,
        /// GRO runs received (several datagrams in one buffer).
        gro_runs,
        /// Frames larger than their link's MTU, left to IP fragmentation.
        fragmented,
    }
}

counter_set! {
    /// How the dispatcher threads spent their passes.
    pub struct DispatchCounters {
        /// Polling passes that found work / found none.
        busy_passes,
        idle_passes,
        /// Idle passes that yielded the CPU (immediate) / slept T_sleep (timed).
        yields,
        sleeps,
        /// Event waits that returned with work.
        wakeups,
        /// `sendmmsg` batches and the datagrams in them.
        tx_batches,
        tx_batched,
        /// Frames read per NIC read pass: sum and count, for the mean batch
        /// (shown as `rx_batch_mean` only).
        rx_frames,
        rx_passes,
        /// Extra copies made by fan-out (a frame to n destinations counts n-1).
        fanout_copies,
        /// Entries in the route cache (a gauge; summed over threads).
        cache_entries,
        /// Guests' ARP requests and neighbour solicitations answered on
        /// this host (never sent on), and addresses learned from what local
        /// guests said of themselves (`neigh`).
        neigh_answered,
        neigh_learned,
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
    /// Counts frames received, on the port that took them and in the totals.
    #[inline]
    pub fn received_at(&self, port: &Counters, frames: usize, bytes: usize) {
        port.received_many(frames, bytes);
        self.global.received_many(frames, bytes);
    }

    /// Counts frames sent, on the port that sent them and in the totals.
    #[inline]
    pub fn sent_at(&self, port: &Counters, frames: usize, bytes: usize) {
        port.sent_many(frames, bytes);
        self.global.sent_many(frames, bytes);
    }

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
    let mut offload = [0u64; OffloadCounters::LEN];
    let mut dispatch = [0u64; DispatchCounters::LEN];
    for t in threads {
        let g = &t.global;
        for (i, v) in [&g.in_frames, &g.in_bytes, &g.out_frames, &g.out_bytes].iter().enumerate() {
            global[i] += v.load(Relaxed);
        }
        for (i, d) in DropReason::ALL.iter().enumerate() {
            global[4 + i] += g.drops(*d);
        }
        for (sum, (_, v)) in offload.iter_mut().zip(t.offload.fields()) {
            *sum += v;
        }
        for (sum, (_, v)) in dispatch.iter_mut().zip(t.dispatch.fields()) {
            *sum += v;
        }
    }
    let mut g = format!("in_frames={} in_bytes={} out_frames={} out_bytes={}", global[0], global[1], global[2], global[3]);
    for (i, d) in DropReason::ALL.iter().enumerate() {
        g.push_str(&format!(" drop_{}={}", d.name(), global[4 + i]));
    }
    let names = |f: &[(&'static str, u64)]| f.iter().map(|(n, _)| *n).collect::<Vec<_>>();
    let onames = names(&OffloadCounters::default().fields());
    let o: Vec<String> = onames.iter().zip(offload).map(|(n, v)| format!("{n}={v}")).collect();
    let dnames = names(&DispatchCounters::default().fields());
    let at = |name: &str| dnames.iter().position(|n| *n == name).expect("a dispatch counter");
    let mut d = Vec::new();
    for (n, v) in dnames.iter().zip(dispatch) {
        match *n {
            "rx_frames" | "rx_passes" => {}
            _ => d.push(format!("{n}={v}")),
        }
        if *n == "tx_batched" {
            // The mean NIC read batch, where the old line had it.
            d.push(format!("rx_batch_mean={:.1}", dispatch[at("rx_frames")] as f64 / dispatch[at("rx_passes")].max(1) as f64));
        }
    }
    [g, o.join(" "), d.join(" ")]
}

#[cfg(test)]
mod tests {
    use super::Changes;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    #[test]
    fn a_waiter_wakes_at_the_next_change_and_not_before() {
        let c = Arc::new(Changes::default());
        assert_eq!(c.wait_past(5, Duration::from_secs(10)), 0, "already past: at once");
        let t = Instant::now();
        assert_eq!(c.wait_past(0, Duration::from_millis(100)), 0);
        assert!(t.elapsed() >= Duration::from_millis(100), "no change: its whole time");
        let b = c.clone();
        let bumper = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            b.bump();
        });
        let t = Instant::now();
        assert_eq!(c.wait_past(0, Duration::from_secs(10)), 1);
        assert!(t.elapsed() < Duration::from_secs(5), "woken by the change");
        bumper.join().unwrap();
    }
}
