//! Network devices through ioctls and plain system calls, for every kind of
//! NIC and link: a device's MTU, MAC, index and flags, its checksum offload,
//! entering a named network namespace safely, and writing a frame with its
//! virtio-net header. No vnetd state here; `rtnl` does the netlink side.

use anyhow::{anyhow, bail, Result};
use std::ffi::CString;
use std::fs::OpenOptions;
use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use vnet_core::offload::{VnetHdr, VNET_HDR_LEN};
use vnet_core::Mac;

/// The CLONE_NEW* type of a namespace file.
const NS_GET_NSTYPE: libc::c_ulong = libc::NS_GET_NSTYPE as libc::c_ulong;

/// Most pieces one frame is written in (a merged super-frame: its headers
/// and up to `vnet_core::offload::MAX_RUN` payloads).
pub const MAX_PARTS: usize = 64;

#[repr(C)]
pub struct IfReqFlags {
    pub name: [u8; libc::IFNAMSIZ],
    pub flags: libc::c_short,
    pub _pad: [u8; 22],
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

pub fn ifname_bytes(name: &str) -> [u8; libc::IFNAMSIZ] {
    let mut b = [0u8; libc::IFNAMSIZ];
    b[..name.len()].copy_from_slice(name.as_bytes());
    b
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
pub fn configure(name: &str, mtu: u32, mac: Option<Mac>) -> Result<()> {
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

/// Turns a device's transmit checksum offload off (`ethtool -K <dev> tx
/// off`): the kernel then finishes checksums, and segments, in software
/// before the device, as for a NIC without those offloads.
pub fn tx_checksum_off(name: &str) -> Result<()> {
    with_ioctl_socket(|sock| set_feature(sock, name, ETHTOOL_STXCSUM, false))
}

/// A device's offloads by ethtool's one-feature commands (`ethtool -K`).
pub const ETHTOOL_STXCSUM: u32 = 0x17;
/// Every TCP segmentation offload (TSO, TSO6, ECN, mangle-id).
pub const ETHTOOL_STSO: u32 = 0x1f;
pub const ETHTOOL_SGRO: u32 = 0x2c;

/// Sets one offload of device `name` on or off (`cmd`: an `ETHTOOL_S*`),
/// through `sock`, a socket in the device's namespace.
pub fn set_feature(sock: RawFd, name: &str, cmd: u32, on: bool) -> Result<()> {
    #[repr(C)]
    struct EthtoolValue {
        cmd: u32,
        data: u32,
    }
    #[repr(C)]
    struct IfReqData {
        name: [u8; libc::IFNAMSIZ],
        data: *mut EthtoolValue,
        _pad: [u8; 16],
    }
    const SIOCETHTOOL: libc::c_ulong = 0x8946;
    let mut v = EthtoolValue { cmd, data: on as u32 };
    let mut req = IfReqData { name: ifname_bytes(name), data: &mut v, _pad: [0; 16] };
    // SAFETY: SIOCETHTOOL takes an ifreq whose ifr_data points at an
    // ethtool command, as `req` is laid out; `v` outlives the call.
    if unsafe { libc::ioctl(sock, SIOCETHTOOL, &mut req) } < 0 {
        bail!("ethtool command {cmd:#x} on {name}: {}", io::Error::last_os_error());
    }
    Ok(())
}

/// Sets one offload of device `name` in this namespace (see `set_feature`).
pub fn set_feature_here(name: &str, cmd: u32, on: bool) -> Result<()> {
    with_ioctl_socket(|sock| set_feature(sock, name, cmd, on))
}

/// Sets one offload of device `name` in the network namespace `ns`.
pub fn set_feature_in(ns: &OwnedFd, name: &str, cmd: u32, on: bool) -> Result<()> {
    in_netns(ns, "the guest's", || set_feature_here(name, cmd, on))
}

/// Runs `f` in a thread of ours that enters the network namespace `ns`
/// first (setns changes only the calling thread), and gives back what `f`
/// returns. `what` names the namespace in the error if it cannot be
/// entered.
pub fn in_netns<T: Send, E: From<io::Error> + Send>(ns: &OwnedFd, what: &str, f: impl FnOnce() -> std::result::Result<T, E> + Send) -> std::result::Result<T, E> {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                // SAFETY: setns on a network namespace file the caller holds, in this thread only.
                if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } < 0 {
                    let e = io::Error::last_os_error();
                    return Err(io::Error::new(e.kind(), format!("cannot enter network namespace {what}: {e}")).into());
                }
                f()
            })
            .join()
            .unwrap_or_else(|_| Err(io::Error::other(format!("a thread in network namespace {what} panicked")).into()))
    })
}

