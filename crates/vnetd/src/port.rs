//! Ports, as the datapath's sources see them: where a frame came from in a
//! snapshot (`Slot`), and what a source of frames hands them to (`Intake`:
//! the forwarder). Below `nic` and `link`, so that a link kind reads its own
//! sockets and streams and routes what they bring without knowing the
//! topology or the dispatcher.

use std::ops::Range;
use vnet_core::offload::VnetHdr;

/// Where a port is in one snapshot.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Slot {
    Iface(u32),
    Link(u32),
}

/// Where the frames a source reads go (the dispatcher's forwarder).
pub trait Intake {
    /// A frame of the port at `at` with its virtio-net header (a device
    /// link's frame, which may be a super-frame).
    fn port_frame(&mut self, at: Slot, frame: &mut [u8], vnet: VnetHdr);
    /// A frame of the link at `slot`: `buf[frame]`, one of a run.
    fn link_frame(&mut self, slot: u32, buf: &mut [u8], frame: Range<usize>);
    /// The run (so far) ends: the frames handed over are done with `buf`.
    fn end_run(&mut self, buf: &[u8]);
}
