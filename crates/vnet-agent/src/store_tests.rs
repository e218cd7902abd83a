//! Claims against a real etcd (docs/controller.md "Claims, migration and
//! conflicts"): a host that lost a guest to a migration and has not yet
//! seen it (its watch not read, as when its agent was stalled or its etcd
//! connection slow) deletes or writes its old claim late. Each such write
//! is a transaction that compares the key's mod_revision with the one the
//! old host saw, so it fails, and the migration stands.
//!
//! The test starts its own etcd (`etcd` from Debian's etcd-server, which
//! scripts/setup installs) on free loopback ports, in a temporary
//! directory. Catches (each mutated so, in crates/vnet-agent/src/store.rs's
//! `publish`): the compare taken out of the delete (the late delete removed
//! the new host's key) or out of the put (the late write took the guest
//! back to the old host); and a new lease making the old host forget it
//! lost the guest (it claimed it back with a higher seq).

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
    let etcd = EtcdArgs { endpoints: vec![url.to_string()], prefix: "/vnet".into(), cacert: None, cert: None, key: None };
    Store::new(&etcd, Registration { host: host.into(), underlay: "198.18.0.1".parse().expect("an address"), port: 9000, ttl: 5 })
}

/// This host's interfaces, as `publish` takes them: MAC -> (vnetd id, network).
fn ifaces(list: &[(&str, u32)]) -> BTreeMap<String, (u32, String)> {
    list.iter().map(|(m, id)| (m.to_string(), (*id, "a".to_string()))).collect()
}

/// The guest key of `mac` as etcd holds it: (host, seq, lease).
async fn guest(c: &mut Client, mac: &str) -> Option<(String, u64, i64)> {
    let r = c.get(format!("/vnet/guests/{mac}"), None).await.expect("etcd answers");
    r.kvs().first().map(|kv| {
        let v: GuestValue = serde_json::from_slice(kv.value()).expect("a guest value");
        (v.host, v.seq, kv.lease())
    })
}

#[test]
fn an_old_hosts_late_delete_or_write_fails_instead_of_undoing_a_migration() {
    let etcd = Etcd::start();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    rt.block_on(async {
        let mut c = etcd.client().await;
        let (m1, m2) = ("02:00:00:00:00:0c", "02:00:00:00:00:0d");
        // Host h2 has both guests; then both move to h3, whose claims come
        // after h2's (seq 2). h2's agent has not read its watch since.
        let mut old = store(&etcd.url, "h2");
        old.maintain().await;
        old.publish(&ifaces(&[(m1, 1), (m2, 2)])).await;
        for m in [m1, m2] {
            assert_eq!(guest(&mut c, m).await.map(|g| (g.0, g.1)), Some(("h2".into(), 1)), "h2 published {m}");
        }
        let mut new = store(&etcd.url, "h3");
        new.maintain().await;
        new.publish(&ifaces(&[(m1, 7), (m2, 8)])).await;
        let moved = |g: Option<(String, u64, i64)>| g.map(|g| (g.0, g.1)) == Some(("h3".into(), 2));
        assert!(moved(guest(&mut c, m1).await) && moved(guest(&mut c, m2).await), "h3 claimed both");

        // A late delete: h2's interface with m1 is gone, and h2 withdraws
        // the claim it wrote, from its stale view.
        old.publish(&ifaces(&[(m2, 2)])).await;
        assert!(moved(guest(&mut c, m1).await), "h2's late delete undid the migration: {:?}", guest(&mut c, m1).await);

        // A late write: h2's lease was lost meanwhile (etcd unreachable
        // longer than its TTL); it registers again and writes every claim
        // again under the new lease, still from its stale view.
        old.lease = None;
        old.maintain().await;
        assert!(old.lease.is_some(), "h2 registered again");
        assert!(old.claims.get(m2).is_some_and(|c| c.written.is_none()), "h2's claim of m2 is to be written again");
        old.publish(&ifaces(&[(m2, 2)])).await;
        assert!(moved(guest(&mut c, m2).await), "h2's late write undid the migration: {:?}", guest(&mut c, m2).await);

        // Once h2 has read what happened, it knows it lost m2 and does not
        // claim it back on its new lease while h3's claim stands (it used
        // to: the new lease made it forget the loss, and it claimed m2 with
        // a higher seq).
        tokio::time::sleep(Duration::from_millis(200)).await;
        old.drain().await;
        old.publish(&ifaces(&[(m2, 2)])).await;
        assert!(old.claims.get(m2).is_some_and(|c| c.lost), "h2 knows it lost m2");
        old.lease = None;
        old.maintain().await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        old.drain().await;
        old.publish(&ifaces(&[(m2, 2)])).await;
        assert!(moved(guest(&mut c, m2).await), "h2 took m2 back on its new lease: {:?}", guest(&mut c, m2).await);
        assert!(old.claims.get(m2).is_some_and(|c| c.lost));
    });
}
