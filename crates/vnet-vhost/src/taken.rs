//! How far each transmit ring has been taken, kept where a vnetd that is
//! killed leaves it: a page of a memfd the descriptor store holds with the
//! device's state (`taken` among `Exported`'s descriptors).
//!
//! A frame is taken from the guest's ring, then sent, and only then is its
//! buffer handed back (the used index published): a frame sent from where
//! it lay must not be handed back before. A vnetd killed between the send
//! and the hand-back leaves the used index behind what it sent; the next
//! vnetd, reading the used index back from guest memory, would send those
//! frames a second time (a ping answered twice). So the next index to
//! take is written here before each frame goes to be sent, and the next
//! vnetd resumes from it: the frames between the used index and it are
//! handed back unsent. A frame is sent at most once across a crash: the
//! one a vnetd was killed in the middle of sending may be lost, never
//! duplicated. One relaxed store per frame, into memory vnetd owns.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};

/// A word's bit saying it holds an index (the low 16 bits); a ring not
/// running has none.
const SET: u32 = 1 << 16;
const LEN: usize = 4096;
/// Pairs a log has room for (a device has `MAX_PAIRS`).
const WORDS: usize = LEN / 4;

/// One word per pair: the next index its transmit ring takes.
pub struct TakenLog {
    fd: OwnedFd,
    words: NonNull<AtomicU32>,
}

// SAFETY: the mapping is owned by the log for its whole life and only
// ever accessed through atomics.
unsafe impl Send for TakenLog {}
unsafe impl Sync for TakenLog {}

impl TakenLog {
    pub fn new() -> io::Result<TakenLog> {
        // SAFETY: plain system calls; every result is checked.
        unsafe {
            let fd = libc::memfd_create(c"vnetd-tx-taken".as_ptr(), libc::MFD_CLOEXEC);
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            let fd = OwnedFd::from_raw_fd(fd);
            if libc::ftruncate(fd.as_raw_fd(), LEN as libc::off_t) < 0 {
                return Err(io::Error::last_os_error());
            }
            let p = libc::mmap(std::ptr::null_mut(), LEN, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0);
            if p == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
            Ok(TakenLog { fd, words: NonNull::new(p.cast()).expect("mmap gives no null") })
        }
    }

    fn word(&self, pair: usize) -> &AtomicU32 {
        assert!(pair < WORDS);
        // SAFETY: inside the page mapped for the log's life, aligned.
        unsafe { &*self.words.as_ptr().add(pair) }
    }

    /// Pair `pair`'s transmit ring takes `next` next.
    #[inline]
    pub fn set(&self, pair: usize, next: u16) {
        self.word(pair).store(SET | u32::from(next), Relaxed);
    }

    /// Pair `pair`'s transmit ring takes nothing (stopped, reset).
    pub fn clear(&self, pair: usize) {
        self.word(pair).store(0, Relaxed);
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.fd.as_fd()
    }

    /// What a log another vnetd kept says of its first `N` pairs: read,
    /// never mapped (a file too short, or unreadable, says nothing).
    pub fn read<const N: usize>(fd: &OwnedFd) -> [Option<u16>; N] {
        let mut buf = vec![0u8; 4 * N.min(WORDS)];
        let mut out = [None; N];
        // SAFETY: reads into a buffer of the length given.
        let n = unsafe { libc::pread(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n != buf.len() as isize {
            return out;
        }
        for (k, w) in buf.chunks_exact(4).enumerate() {
            let w = u32::from_ne_bytes(w.try_into().unwrap());
            if w & !0xffff == SET {
                out[k] = Some(w as u16);
            }
        }
        out
    }
}

impl Drop for TakenLog {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.words.as_ptr().cast(), LEN) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_one_log_says_another_reads_through_its_descriptor() {
        let log = TakenLog::new().unwrap();
        log.set(0, 65535);
        log.set(3, 7);
        log.set(5, 1);
        log.clear(5);
        let fd = log.fd().try_clone_to_owned().unwrap();
        drop(log);
        let got = TakenLog::read::<8>(&fd);
        assert_eq!(got[0], Some(65535));
        assert_eq!(got[3], Some(7));
        assert_eq!(got[5], None, "cleared");
        assert_eq!(got[1], None, "never set");
    }

    #[test]
    fn a_file_that_is_not_a_log_says_nothing() {
        let fd: OwnedFd = std::fs::File::open("/dev/null").unwrap().into();
        assert_eq!(TakenLog::read::<8>(&fd), [None; 8]);
    }
}
