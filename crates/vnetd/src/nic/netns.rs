//! Interfaces attached as `netns` (`INTERFACE ADD <name> <mac> [netns
//! <ns>]`, the default): a TAP (`tap.rs`) whose network device is the
//! guest's NIC. In a guest namespace it is persistent and marked as vnetd's,
//! so a vnetd started again takes it over; without one it is plain and
//! always new.

use super::tap::{not_vnetds, Tap};
use super::{NicKind, NicSpec, VirtualNic};
use crate::sys::rtnl;
use vnet_core::command::Attach;

/// Interfaces attached as `netns` (the default): a TAP whose device is the
/// guest's NIC, made in the guest's namespace (persistent, and taken over
/// by a vnetd started again) or, without one, plain and always new.
pub struct Kind;

impl NicKind for Kind {
    fn takes(&self, attach: &Attach) -> bool {
        *attach == Attach::Netns
    }

    fn make(&self, spec: &NicSpec) -> Result<Box<dyn VirtualNic>, String> {
        let (name, mtu, mac) = (spec.name, spec.mtu, spec.mac);
        let tap = match spec.netns {
            Some(ns) => Tap::create_in_netns(name, mtu, mac, ns).map(|(t, _)| t),
            None => {
                match rtnl::device(name).map_err(|e| format!("cannot look up {name}: {e}"))? {
                    Some(d) if d.is_vnetds() => return Err(format!("a device named {name} already exists on this host")),
                    Some(_) => return Err(not_vnetds(name)),
                    None => {}
                }
                Tap::create(name, mtu, mac)
            }
        };
        tap.map(|t| Box::new(t) as Box<dyn VirtualNic>).map_err(|e| format!("{e:#}"))
    }
}
