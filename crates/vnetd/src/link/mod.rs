//! Links (the papers' "edges"): how frames travel to and from other hosts.
//!
//! Today: UDP in the VNET/P wire format, where the whole Ethernet frame is the
//! datagram's payload with no header of our own.

pub mod udp;

pub use udp::UdpEndpoint;
