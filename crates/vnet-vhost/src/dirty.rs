//! Dirty-page logging, for a VM's live migration: while the frontend asks
//! for it (`VHOST_F_LOG_ALL` acknowledged and a log shared with
//! `SET_LOG_BASE`), every page of guest memory vnetd writes (frames into
//! the guest's receive buffers, used-ring entries, used indexes) is marked
//! in the frontend's log, one bit per 4 KiB guest-physical page, so that
//! the VMM copies it again before the VM runs on its new host.
//!
//! The log is a property of the guest memory's type, as rust-vmm's
//! `vhost-user-backend` makes it: `DirtyPages` is the `vm-memory` bitmap of
//! each region, and every write through `GuestMemoryMmap` marks it, so no
//! write can go around it. `vhost-user-backend`'s own bitmap
//! (`BitmapMmapRegion`) was measured and not used: it costs about 30% of
//! the receive path at 1500 B with no log set (its `RwLock` and `Arc` per
//! write); this one costs one atomic load per write while no log is set.
//!
//! The log's view of a region (where the log is mapped and where the
//! region lies in the guest) is swapped atomically; a view is freed only
//! once no writer can hold it: every write into guest memory happens under
//! one of the device's ring locks, so after the swap the protocol thread
//! takes each ring's lock once (`protocol.rs`), and then drops the old one.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicPtr, AtomicU8, Ordering};
use std::sync::Arc;
use vm_memory::bitmap::{Bitmap, NewBitmap, RefSlice, WithBitmapSlice};

/// Guest-physical bytes per bit of the log (the vhost-user spec's
/// `VHOST_LOG_PAGE`).
pub const LOG_PAGE: u64 = 0x1000;
/// The largest log taken: one bit per 4 KiB page, so 64 MiB of log covers
/// 2 TiB of guest memory.
pub const MAX_LOG: u64 = 64 << 20;

/// The frontend's log, mapped into vnetd (`SET_LOG_BASE`), and guarded as
/// guest memory is (`fault::Guard`): a log that faults all the same (a
/// hugetlbfs file can lose a page under a seal when the pool runs dry: the
/// security review's L1) is replaced by zero pages, and its marks are lost
/// rather than vnetd ended by SIGBUS.
pub struct LogMap {
    at: *mut AtomicU8,
    len: usize,
    /// Dropped after the mapping is unmapped (`Drop` runs first).
    guard: crate::fault::Guard,
}

// SAFETY: the mapping is shared memory, touched only through atomics.
unsafe impl Send for LogMap {}
// SAFETY: as above.
unsafe impl Sync for LogMap {}

impl LogMap {
    /// Maps `size` bytes of `file` from `offset`. The file must hold them
    /// and be sealed against shrinking (QEMU's log is a memfd sealed so):
    /// a log that shrank under vnetd would fault a dispatcher.
    pub fn map(file: &File, size: u64, offset: u64) -> Result<LogMap, String> {
        if size == 0 || size > MAX_LOG {
            return Err(format!("a dirty-page log of {size} bytes (at most {MAX_LOG})"));
        }
        let len = file.metadata().map_err(|e| format!("cannot stat the log file: {e}"))?.len();
        if offset.checked_add(size).is_none_or(|end| end > len) {
            return Err(format!("a log of {size} bytes at offset {offset} lies past its file's end ({len} bytes)"));
        }
        if !crate::fault::sealed_against_shrinking(file) {
            return Err("a log file not sealed against shrinking (F_SEAL_SHRINK)".into());
        }
        LogMap::map_guarded(file, size, offset)
    }

