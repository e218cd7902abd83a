//! A connected device's state, as one vnetd hands it to the next at an
//! upgrade (vnetd's `handover`), so that the frontend (QEMU) never sees
//! the backend go: its connection, guest memory, rings and notifiers move
//! over whole, and the guest's link never goes down.
//!
//! What is handed over is what the frontend set up: the features and
//! protocol features it acknowledged, its memory table (the regions and
//! their files), and each ring's size, addresses (guest-physical), the
//! next index to take and its kick and call eventfds. The new vnetd
//! applies it through the same checks as the frontend's own messages
//! (sealed memory files, eventfds verified, addresses inside the memory);
//! the used index is read back from guest memory, as after any restart of
//! a ring. A device whose frontend is migrating the VM (dirty-page
//! logging on) or is not set up is not handed over: its frontend
//! reconnects, as after a restart.

use crate::device::pair_of;
use crate::memory::{DirtyLog, GuestMemory};
use crate::notify::{Kick, Notifier};
use crate::protocol::Frontend;
use crate::queue::MAX_QUEUE_SIZE;
use crate::taken::TakenLog;
use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::Ordering::Relaxed;
use vhost::vhost_user::message::VhostUserMemoryRegion;
use virtio_queue::QueueT;
use vm_memory::GuestAddress;

/// A device's state written out: one line of words, and its descriptors
/// by name (`mem <i>`, `kick <ring>`, `call <ring>`).
pub struct Exported {
    pub text: String,
    pub fds: Vec<(String, OwnedFd)>,
}

