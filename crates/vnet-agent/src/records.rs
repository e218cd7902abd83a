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

/// `<p>/host/<host>/guests/<mac>/<epoch>`: the host's claim of the guest
/// with `mac`, made at one time (`epoch`, 16 hex digits of its own): a host
/// claims anew, under a new epoch, each time a guest with that MAC starts
/// on it.
pub fn guest_key(prefix: &str, host: &str, mac: &str, epoch: &str) -> String {
    format!("{prefix}/host/{host}/guests/{mac}/{epoch}")
}

/// A new epoch for a claim: microseconds of the wall clock, in 16 hex
/// digits (unique per host and MAC; its order means nothing to readers).
pub fn new_epoch() -> String {
    let us = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64);
    format!("{us:016x}")
}

/// Whether `e` is an epoch as `new_epoch` spells them.
pub fn check_epoch(e: &str) -> bool {
    e.len() == 16 && e.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
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
    /// Host, MAC, epoch.
    Guest(&'a str, &'a str, &'a str),
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
            _ => {
                let (mac, epoch) = what.strip_prefix("guests/")?.split_once('/')?;
                Some(Record::Guest(host, mac, epoch))
            }
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

/// `<p>/host/<host>/guests/<mac>/<epoch>`: the network the host's guest is
/// in, and whether the host let the MAC go since (the guest left it).
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct GuestValue {
    pub network: String,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub released: bool,
    /// The addresses the guest holds (what it said of itself to its host's
    /// vnetd, `INTERFACE LIST`'s `ips=`): other hosts answer ARP and
    /// neighbour solicitations for them locally (`NEIGH`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ips: Vec<IpAddr>,
}

/// Addresses a guest may publish at most (vnetd learns no more).
pub const MAX_IPS: usize = 16;

/// The addresses of a claim that a reader takes: unicast ones, at most
/// `MAX_IPS` (a bad writer's others are ignored).
pub fn usable_ips(ips: &[IpAddr]) -> Vec<IpAddr> {
    let mut out: Vec<IpAddr> = Vec::new();
    for ip in ips.iter().map(|i| i.to_canonical()) {
        let unicast = match ip {
            IpAddr::V4(a) => !(a.is_unspecified() || a.is_broadcast() || a.is_multicast() || a.is_loopback()),
            IpAddr::V6(a) => !(a.is_unspecified() || a.is_multicast() || a.is_loopback()),
        };
        if unicast && !out.contains(&ip) && out.len() < MAX_IPS {
            out.push(ip);
        }
    }
    out
}

/// One claim of a MAC as a reader saw it: whose, its network, the
/// revisions etcd created and last changed its key at (for a released
/// claim, the change is its release), and whether it is released.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimSeen {
    pub network: String,
    pub create_revision: i64,
    pub mod_revision: i64,
    pub released: bool,
    pub ips: Vec<IpAddr>,
}

/// Every claim of one MAC, by (host, epoch).
pub type Claims = BTreeMap<(String, String), ClaimSeen>;

/// Who holds a MAC.
#[derive(Debug, PartialEq, Eq)]
pub enum Holding<'a> {
    /// This claim of this host's.
    Held(&'a str, &'a ClaimSeen),
    /// Nobody: the last holder let it go and no claim has been made since.
    Free,
    /// The holder's host is gone (its registration's lease ran out) without
    /// letting the MAC go: nobody may take it until that host comes back
    /// (and lets it go, or holds it again) or an administrator releases it
    /// (`vnet-agent release`). Fail closed: a host gone is not a hand-over.
    Stranded(&'a str),
}

/// Who holds a MAC, from its claims alone (every reader, whenever it reads,
/// gets the same answer). A MAC's holders form a chain: the first is the
/// claim etcd created first; each next one is the first claim created after
/// the one before was released (released: the key rewritten so, which only
/// its own host can do). A claim made while another held the MAC is never
/// on the chain: it does not take the MAC when the holder lets it go, as it
/// did when the oldest claim simply won (a host could claim any MAC ahead
/// of time and take it at the guest's next migration). A claim counts while
/// its host is registered (`alive`).
pub fn holder<'a>(claims: &'a Claims, alive: impl Fn(&str) -> bool) -> Holding<'a> {
    match chain(claims).find(|(_, c)| !c.released) {
        Some(((host, _), c)) => {
            if alive(host) {
                Holding::Held(host, c)
            } else {
                Holding::Stranded(host)
            }
        }
        None => Holding::Free,
    }
}

