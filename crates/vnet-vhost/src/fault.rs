//! The fault guard: a frontend whose memory file shrinks under a mapping
//! makes the next access to it fault (SIGBUS), which would end vnetd and
//! every guest's overlay with it (the security review's S4). Each mapped
//! region of guest memory is registered here; a SIGBUS inside one maps
//! zero pages over the whole region (the access that faulted then reads
//! or writes those) and marks its memory faulted, which breaks that device
//! only. A SIGBUS anywhere else keeps its default action.
//!
//! The handler only loads atomics and calls mmap(2), both safe in a signal
//! handler. Slots are taken and given back by the threads that map and
//! unmap guest memory, never while a dispatcher could touch that memory
//! (it holds the memory's `Arc`).

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Once};

/// Regions guarded at once across all devices (a vhost-user memory table
/// has at most 8, or 509 with memory slots, which vnetd does not offer).
const SLOTS: usize = 1024;

struct Slot {
    start: AtomicUsize,
    /// 0: free. Set last (Release) when taken, cleared first when given back.
    len: AtomicUsize,
    /// The faulted flag of the memory the region belongs to.
    flag: AtomicPtr<AtomicBool>,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE: Slot = Slot { start: AtomicUsize::new(0), len: AtomicUsize::new(0), flag: AtomicPtr::new(std::ptr::null_mut()) };
static TABLE: [Slot; SLOTS] = [FREE; SLOTS];
/// Serialises taking slots (the handler never takes this).
static TAKING: std::sync::Mutex<()> = std::sync::Mutex::new(());
static INSTALL: Once = Once::new();

extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let addr = unsafe { (*info).si_addr() } as usize;
    for s in &TABLE {
        let len = s.len.load(Ordering::Acquire);
        if len == 0 {
            continue;
        }
        let start = s.start.load(Ordering::Relaxed);
        if addr >= start && addr - start < len {
            // SAFETY: the range is a mapping of guest memory this process
            // made and still holds; replacing it with private zero pages
            // keeps every pointer into it valid.
            unsafe {
                libc::mmap(start as *mut libc::c_void, len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED, -1, 0);
            }
            let flag = s.flag.load(Ordering::Acquire);
            if !flag.is_null() {
                // SAFETY: the flag lives in an Arc the slot's Guard holds.
                unsafe { (*flag).store(true, Ordering::Release) };
            }
            return;
        }
    }
    // Not guest memory: the default action, when the access retries.
    // SAFETY: signal(2) is async-signal-safe.
    unsafe { libc::signal(libc::SIGBUS, libc::SIG_DFL) };
}

fn install() {
    INSTALL.call_once(|| {
        // SAFETY: a plain sigaction with an extern "C" handler.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_sigbus as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_NODEFER;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut());
        }
    });
}

/// The guard over one memory table's regions: given back when dropped
/// (after the regions are unmapped: it is the last field of its memory).
pub struct Guard {
    slots: Vec<usize>,
    faulted: Arc<AtomicBool>,
}

impl Guard {
    /// Guards the regions (host address, length); `None` if the table is
    /// full.
    pub fn new(regions: &[(usize, usize)]) -> Option<Guard> {
        install();
        let faulted = Arc::new(AtomicBool::new(false));
        let mut g = Guard { slots: Vec::with_capacity(regions.len()), faulted };
        let _taking = TAKING.lock().unwrap_or_else(|e| e.into_inner());
        for &(start, len) in regions {
            let i = TABLE.iter().position(|s| s.len.load(Ordering::Acquire) == 0)?;
            let s = &TABLE[i];
            s.start.store(start, Ordering::Relaxed);
            s.flag.store(Arc::as_ptr(&g.faulted).cast_mut(), Ordering::Relaxed);
            s.len.store(len.max(1), Ordering::Release);
            g.slots.push(i);
        }
        Some(g)
    }

    /// Whether a fault hit one of the regions.
    #[inline]
    pub fn faulted(&self) -> bool {
        self.faulted.load(Ordering::Relaxed)
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let _taking = TAKING.lock().unwrap_or_else(|e| e.into_inner());
        for &i in &self.slots {
            TABLE[i].len.store(0, Ordering::Release);
            TABLE[i].flag.store(std::ptr::null_mut(), Ordering::Release);
        }
    }
}

/// Whether the file is sealed against shrinking (a memfd with
/// `F_SEAL_SHRINK`), so that a mapping of it cannot fault; files that
/// cannot be sealed are not.
pub(crate) fn sealed_against_shrinking(file: &std::fs::File) -> bool {
    // SAFETY: fcntl on a descriptor we hold.
    let seals = unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(file), libc::F_GET_SEALS) };
    seals >= 0 && seals & libc::F_SEAL_SHRINK != 0
}
