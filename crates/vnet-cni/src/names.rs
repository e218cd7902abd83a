//! What the plugin derives from an attachment's identity, the pair
//! (CNI_CONTAINERID, CNI_IFNAME): vnetd's interface name, the container's
//! MAC when none is given, and the name of the /run/netns bind mount the
//! plugin makes for a namespace given by another path. All are hashes of
//! that pair, so a retried ADD, a DEL without state and a GC all arrive at
//! the same names.

use sha2::{Digest, Sha256};
use vnet_core::Mac;

/// SHA-256 of the pair, with a domain word so each use gets its own bits.
fn digest(domain: &str, container_id: &str, ifname: &str) -> [u8; 32] {
    let mut h = Sha256::new();
    for part in [domain, container_id, ifname] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    h.finalize().into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// vnetd's name for the attachment's interface: `c` and 12 hex digits (48
/// bits of the hash), 13 characters, within a device name's 15. Names must
/// be unique per vnetd; a collision among a host's containers would need
/// about 2^24 of them.
pub fn interface_name(container_id: &str, ifname: &str) -> String {
    format!("c{}", hex(&digest("interface", container_id, ifname)[..6]))
}

/// The name under /run/netns the plugin bind-mounts a namespace given as
/// another path (e.g. /proc/<pid>/ns/net) to, since vnetd takes a name.
pub fn netns_mount_name(container_id: &str, ifname: &str) -> String {
    format!("vnet-cni-{}", hex(&digest("netns", container_id, ifname)[..6]))
}

/// A MAC for a container that was given none: unicast and locally
/// administered (first byte `xxxxxx10`), the other 46 bits from the hash.
/// Container IDs are unique, so the MAC is unique in the overlay too, which
/// VNET needs (vnet-agent keys guests by MAC).
pub fn derived_mac(container_id: &str, ifname: &str) -> Mac {
    let d = digest("mac", container_id, ifname);
    let mut b: [u8; 6] = d[..6].try_into().expect("6 of 32 bytes");
    b[0] = (b[0] & 0xfc) | 0x02;
    Mac(b)
}

/// A plain name as vnetd takes them: 1 to `max` of `A-Za-z0-9_.-`, never
/// `.` or `..`.
pub fn is_plain_name(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s != "."
        && s != ".."
        && s.chars().all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
}

/// A name as CNI wants container IDs and network names: an alphanumeric
/// first character, then alphanumerics, `_`, `.` and `-`.
pub fn is_cni_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
}

/// The VNET network of a config that names none: the CNI network's name if
/// vnetd takes it as a network name, else vnetd's `default`.
pub fn default_network(cni_name: &str) -> String {
    if is_plain_name(cni_name, 64) {
        cni_name.to_string()
    } else {
        vnet_core::command::DEFAULT_NETWORK.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_names_are_short_stable_and_distinct() {
        let a = interface_name("4f1c0a9d2e", "eth0");
        assert_eq!(a, interface_name("4f1c0a9d2e", "eth0"), "the same pair, the same name");
        assert_ne!(a, interface_name("4f1c0a9d2e", "eth1"));
        assert_ne!(a, interface_name("4f1c0a9d2f", "eth0"));
        assert_eq!(a.len(), 13);
        assert!(a.starts_with('c') && a[1..].chars().all(|c| c.is_ascii_hexdigit()));
        vnet_core::command::check_ifname(&a).unwrap();
        // The separator keeps ("ab", "c") and ("a", "bc") apart.
        assert_ne!(interface_name("ab", "c"), interface_name("a", "bc"));
    }

    #[test]
    fn netns_mount_names_are_valid_netns_names() {
        let n = netns_mount_name("cnitool-0123456789abcdef0123", "eth0");
        assert_eq!(n, netns_mount_name("cnitool-0123456789abcdef0123", "eth0"));
        assert!(n.starts_with("vnet-cni-") && n.len() == 21);
        vnet_core::command::check_netns_name(&n).unwrap();
    }

    #[test]
    fn derived_macs_are_local_unicast_and_stable() {
        for i in 0..200 {
            let id = format!("container-{i}");
            let m = derived_mac(&id, "eth0");
            assert_eq!(m, derived_mac(&id, "eth0"));
            assert_eq!(m.0[0] & 0x01, 0, "{m} must be unicast");
            assert_eq!(m.0[0] & 0x02, 0x02, "{m} must be locally administered");
            assert_ne!(m, derived_mac(&id, "eth1"));
        }
    }

    #[test]
    fn names_checked_as_cni_and_vnetd_check_them() {
        assert!(is_cni_name("a") && is_cni_name("9f.x_y-z"));
        assert!(!is_cni_name("") && !is_cni_name("-a") && !is_cni_name("a/b") && !is_cni_name("a b"));
        assert!(is_plain_name("blue", 64) && !is_plain_name("..", 64) && !is_plain_name(&"x".repeat(65), 64));
        assert_eq!(default_network("vnet-blue"), "vnet-blue");
        assert_eq!(default_network(&"n".repeat(80)), "default");
    }
}
