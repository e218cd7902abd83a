//! Threads that stay: VTOE's work items (a guest's connect, an incoming
//! handshake) each wait on the network or on a guest's kernel for a while,
//! so each gets a thread, but spawning one costs more than a connection's
//! whole decision (about 50 µs here). Idle threads wait for the next item;
//! a new one is made only when all are busy, up to `max`.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};

type Job = Box<dyn FnOnce() + Send>;

pub struct Workers {
    name: &'static str,
    max: usize,
    tx: Mutex<Sender<Job>>,
    rx: Arc<Mutex<Receiver<Job>>>,
    idle: Arc<AtomicUsize>,
    threads: AtomicUsize,
}

impl Workers {
    pub fn new(name: &'static str, max: usize) -> Workers {
        let (tx, rx) = channel();
        Workers { name, max, tx: Mutex::new(tx), rx: Arc::new(Mutex::new(rx)), idle: Arc::default(), threads: AtomicUsize::new(0) }
    }

    /// Runs `job` on an idle thread, or a new one; false when all `max`
    /// are busy (the job is not run).
    ///
    /// The idle thread is taken (`idle` counts threads free and not yet
    /// promised a job) before the job is sent, so every job sent has a
    /// thread of its own: two jobs never count on one idle thread, which
    /// would leave the second queued behind the first however long that
    /// takes (a burst of stalled handshakes then held a few threads and an
    /// unbounded queue, and declined none).
    pub fn run(&self, job: impl FnOnce() + Send + 'static) -> bool {
        let took_idle = self.idle.fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1)).is_ok();
        if !took_idle && !self.spawn() {
            return false;
        }
        self.tx.lock().unwrap_or_else(|p| p.into_inner()).send(Box::new(job)).is_ok()
    }

    /// A new thread, for the job about to be sent; false at `max`.
    fn spawn(&self) -> bool {
        if self.threads.fetch_update(Relaxed, Relaxed, |n| (n < self.max).then_some(n + 1)).is_err() {
            return false;
        }
        let (rx, idle) = (self.rx.clone(), self.idle.clone());
        let ok = std::thread::Builder::new()
            .name(self.name.into())
            .spawn(move || loop {
                let job = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                let Ok(job) = job else { return };
                job();
                idle.fetch_add(1, Relaxed);
            })
            .is_ok();
        if !ok {
            self.threads.fetch_sub(1, Relaxed);
        }
        ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Barrier;

    #[test]
    fn threads_are_reused_and_bounded() {
        let w = Workers::new("t", 2);
        let (done_tx, done_rx) = channel();
        for i in 0..10 {
            let d = done_tx.clone();
            // One at a time: the same thread takes them all.
            assert!(w.run(move || d.send(i).unwrap()));
            done_rx.recv().unwrap();
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(w.threads.load(Relaxed), 1);
        // Two held busy: a third job is refused.
        let gate = Arc::new(Barrier::new(3));
        for _ in 0..2 {
            let g = gate.clone();
            while w.idle.load(Relaxed) == 0 && w.threads.load(Relaxed) == 2 {
                std::thread::yield_now();
            }
            assert!(w.run(move || {
                g.wait();
            }));
            while w.idle.load(Relaxed) != 0 {
                std::thread::yield_now();
            }
        }
        assert!(!w.run(|| {}));
        gate.wait();
    }

    #[test]
    fn a_burst_of_jobs_that_block_gets_max_threads_and_no_queue() {
        // Jobs sent back to back, each holding its thread: the first `max`
        // each get a thread of their own at once, the rest are refused (none
        // waits in the queue behind a busy thread).
        let w = Workers::new("t", 4);
        let (release_tx, release_rx) = channel::<()>();
        let release_rx = Arc::new(Mutex::new(release_rx));
        let (started_tx, started_rx) = channel();
        let taken: Vec<bool> = (0..10)
            .map(|_| {
                let (r, s) = (release_rx.clone(), started_tx.clone());
                w.run(move || {
                    s.send(()).unwrap();
                    let _ = r.lock().unwrap().recv();
                })
            })
            .collect();
        assert_eq!(taken, [true, true, true, true, false, false, false, false, false, false]);
        for _ in 0..4 {
            started_rx.recv_timeout(std::time::Duration::from_secs(5)).expect("every job taken runs at once");
        }
        assert_eq!(w.threads.load(Relaxed), 4);
        drop(release_tx);
    }
}
