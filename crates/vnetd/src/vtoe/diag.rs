//! What the kernel knows of the shadow connections vnetd handed over
//! (sock_diag, as `ss` asks): their TCP state and byte counts, and the
//! moment each one is gone (the SKNLGRP_INET_TCP_DESTROY group). vnetd
//! keeps no descriptor of a socket it handed to a guest (the guest's close
//! must close it), so this is how it follows them.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const NETLINK_SOCK_DIAG: i32 = 4;
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const SOCK_DESTROY: u16 = 21;
const INET_DIAG_INFO: u16 = 2;
/// Multicast group of TCP sockets' destruction (1 << (SKNLGRP_INET_TCP_DESTROY - 1)).
const GROUP_TCP_DESTROY: u32 = 1;
const NLMSG_HDR: usize = 16;
const NLMSG_DONE: u16 = 3;
const NLMSG_ERROR: u16 = 2;
/// struct inet_diag_msg.
const DIAG_MSG: usize = 72;
/// Offsets in struct tcp_info.
const TCPI_RTT: usize = 68;
const TCPI_BYTES_ACKED: usize = 120;
const TCPI_BYTES_RECEIVED: usize = 128;

/// One TCP socket as sock_diag reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TcpDiag {
    /// The kernel's TCP state (1 established, 10 listen, ...).
    pub state: u8,
    pub bytes_acked: u64,
    pub bytes_received: u64,
    pub rtt_us: u32,
    /// Its local port.
    pub port: u16,
}

/// The kernel's name of a TCP state.
pub fn state_name(s: u8) -> &'static str {
    match s {
        1 => "established",
        2 => "syn_sent",
        3 => "syn_recv",
        4 => "fin_wait1",
        5 => "fin_wait2",
        6 => "time_wait",
        7 => "close",
        8 => "close_wait",
        9 => "last_ack",
        10 => "listen",
        11 => "closing",
        _ => "unknown",
    }
}

