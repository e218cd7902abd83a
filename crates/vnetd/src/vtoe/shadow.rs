//! Shadow connections: the host-to-host TCP connection that carries one
//! guest connection, opened with the handshake of `vnet_core::vtoe` on
//! vnetd's VTOE port. `open` is the initiator's side (the host of the guest
//! that connects), `Incoming` the responder's (the host of the guest that
//! listens). Each side reads exactly the handshake's bytes, so what follows
//! on the connection is the guests' stream, untouched.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, SocketAddrV4, TcpStream};
use std::time::{Duration, Instant};
use vnet_core::linkauth::{self, Nonce, VTOE};
use vnet_core::vtoe::{self as proto, HandshakeError, Reason, Request, Verdict};

/// How long the peer's VTOE port may take to answer: beyond it the guest's
/// connection takes the Ethernet path.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// A handshake must finish within this, as a whole: a peer that trickles
/// its messages a byte at a time holds it no longer than one that stalls.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);

fn nonce() -> io::Result<Nonce> {
    let mut n = [0u8; linkauth::NONCE_LEN];
    getrandom::getrandom(&mut n).map_err(|e| io::Error::other(format!("no randomness: {e}")))?;
    Ok(n)
}

fn v4(a: io::Result<SocketAddr>) -> io::Result<SocketAddrV4> {
    match a? {
        SocketAddr::V4(a) => Ok(a),
        SocketAddr::V6(a) => match a.ip().to_ipv4_mapped() {
            Some(ip) => Ok(SocketAddrV4::new(ip, a.port())),
            None => Err(io::Error::other("not an IPv4 connection")),
        },
    }
}

/// A connection handed to a guest: its host ends.
pub struct Shadow {
    pub stream: TcpStream,
    pub local: SocketAddrV4,
    pub peer: SocketAddrV4,
}

impl Shadow {
    fn new(stream: TcpStream) -> io::Result<Shadow> {
        Ok(Shadow { local: v4(stream.local_addr())?, peer: v4(stream.peer_addr())?, stream })
    }

    /// The socket as a program expects a fresh one: blocking, no timeouts,
    /// Nagle on (the runner then copies the program's own options).
    fn settle(&self) -> io::Result<()> {
        self.stream.set_read_timeout(None)?;
        self.stream.set_write_timeout(None)?;
        self.stream.set_nodelay(false)
    }
}

fn handshake_io(stream: &TcpStream) -> io::Result<Instant> {
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
    stream.set_nodelay(true)?;
    Ok(Instant::now() + HANDSHAKE_TIMEOUT)
}

/// Fills `buf` from the stream by `deadline` (each read waits only what is
/// left of it).
fn read_by(stream: &TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "handshake not finished in time"));
        }
        stream.set_read_timeout(Some(left))?;
        match (&*stream).read(&mut buf[got..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Initiator: opens a shadow connection to the vnetd at `peer` for `req`,
/// proving the link's `key`. Err: why the guest's connection is not
/// offloaded (the peer's own reason when it declined).
pub fn open(peer: SocketAddrV4, key: &[u8], req: &Request) -> Result<Shadow, Reason> {
    let stream = TcpStream::connect_timeout(&peer.into(), CONNECT_TIMEOUT).map_err(|e| {
        tracing::debug!(%peer, "VTOE: shadow connect failed: {e}");
        Reason::PeerUnreachable
    })?;
    let io_err = |e: io::Error| {
        tracing::info!(%peer, "VTOE: handshake failed: {e}");
        Reason::Protocol
    };
    let auth_err = |e: HandshakeError| {
        tracing::warn!(%peer, "VTOE: handshake refused: {e}");
        match e {
            HandshakeError::Auth(_) => Reason::PeerAuth,
            HandshakeError::Malformed(_) => Reason::Protocol,
        }
    };
    let deadline = handshake_io(&stream).map_err(io_err)?;
    let mut s = &stream;
    let nonce_i = nonce().map_err(io_err)?;
    s.write_all(&linkauth::hello(&VTOE, &nonce_i)).map_err(io_err)?;
    let mut ch = [0u8; linkauth::CHALLENGE_LEN];
    read_by(&stream, &mut ch, deadline).map_err(io_err)?;
    let (nonce_r, msg) = proto::request_msg(key, &nonce_i, &ch, req).map_err(auth_err)?;
    s.write_all(&msg).map_err(io_err)?;
    let mut v = [0u8; proto::VERDICT_MSG_LEN];
    read_by(&stream, &mut v, deadline).map_err(io_err)?;
    proto::read_verdict(key, &nonce_i, &nonce_r, req, &v).map_err(auth_err)??;
    let shadow = Shadow::new(stream).map_err(io_err)?;
    shadow.settle().map_err(io_err)?;
    Ok(shadow)
}

/// Responder: a connection on the VTOE port whose peer proved the key and
/// made a request, waiting for the verdict.
pub struct Incoming {
    pub stream: TcpStream,
    pub req: Request,
    nonces: (Nonce, Nonce),
}

impl Incoming {
    /// Runs the handshake up to the request, with `key`: the key of the
    /// link at the connection's source address.
    pub fn read(stream: TcpStream, key: &[u8]) -> Result<Incoming, Reason> {
        let peer = stream.peer_addr().ok();
        let io_err = |e: io::Error| {
            tracing::info!(?peer, "VTOE: incoming handshake failed: {e}");
            Reason::Protocol
        };
        let deadline = handshake_io(&stream).map_err(io_err)?;
        let mut s = &stream;
        let mut hello = [0u8; linkauth::HELLO_LEN];
        read_by(&stream, &mut hello, deadline).map_err(io_err)?;
        let nonce_i = linkauth::read_hello(&VTOE, &hello).map_err(|_| Reason::PeerAuth)?;
        let nonce_r = nonce().map_err(io_err)?;
        s.write_all(&linkauth::challenge(&VTOE, key, &nonce_i, &nonce_r)).map_err(io_err)?;
        let mut msg = [0u8; proto::REQUEST_MSG_LEN];
        read_by(&stream, &mut msg, deadline).map_err(io_err)?;
        let req = proto::read_request(key, &nonce_i, &nonce_r, &msg).map_err(|e| {
            tracing::warn!(?peer, "VTOE: incoming request refused: {e}");
            match e {
                HandshakeError::Auth(_) => Reason::PeerAuth,
                HandshakeError::Malformed(_) => Reason::Protocol,
            }
        })?;
        Ok(Incoming { stream, req, nonces: (nonce_i, nonce_r) })
    }

    /// Sends the verdict; on an accepting one, the connection is the
    /// guests' from here.
    pub fn answer(self, key: &[u8], v: Verdict) -> io::Result<Shadow> {
        let msg = proto::verdict_msg(key, &self.nonces.0, &self.nonces.1, &self.req, v);
        (&self.stream).write_all(&msg)?;
        let shadow = Shadow::new(self.stream)?;
        shadow.settle()?;
        Ok(shadow)
    }
}
