//! The vhost-user protocol, from the device's side: what a frontend (QEMU,
//! cloud-hypervisor, DPDK's virtio-user) sets up is applied to the device's
//! queue pairs. The `vhost` crate reads and answers the messages; this is what
//! each one does to a device (the virtio-net one, `Device`, or the vsock one,
//! `vsock::Device`, each behind `Virtio`), and what it refuses: memory files
//! that can shrink (`memory`), call and kick descriptors that are not
//! eventfds (`notify`), queue sizes past `MAX_QUEUE_SIZE`, addresses outside
//! the memory table. Each refusal is an error reply and a counter.
//!
//! `vhost-user-backend`'s daemon is not used: it serves each queue's kicks
//! from its own threads, and VNET's dispatchers (pinned by `--cpus`, in the
//! papers' modes) must own them.

use crate::counters::Counters;
use crate::device::{feature, pair_of, Device};
use crate::dirty::LogMap;
use crate::memory::{DirtyLog, GuestMemory, MemoryPolicy};
use crate::notify::{Kick, Notifier};
use crate::queue::{Ring, MAX_QUEUE_SIZE};
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
use vm_memory::GuestAddress;

/// What the protocol needs of a device: its rings, its features and
/// configuration, and what a ring starting, stopping or changing its kick
/// means to it. The net device and the vsock device implement it; every
/// check on what the frontend sends (memory, descriptors, sizes, addresses)
/// is the protocol's, the same for both.
pub trait Virtio<B: DirtyLog>: Send + Sync {
    /// How many queues it has.
    fn queues(&self) -> usize;
    /// Queue `i`, locked.
    fn ring(&self, i: usize) -> std::sync::MutexGuard<'_, Ring<B>>;
    fn counters(&self) -> &Counters;
    fn memory_policy(&self) -> MemoryPolicy;
    /// The virtio feature bits it offers.
    fn features(&self) -> u64;
    /// The vhost-user protocol features it offers beyond REPLY_ACK.
    fn protocol_features(&self) -> VhostUserProtocolFeatures;
    /// The frontend acknowledged `features` (0: reset).
    fn set_acked(&self, features: u64);
    /// Its configuration space (`GET_CONFIG`), if it has one of its own.
    fn config(&self) -> Option<Vec<u8>> {
        None
    }
    /// Whether queue `i`'s kicks are watched (the net device: transmit
    /// queues only); `watch_kick` is told of each change of theirs.
    fn watched(&self, i: usize) -> bool;
    fn watch_kick(&self, i: usize, old: Option<std::os::fd::RawFd>, new: Option<std::os::fd::RawFd>);
    /// Queue `i` runs or not (after any message that may have changed it).
    fn note_running(&self, i: usize, running: bool);
    /// A running queue `i` takes from where its ring stands now.
    fn mark_taken(&self, _i: usize, _r: &Ring<B>) {}
    /// Queue `i` just started (`starting`), or was enabled while running:
    /// whatever waits for it is looked at.
    fn go(&self, i: usize, r: &mut Ring<B>, starting: bool);
    /// Queue `i` stops; `migrating`: the frontend logs dirty pages (a live
    /// migration's end: the guest goes on elsewhere).
    fn stopping(&self, _i: usize, _r: &mut Ring<B>, _migrating: bool) {}
}

impl<B: DirtyLog> Virtio<B> for Device<B> {
    fn queues(&self) -> usize {
        Device::queues(self)
    }
    fn ring(&self, i: usize) -> std::sync::MutexGuard<'_, Ring<B>> {
        Device::ring(self, i)
    }
    fn counters(&self) -> &Counters {
        &self.counters
    }
    fn memory_policy(&self) -> MemoryPolicy {
        self.memory
    }
    fn features(&self) -> u64 {
        feature::offered::<B>()
    }
    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        let log = if B::LOGS { VhostUserProtocolFeatures::LOG_SHMFD } else { VhostUserProtocolFeatures::empty() };
        VhostUserProtocolFeatures::MQ | log
    }
    fn set_acked(&self, features: u64) {
        self.acked.store(features, Relaxed);
    }
    fn watched(&self, i: usize) -> bool {
        !pair_of(i).1
    }
    fn watch_kick(&self, i: usize, old: Option<std::os::fd::RawFd>, new: Option<std::os::fd::RawFd>) {
        Device::watch_kick(self, i, old, new)
    }
    fn note_running(&self, i: usize, running: bool) {
        Device::note_running(self, i, running)
    }
    fn mark_taken(&self, i: usize, r: &Ring<B>) {
        Device::mark_taken(self, i, r)
    }
    fn go(&self, i: usize, r: &mut Ring<B>, starting: bool) {
        if pair_of(i).1 {
            // Frames held for the guest while its ring was down or disabled.
            if starting {
                r.held.resume();
            }
            self.release_held(r);
        } else {
            // Frames the guest queued before: their kicks came earlier.
            self.poke(i);
        }
    }
    fn stopping(&self, i: usize, r: &mut Ring<B>, migrating: bool) {
        if migrating && pair_of(i).1 {
            // Frames for it from here are dropped as for a ring down
            // (`drop_down`), not held for a start that never comes here.
            r.held.leave(&self.counters);
        }
    }
}

