//! An upgrade that hands over instead of restarting: the new vnetd takes
//! the running one's kept descriptors (`sys::keep`: the TAPs' files, the
//! link sockets) over a Unix socket, so no TAP loses its reader and no
//! port is left unbound while the new one starts; the kernel queues what
//! arrives meanwhile, and the new vnetd reads it.
//!
//! The running vnetd listens on `<state file>.handover` (a SOCK_SEQPACKET
//! socket, mode 0600; a peer of another user is refused). `vnetd
//! --takeover` connects and says `TAKEOVER <protocol>`. The running one
//! answers `NO <reason>` (another protocol: it goes on as it was, and the
//! new one falls back to a restart: it stops it with SIGTERM, waits for
//! it to exit, and starts as after any stop), or `OK`: then it stops as on
//! SIGTERM, and once its dispatchers have stopped reading (a known point:
//! no frame is half-forwarded) it sends each kept descriptor as a message
//! `fd <name>` carrying it, then `END`, and exits; the connection closes
//! when it is gone, its locks (state file, pinned datapath) free. The new
//! vnetd then starts as usual: it adopts the pinned datapath, restores the
//! state file, and whatever opens a TAP or binds a socket takes the
//! descriptor of its name.

use crate::sys::keep;
use anyhow::{anyhow, bail, Context, Result};
use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, UnixAddr};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The hand-over's protocol: what the messages are and what the names
/// of the descriptors mean (`sys::keep`).
pub const PROTOCOL: u32 = 1;

/// The connection of a successor that was told OK, until the main thread
/// sends it the descriptors (`serve`).
static PENDING: Mutex<Option<OwnedFd>> = Mutex::new(None);

/// The hand-over socket of the vnetd whose state file is `state`.
pub fn path(state: &Path) -> PathBuf {
    PathBuf::from(format!("{}.handover", state.display()))
}

fn seqpacket() -> Result<OwnedFd> {
    socket::socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None).context("cannot make a Unix socket")
}

fn send(fd: &OwnedFd, text: &str) -> Result<()> {
    socket::send(fd.as_raw_fd(), text.as_bytes(), socket::MsgFlags::MSG_NOSIGNAL)?;
    Ok(())
}

fn recv(fd: &OwnedFd, buf: &mut [u8]) -> Result<(String, Vec<OwnedFd>)> {
    let (n, fds) = crate::sys::cmsg::recv_with_fds(fd.as_raw_fd(), buf)?;
    Ok((String::from_utf8_lossy(&buf[..n]).into_owned(), fds))
}

/// Listens for a successor at `path` (the running vnetd), on a thread of
/// its own; `stop` is how it stops this vnetd once a hand-over is agreed.
pub fn listen(path: &Path, stop: impl Fn() + Send + 'static) -> Result<()> {
    let _ = std::fs::remove_file(path);
    let l = seqpacket()?;
    socket::bind(l.as_raw_fd(), &UnixAddr::new(path)?).with_context(|| format!("cannot bind {}", path.display()))?;
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    socket::listen(&l, socket::Backlog::new(4)?)?;
    let me = nix::unistd::geteuid().as_raw();
    let shown = path.display().to_string();
    std::thread::Builder::new().name("handover".into()).spawn(move || loop {
        let Ok(c) = socket::accept(l.as_raw_fd()) else { continue };
        // SAFETY: accept returned a new descriptor, ours.
        let c = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(c) };
        match socket::getsockopt(&c, socket::sockopt::PeerCredentials) {
            Ok(cred) if cred.uid() == me => {}
            _ => continue,
        }
        let _ = socket::setsockopt(&c, socket::sockopt::ReceiveTimeout, &nix::sys::time::TimeVal::new(2, 0));
        let mut buf = [0u8; 64];
        let Ok((req, _)) = recv(&c, &mut buf) else { continue };
        match req.trim().strip_prefix("TAKEOVER ").map(|v| v.parse::<u32>()) {
            Some(Ok(PROTOCOL)) => {
                if send(&c, "OK").is_ok() {
                    tracing::info!("hand-over: a new vnetd takes over ({shown}); stopping");
                    *PENDING.lock().unwrap_or_else(|p| p.into_inner()) = Some(c);
                    stop();
                    return;
                }
            }
            Some(Ok(v)) => {
                tracing::warn!("hand-over refused: a vnetd speaking protocol {v} (this one speaks {PROTOCOL}); going on");
                let _ = send(&c, &format!("NO protocol {v} (this vnetd speaks {PROTOCOL})"));
            }
            _ => {
                let _ = send(&c, "NO not a TAKEOVER request");
            }
        }
    })?;
    Ok(())
}

