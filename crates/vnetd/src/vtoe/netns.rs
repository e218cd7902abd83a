//! A guest's network namespace as VTOE sees it: its cookie (how a runner
//! that connects is recognised: the kernel records the namespace of the
//! connecting socket on the socket vnetd accepts), and an rtnetlink socket
//! opened inside it, for the guest kernel's own view of a connection: its
//! route to the destination, its ARP entry, whether an address is its own.
//!
//! Also a sock_diag socket opened inside it, to tell whether a listener a
//! runner registered still listens, and a second rtnetlink socket for the
//! addresses of one device (is a destination an address of the interface
//! its frames go to?).
//!
//! Namespaces are found by the names interfaces were made with (`netns
//! <name>`, a file in /run/netns) and kept while that file stays the same.

use crate::sys::rtnl::{RouteTo, Rtnl};
use crate::sys::netdev::{in_netns, open_netns};
use anyhow::{Context, Result};
use netlink_packet_route::neighbour::NeighbourState;
use netlink_packet_route::route::RouteType;
use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// `getsockopt(SOL_SOCKET, SO_NETNS_COOKIE)`: the network namespace a socket
/// belongs to.
pub fn netns_cookie(fd: RawFd) -> std::io::Result<u64> {
    let mut v: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt into a u64 of the length given.
    let r = unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_NETNS_COOKIE, (&mut v as *mut u64).cast(), &mut len) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(v)
}

pub struct GuestNs {
    pub name: String,
    pub cookie: u64,
    rtnl: Rtnl,
    /// sock_diag in the guest's namespace (its listeners).
    diag: Mutex<OwnedFd>,
    /// The namespace file's identity, to notice it being replaced.
    file: (u64, u64),
    /// Devices' indices by name, as last looked up (a device made again
    /// gets a new index: a miss looks again).
    indices: Mutex<HashMap<String, u32>>,
}

/// How long the guest's kernel may take to resolve a neighbour: its ARP
/// gives up after 3 probes a second apart (the default `mcast_solicit` and
/// `retrans_time`), and then so do we.
const RESOLVE_TIMEOUT: Duration = Duration::from_millis(3500);

impl GuestNs {
    fn open(name: &str) -> Result<GuestNs> {
        let fd = open_netns(name)?;
        let meta = std::fs::metadata(format!("/proc/self/fd/{}", fd.as_raw_fd())).context("netns file")?;
        let (rtnl, cookie, diag) = in_netns(&fd, name, || -> Result<(Rtnl, u64, OwnedFd)> {
            let rtnl = Rtnl::open().context("rtnetlink in the guest's namespace")?;
            let diag = super::diag::open().context("sock_diag in the guest's namespace")?;
            let probe = std::net::UdpSocket::bind("0.0.0.0:0").or_else(|_| std::net::UdpSocket::bind("[::]:0"));
            let cookie = match probe {
                Ok(p) => netns_cookie(p.as_raw_fd())?,
                // No address family at all: a raw netlink socket has a namespace too.
                Err(_) => {
                    let s = socket2::Socket::new(socket2::Domain::UNIX, socket2::Type::DGRAM, None)?;
                    netns_cookie(s.as_raw_fd())?
                }
            };
            Ok((rtnl, cookie, diag))
        })?;
        Ok(GuestNs {
            name: name.to_string(),
            cookie,
            rtnl,
            diag: Mutex::new(diag),
            file: (meta.dev(), meta.ino()),
            indices: Mutex::default(),
        })
    }

    /// The guest kernel's route toward `dst`.
    pub fn route(&self, dst: Ipv4Addr) -> std::io::Result<RouteTo> {
        self.rtnl.route_get(dst)
    }

    /// Whether `ip` is one of the guest's own addresses.
    pub fn is_local(&self, ip: Ipv4Addr) -> bool {
        matches!(self.rtnl.route_get(ip), Ok(r) if r.kind == RouteType::Local)
    }

    /// Whether the guest's socket with this cookie still listens (on `port`,
    /// of `family`). An error counts as not.
    pub fn listens(&self, family: u8, port: u16, cookie: u64) -> bool {
        let fd = self.diag.lock().unwrap_or_else(|p| p.into_inner());
        super::diag::listening(&fd, family, port).is_ok_and(|c| c.contains(&cookie))
    }

    /// The IPv4 addresses of the guest's device `ifindex`.
    pub fn addresses(&self, ifindex: u32) -> std::io::Result<Vec<Ipv4Addr>> {
        self.rtnl.addresses(ifindex)
    }

    /// The index of the guest's device `name`, asked now (a device made
    /// again has another).
    pub fn index_of(&self, name: &str) -> Option<u32> {
        self.rtnl.index_of(name).ok().flatten()
    }

    /// Which of the devices `names` has index `oif` in the guest's
    /// namespace: from the indices last seen, else looked up again.
    pub fn device_with_index<'a>(&self, names: impl Iterator<Item = &'a str> + Clone, oif: u32) -> Option<&'a str> {
        let mut known = self.indices.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = names.clone().find(|n| known.get(*n) == Some(&oif)) {
            return Some(n);
        }
        for n in names.clone() {
            match self.rtnl.index_of(n) {
                Ok(Some(i)) => known.insert(n.to_string(), i),
                _ => known.remove(n),
            };
        }
        names.into_iter().find(|n| known.get(*n) == Some(&oif))
    }

    /// The MAC of `ip` on device `ifindex`, as the guest's kernel resolves it
    /// (over the overlay, by ARP, as it would for a packet of its own):
    /// None when its ARP gives up.
    pub fn resolve(&self, ifindex: u32, ip: Ipv4Addr) -> std::io::Result<Option<[u8; 6]>> {
        let deadline = Instant::now() + RESOLVE_TIMEOUT;
        let mut asked = false;
        let mut pause = Duration::from_micros(200);
        loop {
            let n = self.rtnl.neighbour(ifindex, ip)?;
            if let Some(mac) = n.and_then(|n| n.usable()) {
                return Ok(Some(mac));
            }
            let failed = n.is_some_and(|n| n.state == NeighbourState::Failed);
            if failed && asked {
                return Ok(None);
            }
            if !asked || failed {
                self.rtnl.resolve(ifindex, ip)?;
                asked = true;
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }
}

/// The guests' namespaces met so far, by name.
#[derive(Default)]
pub struct Namespaces {
    by_name: Mutex<HashMap<String, Arc<GuestNs>>>,
}

impl Namespaces {
    /// The namespace named `name`, opened once and kept while its file is
    /// the same one.
    pub fn get(&self, name: &str) -> Result<Arc<GuestNs>> {
        let current = std::fs::metadata(format!("/run/netns/{name}")).map(|m| (m.dev(), m.ino())).ok();
        let mut map = self.by_name.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(ns) = map.get(name) {
            if Some(ns.file) == current {
                return Ok(ns.clone());
            }
        }
        let ns = Arc::new(GuestNs::open(name)?);
        map.insert(name.to_string(), ns.clone());
        Ok(ns)
    }
}
