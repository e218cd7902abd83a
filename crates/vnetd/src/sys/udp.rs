//! vnetd's UDP sockets (VNET/P's port and VXLAN's), each one shared by
//! every link of its kind: binding them (one per dispatcher on one port),
//! and moving datagrams in batches.
//!
//! Speed comes from the kernel's UDP offloads, with the wire unchanged (one
//! Ethernet frame per datagram): `UDP_GRO` hands us runs of same-sized
//! datagrams in one buffer, `UDP_SEGMENT` (GSO) sends many equal-sized
//! datagrams in one call, and `recvmmsg`/`sendmmsg` batch the rest.

use anyhow::{Context, Result};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use std::io::{self, IoSlice};
use std::mem::{size_of, zeroed};
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use super::netdev::setsockopt_int;
use vnet_sys::cmsg;

/// Largest UDP payload over IPv4 (65535 - 20 IP - 8 UDP): the largest frame
/// a UDP link can carry. Larger frames are dropped as oversize.
pub const MAX_UDP_PAYLOAD_V4: usize = 65507;
/// Over IPv6 (without jumbograms) the UDP header is the only overhead.
pub const MAX_UDP_PAYLOAD_V6: usize = 65527;
/// Most datagrams one GSO send may make (the kernel's UDP_MAX_SEGMENTS).
pub const MAX_GSO_SEGMENTS: usize = 64;
/// Receive buffers per `recvmmsg`.
pub const RX_BATCH: usize = 16;
/// Room for one received GRO run (at most 64 KiB of payload).
const RX_BUF: usize = 65536;
/// Datagrams per `sendmmsg`.
pub const TX_BATCH: usize = 64;

const UDP_SEGMENT: libc::c_int = 103;
const UDP_GRO: libc::c_int = 104;

pub struct UdpEndpoint {
    socket: UdpSocket,
    local: SocketAddr,
    gro: bool,
}

/// Socket buffer size asked for: big buffers absorb bursts between
/// dispatcher passes.
const SOCKET_BUFFER: usize = 16 << 20;

impl UdpEndpoint {
    pub fn bind(addr: SocketAddr) -> Result<UdpEndpoint> {
        Self::bind_with(addr, false)
    }

    /// `n` sockets on one port (`SO_REUSEPORT` when `n` > 1), one per
    /// dispatcher: the kernel spreads received datagrams over them by flow
    /// (the peer's address and port), so each peer's frames stay in order
    /// on one thread. The first one also sends. A port another socket
    /// already holds is refused, as for one socket.
    pub fn bind_group(addr: SocketAddr, n: usize) -> Result<Vec<Arc<UdpEndpoint>>> {
        if n <= 1 {
            return Ok(vec![Arc::new(Self::bind(addr)?)]);
        }
        // Joining a reuse group never fails for the same user, so check
        // first that nobody holds the port.
        let probe = Self::bind(addr)?;
        let addr = probe.local_addr();
        drop(probe);
        (0..n).map(|_| Self::bind_with(addr, true).map(Arc::new)).collect()
    }

