//! What one host's vnetd should hold, derived from the overlay's published
//! state: pure functions, so every rule the agent writes can be checked by a
//! unit test without etcd or vnetd.
//!
//! The overlay as etcd holds it (docs/controller.md): hosts with their
//! underlay address, and guests (by MAC) with the host they are on and the
//! network they are in. For host H and each network N with a guest on H:
//!
//! - H has a link to every other host with a guest in N (`agent.<host>`);
//! - each local guest s of N reaches every other guest d of N, and no one
//!   else: unicast rules with s's exact MAC as source (`s d edge R interface s`
//!   to a remote d on host R; `s d interface d interface s` to a local d);
//! - frames from links reach a local guest d (`any d interface d edge`): a
//!   remote host sends only its own guests' frames within their networks;
//! - broadcast (ARP): s's broadcasts go to N's other local guests and to each
//!   host with members of N; a remote member r's broadcast, arriving from its
//!   host's link, goes to N's local guests (`r ff:.. interface d edge R`).
//!   Split horizon is VNET/P's: nothing goes back where it came from, and
//!   frames from links never go on to links.
//!
//! So a guest's frames reach only its own network, on every host, with the
//! VNET/P rule table unchanged. The rules grow as local × remote members per
//! network (docs/controller.md gives the sizes).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

pub const BROADCAST: &str = "ff:ff:ff:ff:ff:ff";
/// The owner tag of the agent's routes (`ROUTE ADD ... owner agent`).
pub const OWNER: &str = "agent";
/// The agent's links are named this prefix and the host's name.
pub const LINK_PREFIX: &str = "agent.";

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Host {
    pub underlay: IpAddr,
    pub port: u16,
    /// Its vnetd's WireGuard port and public key, if it encrypts
    /// (`vnet-agent run --encrypt`).
    pub wireguard: Option<(u16, String)>,
}

/// The hosts this one links to, and how: encrypting (`--encrypt`), only
/// hosts that publish a WireGuard key, by WireGuard (never in clear: a host
/// without a key gets no link, so a mixed overlay fails closed); otherwise
/// every host by plain UDP.
pub fn hosts_for(hosts: &BTreeMap<String, Host>, encrypt: bool) -> BTreeMap<String, Host> {
    hosts
        .iter()
        .filter(|(_, h)| !encrypt || h.wireguard.is_some())
        .map(|(n, h)| (n.clone(), Host { wireguard: if encrypt { h.wireguard.clone() } else { None }, ..h.clone() }))
        .collect()
}

/// A WireGuard public key as `wg pubkey` writes it (44 characters of
/// base64, 32 bytes): what a host may publish.
pub fn check_wireguard_key(key: &str) -> anyhow::Result<()> {
    let ok = key.len() == 44
        && key.ends_with('=')
        && !key[..43].contains('=')
        && key.chars().all(|c| c.is_ascii_alphanumeric() || "+/=".contains(c));
    anyhow::ensure!(ok, "'{key}' is not a WireGuard public key");
    Ok(())
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Guest {
    pub host: String,
    pub network: String,
    /// The addresses its holder's record says it holds.
    pub ips: Vec<IpAddr>,
    /// The etcd revision its holder's claim was made at: of two guests
    /// that say they hold one address, the one claimed first has it.
    pub since: i64,
}

/// A link the agent wants: its name and the `LINK ADD` arguments.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct LinkWant {
    pub name: String,
    pub underlay: IpAddr,
    pub port: u16,
    /// The peer's WireGuard public key: a WireGuard link (else UDP).
    pub key: Option<String>,
}

impl LinkWant {
    pub fn command(&self) -> String {
        match &self.key {
            Some(k) => format!("LINK ADD {} {} wireguard {k} name {}", self.underlay, self.port, self.name),
            None => format!("LINK ADD {} {} udp name {}", self.underlay, self.port, self.name),
        }
    }
}

#[derive(Debug, Default, PartialEq, Eq)]
pub struct Desired {
    pub links: BTreeSet<LinkWant>,
    /// Rules as `ROUTE LIST` prints them (lower-case MACs, canonical words).
    pub routes: BTreeSet<String>,
    /// Addresses of remote members of this host's networks, to the MAC
    /// holding each (`NEIGH ADD ... owner agent`): their ARP requests and
    /// neighbour solicitations are answered here.
    pub neigh: BTreeMap<IpAddr, String>,
    /// Addresses two guests say they hold, the later claim's left out:
    /// (address, the MAC refused).
    pub ip_conflicts: Vec<(IpAddr, String)>,
}

