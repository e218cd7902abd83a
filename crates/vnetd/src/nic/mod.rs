//! Virtual NICs: how guest frames enter and leave the daemon.
//!
//! Each kind implements `VirtualNic`:
//! - `netns` (`Tap`): vnetd holds the TAP's file side; the network device
//!   is the guest's NIC (moved into a guest namespace or container). The
//!   TAP itself (`tap.rs`) is also what the QEMU kind and the fast path's
//!   upcall build on.
//! - `QemuNic`: QEMU holds the file side (`-netdev tap,ifname=..`); vnetd
//!   meets the TAP device through the fast path (`upcall.rs`) or a packet
//!   socket.
//! - `VethNic`: a veth pair, the guest's end in its namespace; the kernel
//!   fast path attaches to the host's end (`veth.rs`).
//! - `VhostUserNic`: the VMM shares the guest's memory and virtio rings
//!   over a vhost-user socket; dispatchers work the rings (`vhost_user.rs`,
//!   the device itself in the `vnet-vhost` crate).
//! - `DummyNic`: no device; frames injected and kept by hand, for driving
//!   the datapath in unit tests and fuzz targets (`dummy.rs`).
//!
//! A kind is one module behind `NicKind` (how `INTERFACE ADD` makes one),
//! listed once in `kinds.rs`. Persistent TAPs (`netns` and `qemu` kinds) carry vnetd's mark (`rtnl`);
//! only marked ones are taken over, un-persisted or deleted.

pub mod dummy;
pub mod kinds;
pub mod netns;
pub mod qemu;
pub mod tap;
pub mod upcall;
pub mod veth;
pub mod vhost_user;

use crate::settings::IrqPolicy;
use std::io;
use std::os::fd::RawFd;
use vnet_core::offload::{VnetHdr, VNET_HDR_LEN};
pub use vnet_vhost::GuestFrame;

pub use dummy::DummyNic;

/// What `INTERFACE ADD` asks for, as a NIC kind sees it.
pub struct NicSpec<'a> {
    pub name: &'a str,
    pub mac: vnet_core::Mac,
    pub mtu: u32,
    pub attach: vnet_core::command::Attach,
    pub netns: Option<&'a str>,
    /// A vhost-user NIC's socket (a plain name in `vhost_dir`, or a path
    /// there).
    pub socket: Option<&'a str>,
    pub vhost_dir: &'a std::path::Path,
    /// A veth's name in the guest's namespace, if not `name`.
    pub ifname: Option<&'a str>,
    /// The id the interface will have (the fast path's port number).
    pub id: u32,
    /// Where a NIC reports its guest starting or stopping (`running`).
    pub changes: &'a std::sync::Arc<crate::stats::Changes>,
    /// The kernel fast path, if loaded (where a NIC on a kernel device
    /// attaches).
    pub kernel: Option<&'a std::sync::Arc<vnet_fastpath::Kernel>>,
}

/// A kind of NIC: one module, one line in `kinds::ALL`.
pub trait NicKind: Sync {
    /// Whether it makes the NICs of this attachment.
    fn takes(&self, attach: &vnet_core::command::Attach) -> bool;
    /// Makes one.
    fn make(&self, spec: &NicSpec) -> Result<Box<dyn VirtualNic>, String>;
}

