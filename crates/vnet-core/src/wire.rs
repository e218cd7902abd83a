//! Parsing what arrives from the network, besides the frames themselves:
//! VXLAN headers (RFC 7348), the length prefixes of TCP links, and the runs
//! of datagrams UDP GRO delivers in one buffer. Pure functions, fuzzed.

use std::ops::Range;

/// VXLAN header length: flags with the I bit, 24 reserved bits, the 24-bit
/// VNI, 8 reserved bits.
pub const VXLAN_HDR_LEN: usize = 8;
const VXLAN_FLAG_I: u8 = 0x08;

pub fn vxlan_header(vni: u32) -> [u8; VXLAN_HDR_LEN] {
    [VXLAN_FLAG_I, 0, 0, 0, (vni >> 16) as u8, (vni >> 8) as u8, vni as u8, 0]
}

/// The VNI of a VXLAN datagram, or `None` if it has no valid VXLAN header.
pub fn parse_vxlan(datagram: &[u8]) -> Option<u32> {
    let h = datagram.get(..VXLAN_HDR_LEN)?;
    if h[0] & VXLAN_FLAG_I == 0 {
        return None;
    }
    Some((h[4] as u32) << 16 | (h[5] as u32) << 8 | h[6] as u32)
}

/// Largest frame a TCP link carries (64 KiB MTU plus Ethernet and VLAN headers).
pub const MAX_TCP_FRAME: usize = 65535 + 18;

/// The length a TCP link's 4-byte big-endian prefix announces, if it is one
/// a frame can have (an Ethernet header at least, `MAX_TCP_FRAME` at most).
pub fn tcp_frame_len(prefix: [u8; 4]) -> Option<usize> {
    let n = u32::from_be_bytes(prefix) as usize;
    (14..=MAX_TCP_FRAME).contains(&n).then_some(n)
}

/// The datagrams of a received buffer of `len` bytes: one, or (with UDP GRO)
/// consecutive runs of `seg` bytes, the last possibly shorter. An empty
/// datagram is one empty range, so that it too is counted.
pub fn gro_segments(len: usize, seg: usize) -> impl Iterator<Item = Range<usize>> {
    let seg = if seg == 0 { len.max(1) } else { seg };
    (0..len.div_ceil(seg).max(1)).map(move |i| i * seg..((i + 1) * seg).min(len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vxlan_round_trips_and_rejects() {
        let h = vxlan_header(0x12_3456);
        assert_eq!(h, [0x08, 0, 0, 0, 0x12, 0x34, 0x56, 0]);
        assert_eq!(parse_vxlan(&h), Some(0x12_3456));
        assert_eq!(parse_vxlan(&h[..7]), None);
        assert_eq!(parse_vxlan(&[0u8; 8]), None, "I flag clear");
    }

    #[test]
    fn tcp_lengths_are_bounded() {
        assert_eq!(tcp_frame_len(64u32.to_be_bytes()), Some(64));
        assert_eq!(tcp_frame_len(13u32.to_be_bytes()), None);
        assert_eq!(tcp_frame_len((MAX_TCP_FRAME as u32 + 1).to_be_bytes()), None);
        assert_eq!(tcp_frame_len(u32::MAX.to_be_bytes()), None);
    }

    #[test]
    fn gro_runs_split_into_datagrams() {
        assert_eq!(gro_segments(10, 0).collect::<Vec<_>>(), vec![0..10]);
        assert_eq!(gro_segments(10, 4).collect::<Vec<_>>(), vec![0..4, 4..8, 8..10]);
        assert_eq!(gro_segments(8, 4).collect::<Vec<_>>(), vec![0..4, 4..8]);
        assert_eq!(gro_segments(0, 4).collect::<Vec<_>>(), vec![0..0]);
        assert_eq!(gro_segments(0, 0).collect::<Vec<_>>(), vec![0..0]);
    }
}
