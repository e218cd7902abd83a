//! Any received buffer as the links see it: a GRO run of datagrams (UDP,
//! VXLAN or Geneve), or a TCP link's byte stream of length-prefixed frames. Splitting,
//! header parsing and frame parsing never panic, never read past the
//! buffer, and account for every byte.
#![no_main]
use libfuzzer_sys::fuzz_target;
use vnet_core::mac::frame_macs;
use vnet_core::wire::{gro_segments, parse_geneve, parse_vxlan, tcp_frame_len, VXLAN_HDR_LEN};

fuzz_target!(|data: &[u8]| {
    let Some((&s, buf)) = data.split_first() else { return };
    // A GRO run with segment size s (0: a single datagram).
    let mut covered = 0;
    for r in gro_segments(buf.len(), s as usize) {
        assert_eq!(r.start, covered);
        covered = r.end;
        let d = &buf[r];
        let _ = frame_macs(d);
        if parse_vxlan(d).is_some() {
            let _ = frame_macs(&d[VXLAN_HDR_LEN..]);
        }
        if let Ok((_, at)) = parse_geneve(d) {
            // The frame starts inside the datagram, after whole options, and
            // holds at least an Ethernet header.
            assert!(at >= 8 && at % 4 == 0 && at + 14 <= d.len());
            assert!(frame_macs(&d[at..]).is_some());
        }
    }
    assert_eq!(covered, buf.len());
    // The same bytes as a TCP link's stream.
    let mut at = 0;
    while let Some(p) = buf.get(at..at + 4) {
        let Some(n) = tcp_frame_len(p.try_into().unwrap()) else { break };
        let Some(frame) = buf.get(at + 4..at + 4 + n) else { break };
        assert!(frame_macs(frame).is_some());
        at += 4 + n;
    }
});
