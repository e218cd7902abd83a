//! Any virtio-net header and frame, as a guest's TAP or a LAN device hands
//! them over, through checksum completion, TCP segmentation and coalescing.
//! Checksums are verified here with a plain RFC 1071 sum, not offload.rs's.
//!
//! Input: `[virtio-net header: 10][control: 8][frame]`. The header's
//! csum_start/csum_offset go to `complete_checksum` as they are; its gso_size
//! is the MSS. The control bytes choose corruptions of the segments (below).
//! A frame that is not TCP is checked as it is, then made into one
//! (`synthesize`) for the rest, so the fuzzer reaches it from any bytes.
//!
//! Checked:
//! - `complete_checksum` on the raw frame: Ok exactly when the field lies in
//!   the frame and the sum starts at or past the L3 header (14, or 18 with a
//!   VLAN tag); on Ok only the 2-byte field changes and (for an even offset)
//!   the sum verifies with the seed the field held; on Err nothing changes.
//! - A TCP frame (its IP length and checksums repaired) with its checksum
//!   field set to the pseudo-header sum, as a guest leaves it, comes back
//!   from `complete_checksum(l4, 16)` as the repaired frame.
//! - `plan_tcp_segments` fails exactly for frames that are not TCP; else
//!   every segment: headers as the frame's but for IP length (= the
//!   segment's), IPv4 ID (+i) and checksum (valid), sequence number
//!   (consecutive), TCP checksum (valid over the segment), FIN/PSH (last
//!   segment only) and CWR (first only); payloads of `mss` bytes but the
//!   last, concatenated = the frame's payload.
//! - `TcpCoalescer` offered those segments in order (for a plain ACK or
//!   ACK|PSH data segment without IP options) merges them: it refuses one
//!   only when the run is complete (`MAX_RUN` frames, the merged IP length
//!   at its bound, or after a short or PSH segment) or the segment is larger
//!   than the run's gso_size; one run gives back the original frame when it
//!   fits. The same for the segments of two consecutive super-frames of the
//!   flow (a stream longer than an IP packet).
//! - A coalescer offered arbitrary frames (the segments with bits flipped,
//!   padding added, bytes cut, dropped, doubled, swapped, split; headers,
//!   sequence numbers or lengths changed with checksums made right; then
//!   the raw frame) takes only exact frames (length = IP length) with valid
//!   TCP checksums that are plain data segments.
//! - Every run it hands back: at most `MAX_RUN` frames, one flow,
//!   consecutive sequence numbers, every frame but the last of gso_size
//!   bytes, PSH on the last only; the virtio-net header as for TSO; with its
//!   partial checksum completed, the merged frame has the right IP length
//!   and valid checksums and equals the first frame's headers (PSH if any
//!   had it) over all the payloads, as merged here.
#![no_main]
use libfuzzer_sys::fuzz_target;
use vnet_core::offload::{
    complete_checksum, plan_tcp_segments, tcp_payload_offset, Run, SegmentPlan, TcpCoalescer, VnetHdr, F_NEEDS_CSUM,
    GSO_TCPV4, GSO_TCPV6, MAX_RUN,
};

const CTRL: usize = 8;
/// Largest merged IP packet the coalescer builds (offload.rs: 65535 - 256).
const MAX_MERGED_IP: usize = 65535 - 256;
/// Bound on segments per frame, to keep each input fast.
const MAX_SEGMENTS: usize = 256;

// ---- Plain checksums (RFC 1071) ----

fn sum(data: &[u8]) -> u64 {
    data.chunks(2).map(|w| (w[0] as u64) << 8 | w.get(1).copied().unwrap_or(0) as u64).sum()
}

fn fold(mut s: u64) -> u16 {
    while s >> 16 != 0 {
        s = (s & 0xffff) + (s >> 16);
    }
    s as u16
}

