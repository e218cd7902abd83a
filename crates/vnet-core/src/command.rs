//! The control language: one command a line, keywords case-insensitive,
//! `#` starts a comment. A request is a list of lines; it is parsed whole
//! and any error names its line, so nothing is applied from a bad request.
//!
//! ```text
//! INTERFACE ADD <name> <guest-MAC> [mtu <bytes>] [netns <name> [veth [ifname <dev>]] | qemu | vhost-user <socket> [client] [unsealed-memory] [vsock <cid>]]
//!               [network <name>]
//! INTERFACE DEL <tap-name | guest-MAC> [detach]
//! INTERFACE LIST
//! LINK ADD <remote-ip> [<port>] [udp | tcp key <key-name> | vxlan vni <n> | geneve vni <n> | wireguard <peer-public-key>] [name <name>] [mtu <bytes>] [vtoe <key-name>]
//! LINK ADD direct <device> [name <name>] [mtu <bytes>]
//! LINK DEL <link-idx | name>
//! LINK LIST
//! ROUTE ADD <src-MAC> <dst-MAC> <dst-TYPE> <dst-ID> <src-TYPE> [<src-ID>] [owner <tag>]
//! ROUTE DEL <route-idx | the rule as added>
//! ROUTE LIST
//! NEIGH ADD <ip> <guest-MAC> [owner <tag>]
//! NEIGH DEL <ip>
//! NEIGH LIST
//! STATS [interfaces | links | routes | global | vtoe]
//! SET <mode | yield | sleep-us | nowork-us | alpha-lower | alpha-upper | window-ms | quota | datapath
//!      | interrupts | eoc-alpha | eoc-beta | cut-through | storm-pps> <value>
//! INTERFACE SET <tap-name | guest-MAC> <mode | alpha-lower | alpha-upper | window-ms> <value | default>
//! SHOW
//! HELP
//! ```

use crate::mac::Mac;
use crate::rule::{canonical_link_name, RuleSpec};
use std::net::IpAddr;

/// Largest MTU a Linux TAP device takes (65535 minus its own headroom).
pub const MAX_MTU: u32 = 65521;
/// Smallest MTU Linux allows an Ethernet device that carries IPv4.
pub const MIN_MTU: u32 = 68;

/// How a link carries frames (by default, as `LINK ADD` without one: VNET/P).
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub enum LinkProto {
    /// VNET/P: the bare frame as a UDP datagram.
    #[default]
    Udp,
    /// A TCP connection, each frame prefixed by its length, opened by a
    /// handshake proving both ends hold the key in vnetd's key file `key`.
    Tcp { key: String },
    /// RFC 7348: an 8-byte VXLAN header and the frame in a UDP datagram.
    Vxlan { vni: u32 },
    /// RFC 8926: a Geneve header (8 bytes, and options) and the frame in a
    /// UDP datagram.
    Geneve { vni: u32 },
    /// Raw onto a host device (the papers' direct send/receive).
    Direct { device: String },
    /// WireGuard to the peer holding this X25519 public key: the frame as a
    /// VNET/P datagram (IPv4/UDP to the peer's port 9000) inside the tunnel.
    WireGuard { peer: [u8; 32] },
}

impl LinkProto {
    pub fn name(&self) -> &'static str {
        match self {
            LinkProto::Udp => "udp",
            LinkProto::Tcp { .. } => "tcp",
            LinkProto::Vxlan { .. } => "vxlan",
            LinkProto::Geneve { .. } => "geneve",
            LinkProto::Direct { .. } => "direct",
            LinkProto::WireGuard { .. } => "wireguard",
        }
    }
}

/// Default UDP port of WireGuard (what `wg-quick` users expect).
pub const WIREGUARD_PORT: u16 = 51820;

/// A WireGuard key as `wg genkey`/`wg pubkey` write it: 32 bytes in base64.
pub fn parse_wireguard_key(text: &str) -> Result<[u8; 32], String> {
    use base64::Engine;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(text.trim())
        .map_err(|_| format!("'{}' is not a WireGuard key (32 bytes in base64, as wg genkey/wg pubkey write)", text.trim()))?;
    bytes.try_into().map_err(|_| format!("'{}' is not a WireGuard key: not 32 bytes", text.trim()))
}

/// A WireGuard key in the base64 `wg` writes.
pub fn wireguard_key_text(key: &[u8; 32]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(key)
}

/// Default UDP port of VXLAN (IANA).
pub const VXLAN_PORT: u16 = 4789;

/// Default UDP port of Geneve (IANA).
pub const GENEVE_PORT: u16 = 6081;

/// Who holds the TAP's file side, and so where the guest's frames appear.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum Attach {
    /// vnetd holds the file side; the network device is the guest's NIC (a
    /// namespace or container).
    #[default]
    Netns,
    /// The file side is left for QEMU (`-netdev tap,ifname=..`); vnetd
    /// exchanges frames with the device side through a packet socket.
    Qemu,
    /// A veth pair: the guest's end in its namespace, the host's end where
    /// the kernel fast path attaches.
    Veth,
    /// A vhost-user virtio-net device on a Unix socket (`IfaceAdd::socket`):
    /// vnetd listens there, or with `client` connects to the VMM's socket;
    /// `vsock`: vnetd also serves the VM a vhost-user vsock device for this
    /// guest CID (VTOE for VMs, docs/vtoe.md).
    VhostUser { client: bool, unsealed: bool, vsock: Option<u32> },
}

impl Attach {
    /// Its word (`INTERFACE LIST`'s `attach=`; in `INTERFACE ADD`, `netns`
    /// is the default and written as `netns <name>`).
    pub fn word(&self) -> &'static str {
        match self {
            Attach::Netns => "netns",
            Attach::Qemu => "qemu",
            Attach::Veth => "veth",
            Attach::VhostUser { .. } => "vhost-user",
        }
    }
}

#[derive(Clone, PartialEq, Eq, Debug)]
pub enum IfaceRef {
    Name(String),
    Mac(Mac),
}

#[derive(Clone, PartialEq, Eq, Debug)]
pub enum LinkRef {
    Index(u32),
    Name(String),
}