    fn bind_with(addr: SocketAddr, reuse_port: bool) -> Result<UdpEndpoint> {
        let domain = if addr.is_ipv4() { Domain::IPV4 } else { Domain::IPV6 };
        let sock = Socket::new(domain, Type::DGRAM.nonblocking().cloexec(), Some(Protocol::UDP))
            .context("cannot create UDP socket")?;
        if reuse_port {
            sock.set_reuse_port(true).context("SO_REUSEPORT")?;
        }
        set_buffers(&sock, SOCKET_BUFFER, &addr.to_string());
        if addr.is_ipv4() {
            // Frames bigger than the underlay's MTU are carried by IP
            // fragmentation, as VNET/P did: never set DF.
            let _ = setsockopt_int(sock.as_raw_fd(), libc::IPPROTO_IP, libc::IP_MTU_DISCOVER, libc::IP_PMTUDISC_DONT);
        } else {
            let _ = sock.set_only_v6(true);
            let _ = setsockopt_int(sock.as_raw_fd(), libc::IPPROTO_IPV6, libc::IPV6_MTU_DISCOVER, libc::IP_PMTUDISC_DONT);
        }
        let gro = setsockopt_int(sock.as_raw_fd(), libc::IPPROTO_UDP, UDP_GRO, 1).is_ok();
        sock.bind(&addr.into()).map_err(|e| {
            let hint = if e.kind() == io::ErrorKind::AddrInUse { " (is another vnetd running? choose --udp-port)" } else { "" };
            anyhow::anyhow!("cannot bind UDP {addr}: {e}{hint}")
        })?;
        let socket: UdpSocket = sock.into();
        let local = socket.local_addr()?;
        Ok(UdpEndpoint { socket, local, gro })
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

    /// The path MTU toward `to` as the kernel knows it (the route's or the
    /// device's MTU), for sizing the frames of a link.
    pub fn path_mtu(&self, to: SocketAddr) -> Option<u32> {
        let domain = if to.is_ipv4() { Domain::IPV4 } else { Domain::IPV6 };
        let probe = Socket::new(domain, Type::DGRAM.cloexec(), Some(Protocol::UDP)).ok()?;
        probe.connect(&to.into()).ok()?;
        let (level, opt) = if to.is_ipv4() { (libc::IPPROTO_IP, libc::IP_MTU) } else { (libc::IPPROTO_IPV6, libc::IPV6_MTU) };
        let mut v: libc::c_int = 0;
        let mut len = size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt into an int.
        let r = unsafe { libc::getsockopt(probe.as_raw_fd(), level, opt, (&mut v as *mut libc::c_int).cast(), &mut len) };
        (r == 0 && v > 0).then_some(v as u32)
    }

    /// Receives up to `RX_BATCH` datagrams (or GRO runs of them) without
    /// blocking; returns how many slots of `rx` were filled.
    pub fn recv_batch(&self, rx: &mut RxBatch) -> io::Result<usize> {
        for i in 0..RX_BATCH {
            rx.iov[i] = libc::iovec { iov_base: rx.bufs[i].as_mut_ptr().cast(), iov_len: RX_BUF };
            let h = &mut rx.msgs[i].msg_hdr;
            h.msg_name = (&mut rx.addrs[i] as *mut libc::sockaddr_storage).cast();
            h.msg_namelen = size_of::<libc::sockaddr_storage>() as u32;
            h.msg_iov = &mut rx.iov[i];
            h.msg_iovlen = 1;
            h.msg_control = rx.cmsgs[i].as_mut_ptr().cast();
            h.msg_controllen = size_of::<[u64; 8]>();
            h.msg_flags = 0;
        }
        // SAFETY: every header points at live buffers owned by `rx`.
        let n = unsafe {
            libc::recvmmsg(self.socket.as_raw_fd(), rx.msgs.as_mut_ptr(), RX_BATCH as u32, libc::MSG_DONTWAIT, std::ptr::null_mut())
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let n = n as usize;
        for i in 0..n {
            rx.lens[i] = rx.msgs[i].msg_len as usize;
            rx.seg[i] = 0;
            if self.gro {
                rx.seg[i] = gro_segment_size(&rx.msgs[i].msg_hdr);
            }
            // SAFETY: the kernel filled a sockaddr of msg_namelen bytes.
            let sa = unsafe { SockAddr::new(rx.addrs[i], rx.msgs[i].msg_hdr.msg_namelen) };
            rx.from[i] = sa.as_socket();
            rx.truncated[i] = rx.msgs[i].msg_hdr.msg_flags & libc::MSG_TRUNC != 0;
        }
        Ok(n)
    }

    /// Sends the concatenation of `iov` as one datagram, or with `seg_size`
    /// as datagrams of `seg_size` bytes each (the last may be shorter) in one
    /// call: UDP GSO.
    pub fn send_iov(&self, iov: &[IoSlice], to: SocketAddr, seg_size: Option<u16>) -> io::Result<usize> {
        let addr = SockAddr::from(to);
        let mut space: cmsg::Space = [0; 8];
        // SAFETY: msghdr is plain data; zeroed is valid.
        let mut h: libc::msghdr = unsafe { zeroed() };
        h.msg_name = addr.as_ptr() as *mut _;
        h.msg_namelen = addr.len();
        h.msg_iov = iov.as_ptr() as *mut libc::iovec;
        h.msg_iovlen = iov.len();
        if let Some(seg_size) = seg_size {
            cmsg::put(&mut h, &mut space, libc::SOL_UDP, UDP_SEGMENT, &seg_size.to_ne_bytes());
        }
        // SAFETY: h points at live buffers.
        let n = unsafe { libc::sendmsg(self.socket.as_raw_fd(), &h, 0) };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }

    /// Sends every queued datagram of `tx` (`sendmmsg`), then empties it.
    /// Returns per-datagram results through `done(link_slot, len, error)`.
    pub fn flush(&self, tx: &mut TxBatch, mut done: impl FnMut(u32, usize, Option<io::Error>)) {
        let mut start = 0;
        while start < tx.count {
            let n = tx.count - start;
            for i in start..tx.count {
                let (off, len) = tx.spans[i];
                tx.iov[i] = libc::iovec { iov_base: tx.data[off..].as_mut_ptr().cast(), iov_len: len };
                let h = &mut tx.msgs[i].msg_hdr;
                h.msg_name = tx.addrs[i].as_ptr() as *mut _;
                h.msg_namelen = tx.addrs[i].len();
                h.msg_iov = &mut tx.iov[i];
                h.msg_iovlen = 1;
            }
            // SAFETY: headers point at live buffers owned by `tx`.
            let sent = unsafe { libc::sendmmsg(self.socket.as_raw_fd(), tx.msgs[start..].as_mut_ptr(), n as u32, 0) };
            if sent <= 0 {
                let e = io::Error::last_os_error();
                if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::ENOBUFS)) {
                    // The socket is full: the rest would fail the same way.
                    for i in start..tx.count {
                        done(tx.links[i], tx.spans[i].1, Some(io::Error::from_raw_os_error(e.raw_os_error().unwrap_or(libc::EAGAIN))));
                    }
                    break;
                }
                // The first datagram failed: report it and go on with the rest.
                done(tx.links[start], tx.spans[start].1, Some(e));
                start += 1;
                continue;
            }
            for i in start..start + sent as usize {
                done(tx.links[i], tx.spans[i].1, None);
            }
            start += sent as usize;
        }
        tx.clear();
    }
}

