//! OS plumbing that several VNET programs share, each thing written once:
//!
//! - `epoll`: one wrapper (microsecond timeouts where the kernel has
//!   `epoll_pwait2`), for vnetd's dispatchers, its vhost-user NICs and the
//!   vtoe runner's supervisor;
//! - `eventfd`: the one way an eventfd is made (non-blocking, close-on-exec),
//!   written and drained;
//! - `cmsg`: the one walker of a received message's control data, the one
//!   writer of a control message, and descriptor passing built on them;
//! - `process`: a panic in any thread of a VNET program ends the process.
//!
//! No VNET knowledge lives here: only system calls behind safe functions,
//! each `unsafe` block with the reason it is sound. It may use only `libc`.

pub mod cmsg;
pub mod epoll;
pub mod eventfd;
pub mod process;
