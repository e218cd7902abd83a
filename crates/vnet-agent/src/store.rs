//! The overlay's state in etcd, as one agent keeps it: its host's
//! registration on a lease, its guests' claims, and a cache of everyone's
//! keys kept current by a watch.
//!
//! Keys (under `--prefix`, default `/vnet`; each host writes only its own
//! `<p>/host/<host>/`, which etcd's RBAC enforces: `auth.rs`), values JSON:
//!
//! ```text
//! <p>/host/<host>/reg                     {"underlay": "198.18.0.1", "port": 9000}   on the host's lease
//! <p>/host/<host>/guests/<mac>/<epoch>    {"network": "blue"}                        (released: "released": true)
//! <p>/host/<host>/traffic                 counters (show.rs)                         on the host's lease
//! ```
//!
//! A host claims a MAC when a guest with it starts there (its vnetd gets the
//! interface; a VM's rings start), under a new epoch each time, and
//! releases the claim (rewrites it `released`) when the guest leaves. Who
//! holds a MAC follows from the claims alone (`records::holder`): the first
//! claim, then after each release the first claim made after it. So a claim
//! made while another host held the MAC never takes it: it is counted
//! (`contested`) and ignored for good, and a migration hands the MAC to the
//! claim its new host makes when the guest starts there. A claim counts
//! only while its host is registered: when a host's agent dies, its lease
//! and registration go, and its guests' MACs are held by nobody ("stranded")
//! until it comes back or an administrator releases them (`vnet-agent
//! release`); a host gone does not hand its guests over. Claims are not on
//! the lease, so that a stranded claim stays to say so.
//!
//! When etcd is unreachable, the cache is kept and nothing is changed; a
//! watch that broke goes on from the last revision seen, and only when it
//! cannot (etcd compacted past it) does the agent list the prefix again
//! (`session.rs`). This host's own writes are in `claims.rs`.

mod claims;
mod session;

use crate::etcd::EtcdArgs;
use crate::lease::Lease;
use crate::model::{Guest, Host};
use crate::records::{check_epoch, holder, usable_ips, ClaimSeen, Claims, GuestValue, HostValue, Holding, Record, Traffic};
use etcd_client::{Client, EventType, WatchStream};
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// The longest a write of a guest's record may take before it is given up
/// and made again (under the same key, so nothing is written twice): a
/// proposal the dying leader took with it waits etcd's own request timeout
/// (7 s with the default 1-s election) before it fails, while the next
/// leader is elected in 1-2 s.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(2);

/// How long after its guest started a host's claim may be made again when
/// the MAC's holder let it go after the claim was made (a migration whose
/// new host claimed before the old one released): longer, and the claim is
/// one that waited behind a holder, which never takes a MAC
/// (`--handover-ms`).
pub const HANDOVER: Duration = Duration::from_secs(30);

/// This host's claim on a local interface's MAC.
#[derive(Clone, Debug)]
struct Claim {
    /// The vnetd interface id it is for.
    iface: u32,
    network: String,
    /// The epoch of its record in etcd, once written.
    epoch: Option<String>,
    /// The epoch of a write whose answer did not come (etcd may have
    /// committed it): a retry writes the same key, so a claim is never made
    /// twice behind itself.
    trying: Option<String>,
    /// When the guest started here (the interface was first seen), or,
    /// once its claim is written, when etcd took it: a migration's hand-over
    /// window runs from then, so an etcd slow to take writes (or an agent
    /// slow to get to them) does not close it before it opens.
    since: Instant,
    /// Another claim holds the MAC (logged once).
    waiting: bool,
    /// The addresses its record says the guest holds.
    ips: Vec<IpAddr>,
}

pub struct View<'a> {
    pub hosts: &'a BTreeMap<String, Host>,
    pub guests: &'a BTreeMap<String, Guest>,
    /// The guests of each network, and the guests that say they hold each
    /// address (indexes of `guests`).
    pub by_net: &'a BTreeMap<String, BTreeSet<String>>,
    pub by_ip: &'a BTreeMap<IpAddr, BTreeSet<String>>,
    pub revision: i64,
}

/// This host as the store registers it.
#[derive(Clone, Debug)]
pub struct Registration {
    /// This host's name in the overlay (unique).
    pub host: String,
    /// Where other hosts' vnetds reach this one's links.
    pub underlay: IpAddr,
    pub port: u16,
    /// Its vnetd's WireGuard port and public key, published when the agent
    /// encrypts.
    pub wireguard: Option<(u16, String)>,
    /// Seconds the registration lives without the agent.
    pub ttl: i64,
}

