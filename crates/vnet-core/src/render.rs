//! Commands written back as the control language: one canonical line per
//! command, which `command::parse_line` reads as the same command
//! (`parse_line(&c.to_string()) == Ok(Some(c))`). vnetd records what it
//! was told in these lines (its run-time state, restored at start), and
//! they are what a person reads in that record.

use crate::command::{Attach, Command, IfaceRef, LinkProto, LinkRef, RouteRef, StatsScope};
use crate::setting::{IfaceSetting, Setting};
use std::fmt;

impl fmt::Display for IfaceRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IfaceRef::Name(n) => f.write_str(n),
            IfaceRef::Mac(m) => write!(f, "{m}"),
        }
    }
}

impl fmt::Display for LinkRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LinkRef::Index(i) => write!(f, "{i}"),
            LinkRef::Name(n) => f.write_str(n),
        }
    }
}

impl fmt::Display for RouteRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RouteRef::Index(i) => write!(f, "{i}"),
            RouteRef::Rule(r) => write!(f, "{r}"),
        }
    }
}

impl Setting {
    /// `<key> <value>`, as `SET` takes them.
    pub fn key_value(&self) -> (&'static str, String) {
        match *self {
            Setting::Mode(m) => ("mode", m.name().into()),
            Setting::Yield(y) => ("yield", y.name().into()),
            Setting::SleepUs(v) => ("sleep-us", v.to_string()),
            Setting::NoworkUs(v) => ("nowork-us", v.to_string()),
            Setting::AlphaLower(v) => ("alpha-lower", v.to_string()),
            Setting::AlphaUpper(v) => ("alpha-upper", v.to_string()),
            Setting::WindowMs(v) => ("window-ms", v.to_string()),
            Setting::Quota(v) => ("quota", v.to_string()),
            Setting::Datapath(d) => ("datapath", d.name().into()),
            Setting::Interrupts(i) => ("interrupts", i.name().into()),
            Setting::EocAlpha(v) => ("eoc-alpha", v.to_string()),
            Setting::EocBeta(v) => ("eoc-beta", v.to_string()),
            Setting::CutThrough(v) => ("cut-through", if v { "on" } else { "off" }.into()),
            Setting::StormPps(v) => ("storm-pps", v.to_string()),
        }
    }
}

impl IfaceSetting {
    /// `<key> <value | default>`, as `INTERFACE SET` takes them.
    pub fn key_value(&self) -> (&'static str, String) {
        let n = |v: Option<u32>| v.map_or("default".to_string(), |v| v.to_string());
        match *self {
            IfaceSetting::Mode(m) => ("mode", m.map_or("default", |m| m.name()).into()),
            IfaceSetting::AlphaLower(v) => ("alpha-lower", n(v)),
            IfaceSetting::AlphaUpper(v) => ("alpha-upper", n(v)),
            IfaceSetting::WindowMs(v) => ("window-ms", n(v)),
        }
    }
}