impl AsRawFd for UdpEndpoint {
    fn as_raw_fd(&self) -> RawFd {
        self.socket.as_raw_fd()
    }
}

/// Buffers for `recv_batch`, reused across calls.
pub struct RxBatch {
    bufs: Vec<Box<[u8]>>,
    iov: Vec<libc::iovec>,
    msgs: Vec<libc::mmsghdr>,
    addrs: Vec<libc::sockaddr_storage>,
    cmsgs: Vec<[u64; 8]>,
    pub lens: [usize; RX_BATCH],
    /// GRO segment size of each slot: 0 for a single datagram.
    pub seg: [usize; RX_BATCH],
    pub from: [Option<SocketAddr>; RX_BATCH],
    pub truncated: [bool; RX_BATCH],
}

// SAFETY: the raw pointers inside are only set and used within recv_batch.
unsafe impl Send for RxBatch {}

impl Default for RxBatch {
    fn default() -> Self {
        RxBatch {
            bufs: (0..RX_BATCH).map(|_| vec![0u8; RX_BUF].into_boxed_slice()).collect(),
            // SAFETY: iovec, mmsghdr and sockaddr_storage are plain data.
            iov: vec![unsafe { zeroed() }; RX_BATCH],
            msgs: vec![unsafe { zeroed() }; RX_BATCH],
            addrs: vec![unsafe { zeroed() }; RX_BATCH],
            cmsgs: vec![[0u64; 8]; RX_BATCH],
            lens: [0; RX_BATCH],
            seg: [0; RX_BATCH],
            from: [None; RX_BATCH],
            truncated: [false; RX_BATCH],
        }
    }
}

