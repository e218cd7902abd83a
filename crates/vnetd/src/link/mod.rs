//! Links (the papers' "edges"): how frames travel to and from other hosts.
//!
//! - `udp`: VNET/P's encapsulation, the bare frame as a UDP datagram, and the
//!   UDP socket machinery (GSO, GRO, batches) VXLAN shares.
//! - VXLAN (RFC 7348) shares `udp`'s sockets; its header is
//!   `vnet_core::wire`'s.
//! - `tcp`: frames over a TCP connection, for networks where UDP does not pass.
//! - direct links (raw onto a host device) use `nic::packet::PacketPort`.

pub mod tcp;
pub mod udp;

pub use udp::UdpEndpoint;