/// Host names become link names (`agent.<host>`) and etcd keys.
pub fn check_host_name(name: &str) -> anyhow::Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 48
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
        && name.chars().next().is_some_and(|c| c.is_ascii_alphanumeric());
    anyhow::ensure!(ok, "'{name}' is not a host name (up to 48 of A-Z a-z 0-9 _ . -, starting with a letter or digit)");
    Ok(())
}

/// Network names as vnetd takes them (`INTERFACE ADD ... network <name>`).
pub fn check_network(name: &str) -> anyhow::Result<()> {
    let ok = !name.is_empty() && name.len() <= 64 && name.chars().all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c));
    anyhow::ensure!(ok, "'{name}' is not a network name");
    Ok(())
}

/// A unicast MAC, in the lower-case form vnetd prints.
pub fn check_mac(mac: &str) -> anyhow::Result<String> {
    let bytes: Vec<u8> = mac.split(':').filter_map(|b| (b.len() == 2).then(|| u8::from_str_radix(b, 16).ok()).flatten()).collect();
    anyhow::ensure!(bytes.len() == 6 && mac.len() == 17, "'{mac}' is not a MAC address");
    anyhow::ensure!(bytes[0] & 1 == 0, "'{mac}' is a multicast address");
    Ok(mac.to_ascii_lowercase())
}

pub fn link_name(host: &str) -> String {
    format!("{LINK_PREFIX}{host}")
}

/// One network's share of what host `me` wants (`derive_part`): its
/// routes, the other hosts with members of it (each gets a link), the
/// bindings of its remote members' addresses, and the addresses its
/// members say they hold but another guest claimed first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Part {
    pub routes: BTreeSet<String>,
    pub hosts: BTreeSet<String>,
    pub neigh: BTreeMap<IpAddr, String>,
    pub ip_conflicts: Vec<(IpAddr, String)>,
}

/// A network's share of host `me`'s links and routes, where `local` are
/// its members held here and `members` all of its guests, `local` among
/// them (MACs in `guests`; those of hosts not in `hosts` are not reachable
/// and left out), and `holder` says which guest holds an address (the
/// first claim of it).
pub fn derive_part<'a>(
    me: &str,
    hosts: &BTreeMap<String, Host>,
    guests: &'a BTreeMap<String, Guest>,
    local: &[&'a str],
    members: impl IntoIterator<Item = &'a str>,
    holder: &dyn Fn(&IpAddr) -> Option<&'a str>,
) -> Part {
    let mut p = Part::default();
    let mut remote: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for mac in members {
        let Some(g) = guests.get(mac) else { continue };
        for ip in &g.ips {
            if holder(ip).is_some_and(|h| h != mac) {
                p.ip_conflicts.push((*ip, mac.to_string()));
            }
        }
        if g.host == me || !hosts.contains_key(&g.host) {
            continue;
        }
        remote.entry(g.host.as_str()).or_default().push(mac);
    }
    if local.is_empty() {
        return p;
    }
    for r in remote.values().flatten() {
        for ip in &guests[*r].ips {
            if holder(ip) == Some(*r) {
                p.neigh.insert(*ip, r.to_string());
            }
        }
    }
    p.hosts = remote.keys().map(|h| h.to_string()).collect();
    for &s in local {
        p.routes.insert(format!("any {s} interface {s} edge"));
        for &t in local.iter().filter(|&&t| t != s) {
            p.routes.insert(format!("{s} {t} interface {t} interface {s}"));
            p.routes.insert(format!("{s} {BROADCAST} interface {t} interface {s}"));
        }
        for (host, members) in &remote {
            let link = link_name(host);
            p.routes.insert(format!("{s} {BROADCAST} edge {link} interface {s}"));
            for &r in members {
                p.routes.insert(format!("{s} {r} edge {link} interface {s}"));
                p.routes.insert(format!("{r} {BROADCAST} interface {s} edge {link}"));
            }
        }
    }
    p.ip_conflicts.sort();
    p
}

