//! Parsing what arrives from the network, besides the frames themselves:
//! VXLAN headers (RFC 7348), the length prefixes of TCP links, and the runs
//! of datagrams UDP GRO delivers in one buffer. Pure code, fuzzed.

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

/// A Geneve header without options (RFC 8926): version 0, no options,
/// neither control (O) nor critical options (C), protocol Transparent
/// Ethernet Bridging, the VNI.
pub const GENEVE_HDR_LEN: usize = 8;
const GENEVE_ETHERNET: u16 = 0x6558;

pub fn geneve_header(vni: u32) -> [u8; GENEVE_HDR_LEN] {
    let p = GENEVE_ETHERNET.to_be_bytes();
    [0, 0, p[0], p[1], (vni >> 16) as u8, (vni >> 8) as u8, vni as u8, 0]
}

/// A Geneve datagram's VNI and where its frame starts (after the header
/// and its options), or why it carries no frame for us: not version 0,
/// not Ethernet, a control packet (O), critical options (C: RFC 8926 says
/// a receiver that does not process them must drop it; vnetd processes
/// none), or shorter than its header says.
pub fn parse_geneve(datagram: &[u8]) -> Result<(u32, usize), &'static str> {
    let h = datagram.get(..GENEVE_HDR_LEN).ok_or("shorter than a Geneve header")?;
    if h[0] >> 6 != 0 {
        return Err("not Geneve version 0");
    }
    if h[1] & 0x80 != 0 {
        return Err("a Geneve control packet");
    }
    if h[1] & 0x40 != 0 {
        return Err("critical Geneve options");
    }
    if u16::from_be_bytes([h[2], h[3]]) != GENEVE_ETHERNET {
        return Err("not an Ethernet frame");
    }
    let start = GENEVE_HDR_LEN + (h[0] & 0x3f) as usize * 4;
    if start + 14 > datagram.len() {
        return Err("shorter than its options and a frame");
    }
    Ok(((h[4] as u32) << 16 | (h[5] as u32) << 8 | h[6] as u32, start))
}

/// Largest frame a TCP link carries (64 KiB MTU plus Ethernet and VLAN headers).
pub const MAX_TCP_FRAME: usize = 65535 + 18;

/// The length a TCP link's 4-byte big-endian prefix announces, if it is one
/// a frame can have (an Ethernet header at least, `MAX_TCP_FRAME` at most).
pub fn tcp_frame_len(prefix: [u8; 4]) -> Option<usize> {
    let n = u32::from_be_bytes(prefix) as usize;
    (14..=MAX_TCP_FRAME).contains(&n).then_some(n)
}

/// Reassembles a TCP link's byte stream into frames. Read into `spare()`,
/// record it with `filled(n)`, take the complete frames with `next_frame()`
/// (ranges into `buf()`, valid until the next `compact()`), then `compact()`
/// before reading again: a frame split across reads waits at the front.
pub struct TcpFramer {
    buf: Vec<u8>,
    /// Unconsumed bytes are `buf[start..end]`.
    start: usize,
    end: usize,
}

/// The length prefix announced a length no frame can have: the stream is out
/// of step and nothing after it can be trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BadLength(pub u32);

impl TcpFramer {
    /// A framer reading up to `batch` bytes at a time (room is added for one
    /// split frame on top).
    pub fn new(batch: usize) -> TcpFramer {
        TcpFramer { buf: vec![0u8; batch.max(1) + 4 + MAX_TCP_FRAME], start: 0, end: 0 }
    }

    /// Where the next read goes; never empty after `compact()`.
    pub fn spare(&mut self) -> &mut [u8] {
        &mut self.buf[self.end..]
    }

    /// `n` bytes were read into `spare()`.
    pub fn filled(&mut self, n: usize) {
        self.end = (self.end + n).min(self.buf.len());
    }

    /// The next complete frame, as a range of `buf()`; `None` when the rest
    /// (if any) is a frame still arriving.
    pub fn next_frame(&mut self) -> Option<Result<Range<usize>, BadLength>> {
        let have = &self.buf[self.start..self.end];
        let prefix: [u8; 4] = have.get(..4)?.try_into().expect("4 bytes");
        let Some(n) = tcp_frame_len(prefix) else {
            return Some(Err(BadLength(u32::from_be_bytes(prefix))));
        };
        if have.len() < 4 + n {
            return None;
        }
        let frame = self.start + 4..self.start + 4 + n;
        self.start = frame.end;
        Some(Ok(frame))
    }

    pub fn buf(&self) -> &[u8] {
        &self.buf
    }

