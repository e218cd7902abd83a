//! A vhost-user vsock device (virtio 1.2, 5.10) served by vnetd itself:
//! a VM's channel to its host, for VTOE (docs/vtoe.md). The vhost-user
//! protocol and its checks are the net device's (`protocol::Virtio`); the
//! rings are the same `Ring`s with the same budgets.
//!
//! - [`packet`]: the packet header, parsed from a copy and refused whole
//!   if the guest names anything but itself and its host.
//! - [`conn`]: one connection's state and credit.
//! - [`device`]: the three rings and the configuration (the guest's CID).
//! - [`mux`]: the connection thread, moving bytes between the guest's
//!   buffers and host stream sockets; [`mux::HostSide`] says where a
//!   guest's connection goes.

pub mod conn;
pub mod device;
pub mod mux;
pub mod packet;

pub use device::Device;
pub use mux::{Counters, HostSide, Incoming, Mux, Opener};
