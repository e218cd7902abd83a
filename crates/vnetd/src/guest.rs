//! What vnetd keeps of each guest beyond its NIC (`topology::Interface`
//! holds it; `dispatch::home` uses it): its broadcast budget (storm
//! control) and the addresses it said it holds.

use crate::stats::Changes;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// Addresses one guest may hold at once (learned); more are refused
/// (counted as spoofed): a guest cannot fill vnetd with bindings.
pub const MAX_LEARNED: usize = 16;

/// Nanoseconds on a clock of this process's own (from its first use).
pub fn now_ns() -> u64 {
    static E: OnceLock<Instant> = OnceLock::new();
    E.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// A guest's broadcast budget: a token bucket, tokens in millionths of a
/// frame, refilled by elapsed time. Only the dispatcher that reads the
/// guest's NIC takes from it.
#[derive(Default)]
pub struct StormBucket {
    micro_tokens: AtomicU64,
    /// When it was last refilled (`now_ns`; 0: never).
    at: AtomicU64,
}

impl StormBucket {
    /// Takes one frame's token at `pps` a second (a burst of `pps`); false
    /// when there is none.
    pub fn take(&self, pps: u32, now_ns: u64) -> bool {
        let cap = u64::from(pps) * 1_000_000;
        let at = self.at.load(Relaxed);
        let mut t = self.micro_tokens.load(Relaxed);
        if at == 0 {
            t = cap;
        } else {
            // ns × frames/s ÷ 1000 = millionths of a frame.
            t = t.saturating_add(now_ns.saturating_sub(at).saturating_mul(u64::from(pps)) / 1000).min(cap);
        }
        self.at.store(now_ns.max(1), Relaxed);
        let ok = t >= 1_000_000;
        self.micro_tokens.store(if ok { t - 1_000_000 } else { t }, Relaxed);
        ok
    }
}

/// What a guest has said it holds.
#[derive(Default)]
pub struct Learned {
    ips: Mutex<Vec<IpAddr>>,
    /// Told of each address learned (what `WAIT` watches: vnet-agent
    /// publishes it at once).
    changes: OnceLock<Arc<Changes>>,
}

/// What `Learned::add` did.
pub enum Added {
    New,
    Already,
    /// The guest holds `MAX_LEARNED` already.
    Full,
}

impl Learned {
    pub fn tell(&self, changes: Arc<Changes>) {
        let _ = self.changes.set(changes);
    }

    pub fn list(&self) -> Vec<IpAddr> {
        self.ips.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn holds(&self, ip: &IpAddr) -> bool {
        self.ips.lock().unwrap_or_else(|p| p.into_inner()).contains(ip)
    }

    pub fn add(&self, ip: IpAddr) -> Added {
        let mut ips = self.ips.lock().unwrap_or_else(|p| p.into_inner());
        if ips.contains(&ip) {
            return Added::Already;
        }
        if ips.len() >= MAX_LEARNED {
            return Added::Full;
        }
        ips.push(ip);
        drop(ips);
        if let Some(c) = self.changes.get() {
            c.bump();
        }
        Added::New
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_storm_budget_is_a_burst_then_the_rate() {
        let b = StormBucket::default();
        let t0 = 1_000_000_000;
        let burst = (0..150).filter(|_| b.take(100, t0)).count();
        assert_eq!(burst, 100, "a burst of one second's budget");
        // 0.5 s later: 50 more.
        let later = (0..80).filter(|_| b.take(100, t0 + 500_000_000)).count();
        assert_eq!(later, 50);
        // An hour idle refills no more than the burst.
        let again = (0..500).filter(|_| b.take(100, t0 + 3_600_000_000_000)).count();
        assert_eq!(again, 100);
    }
}
