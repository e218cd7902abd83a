//! The rule table and the matcher: VNET/P's priority rules, fan-out and split
//! horizon, over rules whose endpoints are already resolved to ports.

use crate::mac::Mac;
use crate::rule::MacQual;
use imbl::shared_ptr::DefaultSharedPtr;
use imbl::{GenericHashMap, OrdMap};
use std::fmt;
use std::hash::Hash;
use std::sync::Arc;

/// A local endpoint of the datapath: an interface (virtual NIC) or a link
/// (edge), by its id: given when it is added, never changed or reused.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
pub enum Port {
    Interface(u32),
    Link(u32),
}

/// Which origins a rule accepts, resolved.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum SrcMatch {
    Any,
    AnyInterface,
    AnyLink,
    Exactly(Port),
}

impl SrcMatch {
    #[inline]
    fn accepts(self, origin: Port) -> bool {
        match self {
            SrcMatch::Any => true,
            SrcMatch::AnyInterface => matches!(origin, Port::Interface(_)),
            SrcMatch::AnyLink => matches!(origin, Port::Link(_)),
            SrcMatch::Exactly(p) => p == origin,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Rule {
    pub src_mac: MacQual,
    pub dst_mac: MacQual,
    pub src: SrcMatch,
    pub dst: Port,
}

/// How one side of a rule matched a MAC.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Class {
    Direct,
    Any,
    Not,
}

#[inline]
fn classify(q: MacQual, mac: Mac) -> Option<Class> {
    match q {
        MacQual::Addr(a) if a == mac => Some(Class::Direct),
        MacQual::Any => Some(Class::Any),
        MacQual::Not(a) if a != mac => Some(Class::Not),
        _ => None,
    }
}

/// Priority of a default route (`src-MAC none`): below every rule that names
/// the destination in any way except NOT/NOT.
pub const DEFAULT_ROUTE_PRIORITY: u8 = 4;

/// The priority with which a rule's MAC qualifiers match a frame, or `None`
/// when they do not match. The table is VNET/P's [src class][dst class].
#[inline]
pub fn priority(src_q: MacQual, dst_q: MacQual, src: Mac, dst: Mac) -> Option<u8> {
    if dst_q == MacQual::None {
        return (src_q == MacQual::Addr(src)).then_some(DEFAULT_ROUTE_PRIORITY);
    }
    let s = classify(src_q, src)?;
    let d = classify(dst_q, dst)?;
    Some(match (s, d) {
        (Class::Direct, Class::Direct) | (Class::Direct, Class::Any) => 8,
        (Class::Direct, Class::Not) | (Class::Not, Class::Direct) => 7,
        (Class::Any, Class::Direct) | (Class::Any, Class::Any) => 6,
        (Class::Any, Class::Not) | (Class::Not, Class::Any) => 5,
        (Class::Not, Class::Not) => 3,
    })
}

/// One destination of a routed frame, and the rule (by its id) that sent it
/// there.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Hit {
    pub dst: Port,
    pub rule: u32,
}

/// A rule in an index bucket: its id, which is its place in table order,
/// and the rule.
type Entry = (u32, Rule);

/// The rules of one index key, in ascending id. Shared between the tables
/// of successive generations until a change touches this key.
type Bucket = Arc<Vec<Entry>>;

type Buckets<K> = GenericHashMap<K, Bucket, ahash::RandomState, DefaultSharedPtr>;

/// The rule table: rules by id (ascending ids are table order, which
/// decides which rule a destination is credited to), indexed by the MACs
/// they name so that a lookup visits only the rules that can match the
/// frame, as OVS's classifier indexes its flows:
///
/// - src exact, dst exact: by (src, dst);
/// - src `any` or `not-X`, dst exact: by dst;
/// - src exact, dst `any`, `not-X` or `none`: by src;
/// - src and dst each `any` or `not-X`: the wildcard rules, which every
///   lookup visits.
///
/// Rules that can never match (`none` as source; `none` as destination
/// without an exact source) are kept but indexed nowhere.
///
/// The table is persistent: cloning it is O(1) and shares everything, and
/// a change copies only the path to what it touches (the hash trie's nodes
/// and the one bucket), so a table of any size changes in microseconds and
/// the dispatchers keep reading the old one meanwhile. A new generation
/// tells route caches to start afresh.
#[derive(Clone, Default)]
pub struct RouteTable {
    generation: u64,
    rules: OrdMap<u32, Rule>,
    pair: Buckets<(Mac, Mac)>,
    dst: Buckets<Mac>,
    src: Buckets<Mac>,
    wild: Bucket,
}

impl fmt::Debug for RouteTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RouteTable {{ generation: {}, rules: {}, pair keys: {}, dst keys: {}, src keys: {}, wild: {} }}",
            self.generation,
            self.rules.len(),
            self.pair.len(),
            self.dst.len(),
            self.src.len(),
            self.wild.len()
        )
    }
}

