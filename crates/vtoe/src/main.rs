//! `vtoe <program> [args]`: runs an unmodified program with its TCP
//! connections offloaded to the overlay (VTOE, docs/vtoe.md), as
//! OpenOnload's `onload` or InfiniBand's SDP preload did.
//!
//! The runner talks to its host's vnetd (`--socket`, or `VNETD_SOCKET`),
//! starts the program under a seccomp filter whose notifications it answers
//! (`notify`), and stays as its supervisor (`supervisor`) until every
//! process of the program is gone; it exits with the program's status.
//! Without vnetd (or outside a guest), it runs the program as it is, and
//! says so.
//!
//! What it owns: the interception and the program's side of each call.
//! What it does not: any decision (vnetd's) or any security line (vnetd's
//! eBPF guard).

mod notify;
mod sock;
mod supervisor;
mod vnetd;

use anyhow::{bail, Context, Result};
use clap::Parser;
use std::ffi::{CString, OsString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(version, about = "Run a program with its TCP connections offloaded to the VNET overlay (VTOE)")]
struct Args {
    /// vnetd's VTOE socket (vnetd --vtoe-socket).
    #[arg(long, env = "VNETD_SOCKET", default_value = "/run/vnetd-vtoe.sock")]
    socket: PathBuf,
    /// Say what happens to each connection, and sum up at the end (on stderr).
    #[arg(short, long, env = "VTOE_VERBOSE", action = clap::ArgAction::SetTrue, value_parser = clap::builder::BoolishValueParser::new())]
    verbose: bool,
    /// The program and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    program: Vec<OsString>,
}

const FORWARDED: [i32; 6] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT, libc::SIGUSR1, libc::SIGUSR2];

fn main() {
    vnet_sys::process::abort_on_panic();
    let args = Args::parse();
    match run(&args) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("vtoe: {e:#}");
            std::process::exit(127);
        }
    }
}

fn cstrings(program: &[OsString]) -> Result<Vec<CString>> {
    program.iter().map(|a| CString::new(a.as_bytes()).context("an argument holds a NUL byte")).collect()
}

/// Replaces this process with the program (returns only on failure).
fn exec(argv: &[CString]) -> std::io::Error {
    let mut ptrs: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    ptrs.push(std::ptr::null());
    // SAFETY: execvp with a NUL-terminated array of C strings we own.
    unsafe { libc::execvp(ptrs[0], ptrs.as_ptr()) };
    std::io::Error::last_os_error()
}

