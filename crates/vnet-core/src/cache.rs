//! The route cache: a hash from (origin, destination MAC, source MAC) to the
//! routing decision, in front of the rule table.
//!
//! Each dispatcher thread owns its cache, so the hot path takes no lock. A
//! cache belongs to one table generation: when it sees a newer table it
//! starts empty, which keeps it correct across every change without the
//! control plane ever touching (or stalling) the datapath.
//!
//! The cache is bounded twice, so that a guest sending from made-up MACs can
//! neither grow memory nor flush the flows of others:
//! - each origin (interface or link) holds at most `per_origin` entries; an
//!   origin that needs one more loses all its entries first, and no one
//!   else's;
//! - the whole cache holds at most `capacity` entries; when it is full, the
//!   origin holding the most entries loses all of them. With the default
//!   budget (a quarter of the capacity) that takes five or more busy origins,
//!   and an origin holding fewer entries than some other origin is never the
//!   one evicted.
//!
//! Evicting is a pass over the map (`retain`) on the miss that needs room; a
//! flooding origin pays it once per `per_origin` misses.
//!
//! The hits of every entry are kept in one array, each entry naming its run,
//! so a miss allocates nothing (past the array's growth) and an eviction frees
//! nothing; a hit is one hash lookup.

use crate::mac::Mac;
use crate::table::{Hit, Port, RouteTable};
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

/// Bound on entries in all, so a flood of made-up MACs cannot grow memory
/// without limit.
pub const DEFAULT_CAPACITY: usize = 16 * 1024;

/// Bound on one origin's entries, by default: a quarter of the capacity.
pub const DEFAULT_PER_ORIGIN: usize = DEFAULT_CAPACITY / 4;

/// (origin, destination MAC, source MAC).
#[derive(Clone, Copy, PartialEq, Eq)]
struct Key(Port, Mac, Mac);

/// Two words of hash input for the 20 bytes of key, rather than the derived
/// six writes (enum tag, id, and a length and bytes per MAC). Equal keys
/// hash equally; that some bits of a port's id share the second word's top
/// with its kind costs only the odd collision.
impl Hash for Key {
    #[inline]
    fn hash<H: Hasher>(&self, h: &mut H) {
        let (kind, id) = match self.0 {
            Port::Interface(i) => (0u64, i as u64),
            Port::Link(i) => (1u64, i as u64),
        };
        let word = |m: Mac| u64::from_le_bytes([m.0[0], m.0[1], m.0[2], m.0[3], m.0[4], m.0[5], 0, 0]);
        h.write_u64(word(self.1) | id << 48);
        h.write_u64(word(self.2) | (id >> 16) << 48 | kind << 63);
    }
}

pub struct RouteCache {
    generation: u64,
    /// Each entry's hits: `hits_of[start..start + len]`.
    map: HashMap<Key, (u32, u32), ahash::RandomState>,
    hits_of: Vec<Hit>,
    /// Where an eviction compacts the survivors' hits (then swapped in).
    spare: Vec<Hit>,
    capacity: usize,
    per_origin: usize,
    /// Entries held per origin; the values sum to the map's length.
    held: HashMap<Port, usize, ahash::RandomState>,
    scratch: Vec<Hit>,
    pub hits: u64,
    pub misses: u64,
    /// Entries dropped to stay within the bounds (not counting the whole
    /// cache dropped for a new table generation).
    pub evictions: u64,
}

impl Default for RouteCache {
    fn default() -> Self {
        RouteCache::with_limits(DEFAULT_CAPACITY, DEFAULT_PER_ORIGIN)
    }
}

impl RouteCache {
    /// A cache of at most `capacity` entries, each origin at most a quarter
    /// of them (at least 1).
    pub fn with_capacity(capacity: usize) -> RouteCache {
        RouteCache::with_limits(capacity, capacity / 4)
    }

