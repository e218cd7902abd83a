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

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;
    use std::process::Command;

    const CHILD: &str = "VNET_SYS_PANIC_CHILD";

    /// Run in a child process of the test below: a thread panics while the
    /// main thread would go on for 10 s.
    #[test]
    fn child_panics_in_a_thread() {
        if std::env::var_os(CHILD).is_none() {
            return;
        }
        super::abort_on_panic();
        let _ = std::thread::spawn(|| panic!("a dispatcher's bug"));
        std::thread::sleep(std::time::Duration::from_secs(10));
        std::process::exit(0);
    }

    #[test]
    fn a_panic_in_any_thread_ends_the_whole_process_with_sigabrt_and_its_message() {
        let me = std::env::current_exe().unwrap();
        let started = std::time::Instant::now();
        let out = Command::new(me).args(["--exact", "process::tests::child_panics_in_a_thread", "--nocapture", "--test-threads=1"]).env(CHILD, "1").output().unwrap();
        assert_eq!(out.status.signal(), Some(libc::SIGABRT), "{out:?}");
        assert!(started.elapsed().as_secs() < 5, "the process went on after the panic");
        assert!(String::from_utf8_lossy(&out.stderr).contains("a dispatcher's bug"), "{out:?}");
    }
}
