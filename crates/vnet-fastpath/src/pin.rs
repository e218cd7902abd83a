//! The fast path's folder in bpffs: what makes it outlive vnetd.
//!
//! ```text
//! <dir>/maps/<name>            every map (flows, links, ports, counters, ...)
//! <dir>/links/<hook>-<ifindex> every attachment (a TCX link)
//! ```
//!
//! A pinned object lives as long as its pin, not as long as the descriptor
//! a process holds: a TCX link that is pinned keeps its program on the
//! device after vnetd exits, and the program keeps reading the pinned maps.
//! So the kernel datapath has three acts, as OVS's `dpif` open/close/destroy
//! and Cilium's loader: `Kernel::open` creates the folder or adopts what it
//! holds, dropping the `Kernel` closes it (everything stays), and
//! `destroy` removes it (programs detached, maps freed).
//!
//! Adopting needs the maps to mean what this build thinks they mean: the
//! `meta` map holds `LAYOUT` (bumped by any change of a map's meaning) and
//! the network namespace whose ifindexes the maps hold, and every pinned
//! map's type and sizes must be the object's. Maps that fail either test
//! are not adopted: new ones are made, pinned over the old (a rename, so a
//! pin is never missing), and each attachment switches to the new program
//! and maps in one `bpf_link_update` when vnetd claims it.
//!
//! One vnetd holds the folder at a time (an `flock` on it): a second one
//! given the same folder is refused rather than sharing the first's maps.

use anyhow::{anyhow, bail, Context, Result};
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// The maps' layout: bumped whenever a map's key or value changes meaning
/// (a size change is caught anyway). A vnetd adopts only its own layout.
pub const LAYOUT: u32 = 1;
/// What `meta` starts with, so a stray map of that name is not taken.
pub const MAGIC: u32 = 0x564e_4554; // "VNET"

/// bpffs' magic number (statfs f_type).
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
/// Where systemd (and vnetd, if nobody has) mounts bpffs.
pub const BPFFS: &str = "/sys/fs/bpf";

/// The folder is held by another process (a vnetd given the same
/// --pin-dir): not a fast path that cannot load, but two daemons that would
/// share one datapath.
#[derive(Debug)]
pub struct InUse(pub PathBuf);

impl std::fmt::Display for InUse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} is in use by another vnetd; give each vnetd a --pin-dir of its own", self.0.display())
    }
}

impl std::error::Error for InUse {}

/// The folder, held (locked) by this process.
pub struct Pins {
    dir: PathBuf,
    /// The lock: an open descriptor of `dir` with an exclusive flock.
    _lock: nix::fcntl::Flock<std::fs::File>,
}

fn cpath(p: &Path) -> Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| anyhow!("{} has a NUL byte", p.display()))
}

fn is_bpffs(p: &Path) -> bool {
    nix::sys::statfs::statfs(p).map(|s| s.filesystem_type().0 as i64 == BPF_FS_MAGIC).unwrap_or(false)
}

/// Whether no process but this one is in this process's mount namespace:
/// then what it mounts goes when it exits (`ip netns exec` makes such a
/// namespace for the program it runs). Unknown (no /proc) counts as shared.
fn mount_namespace_is_ours_alone() -> bool {
    let Ok(mine) = std::fs::read_link("/proc/self/ns/mnt") else { return false };
    let me = std::process::id().to_string();
    let Ok(procs) = std::fs::read_dir("/proc") else { return false };
    !procs.flatten().any(|e| {
        let name = e.file_name();
        let pid = name.to_string_lossy();
        pid.bytes().all(|b| b.is_ascii_digit()) && pid != me.as_str() && std::fs::read_link(e.path().join("ns/mnt")).is_ok_and(|ns| ns == mine)
    })
}

/// Makes sure `dir` is on a bpf filesystem: under /sys/fs/bpf, bpffs is
/// mounted there if nobody has (as Cilium does); anywhere else it must be
/// already.
fn ensure_bpffs(dir: &Path) -> Result<()> {
    let mut probe = dir.to_path_buf();
    while !probe.exists() {
        if !probe.pop() {
            break;
        }
    }
    if is_bpffs(&probe) {
        return Ok(());
    }
    let base = Path::new(BPFFS);
    if dir.starts_with(base) && (probe == base || base.starts_with(&probe)) {
        std::fs::create_dir_all(base).with_context(|| format!("cannot make {BPFFS}"))?;
        nix::mount::mount(Some("bpf"), base, Some("bpf"), nix::mount::MsFlags::empty(), None::<&str>)
            .with_context(|| format!("no bpf filesystem at {BPFFS}, and cannot mount one"))?;
        tracing::info!("mounted a bpf filesystem at {BPFFS} (nobody had)");
        if mount_namespace_is_ours_alone() {
            tracing::warn!(
                "the bpf filesystem vnetd mounted at {BPFFS} is in a mount namespace no other process shares \
                 (vnetd runs under `ip netns exec`, or in a unit or container with private mounts): it goes when \
                 vnetd exits, and the pinned datapath with it, so guests' flows stop while vnetd is away. Mount \
                 bpffs where the host sees it (`mount -t bpf bpf {BPFFS}` in the host's mount namespace), or give \
                 --pin-dir a folder on a bpf filesystem that outlives vnetd"
            );
        }
        return Ok(());
    }
    bail!("{} is not on a bpf filesystem (mount -t bpf bpf <dir>, or give a folder under {BPFFS})", dir.display())
}

