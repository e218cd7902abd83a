//! A NIC with no device behind it, in the style of OVS's `netdev-dummy` and
//! smoltcp's `Loopback`: frames are put in by hand (`inject`), and what
//! vnetd sends to it is kept (`take_sent`), so that the forwarder and the
//! dispatcher can be driven and checked without namespaces, in unit tests
//! and fuzz targets. The control language cannot make one.

use super::{Received, VirtualNic};
use crate::sys::eventfd::EventFd;
use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use vnet_core::offload::{VnetHdr, VNET_HDR_LEN};

/// One frame, with its offload metadata.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DummyFrame {
    pub vnet: VnetHdr,
    pub bytes: Vec<u8>,
}

#[derive(Debug)]
struct State {
    /// Frames the "guest" sent, waiting for vnetd to read.
    rx: Mutex<VecDeque<DummyFrame>>,
    /// Frames vnetd sent to the "guest".
    sent: Mutex<Vec<DummyFrame>>,
    /// How many frames each `send_burst` call brought.
    bursts: Mutex<Vec<usize>>,
    /// Readable while `rx` holds frames (what a dispatcher watches).
    event: EventFd,
    /// Sends fail with ENETDOWN, as a TAP's do before the guest brings it up.
    down: AtomicBool,
    takes_offloads: bool,
}

/// A handle on a dummy NIC; clones share it (keep one to inject and read
/// back, give another to the topology).
#[derive(Clone, Debug)]
pub struct DummyNic(Arc<State>);

impl DummyNic {
    /// A dummy NIC that takes offloaded frames as they are (as a TAP does)
    /// or, with `takes_offloads` false, wants them finished first (as a
    /// virtio driver that did not negotiate offloads).
    pub fn new(takes_offloads: bool) -> io::Result<DummyNic> {
        Ok(DummyNic(Arc::new(State {
            rx: Mutex::new(VecDeque::new()),
            sent: Mutex::new(Vec::new()),
            bursts: Mutex::new(Vec::new()),
            event: EventFd::new()?,
            down: AtomicBool::new(false),
            takes_offloads,
        })))
    }

    /// The guest sends `bytes` with offload metadata `vnet`.
    pub fn inject(&self, vnet: VnetHdr, bytes: &[u8]) {
        self.0.rx.lock().unwrap().push_back(DummyFrame { vnet, bytes: bytes.to_vec() });
        let _ = self.0.event.notify();
    }

    /// Frames vnetd sent to this NIC since the last call.
    pub fn take_sent(&self) -> Vec<DummyFrame> {
        std::mem::take(&mut *self.0.sent.lock().unwrap())
    }

    /// How many frames each burst vnetd sent since the last call held.
    pub fn take_bursts(&self) -> Vec<usize> {
        std::mem::take(&mut *self.0.bursts.lock().unwrap())
    }

    /// Frames injected and not yet read by vnetd.
    pub fn waiting(&self) -> usize {
        self.0.rx.lock().unwrap().len()
    }

    /// The "guest" brings its NIC down (`true`) or up.
    pub fn set_down(&self, down: bool) {
        self.0.down.store(down, Relaxed);
    }
}

impl VirtualNic for DummyNic {
    fn recv(&self, buf: &mut [u8]) -> io::Result<Received> {
        let mut rx = self.0.rx.lock().unwrap();
        let Some(f) = rx.pop_front() else {
            self.0.event.drain();
            return Err(io::ErrorKind::WouldBlock.into());
        };
        if rx.is_empty() {
            self.0.event.drain();
        }
        let end = VNET_HDR_LEN + f.bytes.len();
        if end > buf.len() {
            return Err(io::Error::from_raw_os_error(libc::EMSGSIZE));
        }
        f.vnet.write(&mut buf[..VNET_HDR_LEN]);
        buf[VNET_HDR_LEN..end].copy_from_slice(&f.bytes);
        Ok(Received { start: VNET_HDR_LEN, end, vnet: f.vnet })
    }

    fn send(&self, vnet: &VnetHdr, parts: &[&[u8]]) -> io::Result<usize> {
        if self.0.down.load(Relaxed) {
            return Err(io::Error::from_raw_os_error(libc::ENETDOWN));
        }
        let bytes = parts.concat();
        let n = bytes.len();
        self.0.sent.lock().unwrap().push(DummyFrame { vnet: *vnet, bytes });
        Ok(n)
    }

    fn send_burst(&self, vnet: &VnetHdr, frames: &mut dyn Iterator<Item = &[u8]>, done: &mut dyn FnMut(io::Result<usize>)) {
        let mut n = 0;
        for f in frames {
            n += 1;
            done(self.send(vnet, &[f]));
        }
        self.0.bursts.lock().unwrap().push(n);
    }

    fn event_fd(&self, _queue: usize) -> RawFd {
        self.0.event.as_raw_fd()
    }

    fn takes_offloads(&self) -> bool {
        self.0.takes_offloads
    }

    fn describe(&self) -> String {
        "dummy".into()
    }
}
