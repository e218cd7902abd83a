//! The forwarder on dummy ports (`rig.rs`): what a frame becomes on its way
//! from a guest or a link to each destination, and how it is counted, with
//! the real rule table and no namespace. The end-to-end tests show the same
//! with real guests; these pin the forwarder's own rules one by one.
//!
//! Shown to fail: with the route cache keyed without the table's generation
//! (`a_deleted_route_...` fails) and with the oversize check off by one
//! (`a_frame_longer_...` fails).

use super::super::rig::Rig;
use crate::stats::DropReason;
use std::sync::atomic::Ordering::Relaxed;
use vnet_core::offload::{csum_add, csum_fold, VnetHdr, F_NEEDS_CSUM, GSO_TCPV4};
use vnet_core::Mac;

const A: &str = "02:00:00:00:00:0a";
const B: &str = "02:00:00:00:00:0b";
const C: &str = "02:00:00:00:00:0c";
const R: &str = "02:00:00:00:00:0e"; // a guest on another host
const BCAST: &str = "ff:ff:ff:ff:ff:ff";

fn mac(s: &str) -> Mac {
    s.parse().unwrap()
}

/// An Ethernet frame from `src` to `dst` with a payload of `n` bytes.
fn eth(dst: &str, src: &str, n: usize) -> Vec<u8> {
    let mut f = Vec::with_capacity(14 + n);
    f.extend_from_slice(&mac(dst).0);
    f.extend_from_slice(&mac(src).0);
    f.extend_from_slice(&[0x88, 0xb5]); // local experimental ethertype
    f.extend((0..n).map(|i| i as u8));
    f
}

/// A TCP/IPv4 frame from `src` to `dst` carrying `payload`, with both
/// checksums right.
fn tcp4(dst: &str, src: &str, seq: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![0u8; 54];
    f[0..6].copy_from_slice(&mac(dst).0);
    f[6..12].copy_from_slice(&mac(src).0);
    f[12..14].copy_from_slice(&[0x08, 0x00]);
    f[14] = 0x45;
    f[16..18].copy_from_slice(&((40 + payload.len()) as u16).to_be_bytes());
    f[22] = 64;
    f[23] = 6;
    f[26..30].copy_from_slice(&[198, 19, 0, 1]);
    f[30..34].copy_from_slice(&[198, 19, 0, 2]);
    f[34..36].copy_from_slice(&40000u16.to_be_bytes());
    f[36..38].copy_from_slice(&5201u16.to_be_bytes());
    f[38..42].copy_from_slice(&seq.to_be_bytes());
    f[46] = 5 << 4;
    f[47] = 0x10; // ACK
    f[48..50].copy_from_slice(&64000u16.to_be_bytes());
    f.extend_from_slice(payload);
    let c = csum_fold(csum_add(0, &f[14..34]));
    f[24..26].copy_from_slice(&c.to_be_bytes());
    let c = csum_fold(csum_add(pseudo(&f), &f[34..]));
    f[50..52].copy_from_slice(&c.to_be_bytes());
    f
}

fn pseudo(f: &[u8]) -> u64 {
    csum_add(0, &f[26..34]) + 6 + (f.len() - 34) as u64
}

/// What a guest's TCP hands over with offloads: the TCP checksum left to
/// the NIC (the pseudo-header sum in its field), and for a super-frame the
/// segment size.
fn offloaded(mut f: Vec<u8>, gso_size: u16) -> (VnetHdr, Vec<u8>) {
    let seed = !csum_fold(pseudo(&f));
    f[50..52].copy_from_slice(&seed.to_be_bytes());
    let mut v = VnetHdr { flags: F_NEEDS_CSUM, csum_start: 34, csum_offset: 16, ..VnetHdr::default() };
    if gso_size > 0 {
        v.gso_type = GSO_TCPV4;
        v.gso_size = gso_size;
        v.hdr_len = 54;
    }
    (v, f)
}

/// A TCP/IPv4 frame whose IP and TCP checksums are both right.
fn checksums_right(f: &[u8]) -> bool {
    csum_fold(csum_add(0, &f[14..34])) == 0 && csum_fold(csum_add(pseudo(f), &f[34..])) == 0
}

fn tcp_payload(f: &[u8]) -> &[u8] {
    &f[54..]
}

