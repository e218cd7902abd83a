"""What a control request can make root do on the host, confined: vnetd
takes over and deletes only the TAPs it made (marked with ifalias "vnetd"),
enters only network namespaces that are files directly in /run/netns, and
puts direct links only on the devices named with --allow-direct."""

import os
import signal
from pathlib import Path

from netlab import guest_mac

QEMU_MAC = "52:54:00:00:00:21"
NOT_OURS = "exists and was not made by vnetd"


def dev_name(lab, suffix):
    """A device name carrying the lab's prefix (it fits IFNAMSIZ)."""
    name = lab.prefix + suffix
    assert len(name) <= 15, name
    return name


def link_show(lab, ns, dev):
    """`ip -d link show` of a device in a namespace, or None if there is none."""
    p = lab.x(ns, "ip", "-d", "link", "show", "dev", dev, check=False)
    return p.stdout if p.returncode == 0 else None


def refused(d, *words, text=None):
    """The request fails; returns vnetd's reason."""
    p = d.ctl_file(text, check=False) if text is not None else d.ctl(*words, check=False)
    assert p.returncode != 0, p.stdout
    return p.stdout + p.stderr


def ifaces(d):
    return d.ctl("INTERFACE", "LIST").stdout


def test_a_foreign_tap_or_tun_on_the_host_is_refused_and_left_alone(lab):
    h = lab.add_host(1)
    d = lab.start_vnetd(h)
    tap, tun = dev_name(lab, "x"), dev_name(lab, "u")
    lab.x(h, "ip", "tuntap", "add", tap, "mode", "tap")
    lab.x(h, "ip", "tuntap", "add", tun, "mode", "tun")
    before = {dev: link_show(lab, h, dev) for dev in (tap, tun)}
    for dev in (tap, tun):
        # As a QEMU TAP, and as a plain one: refused, saying why.
        for req in ([dev, QEMU_MAC, "qemu"], [dev, QEMU_MAC]):
            reason = refused(d, "INTERFACE", "ADD", *req)
            assert f"a device named {dev} {NOT_OURS}" in reason, reason
        # Inside a request whose later line is bad.
        reason = refused(d, text=f"INTERFACE ADD {dev} {QEMU_MAC} qemu\nROUTE ADD any {QEMU_MAC} edge nowhere any\n")
        assert NOT_OURS in reason, reason
        # The same line first in a request that fails on a bad line later on.
        reason = refused(d, text=f"LINK ADD 198.18.0.9\nINTERFACE ADD {dev} {QEMU_MAC} qemu\n")
        assert NOT_OURS in reason, reason
    # Both devices are still there, exactly as they were: not taken over,
    # not marked, not deleted.
    for dev in (tap, tun):
        assert link_show(lab, h, dev) == before[dev], dev
        assert "alias vnetd" not in before[dev]
    assert "name=" not in ifaces(d)


def test_vnetds_own_qemu_tap_stays_when_detached_and_goes_when_deleted(lab):
    h = lab.add_host(1)
    vm = dev_name(lab, "v")
    config = f"INTERFACE ADD {vm} {QEMU_MAC} qemu\n"
    d = lab.start_vnetd(h, config)
    shown = link_show(lab, h, vm)
    assert shown and "tun type tap" in shown, shown
    index = shown.split(":")[0]
    # A vnetd killed outright leaves the TAP; started again, it takes it over.
    d.stop(signal.SIGKILL)
    assert link_show(lab, h, vm) is not None
    d = lab.start_vnetd(h, config)
    assert f"name={vm} " in ifaces(d) and "attach=qemu" in ifaces(d)
    # Detach (a migration): vnetd lets go of the TAP, which stays for QEMU.
    d.ctl("INTERFACE", "DEL", vm, "detach")
    assert f"name={vm} " not in ifaces(d)
    shown = link_show(lab, h, vm)
    assert shown is not None and shown.split(":")[0] == index, shown
    # It carries vnetd's mark, as `ip link` shows.
    assert "alias vnetd" in shown, shown
    # A request that takes it over and then fails leaves it too.
    refused(d, text=f"INTERFACE ADD {vm} {QEMU_MAC} qemu\nROUTE ADD any {QEMU_MAC} edge nowhere any\n")
    assert link_show(lab, h, vm) is not None
    # Taken over again, then deleted for good.
    d.ctl("INTERFACE", "ADD", vm, QEMU_MAC, "qemu")
    assert link_show(lab, h, vm).split(":")[0] == index
    d.ctl("INTERFACE", "DEL", vm)
    assert link_show(lab, h, vm) is None
    # One that vnetd makes in a request that fails goes with the request.
    refused(d, text=f"INTERFACE ADD {vm} {QEMU_MAC} qemu\nROUTE ADD any {QEMU_MAC} edge nowhere any\n")
    assert link_show(lab, h, vm) is None


