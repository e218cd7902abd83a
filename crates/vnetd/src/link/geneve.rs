//! Geneve links (`LINK ADD <ip> [<port>] geneve vni <n>`, RFC 8926): an
//! 8-byte header with the VNI (protocol Transparent Ethernet Bridging, no
//! options) before each frame, on UDP port 6081, bound with the first
//! Geneve link of a family. A received datagram is the link's whose peer IP
//! and VNI it carries; its options are skipped and ignored, as RFC 8926 lets
//! a receiver do, but a control packet (O) or one with critical options (C),
//! which a receiver that does not process them must drop, is dropped
//! (`malformed`). Interoperates with Open vSwitch's Geneve ports (OVN's
//! encapsulation).

use super::carriers::{open_vni_run, PrefixedLink};
use super::{CarrierKey, DemuxKey, LinkEnv, LinkKind, LinkLookup, LinkSpec, Made, RunOpener};
use crate::port::Intake;
use crate::settings::Settings;
use crate::stats::ThreadStats;
use std::net::SocketAddr;
use std::sync::Arc;
use vnet_core::command::{LinkProto, GENEVE_PORT};
use vnet_core::wire::{geneve_header, parse_geneve};

pub const WORD: &str = "geneve";

pub struct Kind;

/// Opens Geneve's runs: each datagram's frame follows its header and options.
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
        open_vni_run(carrier, links, st, from, run, seg, intake, |d| parse_geneve(d).ok());
    }
}

impl LinkKind for Kind {
    fn word(&self) -> &'static str {
        WORD
    }

    fn takes(&self, proto: &LinkProto) -> bool {
        matches!(proto, LinkProto::Geneve { .. })
    }

    fn make(&self, spec: &LinkSpec, _settings: &Settings, env: &dyn LinkEnv) -> Result<Made, String> {
        let LinkProto::Geneve { vni } = *spec.proto else { return Err("not a geneve link".into()) };
        let ip = spec.ip.ok_or("this link needs a remote address")?;
        let c = env.udp_carrier(CarrierKey::udp(GENEVE_PORT, &ip), WORD, &|| Arc::new(Opener))?;
        let remote = SocketAddr::new(ip, spec.port.unwrap_or(GENEVE_PORT));
        let demux = vec![(c.key, DemuxKey::Vni(ip, vni))];
        let link = PrefixedLink::new(WORD, c.sender().clone(), remote, &geneve_header(vni), demux, format!(" vni={vni}"), false);
        let mtu = spec.mtu.or_else(|| env.path_mtu(remote)).unwrap_or(1500);
        Ok(Made { transport: Arc::new(link), remote: Some(remote), name: spec.name.clone().unwrap_or_else(|| ip.to_string()), mtu, overhead: if ip.is_ipv4() { 36 } else { 56 } })
    }
}
