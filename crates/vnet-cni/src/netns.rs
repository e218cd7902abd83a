//! The container's network namespace: naming it for vnetd, and setting up
//! and inspecting the device inside it.
//!
//! vnetd's `INTERFACE ADD ... netns <name>` takes a name in /run/netns.
//! A CNI_NETNS of /run/netns/<name> (or /var/run/netns/<name>) is used by
//! that name; any other path (/proc/<pid>/ns/net, a runtime's own
//! directory) is bind-mounted to /run/netns/vnet-cni-<hash>, as `ip netns
//! attach` does, and unmounted by DEL.
//!
//! Inside the namespace the plugin uses iproute2 (`ip -n <name>`, JSON
//! output for reading): one `ip -batch` for the whole setup, so a failure
//! names its line, and nothing here needs the process to enter the
//! namespace itself.

use crate::error::{code, CniError, CniResult};
use crate::result::{AddResult, Cidr};
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sys::statfs::{statfs, NSFS_MAGIC};
use serde_json::Value;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

pub const RUN_NETNS: &str = "/run/netns";

/// The namespace as vnetd and `ip -n` name it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Netns {
    pub name: String,
    /// The plugin bind-mounted it there (and DEL unmounts it).
    pub bound: bool,
    /// This call made that mount: a failed ADD takes back only a mount it
    /// made, never the one an earlier ADD of the attachment made and still
    /// uses (a second ADD of an existing attachment changes nothing).
    pub made: bool,
}

pub fn path_of(name: &str) -> PathBuf {
    Path::new(RUN_NETNS).join(name)
}

/// Whether `path` is a namespace file (an nsfs inode: a /proc/<pid>/ns
/// link or a bind mount of one).
pub fn is_netns(path: &Path) -> bool {
    statfs(path).is_ok_and(|s| s.filesystem_type() == NSFS_MAGIC)
}

/// The name a CNI_NETNS path already has in /run/netns, if it is there.
pub fn named(cni_netns: &str) -> Option<&str> {
    let name = cni_netns.strip_prefix("/run/netns/").or_else(|| cni_netns.strip_prefix("/var/run/netns/"))?;
    vnet_core::command::check_netns_name(name).is_ok().then_some(name)
}

/// Names the container's namespace for vnetd, bind-mounting it to
/// /run/netns/`mount_name` if it has no name there. A namespace that does
/// not exist is CNI error 3 (the container is unknown: nothing was done).
pub fn resolve(cni_netns: &str, mount_name: &str) -> CniResult<Netns> {
    let path = Path::new(cni_netns);
    if !path.exists() {
        return Err(CniError::new(code::UNKNOWN_CONTAINER, format!("network namespace {cni_netns} does not exist")));
    }
    if !is_netns(path) {
        return Err(CniError::new(code::INVALID_ENV, format!("CNI_NETNS {cni_netns} is not a network namespace")));
    }
    if let Some(name) = named(cni_netns) {
        return Ok(Netns { name: name.to_string(), bound: false, made: false });
    }
    let target = path_of(mount_name);
    let setup = CniError::new(code::CONTAINER_SETUP, format!("cannot bind-mount {cni_netns} to {}", target.display()));
    if is_netns(&target) {
        if same_file(path, &target) {
            return Ok(Netns { name: mount_name.to_string(), bound: true, made: false }); // a retried ADD
        }
        unbind(mount_name).map_err(|e| setup.clone().with_details(e))?;
    }
    bind(path, &target).map_err(|e| setup.with_details(e))?;
    Ok(Netns { name: mount_name.to_string(), bound: true, made: true })
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// `ip netns attach`: /run/netns made a shared mount point (so the mount
/// reaches vnetd in another mount namespace), an empty file, a bind mount.
fn bind(src: &Path, target: &Path) -> Result<(), String> {
    std::fs::create_dir_all(RUN_NETNS).map_err(|e| format!("cannot make {RUN_NETNS}: {e}"))?;
    let none = None::<&str>;
    if mount(none, RUN_NETNS, Some("none"), MsFlags::MS_SHARED | MsFlags::MS_REC, none).is_err() {
        // Not a mount point yet: make it one, then shared.
        mount(Some(RUN_NETNS), RUN_NETNS, Some("none"), MsFlags::MS_BIND | MsFlags::MS_REC, none)
            .and_then(|_| mount(none, RUN_NETNS, Some("none"), MsFlags::MS_SHARED | MsFlags::MS_REC, none))
            .map_err(|e| format!("cannot make {RUN_NETNS} a shared mount: {e}"))?;
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(target)
        .map_err(|e| format!("cannot create {}: {e}", target.display()))?;
    mount(Some(src), target, Some("none"), MsFlags::MS_BIND, none).map_err(|e| {
        let _ = std::fs::remove_file(target);
        format!("bind mount failed: {e}")
    })
}

/// Undoes a bind mount the plugin made (nothing there is fine).
pub fn unbind(name: &str) -> Result<(), String> {
    let target = path_of(name);
    if is_netns(&target) {
        umount2(&target, MntFlags::MNT_DETACH).map_err(|e| format!("cannot unmount {}: {e}", target.display()))?;
    }
    match std::fs::remove_file(&target) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(format!("cannot remove {}: {e}", target.display())),
        _ => Ok(()),
    }
}

/// iproute2's `ip`: from PATH, else where Debian puts it (a runtime may run
/// plugins with a thin PATH).
fn ip_binary() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|d| d.join("ip"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from("ip"))
}

