//! Guest memory as vnetd maps it from a frontend's memory table.
//!
//! `GuestMemory<B>` is the guest's regions (rust-vmm's `GuestMemoryMmap`,
//! bounds-checked access) with the fault guard that keeps a shrinking file
//! from ending vnetd, generic over the dirty-page bitmap `B` (`()`: none;
//! `dirty::DirtyPages`: every write marked in the frontend's log while it
//! asks for one, for live migration).
//!
//! A region's file must hold the whole region, and must be sealed against
//! shrinking (`F_SEAL_SHRINK`, as QEMU's memfd backend seals by default):
//! else it is refused unless the interface allows unsealed memory (DPDK's
//! virtio-user, hugetlbfs files), and then the fault guard is what stands
//! between a frontend that truncates its file and vnetd.

use crate::fault::{sealed_against_shrinking, Guard};
use std::fs::File;
use std::sync::Arc;
use vhost::vhost_user::message::VhostUserMemoryRegion;
use crate::dirty::{LogMap, Stale};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, GuestRegionMmap};

pub use crate::dirty::DirtyLog;

/// Which memory files the device takes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryPolicy {
    /// Files without `F_SEAL_SHRINK` too (the fault guard then breaks the
    /// device if one shrinks).
    pub allow_unsealed: bool,
}

/// The guest's memory, mapped, and its fault guard.
pub struct GuestMemory<B: DirtyLog = ()> {
    // Field order matters: the regions are unmapped before the guard goes.
    mmap: GuestMemoryMmap<B>,
    guard: Guard,
    /// The fault was counted (by the first ring that saw it).
    reported: std::sync::atomic::AtomicBool,
    /// (frontend's virtual address, size, guest physical address) of each
    /// region: ring addresses come as the frontend's addresses.
    user: Vec<(u64, u64, u64)>,
}

impl<B: DirtyLog> std::ops::Deref for GuestMemory<B> {
    type Target = GuestMemoryMmap<B>;
    fn deref(&self) -> &GuestMemoryMmap<B> {
        &self.mmap
    }
}

/// Why a memory table was refused.
#[derive(Debug)]
pub struct Refused(pub String);

impl<B: DirtyLog> GuestMemory<B> {
    /// Maps a frontend's memory table.
    pub fn map(table: &[VhostUserMemoryRegion], files: Vec<File>, policy: MemoryPolicy) -> Result<Arc<GuestMemory<B>>, Refused> {
        if table.len() != files.len() || table.is_empty() {
            return Err(Refused(format!("{} regions with {} files", table.len(), files.len())));
        }
        let mut regions = Vec::with_capacity(table.len());
        let mut user = Vec::with_capacity(table.len());
        for (region, file) in table.iter().zip(files) {
            // A mapping past the file's end faults when touched: the file
            // must hold the whole region, and stay that long.
            let len = file.metadata().map_err(|e| Refused(format!("cannot stat a memory file: {e}")))?.len();
            let (size, offset) = (region.memory_size, region.mmap_offset);
            if offset.checked_add(size).is_none_or(|end| end > len) || size == 0 {
                return Err(Refused(format!("a region of {size} bytes at offset {offset} lies past its file's end ({len} bytes)")));
            }
            if !policy.allow_unsealed && !sealed_against_shrinking(&file) {
                return Err(Refused("a memory file not sealed against shrinking (F_SEAL_SHRINK); the interface takes it only with unsealed-memory".into()));
            }
            let mapped = region.mmap_region::<B>(file).map_err(|e| Refused(format!("cannot map a region: {e}")))?;
            let r = GuestRegionMmap::new(mapped, GuestAddress(region.guest_phys_addr)).ok_or_else(|| Refused("a region that wraps the address space".into()))?;
            user.push((region.user_addr, region.memory_size, region.guest_phys_addr));
            regions.push(r);
        }
        let spans: Vec<(usize, usize)> = regions.iter().map(|r| (r.as_ptr() as usize, r.len() as usize)).collect();
        let mmap = GuestMemoryMmap::from_regions(regions).map_err(|e| Refused(format!("overlapping regions: {e}")))?;
        let guard = Guard::new(&spans).ok_or_else(|| Refused("too many guest memory regions mapped in vnetd".into()))?;
        Ok(Arc::new(GuestMemory { mmap, guard, reported: Default::default(), user }))
    }

    /// Guest memory for tests and fuzzing: anonymous, guarded like the rest.
    pub fn anonymous(ranges: &[(GuestAddress, usize)]) -> Arc<GuestMemory<B>> {
        let mmap = GuestMemoryMmap::<B>::from_ranges(ranges).expect("anonymous guest memory");
        let spans: Vec<(usize, usize)> = mmap.iter().map(|r| (r.as_ptr() as usize, r.len() as usize)).collect();
        let guard = Guard::new(&spans).expect("a free fault-guard slot");
        Arc::new(GuestMemory { mmap, guard, reported: Default::default(), user: ranges.iter().map(|&(a, l)| (a.0, l as u64, a.0)).collect() })
    }

