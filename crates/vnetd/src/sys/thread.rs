//! Where and how a thread runs: pinned to a CPU, in the real-time class or
//! the normal one. The dispatcher threads use these.

use std::io;

/// Pins the calling thread to one CPU.
pub fn pin_to(cpu: usize) {
    if cpu >= libc::CPU_SETSIZE as usize {
        tracing::warn!("cannot pin thread to CPU {cpu}: beyond the kernel's CPU set");
        return;
    }
    // SAFETY: cpu_set_t is plain data; sched_setaffinity reads it; cpu is in range.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            tracing::warn!("cannot pin thread to CPU {cpu}: {}", io::Error::last_os_error());
        }
    }
}

/// Puts the calling thread in the real-time class (FIFO, priority 1) or
/// back in the normal one; false if the kernel refused.
pub fn set_realtime(on: bool) -> bool {
    let param = libc::sched_param { sched_priority: if on { 1 } else { 0 } };
    let policy = if on { libc::SCHED_FIFO } else { libc::SCHED_OTHER };
    // SAFETY: sched_setscheduler(2) on the calling thread reads `param`.
    if unsafe { libc::sched_setscheduler(0, policy, &param) } != 0 {
        tracing::warn!("cannot switch to {}: {}", if on { "SCHED_FIFO" } else { "SCHED_OTHER" }, io::Error::last_os_error());
        return false;
    }
    true
}

