//! Claims against a real etcd (docs/controller.md "Claims, migration and
//! conflicts"): two hosts claim one MAC; the first claim holds it, whatever
//! the second host writes or however late its agent reads; when the first
//! host releases it, the claim that waited does not take it (the security
//! review's F4: a rogue host's early claim took a guest at its migration),
//! a claim made after the release does, and so does a claim made just
//! before it by a guest that had just started (a migration's new host
//! claiming a moment early); a holder whose host is gone strands the MAC.
//!
//! The test starts its own etcd (`etcd` from Debian's etcd-server, which
//! scripts/setup installs) on free loopback ports, in a temporary
//! directory. Catches (each mutated so, in records.rs's `holder` or
//! store.rs): the later claim winning (the rule before the per-host
//! records: a rogue host took any MAC), a waiting claim taking over at a
//! release (the rule before the chain), a claim losing its place when its
//! host registers again, and a host gone handing its guests over.

use super::session::backoff;
use super::*;
use etcd_client::GetOptions;
use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

struct Etcd {
    child: Child,
    dir: PathBuf,
    url: String,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free loopback port").port()
}

impl Etcd {
    fn start() -> Etcd {
        let (client, peer) = (free_port(), free_port());
        let dir = std::env::temp_dir().join(format!("vnet-agent-store-tests-{}-{client}", std::process::id()));
        let url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let child = Command::new("etcd")
            .args(["--name", "t", "--data-dir"])
            .arg(&dir)
            .args(["--listen-client-urls", &url, "--advertise-client-urls", &url])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("t={peer_url}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("cannot run etcd (Debian's etcd-server: scripts/setup installs it)");
        Etcd { child, dir, url }
    }

    async fn client(&self) -> Client {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(mut c) = Client::connect([self.url.as_str()], None).await {
                if c.get("/", None).await.is_ok() {
                    return c;
                }
            }
            assert!(Instant::now() < deadline, "etcd at {} did not answer in 20 s", self.url);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A store for host `host` on the etcd at `url`.
fn store(url: &str, host: &str) -> Store {
    let etcd = EtcdArgs { endpoints: vec![url.to_string()], prefix: "/vnet".into(), cacert: None, cert: None, key: None, user: None, password_file: None };
    Store::new(&etcd, Registration { host: host.into(), underlay: "198.18.0.1".parse().expect("an address"), port: 9000, wireguard: None, ttl: 5 })
}

/// This host's interfaces, as `publish` takes them: MAC -> (vnetd id, network).
fn ifaces(list: &[(&str, u32)]) -> BTreeMap<String, (u32, String)> {
    list.iter().map(|(m, id)| (m.to_string(), (*id, "a".to_string()))).collect()
}

/// Reads what the watch brought.
async fn settle(s: &mut Store) {
    tokio::time::sleep(Duration::from_millis(200)).await;
    s.drain().await;
}

/// Who holds `mac` as store `s` routes it.
fn holder_of(s: &Store, mac: &str) -> Option<String> {
    s.routed.get(mac).map(|g| g.host.clone())
}

/// Makes `s`'s claim of `mac` look as if its guest started long ago.
fn started_long_ago(s: &mut Store, mac: &str) {
    s.claims.get_mut(mac).expect("a claim").since = Instant::now() - HANDOVER * 2;
}

#[test]
fn a_mac_goes_down_its_chain_of_holders_and_never_to_a_claim_that_waited() {
    let etcd = Etcd::start();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    rt.block_on(async {
        let _c = etcd.client().await;
        let m = "02:00:00:00:00:0c";
        let mut h1 = store(&etcd.url, "h1");
        h1.maintain().await;
        h1.publish(&ifaces(&[(m, 1)]), &Default::default()).await;
        // h3 claims the same MAC later (a clone, a rogue host): every
        // reader, h3 too, gives it to h1.
        let mut h3 = store(&etcd.url, "h3");
        h3.maintain().await;
        h3.publish(&ifaces(&[(m, 7)]), &Default::default()).await;
        settle(&mut h1).await;
        settle(&mut h3).await;
        assert_eq!(holder_of(&h1, m).as_deref(), Some("h1"));
        assert_eq!(holder_of(&h3, m).as_deref(), Some("h1"), "h3's later claim took the MAC");
        assert!(h3.held(&ifaces(&[(m, 7)])).is_empty(), "h3 routes an interface it does not hold");
        assert_eq!(h1.held(&ifaces(&[(m, 1)])).len(), 1);
        assert_eq!((h1.contested, h3.contested), (1, 1), "each saw the contested claim once");
        started_long_ago(&mut h3, m);
        // h1 registers again on a new lease (etcd was slow past its TTL):
        // its claim keeps its place.
        h1.lease = None;
        h1.maintain().await;
        h1.publish(&ifaces(&[(m, 1)]), &Default::default()).await;
        settle(&mut h3).await;
        assert_eq!(holder_of(&h3, m).as_deref(), Some("h1"), "h1's claim lost its place on its new lease");
        // h1's guest leaves (migrates): h1 releases its claim. h3's claim,
        // made while h1 held the MAC, does not take it, even when h3's
        // agent passes again: nobody holds it.
        h1.publish(&ifaces(&[]), &Default::default()).await;
        settle(&mut h3).await;
        h3.publish(&ifaces(&[(m, 7)]), &Default::default()).await;
        settle(&mut h3).await;
        settle(&mut h1).await;
        assert_eq!(holder_of(&h3, m), None, "the waiting claim took the MAC at the hand-over");
        assert_eq!(holder_of(&h1, m), None);
        // The guest starts on h2, which claims it: h2 holds it.
        let mut h2 = store(&etcd.url, "h2");
        h2.maintain().await;
        h2.publish(&ifaces(&[(m, 4)]), &Default::default()).await;
        for s in [&mut h1, &mut h2, &mut h3] {
            settle(s).await;
            assert_eq!(holder_of(s, m).as_deref(), Some("h2"));
        }
        assert_eq!(h2.held(&ifaces(&[(m, 4)])).len(), 1);
        // A migration whose new host claims a moment before the old one
        // releases: h4's guest starts and claims; h2 releases after.
        let mut h4 = store(&etcd.url, "h4");
        h4.maintain().await;
        h4.publish(&ifaces(&[(m, 2)]), &Default::default()).await;
        settle(&mut h2).await;
        h2.publish(&ifaces(&[]), &Default::default()).await;
        settle(&mut h4).await;
        // Its claim missed the release by a moment: h4 claims again, and holds it.
        h4.publish(&ifaces(&[(m, 2)]), &Default::default()).await;
        for s in [&mut h1, &mut h3, &mut h4] {
            settle(s).await;
            assert_eq!(holder_of(s, m).as_deref(), Some("h4"), "the new host's early claim did not take the MAC");
        }
        // A fresh reader (an agent started now) gets the same answer.
        let mut h5 = store(&etcd.url, "h5");
        h5.maintain().await;
        assert_eq!(holder_of(&h5, m).as_deref(), Some("h4"));
        // h4's host goes (its lease revoked): the MAC is stranded, h3's
        // claim does not take it; released by hand, it is free.
        let id = h4.lease.as_ref().expect("a lease").id;
        h4.client.as_mut().expect("connected").lease_revoke(id).await.expect("revoked");
        settle(&mut h3).await;
        assert_eq!(holder_of(&h3, m), None, "a host gone handed its guest over");
        assert!(h3.stranded.contains(m));
        let released = crate::show::release(crate::show::ReleaseArgs::for_test(&etcd.url, "h4", &[m])).await;
        assert!(released.is_ok(), "{released:?}");
        settle(&mut h3).await;
        assert!(!h3.stranded.contains(m) && holder_of(&h3, m).is_none());
    });
}

/// A store's interfaces in network `net`.
fn ifaces_in(list: &[(&str, u32)], net: &str) -> BTreeMap<String, (u32, String)> {
    list.iter()
        .map(|(m, id)| (m.to_string(), (*id, net.to_string())))
        .collect()
}

/// docs/controller.md "At scale": a change to another network's guests
/// costs a host nothing (its store is not dirty: no pass reads vnetd or
/// derives), a change to its own networks' does, and the store kept up one
/// change at a time holds what a fresh listing of etcd holds. Catches a
/// store dirtied by every change (1,000 hosts each doing a full pass for
/// every guest anywhere) and an incremental rebuild that misses a change.
#[test]
fn only_changes_in_a_hosts_own_networks_make_it_work() {
    let etcd = Etcd::start();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    rt.block_on(async {
        let _c = etcd.client().await;
        let mut h1 = store(&etcd.url, "h1");
        h1.maintain().await;
        h1.publish(&ifaces_in(&[("02:00:00:00:01:01", 1)], "a"), &Default::default()).await;
        settle(&mut h1).await;
        h1.take_dirty();
        let mut h2 = store(&etcd.url, "h2");
        h2.maintain().await;
        settle(&mut h1).await;
        h1.take_dirty();
        // Another network's guests come and go: nothing for h1 to do.
        let b = ifaces_in(&[("02:00:00:00:02:01", 1), ("02:00:00:00:02:02", 2)], "b");
        h2.publish(&b, &Default::default()).await;
        settle(&mut h1).await;
        assert!(!h1.take_dirty(), "a guest of network b dirtied h1, which has none");
        assert_eq!(holder_of(&h1, "02:00:00:00:02:02").as_deref(), Some("h2"), "but h1 knows it");
        // One of h1's networks: h1 works.
        let mut both = b.clone();
        both.extend(ifaces_in(&[("02:00:00:00:02:03", 3)], "a"));
        h2.publish(&both, &Default::default()).await;
        settle(&mut h1).await;
        assert!(h1.take_dirty(), "a new guest of network a did not reach h1");
        // It leaves: h1 works again; a network-b guest leaving does not.
        h2.publish(&b, &Default::default()).await;
        settle(&mut h1).await;
        assert!(h1.take_dirty(), "a guest of network a leaving did not reach h1");
        h2.publish(&ifaces_in(&[("02:00:00:00:02:01", 1)], "b"), &Default::default()).await;
        settle(&mut h1).await;
        assert!(!h1.take_dirty());
        // What h1 built change by change is what a fresh listing builds.
        let mut fresh = store(&etcd.url, "h9");
        fresh.maintain().await;
        assert_eq!(h1.routed, fresh.routed);
        assert!(h1.routed.contains_key("02:00:00:00:02:01") && !h1.routed.contains_key("02:00:00:00:02:03"));
    });
}

/// The wait after failures at etcd grows from 200 ms to 10 s, and is drawn
/// at random in its upper half: a thousand agents that lost etcd together
/// come back spread out (bench/scale.py at 1,000 hosts was a storm of
/// reconnections every 200 ms before).
#[test]
fn retries_back_off_and_spread_out() {
    let first = backoff(1);
    assert!(first >= Duration::from_millis(100) && first <= Duration::from_millis(200), "{first:?}");
    let late = backoff(12);
    assert!(late >= Duration::from_secs(5) && late <= Duration::from_secs(10), "{late:?}");
    let draws: std::collections::BTreeSet<Duration> = (0..20).map(|_| backoff(8)).collect();
    assert!(draws.len() > 10, "not spread: {draws:?}");
}

/// A lease that ran out while etcd was away (etcd restarted after longer
/// than the TTL, or unreachable that long) is no failure: the first try
/// after the connection is back registers the host on a new lease, at
/// once. Before, the client's "lease not found" was taken for a failure,
/// and after a few failed tries in a row the agent waited up to 10 s more
/// (the CI run of 2026-11-28: a host not registered 15 s after etcd was
/// back).
#[test]
fn a_lease_gone_while_etcd_was_away_is_registered_again_at_the_first_try() {
    let etcd = Etcd::start();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    rt.block_on(async {
        let mut c = etcd.client().await;
        let mut h1 = store(&etcd.url, "h1");
        h1.maintain().await;
        let old = h1.lease.as_ref().map(|l| l.id).expect("registered on a lease");
        // The connection is lost after many failures (as `maintain` leaves
        // it), and the lease runs out meanwhile.
        h1.client = None;
        h1.watch = None;
        h1.lease = None;
        h1.lease_id = Some(old);
        h1.failures = 7;
        c.lease_revoke(old).await.expect("the lease revoked");
        h1.maintain().await;
        assert_eq!(h1.failures, 0, "the lost lease was taken for a failure");
        let new = h1.lease.as_ref().map(|l| l.id).expect("registered again");
        assert_ne!(new, old);
        let reg = c.get("/vnet/host/h1/reg", None).await.expect("a read");
        assert_eq!(reg.kvs().first().map(|kv| kv.lease()), Some(new), "the registration is not on the new lease");
    });
}

/// A claim whose write timed out after etcd committed it (etcd overloaded
/// at a thousand hosts' bring-up) is never made a second time behind
/// itself: the retry writes the same key. And two claims of one MAC by one
/// host (an agent before that rule) become one, the first: the later only
/// waits behind it, and a later release of it alone would have left the
/// first holding the MAC for good. Fails if a retry picks a new epoch, or
/// the first claim is the one deleted.
#[test]
fn a_claim_retried_or_made_twice_is_one_claim_the_first() {
    let etcd = Etcd::start();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    rt.block_on(async {
        let mut c = etcd.client().await;
        let m = "02:00:00:00:00:0c";
        let mine = |kvs: &etcd_client::GetResponse| -> Vec<(String, i64)> {
            kvs.kvs().iter().map(|kv| (String::from_utf8_lossy(kv.key()).into_owned(), kv.create_revision())).collect()
        };
        let mut h1 = store(&etcd.url, "h1");
        h1.maintain().await;
        // The first write's answer is lost: the claim was committed under
        // the epoch being tried, and the agent does not know it yet.
        h1.claims.insert(m.into(), Claim { iface: 1, network: "a".into(), epoch: None, trying: Some("00000000000000aa".into()), since: Instant::now(), waiting: false, ips: Vec::new() });
        c.put(format!("/vnet/host/h1/guests/{m}/00000000000000aa"), r#"{"network":"a"}"#, None).await.expect("a write");
        h1.publish(&ifaces(&[(m, 1)]), &Default::default()).await;
        let claims = c.get(format!("/vnet/host/h1/guests/{m}/"), Some(GetOptions::new().with_prefix())).await.expect("a read");
        assert_eq!(mine(&claims).len(), 1, "the retry made a second claim: {:?}", mine(&claims));
        settle(&mut h1).await;
        h1.publish(&ifaces(&[(m, 1)]), &Default::default()).await;
        let claims = c.get(format!("/vnet/host/h1/guests/{m}/"), Some(GetOptions::new().with_prefix())).await.expect("a read");
        assert_eq!(mine(&claims).len(), 1, "claimed twice: {:?}", mine(&claims));
        assert_eq!(h1.claims[m].epoch.as_deref(), Some("00000000000000aa"));
        // Two claims of ours already there, the agent holding the later.
        let n = "02:00:00:00:00:0d";
        c.put(format!("/vnet/host/h1/guests/{n}/00000000000000b1"), r#"{"network":"a"}"#, None).await.expect("a write");
        c.put(format!("/vnet/host/h1/guests/{n}/00000000000000b2"), r#"{"network":"a"}"#, None).await.expect("a write");
        settle(&mut h1).await;
        h1.claims.insert(n.into(), Claim { iface: 2, network: "a".into(), epoch: Some("00000000000000b2".into()), trying: None, since: Instant::now(), waiting: false, ips: Vec::new() });
        h1.publish(&ifaces(&[(m, 1), (n, 2)]), &Default::default()).await;
        let claims = c.get(format!("/vnet/host/h1/guests/{n}/"), Some(GetOptions::new().with_prefix())).await.expect("a read");
        assert_eq!(mine(&claims).iter().map(|(k, _)| k.rsplit('/').next().unwrap().to_string()).collect::<Vec<_>>(), ["00000000000000b1"]);
        assert_eq!(h1.claims[n].epoch.as_deref(), Some("00000000000000b1"), "the first claim is not the one held");
    });
}

/// At a hand-over under a slow etcd, the new host has two claims of its
/// own: the one made before the old host released (which only waits) and
/// the one made again after (which holds), the first's delete not yet
/// answered. The one that holds is kept and the other deleted, whichever
/// came first; the one given up is never taken back as ours. Fails as the
/// 1,000-host churn did (a migrated guest held by no one for good, on 200
/// hosts): keeping the first and deleting the holder.
#[test]
fn at_a_hand_over_the_claim_made_again_is_kept_not_the_one_that_waited() {
    let etcd = Etcd::start();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    rt.block_on(async {
        let mut c = etcd.client().await;
        let mut h1 = store(&etcd.url, "h1");
        h1.maintain().await;
        let mut h2 = store(&etcd.url, "h2");
        h2.maintain().await;
        let ours = |r: &etcd_client::GetResponse| -> Vec<String> {
            r.kvs().iter().map(|kv| String::from_utf8_lossy(kv.key()).rsplit('/').next().unwrap().to_string()).collect()
        };
        // Both claims of h2 there (its agent restarted between, or the
        // delete of the first was lost): the one that holds is kept.
        let m = "02:00:00:00:00:0e";
        h1.publish(&ifaces(&[(m, 1)]), &Default::default()).await;
        c.put(format!("/vnet/host/h2/guests/{m}/00000000000000e1"), r#"{"network":"a"}"#, None).await.expect("a write");
        h1.publish(&ifaces(&[]), &Default::default()).await;
        c.put(format!("/vnet/host/h2/guests/{m}/00000000000000e2"), r#"{"network":"a"}"#, None).await.expect("a write");
        settle(&mut h2).await;
        assert_eq!(holder_of(&h2, m).as_deref(), Some("h2"));
        h2.claims.insert(m.into(), Claim { iface: 2, network: "a".into(), epoch: Some("00000000000000e2".into()), trying: None, since: Instant::now(), waiting: false, ips: Vec::new() });
        h2.publish(&ifaces(&[(m, 2)]), &Default::default()).await;
        settle(&mut h2).await;
        let left = c.get(format!("/vnet/host/h2/guests/{m}/"), Some(GetOptions::new().with_prefix())).await.expect("a read");
        assert_eq!(ours(&left), ["00000000000000e2"], "the claim that holds was deleted, the one that waited kept");
        assert_eq!(h2.claims[m].epoch.as_deref(), Some("00000000000000e2"));
        // The agent made its claim again (the holder let the MAC go), and
        // the old one's delete did not get through: the old one is not
        // taken back as ours, a new claim is made, and it holds.
        let n = "02:00:00:00:00:0f";
        h1.publish(&ifaces(&[(n, 1)]), &Default::default()).await;
        c.put(format!("/vnet/host/h2/guests/{n}/00000000000000f1"), r#"{"network":"a"}"#, None).await.expect("a write");
        h1.publish(&ifaces(&[]), &Default::default()).await;
        settle(&mut h2).await;
        assert_eq!(holder_of(&h2, n), None);
        h2.claims.insert(n.into(), Claim { iface: 3, network: "a".into(), epoch: None, trying: None, since: Instant::now(), waiting: false, ips: Vec::new() });
        h2.given_up.insert((n.into(), "00000000000000f1".into()), None);
        h2.publish(&ifaces(&[(m, 2), (n, 3)]), &Default::default()).await;
        settle(&mut h2).await;
        let left = c.get(format!("/vnet/host/h2/guests/{n}/"), Some(GetOptions::new().with_prefix())).await.expect("a read");
        assert!(h2.given_up.is_empty() && ours(&left).len() == 1 && ours(&left)[0] != "00000000000000f1", "{:?}", ours(&left));
        assert_eq!(h2.claims[n].epoch.as_deref(), Some(ours(&left)[0].as_str()));
        let mut h3 = store(&etcd.url, "h3");
        h3.maintain().await;
        assert_eq!((holder_of(&h3, m).as_deref(), holder_of(&h3, n).as_deref()), (Some("h2"), Some("h2")), "a migrated guest held by no one");
    });
}

/// A watch that broke (a member lost, a connection cut) goes on from the
/// last revision seen, on a new connection, without listing the overlay
/// again, and misses nothing written meanwhile; only a compaction past that
/// revision makes the agent list again. Fails if a broken watch lists (what
/// overloaded etcd at 1,000 hosts: every agent listing at once after a
/// member's loss) or if the resumed watch skips a change.
#[test]
fn a_broken_watch_goes_on_from_its_revision_and_only_a_compaction_lists_again() {
    let etcd = Etcd::start();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    rt.block_on(async {
        let mut c = etcd.client().await;
        let mut h1 = store(&etcd.url, "h1");
        h1.maintain().await;
        assert_eq!(h1.listings, 1);
        let mut h2 = store(&etcd.url, "h2");
        h2.maintain().await;
        settle(&mut h1).await;
        // The connection and the watch lost; meanwhile h2 claims a guest.
        h1.client = None;
        h1.watch = None;
        h2.publish(&ifaces(&[("02:00:00:00:00:21", 1)]), &Default::default()).await;
        h1.maintain().await;
        settle(&mut h1).await;
        assert_eq!(h1.listings, 1, "listed again after a broken watch");
        assert_eq!(holder_of(&h1, "02:00:00:00:00:21").as_deref(), Some("h2"), "the resumed watch missed a change");
        // etcd compacted past the revision h1 would go on from: listed.
        h1.client = None;
        h1.watch = None;
        h2.publish(&ifaces(&[("02:00:00:00:00:21", 1), ("02:00:00:00:00:22", 2)]), &Default::default()).await;
        c.put("/vnet/other", "x", None).await.expect("a write");
        let rev = c.get("/", None).await.expect("a read").header().expect("a header").revision();
        c.compact(rev, None).await.expect("a compaction");
        h1.maintain().await;
        settle(&mut h1).await;
        h1.maintain().await;
        settle(&mut h1).await;
        assert_eq!(h1.listings, 2, "a compacted revision was not listed again");
        assert_eq!(holder_of(&h1, "02:00:00:00:00:22").as_deref(), Some("h2"));
    });
}

/// A guest's addresses wait in its old host's release for the host it goes
/// to: a release is not forgotten at once when no claim followed it yet
/// (the new host may read it before it claims: in the CI runs that failed,
/// h2 released and forgot within one pass, and h3, claiming after it had
/// seen both, came without the address), but once the new host's claim has
/// them, or, for a guest gone for good, once the hand-over window passed,
/// and the agent wakes for that. Fails if the release goes before h3 reads
/// it, or stays for good.
#[test]
fn a_release_keeps_its_guests_addresses_for_the_next_host_and_goes_after() {
    let etcd = Etcd::start();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    rt.block_on(async {
        let mut c = etcd.client().await;
        let mut h2 = store(&etcd.url, "h2");
        h2.maintain().await;
        let (m, ip): (&str, IpAddr) = ("02:00:00:00:00:0c", "198.19.0.12".parse().expect("an address"));
        let ips: BTreeMap<String, Vec<IpAddr>> = [(m.to_string(), vec![ip])].into();
        h2.publish(&ifaces(&[(m, 1)]), &ips).await;
        settle(&mut h2).await;
        // The guest leaves h2; nobody has claimed it yet.
        h2.publish(&ifaces(&[]), &Default::default()).await;
        for _ in 0..3 {
            settle(&mut h2).await;
            h2.publish(&ifaces(&[]), &Default::default()).await;
        }
        let rec = |r: &etcd_client::GetResponse| -> Vec<String> { r.kvs().iter().map(|kv| String::from_utf8_lossy(kv.value()).into_owned()).collect() };
        let left = c.get(format!("/vnet/host/h2/guests/{m}/"), Some(GetOptions::new().with_prefix())).await.expect("a read");
        assert_eq!(rec(&left), [r#"{"network":"a","released":true,"ips":["198.19.0.12"]}"#], "the release went before the next host read it");
        assert!(h2.due() <= Instant::now() + HANDOVER, "the agent would not wake to forget it");
        // h3 reads the overlay, then its guest starts: it claims with the
        // address, and h2 forgets its release.
        let mut h3 = store(&etcd.url, "h3");
        h3.maintain().await;
        h3.publish(&ifaces(&[(m, 7)]), &Default::default()).await;
        let claim = c.get(format!("/vnet/host/h3/guests/{m}/"), Some(GetOptions::new().with_prefix())).await.expect("a read");
        assert_eq!(rec(&claim), [r#"{"network":"a","ips":["198.19.0.12"]}"#]);
        settle(&mut h2).await;
        h2.publish(&ifaces(&[]), &Default::default()).await;
        let left = c.get(format!("/vnet/host/h2/guests/{m}/"), Some(GetOptions::new().with_prefix())).await.expect("a read");
        assert_eq!(left.kvs().len(), 0, "the release stayed after its addresses were taken");
        // A guest gone for good: its release goes when the window passed.
        let n = "02:00:00:00:00:0d";
        let ips: BTreeMap<String, Vec<IpAddr>> = [(n.to_string(), vec![ip])].into();
        h2.handover = Duration::from_millis(500);
        h2.publish(&ifaces(&[(n, 2)]), &ips).await;
        settle(&mut h2).await;
        h2.publish(&ifaces(&[]), &Default::default()).await;
        settle(&mut h2).await;
        h2.publish(&ifaces(&[]), &Default::default()).await;
        let left = c.get(format!("/vnet/host/h2/guests/{n}/"), Some(GetOptions::new().with_prefix())).await.expect("a read");
        assert_eq!(left.kvs().len(), 1, "forgotten before its window passed");
        tokio::time::sleep_until(h2.due().into()).await;
        assert!(h2.wants_pass(), "woken, but no pass wanted");
        h2.publish(&ifaces(&[]), &Default::default()).await;
        let left = c.get(format!("/vnet/host/h2/guests/{n}/"), Some(GetOptions::new().with_prefix())).await.expect("a read");
        assert_eq!(left.kvs().len(), 0, "a guest gone for good left its release for good");
    });
}
