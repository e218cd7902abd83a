//! Every kind of NIC vnetd has, the one list of them: `INTERFACE ADD` makes
//! an interface's NIC by the first kind that takes its attachment. A new
//! kind is a module in `nic/` and one line here (and its word in the control
//! language's grammar, `vnet_core::command::Attach`).

use super::NicKind;
use vnet_core::command::Attach;

pub static ALL: &[&dyn NicKind] = &[&super::netns::Kind, &super::qemu::Kind, &super::veth::Kind, &super::vhost_user::Kind];

/// The kind that makes NICs attached as `attach`.
pub fn of(attach: &Attach) -> Option<&'static dyn NicKind> {
    ALL.iter().copied().find(|k| k.takes(attach))
}
