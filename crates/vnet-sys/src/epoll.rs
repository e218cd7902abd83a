//! One epoll wrapper: watch descriptors under a 64-bit token, wait with a
//! microsecond timeout (`epoll_pwait2`), falling back to millisecond
//! `epoll_wait` where the kernel (before 5.11) or a seccomp profile lacks it.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// Readable, writable, and the peer closed its end (event bits).
pub const IN: u32 = libc::EPOLLIN as u32;
pub const OUT: u32 = libc::EPOLLOUT as u32;
pub const RDHUP: u32 = libc::EPOLLRDHUP as u32;
pub const HUP: u32 = libc::EPOLLHUP as u32;
pub const ERR: u32 = libc::EPOLLERR as u32;

/// One readiness: the token the descriptor was watched under, and its bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    pub token: u64,
    pub events: u32,
}

pub struct Epoll {
    fd: OwnedFd,
    ready: Vec<libc::epoll_event>,
    pwait2: bool,
    /// Why waits fell back to `epoll_wait`, until the owner took it (to log).
    fell_back: Option<io::Error>,
}

impl Epoll {
    /// An epoll set whose `wait` reports up to `capacity` events at a time
    /// (0 for a set that is only watched by another epoll).
    pub fn new(capacity: usize) -> io::Result<Epoll> {
        // SAFETY: epoll_create1 returns a new descriptor or -1.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor, owned from here on.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Epoll { fd, ready: vec![libc::epoll_event { events: 0, u64: 0 }; capacity], pwait2: true, fell_back: None })
    }

    fn ctl(&self, op: libc::c_int, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: token };
        // SAFETY: ev is a valid epoll_event for the call's duration.
        if unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), op, fd, &mut ev) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Watches `fd` for `events` (e.g. `IN`), reported under `token`.
    pub fn add(&self, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd, events, token)
    }

    /// Changes what `fd` is watched for, or its token.
    pub fn modify(&self, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_MOD, fd, events, token)
    }

    /// Stops watching `fd`; a descriptor not watched (or closed) is no error.
    pub fn delete(&self, fd: RawFd) {
        // SAFETY: a null event is allowed for EPOLL_CTL_DEL.
        unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()) };
    }

    /// Waits up to `timeout` (None: until an event); returns how many events
    /// are ready (0 on timeout or a signal), each read with `event(i)`.
    pub fn wait(&mut self, timeout: Option<Duration>) -> io::Result<usize> {
        loop {
            let cap = self.ready.len().max(1) as libc::c_int;
            let n = if self.pwait2 {
                let ts = timeout.map(|d| libc::timespec { tv_sec: d.as_secs() as _, tv_nsec: d.subsec_nanos() as _ });
                let tsp = ts.as_ref().map_or(std::ptr::null(), |t| t as *const libc::timespec);
                // SAFETY: `ready` has room for `cap` entries (it is never
                // empty when waited on: see below); tsp is null or valid.
                unsafe {
                    libc::syscall(
                        libc::SYS_epoll_pwait2,
                        self.fd.as_raw_fd(),
                        self.ready_ptr(),
                        cap,
                        tsp,
                        std::ptr::null::<libc::sigset_t>(),
                        0usize,
                    ) as libc::c_int
                }
            } else {
                // Round up, so that a short sleep is not a busy spin.
                let ms = timeout.map_or(-1, |d| d.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int);
                // SAFETY: `ready` has room for `cap` entries.
                unsafe { libc::epoll_wait(self.fd.as_raw_fd(), self.ready_ptr(), cap, ms) }
            };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => return Ok(0),
                Some(libc::ENOSYS | libc::EPERM) if self.pwait2 => {
                    self.pwait2 = false;
                    self.fell_back = Some(e);
                }
                _ => return Err(e),
            }
        }
    }

    fn ready_ptr(&mut self) -> *mut libc::epoll_event {
        if self.ready.is_empty() {
            self.ready.push(libc::epoll_event { events: 0, u64: 0 });
        }
        self.ready.as_mut_ptr()
    }

    /// The `i`-th event of the last `wait`.
    #[inline]
    pub fn event(&self, i: usize) -> Event {
        let e = self.ready[i];
        Event { token: e.u64, events: e.events }
    }

    /// Once, after waits fell back to millisecond `epoll_wait`: why.
    pub fn take_fallback(&mut self) -> Option<io::Error> {
        self.fell_back.take()
    }
}

impl AsRawFd for Epoll {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eventfd::EventFd;

    #[test]
    fn reports_a_ready_descriptor_under_its_token_and_forgets_it_when_deleted() {
        let mut ep = Epoll::new(8).unwrap();
        let a = EventFd::new().unwrap();
        ep.add(a.as_raw_fd(), IN, 42).unwrap();
        assert_eq!(ep.wait(Some(Duration::ZERO)).unwrap(), 0);
        a.notify().unwrap();
        assert_eq!(ep.wait(Some(Duration::from_millis(100))).unwrap(), 1);
        assert_eq!(ep.event(0), Event { token: 42, events: IN });
        ep.modify(a.as_raw_fd(), IN, 7).unwrap();
        assert_eq!(ep.wait(Some(Duration::ZERO)).unwrap(), 1);
        assert_eq!(ep.event(0).token, 7);
        ep.delete(a.as_raw_fd());
        ep.delete(a.as_raw_fd()); // twice: no error, no panic
        assert_eq!(ep.wait(Some(Duration::ZERO)).unwrap(), 0);
    }

    #[test]
    fn a_watch_only_set_is_readable_through_an_outer_set() {
        let inner = Epoll::new(0).unwrap();
        let mut outer = Epoll::new(4).unwrap();
        outer.add(inner.as_raw_fd(), IN, 1).unwrap();
        let e = EventFd::new().unwrap();
        inner.add(e.as_raw_fd(), IN, 2).unwrap();
        assert_eq!(outer.wait(Some(Duration::ZERO)).unwrap(), 0);
        e.notify().unwrap();
        assert_eq!(outer.wait(Some(Duration::from_millis(100))).unwrap(), 1);
        assert_eq!(outer.event(0).token, 1);
    }
}