fn run(args: &Args) -> Result<i32> {
    let argv = cstrings(&args.program)?;
    let session = match vnetd::Vnetd::connect(&args.socket) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("vtoe: {e:#}: running {} without offload", args.program[0].to_string_lossy());
            let e = exec(&argv);
            bail!("cannot run {}: {e}", args.program[0].to_string_lossy());
        }
    };

    // Signals for the program arrive by descriptor, from before the fork on.
    // SAFETY: sigset operations on a set we own.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above; sigprocmask on the (single-threaded) runner.
    unsafe {
        libc::sigemptyset(&mut set);
        for s in FORWARDED.iter().chain([libc::SIGCHLD].iter()) {
            libc::sigaddset(&mut set, *s);
        }
        libc::sigprocmask(libc::SIG_BLOCK, &set, &mut old);
    }
    let mut pair = [0 as RawFd; 2];
    // SAFETY: socketpair into an array of two.
    if unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0, pair.as_mut_ptr()) } < 0 {
        bail!("socketpair: {}", std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors are ours.
    let (here, there) = unsafe { (OwnedFd::from_raw_fd(pair[0]), OwnedFd::from_raw_fd(pair[1])) };

    // SAFETY: getpid cannot fail.
    let runner = unsafe { libc::getpid() };
    // SAFETY: the runner has no other thread; the child only installs the
    // filter, passes its descriptor and execs.
    let child = unsafe { libc::fork() };
    if child < 0 {
        bail!("fork: {}", std::io::Error::last_os_error());
    }
    if child == 0 {
        // Without its runner the program's stopped calls would fail
        // (ENOSYS): it goes when the runner goes, however that ends.
        // SAFETY: prctl and getppid on ourselves.
        unsafe {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            if libc::getppid() != runner {
                libc::_exit(127);
            }
        }
        drop(here);
        let code = match notify::install() {
            Ok(notif) => {
                if let Err(e) = vnet_sys::cmsg::send_fd(there.as_raw_fd(), notif.as_raw_fd()) {
                    eprintln!("vtoe: cannot hand the filter over: {e}");
                    127
                } else {
                    drop(notif);
                    drop(there);
                    // SAFETY: restore the mask the program should start with.
                    unsafe { libc::sigprocmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
                    let e = exec(&argv);
                    eprintln!("vtoe: cannot run {}: {e}", args.program[0].to_string_lossy());
                    if e.kind() == std::io::ErrorKind::NotFound { 127 } else { 126 }
                }
            }
            Err(e) if already_filtered() => {
                // Under another vtoe already (mpirun under vtoe starting a
                // rank through vtoe, say): the kernel allows one listener
                // per chain of filters, and the outer runner serves this
                // program too, when it runs in the same namespace.
                if args.verbose {
                    eprintln!("vtoe: {e:#}: already under a vtoe runner, running as is");
                }
                drop(there);
                // SAFETY: restore the mask the program should start with.
                unsafe { libc::sigprocmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
                let e = exec(&argv);
                eprintln!("vtoe: cannot run {}: {e}", args.program[0].to_string_lossy());
                127
            }
            Err(e) => {
                eprintln!("vtoe: {e:#}");
                127
            }
        };
        // SAFETY: leave the child without running the parent's destructors.
        unsafe { libc::_exit(code) };
    }
    drop(there);
    let notif = match recv_fd(here.as_raw_fd()) {
        Ok(fd) => fd,
        Err(_) => return Ok(wait_child(child)),
    };
    // SAFETY: signalfd on the set blocked above.
    let sfd = unsafe { libc::signalfd(-1, &set, libc::SFD_CLOEXEC | libc::SFD_NONBLOCK) };
    if sfd < 0 {
        bail!("signalfd: {}", std::io::Error::last_os_error());
    }
    // SAFETY: sfd is ours.
    let sfd = unsafe { OwnedFd::from_raw_fd(sfd) };
    let mut sup = supervisor::Supervisor::new(notif, session, &args.socket, sfd.as_raw_fd(), args.verbose)?;
    let mut status = None;
    sup.run(|| {
        // SAFETY: reading signalfd_siginfo records from our signalfd.
        let mut info: libc::signalfd_siginfo = unsafe { std::mem::zeroed() };
        while unsafe { libc::read(sfd.as_raw_fd(), (&mut info as *mut libc::signalfd_siginfo).cast(), std::mem::size_of_val(&info)) }
            > 0
        {
            let sig = info.ssi_signo as i32;
            if sig != libc::SIGCHLD {
                // SAFETY: kill(2) of the child we started, by its pid.
                unsafe { libc::kill(child, sig) };
            } else if status.is_none() {
                let mut st = 0;
                // SAFETY: waitpid on our child, without blocking.
                if unsafe { libc::waitpid(child, &mut st, libc::WNOHANG) } == child {
                    status = Some(st);
                }
            }
        }
    });
    let code = match status {
        Some(st) => exit_code(st),
        None => wait_child(child),
    };
    if args.verbose {
        let t = &sup.tally;
        eprintln!(
            "vtoe: {} connection(s) offloaded out, {} in; {} not offloaded; {} refused; {} interface ioctl(s) refused; {} listener(s) not registered; {} incoming refused",
            t.offloaded_out, t.offloaded_in, t.not_offloaded, t.refused, t.ioctl_refused, t.listeners_refused, t.incoming_refused
        );
    }
    Ok(code)
}

/// Whether this process already runs under a seccomp filter.
fn already_filtered() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .map(|s| s.lines().any(|l| l.starts_with("Seccomp:") && l.split_whitespace().nth(1) == Some("2")))
        .unwrap_or(false)
}

fn exit_code(st: i32) -> i32 {
    if libc::WIFEXITED(st) {
        libc::WEXITSTATUS(st)
    } else if libc::WIFSIGNALED(st) {
        128 + libc::WTERMSIG(st)
    } else {
        1
    }
}

fn wait_child(child: i32) -> i32 {
    let mut st = 0;
    // SAFETY: waitpid on our child.
    while unsafe { libc::waitpid(child, &mut st, 0) } < 0 {
        if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return 1;
        }
    }
    exit_code(st)
}

fn recv_fd(sock: RawFd) -> std::io::Result<OwnedFd> {
    let mut byte = [0u8; 1];
    match vnet_sys::cmsg::recv_with_fds(sock, &mut byte)? {
        (0, _) => Err(std::io::Error::other("the program exited before its filter was in place")),
        (_, fds) => fds.into_iter().next().ok_or_else(|| std::io::Error::other("no filter descriptor")),
    }
}
