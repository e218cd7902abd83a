//! vnetd, the VNET daemon, as a library: the binary (`main.rs`) is its
//! command line, and unit tests, fuzz targets and benchmarks link the same
//! code. docs/architecture.md draws the house; docs/vocabulary.md names its
//! parts. From the ground up (each floor may use the ones below it, never
//! one above; `scripts/check-structure` fails on any circle):
//!
//! - `sys` (the OS: netlink, devices, sockets, epoll), `settings` (what vnetd
//!   runs by), `stats` (counters): the ground floor;
//! - `port`: where a frame came from, and what a source hands frames to;
//!   `guest`: what vnetd keeps of a guest beyond its NIC (broadcast budget,
//!   learned addresses);
//! - `nic` (a guest's virtual NIC, one module per kind) and `link` (a path to
//!   another host, one module per kind, listed in `link::kinds`);
//! - `topology`: the control plane's state, and the `Snapshot` it publishes
//!   for the datapath;
//! - `fast`: what the kernel fast path may carry, installed from the rule
//!   table;
//! - `dispatch`: the user-level datapath (dispatcher threads, the forwarder);
//! - `vtoe`: virtual TCP offload;
//! - `control`: the control language's server and executor; `metrics`;
//! - `handover`: an upgrade's hand-over of kept descriptors (`sys::keep`);
//! - `daemon`: start and stop.

pub mod control;
pub mod daemon;
pub mod dispatch;
pub mod fast;
pub mod guest;
pub mod handover;
pub mod link;
pub mod metrics;
pub mod nic;
pub mod port;
pub mod settings;
pub mod stats;
pub mod sys;
pub mod topology;
pub mod vtoe;
