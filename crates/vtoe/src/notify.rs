//! The interception: a seccomp filter whose matching system calls stop the
//! calling thread and reach the runner as notifications (seccomp user
//! notification), which the runner answers: let the call go on as it was
//! (`proceed`), give it a result (`reply`), or first put a socket into the
//! program's descriptor table (`add_fd`, SECCOMP_IOCTL_NOTIF_ADDFD).
//!
//! What is notified: connect, listen, accept, accept4, and the socket ioctls
//! that name interfaces (0x89xx). Nothing on the data path (read, write,
//! send, recv, poll...) is: those run at the kernel's full speed.
//!
//! The runner reads and writes the program's memory (the address a call
//! points at) with process_vm_readv/writev and takes copies of its sockets
//! with pidfd_getfd: it is the program's parent, which the kernel allows.
//! The filter is how VTOE sees a program's sockets, not a security line:
//! what holds that is vnetd's eBPF guard on every socket it hands over.

use anyhow::{anyhow, Context, Result};
use libseccomp::{
    notify_id_valid, ScmpAction, ScmpArch, ScmpArgCompare, ScmpCompareOp, ScmpFilterContext, ScmpNotifReq, ScmpNotifResp,
    ScmpNotifRespFlags, ScmpSyscall,
};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// The calls the runner answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    Connect,
    Listen,
    Accept,
    Accept4,
    Ioctl,
}

/// Installs the filter in the calling process (the program's, before it
/// execs) and returns the notification descriptor. Without root, the
/// process gets no_new_privs (the kernel's condition for a filter): a
/// set-user-ID program then runs without its privileges.
pub fn install() -> Result<OwnedFd> {
    let mut f = ScmpFilterContext::new(ScmpAction::Allow)?;
    // 32-bit calls (another ABI) are let through, not offloaded.
    f.set_act_badarch(ScmpAction::Allow)?;
    // SAFETY: geteuid cannot fail.
    f.set_ctl_nnp(unsafe { libc::geteuid() } != 0)?;
    for name in ["connect", "listen", "accept", "accept4"] {
        f.add_rule(ScmpAction::Notify, ScmpSyscall::from_name(name)?)?;
    }
    // Socket ioctls on interfaces: SIOCGIFCONF, SIOCGIFADDR, ... (0x89xx).
    f.add_rule_conditional(
        ScmpAction::Notify,
        ScmpSyscall::from_name("ioctl")?,
        &[ScmpArgCompare::new(1, ScmpCompareOp::MaskedEqual(0xffff_ff00), 0x8900)],
    )?;
    f.load().context("cannot load the seccomp filter")?;
    let fd = f.get_notify_fd().context("no seccomp notification descriptor")?;
    // SAFETY: libseccomp hands the descriptor over; it is ours to close.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// One stopped call.
pub struct Notif {
    pub id: u64,
    /// The calling thread (in the runner's pid namespace).
    pub tid: i32,
    pub call: Call,
    pub args: [u64; 6],
}

/// Receives the next notification: None for a call the runner does not
/// answer (it is let go on), or when the caller vanished meanwhile.
pub fn receive(notif: &OwnedFd) -> Result<Option<Notif>> {
    let req = match ScmpNotifReq::receive(notif.as_raw_fd()) {
        Ok(r) => r,
        // The thread was interrupted (a signal) before we read it.
        Err(e) if e.errno().map(|e| e as i32) == Some(libc::ENOENT) => return Ok(None),
        Err(e) => return Err(anyhow!("seccomp notification: {e}")),
    };
    let name = if req.data.arch == ScmpArch::native() { req.data.syscall.get_name().unwrap_or_default() } else { String::new() };
    let call = match name.as_str() {
        "connect" => Call::Connect,
        "listen" => Call::Listen,
        "accept" => Call::Accept,
        "accept4" => Call::Accept4,
        "ioctl" => Call::Ioctl,
        _ => {
            proceed(notif, req.id);
            return Ok(None);
        }
    };
    Ok(Some(Notif { id: req.id, tid: req.pid as i32, call, args: req.data.args }))
}

/// Lets the call go on in the kernel as it was made.
pub fn proceed(notif: &OwnedFd, id: u64) {
    let _ = ScmpNotifResp::new_continue(id, ScmpNotifRespFlags::empty()).respond(notif.as_raw_fd());
}

/// Ends the call with a result: `Ok(value)` or `Err(errno)`.
pub fn reply(notif: &OwnedFd, id: u64, r: std::result::Result<i64, i32>) -> bool {
    let resp = match r {
        Ok(v) => ScmpNotifResp::new_val(id, v, ScmpNotifRespFlags::empty()),
        Err(errno) => ScmpNotifResp::new_error(id, -errno, ScmpNotifRespFlags::empty()),
    };
    resp.respond(notif.as_raw_fd()).is_ok()
}

/// Whether the call is still waiting for its answer.
pub fn valid(notif: &OwnedFd, id: u64) -> bool {
    notify_id_valid(notif.as_raw_fd(), id).is_ok()
}

/// Puts `sock` into the program's descriptor table: at `at` (replacing what
/// is there, as dup2 does), or, with `at` None, at the lowest free number,
/// which then also ends the call as its result (accept's). Returns the
/// number.
pub fn add_fd(notif: &OwnedFd, id: u64, sock: RawFd, at: Option<RawFd>, cloexec: bool) -> io::Result<i32> {
    let mut a = libc::seccomp_notif_addfd {
        id,
        flags: match at {
            Some(_) => libc::SECCOMP_ADDFD_FLAG_SETFD as u32,
            None => libc::SECCOMP_ADDFD_FLAG_SEND as u32,
        },
        srcfd: sock as u32,
        newfd: at.unwrap_or(0) as u32,
        newfd_flags: if cloexec { libc::O_CLOEXEC as u32 } else { 0 },
    };
    // SAFETY: the ioctl takes a seccomp_notif_addfd we own.
    let r = unsafe { libc::ioctl(notif.as_raw_fd(), libc::SECCOMP_IOCTL_NOTIF_ADDFD, &mut a) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r)
}

/// A copy of the program's descriptor `fd` (pidfd_getfd), checked to be the
/// one the stopped call named (the notification is still valid, so the
/// thread is still in it).
pub fn take_fd(notif: &OwnedFd, n: &Notif, fd: RawFd) -> Option<OwnedFd> {
    const PIDFD_THREAD: libc::c_uint = libc::O_EXCL as libc::c_uint;
    // SAFETY: pidfd_open returns a new descriptor or -1.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, n.tid, PIDFD_THREAD) };
    if pidfd < 0 {
        return None;
    }
    // SAFETY: pidfd was just opened and is ours.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as RawFd) };
    if !valid(notif, n.id) {
        return None; // the thread id may have been reused
    }
    // SAFETY: pidfd_getfd returns a new descriptor or -1.
    let got = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if got < 0 {
        return None;
    }
    // SAFETY: got is a new descriptor, ours.
    Some(unsafe { OwnedFd::from_raw_fd(got as RawFd) })
}

/// The process (thread group) of thread `tid`.
pub fn tgid(tid: i32) -> Option<i32> {
    std::fs::read_to_string(format!("/proc/{tid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:").and_then(|v| v.trim().parse().ok()))
}

/// A copy of the socket with inode `inode` from process `pid`: at
/// descriptor `fd` if it is still there, else wherever the process holds
/// it now (/proc/<pid>/fd). None when the process no longer holds it.
pub fn retake(pid: i32, fd: RawFd, inode: u64) -> Option<OwnedFd> {
    // SAFETY: pidfd_open returns a new descriptor or -1.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if pidfd < 0 {
        return None;
    }
    // SAFETY: pidfd was just opened and is ours.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as RawFd) };
    let get = |n: RawFd| -> Option<OwnedFd> {
        // SAFETY: pidfd_getfd returns a new descriptor or -1.
        let got = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), n, 0) };
        // SAFETY: got is a new descriptor, ours.
        (got >= 0).then(|| unsafe { OwnedFd::from_raw_fd(got as RawFd) })
    };
    if let Some(d) = get(fd).filter(|d| crate::sock::inode(d.as_raw_fd()) == Some(inode)) {
        return Some(d);
    }
    let want = format!("socket:[{inode}]");
    let dir = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
    dir.flatten()
        .filter(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.as_os_str() == want.as_str()))
        .find_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()).and_then(get))
        .filter(|d| crate::sock::inode(d.as_raw_fd()) == Some(inode))
}