impl RxBatch {
    pub fn buf_mut(&mut self, i: usize) -> &mut [u8] {
        &mut self.bufs[i][..self.lens[i]]
    }
}

/// Datagrams waiting for one `sendmmsg`, copied into one arena.
pub struct TxBatch {
    data: Vec<u8>,
    spans: Vec<(usize, usize)>,
    addrs: Vec<SockAddr>,
    links: Vec<u32>,
    iov: Vec<libc::iovec>,
    msgs: Vec<libc::mmsghdr>,
    count: usize,
}

// SAFETY: the raw pointers inside are only set and used within flush.
unsafe impl Send for TxBatch {}

impl Default for TxBatch {
    fn default() -> Self {
        TxBatch {
            data: Vec::with_capacity(TX_BATCH * 2048),
            spans: Vec::with_capacity(TX_BATCH),
            addrs: Vec::with_capacity(TX_BATCH),
            links: Vec::with_capacity(TX_BATCH),
            // SAFETY: iovec and mmsghdr are plain data.
            iov: vec![unsafe { zeroed() }; TX_BATCH],
            msgs: vec![unsafe { zeroed() }; TX_BATCH],
            count: 0,
        }
    }
}

impl TxBatch {
    /// Queues a copy of the datagram made of `parts`; false when the batch
    /// is full (flush first).
    pub fn push(&mut self, parts: &[&[u8]], to: SocketAddr, link: u32) -> bool {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if self.count == TX_BATCH || self.data.len() + len > 4 << 20 {
            return false;
        }
        let off = self.data.len();
        for p in parts {
            self.data.extend_from_slice(p);
        }
        self.spans.push((off, len));
        self.addrs.push(SockAddr::from(to));
        self.links.push(link);
        self.count += 1;
        true
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    fn clear(&mut self) {
        self.data.clear();
        self.spans.clear();
        self.addrs.clear();
        self.links.clear();
        self.count = 0;
    }
}

fn gro_segment_size(h: &libc::msghdr) -> usize {
    // SAFETY: recvmmsg just filled h's control buffer (RxBatch's, alive).
    unsafe { cmsg::find_int(h, libc::SOL_UDP, UDP_GRO) }.map_or(0, |s| s.max(0) as usize)
}

/// Sets a socket's receive and send buffers to `size`, past the sysctl caps
/// (`SO_RCVBUFFORCE`, `SO_SNDBUFFORCE`: vnetd runs as root) where it may,
/// and logs the sizes the kernel actually gave if they are smaller.
pub fn set_buffers(sock: &Socket, size: usize, what: &str) {
    let fd = sock.as_raw_fd();
    let v = size.min(i32::MAX as usize) as libc::c_int;
    if setsockopt_int(fd, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, v).is_err() {
        let _ = sock.set_recv_buffer_size(size);
    }
    if setsockopt_int(fd, libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, v).is_err() {
        let _ = sock.set_send_buffer_size(size);
    }
    // The kernel reports twice what it grants (bookkeeping included).
    let rcv = sock.recv_buffer_size().unwrap_or(0) / 2;
    let snd = sock.send_buffer_size().unwrap_or(0) / 2;
    if rcv < size || snd < size {
        tracing::warn!("{what}: socket buffers are {rcv} (receive) and {snd} (send) bytes, not the {size} asked (without CAP_NET_ADMIN, net.core.rmem_max/wmem_max cap them)");
    } else {
        tracing::debug!("{what}: socket buffers {rcv} / {snd} bytes");
    }
}

