//! Notifications both ways, on descriptors the frontend gave: the guest's
//! interrupt (`Notifier`, the call eventfd) and its kick (`Kick`).
//!
//! Both are built only from a descriptor verified to be an eventfd and made
//! non-blocking (the security review's S2: a full pipe given as a call
//! descriptor blocked a dispatcher in `write(2)`, and with it every guest it
//! served). An eventfd whose counter is full makes `write` fail with
//! `EAGAIN`, which means an interrupt is pending anyway.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

/// Why a descriptor was refused.
#[derive(Debug)]
pub struct NotAnEventFd(pub String);

impl std::fmt::Display for NotAnEventFd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "not an eventfd ({})", self.0)
    }
}

/// Checks that `file` is an eventfd and makes it non-blocking.
fn verified(file: File) -> Result<OwnedFd, NotAnEventFd> {
    let fd = file.as_raw_fd();
    // An eventfd is an anonymous inode; its link in /proc names it.
    let what = std::fs::read_link(format!("/proc/self/fd/{fd}")).map_err(|e| NotAnEventFd(format!("cannot tell: {e}")))?;
    if what.as_os_str() != "anon_inode:[eventfd]" {
        return Err(NotAnEventFd(what.display().to_string()));
    }
    // SAFETY: fcntl on a descriptor we own.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(NotAnEventFd(format!("fcntl: {}", io::Error::last_os_error())));
    }
    Ok(OwnedFd::from(file))
}

/// What signalling the guest did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    Signalled,
    /// The eventfd's counter is full: an interrupt is pending already.
    AlreadyPending,
    /// The frontend made the descriptor blocking again (it shares the open
    /// file): not written, since a write could block.
    Blocking,
    Failed,
}

/// The guest's interrupt (the ring's call eventfd).
pub struct Notifier(OwnedFd);

impl Notifier {
    pub fn new(file: File) -> Result<Notifier, NotAnEventFd> {
        verified(file).map(Notifier)
    }

    /// Interrupts the guest; never blocks. The frontend shares the
    /// eventfd's open file and could clear `O_NONBLOCK` again (Linux's
    /// eventfd takes no per-write non-blocking flag): the flag is looked at
    /// first, and a descriptor made blocking is never written.
    pub fn try_signal(&self) -> Signal {
        let fd = self.0.as_raw_fd();
        // SAFETY: fcntl on a descriptor we hold.
        if unsafe { libc::fcntl(fd, libc::F_GETFL) } & libc::O_NONBLOCK == 0 {
            return Signal::Blocking;
        }
        match vnet_sys::eventfd::write_one(fd) {
            Ok(()) => Signal::Signalled,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Signal::AlreadyPending,
            Err(_) => Signal::Failed,
        }
    }

    /// Its descriptor (to hand the device over to another vnetd).
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.0.as_fd()
    }

    /// Whether the last interrupt is still unread by the frontend (the
    /// eventfd readable): another would only add to its counter.
    pub fn pending(&self) -> bool {
        let mut p = libc::pollfd { fd: self.0.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one pollfd, no wait.
        unsafe { libc::poll(&mut p, 1, 0) == 1 && p.revents & libc::POLLIN != 0 }
    }
}

/// The guest's kick (the ring's kick eventfd), which the dispatcher watches.
pub struct Kick(OwnedFd);

impl Kick {
    pub fn new(file: File) -> Result<Kick, NotAnEventFd> {
        verified(file).map(Kick)
    }

    /// Consumes pending kicks.
    pub fn clear(&self) {
        vnet_sys::eventfd::drain(self.0.as_raw_fd());
    }
}

impl AsRawFd for Kick {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn only_eventfds_are_taken_and_a_full_one_never_blocks() {
        let (r, w) = std::io::pipe().unwrap();
        assert!(Notifier::new(File::from(OwnedFd::from(w))).is_err());
        assert!(Kick::new(File::from(OwnedFd::from(r))).is_err());
        assert!(Notifier::new(File::open("/dev/null").unwrap()).is_err());
        // A blocking eventfd at the counter's top: a write would block.
        // SAFETY: eventfd(2) with no flags.
        let fd = unsafe { libc::eventfd(0, 0) };
        assert!(fd >= 0);
        let mut f = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        f.write_all(&0xffff_ffff_ffff_fffeu64.to_ne_bytes()).unwrap();
        let n = Notifier::new(f).unwrap();
        assert_eq!(n.try_signal(), Signal::AlreadyPending);
        assert!(n.pending());
        // The frontend clears O_NONBLOCK on the file it shares: never written.
        // SAFETY: fcntl on the test's descriptor.
        unsafe { libc::fcntl(n.0.as_raw_fd(), libc::F_SETFL, 0) };
        assert_eq!(n.try_signal(), Signal::Blocking);
    }
}