/// Reads `len` bytes at `addr` in the thread's memory.
pub fn read_mem(tid: i32, addr: u64, len: usize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    let local = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: len };
    let remote = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: len };
    // SAFETY: process_vm_readv into a buffer we own; the remote side is checked by the kernel.
    let n = unsafe { libc::process_vm_readv(tid, &local, 1, &remote, 1, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n as usize != len {
        return Err(io::Error::other("short read of the program's memory"));
    }
    Ok(buf)
}

/// Writes `data` at `addr` in the thread's memory.
pub fn write_mem(tid: i32, addr: u64, data: &[u8]) -> io::Result<()> {
    let local = libc::iovec { iov_base: data.as_ptr() as *mut libc::c_void, iov_len: data.len() };
    let remote = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: data.len() };
    // SAFETY: process_vm_writev from a buffer we own; the remote side is checked by the kernel.
    let n = unsafe { libc::process_vm_writev(tid, &local, 1, &remote, 1, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n as usize != data.len() {
        return Err(io::Error::other("short write to the program's memory"));
    }
    Ok(())
}

/// Whether the program's descriptor `fd` is close-on-exec
/// (/proc/<tid>/fdinfo/<fd>'s flags).
pub fn is_cloexec(tid: i32, fd: RawFd) -> bool {
    std::fs::read_to_string(format!("/proc/{tid}/fdinfo/{fd}"))
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("flags:").map(|v| v.trim().to_string())))
        .and_then(|v| i64::from_str_radix(&v, 8).ok())
        .is_some_and(|f| f & libc::O_CLOEXEC as i64 != 0)
}
