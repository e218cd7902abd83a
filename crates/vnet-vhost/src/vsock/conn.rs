//! One vsock stream connection's state and credit (virtio 1.2, 5.10.6.3):
//! each side says how much it can buffer (`buf_alloc`) and how much of what
//! it received it has handed on (`fwd_cnt`), and never sends more than the
//! other has room for. A guest that sends past the credit vnetd gave it is
//! reset (`Credit::accept`), so what vnetd holds for a connection is
//! bounded by `BUF_ALLOC` whatever the guest does.

use super::packet::{Header, Op};

/// What vnetd buffers of one connection's bytes from the guest that the
/// host side has not taken yet: the credit it gives the guest.
pub const BUF_ALLOC: u32 = 256 * 1024;

/// Where a connection stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// The guest asked (REQUEST); the host side is connecting.
    Connecting,
    /// The host side asked; the guest has been sent a REQUEST.
    Requesting,
    Established,
}

/// Both sides' credit, in bytes (the counters wrap, as virtio's do).
#[derive(Clone, Copy, Debug, Default)]
pub struct Credit {
    /// The guest's receive buffer and how much it has handed on.
    pub peer_buf_alloc: u32,
    pub peer_fwd_cnt: u32,
    /// Bytes sent to the guest.
    pub tx_cnt: u32,
    /// Bytes taken from the guest, and of those handed to the host side.
    pub rx_cnt: u32,
    pub fwd_cnt: u32,
    /// The `fwd_cnt` last told the guest.
    pub told_fwd: u32,
}

impl Credit {
    /// What the guest's last header says of its side.
    pub fn heard(&mut self, h: &Header) {
        self.peer_buf_alloc = h.buf_alloc;
        self.peer_fwd_cnt = h.fwd_cnt;
    }

    /// Bytes the guest has room for now. A guest that claims to have
    /// handed on more than it was sent has none.
    pub fn peer_free(&self) -> u32 {
        let in_flight = self.tx_cnt.wrapping_sub(self.peer_fwd_cnt);
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    /// `n` bytes sent to the guest.
    pub fn sent(&mut self, n: u32) {
        self.tx_cnt = self.tx_cnt.wrapping_add(n);
    }

    /// `len` bytes arrived from the guest: false if they are past the
    /// credit it was given (the connection is reset, nothing taken).
    pub fn accept(&mut self, len: u32) -> bool {
        let held = self.rx_cnt.wrapping_sub(self.fwd_cnt);
        if u64::from(held) + u64::from(len) > u64::from(BUF_ALLOC) {
            return false;
        }
        self.rx_cnt = self.rx_cnt.wrapping_add(len);
        true
    }

    /// Bytes from the guest vnetd holds (accepted, not yet handed on).
    pub fn held(&self) -> u32 {
        self.rx_cnt.wrapping_sub(self.fwd_cnt)
    }

    /// `n` bytes handed to the host side.
    pub fn forwarded(&mut self, n: u32) {
        self.fwd_cnt = self.fwd_cnt.wrapping_add(n);
    }

    /// Whether the guest should hear of the room made since it was last
    /// told (a quarter of the buffer), before it runs out.
    pub fn update_due(&self) -> bool {
        self.fwd_cnt.wrapping_sub(self.told_fwd) >= BUF_ALLOC / 4
    }

    /// Writes vnetd's side into a header going to the guest.
    pub fn stamp(&mut self, h: &mut Header) {
        h.buf_alloc = BUF_ALLOC;
        h.fwd_cnt = self.fwd_cnt;
        self.told_fwd = self.fwd_cnt;
    }
}

/// Control packets a connection owes the guest, sent as receive buffers
/// come (in this order, before data).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Owed {
    pub request: bool,
    pub response: bool,
    pub credit_update: bool,
    /// SHUTDOWN flags (0: none owed).
    pub shutdown: u32,
}

impl Owed {
    pub fn any(&self) -> bool {
        self.request || self.response || self.credit_update || self.shutdown != 0
    }

    /// The next one owed, taken.
    pub fn take(&mut self) -> Option<(Op, u32)> {
        if std::mem::take(&mut self.request) {
            return Some((Op::Request, 0));
        }
        if std::mem::take(&mut self.response) {
            return Some((Op::Response, 0));
        }
        if self.shutdown != 0 {
            return Some((Op::Shutdown, std::mem::take(&mut self.shutdown)));
        }
        if std::mem::take(&mut self.credit_update) {
            return Some((Op::CreditUpdate, 0));
        }
        None
    }
}

/// Bytes waiting for a socket that would not take them all: written from
/// the front, added at the back, with no move of what is left for each
/// partial write (the front is reclaimed once it is half the buffer).
#[derive(Debug, Default)]
pub struct Pending {
    buf: Vec<u8>,
    at: usize,
}