    pub fn buf_mut(&mut self) -> &mut [u8] {
        &mut self.buf
    }

    /// Bytes received that are not yet a complete frame.
    pub fn pending(&self) -> usize {
        self.end - self.start
    }

    /// Moves the unconsumed bytes to the front (invalidates ranges).
    pub fn compact(&mut self) {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
    }

    /// Forgets everything (a new connection starts a new stream).
    pub fn reset(&mut self) {
        self.start = 0;
        self.end = 0;
    }
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
    fn geneve_round_trips_skips_options_and_refuses_what_it_cannot_carry() {
        let h = geneve_header(0x12_3456);
        assert_eq!(h, [0, 0, 0x65, 0x58, 0x12, 0x34, 0x56, 0]);
        let mut d = h.to_vec();
        d.extend_from_slice(&[0xaa; 14]);
        assert_eq!(parse_geneve(&d), Ok((0x12_3456, 8)));
        // Two 4-byte words of options (a non-critical option): skipped.
        let mut o = d.clone();
        o[0] = 2;
        o.splice(8..8, [1u8; 8]);
        assert_eq!(parse_geneve(&o), Ok((0x12_3456, 16)));
        for (byte, val, why) in [(0, 0x40, "version"), (1, 0x80, "control"), (1, 0x40, "critical"), (2, 0x08, "Ethernet")] {
            let mut bad = d.clone();
            bad[byte] = val;
            assert!(parse_geneve(&bad).is_err(), "{why}");
        }
        let mut long = d.clone();
        long[0] = 63;
        assert!(parse_geneve(&long).is_err(), "options past its end");
        assert!(parse_geneve(&d[..7]).is_err());
    }

    #[test]
    fn tcp_lengths_are_bounded() {
        assert_eq!(tcp_frame_len(64u32.to_be_bytes()), Some(64));
        assert_eq!(tcp_frame_len(13u32.to_be_bytes()), None);
        assert_eq!(tcp_frame_len((MAX_TCP_FRAME as u32 + 1).to_be_bytes()), None);
        assert_eq!(tcp_frame_len(u32::MAX.to_be_bytes()), None);
    }

    fn framed(frames: &[&[u8]]) -> Vec<u8> {
        let mut v = Vec::new();
        for f in frames {
            v.extend_from_slice(&(f.len() as u32).to_be_bytes());
            v.extend_from_slice(f);
        }
        v
    }

    /// Feeds `stream` to a framer in chunks of the given sizes; returns the
    /// frames, or the bad length that stopped it.
    fn feed(stream: &[u8], chunks: &[usize]) -> Result<Vec<Vec<u8>>, BadLength> {
        let mut f = TcpFramer::new(64);
        let mut out = Vec::new();
        let (mut at, mut i) = (0, 0);
        while at < stream.len() {
            f.compact();
            let want = chunks[i % chunks.len()].max(1);
            i += 1;
            let spare = f.spare();
            let n = want.min(spare.len()).min(stream.len() - at);
            spare[..n].copy_from_slice(&stream[at..at + n]);
            f.filled(n);
            at += n;
            while let Some(r) = f.next_frame() {
                out.push(f.buf()[r?].to_vec());
            }
        }
        assert_eq!(f.pending(), 0, "a complete stream leaves nothing behind");
        Ok(out)
    }

    #[test]
    fn frames_split_anywhere_come_back_whole() {
        let a = [0xAAu8; 60];
        let b: Vec<u8> = (0..1500u32).map(|i| i as u8).collect();
        let c = [0xCCu8; 14];
        let stream = framed(&[&a, &b, &c]);
        for chunks in [&[1usize][..], &[3], &[4], &[5, 7], &[64], &[100_000], &[2, 1500, 1]] {
            let got = feed(&stream, chunks).unwrap();
            assert_eq!(got, vec![a.to_vec(), b.clone(), c.to_vec()], "chunks {chunks:?}");
        }
    }

    #[test]
    fn a_bad_length_stops_the_stream() {
        let mut stream = framed(&[&[1u8; 20]]);
        stream.extend_from_slice(&5u32.to_be_bytes());
        stream.extend_from_slice(&[0u8; 5]);
        assert_eq!(feed(&stream, &[7]), Err(BadLength(5)));
    }

    #[test]
    fn the_largest_frame_fits_after_any_split() {
        let big = vec![0x5Au8; MAX_TCP_FRAME];
        let stream = framed(&[&[1u8; 14], &big, &big]);
        let got = feed(&stream, &[13, 65536]).unwrap();
        assert_eq!(got.len(), 3);
        assert_eq!(got[2], big);
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
