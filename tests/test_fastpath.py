"""End to end: the kernel fast path. Guests on veth (`INTERFACE ADD ... netns
<ns> veth`), one vnetd per host with its eBPF programs loaded; real ping and
TCP across hosts, checked by what the guests see and by STATS saying which
path carried the frames."""

import time

import pytest

from netlab import Guest, Lab, REPO, guest_mac, mesh_config, overlay_ip, underlay_ip, wait_until

XFER = REPO / "tests" / "tools" / "xfer.py"

# Guest MTU that lets every frame cross a 1500-byte underlay whole (the
# VNET/P wire adds 42 bytes: outer IPv4, UDP, and the frame's own Ethernet).
FAST_MTU = 1458


def veth_mesh(lab: Lab, layout: dict[int, list[int]], mtu=FAST_MTU, extra: dict[int, str] | None = None):
    """layout: host number -> guest numbers. Every guest is a namespace with
    a veth from its host's vnetd. `extra`: more config lines per host.
    Returns (hosts, daemons, guests)."""
    hosts = {h: lab.add_host(h) for h in layout}
    gns = {}
    for ns in layout.values():
        for n in ns:
            g = lab.ns(f"g{n}")
            lab.x(g, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
            lab.x(g, "sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1")
            gns[n] = g
    by_host = {h: [(f"g{n}", guest_mac(n)) for n in ns] for h, ns in layout.items()}
    attach = {f"g{n}": f"netns {gns[n]} veth" for n in gns}
    daemons = {}
    for h in layout:
        conf = mesh_config(h, by_host, mtu=mtu, attach=attach) + ((extra or {}).get(h, ""))
        daemons[h] = lab.start_vnetd(hosts[h], conf)
    guests = {}
    for h, ns in layout.items():
        for n in ns:
            g = gns[n]
            lab.x(g, "ip", "addr", "add", f"{overlay_ip(n)}/24", "dev", f"g{n}")
            lab.x(g, "ip", "link", "set", f"g{n}", "up")
            guests[n] = Guest(ns=g, tap=f"g{n}", mac=guest_mac(n), ip=overlay_ip(n), host=hosts[h])
    return hosts, daemons, guests


def fast(d) -> dict:
    return d.stats()["fastpath"]


def transfer(lab, src: Guest, dst: Guest, n: int, port=5001):
    recv = lab.popen(dst.ns, "python3", XFER, "recv", port, stdout=-1, text=True)
    assert recv.stdout.readline().strip() == "listening"
    sent = lab.x(src.ns, "python3", XFER, "send", dst.ip, port, n, timeout=300).stdout.split()
    got = recv.communicate(timeout=60)[0].split()
    assert sent[0] == str(n)
    assert got == sent, f"sent {sent}, received {got}"


def tx_packets(lab, g: Guest) -> int:
    return int(lab.x(g.ns, "cat", f"/sys/class/net/{g.tap}/statistics/tx_packets").stdout)


def test_veth_guests_ping_across_hosts_in_the_kernel(lab):
    _, d, g = veth_mesh(lab, {1: [1], 2: [2]})
    assert "path=kernel" in d[1].ctl("INTERFACE", "LIST").stdout
    r = lab.ping(g[1], g[2], count=50)
    assert "50 received" in r.stdout, r.stdout
    s1, s2 = d[1].stats(), d[2].stats()
    f1 = s1["fastpath"]
    assert (f1["loaded"], f1["enabled"]) == ("yes", "yes"), f1
    # After the first exchange (ARP, the first echo) the kernel carries it:
    # host 1 encapsulated g1's echoes and decapsulated g2's replies.
    assert f1["hit_guest"] >= 45 and f1["hit_net"] >= 45, f1
    assert s1["interface g1"]["fast_in_frames"] >= 45, s1["interface g1"]
    assert s1["link 198.18.0.2"]["fast_out_frames"] >= 45, s1
    # vnetd itself saw only the first few frames of the flow.
    slow_in = s1["interface g1"]["in_frames"] - s1["interface g1"]["fast_in_frames"]
    assert slow_in <= 5, s1["interface g1"]
    assert s2["paths"]["kernel_frames"] >= 90, s2["paths"]


def test_200mb_tcp_both_ways_arrives_intact_in_the_kernel(lab):
    _, d, g = veth_mesh(lab, {1: [1], 2: [2]})
    transfer(lab, g[1], g[2], 200 * 1000 * 1000)
    transfer(lab, g[2], g[1], 200 * 1000 * 1000, port=5002)
    for h in (1, 2):
        f = fast(d[h])
        # Super-frames crossed whole: far fewer hits than 1458-byte frames.
        assert f["hit_guest"] > 1000 and f["hit_net"] > 1000, f
        assert f["drop_encap"] == 0 and f["drop_decap"] == 0, f
        s = d[h].stats()[f"interface g{h}"]
        assert s["in_frames"] - s["fast_in_frames"] < 100, s


def test_local_guests_are_delivered_in_the_kernel(lab):
    _, d, g = veth_mesh(lab, {1: [1, 3], 2: [2]})
    r = lab.ping(g[1], g[3], count=20)
    assert "20 received" in r.stdout, r.stdout
    f = fast(d[1])
    assert f["hit_guest"] >= 30, f
    s = d[1].stats()
    assert s["interface g3"]["fast_out_frames"] >= 15, s["interface g3"]


def test_route_deleted_stops_kernel_traffic_and_added_back_restores_it(lab):
    _, d, g = veth_mesh(lab, {1: [1], 2: [2]})
    assert "10 received" in lab.ping(g[1], g[2], count=10).stdout
    rule = f"any {g[2].mac} edge {underlay_ip(2)} any"
    entries = fast(d[1])["entries"]
    assert entries >= 1
    d[1].ctl("ROUTE", "DEL", *rule.split())
    # The reply means "in force": the kernel's entry for the flow is gone.
    f = fast(d[1])
    assert f["revoked"] >= 1 and f["entries"] < entries, f
    before = d[1].stats()["interface g1"]["drop_no_route"]
    assert lab.ping(g[1], g[2], count=5, wait=1).returncode != 0
    assert d[1].stats()["interface g1"]["drop_no_route"] >= before + 5
    d[1].ctl("ROUTE", "ADD", *rule.split())
    hits = fast(d[1])["hit_guest"]
    assert "10 received" in lab.ping(g[1], g[2], count=10).stdout
    assert fast(d[1])["hit_guest"] >= hits + 8


def test_route_change_under_traffic_never_sends_to_the_old_destination(lab):
    """A flow in the kernel is moved to another guest by a route change: no
    frame reaches the old destination once the reply is back."""
    _, d, g = veth_mesh(lab, {1: [1, 3], 2: [2]})
    assert lab.reaches(g[1], g[3])
    # g1's frames to g3's MAC now go to the link instead (host 2 drops them:
    # no route there for g3's MAC).
    pinger = lab.popen(g[1].ns, "ping", "-n", "-q", "-i", "0.01", "-c", "300", g[3].ip, stdout=-1, text=True)
    time.sleep(0.5)
    d[1].ctl_file(f"ROUTE DEL any {g[3].mac} interface {g[3].mac} any\n"
                  f"ROUTE ADD any {g[3].mac} edge {underlay_ip(2)} any\n")
    rx_after = int(lab.x(g[3].ns, "cat", f"/sys/class/net/{g[3].tap}/statistics/rx_packets").stdout)
    time.sleep(1.0)
    rx_later = int(lab.x(g[3].ns, "cat", f"/sys/class/net/{g[3].tap}/statistics/rx_packets").stdout)
    assert rx_later == rx_after, "frames reached g3 after its route was changed"
    pinger.wait(timeout=30)
    assert d[2].stats()["link 198.18.0.1"]["in_frames"] >= 50


def test_fast_host_and_user_host_interoperate(lab):
    _, d, g = veth_mesh(lab, {1: [1], 2: [2]}, extra={2: "SET datapath user\n"})
    assert "datapath=user" in d[2].ctl("SHOW").stdout
    transfer(lab, g[1], g[2], 50 * 1000 * 1000)
    transfer(lab, g[2], g[1], 50 * 1000 * 1000, port=5002)
    assert "20 received" in lab.ping(g[1], g[2], count=20).stdout
    f1, f2 = fast(d[1]), fast(d[2])
    assert f1["hit_guest"] > 100, f1
    assert f2["enabled"] == "no" and f2["hit_guest"] == 0 and f2["hit_net"] == 0 and f2["entries"] == 0, f2
    assert d[2].stats()["paths"]["kernel_frames"] == 0


def test_datapath_setting_switches_at_run_time(lab):
    _, d, g = veth_mesh(lab, {1: [1], 2: [2]})
    assert "datapath=auto" in d[1].ctl("SHOW").stdout
    assert lab.reaches(g[1], g[2])
    d[1].ctl("SET", "datapath", "user")
    f = fast(d[1])
    assert f["enabled"] == "no" and f["entries"] == 0, f
    hits = f["hit_guest"]
    assert "10 received" in lab.ping(g[1], g[2], count=10).stdout
    f = fast(d[1])
    assert f["hit_guest"] == hits and f["disabled"] >= 10, f
    d[1].ctl("SET", "datapath", "kernel")
    assert "10 received" in lab.ping(g[1], g[2], count=10).stdout
    assert fast(d[1])["hit_guest"] >= hits + 8
    bad = d[1].ctl("SET", "datapath", "fast", check=False)
    assert bad.returncode != 0 and "not a datapath" in bad.stderr + bad.stdout


def test_counters_add_up(lab):
    """Every frame a guest sent is counted once: on the fast path or the
    slow path, or as a drop with its reason."""
    _, d, g = veth_mesh(lab, {1: [1], 2: [2]})
    lab.ping(g[1], g[2], count=30)
    transfer(lab, g[1], g[2], 20 * 1000 * 1000)
    time.sleep(0.3)
    s = d[1].stats()["interface g1"]
    drops = sum(v for k, v in s.items() if k.startswith("drop_"))
    f = fast(d[1])
    kernel_drops = f["drop_encap"] + f["drop_decap"]
    assert tx_packets(lab, g[1]) == s["in_frames"] + drops + kernel_drops, (s, f)


def test_veth_guest_stays_across_a_vnetd_restart_and_goes_with_interface_del(lab):
    hosts, d, g = veth_mesh(lab, {1: [1], 2: [2]})
    assert lab.reaches(g[1], g[2])
    d[1].stop()
    # The guest keeps its NIC, MAC and address while vnetd is away.
    link = lab.x(g[1].ns, "ip", "-o", "link", "show", "g1").stdout
    assert g[1].mac in link, link
    d1 = lab.start_vnetd(hosts[1], mesh_config(1, {1: [("g1", g[1].mac)], 2: [("g2", g[2].mac)]},
                                                 mtu=FAST_MTU, attach={"g1": f"netns {g[1].ns} veth"}))
    assert lab.reaches(g[1], g[2])
    assert "10 received" in lab.ping(g[1], g[2], count=10).stdout
    assert fast(d1)["hit_guest"] >= 8
    d1.ctl_file(f"ROUTE DEL any {g[1].mac} interface {g[1].mac} any\n"
                f"ROUTE DEL any ff:ff:ff:ff:ff:ff interface {g[1].mac} any\n"
                "INTERFACE DEL g1\n")
    gone = lab.x(g[1].ns, "ip", "link", "show", "g1", check=False)
    assert gone.returncode != 0, gone.stdout


def test_a_device_vnetd_did_not_make_is_refused_and_left_alone(lab):
    host = lab.add_host(1)
    gns = lab.ns("g1")
    d = lab.start_vnetd(host)
    # Someone else's device already has the guest's name in the namespace.
    lab.x(gns, "ip", "link", "add", "g1", "type", "veth", "peer", "name", "theirs")
    r = d.ctl("INTERFACE", "ADD", "g1", guest_mac(1), "netns", gns, "veth", check=False)
    assert r.returncode != 0 and "exists there" in r.stderr + r.stdout, r
    # Theirs, untouched: still paired with its own peer.
    assert "g1@theirs" in lab.x(gns, "ip", "-o", "link", "show", "g1").stdout
    # Nothing was left behind on the host either.
    assert d.ctl("INTERFACE", "LIST").stdout.strip() == ""
    names = [l.split(":")[1].strip().split("@")[0] for l in lab.x(host, "ip", "-o", "link").stdout.splitlines()]
    assert not [n for n in names if n.startswith(("vh", "vu"))], names
