//! TAP devices through the raw `/dev/net/tun` ioctls (the interface is five
//! ioctls; a crate would add more surface than it saves).

use anyhow::{bail, Context, Result};
use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use vnet_core::Mac;

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;

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
pub struct Tap {
    file: File,
}

impl Tap {
    /// Creates the TAP `name` with the given MTU and MAC, non-blocking, frames
    /// without any packet-information header.
    pub fn create(name: &str, mtu: u32, mac: Mac) -> Result<Tap> {
        if name.is_empty() || name.len() >= libc::IFNAMSIZ {
            bail!("'{name}' is not a device name");
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open("/dev/net/tun")
            .map_err(|e| anyhow::anyhow!("cannot create TAP {name}: cannot open /dev/net/tun: {}", explain_tun_error(e)))?;
        let mut req = IfReqFlags { name: ifname_bytes(name), flags: IFF_TAP | IFF_NO_PI, _pad: [0; 22] };
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
        let tap = Tap { file };
        tap.configure(name, mtu, mac).with_context(|| format!("cannot configure TAP {name}"))?;
        Ok(tap)
    }

    fn configure(&self, name: &str, mtu: u32, mac: Mac) -> Result<()> {
        // Device ioctls go through any socket in the device's namespace.
        // SAFETY: plain socket(2); the fd is closed below.
        let sock = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if sock < 0 {
            return Err(io::Error::last_os_error().into());
        }
        let result = (|| -> Result<()> {
            let mut m = IfReqMtu { name: ifname_bytes(name), mtu: mtu as libc::c_int, _pad: [0; 20] };
            // SAFETY: SIOCSIFMTU takes an ifreq with ifr_mtu, as `m` is laid out.
            if unsafe { libc::ioctl(sock, libc::SIOCSIFMTU, &mut m) } < 0 {
                bail!("set MTU {mtu}: {}", io::Error::last_os_error());
            }
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
        })();
        // SAFETY: sock is ours and open.
        unsafe { libc::close(sock) };
        result
    }

    /// Reads one frame; `WouldBlock` when none is queued.
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

    /// Writes one frame to the guest.
    #[inline]
    pub fn send(&self, frame: &[u8]) -> io::Result<usize> {
        // SAFETY: frame is valid for reads of frame.len() bytes.
        let n = unsafe { libc::write(self.file.as_raw_fd(), frame.as_ptr().cast(), frame.len()) };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }
}

impl AsRawFd for Tap {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

fn explain_tun_error(e: io::Error) -> io::Error {
    match e.kind() {
        io::ErrorKind::NotFound => io::Error::new(e.kind(), format!("{e} (is the tun module loaded?)")),
        io::ErrorKind::PermissionDenied => io::Error::new(e.kind(), format!("{e} (vnetd needs CAP_NET_ADMIN)")),
        _ => e,
    }
}

/// Whether a network device of this name exists in our namespace.
pub fn device_exists(name: &str) -> bool {
    CString::new(name).map(|c| unsafe { libc::if_nametoindex(c.as_ptr()) } != 0).unwrap_or(false)
}