def test_a_foreign_tap_in_a_guest_namespace_is_refused_and_left_alone(lab):
    h = lab.add_host(1)
    g = lab.ns("g1")
    d = lab.start_vnetd(h)
    mac = guest_mac(1)
    for mode, dev in (("tap", "gx"), ("tun", "gu")):
        lab.x(g, "ip", "tuntap", "add", dev, "mode", mode)
        before = link_show(lab, g, dev)
        reason = refused(d, "INTERFACE", "ADD", dev, mac, "netns", g)
        assert f"a device named {dev} {NOT_OURS}" in reason and g in reason, reason
        reason = refused(d, text=f"INTERFACE ADD {dev} {mac} netns {g}\nINTERFACE DEL {dev}\nLINK DEL nowhere\n")
        assert NOT_OURS in reason, reason
        assert link_show(lab, g, dev) == before
    # A device that is no TAP at all.
    lab.x(g, "ip", "link", "add", "gv", "type", "veth", "peer", "name", "gw")
    reason = refused(d, "INTERFACE", "ADD", "gv", mac, "netns", g)
    assert NOT_OURS in reason, reason
    assert link_show(lab, g, "gv") is not None
    assert "name=" not in ifaces(d)
    # A TAP vnetd makes there carries the mark, and a detached one is taken
    # over again (a restart or a migration).
    d.ctl("INTERFACE", "ADD", "g1", mac, "netns", g)
    assert "alias vnetd" in link_show(lab, g, "g1")
    d.ctl("INTERFACE", "DEL", "g1", "detach")
    assert link_show(lab, g, "g1") is not None
    d.ctl("INTERFACE", "ADD", "g1", mac, "netns", g)
    d.ctl("INTERFACE", "DEL", "g1")
    assert link_show(lab, g, "g1") is None


def test_netns_names_are_confined_to_files_in_run_netns(lab):
    h = lab.add_host(1)
    other = lab.ns("g2")
    d = lab.start_vnetd(h)
    mac = guest_mac(3)
    planted = {
        # A symbolic link to vnetd's own namespace (the host's)...
        Path("/run/netns") / (lab.prefix + "self"): "/proc/self/ns/net",
        # ...and to another namespace's entry.
        Path("/run/netns") / (lab.prefix + "other"): f"/run/netns/{other}",
    }
    plain_file = Path("/run/netns") / (lab.prefix + "file")
    try:
        for link, target in planted.items():
            os.symlink(target, link)
        plain_file.write_text("")
        for ns in ("../x", f"../netns/{other}", f"/run/netns/{other}", "/proc/1/ns/net", ".."):
            reason = refused(d, "INTERFACE", "ADD", "t3", mac, "netns", ns)
            assert "is not a network namespace name" in reason, (ns, reason)
        for link in planted:
            reason = refused(d, "INTERFACE", "ADD", "t3", mac, "netns", link.name)
            assert f"/run/netns/{link.name} is a symbolic link" in reason, reason
        reason = refused(d, "INTERFACE", "ADD", "t3", mac, "netns", plain_file.name)
        assert f"/run/netns/{plain_file.name} is not a network namespace" in reason, reason
        # Nothing was made anywhere.
        for ns in (h, other):
            assert link_show(lab, ns, "t3") is None, ns
        assert "name=" not in ifaces(d)
        # The namespace itself, by its plain name, works.
        d.ctl("INTERFACE", "ADD", "t3", mac, "netns", other)
        assert link_show(lab, other, "t3") is not None
    finally:
        for p in (*planted, plain_file):
            try:
                p.unlink()
            except FileNotFoundError:
                pass


def packet_sockets(lab, ns, dev):
    """Packet sockets bound to `dev` in namespace `ns` (/proc/net/packet)."""
    index = lab.x(ns, "cat", f"/sys/class/net/{dev}/ifindex").stdout.strip()
    rows = lab.x(ns, "cat", "/proc/net/packet").stdout.splitlines()[1:]
    return sum(1 for r in rows if r.split()[4] == index)


def test_direct_links_only_on_devices_allowed_at_start(lab):
    h = lab.add_host(1, mtu=1400)
    # No device allowed: eth0 is refused, with the way to allow it.
    d = lab.start_vnetd(h)
    reason = refused(d, "LINK", "ADD", "direct", "eth0")
    assert "device eth0 is not allowed for direct links (start vnetd with --allow-direct eth0)" in reason, reason
    # Refused whether the device exists or not: nothing is learnt about it.
    reason = refused(d, "LINK", "ADD", "direct", "nosuchdev")
    assert "device nosuchdev is not allowed for direct links" in reason, reason
    assert "name=" not in d.ctl("LINK", "LIST").stdout
    assert packet_sockets(lab, h, "eth0") == 0
    d.stop()
    # Another device allowed: eth0 still refused; lo, allowed too, works.
    d = lab.start_vnetd(h, None, "--allow-direct", "eth1,lo")
    assert "not allowed for direct links" in refused(d, "LINK", "ADD", "direct", "eth0")
    assert packet_sockets(lab, h, "eth0") == 0
    d.stop()
    d = lab.start_vnetd(h, None, "--allow-direct", "eth1", "--allow-direct", "eth0")
    d.ctl("LINK", "ADD", "direct", "eth0", "name", "lan")
    line = d.ctl("LINK", "LIST").stdout
    # Its MTU is the device's, read in vnetd's own namespace.
    assert "name=lan " in line and "proto=direct" in line and "mtu=1400 " in line, line
    assert packet_sockets(lab, h, "eth0") == 1
    d.ctl("LINK", "DEL", "lan")
    assert packet_sockets(lab, h, "eth0") == 0
