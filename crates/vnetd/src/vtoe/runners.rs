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
//! **What a runner may claim.** A listener is registered only on the proof
//! of the listening socket itself, passed with the Listen (SCM_RIGHTS) and
//! checked here (`prove`): a TCP socket of the runner's own namespace,
//! listening, bound to exactly the address named. vnetd records its cookie,
//! family and owner, and closes its copy at once (the program's close must
//! close it); whether it still listens is asked of the guest's kernel when
//! it matters (sock_diag). Any user in the guest may run a runner, so a
//! live registration is never replaced (`Vtoe::listen`).
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
use std::net::SocketAddrV4;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;
use std::os::fd::{AsFd, OwnedFd};
use vnet_core::vtoe::{FromVnetd, ListenRefusal, Reason, ToVnetd, MAX_MSG, RUNNER_VERSION};

/// Connect requests of one runner answered at once, at most.
const MAX_IN_FLIGHT: usize = 64;

/// One runner's session: its socket and its guest.
pub struct Runner {
    sock: Socket,
    pub ns: Arc<GuestNs>,
    /// The runner's pid and uid, as the kernel recorded them when it
    /// connected (SO_PEERCRED, in vnetd's namespaces).
    pub cred: (i32, u32),
    in_flight: AtomicUsize,
}

/// What a listening socket proved: its kernel cookie, family (AF_INET, or
/// AF_INET6 for a dual-stack one), port and owner (the uid that made it).
#[derive(Clone, Copy, Debug)]
pub struct Proof {
    pub cookie: u64,
    pub family: u8,
    pub port: u16,
    pub owner: u32,
}

fn int_opt(fd: BorrowedFd<'_>, level: i32, name: i32) -> Option<i32> {
    let mut v: i32 = 0;
    let mut len = std::mem::size_of::<i32>() as libc::socklen_t;
    // SAFETY: getsockopt into an i32 of the length given.
    let r = unsafe { libc::getsockopt(fd.as_raw_fd(), level, name, (&mut v as *mut i32).cast(), &mut len) };
    (r == 0).then_some(v)
}

/// Checks the socket a runner sent with its Listen for `addr`: a TCP socket
/// (IPv4, or IPv6 taking IPv4) of the namespace `netns`, listening, bound
/// to `addr` exactly. Loopback, multicast and broadcast addresses are not
/// the overlay's.
pub fn prove(fd: Option<BorrowedFd<'_>>, addr: SocketAddrV4, netns: u64) -> Result<Proof, ListenRefusal> {
    let ip = *addr.ip();
    if ip.is_loopback() || ip.is_multicast() || ip.is_broadcast() {
        return Err(ListenRefusal::BadAddress);
    }
    let fd = fd.ok_or(ListenRefusal::NoSocket)?;
    let st = nix::sys::stat::fstat(fd.as_raw_fd()).map_err(|_| ListenRefusal::NotTcp)?;
    if st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return Err(ListenRefusal::NotTcp);
    }
    let family = match int_opt(fd, libc::SOL_SOCKET, libc::SO_DOMAIN) {
        Some(libc::AF_INET) => libc::AF_INET,
        Some(libc::AF_INET6) if int_opt(fd, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY) == Some(0) => libc::AF_INET6,
        _ => return Err(ListenRefusal::NotTcp),
    };
    if int_opt(fd, libc::SOL_SOCKET, libc::SO_TYPE) != Some(libc::SOCK_STREAM)
        || int_opt(fd, libc::SOL_SOCKET, libc::SO_PROTOCOL) != Some(libc::IPPROTO_TCP)
    {
        return Err(ListenRefusal::NotTcp);
    }
    if netns_cookie(fd.as_raw_fd()).ok() != Some(netns) {
        return Err(ListenRefusal::OtherNamespace);
    }
    if int_opt(fd, libc::SOL_SOCKET, libc::SO_ACCEPTCONN) != Some(1) {
        return Err(ListenRefusal::NotListening);
    }
    let bound = match nix::sys::socket::getsockname::<nix::sys::socket::SockaddrStorage>(fd.as_raw_fd()) {
        Ok(a) => match (a.as_sockaddr_in(), a.as_sockaddr_in6()) {
            (Some(v4), _) => Some(SocketAddrV4::new(v4.ip(), v4.port())),
            (_, Some(v6)) => {
                let ip = v6.ip();
                match ip.to_ipv4_mapped() {
                    Some(v4) => Some(SocketAddrV4::new(v4, v6.port())),
                    None if ip.is_unspecified() => Some(SocketAddrV4::new(std::net::Ipv4Addr::UNSPECIFIED, v6.port())),
                    None => None,
                }
            }
            _ => None,
        },
        Err(_) => None,
    };
    if bound != Some(addr) {
        return Err(ListenRefusal::WrongAddress);
    }
    let cookie = super::diag::socket_cookie(fd.as_raw_fd()).map_err(|_| ListenRefusal::NotTcp)?;
    Ok(Proof { cookie, family: family as u8, port: addr.port(), owner: st.st_uid })
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

