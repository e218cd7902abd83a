//! The daemon's TCP link listener: each connection's handshake runs on a
//! thread of its own, with the TCP link for the peer's address.

use super::conn::TcpLink;
use super::TcpTransport;
use crate::link::{CarrierKey, DemuxKey, LinksNow};
use anyhow::{Context, Result};
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

/// Handshakes of incoming connections in progress at once, at most.
const MAX_HANDSHAKES: usize = 32;

/// Accepts TCP link connections on the daemon's port, and runs each one's
/// handshake (on a thread of its own, at most `MAX_HANDSHAKES` at once)
/// with the TCP link for the peer's address.
pub struct TcpAcceptor {
    pub local: SocketAddr,
}

/// The TCP link to a peer's address, in force now.
fn link_for(links: &LinksNow, ip: IpAddr) -> Option<Arc<TcpLink>> {
    let now = (links.now)()?;
    let slot = now.demux(&CarrierKey::Stream, &DemuxKey::Peer(ip))?;
    let (t, _) = now.link(slot)?;
    t.as_any().downcast_ref::<TcpTransport>().map(|t| t.link.clone())
}

impl TcpAcceptor {
    pub fn start(addr: SocketAddr, links: LinksNow) -> Result<TcpAcceptor> {
        let listener = TcpListener::bind(addr).with_context(|| format!("cannot listen for TCP links on {addr}"))?;
        let local = listener.local_addr()?;
        let busy = Arc::new(AtomicUsize::new(0));
        std::thread::Builder::new().name("tcp-accept".into()).spawn(move || loop {
            let stream = match listener.accept() {
                Ok((s, _)) => s,
                Err(e) => {
                    // Out of descriptors or memory: wait rather than spin.
                    if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)) {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    continue;
                }
            };
            let Ok(peer) = stream.peer_addr() else { continue };
            let Some(link) = link_for(&links, peer.ip().to_canonical()) else {
                // Counted as datagrams from unknown senders are.
                (links.unknown)();
                tracing::debug!(%peer, "TCP connection from an address with no TCP link refused");
                continue;
            };
            if busy.fetch_add(1, Relaxed) >= MAX_HANDSHAKES {
                busy.fetch_sub(1, Relaxed);
                tracing::warn!(%peer, "too many TCP link handshakes at once; connection refused");
                continue;
            }
            let busy = busy.clone();
            let spawned = std::thread::Builder::new().name("tcp-handshake".into()).spawn(move || {
                if let Err(e) = link.accept_from(stream) {
                    tracing::warn!(%peer, "TCP link connection refused: {e}");
                }
                busy.fetch_sub(1, Relaxed);
            });
            if spawned.is_err() {
                tracing::warn!(%peer, "cannot start a handshake thread");
            }
        })?;
        Ok(TcpAcceptor { local })
    }
}