#[derive(Clone, PartialEq, Eq, Debug)]
pub enum RouteRef {
    Index(u32),
    Rule(RuleSpec),
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum StatsScope {
    All,
    Interfaces,
    Links,
    Routes,
    Global,
    /// VTOE: its counters and the offloaded connections.
    Vtoe,
}

// The dispatcher's tunables are their own module; commands carry them.
pub use crate::setting::{Datapath, IfaceSetting, Interrupts, Mode, Setting, YieldStrategy};

#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Command {
    /// `netns`: create the TAP persistent, inside this named network
    /// namespace (the guest's), so it survives vnetd restarts.
    /// `network`: the overlay network the guest belongs to (`default` when
    /// not given): what vnet-agent publishes it under.
    IfaceAdd { name: String, mac: Mac, mtu: Option<u32>, attach: Attach, netns: Option<String>, socket: Option<String>, network: String, ifname: Option<String> },
    /// `detach`: let go of the TAP but leave the device (for migration).
    IfaceDel(IfaceRef, bool),
    IfaceList,
    /// `INTERFACE SET <ref> <key> <value|default>`: an interface's own mode
    /// or adaptive thresholds; `default` follows the global setting again.
    IfaceSet(IfaceRef, IfaceSetting),
    Set(Setting),
    /// `vtoe`: the key (a file in --link-key-dir) that authenticates VTOE
    /// shadow connections with this link's peer.
    LinkAdd { ip: Option<IpAddr>, port: Option<u16>, proto: LinkProto, name: Option<String>, mtu: Option<u32>, vtoe: Option<String> },
    LinkDel(LinkRef),
    LinkList,
    /// `owner <tag>` after the rule: who manages the route (vnet-agent
    /// marks its own `agent`), shown by `ROUTE LIST`; no effect on routing.
    RouteAdd(RuleSpec, Option<String>),
    RouteDel(RouteRef),
    /// `ROUTE LIST [<MAC>]`: every route, or those naming this MAC (as the
    /// source or destination MAC, or as an interface at either end).
    RouteList(Option<Mac>),
    /// `NEIGH ADD <ip> <guest-MAC>`: the guest with that MAC holds that
    /// address; a local guest's ARP request or neighbour solicitation for
    /// it is answered on this host (`neigh`).
    /// `owner <tag>`: who manages the binding (vnet-agent: `agent`), as
    /// for routes.
    NeighAdd { ip: IpAddr, mac: Mac, owner: Option<String> },
    NeighDel(IpAddr),
    NeighList,
    Stats(StatsScope),
    Show,
    Help,
    /// `RELOAD`: apply vnetd's config file again (what changed in it since
    /// it was last applied).
    Reload,
    /// A request of a link kind's own, `<KIND> <VERB>` (`WIREGUARD ROTATE`:
    /// a new WireGuard key pair for vnetd, written to its key file): the
    /// kind's word and the verb, lower-case.
    KindRequest { kind: String, verb: String },
}

impl Command {
    /// Whether the command changes state (and so takes part in a request's
    /// all-or-nothing application) rather than only reporting it.
    pub fn mutates(&self) -> bool {
        matches!(
            self,
            Command::IfaceAdd { .. }
                | Command::IfaceDel(..)
                | Command::IfaceSet(..)
                | Command::Set(_)
                | Command::LinkAdd { .. }
                | Command::LinkDel(_)
                | Command::RouteAdd(..)
                | Command::RouteDel(_)
                | Command::NeighAdd { .. }
                | Command::NeighDel(_)
                | Command::Reload
        )
    }

    /// The command that takes back what this one added (`INTERFACE DEL`,
    /// `LINK DEL`, `ROUTE DEL`), for a line gone from a reloaded config;
    /// None for what has nothing to take back (settings, reports).
    pub fn undo(&self) -> Option<String> {
        match self {
            Command::IfaceAdd { name, .. } => Some(format!("INTERFACE DEL {name}")),
            Command::LinkAdd { .. } => Some(format!("LINK DEL {}", self.link_name()?)),
            Command::RouteAdd(rule, _) => Some(format!("ROUTE DEL {rule}")),
            Command::NeighAdd { ip, .. } => Some(format!("NEIGH DEL {ip}")),
            _ => None,
        }
    }
}

impl Command {
    /// The name of the link a `LINK ADD` makes: the one given, else its
    /// device (direct) or its peer's address.
    pub fn link_name(&self) -> Option<String> {
        let Command::LinkAdd { ip, proto, name, .. } = self else { return None };
        match (name, ip, proto) {
            (Some(n), _, _) => Some(n.clone()),
            (None, _, LinkProto::Direct { device }) => Some(device.clone()),
            (None, Some(ip), _) => Some(ip.to_string()),
            (None, None, _) => None,
        }
    }
}

pub const HELP: &str = "\
INTERFACE ADD <name> <guest-MAC> [mtu <bytes>] [netns <name> [veth [ifname <dev>]] | qemu | vhost-user <socket> [client] [unsealed-memory] [vsock <cid>]]
              [network <name>]                       create a guest's NIC: a TAP (netns: persistent, in
                                                     that namespace; veth: a veth pair there, the guest's
                                                     end named <dev> if given, else <name>; qemu: a TAP
                                                     for QEMU to open) or a vhost-user virtio-net device
                                                     on a Unix socket, a name in vnetd's --vhost-user-dir
                                                     (client: connect to the VMM's; unsealed-memory: take
                                                     guest memory files not sealed against shrinking;
                                                     vsock: also a vhost-user vsock device for the VM, CID
                                                     <cid>, on <socket>.vsock: docs/vtoe.md);
                                                     network: the overlay network it is in (default:
                                                     default), which vnet-agent publishes
INTERFACE DEL <tap-name | guest-MAC> [detach]        (detach: leave the TAP, for migration)
INTERFACE LIST
INTERFACE SET <tap-name | guest-MAC> <mode | alpha-lower | alpha-upper | window-ms> <value | default>
LINK ADD <remote-ip> [<port>] [udp | tcp key <key-name> | vxlan vni <n> | geneve vni <n> | wireguard <peer-public-key>]
         [name <name>] [mtu <underlay-MTU>]
         [vtoe <key-name>]                           a link to another vnetd (or VXLAN endpoint); wireguard:
                                                     encrypted to the peer holding that key (its port,
                                                     default 51820); vtoe: guests' TCP connections to its
                                                     guests may be offloaded (VTOE), shadow connections
                                                     authenticated by that key
LINK ADD direct <device> [name <name>] [mtu <bytes>]  frames raw onto a host device's LAN
WIREGUARD ROTATE                                     a new WireGuard key pair (written to --wireguard-key-file);
                                                     every WireGuard link handshakes again with it
LINK DEL <link-idx | name>
LINK LIST
ROUTE ADD <src-MAC> <dst-MAC> <dst-TYPE> <dst-ID> <src-TYPE> [<src-ID>] [owner <tag>]
    owner: who manages the route (vnet-agent: agent), shown by ROUTE LIST
    MAC: an address, any, none (dst only: default route) or not-<MAC>
    dst-TYPE: interface <guest-MAC> | edge <link-name>
    src-TYPE: any | interface [<guest-MAC>] | edge [<link-name>]
ROUTE DEL <route-idx | the rule as added>
ROUTE LIST [<MAC>]                                   every route, or those naming this MAC
NEIGH ADD <ip> <guest-MAC> [owner <tag>]             that guest holds that address: a guest's ARP request or
                                                     neighbour solicitation for it is answered on its own
                                                     host (if its rules let it reach that MAC), never sent
                                                     on; what local guests say of themselves is learned
