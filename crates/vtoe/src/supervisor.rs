//! The runner's event loop: the program's stopped calls, vnetd's answers
//! and offloaded connections, and the listeners' wake-ups, on one thread.
//!
//! **connect.** An IPv4 TCP socket never connected, to an address that is
//! not loopback, unspecified, multicast or broadcast, from one that is not
//! loopback either: the runner holds a port of the source address for it (the
//! guest's kernel then gives it to nobody else), asks vnetd, and meanwhile
//! the program's call waits. Offloaded: the shadow socket takes the
//! program's options and blocking mode and replaces its socket at the same
//! descriptor number, and connect returns 0 (EINPROGRESS if non-blocking:
//! the socket is writable at once). Not offloaded: the call goes on in the
//! guest's kernel as it was made, over the Ethernet path. Refused: it fails
//! with vnetd's errno.
//!
//! **listen** is made by the runner on the program's socket, which is then
//! registered with vnetd, the listening socket passed along as its proof
//! (listen returns once vnetd answered). The runner keeps no copy of it
//! (the program's close must close it): to register it again with a vnetd
//! that restarted, it takes it from the program again, by its inode. A
//! listener on a loopback address is not registered (nothing on the
//! overlay may reach it).
//!
//! **accept.** A listener gets two kinds of connections: the guest kernel's
//! own (plain ones) and offloaded ones, which vnetd hands to the runner.
//! Every accept on a registered listener is answered by the runner: an
//! offloaded connection if one waits, else one it accepts from the guest's
//! kernel, with accept's address and flags. So that a program waiting in
//! poll/epoll/select on the listener wakes up for an offloaded connection,
//! the runner makes a *wake* connection to the listener from the guest's
//! own loopback: the listener becomes readable as for any connection, and
//! when the program's accept meets a wake connection the runner discards it
//! and gives the offloaded one (or EAGAIN, as a spurious wake-up).
//!
//! **ioctl** on interfaces (SIOCGIFCONF, ...) through an offloaded socket
//! would list the host's devices: refused (EPERM) for sockets that are not
//! of the guest's namespace.

use crate::notify::{self, Call, Notif};
use crate::sock::{self, Defaults};
use crate::vnetd::Vnetd;
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddrV4;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use vnet_core::vtoe::{is_overlay_unicast, FromVnetd, ToVnetd};
use vnet_sys::epoll::Epoll;

const T_NOTIF: u64 = 0;
const T_VNETD: u64 = 1;
const T_SIGNAL: u64 = 2;
/// Tokens at or above: parked accepts and wake connections.
const T_FIRST: u64 = 16;

/// A connect waiting for vnetd's answer.
struct Pending {
    notif: Notif,
    fd: RawFd,
    /// The runner's copy of the program's socket.
    guest: OwnedFd,
    /// The port held for it, if the program had not bound one.
    reservation: Option<OwnedFd>,
    nonblocking: bool,
    dst: SocketAddrV4,
}

/// A connection waiting for the program's accept, with the address accept
/// reports (sockaddr bytes, as the kernel would write them).
struct Ready {
    sock: OwnedFd,
    addr: Vec<u8>,
}

/// A listening socket of the program, by inode.
struct Listener {
    /// Its IPv4 address (0.0.0.0: all of the guest's).
    addr: SocketAddrV4,
    /// An IPv6 socket taking IPv4 too: accept reports IPv4-mapped addresses.
    v6: bool,
    ready: VecDeque<Ready>,
    /// Wake connections not yet met by an accept, by their local address.
    wakes: HashMap<SocketAddrV4, (u64, OwnedFd)>,
    /// Where the program held it when it listened (process, descriptor), to
    /// take it again for a vnetd that restarted.
    held: (i32, RawFd),
}

/// A blocking accept with nothing to give yet.
struct Parked {
    notif: Notif,
    inode: u64,
    dup: OwnedFd,
}

