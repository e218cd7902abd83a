//! The vhost-user protocol, from the device's side: what a frontend (QEMU,
//! cloud-hypervisor, DPDK's virtio-user) sets up is applied to the NIC's two
//! rings. The `vhost` crate reads and answers the messages; this is what
//! each one does to a virtio-net device.
//!
//! `vhost-user-backend`'s daemon is not used: it serves each queue's kicks
//! from its own threads, and VNET's dispatchers (pinned by `--cpus`, in the
//! papers' modes) must own them.

use super::ring::{Memory, Ring, MAX_QUEUE_SIZE};
use super::Shared;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserConfigFlags, VhostUserInflight, VhostUserLog,
    VhostUserMemoryRegion, VhostUserProtocolFeatures, VhostUserShMemConfig, VhostUserSharedMsg,
    VhostUserSingleMemoryRegion, VhostUserVringAddrFlags, VhostUserVringState,
};
use vhost::vhost_user::{Error, GpuBackend, Result, VhostUserBackendReqHandlerMut};
use vhost::VhostUserMemoryRegionBase;
use virtio_queue::QueueT;
use vm_memory::{GuestAddress, GuestMemoryMmap, GuestRegionMmap};

/// Feature bits (virtio 1.2, 5.1.3 and 6).
pub mod feature {
    pub const CSUM: u64 = 1 << 0;
    pub const GUEST_CSUM: u64 = 1 << 1;
    pub const GUEST_TSO4: u64 = 1 << 7;
    pub const GUEST_TSO6: u64 = 1 << 8;
    pub const GUEST_ECN: u64 = 1 << 9;
    pub const HOST_TSO4: u64 = 1 << 11;
    pub const HOST_TSO6: u64 = 1 << 12;
    pub const HOST_ECN: u64 = 1 << 13;
    pub const MRG_RXBUF: u64 = 1 << 15;
    pub const INDIRECT_DESC: u64 = 1 << 28;
    pub const EVENT_IDX: u64 = 1 << 29;
    pub const PROTOCOL_FEATURES: u64 = 1 << 30;
    pub const VERSION_1: u64 = 1 << 32;
    /// What vnetd offers: what a modern guest uses. Offloads both ways, so
    /// that a guest's 64 KiB segments cross whole and merged runs reach it
    /// whole; one queue pair (a NIC is served by one dispatcher).
    pub const OFFERED: u64 = CSUM
        | GUEST_CSUM
        | GUEST_TSO4
        | GUEST_TSO6
        | GUEST_ECN
        | HOST_TSO4
        | HOST_TSO6
        | HOST_ECN
        | MRG_RXBUF
        | INDIRECT_DESC
        | EVENT_IDX
        | PROTOCOL_FEATURES
        | VERSION_1;
}

/// Queue 0 receives (vnetd → guest), queue 1 transmits.
pub const RX: usize = 0;
pub const TX: usize = 1;

/// One frontend connection's view of the device.
pub struct Frontend {
    shared: Arc<Shared>,
    acked: u64,
    /// (frontend's virtual address, size, guest physical address) of each
    /// memory region: ring addresses come as the frontend's addresses.
    mappings: Vec<(u64, u64, u64)>,
}

impl Frontend {
    pub fn new(shared: Arc<Shared>) -> Frontend {
        let f = Frontend { shared, acked: 0, mappings: Vec::new() };
        f.reset();
        f
    }

    /// Both rings back to nothing, guest memory let go (a reset, or the
    /// frontend went away).
    pub fn reset(&self) {
        for i in [RX, TX] {
            let mut r = self.shared.ring(i).lock().unwrap();
            if i == TX {
                self.shared.watch_kick(r.kick.as_ref(), None);
            }
            r.reset();
            r.mem = None;
        }
        self.shared.acked.store(0, Relaxed);
    }

    fn ring(&self, index: u32) -> Result<std::sync::MutexGuard<'_, Ring>> {
        match index as usize {
            RX | TX => Ok(self.shared.ring(index as usize).lock().unwrap()),
            _ => Err(Error::InvalidParam),
        }
    }

    fn gpa(&self, va: u64) -> Result<u64> {
        self.mappings
            .iter()
            .find(|(base, size, _)| va >= *base && va - base < *size)
            .map(|(base, _, gpa)| va - base + gpa)
            .ok_or(Error::InvalidParam)
    }

    /// A ring that has all it needs starts; the dispatcher is told so it
    /// looks at frames the guest queued before.
    fn start(&self, index: u32, r: &mut Ring) {
        if r.running() || !r.try_start() {
            return;
        }
        if r.running() {
            tracing::debug!(queue = index, "vhost-user ring started");
            if index as usize == TX {
                self.shared.poke();
            }
        }
    }
}

