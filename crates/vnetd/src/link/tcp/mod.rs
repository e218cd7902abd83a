//! TCP links: frames over a TCP connection between two vnetd, for networks
//! where UDP does not pass. Each frame is sent as a 4-byte big-endian length
//! and the frame.
//!
//! **Who may connect.** A connection carries frames only after the key
//! handshake of `vnet_core::linkauth`: both ends prove they hold the link's
//! key. A process at the peer's address without the key gets nothing and
//! never replaces the live connection.
//!
//! **Who does what.** Connecting (with exponential backoff) and the
//! handshakes run on control threads: one connector per link and the
//! acceptor's handshake threads. Once authenticated, the connection is
//! non-blocking and belongs to the datapath: the dispatcher thread that owns
//! the link reads it from its epoll set (frames are routed like any link's),
//! and any dispatcher appends frames to the link's send buffer, written out
//! in one `write` per pass. The link's event fd tells the owning dispatcher
//! when the connection changed or the buffer waits for the socket.
//!
//! **Both sides connect.** If both connections come up, both sides keep the
//! one initiated by the peer with the lower address, so they always agree;
//! an authenticated connection from the peer replaces an older one of the
//! peer's (it restarted).
//!
//! **Bounded.** Frames sent while the link is down wait in the send buffer,
//! at most `TX_BUDGET` bytes; what does not fit is dropped and counted. A
//! peer that stops reading is cut off after `USER_TIMEOUT`
//! (`TCP_USER_TIMEOUT`), a silent one by keepalive.
//!
//! This module knows nothing of the topology or the dispatcher: the links
//! in force are asked for through `LinkEnv::links_now` (the acceptor), and
//! the dispatcher reads a link's connection through its `LinkSource`.
//! `TcpTransport` is the link the forwarder sees; `Kind` makes them.

//!
//! The rooms: `conn.rs` (a link's connection: connecting, the handshake,
//! the send buffer), `stream.rs` (what the owning dispatcher reads),
//! `accept.rs` (the daemon's listener).

mod accept;
mod conn;
mod stream;

pub use accept::TcpAcceptor;
pub use conn::{State, TcpLink, HANDSHAKE_TIMEOUT, MAX_TCP_FRAME, TX_BUDGET, USER_TIMEOUT};

use super::{CarrierKey, DemuxKey, LinkEnv, LinkKey, LinkKind, LinkSource, LinkSpec, Made, Segments, Sent, Transport, TxCtx, TxQueue, SEG_PARTS};
use crate::settings::Settings;
use crate::stats::DropReason;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use stream::StreamSource;
use vnet_core::command::LinkProto;
use vnet_core::offload::{Pieces, VnetHdr};

pub const WORD: &str = "tcp";

pub struct Kind;

impl LinkKind for Kind {
    fn word(&self) -> &'static str {
        WORD
    }

    fn takes(&self, proto: &LinkProto) -> bool {
        matches!(proto, LinkProto::Tcp { .. })
    }

    fn make(&self, spec: &LinkSpec, settings: &Settings, env: &dyn LinkEnv) -> Result<Made, String> {
        let LinkProto::Tcp { key } = spec.proto else { return Err("not a tcp link".into()) };
        let ip = spec.ip.ok_or("this link needs a remote address")?;
        let key = LinkKey::load(&settings.link_key_dir, key)?;
        // One acceptor for every TCP link, started with the first.
        let links = env.links_now();
        let (port, bind) = (settings.default_link_port, settings.udp_bind);
        env.shared(WORD, &mut || {
            // On --udp-bind's address if given; else one dual-stack listener
            // (IPv4 peers arrive as mapped addresses).
            let a = match bind {
                Some(ip) => TcpAcceptor::start(SocketAddr::new(ip, port), links.clone()),
                None => TcpAcceptor::start(SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), port), links.clone())
                    .or_else(|_| TcpAcceptor::start(SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), port), links.clone())),
            }
            .map_err(|e| format!("{e:#}"))?;
            Ok(Arc::new(a) as Arc<dyn std::any::Any + Send + Sync>)
        })?;
        let remote = SocketAddr::new(ip, spec.port.unwrap_or(settings.default_link_port));
        let link = TcpLink::new(remote, key)?;
        let mtu = spec.mtu.or_else(|| env.path_mtu(remote)).unwrap_or(1500);
        let t = TcpTransport { source: StreamSource::new(link.clone()), link };
        Ok(Made { transport: Arc::new(t), remote: Some(remote), name: spec.name.clone().unwrap_or_else(|| ip.to_string()), mtu, overhead: if ip.is_ipv4() { 40 } else { 60 } })
    }

    /// Where TCP links are accepted (`SHOW`'s listen addresses).
    fn listens(&self, env: &dyn LinkEnv) -> Vec<String> {
        env.shared_now(WORD).and_then(|a| a.downcast::<TcpAcceptor>().ok()).map(|a| vec![format!("tcp:{}", a.local)]).unwrap_or_default()
    }
}

/// A TCP link as the forwarder sees it: frames go into the link's send
/// buffer and are written out at the end of the dispatcher's pass.
pub struct TcpTransport {
    pub link: Arc<TcpLink>,
    /// What its dispatcher reads: one for the link's life, so that a partial
    /// frame survives every snapshot.
    source: Arc<StreamSource>,
}

impl Transport for TcpTransport {
    fn kind(&self) -> &'static str {
        WORD
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn demux(&self) -> Vec<(CarrierKey, DemuxKey)> {
        vec![(CarrierKey::Stream, DemuxKey::Peer(self.link.remote.ip().to_canonical()))]
    }

    fn identify(&self, id: u32) {
        self.source.id.store(id, Relaxed);
    }

    fn source(&self) -> Option<Arc<dyn LinkSource>> {
        Some(self.source.clone())
    }

    fn in_force(&self) {
        self.link.start();
    }

    fn send(&self, q: &mut TxQueue, cx: &TxCtx, _vnet: &VnetHdr, frame: Pieces) -> Sent {
        if frame.len() > MAX_TCP_FRAME {
            return Sent::dropped(DropReason::Oversize, 1);
        }
        if !self.link.enqueue(frame.parts()) {
            return Sent::dropped(DropReason::QueueFull, 1);
        }
        q.buffered(cx.slot);
        Sent::later()
    }

    fn send_segments(&self, q: &mut TxQueue, cx: &TxCtx, segs: &Segments) -> Sent {
        let mut out = Sent::later();
        let mut parts = [&[][..]; SEG_PARTS];
        for k in 0..segs.len() {
            let n = segs.parts(k, &mut parts);
            if !self.link.enqueue(&parts[..n]) {
                out.add(Sent::dropped(DropReason::QueueFull, 1));
            }
        }
        q.buffered(cx.slot);
        out
    }

    fn write_out(&self) -> (usize, usize) {
        let w = self.link.write_out();
        (w.frames, w.bytes)
    }

    fn describe(&self) -> String {
        let (state, since) = self.link.state();
        format!(
            " state={} since={:.1}s connects={} auth_failures={}",
            state.name(),
            since.as_secs_f64(),
            self.link.connects.load(Relaxed),
            self.link.auth_failures.load(Relaxed)
        )
    }

    fn teardown(&self) -> usize {
        self.link.stop()
    }
}
