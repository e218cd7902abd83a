//! The store's session with etcd: connecting (one member at a time, the
//! next that answers after any failure), the registration's lease, the
//! watch resumed from the last revision seen (or the overlay listed), and
//! how long to wait and what to keep when etcd fails or is slow.

use super::Store;
use crate::etcd::REQUEST_TIMEOUT;
use crate::lease::{Lease, State as LeaseState};
use crate::records::reg_key;
use etcd_client::{GetOptions, PutOptions, WatchOptions};
use std::time::{Duration, Instant};

pub(super) async fn bounded<T>(timeout: Duration, f: impl std::future::Future<Output = Result<T, etcd_client::Error>>) -> anyhow::Result<T> {
    match tokio::time::timeout(timeout, f).await {
        Ok(r) => Ok(r?),
        Err(_) => anyhow::bail!("etcd did not answer in {} s", timeout.as_secs()),
    }
}

/// Our lease's keep-alive got no answer in time (etcd slow: the lease may
/// well live).
#[derive(Debug)]
struct KeepAliveUnanswered;

impl std::fmt::Display for KeepAliveUnanswered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("lease keep-alive unanswered")
    }
}

impl std::error::Error for KeepAliveUnanswered {}

/// Whether `e` says etcd is slow or between leaders, not gone: a request
/// timed out (the client's deadline, or etcd's own "request timed out"),
/// our keep-alive went unanswered, or the member answered that the cluster
/// has no leader just now.
fn slow_not_gone(e: &anyhow::Error) -> bool {
    if e.is::<KeepAliveUnanswered>() {
        return true;
    }
    match e.downcast_ref::<etcd_client::Error>() {
        Some(etcd_client::Error::GRpcStatus(st)) => match st.code() {
            tonic::Code::Cancelled | tonic::Code::DeadlineExceeded => true,
            tonic::Code::Unavailable => st.message().starts_with("etcdserver:"),
            _ => false,
        },
        _ => false,
    }
}

/// How long to wait before the next try at etcd after `failures` in a row:
/// 200 ms doubling to 10 s, each drawn at random between half and all of
/// it, so that many agents that lost etcd together (a member down, an
/// overloaded cluster at a thousand hosts' bring-up) do not come back
/// together and overload it again.
pub fn backoff(failures: u32) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let full = Duration::from_millis(200).saturating_mul(1 << failures.saturating_sub(1).min(6)).min(Duration::from_secs(10));
    // A random fraction from the standard library's randomly keyed hasher.
    let r = std::collections::hash_map::RandomState::new().build_hasher().finish();
    full / 2 + full.mul_f64((r % 1000) as f64 / 2000.0)
}

impl Store {
    /// Connects, registers the host and lists the overlay, as far as etcd
    /// lets it; what fails is tried again after `backoff`.
    pub async fn maintain(&mut self) {
        if Instant::now() < self.retry_at {
            return;
        }
        if let Err(e) = self.try_maintain().await {
            self.failures += 1;
            let wait = backoff(self.failures);
            if self.failures <= 3 || self.failures % 10 == 0 {
                tracing::warn!("etcd: {e:#} (routes stay as they are; trying again in {} ms, failure {})", wait.as_millis(), self.failures);
            }
            self.retry_at = Instant::now() + wait;
            // etcd slow, not gone (a request timed out, or etcd's own
            // "request timed out" or "no leader"): the connection, the
            // lease and the watch are kept, and only what failed is tried
            // again. Starting afresh would list the whole overlay again,
            // which is what overloads etcd most (bench/scale.py at 1,000
            // hosts: a storm of listings, each timing out). Three in a
            // row on one member and it is left for the next.
            if slow_not_gone(&e) && self.failures % 3 != 0 {
                return;
            }
            // Start afresh with the next member: a new connection, the
            // same lease kept alive through it if it still lives (the
            // registration stays: a member lost is no host lost), a new
            // listing.
            self.watch = None;
            self.client = None;
            self.endpoint_at += 1;
            if let Some(l) = self.lease.take() {
                self.lease_id = Some(l.id);
            }
        }
    }

