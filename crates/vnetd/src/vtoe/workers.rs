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
    pub fn run(&self, job: impl FnOnce() + Send + 'static) -> bool {
        if self.idle.load(Relaxed) == 0 && (self.threads.load(Relaxed) >= self.max || !self.spawn()) {
            return false;
        }
        self.tx.lock().unwrap_or_else(|p| p.into_inner()).send(Box::new(job)).is_ok()
    }

    fn spawn(&self) -> bool {
        let (rx, idle) = (self.rx.clone(), self.idle.clone());
        idle.fetch_add(1, Relaxed);
        let ok = std::thread::Builder::new()
            .name(self.name.into())
            .spawn(move || loop {
                let job = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                let Ok(job) = job else { return };
                idle.fetch_sub(1, Relaxed);
                job();
                idle.fetch_add(1, Relaxed);
            })
            .is_ok();
        if ok {
            self.threads.fetch_add(1, Relaxed);
        } else {
            self.idle.fetch_sub(1, Relaxed);
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
}
