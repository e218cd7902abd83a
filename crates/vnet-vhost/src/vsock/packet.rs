//! The virtio-vsock packet header (virtio 1.2, 5.10.6): 44 bytes,
//! little-endian, before each packet's payload on all three of the device's
//! rings. What the guest wrote is parsed once, from a copy vnetd owns, and
//! refused whole if it could not be a stream packet from this guest.

/// The host's context ID: the other end of every guest connection.
pub const HOST_CID: u64 = 2;
/// Header length.
pub const HDR_LEN: usize = 44;
/// `type`: a stream socket (the only type offered; SEQPACKET is a feature).
pub const TYPE_STREAM: u16 = 1;
/// The `flags` of a SHUTDOWN: no more to receive, no more to send.
pub const SHUTDOWN_RCV: u32 = 1;
pub const SHUTDOWN_SEND: u32 = 2;

/// What a packet asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum Op {
    Request = 1,
    Response = 2,
    Rst = 3,
    Shutdown = 4,
    Rw = 5,
    CreditUpdate = 6,
    CreditRequest = 7,
}

impl Op {
    fn from_u16(v: u16) -> Option<Op> {
        Some(match v {
            1 => Op::Request,
            2 => Op::Response,
            3 => Op::Rst,
            4 => Op::Shutdown,
            5 => Op::Rw,
            6 => Op::CreditUpdate,
            7 => Op::CreditRequest,
            _ => return None,
        })
    }
}

/// One header, as vnetd reads or writes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub src_cid: u64,
    pub dst_cid: u64,
    pub src_port: u32,
    pub dst_port: u32,
    /// Payload bytes after the header (RW only).
    pub len: u32,
    pub op: Op,
    pub flags: u32,
    /// The sender's receive buffer, and how much of what it received it has
    /// handed on: its credit to the other side (5.10.6.3).
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}

/// Why a packet from the guest was refused (each one counted).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Shorter than a header.
    Short,
    /// Not a stream packet (`type`), or an op virtio does not define.
    Kind,
    /// A source other than the guest's own CID, or a destination other
    /// than the host: a guest names only itself and its host.
    Address,
    /// `len` on anything but RW, or more than the chain holds.
    Length,
}

impl Header {
    /// A header from the host to the guest `cid`.
    pub fn to_guest(cid: u64, src_port: u32, dst_port: u32, op: Op) -> Header {
        Header { src_cid: HOST_CID, dst_cid: cid, src_port, dst_port, len: 0, op, flags: 0, buf_alloc: 0, fwd_cnt: 0 }
    }

    /// Parses a header the guest `cid` wrote, with `payload` bytes after it
    /// in its chain.
    pub fn parse(b: &[u8], cid: u64, payload: usize) -> Result<Header, Refusal> {
        let b: &[u8; HDR_LEN] = b.get(..HDR_LEN).and_then(|b| b.try_into().ok()).ok_or(Refusal::Short)?;
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        if u16_at(28) != TYPE_STREAM {
            return Err(Refusal::Kind);
        }
        let op = Op::from_u16(u16_at(30)).ok_or(Refusal::Kind)?;
        let h = Header {
            src_cid: u64_at(0),
            dst_cid: u64_at(8),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            op,
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        };
        if h.src_cid != cid || h.dst_cid != HOST_CID {
            return Err(Refusal::Address);
        }
        if (h.op != Op::Rw && h.len != 0) || h.len as usize > payload {
            return Err(Refusal::Length);
        }
        Ok(h)
    }

    pub fn encode(&self) -> [u8; HDR_LEN] {
        let mut b = [0u8; HDR_LEN];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&TYPE_STREAM.to_le_bytes());
        b[30..32].copy_from_slice(&(self.op as u16).to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from_guest(op: Op, len: u32) -> Header {
        Header { src_cid: 3, dst_cid: HOST_CID, src_port: 1025, dst_port: 5201, len, op, flags: 0, buf_alloc: 65536, fwd_cnt: 7 }
    }

    #[test]
    fn a_header_reads_back_as_written() {
        let h = from_guest(Op::Rw, 100);
        assert_eq!(Header::parse(&h.encode(), 3, 100), Ok(h));
    }

    #[test]
    fn a_guest_names_only_itself_and_its_host() {
        let mut h = from_guest(Op::Request, 0);
        h.src_cid = 4; // another VM's CID
        assert_eq!(Header::parse(&h.encode(), 3, 0), Err(Refusal::Address));
        let mut h = from_guest(Op::Request, 0);
        h.dst_cid = 5; // a guest-to-guest packet
        assert_eq!(Header::parse(&h.encode(), 3, 0), Err(Refusal::Address));
    }

    #[test]
    fn lengths_past_the_chain_or_off_rw_are_refused() {
        assert_eq!(Header::parse(&from_guest(Op::Rw, 101).encode(), 3, 100), Err(Refusal::Length));
        assert_eq!(Header::parse(&from_guest(Op::Request, 1).encode(), 3, 100), Err(Refusal::Length));
        assert_eq!(Header::parse(&from_guest(Op::Rw, 0).encode()[..43], 3, 0), Err(Refusal::Short));
    }

    #[test]
    fn unknown_ops_and_types_are_refused() {
        let mut b = from_guest(Op::Rw, 0).encode();
        b[30] = 8;
        assert_eq!(Header::parse(&b, 3, 0), Err(Refusal::Kind));
        let mut b = from_guest(Op::Rw, 0).encode();
        b[28] = 2; // SEQPACKET, not offered
        assert_eq!(Header::parse(&b, 3, 0), Err(Refusal::Kind));
    }
}
