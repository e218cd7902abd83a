//! The overlay's state in etcd, as one agent keeps it: its host's
//! registration on a lease, its guests' claims, and a cache of everyone's
//! keys kept current by a watch.
//!
//! Keys (under `--prefix`, default `/vnet`), values JSON:
//!
//! ```text
//! <p>/hosts/<host>   {"underlay": "198.18.0.1", "port": 9000}           on the host's lease
//! <p>/guests/<mac>   {"host": "h1", "network": "blue", "seq": 3}         on the claiming host's lease
//! ```
//!
//! A guest's key says which host has it. A host claims a MAC when its vnetd
//! gets an interface with it: with `seq` one past the key's (or, if there is
//! none, one past the highest this agent has seen for the MAC), in a transaction that holds only if the key is unchanged since
//! the agent read it. So claims are ordered: the later claim (a migration's
//! new host) has the higher `seq` and wins, and a late write from the old
//! host fails its transaction rather than overwrite the new claim. A host
//! that lost a MAC to a later claim does not claim it again while that
//! claim stands (its interface is stale: logged, not routed); it deletes a
//! key only if the key is still the one it wrote.
//!
//! When a host's agent dies, its lease expires and etcd deletes its keys:
//! the other agents see the deletes and withdraw its guests. When etcd is
//! unreachable, the cache is kept and nothing is changed; when the watch
//! cannot go on (etcd compacted past it, or restarted), the agent lists the
//! prefix again and watches from there.

use crate::etcd::{EtcdArgs, OP_TIMEOUT};
use crate::model::{Guest, Host};
use crate::records::{key, GuestValue, HostValue, Traffic};
use etcd_client::{
    Client, Compare, CompareOp, EventType, GetOptions, LeaseKeeper, LeaseKeepAliveStream, PutOptions, Txn, TxnOp, WatchOptions,
    WatchStream,
};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};


/// A guest key as last seen.
#[derive(Clone, Debug)]
struct GuestEntry {
    value: GuestValue,
    mod_revision: i64,
}