#[derive(Default)]
pub struct Tally {
    pub offloaded_out: u64,
    pub offloaded_in: u64,
    pub not_offloaded: u64,
    pub refused: u64,
    pub ioctl_refused: u64,
    /// Offloaded connections vnetd handed over for a loopback, unspecified,
    /// multicast or broadcast end: closed.
    pub incoming_refused: u64,
    /// Listeners vnetd did not register.
    pub listeners_refused: u64,
}

pub struct Supervisor {
    notif: OwnedFd,
    /// The session with vnetd; after it ends, tried again at most once a
    /// second, on the next call that needs it (listeners registered again).
    vnetd: Option<Vnetd>,
    socket: std::path::PathBuf,
    retry_at: std::time::Instant,
    epoll: Epoll,
    defaults: Defaults,
    own_netns: Option<u64>,
    /// The runner's network namespace (device, inode): only calls of
    /// processes in it are the guest's whom vnetd knows this runner by.
    own_ns_file: Option<(u64, u64)>,
    next_id: u32,
    next_token: u64,
    connects: HashMap<u32, Pending>,
    listens: HashMap<SocketAddrV4, Vec<u64>>,
    listeners: HashMap<u64, Listener>,
    by_addr: HashMap<SocketAddrV4, u64>,
    reservations: HashMap<u64, OwnedFd>,
    parked: HashMap<u64, Parked>,
    /// Wake connections still connecting: token -> listener inode.
    waking: HashMap<u64, u64>,
    verbose: bool,
    pub tally: Tally,
}

/// A process's network namespace, as the (device, inode) of its ns file.
fn ns_file(pid: &str) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}/ns/net")).ok().map(|m| (m.dev(), m.ino()))
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

impl Supervisor {
    pub fn new(notif: OwnedFd, vnetd: Vnetd, socket: &std::path::Path, signals: RawFd, verbose: bool) -> std::io::Result<Supervisor> {
        let epoll = Epoll::new(32)?;
        let own_netns = std::net::UdpSocket::bind("0.0.0.0:0").ok().and_then(|u| sock::netns_cookie(u.as_raw_fd()));
        let s = Supervisor {
            notif,
            vnetd: Some(vnetd),
            socket: socket.to_path_buf(),
            retry_at: std::time::Instant::now(),
            epoll,
            defaults: Defaults::read(),
            own_netns,
            own_ns_file: ns_file("self"),
            next_id: 1,
            next_token: T_FIRST,
            connects: HashMap::new(),
            listens: HashMap::new(),
            listeners: HashMap::new(),
            by_addr: HashMap::new(),
            reservations: HashMap::new(),
            parked: HashMap::new(),
            waking: HashMap::new(),
            verbose,
            tally: Tally::default(),
        };
        s.watch(s.notif.as_raw_fd(), T_NOTIF, libc::EPOLLIN as u32)?;
        s.watch(s.vnetd.as_ref().expect("set").fd(), T_VNETD, libc::EPOLLIN as u32)?;
        s.watch(signals, T_SIGNAL, libc::EPOLLIN as u32)?;
        Ok(s)
    }

    fn watch(&self, fd: RawFd, token: u64, events: u32) -> std::io::Result<()> {
        self.epoll.add(fd, events, token)
    }

    fn unwatch(&self, fd: RawFd) {
        self.epoll.delete(fd);
    }

    fn say(&self, what: impl FnOnce() -> String) {
        if self.verbose {
            eprintln!("vtoe: {}", what());
        }
    }

