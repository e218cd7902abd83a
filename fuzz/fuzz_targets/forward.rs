//! vnetd's forwarder itself (linked from the vnetd library), on dummy ports:
//! three guests (one whose driver takes no offloads) and two links, the
//! routes of a small LAN, and frames from any of them with any offload
//! metadata, while routes come and go.
//!
//! Checked after every frame:
//! - nothing panics, whatever the frame and its virtio-net header claim;
//! - nothing goes back out of the port it came in on (split horizon);
//! - nothing reaches a guest longer than its MTU allows (1518 bytes at MTU
//!   1500) unless it is a super-frame to a guest that takes them, and no
//!   datagram on a link is longer than a UDP datagram can be;
//! - every frame is counted: frames received, plus fan-out copies, plus the
//!   extra segments cut from super-frames, equal frames sent plus drops.
//!
//! Input: a byte stream read with `arbitrary::Unstructured`: operations until
//! the input runs out.
#![no_main]
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use std::sync::atomic::Ordering::Relaxed;
use vnet_core::offload::{VnetHdr, VNET_HDR_LEN};
use vnet_core::Mac;
use vnetd::dispatch::rig::Rig;
use vnetd::stats::DropReason;

const MACS: [&str; 5] = ["02:00:00:00:00:01", "02:00:00:00:00:02", "02:00:00:00:00:03", "02:00:00:00:00:04", "ff:ff:ff:ff:ff:ff"];

fn lan() -> Rig {
    let mut r = Rig::default();
    for (i, m) in MACS[..3].iter().enumerate() {
        r.guest(&format!("g{i}"), m.parse().unwrap(), 1500, i != 2);
    }
    r.link("l0", 1500);
    r.link("l1", 9000);
    r.commit();
    let mut req = String::new();
    for m in &MACS[..3] {
        req += &format!("ROUTE ADD any {m} interface {m} any\nROUTE ADD any ff:ff:ff:ff:ff:ff interface {m} any\n");
    }
    req += &format!("ROUTE ADD any {} edge l0 any\nROUTE ADD any ff:ff:ff:ff:ff:ff edge l0 interface\n", MACS[3]);
    req += "ROUTE ADD any ff:ff:ff:ff:ff:ff edge l1 any\n";
    r.apply(&req).expect("the LAN's routes");
    r
}

fn balanced(r: &Rig) -> bool {
    let g = &r.st.global;
    let drops: u64 = DropReason::ALL.iter().map(|d| g.drops(*d)).sum();
    let extra = r.st.offload.segments.load(Relaxed) - r.st.offload.segmented.load(Relaxed);
    g.in_frames.load(Relaxed) + r.st.dispatch.fanout_copies.load(Relaxed) + extra == g.out_frames.load(Relaxed) + drops
}

fn frame(u: &mut Unstructured) -> Result<Vec<u8>> {
    let mut f = Vec::new();
    f.extend_from_slice(&MACS[u.choose_index(MACS.len())?].parse::<Mac>().unwrap().0);
    f.extend_from_slice(&MACS[u.choose_index(4)?].parse::<Mac>().unwrap().0);
    let len = u.int_in_range(0..=9000usize)?;
    let body = u.bytes(len.min(u.len()))?;
    f.extend_from_slice(body);
    if u.arbitrary::<bool>()? {
        f.truncate(u.int_in_range(0..=20usize)?); // runts
    }
    Ok(f)
}

fn run(data: &[u8]) -> Result<()> {
    let mut u = Unstructured::new(data);
    let mut r = lan();
    while !u.is_empty() {
        match u.int_in_range(0..=9u8)? {
            0..=5 => {
                let g = u.choose_index(3)?;
                let mut h = [0u8; VNET_HDR_LEN];
                if u.arbitrary::<bool>()? {
                    u.fill_buffer(&mut h)?;
                }
                let vnet = VnetHdr::parse(&h).expect("10 bytes");
                let f = frame(&mut u)?;
                r.from_guest(g, vnet, &f);
                assert!(r.nics[g].1.take_sent().is_empty(), "a frame went back to the guest that sent it");
            }
            6..=7 => {
                let l = u.choose_index(2)?;
                let n = u.int_in_range(1..=4usize)?;
                let frames = (0..n).map(|_| frame(&mut u)).collect::<Result<Vec<_>>>()?;
                let refs: Vec<&[u8]> = frames.iter().map(|f| &f[..]).collect();
                r.from_link(l, &refs);
                assert!(r.links[l].1.take_sent().is_empty(), "a frame went back out of the link it came in on");
            }
            8 => {
                let m = MACS[u.choose_index(3)?];
                let _ = r.apply(&format!("ROUTE DEL any {m} interface {m} any"));
            }
            _ => {
                let m = MACS[u.choose_index(3)?];
                let _ = r.apply(&format!("ROUTE ADD any {m} interface {m} any"));
            }
        }
        for (i, (_, nic)) in r.nics.iter().enumerate() {
            for f in nic.take_sent() {
                let takes = i != 2;
                assert!(f.bytes.len() <= 1518 || (takes && f.vnet.is_gso()), "{} bytes to guest {i}, {:?}", f.bytes.len(), f.vnet);
            }
        }
        for (_, link) in &r.links {
            for d in link.take_sent() {
                assert!(d.len() <= 65507, "a datagram of {} bytes", d.len());
            }
        }
        assert!(balanced(&r), "a frame not counted, or counted twice");
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(data);
});
