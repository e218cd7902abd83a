//! VTOE's guard (`bpf/vtoe_guard.bpf.c`): cgroup eBPF programs that hold
//! the security line around shadow sockets handed to guest programs.
//!
//! A sealed socket can never be connected or bound again, exchanges packets
//! only on the host connection it was sealed with (so a disconnect and a
//! listen() on a host port gain nothing), refuses the socket options that
//! tie it to host devices, and reports the overlay's addresses to
//! getpeername/getsockname (and so to accept). The seal lives in the
//! socket's own storage and goes with the socket.
//!
//! The programs are attached to one cgroup (v2) and act on sockets created
//! in it: the shadow sockets' creator must be in it when it makes them
//! (`cgroup_of_self`). They are attached the classic way (BPF_PROG_ATTACH,
//! multi), not by links that die with their process: a socket sealed by a
//! vnetd that is killed stays guarded. Each socket holds its cgroup and so
//! the programs; removing the cgroup once its vnetd is gone frees them after
//! the last of its sockets.

use anyhow::{anyhow, Context, Result};
use libbpf_rs::{MapCore, MapFlags, MapHandle, ObjectBuilder};
use std::net::SocketAddrV4;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};

static OBJECT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/vtoe_guard.bpf.o"));

/// Same layout as `struct seal` in the program.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Seal {
    overlay_local_ip: [u8; 4],
    overlay_peer_ip: [u8; 4],
    overlay_local_port: [u8; 2],
    overlay_peer_port: [u8; 2],
    host_local_ip: [u8; 4],
    host_peer_ip: [u8; 4],
    host_local_port: [u8; 2],
    host_peer_port: [u8; 2],
}

/// What the guard refused, dropped or rewrote, by kind (the program's
/// counter order).
pub const COUNTER_NAMES: [&str; 7] = [
    "denied_connect",
    "denied_bind",
    "denied_sockopt",
    "dropped_out",
    "dropped_in",
    "overlay_peername",
    "overlay_sockname",
];

/// A shadow connection's two pairs of ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ends {
    /// The guests' ends (what getsockname/getpeername report).
    pub overlay_local: SocketAddrV4,
    pub overlay_peer: SocketAddrV4,
    /// The host connection's ends (the only packets the socket may carry).
    pub host_local: SocketAddrV4,
    pub host_peer: SocketAddrV4,
}

pub struct Guard {
    sealed: MapHandle,
    counters: MapHandle,
    cgroup: PathBuf,
}

impl Guard {
    /// Loads the programs and attaches them to the cgroup (v2) directory
    /// `cgroup`.
    pub fn load(cgroup: &Path) -> Result<Guard> {
        let open = ObjectBuilder::default().open_memory(OBJECT).context("cannot open the VTOE guard's eBPF object")?;
        let obj = open.load().context("the kernel refused the VTOE guard's eBPF programs ")?;
        let map = |name: &str| -> Result<MapHandle> {
            let m = obj.maps().find(|m| m.name() == name).ok_or_else(|| anyhow!("no map {name}"))?;
            MapHandle::try_from(&m).with_context(|| format!("map {name}"))
        };
        let dir = std::fs::File::open(cgroup).with_context(|| format!("cannot open cgroup {}", cgroup.display()))?;
        for p in obj.progs() {
            let name = p.name().to_string_lossy().into_owned();
            // SAFETY: bpf_prog_attach with two descriptors we hold.
            let r = unsafe {
                libbpf_sys::bpf_prog_attach(p.as_fd().as_raw_fd(), dir.as_raw_fd(), p.attach_type() as u32, libbpf_sys::BPF_F_ALLOW_MULTI)
            };
            if r < 0 {
                return Err(std::io::Error::from_raw_os_error(-r)).with_context(|| format!("cannot attach {name} to {}", cgroup.display()));
            }
        }
        Ok(Guard { sealed: map("sealed")?, counters: map("counters")?, cgroup: cgroup.to_path_buf() })
    }

    /// The cgroup the address programs watch.
    pub fn cgroup(&self) -> &Path {
        &self.cgroup
    }

