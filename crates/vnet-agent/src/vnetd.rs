//! The agent's session with its vnetd: the control language over the Unix
//! socket (docs/control-language.md), as any other admin client speaks it.
//! The agent reads vnetd's interfaces, links and routes, and applies its
//! changes as one BEGIN..COMMIT request, all or nothing. A second session
//! waits on vnetd's changes (`WAIT`, `watch`), so that a change vnetd makes
//! by itself (a VM's rings starting on the host it migrated to) reaches the
//! agent at once, not at its next poll.
//!
//! An interface whose guest does not run there (`running=no`: a VM arriving
//! by migration whose rings have not started, a VM that left or stopped) is
//! not a local guest: its MAC is not claimed, and where another host holds
//! it, it is routed there.

use anyhow::{anyhow, Context, Result};
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;
use vnet_client::{Error, Session};

use crate::model::{Desired, LINK_PREFIX, OWNER};

pub struct Vnetd {
    path: PathBuf,
    session: Option<Session>,
    /// How many sessions were opened: a new one may be a new vnetd, whose
    /// change count starts again (`Cache`).
    sessions: u64,
}

/// What vnetd has, as the agent sees it.
#[derive(Debug, Default)]
pub struct State {
    /// Local guests: MAC (lower case) → (interface id, network).
    pub ifaces: BTreeMap<String, (u32, String)>,
    /// The agent's links: name → (remote ip, port, WireGuard peer key).
    pub links: BTreeMap<String, (IpAddr, u16, Option<String>)>,
    /// The agent's routes' rules.
    pub routes: BTreeSet<String>,
    /// Every other route's rule (a user's).
    pub user_routes: BTreeSet<String>,
    /// What each local guest said it holds (`ips=`).
    pub ips: BTreeMap<String, Vec<IpAddr>>,
    /// The agent's address bindings (`NEIGH ... owner agent`): address →
    /// MAC; and the addresses bound otherwise (a user's, or learned here).
    pub neigh: BTreeMap<IpAddr, String>,
    pub other_neigh: BTreeSet<IpAddr>,
}

impl State {
    /// What vnetd holds once the agent's request for `want` committed (all
    /// or nothing): the agent's links, routes and bindings are `want`'s
    /// (less what a user holds); the rest is as it was.
    pub fn after(&mut self, want: &Desired) {
        self.links = want.links.iter().map(|l| (l.name.clone(), (l.underlay, l.port, l.key.clone()))).collect();
        self.routes = want.routes.iter().filter(|r| !self.user_routes.contains(*r)).cloned().collect();
        self.neigh = want.neigh.iter().filter(|(ip, _)| !self.other_neigh.contains(ip)).map(|(ip, m)| (*ip, m.clone())).collect();
    }
}

/// vnetd's tables as the agent last read them, at vnetd's change count
/// `count` (`WAIT`), on session `session`: while vnetd's count is the same
/// on the same session, nothing changed there, and a pass needs no
/// reading (docs/controller.md, "At scale").
pub struct Cache {
    pub session: u64,
    pub count: u64,
    pub state: State,
}

impl Vnetd {
    pub fn new(path: &Path) -> Vnetd {
        Vnetd { path: path.to_path_buf(), session: None, sessions: 0 }
    }

    /// vnetd's count of changes (`WAIT` without a count answers at once),
    /// and the session it was read on.
    pub fn count(&mut self) -> Result<(u64, u64)> {
        let lines = self.request("WAIT")?;
        let n = parse_changes(&lines).ok_or_else(|| anyhow!("vnetd answered WAIT with {lines:?}"))?;
        Ok((self.sessions, n))
    }

