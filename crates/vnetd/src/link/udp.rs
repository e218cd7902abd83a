//! The daemon's UDP endpoint: one socket, bound to the daemon's port, shared
//! by every UDP link. A link is just a remote address; a received datagram is
//! attributed to a link by its sender's address.

use anyhow::{Context, Result};
use socket2::{Domain, Protocol, Socket, Type};
use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};

/// Largest UDP payload over IPv4 (65535 - 20 IP - 8 UDP): the largest frame
/// a UDP link can carry. Larger frames are dropped as oversize.
pub const MAX_UDP_PAYLOAD_V4: usize = 65507;
/// Over IPv6 (without jumbograms) the UDP header is the only overhead.
pub const MAX_UDP_PAYLOAD_V6: usize = 65527;

pub struct UdpEndpoint {
    socket: UdpSocket,
    local: SocketAddr,
}

impl UdpEndpoint {
    pub fn bind(addr: SocketAddr) -> Result<UdpEndpoint> {
        let domain = if addr.is_ipv4() { Domain::IPV4 } else { Domain::IPV6 };
        let sock = Socket::new(domain, Type::DGRAM.nonblocking().cloexec(), Some(Protocol::UDP))
            .context("cannot create UDP socket")?;
        // Big buffers absorb bursts between dispatcher passes.
        let _ = sock.set_recv_buffer_size(8 << 20);
        let _ = sock.set_send_buffer_size(8 << 20);
        if addr.is_ipv4() {
            // Frames bigger than the underlay's MTU are carried by IP
            // fragmentation, as VNET/P did: never set DF.
            set_pmtudisc_dont(&sock, libc::IPPROTO_IP, libc::IP_MTU_DISCOVER, libc::IP_PMTUDISC_DONT);
        } else {
            let _ = sock.set_only_v6(true);
            set_pmtudisc_dont(&sock, libc::IPPROTO_IPV6, libc::IPV6_MTU_DISCOVER, libc::IP_PMTUDISC_DONT);
        }
        sock.bind(&addr.into()).map_err(|e| {
            let hint = if e.kind() == io::ErrorKind::AddrInUse { " (is another vnetd running? choose --udp-port)" } else { "" };
            anyhow::anyhow!("cannot bind UDP {addr}: {e}{hint}")
        })?;
        let socket: UdpSocket = sock.into();
        let local = socket.local_addr()?;
        Ok(UdpEndpoint { socket, local })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    pub fn max_payload(&self) -> usize {
        if self.local.is_ipv4() {
            MAX_UDP_PAYLOAD_V4
        } else {
            MAX_UDP_PAYLOAD_V6
        }
    }

    #[inline]
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<(usize, SocketAddr)> {
        self.socket.recv_from(buf)
    }

    #[inline]
    pub fn send(&self, frame: &[u8], to: SocketAddr) -> io::Result<usize> {
        self.socket.send_to(frame, to)
    }
}

impl AsRawFd for UdpEndpoint {
    fn as_raw_fd(&self) -> RawFd {
        self.socket.as_raw_fd()
    }
}

fn set_pmtudisc_dont(sock: &Socket, level: libc::c_int, opt: libc::c_int, val: libc::c_int) {
    // SAFETY: setsockopt with an int option value.
    unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            level,
            opt,
            (&val as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}