    /// Runs until no process under the filter is left; `on_signal` is called
    /// when the signal descriptor is readable.
    pub fn run(&mut self, mut on_signal: impl FnMut()) {
        loop {
            // Without vnetd, look for it again every second (its listeners
            // registered again as soon as it is back).
            let timeout = if self.vnetd.is_none() { Some(std::time::Duration::from_secs(1)) } else { None };
            let n = match self.epoll.wait(timeout) {
                Ok(0) => {
                    self.session();
                    continue;
                }
                Ok(n) => n,
                Err(e) => {
                    eprintln!("vtoe: epoll: {e}");
                    return;
                }
            };
            for i in 0..n {
                let ev = self.epoll.event(i);
                let (token, flags) = (ev.token, ev.events);
                match token {
                    T_NOTIF => {
                        if flags & libc::EPOLLIN as u32 != 0 {
                            self.on_notification();
                        } else if flags & (libc::EPOLLHUP | libc::EPOLLERR) as u32 != 0 {
                            return; // every process under the filter is gone
                        }
                    }
                    T_VNETD => self.on_vnetd(),
                    T_SIGNAL => on_signal(),
                    t => self.on_token(t),
                }
            }
        }
    }

    fn on_notification(&mut self) {
        let n = match notify::receive(&self.notif) {
            Ok(Some(n)) => n,
            Ok(None) => return,
            Err(e) => {
                eprintln!("vtoe: {e:#}");
                return;
            }
        };
        // A process that moved to another network namespace (ip netns exec
        // under the program) is not the guest vnetd knows this runner as.
        if self.own_ns_file.is_none() || ns_file(&n.tid.to_string()) != self.own_ns_file {
            return notify::proceed(&self.notif, n.id);
        }
        match n.call {
            Call::Connect => self.on_connect(n),
            Call::Listen => self.on_listen(n),
            Call::Accept | Call::Accept4 => self.on_accept(n),
            Call::Ioctl => self.on_ioctl(n),
        }
    }

    // ---- connect ----

    /// The session with vnetd, made again if it ended (vnetd restarted).
    fn session(&mut self) -> Option<&Vnetd> {
        if self.vnetd.is_none() && std::time::Instant::now() >= self.retry_at {
            self.retry_at = std::time::Instant::now() + std::time::Duration::from_secs(1);
            if let Ok(v) = Vnetd::connect(&self.socket) {
                if self.watch(v.fd(), T_VNETD, libc::EPOLLIN as u32).is_ok() {
                    // Each listener again, with its socket taken from the
                    // program again (one it no longer holds is gone).
                    let mut gone = Vec::new();
                    for (addr, inode) in &self.by_addr {
                        let Some(l) = self.listeners.get(inode) else { continue };
                        match notify::retake(l.held.0, l.held.1, *inode) {
                            Some(fd) => drop(v.send_with(&ToVnetd::Listen { addr: *addr }, fd.as_raw_fd())),
                            None => gone.push(*inode),
                        }
                    }
                    for inode in gone {
                        self.listener_gone(inode, "the program no longer holds it");
                    }
                    eprintln!("vtoe: vnetd is back: connections are offloaded again");
                    self.vnetd = Some(v);
                }
            }
        }
        self.vnetd.as_ref()
    }