fn diag_socket(groups: u32) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the descriptor is owned at once.
    let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, NETLINK_SOCK_DIAG) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just made and is ours.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_nl is plain old data; zeroed is a valid value.
    let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    sa.nl_family = libc::AF_NETLINK as u16;
    sa.nl_groups = groups;
    // SAFETY: bind with a sockaddr_nl of its size.
    let r = unsafe { libc::bind(fd.as_raw_fd(), (&sa as *const libc::sockaddr_nl).cast(), std::mem::size_of::<libc::sockaddr_nl>() as u32) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// The cookie of an inet_diag_msg, and the message's TCP info if it has any.
fn parse_diag(msg: &[u8]) -> Option<(u64, TcpDiag)> {
    if msg.len() < DIAG_MSG {
        return None;
    }
    let lo = u32::from_ne_bytes(msg[44..48].try_into().ok()?) as u64;
    let hi = u32::from_ne_bytes(msg[48..52].try_into().ok()?) as u64;
    let mut d = TcpDiag { state: msg[1], port: u16::from_be_bytes([msg[4], msg[5]]), ..TcpDiag::default() };
    let mut at = DIAG_MSG;
    while at + 4 <= msg.len() {
        let len = u16::from_ne_bytes([msg[at], msg[at + 1]]) as usize;
        let kind = u16::from_ne_bytes([msg[at + 2], msg[at + 3]]);
        if len < 4 || at + len > msg.len() {
            break;
        }
        let v = &msg[at + 4..at + len];
        if kind == INET_DIAG_INFO && v.len() >= TCPI_BYTES_RECEIVED + 8 {
            let u64_at = |o: usize| u64::from_ne_bytes(v[o..o + 8].try_into().expect("8"));
            d.bytes_acked = u64_at(TCPI_BYTES_ACKED);
            d.bytes_received = u64_at(TCPI_BYTES_RECEIVED);
            d.rtt_us = u32::from_ne_bytes(v[TCPI_RTT..TCPI_RTT + 4].try_into().expect("4"));
        }
        at += len.next_multiple_of(4);
    }
    Some((lo | hi << 32, d))
}

/// A sock_diag request: nlmsghdr + inet_diag_req_v2 (family, protocol,
/// ext, pad, states, sockid) for IPv4 TCP sockets in every state.
fn request(kind: u16, flags: u16) -> Vec<u8> {
    let mut req = vec![0u8; NLMSG_HDR + 56];
    let len = req.len() as u32;
    req[0..4].copy_from_slice(&len.to_ne_bytes());
    req[4..6].copy_from_slice(&kind.to_ne_bytes());
    req[6..8].copy_from_slice(&flags.to_ne_bytes());
    req[8..12].copy_from_slice(&1u32.to_ne_bytes());
    req[16] = libc::AF_INET as u8;
    req[17] = libc::IPPROTO_TCP as u8;
    req[20..24].copy_from_slice(&u32::MAX.to_ne_bytes());
    req
}

fn send(fd: &OwnedFd, req: &[u8]) -> io::Result<()> {
    // SAFETY: send from a buffer we own.
    if unsafe { libc::send(fd.as_raw_fd(), req.as_ptr().cast(), req.len(), 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Aborts the TCP socket with these ends and this cookie, whoever holds it
/// (SOCK_DESTROY, as `ss -K` does): its program gets ECONNABORTED, its
/// peer a reset.
pub fn destroy(cookie: u64, local: std::net::SocketAddrV4, peer: std::net::SocketAddrV4) -> io::Result<()> {
    let fd = diag_socket(0)?;
    let mut req = request(SOCK_DESTROY, (libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16);
    let id = NLMSG_HDR + 8;
    req[id..id + 2].copy_from_slice(&local.port().to_be_bytes());
    req[id + 2..id + 4].copy_from_slice(&peer.port().to_be_bytes());
    req[id + 4..id + 8].copy_from_slice(&local.ip().octets());
    req[id + 20..id + 24].copy_from_slice(&peer.ip().octets());
    req[id + 40..id + 44].copy_from_slice(&(cookie as u32).to_ne_bytes());
    req[id + 44..id + 48].copy_from_slice(&((cookie >> 32) as u32).to_ne_bytes());
    send(&fd, &req)?;
    let mut buf = [0u8; 512];
    // SAFETY: recv into a buffer we own.
    let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n < (NLMSG_HDR + 4) as isize {
        return Err(io::Error::last_os_error());
    }
    match i32::from_ne_bytes(buf[16..20].try_into().expect("4")) {
        0 => Ok(()),
        code => Err(io::Error::from_raw_os_error(-code)),
    }
}

/// Every IPv4 TCP socket of this network namespace, by cookie.
pub fn tcp_sockets() -> io::Result<HashMap<u64, TcpDiag>> {
    let fd = diag_socket(0)?;
    let mut req = request(SOCK_DIAG_BY_FAMILY, (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16);
    req[18] = 1 << (INET_DIAG_INFO - 1);
    let mut out = HashMap::new();
    dump(&fd, &req, |cookie, d| {
        out.insert(cookie, d);
    })?;
    Ok(out)
}

/// A sock_diag socket of the calling thread's network namespace (open it in
/// a guest's, for `listening`).
pub fn open() -> io::Result<OwnedFd> {
    diag_socket(0)
}

/// The cookies of the TCP sockets of `family` (AF_INET, AF_INET6) listening
/// on `port` in the namespace of `fd` (a socket from `open`). The kernel
/// filters the listeners by port itself.
pub fn listening(fd: &OwnedFd, family: u8, port: u16) -> io::Result<Vec<u64>> {
    let mut req = request(SOCK_DIAG_BY_FAMILY, (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16);
    req[16] = family;
    req[20..24].copy_from_slice(&(1u32 << 10).to_ne_bytes()); // TCPF_LISTEN
    req[NLMSG_HDR + 8..NLMSG_HDR + 10].copy_from_slice(&port.to_be_bytes());
    let mut out = Vec::new();
    dump(fd, &req, |cookie, d| {
        if d.state == 10 && d.port == port {
            out.push(cookie);
        }
    })?;
    Ok(out)
}

/// Sends a dump request and calls `each` for every socket it reports.
fn dump(fd: &OwnedFd, req: &[u8], mut each: impl FnMut(u64, TcpDiag)) -> io::Result<()> {
    send(fd, req)?;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // SAFETY: recv into a buffer we own.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(io::Error::last_os_error());
        }
        let mut at = 0;
        let n = n as usize;
        while at + NLMSG_HDR <= n {
            let len = u32::from_ne_bytes(buf[at..at + 4].try_into().expect("4")) as usize;
            let kind = u16::from_ne_bytes(buf[at + 4..at + 6].try_into().expect("2"));
            if len < NLMSG_HDR || at + len > n {
                return Ok(());
            }
            match kind {
                NLMSG_DONE => return Ok(()),
                NLMSG_ERROR => {
                    let code = i32::from_ne_bytes(buf[at + 16..at + 20].try_into().unwrap_or([0; 4]));
                    return Err(io::Error::from_raw_os_error(-code));
                }
                SOCK_DIAG_BY_FAMILY => {
                    if let Some((cookie, d)) = parse_diag(&buf[at + NLMSG_HDR..at + len]) {
                        each(cookie, d);
                    }
                }
                _ => {}
            }
            at += len.next_multiple_of(4);
        }
    }
}

/// Calls `gone(cookie)` for every TCP socket of this namespace destroyed
/// from now on; returns only if the subscription fails.
pub fn watch_destroyed(mut gone: impl FnMut(u64)) -> io::Error {
    let fd = match diag_socket(GROUP_TCP_DESTROY) {
        Ok(fd) => fd,
        Err(e) => return e,
    };
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // SAFETY: recv into a buffer we own.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                // Too many at once: some were missed; the table's next
                // sweep (tcp_sockets) finds them gone.
                Some(libc::ENOBUFS) => {
                    gone(0);
                    continue;
                }
                _ => return e,
            }
        }
        let n = n as usize;
        let mut at = 0;
        while at + NLMSG_HDR <= n {
            let len = u32::from_ne_bytes(buf[at..at + 4].try_into().expect("4")) as usize;
            let kind = u16::from_ne_bytes(buf[at + 4..at + 6].try_into().expect("2"));
            if len < NLMSG_HDR || at + len > n {
                break;
            }
            if kind == SOCK_DIAG_BY_FAMILY {
                if let Some((cookie, _)) = parse_diag(&buf[at + NLMSG_HDR..at + len]) {
                    gone(cookie);
                }
            }
            at += len.next_multiple_of(4);
        }
    }
}

/// `getsockopt(SOL_SOCKET, SO_COOKIE)`: the kernel's id of a socket, the one
/// sock_diag reports.
pub fn socket_cookie(fd: std::os::fd::RawFd) -> io::Result<u64> {
    let mut v: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt into a u64 of the length given.
    let r = unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_COOKIE, (&mut v as *mut u64).cast(), &mut len) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_destroyed_socket_is_aborted_and_its_peer_reset() {
        use std::io::Read;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut s, _) = l.accept().unwrap();
        let v4 = |a: std::net::SocketAddr| match a {
            std::net::SocketAddr::V4(a) => a,
            _ => unreachable!(),
        };
        let cookie = socket_cookie(c.as_raw_fd()).unwrap();
        // A wrong cookie destroys nothing.
        assert!(destroy(cookie ^ 1, v4(c.local_addr().unwrap()), v4(c.peer_addr().unwrap())).is_err());
        destroy(cookie, v4(c.local_addr().unwrap()), v4(c.peer_addr().unwrap())).unwrap();
        let mut b = [0u8; 1];
        assert_eq!((&c).read(&mut b).unwrap_err().raw_os_error(), Some(libc::ECONNABORTED));
        assert!(matches!(s.read(&mut b), Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset));
    }

    #[test]
    fn a_connected_socket_is_found_by_its_cookie_with_its_bytes() {
        use std::io::{Read, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut s, _) = l.accept().unwrap();
        c.write_all(&[7u8; 5000]).unwrap();
        let mut got = vec![0u8; 5000];
        s.read_exact(&mut got).unwrap();
        let cookie = socket_cookie(c.as_raw_fd()).unwrap();
        // The receiver's acknowledgement may be delayed a little.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        let d = loop {
            let d = tcp_sockets().unwrap().get(&cookie).copied().expect("the socket is listed under its cookie");
            if d.bytes_acked >= 5000 || std::time::Instant::now() > deadline {
                break d;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        };
        assert_eq!(state_name(d.state), "established");
        // The kernel counts sequence space: the SYN may be in it.
        assert!((5000..=5001).contains(&d.bytes_acked), "{}", d.bytes_acked);
        let all = tcp_sockets().unwrap();
        let d = all[&socket_cookie(s.as_raw_fd()).unwrap()];
        assert!((5000..=5001).contains(&d.bytes_received), "{}", d.bytes_received);
    }

    #[test]
    fn a_listener_is_found_by_port_while_it_listens() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let cookie = socket_cookie(l.as_raw_fd()).unwrap();
        let fd = open().unwrap();
        assert!(listening(&fd, libc::AF_INET as u8, port).unwrap().contains(&cookie));
        // Not under another port, nor another family.
        assert!(!listening(&fd, libc::AF_INET as u8, port ^ 1).unwrap().contains(&cookie));
        assert!(!listening(&fd, libc::AF_INET6 as u8, port).unwrap().contains(&cookie));
        // A connection to it is not a listener.
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let c_cookie = socket_cookie(c.as_raw_fd()).unwrap();
        let (_s, _) = l.accept().unwrap();
        assert!(!listening(&fd, libc::AF_INET as u8, port).unwrap().contains(&c_cookie));
        // Closed: gone.
        drop(l);
        assert!(!listening(&fd, libc::AF_INET as u8, port).unwrap().contains(&cookie));
    }
}
