//! Ethernet MAC addresses and the few frame-header reads the core needs.

use std::fmt;
use std::str::FromStr;

/// Length of an Ethernet header: destination MAC, source MAC, ethertype.
pub const ETH_HEADER_LEN: usize = 14;

#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Mac(pub [u8; 6]);

impl Mac {
    pub const BROADCAST: Mac = Mac([0xff; 6]);

    pub fn is_multicast(&self) -> bool {
        self.0[0] & 1 == 1
    }
}

impl fmt::Display for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        write!(f, "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}", b[0], b[1], b[2], b[3], b[4], b[5])
    }
}

impl fmt::Debug for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for Mac {
    type Err = String;

    /// Accepts `aa:bb:cc:dd:ee:ff` or `aa-bb-cc-dd-ee-ff`, any case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || format!("'{s}' is not a MAC address (want six hex bytes like 02:00:00:00:00:01)");
        let parts: Vec<&str> = s.split([':', '-']).collect();
        if parts.len() != 6 {
            return Err(bad());
        }
        let mut mac = [0u8; 6];
        for (byte, part) in mac.iter_mut().zip(parts) {
            if part.is_empty() || part.len() > 2 {
                return Err(bad());
            }
            *byte = u8::from_str_radix(part, 16).map_err(|_| bad())?;
        }
        Ok(Mac(mac))
    }
}

/// The destination and source MACs of an Ethernet frame, or `None` for a runt
/// shorter than an Ethernet header.
#[inline]
pub fn frame_macs(frame: &[u8]) -> Option<(Mac, Mac)> {
    if frame.len() < ETH_HEADER_LEN {
        return None;
    }
    let dst = Mac(frame[0..6].try_into().unwrap());
    let src = Mac(frame[6..12].try_into().unwrap());
    Some((dst, src))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        let m: Mac = "02:AB:cd:00:0f:10".parse().unwrap();
        assert_eq!(m.0, [0x02, 0xab, 0xcd, 0x00, 0x0f, 0x10]);
        assert_eq!(m.to_string(), "02:ab:cd:00:0f:10");
        assert_eq!("02-ab-cd-00-0f-10".parse::<Mac>().unwrap(), m);
    }

    #[test]
    fn rejects_garbage() {
        for s in ["", "02:00:00:00:00", "02:00:00:00:00:00:00", "zz:00:00:00:00:00", "002:00:00:00:00:0", "02::00:00:00:00"] {
            assert!(s.parse::<Mac>().is_err(), "{s}");
        }
    }

    #[test]
    fn runt_frames_have_no_macs() {
        assert!(frame_macs(&[0u8; 13]).is_none());
        let mut f = [0u8; 14];
        f[0..6].copy_from_slice(&[0xff; 6]);
        f[6..12].copy_from_slice(&[2, 0, 0, 0, 0, 1]);
        let (d, s) = frame_macs(&f).unwrap();
        assert_eq!(d, Mac::BROADCAST);
        assert!(d.is_multicast());
        assert_eq!(s.to_string(), "02:00:00:00:00:01");
    }
}
