//! When the guest is interrupted for frames it received: virtio's event
//! index (or NO_INTERRUPT flag) says whether it asked; VNET/P+'s optimistic
//! interrupts add an early virtual interrupt (EVI) when frames start to
//! arrive and decide at the end of coalescing (EoC) by the receive density
//! since that EVI.

use std::time::Instant;

/// How NICs with shared rings interrupt their guests (`SET interrupts`,
/// `eoc-alpha`, `eoc-beta`).
#[derive(Clone, Copy, Debug)]
pub struct IrqPolicy {
    pub optimistic: bool,
    /// Receive-density thresholds α and β, bytes per second.
    pub alpha: u64,
    pub beta: u64,
}

/// Since the last early virtual interrupt (EVI) that was sent: when, how
/// many bytes came, whether the last attempt found the guest's interrupts
/// off, and whether an interrupt waits for the dispatcher's idle point.
#[derive(Default)]
pub struct IrqState {
    pub evi_at: Option<Instant>,
    pub bytes: u64,
    pub evi_failed: bool,
    pub deferred: bool,
}

/// What to do at the end of a burst, and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IrqDecision {
    /// Plain interrupts: interrupt if the guest asked.
    Plain(bool),
    /// The guest did not ask.
    NotNeeded,
    /// The early interrupt found the guest's interrupts off: interrupt now.
    Masked,
    /// Below α (the paper skipped it; virtio's event index says the guest
    /// has not taken the frames, and skipping would stall it): now.
    Cold,
    /// Between α and β: now.
    Density,
    /// Above β ("too hot": EVIs drive the stream): at the dispatcher's idle
    /// point.
    Hot,
}

impl IrqDecision {
    /// Whether to interrupt now.
    pub fn now(self) -> bool {
        matches!(self, IrqDecision::Plain(true) | IrqDecision::Masked | IrqDecision::Cold | IrqDecision::Density)
    }
}

impl IrqState {
    /// The end of coalescing: frames were published and the guest `wants`
    /// an interrupt for them (or not).
    pub fn end_of_coalescing(&mut self, policy: &IrqPolicy, wants: bool) -> IrqDecision {
        if !policy.optimistic {
            return IrqDecision::Plain(wants);
        }
        if !wants {
            return IrqDecision::NotNeeded;
        }
        if std::mem::take(&mut self.evi_failed) {
            return IrqDecision::Masked;
        }
        let rd = self.evi_at.map_or(u64::MAX / 2, |t| {
            let ns = t.elapsed().as_nanos().max(1) as u64;
            self.bytes.saturating_mul(1_000_000_000) / ns
        });
        if rd > policy.beta {
            self.deferred = true;
            IrqDecision::Hot
        } else if rd < policy.alpha {
            IrqDecision::Cold
        } else {
            IrqDecision::Density
        }
    }

    /// An early interrupt was sent now.
    pub fn evi_sent(&mut self) {
        self.evi_at = Some(Instant::now());
        self.bytes = 0;
        self.evi_failed = false;
        self.deferred = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decisions_follow_the_receive_density() {
        let p = IrqPolicy { optimistic: true, alpha: 1_000, beta: 1_000_000_000_000 };
        let mut s = IrqState::default();
        assert_eq!(s.end_of_coalescing(&IrqPolicy { optimistic: false, ..p }, true), IrqDecision::Plain(true));
        assert_eq!(s.end_of_coalescing(&p, false), IrqDecision::NotNeeded);
        s.evi_failed = true;
        assert_eq!(s.end_of_coalescing(&p, true), IrqDecision::Masked);
        assert!(!s.evi_failed);
        s.evi_sent();
        assert_eq!(s.end_of_coalescing(&p, true), IrqDecision::Cold, "nothing came since the EVI");
        s.evi_sent();
        s.bytes = u64::MAX / 4;
        let hot = IrqPolicy { beta: 1, ..p };
        assert_eq!(s.end_of_coalescing(&hot, true), IrqDecision::Hot);
        assert!(s.deferred && !IrqDecision::Hot.now());
    }
}