fn be16(f: &[u8], at: usize) -> usize {
    u16::from_be_bytes([f[at], f[at + 1]]) as usize
}

fn be32(f: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(f[at..at + 4].try_into().unwrap())
}

// ---- TCP frame layout, as the docs define what is TCP ----

#[derive(Clone, Copy, Debug, PartialEq)]
struct L {
    l3: usize,
    v4: bool,
    l4: usize,
    hl: usize,
}

fn layout(f: &[u8]) -> Option<L> {
    let mut l3 = 14;
    let mut et = be16(f.get(..14)?, 12);
    if et == 0x8100 || et == 0x88a8 {
        et = be16(f.get(..18)?, 16);
        l3 = 18;
    }
    let (v4, l4) = match et {
        0x0800 => {
            let ihl = (*f.get(l3)? & 0x0f) as usize * 4;
            if ihl < 20 || *f.get(l3 + 9)? != 6 {
                return None;
            }
            (true, l3 + ihl)
        }
        0x86dd if *f.get(l3 + 6)? == 6 => (false, l3 + 40),
        _ => return None,
    };
    let thl = (*f.get(l4 + 12)? >> 4) as usize * 4;
    (thl >= 20 && l4 + thl <= f.len()).then_some(L { l3, v4, l4, hl: l4 + thl })
}

fn pseudo(f: &[u8], t: &L, tcp_len: usize) -> u64 {
    let addrs = if t.v4 { &f[t.l3 + 12..t.l3 + 20] } else { &f[t.l3 + 8..t.l3 + 40] };
    sum(addrs) + 6 + tcp_len as u64
}

fn tcp_ok(f: &[u8], t: &L) -> bool {
    fold(pseudo(f, t, f.len() - t.l4) + sum(&f[t.l4..])) == 0xffff
}

fn ip4_ok(f: &[u8], t: &L) -> bool {
    fold(sum(&f[t.l3..t.l4])) == 0xffff
}

/// The IP packet's length as its header says.
fn ip_len(f: &[u8], t: &L) -> usize {
    if t.v4 {
        be16(f, t.l3 + 2)
    } else {
        40 + be16(f, t.l3 + 4)
    }
}

/// Makes a TCP frame valid: IP length = the frame's, checksums right.
fn repair(f: &mut Vec<u8>, t: &L) {
    f.truncate(t.l3 + if t.v4 { 65535 } else { 40 + 65535 });
    let n = f.len() - t.l3;
    if t.v4 {
        f[t.l3 + 2..t.l3 + 4].copy_from_slice(&(n as u16).to_be_bytes());
        f[t.l3 + 10..t.l3 + 12].copy_from_slice(&[0, 0]);
        let c = !fold(sum(&f[t.l3..t.l4]));
        f[t.l3 + 10..t.l3 + 12].copy_from_slice(&c.to_be_bytes());
    } else {
        f[t.l3 + 4..t.l3 + 6].copy_from_slice(&((n - 40) as u16).to_be_bytes());
    }
    f[t.l4 + 16..t.l4 + 18].copy_from_slice(&[0, 0]);
    let c = !fold(pseudo(f, t, f.len() - t.l4) + sum(&f[t.l4..]));
    f[t.l4 + 16..t.l4 + 18].copy_from_slice(&c.to_be_bytes());
}

/// Headers `a` and `b` (`t.hl` bytes each) are equal but for what differs
/// between segments of one flow: IP length, ID and checksum; TCP sequence
/// number, flags and checksum.
fn same_but_per_segment(a: &[u8], b: &[u8], t: &L) -> bool {
    let mut skip = vec![t.l4 + 4..t.l4 + 8, t.l4 + 13..t.l4 + 14, t.l4 + 16..t.l4 + 18];
    if t.v4 {
        skip.extend([t.l3 + 2..t.l3 + 6, t.l3 + 10..t.l3 + 12]);
    } else {
        skip.push(t.l3 + 4..t.l3 + 6);
    }
    (0..t.hl).all(|i| skip.iter().any(|r| r.contains(&i)) || a[i] == b[i])
}

