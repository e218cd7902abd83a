//! TAP devices through the raw `/dev/net/tun` ioctls (the interface is five
//! ioctls; a crate would add more surface than it saves).
//!
//! vnetd runs as root, and control requests name devices and namespaces on
//! the host, so what it may touch is confined here:
//! - every persistent TAP vnetd makes (`netns` and `qemu` kinds) carries
//!   vnetd's mark (its ifalias, see `rtnl`); an existing device is taken over
//!   only if it is a TAP with that mark, and only marked devices are ever
//!   un-persisted or deleted;
//! - a new TAP is made with IFF_TUN_EXCL, so it never attaches to a device
//!   that appeared in the meantime;
//! - `netns <name>` opens only a network namespace file directly in
//!   /run/netns, never through a symbolic link.

use super::{parse_received, Received, VirtualNic};
use crate::sys::netdev::{configure, ifindex, ifname_bytes, in_netns, open_netns, send_vnet, set_up, IfReqFlags};
use crate::sys::{keep, rtnl};
use anyhow::{anyhow, bail, Context, Result};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use vnet_core::offload::VnetHdr;
use vnet_core::Mac;

// The kernel's numbers, from libc (right for every architecture's ioctl
// encoding), in the types the calls below take.
const TUNSETIFF: libc::c_ulong = libc::TUNSETIFF as libc::c_ulong;
const TUNSETPERSIST: libc::c_ulong = libc::TUNSETPERSIST as libc::c_ulong;
const TUNSETOFFLOAD: libc::c_ulong = libc::TUNSETOFFLOAD as libc::c_ulong;
const IFF_TAP: libc::c_short = libc::IFF_TAP as libc::c_short;
const IFF_NO_PI: libc::c_short = libc::IFF_NO_PI as libc::c_short;
const IFF_VNET_HDR: libc::c_short = libc::IFF_VNET_HDR as libc::c_short;
/// TUNSETIFF fails (EBUSY) rather than attach to an existing device.
const IFF_TUN_EXCL: libc::c_short = libc::IFF_TUN_EXCL as u16 as libc::c_short;
const TUN_F_CSUM: libc::c_ulong = libc::TUN_F_CSUM as libc::c_ulong;
const TUN_F_TSO4: libc::c_ulong = libc::TUN_F_TSO4 as libc::c_ulong;
const TUN_F_TSO6: libc::c_ulong = libc::TUN_F_TSO6 as libc::c_ulong;
const TUN_F_TSO_ECN: libc::c_ulong = libc::TUN_F_TSO_ECN as libc::c_ulong;

/// An open TAP device. Closing it (dropping the last reference) removes the
/// device, wherever it has been moved.
///
/// Every frame read or written carries a `virtio_net_hdr` (IFF_VNET_HDR), and
/// the device offers the guest checksum and TCP segmentation offload: a
/// guest's TCP hands over 64 KiB super-frames, and vnetd may hand it merged
/// ones.
pub struct Tap {
    file: File,
    /// Made with TUNSETPERSIST: the device outlives this descriptor.
    persistent: bool,
    /// Remove a persistent device when this descriptor closes (its interface
    /// was deleted, or the request that made it failed).
    remove_on_close: AtomicBool,
    /// A persistent TAP's descriptor, offered to the next vnetd
    /// (`sys::keep`): its queue and carrier outlive this one.
    offer: Option<keep::Offer>,
}

impl Tap {
    /// Creates the TAP `name` with the given MTU and MAC, non-blocking, with
    /// virtio-net headers and offloads.
    /// The device is new: an existing device of that name is refused.
    pub fn create(name: &str, mtu: u32, mac: Mac) -> Result<Tap> {
        let tap = Tap::open(name, IFF_VNET_HDR | IFF_TUN_EXCL)?;
        tap.enable_offloads(name)?;
        configure(name, mtu, Some(mac)).with_context(|| format!("cannot configure TAP {name}"))?;
        Ok(tap)
    }

    /// Creates the TAP `name` inside the named network namespace `netns`
    /// (/run/netns/<netns>), persistent and marked as vnetd's, so that it
    /// outlives vnetd: a vnetd started again (or another host's vnetd, after
    /// a migration) attaches to it as it is, and the guest sees no change.
    /// An existing device of that name is attached to only if it is a TAP
    /// vnetd made; any other is refused and left alone.
    /// Returns the TAP and whether it already existed.
    pub fn create_in_netns(name: &str, mtu: u32, mac: Mac, netns: &str) -> Result<(Tap, bool)> {
        let ns = open_netns(netns)?;
        in_netns(&ns, netns, || -> Result<(Tap, bool)> {
            let made = Tap::create_persistent(name, mtu, mac).map_err(|e| anyhow!("{e:#} (in network namespace {netns})"))?;
            keep_neighbours_without_carrier(name);
            Ok(made)
        })
    }

