//! Any virtio-net header and frame, as a guest's TAP or a LAN device hands
//! them over: finishing a checksum, planning segmentation and merging the
//! segments back never panic, the segments cover the payload exactly, and
//! merging them gives back the frame's payload.
#![no_main]
use libfuzzer_sys::fuzz_target;
use vnet_core::offload::{complete_checksum, plan_tcp_segments, tcp_payload_offset, Run, SegmentPlan, TcpCoalescer, VnetHdr};

fuzz_target!(|data: &[u8]| {
    let Some(hdr) = VnetHdr::parse(data) else { return };
    let mut frame = data[10..].to_vec();
    let _ = complete_checksum(&mut frame, hdr.csum_start as usize, hdr.csum_offset as usize);
    let mss = (hdr.gso_size as usize).clamp(1, 9000);
    let mut plan = SegmentPlan::default();
    if plan_tcp_segments(&frame, mss, &mut plan).is_err() {
        assert!(tcp_payload_offset(&frame).is_none());
        return;
    }
    let hl = tcp_payload_offset(&frame).unwrap();
    let mut at = hl;
    let mut wire = Vec::new();
    let mut ranges = Vec::new();
    for i in 0..plan.len() {
        let r = plan.payload[i].clone();
        assert_eq!(r.start, at, "segments are contiguous");
        assert!(r.len() <= mss);
        at = r.end;
        let start = wire.len();
        wire.extend_from_slice(plan.header(i));
        wire.extend_from_slice(&frame[r]);
        ranges.push(start..wire.len());
    }
    assert_eq!(at, frame.len(), "segments cover the payload");
    let mut c = TcpCoalescer::default();
    let mut merged = Vec::new();
    for r in &ranges {
        if !c.offer(&wire, r.clone()) {
            take(&mut c, &wire, &mut merged);
            if !c.offer(&wire, r.clone()) {
                merged.extend_from_slice(&wire[r.start + hl..r.end]);
            }
        }
    }
    take(&mut c, &wire, &mut merged);
    assert_eq!(&merged[..], &frame[hl..], "merging gives back the payload");
});

fn take(c: &mut TcpCoalescer, wire: &[u8], merged: &mut Vec<u8>) {
    match c.take() {
        Run::Empty => {}
        Run::Single(r) => {
            let hl = tcp_payload_offset(&wire[r.clone()]).unwrap();
            merged.extend_from_slice(&wire[r.start + hl..r.end]);
        }
        Run::Merged { payloads, .. } => {
            for p in payloads {
                merged.extend_from_slice(&wire[p.clone()]);
            }
        }
    }
}
