//! The ADD result (and an IPAM plugin's, and a prevResult), read from any
//! version the plugin speaks and written in the one the runtime asked for:
//!
//! - 0.3.1 and 0.4.0: each IP has `"version": "4"` or `"6"`;
//! - 1.0.0: no `version`;
//! - 1.1.0: also an interface's `mtu`, `socketPath`, `pciID` and a route's
//!   `mtu`, `advmss`, `priority`, `table`, `scope`.

use crate::config::at_least;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

/// An address with its prefix length, `10.88.5.2/24` (without a `/`, a
/// host address).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Cidr {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl Cidr {
    pub fn is_v4(&self) -> bool {
        self.addr.is_ipv4()
    }

    /// The same prefix with the host bits cleared (`10.88.5.2/24` →
    /// `10.88.5.0/24`), for comparing route destinations.
    pub fn network(&self) -> Cidr {
        let addr = match self.addr {
            IpAddr::V4(a) => {
                let mask = if self.prefix == 0 { 0 } else { u32::MAX << (32 - self.prefix as u32) };
                IpAddr::V4((u32::from(a) & mask).into())
            }
            IpAddr::V6(a) => {
                let mask = if self.prefix == 0 { 0 } else { u128::MAX << (128 - self.prefix as u32) };
                IpAddr::V6((u128::from(a) & mask).into())
            }
        };
        Cidr { addr, prefix: self.prefix }
    }
}

impl FromStr for Cidr {
    type Err = String;

