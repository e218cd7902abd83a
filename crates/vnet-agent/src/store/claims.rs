//! This host's writes: its guests' claims (created only if absent, in one
//! transaction a pass), their addresses, their release and deletion, and
//! its traffic counters; a write given up is made again at a pass of its
//! own, soon.

use super::session::{backoff, bounded};
use super::{Claim, Store, WRITE_TIMEOUT};
use crate::etcd::REQUEST_TIMEOUT;
use crate::records::{can_forget, chain, guest_key, holder, new_epoch, traffic_key, usable_ips, ClaimSeen, Claims, GuestValue, Holding, Traffic};
use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// The addresses a guest held at the host it left: those of the last
/// holder that let it go, if another host (its release keeps them). Never
/// a claim that only waited: a host that claimed the MAC ahead of time
/// does not choose the addresses it comes with.
fn inherited_ips(claims: Option<&Claims>, me: &str) -> Vec<IpAddr> {
    claims
        .and_then(|cl| chain(cl).take_while(|(_, c)| c.released).last())
        .filter(|((h, _), _)| h != me)
        .map_or_else(Vec::new, |(_, c)| c.ips.clone())
}

/// A write of ours, given the time writes are given now (`timeout`):
/// doubled after one is given up, up to a request's whole time (under a
/// thousand hosts' bring-up a write takes seconds, and giving up at 2 s
/// again and again only adds to it), back to `WRITE_TIMEOUT` once one is
/// answered.
async fn write<T>(timeout: &mut Duration, f: impl std::future::Future<Output = Result<T, etcd_client::Error>>) -> anyhow::Result<T> {
    let r = bounded(*timeout, f).await;
    *timeout = if r.is_ok() { WRITE_TIMEOUT } else { (*timeout * 2).min(REQUEST_TIMEOUT) };
    r
}

