//! Eventfds: made one way (non-blocking, close-on-exec), so that a write
//! never blocks the writer and a read never blocks the reader.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// A non-blocking eventfd.
#[derive(Debug)]
pub struct EventFd(OwnedFd);

impl EventFd {
    pub fn new() -> io::Result<EventFd> {
        // SAFETY: eventfd(2) returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor, owned from here on.
        Ok(EventFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Adds one to the counter, making the descriptor readable. Never
    /// blocks: a counter at its maximum (never reached by ones) fails with
    /// EAGAIN, and it is readable then anyway.
    pub fn notify(&self) -> io::Result<()> {
        write_one(self.0.as_raw_fd())
    }

    /// Reads and resets the counter; 0 if it was 0 (nothing pending).
    pub fn drain(&self) -> u64 {
        drain(self.0.as_raw_fd())
    }

    pub fn into_owned(self) -> OwnedFd {
        self.0
    }
}

/// Adds one to the eventfd `fd`'s counter (non-blocking if `fd` is).
pub fn write_one(fd: RawFd) -> io::Result<()> {
    let one = 1u64.to_ne_bytes();
    // SAFETY: writing 8 bytes from a local buffer.
    if unsafe { libc::write(fd, one.as_ptr().cast(), 8) } == 8 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Reads and resets the eventfd `fd`'s counter; 0 if nothing was pending
/// (or the read failed).
pub fn drain(fd: RawFd) -> u64 {
    let mut v = [0u8; 8];
    // SAFETY: reading an eventfd's 8-byte counter into a local buffer.
    if unsafe { libc::read(fd, v.as_mut_ptr().cast(), 8) } == 8 {
        u64::from_ne_bytes(v)
    } else {
        0
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

impl AsFd for EventFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_up_and_drains_without_blocking() {
        let e = EventFd::new().unwrap();
        assert_eq!(e.drain(), 0, "nothing pending, and the read did not block");
        e.notify().unwrap();
        e.notify().unwrap();
        assert_eq!(e.drain(), 2);
        assert_eq!(e.drain(), 0);
    }
}
