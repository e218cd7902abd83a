"""Every kind of link end to end: TCP (with failure and recovery), direct
(a plain namespace on a LAN reaching a VNET guest), VXLAN against the
kernel's own VXLAN device, IPv6 underlays, and per-link MTUs."""

import signal
import subprocess
import time

import pytest

from netlab import REPO, guest_mac, mesh_config, overlay_ip, underlay_ip, underlay_ip6, wait_until

EXAMPLES = REPO / "examples" / "links"
from test_datapath import transfer
from test_overlay import build_mesh


def link_line(d, name):
    return next(l for l in d.ctl("LINK", "LIST").stdout.splitlines() if f"name={name} " in l)


def wait_state(d, name, state, timeout=15):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if f"state={state} " in link_line(d, name):
            return
        time.sleep(0.1)
    raise AssertionError(f"link {name} never {state}: {link_line(d, name)}")


def mesh(lab, layout, link, addr=underlay_ip, mtu=None):
    by_host = {h: [(f"g{n}", guest_mac(n)) for n in ns] for h, ns in layout.items()}
    hosts = {h: lab.add_host(h) for h in layout}
    configs = {h: mesh_config(h, by_host, link=link, addr=addr, mtu=mtu) for h in layout}
    daemons = {h: lab.start_vnetd(hosts[h], configs[h]) for h in layout}
    guests = {n: lab.attach_guest(hosts[h], f"g{n}", n) for h, ns in layout.items() for n in ns}
    return hosts, daemons, guests, configs


def test_tcp_link_carries_traffic_and_recovers_from_a_peer_restart(lab):
    hosts = {h: lab.add_host(h) for h in (1, 2)}
    # Host 2's guest NIC is a TAP vnetd makes in the guest's namespace, so it
    # outlives a killed vnetd and its guest can wait, socket open, for the
    # frames queued while host 2 was down (the shipped config, but `netns`).
    g2ns = lab.ns("g2")
    for k in ("all", "default"):
        lab.x(g2ns, "sysctl", "-qw", f"net.ipv6.conf.{k}.disable_ipv6=1")
    conf2 = (EXAMPLES / "tcp-h2.conf").read_text().replace("INTERFACE ADD g2 02:00:00:00:00:02",
                                                          f"INTERFACE ADD g2 02:00:00:00:00:02 netns {g2ns}")
    assert f"netns {g2ns}" in conf2
    d = {1: lab.start_vnetd(hosts[1], EXAMPLES / "tcp-h1.conf"), 2: lab.start_vnetd(hosts[2], conf2)}
    g = {1: lab.attach_guest(hosts[1], "g1", 1), 2: lab.veth_guest(hosts[2], "g2", 2, g2ns)}
    wait_state(d[1], "198.18.0.2", "up")
    wait_state(d[2], "198.18.0.1", "up")
    assert lab.ping(g[1], g[2], count=5).returncode == 0
    transfer(lab, g[1], g[2], 20_000_000)
    transfer(lab, g[2], g[1], 5_000_000, port=5002)
    # The peer dies: the link goes down, frames sent meanwhile queue up to
    # the bound and the rest are dropped and counted.
    d[2].stop(signal.SIGKILL)
    wait_state(d[1], "198.18.0.2", "down")
    # g2 waits for them: a socket that counts the blast's datagrams (a
    # receive buffer big enough for all that can wait) until 3 s pass
    # without one (30 s for the first).
    rx = lab.popen(g2ns, "python3", "-c",
                   "import socket\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
                   "s.setsockopt(socket.SOL_SOCKET,33,64<<20)  # SO_RCVBUFFORCE\n"
                   "s.bind(('198.19.0.2',7))\nprint('bound',flush=True)\ns.settimeout(30)\nn=0\n"
                   "try:\n    while True:\n        n+=s.recv(2048)==b'q'*1400\n        s.settimeout(3)\n"
                   "except OSError:\n    pass\n"
                   "print(n,flush=True)\n", stdout=subprocess.PIPE, text=True)
    assert rx.stdout.readline().strip() == "bound"
    # 6000 frames of 1442 bytes: as many as fit the 4 MiB send buffer (a
    # 4-byte length prefix each) wait, and exactly the rest are dropped.
    blast = ("import socket;s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM);"
             "[s.sendto(b'q'*1400,('198.19.0.2',7)) for _ in range(6000)]")
    # g2 cannot answer ARP now: pin its address so the blast is sent.
    lab.x(g[1].ns, "ip", "neigh", "replace", g[2].ip, "lladdr", g[2].mac, "dev", "g1", "nud", "permanent")
    before = d[1].stats()
    lab.x(g[1].ns, "python3", "-c", blast)
    fits = (4 << 20) // (1442 + 4)

    def routed():
        return d[1].stats()["interface g1"]["in_frames"] - before["interface g1"]["in_frames"]
    # (The guest's own TAP queue may drop some before vnetd sees them: count
    # what vnetd received, once it stops growing.)
    last, deadline = -1, time.time() + 5
    while routed() != last and time.time() < deadline:
        last = routed()
        time.sleep(0.3)
    n = routed()
    s = d[1].stats()
    assert n > fits + 1000, n
    assert s["link 198.18.0.2"]["drop_queue_full"] - before["link 198.18.0.2"]["drop_queue_full"] == n - fits
    # It comes back with the same config (taking g2's TAP over): the link
    # reconnects on its own, and the frames that waited reach the peer and
    # its guest, whole: host 2's link counts them in, g2's socket gets them.
    d2 = lab.start_vnetd(hosts[2], conf2)
    wait_state(d[1], "198.18.0.2", "up", timeout=20)
    out, _ = rx.communicate(timeout=30)
    assert int(out) == fits, (out, fits)
    assert d2.stats()["link 198.18.0.1"]["in_frames"] >= fits
    assert d2.stats()["link 198.18.0.1"]["drop_malformed"] == 0
    assert lab.reaches(g[1], g[2], tries=10)
    transfer(lab, g[1], g[2], 5_000_000, port=5003)
    assert "state=up" in link_line(d2, "198.18.0.1")


