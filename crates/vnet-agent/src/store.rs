//! The overlay's state in etcd, as one agent keeps it: its host's
//! registration on a lease, its guests' claims, and a cache of everyone's
//! keys kept current by a watch.
//!
//! Keys (under `--prefix`, default `/vnet`; each host writes only its own
//! `<p>/host/<host>/`, which etcd's RBAC enforces: `auth.rs`), values JSON:
//!
//! ```text
//! <p>/host/<host>/reg             {"underlay": "198.18.0.1", "port": 9000}   on the host's lease
//! <p>/host/<host>/guests/<mac>    {"network": "blue"}                        on the host's lease
//! <p>/host/<host>/traffic         counters (show.rs)                         on the host's lease
//! ```
//!
//! A host claims a MAC when its vnetd gets an interface with it, and
//! withdraws the claim when the interface goes. Two hosts may claim one MAC
//! (a migration's new host before the old one let go, a clone, a rogue
//! host): every reader gives it to the claim etcd created first
//! (`records::holder`). So a later claim never takes a MAC another host
//! holds; it waits, and holds the MAC once the earlier claim is withdrawn
//! or its host's lease runs out. A host whose claim waits does not route
//! its interface (logged); every agent counts the claims it saw waiting
//! behind another host's (`contested`, in its traffic record and the log).
//!
//! When a host's agent dies, its lease expires and etcd deletes its keys:
//! the other agents see the deletes and withdraw its guests. When etcd is
//! unreachable, the cache is kept and nothing is changed; when the watch
//! cannot go on (etcd compacted past it, or restarted), the agent lists the
//! prefix again and watches from there.

use crate::etcd::{EtcdArgs, OP_TIMEOUT};
use crate::model::{Guest, Host};
use crate::records::{guest_key, holder, reg_key, traffic_key, ClaimSeen, GuestValue, HostValue, Record, Traffic};
use etcd_client::{Client, EventType, GetOptions, LeaseKeeper, LeaseKeepAliveStream, PutOptions, WatchOptions, WatchStream};
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// This host's claim on a local interface's MAC.
#[derive(Clone, Debug)]
struct Claim {
    /// The vnetd interface id it is for.
    iface: u32,
    network: String,
    /// Written under the current lease.
    written: bool,
    /// Another host's earlier claim holds the MAC (logged once).
    waiting: bool,
}

pub struct View<'a> {
    pub hosts: &'a BTreeMap<String, Host>,
    pub guests: &'a BTreeMap<String, Guest>,
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
    lease: Option<(i64, LeaseKeeper, LeaseKeepAliveStream, Instant)>,
    watch: Option<WatchStream>,
    /// The cache is a true copy of etcd as of `revision` (listed, then
    /// followed by the watch); None until the first listing.
    revision: Option<i64>,
    hosts: BTreeMap<String, Host>,
    /// Every host's claims, by MAC then host.
    claimed: BTreeMap<String, BTreeMap<String, ClaimSeen>>,
    /// Each MAC's holder, as the model wants them.
    routed: BTreeMap<String, Guest>,
    claims: BTreeMap<String, Claim>,
    retry_at: Instant,
    /// The registration's value changed (a new WireGuard key): written again.
    reregister: bool,
    /// A host or guest key changed since `take_dirty` was last asked.
    dirty: bool,
    /// Claims seen waiting behind another host's (MAC, host, create
    /// revision), each counted once in `contested`.
    seen_waiting: BTreeSet<(String, String, i64)>,
    pub contested: u64,
}

impl Store {
    pub fn new(etcd: &EtcdArgs, me: Registration) -> Store {
        Store {
            etcd: etcd.clone(),
            me,
            client: None,
            lease: None,
            watch: None,
            revision: None,
            hosts: BTreeMap::new(),
            claimed: BTreeMap::new(),
            routed: BTreeMap::new(),
            claims: BTreeMap::new(),
            retry_at: Instant::now(),
            reregister: false,
            dirty: true,
            seen_waiting: BTreeSet::new(),
            contested: 0,
        }
    }