    /// Maps the range and guards it.
    fn map_guarded(file: &File, size: u64, offset: u64) -> Result<LogMap, String> {
        // SAFETY: a shared mapping of a range the file holds; the result is
        // checked, and a fault in it is caught (`fault::Guard`).
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), size as usize, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, file.as_raw_fd(), offset as libc::off_t)
        };
        if p == libc::MAP_FAILED {
            return Err(format!("cannot map the log: {}", std::io::Error::last_os_error()));
        }
        let Some(guard) = crate::fault::Guard::new(&[(p as usize, size as usize)]) else {
            // SAFETY: the mapping just made.
            unsafe { libc::munmap(p, size as usize) };
            return Err("too many guarded mappings in vnetd to take another log".into());
        };
        Ok(LogMap { at: p.cast(), len: size as usize, guard })
    }

    /// Whether the log faulted (its marks since went to zero pages).
    pub fn faulted(&self) -> bool {
        self.guard.faulted()
    }

    /// Marks guest-physical pages `first..=last`; pages past the log's end
    /// are not marked (the frontend sized its log for its memory).
    fn mark(&self, first: u64, last: u64) {
        for page in first..=last {
            let byte = (page / 8) as usize;
            if byte >= self.len {
                return;
            }
            // SAFETY: inside the mapping; atomic, as the frontend clears
            // bits while vnetd sets them.
            unsafe { (*self.at.add(byte)).fetch_or(1 << (page % 8), Ordering::Relaxed) };
        }
    }

    fn marked(&self, page: u64) -> bool {
        let byte = (page / 8) as usize;
        // SAFETY: inside the mapping.
        byte < self.len && unsafe { (*self.at.add(byte)).load(Ordering::Relaxed) } & (1 << (page % 8)) != 0
    }
}

impl Drop for LogMap {
    fn drop(&mut self) {
        if self.faulted() {
            tracing::warn!("a vhost-user dirty-page log faulted (its file lost pages): the pages vnetd wrote after that were not logged");
        }
        // SAFETY: the mapping made in `map`.
        unsafe { libc::munmap(self.at.cast(), self.len) };
    }
}

/// Where one region's writes go: the log, and the region's first
/// guest-physical address.
struct View {
    log: Arc<LogMap>,
    gpa: u64,
}

/// One guest memory region's dirty-page bitmap: its writes go to the
/// frontend's log while one is set, and nowhere otherwise.
#[derive(Default)]
pub struct DirtyPages {
    view: AtomicPtr<View>,
}

/// A view taken out of use: dropped once no writer can still hold it.
pub struct Stale {
    _view: Option<Box<View>>,
}

impl Stale {
    pub fn none() -> Stale {
        Stale { _view: None }
    }
}

impl DirtyPages {
    /// Logs this region's writes (the region starts at guest-physical
    /// `gpa`) into `log` from now on, or nowhere. The view it replaces is
    /// returned, for the caller to drop once no writer can hold it.
    fn set_view(&self, log: Option<&Arc<LogMap>>, gpa: u64) -> Stale {
        let new = log.map_or(std::ptr::null_mut(), |l| Box::into_raw(Box::new(View { log: l.clone(), gpa })));
        let old = self.view.swap(new, Ordering::AcqRel);
        // SAFETY: every view was made by Box::into_raw here.
        Stale { _view: (!old.is_null()).then(|| unsafe { Box::from_raw(old) }) }
    }

    fn with_view<R>(&self, f: impl FnOnce(&View) -> R) -> Option<R> {
        let v = self.view.load(Ordering::Acquire);
        // SAFETY: a view is freed only after it was swapped out and every
        // ring lock was taken once since (module comment); writers hold one.
        (!v.is_null()).then(|| f(unsafe { &*v }))
    }
}

impl Drop for DirtyPages {
    fn drop(&mut self) {
        drop(self.set_view(None, 0));
    }
}

impl std::fmt::Debug for DirtyPages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DirtyPages(logging: {})", !self.view.load(Ordering::Relaxed).is_null())
    }
}

impl<'a> WithBitmapSlice<'a> for DirtyPages {
    type S = RefSlice<'a, DirtyPages>;
}

impl Bitmap for DirtyPages {
    #[inline]
    fn mark_dirty(&self, offset: usize, len: usize) {
        if len == 0 {
            return;
        }
        self.with_view(|v| {
            let start = v.gpa.wrapping_add(offset as u64);
            v.log.mark(start / LOG_PAGE, start.wrapping_add(len as u64 - 1) / LOG_PAGE);
        });
    }