fn unsupported<T>(what: &'static str) -> Result<T> {
    Err(Error::InvalidOperation(what))
}

impl VhostUserBackendReqHandlerMut for Frontend {
    fn set_owner(&mut self) -> Result<()> {
        Ok(())
    }

    fn reset_owner(&mut self) -> Result<()> {
        self.reset();
        Ok(())
    }

    fn reset_device(&mut self) -> Result<()> {
        self.reset();
        Ok(())
    }

    fn get_features(&mut self) -> Result<u64> {
        Ok(feature::OFFERED)
    }

    fn set_features(&mut self, features: u64) -> Result<()> {
        tracing::debug!("vhost-user features acked: {features:#x}");
        if features & !feature::OFFERED != 0 {
            return Err(Error::InvalidParam);
        }
        self.acked = features;
        self.shared.acked.store(features, Relaxed);
        for i in [RX, TX] {
            let mut r = self.shared.ring(i).lock().unwrap();
            r.queue.set_event_idx(features & feature::EVENT_IDX != 0);
        }
        Ok(())
    }

    fn set_mem_table(&mut self, ctx: &[VhostUserMemoryRegion], files: Vec<File>, postcopy: Option<bool>) -> Result<Option<Vec<VhostUserMemoryRegionBase>>> {
        if postcopy.is_some() || ctx.len() != files.len() {
            return Err(Error::InvalidParam);
        }
        let mut regions = Vec::with_capacity(ctx.len());
        let mut mappings = Vec::with_capacity(ctx.len());
        for (region, file) in ctx.iter().zip(files) {
            // A mapping past the file's end faults (SIGBUS) when touched: the
            // frontend's file must hold the whole region.
            let len = file.metadata().map_err(|_| Error::InvalidParam)?.len();
            let (size, offset) = (region.memory_size, region.mmap_offset);
            if offset.checked_add(size).is_none_or(|end| end > len) || size == 0 {
                tracing::info!(size, offset, file = len, "vhost-user memory region past its file's end refused");
                return Err(Error::InvalidParam);
            }
            let mapped = region.mmap_region(file)?;
            let r = GuestRegionMmap::new(mapped, GuestAddress(region.guest_phys_addr)).ok_or(Error::InvalidParam)?;
            mappings.push((region.user_addr, region.memory_size, region.guest_phys_addr));
            regions.push(r);
        }
        let mem: Arc<Memory> = Arc::new(GuestMemoryMmap::from_regions(regions).map_err(|_| Error::InvalidParam)?);
        self.mappings = mappings;
        for i in [RX, TX] {
            self.shared.ring(i).lock().unwrap().mem = Some(mem.clone());
        }
        Ok(None)
    }

    fn set_vring_num(&mut self, index: u32, num: u32) -> Result<()> {
        tracing::debug!(index, ?num, "vhost-user set_vring_num");
        let mut r = self.ring(index)?;
        if num == 0 || num > u32::from(MAX_QUEUE_SIZE) || !num.is_power_of_two() {
            return Err(Error::InvalidParam);
        }
        r.queue.set_size(num as u16);
        Ok(())
    }

    fn set_vring_addr(&mut self, index: u32, _flags: VhostUserVringAddrFlags, desc: u64, used: u64, avail: u64, _log: u64) -> Result<()> {
        tracing::debug!(index, desc, used, avail, "vhost-user set_vring_addr");
        let (desc, used, avail) = (self.gpa(desc)?, self.gpa(used)?, self.gpa(avail)?);
        let mut r = self.ring(index)?;
        let q = &mut r.queue;
        q.try_set_desc_table_address(GuestAddress(desc)).map_err(|_| Error::InvalidParam)?;
        q.try_set_avail_ring_address(GuestAddress(avail)).map_err(|_| Error::InvalidParam)?;
        q.try_set_used_ring_address(GuestAddress(used)).map_err(|_| Error::InvalidParam)?;
        Ok(())
    }

    fn set_vring_base(&mut self, index: u32, base: u32) -> Result<()> {
        tracing::debug!(index, ?base, "vhost-user set_vring_base");
        let mut r = self.ring(index)?;
        r.queue.set_next_avail(base as u16);
        Ok(())
    }

