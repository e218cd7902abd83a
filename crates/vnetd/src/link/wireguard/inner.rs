//! What travels inside the tunnel: each frame as a plain VNET/P datagram, an
//! IP/UDP packet from this host's address toward the peer to the peer's
//! address, both ports vnetd's UDP port (9000), of the underlay's family
//! (IPv4 over an IPv4 underlay, IPv6 over IPv6), so that a host running any
//! WireGuard with a plain vnetd UDP link over the tunnel is a peer too.
//! Padded to a multiple of 16 bytes, as WireGuard's paper asks and
//! wireguard-go does: the packet's own length says where it ends.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::ops::Range;
use vnet_core::offload::{csum_add, csum_fold};

/// The inner IPv4 + UDP header before each frame.
pub const INNER_V4: usize = 28;
/// The inner IPv6 + UDP header.
pub const INNER_V6: usize = 48;
/// Inner packets are padded to a multiple of this.
pub const PAD: usize = 16;

/// The inner header's addresses and ports.
#[derive(Clone, Copy, Debug)]
pub struct Inner {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    pub dport: u16,
}

impl Inner {
    /// The local address the kernel would send to `to` from.
    pub fn toward(to: SocketAddr, port: u16) -> Result<Inner, String> {
        let any: IpAddr = if to.is_ipv4() { Ipv4Addr::UNSPECIFIED.into() } else { Ipv6Addr::UNSPECIFIED.into() };
        let probe = std::net::UdpSocket::bind((any, 0)).map_err(|e| format!("{e}"))?;
        probe.connect(to).map_err(|e| format!("no route to {to}: {e}"))?;
        let src = probe.local_addr().map_err(|e| format!("{e}"))?.ip();
        Ok(Inner { src, dst: to.ip(), sport: port, dport: port })
    }

    /// Bytes of the header.
    pub fn len(&self) -> usize {
        if self.dst.is_ipv4() {
            INNER_V4
        } else {
            INNER_V6
        }
    }

    /// Writes the IP + UDP header for a frame of `len` bytes into `h`
    /// (`self.len()` bytes of it).
    pub fn write(&self, len: usize, h: &mut [u8]) {
        match (self.src, self.dst) {
            (IpAddr::V4(src), IpAddr::V4(dst)) => {
                let total = (INNER_V4 + len) as u16;
                h[0] = 0x45;
                h[1] = 0;
                h[2..4].copy_from_slice(&total.to_be_bytes());
                h[4..6].copy_from_slice(&[0, 0]);
                h[6..8].copy_from_slice(&0x4000u16.to_be_bytes()); // DF: never fragmented inside
                h[8] = 64;
                h[9] = 17;
                h[10..12].copy_from_slice(&[0, 0]);
                h[12..16].copy_from_slice(&src.octets());
                h[16..20].copy_from_slice(&dst.octets());
                let sum = csum_fold(csum_add(0, &h[..20]));
                h[10..12].copy_from_slice(&sum.to_be_bytes());
                self.udp(len, &mut h[20..28]);
                // No UDP checksum (IPv4 allows it): the AEAD tag covers every byte.
            }
            (src, dst) => {
                let (src, dst) = (v6(src), v6(dst));
                h[0] = 0x60;
                h[1..4].copy_from_slice(&[0, 0, 0]);
                h[4..6].copy_from_slice(&((8 + len) as u16).to_be_bytes());
                h[6] = 17;
                h[7] = 64;
                h[8..24].copy_from_slice(&src.octets());
                h[24..40].copy_from_slice(&dst.octets());
                self.udp(len, &mut h[40..48]);
                // IPv6 makes the UDP checksum mandatory (RFC 8200): over
                // the pseudo-header, the UDP header and the frame, which the
                // caller adds with `finish_v6`.
            }
        }
    }

    fn udp(&self, len: usize, u: &mut [u8]) {
        u[0..2].copy_from_slice(&self.sport.to_be_bytes());
        u[2..4].copy_from_slice(&self.dport.to_be_bytes());
        u[4..6].copy_from_slice(&((8 + len) as u16).to_be_bytes());
        u[6..8].copy_from_slice(&[0, 0]);
    }

    /// Completes an IPv6 inner packet's UDP checksum (`p`: header and frame).
    pub fn finish_v6(p: &mut [u8]) {
        if p.len() < INNER_V6 || p[0] >> 4 != 6 {
            return;
        }
        let udp_len = (p.len() - 40) as u32;
        let mut sum = csum_add(0, &p[8..40]);
        sum = csum_add(sum, &udp_len.to_be_bytes());
        sum = csum_add(sum, &[0, 0, 0, 17]);
        sum = csum_add(sum, &p[40..]);
        let c = match csum_fold(sum) {
            0 => 0xffff,
            c => c,
        };
        p[46..48].copy_from_slice(&c.to_be_bytes());
    }
}

