//! VXLAN links (`LINK ADD <ip> [<port>] vxlan vni <n>`, RFC 7348): an 8-byte
//! header with the VNI before each frame, on UDP port 4789 (`--vxlan-port`),
//! bound with the first VXLAN link of a family. A datagram is the link's
//! whose peer IP and VNI it carries; its source port is not looked at (the
//! kernel's VXLAN sends from ports of its own choosing). Interoperates with
//! the kernel's VXLAN device.

use super::carriers::{open_vni_run, PrefixedLink};
use super::{CarrierKey, DemuxKey, LinkEnv, LinkKind, LinkLookup, LinkSpec, Made, RunOpener};
use crate::port::Intake;
use crate::settings::Settings;
use crate::stats::ThreadStats;
use std::net::SocketAddr;
use std::sync::Arc;
use vnet_core::command::{LinkProto, VXLAN_PORT};
use vnet_core::wire::{parse_vxlan, vxlan_header, VXLAN_HDR_LEN};

pub const WORD: &str = "vxlan";

pub struct Kind;

/// Opens VXLAN's runs: each datagram's frame follows its header.
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
        open_vni_run(carrier, links, st, from, run, seg, intake, |d| parse_vxlan(d).map(|vni| (vni, VXLAN_HDR_LEN)));
    }
}

impl LinkKind for Kind {
    fn word(&self) -> &'static str {
        WORD
    }

    fn takes(&self, proto: &LinkProto) -> bool {
        matches!(proto, LinkProto::Vxlan { .. })
    }

    fn make(&self, spec: &LinkSpec, settings: &Settings, env: &dyn LinkEnv) -> Result<Made, String> {
        let LinkProto::Vxlan { vni } = *spec.proto else { return Err("not a vxlan link".into()) };
        let ip = spec.ip.ok_or("this link needs a remote address")?;
        let c = env.udp_carrier(CarrierKey::udp(settings.vxlan_port, &ip), WORD, &|| Arc::new(Opener))?;
        let remote = SocketAddr::new(ip, spec.port.unwrap_or(VXLAN_PORT));
        let demux = vec![(c.key, DemuxKey::Vni(ip, vni))];
        let link = PrefixedLink::new(WORD, c.sender().clone(), remote, &vxlan_header(vni), demux, format!(" vni={vni}"), false);
        let mtu = spec.mtu.or_else(|| env.path_mtu(remote)).unwrap_or(1500);
        Ok(Made { transport: Arc::new(link), remote: Some(remote), name: spec.name.clone().unwrap_or_else(|| ip.to_string()), mtu, overhead: if ip.is_ipv4() { 36 } else { 56 } })
    }
}