    /// vnetd's tables, from `cache` if vnetd's count says nothing changed
    /// since it was read, else read now (and cached); and whether they were
    /// read.
    pub fn tables<'c>(&mut self, cache: &'c mut Option<Cache>) -> Result<(&'c mut State, bool)> {
        let (session, count) = self.count()?;
        let fresh = cache.as_ref().is_some_and(|c| c.session == session && c.count == count);
        if !fresh {
            // Read after the count: a change made between the two shows as
            // a count past this one at the next pass, and is read then.
            *cache = None;
            let state = self.state()?;
            *cache = Some(Cache { session, count, state });
        }
        Ok((&mut cache.as_mut().expect("set above").state, !fresh))
    }

    /// One request; its output lines, or vnetd's error. A broken session is
    /// dropped, to be opened again by the next request.
    pub fn request(&mut self, text: &str) -> Result<Vec<String>> {
        self.with_session(|s| s.request(text))
    }

    fn with_session(&mut self, f: impl FnOnce(&mut Session) -> Result<Vec<String>, Error>) -> Result<Vec<String>> {
        if self.session.is_none() {
            self.session = Some(Session::unix(&self.path, Some(Duration::from_secs(30)))?);
            self.sessions += 1;
        }
        let r = f(self.session.as_mut().expect("opened above"));
        if matches!(r, Err(Error::Unreachable(_))) {
            self.session = None;
        }
        Ok(r?)
    }

    /// Interfaces, the agent's links and all routes, read in one request
    /// so that they agree with each other.
    pub fn state(&mut self) -> Result<State> {
        let lines = self.request("BEGIN\nINTERFACE LIST\nLINK LIST\nROUTE LIST\nNEIGH LIST\nCOMMIT")?;
        parse_state(&lines)
    }

    /// Applies `changes` as one request (all or nothing).
    pub fn apply(&mut self, changes: &[String]) -> Result<Vec<String>> {
        self.with_session(|s| s.apply(changes))
    }
}

/// Least time between two wake-ups of the agent by vnetd's changes: a VMM
/// that starts and stops its rings in a loop makes at most one pass (and
/// etcd write) per this.
pub const WATCH_GAP: Duration = Duration::from_millis(20);

