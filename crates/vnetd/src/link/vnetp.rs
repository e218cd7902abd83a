//! VNET/P's own links (`LINK ADD <ip> [<port>] [udp]`): the bare Ethernet
//! frame as a UDP datagram, no header of vnetd's own (VNET/P's wire format,
//! [wire-format.md](../../../../docs/wire-format.md)), on vnetd's UDP port
//! (`--udp-port`, 9000), which is bound from the start for IPv4 and, where
//! the host has it, IPv6. A datagram is the link's whose remote address
//! sent it, or else the only link to the sender's IP (VNET/P matched by IP
//! alone; a peer behind NAT sends from another port); the kernel fast path
//! may carry these links.

use super::carriers::PrefixedLink;
use super::{CarrierKey, DemuxKey, LinkEnv, LinkKind, LinkLookup, LinkSpec, Made, RunOpener};
use crate::port::Intake;
use crate::settings::Settings;
use crate::stats::{DropReason, ThreadStats};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use vnet_core::command::LinkProto;
use vnet_core::wire::gro_segments;

pub const WORD: &str = "udp";

pub struct Kind;

/// Opens VNET/P's runs: each datagram is a frame, where it lies.
struct Opener;

impl RunOpener for Opener {
    fn open_run(
        &self,
        carrier: &CarrierKey,
        links: &dyn LinkLookup,
        st: &ThreadStats,
        from: SocketAddr,
        run: &mut [u8],
        seg: usize,
        _buf: &mut [u8],
        intake: &mut dyn Intake,
    ) {
        let found = links.demux(carrier, &DemuxKey::Sender(from)).or_else(|| links.demux(carrier, &DemuxKey::SenderIp(from.ip())));
        let Some(slot) = found else {
            for r in gro_segments(run.len(), seg) {
                st.global.received(r.len());
                st.drop_at(None, DropReason::UnknownSender);
            }
            tracing::debug!(%from, "datagram from an address with no link dropped");
            return;
        };
        for r in gro_segments(run.len(), seg) {
            intake.link_frame(slot, run, r);
        }
        intake.end_run(run);
    }
}

fn carrier(settings: &Settings, ip: &IpAddr, env: &dyn LinkEnv) -> Result<Arc<super::carriers::UdpCarrier>, String> {
    env.udp_carrier(CarrierKey::udp(settings.default_link_port, ip), WORD, &|| Arc::new(Opener))
}

impl LinkKind for Kind {
    fn word(&self) -> &'static str {
        WORD
    }

    fn takes(&self, proto: &LinkProto) -> bool {
        matches!(proto, LinkProto::Udp)
    }

    fn make(&self, spec: &LinkSpec, settings: &Settings, env: &dyn LinkEnv) -> Result<Made, String> {
        let ip = spec.ip.ok_or("this link needs a remote address")?;
        let c = carrier(settings, &ip, env).map_err(|e| format!("vnetd has no UDP socket for {}: {e} (see --udp-bind)", if ip.is_ipv4() { "IPv4" } else { "IPv6" }))?;
        let remote = SocketAddr::new(ip, spec.port.unwrap_or(settings.default_link_port));
        let demux = vec![(c.key, DemuxKey::Sender(remote)), (c.key, DemuxKey::SenderIp(ip))];
        let link = PrefixedLink::new(WORD, c.sender().clone(), remote, &[], demux, String::new(), true);
        let mtu = spec.mtu.or_else(|| env.path_mtu(remote)).unwrap_or(1500);
        Ok(Made { transport: Arc::new(link), remote: Some(remote), name: spec.name.clone().unwrap_or_else(|| ip.to_string()), mtu, overhead: if ip.is_ipv4() { 28 } else { 48 } })
    }

    /// Binds vnetd's UDP port from the start (so a busy port is said before
    /// anything runs): IPv4, and IPv6 where the host has it.
    fn start(&self, settings: &Settings, env: &dyn LinkEnv) -> Result<(), String> {
        match settings.udp_bind {
            Some(ip) => carrier(settings, &ip, env).map(|_| ()),
            None => {
                carrier(settings, &Ipv4Addr::UNSPECIFIED.into(), env)?;
                // IPv6 is optional: a host without it still runs IPv4 links.
                if let Err(e) = carrier(settings, &Ipv6Addr::UNSPECIFIED.into(), env) {
                    tracing::warn!("no IPv6 links: {e}");
                }
                Ok(())
            }
        }
    }
}