impl<B: DirtyLog> Frontend<B> {
    /// The device's state, the rings published first; None if it cannot be
    /// handed over (not set up, or logging dirty pages for a migration).
    /// `position`: with each ring's next index (a hand-over, the rings
    /// stopped); without, for a store that outlives a crash, the next index
    /// is the used one read back from guest memory then, or for a transmit
    /// ring the one its `taken` log (a descriptor, kept live) says: a frame
    /// taken is handed back only once it was sent, so the used index alone
    /// would send the frames in flight at the crash a second time.
    pub fn export(&self, position: bool) -> Option<Exported> {
        if self.logging || self.log.is_some() || self.table.is_empty() || self.mem.is_none() {
            return None;
        }
        let mut words = vec![format!("features {:x}", self.acked), format!("protocol {:x}", self.protocol)];
        let mut fds = Vec::new();
        for (i, (r, f)) in self.table.iter().enumerate() {
            let (gpa, size, ua, off) = (r.guest_phys_addr, r.memory_size, r.user_addr, r.mmap_offset);
            words.push(format!("region {gpa:x} {size:x} {ua:x} {off:x}"));
            fds.push((format!("mem {i}"), f.as_fd().try_clone_to_owned().ok()?));
        }
        for i in 0..self.shared.queues() {
            let mut r = self.shared.ring(i);
            // Queues of pairs past the first that the frontend never set
            // up are left out.
            if i >= 2 && r.kick.is_none() && r.call.is_none() && !r.queue.ready() {
                continue;
            }
            // The rings stopped (a hand-over): what was done is published
            // first, so the next index is where the guest sees it.
            if position {
                r.publish();
            }
            let q = &r.queue;
            let next = if position { q.next_avail().to_string() } else { "-".to_string() };
            words.push(format!(
                "ring {i} {} {:x} {:x} {:x} {next} {} {}",
                q.size(),
                q.desc_table(),
                q.avail_ring(),
                q.used_ring(),
                r.enabled as u8,
                q.ready() as u8
            ));
            if let Some(k) = &r.kick {
                // SAFETY: a descriptor the ring holds, borrowed to be duplicated.
                let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(k.as_raw_fd()) };
                fds.push((format!("kick {i}"), fd.try_clone_to_owned().ok()?));
            }
            if let Some(c) = &r.call {
                fds.push((format!("call {i}"), c.fd().try_clone_to_owned().ok()?));
            }
        }
        if !position {
            if let Some(l) = &self.shared.taken {
                fds.push(("taken".to_string(), l.fd().try_clone_to_owned().ok()?));
            }
        }
        Some(Exported { text: words.join(";"), fds })
    }

    /// A frontend for the device `shared` as another vnetd exported it
    /// (`text`, `fds`), through the checks of the frontend's own messages.
    /// The features and protocol features it acknowledged are returned for
    /// the caller to tell its protocol handler (which keeps its own).
    pub fn import(shared: std::sync::Arc<crate::Device<B>>, text: &str, mut fds: HashMap<String, OwnedFd>) -> Result<(Frontend<B>, u64, u64), String> {
        let mut f = Frontend::new(shared);
        let mut take = |name: &str| fds.remove(name).map(File::from);
        let (mut acked, mut protocol) = (None, 0);
        let mut table = Vec::new();
        let mut rings = Vec::new();
        let hex = |w: &str| u64::from_str_radix(w, 16).map_err(|_| format!("'{w}' is not a number"));
        for part in text.split(';') {
            let w: Vec<&str> = part.split_whitespace().collect();
            match w.as_slice() {
                ["features", v] => acked = Some(hex(v)?),
                ["protocol", v] => protocol = hex(v)?,
                ["region", gpa, size, ua, off] => {
                    let r = VhostUserMemoryRegion::new(hex(gpa)?, hex(size)?, hex(ua)?, hex(off)?);
                    let file = take(&format!("mem {}", table.len())).ok_or("a memory region without its file")?;
                    table.push((r, file));
                }
                ["ring", i, size, desc, avail, used, next, enabled, ready] => {
                    let i: usize = i.parse().map_err(|_| "a ring index")?;
                    if i >= f.shared.queues() {
                        return Err(format!("no ring {i}"));
                    }
                    let size: u16 = size.parse().map_err(|_| "a ring size")?;
                    let next: Option<u16> = match *next {
                        "-" => None,
                        n => Some(n.parse().map_err(|_| "a ring index")?),
                    };
                    rings.push((i, size, hex(desc)?, hex(avail)?, hex(used)?, next, *enabled == "1", *ready == "1"));
                }
                _ => return Err(format!("not a device state: {part}")),
            }
        }
        let taken = take("taken").map(|f| TakenLog::read::<{ crate::MAX_PAIRS }>(&f.into())).unwrap_or([None; crate::MAX_PAIRS]);
        let acked = acked.ok_or("no features")?;
        vhost::vhost_user::VhostUserBackendReqHandlerMut::set_features(&mut f, acked).map_err(|_| "features this build does not offer")?;
        f.protocol = protocol;
        if table.is_empty() {
            return Err("no memory table".into());
        }
        let ctx: Vec<VhostUserMemoryRegion> = table.iter().map(|(r, _)| *r).collect();
        let copies: Vec<File> = table.iter().filter_map(|(_, file)| file.try_clone().ok()).collect();
        let mem = GuestMemory::map(&ctx, copies, f.shared.memory).map_err(|e| {
            f.shared.counters.refused_memory.fetch_add(1, Relaxed);
            format!("memory refused: {}", e.0)
        })?;
        f.table = table;
        f.mem = Some(mem.clone());
        for (i, size, desc, avail, used, next, enabled, ready) in rings {
            let mut r = f.shared.ring(i);
            r.mem = Some(mem.clone());
            r.enabled = enabled;
            if size == 0 || size > MAX_QUEUE_SIZE || !size.is_power_of_two() {
                return Err(format!("ring {i}: size {size}"));
            }
            r.queue.set_size(size);
            let q = &mut r.queue;
            q.try_set_desc_table_address(GuestAddress(desc)).map_err(|_| "ring address")?;
            q.try_set_avail_ring_address(GuestAddress(avail)).map_err(|_| "ring address")?;
            q.try_set_used_ring_address(GuestAddress(used)).map_err(|_| "ring address")?;
            if let Some(n) = next {
                q.set_next_avail(n);
            }
            if let Some(file) = take(&format!("call {i}")) {
                r.call = Some(Notifier::new(file).map_err(|e| format!("call {i}: {e:?}"))?);
            }
            if let Some(file) = take(&format!("kick {i}")) {
                let kick = Kick::new(file).map_err(|e| format!("kick {i}: {e:?}"))?;
                if !pair_of(i).1 {
                    f.shared.watch_kick(i, None, Some(kick.as_raw_fd()));
                }
                r.kick = Some(kick);
            }
            if ready {
                f.start(i as u32, &mut r);
                if next.is_none() {
                    // After a crash: on from the last chain used, or, for a
                    // transmit ring, from the last chain taken (`taken`:
                    // the frames between were sent, or being sent).
                    let used = r.queue.next_used();
                    r.queue.set_next_avail(used);
                    let (k, rx) = pair_of(i);
                    if let (false, Some(to)) = (rx, taken[k]) {
                        let n = r.resume_after_crash(to);
                        if n > 0 {
                            f.shared.counters.tx_handed_back_at_takeover.fetch_add(u64::from(n), Relaxed);
                            tracing::info!(queue = i, frames = n, "frames the killed vnetd had taken handed back to the guest unsent");
                        }
                    }
                    f.shared.mark_taken(i, &r);
                }
            }
        }
        Ok((f, acked, protocol))
    }
}
