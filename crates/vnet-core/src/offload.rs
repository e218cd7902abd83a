//! Offload metadata (the `virtio_net_hdr` Linux uses for TAP and packet
//! sockets) and what a software datapath does with it: finishing a partial
//! checksum, cutting a TCP super-frame (TSO/GSO) into frames that fit a link,
//! and merging received segments back into a super-frame.

/// `struct virtio_net_hdr` without `num_buffers`: 10 bytes, little-endian.
pub const VNET_HDR_LEN: usize = 10;

pub const F_NEEDS_CSUM: u8 = 1;
pub const F_DATA_VALID: u8 = 2;

pub const GSO_NONE: u8 = 0;
pub const GSO_TCPV4: u8 = 1;
pub const GSO_UDP: u8 = 3;
pub const GSO_TCPV6: u8 = 4;
pub const GSO_UDP_L4: u8 = 5;
pub const GSO_ECN: u8 = 0x80;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VnetHdr {
    pub flags: u8,
    pub gso_type: u8,
    pub hdr_len: u16,
    pub gso_size: u16,
    pub csum_start: u16,
    pub csum_offset: u16,
}

impl VnetHdr {
    pub fn parse(b: &[u8]) -> Option<VnetHdr> {
        let b: &[u8; VNET_HDR_LEN] = b.get(..VNET_HDR_LEN)?.try_into().ok()?;
        let u = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        Some(VnetHdr { flags: b[0], gso_type: b[1], hdr_len: u(2), gso_size: u(4), csum_start: u(6), csum_offset: u(8) })
    }

    pub fn write(&self, b: &mut [u8]) {
        b[0] = self.flags;
        b[1] = self.gso_type;
        b[2..4].copy_from_slice(&self.hdr_len.to_le_bytes());
        b[4..6].copy_from_slice(&self.gso_size.to_le_bytes());
        b[6..8].copy_from_slice(&self.csum_start.to_le_bytes());
        b[8..10].copy_from_slice(&self.csum_offset.to_le_bytes());
    }

    pub fn is_gso(&self) -> bool {
        self.gso_type & !GSO_ECN != GSO_NONE
    }
}

/// Why a frame's offload request could not be carried out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OffloadError {
    /// Offsets or headers do not fit the frame.
    Malformed,
    /// A GSO type we do not segment (UFO, USO).
    Unsupported,
}

/// One's-complement sum of `data` (as big-endian 16-bit words) added to `sum`.
///
/// The bytes are summed as native (little-endian) 64-bit words with their
/// carries counted, in two independent chains; by RFC 1071's byte-order
/// independence, the folded little-endian sum byte-swapped is the big-endian
/// one. `data` must start at an even offset of the checksummed region.
#[inline]
pub fn csum_add(sum: u64, data: &[u8]) -> u64 {
    let (mut a, mut b, mut carries) = (0u64, 0u64, 0u64);
    let mut chunks = data.chunks_exact(16);
    for c in &mut chunks {
        let x = u64::from_le_bytes(c[0..8].try_into().unwrap());
        let y = u64::from_le_bytes(c[8..16].try_into().unwrap());
        let (s, o) = a.overflowing_add(x);
        a = s;
        carries += o as u64;
        let (s, o) = b.overflowing_add(y);
        b = s;
        carries += o as u64;
    }
    let mut t = a as u128 + b as u128 + carries as u128;
    let mut words = chunks.remainder().chunks_exact(2);
    for w in &mut words {
        t += u16::from_le_bytes([w[0], w[1]]) as u128;
    }
    if let [last] = words.remainder() {
        t += *last as u128;
    }
    // Fold to 16 bits (little-endian), then swap into big-endian order.
    let mut f = (t as u64 as u128) + (t >> 64);
    while f >> 16 != 0 {
        f = (f & 0xffff) + (f >> 16);
    }
    sum + (f as u16).swap_bytes() as u64
}

/// Folds a sum to 16 bits and complements it: the value to store.
#[inline]
pub fn csum_fold(mut sum: u64) -> u16 {
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// Finishes a checksum the sender left partial (`F_NEEDS_CSUM`): the field at
/// `start + offset` holds the pseudo-header sum; sum from `start` to the end
/// and store the result there. The sum and its field must lie past the
/// Ethernet header (and VLAN tag): a guest's offsets never rewrite the MACs
/// or type the frame was routed by.
pub fn complete_checksum(frame: &mut [u8], start: usize, offset: usize) -> Result<(), OffloadError> {
    let l3 = match frame.get(12..14) {
        Some([0x81, 0x00] | [0x88, 0xa8]) => 18,
        Some(_) => 14,
        None => return Err(OffloadError::Malformed),
    };
    let field_end = start.checked_add(offset).and_then(|x| x.checked_add(2));
    if start < l3 || start >= frame.len() || field_end.is_none_or(|e| e > frame.len()) {
        return Err(OffloadError::Malformed);
    }
    let c = csum_fold(csum_add(0, &frame[start..]));
    frame[start + offset..start + offset + 2].copy_from_slice(&c.to_be_bytes());
    Ok(())
}

/// Most pieces a frame may arrive in after its head (`Pieces`): a frame in
/// more is copied whole instead.
pub const MAX_PIECES: usize = 32;

/// A frame in pieces, in order: its head (holding every header) and the
/// buffers after it, e.g. a guest's transmit descriptors, read where they
/// lie. A contiguous frame is one piece.
#[derive(Clone, Copy)]
pub struct Pieces<'a> {
    parts: &'a [&'a [u8]],
    len: usize,
}

