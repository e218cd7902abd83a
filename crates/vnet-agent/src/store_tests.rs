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

use super::*;
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
        let id = h4.lease.as_ref().expect("a lease").0;
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
