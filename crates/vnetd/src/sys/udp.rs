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
use std::os::fd::{AsFd, AsRawFd, RawFd};
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
/// Datagrams queued for one `sendmmsg` (in GSO runs, as few messages).
pub const TX_BATCH: usize = 256;

const UDP_SEGMENT: libc::c_int = 103;
const UDP_GRO: libc::c_int = 104;

pub struct UdpEndpoint {
    socket: UdpSocket,
    local: SocketAddr,
    gro: bool,
    /// Offered to the next vnetd (`keep`): the port is never left unbound.
    _offer: Option<super::keep::Offer>,
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
    ///
    /// A group on a fixed port is kept for the next vnetd (`keep`), and
    /// taken from the previous one's when it kept one of `n` sockets.
    pub fn bind_group(addr: SocketAddr, n: usize) -> Result<Vec<Arc<UdpEndpoint>>> {
        let n = n.max(1);
        let mut group = match Self::kept(addr, n) {
            Some(g) => g,
            None => Self::bind_new(addr, n)?,
        };
        if addr.port() != 0 {
            for (i, ep) in group.iter_mut().enumerate() {
                let offer = super::keep::offer(kept_name(addr, i, n), ep.socket.as_fd());
                ep._offer = Some(offer);
            }
        }
        Ok(group.into_iter().map(Arc::new).collect())
    }

    /// The previous vnetd's group on `addr`, if it kept all `n` sockets of
    /// one (any other it kept there is closed, so the port is free).
    fn kept(addr: SocketAddr, n: usize) -> Option<Vec<UdpEndpoint>> {
        let mut got = super::keep::take_all(kept_name(addr, 0, 0).trim_end_matches("0/0"));
        // By index ("<i>/<n>" ends each name).
        got.sort_by_key(|(name, _)| name.rsplit(' ').next().and_then(|x| x.split('/').next()?.parse::<usize>().ok()));
        let whole = got.len() == n && got.iter().enumerate().all(|(i, (name, _))| *name == kept_name(addr, i, n));
        if !whole {
            if !got.is_empty() {
                tracing::info!("{} kept socket(s) on {addr} are not a group of {n}: bound anew", got.len());
            }
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for (_, fd) in got {
            let socket = UdpSocket::from(fd);
            match socket.local_addr() {
                Ok(local) if local == addr => {
                    let gro = setsockopt_int(socket.as_raw_fd(), libc::IPPROTO_UDP, UDP_GRO, 1).is_ok();
                    out.push(UdpEndpoint { socket, local, gro, _offer: None });
                }
                _ => return None,
            }
        }
        Some(out)
    }

    fn bind_new(addr: SocketAddr, n: usize) -> Result<Vec<UdpEndpoint>> {
        if n <= 1 {
            return Ok(vec![Self::bind(addr)?]);
        }
        // Joining a reuse group never fails for the same user, so check
        // first that nobody holds the port.
        let probe = Self::bind(addr)?;
        let addr = probe.local_addr();
        drop(probe);
        (0..n).map(|_| Self::bind_with(addr, true)).collect()
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
        Ok(UdpEndpoint { socket, local, gro, _offer: None })
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

    /// Sends every queued datagram of `tx`, then empties it; returns how
    /// many messages held more than one datagram (GSO). One
    /// `sendmmsg` for the lot, in which each run of datagrams to one peer of
    /// one size (the last may be shorter) is one message with `UDP_SEGMENT`
    /// (GSO): the kernel routes and builds the run once, and a receiver
    /// with `UDP_GRO` takes it in one read. Reports each datagram through
    /// `done(link_slot, len, error)`, and each link whose GSO the kernel
    /// refused (its run then went datagram by datagram) through `refused`.
    pub fn flush(&self, tx: &mut TxBatch, mut done: impl FnMut(u32, usize, Option<io::Error>), mut refused: impl FnMut(u32)) -> u64 {
        let msgs = tx.plan();
        let mut gso_messages = 0;
        let mut start = 0;
        while start < msgs {
            let n = msgs - start;
            // SAFETY: headers point at live buffers owned by `tx`.
            let sent = unsafe { libc::sendmmsg(self.socket.as_raw_fd(), tx.msgs[start..].as_mut_ptr(), n as u32, 0) };
            if sent <= 0 {
                let e = io::Error::last_os_error();
                let code = e.raw_os_error().unwrap_or(libc::EIO);
                if matches!(code, libc::EAGAIN | libc::ENOBUFS) {
                    // The socket is full: the rest would fail the same way.
                    for m in start..msgs {
                        tx.each(m, |link, len| done(link, len, Some(io::Error::from_raw_os_error(code))));
                    }
                    break;
                }
                let (first, last) = tx.runs[start];
                if last - first > 1 && gso_refusal(&e) {
                    // GSO refused toward this peer (no checksum offload on
                    // the way, or segments above the path MTU): its run
                    // goes datagram by datagram.
                    refused(tx.links[first]);
                    for i in first..last {
                        let (off, len) = tx.spans[i];
                        let iov = [IoSlice::new(&tx.data[off..off + len])];
                        let r = self.send_iov(&iov, tx.to[i], None);
                        done(tx.links[i], len, r.err());
                    }
                } else {
                    // The first message failed: report it and go on with the rest.
                    tx.each(start, |link, len| done(link, len, Some(io::Error::from_raw_os_error(code))));
                }
                start += 1;
                continue;
            }
            for m in start..start + sent as usize {
                if tx.runs[m].1 - tx.runs[m].0 > 1 {
                    gso_messages += 1;
                }
                tx.each(m, |link, len| done(link, len, None));
            }
            start += sent as usize;
        }
        tx.clear();
        gso_messages
    }
}

/// Whether a failed GSO send means the kernel will not segment toward that
/// peer (no checksum offload on the way, or segments above the path MTU):
/// its datagrams must go one by one.
pub fn gso_refusal(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EIO) | Some(libc::EINVAL))
}

