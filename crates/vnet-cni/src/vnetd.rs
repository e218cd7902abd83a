//! A session with vnetd over its Unix control socket
//! (docs/control-language.md, "The wire protocol of the control channel"):
//! a request is a line, or `BEGIN`, lines, `COMMIT` (all or nothing); the
//! reply is `OK <n>` and n lines, or `ERR <message>`.

use crate::error::{code, CniError};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Why a request did not go through.
#[derive(Debug)]
pub enum VnetdError {
    /// No vnetd answered (not running, socket missing, connection broken).
    Unreachable(String),
    /// vnetd answered `ERR`: its reason.
    Refused(String),
}

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

pub struct Vnetd {
    path: PathBuf,
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

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
        let unreachable = |e: std::io::Error| VnetdError::Unreachable(format!("vnetd does not answer on {}: {e}", path.display()));
        let s = UnixStream::connect(path).map_err(unreachable)?;
        // A vnetd that accepts but never answers must not hang the runtime.
        s.set_read_timeout(Some(Duration::from_secs(30))).map_err(unreachable)?;
        let reader = BufReader::new(s.try_clone().map_err(unreachable)?);
        Ok(Vnetd { path: path.to_path_buf(), reader, writer: s })
    }

    /// Sends one request (text ending in a newline) and reads its reply.
    pub fn request(&mut self, text: &str) -> Result<Vec<String>, VnetdError> {
        let broken = |e: String| VnetdError::Unreachable(format!("the session with vnetd on {} broke: {e}", self.path.display()));
        // vnetd may refuse a session before reading it: its one-line reason
        // is then the answer, not the broken pipe.
        let sent = self.writer.write_all(text.as_bytes()).and_then(|_| self.writer.flush());
        let mut status = String::new();
        match self.reader.read_line(&mut status) {
            Ok(0) => return Err(broken(sent.err().map_or("closed without a reply".into(), |e| e.to_string()))),
            Err(e) => return Err(broken(e.to_string())),
            Ok(_) => {}
        }
        let status = status.trim_end();
        if let Some(msg) = status.strip_prefix("ERR ") {
            return Err(VnetdError::Refused(msg.to_string()));
        }
        let n: usize = status
            .strip_prefix("OK ")
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| broken(format!("unexpected reply '{status}'")))?;
        let mut lines = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            let mut l = String::new();
            if self.reader.read_line(&mut l).map_err(|e| broken(e.to_string()))? == 0 {
                return Err(broken("the reply ended early".into()));
            }
            lines.push(l.trim_end_matches(['\n', '\r']).to_string());
        }
        Ok(lines)
    }

    /// Applies `lines` as one request: all of them or, if vnetd refuses
    /// one, none.
    pub fn apply(&mut self, lines: &[String]) -> Result<Vec<String>, VnetdError> {
        let mut text = String::from("BEGIN\n");
        for l in lines {
            text.push_str(l);
            text.push('\n');
        }
        text.push_str("COMMIT\n");
        self.request(&text)
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
