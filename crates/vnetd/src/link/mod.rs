//! Links (the papers' "edges"): how frames travel to and from other hosts.
//!
//! - `udp`: VNET/P's encapsulation, the bare frame as a UDP datagram, and the
//!   UDP socket machinery (GSO, GRO, batches) VXLAN shares.
//! - `vxlan`: RFC 7348, for interoperating with the kernel's VXLAN.
//! - `tcp`: frames over a TCP connection, for networks where UDP does not pass.
//! - direct links (raw onto a host device) use `nic::packet::PacketPort`.

pub mod tcp;
pub mod udp;
pub mod vxlan;

pub use udp::UdpEndpoint;