/// One frontend connection's view of the device (`D`: the net device
/// unless said).
pub struct Frontend<B: DirtyLog = (), D: Virtio<B> = Device<B>> {
    pub(crate) shared: Arc<D>,
    pub(crate) acked: u64,
    /// The protocol features the frontend acknowledged.
    pub(crate) protocol: u64,
    /// The memory table in force: ring addresses come as the frontend's
    /// addresses, translated through it.
    pub(crate) mem: Option<Arc<GuestMemory<B>>>,
    /// That table as the frontend gave it, with its files (for a hand-over
    /// to the next vnetd: `state`).
    pub(crate) table: Vec<(VhostUserMemoryRegion, File)>,
    /// The frontend's dirty-page log (`SET_LOG_BASE`), and whether it asks
    /// for writes to be logged now (`VHOST_F_LOG_ALL` acknowledged).
    pub(crate) log: Option<Arc<LogMap>>,
    pub(crate) logging: bool,
}

impl<B: DirtyLog, D: Virtio<B>> Frontend<B, D> {
    pub fn new(shared: Arc<D>) -> Frontend<B, D> {
        let mut f = Frontend { shared, acked: 0, protocol: 0, mem: None, table: Vec::new(), log: None, logging: false };
        f.reset();
        f
    }

    /// Every ring back to nothing, guest memory and the log let go (a
    /// reset, or the frontend went away).
    pub fn reset(&mut self) {
        self.logging = false;
        self.log = None;
        self.table.clear();
        self.mem = None;
        self.apply_log();
        for i in 0..self.shared.queues() {
            let mut r = self.shared.ring(i);
            if self.shared.watched(i) {
                self.shared.watch_kick(i, r.kick.as_ref().map(|k| k.as_raw_fd()), None);
            }
            r.reset();
            r.mem = None;
            self.shared.note_running(i, false);
        }
        self.shared.set_acked(0);
    }

    /// The log where writes go now, if the frontend asks for one.
    fn log_in_force(&self) -> Option<&Arc<LogMap>> {
        self.log.as_ref().filter(|_| self.logging)
    }

    /// Points guest memory's writes at the log in force (or nowhere), then
    /// frees the views replaced once no writer can hold one: every write
    /// into guest memory is made under a ring lock, so each ring's lock is
    /// taken once after the swap (one at a time: the lock order).
    fn apply_log(&self) {
        let Some(mem) = &self.mem else { return };
        let stale = mem.set_log(self.log_in_force());
        for i in 0..self.shared.queues() {
            drop(self.shared.ring(i));
        }
        drop(stale);
    }

