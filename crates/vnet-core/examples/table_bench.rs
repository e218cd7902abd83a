//! The rule table's costs at a size: building it, changing it, and a lookup
//! that misses every cache (bench/core.py runs this and prints the figures).
//!
//! `cargo run --release -p vnet-core --example table_bench -- 1000 10000 100000`
//!
//! The table is shaped as a controller writes it (docs/controller.md): one
//! unicast route per remote guest MAC to the link of its host, a broadcast
//! route per host link, local delivery per local guest, plus the hand-made
//! kind (a per-source default route, an `any`/`not-` catch-all). Output: one
//! JSON object per size.

use std::time::Instant;
use vnet_core::rule::MacQual;
use vnet_core::table::{Port, Rule, RouteTable, SrcMatch};
use vnet_core::Mac;

fn mac(i: u32) -> Mac {
    let b = i.to_be_bytes();
    Mac([2, 0x76, b[0], b[1], b[2], b[3]])
}

fn rules(n: u32) -> Vec<Rule> {
    let hosts = 100u32;
    let mut v = Vec::with_capacity(n as usize + 200);
    for h in 0..hosts {
        v.push(Rule { src_mac: MacQual::Any, dst_mac: MacQual::Addr(Mac::BROADCAST), src: SrcMatch::AnyInterface, dst: Port::Link(h) });
    }
    for i in 0..8 {
        v.push(Rule { src_mac: MacQual::Any, dst_mac: MacQual::Addr(mac(i)), src: SrcMatch::Any, dst: Port::Interface(i) });
        v.push(Rule { src_mac: MacQual::Any, dst_mac: MacQual::Addr(Mac::BROADCAST), src: SrcMatch::Any, dst: Port::Interface(i) });
    }
    v.push(Rule { src_mac: MacQual::Addr(mac(0)), dst_mac: MacQual::None, src: SrcMatch::Any, dst: Port::Link(0) });
    v.push(Rule { src_mac: MacQual::Not(mac(1)), dst_mac: MacQual::Not(mac(1)), src: SrcMatch::AnyLink, dst: Port::Interface(1) });
    let fill = n.saturating_sub(v.len() as u32);
    for i in 0..fill {
        v.push(Rule { src_mac: MacQual::Any, dst_mac: MacQual::Addr(mac(1000 + i)), src: SrcMatch::AnyInterface, dst: Port::Link(i % hosts) });
    }
    v
}

/// min, median, max of `xs` (sorted here).
fn mmm(xs: &mut [f64]) -> (f64, f64, f64) {
    xs.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (xs[0], xs[xs.len() / 2], xs[xs.len() - 1])
}

fn main() {
    let sizes: Vec<u32> = std::env::args().skip(1).map(|a| a.parse().expect("a table size")).collect();
    for n in sizes {
        let rs = rules(n);
        let t0 = Instant::now();
        let table = RouteTable::new(rs.clone(), 1);
        let build_s = t0.elapsed().as_secs_f64();

        // One change on a table shared with the one in force (as vnetd
        // publishes it): clone, insert, then clone, remove.
        let mut add_us = Vec::new();
        let mut del_us = Vec::new();
        let mut cur = table.clone();
        for k in 0..200u32 {
            let id = n + 10 + k;
            let r = Rule { src_mac: MacQual::Any, dst_mac: MacQual::Addr(mac(0x0f00_0000 + k)), src: SrcMatch::AnyInterface, dst: Port::Link(k % 100) };
            let t0 = Instant::now();
            let mut next = cur.clone();
            next.insert(id, r);
            add_us.push(t0.elapsed().as_secs_f64() * 1e6);
            let t0 = Instant::now();
            let mut after = next.clone();
            after.remove(id);
            del_us.push(t0.elapsed().as_secs_f64() * 1e6);
            cur = after;
        }

        // Misses: each lookup a frame to a different routed MAC, from a
        // guest port, as a route cache miss asks the table.
        let mut out = Vec::new();
        let mut lookup_ns = Vec::new();
        let fill = rs.len() as u32 - 118;
        let mut x = 0x1234_5678u32;
        let mut routed = 0usize;
        for _ in 0..20 {
            let t0 = Instant::now();
            const K: u32 = 5000;
            for _ in 0..K {
                x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                let dst = mac(1000 + x % fill.max(1));
                table.lookup(Port::Interface(3), mac(3), dst, &mut out);
                routed += out.len();
            }
            lookup_ns.push(t0.elapsed().as_secs_f64() * 1e9 / K as f64);
        }
        // And a broadcast (fan-out to every host link and local guest).
        let t0 = Instant::now();
        for _ in 0..1000 {
            table.lookup(Port::Interface(3), mac(3), Mac::BROADCAST, &mut out);
        }
        let bcast_ns = t0.elapsed().as_secs_f64() * 1e9 / 1000.0;
        let fanout = out.len();
        // The scan the index replaced, for comparison.
        let t0 = Instant::now();
        let scans = 200;
        for _ in 0..scans {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            table.lookup_linear(Port::Interface(3), mac(3), mac(1000 + x % fill.max(1)), &mut out);
        }
        let scan_ns = t0.elapsed().as_secs_f64() * 1e9 / scans as f64;

        let (a0, a1, a2) = mmm(&mut add_us);
        let (d0, d1, d2) = mmm(&mut del_us);
        let (l0, l1, l2) = mmm(&mut lookup_ns);
        assert!(routed > 0);
        println!(
            "{{\"rules\": {}, \"build_s\": {build_s:.4}, \"add_us\": [{a0:.2}, {a1:.2}, {a2:.2}], \"del_us\": [{d0:.2}, {d1:.2}, {d2:.2}], \"miss_ns\": [{l0:.0}, {l1:.0}, {l2:.0}], \"broadcast_ns\": {bcast_ns:.0}, \"broadcast_fanout\": {fanout}, \"linear_scan_ns\": {scan_ns:.0}}}",
            table.len()
        );
    }
}
