//! VNET core: the pure logic of the overlay, with no I/O.
//!
//! - [`mac`]: MAC addresses and frame headers.
//! - [`rule`]: route rules as users write them (the VNET/P grammar).
//! - [`table`]: the resolved rule table and the matcher (priorities, fan-out,
//!   split horizon).
//! - [`cache`]: the per-thread route cache in front of the table.
//! - [`command`]: the control language.
//! - [`setting`]: the dispatcher's tunables (`SET`, `INTERFACE SET`).
//! - [`wire`]: VXLAN headers, TCP-link framing, GRO runs.
//! - [`linkauth`]: the key handshake that opens a TCP link connection (and a
//!   VTOE shadow connection).
//! - [`vtoe`]: VTOE's shadow-connection handshake and runner messages.
//! - [`counters`]: `counter_set!`, counters whose names are written once.
//! - [`offload`]: checksum completion and TCP segmentation for offloaded frames.

pub mod cache;
pub mod command;
pub mod counters;
pub mod linkauth;
pub mod mac;
pub mod offload;
pub mod rule;
pub mod setting;
pub mod table;
pub mod vtoe;
pub mod wire;

pub use cache::RouteCache;
pub use mac::Mac;
pub use rule::{DstSpec, MacQual, RuleSpec, SrcSpec};
pub use table::{Hit, Port, RouteTable, Rule, SrcMatch};