/// Guests A, B and C on this host (MTU 1500), a link `far` (MTU 1500) to
/// the host of guest R; unicast routes to each, and broadcasts to all.
fn lan() -> Rig {
    let mut r = Rig::default();
    r.guest("a", mac(A), 1500, true);
    r.guest("b", mac(B), 1500, true);
    r.guest("c", mac(C), 1500, false);
    r.link("far", 1500);
    r.commit();
    r.apply(&format!(
        "ROUTE ADD any {A} interface {A} any\nROUTE ADD any {B} interface {B} any\nROUTE ADD any {C} interface {C} any\n\
         ROUTE ADD any {R} edge far any\n\
         ROUTE ADD any {BCAST} interface {A} any\nROUTE ADD any {BCAST} interface {B} any\nROUTE ADD any {BCAST} interface {C} any\n\
         ROUTE ADD any {BCAST} edge far interface"
    ))
    .unwrap();
    r
}

#[test]
fn a_unicast_frame_reaches_its_guest_once_as_it_was_sent_and_is_counted_on_both_ports() {
    let mut r = lan();
    let f = eth(B, A, 100);
    r.from_guest(0, VnetHdr::default(), &f);
    let got = r.nics[1].1.take_sent();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].bytes, f);
    assert!(r.nics[0].1.take_sent().is_empty() && r.nics[2].1.take_sent().is_empty() && r.links[0].1.take_sent().is_empty());
    assert_eq!((r.guest_stats(0).in_frames.load(Relaxed), r.guest_stats(0).in_bytes.load(Relaxed)), (1, 114));
    assert_eq!((r.guest_stats(1).out_frames.load(Relaxed), r.guest_stats(1).out_bytes.load(Relaxed)), (1, 114));
    assert_eq!(r.st.global.in_frames.load(Relaxed), 1);
    assert_eq!(r.st.global.out_frames.load(Relaxed), 1);
}

#[test]
fn a_broadcast_goes_to_every_destination_of_the_highest_priority_but_never_back_where_it_came_from() {
    let mut r = lan();
    let f = eth(BCAST, A, 60);
    r.from_guest(0, VnetHdr::default(), &f);
    assert!(r.nics[0].1.take_sent().is_empty(), "not back to its sender");
    assert_eq!(r.nics[1].1.take_sent().len(), 1);
    assert_eq!(r.nics[2].1.take_sent().len(), 1);
    assert_eq!(r.links[0].1.take_sent(), vec![f.clone()]);
    assert_eq!(r.st.dispatch.fanout_copies.load(Relaxed), 2, "one frame to three destinations: two copies");
    // From the link, the broadcast reaches the local guests, and the rule
    // `edge far interface` (only frames from guests) keeps it off the link.
    let g = eth(BCAST, R, 60);
    r.from_link(0, &[&g]);
    for n in 0..3 {
        assert_eq!(r.nics[n].1.take_sent().len(), 1, "guest {n}");
    }
    assert!(r.links[0].1.take_sent().is_empty(), "never back out of the link it came in on");
}

#[test]
fn frames_no_rule_takes_or_too_short_to_be_ethernet_are_dropped_and_counted_where_they_came_in() {
    let mut r = lan();
    r.from_guest(0, VnetHdr::default(), &eth("02:00:00:00:00:99", A, 60));
    r.from_guest(0, VnetHdr::default(), &[0x02, 0, 0, 0]);
    assert_eq!(r.guest_stats(0).drops(DropReason::NoRoute), 1);
    assert_eq!(r.guest_stats(0).drops(DropReason::Malformed), 1);
    assert_eq!(r.st.global.drops(DropReason::NoRoute), 1);
    assert_eq!(r.st.global.drops(DropReason::Malformed), 1);
    assert_eq!(r.guest_stats(0).in_frames.load(Relaxed), 2, "both were received");
    for n in 0..3 {
        assert!(r.nics[n].1.take_sent().is_empty());
    }
}

#[test]
fn a_frame_longer_than_the_destination_takes_is_dropped_as_oversize_there() {
    let mut r = lan();
    // MTU 1500 takes 1518 bytes of frame (with an 802.1Q tag), not 1519.
    r.from_guest(0, VnetHdr::default(), &eth(B, A, 1518 - 14));
    r.from_guest(0, VnetHdr::default(), &eth(B, A, 1519 - 14));
    assert_eq!(r.nics[1].1.take_sent().len(), 1);
    assert_eq!(r.guest_stats(1).drops(DropReason::Oversize), 1);
}