impl Store {
    /// Claims the MACs of new local interfaces, releases those of
    /// interfaces gone, makes again a claim that missed a hand-over by a
    /// moment, and forgets released claims no reader needs. Only while etcd
    /// answers; otherwise next time.
    pub async fn publish(&mut self, local: &BTreeMap<String, (u32, String)>, ips: &BTreeMap<String, Vec<IpAddr>>) {
        if self.lease.is_none() || self.revision.is_none() {
            return;
        }
        self.publish_retry = None;
        let (prefix, host) = (self.etcd.prefix.clone(), self.me.host.clone());
        // Guests gone: their claims released (a key of ours, rewritten).
        let gone: Vec<String> = self.claims.keys().filter(|m| !local.contains_key(*m)).cloned().collect();
        for mac in gone {
            let c = self.claims.remove(&mac).expect("listed above");
            self.touched.insert(mac.clone());
            if let (None, Some(trying)) = (&c.epoch, &c.trying) {
                // A claim whose write's answer did not come (etcd may hold
                // it): released as any other of ours given up.
                self.given_up.insert((mac.clone(), trying.clone()), Some(c.network.clone()));
            }
            if let Some(epoch) = &c.epoch {
                if let Err(e) = self.release(&mac, epoch, &c.network, &c.ips).await {
                    tracing::warn!("etcd: cannot release guest {mac}: {e}");
                    self.publish_failed();
                    self.claims.insert(mac, c);
                    continue;
                }
                tracing::info!("guest {mac}: released (its interface is gone)");
            }
        }
        let now = Instant::now();
        // New claims, written together (one etcd revision, one watch event
        // to each host for all of them: a host coming up with its guests
        // costs etcd one write and its watchers one message, not one each).
        let mut new_claims: Vec<(String, String, String)> = Vec::new();
        let mut retry = false;
        for (mac, (id, network)) in local {
            let c = self
                .claims
                .entry(mac.clone())
                .or_insert_with(|| Claim { iface: *id, network: network.clone(), epoch: None, trying: None, since: now, waiting: false, ips: Vec::new() });
            // An interface added again (or renumbered by a restarted vnetd)
            // keeps its claim, and with it its place.
            c.iface = *id;
            if &c.network != network {
                // Moved to another network: claimed again, the old claim
                // released.
                c.trying = None;
                if let Some(e) = c.epoch.take() {
                    self.given_up.insert((mac.clone(), e), Some(c.network.clone()));
                }
                c.network = network.clone();
                self.touched.insert(mac.clone());
            } else if c.epoch.is_some()
                && now.duration_since(c.since) < self.handover
                && matches!(self.claimed.get(mac).map(|cl| holder(cl, |h| self.hosts.contains_key(h))), Some(Holding::Free))
            {
                // The holder let the MAC go just after our guest started
                // here and claimed it (a migration): our claim, made before
                // the release, is off the chain; made again, it is the
                // first after it.
                tracing::info!("guest {mac}: its holder let it go just after we claimed it: claiming it again");
                if let Some(e) = c.epoch.take() {
                    self.given_up.insert((mac.clone(), e), None);
                }
            }
            // A claim of ours for it that etcd holds already (a write whose
            // answer was lost: etcd timed out after committing it) is
            // taken as it is, never claimed a second time behind it.
            let written = if self.claims[mac].epoch.is_none() { self.own_claims(mac, Some(network)).into_iter().next() } else { None };
            let c = self.claims.get_mut(mac).expect("inserted above");
            // What vnetd heard the guest say; until it says anything here,
            // what it held at its last host (a guest that migrated needs
            // no ARP of its own to have its address answered for again).
            let mut now_ips = ips.get(mac).map_or_else(Vec::new, |i| usable_ips(i));
            if now_ips.is_empty() {
                now_ips = if c.ips.is_empty() { inherited_ips(self.claimed.get(mac), &host) } else { c.ips.clone() };
            }
            if let Some(epoch) = c.epoch.clone() {
                if c.ips != now_ips {
                    // The guest holds other addresses now: its record says
                    // so (one write; the claim keeps its place).
                    let v = serde_json::to_string(&GuestValue { network: c.network.clone(), released: false, ips: now_ips.clone() }).expect("plain struct");
                    match write(&mut self.write_timeout, self.client.as_mut().expect("connected").put(guest_key(&prefix, &host, mac, &epoch), v, None)).await {
                        Ok(_) => {
                            tracing::info!("guest {mac}: holds {}", now_ips.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(", "));
                            c.ips = now_ips;
                        }
                        Err(e) => {
                            tracing::warn!("etcd: cannot publish guest {mac}'s addresses: {e}");
                            retry = true;
                        }
                    }
                }
                continue;
            }
            if let Some(epoch) = written {
                tracing::info!("guest {mac}: our claim {epoch} was written after all: taken as it is");
                c.ips = self.claimed[mac][&(host.clone(), epoch.clone())].ips.clone();
                c.epoch = Some(epoch);
                c.trying = None;
                self.touched.insert(mac.clone());
                continue;
            }
            let epoch = c.trying.get_or_insert_with(new_epoch).clone();
            c.ips = now_ips;
            let v = serde_json::to_string(&GuestValue { network: c.network.clone(), released: false, ips: c.ips.clone() }).expect("plain struct");
            new_claims.push((mac.clone(), epoch, v));
        }
        if retry {
            self.publish_failed();
        }
        self.write_given_up().await;
        // etcd takes at most 128 operations a transaction (--max-txn-ops).
        for batch in new_claims.chunks(100) {
            // Created only if absent: a retry of a write whose answer was
            // lost finds its keys there and writes nothing (no second
            // revision, no second event to every host), reading back the
            // revisions they were made at instead.
            let keys: Vec<String> = batch.iter().map(|(mac, epoch, _)| guest_key(&prefix, &host, mac, epoch)).collect();
            let absent: Vec<Compare> = keys.iter().map(|k| Compare::create_revision(k.as_str(), CompareOp::Equal, 0)).collect();
            let puts: Vec<TxnOp> = keys.iter().zip(batch).map(|(k, (_, _, v))| TxnOp::put(k.as_str(), v.as_str(), None)).collect();
            let gets: Vec<TxnOp> = keys.iter().map(|k| TxnOp::get(k.as_str(), None)).collect();
            let txn = Txn::new().when(absent).and_then(puts).or_else(gets);
            match write(&mut self.write_timeout, self.client.as_mut().expect("connected").txn(txn)).await {
                Ok(r) => {
                    // Our own writes come back through the watch too; noted now.
                    let rev = r.header().map_or(0, |h| h.revision());
                    let made: Vec<Option<i64>> = if r.succeeded() {
                        vec![Some(rev); batch.len()]
                    } else {
                        r.op_responses()
                            .iter()
                            .map(|o| match o {
                                etcd_client::TxnOpResponse::Get(g) => g.kvs().first().map(|kv| kv.create_revision()),
                                _ => None,
                            })
                            .collect()
                    };
                    for ((mac, epoch, _), made) in batch.iter().zip(made) {
                        let Some(created) = made else {
                            // Not there (it was not in the lost write):
                            // written at the next try.
                            self.publish_failed();
                            continue;
                        };
                        let Some(c) = self.claims.get_mut(mac) else { continue };
                        tracing::info!("guest {mac}: claimed in network {}", c.network);
                        let seen = ClaimSeen { network: c.network.clone(), create_revision: created, mod_revision: created, released: false, ips: c.ips.clone() };
                        self.claimed.entry(mac.clone()).or_default().insert((host.clone(), epoch.clone()), seen);
                        self.by_host.entry(host.clone()).or_default().insert(mac.clone());
                        c.epoch = Some(epoch.clone());
                        c.trying = None;
                        c.since = Instant::now();
                        self.touched.insert(mac.clone());
                    }
                    self.forget_due = true;
                }
                Err(e) => {
                    tracing::warn!("etcd: cannot publish {} guest(s): {e} (written again, under the same keys, soon)", batch.len());
                    self.publish_failed();
                }
            }
        }
        // Two claims of ours of one MAC in its network (an agent before
        // `trying`, whose claim's answer was lost and which claimed again):
        // the one that holds the MAC (else the first) is kept, and taken as
        // ours if it was not; the other, which only waits, goes. A claim we
        // gave up is none of them: it is being deleted, and the claim made
        // after it is the one that holds.
        let mut twice: Vec<(String, String)> = Vec::new();
        let held: Vec<(String, String)> = self.claims.iter().filter(|(_, c)| c.epoch.is_some()).map(|(m, c)| (m.clone(), c.network.clone())).collect();
        for (mac, network) in held {
            let mut own = self.own_claims(&mac, Some(&network));
            if own.len() < 2 {
                continue;
            }
            let c = self.claims.get_mut(&mac).expect("listed above");
            let keep = own.remove(0);
            if c.epoch.as_ref() != Some(&keep) {
                c.epoch = Some(keep);
                self.touched.insert(mac.clone());
            }
            twice.extend(own.into_iter().map(|e| (mac.clone(), e)));
        }
        for (mac, epoch) in twice {
            tracing::info!("guest {mac}: a second claim of ours ({epoch}) only waits behind the one kept: deleted");
            if let Err(e) = self.forget(&mac, &epoch).await {
                tracing::warn!("etcd: cannot delete guest {mac}'s second claim: {e}");
                self.publish_failed();
            }
        }
        // Released claims of ours that no reader needs any more (looked for
        // when claims changed).
        let now = Instant::now();
        let mut done: Vec<(String, String)> = Vec::new();
        if std::mem::take(&mut self.forget_due) || self.forget_at.is_some_and(|t| now >= t) {
            let mut kept_until = BTreeMap::new();
            for (mac, cl) in &self.claimed {
                for (k, _) in cl.iter().filter(|(k, c)| k.0 == host && c.released) {
                    let key = (mac.clone(), k.1.clone());
                    let until = self.kept_until.get(&key).copied().unwrap_or(now + self.handover);
                    if can_forget(cl, k, now >= until) {
                        done.push(key.clone());
                    }
                    kept_until.insert(key, until);
                }
            }
            self.forget_at = kept_until.iter().filter(|(k, t)| **t > now && !done.contains(k)).map(|(_, t)| *t).min();
            self.kept_until = kept_until;
        }
        for (mac, epoch) in done {
            if let Err(e) = self.forget(&mac, &epoch).await {
                self.forget_due = true;
                tracing::warn!("etcd: cannot forget guest {mac}'s released claim: {e}");
                self.publish_failed();
            }
        }
        self.rebuild();
    }