    /// A cache of at most `capacity` entries in all and `per_origin` for any
    /// one origin (each at least 1; `per_origin` at most `capacity`).
    pub fn with_limits(capacity: usize, per_origin: usize) -> RouteCache {
        let capacity = capacity.max(1);
        RouteCache {
            generation: u64::MAX,
            map: HashMap::with_capacity_and_hasher(256, ahash::RandomState::new()),
            hits_of: Vec::new(),
            spare: Vec::new(),
            capacity,
            per_origin: per_origin.clamp(1, capacity),
            held: HashMap::default(),
            scratch: Vec::new(),
            hits: 0,
            misses: 0,
            evictions: 0,
        }
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Entries held for frames from `origin`.
    pub fn origin_len(&self, origin: Port) -> usize {
        self.held.get(&origin).copied().unwrap_or(0)
    }

    /// The bound on entries in all.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The bound on one origin's entries.
    pub fn per_origin(&self) -> usize {
        self.per_origin
    }

    /// The destinations for a frame, from the cache or (on a miss) the table.
    /// A hit is one hash lookup and allocates nothing.
    #[inline]
    pub fn route(&mut self, table: &RouteTable, origin: Port, src: Mac, dst: Mac) -> &[Hit] {
        if self.generation != table.generation() {
            self.restart(table.generation());
        }
        let key = Key(origin, dst, src);
        if let Some(&(start, len)) = self.map.get(&key) {
            self.hits += 1;
            return &self.hits_of[start as usize..(start + len) as usize];
        }
        self.miss(table, key)
    }

    #[cold]
    #[inline(never)]
    fn restart(&mut self, generation: u64) {
        self.map.clear();
        self.hits_of.clear();
        self.held.clear();
        self.generation = generation;
    }

    /// Asks the table, making room first if the origin is at its budget or
    /// the cache is full. Out of line, so the hit path stays small.
    #[inline(never)]
    fn miss(&mut self, table: &RouteTable, key: Key) -> &[Hit] {
        self.misses += 1;
        let Key(origin, dst, src) = key;
        if self.origin_len(origin) >= self.per_origin {
            self.evict(origin);
        } else if self.map.len() >= self.capacity {
            // The most entries; among equals, the greatest port, so the
            // choice does not depend on the hasher's order.
            if let Some((&victim, _)) = self.held.iter().max_by_key(|&(p, n)| (*n, *p)) {
                self.evict(victim);
            }
        }
        table.lookup(origin, src, dst, &mut self.scratch);
        if self.hits_of.len() + self.scratch.len() > u32::MAX as usize {
            // Runs are numbered in u32: out of numbers (never with a sane
            // table), start over.
            self.restart(self.generation);
        }
        let start = self.hits_of.len();
        self.hits_of.extend_from_slice(&self.scratch);
        self.map.insert(key, (start as u32, self.scratch.len() as u32));
        *self.held.entry(origin).or_insert(0) += 1;
        &self.hits_of[start..]
    }

    /// Drops every entry of `victim`, and compacts the hits of the rest.
    fn evict(&mut self, victim: Port) {
        let Some(removed) = self.held.remove(&victim) else { return };
        let (old, new) = (&self.hits_of, &mut self.spare);
        new.clear();
        self.map.retain(|k, run| {
            if k.0 == victim {
                return false;
            }
            let (start, len) = (run.0 as usize, run.1 as usize);
            run.0 = new.len() as u32;
            new.extend_from_slice(&old[start..start + len]);
            true
        });
        std::mem::swap(&mut self.hits_of, &mut self.spare);
        self.evictions += removed as u64;
        debug_assert_eq!(self.held.values().sum::<usize>(), self.map.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rule::MacQual;
    use crate::table::{Rule, SrcMatch};

    const A: Mac = Mac([2, 0, 0, 0, 0, 0xa]);
    const B: Mac = Mac([2, 0, 0, 0, 0, 0xb]);

    fn to(dst_mac: MacQual, dst: Port) -> Rule {
        Rule { src_mac: MacQual::Any, dst_mac, src: SrcMatch::Any, dst }
    }

    fn ports(h: &[Hit]) -> Vec<Port> {
        h.iter().map(|h| h.dst).collect()
    }

    #[test]
    fn hits_after_first_lookup() {
        let t = RouteTable::new(vec![to(MacQual::Addr(B), Port::Link(0))], 1);
        let mut c = RouteCache::default();
        assert_eq!(ports(c.route(&t, Port::Interface(0), A, B)), vec![Port::Link(0)]);
        assert_eq!(ports(c.route(&t, Port::Interface(0), A, B)), vec![Port::Link(0)]);
        assert_eq!((c.hits, c.misses), (1, 1));
        // A different origin is a different key (source type and id matter).
        assert!(c.route(&t, Port::Link(0), A, B).is_empty());
        assert_eq!(c.misses, 2);
    }

    #[test]
    fn stays_correct_after_add_and_delete() {
        let mut c = RouteCache::default();
        let t1 = RouteTable::new(vec![to(MacQual::Addr(B), Port::Link(0))], 1);
        assert_eq!(ports(c.route(&t1, Port::Interface(0), A, B)), vec![Port::Link(0)]);
        // Add a more specific rule: the cached answer must not survive.
        let t2 = RouteTable::new(
            vec![
                to(MacQual::Addr(B), Port::Link(0)),
                Rule { src_mac: MacQual::Addr(A), dst_mac: MacQual::Addr(B), src: SrcMatch::Any, dst: Port::Link(1) },
            ],
            2,
        );
        assert_eq!(ports(c.route(&t2, Port::Interface(0), A, B)), vec![Port::Link(1)]);
        // Delete everything: the frame now has no route.
        let t3 = RouteTable::new(vec![], 3);
        assert!(c.route(&t3, Port::Interface(0), A, B).is_empty());
        // And adding the first rule back restores the route.
        let t4 = RouteTable::new(vec![to(MacQual::Addr(B), Port::Link(0))], 4);
        assert_eq!(ports(c.route(&t4, Port::Interface(0), A, B)), vec![Port::Link(0)]);
    }

    fn mac(i: u32) -> Mac {
        let b = i.to_be_bytes();
        Mac([2, 0, b[0], b[1], b[2], b[3]])
    }

    /// Routes `flows` from `origin` once more and says how many were hits.
    fn hits_of(c: &mut RouteCache, t: &RouteTable, origin: Port, flows: &[(Mac, Mac)]) -> u64 {
        let before = c.hits;
        for &(src, dst) in flows {
            assert_eq!(ports(c.route(t, origin, src, dst)), vec![Port::Link(0)]);
        }
        c.hits - before
    }

    /// Review M6: a guest sending from a new source MAC in every frame
    /// evicts only its own entries; another origin's flows stay cached.
    #[test]
    fn a_flooding_origin_does_not_evict_another_origins_entries() {
        let t = RouteTable::new(vec![to(MacQual::Any, Port::Link(0))], 1);
        let mut c = RouteCache::with_capacity(100);
        assert_eq!((c.capacity(), c.per_origin()), (100, 25));
        let quiet = Port::Interface(1);
        let flows: Vec<(Mac, Mac)> = (0..20).map(|i| (A, mac(i))).collect();
        assert_eq!(hits_of(&mut c, &t, quiet, &flows), 0);
        let flooder = Port::Interface(0);
        for i in 0..10_000 {
            c.route(&t, flooder, mac(1_000_000 + i), B);
            assert!(c.origin_len(flooder) <= 25, "{}", c.origin_len(flooder));
            assert!(c.len() <= 100);
        }
        assert!(c.evictions >= 10_000 - 25);
        assert_eq!(c.origin_len(quiet), 20);
        assert_eq!(hits_of(&mut c, &t, quiet, &flows), 20, "every quiet flow is still cached");
        // The same from a link, and with the default limits.
        let mut c = RouteCache::default();
        assert_eq!((c.capacity(), c.per_origin()), (DEFAULT_CAPACITY, DEFAULT_PER_ORIGIN));
        hits_of(&mut c, &t, Port::Link(3), &flows);
        for i in 0..100_000 {
            c.route(&t, flooder, mac(1_000_000 + i), B);
        }
        assert_eq!(c.origin_len(flooder), (100_000 - 1) % DEFAULT_PER_ORIGIN + 1);
        assert_eq!(hits_of(&mut c, &t, Port::Link(3), &flows), 20);
    }

    /// With more busy origins than the capacity holds at their budget, the
    /// cache stays within its bound by evicting the origin holding the most,
    /// never an origin holding fewer than the others.
    #[test]
    fn many_flooding_origins_stay_within_the_bound_and_spare_the_small() {
        let t = RouteTable::new(vec![to(MacQual::Any, Port::Link(0))], 1);
        let mut c = RouteCache::with_capacity(100);
        let quiet = Port::Link(7);
        let flows: Vec<(Mac, Mac)> = (0..5).map(|i| (mac(i), B)).collect();
        hits_of(&mut c, &t, quiet, &flows);
        let mut full = 0;
        for i in 0..20_000u32 {
            let flooder = Port::Interface(i % 8);
            c.route(&t, flooder, mac(1_000_000 + i), B);
            assert!(c.len() <= 100, "{} entries", c.len());
            assert!(c.origin_len(flooder) <= 25);
            full += (c.len() == 100) as u32;
            if i % 1000 == 999 {
                assert_eq!(hits_of(&mut c, &t, quiet, &flows), 5);
            }
        }
        assert!(full > 100, "the total bound was reached ({full} times)");
        // Many origins of one entry each: the total bound holds too.
        for i in 0..1000 {
            c.route(&t, Port::Interface(100 + i), A, B);
            assert!(c.len() <= 100);
        }
    }

    /// A new table generation drops every origin's entries and counts.
    #[test]
    fn a_new_generation_invalidates_every_entry() {
        let t1 = RouteTable::new(vec![to(MacQual::Any, Port::Link(0))], 1);
        let mut c = RouteCache::with_capacity(100);
        for i in 0..30 {
            c.route(&t1, Port::Interface(i % 3), mac(i), B);
        }
        assert_eq!((c.len(), c.origin_len(Port::Interface(0))), (30, 10));
        let t2 = RouteTable::new(vec![to(MacQual::Any, Port::Link(1))], 2);
        assert_eq!(ports(c.route(&t2, Port::Interface(0), mac(0), B)), vec![Port::Link(1)]);
        assert_eq!((c.len(), c.origin_len(Port::Interface(0)), c.origin_len(Port::Interface(1))), (1, 1, 0));
        assert_eq!(c.hits_of.len(), 1, "the old generation's hits are gone too");
        // Also when an origin was at its budget.
        for i in 0..24 {
            c.route(&t2, Port::Interface(0), mac(100 + i), B);
        }
        assert_eq!(c.origin_len(Port::Interface(0)), 25);
        let t3 = RouteTable::new(vec![], 3);
        assert!(c.route(&t3, Port::Interface(0), mac(100), B).is_empty());
        assert!(c.route(&t3, Port::Interface(0), mac(101), B).is_empty());
        assert_eq!((c.len(), c.evictions), (2, 0), "nothing left over from the old generation");
        // The same rules under a new generation are a new table too.
        let t4 = RouteTable::new(vec![], 4);
        let misses = c.misses;
        c.route(&t4, Port::Interface(0), mac(100), B);
        assert_eq!(c.misses, misses + 1);
    }

    /// Keys that differ only where the hash folds bits together (an id's
    /// high bits, the kind) are still different keys.
    #[test]
    fn keys_differ_in_every_part() {
        let t = RouteTable::new(
            vec![
                Rule { src_mac: MacQual::Any, dst_mac: MacQual::Any, src: SrcMatch::Exactly(Port::Link(1 << 31)), dst: Port::Link(1) },
                Rule { src_mac: MacQual::Any, dst_mac: MacQual::Any, src: SrcMatch::AnyInterface, dst: Port::Link(2) },
            ],
            1,
        );
        let mut c = RouteCache::default();
        let from = [Port::Interface(0), Port::Link(0), Port::Link(1 << 31), Port::Interface(1 << 31), Port::Link(1 << 16)];
        let want = [vec![Port::Link(2)], vec![], vec![Port::Link(1)], vec![Port::Link(2)], vec![]];
        for round in 0..2 {
            for (o, w) in from.iter().zip(&want) {
                assert_eq!(&ports(c.route(&t, *o, A, B)), w, "{o:?}, round {round}");
            }
        }
        assert_eq!((c.misses, c.hits, c.len()), (5, 5, 5));
        assert!(c.route(&t, Port::Interface(0), B, A) == [Hit { dst: Port::Link(2), rule: 1 }]);
        assert_eq!(c.len(), 6, "the MACs swapped are another key");
    }

    /// Every answer is the table's, through evictions of other origins and
    /// of the asking one, when entries differ in their hits (one, several
    /// or none).
    #[test]
    fn answers_stay_right_through_evictions() {
        let mut rules: Vec<Rule> = (0..200).map(|i| to(MacQual::Addr(mac(i)), Port::Link(i % 7))).collect();
        rules.extend((0..5).map(|i| to(MacQual::Addr(Mac::BROADCAST), Port::Interface(i))));
        let t = RouteTable::new(rules, 1);
        let mut c = RouteCache::with_capacity(40);
        let mut want = Vec::new();
        let mut x = 1u32;
        for n in 0..20_000 {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            let origin = Port::Interface((x >> 8) % 6);
            let dst = match (x >> 12) % 10 {
                0 => Mac::BROADCAST,
                1 => mac(1000), // no route
                _ => mac((x >> 16) % 20),
            };
            let src = mac((x >> 24) % 2);
            t.lookup(origin, src, dst, &mut want);
            assert_eq!(c.route(&t, origin, src, dst), &want[..], "frame {n}: from {origin:?} {src} -> {dst}");
        }
        assert!(c.evictions > 1000 && c.hits > 1000, "{} evicted, {} hits", c.evictions, c.hits);
    }

    #[test]
    fn bounded_under_a_flood_of_macs() {
        let t = RouteTable::new(vec![to(MacQual::Any, Port::Link(0))], 1);
        let mut c = RouteCache::with_capacity(100);
        for i in 0..10_000u32 {
            let b = i.to_be_bytes();
            let src = Mac([2, 0, b[0], b[1], b[2], b[3]]);
            assert_eq!(ports(c.route(&t, Port::Interface(0), src, B)), vec![Port::Link(0)]);
            assert!(c.len() <= 100);
        }
    }
}
