//! The agent's session with its vnetd: the control language over the Unix
//! socket (docs/control-language.md), as any other admin client speaks it.
//! The agent reads vnetd's interfaces, links and routes, and applies its
//! changes as one BEGIN..COMMIT request, all or nothing.

use anyhow::{anyhow, Context, Result};
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;
use vnet_client::{Error, Session};

use crate::model::{LINK_PREFIX, OWNER};

pub struct Vnetd {
    path: PathBuf,
    session: Option<Session>,
}

/// What vnetd has, as the agent sees it.
#[derive(Debug, Default)]
pub struct State {
    /// Local guests: MAC (lower case) → (interface id, network).
    pub ifaces: BTreeMap<String, (u32, String)>,
    /// The agent's links: name → (index, remote ip, port).
    pub links: BTreeMap<String, (u32, IpAddr, u16)>,
    /// The agent's routes: rule → index.
    pub routes: BTreeMap<String, u32>,
    /// Every other route's rule (a user's).
    pub user_routes: BTreeSet<String>,
}

impl Vnetd {
    pub fn new(path: &Path) -> Vnetd {
        Vnetd { path: path.to_path_buf(), session: None }
    }

    /// One request; its output lines, or vnetd's error. A broken session is
    /// dropped, to be opened again by the next request.
    pub fn request(&mut self, text: &str) -> Result<Vec<String>> {
        self.with_session(|s| s.request(text))
    }

    fn with_session(&mut self, f: impl FnOnce(&mut Session) -> Result<Vec<String>, Error>) -> Result<Vec<String>> {
        if self.session.is_none() {
            self.session = Some(Session::unix(&self.path, Some(Duration::from_secs(30)))?);
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
        let lines = self.request("BEGIN\nINTERFACE LIST\nLINK LIST\nROUTE LIST\nCOMMIT")?;
        parse_state(&lines)
    }

    /// The local interfaces alone: MAC → (id, network).
    pub fn interfaces(&mut self) -> Result<BTreeMap<String, (u32, String)>> {
        let lines = self.request("INTERFACE LIST")?;
        Ok(parse_state(&lines)?.ifaces)
    }

    /// Applies `changes` as one request (all or nothing).
    pub fn apply(&mut self, changes: &[String]) -> Result<Vec<String>> {
        self.with_session(|s| s.apply(changes))
    }
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
                let id: u32 = words.get(1).and_then(|w| w.parse().ok()).context("interface line without an id")?;
                let mac = field(line, "mac").context("interface line without mac=")?.to_ascii_lowercase();
                let net = field(line, "network").unwrap_or("default").to_string();
                st.ifaces.insert(mac, (id, net));
            }
            Some("link") => {
                let id: u32 = words.get(1).and_then(|w| w.parse().ok()).context("link line without an id")?;
                let name = field(line, "name").context("link line without name=")?;
                if !name.starts_with(LINK_PREFIX) {
                    continue;
                }
                let remote: SocketAddr = field(line, "remote")
                    .context("agent link without remote=")?
                    .parse()
                    .map_err(|_| anyhow!("bad remote= in '{line}'"))?;
                st.links.insert(name.to_string(), (id, remote.ip(), remote.port()));
            }
            Some("route") => {
                let id: u32 = words.get(1).and_then(|w| w.parse().ok()).context("route line without an id")?;
                let rest = &words[2..];
                match rest {
                    [rule @ .., "owner", o] if *o == OWNER => {
                        st.routes.insert(rule.join(" "), id);
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
        assert_eq!(st.links.len(), 1, "only the agent's links");
        assert_eq!(st.links["agent.h2"], (0, "198.18.0.2".parse().unwrap(), 9000));
        assert_eq!(st.routes["02:00:00:00:00:01 02:00:00:00:00:a2 edge agent.h2 interface 02:00:00:00:00:01"], 4);
        assert_eq!(st.routes.len(), 1);
        assert!(st.user_routes.contains("any ff:ff:ff:ff:ff:ff edge mine interface"));
        assert!(st.user_routes.contains("any 02:00:00:00:00:09 edge mine any"));
    }
}
