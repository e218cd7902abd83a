//! Plain socket questions and settings the runner needs on the program's
//! sockets (through its copies of them).

use std::io;
use std::mem::{size_of, zeroed};
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

fn getsockopt_raw(fd: RawFd, level: i32, name: i32, buf: &mut [u8]) -> io::Result<usize> {
    let mut len = buf.len() as libc::socklen_t;
    // SAFETY: getsockopt into a buffer of the length given.
    let r = unsafe { libc::getsockopt(fd, level, name, buf.as_mut_ptr().cast(), &mut len) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(len as usize)
}

fn setsockopt_raw(fd: RawFd, level: i32, name: i32, v: &[u8]) -> io::Result<()> {
    // SAFETY: setsockopt from a buffer of the length given.
    let r = unsafe { libc::setsockopt(fd, level, name, v.as_ptr().cast(), v.len() as libc::socklen_t) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

pub fn int_opt(fd: RawFd, level: i32, name: i32) -> io::Result<i32> {
    let mut b = [0u8; 4];
    getsockopt_raw(fd, level, name, &mut b)?;
    Ok(i32::from_ne_bytes(b))
}

/// An IPv4 TCP socket (what VTOE offloads)?
pub fn is_tcp4(fd: RawFd) -> bool {
    int_opt(fd, libc::SOL_SOCKET, libc::SO_DOMAIN).ok() == Some(libc::AF_INET) && is_tcp(fd)
}

fn is_tcp(fd: RawFd) -> bool {
    int_opt(fd, libc::SOL_SOCKET, libc::SO_TYPE).ok() == Some(libc::SOCK_STREAM)
        && int_opt(fd, libc::SOL_SOCKET, libc::SO_PROTOCOL).ok() == Some(libc::IPPROTO_TCP)
}

/// A TCP socket that takes IPv4 connections when listening: IPv4, or IPv6
/// without IPV6_V6ONLY (a dual-stack listener). Some(true) for the latter.
pub fn tcp_takes_v4(fd: RawFd) -> Option<bool> {
    if !is_tcp(fd) {
        return None;
    }
    match int_opt(fd, libc::SOL_SOCKET, libc::SO_DOMAIN).ok()? {
        libc::AF_INET => Some(false),
        libc::AF_INET6 if int_opt(fd, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY).ok() == Some(0) => Some(true),
        _ => None,
    }
}

/// The TCP state (TCP_INFO's first byte): 7 is CLOSE, a socket never
/// connected or listening.
pub fn tcp_state(fd: RawFd) -> Option<u8> {
    let mut b = [0u8; 8];
    getsockopt_raw(fd, libc::IPPROTO_TCP, libc::TCP_INFO, &mut b).ok().map(|_| b[0])
}
pub const TCP_CLOSE: u8 = 7;


/// A sockaddr_in as bytes, for the program's memory.
pub fn sockaddr_bytes(a: SocketAddrV4) -> [u8; 16] {
    // SAFETY: sockaddr_in is plain old data; zeroed is a valid value.
    let mut sa: libc::sockaddr_in = unsafe { zeroed() };
    sa.sin_family = libc::AF_INET as u16;
    sa.sin_port = a.port().to_be();
    sa.sin_addr.s_addr = u32::from(*a.ip()).to_be();
    // SAFETY: a sockaddr_in is 16 bytes of plain data.
    unsafe { std::mem::transmute::<libc::sockaddr_in, [u8; 16]>(sa) }
}

/// The same address as an IPv6 socket reports an IPv4 peer: mapped
/// (::ffff:a.b.c.d), as a sockaddr_in6.
pub fn sockaddr6_bytes(a: SocketAddrV4) -> [u8; 28] {
    let mut b = [0u8; 28];
    b[0..2].copy_from_slice(&(libc::AF_INET6 as u16).to_ne_bytes());
    b[2..4].copy_from_slice(&a.port().to_be_bytes());
    b[8..24].copy_from_slice(&a.ip().to_ipv6_mapped().octets());
    b
}

/// The IPv4 address in a sockaddr: an AF_INET one, or an AF_INET6 one that
/// is IPv4-mapped (or the unspecified address, as 0.0.0.0).
pub fn v4_of(bytes: &[u8]) -> Option<SocketAddrV4> {
    let family = u16::from_ne_bytes([*bytes.first()?, *bytes.get(1)?]) as i32;
    let port = u16::from_be_bytes([*bytes.get(2)?, *bytes.get(3)?]);
    match family {
        libc::AF_INET if bytes.len() >= 8 => Some(SocketAddrV4::new(Ipv4Addr::new(bytes[4], bytes[5], bytes[6], bytes[7]), port)),
        libc::AF_INET6 if bytes.len() >= 24 => {
            let ip = std::net::Ipv6Addr::from(<[u8; 16]>::try_from(&bytes[8..24]).ok()?);
            match ip.to_ipv4_mapped() {
                Some(v4) => Some(SocketAddrV4::new(v4, port)),
                None if ip.is_unspecified() => Some(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port)),
                None => None,
            }
        }
        _ => None,
    }
}

/// An IPv4 address the program passed to connect (a sockaddr_in), if it is one.
pub fn parse_sockaddr_in(bytes: &[u8]) -> Option<SocketAddrV4> {
    if bytes.len() < size_of::<libc::sockaddr_in>() || u16::from_ne_bytes([bytes[0], bytes[1]]) != libc::AF_INET as u16 {
        return None;
    }
    v4_of(bytes)
}

/// The socket's own address as the kernel reports it (sockaddr bytes).
fn raw_local(fd: RawFd) -> io::Result<Vec<u8>> {
    // SAFETY: sockaddr_storage is plain old data.
    let mut sa: libc::sockaddr_storage = unsafe { zeroed() };
    let mut len = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: getsockname into a sockaddr_storage of the length given.
    if unsafe { libc::getsockname(fd, (&mut sa as *mut libc::sockaddr_storage).cast(), &mut len) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the storage is at least `len` bytes long.
    Ok(unsafe { std::slice::from_raw_parts((&sa as *const libc::sockaddr_storage).cast::<u8>(), len as usize) }.to_vec())
}

/// The socket's own IPv4 address (see `v4_of`).
pub fn local_addr(fd: RawFd) -> io::Result<SocketAddrV4> {
    v4_of(&raw_local(fd)?).ok_or_else(|| io::Error::other("not an IPv4 address"))
}

/// The source address this namespace's kernel would use toward `dst`
/// (a UDP socket's connect sends nothing).
pub fn source_toward(dst: SocketAddrV4) -> io::Result<Ipv4Addr> {
    let u = UdpSocket::bind("0.0.0.0:0")?;
    u.connect(dst)?;
    match u.local_addr()? {
        std::net::SocketAddr::V4(a) => Ok(*a.ip()),
        _ => Err(io::Error::other("not IPv4")),
    }
}

/// A new IPv4 TCP socket of this namespace (close-on-exec, and `flags`).
fn tcp4_socket(flags: i32) -> io::Result<OwnedFd> {
    // SAFETY: a plain socket(2), owned at once.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC | flags, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is ours.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A TCP port of `ip` held for a connection the guest's kernel does not
/// carry, so it gives the port to nobody else meanwhile: a socket bound to
/// it, neither listening nor connected.
pub fn reserve_port(ip: Ipv4Addr) -> io::Result<(OwnedFd, u16)> {
    let fd = tcp4_socket(0)?;
    let sa = sockaddr_bytes(SocketAddrV4::new(ip, 0));
    // SAFETY: bind with a sockaddr_in of 16 bytes.
    if unsafe { libc::bind(fd.as_raw_fd(), sa.as_ptr().cast(), 16) } < 0 {
        return Err(io::Error::last_os_error());
    }
    let port = local_addr(fd.as_raw_fd())?.port();
    Ok((fd, port))
}

pub fn nonblocking(fd: RawFd) -> bool {
    // SAFETY: F_GETFL takes no argument.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    fl >= 0 && fl & libc::O_NONBLOCK != 0
}

pub fn set_nonblocking(fd: RawFd, on: bool) -> io::Result<()> {
    // SAFETY: F_GETFL/F_SETFL on a descriptor we hold.
    unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        if fl < 0 {
            return Err(io::Error::last_os_error());
        }
        let fl = if on { fl | libc::O_NONBLOCK } else { fl & !libc::O_NONBLOCK };
        if libc::fcntl(fd, libc::F_SETFL, fl) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The socket's inode: which socket a descriptor is, whatever its number.
pub fn inode(fd: RawFd) -> Option<u64> {
    // SAFETY: fstat into a stat we own.
    let mut st: libc::stat = unsafe { zeroed() };
    // SAFETY: as above.
    (unsafe { libc::fstat(fd, &mut st) } == 0 && st.st_mode & libc::S_IFMT == libc::S_IFSOCK).then_some(st.st_ino)
}

/// The network namespace a socket belongs to (SO_NETNS_COOKIE).
pub fn netns_cookie(fd: RawFd) -> Option<u64> {
    let mut b = [0u8; 8];
    getsockopt_raw(fd, libc::SOL_SOCKET, libc::SO_NETNS_COOKIE, &mut b).ok().map(|_| u64::from_ne_bytes(b))
}

/// The socket options a program may have set before connecting, which the
/// offloaded socket takes over: (level, name, size).
const OPTIONS: &[(i32, i32, usize)] = &[
    (libc::SOL_SOCKET, libc::SO_SNDBUF, 4),
    (libc::SOL_SOCKET, libc::SO_RCVBUF, 4),
    (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 4),
    (libc::SOL_SOCKET, libc::SO_OOBINLINE, 4),
    (libc::SOL_SOCKET, libc::SO_PRIORITY, 4),
    (libc::SOL_SOCKET, libc::SO_RCVLOWAT, 4),
    (libc::SOL_SOCKET, libc::SO_LINGER, size_of::<libc::linger>()),
    (libc::SOL_SOCKET, libc::SO_SNDTIMEO, size_of::<libc::timeval>()),
    (libc::SOL_SOCKET, libc::SO_RCVTIMEO, size_of::<libc::timeval>()),
    (libc::IPPROTO_TCP, libc::TCP_NODELAY, 4),
    (libc::IPPROTO_TCP, libc::TCP_CORK, 4),
    (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 4),
    (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 4),
    (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 4),
    (libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, 4),
    (libc::IPPROTO_TCP, libc::TCP_NOTSENT_LOWAT, 4),
    (libc::IPPROTO_TCP, libc::TCP_CONGESTION, 16),
    (libc::IPPROTO_IP, libc::IP_TOS, 4),
    (libc::IPPROTO_IP, libc::IP_TTL, 4),
];

/// What a fresh TCP socket of this namespace has, option by option.
pub struct Defaults(Vec<Option<Vec<u8>>>);

impl Defaults {
    pub fn read() -> Defaults {
        let Ok(fd) = tcp4_socket(0) else { return Defaults(vec![None; OPTIONS.len()]) };
        Defaults(OPTIONS.iter().map(|&(l, n, size)| read(fd.as_raw_fd(), l, n, size)).collect())
    }

    /// Gives `to` every option `from` (the program's socket) holds that
    /// differs from a fresh socket's, as the program set it.
    pub fn copy(&self, from: RawFd, to: RawFd) {
        for (i, &(level, name, size)) in OPTIONS.iter().enumerate() {
            let Some(v) = read(from, level, name, size) else { continue };
            if self.0[i].as_ref() == Some(&v) {
                continue;
            }
            let v = if level == libc::SOL_SOCKET && (name == libc::SO_SNDBUF || name == libc::SO_RCVBUF) {
                // The kernel reports twice what was set (its bookkeeping).
                (i32::from_ne_bytes(v[..4].try_into().expect("4")) / 2).to_ne_bytes().to_vec()
            } else if name == libc::TCP_CONGESTION && level == libc::IPPROTO_TCP {
                v.split(|&b| b == 0).next().unwrap_or(&[]).to_vec()
            } else {
                v
            };
            let _ = setsockopt_raw(to, level, name, &v);
        }
    }
}

fn read(fd: RawFd, level: i32, name: i32, size: usize) -> Option<Vec<u8>> {
    let mut b = vec![0u8; size];
    let n = getsockopt_raw(fd, level, name, &mut b).ok()?;
    b.truncate(n);
    Some(b)
}

/// Starts a connection to `to` from this namespace that only wakes a
/// listener (see the supervisor); returns it and its local port.
pub fn wake(to: SocketAddrV4) -> io::Result<(OwnedFd, u16)> {
    let to = if to.ip().is_unspecified() { SocketAddrV4::new(Ipv4Addr::LOCALHOST, to.port()) } else { to };
    let fd = tcp4_socket(libc::SOCK_NONBLOCK)?;
    let sa = sockaddr_bytes(to);
    // SAFETY: connect with a sockaddr_in of 16 bytes.
    let r = unsafe { libc::connect(fd.as_raw_fd(), sa.as_ptr().cast(), 16) };
    if r < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EINPROGRESS) {
        return Err(io::Error::last_os_error());
    }
    let port = local_addr(fd.as_raw_fd())?.port();
    Ok((fd, port))
}

/// Accepts one connection from a listener, without waiting: None if none
/// is queued (or another process took it first). Returns it with its
/// peer's address as the kernel gives it (sockaddr bytes).
pub fn accept_now(listener: RawFd) -> io::Result<Option<(OwnedFd, Vec<u8>)>> {
    let mut p = libc::pollfd { fd: listener, events: libc::POLLIN, revents: 0 };
    // SAFETY: poll on one pollfd we own, no wait.
    if unsafe { libc::poll(&mut p, 1, 0) } <= 0 {
        return Ok(None);
    }
    // SAFETY: sockaddr_storage is plain old data.
    let mut sa: libc::sockaddr_storage = unsafe { zeroed() };
    let mut len = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: accept4 into a sockaddr_storage of the length given.
    let fd = unsafe { libc::accept4(listener, (&mut sa as *mut libc::sockaddr_storage).cast(), &mut len, libc::SOCK_CLOEXEC) };
    if fd < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::EAGAIN) | Some(libc::ECONNABORTED) => Ok(None),
            _ => Err(e),
        };
    }
    // SAFETY: the storage is at least `len` bytes long.
    let addr = unsafe { std::slice::from_raw_parts((&sa as *const libc::sockaddr_storage).cast::<u8>(), len as usize) }.to_vec();
    // SAFETY: fd is a new descriptor, ours.
    Ok(Some((unsafe { OwnedFd::from_raw_fd(fd) }, addr)))
}