impl<'a> Pieces<'a> {
    pub fn new(parts: &'a [&'a [u8]]) -> Pieces<'a> {
        Pieces { parts, len: parts.iter().map(|p| p.len()).sum() }
    }

    /// The pieces, the head first.
    pub fn parts(&self) -> &'a [&'a [u8]] {
        self.parts
    }

    /// The first piece: where the headers are read from.
    pub fn head(&self) -> &'a [u8] {
        self.parts.first().copied().unwrap_or(&[])
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Calls `f` with the slices that hold the frame's bytes `range`, in
    /// order (none empty).
    #[inline]
    pub fn each(&self, range: std::ops::Range<usize>, mut f: impl FnMut(&'a [u8])) {
        let mut at = 0;
        for p in self.parts {
            let end = at + p.len();
            if end > range.start && at < range.end {
                let s = range.start.max(at) - at;
                let e = range.end.min(end) - at;
                f(&p[s..e]);
            }
            if end >= range.end {
                break;
            }
            at = end;
        }
    }

    /// How many slices `each` gives for `range`.
    pub fn count(&self, range: std::ops::Range<usize>) -> usize {
        let mut n = 0;
        self.each(range, |_| n += 1);
        n
    }

    /// The one's-complement sum of the bytes `range` (which starts at an
    /// even offset of the checksummed region) added to `sum`, across
    /// pieces of any length: a slice that starts at an odd offset of the
    /// range is summed byte-swapped (RFC 1071).
    pub fn csum_add(&self, sum: u64, range: std::ops::Range<usize>) -> u64 {
        let (mut sum, mut odd) = (sum, false);
        self.each(range, |s| {
            let c = csum_add(0, s);
            sum += if odd { (c as u16).swap_bytes() as u64 } else { c };
            odd ^= s.len() % 2 == 1;
        });
        sum
    }

    /// Copies the frame into `out` (at least `len()` bytes long).
    pub fn copy_to(&self, out: &mut [u8]) {
        let mut at = 0;
        for p in self.parts {
            out[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
    }
}

/// As `complete_checksum`, for a frame in pieces whose checksum field lies
/// in its (writable) head `head`; `rest` are the pieces after it.
pub fn complete_checksum_pieces(head: &mut [u8], rest: &[&[u8]], start: usize, offset: usize) -> Result<(), OffloadError> {
    if rest.is_empty() {
        return complete_checksum(head, start, offset);
    }
    let l3 = match head.get(12..14) {
        Some([0x81, 0x00] | [0x88, 0xa8]) => 18,
        Some(_) => 14,
        None => return Err(OffloadError::Malformed),
    };
    let len = head.len() + rest.iter().map(|p| p.len()).sum::<usize>();
    let field_end = start.checked_add(offset).and_then(|x| x.checked_add(2));
    if start < l3 || start >= len || field_end.is_none_or(|e| e > head.len()) {
        return Err(OffloadError::Malformed);
    }
    let h: &[u8] = head;
    let mut parts = [&[][..]; MAX_PIECES + 1];
    parts[0] = h;
    let n = rest.len().min(MAX_PIECES);
    parts[1..=n].copy_from_slice(&rest[..n]);
    let c = csum_fold(Pieces::new(&parts[..=n]).csum_add(0, start..len));
    head[start + offset..start + offset + 2].copy_from_slice(&c.to_be_bytes());
    Ok(())
}

/// Offsets of a TCP frame's headers.
struct TcpLayout {
    l3: usize,
    ipv4: bool,
    l4: usize,
    payload: usize,
}

fn tcp_layout(frame: &[u8]) -> Result<TcpLayout, OffloadError> {
    let m = OffloadError::Malformed;
    let mut l3 = 14;
    let mut ethertype = u16::from_be_bytes([*frame.get(12).ok_or(m)?, *frame.get(13).ok_or(m)?]);
    if ethertype == 0x8100 || ethertype == 0x88a8 {
        ethertype = u16::from_be_bytes([*frame.get(16).ok_or(m)?, *frame.get(17).ok_or(m)?]);
        l3 = 18;
    }
    let (ipv4, l4) = match ethertype {
        0x0800 => {
            let ihl = (*frame.get(l3).ok_or(m)? & 0x0f) as usize * 4;
            if ihl < 20 || frame.get(l3 + 9) != Some(&6) {
                return Err(m);
            }
            (true, l3 + ihl)
        }
        0x86dd => {
            if frame.get(l3 + 6) != Some(&6) {
                return Err(OffloadError::Unsupported); // extension headers
            }
            (false, l3 + 40)
        }
        _ => return Err(m),
    };
    let thl = (*frame.get(l4 + 12).ok_or(m)? >> 4) as usize * 4;
    if thl < 20 || l4 + thl > frame.len() {
        return Err(m);
    }
    Ok(TcpLayout { l3, ipv4, l4, payload: l4 + thl })
}

/// Smallest `gso_size` accepted from a guest (IPv4's default MSS): a smaller
/// one would make vnetd cut one 64 KiB super-frame into thousands of frames.
pub const MIN_GSO_SIZE: usize = 536;

/// How a TCP super-frame is cut: for segment `i`, headers `header(i)`
/// (`hdr_len` bytes, with lengths, IDs, sequence numbers, flags and checksums
/// already right) followed by the frame's bytes `payload[i]`. Nothing of the
/// payload is copied, so the segments can be sent as an iovec.
#[derive(Default, Debug)]
pub struct SegmentPlan {
    pub hdr_len: usize,
    pub headers: Vec<u8>,
    pub payload: Vec<std::ops::Range<usize>>,
}

impl SegmentPlan {
    pub fn len(&self) -> usize {
        self.payload.len()
    }

    pub fn is_empty(&self) -> bool {
        self.payload.is_empty()
    }

    pub fn header(&self, i: usize) -> &[u8] {
        &self.headers[i * self.hdr_len..(i + 1) * self.hdr_len]
    }

    /// Length of segment `i` as a frame.
    pub fn frame_len(&self, i: usize) -> usize {
        self.hdr_len + self.payload[i].len()
    }
}

/// Plans cutting a TCP super-frame into frames of at most `mss` payload bytes.
pub fn plan_tcp_segments(frame: &[u8], mss: usize, plan: &mut SegmentPlan) -> Result<(), OffloadError> {
    plan_tcp_segments_in(&Pieces::new(std::slice::from_ref(&frame)), mss, plan)
}

/// As `plan_tcp_segments`, for a frame in pieces: its headers must lie in
/// its head; the payload ranges are offsets into the whole frame.
pub fn plan_tcp_segments_in(frame: &Pieces, mss: usize, plan: &mut SegmentPlan) -> Result<(), OffloadError> {
    let head = frame.head();
    let t = tcp_layout(head)?;
    if mss == 0 {
        return Err(OffloadError::Malformed);
    }
    let total = frame.len();
    let payload_len = total - t.payload;
    let n = payload_len.div_ceil(mss).max(1);
    plan.hdr_len = t.payload;
    plan.headers.clear();
    plan.payload.clear();
    let seq0 = u32::from_be_bytes(head[t.l4 + 4..t.l4 + 8].try_into().unwrap());
    let id0 = if t.ipv4 { u16::from_be_bytes([head[t.l3 + 4], head[t.l3 + 5]]) } else { 0 };
    let flags0 = head[t.l4 + 13];
    for i in 0..n {
        let range = (t.payload + i * mss).min(total)..(t.payload + (i + 1) * mss).min(total);
        let at = plan.headers.len();
        plan.headers.extend_from_slice(&head[..t.payload]);
        let h = &mut plan.headers[at..];
        let l4_len = h.len() - t.l4 + range.len();
        if t.ipv4 {
            let total = (t.payload - t.l3 + range.len()) as u16;
            h[t.l3 + 2..t.l3 + 4].copy_from_slice(&total.to_be_bytes());
            h[t.l3 + 4..t.l3 + 6].copy_from_slice(&id0.wrapping_add(i as u16).to_be_bytes());
            h[t.l3 + 10..t.l3 + 12].copy_from_slice(&[0, 0]);
            let c = csum_fold(csum_add(0, &h[t.l3..t.l4]));
            h[t.l3 + 10..t.l3 + 12].copy_from_slice(&c.to_be_bytes());
        } else {
            h[t.l3 + 4..t.l3 + 6].copy_from_slice(&(l4_len as u16).to_be_bytes());
        }
        let seq = seq0.wrapping_add((i * mss) as u32);
        h[t.l4 + 4..t.l4 + 8].copy_from_slice(&seq.to_be_bytes());
        let mut flags = flags0;
        if i + 1 < n {
            flags &= !(0x01 | 0x08); // FIN, PSH only on the last segment
        }
        if i > 0 {
            flags &= !0x80; // CWR only on the first
        }
        h[t.l4 + 13] = flags;
        h[t.l4 + 16..t.l4 + 18].copy_from_slice(&[0, 0]);
        let sum = frame.csum_add(csum_add(pseudo_header_sum(h, &t, l4_len), &h[t.l4..]), range.clone());
        // The payload may start at an odd offset within the TCP segment only
        // if the header length is odd, which TCP's 4-byte units rule out.
        h[t.l4 + 16..t.l4 + 18].copy_from_slice(&csum_fold(sum).to_be_bytes());
        plan.payload.push(range);
    }
    Ok(())
}

/// The payload offset of a TCP frame, or `None` when it is not TCP over
/// IPv4/IPv6 (without extension headers).
pub fn tcp_payload_offset(frame: &[u8]) -> Option<usize> {
    tcp_layout(frame).ok().map(|t| t.payload)
}

/// Merges consecutive segments of one TCP flow (as a receiver's GRO does)
/// into one super-frame for a destination that takes them (a TAP with
/// virtio-net headers), so the guest's stack handles 64 KiB at a time.
///
/// Frames are given as ranges of one buffer; the merged frame is the merged
/// headers (`take`) followed by the payload ranges, ready for `writev`.
#[derive(Default)]
pub struct TcpCoalescer {
    hdr: Vec<u8>,
    layout: Option<(usize, bool, usize, usize)>, // l3, ipv4, l4, payload offset
    first: std::ops::Range<usize>,
    payloads: Vec<std::ops::Range<usize>>,
    mss: usize,
    next_seq: u32,
    frame_bytes: usize,
    psh: bool,
    closed: bool,
}

/// What `TcpCoalescer::take` hands back.
pub enum Run<'a> {
    /// Nothing was pending.
    Empty,
    /// One frame: deliver `buf[range]` as it is.
    Single(std::ops::Range<usize>),
    /// Several: the merged headers, then `payloads` of the buffer; `frames`
    /// segments of `frame_bytes` bytes in all went into it.
    Merged { vnet: VnetHdr, header: &'a [u8], payloads: &'a [std::ops::Range<usize>], frames: usize, frame_bytes: usize },
}

/// Largest merged IP packet: its length must fit the IP header.
const MAX_MERGED_IP: usize = 65535 - 256;
/// Most segments merged into one super-frame.
pub const MAX_RUN: usize = 62;

impl TcpCoalescer {
    pub fn is_pending(&self) -> bool {
        self.layout.is_some()
    }

    /// Offers `buf[range]`. Returns true if it was taken into the pending run
    /// (starting one if none was pending); false if it cannot join it (the
    /// caller then `take`s the run and offers the frame again, or delivers
    /// it alone).
    pub fn offer(&mut self, buf: &[u8], range: std::ops::Range<usize>) -> bool {
        let f = &buf[range.clone()];
        let Ok(t) = tcp_layout(f) else { return false };
        let payload = f.len() - t.payload;
        let flags = f[t.l4 + 13];
        // Only plain data segments (ACK, maybe PSH) join runs.
        if payload == 0 || flags & !(0x10 | 0x08) != 0 || flags & 0x10 == 0 {
            return false;
        }
        if t.ipv4 && (t.l4 - t.l3 != 20 || f[t.l3 + 6] & 0x3f != 0 || f[t.l3 + 7] != 0) {
            return false; // IP options or a fragment
        }
        // The frame must be exactly its IP packet: Ethernet padding (or a
        // truncated packet) would otherwise enter the merged stream.
        let ip_len = if t.ipv4 {
            u16::from_be_bytes([f[t.l3 + 2], f[t.l3 + 3]]) as usize
        } else {
            40 + u16::from_be_bytes([f[t.l3 + 4], f[t.l3 + 5]]) as usize
        };
        if t.l3 + ip_len != f.len() {
            return false;
        }
        // A merged frame reaches the guest as CHECKSUM_PARTIAL, which it does
        // not verify: so verify every segment that goes into one here.
        if csum_fold(csum_add(pseudo_header_sum(f, &t, f.len() - t.l4), &f[t.l4..])) != 0 {
            return false;
        }
        let seq = u32::from_be_bytes(f[t.l4 + 4..t.l4 + 8].try_into().unwrap());
        match self.layout {
            None => {
                self.hdr.clear();
                self.hdr.extend_from_slice(&f[..t.payload]);
                self.layout = Some((t.l3, t.ipv4, t.l4, t.payload));
                self.first = range.clone();
                self.payloads.clear();
                self.payloads.push(range.start + t.payload..range.end);
                self.mss = payload;
                self.next_seq = seq.wrapping_add(payload as u32);
                self.frame_bytes = f.len();
                self.psh = flags & 0x08 != 0;
                self.closed = self.psh;
                true
            }
            Some((l3, ipv4, l4, hl)) => {
                if self.closed
                    || self.payloads.len() >= MAX_RUN
                    || (l3, ipv4, l4, hl) != (t.l3, t.ipv4, t.l4, t.payload)
                    || seq != self.next_seq
                    || payload > self.mss
                    || self.hdr.len() - l3 + (self.next_seq.wrapping_sub(self.first_seq()) as usize) + payload > MAX_MERGED_IP
                    || !same_flow_headers(&self.hdr, &f[..hl], l3, ipv4, l4)
                {
                    return false;
                }
                self.payloads.push(range.start + hl..range.end);
                self.next_seq = seq.wrapping_add(payload as u32);
                self.frame_bytes += f.len();
                self.psh |= flags & 0x08 != 0;
                // After a short or PSH segment, the run is complete.
                self.closed = payload < self.mss || flags & 0x08 != 0;
                true
            }
        }
    }

    fn first_seq(&self) -> u32 {
        let (_, _, l4, _) = self.layout.unwrap();
        u32::from_be_bytes(self.hdr[l4 + 4..l4 + 8].try_into().unwrap())
    }

    /// Ends the pending run.
    pub fn take(&mut self) -> Run<'_> {
        let Some((l3, ipv4, l4, hl)) = self.layout.take() else { return Run::Empty };
        if self.payloads.len() == 1 {
            return Run::Single(self.first.clone());
        }
        let payload: usize = self.payloads.iter().map(|r| r.len()).sum();
        let l4_len = hl - l4 + payload;
        let h = &mut self.hdr[..];
        if ipv4 {
            let total = (hl - l3 + payload) as u16;
            h[l3 + 2..l3 + 4].copy_from_slice(&total.to_be_bytes());
            h[l3 + 10..l3 + 12].copy_from_slice(&[0, 0]);
            let c = csum_fold(csum_add(0, &h[l3..l4]));
            h[l3 + 10..l3 + 12].copy_from_slice(&c.to_be_bytes());
        } else {
            h[l3 + 4..l3 + 6].copy_from_slice(&(l4_len as u16).to_be_bytes());
        }
        if self.psh {
            h[l4 + 13] |= 0x08;
        }
        // A partial checksum: the pseudo-header sum over the whole segment,
        // as a sender's TSO leaves it; the guest trusts it (CHECKSUM_PARTIAL).
        let t = TcpLayout { l3, ipv4, l4, payload: hl };
        let seed = !csum_fold(pseudo_header_sum(h, &t, l4_len));
        h[l4 + 16..l4 + 18].copy_from_slice(&seed.to_be_bytes());
        let vnet = VnetHdr {
            flags: F_NEEDS_CSUM,
            gso_type: if ipv4 { GSO_TCPV4 } else { GSO_TCPV6 },
            hdr_len: hl as u16,
            gso_size: self.mss as u16,
            csum_start: l4 as u16,
            csum_offset: 16,
        };
        Run::Merged { vnet, header: &self.hdr, payloads: &self.payloads, frames: self.payloads.len(), frame_bytes: self.frame_bytes }
    }
}