impl Pins {
    /// Opens (making it if needed) and locks the folder.
    pub fn open(dir: &Path) -> Result<Pins> {
        ensure_bpffs(dir)?;
        for d in [dir.to_path_buf(), dir.join("maps"), dir.join("links")] {
            std::fs::create_dir_all(&d).with_context(|| format!("cannot make {}", d.display()))?;
        }
        let file = std::fs::File::open(dir).with_context(|| format!("cannot open {}", dir.display()))?;
        let lock = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock)
            .map_err(|_| anyhow::Error::new(InUse(dir.to_path_buf())))?;
        Ok(Pins { dir: dir.to_path_buf(), _lock: lock })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn map_path(&self, name: &str) -> PathBuf {
        self.dir.join("maps").join(name)
    }

    /// A map's path while it is being replaced (renamed over the old one;
    /// bpffs refuses dots in names).
    pub fn new_map_path(&self, name: &str) -> PathBuf {
        self.dir.join("maps").join(format!("new-{name}"))
    }

    pub fn link_path(&self, hook: &str, ifindex: u32) -> PathBuf {
        self.dir.join("links").join(format!("{hook}-{ifindex}"))
    }

    /// Every pinned attachment: (hook, ifindex, descriptor). Pins that do
    /// not parse, cannot be opened, or whose device is gone (a defunct TCX
    /// link) are removed.
    pub fn links(&self) -> Vec<(String, u32, OwnedFd)> {
        let mut out = Vec::new();
        let Ok(rd) = std::fs::read_dir(self.dir.join("links")) else { return out };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let parsed = name.rsplit_once('-').and_then(|(h, i)| Some((h.to_string(), i.parse::<u32>().ok()?)));
            let fd = obj_get(&e.path()).ok();
            match (parsed, fd) {
                (Some((hook, ifindex)), Some(fd)) if link_ifindex(fd.as_raw_fd()) == Some(ifindex) => {
                    out.push((hook, ifindex, fd))
                }
                _ => {
                    tracing::info!("fast path: removing {}, whose device is gone", e.path().display());
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        out
    }

    /// Removes the folder: every attachment detached (unless another
    /// descriptor still holds it), every map freed once unused.
    pub fn destroy(self) -> Result<()> {
        for sub in ["links", "maps"] {
            if let Ok(rd) = std::fs::read_dir(self.dir.join(sub)) {
                for e in rd.flatten() {
                    std::fs::remove_file(e.path()).with_context(|| format!("cannot remove {}", e.path().display()))?;
                }
            }
            let _ = std::fs::remove_dir(self.dir.join(sub));
        }
        std::fs::remove_dir(&self.dir).with_context(|| format!("cannot remove {}", self.dir.display()))
    }
}

/// `bpf_obj_get`: a descriptor of a pinned object.
pub fn obj_get(path: &Path) -> Result<OwnedFd> {
    let c = cpath(path)?;
    // SAFETY: a valid C string; the call returns a new descriptor or -errno.
    let fd = unsafe { libbpf_sys::bpf_obj_get(c.as_ptr()) };
    if fd < 0 {
        bail!("cannot open {}: {}", path.display(), std::io::Error::from_raw_os_error(-fd));
    }
    // SAFETY: a new descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `bpf_obj_pin`, replacing a stale pin of that name.
pub fn obj_pin(fd: RawFd, path: &Path) -> Result<()> {
    let c = cpath(path)?;
    let _ = std::fs::remove_file(path);
    // SAFETY: a valid descriptor and C string.
    let r = unsafe { libbpf_sys::bpf_obj_pin(fd, c.as_ptr()) };
    if r < 0 {
        bail!("cannot pin {}: {}", path.display(), std::io::Error::from_raw_os_error(-r));
    }
    Ok(())
}

/// What the kernel says of a link.
fn link_info(fd: RawFd) -> Option<libbpf_sys::bpf_link_info> {
    let mut info = libbpf_sys::bpf_link_info::default();
    let mut len = std::mem::size_of::<libbpf_sys::bpf_link_info>() as u32;
    // SAFETY: info is a bpf_link_info of `len` bytes.
    let r = unsafe { libbpf_sys::bpf_link_get_info_by_fd(fd, &mut info, &mut len) };
    (r >= 0).then_some(info)
}

/// The device a TCX link is attached to; None for a defunct link (its
/// device was deleted) or a descriptor that is no TCX link.
pub fn link_ifindex(fd: RawFd) -> Option<u32> {
    let info = link_info(fd).filter(|i| i.type_ == libbpf_sys::BPF_LINK_TYPE_TCX)?;
    // SAFETY: a TCX link's info is the `tcx` member.
    let ifindex = unsafe { info.__bindgen_anon_1.tcx.ifindex };
    (ifindex != 0).then_some(ifindex)
}

/// A link's id (two descriptors of one link give the same).
pub fn link_id(fd: RawFd) -> Option<u32> {
    link_info(fd).map(|i| i.id)
}

/// `bpf_link_update`: the link runs `prog` from now on, with no moment
/// where the device runs neither.
pub fn link_update(link: RawFd, prog: RawFd) -> std::io::Result<()> {
    // SAFETY: valid descriptors; NULL options are allowed.
    let r = unsafe { libbpf_sys::bpf_link_update(link, prog, std::ptr::null()) };
    if r < 0 {
        return Err(std::io::Error::from_raw_os_error(-r));
    }
    Ok(())
}

/// The inode of this thread's network namespace: what the ifindexes in the
/// maps are of.
pub fn netns_inode() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/thread-self/ns/net").map(|m| m.ino()).unwrap_or(0)
}
