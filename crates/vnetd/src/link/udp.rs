//! The UDP link kinds (`UdpLink`): VNET/P's encapsulation (the bare frame
//! as a UDP datagram) and, with a VNI, VXLAN (RFC 7348, an 8-byte header
//! first), on vnetd's shared UDP sockets (`crate::sys::udp`). A link is just
//! a remote address (and a VNI); a received datagram is attributed to a
//! link by its sender's address.

use super::{sent_now, Rx, Segments, Sent, Transport, TxCtx, TxQueue, SEG_PARTS};
use crate::stats::DropReason;
use crate::sys::udp::{gso_refusal, UdpEndpoint, MAX_GSO_SEGMENTS};
use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use vnet_core::offload::{Pieces, VnetHdr, MAX_PIECES};
use vnet_core::wire::{vxlan_header, VXLAN_HDR_LEN};

/// A UDP link (VNET/P) or, with a VNI, a VXLAN link: a remote address on
/// one of the daemon's shared UDP sockets.
pub struct UdpLink {
    ep: Arc<UdpEndpoint>,
    remote: SocketAddr,
    vni: Option<u32>,
}

/// Largest payload of one UDP GSO call we build (the kernel's limit is a
/// 64 KiB datagram).
const MAX_GSO_BYTES: usize = 65000;
/// Slices in one UDP GSO call's iovec.
const GSO_IOV: usize = 4 * MAX_GSO_SEGMENTS;

impl UdpLink {
    pub fn new(ep: Arc<UdpEndpoint>, remote: SocketAddr, vni: Option<u32>) -> UdpLink {
        UdpLink { ep, remote, vni }
    }

    fn prefix(&self) -> ([u8; VXLAN_HDR_LEN], usize) {
        match self.vni {
            Some(v) => (vxlan_header(v), VXLAN_HDR_LEN),
            None => ([0; VXLAN_HDR_LEN], 0),
        }
    }

    /// Sends segments `from..to` one datagram each; how many went.
    fn send_each(&self, pre: &[u8], segs: &Segments, from: usize, to: usize) -> (usize, io::Result<()>) {
        let mut parts = [&[][..]; SEG_PARTS];
        for k in from..to {
            let n = segs.parts(k, &mut parts);
            let mut iov = [IoSlice::new(&[]); SEG_PARTS + 1];
            iov[0] = IoSlice::new(pre);
            for (v, p) in iov[1..].iter_mut().zip(&parts[..n]) {
                *v = IoSlice::new(p);
            }
            if let Err(e) = self.ep.send_iov(&iov[..n + 1], self.remote, None) {
                return (k - from, Err(e));
            }
        }
        (to - from, Ok(()))
    }
}

impl Transport for UdpLink {
    fn kind(&self) -> &'static str {
        if self.vni.is_some() {
            "vxlan"
        } else {
            "udp"
        }
    }

    fn rx(&self) -> Rx<'_> {
        Rx::Shared { vni: self.vni }
    }

    fn send(&self, q: &mut TxQueue, cx: &TxCtx, _vnet: &VnetHdr, frame: Pieces) -> Sent {
        let (pre, plen) = self.prefix();
        if frame.len() + plen > self.ep.max_payload() {
            return Sent::dropped(DropReason::Oversize, 1);
        }
        if frame.len() > cx.max_frame {
            cx.offload.fragmented.fetch_add(1, Relaxed);
        }
        let n = frame.parts().len().min(MAX_PIECES + 1);
        let mut parts = [&[][..]; MAX_PIECES + 2];
        parts[0] = &pre[..plen];
        parts[1..=n].copy_from_slice(&frame.parts()[..n]);
        // Frames that fit the underlay may share a GSO message with their
        // neighbours; bigger ones go as IP fragments, one datagram each.
        let gso = frame.len() <= cx.max_frame && cx.gso.ok();
        q.push(&self.ep, &parts[..=n], self.remote, cx.slot, gso);
        Sent::later()
    }

    /// One UDP GSO call per up to 64 segments; segment by segment while the
    /// kernel refuses GSO toward this peer. The segments go by reference (an
    /// iovec of their headers and slices of the frame, which may be the
    /// guest's buffers: no copy), so they cannot wait in the pass's batch,
    /// which copies what it holds; they leave at once, after what the batch
    /// held (a flow keeps its order).
    fn send_segments(&self, q: &mut TxQueue, cx: &TxCtx, segs: &Segments) -> Sent {
        // Frames queued before this one leave first: a flow's order holds.
        q.flush();
        let (pre, plen) = self.prefix();
        let pre = &pre[..plen];
        let seg_size = plen + segs.seg_size;
        let per_call = (MAX_GSO_BYTES / seg_size).clamp(1, MAX_GSO_SEGMENTS);
        let n = segs.len();
        let mut out = Sent::default();
        let mut i = 0;
        while i < n {
            let mut end = (i + per_call).min(n);
            let (went, r) = if end - i == 1 || !cx.gso.ok() {
                self.send_each(pre, segs, i, end)
            } else {
                // Each segment is its prefix, header and payload slices; a
                // call ends early when the iovec is full (a frame in many
                // pieces).
                let mut iov = [IoSlice::new(&[]); GSO_IOV];
                let mut parts = [&[][..]; SEG_PARTS];
                let mut m = 0;
                for k in i..end {
                    if m + 1 + SEG_PARTS > GSO_IOV {
                        end = k;
                        break;
                    }
                    if !pre.is_empty() {
                        iov[m] = IoSlice::new(pre);
                        m += 1;
                    }
                    let n = segs.parts(k, &mut parts);
                    for p in &parts[..n] {
                        iov[m] = IoSlice::new(p);
                        m += 1;
                    }
                }
                match self.ep.send_iov(&iov[..m], self.remote, Some(seg_size as u16)) {
                    Ok(_) => {
                        cx.offload.gso_sends.fetch_add(1, Relaxed);
                        (end - i, Ok(()))
                    }
                    Err(e) if gso_refusal(&e) => {
                        tracing::info!(remote = %self.remote, "UDP GSO refused ({e}); sending segments one by one for a while");
                        cx.gso.refused();
                        self.send_each(pre, segs, i, end)
                    }
                    Err(e) => (0, Err(e)),
                }
            };
            out.add(Sent::now(went, segs.bytes(i, i + went)));
            if let Err(e) = r {
                out.add(sent_now(Err(e), end - i - went, 0));
            }
            i = end;
        }
        out
    }

    fn describe(&self) -> String {
        self.vni.map_or(String::new(), |v| format!(" vni={v}"))
    }
}


