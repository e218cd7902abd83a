//! VXLAN (RFC 7348) encapsulation: an 8-byte header — flags with the I bit
//! (a valid VNI follows), 24 reserved bits, the 24-bit VNI, 8 reserved bits —
//! then the Ethernet frame, in a UDP datagram to port 4789. This is what the
//! Linux kernel's `vxlan` device sends and accepts.

pub const HDR_LEN: usize = 8;
const FLAG_I: u8 = 0x08;

pub fn header(vni: u32) -> [u8; HDR_LEN] {
    [FLAG_I, 0, 0, 0, (vni >> 16) as u8, (vni >> 8) as u8, vni as u8, 0]
}

/// The VNI of a VXLAN datagram, or `None` if it has no valid VXLAN header.
pub fn parse(datagram: &[u8]) -> Option<u32> {
    let h = datagram.get(..HDR_LEN)?;
    if h[0] & FLAG_I == 0 {
        return None;
    }
    Some((h[4] as u32) << 16 | (h[5] as u32) << 8 | h[6] as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects() {
        let h = header(0x12_3456);
        assert_eq!(h, [0x08, 0, 0, 0, 0x12, 0x34, 0x56, 0]);
        assert_eq!(parse(&h), Some(0x12_3456));
        assert_eq!(parse(&h[..7]), None);
        assert_eq!(parse(&[0u8; 8]), None, "I flag clear");
    }
}
