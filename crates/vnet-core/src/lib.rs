//! VNET core: the pure logic of the overlay, with no I/O.
//!
//! - [`mac`]: MAC addresses and frame headers.
//! - [`rule`]: route rules as users write them (the VNET/P grammar).
//! - [`table`]: the resolved rule table and the matcher (priorities, fan-out,
//!   split horizon).
//! - [`cache`]: the per-thread route cache in front of the table.
//! - [`command`]: the control language.
//! - [`setting`]: the dispatcher's tunables (`SET`, `INTERFACE SET`).
//! - [`render`]: commands written back as canonical lines of the language.
//! - [`wire`]: VXLAN headers, TCP-link framing, GRO runs.
//! - [`linkauth`]: the key handshake that opens a TCP link connection (and a
//!   VTOE shadow connection).
//! - [`vtoe`]: VTOE's shadow-connection handshake and runner messages.
//! - [`counters`]: `counter_set!`, counters whose names are written once.
//! - [`neigh`]: IP-to-MAC bindings, and ARP / neighbour-discovery requests
//!   answered on the asker's host (the rule every datapath obeys).
//! - [`offload`]: checksum completion and TCP segmentation for offloaded frames.

pub mod cache;
pub mod command;
pub mod counters;
pub mod linkauth;
pub mod mac;
pub mod neigh;
pub mod offload;
pub mod render;
pub mod rule;
pub mod setting;
pub mod table;
pub mod vtoe;
pub mod wire;

pub use cache::RouteCache;
pub use mac::Mac;
pub use rule::{DstSpec, MacQual, RuleSpec, SrcSpec};
pub use table::{Hit, Port, RouteTable, Rule, SrcMatch};

/// FNV-1a (64 bits) of a name: stable across processes, builds and
/// machines, for what must be derived from a name the same way every time
/// (vnetd's device names from a guest's, the recorded ids of objects by
/// their names). Not for anything an attacker must not be able to collide.
pub fn name_hash(name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}
