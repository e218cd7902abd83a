//! Virtual NICs: how guest frames enter and leave the daemon.
//!
//! Each kind implements `VirtualNic`:
//! - `Tap`: vnetd holds the TAP's file side; the network device is the
//!   guest's NIC (moved into a guest namespace or container).
//! - `QemuNic`: QEMU holds the file side (`-netdev tap,ifname=..`); vnetd
//!   meets the TAP device through the fast path (`upcall.rs`) or a packet
//!   socket.
//! - `VethNic`: a veth pair, the guest's end in its namespace; the kernel
//!   fast path attaches to the host's end (`veth.rs`).
//! - `VhostUserNic`: the VMM shares the guest's memory and virtio rings
//!   over a vhost-user socket; dispatchers work the rings (`vhost_user/`).
//! - `DummyNic`: no device; frames injected and kept by hand, for driving
//!   the datapath in unit tests and fuzz targets (`dummy.rs`).
//!
//! Which kind an interface gets is decided in one place,
//! `topology/factory.rs`. Persistent TAPs (`netns` and `qemu` kinds) carry vnetd's mark (`rtnl`);
//! only marked ones are taken over, un-persisted or deleted.

pub mod dummy;
pub mod qemu;
pub mod tap;
pub mod upcall;
pub mod veth;
pub mod vhost_user;

use crate::settings::IrqPolicy;
use std::io;
use std::os::fd::RawFd;
use vnet_core::offload::{VnetHdr, MAX_PIECES, VNET_HDR_LEN};

pub use dummy::DummyNic;
pub use qemu::QemuNic;
pub use tap::{QemuTap, Tap};
pub use veth::VethNic;
pub use vhost_user::VhostUserNic;

/// A guest's virtual NIC, as the dispatcher uses it; the dispatcher never
/// asks which kind it has. The first three methods (and `event_fd`) are
/// what a NIC behind a file descriptor needs; the vhost-user NIC added the
/// ones shared rings need (`recv_in_place`, `arriving`, `flush`, `idle`,
/// `takes_offloads`), each a no-op by default.
pub trait VirtualNic: Send + Sync {
    /// Reads one frame without blocking: `buf[start..end]`, with its offload
    /// metadata (every NIC kind here speaks virtio-net headers, so a guest's
    /// super-frames and partial checksums arrive labelled).
    fn recv(&self, buf: &mut [u8]) -> io::Result<Received>;
    /// As `recv`, but a NIC that shares the guest's memory may leave the
    /// frame where it lies, uncopied (cut-through): it then describes it in
    /// `at` (the dispatcher's, reused) and returns `Frame::InPlace`; the
    /// dispatcher finishes with it before its next flush.
    fn recv_in_place(&self, buf: &mut [u8], _at: &mut InPlace) -> io::Result<Frame> {
        self.recv(buf).map(Frame::Copied)
    }
    /// Sends one frame made of `parts`, with offload metadata `vnet` (all
    /// zero for a plain frame); returns the frame's length.
    fn send(&self, vnet: &VnetHdr, parts: &[&[u8]]) -> io::Result<usize>;
    /// A descriptor that is readable while frames wait: the dispatcher
    /// watches it while the NIC runs guest-driven.
    fn event_fd(&self) -> RawFd;
    /// Notifications on (guest-driven: the dispatcher sleeps until a frame)
    /// or off (VMM-driven: it polls). For a TAP the dispatcher's epoll
    /// membership is the whole switch; a NIC with shared rings would also
    /// tell the guest here (virtio's `VRING_USED_F_NO_NOTIFY`).
    fn set_notify(&self, _on: bool) {}
    /// The request that holds this NIC committed with it in force.
    fn in_force(&self) {}
    /// The request that deleted its interface committed (`detach`: the
    /// device stays for another vnetd, e.g. after a migration).
    fn deleted(&self, _detach: bool) {}
    /// How the kernel fast path delivers to this NIC, if it is one of the
    /// fast path's ports (its frames then meet the fast path too).
    fn fast_target(&self) -> Option<vnet_fastpath::Action> {
        None
    }
    /// What `INTERFACE LIST` adds about the attachment.
    fn describe(&self) -> String {
        String::new()
    }
    /// Frames from the guest lost before vnetd could read them (a queue
    /// between the kernel and vnetd was full), if the NIC has such a queue.
    fn upcall_dropped(&self) -> u64 {
        0
    }
    /// Frames for this NIC arrived and are about to be copied in (the first
    /// of a dispatcher pass): where optimistic interrupts are on, a NIC with
    /// shared rings may interrupt its guest now (an early virtual
    /// interrupt), so that the guest wakes while they are copied.
    fn arriving(&self, _irq: &IrqPolicy) {}
    /// The end of a burst: frames were sent to this NIC, or read from it,
    /// since the last flush. A NIC with shared rings makes them visible to
    /// the guest and interrupts it here, once per burst. Every dispatcher
    /// that sends to a NIC or reads it calls this before it sleeps. True if
    /// the NIC held an interrupt back for the end of the dispatcher's busy
    /// period (`idle`).
    fn flush(&self, _irq: &IrqPolicy) -> bool {
        false
    }
    /// The dispatcher that flushed this NIC has no more work: deliver an
    /// interrupt held back.
    fn idle(&self) {}
    /// Whether the guest takes super-frames and partial checksums as they
    /// are (a TAP or veth always does; a virtio driver only if it
    /// negotiated them); otherwise the forwarder finishes them first.
    fn takes_offloads(&self) -> bool {
        true
    }
    /// Counters of this NIC kind, for `STATS` (` key=value` pairs).
    fn extra_stats(&self) -> String {
        String::new()
    }
}

