//! A pass's work in proportion to what changed: what host `me` wants is
//! the union of one part per network it has a member of
//! (`model::derive_part`), so a change in one network derives that part
//! again and compares it with the part in force, and nothing else
//! (docs/controller.md, "At scale"). At 1,000 hosts a host's 2,392 routes
//! took 4 ms to derive and 0.6 ms to compare whole at every change of any of
//! its networks' 800 guests; one part is a fifth of that, and only its
//! difference is compared and sent.
//!
//! The difference is taken against vnetd's tables as the agent's last
//! commit left them (`vnetd::Cache`, kept in step with each commit). When
//! vnetd's tables were read again (someone else changed them: a user, a
//! CNI plugin, a restarted vnetd), or a link's host moved or changed its
//! key, or the overlay was listed again, a pass derives and compares
//! everything, as `model::derive` and `model::plan` say: the reference the
//! parts are tested against.

use crate::model::{derive_part, derive_parts, link_to, merge, plan, plan_neigh, Desired, Guest, Host, Part, OWNER};
use crate::store::View;
use crate::vnetd::State;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

/// The parts in force (vnetd holds them, less a user's routes and
/// bindings), and the local guests they were derived for.
#[derive(Default)]
pub struct Deriver {
    parts: BTreeMap<String, Part>,
    held: BTreeMap<String, String>,
    /// How many parts want a link to each host.
    links: BTreeMap<String, usize>,
    valid: bool,
}

/// A pass's plan, to be put in force (`Deriver::commit`) once vnetd took
/// its request; dropped if vnetd refused it.
pub struct Pending {
    /// The request: ROUTE DEL, LINK DEL, LINK ADD, ROUTE ADD, NEIGH.
    pub lines: Vec<String>,
    /// The parts that change (None: a network with no member here any more).
    parts: BTreeMap<String, Option<Part>>,
    /// All parts (a full pass).
    full: Option<(BTreeMap<String, Part>, Desired)>,
    held: BTreeMap<String, String>,
    /// The cache's changes.
    routes_del: Vec<String>,
    routes_add: Vec<String>,
    links_del: Vec<String>,
    links_add: Vec<(String, (IpAddr, u16, Option<String>))>,
    neigh_del: Vec<IpAddr>,
    neigh_add: Vec<(IpAddr, String)>,
    /// Whether the incremental plan was taken (else everything was derived).
    pub incremental: bool,
}

/// The guest holding `ip` among those that say they do: the first claim.
fn holder<'a>(guests: &'a BTreeMap<String, Guest>, by_ip: &'a BTreeMap<IpAddr, BTreeSet<String>>, ip: &IpAddr) -> Option<&'a str> {
    by_ip.get(ip)?.iter().filter_map(|m| guests.get_key_value(m)).min_by_key(|(m, g)| (g.since, m.as_str())).map(|(m, _)| m.as_str())
}

impl Deriver {
    /// Forgets the parts: the next pass derives everything.
    pub fn invalidate(&mut self) {
        self.valid = false;
    }

    /// The addresses guests of this host's networks say they hold but
    /// another guest claimed first, as the parts in force have them.
    pub fn conflicts(&self) -> Vec<(IpAddr, String)> {
        let mut v: Vec<(IpAddr, String)> = self.parts.values().flat_map(|p| p.ip_conflicts.iter().cloned()).collect();
        v.sort();
        v.dedup();
        v
    }

    /// Plans a pass for host `me`: with `dirty` the networks that changed
    /// in etcd since the last pass (None: any may have), `held` the local
    /// guests held here, `state` vnetd's tables as the last commit left
    /// them, and `fresh` whether they were just read from vnetd.
    pub fn plan(
        &self,
        me: &str,
        hosts: &BTreeMap<String, Host>,
        view: &View,
        held: &BTreeMap<String, String>,
        dirty: Option<&BTreeSet<String>>,
        state: &State,
        fresh: bool,
    ) -> Pending {
        if let (true, false, Some(dirty)) = (self.valid, fresh, dirty) {
            if let Some(p) = self.step(me, hosts, view, held, dirty, state) {
                return p;
            }
        }
        let parts = derive_parts(me, hosts, view.guests, held);
        let want = merge(hosts, &parts);
        let mut lines = plan(&want, &state.links, &state.routes, &state.user_routes);
        lines.extend(plan_neigh(&want, &state.neigh, &state.other_neigh));
        Pending {
            lines,
            parts: BTreeMap::new(),
            full: Some((parts, want)),
            held: held.clone(),
            routes_del: Vec::new(),
            routes_add: Vec::new(),
            links_del: Vec::new(),
            links_add: Vec::new(),
            neigh_del: Vec::new(),
            neigh_add: Vec::new(),
            incremental: false,
        }
    }

