//! What a panic does to a VNET program: it ends the whole process.
//!
//! The release profile unwinds (so that `cargo test --release` shares the
//! binaries' compiled dependencies instead of building them all again with
//! another panic strategy), but a daemon must not lose one thread and go
//! on: a dead dispatcher would leave its guests without a network while
//! vnetd still looked alive, and a panicked task in the agent's runtime
//! would stop following etcd unseen. `abort_on_panic` keeps what
//! `panic = "abort"` gave: the panic's message, then SIGABRT.

/// Makes every later panic, in any thread, print its message and abort the
/// process. Call it first thing in `main`.
pub fn abort_on_panic() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        std::process::abort();
    }));
}