fn flags(f: &[u8], t: &L) -> u8 {
    f[t.l4 + 13]
}

/// What the coalescer may take: a plain data segment (ACK, maybe PSH) with
/// payload, no IP options and not a fragment.
fn plain_data(f: &[u8], t: &L) -> bool {
    let fl = flags(f, t);
    f.len() > t.hl
        && fl & !0x18 == 0
        && fl & 0x10 != 0
        && (!t.v4 || (t.l4 - t.l3 == 20 && f[t.l3 + 6] & 0x3f == 0 && f[t.l3 + 7] == 0))
}

// ---- complete_checksum ----

fn check_complete_checksum(raw: &[u8], start: usize, offset: usize) {
    let mut f = raw.to_vec();
    let r = complete_checksum(&mut f, start, offset);
    let l3 = match raw.get(12..14) {
        Some([0x81, 0x00] | [0x88, 0xa8]) => Some(18),
        Some(_) => Some(14),
        None => None,
    };
    let field = start + offset;
    let fits = l3.is_some_and(|l3| start >= l3 && field + 2 <= raw.len());
    assert_eq!(r.is_ok(), fits, "complete_checksum({start}, {offset}) on {} bytes, L3 at {l3:?}: {r:?}", raw.len());
    if r.is_err() {
        assert_eq!(f, raw, "a refused completion changed the frame");
        return;
    }
    assert!(f[..field] == raw[..field] && f[field + 2..] == raw[field + 2..], "only the checksum field changes");
    if offset % 2 == 0 {
        let seed = be16(raw, field) as u64;
        assert_eq!(fold(seed + sum(&f[start..])), 0xffff, "the completed checksum verifies");
    }
}

// ---- Coalescer runs ----

/// Checks one run the coalescer handed back, whose frames were `members`
/// (ranges of `buf`), against the same frames merged here.
fn check_run(buf: &[u8], members: &[std::ops::Range<usize>], run: Run<'_>) -> Option<Vec<u8>> {
    match run {
        Run::Empty => {
            assert!(members.is_empty(), "{} frames taken, none handed back", members.len());
            None
        }
        Run::Single(r) => {
            assert_eq!(members, &[r.clone()], "a single frame is the one taken");
            Some(buf[r].to_vec())
        }
        Run::Merged { vnet, header, payloads, frames, frame_bytes } => {
            assert!(members.len() >= 2 && frames == members.len(), "merged {frames} of {} frames", members.len());
            assert!(frames <= MAX_RUN, "{frames} frames in a run, MAX_RUN {MAX_RUN}");
            assert_eq!(frame_bytes, members.iter().map(|r| r.len()).sum::<usize>());
            let first = &buf[members[0].clone()];
            let t = layout(first).expect("a merged frame is TCP");
            let mut psh = false;
            let mut seq = be32(first, t.l4 + 4);
            for (m, p) in members.iter().zip(payloads) {
                let f = &buf[m.clone()];
                assert_eq!(layout(f), Some(t), "one layout in a run");
                assert!(same_but_per_segment(first, f, &t), "one flow in a run");
                assert_eq!(be32(f, t.l4 + 4), seq, "consecutive sequence numbers in a run");
                assert_eq!(*p, m.start + t.hl..m.end, "the payloads are the frames'");
                seq = seq.wrapping_add((f.len() - t.hl) as u32);
                psh |= flags(f, &t) & 0x08 != 0;
                assert!(!psh || *m == members[members.len() - 1], "a run ends at a PSH segment");
            }
            let mss = members[0].len() - t.hl;
            for (k, m) in members.iter().enumerate() {
                let p = m.len() - t.hl;
                assert!(p == mss || (k + 1 == members.len() && p <= mss), "frame {k} of a run: {p} bytes, gso_size {mss}");
            }
            let want_vnet = VnetHdr {
                flags: F_NEEDS_CSUM,
                gso_type: if t.v4 { GSO_TCPV4 } else { GSO_TCPV6 },
                hdr_len: t.hl as u16,
                gso_size: mss as u16,
                csum_start: t.l4 as u16,
                csum_offset: 16,
            };
            assert_eq!(vnet, want_vnet);
            assert_eq!(header.len(), t.hl);
            let mut merged = header.to_vec();
            for p in payloads {
                merged.extend_from_slice(&buf[p.clone()]);
            }
            complete_checksum(&mut merged, vnet.csum_start as usize, vnet.csum_offset as usize)
                .expect("the merged frame's own offsets");
            assert!(ip_len(&merged, &t) == merged.len() - t.l3, "merged IP length");
            assert!(!t.v4 || ip4_ok(&merged, &t), "merged IPv4 header checksum");
            assert!(tcp_ok(&merged, &t), "merged TCP checksum");
            // The oracle: the first frame's headers, PSH if any had it, over
            // every payload, with lengths and checksums made right.
            let mut want = first[..t.hl].to_vec();
            for m in members {
                want.extend_from_slice(&buf[m.start + t.hl..m.end]);
            }
            if psh {
                want[t.l4 + 13] |= 0x08;
            }
            repair(&mut want, &t);
            assert!(merged == want, "merged frame differs from its frames merged");
            Some(merged)
        }
    }
}