/// Where a rule is indexed.
enum Key {
    Pair(Mac, Mac),
    Dst(Mac),
    Src(Mac),
    Wild,
    Never,
}

fn key_of(r: &Rule) -> Key {
    let wildcard = |q: MacQual| matches!(q, MacQual::Any | MacQual::Not(_));
    match (r.src_mac, r.dst_mac) {
        (MacQual::Addr(s), MacQual::Addr(d)) => Key::Pair(s, d),
        (s, MacQual::Addr(d)) if wildcard(s) => Key::Dst(d),
        (MacQual::Addr(s), _) => Key::Src(s),
        (s, d) if wildcard(s) && wildcard(d) => Key::Wild,
        _ => Key::Never,
    }
}

/// Puts `e` into the bucket at its place by id, copying the bucket first
/// if an older table still shares it.
fn bucket_insert(b: &mut Bucket, e: Entry) {
    let v = Arc::make_mut(b);
    match v.last() {
        Some(last) if last.0 >= e.0 => {
            let at = v.partition_point(|x| x.0 < e.0);
            v.insert(at, e);
        }
        _ => v.push(e),
    }
}

fn bucket_remove(b: &mut Bucket, id: u32) {
    if let Ok(at) = b.binary_search_by_key(&id, |x| x.0) {
        Arc::make_mut(b).remove(at);
    }
}

fn buckets_insert<K: Hash + Eq + Clone>(m: &mut Buckets<K>, k: K, e: Entry) {
    match m.get_mut(&k) {
        Some(b) => bucket_insert(b, e),
        None => {
            m.insert(k, Arc::new(vec![e]));
        }
    }
}

fn buckets_remove<K: Hash + Eq + Clone>(m: &mut Buckets<K>, k: K, id: u32) {
    if let Some(b) = m.get_mut(&k) {
        bucket_remove(b, id);
        if b.is_empty() {
            m.remove(&k);
        }
    }
}

#[inline]
fn bucket_get<'a, K: Hash + Eq + Clone>(m: &'a Buckets<K>, k: &K) -> &'a [Entry] {
    if m.is_empty() {
        return &[];
    }
    m.get(k).map_or(&[], |b| &b[..])
}

/// Up to this many hits, a destination already among them is found by a
/// scan before each push; past it (a broadcast to many ports), hits are
/// pushed as they come and deduplicated once by sorting, so a wide fan-out
/// costs n log n, not n squared.
const LINEAR_DEDUP: usize = 16;

