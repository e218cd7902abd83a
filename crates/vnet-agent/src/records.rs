//! The records the overlay keeps in etcd, as every agent writes and reads
//! them: a host's registration, its guests' claims and its traffic
//! counters, all under the host's own prefix (keys and rules: `store.rs`
//! and docs/controller.md). Plain data with their JSON form, the keys'
//! layout and the rule that settles a MAC two hosts claim; no I/O.
//!
//! Everything a host writes is under `<p>/host/<host>/`, so etcd's RBAC can
//! let each host's agent write its own prefix and only read the rest
//! (`vnet-agent auth`): the key, not the value, says whose a record is.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::IpAddr;

/// `<p>/host/<host>/`: everything host `host` writes.
pub fn host_prefix(prefix: &str, host: &str) -> String {
    format!("{prefix}/host/{host}/")
}

/// `<p>/host/<host>/reg`: where the host's vnetd takes links.
pub fn reg_key(prefix: &str, host: &str) -> String {
    format!("{prefix}/host/{host}/reg")
}

/// `<p>/host/<host>/guests/<mac>`: the host claims the guest with `mac`.
pub fn guest_key(prefix: &str, host: &str, mac: &str) -> String {
    format!("{prefix}/host/{host}/guests/{mac}")
}

/// `<p>/host/<host>/traffic`: the host's published counters.
pub fn traffic_key(prefix: &str, host: &str) -> String {
    format!("{prefix}/host/{host}/traffic")
}

/// A key of the overlay, by what it is and whose. Names are as the key
/// spells them: the reader checks them.
#[derive(Debug, PartialEq, Eq)]
pub enum Record<'a> {
    Reg(&'a str),
    Guest(&'a str, &'a str),
    Traffic(&'a str),
}

impl<'a> Record<'a> {
    /// What `key` is, if it is one of the overlay's under `prefix`.
    pub fn parse(prefix: &str, key: &'a str) -> Option<Record<'a>> {
        let rest = key.strip_prefix(prefix)?.strip_prefix("/host/")?;
        let (host, what) = rest.split_once('/')?;
        match what {
            "reg" => Some(Record::Reg(host)),
            "traffic" => Some(Record::Traffic(host)),
            _ => Some(Record::Guest(host, what.strip_prefix("guests/")?)),
        }
    }
}

/// `<p>/host/<host>`: where a host's vnetd takes links.
#[derive(Serialize, Deserialize)]
pub struct HostValue {
    pub underlay: IpAddr,
    pub port: u16,
    /// Its vnetd's WireGuard side, if the host encrypts (`--encrypt`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wireguard: Option<WireGuardValue>,
}

/// Where and how a host takes WireGuard links: its vnetd's port and public key.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct WireGuardValue {
    pub port: u16,
    pub public_key: String,
}

/// `<p>/host/<host>/guests/<mac>`: the network the host's guest is in.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct GuestValue {
    pub network: String,
}

/// One host's claim of a MAC as a reader saw it: its network and the
/// revision etcd created the key at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimSeen {
    pub network: String,
    pub create_revision: i64,
}

/// Which of the hosts claiming one MAC holds it: the claim etcd created
/// first (the lowest create revision; two keys are never created at the
/// same revision, as each revision is one write, and a transaction writes
/// one key of a host's only). A later claim waits, whoever makes it: no
/// host can take a MAC another holds; it gets it when that claim goes.
pub fn holder(claims: &BTreeMap<String, ClaimSeen>) -> Option<(&str, &ClaimSeen)> {
    claims.iter().min_by_key(|(h, c)| (c.create_revision, h.as_str())).map(|(h, c)| (h.as_str(), c))
}

/// Frames and bytes, one cell of the traffic matrix.
#[derive(Serialize, Deserialize, Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub frames: u64,
    pub bytes: u64,
}

impl Counts {
    pub fn add(&mut self, frames: u64, bytes: u64) {
        self.frames += frames;
        self.bytes += bytes;
    }
}

/// `<p>/host/<host>/traffic`: one host's published counters.
#[derive(Serialize, Deserialize, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Unix seconds when read.
    pub at: u64,
    /// Sent to each other host (unicast and broadcast).
    pub to_hosts: BTreeMap<String, Counts>,
    /// Sent from each local guest to each guest, by "src>dst" MAC.
    pub guests: BTreeMap<String, Counts>,
    /// Claims this host's agent has seen of a MAC another host held
    /// (ignored: `holder`), since the agent started.
    #[serde(default)]
    pub contested: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_say_whose_they_are() {
        let p = "/vnet";
        assert_eq!(Record::parse(p, &reg_key(p, "h1")), Some(Record::Reg("h1")));
        assert_eq!(Record::parse(p, &guest_key(p, "h1", "02:00:00:00:00:0b")), Some(Record::Guest("h1", "02:00:00:00:00:0b")));
        assert_eq!(Record::parse(p, &traffic_key(p, "h1")), Some(Record::Traffic("h1")));
        assert!(host_prefix(p, "h1").starts_with(p) && reg_key(p, "h10").starts_with(&host_prefix(p, "h10")));
        assert!(!reg_key(p, "h10").starts_with(&host_prefix(p, "h1")), "h1's prefix is not h10's");
        for k in ["/vnet/hosts/h1", "/vnet/host/h1", "/vnet/host/h1/other", "/vnetx/host/h1/reg", "/vnet/host/h1/guestsx"] {
            assert_eq!(Record::parse(p, k), None, "{k}");
        }
    }

    #[test]
    fn the_first_claim_holds_a_mac_whoever_claims_it_later() {
        let c = |r| ClaimSeen { network: "a".into(), create_revision: r };
        let mut claims: BTreeMap<String, ClaimSeen> = [("h3".to_string(), c(9)), ("h1".to_string(), c(4))].into_iter().collect();
        assert_eq!(holder(&claims).map(|(h, _)| h), Some("h1"));
        claims.remove("h1");
        assert_eq!(holder(&claims).map(|(h, _)| h), Some("h3"), "the next claim once the first goes");
        claims.clear();
        assert_eq!(holder(&claims), None);
    }
}