/// A guest's virtual NIC, as the dispatcher uses it; the dispatcher never
/// asks which kind it has. `recv`, `send` and `event_fd` are what a NIC
/// behind a file descriptor needs; the vhost-user NIC added the ones
/// shared rings need (its own `recv_burst`, `arriving`, `flush`, `idle`,
/// `takes_offloads`), each a loop over `recv` or a no-op by default.
pub trait VirtualNic: Send + Sync {
    /// Reads one frame without blocking: `buf[start..end]`, with its offload
    /// metadata (every NIC kind here speaks virtio-net headers, so a guest's
    /// super-frames and partial checksums arrive labelled).
    fn recv(&self, buf: &mut [u8]) -> io::Result<Received>;
    /// How many queues the NIC takes frames from, each a source of its own
    /// that one dispatcher drains (`recv_burst`, `event_fd`, `set_notify`):
    /// a multi-queue vhost-user NIC's pairs; 1 for the others.
    fn queues(&self) -> usize {
        1
    }
    /// Reads up to `quota` frames of queue `queue` without blocking, handing each to `each`
    /// as it comes (the burst is the unit: a NIC with shared rings holds
    /// its ring once for all of them). Given `rx.in_place`, a NIC that
    /// shares the guest's memory may leave most of a frame where it lies
    /// (cut-through): its headers are copied there, the rest noted, and
    /// `each` must be done with it when it returns. An error other than
    /// "nothing waits" ends the burst.
    fn recv_burst(&self, _queue: usize, rx: &mut RxBuffers, quota: usize, each: &mut dyn FnMut(RxFrame)) -> io::Result<()> {
        for _ in 0..quota {
            match self.recv(rx.buf) {
                Ok(r) => each(RxFrame::Copied(&mut rx.buf[r.start..r.end], r.vnet)),
                Err(e) if e.raw_os_error() == Some(libc::EMSGSIZE) => each(RxFrame::Oversize),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
    /// Sends one frame made of `parts`, with offload metadata `vnet` (all
    /// zero for a plain frame); returns the frame's length.
    fn send(&self, vnet: &VnetHdr, parts: &[&[u8]]) -> io::Result<usize>;
    /// Sends a burst of plain frames (each one piece, all with offload
    /// metadata `vnet`), telling `done` of each in turn: its length, or why
    /// it was dropped. A NIC with shared rings holds its ring once for all.
    fn send_burst(&self, vnet: &VnetHdr, frames: &mut dyn Iterator<Item = &[u8]>, done: &mut dyn FnMut(io::Result<usize>)) {
        for f in frames {
            done(self.send(vnet, &[f]));
        }
    }
    /// A descriptor that is readable while frames wait in queue `queue`:
    /// its dispatcher watches it while the NIC runs guest-driven.
    fn event_fd(&self, queue: usize) -> RawFd;
    /// Notifications for queue `queue` on (guest-driven: the dispatcher sleeps until a frame)
    /// or off (VMM-driven: it polls). For a TAP the dispatcher's epoll
    /// membership is the whole switch; a NIC with shared rings would also
    /// tell the guest here (virtio's `VRING_USED_F_NO_NOTIFY`).
    fn set_notify(&self, _queue: usize, _on: bool) {}
    /// Whether a guest works this NIC now. A VM's vhost-user NIC runs while
    /// its rings do: not yet on the host a VM is migrating to (QEMU starts
    /// them when the VM resumes there), no more on the host it left, nor
    /// while its VMM is away. vnet-agent claims only a running interface's
    /// MAC, so the overlay follows the running VM. A NIC whose answer
    /// changes bumps `stats::Changes` (control clients `WAIT` on it).
    fn running(&self) -> bool {
        true
    }
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
    /// The frames this dispatcher took from queue `queue` this pass have
    /// left (its flush is done): a NIC with shared rings hands their
    /// buffers back to the guest now, never before (cut-through sends them
    /// from there). Only the queue's own dispatcher calls it.
    fn release(&self, _queue: usize) {}
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

/// Where a burst's frames are read to: the dispatcher's buffer, reused
/// frame after frame, and, when cut-through is on, its `GuestFrame`.
pub struct RxBuffers<'a> {
    pub buf: &'a mut [u8],
    pub in_place: Option<&'a mut GuestFrame>,
}

/// One frame of a burst, as `VirtualNic::recv_burst` hands it over.
pub enum RxFrame<'a> {
    /// Copied: the frame, with its offload metadata.
    Copied(&'a mut [u8], VnetHdr),
    /// Cut through: its headers copied into the `GuestFrame`, the rest where
    /// it lies in guest memory.
    InPlace(&'a mut GuestFrame),
    /// Longer than the buffer: not read (the guest has it back); the
    /// dispatcher counts the drop.
    Oversize,
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