/// Offers `frames` in order, taking the run and offering again on refusal.
/// `in_order`: the frames are a valid flow's segments, so the coalescer
/// may refuse one only when its run is complete. Returns the delivered
/// frames.
fn coalesce(frames: &[Vec<u8>], in_order: bool) -> Vec<Vec<u8>> {
    let buf = frames.concat();
    let mut ranges = Vec::new();
    let mut at = 0;
    for f in frames {
        ranges.push(at..at + f.len());
        at += f.len();
    }
    let mut c = TcpCoalescer::default();
    let mut members: Vec<std::ops::Range<usize>> = Vec::new();
    let mut out = Vec::new();
    for (i, r) in ranges.iter().enumerate() {
        let f = &buf[r.clone()];
        let mut taken = c.offer(&buf, r.clone());
        if !taken {
            if in_order {
                // A valid flow's segment is refused only when the run is
                // complete (full, or ended by a short or PSH segment) or
                // the segment is larger than the run's gso_size.
                let t = layout(f).unwrap();
                let last = &buf[members.last().expect("an empty coalescer refused a segment").clone()];
                let (first_len, last_len) = (members[0].len() - t.hl, last.len() - t.hl);
                let run_ip = t.hl - t.l3 + members.iter().map(|m| m.len() - t.hl).sum::<usize>();
                assert!(
                    members.len() >= MAX_RUN
                        || run_ip + f.len() - t.hl > MAX_MERGED_IP
                        || last_len < first_len
                        || f.len() - t.hl > first_len
                        || flags(last, &t) & 0x08 != 0,
                    "segment {i} of {} refused: a run of {} frames ({run_ip} IP bytes)",
                    frames.len(),
                    members.len()
                );
            }
            out.extend(check_run(&buf, &members, c.take()));
            members.clear();
            taken = c.offer(&buf, r.clone());
            assert!(taken || !in_order, "segment {i} refused by an empty coalescer");
        }
        if taken {
            let t = layout(f).expect("the coalescer took a frame that is not TCP");
            assert_eq!(t.l3 + ip_len(f, &t), f.len(), "the coalescer took a frame whose length is not its IP length");
            assert!(tcp_ok(f, &t), "the coalescer took a frame with a bad TCP checksum");
            assert!(plain_data(f, &t), "the coalescer took a frame that is not a plain data segment");
            members.push(r.clone());
        } else {
            out.push(f.to_vec());
        }
    }
    out.extend(check_run(&buf, &members, c.take()));
    assert!(matches!(c.take(), Run::Empty), "take empties the coalescer");
    out
}

