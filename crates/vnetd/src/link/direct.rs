//! Direct links: frames raw onto a host device's LAN, through a packet
//! socket (the papers' direct send and receive). Only on devices the
//! administrator allowed (`--allow-direct`). The kernel segments super-frames
//! and finishes checksums, so frames go as they are, offload metadata and all.

use super::{sent_now, Rx, Segments, Sent, Transport, TxCtx, TxQueue, SEG_PARTS};
use crate::sys::netdev::send_vnet;
use crate::sys::packet::PacketPort;
use crate::stats::DropReason;
use std::os::fd::AsRawFd;
use vnet_core::offload::{Pieces, VnetHdr};

pub struct DirectLink {
    port: PacketPort,
    device: String,
}

impl DirectLink {
    pub fn bind(device: &str) -> anyhow::Result<DirectLink> {
        Ok(DirectLink { port: PacketPort::bind(device)?, device: device.to_string() })
    }
}

impl Transport for DirectLink {
    fn kind(&self) -> &'static str {
        "direct"
    }

    fn rx(&self) -> Rx<'_> {
        Rx::Device(&self.port)
    }

    fn takes_offloads(&self) -> bool {
        true
    }

    fn send(&self, _q: &mut TxQueue, cx: &TxCtx, vnet: &VnetHdr, frame: Pieces) -> Sent {
        if !vnet.is_gso() && frame.len() > cx.max_frame {
            return Sent::dropped(DropReason::Oversize, 1);
        }
        sent_now(send_vnet(self.port.as_raw_fd(), vnet, frame.parts()).map(|_| ()), 1, frame.len())
    }

    fn send_segments(&self, _q: &mut TxQueue, _cx: &TxCtx, segs: &Segments) -> Sent {
        // Not reached: a direct link takes super-frames whole. Should a
        // caller cut one anyway, send the segments as plain frames.
        let mut out = Sent::default();
        let mut parts = [&[][..]; SEG_PARTS];
        for k in 0..segs.len() {
            let n = segs.parts(k, &mut parts);
            let r = send_vnet(self.port.as_raw_fd(), &VnetHdr::default(), &parts[..n]).map(|_| ());
            out.add(sent_now(r, 1, segs.plan.frame_len(k)));
        }
        out
    }

    fn describe(&self) -> String {
        format!(" device={}", self.device)
    }
}
