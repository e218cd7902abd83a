//! Times the matcher and the route cache on a large table (100 000 rules by
//! default), single-threaded, with no benchmark framework:
//!
//!     cargo run --release -p vnet-core --example table_timing [rules]
//!
//! Prints the median of several rounds for: building the table, a lookup
//! that misses the cache (a known destination, and one no rule names), a
//! cache hit, and a cache miss (through `RouteCache::route`). A rough probe
//! for reviews, not a benchmark: the numbers move with the machine's load.

use std::hint::black_box;
use std::time::{Duration, Instant};
use vnet_core::table::{Hit, Port, Rule, RouteTable, SrcMatch};
use vnet_core::{Mac, MacQual, RouteCache};

fn mac(i: u32) -> Mac {
    let b = i.to_be_bytes();
    Mac([2, 0, b[0], b[1], b[2], b[3]])
}

/// A table shaped like a large deployment: one exact-destination rule per
/// remote guest MAC (most of it), broadcast fan-out to 64 guests and 64
/// links, per-source default routes, and a few catch-alls.
fn rules(n: u32) -> Vec<Rule> {
    let mut v = Vec::with_capacity(n as usize);
    for i in 0..64 {
        v.push(Rule { src_mac: MacQual::Any, dst_mac: MacQual::Addr(Mac::BROADCAST), src: SrcMatch::Any, dst: Port::Interface(i) });
        v.push(Rule { src_mac: MacQual::Any, dst_mac: MacQual::Addr(Mac::BROADCAST), src: SrcMatch::AnyInterface, dst: Port::Link(i) });
    }
    for i in 0..8 {
        v.push(Rule { src_mac: MacQual::Any, dst_mac: MacQual::Not(mac(i)), src: SrcMatch::AnyLink, dst: Port::Interface(i) });
    }
    let defaults = n / 100;
    for i in 0..defaults {
        v.push(Rule { src_mac: MacQual::Addr(mac(1_000_000 + i)), dst_mac: MacQual::None, src: SrcMatch::AnyInterface, dst: Port::Link(i % 64) });
    }
    let mut i = 0;
    while (v.len() as u32) < n {
        v.push(Rule { src_mac: MacQual::Any, dst_mac: MacQual::Addr(mac(i)), src: SrcMatch::AnyInterface, dst: Port::Link(i % 64) });
        i += 1;
    }
    v.truncate(n as usize);
    v
}

/// Median over `rounds` of the time per iteration of `f`, run `iters` times.
fn time_per(rounds: usize, iters: u32, mut f: impl FnMut(u32)) -> Duration {
    let mut t: Vec<Duration> = (0..rounds)
        .map(|_| {
            let start = Instant::now();
            for i in 0..iters {
                f(i);
            }
            start.elapsed() / iters
        })
        .collect();
    t.sort();
    t[rounds / 2]
}

/// Cache hits over `flows`, all cached, visited in turn. Apart from `main`,
/// so that what the compiler makes of the rest of `main` does not change it.
#[inline(never)]
fn time_hits(cache: &mut RouteCache, table: &RouteTable, flows: &[(Port, Mac, Mac)]) -> Duration {
    time_per(9, 1_000_000, |i| {
        let (o, s, d) = flows[(i % 1000) as usize];
        black_box(cache.route(table, o, s, d));
    })
}

fn main() {
    let n: u32 = std::env::args().nth(1).map(|s| s.parse().expect("rule count")).unwrap_or(100_000);
    let rules = rules(n);
    let from = Port::Interface(0);

    let build = time_per(5, 1, |_| {
        black_box(RouteTable::new(black_box(rules.clone()), 1));
    });
    let clone = time_per(5, 1, |_| {
        black_box(black_box(&rules).clone());
    });
    println!("rules {n}: build {:?} (of which cloning the Vec {:?})", build, clone);

    let table = RouteTable::new(rules.clone(), 1);
    let mut out: Vec<Hit> = Vec::new();
    let last_dst = (0..n).rev().map(mac).find(|m| {
        table.lookup(from, mac(5_000_000), *m, &mut out);
        !out.is_empty() && out[0].rule as usize == rules.len() - 1
    });
    let iters = if n >= 10_000 { 200 } else { 20_000 };
    let known = last_dst.unwrap_or(Mac::BROADCAST);
    let miss_known = time_per(7, iters, |i| {
        table.lookup(from, mac(5_000_000 + i), black_box(known), &mut out);
        black_box(&out);
    });
    let miss_unknown = time_per(7, iters, |i| {
        table.lookup(from, mac(5_000_000 + i), black_box(mac(9_000_000)), &mut out);
        black_box(&out);
    });
    let miss_default = time_per(7, iters, |_| {
        table.lookup(from, black_box(mac(1_000_000)), black_box(mac(9_000_000)), &mut out);
        black_box(&out);
    });
    let broadcast = time_per(7, iters, |i| {
        table.lookup(from, mac(5_000_000 + i), black_box(Mac::BROADCAST), &mut out);
        black_box(&out);
    });
    println!("lookup (table, no cache): known dst {:?}, unknown dst {:?}, default route {:?}, broadcast (127 hits) {:?}",
        miss_known, miss_unknown, miss_default, broadcast);

    // Cache hits: 1 000 flows, all cached, visited in turn.
    let mut cache = RouteCache::default();
    let flows: Vec<(Port, Mac, Mac)> =
        (0..1000u32).map(|i| (Port::Interface(i % 8), mac(5_000_000 + i), mac(i * 7 % n.max(1)))).collect();
    for &(o, s, d) in &flows {
        cache.route(&table, o, s, d);
    }
    let hit = time_hits(&mut cache, &table, &flows);
    // Cache misses: a guest sending from a new source MAC every frame, long
    // enough to reach its bound, so the evictions are in the mean; the 1 000
    // flows of other origins stay cached.
    let mut fresh = 20_000_000;
    let miss = time_per(7, 10_000, |_| {
        fresh += 1;
        black_box(cache.route(&table, Port::Interface(9), mac(fresh), known));
    });
    let hits = cache.hits;
    for &(o, s, d) in &flows {
        cache.route(&table, o, s, d);
    }
    println!(
        "cache: hit {:?}, miss {:?} ({} entries held, {} evicted; the 1000 other flows: {} hits)",
        hit,
        miss,
        cache.len(),
        cache.evictions,
        cache.hits - hits
    );

    // The dearest single call: a full cache (four origins at just under
    // their budget, a fifth flooding), where a call pays for an eviction.
    let mut cache = RouteCache::default();
    let per = vnet_core::cache::DEFAULT_PER_ORIGIN as u32 - 1;
    for o in 0..4 {
        for i in 0..per {
            cache.route(&table, Port::Link(o), mac(30_000_000 + i), known);
        }
    }
    let (mut total, mut evicting) = (Duration::ZERO, Vec::new());
    let calls = 50_000u32;
    for i in 0..calls {
        let before = cache.evictions;
        let t = Instant::now();
        black_box(cache.route(&table, Port::Interface(0), mac(40_000_000 + i), known));
        let d = t.elapsed();
        total += d;
        if cache.evictions != before {
            evicting.push(d);
        }
    }
    evicting.sort();
    println!(
        "full cache ({} entries), one origin flooding: mean {:?} a call; {} calls evicted ({} entries), median {:?} each",
        cache.len(),
        total / calls,
        evicting.len(),
        cache.evictions,
        evicting[evicting.len() / 2]
    );
}
