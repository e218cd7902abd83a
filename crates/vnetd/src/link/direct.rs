//! Direct links: frames raw onto a host device's LAN, through a packet
//! socket (the papers' direct send and receive). Only on devices the
//! administrator allowed (`--allow-direct`). The kernel segments super-frames
//! and finishes checksums, so frames go as they are, offload metadata and all.

use super::{sent_now, CarrierKey, DemuxKey, DeviceName, LinkEnv, LinkKind, LinkSource, LinkSpec, Made, RxCx, Segments, Sent, Transport, TxCtx, TxQueue, SEG_PARTS};
use crate::port::Slot;
use crate::settings::Settings;
use crate::stats::DropReason;
use crate::sys::netdev::{device_mtu, send_vnet};
use crate::sys::packet::PacketPort;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::Arc;
use vnet_core::command::LinkProto;
use vnet_core::offload::{Pieces, VnetHdr, VNET_HDR_LEN};

pub const WORD: &str = "direct";

pub struct Kind;

impl LinkKind for Kind {
    fn word(&self) -> &'static str {
        WORD
    }

    fn takes(&self, proto: &LinkProto) -> bool {
        matches!(proto, LinkProto::Direct { .. })
    }

    fn make(&self, spec: &LinkSpec, settings: &Settings, _env: &dyn LinkEnv) -> Result<Made, String> {
        let LinkProto::Direct { device } = spec.proto else { return Err("not a direct link".into()) };
        allowed(settings, device)?;
        let dev_mtu = device_mtu(device).map_err(|e| format!("no device {device} on this host ({e})"))?;
        let link = DirectLink::bind(device).map_err(|e| format!("{e:#}"))?;
        // A direct link's MTU is its device's; frames carry only Ethernet.
        Ok(Made { transport: Arc::new(link), remote: None, name: spec.name.clone().unwrap_or_else(|| device.clone()), mtu: spec.mtu.unwrap_or(dev_mtu), overhead: -14 })
    }
}

/// Direct links put frames raw onto a host device: only onto the devices the
/// administrator named with `--allow-direct`.
pub fn allowed(settings: &Settings, device: &str) -> Result<(), String> {
    if settings.direct_devices.iter().any(|d| d == device) {
        Ok(())
    } else {
        Err(format!("device {device} is not allowed for direct links (start vnetd with --allow-direct {device})"))
    }
}

/// A direct link: its device, which its dispatcher reads as its source.
pub struct DirectLink(Arc<DeviceSource>);

impl DirectLink {
    pub fn bind(device: &str) -> anyhow::Result<DirectLink> {
        Ok(DirectLink(Arc::new(DeviceSource { port: PacketPort::bind(device)?, device: device.to_string(), id: AtomicU32::new(u32::MAX) })))
    }
}

/// A direct link's device, as the dispatcher that owns the link reads it.
struct DeviceSource {
    port: PacketPort,
    device: String,
    /// The link's id once in a topology (it finds its slot by it).
    id: AtomicU32,
}

impl LinkSource for DeviceSource {
    fn watch(&self) -> Vec<(RawFd, u32)> {
        vec![(self.port.as_raw_fd(), libc::EPOLLIN as u32)]
    }

    fn owner(&self, n: usize) -> usize {
        self.id.load(Relaxed) as usize % n.max(1)
    }

    /// Takes up to `quota` frames (with their virtio-net headers).
    fn ready(&self, _i: usize, _events: u32, cx: &mut RxCx) -> usize {
        let Some(slot) = cx.links.slot_of_link(self.id.load(Relaxed)) else { return 0 };
        let mut n = 0;
        while n < cx.quota {
            match self.port.recv(cx.buf) {
                Ok(len) => {
                    n += 1;
                    let Some(vnet) = VnetHdr::parse(&cx.buf[..len]) else { continue };
                    cx.intake.port_frame(Slot::Link(slot), &mut cx.buf[VNET_HDR_LEN..len], vnet);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.raw_os_error() == Some(libc::EMSGSIZE) => {
                    if let Some((_, stats)) = cx.links.link(slot) {
                        cx.st.drop_at(Some(stats), DropReason::Oversize);
                    }
                }
                Err(e) => {
                    tracing::warn!(device = %self.device, "read from device failed: {e}");
                    break;
                }
            }
        }
        n
    }
}

impl Transport for DirectLink {
    fn kind(&self) -> &'static str {
        WORD
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn demux(&self) -> Vec<(CarrierKey, DemuxKey)> {
        DeviceName::new(&self.0.device).map(|d| vec![(CarrierKey::Device, DemuxKey::Device(d))]).unwrap_or_default()
    }

    fn identify(&self, id: u32) {
        self.0.id.store(id, Relaxed);
    }

    fn source(&self) -> Option<Arc<dyn LinkSource>> {
        Some(self.0.clone())
    }

    fn takes_offloads(&self) -> bool {
        true
    }

    fn send(&self, _q: &mut TxQueue, cx: &TxCtx, vnet: &VnetHdr, frame: Pieces) -> Sent {
        if !vnet.is_gso() && frame.len() > cx.max_frame {
            return Sent::dropped(DropReason::Oversize, 1);
        }
        sent_now(send_vnet(self.0.port.as_raw_fd(), vnet, frame.parts()).map(|_| ()), 1, frame.len())
    }

    fn send_segments(&self, _q: &mut TxQueue, _cx: &TxCtx, segs: &Segments) -> Sent {
        // Not reached: a direct link takes super-frames whole. Should a
        // caller cut one anyway, send the segments as plain frames.
        let mut out = Sent::default();
        let mut parts = [&[][..]; SEG_PARTS];
        for k in 0..segs.len() {
            let n = segs.parts(k, &mut parts);
            let r = send_vnet(self.0.port.as_raw_fd(), &VnetHdr::default(), &parts[..n]).map(|_| ());
            out.add(sent_now(r, 1, segs.plan.frame_len(k)));
        }
        out
    }

    fn describe(&self) -> String {
        format!(" device={}", self.0.device)
    }
}