    /// Creates the TAP `name` in this thread's network namespace,
    /// persistent and marked as vnetd's, or attaches to it if vnetd made it
    /// earlier (any other device of that name is refused and left alone).
    /// Until `keep`, a TAP made here goes when the descriptor closes; one
    /// taken over stays. Returns the TAP and whether it already existed.
    pub fn create_persistent(name: &str, mtu: u32, mac: Mac) -> Result<(Tap, bool)> {
        let existing = rtnl::device(name).with_context(|| format!("cannot look up {name}"))?;
        let key = format!("tap {name}");
        if let Some(d) = existing {
            if !d.is_vnetds() {
                bail!(not_vnetds(name));
            }
            // The previous vnetd's own descriptor, if it kept it for us:
            // the device never lost its reader (frames waited in its queue).
            let mut tap = match keep::take(&key).map(File::from).filter(|f| device_name(f).is_ok_and(|n| n == name)) {
                Some(file) => Tap { file, persistent: false, remove_on_close: AtomicBool::new(false), offer: None },
                None => Tap::open(name, IFF_VNET_HDR)?,
            };
            tap.enable_offloads(name)?;
            tap.persistent = true;
            tap.offer = Some(keep::offer(key, tap.file.as_fd()));
            return Ok((tap, true));
        }
        let mut tap = Tap::open(name, IFF_VNET_HDR | IFF_TUN_EXCL)?;
        tap.make_persistent(name)?;
        tap.enable_offloads(name)?;
        configure(name, mtu, Some(mac)).with_context(|| format!("cannot configure TAP {name}"))?;
        tap.offer = Some(keep::offer(key, tap.file.as_fd()));
        Ok((tap, false))
    }

    /// Makes a TAP this descriptor just created persistent and marks it as
    /// vnetd's. Until its request commits (`keep`), it goes when the
    /// descriptor closes, as it does if marking fails.
    fn make_persistent(&mut self, name: &str) -> Result<()> {
        // SAFETY: TUNSETPERSIST takes an int argument.
        if unsafe { libc::ioctl(self.file.as_raw_fd(), TUNSETPERSIST, 1 as libc::c_ulong) } < 0 {
            bail!("cannot make TAP {name} persistent: {}", io::Error::last_os_error());
        }
        self.persistent = true;
        self.remove_on_close.store(true, Relaxed);
        ifindex(name)
            .and_then(rtnl::set_mark)
            .map_err(|e| anyhow!("cannot mark TAP {name} as vnetd's (ifalias {}): {e}", rtnl::MARK))
    }

    /// Keep a persistent device when this descriptor closes.
    pub fn keep(&self) {
        self.remove_on_close.store(false, Relaxed);
    }

    /// Remove a persistent device when this descriptor closes.
    pub fn remove_on_close(&self) {
        self.remove_on_close.store(true, Relaxed);
    }

    fn enable_offloads(&self, name: &str) -> Result<()> {
        let tap = self;
        let offloads = TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN;
        // SAFETY: TUNSETOFFLOAD takes an unsigned int argument.
        if unsafe { libc::ioctl(tap.file.as_raw_fd(), TUNSETOFFLOAD, offloads) } < 0 {
            bail!("cannot enable offloads on TAP {name}: {}", io::Error::last_os_error());
        }
        if let Err(e) = ifindex(name).and_then(|i| rtnl::set_gso_max_size(i, GUEST_GSO_MAX_SIZE)) {
            tracing::debug!("cannot set gso_max_size on TAP {name}: {e}");
        }
        Ok(())
    }