pub struct Store {
    etcd: EtcdArgs,
    me: Registration,
    client: Option<Client>,
    /// The registration's lease, kept alive by a task of its own.
    lease: Option<Lease>,
    /// Notified when the lease's task has news (it expired, or a
    /// keep-alive failed): the agent looks at once.
    pub attention: std::sync::Arc<tokio::sync::Notify>,
    watch: Option<WatchStream>,
    /// The cache is a true copy of etcd as of `revision` (listed, then
    /// followed by the watch); None until the first listing.
    revision: Option<i64>,
    hosts: BTreeMap<String, Host>,
    /// Every host's claims, by MAC.
    claimed: BTreeMap<String, Claims>,
    /// The MACs each host has claims of (a host's registration coming or
    /// going touches these alone).
    by_host: BTreeMap<String, BTreeSet<String>>,
    /// Each MAC's holder, as the model wants them.
    routed: BTreeMap<String, Guest>,
    claims: BTreeMap<String, Claim>,
    retry_at: Instant,
    /// The registration's value changed (a new WireGuard key): written again.
    reregister: bool,
    /// A change this host routes by (a guest of one of its networks, or
    /// of an address one of them holds; a claim of ours) since
    /// `take_dirty` was last asked.
    dirty: bool,
    /// The networks such changes were in (`take_dirty_networks`), or all.
    dirty_nets: BTreeSet<String>,
    dirty_all: bool,
    /// The routed guests of each network.
    by_net: BTreeMap<String, BTreeSet<String>>,
    /// How many times a host's registration came, went or changed.
    pub hosts_changed: u64,
    /// MACs whose claims changed, and hosts whose registration did, since
    /// the last `rebuild` (which looks at these alone); or everything.
    touched: BTreeSet<String>,
    touched_hosts: BTreeSet<String>,
    touched_all: bool,
    /// Claims changed: some released claim of ours may be forgotten now.
    forget_due: bool,
    /// Our releases, by MAC and epoch, and when their hand-over window ends
    /// (`can_forget`: a release that keeps its guest's addresses stays that
    /// long for the host the guest goes to); from the release, or from when
    /// this agent first saw it (one listed at a start).
    kept_until: BTreeMap<(String, String), Instant>,
    /// The first of those ends still to come: a pass then looks again.
    forget_at: Option<Instant>,
    /// Claims of ours given up and not yet written so (a write that timed
    /// out): MAC and epoch → the network to release it in (a guest moved
    /// to another network), or nothing to delete it (a claim made again
    /// after a hand-over, which the old one only waits behind). Written
    /// at each `publish` until done, and never taken as ours meanwhile.
    given_up: BTreeMap<(String, String), Option<String>>,
    /// Which routed guests say they hold each address.
    by_ip: BTreeMap<IpAddr, BTreeSet<String>>,
    /// Claims seen waiting behind another host's: MAC → (host, create
    /// revision), each counted once in `contested`.
    seen_waiting: BTreeMap<String, BTreeSet<(String, i64)>>,
    pub contested: u64,
    /// MACs whose holder's host is gone (logged once).
    stranded: BTreeSet<String>,
    /// The hand-over window (`HANDOVER` unless set).
    pub handover: Duration,
    /// The traffic counters last written (their time left out).
    traffic_sent: Option<Traffic>,
    /// The endpoint to connect to first (the last one that answered; the
    /// next after a failure).
    endpoint_at: usize,
    /// Our lease, between a connection lost and the next one.
    lease_id: Option<i64>,
    /// Failed tries at etcd in a row (`backoff`).
    failures: u32,
    /// Some guest's holder changed (`take_moved`).
    moved: bool,
    /// A write of `publish` failed: when to try again (a pass then, even
    /// if nothing else changes).
    publish_retry: Option<Instant>,
    /// How long a write is given (`WRITE_TIMEOUT`, doubled after each
    /// write given up, back after one answered).
    write_timeout: Duration,
    /// The watch cannot go on from the last revision seen (etcd compacted
    /// past it, or a member is behind it): the overlay is listed again.
    relist_needed: bool,
    /// How many times the overlay was listed (`relist`).
    listings: u64,
}