/// Wakes `wake` each time vnetd's state changes (a session of its own,
/// blocked in `WAIT`; opened again whenever it breaks), from a thread.
pub fn watch(path: &Path, wake: std::sync::Arc<tokio::sync::Notify>) {
    let path = path.to_path_buf();
    let run = move || {
        let mut seen: Option<u64> = None;
        let mut session: Option<Session> = None;
        loop {
            if session.is_none() {
                match Session::unix(&path, Some(Duration::from_secs(70))) {
                    Ok(s) => session = Some(s),
                    Err(_) => {
                        std::thread::sleep(Duration::from_millis(200));
                        continue;
                    }
                }
            }
            let s = session.as_mut().expect("opened above");
            let ask = match seen {
                Some(n) => format!("WAIT {n} 30000"),
                None => "WAIT".to_string(),
            };
            match s.request(&ask).map(|lines| parse_changes(&lines)) {
                Ok(Some(n)) => {
                    if seen != Some(n) {
                        seen = Some(n);
                        wake.notify_one();
                        std::thread::sleep(WATCH_GAP);
                    }
                }
                Ok(None) | Err(Error::Refused(_)) => {
                    // A vnetd without WAIT: the agent's poll is all there is.
                    tracing::warn!("vnetd does not answer WAIT: changes are seen at the agent's poll only");
                    return;
                }
                Err(_) => {
                    session = None;
                    seen = None;
                    wake.notify_one();
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
    };
    if let Err(e) = std::thread::Builder::new().name("vnetd-watch".into()).spawn(run) {
        tracing::warn!("cannot watch vnetd's changes ({e}): changes are seen at the agent's poll only");
    }
}

/// vnetd's WireGuard port and public key, from `SHOW`'s `wireguard` line;
/// None if it has no WireGuard key.
pub fn parse_wireguard(lines: &[String]) -> Option<(u16, String)> {
    let line = lines.iter().find(|l| l.starts_with("wireguard "))?;
    // `listen=` is each carrier's address (IPv4, then IPv6): one port.
    let port = field(line, "listen")?.split(',').next()?.parse::<SocketAddr>().ok()?.port();
    Some((port, field(line, "public_key")?.to_string()))
}

/// The count in `WAIT`'s answer, `changes <n>`.
fn parse_changes(lines: &[String]) -> Option<u64> {
    lines.first()?.strip_prefix("changes ")?.parse().ok()
}

/// `key=value` words of a listing line.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split(' ').find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

pub fn parse_state(lines: &[String]) -> Result<State> {
    let mut st = State::default();
    for line in lines {
        let words: Vec<&str> = line.split(' ').collect();
        match words.first().copied() {
            Some("interface") => {
                if field(line, "running") == Some("no") {
                    continue;
                }
                let id: u32 = words.get(1).and_then(|w| w.parse().ok()).context("interface line without an id")?;
                let mac = field(line, "mac").context("interface line without mac=")?.to_ascii_lowercase();
                let net = field(line, "network").unwrap_or("default").to_string();
                let ips: Vec<IpAddr> = field(line, "ips").map_or_else(Vec::new, |v| v.split(',').filter_map(|a| a.parse().ok()).collect());
                if !ips.is_empty() {
                    st.ips.insert(mac.clone(), ips);
                }
                st.ifaces.insert(mac, (id, net));
            }
            Some("link") => {
                let name = field(line, "name").context("link line without name=")?;
                if !name.starts_with(LINK_PREFIX) {
                    continue;
                }
                let remote: SocketAddr = field(line, "remote")
                    .context("agent link without remote=")?
                    .parse()
                    .map_err(|_| anyhow!("bad remote= in '{line}'"))?;
                let key = field(line, "peer_key").map(str::to_string);
                st.links.insert(name.to_string(), (remote.ip(), remote.port(), key));
            }
            Some("neigh") => {
                let Some(ip) = words.get(1).and_then(|w| w.parse::<IpAddr>().ok()) else { continue };
                match (words.get(2), &words[3.min(words.len())..]) {
                    (Some(mac), ["owner", o]) if *o == OWNER => {
                        st.neigh.insert(ip, mac.to_ascii_lowercase());
                    }
                    _ => {
                        st.other_neigh.insert(ip);
                    }
                }
            }
            Some("route") => {
                words.get(1).and_then(|w| w.parse::<u32>().ok()).context("route line without an id")?;
                let rest = &words[2..];
                match rest {
                    [rule @ .., "owner", o] if *o == OWNER => {
                        st.routes.insert(rule.join(" "));
                    }
                    [rule @ .., "owner", _] => {
                        st.user_routes.insert(rule.join(" "));
                    }
                    rule => {
                        st.user_routes.insert(rule.join(" "));
                    }
                }
            }
            _ => {}
        }
    }
    Ok(st)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vnetds_listings() {
        let lines: Vec<String> = [
            "interface 0 name=g1 mac=02:00:00:00:00:01 mtu=1500 attach=netns netns=g1 network=blue mode=default alpha-lower=default alpha-upper=default window-ms=default",
            "interface 3 name=g2 mac=02:00:00:00:00:02 mtu=1500 attach=veth netns=g2 network=default veth=g2",
            "interface 4 name=vm1 mac=02:00:00:00:00:03 mtu=1500 attach=vhost-user network=default vhost-user=/run/vnet/vm1 connected=yes running=yes",
            "interface 5 name=vm2 mac=02:00:00:00:00:04 mtu=1500 attach=vhost-user network=default vhost-user=/run/vnet/vm2 connected=yes running=no",
            "link 0 name=agent.h2 proto=udp remote=198.18.0.2:9000 mtu=1500 max_frame=1458",
            "link 1 name=mine proto=udp remote=198.18.0.9:9000 mtu=1500 max_frame=1458",
            "route 4 02:00:00:00:00:01 02:00:00:00:00:a2 edge agent.h2 interface 02:00:00:00:00:01 owner agent",
            "route 5 any ff:ff:ff:ff:ff:ff edge mine interface",
            "route 6 any 02:00:00:00:00:09 edge mine any owner someone",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let st = parse_state(&lines).unwrap();
        assert_eq!(st.ifaces["02:00:00:00:00:01"], (0, "blue".to_string()));
        assert_eq!(st.ifaces["02:00:00:00:00:02"], (3, "default".to_string()));
        assert_eq!(st.ifaces["02:00:00:00:00:03"], (4, "default".to_string()), "a VM whose rings run is here");
        assert!(!st.ifaces.contains_key("02:00:00:00:00:04"), "a VM whose rings do not run is not (yet, or any more)");
        assert_eq!(parse_changes(&["changes 42".to_string()]), Some(42));
        assert_eq!(parse_changes(&["route 1".to_string()]), None);
        assert_eq!(st.links.len(), 1, "only the agent's links");
        assert_eq!(st.links["agent.h2"], ("198.18.0.2".parse().unwrap(), 9000, None));
        assert!(st.routes.contains("02:00:00:00:00:01 02:00:00:00:00:a2 edge agent.h2 interface 02:00:00:00:00:01"));
        assert_eq!(st.routes.len(), 1);
        assert!(st.user_routes.contains("any ff:ff:ff:ff:ff:ff edge mine interface"));
        assert!(st.user_routes.contains("any 02:00:00:00:00:09 edge mine any"));
    }

    /// The cache the agent keeps after its own commit (`State::after`) is
    /// what vnetd then holds: planning against it again asks nothing, and
    /// a user's route and binding stay the user's. Catches a cache that
    /// drifts from vnetd (the agent would re-add or never remove routes
    /// until the next full read).
    #[test]
    fn the_cache_after_a_commit_plans_nothing_more() {
        use crate::model::{derive, plan, plan_neigh, Guest, Host};
        let hosts: BTreeMap<String, Host> = (1..=2)
            .map(|i| (format!("h{i}"), Host { underlay: format!("198.18.0.{i}").parse().unwrap(), port: 9000, wireguard: None }))
            .collect();
        let g = |h: &str, ip: &str| Guest { host: h.into(), network: "a".into(), ips: vec![ip.parse().unwrap()], since: 1 };
        let guests: BTreeMap<String, Guest> =
            [("02:00:00:00:00:01".to_string(), g("h1", "10.0.0.1")), ("02:00:00:00:00:02".to_string(), g("h2", "10.0.0.2"))].into();
        let local: BTreeMap<String, String> = [("02:00:00:00:00:01".to_string(), "a".to_string())].into();
        let want = derive("h1", &hosts, &guests, &local);
        let user_rule = want.routes.iter().next().unwrap().clone();
        let mut st = State::default();
        st.user_routes.insert(user_rule.clone());
        st.other_neigh.insert("10.0.0.2".parse().unwrap());
        st.routes.insert("any 02:00:00:00:00:99 edge agent.h2 any".into());
        let first = plan(&want, &st.links, &st.routes, &st.user_routes);
        assert!(first.iter().any(|l| l.starts_with("ROUTE DEL any 02:00:00:00:00:99")) && !first.is_empty());
        st.after(&want);
        assert!(plan(&want, &st.links, &st.routes, &st.user_routes).is_empty());
        assert!(plan_neigh(&want, &st.neigh, &st.other_neigh).is_empty());
        assert!(!st.routes.contains(&user_rule), "a user's route became the agent's");
        assert!(st.neigh.is_empty(), "a user's binding became the agent's");
    }

    #[test]
    fn reads_a_wireguard_link_and_vnetds_key() {
        let key = "yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBmk=";
        let lines = vec![format!(
            "link 2 name=agent.h3 proto=wireguard remote=198.18.0.3:51820 mtu=1500 max_frame=1412 peer_key={key} endpoint=198.18.0.3:51820 handshake_age_s=4"
        )];
        let st = parse_state(&lines).unwrap();
        assert_eq!(st.links["agent.h3"], ("198.18.0.3".parse().unwrap(), 51820, Some(key.to_string())));
        let show = vec!["vnetd version=0.1.0".to_string(), format!("wireguard listen=0.0.0.0:51821 public_key={key} peers=2 cookies_sent=0")];
        assert_eq!(parse_wireguard(&show), Some((51821, key.to_string())));
        assert_eq!(parse_wireguard(&show[..1]), None);
        // Listening on IPv4 and IPv6.
        let both = vec![format!("wireguard listen=0.0.0.0:51821,[::]:51821 public_key={key} peers=0")];
        assert_eq!(parse_wireguard(&both), Some((51821, key.to_string())));
    }
}