fn v6(a: IpAddr) -> Ipv6Addr {
    match a {
        IpAddr::V6(a) => a,
        IpAddr::V4(a) => a.to_ipv6_mapped(),
    }
}

/// The VNET/P frame inside a decrypted packet: IPv4 not a fragment, or IPv6
/// with no extension header, then UDP; its range of `p`.
pub fn inner_frame(p: &[u8]) -> Option<Range<usize>> {
    match p.first()? >> 4 {
        4 => {
            if p.len() < INNER_V4 {
                return None;
            }
            let ihl = (p[0] & 0x0f) as usize * 4;
            let total = u16::from_be_bytes([p[2], p[3]]) as usize;
            let frag = u16::from_be_bytes([p[6], p[7]]) & 0x3fff;
            if ihl < 20 || total > p.len() || total < ihl + 8 || frag != 0 || p[9] != 17 {
                return None;
            }
            let udp_len = u16::from_be_bytes([p[ihl + 4], p[ihl + 5]]) as usize;
            if udp_len < 8 || ihl + udp_len > total {
                return None;
            }
            Some(ihl + 8..ihl + udp_len)
        }
        6 => {
            if p.len() < INNER_V6 || p[6] != 17 {
                return None;
            }
            let payload = u16::from_be_bytes([p[4], p[5]]) as usize;
            let udp_len = u16::from_be_bytes([p[44], p[45]]) as usize;
            if 40 + payload > p.len() || udp_len < 8 || udp_len > payload {
                return None;
            }
            Some(INNER_V6..40 + udp_len)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_inner_header_is_valid_ipv4_udp_and_opens_back_to_the_frame() {
        let inner = Inner { src: Ipv4Addr::new(198, 18, 0, 1).into(), dst: Ipv4Addr::new(198, 18, 0, 2).into(), sport: 9000, dport: 9000 };
        let frame: Vec<u8> = (0..100u8).collect();
        let mut h = [0u8; INNER_V6];
        inner.write(frame.len(), &mut h);
        let mut p = h[..INNER_V4].to_vec();
        p.extend_from_slice(&frame);
        assert_eq!(csum_fold(csum_add(0, &p[..20])), 0, "header checksum verifies");
        assert_eq!(&p[p.len() - 100..], &frame[..]);
        assert_eq!(inner_frame(&p), Some(28..128));
        // Padding after the packet is not the frame's.
        let mut padded = p.clone();
        padded.resize(p.len().div_ceil(PAD) * PAD, 0);
        assert_eq!(inner_frame(&padded), Some(28..128));
        // A fragment, a non-UDP packet, a lying length: not frames.
        let mut frag = p.clone();
        frag[6] = 0x20;
        assert_eq!(inner_frame(&frag), None);
        let mut tcp = p.clone();
        tcp[9] = 6;
        assert_eq!(inner_frame(&tcp), None);
        let mut long = p.clone();
        long[24..26].copy_from_slice(&200u16.to_be_bytes());
        assert_eq!(inner_frame(&long), None);
        assert_eq!(inner_frame(&p[..20]), None);
    }

    #[test]
    fn the_inner_ipv6_header_carries_a_valid_udp_checksum_and_opens_back_to_the_frame() {
        let inner = Inner { src: "fd00::1".parse().unwrap(), dst: "fd00::2".parse().unwrap(), sport: 9000, dport: 9000 };
        let frame: Vec<u8> = (0..101u8).collect();
        let mut h = [0u8; INNER_V6];
        inner.write(frame.len(), &mut h);
        let mut p = h[..INNER_V6].to_vec();
        p.extend_from_slice(&frame);
        Inner::finish_v6(&mut p);
        // The checksum over the pseudo-header and the datagram folds to 0.
        let mut sum = csum_add(0, &p[8..40]);
        sum = csum_add(sum, &((p.len() - 40) as u32).to_be_bytes());
        sum = csum_add(sum, &[0, 0, 0, 17]);
        sum = csum_add(sum, &p[40..]);
        assert_eq!(csum_fold(sum), 0);
        assert_eq!(inner_frame(&p), Some(48..149));
        let mut padded = p.clone();
        padded.resize(p.len().div_ceil(PAD) * PAD, 0);
        assert_eq!(inner_frame(&padded), Some(48..149));
        let mut not_udp = p.clone();
        not_udp[6] = 0;
        assert_eq!(inner_frame(&not_udp), None);
    }
}