/// The segments, changed as `ctrl` says: 4 operations of 2 bytes, `a b`:
/// on segment `a / 14`, operation `a % 14` with parameter `b`.
fn corrupt(segs: &[Vec<u8>], ctrl: &[u8; CTRL], t: &L) -> Vec<Vec<u8>> {
    let hl = t.hl;
    let mut v = segs.to_vec();
    for op in ctrl.chunks(2) {
        if v.is_empty() {
            break;
        }
        let (a, b) = (op[0] as usize, op[1] as usize);
        let i = (a / 14) % v.len();
        let len = v[i].len();
        let trim = (b % 16 + 1).min(len.saturating_sub(hl + 1));
        match a % 14 {
            1 => v[i][b % hl] ^= 1 << (b % 8), // a header bit
            2 if len > hl => v[i][hl + (b * 13) % (len - hl)] ^= 1 << (b % 8), // a payload bit
            3 => v[i].extend(std::iter::repeat_n(b as u8, b % 8 + 1)), // padding
            4 if len > hl + 1 => v[i].truncate(len - (b % 4 + 1).min(len - hl - 1)), // cut short
            5 => drop(v.remove(i)),
            6 => v.insert(i, v[i].clone()),
            7 if i + 1 < v.len() => v.swap(i, i + 1),
            // A header bit, then lengths and checksums made right: another
            // flow, or other options, that still verifies.
            8 => {
                v[i][b % hl] ^= 1 << (b % 8);
                if let Some(u) = layout(&v[i]) {
                    repair(&mut v[i], &u);
                }
            }
            // Another sequence number, checksums right.
            9 => {
                let seq = be32(&v[i], t.l4 + 4).wrapping_add(b as u32 * 0x0101_0101);
                v[i][t.l4 + 4..t.l4 + 8].copy_from_slice(&seq.to_be_bytes());
                repair(&mut v[i], t);
            }
            // Payload bytes taken off the front (the sequence number moves
            // on) or off the end, checksums right: short segments that the
            // next one follows on from, or that leave a gap.
            10 if trim > 0 => {
                v[i].drain(hl..hl + trim);
                let seq = be32(&v[i], t.l4 + 4).wrapping_add(trim as u32);
                v[i][t.l4 + 4..t.l4 + 8].copy_from_slice(&seq.to_be_bytes());
                repair(&mut v[i], t);
            }
            11 if trim > 0 => {
                v[i].truncate(len - trim);
                repair(&mut v[i], t);
            }
            // Split in two segments, checksums right: a short segment that
            // the next one follows on from.
            12 if len > hl + 1 => {
                let at = hl + 1 + b % (len - hl - 1);
                let mut second = v[i][..hl].to_vec();
                second.extend_from_slice(&v[i][at..]);
                let seq = be32(&second, t.l4 + 4).wrapping_add((at - hl) as u32);
                second[t.l4 + 4..t.l4 + 8].copy_from_slice(&seq.to_be_bytes());
                repair(&mut second, t);
                v[i].truncate(at);
                repair(&mut v[i], t);
                v.insert(i + 1, second);
            }
            // Padding or a cut that the TCP checksum covers (summed over the
            // frame, not the IP packet): only the IP length tells.
            13 => {
                if b & 1 == 1 {
                    v[i].extend(std::iter::repeat_n(b as u8, b / 2 % 8 + 1));
                } else if trim > 0 {
                    v[i].truncate(len - trim);
                }
                let f = &mut v[i];
                f[t.l4 + 16..t.l4 + 18].copy_from_slice(&[0, 0]);
                let c = !fold(pseudo(f, t, f.len() - t.l4) + sum(&f[t.l4..]));
                f[t.l4 + 16..t.l4 + 18].copy_from_slice(&c.to_be_bytes());
            }
            _ => {}
        }
    }
    v
}

