//! A link with no peer behind it, the counterpart of `nic::DummyNic`: what
//! vnetd sends over it is kept, one datagram per frame or segment, so that
//! the forwarder's link side can be checked without namespaces (unit tests,
//! fuzz targets). Frames "received" on it are given to the forwarder by the
//! caller. The control language cannot make one.

use super::{Segments, Sent, Transport, TxCtx, TxQueue, SEG_PARTS};
use crate::stats::DropReason;
use std::sync::{Arc, Mutex};
use vnet_core::offload::{Pieces, VnetHdr};

/// A handle on a dummy link; clones share it.
#[derive(Clone, Default)]
pub struct DummyLink {
    sent: Arc<Mutex<Vec<Vec<u8>>>>,
    /// Largest datagram it carries; larger frames are dropped as oversize.
    pub max_datagram: usize,
}

impl DummyLink {
    pub fn new(max_datagram: usize) -> DummyLink {
        DummyLink { sent: Arc::default(), max_datagram }
    }

    /// The datagrams sent since the last call.
    pub fn take_sent(&self) -> Vec<Vec<u8>> {
        std::mem::take(&mut *self.sent.lock().unwrap())
    }
}

impl Transport for DummyLink {
    fn kind(&self) -> &'static str {
        "dummy"
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn send(&self, _q: &mut TxQueue, _cx: &TxCtx, _vnet: &VnetHdr, frame: Pieces) -> Sent {
        if frame.len() > self.max_datagram {
            return Sent::dropped(DropReason::Oversize, 1);
        }
        self.sent.lock().unwrap().push(frame.parts().concat());
        Sent::now(1, frame.len())
    }

    fn send_segments(&self, _q: &mut TxQueue, _cx: &TxCtx, segs: &Segments) -> Sent {
        let mut parts = [&[][..]; SEG_PARTS];
        let mut out = self.sent.lock().unwrap();
        for k in 0..segs.len() {
            let n = segs.parts(k, &mut parts);
            out.push(parts[..n].concat());
        }
        Sent::now(segs.len(), segs.bytes(0, segs.len()))
    }
}