    fn dirty_at(&self, offset: usize) -> bool {
        self.with_view(|v| v.log.marked(v.gpa.wrapping_add(offset as u64) / LOG_PAGE)).unwrap_or(false)
    }

    fn slice_at(&self, offset: usize) -> RefSlice<'_, DirtyPages> {
        RefSlice::new(self, offset)
    }
}

impl NewBitmap for DirtyPages {
    fn with_len(_len: usize) -> Self {
        DirtyPages::default()
    }
}

/// What a guest memory's bitmap must be: `()` (no logging: the device then
/// does not offer it) or `DirtyPages`.
pub trait DirtyLog: Bitmap + NewBitmap + Send + Sync + 'static {
    /// Whether writes can be logged (the device offers `VHOST_F_LOG_ALL`
    /// and `LOG_SHMFD` only then).
    const LOGS: bool;
    /// Points the region's writes at `log` (None: nowhere); the old view,
    /// to drop once no writer holds it.
    fn set_log(&self, log: Option<&Arc<LogMap>>, gpa: u64) -> Stale;
}

impl DirtyLog for () {
    const LOGS: bool = false;
    fn set_log(&self, _log: Option<&Arc<LogMap>>, _gpa: u64) -> Stale {
        Stale::none()
    }
}

impl DirtyLog for DirtyPages {
    const LOGS: bool = true;
    fn set_log(&self, log: Option<&Arc<LogMap>>, gpa: u64) -> Stale {
        self.set_view(log, gpa)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::tests::memfd;
    use crate::memory::GuestMemory;
    use std::sync::atomic::Ordering::Relaxed;
    use vm_memory::{Bytes, GuestAddress};

    fn bits(f: &File) -> Vec<u64> {
        let mut b = vec![0u8; f.metadata().unwrap().len() as usize];
        std::os::unix::fs::FileExt::read_exact_at(f, &mut b, 0).unwrap();
        (0..b.len() as u64 * 8).filter(|p| b[(p / 8) as usize] & (1 << (p % 8)) != 0).collect()
    }

    #[test]
    fn a_log_whose_file_loses_its_pages_faults_the_log_not_the_process() {
        // The review's L1 (a hugetlbfs log with a hole punched and the pool
        // dry): here a file cut short under the mapping, which the seal
        // check would refuse, mapped past it as `map` maps a sealed one.
        let file = memfd(8192, false);
        let keep = file.try_clone().unwrap();
        let log = LogMap::map_guarded(&file, 8192, 0).unwrap();
        log.mark(0, 3);
        assert!(log.marked(2) && !log.faulted());
        keep.set_len(0).unwrap();
        // Without the guard this mark ends the test process by SIGBUS.
        log.mark(40000, 40001);
        assert!(log.faulted());
        assert!(!log.marked(0), "zero pages where the log was");
    }

    #[test]
    fn writes_through_guest_memory_mark_their_guest_pages_while_a_log_is_set_and_only_then() {
        // Two regions, the second at 1 MiB guest-physical.
        let mem = GuestMemory::<DirtyPages>::anonymous(&[(GuestAddress(0), 0x10000), (GuestAddress(0x10_0000), 0x10000)]);
        let file = memfd(64, true);
        let log = Arc::new(LogMap::map(&file, 64, 0).unwrap());
        mem.write_slice(&[1; 100], GuestAddress(0x2000)).unwrap();
        assert!(bits(&file).is_empty(), "no log set: nothing marked");

        drop(mem.set_log(Some(&log)));
        // A frame across a page boundary, a used index, an object in the
        // second region.
        mem.write_slice(&[2; 200], GuestAddress(0x3f80)).unwrap();
        mem.store(7u16, GuestAddress(0x8002), Relaxed).unwrap();
        mem.write_obj(9u64, GuestAddress(0x10_5000)).unwrap();
        // vnetd's own write (one slice), across a page boundary.
        mem.write(&[4; 16], GuestAddress(0x9ff8)).unwrap();
        let mut back = [0u8; 8];
        mem.read_slice(&mut back, GuestAddress(0x6000)).unwrap();
        assert_eq!(bits(&file), vec![3, 4, 8, 9, 10, 0x105], "the pages written, by guest-physical page; reads mark nothing");

        drop(mem.set_log(None));
        mem.write_slice(&[3; 8], GuestAddress(0xa000)).unwrap();
        assert_eq!(bits(&file), vec![3, 4, 8, 9, 10, 0x105], "logging off: nothing more marked");
    }

    /// A frame written into the guest's receive ring (each buffer's region
    /// looked up once, the writes made through that slice) and its used
    /// entry mark their pages, as any write does. Catches: a write that
    /// bypasses the bitmap (a migration's destination would miss the frame
    /// or the used entry).
    #[test]
    fn a_frame_written_into_the_guests_receive_ring_marks_its_buffer_and_the_used_ring() {
        use crate::queue::Ring;
        let mem = GuestMemory::<DirtyPages>::anonymous(&[(GuestAddress(0), 0x10_0000)]);
        let mut d = [0u8; 16];
        d[..8].copy_from_slice(&0x7f00u64.to_le_bytes());
        d[8..12].copy_from_slice(&4096u32.to_le_bytes());
        d[12..14].copy_from_slice(&2u16.to_le_bytes()); // write-only
        mem.write_slice(&d, GuestAddress(0x1000)).unwrap();
        mem.write_obj(0u16, GuestAddress(0x2004)).unwrap();
        mem.write_obj(1u16, GuestAddress(0x2002)).unwrap();
        let mut r = Ring::with_layout(Arc::new(crate::Counters::default()), mem.clone(), 16, 0x1000, 0x2000, 0x3000, false).unwrap();
        let file = memfd(64, true);
        let log = Arc::new(LogMap::map(&file, 64, 0).unwrap());
        drop(mem.set_log(Some(&log)));
        r.put_frame(&vnet_core::offload::VnetHdr::default(), &[&[5u8; 100], &[6u8; 900]], 12, true).unwrap();
        r.publish();
        assert_eq!(bits(&file), vec![3, 7, 8], "the used ring's page and the buffer's two");
        let mut back = [0u8; 1012];
        mem.read_slice(&mut back, GuestAddress(0x7f00)).unwrap();
        assert!(back[12..112].iter().all(|&b| b == 5) && back[112..].iter().all(|&b| b == 6));
    }

    #[test]
    fn a_log_that_could_shrink_lies_past_its_file_or_is_huge_is_refused() {
        assert!(LogMap::map(&memfd(4096, false), 4096, 0).is_err(), "not sealed against shrinking");
        assert!(LogMap::map(&memfd(4096, true), 8192, 0).is_err(), "past the file's end");
        assert!(LogMap::map(&memfd(4096, true), 4096, 1).is_err(), "past the file's end by its offset");
        assert!(LogMap::map(&memfd(4096, true), 0, 0).is_err(), "empty");
        assert!(LogMap::map(&memfd(4096, true), MAX_LOG + 8, 0).is_err(), "too big");
        assert!(LogMap::map(&memfd(4096, true), 4096, 0).is_ok());
    }

    #[test]
    fn pages_past_the_logs_end_are_not_marked() {
        let mem = GuestMemory::<DirtyPages>::anonymous(&[(GuestAddress(0), 0x100000)]);
        let file = memfd(4096, true);
        // A log of one byte: pages 0-7.
        let log = Arc::new(LogMap::map(&file, 1, 0).unwrap());
        drop(mem.set_log(Some(&log)));
        mem.write_slice(&[1; 8], GuestAddress(0x7000)).unwrap();
        mem.write_slice(&[1; 8], GuestAddress(0x9000)).unwrap();
        assert_eq!(bits(&file), vec![7]);
    }
}
