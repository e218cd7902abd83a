//! The operating system, as vnetd uses it: netlink (`rtnl`), network
//! devices and namespaces (`netdev`), packet sockets (`packet`), the UDP
//! sockets links share and their batches (`udp`), threads (`thread`), the
//! descriptors that outlive a vnetd (`keep`), and
//! from `vnet-sys` the plumbing the vtoe runner shares (`epoll`, `eventfd`,
//! `cmsg`).
//!
//! The ground floor: nothing here imports any other part of vnetd, and
//! every other part may use it. What is unsafe about the OS stays here, in
//! functions that are safe to call.

pub mod keep;
pub mod netdev;
pub mod packet;
pub mod rtnl;
pub mod thread;
pub mod udp;

pub use vnet_sys::{cmsg, epoll, eventfd};
