//! The overlay as a whole, from etcd: hosts, networks and guests, and the
//! traffic matrix between hosts and between guests, which each agent builds
//! from its vnetd's route counters and publishes under
//! `<p>/host/<host>/traffic` (the measurement VNET's adaptation work, VTTIF and
//! VADAPT, started from).
//!
//! A route of the agent's carries one guest's frames to one guest
//! (`s d edge agent.R interface s`, or `... interface d ...` here) or one
//! guest's broadcasts to one host, so its counters are the matrix's cells:
//! frames and bytes since the route was made (a migration makes new routes,
//! and so starts its guest's cells again).

use crate::model::{check_host_name, check_mac, LINK_PREFIX};
use crate::etcd::EtcdArgs;
use crate::records::{check_epoch, guest_key, holder, ClaimSeen, Claims, GuestValue, HostValue, Holding, Record, Traffic};
use crate::vnetd::State;
use anyhow::Result;
use etcd_client::GetOptions;
use std::collections::BTreeMap;

#[derive(clap::Args, Debug)]
pub struct ShowArgs {
    #[command(flatten)]
    etcd: EtcdArgs,
    /// Print JSON instead of tables.
    #[arg(short, long)]
    json: bool,
}

/// Builds this host's traffic from `STATS routes` lines and the agent's
/// routes in `state`.
pub fn traffic_of(state: &State, stats: &[String]) -> Traffic {
    let mut t = Traffic {
        at: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        ..Traffic::default()
    };
    for line in stats {
        let w: Vec<&str> = line.split(' ').collect();
        // `route <id> frames=.. bytes=.. fast_frames=.. rule=<the rule>`:
        // the agent's routes by their rule.
        let (Some(&"route"), Some((_, rule))) = (w.first(), line.split_once(" rule=")) else { continue };
        if !state.routes.contains(rule) {
            continue;
        }
        let num = |k: &str| w.iter().find_map(|x| x.strip_prefix(k)?.strip_prefix('=')?.parse::<u64>().ok()).unwrap_or(0);
        let (frames, bytes) = (num("frames"), num("bytes"));
        let r: Vec<&str> = rule.split(' ').collect();
        // Only rules sending a local guest's frames: source is `interface <s>`.
        let [src, dst, kind, to, "interface", s2] = r[..] else { continue };
        if src != s2 {
            continue;
        }
        if kind == "edge" {
            if let Some(host) = to.strip_prefix(LINK_PREFIX) {
                t.to_hosts.entry(host.to_string()).or_default().add(frames, bytes);
            }
        }
        if dst != crate::model::BROADCAST {
            t.guests.entry(format!("{src}>{dst}")).or_default().add(frames, bytes);
        }
    }
    t
}

/// A guest as shown: the host holding its MAC, and its network.
#[derive(serde::Serialize)]
struct Shown {
    host: String,
    network: String,
}