#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::GsoState;
    use crate::stats::OffloadCounters;
    use std::net::UdpSocket;
    use vnet_core::offload::{plan_tcp_segments, SegmentPlan};

    /// An Ethernet + IPv4 + TCP frame with `payload` bytes of `tag`.
    fn tcp_frame(payload: usize, tag: u8) -> Vec<u8> {
        let mut f = vec![0u8; 14 + 20 + 20];
        f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
        f[14] = 0x45;
        f[16..18].copy_from_slice(&((40 + payload) as u16).to_be_bytes());
        f[22] = 64;
        f[23] = 6;
        f[26..30].copy_from_slice(&[10, 0, 0, 1]);
        f[30..34].copy_from_slice(&[10, 0, 0, 2]);
        f[46] = 0x50; // data offset 5
        f[47] = 0x18; // PSH, ACK
        f.extend(std::iter::repeat_n(tag, payload));
        f
    }

    #[test]
    fn a_super_frames_segments_leave_after_the_frames_queued_before_it() {
        let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
        rx.set_read_timeout(Some(std::time::Duration::from_secs(2))).unwrap();
        let ep = Arc::new(UdpEndpoint::bind("127.0.0.1:0".parse().unwrap()).unwrap());
        let link = UdpLink::new(ep, rx.local_addr().unwrap(), None);
        let (gso, offload) = (GsoState::default(), OffloadCounters::default());
        let cx = TxCtx { slot: 0, max_frame: 1500, gso: &gso, offload: &offload };
        let mut q = TxQueue::default();
        // Three small frames of the flow, queued for the pass's batch.
        let small: Vec<Vec<u8>> = (1..=3).map(|i| tcp_frame(10, i)).collect();
        for f in &small {
            let parts = [&f[..]];
            assert_eq!(link.send(&mut q, &cx, &VnetHdr::default(), Pieces::new(&parts)).frames, 0);
        }
        // Then a super-frame of the same flow, cut into three segments.
        let big = tcp_frame(3000, 9);
        let mut plan = SegmentPlan::default();
        plan_tcp_segments(&big, 1000, &mut plan).unwrap();
        let parts = [&big[..]];
        let segs = Segments { plan: &plan, frame: Pieces::new(&parts), seg_size: 54 + 1000 };
        assert_eq!(link.send_segments(&mut q, &cx, &segs).frames, 3);
        q.flush();
        let mut buf = [0u8; 2048];
        let mut got = Vec::new();
        for _ in 0..6 {
            let n = rx.recv(&mut buf).unwrap();
            got.push((n, buf[n - 1]));
        }
        assert_eq!(got, vec![(64, 1), (64, 2), (64, 3), (1054, 9), (1054, 9), (1054, 9)]);
    }
}
