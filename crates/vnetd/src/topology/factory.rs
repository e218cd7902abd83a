//! Where NICs and links are made: each by the kind that takes what
//! `INTERFACE ADD` or `LINK ADD` asks for (`nic::kinds`, `link::kinds`). A
//! new kind is a module in `nic/` or `link/` and one line in its registry;
//! the rest of the topology, and the whole datapath, sees only `VirtualNic`
//! and `Transport`.

use crate::link::{kinds, LinkEnv, LinkSpec, Made};
use crate::nic::{NicSpec, VirtualNic};
use crate::settings::Settings;

/// Makes the NIC of the kind `spec.attach` asks for.
pub fn nic(spec: &NicSpec) -> Result<Box<dyn VirtualNic>, String> {
    let kind = crate::nic::kinds::of(&spec.attach).ok_or_else(|| format!("vnetd has no {} interfaces", spec.attach.word()))?;
    kind.make(spec)
}

/// Makes the link `LINK ADD` asks for, by the kind that takes its protocol.
pub fn link(spec: &LinkSpec, settings: &Settings, env: &dyn LinkEnv) -> Result<Made, String> {
    let kind = kinds::of(spec.proto).ok_or_else(|| format!("vnetd has no {} links", spec.proto.name()))?;
    kind.make(spec, settings, env)
}