impl Pending {
    pub fn is_empty(&self) -> bool {
        self.at == self.buf.len()
    }

    /// What waits, in order.
    pub fn bytes(&self) -> &[u8] {
        &self.buf[self.at..]
    }

    /// The first `n` bytes were written.
    pub fn consumed(&mut self, n: usize) {
        self.at = (self.at + n).min(self.buf.len());
        if self.is_empty() {
            self.buf.clear();
            self.at = 0;
        }
    }

    /// Room for `n` more bytes at the back, to be filled by the caller.
    pub fn grow(&mut self, n: usize) -> &mut [u8] {
        if self.at > 0 && self.at >= self.buf.len() / 2 {
            self.buf.drain(..self.at);
            self.at = 0;
        }
        let end = self.buf.len();
        self.buf.resize(end + n, 0);
        &mut self.buf[end..]
    }

    /// `bytes` first, ahead of anything else (an empty buffer only).
    pub fn start_with(&mut self, bytes: Vec<u8>) {
        debug_assert!(self.is_empty());
        self.buf = bytes;
        self.at = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vsock::packet::{Header, HOST_CID};

    fn from_guest(buf_alloc: u32, fwd_cnt: u32) -> Header {
        Header { src_cid: 3, dst_cid: HOST_CID, src_port: 1, dst_port: 2, len: 0, op: Op::CreditUpdate, flags: 0, buf_alloc, fwd_cnt }
    }

    #[test]
    fn vnetd_sends_no_more_than_the_guest_has_room_for() {
        let mut c = Credit::default();
        c.heard(&from_guest(4096, 0));
        assert_eq!(c.peer_free(), 4096);
        c.sent(4000);
        assert_eq!(c.peer_free(), 96);
        c.heard(&from_guest(4096, 4000));
        assert_eq!(c.peer_free(), 4096);
        // A guest claiming more handed on than it was sent has no room.
        c.heard(&from_guest(4096, 9000));
        assert_eq!(c.peer_free(), 0);
    }

    #[test]
    fn a_guest_past_its_credit_is_refused_and_nothing_is_taken() {
        let mut c = Credit::default();
        assert!(c.accept(BUF_ALLOC - 10));
        assert!(!c.accept(11));
        assert_eq!(c.held(), BUF_ALLOC - 10);
        c.forwarded(BUF_ALLOC - 10);
        assert!(c.accept(BUF_ALLOC));
        assert!(!c.accept(1));
    }

    #[test]
    fn counters_wrap_as_virtios_do() {
        let mut c = Credit { rx_cnt: u32::MAX - 5, fwd_cnt: u32::MAX - 5, tx_cnt: u32::MAX - 1, ..Credit::default() };
        assert!(c.accept(100));
        assert_eq!(c.held(), 100);
        c.heard(&from_guest(1000, u32::MAX - 1));
        c.sent(10);
        assert_eq!(c.peer_free(), 990);
    }

    #[test]
    fn the_guest_hears_of_room_once_a_quarter_of_the_buffer_is_free() {
        let mut c = Credit::default();
        assert!(c.accept(BUF_ALLOC));
        c.forwarded(BUF_ALLOC / 4 - 1);
        assert!(!c.update_due());
        c.forwarded(1);
        assert!(c.update_due());
        let mut h = from_guest(0, 0);
        c.stamp(&mut h);
        assert_eq!((h.buf_alloc, h.fwd_cnt), (BUF_ALLOC, BUF_ALLOC / 4));
        assert!(!c.update_due());
    }

    #[test]
    fn pending_bytes_come_out_in_order_across_partial_writes() {
        let mut p = Pending::default();
        assert!(p.is_empty());
        p.start_with(b"OK 7\n".to_vec());
        p.grow(3).copy_from_slice(b"abc");
        p.consumed(2);
        assert_eq!(p.bytes(), b" 7\nabc");
        p.consumed(3);
        // Over half written: the front is reclaimed as more comes.
        p.grow(2).copy_from_slice(b"de");
        assert_eq!(p.bytes(), b"abcde");
        assert_eq!(p.at, 0);
        p.consumed(5);
        assert!(p.is_empty() && p.buf.is_empty());
    }

    #[test]
    fn owed_packets_come_out_once_each_in_order() {
        let mut o = Owed { response: true, credit_update: true, shutdown: 2, request: false };
        assert_eq!(o.take(), Some((Op::Response, 0)));
        assert_eq!(o.take(), Some((Op::Shutdown, 2)));
        assert_eq!(o.take(), Some((Op::CreditUpdate, 0)));
        assert_eq!(o.take(), None);
        assert!(!o.any());
    }
}