/// The name socket `i` of a group of `n` on `addr` is kept under
/// (`keep`): no ':' (systemd's descriptor names may have none).
fn kept_name(addr: SocketAddr, i: usize, n: usize) -> String {
    format!("udp {} {} {i}/{n}", addr.ip().to_string().replace(':', "-"), addr.port())
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

/// Datagrams waiting for one `sendmmsg`, copied one after another into one
/// arena (so a run of them to one peer is one contiguous buffer, sent as
/// one GSO message).
pub struct TxBatch {
    /// The arena: `data[..used]` holds the queued datagrams; what lies
    /// beyond was written before (the arena never shrinks, so that a
    /// datagram can be made in it without clearing its room first).
    data: Vec<u8>,
    used: usize,
    spans: Vec<(usize, usize)>,
    to: Vec<SocketAddr>,
    addrs: Vec<SockAddr>,
    links: Vec<u32>,
    /// Whether each datagram may share a GSO message with its neighbours.
    gso: Vec<bool>,
    /// The messages `plan` made: the datagrams `runs[m].0..runs[m].1`.
    runs: Vec<(usize, usize)>,
    iov: Vec<libc::iovec>,
    msgs: Vec<libc::mmsghdr>,
    cmsgs: Vec<cmsg::Space>,
    count: usize,
}

// SAFETY: the raw pointers inside are only set and used within flush.
unsafe impl Send for TxBatch {}

/// Most bytes of datagrams one batch holds.
const ARENA_BYTES: usize = 4 << 20;

/// Most bytes one GSO message carries (a UDP datagram's payload limit,
/// with room for headers).
const GSO_MESSAGE_BYTES: usize = 65000;

impl Default for TxBatch {
    fn default() -> Self {
        TxBatch {
            data: Vec::with_capacity(TX_BATCH * 2048),
            used: 0,
            spans: Vec::with_capacity(TX_BATCH),
            to: Vec::with_capacity(TX_BATCH),
            addrs: Vec::with_capacity(TX_BATCH),
            links: Vec::with_capacity(TX_BATCH),
            gso: Vec::with_capacity(TX_BATCH),
            runs: Vec::with_capacity(TX_BATCH),
            // SAFETY: iovec and mmsghdr are plain data.
            iov: vec![unsafe { zeroed() }; TX_BATCH],
            msgs: vec![unsafe { zeroed() }; TX_BATCH],
            cmsgs: vec![[0; 8]; TX_BATCH],
            count: 0,
        }
    }
}

impl TxBatch {
    /// Queues a copy of the datagram made of `parts` for the link at slot
    /// `link`; `gso`: it may go in one GSO message with the datagrams
    /// queued next to it for the same peer. False when the batch is full
    /// (flush first).
    pub fn push(&mut self, parts: &[&[u8]], to: SocketAddr, link: u32, gso: bool) -> bool {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if !self.room(len) {
            return false;
        }
        let (room, mut at) = (self.reserve(len), 0);
        for p in parts {
            room[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
        self.commit(len, to, link, gso);
        true
    }

    /// Whether a datagram of up to `len` bytes fits (else flush first).
    pub fn room(&self, len: usize) -> bool {
        self.count < TX_BATCH && self.used + len <= ARENA_BYTES
    }

    /// Makes a datagram of up to `max` bytes in place: `make` writes it into
    /// the room it is given and says how long it is (0: nothing queued).
    /// The batch must have `room(max)`.
    pub fn push_with(&mut self, max: usize, to: SocketAddr, link: u32, gso: bool, make: impl FnOnce(&mut [u8]) -> usize) -> usize {
        debug_assert!(self.room(max));
        let len = make(self.reserve(max)).min(max);
        if len > 0 {
            self.commit(len, to, link, gso);
        }
        len
    }

    /// The arena's next `len` bytes, grown (once) if it is shorter.
    fn reserve(&mut self, len: usize) -> &mut [u8] {
        if self.data.len() < self.used + len {
            self.data.resize(self.used + len, 0);
        }
        &mut self.data[self.used..self.used + len]
    }

    fn commit(&mut self, len: usize, to: SocketAddr, link: u32, gso: bool) {
        self.spans.push((self.used, len));
        self.used += len;
        self.to.push(to);
        self.links.push(link);
        self.gso.push(gso);
        self.count += 1;
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    pub fn len(&self) -> usize {
        self.count
    }

    /// Groups the queued datagrams into messages and points the headers at
    /// them; how many messages. A message is a run of datagrams to one peer,
    /// of one link, all of one size but the last (which may be shorter),
    /// at most `MAX_GSO_SEGMENTS` and `GSO_MESSAGE_BYTES`: what one
    /// `UDP_SEGMENT` send makes.
    fn plan(&mut self) -> usize {
        self.runs.clear();
        self.addrs.clear();
        let mut i = 0;
        while i < self.count {
            let size = self.spans[i].1;
            let mut end = i + 1;
            let mut bytes = size;
            if self.gso[i] {
                while end < self.count
                    && end - i < MAX_GSO_SEGMENTS
                    && self.gso[end]
                    && self.to[end] == self.to[i]
                    && self.links[end] == self.links[i]
                    && self.spans[end - 1].1 == size
                    && self.spans[end].1 <= size
                    && self.spans[end].1 > 0
                    && bytes + self.spans[end].1 <= GSO_MESSAGE_BYTES
                {
                    bytes += self.spans[end].1;
                    end += 1;
                }
            }
            // The address converted once per message (or peer), not per
            // datagram.
            let addr = match self.runs.last() {
                Some(&(p, _)) if self.to[p] == self.to[i] => self.addrs[self.addrs.len() - 1].clone(),
                _ => SockAddr::from(self.to[i]),
            };
            self.runs.push((i, end));
            self.addrs.push(addr);
            i = end;
        }
        // The headers, once the vectors they point into are complete.
        for m in 0..self.runs.len() {
            let (a, b) = self.runs[m];
            let (off, size) = self.spans[a];
            let bytes: usize = self.spans[a..b].iter().map(|s| s.1).sum();
            self.iov[m] = libc::iovec { iov_base: self.data[off..].as_mut_ptr().cast(), iov_len: bytes };
            let h = &mut self.msgs[m].msg_hdr;
            h.msg_name = self.addrs[m].as_ptr() as *mut _;
            h.msg_namelen = self.addrs[m].len();
            h.msg_iov = &mut self.iov[m];
            h.msg_iovlen = 1;
            h.msg_control = std::ptr::null_mut();
            h.msg_controllen = 0;
            h.msg_flags = 0;
            if b - a > 1 {
                cmsg::put(h, &mut self.cmsgs[m], libc::SOL_UDP, UDP_SEGMENT, &(size as u16).to_ne_bytes());
            }
        }
        self.runs.len()
    }

    /// Calls `f(link, len)` for each datagram of message `m`.
    fn each(&self, m: usize, mut f: impl FnMut(u32, usize)) {
        let (a, b) = self.runs[m];
        for i in a..b {
            f(self.links[i], self.spans[i].1);
        }
    }

    fn clear(&mut self) {
        self.used = 0;
        self.spans.clear();
        self.to.clear();
        self.addrs.clear();
        self.links.clear();
        self.gso.clear();
        self.runs.clear();
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


#[cfg(test)]
mod tests {
    use super::*;

    fn datagram(n: usize, tag: u8) -> Vec<u8> {
        (0..n).map(|i| tag.wrapping_add(i as u8)).collect()
    }

    #[test]
    fn runs_to_one_peer_of_one_size_are_one_gso_message_each() {
        let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:2".parse().unwrap();
        let mut tx = TxBatch::default();
        let mut push = |len: usize, to: SocketAddr, link: u32, gso: bool| assert!(tx.push(&[&datagram(len, 0)], to, link, gso));
        // 0..3: a run of three 100-byte datagrams ending with a shorter one.
        push(100, a, 1, true);
        push(100, a, 1, true);
        push(60, a, 1, true);
        // A shorter one ended the run: this starts another.
        push(100, a, 1, true);
        // Another peer, another link, one that may not share, a bigger one.
        push(100, b, 2, true);
        push(100, b, 3, true);
        push(100, b, 3, false);
        push(100, b, 3, true);
        push(200, b, 3, true);
        assert_eq!(tx.plan(), 7);
        assert_eq!(tx.runs, vec![(0, 3), (3, 4), (4, 5), (5, 6), (6, 7), (7, 8), (8, 9)]);
        // A run stops at the kernel's 64 segments.
        let mut tx = TxBatch::default();
        for _ in 0..100 {
            assert!(tx.push(&[&datagram(64, 0)], a, 1, true));
        }
        assert_eq!(tx.plan(), 2);
        assert_eq!(tx.runs, vec![(0, 64), (64, 100)]);
    }

    #[test]
    fn every_datagram_arrives_whole_and_in_order() {
        let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
        // Room for the lot (200 datagrams wait before the first read).
        set_buffers(&Socket::from(rx.try_clone().unwrap()), 4 << 20, "test receiver");
        rx.set_read_timeout(Some(std::time::Duration::from_secs(2))).unwrap();
        let ep = UdpEndpoint::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let to = rx.local_addr().unwrap();
        let mut tx = TxBatch::default();
        let sizes: Vec<usize> = (0..200).map(|i| if i % 50 == 49 { 30 } else if i < 40 { 1400 } else { 64 }).collect();
        for (i, &n) in sizes.iter().enumerate() {
            assert!(tx.push(&[&datagram(n, i as u8)], to, 7, true));
        }
        let mut results = Vec::new();
        let gso = ep.flush(&mut tx, |link, len, err| results.push((link, len, err.is_none())), |_| panic!("GSO refused on loopback"));
        assert_eq!(results.len(), sizes.len());
        assert!(results.iter().all(|&(link, _, ok)| link == 7 && ok));
        assert!(gso > 0 && gso < 20, "{gso} GSO messages");
        assert!(tx.is_empty());
        let mut buf = [0u8; 2048];
        for (i, &n) in sizes.iter().enumerate() {
            let got = rx.recv(&mut buf).unwrap();
            assert_eq!(&buf[..got], &datagram(n, i as u8)[..], "datagram {i}");
        }
    }

    #[test]
    fn a_run_the_kernel_refuses_to_segment_goes_datagram_by_datagram() {
        let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
        rx.set_read_timeout(Some(std::time::Duration::from_secs(2))).unwrap();
        let ep = UdpEndpoint::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        // Without UDP checksums the kernel refuses GSO (EINVAL), as it does
        // toward a path whose MTU is below the segments.
        setsockopt_int(ep.as_raw_fd(), libc::SOL_SOCKET, libc::SO_NO_CHECK, 1).unwrap();
        let to = rx.local_addr().unwrap();
        let mut tx = TxBatch::default();
        for i in 0..10u8 {
            assert!(tx.push(&[&datagram(300, i)], to, 3, true));
        }
        let (mut results, mut refused) = (Vec::new(), Vec::new());
        let gso = ep.flush(&mut tx, |link, len, err| results.push((link, len, err.is_none())), |link| refused.push(link));
        assert_eq!(refused, vec![3]);
        assert_eq!(results, vec![(3, 300, true); 10]);
        assert_eq!(gso, 0);
        let mut buf = [0u8; 2048];
        for i in 0..10u8 {
            let got = rx.recv(&mut buf).unwrap();
            assert_eq!(&buf[..got], &datagram(300, i)[..]);
        }
    }
}
