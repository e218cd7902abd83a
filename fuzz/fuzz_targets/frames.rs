//! Rule tables built from the fuzz input, and frames from any origin routed
//! through them, directly and through a small route cache, while the table
//! changes under the cache.
//!
//! Checked for every lookup:
//! - `RouteTable::lookup` gives exactly what a plain reference matcher gives,
//!   written here from docs/control-language.md ("How a frame is routed"),
//!   not from table.rs: the same destinations, each credited to the first
//!   top-priority rule that chose it;
//! - never back to the origin (split horizon), each destination once;
//! - `RouteCache::route` answers as a fresh lookup on the current table,
//!   through generation changes (rules added, deleted, replaced, or the same
//!   rules under a new generation) and evictions (capacity 1..=8, a
//!   per-origin budget 1..=capacity, against about 150 keys), and never holds
//!   more than its capacity, nor more than the budget for any origin;
//! - an origin loses cached entries only when it is at its budget, or when
//!   the cache is full and it holds the most; then it loses all of them, and
//!   a new generation empties the cache.
//!
//! Input: a byte stream read with `arbitrary::Unstructured`: the cache
//! capacity and per-origin budget, the first table, then operations until
//! the input runs out.
#![no_main]
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use vnet_core::mac::frame_macs;
use vnet_core::table::{Hit, Port, Rule, RouteTable, SrcMatch};
use vnet_core::{Mac, MacQual, RouteCache};

/// A small pool, so rules and frames name the same addresses often.
const MACS: [Mac; 4] = [
    Mac([2, 0, 0, 0, 0, 1]),
    Mac([2, 0, 0, 0, 0, 2]),
    Mac([2, 0, 0, 0, 0, 3]),
    Mac::BROADCAST,
];
/// Likewise for ports: three interfaces, three links.
const PORTS: [Port; 6] = [
    Port::Interface(0),
    Port::Interface(1),
    Port::Interface(2),
    Port::Link(0),
    Port::Link(1),
    Port::Link(2),
];
const MAX_RULES: usize = 16;

fn mac(u: &mut Unstructured) -> Result<Mac> {
    Ok(*u.choose(&MACS)?)
}

fn port(u: &mut Unstructured) -> Result<Port> {
    Ok(*u.choose(&PORTS)?)
}

fn qual(u: &mut Unstructured) -> Result<MacQual> {
    Ok(match u.int_in_range(0..=3u8)? {
        0 => MacQual::Addr(mac(u)?),
        1 => MacQual::Any,
        2 => MacQual::None,
        _ => MacQual::Not(mac(u)?),
    })
}

fn rule(u: &mut Unstructured) -> Result<Rule> {
    let src_mac = qual(u)?;
    let dst_mac = qual(u)?;
    let src = match u.int_in_range(0..=3u8)? {
        0 => SrcMatch::Any,
        1 => SrcMatch::AnyInterface,
        2 => SrcMatch::AnyLink,
        _ => SrcMatch::Exactly(port(u)?),
    };
    Ok(Rule { src_mac, dst_mac, src, dst: port(u)? })
}

fn rules(u: &mut Unstructured) -> Result<Vec<Rule>> {
    let n = u.int_in_range(0..=MAX_RULES)?;
    (0..n).map(|_| rule(u)).collect()
}

// ---- The reference matcher, from docs/control-language.md ----

/// How one side of a rule matches a MAC: 0 DIRECT, 1 ANY, 2 NOT; `None`:
/// not at all (including `none`, which only the default-route case uses).
fn side(q: MacQual, m: Mac) -> Option<usize> {
    match q {
        MacQual::Addr(x) => (x == m).then_some(0),
        MacQual::Any => Some(1),
        MacQual::Not(x) => (x != m).then_some(2),
        MacQual::None => None,
    }
}

/// The docs' table as printed: rows src, columns dst, each DIRECT, ANY, NOT.
const PRIORITY: [[u8; 3]; 3] = [
    [8, 8, 7], // src DIRECT
    [6, 6, 5], // src ANY
    [7, 5, 3], // src NOT
];

fn ref_priority(r: &Rule, src: Mac, dst: Mac) -> Option<u8> {
    if r.dst_mac == MacQual::None {
        // The default route of an exact source MAC; anything else never matches.
        return (r.src_mac == MacQual::Addr(src)).then_some(4);
    }
    Some(PRIORITY[side(r.src_mac, src)?][side(r.dst_mac, dst)?])
}

fn ref_accepts(s: SrcMatch, origin: Port) -> bool {
    match (s, origin) {
        (SrcMatch::Any, _) => true,
        (SrcMatch::AnyInterface, Port::Interface(_)) => true,
        (SrcMatch::AnyLink, Port::Link(_)) => true,
        (SrcMatch::Exactly(p), o) => p == o,
        _ => false,
    }
}