    fn on_connect(&mut self, n: Notif) {
        if self.session().is_none() {
            return notify::proceed(&self.notif, n.id);
        }
        let (fd, addr, len) = (n.args[0] as RawFd, n.args[1], n.args[2]);
        let dst = (16..=128)
            .contains(&len)
            .then(|| notify::read_mem(n.tid, addr, 16).ok())
            .flatten()
            .and_then(|b| sock::parse_sockaddr_in(&b));
        let Some(dst) = dst.filter(|d| is_overlay_unicast(*d.ip()) && d.port() != 0) else {
            return notify::proceed(&self.notif, n.id);
        };
        let Some(guest) = notify::take_fd(&self.notif, &n, fd) else { return notify::proceed(&self.notif, n.id) };
        let g = guest.as_raw_fd();
        // Only a socket never connected: a second connect on one in
        // progress is the kernel's to answer (EALREADY, EISCONN).
        if !sock::is_tcp4(g) || sock::tcp_state(g) != Some(sock::TCP_CLOSE) {
            return notify::proceed(&self.notif, n.id);
        }
        let bound = sock::local_addr(g).unwrap_or(SocketAddrV4::new(std::net::Ipv4Addr::UNSPECIFIED, 0));
        if !bound.ip().is_unspecified() && !is_overlay_unicast(*bound.ip()) {
            return notify::proceed(&self.notif, n.id); // bound to loopback: the kernel's to refuse
        }
        let (src, reservation) = if bound.port() != 0 {
            (bound, None) // the program's own socket holds its port
        } else {
            let ip = if bound.ip().is_unspecified() { sock::source_toward(dst).ok() } else { Some(*bound.ip()) };
            match ip.filter(|ip| is_overlay_unicast(*ip)).map(sock::reserve_port) {
                Some(Ok((res, port))) => (SocketAddrV4::new(ip.expect("some"), port), Some(res)),
                _ => return notify::proceed(&self.notif, n.id),
            }
        };
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1).max(1);
        let Some(v) = &self.vnetd else { return notify::proceed(&self.notif, n.id) };
        if v.send(&ToVnetd::Connect { id, src, dst }).is_err() {
            return notify::proceed(&self.notif, n.id);
        }
        let nonblocking = sock::nonblocking(g);
        self.connects.insert(id, Pending { notif: n, fd, guest, reservation, nonblocking, dst });
    }

    fn on_connected(&mut self, id: u32, cookie: u64, sock_fd: Option<OwnedFd>) {
        let Some(p) = self.connects.remove(&id) else { return };
        let Some(shadow) = sock_fd else { return notify::proceed(&self.notif, p.notif.id) };
        let s = shadow.as_raw_fd();
        self.defaults.copy(p.guest.as_raw_fd(), s);
        let _ = sock::set_nonblocking(s, p.nonblocking);
        let cloexec = notify::is_cloexec(p.notif.tid, p.fd);
        // The program's socket is replaced where it is, then its call ends.
        if notify::add_fd(&self.notif, p.notif.id, s, Some(p.fd), cloexec).is_err() {
            return; // the call was interrupted: the shadow connection closes
        }
        notify::reply(&self.notif, p.notif.id, if p.nonblocking { Err(libc::EINPROGRESS) } else { Ok(0) });
        self.tally.offloaded_out += 1;
        self.say(|| format!("connect to {} offloaded", p.dst));
        self.reservations.insert(cookie, p.reservation.unwrap_or(p.guest));
    }

    // ---- listen ----

    fn on_listen(&mut self, n: Notif) {
        if self.session().is_none() {
            return notify::proceed(&self.notif, n.id);
        }
        let Some(dup) = notify::take_fd(&self.notif, &n, n.args[0] as RawFd) else { return notify::proceed(&self.notif, n.id) };
        let d = dup.as_raw_fd();
        let Some(v6) = sock::tcp_takes_v4(d) else { return notify::proceed(&self.notif, n.id) };
        // SAFETY: listen(2) on the runner's copy of the program's socket.
        if unsafe { libc::listen(d, n.args[1] as i32) } < 0 {
            notify::reply(&self.notif, n.id, Err(errno()));
            return;
        }
        // An IPv6 listener on an IPv6 address takes no IPv4 connection.
        let (Ok(addr), Some(inode)) = (sock::local_addr(d), sock::inode(d)) else {
            notify::reply(&self.notif, n.id, Ok(0));
            return;
        };
        // A loopback listener is the guest's own business.
        if addr.ip().is_loopback() {
            notify::reply(&self.notif, n.id, Ok(0));
            return;
        }
        let held = (notify::tgid(n.tid).unwrap_or(n.tid), n.args[0] as RawFd);
        let l = self.listeners.entry(inode).or_insert_with(|| Listener { addr, v6, ready: VecDeque::new(), wakes: HashMap::new(), held });
        l.addr = addr;
        l.held = held;
        self.by_addr.insert(addr, inode);
        let Some(v) = &self.vnetd else { return notify::proceed(&self.notif, n.id) };
        // The listening socket goes along: vnetd checks it.
        if v.send_with(&ToVnetd::Listen { addr }, d).is_err() {
            notify::reply(&self.notif, n.id, Ok(0));
            return;
        }
        // listen returns once vnetd has the listener: a peer told "ready"
        // next is then offloaded.
        self.listens.entry(addr).or_default().push(n.id);
    }

    // ---- accept ----

    fn on_accept(&mut self, n: Notif) {
        let Some(dup) = notify::take_fd(&self.notif, &n, n.args[0] as RawFd) else { return notify::proceed(&self.notif, n.id) };
        let Some(inode) = sock::inode(dup.as_raw_fd()).filter(|i| self.listeners.contains_key(i)) else {
            return notify::proceed(&self.notif, n.id);
        };
        self.serve_accept(Parked { notif: n, inode, dup });
    }

    /// Answers an accept on a registered listener, or parks it.
    fn serve_accept(&mut self, p: Parked) {
        let flags = if p.notif.call == Call::Accept4 { p.notif.args[3] as i32 } else { 0 };
        loop {
            let Some(l) = self.listeners.get_mut(&p.inode) else { return notify::proceed(&self.notif, p.notif.id) };
            if let Some(r) = l.ready.pop_front() {
                match self.deliver(&p.notif, r, flags) {
                    Ok(()) => return,
                    Err(r) => {
                        // The call is gone (a signal): the connection waits for the next.
                        if let Some(l) = self.listeners.get_mut(&p.inode) {
                            l.ready.push_front(r);
                        }
                        return;
                    }
                }
            }
            match sock::accept_now(p.dup.as_raw_fd()) {
                Ok(Some((s, addr))) => {
                    if let Some((token, _)) = sock::v4_of(&addr).and_then(|peer| l.wakes.remove(&peer)) {
                        self.waking.remove(&token);
                        continue; // a wake connection: it did its job
                    }
                    if let Err(r) = self.deliver(&p.notif, Ready { sock: s, addr }, flags) {
                        if let Some(l) = self.listeners.get_mut(&p.inode) {
                            l.ready.push_front(r);
                        }
                        self.wake(p.inode);
                    }
                    return;
                }
                Ok(None) if sock::nonblocking(p.dup.as_raw_fd()) => {
                    notify::reply(&self.notif, p.notif.id, Err(libc::EAGAIN));
                    return;
                }
                Ok(None) => {
                    let token = self.next_token;
                    self.next_token += 1;
                    if self.watch(p.dup.as_raw_fd(), token, (libc::EPOLLIN | libc::EPOLLONESHOT) as u32).is_err() {
                        return notify::proceed(&self.notif, p.notif.id);
                    }
                    self.parked.insert(token, p);
                    return;
                }
                Err(e) => {
                    notify::reply(&self.notif, p.notif.id, Err(e.raw_os_error().unwrap_or(libc::EIO)));
                    return;
                }
            }
        }
    }

    /// Gives a connection to an accept: its address where the call points,
    /// then the socket as the call's result.
    fn deliver(&mut self, n: &Notif, r: Ready, flags: i32) -> Result<(), Ready> {
        let s = r.sock.as_raw_fd();
        let _ = sock::set_nonblocking(s, flags & libc::SOCK_NONBLOCK != 0);
        let (addr, lenp) = (n.args[1], n.args[2]);
        if addr != 0 && lenp != 0 {
            let len = notify::read_mem(n.tid, lenp, 4).ok().map(|b| u32::from_ne_bytes(b[..4].try_into().expect("4")));
            let Some(len) = len else {
                notify::reply(&self.notif, n.id, Err(libc::EFAULT));
                return Ok(());
            };
            let wrote = notify::write_mem(n.tid, addr, &r.addr[..(len as usize).min(r.addr.len())])
                .and_then(|_| notify::write_mem(n.tid, lenp, &(r.addr.len() as u32).to_ne_bytes()));
            if wrote.is_err() {
                notify::reply(&self.notif, n.id, Err(libc::EFAULT));
                return Ok(());
            }
        }
        match notify::add_fd(&self.notif, n.id, s, None, flags & libc::SOCK_CLOEXEC != 0) {
            Ok(_) => Ok(()),
            Err(_) => Err(r),
        }
    }

    /// Makes the listener readable for a program that waits in poll, epoll
    /// or select: a connection from the guest's own loopback.
    fn wake(&mut self, inode: u64) {
        let Some(l) = self.listeners.get(&inode) else { return };
        let addr = l.addr;
        match sock::wake(addr) {
            Ok((s, port)) => {
                let from = SocketAddrV4::new(if addr.ip().is_unspecified() { std::net::Ipv4Addr::LOCALHOST } else { *addr.ip() }, port);
                let token = self.next_token;
                self.next_token += 1;
                let _ = self.watch(s.as_raw_fd(), token, (libc::EPOLLOUT | libc::EPOLLONESHOT) as u32);
                self.waking.insert(token, inode);
                if let Some(l) = self.listeners.get_mut(&inode) {
                    l.wakes.insert(from, (token, s));
                }
            }
            Err(e) => self.listener_gone(inode, &e.to_string()),
        }
    }

    /// The program's listener no longer listens: its offloaded connections
    /// are reset, as a closed listener's queue is, and vnetd forgets it.
    fn listener_gone(&mut self, inode: u64, why: &str) {
        let Some(l) = self.listeners.remove(&inode) else { return };
        if !l.ready.is_empty() {
            self.say(|| format!("listener {} gone ({why}): {} waiting connection(s) reset", l.addr, l.ready.len()));
        }
        for r in &l.ready {
            let lg = libc::linger { l_onoff: 1, l_linger: 0 };
            // SAFETY: SO_LINGER with a linger struct: close sends a reset.
            unsafe {
                libc::setsockopt(r.sock.as_raw_fd(), libc::SOL_SOCKET, libc::SO_LINGER, (&lg as *const libc::linger).cast(), 8)
            };
        }
        for (token, _) in l.wakes.values() {
            self.waking.remove(token);
        }
        if self.by_addr.get(&l.addr) == Some(&inode) {
            self.by_addr.remove(&l.addr);
            if let Some(v) = &self.vnetd {
                let _ = v.send(&ToVnetd::Unlisten { addr: l.addr });
            }
        }
    }

    fn on_token(&mut self, token: u64) {
        if let Some(p) = self.parked.remove(&token) {
            self.unwatch(p.dup.as_raw_fd());
            if notify::valid(&self.notif, p.notif.id) {
                self.serve_accept(p);
            }
            return;
        }
        if let Some(inode) = self.waking.remove(&token) {
            // A wake connection finished connecting, or failed: the
            // listener is gone.
            let Some(l) = self.listeners.get(&inode) else { return };
            let failed = l.wakes.values().find(|(t, _)| *t == token).map(|(_, s)| {
                self.unwatch(s.as_raw_fd());
                sock::int_opt(s.as_raw_fd(), libc::SOL_SOCKET, libc::SO_ERROR).unwrap_or(0)
            });
            if let Some(e) = failed.filter(|&e| e != 0) {
                self.listener_gone(inode, &std::io::Error::from_raw_os_error(e).to_string());
            }
        }
    }

    // ---- ioctl ----

    fn on_ioctl(&mut self, n: Notif) {
        let Some(dup) = notify::take_fd(&self.notif, &n, n.args[0] as RawFd) else { return notify::proceed(&self.notif, n.id) };
        let d = dup.as_raw_fd();
        let foreign = sock::inode(d).is_some() && sock::netns_cookie(d).is_some() && sock::netns_cookie(d) != self.own_netns;
        if !foreign {
            return notify::proceed(&self.notif, n.id);
        }
        notify::reply(&self.notif, n.id, Err(libc::EPERM));
        self.tally.ioctl_refused += 1;
        if let Some(v) = &self.vnetd {
            let _ = v.send(&ToVnetd::RefusedIoctl);
        }
    }

    // ---- vnetd ----

    fn on_vnetd(&mut self) {
        let Some(v) = &self.vnetd else { return };
        let got = v.recv();
        match got {
            Ok(Some((m, fd))) => self.on_message(m, fd),
            Ok(None) | Err(_) => {
                if let Err(e) = &got {
                    eprintln!("vtoe: {e:#}");
                }
                eprintln!("vtoe: vnetd closed the session: connections are not offloaded until it is back");
                let fd = v.fd();
                self.unwatch(fd);
                self.vnetd = None;
                for (_, p) in self.connects.drain() {
                    notify::proceed(&self.notif, p.notif.id);
                }
                for (_, ids) in self.listens.drain() {
                    for id in ids {
                        notify::reply(&self.notif, id, Ok(0));
                    }
                }
            }
        }
    }

    fn on_message(&mut self, m: FromVnetd, fd: Option<OwnedFd>) {
        match m {
            FromVnetd::Connected { id, cookie, .. } => self.on_connected(id, cookie, fd),
            FromVnetd::Fallback { id, reason } => {
                if let Some(p) = self.connects.remove(&id) {
                    self.tally.not_offloaded += 1;
                    self.say(|| format!("connect to {} not offloaded: {}", p.dst, reason.name()));
                    notify::proceed(&self.notif, p.notif.id);
                }
            }
            FromVnetd::Failed { id, errno, reason } => {
                if let Some(p) = self.connects.remove(&id) {
                    self.tally.refused += 1;
                    self.say(|| format!("connect to {} refused: {} ({})", p.dst, std::io::Error::from_raw_os_error(errno), reason.name()));
                    notify::reply(&self.notif, p.notif.id, Err(errno));
                }
            }
            FromVnetd::Listening { addr } => {
                for id in self.listens.remove(&addr).unwrap_or_default() {
                    notify::reply(&self.notif, id, Ok(0));
                }
            }
            FromVnetd::NotListening { addr, why } => {
                // The listen stands, for the guest kernel's connections only:
                // its accepts are the kernel's again.
                self.tally.listeners_refused += 1;
                self.say(|| format!("listener {addr} not registered by vnetd: {} (it takes plain connections only)", why.name()));
                for id in self.listens.remove(&addr).unwrap_or_default() {
                    notify::reply(&self.notif, id, Ok(0));
                }
                if let Some(inode) = self.by_addr.remove(&addr) {
                    self.listeners.remove(&inode);
                }
            }
            FromVnetd::Incoming { listener, peer, local, .. } => {
                if !is_overlay_unicast(*local.ip()) || !is_overlay_unicast(*peer.ip()) {
                    // Never from or to a loopback (or other such) address.
                    self.tally.incoming_refused += 1;
                    self.say(|| format!("an offloaded connection {peer} -> {local} refused: not a unicast address"));
                    return;
                }
                let (Some(sock), Some(&inode)) = (fd, self.by_addr.get(&listener)) else {
                    if let Some(v) = &self.vnetd {
                        let _ = v.send(&ToVnetd::Unlisten { addr: listener });
                    }
                    return;
                };
                let Some(l) = self.listeners.get_mut(&inode) else { return };
                let addr = if l.v6 { sock::sockaddr6_bytes(peer).to_vec() } else { sock::sockaddr_bytes(peer).to_vec() };
                l.ready.push_back(Ready { sock, addr });
                self.tally.offloaded_in += 1;
                self.say(|| format!("offloaded connection from {peer} to {listener}"));
                // A blocking accept waiting for it gets it now; else wake the program.
                if let Some(token) = self.parked.iter().find(|(_, p)| p.inode == inode).map(|(t, _)| *t) {
                    let p = self.parked.remove(&token).expect("found");
                    self.unwatch(p.dup.as_raw_fd());
                    if notify::valid(&self.notif, p.notif.id) {
                        return self.serve_accept(p);
                    }
                }
                self.wake(inode);
            }
            FromVnetd::Closed { cookie } => {
                self.reservations.remove(&cookie);
            }
            FromVnetd::Welcome { .. } | FromVnetd::NotGuest => {}
        }
    }
}