impl RouteTable {
    /// A table of `rules` with ids 0, 1, 2... in their order.
    pub fn new(rules: Vec<Rule>, generation: u64) -> RouteTable {
        let mut t = RouteTable { generation, ..RouteTable::default() };
        for (i, r) in rules.into_iter().enumerate() {
            t.insert(i as u32, r);
        }
        t
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Marks the table as a new generation (route caches start afresh).
    pub fn set_generation(&mut self, generation: u64) {
        self.generation = generation;
    }

    pub fn len(&self) -> usize {
        self.rules.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// The rules with their ids, in table order.
    pub fn rules(&self) -> impl Iterator<Item = (u32, &Rule)> + '_ {
        self.rules.iter().map(|(&id, r)| (id, r))
    }

    pub fn get(&self, id: u32) -> Option<&Rule> {
        self.rules.get(&id)
    }

    /// Adds rule `id`, in table order by its id (replacing a rule of that
    /// id). Costs O(log n) plus the size of the one bucket it joins.
    pub fn insert(&mut self, id: u32, rule: Rule) {
        self.remove(id);
        self.rules.insert(id, rule);
        let e = (id, rule);
        match key_of(&rule) {
            Key::Pair(s, d) => buckets_insert(&mut self.pair, (s, d), e),
            Key::Dst(d) => buckets_insert(&mut self.dst, d, e),
            Key::Src(s) => buckets_insert(&mut self.src, s, e),
            Key::Wild => bucket_insert(&mut self.wild, e),
            Key::Never => {}
        }
    }

    /// Removes rule `id`; returns it if it was there.
    pub fn remove(&mut self, id: u32) -> Option<Rule> {
        let rule = self.rules.remove(&id)?;
        match key_of(&rule) {
            Key::Pair(s, d) => buckets_remove(&mut self.pair, (s, d), id),
            Key::Dst(d) => buckets_remove(&mut self.dst, d, id),
            Key::Src(s) => buckets_remove(&mut self.src, s, id),
            Key::Wild => bucket_remove(&mut self.wild, id),
            Key::Never => {}
        }
        Some(rule)
    }

    /// The rules that can match a frame from `src` to `dst`, as up to four
    /// ascending runs with no rule in two runs.
    #[inline]
    fn runs(&self, src: Mac, dst: Mac) -> [&[Entry]; 4] {
        [bucket_get(&self.pair, &(src, dst)), bucket_get(&self.dst, &dst), bucket_get(&self.src, &src), &self.wild]
    }

    /// How many rules a lookup of a frame from `src` to `dst` visits (the
    /// rules that can match it by MAC, before origin and split horizon).
    pub fn candidates(&self, src: Mac, dst: Mac) -> usize {
        self.runs(src, dst).iter().map(|run| run.len()).sum()
    }

    /// Routes a frame from `origin`: every rule at the highest matching
    /// priority contributes its destination (fan-out), each destination once,
    /// and never the origin itself (split horizon). `out` is cleared first.
    ///
    /// Each destination is credited to the first rule (in table order) at
    /// that priority that chose it; `out` lists them in that order.
    pub fn lookup(&self, origin: Port, src: Mac, dst: Mac, out: &mut Vec<Hit>) {
        out.clear();
        let mut best = 0u8;
        // The candidate runs, merged into table order, so that ties are
        // credited exactly as a scan of every rule would credit them.
        let mut runs = self.runs(src, dst);
        loop {
            let mut next: Option<(usize, u32)> = None;
            for (k, run) in runs.iter().enumerate() {
                if let Some(&(i, _)) = run.first() {
                    if next.is_none_or(|(_, j)| i < j) {
                        next = Some((k, i));
                    }
                }
            }
            let Some((k, _)) = next else { break };
            let (id, r) = runs[k][0];
            runs[k] = &runs[k][1..];
            visit(id, &r, origin, src, dst, &mut best, out);
        }
        if out.len() > LINEAR_DEDUP {
            // A wide fan-out, pushed unchecked past the first few: keep each
            // destination's first rule, in table order, as the check would.
            out.sort_unstable_by_key(|h| (h.dst, h.rule));
            out.dedup_by_key(|h| h.dst);
            out.sort_unstable_by_key(|h| h.rule);
        }
    }

    /// The matcher as it was before the index: every rule, in order. The
    /// reference the indexed lookup is tested against.
    #[doc(hidden)]
    pub fn lookup_linear(&self, origin: Port, src: Mac, dst: Mac, out: &mut Vec<Hit>) {
        out.clear();
        let mut best = 0u8;
        for (&id, r) in self.rules.iter() {
            if r.dst == origin || !r.src.accepts(origin) {
                continue;
            }
            let Some(p) = priority(r.src_mac, r.dst_mac, src, dst) else { continue };
            if p > best {
                best = p;
                out.clear();
            }
            if p == best && !out.iter().any(|h| h.dst == r.dst) {
                out.push(Hit { dst: r.dst, rule: id });
            }
        }
    }
}

#[inline]
fn visit(id: u32, r: &Rule, origin: Port, src: Mac, dst: Mac, best: &mut u8, out: &mut Vec<Hit>) {
    if r.dst == origin || !r.src.accepts(origin) {
        return;
    }
    let Some(p) = priority(r.src_mac, r.dst_mac, src, dst) else { return };
    if p > *best {
        *best = p;
        out.clear();
    }
    if p == *best && (out.len() >= LINEAR_DEDUP || !out.iter().any(|h| h.dst == r.dst)) {
        out.push(Hit { dst: r.dst, rule: id });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Mac = Mac([2, 0, 0, 0, 0, 0xa]);
    const B: Mac = Mac([2, 0, 0, 0, 0, 0xb]);
    const C: Mac = Mac([2, 0, 0, 0, 0, 0xc]);

    fn all_quals() -> Vec<(MacQual, &'static str)> {
        vec![
            (MacQual::Addr(A), "A"),
            (MacQual::Addr(B), "B"),
            (MacQual::Any, "any"),
            (MacQual::None, "none"),
            (MacQual::Not(A), "not-A"),
            (MacQual::Not(B), "not-B"),
        ]
    }

    /// Every pair of qualifiers, against a frame from A to B, gives exactly
    /// the priority VNET/P's table gives. The expected values are typed by
    /// hand from the papers' table (DIRECT/DIRECT 8, DIRECT/ANY 8, DIRECT/NOT
    /// 7, NOT/DIRECT 7, ANY/DIRECT 6, ANY/ANY 6, ANY/NOT 5, NOT/ANY 5, NOT/NOT
    /// 3; dst `none` with the exact src: the default route, 4), not computed.
    #[test]
    fn every_qualifier_pair_has_the_papers_priority() {
        const X: Option<u8> = None;
        // rows: src qualifier; columns: dst qualifier; both in all_quals()'s
        // order: A, B, any, none, not-A, not-B. The frame is A -> B.
        #[rustfmt::skip]
        let want: [[Option<u8>; 6]; 6] = [
            /* A     */ [X, Some(8), Some(8), Some(4), Some(7), X],
            /* B     */ [X, X,       X,       X,       X,       X],
            /* any   */ [X, Some(6), Some(6), X,       Some(5), X],
            /* none  */ [X, X,       X,       X,       X,       X],
            /* not-A */ [X, X,       X,       X,       X,       X],
            /* not-B */ [X, Some(7), Some(5), X,       Some(3), X],
        ];
        for (i, (sq, sn)) in all_quals().into_iter().enumerate() {
            for (j, (dq, dn)) in all_quals().into_iter().enumerate() {
                assert_eq!(priority(sq, dq, A, B), want[i][j], "src {sn} dst {dn}");
            }
        }
    }

    fn rule(src_mac: MacQual, dst_mac: MacQual, src: SrcMatch, dst: Port) -> Rule {
        Rule { src_mac, dst_mac, src, dst }
    }

    fn dsts(t: &RouteTable, origin: Port, src: Mac, dst: Mac) -> Vec<Port> {
        let mut out = Vec::new();
        t.lookup(origin, src, dst, &mut out);
        let mut v: Vec<Port> = out.iter().map(|h| h.dst).collect();
        v.sort();
        v
    }

    /// Review M2: a per-source default route (4) loses to every catch-all
    /// at 5 or 6 and beats only NOT/NOT (3).
    #[test]
    fn default_routes_rank_between_not_not_and_the_catch_alls() {
        let default = rule(MacQual::Addr(A), MacQual::None, SrcMatch::Any, Port::Link(1));
        let not_not = rule(MacQual::Not(B), MacQual::Not(C), SrcMatch::Any, Port::Link(3));
        let any_not = rule(MacQual::Any, MacQual::Not(C), SrcMatch::Any, Port::Link(5));
        let any_any = rule(MacQual::Any, MacQual::Any, SrcMatch::Any, Port::Link(6));
        let from = Port::Interface(0);
        let t = |rules: Vec<Rule>| RouteTable::new(rules, 1);
        assert_eq!(dsts(&t(vec![not_not, default]), from, A, B), vec![Port::Link(1)]);
        assert_eq!(dsts(&t(vec![default, any_not]), from, A, B), vec![Port::Link(5)]);
        assert_eq!(dsts(&t(vec![default, any_any]), from, A, B), vec![Port::Link(6)]);
        // The default route is A's only: C's frames take NOT/NOT.
        assert_eq!(dsts(&t(vec![default, not_not]), from, C, B), vec![Port::Link(3)]);
        assert_eq!(dsts(&t(vec![default, not_not]), from, A, C), vec![Port::Link(1)]);
    }

    /// Review M2: a frame whose source and destination MAC are the same.
    #[test]
    fn a_frame_to_its_own_source_mac() {
        let t = RouteTable::new(
            vec![
                rule(MacQual::Addr(A), MacQual::Addr(A), SrcMatch::Any, Port::Link(1)),
                rule(MacQual::Any, MacQual::Not(A), SrcMatch::Any, Port::Link(2)),
                rule(MacQual::Not(A), MacQual::Any, SrcMatch::Any, Port::Link(3)),
            ],
            1,
        );
        assert_eq!(dsts(&t, Port::Interface(0), A, A), vec![Port::Link(1)]);
        // B -> B: ANY/NOT and NOT/ANY, both 5: both get it.
        assert_eq!(dsts(&t, Port::Interface(0), B, B), vec![Port::Link(2), Port::Link(3)]);
    }

    #[test]
    fn highest_priority_wins() {
        let t = RouteTable::new(
            vec![
                rule(MacQual::Any, MacQual::Any, SrcMatch::Any, Port::Link(1)),       // 6
                rule(MacQual::Addr(A), MacQual::Addr(B), SrcMatch::Any, Port::Link(2)), // 8
                rule(MacQual::Not(C), MacQual::Not(C), SrcMatch::Any, Port::Link(3)),  // 3
            ],
            1,
        );
        assert_eq!(dsts(&t, Port::Interface(0), A, B), vec![Port::Link(2)]);
        assert_eq!(dsts(&t, Port::Interface(0), C, B), vec![Port::Link(1)]);
    }

    #[test]
    fn fan_out_to_every_rule_at_top_priority_once_each() {
        let t = RouteTable::new(
            vec![
                rule(MacQual::Any, MacQual::Addr(Mac::BROADCAST), SrcMatch::Any, Port::Interface(0)),
                rule(MacQual::Any, MacQual::Addr(Mac::BROADCAST), SrcMatch::Any, Port::Interface(1)),
                rule(MacQual::Any, MacQual::Addr(Mac::BROADCAST), SrcMatch::AnyInterface, Port::Link(0)),
                rule(MacQual::Any, MacQual::Any, SrcMatch::AnyInterface, Port::Link(0)), // same dst, same prio
                rule(MacQual::Any, MacQual::Not(A), SrcMatch::Any, Port::Link(9)),         // lower prio
            ],
            1,
        );
        let from_iface = dsts(&t, Port::Interface(2), A, Mac::BROADCAST);
        assert_eq!(from_iface, vec![Port::Interface(0), Port::Interface(1), Port::Link(0)]);
        let mut out = Vec::new();
        t.lookup(Port::Interface(2), A, Mac::BROADCAST, &mut out);
        let to_link: Vec<_> = out.iter().filter(|h| h.dst == Port::Link(0)).collect();
        assert_eq!(to_link.len(), 1, "a destination gets a frame once");
        assert_eq!(to_link[0].rule, 2, "credited to the first rule that chose it");
    }

    #[test]
    fn never_back_out_where_it_came_from() {
        let t = RouteTable::new(
            vec![
                rule(MacQual::Any, MacQual::Addr(Mac::BROADCAST), SrcMatch::Any, Port::Interface(0)),
                rule(MacQual::Any, MacQual::Addr(Mac::BROADCAST), SrcMatch::Any, Port::Interface(1)),
                rule(MacQual::Any, MacQual::Addr(Mac::BROADCAST), SrcMatch::Any, Port::Link(0)),
            ],
            1,
        );
        assert_eq!(dsts(&t, Port::Interface(0), A, Mac::BROADCAST), vec![Port::Interface(1), Port::Link(0)]);
        assert_eq!(dsts(&t, Port::Link(0), A, Mac::BROADCAST), vec![Port::Interface(0), Port::Interface(1)]);
        // A unicast whose only route leads back where it came from goes nowhere.
        let t = RouteTable::new(vec![rule(MacQual::Any, MacQual::Addr(B), SrcMatch::Any, Port::Link(0))], 1);
        assert!(dsts(&t, Port::Link(0), A, B).is_empty());
    }

    #[test]
    fn split_horizon_does_not_let_a_lower_rule_win() {
        // The top rule points back at the origin; it is skipped, and the
        // next-best rule carries the frame.
        let t = RouteTable::new(
            vec![
                rule(MacQual::Addr(A), MacQual::Addr(B), SrcMatch::Any, Port::Link(0)),
                rule(MacQual::Any, MacQual::Addr(B), SrcMatch::Any, Port::Link(1)),
            ],
            1,
        );
        assert_eq!(dsts(&t, Port::Link(0), A, B), vec![Port::Link(1)]);
    }

    #[test]
    fn per_source_default_route() {
        let t = RouteTable::new(
            vec![
                rule(MacQual::Addr(A), MacQual::None, SrcMatch::Any, Port::Link(0)),
                rule(MacQual::Any, MacQual::Addr(C), SrcMatch::Any, Port::Link(1)),
                rule(MacQual::Not(A), MacQual::Not(A), SrcMatch::Any, Port::Link(2)),
            ],
            1,
        );
        // A's frames to anyone without a better route take A's default route...
        assert_eq!(dsts(&t, Port::Interface(0), A, B), vec![Port::Link(0)]);
        // ...but a rule naming the destination (priority 6) beats it.
        assert_eq!(dsts(&t, Port::Interface(0), A, C), vec![Port::Link(1)]);
        // Other sources do not use A's default route; NOT/NOT (3) is below it.
        assert_eq!(dsts(&t, Port::Interface(0), B, C), vec![Port::Link(1)]);
        assert_eq!(dsts(&t, Port::Interface(0), B, Mac([2, 0, 0, 0, 0, 0xd])), vec![Port::Link(2)]);
    }

    #[test]
    fn source_type_and_id_take_part() {
        let t = RouteTable::new(
            vec![
                rule(MacQual::Any, MacQual::Addr(B), SrcMatch::AnyInterface, Port::Link(0)),
                rule(MacQual::Any, MacQual::Addr(B), SrcMatch::Exactly(Port::Link(5)), Port::Link(1)),
                rule(MacQual::Any, MacQual::Addr(B), SrcMatch::AnyLink, Port::Interface(3)),
                rule(MacQual::Any, MacQual::Addr(C), SrcMatch::Exactly(Port::Interface(1)), Port::Link(2)),
            ],
            1,
        );
        assert_eq!(dsts(&t, Port::Interface(0), A, B), vec![Port::Link(0)]);
        assert_eq!(dsts(&t, Port::Link(5), A, B), vec![Port::Interface(3), Port::Link(1)]);
        assert_eq!(dsts(&t, Port::Link(6), A, B), vec![Port::Interface(3)]);
        assert_eq!(dsts(&t, Port::Interface(1), A, C), vec![Port::Link(2)]);
        assert!(dsts(&t, Port::Interface(2), A, C).is_empty());
    }

    #[test]
    fn nothing_matches_an_empty_table() {
        assert!(dsts(&RouteTable::default(), Port::Interface(0), A, B).is_empty());
    }

    /// splitmix64: a small deterministic generator, so a failure repeats.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// A rule over `macs` and `ports`; each MAC qualifier is exact with
    /// extra odds `exact` in `exact + 1`, else any of the four kinds.
    fn random_rule(g: &mut Rng, macs: &[Mac], ports: &[Port], exact: usize) -> Rule {
        let qual = |g: &mut Rng| match if g.below(exact + 1) > 0 { 0 } else { g.below(4) } {
            0 => MacQual::Addr(macs[g.below(macs.len())]),
            1 => MacQual::Any,
            2 => MacQual::None,
            _ => MacQual::Not(macs[g.below(macs.len())]),
        };
        let src_mac = qual(g);
        let dst_mac = qual(g);
        let src = match g.below(4) {
            0 => SrcMatch::Any,
            1 => SrcMatch::AnyInterface,
            2 => SrcMatch::AnyLink,
            _ => SrcMatch::Exactly(ports[g.below(ports.len())]),
        };
        rule(src_mac, dst_mac, src, ports[g.below(ports.len())])
    }

    fn mac_pool(n: u8) -> Vec<Mac> {
        let mut v: Vec<Mac> = (1..n).map(|i| Mac([2, 0, 0, 0, 1, i])).collect();
        v.push(Mac::BROADCAST);
        v
    }

    const PORTS: [Port; 6] =
        [Port::Interface(0), Port::Interface(1), Port::Interface(2), Port::Link(0), Port::Link(1), Port::Link(2)];

    /// Review M6: the indexed matcher answers exactly as the linear one did
    /// (the same hits, in the same order, credited to the same rules), for
    /// random tables over every qualifier and source type, and every frame
    /// over the tables' MACs plus one they never name.
    #[test]
    fn indexed_lookup_equals_the_linear_matcher() {
        let mut g = Rng(0x5eed_0006);
        let macs = mac_pool(5);
        let mut frame_macs = macs.clone();
        frame_macs.push(Mac([2, 0, 0, 0, 9, 9]));
        let (mut got, mut want) = (Vec::new(), Vec::new());
        let mut nonempty = 0;
        for round in 0..3000 {
            let n = g.below(if round % 10 == 0 { 200 } else { 24 });
            let rules: Vec<Rule> = (0..n).map(|_| random_rule(&mut g, &macs, &PORTS, 0)).collect();
            let t = RouteTable::new(rules, round);
            for &origin in &PORTS {
                for &src in &frame_macs {
                    for &dst in &frame_macs {
                        t.lookup(origin, src, dst, &mut got);
                        t.lookup_linear(origin, src, dst, &mut want);
                        assert_eq!(got, want, "from {origin:?} {src} -> {dst}, rules {:?}", t.rules().collect::<Vec<_>>());
                        nonempty += !got.is_empty() as usize;
                    }
                }
            }
        }
        assert!(nonempty > 100_000, "the random tables route most frames somewhere ({nonempty})");
    }

    /// The same over bigger tables with more MACs, mostly exact, where each
    /// bucket holds several rules and frames meet only some of them.
    #[test]
    fn indexed_lookup_equals_the_linear_matcher_on_big_tables() {
        let mut g = Rng(0x5eed_0106);
        let macs = mac_pool(60);
        let (mut got, mut want) = (Vec::new(), Vec::new());
        let mut prios = [0usize; 9];
        for round in 0..20 {
            let rules: Vec<Rule> = (0..3000).map(|_| random_rule(&mut g, &macs, &PORTS, 12)).collect();
            let t = RouteTable::new(rules, round);
            for _ in 0..3000 {
                let origin = PORTS[g.below(PORTS.len())];
                let src = macs[g.below(macs.len())];
                let dst = macs[g.below(macs.len())];
                t.lookup(origin, src, dst, &mut got);
                t.lookup_linear(origin, src, dst, &mut want);
                assert_eq!(got, want, "from {origin:?} {src} -> {dst}");
                prios[got.first().and_then(|h| t.get(h.rule)).map_or(0, |r| {
                    priority(r.src_mac, r.dst_mac, src, dst).unwrap() as usize
                })] += 1;
            }
        }
        // Frames were decided at every priority level, not only by catch-alls.
        for p in [3, 4, 5, 6, 7, 8] {
            assert!(prios[p] > 100, "{prios:?}");
        }
    }

    /// The same where frames fan out to hundreds of ports, several rules
    /// naming each, so duplicates past the first few hits are removed by
    /// sorting: still the linear matcher's hits, order and credits.
    #[test]
    fn indexed_lookup_equals_the_linear_matcher_on_wide_fan_out() {
        let mut g = Rng(0x5eed_0206);
        let macs = mac_pool(4);
        let ports: Vec<Port> = (0..150).flat_map(|i| [Port::Interface(i), Port::Link(i)]).collect();
        let (mut got, mut want) = (Vec::new(), Vec::new());
        let mut widest = 0;
        for round in 0..40 {
            let rules: Vec<Rule> = (0..1500)
                .map(|_| {
                    let mut r = random_rule(&mut g, &macs, &ports, 0);
                    if g.below(20) > 0 {
                        (r.src_mac, r.dst_mac) = (MacQual::Any, MacQual::Addr(Mac::BROADCAST));
                        if let SrcMatch::Exactly(_) = r.src {
                            r.src = SrcMatch::Any;
                        }
                    }
                    r
                })
                .collect();
            let t = RouteTable::new(rules, round);
            for _ in 0..200 {
                let origin = ports[g.below(ports.len())];
                let src = macs[g.below(macs.len())];
                let dst = if g.below(2) == 0 { Mac::BROADCAST } else { macs[g.below(macs.len())] };
                t.lookup(origin, src, dst, &mut got);
                t.lookup_linear(origin, src, dst, &mut want);
                assert_eq!(got, want, "from {origin:?} {src} -> {dst}");
                widest = widest.max(got.len());
            }
        }
        assert!(widest > 200, "fan-out to {widest} ports at most");
    }

    /// Tables changed rule by rule (adds at new ids, deletes, a rule put
    /// back at an old id) answer as the plain scan does, and a table cloned
    /// before a change still answers as it did: the change is not seen
    /// through the nodes the two share.
    #[test]
    fn changed_tables_equal_the_linear_matcher_and_old_ones_stay_as_they_were() {
        let mut g = Rng(0x5eed_0306);
        let macs = mac_pool(12);
        let (mut got, mut want) = (Vec::new(), Vec::new());
        let mut t = RouteTable::default();
        let mut next_id = 0u32;
        let mut frozen: Vec<(RouteTable, Vec<(Port, Mac, Mac, Vec<Hit>)>)> = Vec::new();
        for step in 0..4000 {
            let ids: Vec<u32> = t.rules().map(|(id, _)| id).collect();
            match g.below(10) {
                0..=5 => {
                    t.insert(next_id, random_rule(&mut g, &macs, &PORTS, 3));
                    next_id += 1 + g.below(3) as u32;
                }
                6..=8 if !ids.is_empty() => {
                    let id = ids[g.below(ids.len())];
                    assert!(t.remove(id).is_some());
                    assert!(t.remove(id).is_none(), "removed once");
                }
                _ if !ids.is_empty() => {
                    // A rule replaced in place, at an id among the others.
                    t.insert(ids[g.below(ids.len())], random_rule(&mut g, &macs, &PORTS, 3));
                }
                _ => {}
            }
            t.set_generation(step);
            for _ in 0..20 {
                let origin = PORTS[g.below(PORTS.len())];
                let (src, dst) = (macs[g.below(macs.len())], macs[g.below(macs.len())]);
                t.lookup(origin, src, dst, &mut got);
                t.lookup_linear(origin, src, dst, &mut want);
                assert_eq!(got, want, "step {step}: from {origin:?} {src} -> {dst}");
            }
            if step % 400 == 0 {
                let answers = (0..50)
                    .map(|_| {
                        let origin = PORTS[g.below(PORTS.len())];
                        let (src, dst) = (macs[g.below(macs.len())], macs[g.below(macs.len())]);
                        t.lookup(origin, src, dst, &mut got);
                        (origin, src, dst, got.clone())
                    })
                    .collect();
                frozen.push((t.clone(), answers));
            }
        }
        assert!(t.len() > 100, "the table grew ({} rules)", t.len());
        for (old, answers) in &frozen {
            for (origin, src, dst, hits) in answers {
                old.lookup(*origin, *src, *dst, &mut got);
                assert_eq!(&got, hits, "a table kept from before the changes answers as it did");
            }
        }
    }

    /// A lookup visits the rules naming the frame's MACs and the catch-alls,
    /// not the whole table.
    #[test]
    fn a_lookup_visits_only_the_rules_that_can_match() {
        let m = |i: u32| {
            let b = i.to_be_bytes();
            Mac([2, 0, b[0], b[1], b[2], b[3]])
        };
        let mut rules: Vec<Rule> =
            (0..20_000).map(|i| rule(MacQual::Any, MacQual::Addr(m(i)), SrcMatch::Any, Port::Link(i % 7))).collect();
        rules.push(rule(MacQual::Addr(m(5)), MacQual::None, SrcMatch::Any, Port::Link(1)));
        rules.push(rule(MacQual::Addr(m(5)), MacQual::Addr(m(6)), SrcMatch::Any, Port::Link(2)));
        rules.push(rule(MacQual::Not(m(5)), MacQual::Not(m(6)), SrcMatch::Any, Port::Link(3)));
        rules.push(rule(MacQual::None, MacQual::Any, SrcMatch::Any, Port::Link(4))); // never matches
        rules.push(rule(MacQual::Any, MacQual::None, SrcMatch::Any, Port::Link(4))); // never matches
        let t = RouteTable::new(rules, 1);
        assert_eq!(t.candidates(m(5), m(6)), 4); // any->6, 5->none, 5->6, not-5->not-6
        assert_eq!(t.candidates(m(7), m(6)), 2); // any->6, not-5->not-6
        assert_eq!(t.candidates(m(7), m(99_999)), 1); // not-5->not-6
        assert_eq!(dsts(&t, Port::Interface(0), m(5), m(6)), vec![Port::Link(2)]);
        assert_eq!(dsts(&t, Port::Interface(0), m(5), m(99_999)), vec![Port::Link(1)]);
        assert_eq!(dsts(&t, Port::Interface(0), m(7), m(99_999)), vec![Port::Link(3)]);
        assert_eq!(dsts(&t, Port::Interface(0), m(7), m(19_999)), vec![Port::Link(19_999 % 7)]);
    }
}
