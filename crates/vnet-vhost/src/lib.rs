//! The vhost-user virtio-net device of vnetd, from the device's side, built
//! for frontends (and guests) that attack: a VMM shares a guest's memory
//! and rings over a Unix socket, and vnetd's dispatchers move frames
//! straight between the guest's buffers and the overlay.
//!
//! Every frontend and guest is assumed hostile; each defence is a property
//! of a type rather than a check in the forwarder:
//!
//! - [`memory`]: guest memory (`GuestMemory<B>`, generic over the
//!   dirty-page bitmap: [`dirty`] logs every write while the VMM migrates
//!   the VM). Files that can shrink are
//!   refused unless the interface allows them, and a fault on a mapping
//!   (SIGBUS: the file shrank after all) breaks that device only, never
//!   vnetd ([`fault`], the only room that handles signals).
//! - [`notify`]: `Notifier` and `Kick`, built only from descriptors verified
//!   to be eventfds and made non-blocking: a signal never blocks a
//!   dispatcher.
//! - [`queue`]: one split virtqueue ([`walker`]: its chains read through
//!   host pointers resolved once, one copy of each descriptor); every
//!   per-chain and per-pass limit is in one [`Budget`], a ring that breaks the rules is marked broken
//!   ([`Health`]) and left alone until the frontend resets it.
//! - [`frame`]: a frame taken from the guest as a [`GuestFrame`], whose
//!   headers are a copy vnetd owns ([`HeadCopy`]): the forwarder routes and
//!   writes checksums on that copy alone, so a guest cannot change what was
//!   routed, and nothing vnetd writes lands in guest memory.
//! - [`held`]: frames for a receive ring that is not running yet (a
//!   frontend reconnecting), held within bounds until it starts.
//! - [`irq`]: when the guest is interrupted (event index, and VNET/P+'s
//!   optimistic interrupts), as decisions.
//! - [`state`]: a connected device's state, exported by a vnetd handing it
//!   over at an upgrade and imported (through the same checks) by the next;
//!   [`taken`]: how far each transmit ring was taken, so that a vnetd
//!   started after a crash sends no frame twice.
//! - [`device`]: one NIC's queue pairs (multi-queue), features and
//!   counters, as the dispatchers use them ([`steer`]: which receive queue
//!   a flow's frames go to); [`protocol`]: what each vhost-user message does
//!   to the device (the `vhost` crate reads and answers the messages).

pub mod chain;
pub mod counters;
pub mod device;
pub mod dirty;
pub mod fault;
pub mod frame;
pub mod held;
pub mod irq;
pub mod memory;
pub mod notify;
pub mod protocol;
pub mod queue;
pub mod state;
pub mod steer;
pub mod taken;
pub mod vsock;
pub mod walker;

pub use counters::Counters;
pub use device::{Device, Taken, MAX_PAIRS};
pub use dirty::DirtyPages;
pub use frame::{GuestFrame, HeadCopy, MAX_HEAD, MIN_HEAD};
pub use irq::IrqPolicy;
pub use memory::{GuestMemory, MemoryPolicy};
pub use protocol::Frontend;
pub use chain::Chained;
pub use queue::{Budget, Health, Popped, Ring};
pub use state::Exported;