/// Reads one message and the descriptors that came with it (closed unless
/// the message is one that carries a socket); None when the runner closed.
fn recv(sock: &Socket) -> Option<(Result<ToVnetd, String>, Vec<OwnedFd>)> {
    let mut buf = [0u8; 4 * MAX_MSG];
    let (n, fds) = match vnet_sys::cmsg::recv_with_fds(sock.as_raw_fd(), &mut buf) {
        Ok(r) => r,
        Err(_) => return None,
    };
    match n {
        0 => None,
        n if n > MAX_MSG => Some((Err(format!("a message of {n} bytes or more")), fds)),
        n => Some((ToVnetd::decode(&buf[..n]), fds)),
    }
}

/// The pid and uid of the process that connected (SO_PEERCRED).
fn peer_cred(sock: &Socket) -> (i32, u32) {
    // SAFETY: ucred is plain old data.
    let mut c: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt into a ucred of the length given.
    let r = unsafe { libc::getsockopt(sock.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, (&mut c as *mut libc::ucred).cast(), &mut len) };
    if r < 0 {
        return (0, u32::MAX);
    }
    (c.pid, c.uid)
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
    match recv(&sock).map(|(m, _)| m) {
        Some(Ok(ToVnetd::Hello { version: RUNNER_VERSION })) => {}
        Some(Ok(ToVnetd::Hello { version })) => {
            tracing::info!(ns = %ns.name, "VTOE: a runner of version {version} (this vnetd speaks {RUNNER_VERSION}): refused");
            return;
        }
        _ => {
            vtoe.counters.events.bad_messages.fetch_add(1, Relaxed);
            return;
        }
    }
    let cred = peer_cred(&sock);
    let runner = Arc::new(Runner { sock, ns, cred, in_flight: AtomicUsize::new(0) });
    if runner.send(&FromVnetd::Welcome { version: RUNNER_VERSION }, None).is_err() {
        return;
    }
    vtoe.counters.events.runners.fetch_add(1, Relaxed);
    tracing::debug!(ns = %runner.ns.name, "VTOE: runner connected");
    while let Some((m, mut fds)) = recv(&runner.sock) {
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
                // comes, registered or not (if not, plain connections only).
                // The socket is checked, then closed here, either way.
                let sock = if fds.len() == 1 { fds.pop() } else { None };
                let done = prove(sock.as_ref().map(|f| f.as_fd()), addr, runner.ns.cookie).and_then(|p| vtoe.listen(&runner, addr, p));
                drop(sock);
                let reply = match done {
                    Ok(()) => FromVnetd::Listening { addr },
                    Err(why) => {
                        vtoe.counters.listen_refused[why.index()].fetch_add(1, Relaxed);
                        let limit = if why == ListenRefusal::Limit { format!(" ({MAX_LISTENERS_PER_RUNNER} already)") } else { String::new() };
                        tracing::info!(
                            ns = %runner.ns.name,
                            "VTOE: listener {addr} of runner pid {} (uid {}) not registered: {}{limit}",
                            runner.cred.0, runner.cred.1, why.name()
                        );
                        FromVnetd::NotListening { addr, why }
                    }
                };
                let _ = runner.send(&reply, None);
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