#[test]
fn a_guest_whose_nic_is_down_loses_frames_counted_as_down() {
    let mut r = lan();
    r.nics[1].1.set_down(true);
    r.from_guest(0, VnetHdr::default(), &eth(B, A, 60));
    assert_eq!(r.guest_stats(1).drops(DropReason::Down), 1);
    assert_eq!(r.guest_stats(1).out_frames.load(Relaxed), 0);
}

#[test]
fn a_deleted_route_takes_effect_for_the_very_next_frame_of_a_cached_flow() {
    let mut r = lan();
    let f = eth(B, A, 60);
    r.from_guest(0, VnetHdr::default(), &f);
    assert_eq!(r.nics[1].1.take_sent().len(), 1);
    r.apply(&format!("ROUTE DEL any {B} interface {B} any")).unwrap();
    r.from_guest(0, VnetHdr::default(), &f);
    assert!(r.nics[1].1.take_sent().is_empty(), "the cache must not outlive the rule");
    assert_eq!(r.guest_stats(0).drops(DropReason::NoRoute), 1);
}

#[test]
fn a_tso_super_frame_to_a_link_is_cut_to_the_links_size_with_every_checksum_right() {
    let mut r = lan();
    let payload: Vec<u8> = (0..20_000u32).map(|i| (i * 13) as u8).collect();
    let (vnet, f) = offloaded(tcp4(R, A, 1000, &payload), 1448);
    r.from_guest(0, vnet, &f);
    let segs = r.links[0].1.take_sent();
    // The link carries 1500 - 28 bytes of frame: 1472 - 54 = 1418 of payload.
    assert_eq!(segs.len(), payload.len().div_ceil(1418));
    let mut joined = Vec::new();
    let mut seq = 1000u32;
    for s in &segs {
        assert!(s.len() <= 1472, "segment of {} bytes", s.len());
        assert!(checksums_right(s), "segment checksums");
        assert_eq!(u32::from_be_bytes([s[38], s[39], s[40], s[41]]), seq);
        seq += tcp_payload(s).len() as u32;
        joined.extend_from_slice(tcp_payload(s));
    }
    assert_eq!(joined, payload);
    assert_eq!(r.st.offload.segmented.load(Relaxed), 1);
    assert_eq!(r.st.offload.segments.load(Relaxed), segs.len() as u64);
    assert_eq!(r.link_stats(0).out_frames.load(Relaxed), segs.len() as u64);
}

#[test]
fn offloads_go_as_they_are_to_a_guest_that_takes_them_and_are_finished_for_one_that_does_not() {
    let mut r = lan();
    let payload: Vec<u8> = (0..4000u32).map(|i| i as u8).collect();
    // To B (a TAP: takes offloads): one write, metadata and all.
    let (vnet, f) = offloaded(tcp4(B, A, 1, &payload), 1448);
    r.from_guest(0, vnet, &f);
    let got = r.nics[1].1.take_sent();
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].vnet, &got[0].bytes), (vnet, &f));
    // To C (no offloads negotiated): segments of the guest's size, finished.
    let (vnet, f) = offloaded(tcp4(C, A, 1, &payload), 1448);
    r.from_guest(0, vnet, &f);
    let got = r.nics[2].1.take_sent();
    assert_eq!(got.len(), 3, "4000 bytes in segments of 1448");
    for g in &got {
        assert_eq!(g.vnet, VnetHdr::default());
        assert!(checksums_right(&g.bytes));
    }
    assert_eq!(got.iter().flat_map(|g| tcp_payload(&g.bytes).to_vec()).collect::<Vec<u8>>(), payload);
    // A lone partial checksum is finished too.
    let (vnet, f) = offloaded(tcp4(C, A, 9, b"short"), 0);
    r.from_guest(0, vnet, &f);
    let got = r.nics[2].1.take_sent();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].bytes, tcp4(C, A, 9, b"short"));
}

