//! TAP devices through the raw `/dev/net/tun` ioctls (the interface is five
//! ioctls; a crate would add more surface than it saves).

use anyhow::{bail, Context, Result};
use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use vnet_core::Mac;

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNSETPERSIST: libc::c_ulong = 0x4004_54cb;
const TUNSETOFFLOAD: libc::c_ulong = 0x4004_54d0;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;
const TUN_F_CSUM: libc::c_ulong = 0x01;
const TUN_F_TSO4: libc::c_ulong = 0x02;
const TUN_F_TSO6: libc::c_ulong = 0x04;
const TUN_F_TSO_ECN: libc::c_ulong = 0x08;

#[repr(C)]
struct IfReqFlags {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

#[repr(C)]
struct IfReqMtu {
    name: [u8; libc::IFNAMSIZ],
    mtu: libc::c_int,
    _pad: [u8; 20],
}

#[repr(C)]
struct IfReqHwAddr {
    name: [u8; libc::IFNAMSIZ],
    addr: libc::sockaddr,
    _pad: [u8; 8],
}

fn ifname_bytes(name: &str) -> [u8; libc::IFNAMSIZ] {
    let mut b = [0u8; libc::IFNAMSIZ];
    b[..name.len()].copy_from_slice(name.as_bytes());
    b
}

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
}

impl Tap {
    /// Creates the TAP `name` with the given MTU and MAC, non-blocking, with
    /// virtio-net headers and offloads.
    pub fn create(name: &str, mtu: u32, mac: Mac) -> Result<Tap> {
        let tap = Tap::open(name, IFF_VNET_HDR)?;
        tap.enable_offloads(name)?;
        configure(name, mtu, Some(mac)).with_context(|| format!("cannot configure TAP {name}"))?;
        Ok(tap)
    }

    /// Creates the TAP `name` inside the named network namespace `netns`
    /// (/run/netns/<netns>), persistent, so that it outlives vnetd: a vnetd
    /// started again attaches to it as it is, and the guest sees no change.
    /// Returns the TAP and whether it already existed.
    pub fn create_in_netns(name: &str, mtu: u32, mac: Mac, netns: &str) -> Result<(Tap, bool)> {
        let path = format!("/run/netns/{netns}");
        let ns = File::open(&path).map_err(|e| anyhow::anyhow!("no network namespace {netns} ({path}: {e})"))?;
        // setns changes only the calling thread: do it in one of our own.
        std::thread::scope(|scope| {
            scope
                .spawn(|| -> Result<(Tap, bool)> {
                    // SAFETY: setns on a namespace file we opened.
                    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } < 0 {
                        bail!("cannot enter network namespace {netns}: {}", io::Error::last_os_error());
                    }
                    let existed = device_exists(name);
                    let mut tap = Tap::open(name, IFF_VNET_HDR)?;
                    tap.enable_offloads(name)?;
                    if !existed {
                        // SAFETY: TUNSETPERSIST takes an int argument.
                        if unsafe { libc::ioctl(tap.file.as_raw_fd(), TUNSETPERSIST, 1 as libc::c_ulong) } < 0 {
                            bail!("cannot make TAP {name} persistent: {}", io::Error::last_os_error());
                        }
                        tap.persistent = true;
                        // Until its request commits, a new TAP goes if it fails.
                        tap.remove_on_close.store(true, Relaxed);
                        configure(name, mtu, Some(mac)).with_context(|| format!("cannot configure TAP {name}"))?;
                    }
                    tap.persistent = true;
                    Ok((tap, existed))
                })
                .join()
                .map_err(|_| anyhow::anyhow!("TAP creation thread panicked"))?
        })
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
        if let Err(e) = set_gso_max_size(name, GUEST_GSO_MAX_SIZE) {
            tracing::debug!("cannot set gso_max_size on TAP {name}: {e}");
        }
        Ok(())
    }

    /// Creates (or, when it exists, takes over) a persistent TAP for another
    /// program — QEMU — to open by name, and leaves it up with the given MTU.
    /// vnetd keeps no descriptor to it.
    /// A persistent TAP left by an earlier vnetd (QEMU may be holding it) is
    /// taken over as it is.
    pub fn create_for_qemu(name: &str, mtu: u32) -> Result<()> {
        if !is_tap(name) {
            let tap = Tap::open(name, 0)?;
            // SAFETY: TUNSETPERSIST takes an int argument.
            if unsafe { libc::ioctl(tap.file.as_raw_fd(), TUNSETPERSIST, 1 as libc::c_ulong) } < 0 {
                bail!("cannot make TAP {name} persistent: {}", io::Error::last_os_error());
            }
        }
        // The host must not talk on the guest's wire (IPv6 autoconf etc.).
        let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{name}/disable_ipv6"), "1");
        let r = configure(name, mtu, None).and_then(|_| set_up(name));
        if let Err(e) = r {
            let _ = delete_device(name);
            return Err(e.context(format!("cannot configure TAP {name}")));
        }
        Ok(())
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
                Some(libc::EBUSY) => " (a device of that name exists and is in use)",
                Some(libc::EINVAL) => " (a device of that name exists and is not a TAP)",
                Some(libc::EPERM) => " (vnetd needs CAP_NET_ADMIN)",
                _ => "",
            };
            bail!("cannot create TAP {name}: {e}{hint}");
        }
        Ok(Tap { file, persistent: false, remove_on_close: AtomicBool::new(false) })
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
        }
    }
}