impl Store {
    pub fn new(etcd: &EtcdArgs, me: Registration) -> Store {
        // Agents start at different members (by their host's name), so
        // that a thousand hosts' watches are not all one member's work.
        let start = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            me.host.hash(&mut h);
            (h.finish() % etcd.endpoints.len().max(1) as u64) as usize
        };
        Store {
            etcd: etcd.clone(),
            me,
            client: None,
            lease: None,
            watch: None,
            revision: None,
            hosts: BTreeMap::new(),
            claimed: BTreeMap::new(),
            by_host: BTreeMap::new(),
            routed: BTreeMap::new(),
            claims: BTreeMap::new(),
            retry_at: Instant::now(),
            reregister: false,
            dirty: true,
            dirty_nets: BTreeSet::new(),
            dirty_all: true,
            by_net: BTreeMap::new(),
            hosts_changed: 0,
            touched: BTreeSet::new(),
            touched_hosts: BTreeSet::new(),
            touched_all: true,
            forget_due: true,
            kept_until: BTreeMap::new(),
            forget_at: None,
            given_up: BTreeMap::new(),
            by_ip: BTreeMap::new(),
            seen_waiting: BTreeMap::new(),
            contested: 0,
            stranded: BTreeSet::new(),
            handover: HANDOVER,
            traffic_sent: None,
            // Agents start at different members (by their host's name), so
            // that a thousand hosts' watches are not all one member's work.
            endpoint_at: start,
            lease_id: None,
            attention: Default::default(),
            failures: 0,
            moved: true,
            publish_retry: None,
            write_timeout: WRITE_TIMEOUT,
            relist_needed: true,
            listings: 0,
        }
    }

    /// When `maintain` has work next: the lease's keep-alive (at a third
    /// of its life), or another try at etcd after a failure. The agent
    /// wakes for it alone, so that an idle agent wakes no more than its
    /// lease needs.
    pub fn due(&self) -> Instant {
        // Connected, registered and watching: nothing is due (the lease's
        // task keeps it alive, and says when it cannot) but a write to try
        // again; otherwise the next try at etcd.
        let due = match (&self.client, &self.lease, &self.watch) {
            (Some(_), Some(_), Some(_)) => self.retry_at.max(Instant::now() + Duration::from_secs(3600)),
            _ => self.retry_at,
        };
        [self.publish_retry, self.forget_at].into_iter().flatten().fold(due, Instant::min)
    }

    /// Whether a pass is wanted: the overlay changed, or a write of ours
    /// failed and is due again.
    pub fn wants_pass(&self) -> bool {
        let now = Instant::now();
        self.dirty || [self.publish_retry, self.forget_at].into_iter().flatten().any(|t| now >= t)
    }

    /// This host's WireGuard port and key as its vnetd has them now: a
    /// change is written to the registration at the next `maintain`.
    pub fn set_wireguard(&mut self, wg: (u16, String)) {
        if self.me.wireguard.as_ref() != Some(&wg) {
            tracing::info!("WireGuard key now {} (port {}): publishing it", wg.1, wg.0);
            self.me.wireguard = Some(wg);
            self.reregister = true;
        }
    }

    /// This host's registration record.
    fn reg_value(&self) -> anyhow::Result<String> {
        let wireguard = self.me.wireguard.clone().map(|(port, public_key)| crate::records::WireGuardValue { port, public_key });
        Ok(serde_json::to_string(&HostValue { underlay: self.me.underlay, port: self.me.port, wireguard })?)
    }

    /// Takes a key into the cache; true if it is a host's registration or
    /// a guest claim. A value that does not parse is ignored (and logged):
    /// one bad writer cannot stop the overlay.
    fn put_cached(&mut self, key: &str, value: &[u8], create_revision: i64, mod_revision: i64) -> bool {
        match Record::parse(&self.etcd.prefix, key) {
            Some(Record::Reg(name)) => match serde_json::from_slice::<HostValue>(value) {
                Ok(h)
                    if crate::model::check_host_name(name).is_ok()
                        && h.wireguard.as_ref().is_none_or(|w| crate::model::check_wireguard_key(&w.public_key).is_ok()) =>
                {
                    let wireguard = h.wireguard.map(|w| (w.port, w.public_key));
                    self.hosts.insert(name.to_string(), Host { underlay: h.underlay, port: h.port, wireguard });
                    self.touched_hosts.insert(name.to_string());
                    self.hosts_changed += 1;
                }
                _ => tracing::warn!("etcd: ignoring {key}: not a host entry"),
            },
            Some(Record::Guest(host, mac, epoch)) => match (serde_json::from_slice::<GuestValue>(value), crate::model::check_mac(mac)) {
                (Ok(g), Ok(mac))
                    if crate::model::check_host_name(host).is_ok() && crate::model::check_network(&g.network).is_ok() && check_epoch(epoch) =>
                {
                    let ips = usable_ips(&g.ips);
                    let c = ClaimSeen { network: g.network, create_revision, mod_revision, released: g.released, ips };
                    self.touched.insert(mac.clone());
                    self.forget_due = true;
                    self.by_host.entry(host.to_string()).or_default().insert(mac.clone());
                    self.claimed.entry(mac).or_default().insert((host.to_string(), epoch.to_string()), c);
                }
                _ => tracing::warn!("etcd: ignoring {key}: not a guest entry"),
            },
            Some(Record::Traffic(_)) | None => return false,
        }
        true
    }

    fn delete_cached(&mut self, key: &str) -> bool {
        match Record::parse(&self.etcd.prefix, key) {
            Some(Record::Reg(name)) => {
                self.hosts.remove(name);
                self.touched_hosts.insert(name.to_string());
                self.hosts_changed += 1;
            }
            Some(Record::Guest(host, mac, epoch)) => {
                let mac = mac.to_ascii_lowercase();
                self.touched.insert(mac.clone());
                self.forget_due = true;
                if let Some(c) = self.claimed.get_mut(&mac) {
                    c.remove(&(host.to_string(), epoch.to_string()));
                    if !c.keys().any(|(h, _)| h == host) {
                        if let Some(ms) = self.by_host.get_mut(host) {
                            ms.remove(&mac);
                            if ms.is_empty() {
                                self.by_host.remove(host);
                            }
                        }
                    }
                    if c.is_empty() {
                        self.claimed.remove(&mac);
                    }
                }
            }
            Some(Record::Traffic(_)) | None => return false,
        }
        true
    }

    /// At a listing: this host's own claims in etcd (an agent restarted)
    /// are taken back as they are, the newest of each MAC; the interfaces
    /// they were for are matched at the next `publish`, which releases the
    /// claims of guests no longer here.
    fn adopt_own_claims(&mut self) {
        let found: Vec<(String, String)> = self
            .claimed
            .keys()
            .filter(|mac| !self.claims.contains_key(*mac))
            .filter_map(|mac| self.own_claims(mac, None).into_iter().next().map(|e| (mac.clone(), e)))
            .collect();
        let since = Instant::now().checked_sub(self.handover).unwrap_or_else(Instant::now);
        for (mac, epoch) in found {
            let c = &self.claimed[&mac][&(self.me.host.clone(), epoch.clone())];
            let claim = Claim { iface: u32::MAX, network: c.network.clone(), epoch: Some(epoch), trying: None, since, waiting: false, ips: c.ips.clone() };
            self.claims.insert(mac, claim);
        }
    }

    /// Our unreleased claims of `mac` (in `network`, or any), never one we
    /// gave up (`given_up`), the one to take as ours first: the one that
    /// holds the MAC if one of ours does, else the oldest; the rest, which
    /// only wait (a write retried before `trying`, an early claim at a
    /// hand-over), after it by age.
    fn own_claims(&self, mac: &str, network: Option<&str>) -> Vec<String> {
        let Some(cl) = self.claimed.get(mac) else { return Vec::new() };
        let me = self.me.host.as_str();
        let mut own: Vec<(i64, &String)> = cl
            .iter()
            .filter(|((h, e), seen)| {
                h == me && !seen.released && network.is_none_or(|n| seen.network == n) && !self.given_up.contains_key(&(mac.to_string(), e.clone()))
            })
            .map(|((_, e), seen)| (seen.create_revision, e))
            .collect();
        own.sort();
        if let Holding::Held(h, first) = holder(cl, |h| self.hosts.contains_key(h)) {
            if let Some(i) = own.iter().position(|(r, _)| h == me && *r == first.create_revision) {
                let held = own.remove(i);
                own.insert(0, held);
            }
        }
        own.into_iter().map(|(_, e)| e.clone()).collect()
    }

    /// Whether the overlay changed (a host or guest key, or a claim of ours)
    /// since `take_dirty` was last asked.
    pub fn is_dirty(&self) -> bool {
        self.dirty
    }

    pub fn take_dirty(&mut self) -> bool {
        std::mem::take(&mut self.dirty)
    }

    /// The networks whose guests (or their hosts, or the addresses they
    /// share) changed since this was last asked; None if every network
    /// may have (a listing). A pass derives these again and no others.
    pub fn take_dirty_networks(&mut self) -> Option<BTreeSet<String>> {
        let nets = std::mem::take(&mut self.dirty_nets);
        (!std::mem::take(&mut self.dirty_all)).then_some(nets)
    }

    /// Whether any guest's holder changed, in any network, since this was
    /// last asked (the overlay's MAC list, `--macs-file`, follows them all).
    pub fn take_moved(&mut self) -> bool {
        std::mem::take(&mut self.moved)
    }

    /// Gives each MAC whose claims changed (or whose claiming hosts came
    /// or went) to its holder, notes the claims that wait, and marks the
    /// store dirty if this host routes by any of it: work in proportion to
    /// the change, not to the overlay (docs/controller.md, "At scale").
    fn rebuild(&mut self) {
        let mut touched = std::mem::take(&mut self.touched);
        let hosts_changed = std::mem::take(&mut self.touched_hosts);
        if std::mem::take(&mut self.touched_all) {
            touched.extend(self.claimed.keys().cloned());
            touched.extend(self.routed.keys().cloned());
            self.dirty = true;
            self.dirty_all = true;
        } else {
            for h in &hosts_changed {
                touched.extend(self.by_host.get(h).into_iter().flatten().cloned());
            }
        }
        // This host's networks: a change elsewhere is not routed here.
        let mine: BTreeSet<&str> = self.claims.values().map(|c| c.network.as_str()).collect();
        let hosts = &self.hosts;
        let mut relevant = false;
        for mac in &touched {
            let before = self.routed.remove(mac);
            for ip in before.iter().flat_map(|g| &g.ips) {
                if let Some(ms) = self.by_ip.get_mut(ip) {
                    ms.remove(mac);
                    if ms.is_empty() {
                        self.by_ip.remove(ip);
                    }
                }
            }
            if let Some(g) = &before {
                if let Some(ms) = self.by_net.get_mut(&g.network) {
                    ms.remove(mac);
                    if ms.is_empty() {
                        self.by_net.remove(&g.network);
                    }
                }
            }
            let old_waiting = self.seen_waiting.remove(mac).unwrap_or_default();
            let was_stranded = self.stranded.remove(mac);
            let after = match self.claimed.get(mac).map(|claims| (claims, holder(claims, |h| hosts.contains_key(h)))) {
                Some((_, Holding::Stranded(h))) => {
                    if !was_stranded {
                        tracing::warn!("guest {mac}: host {h} holds it and is gone (its lease ran out): nobody else takes it until h comes back or `vnet-agent release` lets it go");
                    }
                    self.stranded.insert(mac.clone());
                    None
                }
                Some((claims, Holding::Held(holder_host, first))) => {
                    let mut waiting = BTreeSet::new();
                    for ((host, _), c) in claims.iter().filter(|(_, c)| !c.released && *c != first) {
                        let w = (host.clone(), c.create_revision);
                        if !old_waiting.contains(&w) {
                            self.contested += 1;
                            tracing::warn!(
                                "guest {mac}: host {host} claims it (revision {}), but host {holder_host} holds it (revision {}): \
                                 ignored for good ({} contested claims seen)",
                                c.create_revision,
                                first.create_revision,
                                self.contested
                            );
                        }
                        waiting.insert(w);
                    }
                    if !waiting.is_empty() {
                        self.seen_waiting.insert(mac.clone(), waiting);
                    }
                    Some(Guest { host: holder_host.to_string(), network: first.network.clone(), ips: first.ips.clone(), since: first.create_revision })
                }
                Some((_, Holding::Free)) | None => None,
            };
            for ip in after.iter().flat_map(|g| &g.ips) {
                self.by_ip.entry(*ip).or_default().insert(mac.clone());
            }
            if let Some(g) = &after {
                self.by_net.entry(g.network.clone()).or_default().insert(mac.clone());
            }
            // Routed here if it is (or was) in one of this host's networks,
            // or says it holds an address a guest of one of them says it
            // holds too (the first claim has it); its holder's
            // registration changing (a new address or key) changes the
            // link to it.
            let of_mine = |g: &Option<Guest>| g.as_ref().is_some_and(|g| mine.contains(g.network.as_str()));
            let shares_ip = |g: &Option<Guest>| {
                g.iter().flat_map(|g| &g.ips).any(|ip| {
                    self.by_ip.get(ip).is_some_and(|ms| {
                        ms.iter().any(|m| m != mac && self.routed.get(m).is_some_and(|o| mine.contains(o.network.as_str())))
                    })
                })
            };
            self.moved |= before != after;
            let host_moved = after.as_ref().is_some_and(|g| hosts_changed.contains(&g.host));
            let changed = before != after || host_moved;
            if !relevant && changed {
                relevant = of_mine(&before) || of_mine(&after) || shares_ip(&before) || shares_ip(&after);
            }
            relevant |= self.claims.contains_key(mac);
            if changed {
                // The networks it was and is in, and those of every guest
                // that says it holds one of its addresses (which of them
                // holds it may have changed).
                for g in before.iter().chain(after.iter()) {
                    self.dirty_nets.insert(g.network.clone());
                    for ip in &g.ips {
                        for m in self.by_ip.get(ip).into_iter().flatten() {
                            if let Some(o) = self.routed.get(m) {
                                self.dirty_nets.insert(o.network.clone());
                            }
                        }
                    }
                }
            }
            if let Some(c) = self.claims.get(mac) {
                self.dirty_nets.insert(c.network.clone());
            }
            if let Some(g) = after {
                self.routed.insert(mac.clone(), g);
            }
        }
        self.dirty |= relevant;
        for mac in &touched {
            let Some(c) = self.claims.get_mut(mac) else { continue };
            let ours = self.routed.get(mac).is_some_and(|g| g.host == self.me.host);
            if c.epoch.is_some() && !ours && !c.waiting {
                c.waiting = true;
                let by = self.routed.get(mac).map_or("no one", |g| g.host.as_str());
                tracing::warn!("guest {mac}: held by {by}, not by our claim: our interface is not routed");
            } else if ours && c.waiting {
                c.waiting = false;
                tracing::info!("guest {mac}: our claim holds it now");
            }
        }
    }

    /// Waits for the watch's next response and takes it in.
    pub async fn next_event(&mut self) {
        let Some(w) = self.watch.as_mut() else {
            std::future::pending::<()>().await;
            return;
        };
        let r = w.message().await;
        self.take(r);
    }

    /// Takes in every watch response already there.
    pub async fn drain(&mut self) {
        loop {
            let Some(w) = self.watch.as_mut() else { return };
            match tokio::time::timeout(Duration::ZERO, w.message()).await {
                Ok(r) => self.take(r),
                Err(_) => return,
            }
        }
    }

    fn take(&mut self, r: Result<Option<etcd_client::WatchResponse>, etcd_client::Error>) {
        match r {
            Ok(Some(resp)) => {
                if resp.canceled() || resp.compact_revision() > 0 {
                    self.relist_needed = true;
                    tracing::warn!(
                        "etcd: watch ended ({}; compacted to {}): listing again",
                        resp.cancel_reason(),
                        resp.compact_revision()
                    );
                    self.watch = None;
                    return;
                }
                let mut changed = false;
                for ev in resp.events() {
                    let Some(kv) = ev.kv() else { continue };
                    let key = String::from_utf8_lossy(kv.key()).into_owned();
                    changed |= match ev.event_type() {
                        EventType::Put => self.put_cached(&key, kv.value(), kv.create_revision(), kv.mod_revision()),
                        EventType::Delete => self.delete_cached(&key),
                    };
                    self.revision = Some(kv.mod_revision().max(self.revision.unwrap_or(0)));
                }
                if let Some(h) = resp.header() {
                    self.revision = Some(h.revision().max(self.revision.unwrap_or(0)));
                }
                if changed {
                    self.rebuild();
                }
            }
            Ok(None) | Err(_) => {
                tracing::warn!("etcd: watch broken: watching again from the last revision once etcd answers");
                self.watch = None;
            }
        }
    }

    /// The overlay as last seen, once it has been listed.
    pub fn view(&self) -> Option<View<'_>> {
        Some(View { hosts: &self.hosts, guests: &self.routed, by_net: &self.by_net, by_ip: &self.by_ip, revision: self.revision? })
    }

    /// The local interfaces this host holds in etcd (MAC → network): a
    /// claim written that no earlier claim of another host's outranks.
    pub fn held(&self, local: &BTreeMap<String, (u32, String)>) -> BTreeMap<String, String> {
        local
            .iter()
            .filter(|(m, (id, _))| {
                self.claims.get(*m).is_some_and(|c| c.iface == *id && c.epoch.is_some())
                    && self.routed.get(*m).is_some_and(|g| g.host == self.me.host)
            })
            .map(|(m, (_, n))| (m.clone(), n.clone()))
            .collect()
    }
}

#[cfg(test)]
#[path = "store_tests.rs"]
mod tests;