NEIGH DEL <ip>
NEIGH LIST                                           the bindings given, then those learned (learned=<iface>)
STATS [interfaces | links | routes | global | vtoe]
SET mode <guest-driven | vmm-driven | adaptive>      dispatch mode of every interface
SET yield <immediate | timed | adaptive>             what an idle poll loop does
SET sleep-us <T_sleep> | nowork-us <T_nowork>        yield timings, microseconds
SET alpha-lower <pkt/s> | alpha-upper <pkt/s> | window-ms <ms>   adaptive mode's thresholds
SET quota <frames>                                   frames taken from a source per pass
SET datapath <auto | kernel | user>                  the kernel fast path, or vnetd's only
SET interrupts <plain | optimistic>                  how vhost-user NICs interrupt guests (VNET/P+)
SET eoc-alpha <kB/s> | eoc-beta <kB/s>               optimistic interrupts' density thresholds
SET cut-through <on | off>                           send vhost-user guests' frames uncopied
SET storm-pps <frames/s>                             each guest's broadcast and multicast budget (storm
                                                     control; 0: none); over it, dropped and counted
SHOW                                                 settings and everything above
RELOAD                                               apply vnetd's --config file again: what was added by
                                                     lines now gone is deleted, new lines are applied
BEGIN ... COMMIT                                     several lines, all or nothing
FORMAT <json | text>                                 replies from now on as one line of JSON, or as text
WAIT [<count> [<ms>]]                                `changes <n>`: how many times the listings changed
                                                     (a change committed, a VM's rings started or stopped),
                                                     once it is no longer <count> or <ms> passed (most 60000)";

/// A parse error: which line (1-based, within the request) and why.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct LineError {
    pub line: usize,
    pub text: String,
    pub reason: String,
}

impl std::fmt::Display for LineError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "line {}: {}: {}", self.line, self.reason, self.text.trim())
    }
}

/// Parses a whole request. Blank lines and comments are skipped but counted,
/// so line numbers match the file the request came from.
pub fn parse_request(text: &str) -> Result<Vec<(usize, Command)>, LineError> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        match parse_line(raw) {
            Ok(Some(cmd)) => out.push((i + 1, cmd)),
            Ok(None) => {}
            Err(reason) => return Err(LineError { line: i + 1, text: raw.to_string(), reason }),
        }
    }
    Ok(out)
}

/// Parses one line; `Ok(None)` for a blank line or a comment.
pub fn parse_line(raw: &str) -> Result<Option<Command>, String> {
    let line = raw.split('#').next().unwrap_or("");
    let toks: Vec<&str> = line.split_whitespace().collect();
    let Some(first) = toks.first() else { return Ok(None) };
    let word = |i: usize| toks.get(i).map(|t| t.to_ascii_lowercase());
    let verb = word(1);
    let args = toks.get(2..).unwrap_or(&[]);
    let no_args = |cmd: Command| {
        if args.is_empty() {
            Ok(Some(cmd))
        } else {
            Err(format!("unexpected '{}' after the command", args.join(" ")))
        }
    };
    match first.to_ascii_lowercase().as_str() {
        "interface" | "iface" => match verb.as_deref() {
            Some("add") => parse_iface_add(args).map(Some),
            Some("del") | Some("delete") => match args {
                [r] => Ok(Some(Command::IfaceDel(parse_iface_ref(r)?, false))),
                [r, d] if d.eq_ignore_ascii_case("detach") => Ok(Some(Command::IfaceDel(parse_iface_ref(r)?, true))),
                _ => Err("INTERFACE DEL needs <tap-name | guest-MAC> [detach]".into()),
            },
            Some("list") => no_args(Command::IfaceList),
            Some("set") => match args {
                [r, k, v] => Ok(Some(Command::IfaceSet(parse_iface_ref(r)?, IfaceSetting::parse(k, v)?))),
                _ => Err("INTERFACE SET needs <tap-name | guest-MAC> <mode | alpha-lower | alpha-upper | window-ms> <value | default>".into()),
            },
            _ => Err(bad_verb("INTERFACE", toks.get(1))),
        },
        "link" => match verb.as_deref() {
            Some("add") => parse_link_add(args).map(Some),
            Some("del") | Some("delete") => {
                let a = one_arg(args, "a link index or name")?;
                Ok(Some(Command::LinkDel(match a.parse::<u32>() {
                    Ok(i) => LinkRef::Index(i),
                    Err(_) => LinkRef::Name(canonical_link_name(a)?),
                })))
            }
            Some("list") => no_args(Command::LinkList),
            _ => Err(bad_verb("LINK", toks.get(1))),
        },
        "route" => match verb.as_deref() {
            Some("add") => {
                let (rule, owner) = match args {
                    [rule @ .., kw, tag] if kw.eq_ignore_ascii_case("owner") => {
                        check_plain_name(tag, 32, "route owner")?;
                        (rule, Some(tag.to_string()))
                    }
                    _ => (args, None),
                };
                Ok(Some(Command::RouteAdd(RuleSpec::parse(rule)?, owner)))
            }
            Some("del") | Some("delete") => match args {
                [] => Err("ROUTE DEL needs a route index or the rule".into()),
                [one] => match one.parse::<u32>() {
                    Ok(i) => Ok(Some(Command::RouteDel(RouteRef::Index(i)))),
                    Err(_) => Err(format!("'{one}' is not a route index")),
                },
                rule => Ok(Some(Command::RouteDel(RouteRef::Rule(RuleSpec::parse(rule)?)))),
            },
            Some("list") => match args {
                [] => Ok(Some(Command::RouteList(None))),
                [one] => one.parse::<Mac>().map(|m| Some(Command::RouteList(Some(m)))).map_err(|e| format!("ROUTE LIST takes a MAC to list the routes naming it: '{one}': {e}")),
                _ => Err(format!("unexpected '{}' after ROUTE LIST <MAC>", args[1..].join(" "))),
            },
            _ => Err(bad_verb("ROUTE", toks.get(1))),
        },
        "neigh" | "neighbour" | "neighbor" => match verb.as_deref() {
            Some("add") => {
                let (ip, mac, owner) = match args {
                    [ip, mac] => (ip, mac, None),
                    [ip, mac, kw, tag] if kw.eq_ignore_ascii_case("owner") => {
                        check_plain_name(tag, 32, "neighbour owner")?;
                        (ip, mac, Some(tag.to_string()))
                    }
                    _ => return Err("NEIGH ADD needs <ip> <guest-MAC> [owner <tag>]".into()),
                };
                let ip = parse_neigh_ip(ip)?;
                let mac: Mac = mac.parse().map_err(|e| format!("'{mac}': {e}"))?;
                if mac.is_multicast() || mac == Mac([0; 6]) {
                    return Err(format!("{mac} is not a guest's MAC"));
                }
                Ok(Some(Command::NeighAdd { ip, mac, owner }))
            }
            Some("del") | Some("delete") => Ok(Some(Command::NeighDel(parse_neigh_ip(one_arg(args, "an address")?)?))),
            Some("list") => no_args(Command::NeighList),
            _ => Err(bad_verb("NEIGH", toks.get(1))),
        },
        "stats" => {
            let scope = match toks.get(1..).unwrap_or(&[]) {
                [] => StatsScope::All,
                [s] => match s.to_ascii_lowercase().as_str() {
                    "interfaces" | "interface" | "iface" => StatsScope::Interfaces,
                    "links" | "link" => StatsScope::Links,
                    "routes" | "route" => StatsScope::Routes,
                    "global" => StatsScope::Global,
                    "vtoe" => StatsScope::Vtoe,
                    _ => return Err(format!("'{s}' is not a stats scope (want interfaces, links, routes, global or vtoe)")),
                },
                more => return Err(format!("unexpected '{}' after STATS", more.join(" "))),
            };
            Ok(Some(Command::Stats(scope)))
        }
        "set" => match toks.get(1..).unwrap_or(&[]) {
            [k, v] => Ok(Some(Command::Set(Setting::parse(k, v)?))),
            _ => Err("SET needs <key> <value> (try HELP)".into()),
        },
        "show" if toks.len() == 1 => Ok(Some(Command::Show)),
        "help" if toks.len() == 1 => Ok(Some(Command::Help)),
        "reload" if toks.len() == 1 => Ok(Some(Command::Reload)),
        "wireguard" if toks.len() == 2 && toks[1].eq_ignore_ascii_case("rotate") => {
            Ok(Some(Command::KindRequest { kind: "wireguard".into(), verb: "rotate".into() }))
        }
        "wireguard" => Err("WIREGUARD takes ROTATE".into()),
        "begin" | "commit" | "abort" => Err(format!("{first} is only allowed as a line of its own, outside a request")),
        _ => Err(format!("unknown command '{}' (try HELP)", toks.join(" "))),
    }
}