impl fmt::Display for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Command::IfaceAdd { name, mac, mtu, attach, netns, socket, network, ifname } => {
                write!(f, "INTERFACE ADD {name} {mac}")?;
                if let Some(m) = mtu {
                    write!(f, " mtu {m}")?;
                }
                if let Some(n) = netns {
                    write!(f, " netns {n}")?;
                }
                match attach {
                    Attach::Netns => {}
                    Attach::Qemu => f.write_str(" qemu")?,
                    Attach::Veth => f.write_str(" veth")?,
                    Attach::VhostUser { client, unsealed, vsock } => {
                        write!(f, " vhost-user {}", socket.as_deref().unwrap_or(""))?;
                        if *client {
                            f.write_str(" client")?;
                        }
                        if *unsealed {
                            f.write_str(" unsealed-memory")?;
                        }
                        if let Some(cid) = vsock {
                            write!(f, " vsock {cid}")?;
                        }
                    }
                }
                if let Some(d) = ifname {
                    write!(f, " ifname {d}")?;
                }
                write!(f, " network {network}")
            }
            Command::IfaceDel(r, detach) => write!(f, "INTERFACE DEL {r}{}", if *detach { " detach" } else { "" }),
            Command::IfaceList => f.write_str("INTERFACE LIST"),
            Command::IfaceSet(r, s) => {
                let (k, v) = s.key_value();
                write!(f, "INTERFACE SET {r} {k} {v}")
            }
            Command::Set(s) => {
                let (k, v) = s.key_value();
                write!(f, "SET {k} {v}")
            }
            Command::LinkAdd { ip, port, proto, name, mtu, vtoe } => {
                f.write_str("LINK ADD")?;
                match (proto, ip) {
                    (LinkProto::Direct { device }, _) => write!(f, " direct {device}")?,
                    (_, Some(ip)) => write!(f, " {ip}")?,
                    (_, None) => {}
                }
                if let Some(p) = port {
                    write!(f, " {p}")?;
                }
                match proto {
                    LinkProto::Direct { .. } => {}
                    LinkProto::Udp => f.write_str(" udp")?,
                    LinkProto::Tcp { key } => write!(f, " tcp key {key}")?,
                    LinkProto::Vxlan { vni } => write!(f, " vxlan vni {vni}")?,
                    LinkProto::Geneve { vni } => write!(f, " geneve vni {vni}")?,
                    LinkProto::WireGuard { peer } => write!(f, " wireguard {}", crate::command::wireguard_key_text(peer))?,
                }
                if let Some(n) = name {
                    write!(f, " name {n}")?;
                }
                if let Some(m) = mtu {
                    write!(f, " mtu {m}")?;
                }
                if let Some(k) = vtoe {
                    write!(f, " vtoe {k}")?;
                }
                Ok(())
            }
            Command::LinkDel(r) => write!(f, "LINK DEL {r}"),
            Command::LinkList => f.write_str("LINK LIST"),
            Command::RouteAdd(rule, owner) => match owner {
                Some(o) => write!(f, "ROUTE ADD {rule} owner {o}"),
                None => write!(f, "ROUTE ADD {rule}"),
            },
            Command::RouteDel(r) => write!(f, "ROUTE DEL {r}"),
            Command::RouteList(None) => f.write_str("ROUTE LIST"),
            Command::RouteList(Some(m)) => write!(f, "ROUTE LIST {m}"),
            Command::NeighAdd { ip, mac, owner } => match owner {
                Some(o) => write!(f, "NEIGH ADD {ip} {mac} owner {o}"),
                None => write!(f, "NEIGH ADD {ip} {mac}"),
            },
            Command::NeighDel(ip) => write!(f, "NEIGH DEL {ip}"),
            Command::NeighList => f.write_str("NEIGH LIST"),
            Command::Stats(scope) => f.write_str(match scope {
                StatsScope::All => "STATS",
                StatsScope::Interfaces => "STATS interfaces",
                StatsScope::Links => "STATS links",
                StatsScope::Routes => "STATS routes",
                StatsScope::Global => "STATS global",
                StatsScope::Vtoe => "STATS vtoe",
            }),
            Command::Show => f.write_str("SHOW"),
            Command::Help => f.write_str("HELP"),
            Command::Reload => f.write_str("RELOAD"),
            Command::KindRequest { kind, verb } => write!(f, "{} {}", kind.to_uppercase(), verb.to_uppercase()),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::command::{parse_line, Command};

    /// Each line parses, and its command written back parses as the same
    /// command (and writes back the same: the form is canonical).
    #[test]
    fn every_command_written_back_reads_as_itself() {
        let lines = [
            "INTERFACE ADD g1 02:00:00:00:00:01",
            "interface add g1 02:00:00:00:00:01 mtu 9000 netns blue veth ifname eth0 network red",
            "INTERFACE ADD t1 02:00:00:00:00:02 netns ns-1",
            "INTERFACE ADD q1 02:00:00:00:00:03 qemu mtu 1400",
            "INTERFACE ADD v1 02:00:00:00:00:04 vhost-user vm1.sock client unsealed-memory network n",
            "INTERFACE ADD v2 02:00:00:00:00:05 vhost-user /run/vnet/vm2.sock",
            "INTERFACE DEL g1",
            "INTERFACE DEL 02:00:00:00:00:01 detach",
            "INTERFACE SET g1 mode vmm-driven",
            "INTERFACE SET 02:00:00:00:00:01 alpha-lower default",
            "INTERFACE SET g1 window-ms 20",
            "SET mode adaptive",
            "SET cut-through off",
            "SET datapath user",
            "SET eoc-alpha 0",
            "SET yield timed",
            "SET interrupts plain",
            "LINK ADD 10.0.0.2",
            "LINK ADD 10.0.0.2 9001 udp name h2 mtu 1400 vtoe lab",
            "LINK ADD fd00::2 tcp key lab",
            "LINK ADD 10.0.0.2 4789 vxlan vni 42",
            "LINK ADD 10.0.0.2 geneve vni 16777215 name g",
            "LINK ADD fd00::3 wireguard 9Qm/9M6L8yfJxvzlL0b0UgVt4Pt/R0UkbCF5LDmUZ1o=",
            "LINK ADD direct eth1 name lan mtu 1500",
            "LINK DEL h2",
            "LINK DEL 3",
            "ROUTE ADD any 02:00:00:00:00:02 link h2 interface 02:00:00:00:00:01",
            "ROUTE ADD any ff:ff:ff:ff:ff:ff edge peer interface owner agent",
            "ROUTE ADD not-02:00:00:00:00:01 any interface 02:00:00:00:00:01 any",
            "ROUTE DEL 7",
            "ROUTE DEL any 02:00:00:00:00:02 edge h2 any",
            "STATS links",
            "SHOW",
            "RELOAD",
            "WIREGUARD ROTATE",
            "NEIGH ADD 10.1.0.2 02:00:00:00:00:02",
            "neigh add ::ffff:10.1.0.3 02:00:00:00:00:03",
            "NEIGH ADD fd00::2 02:00:00:00:00:02 owner agent",
            "NEIGH DEL 10.1.0.2",
            "NEIGH LIST",
            "SET storm-pps 2000",
        ];
        for l in lines {
            let c = parse_line(l).unwrap_or_else(|e| panic!("{l}: {e}")).unwrap();
            let back = c.to_string();
            let again: Command = parse_line(&back).unwrap_or_else(|e| panic!("{back} (from {l}): {e}")).unwrap();
            assert_eq!(again, c, "{l} -> {back}");
            assert_eq!(again.to_string(), back);
        }
    }
}