    fn ring(&self, index: u32) -> Result<std::sync::MutexGuard<'_, Ring<B>>> {
        match index as usize {
            i if i < self.shared.queues() => Ok(self.shared.ring(i)),
            _ => Err(Error::InvalidParam),
        }
    }

    fn gpa(&self, va: u64) -> Result<u64> {
        self.mem.as_ref().and_then(|m| m.gpa(va)).ok_or(Error::InvalidParam)
    }

    /// A ring that has all it needs starts; the dispatcher is told so it
    /// looks at frames the guest queued before.
    pub(crate) fn start(&self, index: u32, r: &mut Ring<B>) {
        let i = index as usize;
        if r.running() || !r.try_start() {
            self.shared.note_running(i, r.running());
            self.shared.mark_taken(i, r);
            return;
        }
        self.shared.mark_taken(i, r);
        if r.running() {
            // Where it starts, against where the ring it follows stopped
            // ("vhost-user ring stopped"): after a migration or a
            // reconnect, the two must match (no frame taken twice or
            // skipped), and `next_avail == used` (nothing claimed in flight).
            tracing::info!(queue = index, next_avail = r.queue.next_avail(), used = r.queue.next_used(), "vhost-user ring started");
            self.shared.note_running(i, true);
            // Whatever a vnetd before us published and did not interrupt
            // for (killed between the two), the guest hears of it now
            // (`start_interrupts`).
            if r.signal() {
                self.shared.counters().start_interrupts.fetch_add(1, Relaxed);
            }
            self.shared.go(i, r, true);
        }
    }
}

fn unsupported<T>(what: &'static str) -> Result<T> {
    Err(Error::InvalidOperation(what))
}

