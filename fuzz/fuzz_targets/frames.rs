//! Any frame from any origin through a rule table and the route cache: no
//! panic, never back to its origin, each destination at most once, and the
//! cache answers as the table does.
#![no_main]
use libfuzzer_sys::fuzz_target;
use vnet_core::mac::frame_macs;
use vnet_core::table::{Port, Rule, RouteTable, SrcMatch};
use vnet_core::{Mac, MacQual, RouteCache};

fn table() -> RouteTable {
    let a = Mac([2, 0, 0, 0, 0, 1]);
    let b = Mac([2, 0, 0, 0, 0, 2]);
    let r = |src_mac, dst_mac, src, dst| Rule { src_mac, dst_mac, src, dst };
    RouteTable::new(
        vec![
            r(MacQual::Any, MacQual::Addr(a), SrcMatch::Any, Port::Interface(0)),
            r(MacQual::Any, MacQual::Addr(b), SrcMatch::Any, Port::Link(0)),
            r(MacQual::Any, MacQual::Addr(Mac::BROADCAST), SrcMatch::Any, Port::Interface(0)),
            r(MacQual::Any, MacQual::Addr(Mac::BROADCAST), SrcMatch::AnyInterface, Port::Link(0)),
            r(MacQual::Any, MacQual::Addr(Mac::BROADCAST), SrcMatch::AnyInterface, Port::Link(1)),
            r(MacQual::Addr(a), MacQual::None, SrcMatch::Exactly(Port::Interface(0)), Port::Link(1)),
            r(MacQual::Not(a), MacQual::Not(b), SrcMatch::AnyLink, Port::Interface(1)),
        ],
        1,
    )
}

fuzz_target!(|data: &[u8]| {
    let Some((&o, frame)) = data.split_first() else { return };
    let origin = if o & 1 == 0 { Port::Interface((o >> 1) as u32 % 3) } else { Port::Link((o >> 1) as u32 % 3) };
    let Some((dst, src)) = frame_macs(frame) else {
        assert!(frame.len() < 14);
        return;
    };
    let t = table();
    let mut direct = Vec::new();
    t.lookup(origin, src, dst, &mut direct);
    let mut cache = RouteCache::with_capacity(4);
    for _ in 0..2 {
        let hits = cache.route(&t, origin, src, dst);
        assert_eq!(hits, &direct[..]);
    }
    for (i, h) in direct.iter().enumerate() {
        assert_ne!(h.dst, origin, "split horizon");
        assert!(direct[..i].iter().all(|x| x.dst != h.dst), "duplicate destination");
    }
});
