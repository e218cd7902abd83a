//! A frame taken from a guest's transmit queue without copying it whole
//! (cut-through): its first bytes, which hold every header the forwarder
//! routes on, copied into vnetd's memory (`HeadCopy`); the rest left where
//! it lies in guest memory, in up to `MAX_PIECES` pieces, and sent from
//! there.
//!
//! The guest may keep writing its buffers while vnetd holds them (the
//! security review's S1 flipped a destination MAC after routing, and frames
//! crossed networks). What it can change is the payload vnetd sends, never
//! the headers vnetd routed by nor where the frame goes; and since the
//! forwarder only ever gets the head as `&mut`, nothing it writes (a
//! finished checksum) lands in guest memory.

use std::sync::Arc;
use vnet_core::offload::{VnetHdr, MAX_PIECES};

/// Every frame longer than this is split into a copied head and pieces in
/// place; a shorter one is copied whole (cheaper than an iovec).
pub const MAX_HEAD: usize = 256;
/// The head holds at least this much (any Ethernet, IP and TCP headers:
/// 18 + 40 + 60), or the guest's first buffer if that holds its TCP
/// headers whole (as Linux sends).
pub const MIN_HEAD: usize = 128;

/// The first bytes of a frame, copied out of guest memory.
pub struct HeadCopy {
    bytes: [u8; MAX_HEAD],
    len: usize,
}

impl HeadCopy {
    pub fn as_slice(&self) -> &[u8] {
        &self.bytes[..self.len]
    }

    /// Room to copy `n` more bytes into (the ring's to fill).
    pub(crate) fn extend(&mut self, n: usize) -> Option<&mut [u8]> {
        let r = self.bytes.get_mut(self.len..self.len + n)?;
        self.len += n;
        Some(r)
    }

    pub(crate) fn clear(&mut self) {
        self.len = 0;
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// One frame from the guest: a head vnetd owns, then pieces in place. Each
/// dispatcher has one, refilled frame after frame (nothing allocated per
/// frame; the mapping's count is the only shared write).
pub struct GuestFrame {
    pub(crate) head: HeadCopy,
    /// (host address, length) of each piece after the head, inside the
    /// mapping `mapping` keeps alive.
    pub(crate) pieces: Vec<(usize, usize)>,
    pub vnet: VnetHdr,
    pub(crate) mapping: Option<Arc<dyn Send + Sync>>,
}

impl Default for GuestFrame {
    fn default() -> GuestFrame {
        GuestFrame { head: HeadCopy { bytes: [0; MAX_HEAD], len: 0 }, pieces: Vec::with_capacity(MAX_PIECES), vnet: VnetHdr::default(), mapping: None }
    }
}

impl GuestFrame {
    /// The head (vnetd's copy: route on it, finish checksums in it) and the
    /// pieces after it, in `rest` (how many: the second value).
    ///
    /// The pieces are memory the guest shares and may write while they are
    /// sent; they are only ever read, as bytes, to be copied or sent.
    pub fn parts<'a>(&'a mut self, rest: &mut [&'a [u8]; MAX_PIECES]) -> (&'a mut [u8], usize) {
        assert!(self.mapping.is_some(), "no frame held");
        for (d, &(p, l)) in rest.iter_mut().zip(&self.pieces) {
            // SAFETY: every piece lies inside the mapping held (the ring
            // found it there); u8 has no invalid values.
            *d = unsafe { std::slice::from_raw_parts(p as *const u8, l) };
        }
        (&mut self.head.bytes[..self.head.len], self.pieces.len())
    }

    /// The frame's length.
    pub fn len(&self) -> usize {
        self.head.len + self.pieces.iter().map(|p| p.1).sum::<usize>()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The head's length.
    pub fn head_len(&self) -> usize {
        self.head.len
    }

    /// Done with the frame: its mapping may go.
    pub fn release(&mut self) {
        self.mapping = None;
        self.pieces.clear();
        self.head.clear();
    }
}
