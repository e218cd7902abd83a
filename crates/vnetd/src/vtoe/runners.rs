//! The socket `vtoe` runners talk to vnetd on (SOCK_SEQPACKET, one message
//! a packet, `vnet_core::vtoe`'s messages).
//!
//! **Who is asking.** Anyone on the host may connect (the socket is mode
//! 0666), but only a guest gets anything: the kernel records on the socket
//! vnetd accepts the network namespace of the socket that connected
//! (SO_NETNS_COOKIE), and a runner is served only if that namespace holds
//! one of this vnetd's interfaces (made with `netns <name>`). Everything it
//! asks is then judged as that guest's: its routes, its addresses, the
//! rule table from its interface. Anything else is told `NotGuest` and
//! closed.
//!
//! Messages are parsed as hostile input; a malformed one ends the runner's
//! session (counted). Each Connect is answered on a worker thread of its
//! own (resolving a neighbour may take seconds), at most `MAX_IN_FLIGHT` at
//! once for one runner.

use super::netns::{netns_cookie, GuestNs};
use super::{Vtoe, MAX_LISTENERS_PER_RUNNER};
use anyhow::{Context, Result};
use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use socket2::{Domain, SockAddr, Socket, Type};
use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;
use vnet_core::vtoe::{FromVnetd, Reason, ToVnetd, MAX_MSG, VERSION};

/// Connect requests of one runner answered at once, at most.
const MAX_IN_FLIGHT: usize = 64;

/// One runner's session: its socket and its guest.
pub struct Runner {
    sock: Socket,
    pub ns: Arc<GuestNs>,
    in_flight: AtomicUsize,
}

impl Runner {
    /// Sends a message, with a socket when it carries one. A runner that
    /// does not read for a second loses it (and the socket closes).
    pub fn send(&self, m: &FromVnetd, fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
        let bytes = m.encode();
        let iov = [IoSlice::new(&bytes)];
        let fds = fd.map(|f| [f.as_raw_fd()]);
        let cmsg: Vec<ControlMessage> = fds.as_ref().map(|f| vec![ControlMessage::ScmRights(f)]).unwrap_or_default();
        sendmsg::<()>(self.sock.as_raw_fd(), &iov, &cmsg, MsgFlags::MSG_NOSIGNAL, None).map_err(io::Error::from)?;
        Ok(())
    }
}

/// Binds the runners' socket at `path` (replacing a stale one).
pub fn bind(path: &Path) -> Result<Socket> {
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            anyhow::bail!("{} exists and is not a socket: not replacing it", path.display());
        }
        let probe = Socket::new(Domain::UNIX, Type::SEQPACKET, None)?;
        if probe.connect(&SockAddr::unix(path)?).is_ok() {
            anyhow::bail!("VTOE socket {} is in use by a running vnetd", path.display());
        }
        std::fs::remove_file(path).with_context(|| format!("cannot remove stale {}", path.display()))?;
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let s = Socket::new(Domain::UNIX, Type::SEQPACKET, None)?;
    s.bind(&SockAddr::unix(path)?).with_context(|| format!("cannot bind VTOE socket {}", path.display()))?;
    // Open to every local user: who is served is decided by namespace.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    s.listen(128)?;
    Ok(s)
}

/// Accepts runners, each served on a thread of its own.
pub fn serve(vtoe: Arc<Vtoe>, listener: Socket) {
    loop {
        let sock = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::error!("VTOE: runner socket failed: {e}");
                return;
            }
        };
        let v = vtoe.clone();
        let _ = std::thread::Builder::new().name("vtoe-runner".into()).spawn(move || session(v, sock));
    }
}

/// The guest namespace a runner's socket was made in, if it is one of ours.
fn identify(vtoe: &Vtoe, sock: &Socket) -> Option<Arc<GuestNs>> {
    let cookie = netns_cookie(sock.as_raw_fd()).ok()?;
    let snap = vtoe.dp.snapshot();
    let mut names: Vec<&str> = snap.ifaces.iter().filter_map(|i| i.netns.as_deref()).collect();
    names.sort_unstable();
    names.dedup();
    names.into_iter().filter_map(|n| vtoe.namespaces.get(n).ok()).find(|ns| ns.cookie == cookie)
}

