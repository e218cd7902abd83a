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
//! When etcd is unreachable, the cache is kept and nothing is changed; when
//! the watch cannot go on (etcd compacted past it, or restarted), the agent
//! lists the prefix again and watches from there.

use crate::etcd::{EtcdArgs, OP_TIMEOUT};
use crate::model::{Guest, Host};
use crate::records::{can_forget, check_epoch, guest_key, holder, new_epoch, reg_key, traffic_key, usable_ips, ClaimSeen, Claims, GuestValue, HostValue, Holding, Record, Traffic};
use etcd_client::{Client, EventType, GetOptions, LeaseKeeper, LeaseKeepAliveStream, PutOptions, WatchOptions, WatchStream};
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// How long after its guest started a host's claim may be made again when
/// the MAC's holder let it go after the claim was made (a migration whose
/// new host claimed before the old one released): longer, and the claim is
/// one that waited behind a holder, which never takes a MAC
/// (`--handover-ms`).
pub const HANDOVER: Duration = Duration::from_secs(10);

/// This host's claim on a local interface's MAC.
#[derive(Clone, Debug)]
struct Claim {
    /// The vnetd interface id it is for.
    iface: u32,
    network: String,
    /// The epoch of its record in etcd, once written.
    epoch: Option<String>,
    /// When the guest started here (the interface was first seen).
    since: Instant,
    /// Another claim holds the MAC (logged once).
    waiting: bool,
    /// The addresses its record says the guest holds.
    ips: Vec<IpAddr>,
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
    /// Every host's claims, by MAC.
    claimed: BTreeMap<String, Claims>,
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
            stranded: BTreeSet::new(),
            handover: HANDOVER,
            traffic_sent: None,
            endpoint_at: 0,
            lease_id: None,
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
            self.retry_at = Instant::now() + Duration::from_millis(200);
            // Start afresh with the next member: a new connection, the
            // same lease kept alive through it if it still lives (the
            // registration stays: a member lost is no host lost), a new
            // listing.
            self.watch = None;
            self.client = None;
            self.endpoint_at += 1;
            if let Some((id, ..)) = self.lease.take() {
                self.lease_id = Some(id);
            }
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
            let (c, at) = self.etcd.connect_from(self.endpoint_at).await?;
            self.endpoint_at = at;
            tracing::info!("etcd: connected to {}", self.etcd.endpoints[at]);
            self.client = Some(c);
        }
        // A lease that lived through a reconnection: kept alive again
        // through the new one (its keys stay as they are).
        if let (None, Some(id)) = (&self.lease, self.lease_id.take()) {
            let client = self.client.as_mut().expect("connected above");
            let (mut keeper, mut stream) = client.lease_keep_alive(id).await?;
            keeper.keep_alive().await?;
            match tokio::time::timeout(OP_TIMEOUT, stream.message()).await {
                Ok(Ok(Some(r))) if r.ttl() > 0 => {
                    tracing::info!("etcd: lease {id:x} kept through the new connection");
                    self.lease = Some((id, keeper, stream, Instant::now()));
                }
                Ok(Ok(_)) => tracing::warn!("etcd: our lease expired meanwhile; registering again"),
                Ok(Err(e)) => return Err(e.into()),
                Err(_) => anyhow::bail!("lease keep-alive unanswered"),
            }
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
            // A new lease: the traffic key (on the old one) is gone.
            self.traffic_sent = None;
            self.reregister = false;
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
        let kvs: Vec<(String, Vec<u8>, i64, i64)> = resp
            .kvs()
            .iter()
            .map(|kv| (String::from_utf8_lossy(kv.key()).into_owned(), kv.value().to_vec(), kv.create_revision(), kv.mod_revision()))
            .collect();
        let stream = client.watch(prefix, Some(WatchOptions::new().with_prefix().with_start_revision(rev + 1))).await?;
        for (k, v, c, m) in kvs {
            self.put_cached(&k, &v, c, m);
        }
        self.watch = Some(stream);
        self.revision = Some(rev);
        self.adopt_own_claims();
        self.rebuild();
        tracing::info!("etcd: listed {} hosts and {} guests at revision {rev}", self.hosts.len(), self.claimed.len());
        Ok(())
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
                }
                _ => tracing::warn!("etcd: ignoring {key}: not a host entry"),
            },
            Some(Record::Guest(host, mac, epoch)) => match (serde_json::from_slice::<GuestValue>(value), crate::model::check_mac(mac)) {
                (Ok(g), Ok(mac))
                    if crate::model::check_host_name(host).is_ok() && crate::model::check_network(&g.network).is_ok() && check_epoch(epoch) =>
                {
                    let ips = usable_ips(&g.ips);
                    let c = ClaimSeen { network: g.network, create_revision, mod_revision, released: g.released, ips };
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
            }
            Some(Record::Guest(host, mac, epoch)) => {
                let mac = mac.to_ascii_lowercase();
                if let Some(c) = self.claimed.get_mut(&mac) {
                    c.remove(&(host.to_string(), epoch.to_string()));
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
        let me = self.me.host.clone();
        for (mac, claims) in &self.claimed {
            if self.claims.contains_key(mac) {
                continue;
            }
            let newest = claims.iter().filter(|((h, _), c)| *h == me && !c.released).max_by_key(|(_, c)| c.create_revision);
            if let Some(((_, epoch), c)) = newest {
                let since = Instant::now().checked_sub(self.handover).unwrap_or_else(Instant::now);
                let ips = c.ips.clone();
                self.claims.insert(mac.clone(), Claim { iface: u32::MAX, network: c.network.clone(), epoch: Some(epoch.clone()), since, waiting: false, ips });
            }
        }
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
        let mut stranded = BTreeSet::new();
        let hosts = &self.hosts;
        for (mac, claims) in &self.claimed {
            let (holder_host, first) = match holder(claims, |h| hosts.contains_key(h)) {
                Holding::Held(h, c) => (h, c),
                Holding::Stranded(h) => {
                    if !self.stranded.contains(mac) {
                        tracing::warn!("guest {mac}: host {h} holds it and is gone (its lease ran out): nobody else takes it until h comes back or `vnet-agent release` lets it go");
                    }
                    stranded.insert(mac.clone());
                    continue;
                }
                Holding::Free => continue,
            };
            self.routed.insert(
                mac.clone(),
                Guest { host: holder_host.to_string(), network: first.network.clone(), ips: first.ips.clone(), since: first.create_revision },
            );
            for ((host, _), c) in claims.iter().filter(|(_, c)| !c.released && *c != first) {
                let w = (mac.clone(), host.clone(), c.create_revision);
                if !self.seen_waiting.contains(&w) {
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
        }
        self.seen_waiting = waiting;
        self.stranded = stranded;
        for (mac, c) in self.claims.iter_mut() {
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
                tracing::warn!("etcd: watch broken: listing again once etcd answers");
                self.watch = None;
            }
        }
    }

    /// Claims the MACs of new local interfaces, releases those of
    /// interfaces gone, makes again a claim that missed a hand-over by a
    /// moment, and forgets released claims no reader needs. Only while etcd
    /// answers; otherwise next time.
    pub async fn publish(&mut self, local: &BTreeMap<String, (u32, String)>, ips: &BTreeMap<String, Vec<IpAddr>>) {
        if self.lease.is_none() || self.revision.is_none() {
            return;
        }
        let (prefix, host) = (self.etcd.prefix.clone(), self.me.host.clone());
        // Guests gone: their claims released (a key of ours, rewritten).
        let gone: Vec<String> = self.claims.keys().filter(|m| !local.contains_key(*m)).cloned().collect();
        for mac in gone {
            let c = self.claims.remove(&mac).expect("listed above");
            if let Some(epoch) = &c.epoch {
                if let Err(e) = self.release(&mac, epoch, &c.network).await {
                    tracing::warn!("etcd: cannot release guest {mac}: {e}");
                    self.claims.insert(mac, c);
                    continue;
                }
                tracing::info!("guest {mac}: released (its interface is gone)");
            }
        }
        let now = Instant::now();
        for (mac, (id, network)) in local {
            let c = self
                .claims
                .entry(mac.clone())
                .or_insert_with(|| Claim { iface: *id, network: network.clone(), epoch: None, since: now, waiting: false, ips: Vec::new() });
            // An interface added again (or renumbered by a restarted vnetd)
            // keeps its claim, and with it its place.
            c.iface = *id;
            let mut stale = None;
            if &c.network != network {
                // Moved to another network: claimed again.
                stale = c.epoch.take().map(|e| (e, c.network.clone(), true));
                c.network = network.clone();
            } else if c.epoch.is_some()
                && now.duration_since(c.since) < self.handover
                && matches!(self.claimed.get(mac).map(|cl| holder(cl, |h| self.hosts.contains_key(h))), Some(Holding::Free))
            {
                // The holder let the MAC go just after our guest started
                // here and claimed it (a migration): our claim, made before
                // the release, is off the chain; made again, it is the
                // first after it.
                tracing::info!("guest {mac}: its holder let it go just after we claimed it: claiming it again");
                stale = c.epoch.take().map(|e| (e, c.network.clone(), false));
            }
            if let Some((epoch, net, released)) = stale {
                let r = if released { self.release(mac, &epoch, &net).await } else { self.forget(mac, &epoch).await };
                if let Err(e) = r {
                    tracing::warn!("etcd: cannot give up guest {mac}'s old claim: {e}");
                }
            }
            let c = self.claims.get_mut(mac).expect("inserted above");
            let now_ips = ips.get(mac).map_or_else(Vec::new, |i| usable_ips(i));
            if let Some(epoch) = c.epoch.clone() {
                if c.ips != now_ips {
                    // The guest holds other addresses now: its record says
                    // so (one write; the claim keeps its place).
                    let v = serde_json::to_string(&GuestValue { network: c.network.clone(), released: false, ips: now_ips.clone() }).expect("plain struct");
                    match self.client.as_mut().expect("connected").put(guest_key(&prefix, &host, mac, &epoch), v, None).await {
                        Ok(_) => {
                            tracing::info!("guest {mac}: holds {}", now_ips.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(", "));
                            c.ips = now_ips;
                        }
                        Err(e) => tracing::warn!("etcd: cannot publish guest {mac}'s addresses: {e}"),
                    }
                }
                continue;
            }
            let epoch = new_epoch();
            c.ips = now_ips;
            let v = serde_json::to_string(&GuestValue { network: c.network.clone(), released: false, ips: c.ips.clone() }).expect("plain struct");
            let key = guest_key(&prefix, &host, mac, &epoch);
            match self.client.as_mut().expect("connected").put(key, v, None).await {
                Ok(r) => {
                    tracing::info!("guest {mac}: claimed in network {}", c.network);
                    // Our own write comes back through the watch too; note it now.
                    let rev = r.header().map_or(0, |h| h.revision());
                    let seen = ClaimSeen { network: c.network.clone(), create_revision: rev, mod_revision: rev, released: false, ips: c.ips.clone() };
                    self.claimed.entry(mac.clone()).or_default().insert((host.clone(), epoch.clone()), seen);
                    c.epoch = Some(epoch);
                }
                Err(e) => tracing::warn!("etcd: cannot publish guest {mac}: {e}"),
            }
        }
        // Released claims of ours that no reader needs any more.
        let done: Vec<(String, String)> = self
            .claimed
            .iter()
            .flat_map(|(mac, cl)| cl.keys().filter(|k| k.0 == host && can_forget(cl, k)).map(move |k| (mac.clone(), k.1.clone())))
            .collect();
        for (mac, epoch) in done {
            if let Err(e) = self.forget(&mac, &epoch).await {
                tracing::warn!("etcd: cannot forget guest {mac}'s released claim: {e}");
            }
        }
        self.rebuild();
    }

    /// Rewrites our claim `epoch` of `mac` as released.
    async fn release(&mut self, mac: &str, epoch: &str, network: &str) -> Result<(), etcd_client::Error> {
        let v = serde_json::to_string(&GuestValue { network: network.to_string(), released: true, ips: Vec::new() }).expect("plain struct");
        let key = guest_key(&self.etcd.prefix, &self.me.host, mac, epoch);
        let r = self.client.as_mut().expect("connected").put(key, v, None).await?;
        let rev = r.header().map_or(0, |h| h.revision());
        if let Some(c) = self.claimed.get_mut(mac).and_then(|cl| cl.get_mut(&(self.me.host.clone(), epoch.to_string()))) {
            c.released = true;
            c.mod_revision = rev;
        }
        Ok(())
    }

    /// Deletes our claim `epoch` of `mac`.
    async fn forget(&mut self, mac: &str, epoch: &str) -> Result<(), etcd_client::Error> {
        let key = guest_key(&self.etcd.prefix, &self.me.host, mac, epoch);
        self.client.as_mut().expect("connected").delete(key, None).await?;
        if let Some(cl) = self.claimed.get_mut(mac) {
            cl.remove(&(self.me.host.clone(), epoch.to_string()));
            if cl.is_empty() {
                self.claimed.remove(mac);
            }
        }
        Ok(())
    }

    /// Publishes this host's traffic counters (on its lease, so they go
    /// with the host).
    pub async fn publish_traffic(&mut self, mut t: Traffic) {
        t.contested = self.contested;
        // Nothing moved since the last write: nothing to write.
        let at = std::mem::take(&mut t.at);
        if self.traffic_sent.as_ref() == Some(&t) {
            return;
        }
        let unstamped = Traffic { at: 0, to_hosts: t.to_hosts.clone(), guests: t.guests.clone(), contested: t.contested };
        t.at = at;
        let (Some((lease, ..)), Some(client)) = (self.lease.as_ref(), self.client.as_mut()) else { return };
        let v = serde_json::to_string(&t).expect("plain struct");
        match client.put(traffic_key(&self.etcd.prefix, &self.me.host), v, Some(PutOptions::new().with_lease(*lease))).await {
            Ok(_) => self.traffic_sent = Some(unstamped),
            Err(e) => tracing::warn!("etcd: cannot publish traffic: {e}"),
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