    /// Creates (or, when it exists and vnetd made it, takes over) a
    /// persistent TAP for another program — QEMU — to open by name, and
    /// leaves it up with the given MTU. vnetd keeps no descriptor to it.
    /// A TAP left by an earlier vnetd (QEMU may be holding it) is taken over
    /// as it is; any other device of that name is refused and left alone.
    pub fn create_for_qemu(name: &str, mtu: u32) -> Result<QemuTap> {
        let existing = rtnl::device(name).with_context(|| format!("cannot look up {name}"))?;
        let (index, new) = match existing {
            Some(d) if d.is_vnetds() => (d.index, None),
            Some(_) => bail!(not_vnetds(name)),
            None => {
                let mut tap = Tap::open(name, IFF_TUN_EXCL)?;
                tap.make_persistent(name)?;
                (ifindex(name)?, Some(tap))
            }
        };
        // The host must not talk on the guest's wire (IPv6 autoconf etc.).
        let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{name}/disable_ipv6"), "1");
        // On failure a new TAP goes with its descriptor; one taken over stays.
        configure(name, mtu, None).and_then(|_| set_up(name)).with_context(|| format!("cannot configure TAP {name}"))?;
        if let Some(tap) = &new {
            // Our descriptor closes on return; the device stays for QEMU.
            tap.keep();
        }
        Ok(QemuTap { name: name.to_string(), index, remove_on_drop: AtomicBool::new(new.is_some()) })
    }

    fn open(name: &str, extra_flags: libc::c_short) -> Result<Tap> {
        if name.is_empty() || name.len() >= libc::IFNAMSIZ {
            bail!("'{name}' is not a device name");
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open("/dev/net/tun")
            .map_err(|e| anyhow::anyhow!("cannot create TAP {name}: cannot open /dev/net/tun: {}", explain_tun_error(e)))?;
        let mut req = IfReqFlags { name: ifname_bytes(name), flags: IFF_TAP | IFF_NO_PI | extra_flags, _pad: [0; 22] };
        // SAFETY: TUNSETIFF reads and writes an ifreq, which `req` is laid out as.
        if unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF, &mut req) } < 0 {
            let e = io::Error::last_os_error();
            let hint = match e.raw_os_error() {
                Some(libc::EBUSY) if extra_flags & IFF_TUN_EXCL != 0 => " (a device of that name exists)",
                Some(libc::EBUSY) => " (a device of that name exists and is in use)",
                Some(libc::EINVAL) => " (a device of that name exists and is not a TAP)",
                Some(libc::EPERM) => " (vnetd needs CAP_NET_ADMIN)",
                _ => "",
            };
            bail!("cannot create TAP {name}: {e}{hint}");
        }
        Ok(Tap { file, persistent: false, remove_on_close: AtomicBool::new(false), offer: None })
    }

    /// Reads one frame with its virtio-net header; `WouldBlock` when none is
    /// queued.
    #[inline]
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: buf is valid for writes of buf.len() bytes.
        let n = unsafe { libc::read(self.file.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }

}

impl Drop for Tap {
    fn drop(&mut self) {
        if self.persistent && self.remove_on_close.load(Relaxed) {
            // SAFETY: TUNSETPERSIST takes an int argument; the device goes
            // when the descriptor closes right after.
            unsafe { libc::ioctl(self.file.as_raw_fd(), TUNSETPERSIST, 0 as libc::c_ulong) };
            // Nothing for a next vnetd to take.
            if let Some(o) = &self.offer {
                o.withdraw();
            }
        }
    }
}

impl AsRawFd for Tap {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

/// The guest's neighbour entries on its TAP `name` (in this thread's
/// namespace) outlive a lost carrier. A TAP loses its carrier while no
/// descriptor holds it — while vnetd restarts — and Linux (5.16 on) then
/// forgets the device's ARP and NDP entries, so the guest would have to
/// find its peers again once vnetd is back, a second late when its first
/// try goes unanswered (measured: bench/restart.py). A kernel without the
/// settings keeps its entries anyway.
fn keep_neighbours_without_carrier(name: &str) {
    for (family, key) in [("ipv4", "arp_evict_nocarrier"), ("ipv6", "ndisc_evict_nocarrier")] {
        let path = format!("/proc/sys/net/{family}/conf/{name}/{key}");
        if let Err(e) = std::fs::write(&path, "0") {
            tracing::debug!("cannot write {path}: {e}");
        }
    }
}

/// Largest TSO super-frame a guest hands over (`gso_max_size`): small enough
/// that, cut for a link of MTU 1500 or more, its segments fit one UDP GSO
/// call (at most 64 KiB of datagrams).
pub const GUEST_GSO_MAX_SIZE: u32 = 60_000;

/// A persistent TAP vnetd made for QEMU (or took over), which it holds no
/// descriptor to. Dropping it deletes the device if `remove_on_drop` says so
/// and the device with its index still is that TAP, carrying vnetd's mark.
pub struct QemuTap {
    name: String,
    index: u32,
    /// Set when vnetd made the device in this request (it goes if the
    /// request fails); settled when a request commits: in force or deleted,
    /// removed; detached, left.
    remove_on_drop: AtomicBool,
}

impl QemuTap {
    pub fn index(&self) -> u32 {
        self.index
    }

