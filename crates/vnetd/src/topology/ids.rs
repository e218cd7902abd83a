//! Ids that outlive vnetd. The kernel fast path's maps name interfaces,
//! links and routes by id (flow keys and actions, ports, counters), and
//! with a pinned datapath those maps outlive vnetd: a vnetd started again
//! must give each object the id it had, or the entries it adopts would
//! mean other objects. So an object's id is recorded, by its kind and a
//! hash of its name (an interface's or link's name, a route's rule), in the
//! datapath's `ids` map when the request that added it commits, and
//! forgotten when the one that deleted it commits; `take` gives a new
//! object the id its name had if that id is free, else the next one.
//!
//! Within one vnetd, ids are still never reused: the next id to give is
//! kept with them, and a name whose object was deleted has no record left.
//! A request that fails records nothing (its `Ids` is the working copy's).
//! Without the fast path (or with an unpinned one) ids start at 0 in every
//! vnetd, as nothing outlives it that names them.

use std::collections::HashSet;
use std::sync::Arc;
use vnet_fastpath::{IdKind, Kernel};

#[derive(Clone, Default)]
pub struct Ids {
    /// The next id of each kind (`IdKind as usize`) never given.
    next: [u32; 3],
    store: Option<Arc<Kernel>>,
    /// Records to write when the request commits: (kind, name hash, id or
    /// None to forget).
    pending: Vec<(IdKind, u64, Option<u32>)>,
    /// Names whose object this request deleted: one added again in the same
    /// request gets a new id, not the deleted one's (still in use by
    /// dispatchers until the request commits, and by anything keyed by it).
    forgotten: HashSet<(IdKind, u64)>,
    /// The store's records are asked: it had some when opened, and its
    /// next ids were believable.
    ask: bool,
}

/// Most ids of one kind a store may say were given. The store is state
/// read back from bpffs: a `next` beyond this was not written by vnetd
/// (ids must stay below `LINK_BIT`, and counting up must not overflow).
const MOST: u32 = 1 << 30;

/// The store's next ids, if believable.
fn believable(next: [u32; 3]) -> Option<[u32; 3]> {
    next.iter().all(|&n| n < MOST).then_some(next)
}

impl Ids {
    /// Ids recorded in `store` (the fast path's maps), if any.
    pub fn new(store: Option<Arc<Kernel>>) -> Ids {
        let recorded = store.as_ref().map(|k| (k.next_ids(), k.had_ids()));
        let (next, ask) = match recorded {
            None => ([0; 3], false),
            Some((next, had)) => match believable(next) {
                Some(next) => (next, had),
                None => {
                    tracing::warn!("fast path: the recorded next ids {next:?} are not vnetd's; ids start at 0 and recorded ones are ignored");
                    ([0; 3], false)
                }
            },
        };
        Ids { next, store, pending: Vec::new(), forgotten: HashSet::new(), ask }
    }

    /// The id for a new object of `kind` named `name`: the one it had in
    /// a vnetd before this one if no object here has it (`in_use`), else
    /// the next.
    pub fn take(&mut self, kind: IdKind, name: &str, in_use: impl Fn(u32) -> bool) -> u32 {
        let h = vnet_core::name_hash(name);
        let stored = match self.forgotten.contains(&(kind, h)) {
            true => None,
            false => self.store.as_ref().filter(|_| self.ask).and_then(|k| k.stored_id(kind, h)),
        };
        let id = match stored {
            Some(id) if !in_use(id) && id < vnet_fastpath::LINK_BIT => id,
            _ => {
                let id = self.next[kind as usize];
                self.next[kind as usize] += 1;
                id
            }
        };
        if self.store.is_some() {
            self.pending.push((kind, h, Some(id)));
        }
        id
    }

    /// An object of `kind` named `name` was deleted: its record goes.
    pub fn forget(&mut self, kind: IdKind, name: &str) {
        if self.store.is_some() {
            let h = vnet_core::name_hash(name);
            self.pending.push((kind, h, None));
            self.forgotten.insert((kind, h));
        }
    }

    /// The request commits: its records are written.
    pub fn commit(&mut self) {
        let Some(k) = &self.store else { return };
        self.forgotten.clear();
        if self.pending.is_empty() {
            return;
        }
        k.store_ids(&self.pending);
        self.pending.clear();
        k.set_next_ids(self.next);
    }

    /// The next id of each kind: interfaces, links, routes.
    pub fn next(&self) -> (u32, u32, u32) {
        (self.next[0], self.next[1], self.next[2])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_store_ids_count_up_per_kind_and_failed_copies_give_nothing_back() {
        let mut ids = Ids::default();
        assert_eq!(ids.take(IdKind::Iface, "a", |_| false), 0);
        assert_eq!(ids.take(IdKind::Iface, "b", |_| false), 1);
        assert_eq!(ids.take(IdKind::Link, "a", |_| false), 0);
        let mut copy = ids.clone();
        assert_eq!(copy.take(IdKind::Route, "r", |_| false), 0);
        // The copy is dropped (its request failed): the original goes on.
        assert_eq!(ids.take(IdKind::Route, "r", |_| false), 0);
        assert_eq!(ids.next(), (2, 1, 1));
    }

    #[test]
    fn next_ids_read_back_from_the_store_are_taken_only_if_vnetd_could_have_written_them() {
        assert_eq!(believable([0, 5, 100_000]), Some([0, 5, 100_000]));
        assert_eq!(believable([0, MOST, 0]), None);
        assert_eq!(believable([u32::MAX, 0, 0]), None);
    }
}