    /// The incremental plan; None when only a full one will do (a link's
    /// host moved or changed its key).
    fn step(&self, me: &str, hosts: &BTreeMap<String, Host>, view: &View, held: &BTreeMap<String, String>, dirty: &BTreeSet<String>, state: &State) -> Option<Pending> {
        // The networks to derive again: those that changed in etcd, and
        // those whose members here came, went or moved.
        let mut nets: BTreeSet<String> = dirty.iter().filter(|n| self.parts.contains_key(*n)).cloned().collect();
        for (mac, net) in held {
            if self.held.get(mac) != Some(net) {
                nets.insert(net.clone());
                nets.extend(self.held.get(mac).cloned());
            }
        }
        for (mac, net) in &self.held {
            if !held.contains_key(mac) {
                nets.insert(net.clone());
            }
        }
        let empty = BTreeSet::new();
        let who = |ip: &IpAddr| holder(view.guests, view.by_ip, ip);
        let mut parts = BTreeMap::new();
        for n in nets {
            let local: Vec<&str> = held.iter().filter(|(_, net)| **net == n).map(|(m, _)| m.as_str()).collect();
            let part = (!local.is_empty()).then(|| {
                let members = view.by_net.get(&n).unwrap_or(&empty).iter().map(String::as_str);
                derive_part(me, hosts, view.guests, &local, members, &who)
            });
            // A link whose host moved or changed its key is replaced with
            // its routes, in every network: a full pass.
            for h in part.iter().flat_map(|p| &p.hosts) {
                let want = link_to(hosts, h)?;
                if state.links.get(&want.name).is_some_and(|have| *have != (want.underlay, want.port, want.key.clone())) {
                    return None;
                }
            }
            if part.as_ref() != self.parts.get(&n) {
                parts.insert(n, part);
            }
        }
        let mut p = Pending {
            lines: Vec::new(),
            parts: BTreeMap::new(),
            full: None,
            held: held.clone(),
            routes_del: Vec::new(),
            routes_add: Vec::new(),
            links_del: Vec::new(),
            links_add: Vec::new(),
            neigh_del: Vec::new(),
            neigh_add: Vec::new(),
            incremental: true,
        };
        // What the changed parts drop and add, together (a guest moving
        // between networks takes a route from one part to the other).
        let none = Part::default();
        let (mut gone, mut came) = (BTreeSet::new(), BTreeSet::new());
        let (mut ips_gone, mut ips_came) = (BTreeMap::new(), BTreeMap::new());
        let mut counts: BTreeMap<&str, isize> = BTreeMap::new();
        for (n, new) in &parts {
            let old = self.parts.get(n).unwrap_or(&none);
            let new = new.as_ref().unwrap_or(&none);
            gone.extend(old.routes.difference(&new.routes));
            came.extend(new.routes.difference(&old.routes));
            for h in old.hosts.difference(&new.hosts) {
                *counts.entry(h).or_default() -= 1;
            }
            for h in new.hosts.difference(&old.hosts) {
                *counts.entry(h).or_default() += 1;
            }
            ips_gone.extend(old.neigh.iter().filter(|(ip, m)| new.neigh.get(*ip) != Some(*m)));
            ips_came.extend(new.neigh.iter().filter(|(ip, m)| old.neigh.get(*ip) != Some(*m)));
        }
        for r in gone.difference(&came) {
            if state.routes.contains(*r) {
                p.routes_del.push((*r).clone());
            }
        }
        for r in &came {
            if !state.routes.contains(*r) && !state.user_routes.contains(*r) {
                p.routes_add.push((*r).clone());
            }
        }
        for (ip, mac) in &ips_gone {
            if !ips_came.contains_key(ip) && state.neigh.get(*ip) == Some(*mac) {
                p.neigh_del.push(**ip);
            }
        }
        for (ip, mac) in &ips_came {
            if state.neigh.get(*ip) != Some(*mac) && !state.other_neigh.contains(*ip) {
                p.neigh_add.push((**ip, (*mac).clone()));
            }
        }
        // Links: those no part wants any more go, those a part wants now
        // come (counted per part: one link serves every network).
        for (h, d) in counts {
            let now = self.links.get(h).copied().unwrap_or(0) as isize + d;
            let name = crate::model::link_name(h);
            if now <= 0 && state.links.contains_key(&name) {
                p.links_del.push(name);
            } else if now > 0 && !state.links.contains_key(&name) {
                let w = link_to(hosts, h)?;
                p.lines.push(w.command());
                p.links_add.push((w.name, (w.underlay, w.port, w.key)));
            }
        }
        let adds = std::mem::take(&mut p.lines);
        p.lines.extend(p.routes_del.iter().map(|r| format!("ROUTE DEL {r}")));
        p.lines.extend(p.links_del.iter().map(|l| format!("LINK DEL {l}")));
        p.lines.extend(adds);
        p.lines.extend(p.routes_add.iter().map(|r| format!("ROUTE ADD {r} owner {OWNER}")));
        p.lines.extend(p.neigh_del.iter().map(|ip| format!("NEIGH DEL {ip}")));
        p.lines.extend(p.neigh_add.iter().map(|(ip, mac)| format!("NEIGH ADD {ip} {mac} owner {OWNER}")));
        p.parts = parts;
        Some(p)
    }

    /// Puts `p` in force: vnetd took its request (or it had none). `state`
    /// becomes what vnetd holds now.
    pub fn commit(&mut self, p: Pending, state: &mut State) {
        if let Some((parts, want)) = p.full {
            state.after(&want);
            self.links = BTreeMap::new();
            for h in parts.values().flat_map(|p| &p.hosts) {
                *self.links.entry(h.clone()).or_default() += 1;
            }
            self.parts = parts;
        } else {
            for r in &p.routes_del {
                state.routes.remove(r);
            }
            for r in p.routes_add {
                state.routes.insert(r);
            }
            for l in &p.links_del {
                state.links.remove(l);
            }
            state.links.extend(p.links_add);
            for ip in &p.neigh_del {
                state.neigh.remove(ip);
            }
            state.neigh.extend(p.neigh_add);
            for (n, part) in p.parts {
                let old = self.parts.remove(&n).unwrap_or_default();
                for h in &old.hosts {
                    if let Some(c) = self.links.get_mut(h) {
                        *c -= 1;
                    }
                }
                if let Some(part) = part {
                    for h in &part.hosts {
                        *self.links.entry(h.clone()).or_default() += 1;
                    }
                    self.parts.insert(n, part);
                }
            }
            self.links.retain(|_, c| *c > 0);
        }
        self.held = p.held;
        self.valid = true;
    }
}

#[cfg(test)]
#[path = "passes_tests.rs"]
mod tests;