/// The link to `host` as host `me` wants it.
pub fn link_to(hosts: &BTreeMap<String, Host>, host: &str) -> Option<LinkWant> {
    let h = hosts.get(host)?;
    let (port, key) = match &h.wireguard {
        Some((p, k)) => (*p, Some(k.clone())),
        None => (h.port, None),
    };
    Some(LinkWant { name: link_name(host), underlay: h.underlay, port, key })
}

/// The first claim of each address among `guests` (the lowest `since`;
/// of equal ones, the first MAC): its holder.
pub fn ip_holders(guests: &BTreeMap<String, Guest>) -> BTreeMap<IpAddr, (i64, &str)> {
    let mut holders: BTreeMap<IpAddr, (i64, &str)> = BTreeMap::new();
    for (mac, g) in guests {
        for ip in &g.ips {
            match holders.get(ip) {
                Some((since, _)) if *since <= g.since => {}
                _ => {
                    holders.insert(*ip, (g.since, mac.as_str()));
                }
            }
        }
    }
    holders
}

/// Every network's part of host `me`'s state (networks with a member held
/// here): `local` are the guests vnetd has here (MAC → network) that this
/// host holds in etcd too. MACs are lower case.
pub fn derive_parts(me: &str, hosts: &BTreeMap<String, Host>, guests: &BTreeMap<String, Guest>, local: &BTreeMap<String, String>) -> BTreeMap<String, Part> {
    let mut nets: BTreeMap<&str, (Vec<&str>, Vec<&str>)> = BTreeMap::new();
    for (mac, net) in local {
        nets.entry(net.as_str()).or_default().0.push(mac.as_str());
    }
    for (mac, g) in guests {
        if let Some(e) = nets.get_mut(g.network.as_str()) {
            e.1.push(mac.as_str());
        }
    }
    let holders = ip_holders(guests);
    let holder = |ip: &IpAddr| holders.get(ip).map(|(_, m)| *m);
    nets.into_iter().map(|(n, (local, members))| (n.to_string(), derive_part(me, hosts, guests, &local, members, &holder))).collect()
}

/// The parts together: host `me`'s links, routes and bindings.
pub fn merge(hosts: &BTreeMap<String, Host>, parts: &BTreeMap<String, Part>) -> Desired {
    let mut d = Desired::default();
    for p in parts.values() {
        d.routes.extend(p.routes.iter().cloned());
        d.neigh.extend(p.neigh.iter().map(|(i, m)| (*i, m.clone())));
        d.links.extend(p.hosts.iter().filter_map(|h| link_to(hosts, h)));
        d.ip_conflicts.extend(p.ip_conflicts.iter().cloned());
    }
    d.ip_conflicts.sort();
    d.ip_conflicts.dedup();
    d
}

/// Host `me`'s links and routes for the overlay `guests` on `hosts`, where
/// `local` are the guests vnetd has here (MAC → network) that this host
/// holds in etcd too. MACs are lower case. The whole derivation at once:
/// what a pass's parts must add up to (passes.rs is tested against it).
#[cfg(test)]
pub fn derive(me: &str, hosts: &BTreeMap<String, Host>, guests: &BTreeMap<String, Guest>, local: &BTreeMap<String, String>) -> Desired {
    merge(hosts, &derive_parts(me, hosts, guests, local))
}

/// The `NEIGH` changes that take vnetd's bindings of the agent's (`have`:
/// address → MAC) to `want`'s, leaving every address a user bound
/// (`users`) alone.
pub fn plan_neigh(want: &Desired, have: &BTreeMap<IpAddr, String>, users: &BTreeSet<IpAddr>) -> Vec<String> {
    let mut req = Vec::new();
    for (ip, mac) in have {
        if want.neigh.get(ip) != Some(mac) {
            req.push(format!("NEIGH DEL {ip}"));
        }
    }
    for (ip, mac) in &want.neigh {
        if have.get(ip) != Some(mac) && !users.contains(ip) {
            req.push(format!("NEIGH ADD {ip} {mac} owner {OWNER}"));
        }
    }
    req
}