/// A frame read from a NIC: copied into the caller's buffer, or left in
/// the guest's memory as the `InPlace` passed says.
pub enum Frame {
    Copied(Received),
    InPlace,
}

/// A frame in the guest's memory, kept mapped while this holds it: in one
/// piece, or (gathered) its headers copied to the front of the
/// dispatcher's buffer and the rest in up to `MAX_PIECES` pieces. The
/// descriptors it lies in are the device's until the NIC's next flush.
/// Each dispatcher has one, filled by `recv_in_place` frame after frame
/// (nothing allocated or moved per frame but the mapping's count).
pub struct InPlace {
    /// Bytes at the front of the dispatcher's buffer (0: none, the frame
    /// is `pieces[0]`).
    head: usize,
    /// (address, length) of each piece.
    pieces: Vec<(usize, usize)>,
    pub vnet: VnetHdr,
    mapping: Option<std::sync::Arc<dyn Send + Sync>>,
}

impl Default for InPlace {
    fn default() -> InPlace {
        InPlace { head: 0, pieces: Vec::with_capacity(MAX_PIECES), vnet: VnetHdr::default(), mapping: None }
    }
}

impl InPlace {
    /// The frame whose first `head` bytes are at the front of the
    /// dispatcher's buffer and the rest at `pieces` (address, length); with
    /// `head` 0, the whole frame is `pieces[0]`.
    ///
    /// # Safety
    /// Every piece lies inside the mapping `mapping` keeps alive.
    pub unsafe fn set(&mut self, head: usize, pieces: &[(usize, usize)], vnet: VnetHdr, mapping: std::sync::Arc<dyn Send + Sync>) {
        self.head = head;
        self.pieces.clear();
        self.pieces.extend_from_slice(&pieces[..pieces.len().min(MAX_PIECES)]);
        self.vnet = vnet;
        self.mapping = Some(mapping);
    }

    /// The frame, if it lies in one piece.
    ///
    /// # Safety (why this is sound only in part)
    /// The slice is memory the guest shares and may write while vnetd reads
    /// it (another process's writes under a `&mut [u8]`: Rust's aliasing
    /// rules do not hold for it). What vnetd decides from it can change
    /// under it: the security review (S1) had a guest flip a frame's
    /// destination MAC after vnetd routed it. Making vnetd route on a copy
    /// it owns (and typing guest memory apart) is the hostile-guest work.
    #[inline]
    pub fn whole(&mut self) -> Option<&mut [u8]> {
        match (self.head, &self.mapping, self.pieces.first()) {
            // SAFETY: the piece is inside the mapping held (the setter's
            // contract); u8 has no invalid values.
            (0, Some(_), Some(&(p, l))) => Some(unsafe { std::slice::from_raw_parts_mut(p as *mut u8, l) }),
            _ => None,
        }
    }

    /// The frame as a head that may be written (checksums are finished
    /// there) and the pieces after it, in `rest` (how many: the second
    /// value); `buf` is the dispatcher's buffer the head was copied to.
    ///
    /// # Safety (why this is sound only in part)
    /// With `head` 0 the head itself is the guest's memory, as for `whole`;
    /// otherwise the head is vnetd's copy and only the pieces after it are
    /// the guest's, which it may still write while they are sent (it can
    /// change the payload vnetd sends, not the headers it routed by).
    pub fn split<'a>(&'a mut self, buf: &'a mut [u8], rest: &mut [&'a [u8]; MAX_PIECES]) -> (&'a mut [u8], usize) {
        assert!(self.mapping.is_some(), "no frame in place");
        // SAFETY: every piece is inside the mapping held (the setters'
        // contract); u8 has no invalid values.
        let piece = |&(p, l): &(usize, usize)| unsafe { std::slice::from_raw_parts_mut(p as *mut u8, l) };
        if self.head == 0 {
            return (piece(&self.pieces[0]), 0);
        }
        for (d, p) in rest.iter_mut().zip(&self.pieces) {
            *d = piece(p);
        }
        (&mut buf[..self.head], self.pieces.len())
    }

    /// Done with the frame: its mapping may go.
    pub fn release(&mut self) {
        self.mapping = None;
    }
}

/// One received frame: `buf[start..end]`, and its offload metadata.
pub struct Received {
    pub start: usize,
    pub end: usize,
    pub vnet: VnetHdr,
}

pub(crate) fn parse_received(buf: &[u8], n: usize) -> io::Result<Received> {
    let vnet = VnetHdr::parse(&buf[..n]).ok_or_else(|| io::Error::from_raw_os_error(libc::EPROTO))?;
    Ok(Received { start: VNET_HDR_LEN, end: n, vnet })
}