/// Whether two segments' headers match in everything but what differs
/// between segments of one flow (IP length, ID and checksum; TCP sequence
/// number, checksum and PSH).
fn same_flow_headers(a: &[u8], b: &[u8], l3: usize, ipv4: bool, l4: usize) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let eq = |r: std::ops::Range<usize>| a[r.clone()] == b[r];
    let ip_ok = if ipv4 {
        eq(0..l3 + 2) && eq(l3 + 6..l3 + 10) && eq(l3 + 12..l4)
    } else {
        eq(0..l3 + 4) && eq(l3 + 6..l4)
    };
    ip_ok && eq(l4..l4 + 4) && eq(l4 + 8..l4 + 13) && (a[l4 + 13] | 0x08) == (b[l4 + 13] | 0x08) && eq(l4 + 14..l4 + 16) && eq(l4 + 18..a.len())
}

fn pseudo_header_sum(f: &[u8], t: &TcpLayout, l4_len: usize) -> u64 {
    let mut s = if t.ipv4 { csum_add(0, &f[t.l3 + 12..t.l3 + 20]) } else { csum_add(0, &f[t.l3 + 8..t.l3 + 40]) };
    s += 6 + l4_len as u64;
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Cuts a TCP super-frame into frames of at most `mss` payload bytes each,
    /// calling `emit` with each (built in `scratch`).
    fn segment_tcp(
        frame: &[u8],
        mss: usize,
        scratch: &mut Vec<u8>,
        mut emit: impl FnMut(&[u8]),
    ) -> Result<usize, OffloadError> {
        let mut plan = SegmentPlan::default();
        plan_tcp_segments(frame, mss, &mut plan)?;
        for i in 0..plan.len() {
            scratch.clear();
            scratch.extend_from_slice(plan.header(i));
            scratch.extend_from_slice(&frame[plan.payload[i].clone()]);
            emit(scratch);
        }
        Ok(plan.len())
    }

    /// A TCP/IPv4 frame with correct checksums and `payload`.
    fn tcp4(payload: &[u8], flags: u8) -> Vec<u8> {
        let mut f = vec![0u8; 14 + 20 + 20];
        f[12..14].copy_from_slice(&[0x08, 0x00]);
        let ip = &mut f[14..34];
        ip[0] = 0x45;
        ip[2..4].copy_from_slice(&((40 + payload.len()) as u16).to_be_bytes());
        ip[4..6].copy_from_slice(&0x1234u16.to_be_bytes());
        ip[8] = 64;
        ip[9] = 6;
        ip[12..16].copy_from_slice(&[198, 19, 0, 1]);
        ip[16..20].copy_from_slice(&[198, 19, 0, 2]);
        let tcp = &mut f[34..54];
        tcp[0..2].copy_from_slice(&5001u16.to_be_bytes());
        tcp[2..4].copy_from_slice(&80u16.to_be_bytes());
        tcp[4..8].copy_from_slice(&1000u32.to_be_bytes());
        tcp[12] = 5 << 4;
        tcp[13] = flags;
        f.extend_from_slice(payload);
        set_checksums(&mut f);
        f
    }

    /// Sets a TCP/IPv4 frame's IP and TCP checksums (the IP packet is the
    /// frame's IP total length; anything after it is padding).
    fn set_checksums(f: &mut [u8]) {
        f[24..26].copy_from_slice(&[0, 0]);
        f[50..52].copy_from_slice(&[0, 0]);
        let c = csum_fold(csum_add(0, &f[14..34]));
        f[24..26].copy_from_slice(&c.to_be_bytes());
        let end = 14 + u16::from_be_bytes([f[16], f[17]]) as usize;
        let mut s = csum_add(0, &f[26..34]);
        s += 6 + (end - 34) as u64;
        let c = csum_fold(csum_add(s, &f[34..end]));
        f[50..52].copy_from_slice(&c.to_be_bytes());
    }

    fn valid(f: &[u8]) -> bool {
        let ip_ok = csum_fold(csum_add(0, &f[14..34])) == 0;
        let mut s = csum_add(0, &f[26..34]);
        s += 6 + (f.len() - 34) as u64;
        ip_ok && csum_fold(csum_add(s, &f[34..])) == 0
    }

    #[test]
    fn checksum_of_known_header() {
        // RFC 1071 style example: an IPv4 header whose checksum is 0xb861.
        let h = [0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0xa8, 0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7];
        assert_eq!(csum_fold(csum_add(0, &h)), 0xb861);
        assert_eq!(csum_fold(csum_add(0, &h[..19])), csum_fold(csum_add(0, &[&h[..19], &[0][..]].concat())));
    }

    #[test]
    fn fast_checksum_matches_the_plain_definition() {
        let plain = |d: &[u8]| -> u16 {
            let mut s: u64 = 0;
            for w in d.chunks(2) {
                s += (w[0] as u64) << 8 | w.get(1).copied().unwrap_or(0) as u64;
            }
            csum_fold(s)
        };
        let data: Vec<u8> = (0..5000u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
        for len in [0, 1, 2, 3, 15, 16, 17, 31, 33, 1400, 1401, 4999, 5000] {
            assert_eq!(csum_fold(csum_add(0, &data[..len])), plain(&data[..len]), "len {len}");
        }
        let ones = vec![0xffu8; 4096];
        assert_eq!(csum_fold(csum_add(0, &ones)), plain(&ones));
        assert_eq!(csum_fold(csum_add(0x1234, &data[..64])), csum_fold(0x1234 + csum_add(0, &data[..64])));
    }

    #[test]
    fn completes_a_partial_checksum() {
        let good = tcp4(b"hello, partial checksum", 0x18);
        let mut partial = good.clone();
        // What a guest hands over: the pseudo-header sum, not complemented.
        let mut s = csum_add(0, &partial[26..34]);
        s += 6 + (partial.len() - 34) as u64;
        let seed = !csum_fold(s);
        partial[50..52].copy_from_slice(&seed.to_be_bytes());
        complete_checksum(&mut partial, 34, 16).unwrap();
        assert_eq!(partial, good);
        assert_eq!(complete_checksum(&mut partial, 60, 16), Err(OffloadError::Malformed));
        // Review M5: offsets inside the Ethernet header would rewrite the
        // MACs after routing. Refused, and the frame is untouched.
        for (start, offset) in [(0, 0), (0, 6), (6, 0), (12, 0), (13, 0), (34, 42), (34, usize::MAX - 40)] {
            let mut f = good.clone();
            assert_eq!(complete_checksum(&mut f, start, offset), Err(OffloadError::Malformed), "{start}+{offset}");
            assert_eq!(f, good);
        }
        let mut tagged = good.clone();
        tagged.splice(12..12, [0x81, 0x00, 0x00, 0x05]);
        assert_eq!(complete_checksum(&mut tagged, 14, 0), Err(OffloadError::Malformed), "inside the VLAN tag");
    }

    #[test]
    fn segments_a_tcp_super_frame() {
        let payload: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let big = tcp4(&payload, 0x19); // FIN|PSH|ACK... ACK=0x10, PSH=0x08, FIN=0x01
        let mut scratch = Vec::new();
        let mut segs: Vec<Vec<u8>> = Vec::new();
        let n = segment_tcp(&big, 1448, &mut scratch, |f| segs.push(f.to_vec())).unwrap();
        assert_eq!(n, 7);
        let mut joined = Vec::new();
        for (i, s) in segs.iter().enumerate() {
            assert!(valid(s), "segment {i} checksums");
            let seq = u32::from_be_bytes(s[38..42].try_into().unwrap());
            assert_eq!(seq, 1000 + (i * 1448) as u32);
            assert_eq!(u16::from_be_bytes([s[18], s[19]]), 0x1234 + i as u16);
            assert_eq!(u16::from_be_bytes([s[16], s[17]]) as usize, s.len() - 14);
            let last = i == segs.len() - 1;
            assert_eq!(s[47] & 0x09 != 0, last, "FIN/PSH only on the last");
            assert!(s.len() <= 14 + 40 + 1448);
            joined.extend_from_slice(&s[54..]);
        }
        assert_eq!(joined, payload);
    }

    #[test]
    fn coalescing_undoes_segmentation() {
        let payload: Vec<u8> = (0..20_000u32).map(|i| (i * 13) as u8).collect();
        let big = tcp4(&payload, 0x18); // ACK|PSH
        let mut scratch = Vec::new();
        let mut buf = Vec::new();
        let mut ranges = Vec::new();
        segment_tcp(&big, 1400, &mut scratch, |f| {
            ranges.push(buf.len()..buf.len() + f.len());
            buf.extend_from_slice(f);
        })
        .unwrap();
        let mut c = TcpCoalescer::default();
        for r in &ranges {
            assert!(c.offer(&buf, r.clone()));
        }
        let Run::Merged { vnet, header, payloads, frames, frame_bytes } = c.take() else { panic!("not merged") };
        assert_eq!(frames, ranges.len());
        assert_eq!(frame_bytes, buf.len());
        assert_eq!(vnet.gso_type, GSO_TCPV4);
        assert_eq!(vnet.gso_size, 1400);
        assert_eq!(vnet.csum_start, 34);
        let mut merged = header.to_vec();
        for p in payloads {
            merged.extend_from_slice(&buf[p.clone()]);
        }
        assert_eq!(merged.len(), big.len());
        assert_eq!(&merged[54..], &payload[..]);
        // Same headers as the original but for the partial checksum.
        assert_eq!(merged[..50], big[..50]);
        complete_checksum(&mut merged, 34, 16).unwrap();
        assert_eq!(merged, big);
        assert!(matches!(c.take(), Run::Empty));
    }

    #[test]
    fn coalescer_refuses_gaps_other_flows_and_control_segments() {
        let a = tcp4(&[1u8; 100], 0x10);
        let mut b = tcp4(&[2u8; 100], 0x10);
        b[38..42].copy_from_slice(&1100u32.to_be_bytes()); // follows a
        set_checksums(&mut b);
        let mut gap = b.clone();
        gap[38..42].copy_from_slice(&9999u32.to_be_bytes());
        set_checksums(&mut gap);
        let mut other = b.clone();
        other[34..36].copy_from_slice(&5002u16.to_be_bytes()); // another source port
        set_checksums(&mut other);
        let syn = tcp4(&[], 0x02);
        let buf = [a.clone(), b.clone(), gap, other, syn].concat();
        let r = |i: usize| i * a.len()..(i + 1) * a.len();
        let mut c = TcpCoalescer::default();
        assert!(c.offer(&buf, r(0)));
        assert!(!c.offer(&buf, r(2)), "sequence gap");
        assert!(!c.offer(&buf, r(3)), "another flow");
        assert!(c.offer(&buf, r(1)));
        assert!(matches!(c.take(), Run::Merged { frames: 2, .. }));
        assert!(!c.offer(&buf, 4 * a.len()..buf.len()), "SYN");
        assert!(c.offer(&buf, r(0)));
        assert!(matches!(c.take(), Run::Single(x) if x == r(0)));
    }

    /// Review H3: a short segment padded to Ethernet's 60 bytes used to be
    /// merged with its padding as payload, and the guest, told the checksum
    /// was partial, never noticed.
    #[test]
    fn coalescer_merges_only_exact_packets_with_valid_checksums() {
        let a = tcp4(&[1u8; 100], 0x10);
        let mut b = tcp4(&[2u8; 3], 0x10);
        b[38..42].copy_from_slice(&1100u32.to_be_bytes());
        set_checksums(&mut b);
        assert_eq!(b.len(), 57);
        let mut padded = b.clone();
        padded.extend_from_slice(&[0xee; 3]); // to the 60-byte minimum
        let mut corrupt = b.clone();
        corrupt[56] ^= 0x40; // one payload bit flipped on the way
        let mut truncated = a.clone();
        truncated.truncate(a.len() - 1);
        for (what, frame, merges) in [("padded", &padded, false), ("corrupt", &corrupt, false), ("exact", &b, true)] {
            let buf = [a.clone(), frame.clone()].concat();
            let mut c = TcpCoalescer::default();
            assert!(c.offer(&buf, 0..a.len()));
            assert_eq!(c.offer(&buf, a.len()..buf.len()), merges, "{what}");
            if merges {
                let Run::Merged { header, payloads, .. } = c.take() else { panic!("not merged") };
                let ip_len = u16::from_be_bytes([header[16], header[17]]) as usize;
                let payload: usize = payloads.iter().map(|p| p.len()).sum();
                assert_eq!((ip_len, payload), (143, 103), "IP length and payload count no padding");
            }
        }
        let mut c = TcpCoalescer::default();
        assert!(!c.offer(&truncated, 0..truncated.len()), "shorter than its IP length");
    }

    // ---- IPv6 (test review M7): the same, over TCP/IPv6 ----

    /// Where a test frame's IP header starts: after a VLAN tag if it has one.
    fn l3_of(f: &[u8]) -> usize {
        if f[12..14] == [0x81, 0x00] {
            18
        } else {
            14
        }
    }

    /// A TCP/IPv6 frame (flow label 0xabcde, hop limit 64) with a correct
    /// checksum and `payload`.
    fn tcp6(payload: &[u8], flags: u8) -> Vec<u8> {
        let mut f = vec![0u8; 14 + 40 + 20];
        f[12..14].copy_from_slice(&[0x86, 0xdd]);
        let ip = &mut f[14..54];
        ip[0..4].copy_from_slice(&[0x60, 0x0a, 0xbc, 0xde]);
        ip[4..6].copy_from_slice(&((20 + payload.len()) as u16).to_be_bytes());
        ip[6] = 6;
        ip[7] = 64;
        ip[8..24].copy_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
        ip[24..40].copy_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0x12, 0x34, 0, 0, 0, 0, 0, 2]);
        let tcp = &mut f[54..74];
        tcp[0..2].copy_from_slice(&5001u16.to_be_bytes());
        tcp[2..4].copy_from_slice(&80u16.to_be_bytes());
        tcp[4..8].copy_from_slice(&0xffff_f000u32.to_be_bytes()); // wraps within a super-frame
        tcp[8..12].copy_from_slice(&77u32.to_be_bytes());
        tcp[12] = 5 << 4;
        tcp[13] = flags;
        tcp[14..16].copy_from_slice(&512u16.to_be_bytes());
        f.extend_from_slice(payload);
        set_checksum6(&mut f);
        f
    }

    /// The TCP checksum of a TCP/IPv6 frame over its IP payload length
    /// (anything after it is padding), with the pseudo-header written out
    /// from RFC 8200 section 8.1 (addresses, 32-bit upper-layer length, next
    /// header) rather than through `pseudo_header_sum`.
    fn tcp6_sum(f: &[u8]) -> u16 {
        let l3 = l3_of(f);
        let end = l3 + 40 + u16::from_be_bytes([f[l3 + 4], f[l3 + 5]]) as usize;
        let mut pseudo = f[l3 + 8..l3 + 40].to_vec();
        pseudo.extend_from_slice(&((end - l3 - 40) as u32).to_be_bytes());
        pseudo.extend_from_slice(&[0, 0, 0, 6]);
        csum_fold(csum_add(csum_add(0, &pseudo), &f[l3 + 40..end]))
    }

    fn set_checksum6(f: &mut [u8]) {
        let c = l3_of(f) + 40 + 16;
        f[c..c + 2].copy_from_slice(&[0, 0]);
        let sum = tcp6_sum(f);
        f[c..c + 2].copy_from_slice(&sum.to_be_bytes());
    }

    /// The frame is exactly its IPv6 packet and its TCP checksum is right.
    fn valid6(f: &[u8]) -> bool {
        let l3 = l3_of(f);
        l3 + 40 + u16::from_be_bytes([f[l3 + 4], f[l3 + 5]]) as usize == f.len() && tcp6_sum(f) == 0
    }

    #[test]
    fn segments_a_tcpv6_super_frame() {
        let payload: Vec<u8> = (0..10_000u32).map(|i| (i * 11) as u8).collect();
        // CWR|ACK|PSH|FIN: CWR only on the first segment, FIN and PSH only on the last.
        let untagged = tcp6(&payload, 0x99);
        let mut tagged = untagged.clone();
        tagged.splice(12..12, [0x81, 0x00, 0x00, 0x07]);
        set_checksum6(&mut tagged);
        assert!(valid6(&untagged) && valid6(&tagged));
        for big in [untagged, tagged] {
            let l3 = l3_of(&big);
            let (l4, hl) = (l3 + 40, l3 + 60);
            let mut scratch = Vec::new();
            let mut segs: Vec<Vec<u8>> = Vec::new();
            let n = segment_tcp(&big, 1428, &mut scratch, |f| segs.push(f.to_vec())).unwrap();
            assert_eq!(n, 8, "7 x 1428 + 4");
            let mut joined = Vec::new();
            for (i, s) in segs.iter().enumerate() {
                let last = i == n - 1;
                assert!(valid6(s), "segment {i}: payload length and checksum");
                assert_eq!(s.len() - hl, if last { 4 } else { 1428 });
                assert_eq!(u16::from_be_bytes([s[l3 + 4], s[l3 + 5]]) as usize, s.len() - l4, "payload length");
                let seq = u32::from_be_bytes(s[l4 + 4..l4 + 8].try_into().unwrap());
                assert_eq!(seq, 0xffff_f000u32.wrapping_add(i as u32 * 1428), "segment {i}");
                assert_eq!(s[l4 + 13] & 0x09 != 0, last, "FIN/PSH only on the last");
                assert_eq!(s[l4 + 13] & 0x09, if last { 0x09 } else { 0 });
                assert_eq!(s[l4 + 13] & 0x80 != 0, i == 0, "CWR only on the first");
                assert_eq!(s[l4 + 13] & 0x10, 0x10, "ACK on every segment");
                // Everything else of the headers is the super-frame's: MACs,
                // tag, version, class, flow label, next header, hop limit,
                // addresses, ports, ack, offset, window, urgent pointer.
                assert_eq!(s[..l3 + 4], big[..l3 + 4]);
                assert_eq!(s[l3 + 6..l4 + 4], big[l3 + 6..l4 + 4]);
                assert_eq!(s[l4 + 8..l4 + 13], big[l4 + 8..l4 + 13]);
                assert_eq!(s[l4 + 14..l4 + 16], big[l4 + 14..l4 + 16]);
                assert_eq!(s[l4 + 18..hl], big[l4 + 18..hl]);
                joined.extend_from_slice(&s[hl..]);
            }
            assert_eq!(joined, payload);
        }
        // With an extension header (hop-by-hop) it is not segmented.
        let mut hbh = tcp6(&payload, 0x10);
        hbh[20] = 0;
        let mut plan = SegmentPlan::default();
        assert_eq!(plan_tcp_segments(&hbh, 1428, &mut plan), Err(OffloadError::Unsupported));
    }

    #[test]
    fn coalescing_undoes_tcpv6_segmentation() {
        let payload: Vec<u8> = (0..20_000u32).map(|i| (i * 17) as u8).collect();
        let big = tcp6(&payload, 0x18); // ACK|PSH
        let mut scratch = Vec::new();
        let mut buf = Vec::new();
        let mut ranges = Vec::new();
        segment_tcp(&big, 1400, &mut scratch, |f| {
            ranges.push(buf.len()..buf.len() + f.len());
            buf.extend_from_slice(f);
        })
        .unwrap();
        assert_eq!(ranges.len(), 15);
        let mut c = TcpCoalescer::default();
        for r in &ranges {
            assert!(c.offer(&buf, r.clone()));
        }
        let Run::Merged { vnet, header, payloads, frames, frame_bytes } = c.take() else { panic!("not merged") };
        assert_eq!(frames, ranges.len());
        assert_eq!(frame_bytes, buf.len());
        assert_eq!(
            vnet,
            VnetHdr { flags: F_NEEDS_CSUM, gso_type: GSO_TCPV6, hdr_len: 74, gso_size: 1400, csum_start: 54, csum_offset: 16 }
        );
        let mut merged = header.to_vec();
        for p in payloads {
            merged.extend_from_slice(&buf[p.clone()]);
        }
        assert_eq!(merged.len(), big.len());
        assert_eq!(u16::from_be_bytes([merged[18], merged[19]]) as usize, 20 + payload.len(), "payload length");
        assert_eq!(&merged[74..], &payload[..]);
        // Same headers as the original but for the partial checksum, which
        // completes to the original's.
        assert_eq!(merged[..70], big[..70]);
        assert_eq!(merged[72..74], big[72..74]);
        complete_checksum(&mut merged, vnet.csum_start as usize, vnet.csum_offset as usize).unwrap();
        assert_eq!(merged, big);
        assert!(valid6(&merged));
        assert!(matches!(c.take(), Run::Empty));
    }

    #[test]
    fn tcpv6_coalescer_refuses_padding_bad_checksums_and_other_flows() {
        let a = tcp6(&[1u8; 100], 0x10);
        let follows = |payload: &[u8], edit: &dyn Fn(&mut Vec<u8>)| {
            let mut b = tcp6(payload, 0x10);
            b[58..62].copy_from_slice(&0xffff_f064u32.to_be_bytes()); // a's seq + 100
            edit(&mut b);
            set_checksum6(&mut b);
            b
        };
        let b = follows(&[2u8; 3], &|_| {});
        assert_eq!(b.len(), 77);
        let mut padded = b.clone();
        padded.extend_from_slice(&[0xee; 3]);
        // Padding the checksum cannot see: its words add up to minus the 3
        // bytes it adds to the pseudo-header's length. Only the IPv6 payload
        // length tells it from payload.
        let mut neutral = b.clone();
        neutral.extend_from_slice(&[0xfc, 0xff, 0x00]);
        let mut pseudo = neutral[22..54].to_vec();
        pseudo.extend_from_slice(&((neutral.len() - 54) as u32).to_be_bytes());
        pseudo.extend_from_slice(&[0, 0, 0, 6]);
        assert_eq!(csum_fold(csum_add(csum_add(0, &pseudo), &neutral[54..])), 0, "checksum-neutral padding");
        let mut corrupt = b.clone();
        corrupt[76] ^= 0x40; // one payload bit flipped on the way
        let mut bad_sum = b.clone();
        bad_sum[70] ^= 0x01;
        let gap = follows(&[2u8; 3], &|f| f[58..62].copy_from_slice(&0xffff_f065u32.to_be_bytes()));
        let other_port = follows(&[2u8; 3], &|f| f[54..56].copy_from_slice(&5002u16.to_be_bytes()));
        let other_addr = follows(&[2u8; 3], &|f| f[53] = 3);
        let other_label = follows(&[2u8; 3], &|f| f[17] ^= 1);
        let other_hops = follows(&[2u8; 3], &|f| f[21] = 63);
        let syn = follows(&[], &|f| f[67] = 0x02);
        let hbh = follows(&[2u8; 3], &|f| f[20] = 0);
        let v4 = tcp4(&[2u8; 3], 0x10);
        for (what, frame, merges) in [
            ("padded", &padded, false),
            ("padded, checksum-neutral", &neutral, false),
            ("payload bit flipped", &corrupt, false),
            ("checksum wrong", &bad_sum, false),
            ("sequence gap", &gap, false),
            ("another port", &other_port, false),
            ("another address", &other_addr, false),
            ("another flow label", &other_label, false),
            ("another hop limit", &other_hops, false),
            ("SYN", &syn, false),
            ("extension header", &hbh, false),
            ("IPv4", &v4, false),
            ("exact", &b, true),
        ] {
            let buf = [a.clone(), frame.clone()].concat();
            let mut c = TcpCoalescer::default();
            assert!(c.offer(&buf, 0..a.len()));
            assert_eq!(c.offer(&buf, a.len()..buf.len()), merges, "{what}");
            if merges {
                let Run::Merged { header, payloads, .. } = c.take() else { panic!("not merged") };
                let ip_len = u16::from_be_bytes([header[18], header[19]]) as usize;
                let payload: usize = payloads.iter().map(|p| p.len()).sum();
                assert_eq!((ip_len, payload), (123, 103), "payload length and payload count no padding");
            } else {
                assert!(matches!(c.take(), Run::Single(r) if r == (0..a.len())), "{what}: the first alone");
            }
        }
        // Alone, a padded, truncated or corrupt segment does not start a run either.
        let mut truncated = a.clone();
        truncated.truncate(a.len() - 1);
        for (what, f) in [("padded", &padded), ("neutral", &neutral), ("truncated", &truncated), ("corrupt", &corrupt)] {
            let mut c = TcpCoalescer::default();
            assert!(!c.offer(f, 0..f.len()), "{what}");
            assert!(!c.is_pending());
        }
    }

    #[test]
    fn header_round_trips() {
        let h = VnetHdr { flags: 1, gso_type: 4, hdr_len: 74, gso_size: 1440, csum_start: 54, csum_offset: 16 };
        let mut b = [0u8; 10];
        h.write(&mut b);
        assert_eq!(VnetHdr::parse(&b), Some(h));
        assert!(h.is_gso());
        assert_eq!(VnetHdr::parse(&b[..9]), None);
    }

    /// Splits `frame` at random cut points (some pieces of odd length, some
    /// of one byte) after `head` bytes.
    fn cut<'a>(frame: &'a [u8], head: usize, seed: &mut u64) -> Vec<&'a [u8]> {
        let mut parts = vec![&frame[..head]];
        let mut at = head;
        while at < frame.len() {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            let n = match *seed % 4 {
                0 => 1,
                1 => (*seed >> 8) as usize % 7 + 1,
                _ => (*seed >> 8) as usize % 3000 + 1,
            };
            let e = (at + n).min(frame.len());
            parts.push(&frame[at..e]);
            at = e;
        }
        parts
    }

    #[test]
    fn a_super_frame_in_pieces_is_cut_as_the_same_frame_whole() {
        let payload: Vec<u8> = (0..40_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let mut seed = 0x9e3779b97f4a7c15u64;
        for (round, frame) in [tcp4(&payload, 0x18), tcp6(&payload[..30_001], 0x19)].iter().cycle().take(200).enumerate() {
            let head = 54 + round % 2 * 20 + round % 37; // headers, and perhaps some payload
            let parts = cut(frame, head.min(frame.len()), &mut seed);
            let pieces = Pieces::new(&parts);
            assert_eq!(pieces.len(), frame.len());
            let mss = [536, 1448, 1460, 8948][round % 4];
            let (mut whole, mut cut_plan) = (SegmentPlan::default(), SegmentPlan::default());
            plan_tcp_segments(frame, mss, &mut whole).unwrap();
            plan_tcp_segments_in(&pieces, mss, &mut cut_plan).unwrap();
            assert_eq!(whole.headers, cut_plan.headers, "round {round}");
            assert_eq!(whole.payload, cut_plan.payload);
            // The slices of each segment's payload are its bytes.
            for r in &whole.payload {
                let mut got = Vec::new();
                pieces.each(r.clone(), |s| {
                    assert!(!s.is_empty());
                    got.extend_from_slice(s)
                });
                assert_eq!(got, &frame[r.clone()]);
                assert_eq!(pieces.count(r.clone()), {
                    let mut n = 0;
                    pieces.each(r.clone(), |_| n += 1);
                    n
                });
            }
            let mut flat = vec![0u8; frame.len()];
            pieces.copy_to(&mut flat);
            assert_eq!(&flat, frame);
        }
    }

    #[test]
    fn a_partial_checksum_over_pieces_is_the_checksum_of_the_whole() {
        let payload: Vec<u8> = (0..9_999u32).map(|i| (i * 13 + 5) as u8).collect();
        let mut seed = 12345u64;
        for round in 0..300 {
            let mut frame = tcp4(&payload[..round * 31 % payload.len()], 0x18);
            // Leave the TCP checksum partial, as a guest does: the field holds
            // the pseudo-header sum.
            frame[50..52].copy_from_slice(&[0x12, 0x34]);
            let mut whole = frame.clone();
            complete_checksum(&mut whole, 34, 16).unwrap();
            let head_len = (54 + round % 9).min(frame.len());
            let (head, tail) = frame.split_at_mut(head_len);
            let rest = cut(tail, 0, &mut seed);
            complete_checksum_pieces(head, &rest[1..], 34, 16).unwrap();
            assert_eq!(&head[50..52], &whole[50..52], "round {round}");
        }
        // The field must lie in the head, past the Ethernet header.
        let mut f = tcp4(&payload[..100], 0x18);
        let (head, tail) = f.split_at_mut(40);
        assert_eq!(complete_checksum_pieces(head, &[tail], 34, 16), Err(OffloadError::Malformed));
        assert_eq!(complete_checksum_pieces(head, &[tail], 10, 16), Err(OffloadError::Malformed));
    }
}