/// A TCP frame from bytes that are not one: `[shape][flags][payload...]`.
/// shape: bit 0 IPv6, bit 1 a VLAN tag (bit 2: 802.1ad), bits 3-4 the
/// flags (ACK, ACK|PSH, the next byte, ACK), bit 5 TCP options (12 bytes),
/// bit 6 a sequence number about to wrap.
fn synthesize(raw: &[u8]) -> Option<Vec<u8>> {
    let (&shape, rest) = raw.split_first()?;
    let (&any_flags, payload) = rest.split_first()?;
    let mut f = vec![2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1];
    if shape & 2 != 0 {
        f.extend_from_slice(if shape & 4 != 0 { &[0x88, 0xa8, 0, 5] } else { &[0x81, 0, 0, 5] });
    }
    let v6 = shape & 1 != 0;
    if v6 {
        f.extend_from_slice(&[0x86, 0xdd, 0x60, 0, 0, 0, 0, 0, 6, 64]);
        f.extend_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
        f.extend_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]);
    } else {
        f.extend_from_slice(&[0x08, 0x00, 0x45, 0, 0, 0, 0x12, 0x34, 0x40, 0, 64, 6, 0, 0, 198, 19, 0, 1, 198, 19, 0, 2]);
    }
    let opts = shape & 0x20 != 0;
    let seq: u32 = if shape & 0x40 != 0 { 0xffff_f000 } else { 1000 };
    let flags = match shape >> 3 & 3 {
        1 => 0x18,
        2 => any_flags,
        _ => 0x10,
    };
    f.extend_from_slice(&[0x13, 0x89, 0, 80]);
    f.extend_from_slice(&seq.to_be_bytes());
    f.extend_from_slice(&[0, 0, 3, 9, if opts { 8 << 4 } else { 5 << 4 }, flags, 0xfd, 0xe8, 0, 0, 0, 0]);
    if opts {
        f.extend_from_slice(&[1, 1, 8, 10, 0, 0, 0, 1, 0, 0, 0, 2]);
    }
    f.extend_from_slice(payload);
    Some(f)
}