/// This host's claim on a local interface's MAC.
#[derive(Clone, Debug)]
struct Claim {
    /// The vnetd interface id it is for: a claim lost to another host is
    /// made again only by a new interface with the MAC.
    iface: u32,
    network: String,
    /// The revision our write got, once written (under this lease).
    written: Option<i64>,
    /// The seq of our last write of it, under any lease: a key of another
    /// host with a higher one is a later claim, even once our lease (and
    /// with it `written`) is gone.
    seq: Option<u64>,
    /// Another host claimed the MAC after us.
    lost: bool,
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
    guests: BTreeMap<String, GuestEntry>,
    /// `guests` as the model wants them.
    routed: BTreeMap<String, Guest>,
    claims: BTreeMap<String, Claim>,
    retry_at: Instant,
    /// A host or guest key changed since `take_dirty` was last asked.
    dirty: bool,
    /// The highest seq seen for each MAC, its key deleted or not: a claim
    /// of a MAC whose key is gone still comes after every claim seen.
    seqs: BTreeMap<String, u64>,
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
            guests: BTreeMap::new(),
            routed: BTreeMap::new(),
            claims: BTreeMap::new(),
            retry_at: Instant::now(),
            dirty: true,
            seqs: BTreeMap::new(),
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
        let client = self.client.as_mut().expect("connected above");
        if self.lease.is_none() {
            let id = client.lease_grant(ttl, None).await?.id();
            let (keeper, stream) = client.lease_keep_alive(id).await?;
            let v = serde_json::to_string(&HostValue { underlay: self.me.underlay, port: self.me.port })?;
            let key = key(&self.etcd.prefix, "hosts", &self.me.host);
            client.put(key, v, Some(PutOptions::new().with_lease(id))).await?;
            self.lease = Some((id, keeper, stream, Instant::now()));
            // Our claims are to be written again under the new lease; one
            // lost to another host's later claim stays lost (it is made
            // again only when that claim's key goes, as ever).
            for c in self.claims.values_mut() {
                c.written = None;
            }
            tracing::info!("etcd: host {} registered (lease {id:x}, ttl {ttl} s)", self.me.host);
        }
        if self.watch.is_none() {
            self.relist().await?;
        }
        Ok(())
    }

    /// Lists the prefix and watches from the revision after it.
    async fn relist(&mut self) -> anyhow::Result<()> {
        let prefix = format!("{}/", self.etcd.prefix);
        let client = self.client.as_mut().expect("connected");
        let resp = client.get(prefix.clone(), Some(GetOptions::new().with_prefix())).await?;
        let rev = resp.header().map_or(0, |h| h.revision());
        self.hosts.clear();
        self.guests.clear();
        let kvs: Vec<(String, Vec<u8>, i64)> =
            resp.kvs().iter().map(|kv| (String::from_utf8_lossy(kv.key()).into_owned(), kv.value().to_vec(), kv.mod_revision())).collect();
        let stream = client.watch(prefix, Some(WatchOptions::new().with_prefix().with_start_revision(rev + 1))).await?;
        for (k, v, m) in kvs {
            self.put_cached(&k, &v, m);
        }
        self.watch = Some(stream);
        self.revision = Some(rev);
        self.rebuild();
        tracing::info!("etcd: listed {} hosts and {} guests at revision {rev}", self.hosts.len(), self.guests.len());
        Ok(())
    }

    /// Takes a key into the cache. A value that does not parse is ignored
    /// (and logged): one bad writer cannot stop the overlay.
    fn put_cached(&mut self, key: &str, value: &[u8], mod_revision: i64) {
        let Some(rest) = key.strip_prefix(&format!("{}/", self.etcd.prefix)) else { return };
        if let Some(name) = rest.strip_prefix("hosts/") {
            match serde_json::from_slice::<HostValue>(value) {
                Ok(h) if crate::model::check_host_name(name).is_ok() => {
                    self.hosts.insert(name.to_string(), Host { underlay: h.underlay, port: h.port });
                }
                _ => tracing::warn!("etcd: ignoring {key}: not a host entry"),
            }
        } else if let Some(mac) = rest.strip_prefix("guests/") {
            match (serde_json::from_slice::<GuestValue>(value), crate::model::check_mac(mac)) {
                (Ok(g), Ok(mac)) if crate::model::check_host_name(&g.host).is_ok() && crate::model::check_network(&g.network).is_ok() => {
                    let seen = self.seqs.entry(mac.clone()).or_default();
                    *seen = (*seen).max(g.seq);
                    self.guests.insert(mac, GuestEntry { value: g, mod_revision });
                }
                _ => tracing::warn!("etcd: ignoring {key}: not a guest entry"),
            }
        }
    }

    fn delete_cached(&mut self, key: &str) {
        let Some(rest) = key.strip_prefix(&format!("{}/", self.etcd.prefix)) else { return };
        if let Some(name) = rest.strip_prefix("hosts/") {
            self.hosts.remove(name);
        } else if let Some(mac) = rest.strip_prefix("guests/") {
            self.guests.remove(&mac.to_ascii_lowercase());
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

    fn rebuild(&mut self) {
        self.dirty = true;
        self.routed = self
            .guests
            .iter()
            .map(|(m, e)| (m.clone(), Guest { host: e.value.host.clone(), network: e.value.network.clone() }))
            .collect();
        // A claim of ours that another host's later claim replaced is lost;
        // one lost whose key is gone since is made again.
        for (mac, c) in self.claims.iter_mut() {
            if c.lost && !self.guests.contains_key(mac) {
                tracing::info!("guest {mac}: the claim that replaced ours is gone; claiming it again");
                c.lost = false;
                c.written = None;
                continue;
            }
            if let Some(e) = self.guests.get(mac) {
                let later = match (c.written, c.seq) {
                    (Some(w), _) => e.mod_revision != w,
                    (None, Some(s)) => e.value.seq > s,
                    (None, None) => false,
                };
                if later && e.value.host != self.me.host && !c.lost {
                    c.lost = true;
                    tracing::warn!(
                        "guest {mac}: host {} claimed it after us (seq {}): our interface is stale and not routed",
                        e.value.host,
                        e.value.seq
                    );
                }
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
                let overlay = format!("{}/hosts/", self.etcd.prefix);
                let guests = format!("{}/guests/", self.etcd.prefix);
                let mut changed = false;
                for ev in resp.events() {
                    let Some(kv) = ev.kv() else { continue };
                    let key = String::from_utf8_lossy(kv.key()).into_owned();
                    changed |= key.starts_with(&overlay) || key.starts_with(&guests);
                    match ev.event_type() {
                        EventType::Put => self.put_cached(&key, kv.value(), kv.mod_revision()),
                        EventType::Delete => self.delete_cached(&key),
                    }
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
        // Interfaces gone.
        let gone: Vec<String> = self.claims.keys().filter(|m| !local.contains_key(*m)).cloned().collect();
        for mac in gone {
            let c = self.claims.remove(&mac).expect("listed above");
            if let (Some(w), false) = (c.written, c.lost) {
                let key = key(&self.etcd.prefix, "guests", &mac);
                let txn = Txn::new().when([Compare::mod_revision(key.clone(), CompareOp::Equal, w)]).and_then([TxnOp::delete(key, None)]);
                match self.client.as_mut().expect("connected").txn(txn).await {
                    Ok(r) if r.succeeded() => tracing::info!("guest {mac}: withdrawn (its interface is gone)"),
                    Ok(_) => tracing::info!("guest {mac}: its key is another host's now; left as it is"),
                    Err(e) => {
                        tracing::warn!("etcd: cannot withdraw guest {mac}: {e}");
                        self.claims.insert(mac, c);
                    }
                }
            }
        }
        let lease = self.lease.as_ref().expect("checked").0;
        for (mac, (id, network)) in local {
            let c = self.claims.entry(mac.clone()).or_insert_with(|| Claim { iface: *id, network: network.clone(), written: None, seq: None, lost: false });
            if c.iface != *id {
                // The interface was added again (or vnetd restarted and
                // numbered it anew). Ours still: kept, and other hosts see
                // no change. Lost to another host: a new interface claims
                // again (the user says the guest is here now).
                c.iface = *id;
                if c.lost {
                    c.lost = false;
                    c.written = None;
                    c.seq = None;
                }
            }
            if &c.network != network {
                // Moved to another network: written again (same seq).
                c.network = network.clone();
                c.written = None;
            }
            if c.written.is_some() || c.lost {
                continue;
            }
            let key = key(&self.etcd.prefix, "guests", mac);
            let seen = self.guests.get(mac);
            // Ours already (a restarted agent, or a new lease): written again
            // with its seq; another host's: the next seq; none: 1.
            let (seq, cmp) = match seen {
                Some(e) if e.value.host == self.me.host => (e.value.seq, Compare::mod_revision(key.clone(), CompareOp::Equal, e.mod_revision)),
                Some(e) => (e.value.seq + 1, Compare::mod_revision(key.clone(), CompareOp::Equal, e.mod_revision)),
                None => (self.seqs.get(mac).map_or(1, |s| s + 1), Compare::version(key.clone(), CompareOp::Equal, 0)),
            };
            let v = GuestValue { host: self.me.host.clone(), network: c.network.clone(), seq };
            let txn = Txn::new()
                .when([cmp])
                .and_then([TxnOp::put(key.clone(), serde_json::to_string(&v).expect("plain struct"), Some(PutOptions::new().with_lease(lease)))]);
            match self.client.as_mut().expect("connected").txn(txn).await {
                Ok(r) if r.succeeded() => {
                    let rev = r.header().map_or(0, |h| h.revision());
                    c.written = Some(rev);
                    c.seq = Some(seq);
                    if let Some(prev) = seen.filter(|e| e.value.host != self.me.host) {
                        tracing::info!("guest {mac}: claimed from host {} (seq {seq})", prev.value.host);
                    } else {
                        tracing::info!("guest {mac}: published in network {} (seq {seq})", c.network);
                    }
                    // Our own write comes back through the watch too; note it now.
                    self.seqs.insert(mac.clone(), seq.max(self.seqs.get(mac).copied().unwrap_or(0)));
                    self.guests.insert(mac.clone(), GuestEntry { value: v, mod_revision: rev });
                }
                Ok(_) => tracing::debug!("guest {mac}: its key changed under us; trying again"),
                Err(e) => tracing::warn!("etcd: cannot publish guest {mac}: {e}"),
            }
        }
        self.rebuild();
    }

    /// Publishes this host's traffic counters (on its lease, so they go
    /// with the host).
    pub async fn publish_traffic(&mut self, t: Traffic) {
        let (Some((lease, ..)), Some(client)) = (self.lease.as_ref(), self.client.as_mut()) else { return };
        let key = key(&self.etcd.prefix, "traffic", &self.me.host);
        let v = serde_json::to_string(&t).expect("plain struct");
        if let Err(e) = client.put(key, v, Some(PutOptions::new().with_lease(*lease))).await {
            tracing::warn!("etcd: cannot publish traffic: {e}");
        }
    }

    /// The overlay as last seen, once it has been listed.
    pub fn view(&self) -> Option<View<'_>> {
        Some(View { hosts: &self.hosts, guests: &self.routed, revision: self.revision? })
    }

    /// The local interfaces this host holds in etcd (MAC → network): a
    /// claim written and not lost.
    pub fn held(&self, local: &BTreeMap<String, (u32, String)>) -> BTreeMap<String, String> {
        local
            .iter()
            .filter(|(m, (id, _))| {
                self.claims.get(*m).is_some_and(|c| c.iface == *id && c.written.is_some() && !c.lost)
                    && self.routed.get(*m).is_some_and(|g| g.host == self.me.host)
            })
            .map(|(m, (_, n))| (m.clone(), n.clone()))
            .collect()
    }
}

#[cfg(test)]
#[path = "store_tests.rs"]
mod tests;