/// Runs `ip -n <ns> <args>` with `stdin`; stdout, or the error text.
fn ip(ns: &str, args: &[&str], stdin: Option<&str>) -> Result<String, String> {
    let mut cmd = Command::new(ip_binary());
    cmd.arg("-n").arg(ns).args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd.stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() });
    let mut child = cmd.spawn().map_err(|e| format!("cannot run ip: {e}"))?;
    if let Some(text) = stdin {
        let _ = child.stdin.take().expect("piped").write_all(text.as_bytes());
    }
    let out = child.wait_with_output().map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

/// The `ip -batch` lines that bring `ifname` up with the result's
/// addresses and routes. A route without a gateway takes the gateway of
/// an address of its family, as the reference plugins do.
pub fn setup_lines(ifname: &str, result: &AddResult) -> Vec<String> {
    let mut lines = vec![format!("link set dev {ifname} up")];
    for ip in &result.ips {
        let nodad = if ip.address.is_v4() { "" } else { " nodad" };
        lines.push(format!("address add {} dev {ifname}{nodad}", ip.address));
    }
    let gateway = |v4: bool| result.ips.iter().filter(|i| i.address.is_v4() == v4).find_map(|i| i.gateway);
    for r in &result.routes {
        let mut l = format!("route add {}", r.dst.network());
        if let Some(gw) = r.gw.or_else(|| gateway(r.dst.is_v4())) {
            l += &format!(" via {gw}");
        }
        l += &format!(" dev {ifname}");
        for (word, v) in [("mtu", r.mtu), ("advmss", r.advmss), ("metric", r.priority), ("table", r.table), ("scope", r.scope)] {
            if let Some(v) = v {
                l += &format!(" {word} {v}");
            }
        }
        lines.push(l);
    }
    lines
}

/// Sets the device up with the IPAM result's addresses and routes.
pub fn configure(ns: &str, ifname: &str, result: &AddResult) -> CniResult<()> {
    let batch = setup_lines(ifname, result).join("\n") + "\n";
    ip(ns, &["-batch", "-"], Some(&batch)).map(drop).map_err(|e| {
        CniError::new(code::CONTAINER_SETUP, format!("cannot configure {ifname} in network namespace {ns}"))
            .with_details(e)
    })
}

/// A device in the namespace, as CHECK and DEL look at it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    pub ifindex: u64,
    pub mac: String,
    pub up: bool,
    pub addrs: Vec<Cidr>,
}

/// `ip -j addr show dev <ifname>`; `None` if there is no such device.
pub fn device(ns: &str, ifname: &str) -> Result<Option<Device>, String> {
    let out = match ip(ns, &["-j", "address", "show", "dev", ifname], None) {
        Ok(out) => out,
        Err(e) if e.contains("does not exist") => return Ok(None),
        Err(e) => return Err(e),
    };
    let v: Value = serde_json::from_str(&out).map_err(|e| format!("cannot read ip's JSON: {e}"))?;
    Ok(v.as_array().and_then(|a| a.first()).map(parse_device))
}