/// Every destination among the rules at the highest priority, once, never
/// the origin (rules leading back are not candidates at all, so the
/// next-best rules are used), each credited to the first rule that chose it.
/// Sorted by destination.
fn reference(rules: &[Rule], origin: Port, src: Mac, dst: Mac) -> Vec<(Port, u32)> {
    let candidates: Vec<(usize, u8)> = rules
        .iter()
        .enumerate()
        .filter(|(_, r)| r.dst != origin && ref_accepts(r.src, origin))
        .filter_map(|(i, r)| Some((i, ref_priority(r, src, dst)?)))
        .collect();
    let Some(top) = candidates.iter().map(|&(_, p)| p).max() else { return Vec::new() };
    let mut out: Vec<(Port, u32)> = Vec::new();
    for &(i, p) in &candidates {
        if p == top && !out.iter().any(|&(d, _)| d == rules[i].dst) {
            out.push((rules[i].dst, i as u32));
        }
    }
    out.sort();
    out
}

fn sorted(h: &[Hit]) -> Vec<(Port, u32)> {
    let mut v: Vec<(Port, u32)> = h.iter().map(|h| (h.dst, h.rule)).collect();
    v.sort();
    v
}

struct State {
    rules: Vec<Rule>,
    table: RouteTable,
    generation: u64,
    cache: RouteCache,
    capacity: usize,
    per_origin: usize,
    /// The generation of the table the cache last saw.
    cache_generation: u64,
    direct: Vec<Hit>,
}

impl State {
    fn set(&mut self, rules: Vec<Rule>) {
        self.generation += 1;
        self.table = RouteTable::new(rules.clone(), self.generation);
        self.rules = rules;
    }

    fn check(&mut self, origin: Port, src: Mac, dst: Mac) {
        self.table.lookup(origin, src, dst, &mut self.direct);
        let want = reference(&self.rules, origin, src, dst);
        assert_eq!(sorted(&self.direct), want, "lookup vs reference: from {origin:?} {src} -> {dst}, rules {:?}", self.rules);
        for (i, h) in self.direct.iter().enumerate() {
            assert_ne!(h.dst, origin, "split horizon");
            assert!(self.direct[..i].iter().all(|x| x.dst != h.dst), "duplicate destination");
        }
        let before: [usize; 6] = PORTS.map(|p| self.cache.origin_len(p));
        let len_before = self.cache.len();
        let cached = self.cache.route(&self.table, origin, src, dst);
        assert_eq!(cached, &self.direct[..], "cache vs table (generation {}): from {origin:?} {src} -> {dst}", self.generation);
        let c = &self.cache;
        assert!(c.len() <= self.capacity, "cache holds {} > {}", c.len(), self.capacity);
        let after: [usize; 6] = PORTS.map(|p| c.origin_len(p));
        assert_eq!(after.iter().sum::<usize>(), c.len(), "per-origin counts vs len");
        for (i, &p) in PORTS.iter().enumerate() {
            assert!(after[i] <= self.per_origin, "{p:?} holds {} > {}", after[i], self.per_origin);
            if self.cache_generation != self.generation {
                assert!(after[i] <= (p == origin) as usize, "a new generation starts empty");
                continue;
            }
            if after[i] < before[i] {
                assert_eq!(after[i], (p == origin) as usize, "{p:?} lost some entries, not all");
                let largest = before.iter().max() == Some(&before[i]);
                assert!(
                    before[i] >= self.per_origin || (len_before >= self.capacity && largest),
                    "{p:?} held {} (budget {}), of {len_before} (capacity {}), counts {before:?}: evicted for another",
                    before[i],
                    self.per_origin,
                    self.capacity
                );
            }
        }
        self.cache_generation = self.generation;
    }
}

fn run(u: &mut Unstructured) -> Result<()> {
    let capacity = u.int_in_range(1..=8usize)?;
    let per_origin = u.int_in_range(1..=capacity)?;
    let first = rules(u)?;
    let mut s = State {
        table: RouteTable::new(first.clone(), 1),
        rules: first,
        generation: 1,
        cache: RouteCache::with_limits(capacity, per_origin),
        capacity,
        per_origin,
        cache_generation: 0,
        direct: Vec::new(),
    };
    while !u.is_empty() {
        match u.int_in_range(0..=15u8)? {
            // Table changes: each a new generation.
            0 if s.rules.len() < MAX_RULES => {
                let mut r = s.rules.clone();
                let at = u.int_in_range(0..=r.len())?;
                r.insert(at, rule(u)?);
                s.set(r);
            }
            1 if !s.rules.is_empty() => {
                let mut r = s.rules.clone();
                r.remove(u.choose_index(r.len())?);
                s.set(r);
            }
            2 => {
                let r = rules(u)?;
                s.set(r);
            }
            3 => s.set(s.rules.clone()),
            // Any 14 bytes as a frame: MACs outside the pool too.
            4 => {
                let origin = port(u)?;
                let frame: [u8; 14] = u.arbitrary()?;
                let (dst, src) = frame_macs(&frame).expect("14 bytes hold the MACs");
                s.check(origin, src, dst);
            }
            // A sweep over more keys than the cache holds.
            5 => {
                let k0 = u.arbitrary::<u8>()? as usize;
                for k in k0..k0 + 2 * s.capacity + 1 {
                    let origin = PORTS[k % 6];
                    let src = MACS[(k / 6) % 4];
                    let dst = MACS[(k / 24) % 4];
                    s.check(origin, src, dst);
                }
            }
            _ => {
                let origin = port(u)?;
                let src = mac(u)?;
                let dst = mac(u)?;
                s.check(origin, src, dst);
            }
        }
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});