/// The chain of a MAC's holders, oldest first (`holder`): the released ones
/// that held it in turn, then the one that holds it now, if any.
pub fn chain(claims: &Claims) -> impl Iterator<Item = (&(String, String), &ClaimSeen)> {
    let first = move |after: i64| claims.iter().filter(move |(_, c)| c.create_revision > after).min_by_key(|(_, c)| c.create_revision);
    let mut cur = first(i64::MIN);
    std::iter::from_fn(move || {
        let here = cur?;
        cur = if here.1.released { first(here.1.mod_revision) } else { None };
        Some(here)
    })
}

/// Whether the released claim `key` can go without changing any reader's
/// answer: no other claim was made while it held the MAC (one that was,
/// would then come first), and, if it keeps addresses (`ips`), the host
/// the guest went to has had them: its next holder, another host, came
/// with addresses of its own or took these (it may have claimed before it
/// saw the release, and the release is where it finds them), or, with no
/// claim after it yet, the hand-over window since the release has passed
/// (`waited_out`: a migration's new host may read the release before it
/// claims; a guest that went for good leaves its release no longer). The
/// host that made it deletes it then.
pub fn can_forget(claims: &Claims, key: &(String, String), waited_out: bool) -> bool {
    let Some(c) = claims.get(key).filter(|c| c.released) else { return false };
    if claims.iter().any(|(k, o)| k != key && o.create_revision > c.create_revision && o.create_revision < c.mod_revision) {
        return false;
    }
    if c.ips.is_empty() || waited_out {
        return true;
    }
    let next = claims.iter().filter(|(_, o)| o.create_revision > c.mod_revision).min_by_key(|(_, o)| o.create_revision);
    match next {
        Some(((h, _), n)) => h == &key.0 || !n.ips.is_empty(),
        None => false,
    }
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
        assert_eq!(
            Record::parse(p, &guest_key(p, "h1", "02:00:00:00:00:0b", "0000018c2f3a4b5c")),
            Some(Record::Guest("h1", "02:00:00:00:00:0b", "0000018c2f3a4b5c"))
        );
        assert_eq!(Record::parse(p, &traffic_key(p, "h1")), Some(Record::Traffic("h1")));
        assert!(host_prefix(p, "h1").starts_with(p) && reg_key(p, "h10").starts_with(&host_prefix(p, "h10")));
        assert!(!reg_key(p, "h10").starts_with(&host_prefix(p, "h1")), "h1's prefix is not h10's");
        for k in ["/vnet/hosts/h1", "/vnet/host/h1", "/vnet/host/h1/other", "/vnetx/host/h1/reg", "/vnet/host/h1/guestsx", "/vnet/host/h1/guests/02:00:00:00:00:0b"] {
            assert_eq!(Record::parse(p, k), None, "{k}");
        }
    }

    fn claim(created: i64, released_at: Option<i64>) -> ClaimSeen {
        ClaimSeen { network: "a".into(), create_revision: created, mod_revision: released_at.unwrap_or(created), released: released_at.is_some(), ips: Vec::new() }
    }

    fn claims(list: &[(&str, ClaimSeen)]) -> Claims {
        list.iter().map(|(h, c)| ((h.to_string(), format!("{:016x}", c.create_revision)), c.clone())).collect()
    }

    fn held(c: &Claims) -> Option<&str> {
        match holder(c, |_| true) {
            Holding::Held(h, _) => Some(h),
            _ => None,
        }
    }

    #[test]
    fn the_first_claim_holds_a_mac_whoever_claims_it_later() {
        let c = claims(&[("h3", claim(9, None)), ("h1", claim(4, None))]);
        assert_eq!(held(&c), Some("h1"));
        assert_eq!(holder(&Claims::new(), |_| true), Holding::Free);
    }

    #[test]
    fn a_claim_made_while_another_held_the_mac_never_takes_it() {
        // h2 held it from 4; h3 claimed at 9 while it did (a rogue, a clone);
        // h2 let it go at 12 (its guest migrated); h1 claimed at 14.
        let c = claims(&[("h2", claim(4, Some(12))), ("h3", claim(9, None)), ("h1", claim(14, None))]);
        assert_eq!(held(&c), Some("h1"), "the waiting claim took the MAC at the hand-over");
        // Before h1's claim the MAC is free, not h3's.
        let c = claims(&[("h2", claim(4, Some(12))), ("h3", claim(9, None))]);
        assert_eq!(holder(&c, |_| true), Holding::Free);
        // And later: h1 lets it go at 20, h2 claims again at 22 (migrated back).
        let c = claims(&[("h2", claim(4, Some(12))), ("h3", claim(9, None)), ("h1", claim(14, Some(20))), ("h2", claim(22, None))]);
        assert_eq!(held(&c), Some("h2"));
    }

    #[test]
    fn a_holder_whose_host_is_gone_strands_the_mac_and_a_released_claim_is_forgotten_only_when_nothing_waited() {
        let c = claims(&[("h2", claim(4, None)), ("h3", claim(9, None))]);
        assert_eq!(holder(&c, |h| h != "h2"), Holding::Stranded("h2"), "a host gone handed the MAC over");
        let c = claims(&[("h2", claim(4, Some(12))), ("h3", claim(9, None)), ("h1", claim(14, None))]);
        let k = |h: &str, r: i64| (h.to_string(), format!("{r:016x}"));
        assert!(!can_forget(&c, &k("h2", 4), false), "forgetting it would hand the MAC to h3");
        assert!(!can_forget(&c, &k("h2", 4), true), "nor once its hand-over window passed");
        assert!(!can_forget(&c, &k("h1", 14), true), "not released");
        let c = claims(&[("h2", claim(4, Some(12))), ("h1", claim(14, None))]);
        assert!(can_forget(&c, &k("h2", 4), false));
        let mut c = c;
        c.remove(&k("h2", 4));
        assert_eq!(held(&c), Some("h1"));
    }

    #[test]
    fn a_release_is_kept_until_the_next_holder_has_taken_its_addresses() {
        let k = |h: &str, r: i64| (h.to_string(), format!("{r:016x}"));
        let ip = |s: &str| vec![s.parse::<IpAddr>().expect("an address")];
        // h2 held it from 4 with 198.19.0.12 and let it go at 12; h3 claimed
        // at 14 before it saw the release, so with no addresses.
        let mut h2 = claim(4, Some(12));
        h2.ips = ip("198.19.0.12");
        let c = claims(&[("h2", h2.clone()), ("h3", claim(14, None))]);
        assert!(!can_forget(&c, &k("h2", 4), false), "h3 would never learn the address g12 held");
        // Nobody claimed it yet: kept for the host it goes to, which may read
        // it before it claims (forgotten at once, as it was, the new host
        // found no release and came without the address), until the
        // hand-over window passed (a guest gone for good).
        let alone = claims(&[("h2", h2.clone())]);
        assert!(!can_forget(&alone, &k("h2", 4), false), "the next host would find nothing to inherit");
        assert!(can_forget(&alone, &k("h2", 4), true));
        // h3 wrote what it inherited: forgotten now.
        let mut h3 = claim(14, None);
        h3.ips = ip("198.19.0.12");
        let mut c = claims(&[("h2", h2.clone()), ("h3", h3)]);
        c.get_mut(&k("h3", 14)).expect("there").mod_revision = 15;
        assert!(can_forget(&c, &k("h2", 4), false));
        // A release with no addresses, or a next claim of the same host
        // (which inherits nothing of its own), holds nothing up.
        let c = claims(&[("h2", claim(4, Some(12))), ("h3", claim(14, None))]);
        assert!(can_forget(&c, &k("h2", 4), false));
        let c = claims(&[("h2", claim(4, Some(12)))]);
        assert!(can_forget(&c, &k("h2", 4), false));
        let c = claims(&[("h2", h2), ("h2", claim(14, None))]);
        assert!(can_forget(&c, &k("h2", 4), false));
    }
}
