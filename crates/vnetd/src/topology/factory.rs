//! Where NIC kinds and link kinds are made: the only place that knows every
//! kind. A new kind of NIC is a module in `nic/` and one arm in `nic`; a new
//! kind of link, a module in `link/` and one arm in `link` (with its
//! encapsulation overhead). The rest of the topology, and the whole
//! datapath, sees only `VirtualNic` and `Transport`.

use super::objects::LinkEnv;
use crate::link::direct::DirectLink;
use crate::link::tcp::{LinkKey, TcpLink, TcpTransport};
use crate::link::udp::UdpLink;
use crate::link::wireguard::{self, Inner};
use crate::link::Transport;
use crate::nic::{QemuNic, Tap, VethNic, VhostUserNic, VirtualNic};
use crate::settings::Settings;
use crate::sys::netdev::device_mtu;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use vnet_core::command::{Attach, LinkProto};
use vnet_core::Mac;

/// What `INTERFACE ADD` asks for, as the NIC factory needs it.
pub struct NicSpec<'a> {
    pub name: &'a str,
    pub mac: Mac,
    pub mtu: u32,
    pub attach: Attach,
    pub netns: Option<&'a str>,
    /// A vhost-user NIC's socket (a plain name in `vhost_dir`, or a path
    /// there).
    pub socket: Option<&'a str>,
    pub vhost_dir: &'a std::path::Path,
    /// A veth's name in the guest's namespace, if not `name`.
    pub ifname: Option<&'a str>,
    /// The id the interface will have (the fast path's port number).
    pub id: u32,
    /// Where a NIC reports its guest starting or stopping (`running`).
    pub changes: &'a Arc<crate::stats::Changes>,
}

/// Makes the NIC of the kind `spec.attach` asks for.
pub fn nic(spec: &NicSpec, kernel: Option<&Arc<vnet_fastpath::Kernel>>) -> Result<Box<dyn VirtualNic>, String> {
    let NicSpec { name, mac, mtu, attach, netns, socket, vhost_dir, ifname, id, changes } = *spec;
    let nic: anyhow::Result<Box<dyn VirtualNic>> = match (attach, netns) {
        (Attach::Netns, None) => Tap::create(name, mtu, mac).map(|t| Box::new(t) as Box<dyn VirtualNic>),
        (Attach::Netns, Some(ns)) => Tap::create_in_netns(name, mtu, mac, ns).map(|(t, _)| Box::new(t) as Box<dyn VirtualNic>),
        (Attach::Qemu, _) => QemuNic::new(name, mtu, id, kernel).map(|n| Box::new(n) as Box<dyn VirtualNic>),
        (Attach::Veth, Some(ns)) => {
            VethNic::new(ifname.unwrap_or(name), mac, mtu, ns, id, kernel).map(|n| Box::new(n) as Box<dyn VirtualNic>)
        }
        (Attach::Veth, None) => return Err("a veth interface needs netns <name>".into()),
        (Attach::VhostUser { client, unsealed }, _) => {
            let Some(socket) = socket else { return Err("a vhost-user interface needs a socket".into()) };
            let at = crate::nic::vhost_user::Where { dir: vhost_dir, socket };
            VhostUserNic::new(name, &at, client, unsealed, changes.clone()).map(|n| Box::new(n) as Box<dyn VirtualNic>)
        }
    };
    nic.map_err(|e| format!("{e:#}"))
}

/// A link as its kind made it, before the topology names and sizes it.
pub struct Made {
    pub transport: Arc<dyn Transport>,
    pub remote: Option<SocketAddr>,
    pub name: String,
    pub mtu: u32,
    /// What the link's encapsulation takes from its MTU (IPv4 + UDP = 28,
    /// + VXLAN 36, TCP 40, WireGuard 88, + 20 over IPv6); negative for a direct link,
    /// which carries frames without their 14-byte Ethernet header counted.
    pub overhead: i64,
}

/// Makes the link `LINK ADD` asks for: its transport (sockets, connection,
/// device), peer address, name and MTU. `ip` is canonical (an IPv4-mapped
/// address is the IPv4 peer).
pub fn link(
    proto: &LinkProto,
    ip: Option<IpAddr>,
    port: Option<u16>,
    name: Option<String>,
    mtu: Option<u32>,
    settings: &Settings,
    env: &dyn LinkEnv,
) -> Result<Made, String> {
    match (proto, ip) {
        (LinkProto::Direct { device }, _) => {
            direct_allowed(settings, device)?;
            let dev_mtu = device_mtu(device).map_err(|e| format!("no device {device} on this host ({e})"))?;
            let link = DirectLink::bind(device).map_err(|e| format!("{e:#}"))?;
            // A direct link's MTU is its device's; frames carry only Ethernet.
            Ok(Made { transport: Arc::new(link), remote: None, name: name.unwrap_or_else(|| device.clone()), mtu: mtu.unwrap_or(dev_mtu), overhead: -14 })
        }
        (_, None) => Err("this link needs a remote address".into()),
        (proto, Some(ip)) => {
            let v4 = ip.is_ipv4();
            let family = if v4 { 0 } else { 20 };
            let default_port = match proto {
                LinkProto::Vxlan { .. } => vnet_core::command::VXLAN_PORT,
                LinkProto::WireGuard { .. } => vnet_core::command::WIREGUARD_PORT,
                _ => settings.default_link_port,
            };
            let remote = SocketAddr::new(ip, port.unwrap_or(default_port));
            let (transport, overhead): (Arc<dyn Transport>, i64) = match proto {
                LinkProto::Udp => {
                    let Some(ep) = env.udp(v4) else {
                        return Err(format!("vnetd has no UDP socket for {} (see --udp-bind)", if v4 { "IPv4" } else { "IPv6" }));
                    };
                    (Arc::new(UdpLink::new(ep, remote, None)), 28 + family)
                }
                LinkProto::Vxlan { vni } => (Arc::new(UdpLink::new(env.vxlan(v4)?, remote, Some(*vni))), 36 + family),
                LinkProto::Tcp { key } => {
                    let key = LinkKey::load(&settings.link_key_dir, key)?;
                    env.ensure_tcp_acceptor()?;
                    (Arc::new(TcpTransport(TcpLink::new(remote, key)?)), 40 + family)
                }
                LinkProto::WireGuard { peer } => {
                    let inner = Inner::toward(SocketAddr::new(ip, settings.default_link_port), settings.default_link_port)?;
                    (env.wireguard()?.link(*peer, remote, inner)? as Arc<dyn Transport>, wireguard::OVERHEAD_V4)
                }
                LinkProto::Direct { .. } => unreachable!("matched above"),
            };
            let mtu = mtu.or_else(|| env.path_mtu(remote)).unwrap_or(1500);
            Ok(Made { transport, remote: Some(remote), name: name.unwrap_or_else(|| ip.to_string()), mtu, overhead })
        }
    }
}

/// Direct links put frames raw onto a host device: only onto the devices the
/// administrator named with `--allow-direct`.
pub fn direct_allowed(settings: &Settings, device: &str) -> Result<(), String> {
    if settings.direct_devices.iter().any(|d| d == device) {
        Ok(())
    } else {
        Err(format!("device {device} is not allowed for direct links (start vnetd with --allow-direct {device})"))
    }
}