    /// Writes the claims of ours given up (released or deleted,
    /// `given_up`); one that fails stays for the next pass.
    async fn write_given_up(&mut self) {
        let todo: Vec<((String, String), Option<String>)> = self.given_up.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        for ((m, epoch), release_in) in todo {
            let r = match &release_in {
                Some(net) => self.release(&m, &epoch, net, &[]).await,
                None => self.forget(&m, &epoch).await,
            };
            match r {
                Ok(()) => {
                    self.given_up.remove(&(m, epoch));
                }
                Err(e) => {
                    tracing::warn!("etcd: cannot give up guest {m}'s old claim {epoch}: {e} (written again soon)");
                    self.publish_failed();
                }
            }
        }
    }

    /// A write of `publish` failed: tried again soon, at a pass of its own.
    fn publish_failed(&mut self) {
        let again = Instant::now() + backoff(self.failures + 1);
        self.publish_retry = Some(self.publish_retry.map_or(again, |t| t.min(again)));
    }

    /// Rewrites our claim `epoch` of `mac` as released.
    /// Rewrites our claim `epoch` of `mac` as released; `ips`, the addresses
    /// its guest held here, stay in it for the host it goes to
    /// (`inherited_ips`).
    async fn release(&mut self, mac: &str, epoch: &str, network: &str, ips: &[IpAddr]) -> anyhow::Result<()> {
        // Written already (a release whose answer was lost, seen since
        // through the watch): nothing more to write. Under an overloaded
        // etcd each write given up and made again was a new revision, and
        // an event to every host.
        let key_of = (self.me.host.clone(), epoch.to_string());
        if self.claimed.get(mac).and_then(|cl| cl.get(&key_of)).is_some_and(|c| c.released) {
            return Ok(());
        }
        let v = serde_json::to_string(&GuestValue { network: network.to_string(), released: true, ips: ips.to_vec() }).expect("plain struct");
        let key = guest_key(&self.etcd.prefix, &self.me.host, mac, epoch);
        let r = write(&mut self.write_timeout, self.client.as_mut().expect("connected").put(key, v, None)).await?;
        let rev = r.header().map_or(0, |h| h.revision());
        if let Some(c) = self.claimed.get_mut(mac).and_then(|cl| cl.get_mut(&(self.me.host.clone(), epoch.to_string()))) {
            c.released = true;
            c.mod_revision = rev;
        }
        Ok(())
    }