#[test]
fn a_run_of_tcp_segments_from_a_link_reaches_a_guest_merged_into_one_super_frame() {
    let mut r = lan();
    let payload: Vec<u8> = (0..1400 * 8).map(|i| (i % 251) as u8).collect();
    let frames: Vec<Vec<u8>> = payload.chunks(1400).enumerate().map(|(k, p)| tcp4(B, R, 5000 + 1400 * k as u32, p)).collect();
    let refs: Vec<&[u8]> = frames.iter().map(|f| &f[..]).collect();
    r.from_link(0, &refs);
    let got = r.nics[1].1.take_sent();
    assert_eq!(got.len(), 1, "one super-frame for the run");
    assert!(got[0].vnet.is_gso());
    assert_eq!(tcp_payload(&got[0].bytes), &payload[..]);
    assert_eq!(r.st.offload.coalesced.load(Relaxed), 1);
    assert_eq!(r.st.offload.coalesced_segments.load(Relaxed), 8);
    // Counted as the frames that arrived, not as one.
    assert_eq!(r.guest_stats(1).out_frames.load(Relaxed), 8);
    assert_eq!(r.link_stats(0).in_frames.load(Relaxed), 8);
}

#[test]
fn a_links_plain_frames_reach_a_guest_as_bursts_in_the_order_they_came_merged_runs_between() {
    let mut r = lan();
    let (p1, p2, p3, p4) = (eth(B, R, 60), eth(B, R, 61), eth(B, R, 62), eth(B, R, 63));
    let too_long = eth(B, R, 1519 - 14);
    let (s1, s2) = (tcp4(B, R, 100, &[1u8; 1000]), tcp4(B, R, 1100, &[2u8; 1000]));
    let to_a = eth(A, R, 60);
    r.from_link(0, &[&p1, &s1, &s2, &p2, &too_long, &p3, &to_a, &p4]);
    let got: Vec<Vec<u8>> = r.nics[1].1.take_sent().into_iter().map(|g| g.bytes).collect();
    assert_eq!(got.len(), 5, "p1, the merged run, p2, p3, p4");
    assert_eq!((&got[0], &got[2], &got[3], &got[4]), (&p1, &p2, &p3, &p4));
    assert_eq!(tcp_payload(&got[1]), &[[1u8; 1000], [2u8; 1000]].concat()[..]);
    // One burst before the merged run, one after it (the frame that was
    // too long dropped from it), one after the frame to A.
    assert_eq!(r.nics[1].1.take_bursts(), vec![1, 2, 1]);
    assert_eq!(r.nics[0].1.take_sent().len(), 1);
    assert_eq!(r.guest_stats(1).drops(DropReason::Oversize), 1);
    assert_eq!(r.guest_stats(1).out_frames.load(Relaxed), 6, "five sent, the run counted as its two");
}

#[test]
fn a_long_run_of_plain_frames_reaches_a_guest_in_bursts_of_at_most_64() {
    let mut r = lan();
    let frames: Vec<Vec<u8>> = (0..150).map(|i| eth(B, R, 60 + i % 7)).collect();
    let refs: Vec<&[u8]> = frames.iter().map(|f| &f[..]).collect();
    r.from_link(0, &refs);
    assert_eq!(r.nics[1].1.take_bursts(), vec![64, 64, 22]);
    let got: Vec<Vec<u8>> = r.nics[1].1.take_sent().into_iter().map(|g| g.bytes).collect();
    assert_eq!(got, frames, "all of them, in order");
}

#[test]
fn every_frame_is_counted_once_received_and_once_sent_or_dropped() {
    // The balance the soak test checks over hours, here frame by frame:
    // in + fan-out copies + extra segments = out + drops.
    let mut r = lan();
    r.from_guest(0, VnetHdr::default(), &eth(B, A, 60));
    r.from_guest(0, VnetHdr::default(), &eth(BCAST, A, 60));
    r.from_guest(1, VnetHdr::default(), &eth("02:00:00:00:00:99", B, 60));
    let (vnet, f) = offloaded(tcp4(R, A, 1, &[7u8; 5000]), 1448);
    r.from_guest(0, vnet, &f);
    r.from_link(0, &[&eth(C, R, 60), &eth(A, R, 2000)]);
    let g = &r.st.global;
    let drops: u64 = DropReason::ALL.iter().map(|d| g.drops(*d)).sum();
    let extra_segments = r.st.offload.segments.load(Relaxed) - r.st.offload.segmented.load(Relaxed);
    let lhs = g.in_frames.load(Relaxed) + r.st.dispatch.fanout_copies.load(Relaxed) + extra_segments;
    assert_eq!(lhs, g.out_frames.load(Relaxed) + drops);
    assert_eq!(drops, 2, "one without a route, one oversize");
}