    fn get_vring_base(&mut self, index: u32) -> Result<VhostUserVringState> {
        tracing::debug!(index, "vhost-user get_vring_base");
        let mut r = self.ring(index)?;
        // The ring stops: publish what was done, then say where it stopped.
        r.publish();
        let next = r.queue.next_avail();
        if index as usize == TX {
            self.shared.watch_kick(r.kick.as_ref(), None);
        }
        r.queue.set_ready(false);
        r.kick = None;
        r.call = None;
        Ok(VhostUserVringState::new(index, u32::from(next)))
    }

    fn set_vring_kick(&mut self, index: u8, fd: Option<File>) -> Result<()> {
        tracing::debug!(index, fd = fd.is_some(), "vhost-user set_vring_kick");
        let mut r = self.ring(u32::from(index))?;
        if let Some(f) = &fd {
            // SAFETY: fcntl on a descriptor we were given.
            unsafe { libc::fcntl(f.as_raw_fd(), libc::F_SETFL, libc::fcntl(f.as_raw_fd(), libc::F_GETFL) | libc::O_NONBLOCK) };
        }
        if usize::from(index) == TX {
            self.shared.watch_kick(r.kick.as_ref(), fd.as_ref());
        }
        r.kick = fd;
        self.start(u32::from(index), &mut r);
        Ok(())
    }

    fn set_vring_call(&mut self, index: u8, fd: Option<File>) -> Result<()> {
        tracing::debug!(index, fd = fd.is_some(), "vhost-user set_vring_call");
        let mut r = self.ring(u32::from(index))?;
        r.call = fd;
        Ok(())
    }

    fn set_vring_err(&mut self, index: u8, _fd: Option<File>) -> Result<()> {
        self.ring(u32::from(index)).map(|_| ())
    }

    fn get_protocol_features(&mut self) -> Result<VhostUserProtocolFeatures> {
        Ok(VhostUserProtocolFeatures::REPLY_ACK)
    }

    fn set_protocol_features(&mut self, _features: u64) -> Result<()> {
        Ok(())
    }

    fn get_queue_num(&mut self) -> Result<u64> {
        Ok(2)
    }

    fn set_vring_enable(&mut self, index: u32, enable: bool) -> Result<()> {
        tracing::debug!(index, ?enable, "vhost-user set_vring_enable");
        let mut r = self.ring(index)?;
        r.enabled = enable;
        if enable {
            self.start(index, &mut r);
            // Frames the guest queued while the ring was disabled: their
            // kicks were consumed then, so the dispatcher is told to look.
            if index as usize == TX && r.running() {
                self.shared.poke();
            }
        }
        Ok(())
    }

    fn get_config(&mut self, _offset: u32, _size: u32, _flags: VhostUserConfigFlags) -> Result<Vec<u8>> {
        unsupported("config space is the frontend's")
    }

    fn set_config(&mut self, _offset: u32, _buf: &[u8], _flags: VhostUserConfigFlags) -> Result<()> {
        unsupported("config space is the frontend's")
    }

    fn set_gpu_socket(&mut self, _gpu: GpuBackend) -> Result<()> {
        unsupported("not a GPU")
    }

    fn get_shared_object(&mut self, _uuid: VhostUserSharedMsg) -> Result<File> {
        unsupported("no shared objects")
    }

    fn get_inflight_fd(&mut self, _inflight: &VhostUserInflight) -> Result<(VhostUserInflight, File)> {
        unsupported("no inflight tracking (a network device resends nothing)")
    }

    fn set_inflight_fd(&mut self, _inflight: &VhostUserInflight, _file: File) -> Result<()> {
        unsupported("no inflight tracking")
    }

    fn get_max_mem_slots(&mut self) -> Result<u64> {
        unsupported("memory slots not offered")
    }

    fn add_mem_region(&mut self, _region: &VhostUserSingleMemoryRegion, _fd: File, _postcopy: Option<bool>) -> Result<Option<VhostUserMemoryRegionBase>> {
        unsupported("memory slots not offered")
    }

    fn remove_mem_region(&mut self, _region: &VhostUserSingleMemoryRegion) -> Result<()> {
        unsupported("memory slots not offered")
    }

    fn set_device_state_fd(&mut self, _d: VhostTransferStateDirection, _p: VhostTransferStatePhase, _fd: File) -> Result<Option<File>> {
        unsupported("no device state to transfer")
    }

    fn check_device_state(&mut self) -> Result<()> {
        unsupported("no device state to transfer")
    }

    fn get_shmem_config(&mut self) -> Result<VhostUserShMemConfig> {
        unsupported("no shared memory regions")
    }

    fn set_log_base(&mut self, _log: &VhostUserLog, _file: File) -> Result<()> {
        unsupported("no dirty-page logging (live migration is not offered)")
    }
}
