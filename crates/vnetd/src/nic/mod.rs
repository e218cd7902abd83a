//! Virtual NICs: how guest frames enter and leave the daemon.
//!
//! Today that is a TAP device whose character-device side vnetd holds and
//! whose network-device side is the guest's NIC (moved into a guest network
//! namespace or container).

pub mod tap;

pub use tap::Tap;
