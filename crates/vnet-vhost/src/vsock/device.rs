//! The vsock device's rings (virtio 1.2, 5.10): receive (0), transmit (1)
//! and event (2, which vnetd never uses: no transport reset is ever sent),
//! its one configuration field (the guest's CID) and what the vhost-user
//! protocol does to them (`Virtio`). Kicks of the transmit and receive rings
//! and a poke are watched by one epoll set (`event_fd`), which the
//! connection thread (`mux`) waits on.

use super::packet::HDR_LEN;
use crate::counters::Counters;
use crate::device::feature;
use crate::memory::MemoryPolicy;
use crate::protocol::Virtio;
use crate::chain::Chained;
use crate::queue::Ring;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vm_memory::{GuestAddress, GuestMemoryBackend};
use vnet_sys::epoll::{self, Epoll};
use vnet_sys::eventfd::EventFd;

pub const RX: usize = 0;
pub const TX: usize = 1;
pub const EVENT: usize = 2;
const QUEUES: usize = 3;

/// What the device offers: a modern device (no stream type beyond STREAM,
/// no event index: the guest kicks for each chain and vnetd never has to
/// re-arm).
pub const OFFERED: u64 = feature::VERSION_1 | feature::INDIRECT_DESC | feature::PROTOCOL_FEATURES;

/// Tokens of the device's epoll set.
pub const TOKEN_POKE: u64 = 100;
pub const TOKEN_KICK: u64 = 101; // + ring

/// One VM's vsock device.
pub struct Device {
    rings: [Mutex<Ring>; QUEUES],
    cid: u64,
    memory: MemoryPolicy,
    pub counters: Arc<Counters>,
    acked: AtomicU64,
    epoll: Epoll,
    poke: EventFd,
}

impl Device {
    /// A device for the guest `cid` (3 or more: 0-2 are the hypervisor's,
    /// the local and the host's).
    pub fn new(cid: u64, memory: MemoryPolicy) -> io::Result<Device> {
        if cid < 3 || cid >= u64::from(u32::MAX) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("guest CID {cid}: must be from 3 to {}", u32::MAX - 1)));
        }
        let counters = Arc::new(Counters::default());
        let d = Device {
            rings: std::array::from_fn(|_| Mutex::new(Ring::new(counters.clone()))),
            cid,
            memory,
            counters,
            acked: AtomicU64::new(0),
            epoll: Epoll::new(0)?,
            poke: EventFd::new()?,
        };
        d.epoll.add(d.poke.as_raw_fd(), epoll::IN, TOKEN_POKE)?;
        Ok(d)
    }

    pub fn cid(&self) -> u64 {
        self.cid
    }

    /// The descriptor that is readable when a ring was kicked or poked.
    pub fn event_fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    /// Wakes the connection thread.
    pub fn poke(&self) {
        let _ = self.poke.notify();
    }

    pub fn drain_poke(&self) {
        self.poke.drain();
    }

    /// Both rings' kicks consumed (the thread then looks at both).
    pub fn clear_kicks(&self) {
        for i in [RX, TX, EVENT] {
            self.ring(i).clear_kick();
        }
    }

    /// Whether the receive and transmit rings run.
    pub fn running(&self) -> bool {
        self.ring(RX).running() && self.ring(TX).running()
    }
}