def test_tcp_link_from_an_unknown_address_is_refused(lab):
    hosts, d, g, _ = mesh(lab, {1: [1], 2: [2]}, link="9000 tcp key lab")
    wait_state(d[1], "198.18.0.2", "up")
    lab.x(hosts[2], "ip", "addr", "add", "198.18.0.99/24", "dev", "eth0")
    before = d[1].stats()["global"]["drop_unknown_sender"]
    lab.x(hosts[2], "python3", "-c",
          "import socket;s=socket.socket();s.bind(('198.18.0.99',0));s.connect(('198.18.0.1',9000));"
          "s.sendall(b'\\x00\\x00\\x00\\x40'+b'x'*64);s.recv(1)", check=False)  # vnetd closes it
    time.sleep(0.2)
    assert d[1].stats()["global"]["drop_unknown_sender"] == before + 1
    assert lab.reaches(g[1], g[2])


def kernel_vxlan_host(lab, h, remote, guest_n, mtu, v6=False, mac=None):
    """A host with no vnetd: a kernel vxlan device and a guest on a bridge."""
    host = lab.add_host(h)
    local = underlay_ip6(h) if v6 else underlay_ip(h)
    lab.x(host, "ip", "link", "add", "vx0", "type", "vxlan", "id", "42", "dstport", "4789",
          "remote", remote, "local", local, "dev", "eth0")
    lab.x(host, "ip", "link", "add", "br0", "type", "bridge")
    x = lab.ns(f"x{guest_n}")
    lab.x(x, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
    peer_mac = ["address", mac] if mac else []
    lab.x(host, "ip", "link", "add", "vg", "type", "veth", "peer", "name", "eth0", "netns", x, *peer_mac)
    for dev in ("vx0", "vg"):
        lab.x(host, "ip", "link", "set", dev, "master", "br0", "mtu", mtu, "up")
    lab.x(host, "ip", "link", "set", "br0", "up")
    lab.x(x, "ip", "link", "set", "eth0", "mtu", mtu, "up")
    # On a veth-only testbed no NIC ever completes the inner checksum the
    # guest leaves partial, and a UDP socket cannot tell: have the guest
    # compute its own, as it must where a real NIC is in the path.
    lab.x(x, "ethtool", "-K", "eth0", "tx", "off")
    lab.x(x, "ip", "addr", "add", f"{overlay_ip(guest_n)}/24", "dev", "eth0")
    mac = lab.x(x, "cat", "/sys/class/net/eth0/address").stdout.strip()
    return host, type("KernelGuest", (), {"ns": x, "ip": overlay_ip(guest_n), "mac": mac})()


@pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])
def test_vxlan_link_interoperates_with_the_kernels_vxlan(lab, v6):
    addr = underlay_ip6 if v6 else underlay_ip
    mtu = 1430 if v6 else 1450
    h1 = lab.add_host(1)
    _, x2 = kernel_vxlan_host(lab, 2, addr(1), 2, mtu, v6=v6, mac=guest_mac(2))
    config = (EXAMPLES / "vxlan.conf").read_text()
    if v6:  # the same example over the IPv6 underlay (IPv6 costs 20 bytes more)
        config = config.replace("LINK ADD 198.18.0.2", f"LINK ADD {addr(2)}").replace("mtu 1450", f"mtu {mtu}")
    d1 = lab.start_vnetd(h1, config)
    g1 = lab.attach_guest(h1, "g1", 1)
    assert lab.reaches(g1, x2), d1.ctl("STATS").stdout
    assert lab.reaches(x2, g1)
    transfer(lab, g1, x2, 20_000_000)
    transfer(lab, x2, g1, 20_000_000, port=5002)
    s = d1.stats()["link vx"]
    assert s["in_frames"] > 10_000 and s["out_frames"] > 10_000
    assert d1.stats()["global"]["drop_malformed"] == 0