    async fn try_maintain(&mut self) -> anyhow::Result<()> {
        if self.client.is_none() {
            let (c, at, rev) = self.etcd.connect_from(self.endpoint_at).await?;
            self.endpoint_at = at;
            tracing::info!("etcd: connected to {}", self.etcd.endpoints[at]);
            self.client = Some(c);
            // A member behind what we have seen (a restored backup) has
            // none of the events we would watch for: listed again.
            if self.revision.is_some_and(|r| rev < r) {
                self.relist_needed = true;
            }
        }
        // A lease that lived through a reconnection: kept alive again
        // through the new one (its keys stay as they are).
        if let (None, Some(id)) = (&self.lease, self.lease_id.take()) {
            let client = self.client.as_mut().expect("connected above");
            // The client reads the stream's first answer itself, and calls
            // a lease etcd no longer has (it expired while etcd was away
            // or unreachable: a TTL of 0) an error of its own kind: that is
            // no failure to back off from, but a registration to make anew
            // at once (below). Any other error is tried again.
            // As long as a request may take: an etcd slow to answer (a
            // thousand hosts at once) must not make the agent give up on
            // its lease, member after member.
            match tokio::time::timeout(REQUEST_TIMEOUT, client.lease_keep_alive(id)).await {
                Ok(Ok((keeper, stream))) => {
                    tracing::info!("etcd: lease {id:x} kept through the new connection");
                    self.lease = Some(Lease::start(id, self.me.ttl, keeper, stream, self.attention.clone()));
                }
                Ok(Err(etcd_client::Error::LeaseKeepAliveError(_))) => {
                    tracing::warn!("etcd: our lease {id:x} expired meanwhile; registering again")
                }
                Ok(Err(e)) => {
                    self.lease_id = Some(id);
                    return Err(e.into());
                }
                Err(_) => {
                    self.lease_id = Some(id);
                    return Err(KeepAliveUnanswered.into());
                }
            }
        }
        // The lease, kept alive by its task: a lost one (etcd down longer
        // than the TTL) is granted again and everything of ours written
        // again under it; one whose keep-alive failed is kept alive again
        // through this connection, or the next.
        let ttl = self.me.ttl;
        match self.lease.as_ref().map(Lease::state) {
            Some(LeaseState::Expired) => {
                tracing::warn!("etcd: our lease expired; registering again");
                self.lease = None;
            }
            Some(LeaseState::Broken) => {
                let id = self.lease.take().map(|l| l.id);
                self.lease_id = id;
                return Err(KeepAliveUnanswered.into());
            }
            _ => {}
        }
        let v = self.reg_value()?;
        let client = self.client.as_mut().expect("connected above");
        if self.lease.is_none() {
            let id = client.lease_grant(ttl, None).await?.id();
            let (keeper, stream) = client.lease_keep_alive(id).await?;
            client.put(reg_key(&self.etcd.prefix, &self.me.host), v, Some(PutOptions::new().with_lease(id))).await?;
            self.lease = Some(Lease::start(id, ttl, keeper, stream, self.attention.clone()));
            // A new lease: the traffic key (on the old one) is gone.
            self.traffic_sent = None;
            self.reregister = false;
            tracing::info!("etcd: host {} registered (lease {id:x}, ttl {ttl} s)", self.me.host);
        }
        if self.reregister {
            if let Some(l) = &self.lease {
                let (id, v) = (l.id, self.reg_value()?);
                let client = self.client.as_mut().expect("connected above");
                client.put(reg_key(&self.etcd.prefix, &self.me.host), v, Some(PutOptions::new().with_lease(id))).await?;
            }
            self.reregister = false;
        }
        if self.watch.is_none() {
            // The watch broke (a member lost, a connection cut): it goes on
            // from the last revision seen, on whichever member answers now,
            // and nothing is listed again; only when etcd compacted past it
            // (or before anything was listed) is the overlay listed. Every
            // agent listing the whole overlay again after a member's loss
            // was what overloaded etcd most at 1,000 hosts.
            match (self.revision, self.relist_needed) {
                (Some(rev), false) => self.rewatch(rev).await?,
                _ => self.relist().await?,
            }
        }
        self.failures = 0;
        Ok(())
    }

    /// Watches again from the revision after `rev`, the last one seen.
    async fn rewatch(&mut self, rev: i64) -> anyhow::Result<()> {
        let prefix = format!("{}/", self.etcd.prefix);
        let client = self.client.as_mut().expect("connected");
        let stream = client.watch(prefix, Some(WatchOptions::new().with_prefix().with_start_revision(rev + 1))).await?;
        self.watch = Some(stream);
        tracing::info!("etcd: watching again from revision {}", rev + 1);
        Ok(())
    }

    /// Lists the prefix and watches from the revision after it.
    async fn relist(&mut self) -> anyhow::Result<()> {
        let prefix = format!("{}/", self.etcd.prefix);
        let client = self.client.as_mut().expect("connected");
        // Served by the member itself (serializable), not through the
        // leader: a thousand agents listing at once (a bring-up, the
        // leader's loss) spread over the members; the watch from the
        // listing's revision on the same member brings anything newer.
        let resp = client.get(prefix.clone(), Some(GetOptions::new().with_prefix().with_serializable())).await?;
        let rev = resp.header().map_or(0, |h| h.revision());
        self.hosts.clear();
        self.hosts_changed += 1;
        self.claimed.clear();
        self.by_host.clear();
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
        self.relist_needed = false;
        self.listings += 1;
        self.adopt_own_claims();
        self.touched_all = true;
        self.forget_due = true;
        // A listing, even of an empty overlay, is news to the MAC list.
        self.moved = true;
        self.rebuild();
        tracing::info!("etcd: listed {} hosts and {} guests at revision {rev}", self.hosts.len(), self.claimed.len());
        Ok(())
    }
}