impl Virtio<()> for Device {
    fn queues(&self) -> usize {
        QUEUES
    }
    fn ring(&self, i: usize) -> MutexGuard<'_, Ring> {
        self.rings[i].lock().unwrap_or_else(|e| e.into_inner())
    }
    fn counters(&self) -> &Counters {
        &self.counters
    }
    fn memory_policy(&self) -> MemoryPolicy {
        self.memory
    }
    fn features(&self) -> u64 {
        OFFERED
    }
    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        // QEMU's vhost-user-vsock reads the guest's CID from the backend.
        VhostUserProtocolFeatures::CONFIG
    }
    fn set_acked(&self, features: u64) {
        self.acked.store(features, Relaxed);
    }
    fn config(&self) -> Option<Vec<u8>> {
        // struct virtio_vsock_config { le64 guest_cid; }
        Some(self.cid.to_le_bytes().to_vec())
    }
    fn watched(&self, _i: usize) -> bool {
        true
    }
    fn watch_kick(&self, i: usize, old: Option<RawFd>, new: Option<RawFd>) {
        if let Some(o) = old {
            self.epoll.delete(o);
        }
        if let Some(n) = new {
            let _ = self.epoll.add(n, epoll::IN, TOKEN_KICK + i as u64);
        }
    }
    fn note_running(&self, _i: usize, _running: bool) {}
    fn go(&self, _i: usize, _r: &mut Ring, _starting: bool) {
        // Whatever waited (chains queued before, connections with bytes
        // for the guest) is looked at.
        self.poke();
    }
}

/// The bytes of a chain's buffers, after its first `skip`, as host
/// pointers (for readv/writev straight between a socket and the guest's
/// memory): at most `max` bytes, in `out`. False if a buffer is not in
/// the guest's memory.
pub fn host_iovecs(r: &Ring, segs: &[(GuestAddress, usize)], mut skip: usize, max: usize, out: &mut Vec<libc::iovec>) -> bool {
    out.clear();
    let Some(mem) = r.mem.as_deref() else { return false };
    let mut left = max;
    for &(addr, len) in segs {
        if left == 0 {
            break;
        }
        if skip >= len {
            skip -= len;
            continue;
        }
        let n = (len - skip).min(left);
        let Ok(s) = mem.get_slice(GuestAddress(addr.0.wrapping_add(skip as u64)), n) else { return false };
        out.push(libc::iovec { iov_base: s.ptr_guard_mut().as_ptr().cast(), iov_len: n });
        left -= n;
        skip = 0;
    }
    true
}

/// Copies the first `buf.len()` bytes of a chain (the header) out of the
/// guest's memory; false if they are not all there.
pub fn read_head(r: &Ring, segs: &[(GuestAddress, usize)], buf: &mut [u8]) -> bool {
    copy_out(r, segs, 0, buf)
}

/// Writes `buf` at the start of a chain's buffers.
pub fn write_head(r: &Ring, segs: &[(GuestAddress, usize)], buf: &[u8]) -> bool {
    let Some(mem) = r.mem.as_deref() else { return false };
    let mut done = 0;
    for &(addr, len) in segs {
        if done == buf.len() {
            break;
        }
        let n = len.min(buf.len() - done);
        if mem.write(&buf[done..done + n], addr).is_err() {
            return false;
        }
        done += n;
    }
    done == buf.len()
}

/// The payload room of a receive chain (its bytes after the header).
pub fn room(segs: &[(GuestAddress, usize)]) -> usize {
    segs.iter().map(|s| s.1).sum::<usize>().saturating_sub(HDR_LEN)
}

/// Takes the next chain of ring `i`, holding at least a header.
pub fn pop(r: &mut Ring, writable: bool, segs: &mut Vec<(GuestAddress, usize)>) -> Chained {
    r.pop_chain(writable, HDR_LEN, segs)
}

/// Copies a chain's bytes from offset `skip` into `out` (all of it).
pub fn copy_out(r: &Ring, segs: &[(GuestAddress, usize)], mut skip: usize, out: &mut [u8]) -> bool {
    let Some(mem) = r.mem.as_deref() else { return false };
    let mut done = 0;
    for &(addr, len) in segs {
        if done == out.len() {
            break;
        }
        if skip >= len {
            skip -= len;
            continue;
        }
        let n = (len - skip).min(out.len() - done);
        if mem.read(&mut out[done..done + n], GuestAddress(addr.0.wrapping_add(skip as u64))).is_err() {
            return false;
        }
        done += n;
        skip = 0;
    }
    done == out.len()
}