impl<B: DirtyLog, D: Virtio<B>> VhostUserBackendReqHandlerMut for Frontend<B, D> {
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
        Ok(self.shared.features())
    }

    fn set_features(&mut self, features: u64) -> Result<()> {
        tracing::debug!("vhost-user features acked: {features:#x}");
        if features & !self.shared.features() != 0 {
            return Err(Error::InvalidParam);
        }
        self.acked = features;
        // Logging starts (a migration's pre-copy) or stops (it ended, or
        // was cancelled) with LOG_ALL, at run time, rings running.
        let logging = features & feature::LOG_ALL != 0;
        if logging != self.logging {
            self.logging = logging;
            tracing::info!(logging, "vhost-user dirty-page logging {}", if logging { "on" } else { "off" });
            self.apply_log();
        }
        self.shared.set_acked(features);
        for i in 0..self.shared.queues() {
            let mut r = self.shared.ring(i);
            r.queue.set_event_idx(features & feature::EVENT_IDX != 0);
        }
        Ok(())
    }

    fn set_mem_table(&mut self, ctx: &[VhostUserMemoryRegion], files: Vec<File>, postcopy: Option<bool>) -> Result<Option<Vec<VhostUserMemoryRegionBase>>> {
        if postcopy.is_some() {
            return Err(Error::InvalidParam);
        }
        let copies: Vec<File> = files.iter().filter_map(|f| f.try_clone().ok()).collect();
        let mem = match GuestMemory::map(ctx, files, self.shared.memory_policy()) {
            Ok(m) => m,
            Err(e) => {
                self.shared.counters().refused_memory.fetch_add(1, Relaxed);
                tracing::warn!("vhost-user memory table refused: {}", e.0);
                return Err(Error::InvalidParam);
            }
        };
        // The new memory logs from its first write, before a ring has it.
        drop(mem.set_log(self.log_in_force()));
        self.table = if copies.len() == ctx.len() { ctx.iter().copied().zip(copies).collect() } else { Vec::new() };
        self.mem = Some(mem.clone());
        for i in 0..self.shared.queues() {
            self.shared.ring(i).mem = Some(mem.clone());
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
        // Stopped while the frontend logs dirty pages: a live migration's
        // end, the guest's next start is on another host.
        self.shared.stopping(index as usize, &mut r, self.logging);
        let next = r.queue.next_avail();
        if r.running() {
            tracing::info!(queue = index, next_avail = next, used = r.queue.next_used(), "vhost-user ring stopped");
        }
        if self.shared.watched(index as usize) {
            self.shared.watch_kick(index as usize, r.kick.as_ref().map(|k| k.as_raw_fd()), None);
        }
        r.queue.set_ready(false);
        r.kick = None;
        r.call = None;
        self.shared.note_running(index as usize, false);
        Ok(VhostUserVringState::new(index, u32::from(next)))
    }

    fn set_vring_kick(&mut self, index: u8, fd: Option<File>) -> Result<()> {
        tracing::debug!(index, fd = fd.is_some(), "vhost-user set_vring_kick");
        let mut r = self.ring(u32::from(index))?;
        let kick = match fd.map(Kick::new).transpose() {
            Ok(k) => k,
            Err(e) => {
                self.shared.counters().refused_fds.fetch_add(1, Relaxed);
                tracing::warn!(index, "vhost-user kick descriptor refused: {e}");
                return Err(Error::InvalidParam);
            }
        };
        if self.shared.watched(usize::from(index)) {
            self.shared.watch_kick(usize::from(index), r.kick.as_ref().map(|k| k.as_raw_fd()), kick.as_ref().map(|k| k.as_raw_fd()));
        }
        r.kick = kick;
        self.start(u32::from(index), &mut r);
        Ok(())
    }

    fn set_vring_call(&mut self, index: u8, fd: Option<File>) -> Result<()> {
        tracing::debug!(index, fd = fd.is_some(), "vhost-user set_vring_call");
        let mut r = self.ring(u32::from(index))?;
        match fd.map(Notifier::new).transpose() {
            Ok(call) => {
                r.call = call;
                // A running ring's new call descriptor: what was signalled
                // into the old one may never reach the guest (QEMU clears
                // the descriptor it starts a ring with, and switches to the
                // guest's right after the kick: the interrupt for a frame
                // held while the ring was down went there, and the guest,
                // its event index left at that frame, asked for no other:
                // deaf after vnetd's restart, in loaded CI runs). Once more
                // on this one (`start_interrupts`).
                if r.running() && r.signal() {
                    self.shared.counters().start_interrupts.fetch_add(1, Relaxed);
                }
            }
            Err(e) => {
                // The ring keeps no call descriptor: the guest polls, or
                // the frontend sends a proper one.
                r.call = None;
                self.shared.counters().refused_fds.fetch_add(1, Relaxed);
                tracing::warn!(index, "vhost-user call descriptor refused: {e}");
                return Err(Error::InvalidParam);
            }
        }
        Ok(())
    }

    fn set_vring_err(&mut self, index: u8, _fd: Option<File>) -> Result<()> {
        self.ring(u32::from(index)).map(|_| ())
    }

    fn get_protocol_features(&mut self) -> Result<VhostUserProtocolFeatures> {
        Ok(VhostUserProtocolFeatures::REPLY_ACK | self.shared.protocol_features())
    }

    fn set_protocol_features(&mut self, features: u64) -> Result<()> {
        self.protocol = features;
        Ok(())
    }

    fn get_queue_num(&mut self) -> Result<u64> {
        Ok(self.shared.queues() as u64)
    }

    fn set_vring_enable(&mut self, index: u32, enable: bool) -> Result<()> {
        tracing::debug!(index, ?enable, "vhost-user set_vring_enable");
        let mut r = self.ring(index)?;
        r.enabled = enable;
        let i = index as usize;
        if enable {
            self.start(index, &mut r);
            // What waits for the ring while it was disabled (the guest's
            // kicks were consumed then, or frames held for it).
            if r.running() {
                self.shared.go(i, &mut r, false);
            }
        }
        self.shared.note_running(i, r.running());
        Ok(())
    }

    fn get_config(&mut self, offset: u32, size: u32, _flags: VhostUserConfigFlags) -> Result<Vec<u8>> {
        let Some(space) = self.shared.config() else { return unsupported("config space is the frontend's") };
        let (at, n) = (offset as usize, size as usize);
        match space.get(at..at.checked_add(n).ok_or(Error::InvalidParam)?) {
            Some(part) => Ok(part.to_vec()),
            None => Err(Error::InvalidParam),
        }
    }

    fn set_config(&mut self, _offset: u32, _buf: &[u8], _flags: VhostUserConfigFlags) -> Result<()> {
        unsupported("the configuration space is read-only")
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

    fn set_log_base(&mut self, log: &VhostUserLog, file: File) -> Result<()> {
        if !B::LOGS {
            return unsupported("no dirty-page logging (live migration is not offered)");
        }
        let map = match LogMap::map(&file, log.mmap_size, log.mmap_offset) {
            Ok(m) => m,
            Err(e) => {
                self.shared.counters().refused_logs.fetch_add(1, Relaxed);
                tracing::warn!("vhost-user dirty-page log refused: {e}");
                return Err(Error::InvalidParam);
            }
        };
        tracing::info!(bytes = log.mmap_size, "vhost-user dirty-page log set");
        self.shared.counters().dirty_logs.fetch_add(1, Relaxed);
        self.log = Some(Arc::new(map));
        self.apply_log();
        Ok(())
    }
}