def test_vxlan_datagram_with_an_unknown_vni_is_dropped_and_counted(lab):
    h1 = lab.add_host(1)
    h2, x2 = kernel_vxlan_host(lab, 2, underlay_ip(1), 2, 1450)
    # Host 2's kernel speaks VNI 42; host 1 only knows VNI 7 from it.
    d1 = lab.start_vnetd(h1, "INTERFACE ADD g1 02:00:00:00:00:01\nLINK ADD 198.18.0.2 vxlan vni 7 name vx\n"
                             "ROUTE ADD any any interface 02:00:00:00:00:01 edge\n")
    lab.attach_guest(h1, "g1", 1)
    lab.x(x2.ns, "ping", "-c", "2", "-W", "1", "198.19.0.1", check=False)
    assert d1.stats()["global"]["drop_unknown_sender"] >= 2
    assert d1.stats()["interface g1"]["out_frames"] == 0


def test_direct_link_puts_a_plain_lan_host_on_the_overlay(lab):
    # Host 1 has a second NIC, eth1, on a plain LAN (a bridge in namespace
    # "lan") where a plain namespace P lives, with no vnetd of its own.
    h1, h2 = lab.add_host(1), lab.add_host(2)
    lan = lab.ns("lan")
    lab.x(lan, "ip", "link", "add", "br0", "type", "bridge")
    lab.x(lan, "ip", "link", "set", "br0", "up")
    p = lab.ns("p50")
    p_mac = "02:00:00:00:00:50"
    subprocess.run(["ip", "link", "add", "eth1", "netns", h1, "type", "veth", "peer", "name", "l1", "netns", lan], check=True)
    subprocess.run(["ip", "link", "add", "eth0", "netns", p, "address", p_mac, "type", "veth",
                    "peer", "name", "l2", "netns", lan], check=True)
    for dev in ("l1", "l2"):
        lab.x(lan, "ip", "link", "set", dev, "master", "br0", "up")
    lab.x(h1, "ip", "link", "set", "eth1", "up")
    lab.x(p, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
    lab.x(p, "ip", "addr", "add", f"{overlay_ip(50)}/24", "dev", "eth0")
    lab.x(p, "ip", "link", "set", "eth0", "up")
    # Direct links only on the devices the administrator allowed.
    d1 = lab.start_vnetd(h1, EXAMPLES / "direct.conf", "--allow-direct", "eth1")
    lab.start_vnetd(h2, EXAMPLES / "direct-h2.conf")
    g2 = lab.attach_guest(h2, "g2", 2)
    pg = type("LanHost", (), {"ns": p, "ip": overlay_ip(50), "mac": p_mac})()
    assert "proto=direct" in d1.ctl("LINK", "LIST").stdout
    assert lab.reaches(pg, g2)  # ARP from the LAN through the overlay
    assert lab.reaches(g2, pg)
    assert g2.mac in lab.x(p, "ip", "neigh").stdout
    transfer(lab, pg, g2, 20_000_000)
    transfer(lab, g2, pg, 5_000_000, port=5002)
    s = d1.stats()["link lan"]
    assert s["in_frames"] > 0 and s["out_frames"] > 0
    assert s["drop_oversize"] == 0
    # A frame bigger than the LAN takes (g2 at MTU 9000, the LAN at 1500) is
    # not put on it: dropped and counted on the direct link.
    lab.x(g2.ns, "ip", "link", "set", "g2", "mtu", "9000")
    lab.x(g2.ns, "ip", "neigh", "replace", pg.ip, "lladdr", p_mac, "dev", "g2", "nud", "permanent")
    r = lab.x(g2.ns, "ping", "-c", "3", "-i", "0.2", "-W", "1", "-s", "8000", pg.ip, check=False)
    assert "0 received" in r.stdout, r.stdout
    assert wait_until(lambda: d1.stats()["link lan"]["drop_oversize"] == 3, timeout=5), d1.stats()["link lan"]
    assert d1.stats()["link lan"]["out_frames"] == s["out_frames"]
    assert d1.stats()["global"]["drop_oversize"] == 3


def test_ipv6_underlay_udp_then_tcp_switched_at_run_time(lab):
    hosts = {h: lab.add_host(h) for h in (1, 2)}
    d = {h: lab.start_vnetd(hosts[h], EXAMPLES / f"ipv6-h{h}.conf") for h in (1, 2)}
    g = {h: lab.attach_guest(hosts[h], f"g{h}", h) for h in (1, 2)}
    line = link_line(d[1], "v6-udp")
    assert f"remote=[{underlay_ip6(2)}]:9000" in line and "max_frame=1452" in line  # 1500 - 48
    assert lab.reaches(g[1], g[2]), d[1].ctl("STATS").stdout
    transfer(lab, g[1], g[2], 20_000_000)
    assert d[1].stats()["link v6-udp"]["out_frames"] > 10_000
    # Move the guests' traffic onto the TCP link, on both hosts, while running.
    wait_state(d[1], "v6-tcp", "up")
    for h in (1, 2):
        peer = guest_mac(3 - h)
        d[h].ctl_file(f"ROUTE DEL any {peer} edge v6-udp any\n"
                      "ROUTE DEL any ff:ff:ff:ff:ff:ff edge v6-udp interface\n"
                      f"ROUTE ADD any {peer} edge v6-tcp any\n"
                      "ROUTE ADD any ff:ff:ff:ff:ff:ff edge v6-tcp interface\n")
    udp_before = d[1].stats()["link v6-udp"]["out_frames"]
    transfer(lab, g[1], g[2], 20_000_000, port=5002)
    assert d[1].stats()["link v6-tcp"]["out_frames"] > 10_000
    assert d[1].stats()["link v6-udp"]["out_frames"] == udp_before


def test_per_link_mtu_is_advertised_and_enforced(lab):
    _, d, g, _ = mesh(lab, {1: [1], 2: [2]}, link="9000 udp mtu 1200", mtu=1458)
    line = link_line(d[1], "198.18.0.2")
    assert "mtu=1200 max_frame=1172" in line
    transfer(lab, g[1], g[2], 10_000_000)
    s = d[1].stats()["link 198.18.0.2"]
    assert s["out_bytes"] / s["out_frames"] <= 1172
    off = d[1].stats()["offload"]
    assert off["segmented"] > 0
    # Not one frame bigger than the link's max_frame (the average would hide it).
    assert off["fragmented"] == 0, off