/// A guest's unicast address (IPv4, or IPv6 not link-local-multicast),
/// canonical (an IPv4-mapped IPv6 address is the IPv4 one).
fn parse_neigh_ip(text: &str) -> Result<IpAddr, String> {
    let ip: IpAddr = text.parse().map_err(|_| format!("'{text}' is not an IP address"))?;
    let ip = ip.to_canonical();
    let bad = match ip {
        IpAddr::V4(a) => a.is_unspecified() || a.is_broadcast() || a.is_multicast() || a.is_loopback(),
        IpAddr::V6(a) => a.is_unspecified() || a.is_multicast() || a.is_loopback(),
    };
    if bad {
        return Err(format!("{ip} is not a guest's unicast address"));
    }
    Ok(ip)
}

fn bad_verb(noun: &str, got: Option<&&str>) -> String {
    match got {
        Some(v) => format!("'{v}' is not a {noun} verb (want ADD, DEL, LIST{})", if noun == "INTERFACE" { " or SET" } else { "" }),
        None => format!("{noun} needs a verb (ADD, DEL or LIST)"),
    }
}

fn one_arg<'a>(args: &[&'a str], what: &str) -> Result<&'a str, String> {
    match args {
        [one] => Ok(one),
        [] => Err(format!("missing {what}")),
        more => Err(format!("want only {what}, got '{}'", more.join(" "))),
    }
}

fn parse_iface_ref(tok: &str) -> Result<IfaceRef, String> {
    if let Ok(mac) = tok.parse::<Mac>() {
        return Ok(IfaceRef::Mac(mac));
    }
    check_ifname(tok)?;
    Ok(IfaceRef::Name(tok.to_string()))
}

/// A plain name: 1 to `max` of `A-Za-z0-9_.-`, never `.` or `..` (so never
/// a path).
fn check_plain_name(name: &str, max: usize, what: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= max
        && name != "."
        && name != ".."
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c));
    if ok {
        Ok(())
    } else {
        Err(format!("'{name}' is not a {what} (1-{max} of A-Z a-z 0-9 _ . -)"))
    }
}

/// Linux interface names: 1 to 15 bytes.
pub fn check_ifname(name: &str) -> Result<(), String> {
    check_plain_name(name, 15, "device name")
}

/// A named network namespace (as `ip netns` makes them, in /run/netns).
/// The network of an interface added without `network <name>`.
pub const DEFAULT_NETWORK: &str = "default";

pub fn check_netns_name(name: &str) -> Result<(), String> {
    check_plain_name(name, 64, "network namespace name")
}

fn parse_iface_add(args: &[&str]) -> Result<Command, String> {
    let [name, mac, rest @ ..] = args else {
        return Err("INTERFACE ADD needs <name> <guest-MAC> [mtu <bytes>] [qemu | netns <ns> [veth] | vhost-user <socket> [client] [unsealed-memory] [vsock <cid>]]".into());
    };
    check_ifname(name)?;
    let mac: Mac = mac.parse()?;
    if mac.is_multicast() {
        return Err(format!("guest MAC {mac} is a multicast address"));
    }
    let (mut mtu, mut attach, mut netns, mut socket) = (None, Attach::Netns, None, None);
    let mut network = DEFAULT_NETWORK.to_string();
    let mut ifname = None;
    let mut rest = rest;
    while let Some((kw, r)) = rest.split_first() {
        match kw.to_ascii_lowercase().as_str() {
            "mtu" => {
                let Some((v, r2)) = r.split_first() else { return Err("mtu needs a value".into()) };
                let m: u32 = v.parse().map_err(|_| format!("'{v}' is not an MTU"))?;
                if !(MIN_MTU..=MAX_MTU).contains(&m) {
                    return Err(format!("MTU {m} is out of range {MIN_MTU}..{MAX_MTU}"));
                }
                mtu = Some(m);
                rest = r2;
                continue;
            }
            "qemu" => attach = Attach::Qemu,
            "veth" => attach = Attach::Veth,
            "vhost-user" => {
                let Some((path, r2)) = r.split_first() else { return Err("vhost-user needs a socket path".into()) };
                check_socket_path(path)?;
                socket = Some(path.to_string());
                attach = Attach::VhostUser { client: false, unsealed: false, vsock: None };
                rest = r2;
                continue;
            }
            "client" if socket.is_some() => {
                if let Attach::VhostUser { client, .. } = &mut attach {
                    *client = true;
                }
            }
            "vsock" if socket.is_some() => {
                let Some((v, r2)) = r.split_first() else { return Err("vsock needs the guest's CID".into()) };
                let cid: u32 = v.parse().map_err(|_| format!("'{v}' is not a vsock CID"))?;
                if cid < 3 || cid == u32::MAX {
                    return Err(format!("vsock CID {cid}: a guest's CID is from 3 to {} (0-2 are the hypervisor's, local and the host's)", u32::MAX - 1));
                }
                if let Attach::VhostUser { vsock, .. } = &mut attach {
                    *vsock = Some(cid);
                }
                rest = r2;
                continue;
            }
            "unsealed-memory" if socket.is_some() => {
                if let Attach::VhostUser { unsealed, .. } = &mut attach {
                    *unsealed = true;
                }
            }
            "network" => {
                let Some((n, r2)) = r.split_first() else { return Err("network needs a network name".into()) };
                check_plain_name(n, 64, "network name")?;
                network = n.to_string();
                rest = r2;
                continue;
            }
            "ifname" => {
                let Some((n, r2)) = r.split_first() else { return Err("ifname needs a device name".into()) };
                check_ifname(n)?;
                ifname = Some(n.to_string());
                rest = r2;
                continue;
            }
            "netns" => {
                let Some((n, r2)) = r.split_first() else { return Err("netns needs a namespace name".into()) };
                check_netns_name(n)?;
                netns = Some(n.to_string());
                rest = r2;
                continue;
            }
            other => return Err(format!("unexpected '{other}' (want: mtu <bytes>, netns <name>, veth, ifname <device>, qemu, vhost-user <socket> [client] [unsealed-memory] [vsock <cid>] or network <name>)")),
        }
        rest = r;
    }
    if netns.is_some() && attach == Attach::Qemu {
        return Err("a qemu interface's TAP stays on the host: it takes no netns".into());
    }
    if netns.is_none() && attach == Attach::Veth {
        return Err("a veth interface needs netns <name>: the guest's end goes there".into());
    }
    if socket.is_some() && (netns.is_some() || !matches!(attach, Attach::VhostUser { .. })) {
        return Err("a vhost-user interface is its socket alone: no netns, veth or qemu".into());
    }
    if ifname.is_some() && attach != Attach::Veth {
        return Err("ifname names a veth guest's device in its namespace: it needs netns <ns> veth".into());
    }
    Ok(Command::IfaceAdd { name: name.to_string(), mac, mtu, attach, netns, socket, network, ifname })
}