/// Reads one message; None when the runner closed or sent something that
/// is not one message.
fn recv(sock: &Socket) -> Option<Result<ToVnetd, String>> {
    let mut buf = [0u8; 4 * MAX_MSG];
    loop {
        // SAFETY: recv into a buffer we own. Descriptors a runner might
        // send are discarded by the kernel: no control buffer is given.
        let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        }
        return match n {
            n if n <= 0 => None,
            n if n as usize > MAX_MSG => Some(Err(format!("a message of {n} bytes or more"))),
            n => Some(ToVnetd::decode(&buf[..n as usize])),
        };
    }
}

fn session(vtoe: Arc<Vtoe>, sock: Socket) {
    let _ = sock.set_write_timeout(Some(Duration::from_secs(1)));
    let Some(ns) = identify(&vtoe, &sock) else {
        vtoe.counters.events.runners_not_guest.fetch_add(1, Relaxed);
        tracing::info!("VTOE: a runner from a namespace with no interface of this vnetd: refused");
        let msg = FromVnetd::NotGuest.encode();
        let _ = sock.send(&msg);
        return;
    };
    match recv(&sock) {
        Some(Ok(ToVnetd::Hello { version: VERSION })) => {}
        Some(Ok(ToVnetd::Hello { version })) => {
            tracing::info!(ns = %ns.name, "VTOE: a runner of version {version} (this vnetd speaks {VERSION}): refused");
            return;
        }
        _ => {
            vtoe.counters.events.bad_messages.fetch_add(1, Relaxed);
            return;
        }
    }
    let runner = Arc::new(Runner { sock, ns, in_flight: AtomicUsize::new(0) });
    if runner.send(&FromVnetd::Welcome { version: VERSION }, None).is_err() {
        return;
    }
    vtoe.counters.events.runners.fetch_add(1, Relaxed);
    tracing::debug!(ns = %runner.ns.name, "VTOE: runner connected");
    while let Some(m) = recv(&runner.sock) {
        let m = match m {
            Ok(m) => m,
            Err(e) => {
                vtoe.counters.events.bad_messages.fetch_add(1, Relaxed);
                tracing::warn!(ns = %runner.ns.name, "VTOE: runner sent a bad message ({e}): session ended");
                break;
            }
        };
        match m {
            ToVnetd::Connect { id, src, dst } => {
                if runner.in_flight.fetch_add(1, Relaxed) >= MAX_IN_FLIGHT {
                    runner.in_flight.fetch_sub(1, Relaxed);
                    vtoe.counters.events.offers.fetch_add(1, Relaxed);
                    vtoe.counters.fallback[Reason::Limit.index()].fetch_add(1, Relaxed);
                    let _ = runner.send(&FromVnetd::Fallback { id, reason: Reason::Limit }, None);
                    continue;
                }
                let (v, r) = (vtoe.clone(), runner.clone());
                let taken = vtoe.offers.run(move || {
                    let (reply, fd) = v.offer(&r, id, src, dst);
                    if let Err(e) = r.send(&reply, fd.as_ref().map(|f| std::os::fd::AsFd::as_fd(f))) {
                        tracing::info!(ns = %r.ns.name, "VTOE: cannot answer the runner: {e}");
                    }
                    r.in_flight.fetch_sub(1, Relaxed);
                });
                if !taken {
                    runner.in_flight.fetch_sub(1, Relaxed);
                    vtoe.counters.events.offers.fetch_add(1, Relaxed);
                    vtoe.counters.fallback[Reason::Limit.index()].fetch_add(1, Relaxed);
                    let _ = runner.send(&FromVnetd::Fallback { id, reason: Reason::Limit }, None);
                }
            }
            ToVnetd::Listen { addr } => {
                // The program's listen waits for this answer: it always
                // comes, registered or not (over the limit: plain only).
                if !vtoe.listen(&runner, addr) {
                    tracing::info!(ns = %runner.ns.name, "VTOE: listener {addr} not registered: {MAX_LISTENERS_PER_RUNNER} already");
                }
                let _ = runner.send(&FromVnetd::Listening { addr }, None);
            }
            ToVnetd::Unlisten { addr } => vtoe.unlisten(&runner, addr),
            ToVnetd::RefusedIoctl => {
                vtoe.counters.events.runner_refused_ioctl.fetch_add(1, Relaxed);
            }
            ToVnetd::Hello { .. } => {
                vtoe.counters.events.bad_messages.fetch_add(1, Relaxed);
                break;
            }
        }
    }
    vtoe.runner_gone(&runner);
    tracing::debug!(ns = %runner.ns.name, "VTOE: runner gone");
}