impl AsRawFd for Tap {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

/// `writev(2)` of `iov` to `fd`.
#[inline]
pub fn writev(fd: RawFd, iov: &[IoSlice]) -> io::Result<usize> {
    // SAFETY: IoSlice is ABI-compatible with iovec and points at live memory.
    let n = unsafe { libc::writev(fd, iov.as_ptr().cast(), iov.len() as libc::c_int) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Sets a device's MTU and (if given) MAC.
fn configure(name: &str, mtu: u32, mac: Option<Mac>) -> Result<()> {
    with_ioctl_socket(|sock| {
        let mut m = IfReqMtu { name: ifname_bytes(name), mtu: mtu as libc::c_int, _pad: [0; 20] };
        // SAFETY: SIOCSIFMTU takes an ifreq with ifr_mtu, as `m` is laid out.
        if unsafe { libc::ioctl(sock, libc::SIOCSIFMTU, &mut m) } < 0 {
            bail!("set MTU {mtu}: {}", io::Error::last_os_error());
        }
        let Some(mac) = mac else { return Ok(()) };
        // SAFETY: sockaddr is plain data; zeroed is a valid value.
        let mut addr: libc::sockaddr = unsafe { std::mem::zeroed() };
        addr.sa_family = libc::ARPHRD_ETHER;
        for (d, s) in addr.sa_data.iter_mut().zip(mac.0) {
            *d = s as libc::c_char;
        }
        let mut h = IfReqHwAddr { name: ifname_bytes(name), addr, _pad: [0; 8] };
        // SAFETY: SIOCSIFHWADDR takes an ifreq with ifr_hwaddr, as `h` is laid out.
        if unsafe { libc::ioctl(sock, libc::SIOCSIFHWADDR, &mut h) } < 0 {
            bail!("set MAC {mac}: {}", io::Error::last_os_error());
        }
        Ok(())
    })
}

/// Runs `f` with a datagram socket: device ioctls go through any socket in
/// the device's namespace.
fn with_ioctl_socket<T>(f: impl FnOnce(RawFd) -> Result<T>) -> Result<T> {
    // SAFETY: plain socket(2); the fd is closed below.
    let sock = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if sock < 0 {
        return Err(io::Error::last_os_error().into());
    }
    let r = f(sock);
    // SAFETY: sock is ours and open.
    unsafe { libc::close(sock) };
    r
}

/// Brings a device up.
fn set_up(name: &str) -> Result<()> {
    with_ioctl_socket(|sock| {
        let mut req = IfReqFlags { name: ifname_bytes(name), flags: 0, _pad: [0; 22] };
        // SAFETY: SIOCGIFFLAGS / SIOCSIFFLAGS take an ifreq with ifr_flags.
        if unsafe { libc::ioctl(sock, libc::SIOCGIFFLAGS, &mut req) } < 0 {
            bail!("get flags: {}", io::Error::last_os_error());
        }
        req.flags |= libc::IFF_UP as libc::c_short;
        if unsafe { libc::ioctl(sock, libc::SIOCSIFFLAGS, &mut req) } < 0 {
            bail!("set up: {}", io::Error::last_os_error());
        }
        Ok(())
    })
}

/// Deletes a network device by name (RTM_DELLINK), even one another program
/// holds open.
pub fn delete_device(name: &str) -> io::Result<()> {
    rtnl_link(libc::RTM_DELLINK, name, None)
}

/// Largest TSO super-frame a guest hands over (`gso_max_size`): small enough
/// that, cut for a link of MTU 1500 or more, its segments fit one UDP GSO
/// call (at most 64 KiB of datagrams).
pub const GUEST_GSO_MAX_SIZE: u32 = 60_000;

/// Sets a device's `gso_max_size` (RTM_NEWLINK with IFLA_GSO_MAX_SIZE).
pub fn set_gso_max_size(name: &str, size: u32) -> io::Result<()> {
    const IFLA_GSO_MAX_SIZE: u16 = 41;
    rtnl_link(libc::RTM_NEWLINK, name, Some((IFLA_GSO_MAX_SIZE, size)))
}

/// One rtnetlink link request on the device `name`, with at most one u32
/// attribute, waiting for the kernel's acknowledgement.
fn rtnl_link(msg_type: u16, name: &str, attr: Option<(u16, u32)>) -> io::Result<()> {
    let c = CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: c is a valid C string.
    let index = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if index == 0 {
        return Err(io::Error::last_os_error());
    }
    #[repr(C)]
    struct Req {
        nlh: libc::nlmsghdr,
        ifi: IfInfoMsg,
        rta_len: u16,
        rta_type: u16,
        value: u32,
    }
    #[repr(C)]
    struct IfInfoMsg {
        family: u8,
        _pad: u8,
        kind: u16,
        index: i32,
        flags: u32,
        change: u32,
    }
    let len = if attr.is_some() { std::mem::size_of::<Req>() } else { std::mem::size_of::<Req>() - 8 };
    let (rta_type, value) = attr.unwrap_or((0, 0));
    let req = Req {
        nlh: libc::nlmsghdr {
            nlmsg_len: len as u32,
            nlmsg_type: msg_type,
            nlmsg_flags: (libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16,
            nlmsg_seq: 1,
            nlmsg_pid: 0,
        },
        ifi: IfInfoMsg { family: libc::AF_UNSPEC as u8, _pad: 0, kind: 0, index: index as i32, flags: 0, change: 0 },
        rta_len: 8,
        rta_type,
        value,
    };
    // SAFETY: plain socket(2), closed by OwnedFd.
    let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_ROUTE) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just opened and is owned here.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: req is a plain struct at least `len` bytes long.
    let n = unsafe { libc::send(fd.as_raw_fd(), (&req as *const Req).cast(), len, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut ack = [0u8; 256];
    // SAFETY: ack is valid for writes of its length.
    let n = unsafe { libc::recv(fd.as_raw_fd(), ack.as_mut_ptr().cast(), ack.len(), 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let hdr = std::mem::size_of::<libc::nlmsghdr>();
    if n as usize >= hdr + 4 {
        let err = i32::from_ne_bytes(ack[hdr..hdr + 4].try_into().unwrap());
        if err < 0 {
            return Err(io::Error::from_raw_os_error(-err));
        }
    }
    Ok(())
}

fn explain_tun_error(e: io::Error) -> io::Error {
    match e.kind() {
        io::ErrorKind::NotFound => io::Error::new(e.kind(), format!("{e} (is the tun module loaded?)")),
        io::ErrorKind::PermissionDenied => io::Error::new(e.kind(), format!("{e} (vnetd needs CAP_NET_ADMIN)")),
        _ => e,
    }
}

/// Whether `name` is an existing TUN/TAP device in our namespace.
pub fn is_tap(name: &str) -> bool {
    std::path::Path::new(&format!("/sys/class/net/{name}/tun_flags")).exists()
}

/// Whether a network device of this name exists in our namespace.
pub fn device_exists(name: &str) -> bool {
    CString::new(name).map(|c| unsafe { libc::if_nametoindex(c.as_ptr()) } != 0).unwrap_or(false)
}
