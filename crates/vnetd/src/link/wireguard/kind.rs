//! The WireGuard kind: vnetd's start makes the hub (with
//! `--wireguard-key-file`: its key pair, its carriers on `--wireguard-port`
//! for IPv4 and IPv6, its handshake thread), `LINK ADD ... wireguard <key>`
//! makes a link on it, and `SHOW`, `STATS` and `WIREGUARD ROTATE` ask it.

use super::{overhead, Inner, WgHub, WgKeys, WORD};
use crate::link::{CarrierKey, LinkEnv, LinkKind, LinkSpec, Made, RunOpener};
use crate::settings::Settings;
use crate::stats::ThreadStats;
use std::any::Any;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use vnet_core::command::{LinkProto, WIREGUARD_PORT};

pub struct Kind;

fn hub(env: &dyn LinkEnv) -> Option<Arc<WgHub>> {
    env.shared_now(WORD).and_then(|h| h.downcast::<WgHub>().ok())
}

impl LinkKind for Kind {
    fn word(&self) -> &'static str {
        WORD
    }

    fn takes(&self, proto: &LinkProto) -> bool {
        matches!(proto, LinkProto::WireGuard { .. })
    }

    fn make(&self, spec: &LinkSpec, settings: &Settings, env: &dyn LinkEnv) -> Result<Made, String> {
        let LinkProto::WireGuard { peer } = spec.proto else { return Err("not a wireguard link".into()) };
        let ip = spec.ip.ok_or("this link needs a remote address")?;
        let hub = hub(env).ok_or("vnetd has no WireGuard key: start it with --wireguard-key-file <file>")?;
        let remote = SocketAddr::new(ip, spec.port.unwrap_or(WIREGUARD_PORT));
        let inner = Inner::toward(SocketAddr::new(ip, settings.default_link_port), settings.default_link_port)?;
        let link = hub.link(*peer, remote, inner)?;
        let mtu = spec.mtu.or_else(|| env.path_mtu(remote)).unwrap_or(1500);
        Ok(Made { transport: link, remote: Some(remote), name: spec.name.clone().unwrap_or_else(|| ip.to_string()), mtu, overhead: overhead(mtu, ip.is_ipv6()) })
    }

    /// With a key file: the key pair (made if missing), the carriers (IPv4,
    /// and IPv6 where the host has it; only `--udp-bind`'s family if given),
    /// and the handshake thread.
    fn start(&self, settings: &Settings, env: &dyn LinkEnv) -> Result<(), String> {
        let Some(path) = &settings.wireguard_key_file else { return Ok(()) };
        let keys = WgKeys::load_or_create(path).map_err(|e| format!("--wireguard-key-file: {e}"))?;
        let hub = WgHub::new(keys, path);
        hub.keep_sessions();
        let port = settings.wireguard_port;
        let families: Vec<IpAddr> = match settings.udp_bind {
            Some(ip) => vec![ip],
            None => vec![Ipv4Addr::UNSPECIFIED.into(), Ipv6Addr::UNSPECIFIED.into()],
        };
        for (k, ip) in families.iter().enumerate() {
            let opener = hub.clone() as Arc<dyn RunOpener>;
            match env.udp_carrier(CarrierKey::udp(port, ip), WORD, &|| opener.clone()) {
                Ok(c) => hub.carry(&c),
                // IPv6 is optional: a host without it still runs IPv4 links.
                Err(e) if k > 0 => tracing::warn!("no IPv6 WireGuard links: {e}"),
                Err(e) => return Err(format!("WireGuard: {e} (choose --wireguard-port)")),
            }
        }
        hub.spawn(env.links_now()).map_err(|e| format!("cannot start WireGuard's handshake thread: {e}"))?;
        tracing::info!("WireGuard on {} with public key {}", hub.listen(), hub.public_text());
        env.shared(WORD, &mut || Ok(hub.clone() as Arc<dyn Any + Send + Sync>))?;
        Ok(())
    }

    fn show(&self, env: &dyn LinkEnv) -> Vec<String> {
        hub(env).map(|h| vec![h.describe()]).unwrap_or_default()
    }

    fn stats(&self, env: &dyn LinkEnv) -> Option<String> {
        hub(env).map(|h| h.stats_line())
    }

    /// `WIREGUARD ROTATE`: a new key pair.
    fn command(&self, verb: &str, env: &dyn LinkEnv) -> Result<Vec<String>, String> {
        let hub = hub(env).ok_or("vnetd has no WireGuard key (start it with --wireguard-key-file)")?;
        match verb {
            "rotate" => {
                hub.rotate()?;
                tracing::info!("WireGuard key rotated; public key now {}", hub.public_text());
                Ok(vec![hub.describe()])
            }
            _ => Err(format!("WIREGUARD has no {verb} (want ROTATE)")),
        }
    }

    fn thread_stats(&self, env: &dyn LinkEnv) -> Option<Arc<ThreadStats>> {
        hub(env).map(|h| h.stats.clone())
    }
}
