//! Every kind of link vnetd has, the one list of them: `LINK ADD` makes a
//! link by the first kind that takes its protocol, vnetd's start runs every
//! kind's `start`, and `SHOW`, `STATS` and a kind's own requests ask them
//! all. A new kind is a module in `link/` and one line here (and its word in
//! the control language's grammar, `vnet_core::command`).

use super::LinkKind;
use vnet_core::command::LinkProto;

pub static ALL: &[&dyn LinkKind] = &[
    &super::vnetp::Kind,
    &super::vxlan::Kind,
    &super::geneve::Kind,
    &super::tcp::Kind,
    &super::direct::Kind,
    &super::wireguard::Kind,
];

/// The kind that makes links of `proto`.
pub fn of(proto: &LinkProto) -> Option<&'static dyn LinkKind> {
    ALL.iter().copied().find(|k| k.takes(proto))
}

/// The kind whose word this is (a request of its own: `WIREGUARD ROTATE`).
pub fn named(word: &str) -> Option<&'static dyn LinkKind> {
    ALL.iter().copied().find(|k| k.word().eq_ignore_ascii_case(word))
}