pub async fn show(args: ShowArgs) -> Result<()> {
    let mut client = args.etcd.connect().await?;
    let prefix = format!("{}/", args.etcd.prefix);
    let resp = client.get(prefix.clone(), Some(GetOptions::new().with_prefix())).await?;
    let mut hosts: BTreeMap<String, HostValue> = BTreeMap::new();
    let mut claimed: BTreeMap<String, Claims> = BTreeMap::new();
    let mut traffic: BTreeMap<String, Traffic> = BTreeMap::new();
    for kv in resp.kvs() {
        let key = String::from_utf8_lossy(kv.key());
        match Record::parse(&args.etcd.prefix, &key) {
            Some(Record::Reg(h)) => {
                if let (Ok(v), Ok(())) = (serde_json::from_slice(kv.value()), check_host_name(h)) {
                    hosts.insert(h.to_string(), v);
                }
            }
            Some(Record::Guest(h, m, e)) => {
                if let (Ok(v), Ok(m), Ok(()), true) = (serde_json::from_slice::<GuestValue>(kv.value()), check_mac(m), check_host_name(h), check_epoch(e)) {
                    let c = ClaimSeen {
                        network: v.network,
                        create_revision: kv.create_revision(),
                        mod_revision: kv.mod_revision(),
                        released: v.released,
                        ips: crate::records::usable_ips(&v.ips),
                    };
                    claimed.entry(m).or_default().insert((h.to_string(), e.to_string()), c);
                }
            }
            Some(Record::Traffic(h)) => {
                if let (Ok(v), Ok(())) = (serde_json::from_slice(kv.value()), check_host_name(h)) {
                    traffic.insert(h.to_string(), v);
                }
            }
            None => {}
        }
    }
    // Each MAC as the agents route it (its holder), and the claims that
    // wait behind another host's.
    let mut guests: BTreeMap<String, Shown> = BTreeMap::new();
    let mut contested: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut stranded: BTreeMap<String, String> = BTreeMap::new();
    for (m, claims) in &claimed {
        let (h, c) = match holder(claims, |h| hosts.contains_key(h)) {
            Holding::Held(h, c) => (h, c),
            Holding::Stranded(h) => {
                stranded.insert(m.clone(), h.to_string());
                continue;
            }
            Holding::Free => continue,
        };
        guests.insert(m.clone(), Shown { host: h.to_string(), network: c.network.clone() });
        let waiting: Vec<String> = claims.iter().filter(|(_, x)| !x.released && *x != c).map(|((h, _), _)| h.clone()).collect();
        if !waiting.is_empty() {
            contested.insert(m.clone(), waiting);
        }
    }
    let revision = resp.header().map_or(0, |h| h.revision());
    if args.json {
        let v = serde_json::json!({ "revision": revision, "hosts": hosts, "guests": guests, "contested": contested, "stranded": stranded, "traffic": traffic });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("overlay at etcd revision {revision}: {} hosts, {} guests", hosts.len(), guests.len());
    for (name, h) in &hosts {
        let n = guests.values().filter(|g| &g.host == name).count();
        println!("host {name} underlay={}:{} guests={n}", h.underlay, h.port);
    }
    for (m, waiting) in &contested {
        println!("contested {m} held by {}, also claimed by {} (ignored)", guests[m].host, waiting.join(" "));
    }
    for (m, h) in &stranded {
        println!("stranded {m} held by {h}, which is gone (vnet-agent release {h} {m} lets it go)");
    }
    let mut nets: BTreeMap<&str, Vec<(&String, &Shown)>> = BTreeMap::new();
    for (m, g) in &guests {
        nets.entry(g.network.as_str()).or_default().push((m, g));
    }
    for (net, members) in &nets {
        let list: Vec<String> = members.iter().map(|(m, g)| format!("{m}@{}", g.host)).collect();
        println!("network {net} guests={} {}", members.len(), list.join(" "));
    }
    if !traffic.is_empty() {
        println!("traffic between hosts (bytes sent, row to column, since the routes were made):");
        let names: Vec<&String> = hosts.keys().collect();
        println!("{:>12} {}", "", names.iter().map(|n| format!("{n:>14}")).collect::<String>());
        for from in &names {
            let row: String = names
                .iter()
                .map(|to| match traffic.get(*from).and_then(|t| t.to_hosts.get(*to)) {
                    _ if from == to => format!("{:>14}", "-"),
                    Some(c) => format!("{:>14}", c.bytes),
                    None => format!("{:>14}", 0),
                })
                .collect();
            println!("{from:>12} {row}");
        }
        println!("traffic between guests (frames and bytes sent):");
        for (host, t) in &traffic {
            for (pair, c) in &t.guests {
                println!("{pair} via {host} frames={} bytes={}", c.frames, c.bytes);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vnetd::parse_state;
    use crate::records::Counts;

    #[test]
    fn route_counters_become_matrix_cells() {
        let listing: Vec<String> = [
            "route 1 02:00:00:00:00:0b 02:00:00:00:00:0c edge agent.h2 interface 02:00:00:00:00:0b owner agent",
            "route 2 02:00:00:00:00:0b ff:ff:ff:ff:ff:ff edge agent.h2 interface 02:00:00:00:00:0b owner agent",
            "route 3 02:00:00:00:00:0b 02:00:00:00:00:0d interface 02:00:00:00:00:0d interface 02:00:00:00:00:0b owner agent",
            "route 4 any 02:00:00:00:00:0b interface 02:00:00:00:00:0b edge owner agent",
            "route 5 any 02:00:00:00:00:0c edge agent.h2 any",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let state = parse_state(&listing).unwrap();
        let stats: Vec<String> = [
            "route 1 frames=10 bytes=1000 fast_frames=4 rule=02:00:00:00:00:0b 02:00:00:00:00:0c edge agent.h2 interface 02:00:00:00:00:0b",
            "route 2 frames=2 bytes=120 fast_frames=0 rule=02:00:00:00:00:0b ff:ff:ff:ff:ff:ff edge agent.h2 interface 02:00:00:00:00:0b",
            "route 3 frames=5 bytes=500 fast_frames=0 rule=02:00:00:00:00:0b 02:00:00:00:00:0d interface 02:00:00:00:00:0d interface 02:00:00:00:00:0b",
            "route 4 frames=7 bytes=700 fast_frames=0 rule=any 02:00:00:00:00:0b interface 02:00:00:00:00:0b edge",
            "route 5 frames=99 bytes=9900 fast_frames=0 rule=any 02:00:00:00:00:0c edge agent.h2 any",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let t = traffic_of(&state, &stats);
        assert_eq!(t.to_hosts["h2"], Counts { frames: 12, bytes: 1120 }, "unicast and broadcast to h2; not a user's route");
        assert_eq!(t.to_hosts.len(), 1);
        assert_eq!(t.guests["02:00:00:00:00:0b>02:00:00:00:00:0c"], Counts { frames: 10, bytes: 1000 });
        assert_eq!(t.guests["02:00:00:00:00:0b>02:00:00:00:00:0d"], Counts { frames: 5, bytes: 500 });
        assert_eq!(t.guests.len(), 2, "delivery from links is the receiver's side: not counted twice");
    }
}

#[derive(clap::Args, Debug)]
pub struct ReleaseArgs {
    #[command(flatten)]
    etcd: EtcdArgs,
    /// The host whose claims to release (etcd's RBAC lets its own agent or
    /// an administrator write them).
    host: String,
    /// The MACs to release; every one the host claims if none.
    macs: Vec<String>,
}

#[cfg(test)]
impl ReleaseArgs {
    pub fn for_test(url: &str, host: &str, macs: &[&str]) -> ReleaseArgs {
        let etcd = EtcdArgs { endpoints: vec![url.to_string()], prefix: "/vnet".into(), cacert: None, cert: None, key: None, user: None, password_file: None };
        ReleaseArgs { etcd, host: host.to_string(), macs: macs.iter().map(|m| m.to_string()).collect() }
    }
}

/// `vnet-agent release <host> [<mac>...]`: the host's claims rewritten as
/// released, as its agent does when a guest leaves: for a host gone for good
/// (its guests' MACs are stranded until then), or to move a guest by hand.
pub async fn release(args: ReleaseArgs) -> Result<()> {
    check_host_name(&args.host)?;
    let macs = args.macs.iter().map(|m| check_mac(m)).collect::<Result<Vec<_>>>()?;
    let mut client = args.etcd.connect().await?;
    let prefix = format!("{}/host/{}/guests/", args.etcd.prefix, args.host);
    let resp = client.get(prefix.clone(), Some(GetOptions::new().with_prefix())).await?;
    let mut done = 0;
    for kv in resp.kvs() {
        let key = String::from_utf8_lossy(kv.key()).into_owned();
        let Some(Record::Guest(_, m, e)) = Record::parse(&args.etcd.prefix, &key) else { continue };
        let Ok(mut v) = serde_json::from_slice::<GuestValue>(kv.value()) else { continue };
        let Ok(m) = check_mac(m) else { continue };
        if v.released || !check_epoch(e) || (!macs.is_empty() && !macs.contains(&m)) {
            continue;
        }
        v.released = true;
        client.put(guest_key(&args.etcd.prefix, &args.host, &m, e), serde_json::to_string(&v)?, None).await?;
        println!("released {m} of host {}", args.host);
        done += 1;
    }
    anyhow::ensure!(done > 0 || macs.is_empty(), "host {} holds no claim of {}", args.host, macs.join(" "));
    Ok(())
}