    /// The guest physical address of the frontend's virtual address `va`.
    pub fn gpa(&self, va: u64) -> Option<u64> {
        self.user.iter().find(|(base, size, _)| va >= *base && va - base < *size).map(|(base, _, gpa)| va - base + gpa)
    }

    /// Writes `buf` at `at`: vnetd's every write of frames and used entries.
    /// Through one `VolatileSlice` when the range lies in one region (the
    /// bitmap marks it as any write), else vm-memory's `write_slice`, whose
    /// walk over regions cost 121 → 209 ns per 1500-byte write, and 15 → 52
    /// ns per 8 bytes, once the bitmap is `DirtyPages` rather than `()`
    /// (measured; one slice costs the same with either; `read` likewise).
    #[inline]
    pub fn write(&self, buf: &[u8], at: GuestAddress) -> Result<(), vm_memory::GuestMemoryError> {
        match self.mmap.get_slice(at, buf.len()) {
            Ok(slice) => {
                slice.copy_from(buf);
                Ok(())
            }
            Err(_) => self.mmap.write_slice(buf, at),
        }
    }

    /// Reads `buf.len()` bytes at `at` into `buf` (as `write`: one slice
    /// when the range lies in one region).
    #[inline]
    pub fn read(&self, buf: &mut [u8], at: GuestAddress) -> Result<(), vm_memory::GuestMemoryError> {
        match self.mmap.get_slice(at, buf.len()) {
            Ok(slice) => {
                slice.copy_to(buf);
                Ok(())
            }
            Err(_) => self.mmap.read_slice(buf, at),
        }
    }

    /// Logs every region's writes into `log` from now on (None: nowhere);
    /// the views replaced, to drop once no writer can hold them.
    pub fn set_log(&self, log: Option<&Arc<LogMap>>) -> Vec<Stale> {
        self.mmap.iter().map(|r| (**r).bitmap().set_log(log, r.start_addr().0)).collect()
    }

    /// Whether a fault hit this memory (its file shrank): the device must
    /// stop using it.
    #[inline]
    pub fn faulted(&self) -> bool {
        self.guard.faulted()
    }

    /// True once, the first time a fault is seen (to count it once).
    pub fn take_fault(&self) -> bool {
        self.faulted() && !self.reported.swap(true, std::sync::atomic::Ordering::Relaxed)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use vm_memory::Bytes;

    /// A memfd of `size` bytes, sealed against shrinking and growing if
    /// `seal` (as QEMU's guest memory and dirty log are).
    pub(crate) fn memfd(size: u64, seal: bool) -> File {
        // SAFETY: memfd_create with a static name.
        let fd = unsafe { libc::memfd_create(c"guest".as_ptr(), libc::MFD_ALLOW_SEALING) };
        assert!(fd >= 0);
        let f = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        f.set_len(size).unwrap();
        if seal {
            // SAFETY: fcntl on our memfd.
            assert_eq!(unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW) }, 0);
        }
        f
    }

    fn region(size: u64) -> VhostUserMemoryRegion {
        VhostUserMemoryRegion::new(0, size, 0x7f00_0000_0000, 0)
    }

    #[test]
    fn unsealed_files_are_refused_unless_allowed() {
        let strict = MemoryPolicy::default();
        assert!(GuestMemory::<()>::map(&[region(1 << 16)], vec![memfd(1 << 16, false)], strict).is_err());
        assert!(GuestMemory::<()>::map(&[region(1 << 16)], vec![memfd(1 << 16, true)], strict).is_ok());
        assert!(GuestMemory::<()>::map(&[region(1 << 17)], vec![memfd(1 << 16, true)], strict).is_err(), "past the file's end");
        let lax = MemoryPolicy { allow_unsealed: true };
        assert!(GuestMemory::<()>::map(&[region(1 << 16)], vec![memfd(1 << 16, false)], lax).is_ok());
    }

    #[test]
    fn a_file_that_shrinks_under_the_mapping_faults_the_memory_not_the_process() {
        let f = memfd(1 << 16, false);
        let keep = f.try_clone().unwrap();
        let mem = GuestMemory::<()>::map(&[region(1 << 16)], vec![f], MemoryPolicy { allow_unsealed: true }).unwrap();
        mem.write_slice(&[7u8; 64], GuestAddress(0x100)).unwrap();
        assert!(!mem.faulted());
        keep.set_len(0).unwrap();
        // Without the guard this read ends the test process by SIGBUS.
        let mut got = [1u8; 64];
        mem.read_slice(&mut got, GuestAddress(0x100)).unwrap();
        assert_eq!(got, [0u8; 64], "zero pages where the file was");
        assert!(mem.faulted());
        mem.write_slice(&[9u8; 64], GuestAddress(0x8000)).unwrap();
    }
}
