//! The host's registration lease, kept alive by a task of its own: a
//! keep-alive every third of the TTL whatever else the agent waits for.
//! A write stuck in etcd (a proposal the dying leader never committed
//! waits etcd's own 7 s before it fails) once held the agent's one loop,
//! and with it the keep-alives, past a 5-s lease: the host's guests were
//! withdrawn everywhere because an etcd member died (the leader-kill test,
//! 1 run in 3).

use crate::etcd::OP_TIMEOUT;
use etcd_client::{LeaseKeepAliveStream, LeaseKeeper};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;

const ALIVE: u8 = 0;
const EXPIRED: u8 = 1;
const BROKEN: u8 = 2;

/// What became of a lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Alive,
    /// etcd answered that it no longer has it (its TTL ran out).
    Expired,
    /// A keep-alive went unanswered (or the stream broke): the connection
    /// is suspect; the lease may still live, kept through another.
    Broken,
}

pub struct Lease {
    pub id: i64,
    state: Arc<AtomicU8>,
    task: tokio::task::JoinHandle<()>,
}

impl Lease {
    /// Keeps lease `id` (of `ttl` seconds) alive through `keeper` and
    /// `stream`, until it expires or a keep-alive fails; `wake` is
    /// notified then.
    pub fn start(id: i64, ttl: i64, mut keeper: LeaseKeeper, mut stream: LeaseKeepAliveStream, wake: Arc<Notify>) -> Lease {
        let state = Arc::new(AtomicU8::new(ALIVE));
        let st = state.clone();
        let period = Duration::from_millis((ttl.max(1) as u64) * 1000 / 3);
        // Keep-alives go out every period whether or not the last was
        // answered: a slow etcd (a thousand hosts coming up at once) is
        // given the lease's whole life to answer, not a request's timeout;
        // only an answer that the lease is gone, a broken stream, or no
        // answer for a whole TTL end it.
        let life = Duration::from_secs(ttl.max(1) as u64);
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            let mut answered = tokio::time::Instant::now();
            let next = loop {
                tokio::select! {
                    _ = tick.tick() => {
                        if answered.elapsed() >= life {
                            break BROKEN;
                        }
                        if tokio::time::timeout(OP_TIMEOUT, keeper.keep_alive()).await.map_or(true, |r| r.is_err()) {
                            break BROKEN;
                        }
                    }
                    m = stream.message() => match m {
                        Ok(Some(r)) if r.ttl() > 0 => answered = tokio::time::Instant::now(),
                        Ok(Some(_)) => break EXPIRED,
                        _ => break BROKEN,
                    },
                }
            };
            st.store(next, Ordering::Release);
            wake.notify_one();
        });
        Lease { id, state, task }
    }

    pub fn state(&self) -> State {
        match self.state.load(Ordering::Acquire) {
            ALIVE => State::Alive,
            EXPIRED => State::Expired,
            _ => State::Broken,
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.task.abort();
    }
}
