//! The packet dispatcher: moves frames between virtual NICs, the routing core
//! and the links, on one or more threads (`worker.rs`), each frame through
//! `forward.rs`.
//!
//! Workers read the topology from an immutable snapshot that the control
//! plane swaps whole, so the hot path takes no lock; each has its own route
//! cache, buffers and batches.

mod forward;
mod worker;

use crate::link::UdpEndpoint;
use crate::stats::{Counters, DispatchCounters, Drop, OffloadCounters};
use crate::topology::Snapshot;
use anyhow::{Context, Result};
use arc_swap::ArcSwap;
use nix::sys::eventfd::{EfdFlags, EventFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What the control plane and the dispatcher threads share.
pub struct Datapath {
    snapshot: ArcSwap<Snapshot>,
    /// Totals over everything, and drops no port can be blamed for.
    pub global: Counters,
    pub offload: OffloadCounters,
    pub dispatch: DispatchCounters,
    pub udp: UdpEndpoint,
    /// Whether UDP GSO works on this underlay (cleared on the first refusal).
    pub gso_ok: AtomicBool,
    workers: Vec<WorkerLink>,
    stop: AtomicBool,
}

/// The control plane's handle on one dispatcher thread.
struct WorkerLink {
    wake: EventFd,
    /// Generation of the snapshot the worker is running.
    running: AtomicU64,
    cpu: Option<usize>,
}

impl Datapath {
    /// A datapath with `workers` dispatcher threads, thread `i` pinned to
    /// `cpus[i]` when given.
    pub fn new(udp: UdpEndpoint, workers: usize, cpus: &[usize]) -> Result<Datapath> {
        let workers = (0..workers.max(1))
            .map(|i| {
                Ok(WorkerLink {
                    wake: EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
                        .context("eventfd")?,
                    running: AtomicU64::new(0),
                    cpu: cpus.get(i).copied(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Datapath {
            snapshot: ArcSwap::from_pointee(Snapshot::empty()),
            global: Counters::default(),
            offload: OffloadCounters::default(),
            dispatch: DispatchCounters::default(),
            udp,
            gso_ok: AtomicBool::new(true),
            workers,
            stop: AtomicBool::new(false),
        })
    }

    pub fn worker_count(&self) -> usize {
        self.workers.len()
    }

    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.snapshot.load_full()
    }

    /// Publishes a new topology and waits (briefly) until every dispatcher
    /// thread runs it, so that when a control request returns its change is
    /// in force.
    pub fn publish(&self, snap: Snapshot) {
        let generation = snap.generation;
        self.snapshot.store(Arc::new(snap));
        for w in &self.workers {
            let _ = w.wake.write(1);
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        while self.workers.iter().any(|w| w.running.load(Ordering::Acquire) < generation) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    /// Forgets the topology (after the dispatcher stopped), releasing its
    /// interfaces and links.
    pub fn clear(&self) {
        self.snapshot.store(Arc::new(Snapshot::empty()));
    }

    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::Release);
        for w in &self.workers {
            let _ = w.wake.write(1);
        }
    }

    #[inline]
    pub fn drop_at(&self, port_stats: Option<&Counters>, why: Drop) {
        self.global.dropped(why);
        if let Some(s) = port_stats {
            s.dropped(why);
        }
    }
}

/// Starts every dispatcher thread; `on_failure` runs if one fails.
pub fn spawn(dp: &Arc<Datapath>, on_failure: fn()) -> Result<Vec<JoinHandle<Result<()>>>> {
    (0..dp.workers.len())
        .map(|i| {
            let dp = dp.clone();
            std::thread::Builder::new()
                .name(format!("dispatcher-{i}"))
                .spawn(move || {
                    if let Some(cpu) = dp.workers[i].cpu {
                        worker::pin_to(cpu);
                    }
                    let r = worker::run(dp, i);
                    if let Err(e) = &r {
                        tracing::error!("dispatcher {i} failed: {e:#}");
                        on_failure();
                    }
                    r
                })
                .context("cannot start a dispatcher thread")
        })
        .collect()
}