    /// Whether the device goes when this handle is dropped.
    pub fn remove_on_drop(&self, remove: bool) {
        self.remove_on_drop.store(remove, Relaxed);
    }
}

impl Drop for QemuTap {
    fn drop(&mut self) {
        if !self.remove_on_drop.load(Relaxed) {
            return;
        }
        let name = &self.name;
        match rtnl::device_by_index(self.index) {
            Ok(Some(d)) if d.name == *name && d.is_vnetds() => {
                if let Err(e) = rtnl::delete(self.index) {
                    tracing::warn!("cannot delete TAP {name}: {e}");
                }
            }
            Ok(Some(_)) => tracing::warn!("not deleting {name}: device {} is no longer vnetd's TAP {name}", self.index),
            Ok(None) => {}
            Err(e) => tracing::warn!("cannot look up TAP {name}: {e}"),
        }
    }
}

impl Tap {
    /// Frames the guest sent that the TAP's queue had no room for (vnetd
    /// was behind): the device's `tx_dropped`, read wherever the device is
    /// now (the guest may have moved or renamed it), on a thread of our own
    /// that enters its namespace. For `STATS`; never on the frame path.
    pub fn queue_dropped(&self) -> io::Result<u64> {
        // SAFETY: TUNGETDEVNETNS takes no argument and returns a new fd.
        let ns = unsafe { libc::ioctl(self.file.as_raw_fd(), libc::TUNGETDEVNETNS as libc::c_ulong) };
        if ns < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the ioctl returned a descriptor we own.
        let ns = unsafe { OwnedFd::from_raw_fd(ns) };
        let name = device_name(&self.file)?;
        in_netns(&ns, &format!("of TAP {name}"), || rtnl::tx_dropped(ifindex(&name)?))
    }
}

/// The name of the TAP device `file` is attached to (TUNGETIFF): an error
/// if it is not a TAP's descriptor.
fn device_name(file: &File) -> io::Result<String> {
    // SAFETY: ifreq is plain data; all-zero is valid.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    // SAFETY: TUNGETIFF fills an ifreq.
    if unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNGETIFF as libc::c_ulong, &mut ifr) } < 0 {
        return Err(io::Error::last_os_error());
    }
    let name: Vec<u8> = ifr.ifr_name.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    Ok(String::from_utf8_lossy(&name).into_owned())
}

/// The refusal for an existing device that vnetd may not take over.
pub fn not_vnetds(name: &str) -> String {
    format!("a device named {name} exists and was not made by vnetd")
}

fn explain_tun_error(e: io::Error) -> io::Error {
    match e.kind() {
        io::ErrorKind::NotFound => io::Error::new(e.kind(), format!("{e} (is the tun module loaded?)")),
        io::ErrorKind::PermissionDenied => io::Error::new(e.kind(), format!("{e} (vnetd needs CAP_NET_ADMIN)")),
        _ => e,
    }
}

/// vnetd holds the TAP's file side; the network device is the guest's NIC
/// (moved into a guest namespace or container). Persistent when made in a
/// guest's namespace: it then stays when vnetd exits.
impl VirtualNic for Tap {
    #[inline]
    fn recv(&self, buf: &mut [u8]) -> io::Result<Received> {
        let n = Tap::recv(self, buf)?;
        parse_received(buf, n)
    }

    #[inline]
    fn send(&self, vnet: &VnetHdr, parts: &[&[u8]]) -> io::Result<usize> {
        send_vnet(self.as_raw_fd(), vnet, parts)
    }

    fn event_fd(&self, _queue: usize) -> RawFd {
        self.as_raw_fd()
    }

    fn in_force(&self) {
        self.keep();
    }

    fn deleted(&self, detach: bool) {
        if !detach {
            self.remove_on_close();
        }
    }

    /// The TAP's own queue: frames the guest sent while vnetd was behind.
    fn upcall_dropped(&self) -> u64 {
        self.queue_dropped().unwrap_or(0)
    }
}
