//! The route cache: a hash from (origin, destination MAC, source MAC) to the
//! routing decision, in front of the linear rule table.
//!
//! Each dispatcher thread owns its cache, so the hot path takes no lock. A
//! cache belongs to one table generation: when it sees a newer table it
//! starts empty, which keeps it correct across every change without the
//! control plane ever touching (or stalling) the datapath.

use crate::mac::Mac;
use crate::table::{Hit, Port, RouteTable};
use std::collections::HashMap;

/// Bound on entries, so a flood of made-up MACs cannot grow memory without
/// limit; when full the cache starts over (cheap, and rare in real traffic).
pub const DEFAULT_CAPACITY: usize = 16 * 1024;

type Key = (Port, Mac, Mac);

pub struct RouteCache {
    generation: u64,
    capacity: usize,
    map: HashMap<Key, Box<[Hit]>, ahash::RandomState>,
    scratch: Vec<Hit>,
    pub hits: u64,
    pub misses: u64,
}

impl Default for RouteCache {
    fn default() -> Self {
        RouteCache::with_capacity(DEFAULT_CAPACITY)
    }
}

impl RouteCache {
    pub fn with_capacity(capacity: usize) -> RouteCache {
        RouteCache {
            generation: u64::MAX,
            capacity: capacity.max(1),
            map: HashMap::with_capacity_and_hasher(256, ahash::RandomState::new()),
            scratch: Vec::new(),
            hits: 0,
            misses: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The destinations for a frame, from the cache or (on a miss) the table.
    #[inline]
    pub fn route(&mut self, table: &RouteTable, origin: Port, src: Mac, dst: Mac) -> &[Hit] {
        if self.generation != table.generation() {
            self.map.clear();
            self.generation = table.generation();
        }
        let key = (origin, dst, src);
        if self.map.contains_key(&key) {
            self.hits += 1;
        } else {
            self.misses += 1;
            if self.map.len() >= self.capacity {
                self.map.clear();
            }
            table.lookup(origin, src, dst, &mut self.scratch);
            self.map.insert(key, self.scratch.as_slice().into());
        }
        &self.map[&key]
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