fuzz_target!(|data: &[u8]| {
    let Some(hdr) = VnetHdr::parse(data) else { return };
    let Some(ctrl) = data.get(10..10 + CTRL) else { return };
    let ctrl: &[u8; CTRL] = ctrl.try_into().unwrap();
    let raw = &data[10 + CTRL..];

    check_complete_checksum(raw, hdr.csum_start as usize, hdr.csum_offset as usize);

    let mut plan = SegmentPlan::default();
    let lib = tcp_payload_offset(raw);
    assert_eq!(lib, layout(raw).map(|t| t.hl), "what is TCP");
    let mut orig = match layout(raw) {
        Some(_) => raw.to_vec(),
        None => {
            assert!(plan_tcp_segments(raw, 1448, &mut plan).is_err());
            coalesce(&[raw.to_vec()], false);
            // Go on with a TCP frame made from the same bytes, so that the
            // rest is reached without a corpus too.
            match synthesize(raw) {
                Some(f) => f,
                None => return,
            }
        }
    };
    let t = layout(&orig).expect("a TCP frame");
    repair(&mut orig, &t);
    assert!(tcp_ok(&orig, &t) && (!t.v4 || ip4_ok(&orig, &t)));

    // A guest's partial checksum: the field holds the pseudo-header sum.
    let mut partial = orig.clone();
    let seed = fold(pseudo(&partial, &t, partial.len() - t.l4));
    partial[t.l4 + 16..t.l4 + 18].copy_from_slice(&seed.to_be_bytes());
    complete_checksum(&mut partial, t.l4, 16).expect("a TCP frame's own checksum offsets");
    assert!(partial == orig, "completing a partial TCP checksum");

    // Segmentation.
    let payload = &orig[t.hl..];
    let mss = (hdr.gso_size as usize).clamp(1, 9000).max(payload.len().div_ceil(MAX_SEGMENTS));
    plan_tcp_segments(&orig, mss, &mut plan).expect("a TCP frame segments");
    let n = payload.len().div_ceil(mss).max(1);
    assert_eq!(plan.len(), n, "segments for {} bytes of {mss}", payload.len());
    assert_eq!(plan.hdr_len, t.hl);
    let f0 = flags(&orig, &t);
    let seq0 = be32(&orig, t.l4 + 4);
    let mut segs = Vec::with_capacity(n);
    let mut joined = Vec::with_capacity(payload.len());
    for i in 0..n {
        let r = plan.payload[i].clone();
        assert_eq!(r.start, t.hl + joined.len(), "segments are contiguous");
        assert!(r.len() == mss || (i + 1 == n && r.len() <= mss), "segment {i}: {} bytes of {mss}", r.len());
        let mut s = plan.header(i).to_vec();
        s.extend_from_slice(&orig[r.clone()]);
        assert_eq!(plan.frame_len(i), s.len());
        assert_eq!(layout(&s), Some(t), "segment {i}'s layout");
        assert!(same_but_per_segment(&orig, &s, &t), "segment {i}: headers as the frame's");
        assert_eq!(ip_len(&s, &t), s.len() - t.l3, "segment {i}: IP length");
        if t.v4 {
            assert!(ip4_ok(&s, &t), "segment {i}: IPv4 header checksum");
            assert_eq!(be16(&s, t.l3 + 4), (be16(&orig, t.l3 + 4) + i) & 0xffff, "segment {i}: IPv4 ID");
        }
        assert!(tcp_ok(&s, &t), "segment {i}: TCP checksum");
        assert_eq!(be32(&s, t.l4 + 4), seq0.wrapping_add(joined.len() as u32), "segment {i}: sequence number");
        let mut want = f0;
        if i + 1 < n {
            want &= !0x09; // FIN, PSH: last only
        }
        if i > 0 {
            want &= !0x80; // CWR: first only
        }
        assert_eq!(flags(&s, &t), want, "segment {i} of {n}: flags from {f0:#04x}");
        joined.extend_from_slice(&orig[r]);
        segs.push(s);
    }
    assert!(joined == payload, "the segments' payloads are the frame's");
    if n == 1 {
        assert!(segs[0] == orig, "a frame that fits is its own segment");
    }

    // Coalescing the segments in order.
    if plain_data(&orig, &t) {
        let out = coalesce(&segs, true);
        if n <= MAX_RUN && orig.len() - t.l3 <= MAX_MERGED_IP {
            assert_eq!(out.len(), 1, "{n} in-order segments, {} runs", out.len());
            assert!(out[0] == orig, "merging the segments gives back the frame");
        }
    }

    // A stream longer than one IP packet takes: the segments of this frame
    // and of the next one of the flow. Runs must end before the merged IP
    // length overflows, as each run's check above (IP length) verifies.
    if plain_data(&orig, &t) && 2 * (orig.len() - t.l3) > MAX_MERGED_IP {
        let mut stream = segs.clone();
        for i in 0..n {
            let mut s = plan.header(i).to_vec();
            let seq = be32(&s, t.l4 + 4).wrapping_add(payload.len() as u32);
            s[t.l4 + 4..t.l4 + 8].copy_from_slice(&seq.to_be_bytes());
            s.extend_from_slice(&orig[plan.payload[i].clone()]);
            repair(&mut s, &t);
            stream.push(s);
        }
        coalesce(&stream, true);
    }

    // A coalescer fed the segments changed, and the raw frame.
    let mut frames = corrupt(&segs, ctrl, &t);
    frames.push(raw.to_vec());
    coalesce(&frames, false);
});