fn parse_device(d: &Value) -> Device {
    let addrs = d["addr_info"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| format!("{}/{}", a["local"].as_str()?, a["prefixlen"].as_u64()?).parse().ok())
        .collect();
    Device {
        ifindex: d["ifindex"].as_u64().unwrap_or(0),
        mac: d["address"].as_str().unwrap_or("").to_ascii_lowercase(),
        up: d["flags"].as_array().is_some_and(|f| f.iter().any(|f| f == "UP")),
        addrs,
    }
}

/// The destinations of every route in the namespace (all tables), of
/// IPv4 or IPv6.
pub fn route_destinations(ns: &str, v4: bool) -> Result<Vec<Cidr>, String> {
    let family = if v4 { "-4" } else { "-6" };
    let out = ip(ns, &["-j", family, "route", "show", "table", "all"], None)?;
    let v: Value = serde_json::from_str(&out).map_err(|e| format!("cannot read ip's JSON: {e}"))?;
    let default = if v4 { "0.0.0.0/0" } else { "::/0" };
    Ok(v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| {
            let dst = r["dst"].as_str()?;
            let dst = if dst == "default" { default } else { dst };
            dst.parse::<Cidr>().ok().map(|c| c.network())
        })
        .collect())
}

/// Deletes the device (for DEL when vnetd, which would have, is down).
pub fn delete_device(ns: &str, ifname: &str) -> Result<(), String> {
    ip(ns, &["link", "delete", "dev", ifname], None).map(drop)
}

/// Whether an address is one of the device's (same address and prefix).
pub fn has_address(dev: &Device, want: &Cidr) -> bool {
    dev.addrs.iter().any(|a| a.addr == want.addr && a.prefix == want.prefix)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::result::{IpConfig, Route};
    use serde_json::json;

    #[test]
    fn names_only_what_is_in_run_netns() {
        assert_eq!(named("/run/netns/cni-1234"), Some("cni-1234"));
        assert_eq!(named("/var/run/netns/blue"), Some("blue"));
        assert_eq!(named("/proc/42/ns/net"), None);
        assert_eq!(named("/run/netns/a/b"), None);
        assert_eq!(named("/run/netns/"), None);
    }

    #[test]
    fn setup_lines_follow_the_ipam_result() {
        let r = AddResult {
            ips: vec![
                IpConfig { address: "10.88.5.2/24".parse().unwrap(), gateway: Some("10.88.5.1".parse().unwrap()), interface: Some(0) },
                IpConfig { address: "fd00::2/64".parse().unwrap(), gateway: None, interface: Some(0) },
            ],
            routes: vec![
                Route { dst: "0.0.0.0/0".parse().unwrap(), gw: None, mtu: None, advmss: None, priority: None, table: None, scope: None },
                Route { dst: "10.9.1.7/16".parse().unwrap(), gw: Some("10.88.5.9".parse().unwrap()), mtu: Some(1400), advmss: None, priority: Some(5), table: None, scope: None },
                Route { dst: "fd01::/64".parse().unwrap(), gw: None, mtu: None, advmss: None, priority: None, table: None, scope: Some(253) },
            ],
            ..AddResult::default()
        };
        assert_eq!(
            setup_lines("eth0", &r),
            vec![
                "link set dev eth0 up",
                "address add 10.88.5.2/24 dev eth0",
                "address add fd00::2/64 dev eth0 nodad",
                "route add 0.0.0.0/0 via 10.88.5.1 dev eth0",
                "route add 10.9.0.0/16 via 10.88.5.9 dev eth0 mtu 1400 metric 5",
                "route add fd01::/64 dev eth0 scope 253",
            ]
        );
    }

    #[test]
    fn reads_ips_json() {
        let d = json!({"ifindex": 7, "ifname": "eth0", "flags": ["BROADCAST","MULTICAST","UP","LOWER_UP"],
                       "address": "02:AA:00:00:00:01",
                       "addr_info": [{"family":"inet","local":"10.88.5.2","prefixlen":24},
                                     {"family":"inet6","local":"fe80::1","prefixlen":64}]});
        let dev = parse_device(&d);
        assert_eq!(dev.ifindex, 7);
        assert_eq!(dev.mac, "02:aa:00:00:00:01");
        assert!(dev.up);
        assert!(has_address(&dev, &"10.88.5.2/24".parse().unwrap()));
        assert!(!has_address(&dev, &"10.88.5.2/16".parse().unwrap()));
    }
}
