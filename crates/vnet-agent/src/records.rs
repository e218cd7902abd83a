//! The records the overlay keeps in etcd, as every agent writes and reads
//! them: a host's registration, a guest's claim, a host's traffic counters
//! (keys and rules: `store.rs` and docs/controller.md). Plain data with their
//! JSON form; no I/O.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::IpAddr;

/// `<prefix>/<kind>/<name>`: a key of the overlay.
pub fn key(prefix: &str, kind: &str, name: &str) -> String {
    format!("{prefix}/{kind}/{name}")
}

/// `<p>/hosts/<host>`: where a host's vnetd takes links.
#[derive(Serialize, Deserialize)]
pub struct HostValue {
    pub underlay: IpAddr,
    pub port: u16,
}

/// `<p>/guests/<mac>`: which host has the guest, in which network, and
/// the claim's order (`seq`).
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct GuestValue {
    pub host: String,
    pub network: String,
    pub seq: u64,
}

/// Frames and bytes, one cell of the traffic matrix.
#[derive(Serialize, Deserialize, Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub frames: u64,
    pub bytes: u64,
}

impl Counts {
    pub fn add(&mut self, frames: u64, bytes: u64) {
        self.frames += frames;
        self.bytes += bytes;
    }
}

/// `<p>/traffic/<host>`: one host's published counters.
#[derive(Serialize, Deserialize, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Unix seconds when read.
    pub at: u64,
    /// Sent to each other host (unicast and broadcast).
    pub to_hosts: BTreeMap<String, Counts>,
    /// Sent from each local guest to each guest, by "src>dst" MAC.
    pub guests: BTreeMap<String, Counts>,
}
