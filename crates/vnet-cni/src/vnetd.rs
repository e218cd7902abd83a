//! A session with vnetd over its Unix control socket
//! (docs/control-language.md, "The wire protocol of the control channel"):
//! a request is a line, or `BEGIN`, lines, `COMMIT` (all or nothing); the
//! reply is `OK <n>` and n lines, or `ERR <message>`.

use crate::error::{code, CniError};
use std::path::Path;
use std::time::Duration;

/// Why a request did not go through: no vnetd answered (`Unreachable`), or
/// it refused (`Refused`, with its reason).
pub use vnet_client::Error as VnetdError;

impl From<VnetdError> for CniError {
    fn from(e: VnetdError) -> CniError {
        match e {
            VnetdError::Unreachable(m) => {
                CniError::new(code::TRY_AGAIN_LATER, format!("{m}; try again when vnetd runs"))
            }
            VnetdError::Refused(m) => CniError::new(code::VNETD_REFUSED, format!("vnetd refused the request: {m}")),
        }
    }
}

pub struct Vnetd(vnet_client::Session);

/// One line of `INTERFACE LIST`, the fields the plugin looks at.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Iface {
    pub name: String,
    pub mac: String,
    pub network: String,
    pub attach: String,
    pub netns: String,
    pub ifname: String,
}

impl Vnetd {
    pub fn connect(path: &Path) -> Result<Vnetd, VnetdError> {
        // A vnetd that accepts but never answers must not hang the runtime.
        vnet_client::Session::unix(path, Some(Duration::from_secs(30))).map(Vnetd)
    }

    /// Sends one request and reads its reply.
    pub fn request(&mut self, text: &str) -> Result<Vec<String>, VnetdError> {
        self.0.request(text)
    }

    /// Applies `lines` as one request: all of them or, if vnetd refuses
    /// one, none.
    pub fn apply(&mut self, lines: &[String]) -> Result<Vec<String>, VnetdError> {
        self.0.apply(lines)
    }

    pub fn interfaces(&mut self) -> Result<Vec<Iface>, VnetdError> {
        Ok(parse_interfaces(&self.request("INTERFACE LIST\n")?))
    }

    /// The interface named `name`, if vnetd holds it.
    pub fn interface(&mut self, name: &str) -> Result<Option<Iface>, VnetdError> {
        Ok(self.interfaces()?.into_iter().find(|i| i.name == name))
    }
}

/// `interface <idx> name=.. mac=.. mtu=.. attach=.. [netns=..] network=.. [ifname=.. host=..] ...`
pub fn parse_interfaces(lines: &[String]) -> Vec<Iface> {
    lines
        .iter()
        .filter(|l| l.starts_with("interface "))
        .map(|l| {
            let field = |key: &str| {
                l.split(' ').find_map(|w| w.strip_prefix(key)?.strip_prefix('=')).unwrap_or("").to_string()
            };
            Iface {
                name: field("name"),
                mac: field("mac").to_ascii_lowercase(),
                network: field("network"),
                attach: field("attach"),
                netns: field("netns"),
                ifname: field("ifname"),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_interface_listing() {
        let lines = vec![
            "interface 0 name=c0123456789ab mac=02:11:22:33:44:55 mtu=1458 attach=veth netns=cni-1 network=blue ifname=eth0 host=vhd7a0b3daae30 path=kernel mode=default alpha-lower=default alpha-upper=default window-ms=default".to_string(),
            "interface 1 name=g1 mac=02:00:00:00:00:0A mtu=1500 attach=netns netns=g1 network=default mode=default".to_string(),
        ];
        let l = parse_interfaces(&lines);
        assert_eq!(l.len(), 2);
        assert_eq!(
            l[0],
            Iface {
                name: "c0123456789ab".into(),
                mac: "02:11:22:33:44:55".into(),
                network: "blue".into(),
                attach: "veth".into(),
                netns: "cni-1".into(),
                ifname: "eth0".into()
            }
        );
        assert_eq!(l[1].mac, "02:00:00:00:00:0a");
        assert_eq!(l[1].ifname, "");
    }
}