/// Brings a device up.
pub fn set_up(name: &str) -> Result<()> {
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

/// A device's index in this thread's network namespace.
pub fn ifindex(name: &str) -> io::Result<u32> {
    let c = CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: c is a valid C string.
    match unsafe { libc::if_nametoindex(c.as_ptr()) } {
        0 => Err(io::Error::last_os_error()),
        i => Ok(i),
    }
}

/// A device's MTU (SIOCGIFMTU), in this thread's network namespace.
pub fn device_mtu(name: &str) -> io::Result<u32> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    // SAFETY: plain socket(2), closed by OwnedFd.
    let sock = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if sock < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: sock was just opened and is owned here.
    let sock = unsafe { OwnedFd::from_raw_fd(sock) };
    let mut m = IfReqMtu { name: ifname_bytes(name), mtu: 0, _pad: [0; 20] };
    // SAFETY: SIOCGIFMTU writes ifr_mtu of an ifreq, as `m` is laid out.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFMTU, &mut m) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(m.mtu as u32)
}

/// Opens the named network namespace `/run/netns/<name>` to enter it: the
/// name must be a plain name (no `/`, not `..`), the entry must not be a
/// symbolic link (O_NOFOLLOW: a link planted there could point at any
/// namespace, such as the host's), and it must be a network namespace
/// (NS_GET_NSTYPE), all checked before anything enters it.
pub fn open_netns(name: &str) -> Result<OwnedFd> {
    vnet_core::command::check_netns_name(name).map_err(|e| anyhow!("{e}"))?;
    let rule = "netns names a network namespace file in /run/netns, as `ip netns add` makes them";
    let dir = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open("/run/netns")
        .map_err(|e| anyhow!("no network namespace {name} (/run/netns: {e})"))?;
    let c = CString::new(name).map_err(|_| anyhow!("'{name}' is not a network namespace name"))?;
    // SAFETY: openat relative to a directory we hold, with a valid C string.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            c.as_ptr(),
            libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK | libc::O_NOCTTY,
        )
    };
    if fd < 0 {
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ELOOP) => bail!("/run/netns/{name} is a symbolic link, which vnetd does not follow ({rule})"),
            Some(libc::ENOENT) => bail!("no network namespace {name} (no /run/netns/{name}; {rule})"),
            _ => bail!("cannot open network namespace {name} (/run/netns/{name}: {e})"),
        }
    }
    // SAFETY: fd was just opened and is owned here.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: NS_GET_NSTYPE takes no argument; on a file that is not a
    // namespace it fails (ENOTTY).
    let nstype = unsafe { libc::ioctl(fd.as_raw_fd(), NS_GET_NSTYPE) };
    if nstype != libc::CLONE_NEWNET {
        bail!("/run/netns/{name} is not a network namespace ({rule})");
    }
    Ok(fd)
}


/// Writes one frame made of `parts`, preceded by its virtio-net header, to a
/// TAP or packet socket `fd`; returns the frame's length.
#[inline]
pub fn send_vnet(fd: RawFd, vnet: &VnetHdr, parts: &[&[u8]]) -> io::Result<usize> {
    let mut hdr = [0u8; VNET_HDR_LEN];
    vnet.write(&mut hdr);
    let mut iov = [IoSlice::new(&[]); MAX_PARTS + 1];
    iov[0] = IoSlice::new(&hdr);
    let n_parts = parts.len().min(MAX_PARTS);
    for (slot, p) in iov[1..].iter_mut().zip(&parts[..n_parts]) {
        *slot = IoSlice::new(p);
    }
    let n = writev(fd, &iov[..1 + n_parts])?;
    Ok(n.saturating_sub(VNET_HDR_LEN))
}

/// `setsockopt` of an int option .
pub fn setsockopt_int(fd: RawFd, level: libc::c_int, opt: libc::c_int, val: libc::c_int) -> io::Result<()> {
    // SAFETY: setsockopt with an int value.
    let r = unsafe {
        libc::setsockopt(fd, level, opt, (&val as *const libc::c_int).cast(), std::mem::size_of::<libc::c_int>() as u32)
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