/// A vhost-user socket: a plain name (in vnetd's `--vhost-user-dir`), or a
/// path there: absolute, no `..`, no control characters,
/// and short enough for a Unix socket address (107 bytes).
pub fn check_socket_path(p: &str) -> Result<(), String> {
    if p.is_empty() || p.chars().any(|c| c.is_control()) {
        return Err(format!("'{p}' is not a socket name (empty, or control characters)"));
    }
    if !p.starts_with('/') {
        // A name in vnetd's vhost-user directory: vnetd, which knows the
        // directory, checks that it is plain (`is_plain_socket_name`).
        return Ok(());
    }
    if p.len() > 107 {
        return Err(format!("vhost-user socket path is {} bytes; a Unix socket's is at most 107", p.len()));
    }
    if p.split('/').any(|c| c == "..") || p.chars().any(|c| c.is_control()) || p.ends_with('/') {
        return Err(format!("'{p}' is not a plain socket path (no '..', no control characters, not a directory)"));
    }
    Ok(())
}

/// A plain socket name: letters, digits, '.', '_' and '-', not `.` or
/// `..`, at most 100 bytes.
pub fn is_plain_socket_name(p: &str) -> bool {
    !p.is_empty() && p.len() <= 100 && p != "." && p != ".." && p.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// A key file's name: letters, digits, '.', '_' and '-', not starting with
/// '.', at most 64 characters (it names a file in one directory, never a path).
fn check_key_name(v: &str) -> Result<(), String> {
    let ok = !v.is_empty()
        && v.len() <= 64
        && !v.starts_with('.')
        && v.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(format!("'{v}' is not a key name (letters, digits, '.', '_', '-'; not starting with '.'; at most 64)"))
    }
}