/// The request that takes vnetd from what it has (`links`: the agent's
/// links by name → (remote ip, port, WireGuard key); `routes`: the agent's
/// routes' rules; `user_routes`: rules a user added, which the agent must
/// neither add again nor remove) to `want`. Empty when nothing differs.
/// Links and routes are deleted by name and rule (vnetd holds each rule
/// once), so a plan needs no index vnetd gave.
pub fn plan(
    want: &Desired,
    links: &BTreeMap<String, (IpAddr, u16, Option<String>)>,
    routes: &BTreeSet<String>,
    user_routes: &BTreeSet<String>,
) -> Vec<String> {
    let mut req = Vec::new();
    let wanted_links: BTreeMap<&str, &LinkWant> = want.links.iter().map(|l| (l.name.as_str(), l)).collect();
    // A link whose host moved to another address, or changed its key (or
    // began or stopped encrypting), is replaced: its routes go first and
    // come back after.
    let moved: BTreeSet<&str> = links
        .iter()
        .filter(|(n, (ip, port, key))| {
            wanted_links.get(n.as_str()).is_some_and(|w| (w.underlay, w.port, &w.key) != (*ip, *port, key))
        })
        .map(|(n, _)| n.as_str())
        .collect();
    let uses = |rule: &str, link: &str| rule.split(' ').any(|w| w == link);
    for rule in routes {
        if !want.routes.contains(rule) || moved.iter().any(|l| uses(rule, l)) {
            req.push(format!("ROUTE DEL {rule}"));
        }
    }
    for name in links.keys() {
        if !wanted_links.contains_key(name.as_str()) || moved.contains(name.as_str()) {
            req.push(format!("LINK DEL {name}"));
        }
    }
    for l in &want.links {
        if !links.contains_key(&l.name) || moved.contains(l.name.as_str()) {
            req.push(l.command());
        }
    }
    for rule in &want.routes {
        let kept = routes.contains(rule) && !moved.iter().any(|l| uses(rule, l));
        if !kept && !user_routes.contains(rule) {
            req.push(format!("ROUTE ADD {rule} owner {OWNER}"));
        }
    }
    req
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(n: usize) -> BTreeMap<String, Host> {
        (1..=n).map(|i| (format!("h{i}"), Host { underlay: format!("198.18.0.{i}").parse().unwrap(), port: 9000, wireguard: None })).collect()
    }

    fn guest(host: &str, net: &str) -> Guest {
        Guest { host: host.into(), network: net.into(), ips: Vec::new(), since: 0 }
    }

    const A1: &str = "02:00:00:00:00:a1";
    const A2: &str = "02:00:00:00:00:a2";
    const A3: &str = "02:00:00:00:00:a3";
    const B1: &str = "02:00:00:00:00:b1";
    const B2: &str = "02:00:00:00:00:b2";

    fn overlay() -> BTreeMap<String, Guest> {
        [(A1, "h1", "a"), (A2, "h2", "a"), (A3, "h1", "a"), (B1, "h1", "b"), (B2, "h3", "b")]
            .iter()
            .map(|(m, h, n)| (m.to_string(), guest(h, n)))
            .collect()
    }

    fn local(of: &str) -> BTreeMap<String, String> {
        overlay().into_iter().filter(|(_, g)| g.host == of).map(|(m, g)| (m, g.network)).collect()
    }

    #[test]
    fn each_network_reaches_its_own_members_only() {
        let d = derive("h1", &hosts(3), &overlay(), &local("h1"));
        let links: Vec<&str> = d.links.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(links, ["agent.h2", "agent.h3"]);
        let want: BTreeSet<String> = [
            // network a: A1 and A3 here, A2 on h2
            format!("any {A1} interface {A1} edge"),
            format!("any {A3} interface {A3} edge"),
            format!("{A1} {A3} interface {A3} interface {A1}"),
            format!("{A3} {A1} interface {A1} interface {A3}"),
            format!("{A1} {BROADCAST} interface {A3} interface {A1}"),
            format!("{A3} {BROADCAST} interface {A1} interface {A3}"),
            format!("{A1} {A2} edge agent.h2 interface {A1}"),
            format!("{A3} {A2} edge agent.h2 interface {A3}"),
            format!("{A1} {BROADCAST} edge agent.h2 interface {A1}"),
            format!("{A3} {BROADCAST} edge agent.h2 interface {A3}"),
            format!("{A2} {BROADCAST} interface {A1} edge agent.h2"),
            format!("{A2} {BROADCAST} interface {A3} edge agent.h2"),
            // network b: B1 here, B2 on h3
            format!("any {B1} interface {B1} edge"),
            format!("{B1} {B2} edge agent.h3 interface {B1}"),
            format!("{B1} {BROADCAST} edge agent.h3 interface {B1}"),
            format!("{B2} {BROADCAST} interface {B1} edge agent.h3"),
        ]
        .into_iter()
        .collect();
        assert_eq!(d.routes, want);
        // Nothing crosses networks: no rule has an a-guest and a b-guest.
        for r in &d.routes {
            let a = [A1, A2, A3].iter().any(|m| r.contains(m));
            let b = [B1, B2].iter().any(|m| r.contains(m));
            assert!(!(a && b), "{r}");
        }
    }

    #[test]
    fn remote_members_addresses_are_bound_here_and_a_later_claim_of_one_is_refused() {
        let mut o = overlay();
        let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
        o.get_mut(A2).unwrap().ips = vec![ip("10.1.0.2"), ip("fd00::a2")];
        o.get_mut(A2).unwrap().since = 5;
        o.get_mut(B2).unwrap().ips = vec![ip("10.2.0.2")];
        // A1 (here) says it holds A2's address too, claimed later: refused.
        o.get_mut(A1).unwrap().ips = vec![ip("10.1.0.1"), ip("10.1.0.2")];
        o.get_mut(A1).unwrap().since = 9;
        let d = derive("h1", &hosts(3), &o, &local("h1"));
        let want: BTreeMap<IpAddr, String> =
            [(ip("10.1.0.2"), A2.to_string()), (ip("fd00::a2"), A2.to_string()), (ip("10.2.0.2"), B2.to_string())].into();
        assert_eq!(d.neigh, want, "remote members of h1's networks, not h1's own");
        assert_eq!(d.ip_conflicts, vec![(ip("10.1.0.2"), A1.to_string())]);
        // h2 has network a only: B2's address is not bound there.
        let d2 = derive("h2", &hosts(3), &o, &local("h2"));
        assert!(!d2.neigh.contains_key(&ip("10.2.0.2")) && d2.neigh.get(&ip("10.1.0.1")) == Some(&A1.to_string()));
        // The plan: only what differs, never a user's address.
        let have: BTreeMap<IpAddr, String> = [(ip("10.1.0.2"), A2.to_string()), (ip("10.9.9.9"), B1.to_string())].into();
        let users: BTreeSet<IpAddr> = [ip("10.2.0.2")].into();
        let p = plan_neigh(&d, &have, &users);
        assert_eq!(p, [format!("NEIGH DEL 10.9.9.9"), format!("NEIGH ADD fd00::a2 {A2} owner agent")]);
    }

    #[test]
    fn a_host_with_no_member_of_a_network_gets_nothing_of_it() {
        let d = derive("h2", &hosts(3), &overlay(), &local("h2"));
        assert_eq!(d.links.iter().map(|l| l.name.as_str()).collect::<Vec<_>>(), ["agent.h1"]);
        assert!(d.routes.iter().all(|r| !r.contains(B1) && !r.contains(B2)));
        assert!(derive("h4", &hosts(4), &overlay(), &BTreeMap::new()).routes.is_empty());
    }

    #[test]
    fn guests_of_an_unregistered_host_are_not_routed() {
        let mut hs = hosts(3);
        hs.remove("h3");
        let d = derive("h1", &hs, &overlay(), &local("h1"));
        assert!(d.routes.iter().all(|r| !r.contains(B2) && !r.contains("agent.h3")));
        assert!(!d.links.iter().any(|l| l.name == "agent.h3"));
    }

    #[test]
    fn the_plan_changes_only_what_differs_and_never_a_users_route() {
        let d = derive("h1", &hosts(3), &overlay(), &local("h1"));
        // Nothing yet: every link, then every route.
        let all = plan(&d, &BTreeMap::new(), &BTreeSet::new(), &BTreeSet::new());
        assert_eq!(all.iter().filter(|l| l.starts_with("LINK ADD")).count(), 2);
        assert_eq!(all.iter().filter(|l| l.starts_with("ROUTE ADD")).count(), d.routes.len());
        assert!(all.iter().position(|l| l.starts_with("ROUTE ADD")) > all.iter().position(|l| l.starts_with("LINK ADD")));
        // All there: nothing to do.
        let links: BTreeMap<String, (IpAddr, u16, Option<String>)> = d.links.iter().map(|l| (l.name.clone(), (l.underlay, l.port, None))).collect();
        let mut routes: BTreeSet<String> = d.routes.clone();
        assert!(plan(&d, &links, &routes, &BTreeSet::new()).is_empty());
        // A stale route of ours goes; a user's identical rule is not added twice.
        routes.insert("any 02:00:00:00:00:99 edge agent.h2 any".into());
        let user_has = d.routes.iter().next().unwrap().clone();
        routes.remove(&user_has);
        let p = plan(&d, &links, &routes, &[user_has].into_iter().collect());
        assert_eq!(p, ["ROUTE DEL any 02:00:00:00:00:99 edge agent.h2 any"]);
        // h2 moved to another address: its link is replaced, with its routes.
        let mut hs = hosts(3);
        hs.get_mut("h2").unwrap().underlay = "198.18.1.2".parse().unwrap();
        let d2 = derive("h1", &hs, &overlay(), &local("h1"));
        let routes = d.routes.clone();
        let p = plan(&d2, &links, &routes, &BTreeSet::new());
        let h2_routes = d.routes.iter().filter(|r| r.contains("agent.h2")).count();
        assert_eq!(p.iter().filter(|l| l.starts_with("ROUTE DEL")).count(), h2_routes);
        assert_eq!(p.iter().filter(|l| l.starts_with("ROUTE ADD")).count(), h2_routes);
        assert!(p.contains(&"LINK DEL agent.h2".to_string()));
        assert!(p.contains(&"LINK ADD 198.18.1.2 9000 udp name agent.h2".to_string()));
    }

    #[test]
    fn encrypting_hosts_link_by_wireguard_to_hosts_with_keys_and_never_in_clear() {
        let k2 = "yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBmk=".to_string();
        let k3 = "bOM+nlWQf25zDapmoDynjD1tTzJ5zEF8A3y7pWklvEQ=".to_string();
        let mut hs = hosts(3);
        hs.get_mut("h2").unwrap().wireguard = Some((51820, k2.clone()));
        // h3 publishes no key: an encrypting h1 makes no link to it (and no
        // route through one); a plain h1 links to both by UDP.
        let d = derive("h1", &hosts_for(&hs, true), &overlay(), &local("h1"));
        let links: Vec<String> = d.links.iter().map(LinkWant::command).collect();
        assert_eq!(links, [format!("LINK ADD 198.18.0.2 51820 wireguard {k2} name agent.h2")]);
        assert!(d.routes.iter().all(|r| !r.contains("agent.h3")));
        let plain = derive("h1", &hosts_for(&hs, false), &overlay(), &local("h1"));
        assert!(plain.links.iter().all(|l| l.key.is_none() && l.port == 9000) && plain.links.len() == 2);
        // h2's key changes (a rotation): its link is replaced, with its routes
        // deleted first and added back after it.
        let have: BTreeMap<String, (IpAddr, u16, Option<String>)> =
            [("agent.h2".to_string(), ("198.18.0.2".parse().unwrap(), 51820, Some(k3.clone())))].into();
        let routes = d.routes.clone();
        let req = plan(&d, &have, &routes, &BTreeSet::new());
        let at = |p: &str| req.iter().position(|l| l.starts_with(p)).unwrap();
        assert!(at("ROUTE DEL") < at("LINK DEL agent.h2") && at("LINK DEL agent.h2") < at("LINK ADD") && at("LINK ADD") < at("ROUTE ADD"), "{req:?}");
        assert!(req.contains(&format!("LINK ADD 198.18.0.2 51820 wireguard {k2} name agent.h2")));
        // The same key: nothing to do.
        let same: BTreeMap<_, _> = [("agent.h2".to_string(), ("198.18.0.2".parse().unwrap(), 51820, Some(k2.clone())))].into();
        assert!(plan(&d, &same, &routes, &BTreeSet::new()).is_empty());
        assert!(check_wireguard_key(&k2).is_ok());
        for bad in ["", "short=", "yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBm=k", "yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBm k="] {
            assert!(check_wireguard_key(bad).is_err(), "{bad}");
        }
    }
}