    fn from_str(s: &str) -> Result<Cidr, String> {
        let bad = || format!("'{s}' is not an address in CIDR notation");
        let (a, p) = s.split_once('/').map_or((s, None), |(a, p)| (a, Some(p)));
        let addr: IpAddr = a.parse().map_err(|_| bad())?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match p {
            None => max,
            Some(p) => p.parse::<u8>().ok().filter(|p| *p <= max).ok_or_else(bad)?,
        };
        Ok(Cidr { addr, prefix })
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Interface {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub socket_path: Option<String>,
    #[serde(default, rename = "pciID", skip_serializing_if = "Option::is_none")]
    pub pci_id: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IpConfig {
    #[serde(with = "as_string")]
    pub address: Cidr,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<IpAddr>,
    /// Index into `interfaces` (absent in an IPAM plugin's result).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interface: Option<usize>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Route {
    #[serde(with = "as_string")]
    pub dst: Cidr,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gw: Option<IpAddr>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub advmss: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub table: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<u32>,
}

/// A success result: what the attachment made.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct AddResult {
    #[serde(default)]
    pub interfaces: Vec<Interface>,
    #[serde(default)]
    pub ips: Vec<IpConfig>,
    #[serde(default)]
    pub routes: Vec<Route>,
    /// Passed through as it came (nameservers, domain, search, options).
    #[serde(default)]
    pub dns: Option<Map<String, Value>>,
}

impl AddResult {
    /// Reads a result of any supported version (an IP's `version` is implied
    /// by its address and ignored).
    pub fn parse(v: &Value) -> Result<AddResult, String> {
        serde_json::from_value(v.clone()).map_err(|e| format!("not a CNI result: {e}"))
    }

    /// The result as version `cni_version` writes it.
    pub fn to_json(&self, cni_version: &str) -> Value {
        let v110 = at_least(cni_version, "1.1.0");
        let v100 = at_least(cni_version, "1.0.0");
        let mut out = Map::new();
        out.insert("cniVersion".into(), cni_version.into());
        if !self.interfaces.is_empty() {
            let ifaces = self.interfaces.iter().map(|i| {
                let mut i = i.clone();
                if !v110 {
                    (i.mtu, i.socket_path, i.pci_id) = (None, None, None);
                }
                serde_json::to_value(i).expect("plain data")
            });
            out.insert("interfaces".into(), ifaces.collect());
        }
        if !self.ips.is_empty() {
            let ips = self.ips.iter().map(|ip| {
                let mut v = serde_json::to_value(ip).expect("plain data");
                if !v100 {
                    v["version"] = (if ip.address.is_v4() { "4" } else { "6" }).into();
                }
                v
            });
            out.insert("ips".into(), ips.collect());
        }
        if !self.routes.is_empty() {
            let routes = self.routes.iter().map(|r| {
                let mut r = r.clone();
                if !v110 {
                    (r.mtu, r.advmss, r.priority, r.table, r.scope) = (None, None, None, None, None);
                }
                serde_json::to_value(r).expect("plain data")
            });
            out.insert("routes".into(), routes.collect());
        }
        if let Some(dns) = self.dns.as_ref().filter(|d| !d.is_empty()) {
            out.insert("dns".into(), Value::Object(dns.clone()));
        }
        Value::Object(out)
    }
}

/// Addresses and destinations travel as strings (`"10.88.5.2/24"`).
mod as_string {
    use super::Cidr;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(c: &Cidr, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(c)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Cidr, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sample() -> AddResult {
        AddResult {
            interfaces: vec![Interface {
                name: "eth0".into(),
                mac: Some("02:00:00:00:00:01".into()),
                mtu: Some(1458),
                sandbox: Some("/run/netns/c1".into()),
                ..Interface::default()
            }],
            ips: vec![
                IpConfig { address: "10.88.5.2/24".parse().unwrap(), gateway: Some("10.88.5.1".parse().unwrap()), interface: Some(0) },
                IpConfig { address: "fd00::2/64".parse().unwrap(), gateway: None, interface: Some(0) },
            ],
            routes: vec![Route { dst: "0.0.0.0/0".parse().unwrap(), gw: None, mtu: None, advmss: None, priority: Some(10), table: None, scope: None }],
            dns: Some(json!({"nameservers": ["10.88.5.1"]}).as_object().unwrap().clone()),
        }
    }

    #[test]
    fn old_versions_carry_ip_versions_and_no_new_fields() {
        for v in ["0.3.1", "0.4.0"] {
            let j = sample().to_json(v);
            assert_eq!(j["cniVersion"], v);
            assert_eq!(j["ips"][0]["version"], "4");
            assert_eq!(j["ips"][1]["version"], "6");
            assert_eq!(j["ips"][0]["interface"], 0);
            assert_eq!(j["ips"][0]["gateway"], "10.88.5.1");
            assert!(j["interfaces"][0].get("mtu").is_none());
            assert!(j["routes"][0].get("priority").is_none());
            assert_eq!(j["interfaces"][0]["sandbox"], "/run/netns/c1");
        }
    }

    #[test]
    fn one_dot_x_has_no_ip_version_and_1_1_has_the_new_fields() {
        let j = sample().to_json("1.0.0");
        assert!(j["ips"][0].get("version").is_none());
        assert!(j["interfaces"][0].get("mtu").is_none());
        let j = sample().to_json("1.1.0");
        assert!(j["ips"][0].get("version").is_none());
        assert_eq!(j["interfaces"][0]["mtu"], 1458);
        assert_eq!(j["routes"][0]["priority"], 10);
        assert_eq!(j["dns"]["nameservers"][0], "10.88.5.1");
    }

    #[test]
    fn reads_every_version_back() {
        for v in ["0.3.1", "0.4.0", "1.0.0", "1.1.0"] {
            let back = AddResult::parse(&sample().to_json(v)).unwrap();
            assert_eq!(back.ips, sample().ips, "{v}");
            assert_eq!(back.interfaces[0].mac, sample().interfaces[0].mac);
        }
        // host-local's answer: no interfaces, no interface index.
        let ipam = json!({"cniVersion":"0.4.0","ips":[{"version":"4","address":"10.1.0.5/16","gateway":"10.1.0.1"}],
                          "routes":[{"dst":"0.0.0.0/0"}],"dns":{}});
        let r = AddResult::parse(&ipam).unwrap();
        assert_eq!(r.ips[0].interface, None);
        assert_eq!(r.ips[0].address.to_string(), "10.1.0.5/16");
        assert!(AddResult::parse(&json!({"ips":[{"address":"10.1.0.300/16"}]})).is_err());
        // An empty result writes no empty lists.
        assert_eq!(AddResult::default().to_json("1.0.0"), json!({"cniVersion":"1.0.0"}));
    }

    #[test]
    fn cidrs() {
        let c: Cidr = "10.88.5.7/24".parse().unwrap();
        assert_eq!(c.network().to_string(), "10.88.5.0/24");
        assert_eq!("10.1.2.3".parse::<Cidr>().unwrap().prefix, 32);
        assert_eq!("fd00::1:2/64".parse::<Cidr>().unwrap().network().to_string(), "fd00::/64");
        assert_eq!("0.0.0.0/0".parse::<Cidr>().unwrap().network().to_string(), "0.0.0.0/0");
        assert!("10.0.0.1/33".parse::<Cidr>().is_err() && "x/1".parse::<Cidr>().is_err());
    }
}