    /// Seals a connected TCP socket (made in the guard's cgroup): from now
    /// on it carries only the host connection `ends.host_*`, cannot be
    /// re-aimed, and reports the overlay's ends as its addresses.
    pub fn seal(&self, sock: BorrowedFd<'_>, ends: &Ends) -> Result<()> {
        let s = Seal {
            overlay_local_ip: ends.overlay_local.ip().octets(),
            overlay_peer_ip: ends.overlay_peer.ip().octets(),
            overlay_local_port: ends.overlay_local.port().to_be_bytes(),
            overlay_peer_port: ends.overlay_peer.port().to_be_bytes(),
            host_local_ip: ends.host_local.ip().octets(),
            host_peer_ip: ends.host_peer.ip().octets(),
            host_local_port: ends.host_local.port().to_be_bytes(),
            host_peer_port: ends.host_peer.port().to_be_bytes(),
        };
        let key = sock.as_raw_fd().to_ne_bytes();
        // SAFETY: Seal is plain old data with no padding.
        let val = unsafe { std::slice::from_raw_parts((&s as *const Seal).cast::<u8>(), std::mem::size_of::<Seal>()) };
        self.sealed.update(&key, val, MapFlags::ANY).context("cannot seal the socket")
    }

    /// Whether a socket is sealed.
    pub fn is_sealed(&self, sock: BorrowedFd<'_>) -> bool {
        matches!(self.sealed.lookup(&sock.as_raw_fd().to_ne_bytes(), MapFlags::ANY), Ok(Some(_)))
    }

    /// The counters, in `COUNTER_NAMES` order, summed over CPUs.
    pub fn counters(&self) -> [u64; COUNTER_NAMES.len()] {
        let mut out = [0u64; COUNTER_NAMES.len()];
        for (i, o) in out.iter_mut().enumerate() {
            if let Ok(Some(per_cpu)) = self.counters.lookup_percpu(&(i as u32).to_ne_bytes(), MapFlags::ANY) {
                *o = per_cpu.iter().map(|v| u64::from_ne_bytes(v[..8].try_into().unwrap_or([0; 8]))).sum();
            }
        }
        out
    }
}

/// The cgroup (v2) the calling process is in, as a directory under a
/// cgroup2 mount: the one it finds, or one it mounts at `mount_at`.
pub fn cgroup_of_self(mount_at: &Path) -> Result<(PathBuf, PathBuf)> {
    let mount = cgroup2_mount(mount_at)?;
    let own = std::fs::read_to_string("/proc/self/cgroup").context("/proc/self/cgroup")?;
    let rel = own
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .ok_or_else(|| anyhow!("this process has no cgroup v2 membership"))?;
    Ok((mount.clone(), mount.join(rel.trim_start_matches('/'))))
}

/// A cgroup2 mount point: one already there, or a new one at `mount_at`.
fn cgroup2_mount(mount_at: &Path) -> Result<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").context("/proc/self/mountinfo")?;
    for l in mounts.lines() {
        // ... mount-point ... - fstype source options
        let (left, right) = l.split_once(" - ").unwrap_or((l, ""));
        if right.split_whitespace().next() == Some("cgroup2") {
            if let Some(mp) = left.split_whitespace().nth(4) {
                return Ok(PathBuf::from(mp));
            }
        }
    }
    std::fs::create_dir_all(mount_at).with_context(|| format!("cannot make {}", mount_at.display()))?;
    let c = |s: &str| std::ffi::CString::new(s).expect("no NUL");
    let target = c(mount_at.to_str().ok_or_else(|| anyhow!("mount point is not UTF-8"))?);
    // SAFETY: plain mount(2) of a cgroup2 filesystem with C strings we own.
    let r = unsafe {
        libc::mount(c("cgroup2").as_ptr(), target.as_ptr(), c("cgroup2").as_ptr(), libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC, std::ptr::null())
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| format!("cannot mount cgroup2 at {}", mount_at.display()));
    }
    Ok(mount_at.to_path_buf())
}
