//! What a panic does to a VNET program (it ends the whole process), and
//! the descriptor limit a daemon raises.
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

/// Raises the soft limit on open descriptors to the hard one, and returns
/// it. A daemon's descriptors are what its guests open (a VM's vsock
/// connections, each a host socket): the 1024 many distributions start a
/// process with would let one guest take them all.
pub fn raise_fd_limit() -> u64 {
    let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit on a struct this frame owns.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) != 0 {
            return 0;
        }
        if l.rlim_cur < l.rlim_max {
            let want = libc::rlimit { rlim_cur: l.rlim_max, rlim_max: l.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0 {
                l = want;
            }
        }
    }
    l.rlim_cur
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