    /// Connects, registers the host and lists the overlay, as far as etcd
    /// lets it; what fails is tried again a second later.
    pub async fn maintain(&mut self) {
        if Instant::now() < self.retry_at {
            return;
        }
        if let Err(e) = self.try_maintain().await {
            tracing::warn!("etcd: {e:#} (routes stay as they are; trying again)");
            self.retry_at = Instant::now() + Duration::from_secs(1);
            // Start afresh: a new connection, a new lease (our keys move to
            // it as they are written again), a new listing. The old lease
            // keeps our keys meanwhile, for its TTL.
            self.watch = None;
            self.client = None;
            self.lease = None;
        }
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

    async fn try_maintain(&mut self) -> anyhow::Result<()> {
        if self.client.is_none() {
            let c = self.etcd.connect().await?;
            tracing::info!("etcd: connected to {}", self.etcd.endpoints.join(","));
            self.client = Some(c);
        }
        // The lease: kept alive at a third of its life; a lost one (etcd
        // down longer than the TTL) is granted again and everything of ours
        // written again under it.
        let ttl = self.me.ttl;
        let mut lost = false;
        if let Some((_, keeper, stream, last)) = &mut self.lease {
            if last.elapsed() >= Duration::from_millis(ttl as u64 * 1000 / 3) {
                keeper.keep_alive().await?;
                match tokio::time::timeout(OP_TIMEOUT, stream.message()).await {
                    Ok(Ok(Some(r))) if r.ttl() > 0 => *last = Instant::now(),
                    Ok(Ok(_)) => lost = true,
                    Ok(Err(e)) => return Err(e.into()),
                    Err(_) => anyhow::bail!("lease keep-alive unanswered"),
                }
            }
        }
        if lost {
            tracing::warn!("etcd: our lease expired; registering again");
            self.lease = None;
        }
        let v = self.reg_value()?;
        let client = self.client.as_mut().expect("connected above");
        if self.lease.is_none() {
            let id = client.lease_grant(ttl, None).await?.id();
            let (keeper, stream) = client.lease_keep_alive(id).await?;
            client.put(reg_key(&self.etcd.prefix, &self.me.host), v, Some(PutOptions::new().with_lease(id))).await?;
            self.lease = Some((id, keeper, stream, Instant::now()));
            self.reregister = false;
            // Our claims are written again under the new lease (where the
            // key still exists, it keeps its create revision, and with it
            // its place among the MAC's claims).
            for c in self.claims.values_mut() {
                c.written = false;
            }
            tracing::info!("etcd: host {} registered (lease {id:x}, ttl {ttl} s)", self.me.host);
        }
        if self.reregister {
            if let Some((id, ..)) = &self.lease {
                let (id, v) = (*id, self.reg_value()?);
                let client = self.client.as_mut().expect("connected above");
                client.put(reg_key(&self.etcd.prefix, &self.me.host), v, Some(PutOptions::new().with_lease(id))).await?;
            }
            self.reregister = false;
        }
        if self.watch.is_none() {
            self.relist().await?;
        }
        Ok(())
    }

    /// This host's registration record.
    fn reg_value(&self) -> anyhow::Result<String> {
        let wireguard = self.me.wireguard.clone().map(|(port, public_key)| crate::records::WireGuardValue { port, public_key });
        Ok(serde_json::to_string(&HostValue { underlay: self.me.underlay, port: self.me.port, wireguard })?)
    }

    /// Lists the prefix and watches from the revision after it.
    async fn relist(&mut self) -> anyhow::Result<()> {
        let prefix = format!("{}/", self.etcd.prefix);
        let client = self.client.as_mut().expect("connected");
        let resp = client.get(prefix.clone(), Some(GetOptions::new().with_prefix())).await?;
        let rev = resp.header().map_or(0, |h| h.revision());
        self.hosts.clear();
        self.claimed.clear();
        let kvs: Vec<(String, Vec<u8>, i64)> = resp
            .kvs()
            .iter()
            .map(|kv| (String::from_utf8_lossy(kv.key()).into_owned(), kv.value().to_vec(), kv.create_revision()))
            .collect();
        let stream = client.watch(prefix, Some(WatchOptions::new().with_prefix().with_start_revision(rev + 1))).await?;
        for (k, v, c) in kvs {
            self.put_cached(&k, &v, c);
        }
        self.watch = Some(stream);
        self.revision = Some(rev);
        self.rebuild();
        tracing::info!("etcd: listed {} hosts and {} guests at revision {rev}", self.hosts.len(), self.claimed.len());
        Ok(())
    }

    /// Takes a key into the cache; true if it is a host's registration or
    /// a guest claim. A value that does not parse is ignored (and logged):
    /// one bad writer cannot stop the overlay.
    fn put_cached(&mut self, key: &str, value: &[u8], create_revision: i64) -> bool {
        match Record::parse(&self.etcd.prefix, key) {
            Some(Record::Reg(name)) => match serde_json::from_slice::<HostValue>(value) {
                Ok(h)
                    if crate::model::check_host_name(name).is_ok()
                        && h.wireguard.as_ref().is_none_or(|w| crate::model::check_wireguard_key(&w.public_key).is_ok()) =>
                {
                    let wireguard = h.wireguard.map(|w| (w.port, w.public_key));
                    self.hosts.insert(name.to_string(), Host { underlay: h.underlay, port: h.port, wireguard });
                }
                _ => tracing::warn!("etcd: ignoring {key}: not a host entry"),
            },
            Some(Record::Guest(host, mac)) => match (serde_json::from_slice::<GuestValue>(value), crate::model::check_mac(mac)) {
                (Ok(g), Ok(mac)) if crate::model::check_host_name(host).is_ok() && crate::model::check_network(&g.network).is_ok() => {
                    let c = ClaimSeen { network: g.network, create_revision };
                    self.claimed.entry(mac).or_default().insert(host.to_string(), c);
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
            }
            Some(Record::Guest(host, mac)) => {
                let mac = mac.to_ascii_lowercase();
                if let Some(c) = self.claimed.get_mut(&mac) {
                    c.remove(host);
                    if c.is_empty() {
                        self.claimed.remove(&mac);
                    }
                }
            }
            Some(Record::Traffic(_)) | None => return false,
        }
        true
    }

    /// Whether the overlay changed (a host or guest key, or a claim of ours)
    /// since `take_dirty` was last asked.
    pub fn is_dirty(&self) -> bool {
        self.dirty
    }

    pub fn take_dirty(&mut self) -> bool {
        std::mem::take(&mut self.dirty)
    }

    /// Gives each MAC to its holder, and notes the claims that wait.
    fn rebuild(&mut self) {
        self.dirty = true;
        self.routed.clear();
        let mut waiting = BTreeSet::new();
        for (mac, claims) in &self.claimed {
            let Some((holder, first)) = holder(claims) else { continue };
            self.routed.insert(mac.clone(), Guest { host: holder.to_string(), network: first.network.clone() });
            for (host, c) in claims.iter().filter(|(h, _)| h.as_str() != holder) {
                let w = (mac.clone(), host.clone(), c.create_revision);
                if !self.seen_waiting.contains(&w) {
                    self.contested += 1;
                    tracing::warn!(
                        "guest {mac}: host {host} claims it (revision {}), but host {holder} holds it (revision {}): \
                         ignored while that claim stands ({} contested claims seen)",
                        c.create_revision,
                        first.create_revision,
                        self.contested
                    );
                }
                waiting.insert(w);
            }
        }
        self.seen_waiting = waiting;
        for (mac, c) in self.claims.iter_mut() {
            let ours = self.routed.get(mac).is_some_and(|g| g.host == self.me.host);
            if c.written && !ours && !c.waiting {
                c.waiting = true;
                let by = self.routed.get(mac).map_or("no one", |g| g.host.as_str());
                tracing::warn!("guest {mac}: host {by} claimed it before us: our interface is not routed until that claim goes");
            } else if ours && c.waiting {
                c.waiting = false;
                tracing::info!("guest {mac}: the earlier claim is gone; ours holds it now");
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
                        EventType::Put => self.put_cached(&key, kv.value(), kv.create_revision()),
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
                tracing::warn!("etcd: watch broken: listing again once etcd answers");
                self.watch = None;
            }
        }
    }

    /// Claims the MACs of new local interfaces and gives up those of
    /// interfaces gone. Only while etcd answers; otherwise next time.
    pub async fn publish(&mut self, local: &BTreeMap<String, (u32, String)>) {
        if self.lease.is_none() || self.revision.is_none() {
            return;
        }
        let (prefix, host) = (self.etcd.prefix.clone(), self.me.host.clone());
        // Interfaces gone: their keys are ours alone, deleted as they are.
        let gone: Vec<String> = self.claims.keys().filter(|m| !local.contains_key(*m)).cloned().collect();
        for mac in gone {
            let c = self.claims.remove(&mac).expect("listed above");
            match self.client.as_mut().expect("connected").delete(guest_key(&prefix, &host, &mac), None).await {
                Ok(_) => tracing::info!("guest {mac}: withdrawn (its interface is gone)"),
                Err(e) => {
                    tracing::warn!("etcd: cannot withdraw guest {mac}: {e}");
                    self.claims.insert(mac, c);
                }
            }
        }
        let lease = self.lease.as_ref().expect("checked").0;
        for (mac, (id, network)) in local {
            let c = self.claims.entry(mac.clone()).or_insert_with(|| Claim { iface: *id, network: network.clone(), written: false, waiting: false });
            // An interface added again (or renumbered by a restarted vnetd)
            // keeps its claim, and with it its place.
            c.iface = *id;
            if &c.network != network {
                // Moved to another network: written again.
                c.network = network.clone();
                c.written = false;
            }
            if c.written {
                continue;
            }
            let v = serde_json::to_string(&GuestValue { network: c.network.clone() }).expect("plain struct");
            let key = guest_key(&prefix, &host, mac);
            match self.client.as_mut().expect("connected").put(key, v, Some(PutOptions::new().with_lease(lease))).await {
                Ok(r) => {
                    c.written = true;
                    tracing::info!("guest {mac}: published in network {}", c.network);
                    // Our own write comes back through the watch too; note
                    // it now (a key written before keeps its create revision).
                    let rev = r.header().map_or(0, |h| h.revision());
                    let claims = self.claimed.entry(mac.clone()).or_default();
                    let create_revision = claims.get(&host).map_or(rev, |s| s.create_revision);
                    claims.insert(host.clone(), ClaimSeen { network: c.network.clone(), create_revision });
                }
                Err(e) => tracing::warn!("etcd: cannot publish guest {mac}: {e}"),
            }
        }
        self.rebuild();
    }

    /// Publishes this host's traffic counters (on its lease, so they go
    /// with the host).
    pub async fn publish_traffic(&mut self, mut t: Traffic) {
        t.contested = self.contested;
        let (Some((lease, ..)), Some(client)) = (self.lease.as_ref(), self.client.as_mut()) else { return };
        let v = serde_json::to_string(&t).expect("plain struct");
        if let Err(e) = client.put(traffic_key(&self.etcd.prefix, &self.me.host), v, Some(PutOptions::new().with_lease(*lease))).await {
            tracing::warn!("etcd: cannot publish traffic: {e}");
        }
    }

    /// The overlay as last seen, once it has been listed.
    pub fn view(&self) -> Option<View<'_>> {
        Some(View { hosts: &self.hosts, guests: &self.routed, revision: self.revision? })
    }

    /// The local interfaces this host holds in etcd (MAC → network): a
    /// claim written that no earlier claim of another host's outranks.
    pub fn held(&self, local: &BTreeMap<String, (u32, String)>) -> BTreeMap<String, String> {
        local
            .iter()
            .filter(|(m, (id, _))| {
                self.claims.get(*m).is_some_and(|c| c.iface == *id && c.written)
                    && self.routed.get(*m).is_some_and(|g| g.host == self.me.host)
            })
            .map(|(m, (_, n))| (m.clone(), n.clone()))
            .collect()
    }
}

#[cfg(test)]
#[path = "store_tests.rs"]
mod tests;