    /// Deletes our claim `epoch` of `mac`.
    async fn forget(&mut self, mac: &str, epoch: &str) -> anyhow::Result<()> {
        // Gone already (a delete whose answer was lost): nothing to write.
        if !self.claimed.get(mac).is_some_and(|cl| cl.contains_key(&(self.me.host.clone(), epoch.to_string()))) {
            return Ok(());
        }
        let key = guest_key(&self.etcd.prefix, &self.me.host, mac, epoch);
        write(&mut self.write_timeout, self.client.as_mut().expect("connected").delete(key, None)).await?;
        self.touched.insert(mac.to_string());
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
        let (Some(lease), Some(client)) = (self.lease.as_ref().map(|l| l.id), self.client.as_mut()) else { return };
        let v = serde_json::to_string(&t).expect("plain struct");
        match client.put(traffic_key(&self.etcd.prefix, &self.me.host), v, Some(PutOptions::new().with_lease(lease))).await {
            Ok(_) => self.traffic_sent = Some(unstamped),
            Err(e) => tracing::warn!("etcd: cannot publish traffic: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::ClaimSeen;

    fn claim(created: i64, modified: i64, released: bool, ip: &str) -> ClaimSeen {
        ClaimSeen { network: "a".into(), create_revision: created, mod_revision: modified, released, ips: vec![ip.parse().expect("an address")] }
    }

    /// A guest that migrated to h2 comes with the addresses its last holder
    /// (h1) released it with, not with those of a claim that only waited (a
    /// rogue h9 claiming the MAC while h1 held it, its record rewritten
    /// since with another guest's address). Fails if the newest claim of
    /// another host is taken, as it was.
    #[test]
    fn a_migrated_guest_comes_with_its_last_holders_addresses_only() {
        let mut cl: Claims = Claims::new();
        cl.insert(("h1".into(), "e1".into()), claim(10, 30, true, "198.19.0.11"));
        cl.insert(("h9".into(), "e9".into()), claim(20, 50, false, "198.19.0.99"));
        cl.insert(("h2".into(), "e2".into()), claim(40, 40, false, "198.19.0.12"));
        assert_eq!(inherited_ips(Some(&cl), "h2"), vec!["198.19.0.11".parse::<IpAddr>().unwrap()]);
        // h2 claimed before h1 let go (it waits too): still h1's.
        cl.remove(&("h2".to_string(), "e2".to_string()));
        cl.insert(("h2".into(), "e2".into()), claim(25, 25, false, "198.19.0.12"));
        assert_eq!(inherited_ips(Some(&cl), "h2"), vec!["198.19.0.11".parse::<IpAddr>().unwrap()]);
        // Nobody let it go to us: nothing inherited.
        assert!(inherited_ips(Some(&Claims::new()), "h2").is_empty());
        assert!(inherited_ips(None, "h2").is_empty());
    }
}