fn parse_link_add(args: &[&str]) -> Result<Command, String> {
    const USAGE: &str =
        "LINK ADD needs <remote-ip> [<port>] [udp | tcp key <key-name> | vxlan vni <n> | geneve vni <n> | wireguard <peer-public-key>] [name <name>] [mtu <bytes>] [vtoe <key-name>], or direct <device>";
    let Some((first, mut rest)) = args.split_first() else { return Err(USAGE.into()) };
    let mut ip = None;
    let mut proto = LinkProto::Udp;
    if first.eq_ignore_ascii_case("direct") {
        let Some((dev, r)) = rest.split_first() else { return Err("direct needs a device name".into()) };
        check_ifname(dev)?;
        proto = LinkProto::Direct { device: dev.to_string() };
        rest = r;
    } else {
        ip = Some(first.parse::<IpAddr>().map_err(|_| format!("'{first}' is not an IP address (or 'direct <device>')"))?);
    }
    let mut port = None;
    if let (Some((p, r)), Some(_)) = (rest.split_first(), ip) {
        if p.chars().all(|c| c.is_ascii_digit()) {
            let n: u16 = p.parse().map_err(|_| format!("'{p}' is not a port"))?;
            if n == 0 {
                return Err("port 0 is not a port".into());
            }
            port = Some(n);
            rest = r;
        }
    }
    let mut name = None;
    let mut mtu = None;
    let mut vtoe = None;
    while let Some((kw, r)) = rest.split_first() {
        let kw = kw.to_ascii_lowercase();
        let needs_value = matches!(kw.as_str(), "name" | "mtu" | "vni" | "key" | "vtoe" | "wireguard");
        let (val, r2) = if needs_value {
            match r.split_first() {
                Some((v, r2)) => (Some(*v), r2),
                None => return Err(format!("{kw} needs a value")),
            }
        } else {
            (None, r)
        };
        match (kw.as_str(), val) {
            ("udp" | "tcp" | "vxlan" | "geneve" | "wireguard", _) if matches!(proto, LinkProto::Direct { .. }) => {
                return Err(format!("a direct link takes no '{kw}'"));
            }
            ("udp", _) => proto = LinkProto::Udp,
            ("tcp", _) => proto = LinkProto::Tcp { key: String::new() },
            ("key", Some(v)) => {
                let LinkProto::Tcp { key } = &mut proto else { return Err("key is only for tcp links".into()) };
                check_key_name(v)?;
                *key = v.to_string();
            }
            ("vxlan", _) => proto = LinkProto::Vxlan { vni: u32::MAX },
            ("geneve", _) => proto = LinkProto::Geneve { vni: u32::MAX },
            ("wireguard", Some(v)) => proto = LinkProto::WireGuard { peer: parse_wireguard_key(v)? },
            ("vni", Some(v)) => {
                let (LinkProto::Vxlan { vni } | LinkProto::Geneve { vni }) = &mut proto else {
                    return Err("vni is only for vxlan and geneve links".into());
                };
                let n: u32 = v.parse().map_err(|_| format!("'{v}' is not a VNI"))?;
                if n > 0xff_ffff {
                    return Err(format!("VNI {n} is out of range 0..16777215"));
                }
                *vni = n;
            }
            ("name", Some(v)) => name = Some(canonical_link_name(v)?),
            ("vtoe", _) if matches!(proto, LinkProto::Direct { .. }) => {
                return Err("a direct link takes no vtoe: VTOE needs a peer vnetd".into());
            }
            ("vtoe", Some(v)) => {
                check_key_name(v)?;
                vtoe = Some(v.to_string());
            }
            ("mtu", Some(v)) => {
                let m: u32 = v.parse().map_err(|_| format!("'{v}' is not an MTU"))?;
                if !(576..=65535).contains(&m) {
                    return Err(format!("link MTU {m} is out of range 576..65535"));
                }
                mtu = Some(m);
            }
            (other, _) => {
                return Err(format!(
                    "unexpected '{other}' (want a port, udp, tcp key <key-name>, vxlan vni <n>, geneve vni <n>, wireguard <peer-public-key>, name <name>, mtu <bytes> or vtoe <key-name>)"
                ))
            }
        }
        rest = r2;
    }
    if proto == (LinkProto::Vxlan { vni: u32::MAX }) || proto == (LinkProto::Geneve { vni: u32::MAX }) {
        return Err(format!("a {} link needs vni <0..16777215>", proto.name()));
    }
    if proto == (LinkProto::Tcp { key: String::new() }) {
        return Err("a tcp link needs key <key-name>: the name of a key file in vnetd's --link-key-dir".into());
    }
    Ok(Command::LinkAdd { ip, port, proto, name, mtu, vtoe })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rule::{DstSpec, MacQual, SrcSpec};

    fn one(s: &str) -> Command {
        parse_line(s).unwrap().unwrap()
    }

    #[test]
    fn interfaces_take_a_network_and_routes_an_owner() {
        let Command::IfaceAdd { network, .. } = one("interface add g1 02:00:00:00:00:01 netns g1 network blue") else { panic!() };
        assert_eq!(network, "blue");
        let Command::IfaceAdd { network, .. } = one("interface add g1 02:00:00:00:00:01") else { panic!() };
        let Command::IfaceAdd { ifname, .. } = one("interface add c-1 02:00:00:00:00:01 netns c veth ifname eth0") else { panic!() };
        assert_eq!(ifname.as_deref(), Some("eth0"));
        assert_eq!(network, DEFAULT_NETWORK);
        let Command::RouteAdd(r, owner) = one("ROUTE ADD any 02:00:00:00:00:02 edge h2 interface 02:00:00:00:00:01 OWNER agent") else {
            panic!()
        };
        assert_eq!(owner.as_deref(), Some("agent"));
        assert_eq!(r.to_string(), "any 02:00:00:00:00:02 edge h2 interface 02:00:00:00:00:01");
        let Command::RouteAdd(_, owner) = one("ROUTE ADD any any edge h2 any") else { panic!() };
        assert_eq!(owner, None);
        for (bad, why) in [
            ("interface add g1 02:00:00:00:00:01 network", "network needs a network name"),
            ("interface add g1 02:00:00:00:00:01 network a/b", "network name"),
            ("route add any any edge h2 any owner", "takes no id"),
            ("route add any any edge h2 any owner a;b", "route owner"),
        ] {
            let e = parse_line(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn parses_every_command() {
        assert_eq!(
            one("interface add vg1 02:00:00:00:00:01 mtu 9000"),
            Command::IfaceAdd { name: "vg1".into(), mac: "02:00:00:00:00:01".parse().unwrap(), mtu: Some(9000), attach: Attach::Netns, netns: None, socket: None, network: "default".into(), ifname: None }
        );
        assert_eq!(
            one("interface add vm1 52:54:00:12:34:56 QEMU mtu 1500"),
            Command::IfaceAdd { name: "vm1".into(), mac: "52:54:00:12:34:56".parse().unwrap(), mtu: Some(1500), attach: Attach::Qemu, netns: None, socket: None, network: "default".into(), ifname: None }
        );
        assert_eq!(
            one("interface add g1 02:00:00:00:00:01 netns guest-1"),
            Command::IfaceAdd { name: "g1".into(), mac: "02:00:00:00:00:01".parse().unwrap(), mtu: None, attach: Attach::Netns, netns: Some("guest-1".into()), socket: None, network: "default".into(), ifname: None }
        );
        assert_eq!(
            one("interface add eth1 02:00:00:00:00:01 mtu 1458 netns c1 veth"),
            Command::IfaceAdd { name: "eth1".into(), mac: "02:00:00:00:00:01".parse().unwrap(), mtu: Some(1458), attach: Attach::Veth, netns: Some("c1".into()), socket: None, network: "default".into(), ifname: None }
        );
        assert_eq!(
            one("interface add vm2 52:54:00:00:00:02 vhost-user /run/vnet/vm2.sock"),
            Command::IfaceAdd { name: "vm2".into(), mac: "52:54:00:00:00:02".parse().unwrap(), mtu: None, attach: Attach::VhostUser { client: false, unsealed: false, vsock: None }, netns: None, socket: Some("/run/vnet/vm2.sock".into()), network: "default".into(), ifname: None }
        );
        assert_eq!(
            one("interface add vm3 52:54:00:00:00:03 vhost-user /tmp/q.sock client mtu 9000"),
            Command::IfaceAdd { name: "vm3".into(), mac: "52:54:00:00:00:03".parse().unwrap(), mtu: Some(9000), attach: Attach::VhostUser { client: true, unsealed: false, vsock: None }, netns: None, socket: Some("/tmp/q.sock".into()), network: "default".into(), ifname: None }
        );
        assert_eq!(
            one("interface add vm5 52:54:00:00:00:05 vhost-user vm5.sock unsealed-memory"),
            Command::IfaceAdd { name: "vm5".into(), mac: "52:54:00:00:00:05".parse().unwrap(), mtu: None, attach: Attach::VhostUser { client: false, unsealed: true, vsock: None }, netns: None, socket: Some("vm5.sock".into()), network: "default".into(), ifname: None }
        );
        assert_eq!(
            one("interface add vm6 52:54:00:00:00:06 vhost-user vm6.sock vsock 7"),
            Command::IfaceAdd { name: "vm6".into(), mac: "52:54:00:00:00:06".parse().unwrap(), mtu: None, attach: Attach::VhostUser { client: false, unsealed: false, vsock: Some(7) }, netns: None, socket: Some("vm6.sock".into()), network: "default".into(), ifname: None }
        );
        for bad in ["interface add vm6 52:54:00:00:00:06 vhost-user vm6.sock vsock 2", "interface add vm6 52:54:00:00:00:06 vhost-user vm6.sock vsock", "interface add vm6 52:54:00:00:00:06 vhost-user vm6.sock vsock x", "interface add vm6 52:54:00:00:00:06 vsock 7"] {
            assert!(parse_line(bad).is_err(), "{bad}");
        }
        for bad in [
            "interface add vm4 52:54:00:00:00:04 vhost-user",
            "interface add vm4 52:54:00:00:00:04 unsealed-memory",
            "interface add vm4 52:54:00:00:00:04 vhost-user /tmp/../etc/x",
            "interface add vm4 52:54:00:00:00:04 client",
            "interface add vm4 52:54:00:00:00:04 vhost-user /tmp/x.sock netns g",
            "interface add vm4 52:54:00:00:00:04 vhost-user /tmp/x.sock qemu",
        ] {
            assert!(parse_line(bad).is_err(), "{bad}");
        }
        assert_eq!(one("set interrupts PLAIN"), Command::Set(Setting::Interrupts(Interrupts::Plain)));
        assert_eq!(one("set eoc-alpha 500"), Command::Set(Setting::EocAlpha(500)));
        assert_eq!(one("set eoc-beta 200000"), Command::Set(Setting::EocBeta(200000)));
        assert!(parse_line("set interrupts often").is_err());
        assert!(parse_line("set eoc-beta 0").is_err());
        assert_eq!(one("set cut-through OFF"), Command::Set(Setting::CutThrough(false)));
        assert!(parse_line("set cut-through maybe").is_err());
        assert_eq!(one("set datapath KERNEL"), Command::Set(Setting::Datapath(Datapath::Kernel)));
        assert_eq!(one("set datapath user"), Command::Set(Setting::Datapath(Datapath::User)));
        assert_eq!(one("set datapath auto"), Command::Set(Setting::Datapath(Datapath::Auto)));
        assert_eq!(one("interface del g1 detach"), Command::IfaceDel(IfaceRef::Name("g1".into()), true));
        assert_eq!(one("IFACE DEL vg1"), Command::IfaceDel(IfaceRef::Name("vg1".into()), false));
        assert_eq!(one("iface del 02:00:00:00:00:01"), Command::IfaceDel(IfaceRef::Mac("02:00:00:00:00:01".parse().unwrap()), false));
        assert_eq!(one("Interface List"), Command::IfaceList);
        assert_eq!(
            one("LINK ADD 10.0.0.2 9000 udp"),
            Command::LinkAdd { ip: Some("10.0.0.2".parse().unwrap()), port: Some(9000), proto: LinkProto::Udp, name: None, mtu: None, vtoe: None }
        );
        assert_eq!(
            one("link add fd00::2 name peer-b"),
            Command::LinkAdd { ip: Some("fd00::2".parse().unwrap()), port: None, proto: LinkProto::Udp, name: Some("peer-b".into()), mtu: None, vtoe: None }
        );
        assert_eq!(
            one("link add 10.0.0.2 mtu 9000"),
            Command::LinkAdd { ip: Some("10.0.0.2".parse().unwrap()), port: None, proto: LinkProto::Udp, name: None, mtu: Some(9000), vtoe: None }
        );
        assert_eq!(
            one("link add 10.0.0.2 tcp key peer-b.key"),
            Command::LinkAdd {
                ip: Some("10.0.0.2".parse().unwrap()),
                port: None,
                proto: LinkProto::Tcp { key: "peer-b.key".into() },
                name: None,
                mtu: None,
                vtoe: None
            }
        );
        assert_eq!(
            one("LINK ADD 10.0.0.2 4789 VXLAN VNI 42 name vx"),
            Command::LinkAdd {
                ip: Some("10.0.0.2".parse().unwrap()),
                port: Some(4789),
                proto: LinkProto::Vxlan { vni: 42 },
                name: Some("vx".into()),
                mtu: None,
                vtoe: None
            }
        );
        assert_eq!(
            one("LINK ADD 198.18.0.2 vtoe h1-h2"),
            Command::LinkAdd {
                ip: Some("198.18.0.2".parse().unwrap()),
                port: None,
                proto: LinkProto::Udp,
                name: None,
                mtu: None,
                vtoe: Some("h1-h2".into())
            }
        );
        assert_eq!(parse_request("LINK ADD 198.18.0.2 vtoe").unwrap_err().to_string(), "line 1: vtoe needs a value: LINK ADD 198.18.0.2 vtoe");
        assert!(parse_request("LINK ADD 198.18.0.2 vtoe ../etc").is_err());
        assert!(parse_request("LINK ADD direct eth1 vtoe k").is_err());
        let key = "yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBmk=";
        assert_eq!(
            one(&format!("LINK ADD 198.18.0.2 wireguard {key} name wg-b")),
            Command::LinkAdd {
                ip: Some("198.18.0.2".parse().unwrap()),
                port: None,
                proto: LinkProto::WireGuard { peer: parse_wireguard_key(key).unwrap() },
                name: Some("wg-b".into()),
                mtu: None,
                vtoe: None
            }
        );
        assert_eq!(wireguard_key_text(&parse_wireguard_key(key).unwrap()), key);
        assert_eq!(one("wireguard rotate"), Command::KindRequest { kind: "wireguard".into(), verb: "rotate".into() });
        assert!(parse_request("WIREGUARD").is_err() && parse_request("WIREGUARD ROTATE now").is_err());
        assert_eq!(
            parse_request("LINK ADD 198.18.0.2 wireguard").unwrap_err().to_string(),
            "line 1: wireguard needs a value: LINK ADD 198.18.0.2 wireguard"
        );
        // Not base64, or not 32 bytes: rejected with the reason.
        assert!(parse_request("LINK ADD 198.18.0.2 wireguard not-a-key").unwrap_err().to_string().contains("is not a WireGuard key"));
        assert!(parse_request("LINK ADD 198.18.0.2 wireguard AAAA").unwrap_err().to_string().contains("not 32 bytes"));
        assert!(parse_request(&format!("LINK ADD direct eth1 wireguard {key}")).is_err());
        assert_eq!(one("stats vtoe"), Command::Stats(StatsScope::Vtoe));
        assert_eq!(
            one("link add direct eth1 name lan"),
            Command::LinkAdd {
                ip: None,
                port: None,
                proto: LinkProto::Direct { device: "eth1".into() },
                name: Some("lan".into()),
                mtu: None,
                vtoe: None
            }
        );
        assert_eq!(one("LINK DEL 3"), Command::LinkDel(LinkRef::Index(3)));
        assert_eq!(one("LINK DEL 10.0.0.2"), Command::LinkDel(LinkRef::Name("10.0.0.2".into())));
        assert_eq!(one("link list"), Command::LinkList);
        let Command::RouteAdd(r, _) = one("ROUTE ADD any 02:00:00:00:00:02 edge 10.0.0.2 interface") else { panic!() };
        assert_eq!(r.src_mac, MacQual::Any);
        assert_eq!(r.dst, DstSpec::Edge("10.0.0.2".into()));
        assert_eq!(r.src, SrcSpec::Interface(None));
        assert_eq!(one("ROUTE DEL 7"), Command::RouteDel(RouteRef::Index(7)));
        assert!(matches!(one("route del any any edge x any"), Command::RouteDel(RouteRef::Rule(_))));
        assert_eq!(one("STATS"), Command::Stats(StatsScope::All));
        assert_eq!(one("stats links"), Command::Stats(StatsScope::Links));
        assert_eq!(one("show"), Command::Show);
        assert_eq!(one("SET mode VMM-driven"), Command::Set(Setting::Mode(Mode::VmmDriven)));
        assert_eq!(one("set yield timed"), Command::Set(Setting::Yield(YieldStrategy::Timed)));
        assert_eq!(one("set window-ms 10"), Command::Set(Setting::WindowMs(10)));
        assert_eq!(one("set alpha-upper 20000"), Command::Set(Setting::AlphaUpper(20000)));
        let g1 = || IfaceRef::Name("g1".into());
        assert_eq!(one("interface set g1 mode adaptive"), Command::IfaceSet(g1(), IfaceSetting::Mode(Some(Mode::Adaptive))));
        assert_eq!(one("interface set g1 mode default"), Command::IfaceSet(g1(), IfaceSetting::Mode(None)));
        assert_eq!(one("interface set g1 alpha-upper 50000"), Command::IfaceSet(g1(), IfaceSetting::AlphaUpper(Some(50000))));
        assert_eq!(one("interface set g1 window-ms default"), Command::IfaceSet(g1(), IfaceSetting::WindowMs(None)));
        assert_eq!(one("help"), Command::Help);
    }

    #[test]
    fn comments_and_blank_lines_are_skipped_but_counted() {
        let req = "# a config\n\nlink add 10.0.0.2   # peer\n   \nroute list\n";
        let cmds = parse_request(req).unwrap();
        assert_eq!(cmds.len(), 2);
        assert_eq!(cmds[0].0, 3);
        assert_eq!(cmds[1].0, 5);
    }

    #[test]
    fn a_bad_line_fails_the_request_with_its_number() {
        let req = "link add 10.0.0.2\nroute add any any edge 10.0.0.2 any\nroute add any bogus edge 10.0.0.2 any\nlink list\n";
        let e = parse_request(req).unwrap_err();
        assert_eq!(e.line, 3);
        assert!(e.reason.contains("bogus"), "{e}");
        assert!(e.to_string().starts_with("line 3: "), "{e}");
    }

    #[test]
    fn rejects_malformed_commands_with_reasons() {
        let cases = [
            ("frobnicate", "unknown command"),
            ("link", "needs a verb"),
            ("link twiddle", "not a LINK verb"),
            ("link add", "LINK ADD needs"),
            ("link add 10.0.0.300", "not an IP address"),
            ("link add 10.0.0.2 70000", "not a port"),
            ("link add 10.0.0.2 0", "port 0"),
            ("link add 10.0.0.2 9000 sctp", "unexpected 'sctp'"),
            ("link add 10.0.0.2 vxlan", "needs vni"),
            ("link add 10.0.0.2 vxlan vni 16777216", "out of range"),
            ("link add 10.0.0.2 vni 4", "only for vxlan and geneve"),
            ("link add 10.0.0.2 geneve", "needs vni"),
            ("link add direct", "needs a device"),
            ("link add direct eth1 tcp", "takes no 'tcp'"),
            ("link add 10.0.0.2 tcp", "a tcp link needs key <key-name>"),
            ("link add 10.0.0.2 key k1", "key is only for tcp links"),
            ("link add 10.0.0.2 tcp key ../etc/shadow", "is not a key name"),
            ("link add 10.0.0.2 tcp key .hidden", "is not a key name"),
            ("link add 10.0.0.2 tcp key", "key needs a value"),
            ("link add direct eth/1", "not a device name"),
            ("link add 10.0.0.2 name", "needs a value"),
            ("link del", "missing"),
            ("link list now", "unexpected"),
            ("interface add vg1", "needs <name> <guest-MAC>"),
            ("interface add this-name-is-too-long 02:00:00:00:00:01", "not a device name"),
            ("interface add vg/1 02:00:00:00:00:01", "not a device name"),
            ("interface add vg1 01:00:00:00:00:01", "multicast"),
            ("interface add vg1 02:00:00:00:00:01 mtu 70000", "out of range"),
            ("interface add vg1 02:00:00:00:00:01 mtu 67", "out of range"),
            ("interface add vg1 02:00:00:00:00:01 mtu", "needs a value"),
            ("interface add vg1 02:00:00:00:00:01 xen", "unexpected 'xen'"),
            ("interface add vg1 02:00:00:00:00:01 netns ../etc", "not a network namespace name"),
            ("interface add vg1 02:00:00:00:00:01 netns /run/x", "not a network namespace name"),
            ("interface add vg1 02:00:00:00:00:01 netns g qemu", "takes no netns"),
            ("interface add vg1 02:00:00:00:00:01 veth", "needs netns"),
            ("interface add vg1 02:00:00:00:00:01 netns g ifname eth0", "needs netns <ns> veth"),
            ("interface add vg1 02:00:00:00:00:01 netns g veth ifname a/b", "not a device name"),
            ("interface add vg1 02:00:00:00:00:01 netns g veth ifname", "ifname needs"),
            ("set datapath fast", "not a datapath"),
            ("set datapath", "SET"),
            ("interface del g1 now", "INTERFACE DEL needs"),
            ("route add any any", "too short"),
            ("route del", "needs a route index"),
            ("route del x", "not a route index"),
            ("stats everything", "not a stats scope"),
            ("begin", "only allowed"),
            ("set", "needs <key> <value>"),
            ("set mode fast", "not a mode"),
            ("set yield never", "not a yield strategy"),
            ("set quota 0", "out of range"),
            ("set colour blue", "not a setting"),
            ("interface set g1 mode", "INTERFACE SET needs"),
            ("interface set g1 yield timed", "belong to the dispatcher threads"),
            ("interface set g1 alpha-lower 0", "out of range"),
        ];
        for (s, want) in cases {
            let e = parse_line(s).unwrap_err();
            assert!(e.contains(want), "{s}: {e}");
        }
    }

    #[test]
    fn route_list_takes_a_mac_and_lists_the_routes_naming_it() {
        let g1: Mac = "02:00:00:00:00:01".parse().unwrap();
        assert_eq!(one("route list"), Command::RouteList(None));
        assert_eq!(one("ROUTE LIST 02:00:00:00:00:01"), Command::RouteList(Some(g1)));
        assert!(parse_line("route list nope").unwrap_err().contains("'nope'"));
        assert!(parse_line("route list 02:00:00:00:00:01 more").is_err());
        let rule = |r: &str| RuleSpec::parse(&r.split(' ').collect::<Vec<_>>()).unwrap();
        // As source, destination, not-, or an interface at either end.
        assert!(rule("02:00:00:00:00:01 any edge l1 any").names(g1));
        assert!(rule("any 02:00:00:00:00:01 edge l1 any").names(g1));
        assert!(rule("not-02:00:00:00:00:01 any edge l1 any").names(g1));
        assert!(rule("any ff:ff:ff:ff:ff:ff interface 02:00:00:00:00:01 edge").names(g1));
        assert!(rule("any any edge l1 interface 02:00:00:00:00:01").names(g1));
        assert!(!rule("02:00:00:00:00:02 any interface 02:00:00:00:00:03 interface").names(g1));
    }

    #[test]
    fn mutating_commands_are_known() {
        assert!(one("route add any any edge x any").mutates());
        assert!(!one("route list").mutates());
        assert!(!one("stats").mutates());
    }
}