/// The running vnetd, stopping: if a successor was told OK, sends it
/// every kept descriptor (the dispatchers have stopped reading them), then
/// `END`. The connection stays open until this process exits.
pub fn serve() -> Option<OwnedFd> {
    let c = PENDING.lock().unwrap_or_else(|p| p.into_inner()).take()?;
    let kept = keep::offered();
    let mut sent = 0;
    for (name, fd) in &kept {
        match crate::sys::cmsg::send_with_fd(c.as_raw_fd(), format!("fd {name}").as_bytes(), *fd) {
            Ok(()) => sent += 1,
            Err(e) => tracing::warn!("hand-over: cannot send {name}: {e}"),
        }
    }
    // Objects written out now (vhost-user devices): their descriptors,
    // then their state.
    let mut states = 0;
    for (name, x) in keep::exported() {
        let all = x.fds.iter().all(|(n, fd)| crate::sys::cmsg::send_with_fd(c.as_raw_fd(), format!("fd {name} {n}").as_bytes(), fd.as_raw_fd()).is_ok());
        if all && send(&c, &format!("state {name}\n{}", x.state)).is_ok() {
            states += 1;
            sent += x.fds.len();
        } else {
            tracing::warn!("hand-over: cannot send {name}");
        }
    }
    let _ = send(&c, "END");
    tracing::info!("hand-over: {sent} descriptor(s) sent, {states} device state(s)");
    Some(c)
}

/// The new vnetd (`--takeover`): takes over from the vnetd listening at
/// `path`, if one does (its descriptors given to `keep`), or has it stop
/// if it will not hand over; returns once it has exited. Nothing to do if
/// no vnetd listens there.
pub fn take_over(path: &Path, timeout: Duration) -> Result<()> {
    let c = seqpacket()?;
    if socket::connect(c.as_raw_fd(), &UnixAddr::new(path)?).is_err() {
        tracing::info!("--takeover: no vnetd answers at {}: starting afresh", path.display());
        return Ok(());
    }
    let old = socket::getsockopt(&c, socket::sockopt::PeerCredentials).map(|c| c.pid())?;
    socket::setsockopt(&c, socket::sockopt::ReceiveTimeout, &nix::sys::time::TimeVal::new(timeout.as_secs() as i64, 0))?;
    send(&c, &format!("TAKEOVER {PROTOCOL}"))?;
    let mut buf = vec![0u8; 16384];
    let (answer, _) = recv(&c, &mut buf).context("--takeover: no answer")?;
    if let Some(why) = answer.strip_prefix("NO ") {
        tracing::warn!("--takeover: vnetd {old} will not hand over ({why}): restarting it instead (SIGTERM)");
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(old), nix::sys::signal::Signal::SIGTERM)?;
        return wait_gone(old, timeout);
    }
    if answer != "OK" {
        bail!("--takeover: vnetd {old} answered '{answer}'");
    }
    let t0 = Instant::now();
    let mut given = Vec::new();
    loop {
        let (msg, mut fds) = recv(&c, &mut buf).context("--takeover: the hand-over broke off")?;
        if msg == "END" {
            break;
        }
        if let Some((name, state)) = msg.strip_prefix("state ").and_then(|m| m.split_once('\n')) {
            keep::give_state(name.to_string(), state.to_string());
            continue;
        }
        if msg.is_empty() {
            bail!("--takeover: vnetd {old} closed the hand-over before its end");
        }
        match (msg.strip_prefix("fd "), fds.pop()) {
            (Some(name), Some(fd)) => given.push((name.to_string(), fd)),
            _ => return Err(anyhow!("--takeover: not a descriptor message: {msg}")),
        }
    }
    let n = given.len();
    keep::give(given);
    // The old vnetd is exiting once the connection closes, and has let go
    // of its locks once it is gone (a process closes its descriptors in
    // their order as it exits: the connection may close before a lock).
    loop {
        match recv(&c, &mut buf) {
            Ok((m, _)) if m.is_empty() => break,
            Ok(_) => continue,
            Err(_) if t0.elapsed() < timeout => continue,
            Err(e) => bail!("--takeover: vnetd {old} did not exit: {e}"),
        }
    }
    wait_gone(old, timeout)?;
    tracing::info!("--takeover: {n} descriptor(s) taken from vnetd {old}, which stopped in {:.3} s", t0.elapsed().as_secs_f64());
    Ok(())
}

/// Waits until process `pid` is gone: no longer there, or a zombie whose
/// every thread has exited (a process's descriptors, and the locks on
/// them, go with its last thread; its leader may be a zombie before that).
fn wait_gone(pid: i32, timeout: Duration) -> Result<()> {
    let t0 = Instant::now();
    loop {
        let stat = match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Ok(s) => s,
            Err(_) => return Ok(()),
        };
        let zombie = stat.rsplit(')').next().is_some_and(|r| r.trim_start().starts_with('Z'));
        let threads = std::fs::read_dir(format!("/proc/{pid}/task")).map(|d| d.count()).unwrap_or(0);
        if zombie && threads <= 1 {
            return Ok(());
        }
        if t0.elapsed() > timeout {
            bail!("--takeover: vnetd {pid} did not stop in {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}
