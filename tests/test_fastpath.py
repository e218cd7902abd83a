"""End to end: the kernel fast path. Guests on veth (`INTERFACE ADD ... netns
<ns> veth`), one vnetd per host with its eBPF programs loaded; real ping and
TCP across hosts, checked by what the guests see and by STATS saying which
path carried the frames."""

import re
import shutil
import signal
import subprocess
import time

import pytest

from netlab import FAST_MTU, Guest, Lab, REPO, UnixSession, guest_mac, mesh_config, overlay_ip, underlay_ip, underlay_ip6, veth_mesh, wait_until

XFER = REPO / "tests" / "tools" / "xfer.py"
UNDERLAY = REPO / "tests" / "tools" / "underlay.py"
SPOOF = REPO / "tests" / "tools" / "spoof.py"

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


def rx_packets(lab, g: Guest) -> int:
    return int(lab.x(g.ns, "cat", f"/sys/class/net/{g.tap}/statistics/rx_packets").stdout)


def from_peer(lab, hosts, kind: str, count: int, inner_dst: str, inner_src: str, rate: float = 0,
              dst_mac: str | None = None, dst_ip: str | None = None):
    """`count` VNET/P datagrams of `kind` (tools/underlay.py) with host 2's
    address and port, as if its vnetd sent them to host 1, written straight
    onto host 1's wire (its switch port, p1): the switch's bridge would check
    and trim IPv4 headers on the way (br_netfilter), which a plain wire does
    not. `dst_mac`, `dst_ip`: the frame's and the datagram's destination
    (default: host 1's)."""
    if dst_mac is None:
        dst_mac = lab.x(hosts[1], "cat", "/sys/class/net/eth0/address").stdout.strip()
    out = lab.x(lab.switch, "python3", UNDERLAY, "p1", dst_mac, underlay_ip(2), dst_ip or underlay_ip(1), kind,
                count, inner_dst, inner_src, rate, timeout=120).stdout
    assert out.split() == ["sent", str(count)], out


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
    frame reaches the old destination once the reply is back. The old
    destination's receive count is read within microseconds of the reply
    (the test reads the reply off the control socket itself, then the
    guest's counter through /proc/<pid>/net/dev of a process in its
    namespace), and a frame goes every 5 ms.
    Catches: revocation done after the reply (a mutant that revokes 50 ms
    later fails here)."""
    _, d, g = veth_mesh(lab, {1: [1, 3], 2: [2]})
    assert lab.reaches(g[1], g[3])
    # g3 receives nothing but g1's echo requests (no ARP either way).
    for a, b in ((1, 3), (3, 1)):
        lab.x(g[a].ns, "ip", "neigh", "replace", g[b].ip, "lladdr", g[b].mac, "dev", g[a].tap, "nud", "permanent")
    in_g3 = lab.popen(g[3].ns, "sleep", "30")
    # Once `ip netns exec` has entered g3 and exec'd sleep, /proc/<pid>/net is g3's.
    assert wait_until(lambda: open(f"/proc/{in_g3.pid}/comm").read().strip() == "sleep")

    def g3_rx() -> int:
        for line in open(f"/proc/{in_g3.pid}/net/dev"):
            name, _, rest = line.partition(":")
            if name.strip() == g[3].tap:
                return int(rest.split()[1])
        raise AssertionError(f"no {g[3].tap} in g3's /proc/net/dev")

    # g1's frames to g3's MAC now go to the link instead (host 2 drops them:
    # no route there for g3's MAC).
    rx0 = g3_rx()
    pinger = lab.popen(g[1].ns, "ping", "-n", "-q", "-i", "0.005", "-c", "400", g[3].ip, stdout=-1, text=True)
    time.sleep(0.5)
    assert g3_rx() - rx0 > 20 and fast(d[1])["hit_guest"] > 20, "g3 gets the flow, in the kernel, before the change"
    s = UnixSession(d[1].sock)
    try:
        status, _ = s.request(f"BEGIN\nROUTE DEL any {g[3].mac} interface {g[3].mac} any\n"
                              f"ROUTE ADD any {g[3].mac} edge {underlay_ip(2)} any\nCOMMIT\n")
        rx_at_reply = g3_rx()
    finally:
        s.close()
    assert status.startswith("OK"), status
    time.sleep(1.0)
    rx_later = g3_rx()
    assert rx_later == rx_at_reply, f"{rx_later - rx_at_reply} frames reached g3 after its route was changed"
    pinger.wait(timeout=30)
    assert d[2].stats()["link 198.18.0.1"]["in_frames"] >= 100


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


def test_a_tcp_stream_that_crossed_the_link_segment_by_segment_reaches_a_veth_guest_merged(lab):
    """A VM's TCP stream crosses the link one datagram per segment (its
    host's vnetd cuts the VM's super-frames; here a guest of a host on the
    slow path, `SET datapath user`). The receiving host's kernel cuts each
    train round the finishing pair and hands the segments to the veth guest
    through the pair's host end, where the guest's kernel merges them (GRO),
    as a NIC's driver does: the guest's stack takes the stream in pieces
    larger than a segment (what `tcpdump` in the guest shows), and the
    bytes arrive intact. With the guest's end down, each segment lost on
    the way in is counted (`drop_delivery_full`).
    Catches: segments handed over one by one (straight into the guest's
    side, or GRO off on its end), merged wrongly (the bytes differ), or
    lost uncounted."""
    _, d, g = veth_mesh(lab, {1: [1], 2: [2]}, extra={1: "SET datapath user\n"})
    assert "1 received" in lab.ping(g[1], g[2], count=1, wait=5).stdout
    cap = lab.popen(g[2].ns, "timeout", "30", "tcpdump", "-i", g[2].tap, "-n", "-q", "-c", "5", "tcp and greater 3000",
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert "listening on" in cap.stderr.readline() + cap.stderr.readline()
    transfer(lab, g[1], g[2], 20 * 1000 * 1000)
    out = cap.communicate(timeout=40)[0]
    merged = [l for l in out.splitlines() if " tcp " in l]
    assert len(merged) == 5, f"no segments merged in the guest: {out!r}"
    f = fast(d[2])
    assert f["hit_net"] > 1000 and f["finish"] > 0 and f["drop_decap"] == 0, f
    # What the kernel loses on the way in is counted: the guest's end down,
    # each TCP segment sent to it (SYNs, by its peer's count) is lost at the
    # host end, and the interface's drop_delivery_full says how many.
    lab.x(g[1].ns, "ip", "neigh", "replace", g[2].ip, "lladdr", g[2].mac, "dev", g[1].tap, "nud", "permanent")
    lab.x(g[2].ns, "ip", "link", "set", g[2].tap, "down")

    def out_segs():
        rows = [l.split() for l in lab.x(g[1].ns, "cat", "/proc/net/snmp").stdout.splitlines() if l.startswith("Tcp:")]
        tcp = dict(zip(rows[0][1:], rows[1][1:]))
        return int(tcp["OutSegs"]) + int(tcp["RetransSegs"])  # a SYN sent again is counted only there

    def lost():
        return d[2].stats()[f"interface {g[2].tap}"]["drop_delivery_full"]
    s0, l0 = out_segs(), lost()
    lab.x(g[1].ns, "python3", "-c", "import socket\ntry:\n socket.create_connection(("
          f"'{g[2].ip}', 5003), timeout=2.5)\nexcept OSError: pass")
    sent = out_segs() - s0
    assert sent >= 2, sent
    assert wait_until(lambda: lost() - l0 == sent, timeout=5), (lost() - l0, sent)


def test_datapath_setting_switches_at_run_time(lab):
    _, d, g = veth_mesh(lab, {1: [1], 2: [2]})
    show = d[1].ctl("SHOW").stdout
    assert "datapath=auto" in show and "datapath_in_force=kernel" in show, show
    assert lab.reaches(g[1], g[2])
    d[1].ctl("SET", "datapath", "user")
    assert "datapath_in_force=user" in d[1].ctl("SHOW").stdout
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


def test_frames_for_vnetd_that_a_full_upcall_queue_drops_are_counted_drop_upcall_full(lab):
    """A frame the fast path hands to vnetd waits in the port's upcall TAP;
    with vnetd stopped (as if busy) the queue fills and the kernel drops the
    rest, counting them on the TAP. STATS shows that count as the
    interface's `drop_upcall_full`, and the frames the queue held are
    forwarded once vnetd runs again: the other guest receives exactly those
    handed up less those dropped.
    Catches: drop_upcall_full read from another device (or not at all) for
    a fast port; held frames lost or sent twice."""
    hosts, d, g = veth_mesh(lab, {1: [1], 2: [2]})
    for a, b in ((1, 2), (2, 1)):  # no ARP: the blast is all there is
        lab.x(g[a].ns, "ip", "neigh", "replace", g[b].ip, "lladdr", g[b].mac, "dev", g[a].tap, "nud", "permanent")
    names = [l.split(":")[1].strip().split("@")[0] for l in lab.x(hosts[1], "ip", "-o", "link").stdout.splitlines()]
    [upcall] = [n for n in names if n.startswith("vu")]
    dropped = lambda: int(lab.x(hosts[1], "cat", f"/sys/class/net/{upcall}/statistics/tx_dropped").stdout)
    k0, s0, f0, rx0 = dropped(), d[1].stats()["interface g1"], fast(d[1]), rx_packets(lab, g[2])
    n = 3000
    d[1].proc.send_signal(signal.SIGSTOP)
    try:
        # No entry for the flow yet (vnetd would install it): every frame a miss.
        lab.x(g[1].ns, "python3", "-c",
              "import socket;s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
              f"for _ in range({n}): s.sendto(b'q'*100,({g[2].ip!r},7))\n")
    finally:
        d[1].proc.send_signal(signal.SIGCONT)
    lost = dropped() - k0
    assert lost > 1000, f"the upcall TAP's queue should have overflowed, the kernel counted {lost}"
    assert fast(d[1])["miss_guest"] - f0["miss_guest"] == n
    assert d[1].stats()["interface g1"]["drop_upcall_full"] - s0["drop_upcall_full"] == lost
    assert wait_until(lambda: rx_packets(lab, g[2]) - rx0 >= n - lost, timeout=5), (rx_packets(lab, g[2]) - rx0, lost)
    time.sleep(0.3)  # nothing more comes
    assert rx_packets(lab, g[2]) - rx0 == n - lost, (rx_packets(lab, g[2]) - rx0, lost)


def test_unpinned_the_finishing_pair_goes_at_exit_and_a_killed_vnetds_pair_is_swept_by_the_next(lab):
    """With the fast path not pinned (--pin-dir none), vnetd makes the
    finishing pair vfa<pid>/vfb<pid> in its namespace at start
    (docs/datapath.md, offloads across the fast path). SIGTERM: it
    deletes it, while the namespace lives on. SIGKILL leaves it; the next
    vnetd in that namespace deletes it at start. (Pinned, the pair is the
    pin folder's and stays: tests/test_restart.py.)
    Catches: M1 (`impl Drop for Finisher` a no-op: the pair stays after
    SIGTERM); `Finisher::sweep` gone (a killed vnetd's pair stays)."""
    host = lab.add_host(1)

    def pairs():
        names = [l.split(":")[1].strip().split("@")[0] for l in lab.x(host, "ip", "-o", "link").stdout.splitlines()]
        return sorted(n for n in names if n.startswith(("vfa", "vfb")))

    d = lab.start_vnetd(host, None, "--pin-dir", "none")
    pid = d.proc.pid  # ip netns exec execs vnetd: the same process
    assert pairs() == [f"vfa{pid}", f"vfb{pid}"]
    assert d.stop() == 0
    assert pairs() == [], "vnetd left its finishing pair after SIGTERM"

    killed = lab.start_vnetd(host, None, "--pin-dir", "none")
    old = killed.proc.pid
    assert pairs() == [f"vfa{old}", f"vfb{old}"]
    killed.stop(signal.SIGKILL)
    assert pairs() == [f"vfa{old}", f"vfb{old}"]  # no exit code ran
    d2 = lab.start_vnetd(host, None, "--pin-dir", "none")
    assert pairs() == [f"vfa{d2.proc.pid}", f"vfb{d2.proc.pid}"], "the killed vnetd's pair was not swept"
    assert f"removing vfa{old}, left by a vnetd that is gone" in d2.log_text()


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


def test_a_hand_made_vnetp_peer_talks_to_the_kernel_fast_path(lab):
    """The wire, byte for byte: a peer written from docs/wire-format.md (no
    vnetd on its host) exchanges ICMP echoes with a veth guest; after the
    first exchange the kernel encapsulates and decapsulates them."""
    h1, h2 = lab.add_host(1), lab.add_host(2)
    gns = lab.guest_ns("g1")
    peer_mac, peer_ip = "02:00:00:00:00:50", "198.19.0.50"
    d = lab.start_vnetd(h1, f"INTERFACE ADD g1 {guest_mac(1)} mtu {FAST_MTU} netns {gns} veth\n"
                            f"LINK ADD {underlay_ip(2)} 9000 udp\n"
                            f"ROUTE ADD any {guest_mac(1)} interface {guest_mac(1)} any\n"
                            f"ROUTE ADD any {peer_mac} edge {underlay_ip(2)} any\n")
    g1 = lab.veth_guest(h1, "g1", 1, gns)
    # No ARP on this wire: the guest knows the peer's MAC.
    lab.x(gns, "ip", "neigh", "add", peer_ip, "lladdr", peer_mac, "dev", "g1")
    out = lab.x(h2, "python3", REPO / "tests" / "tools" / "vnetp_peer.py", underlay_ip(2), 9000, underlay_ip(1),
                g1.mac, g1.ip, peer_mac, peer_ip, 40, 1400, timeout=120).stdout
    assert out.split() == ["replies", "40", "bad", "0"], out
    f = fast(d)
    assert f["hit_net"] >= 38 and f["hit_guest"] >= 38, f


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (scripts/setup installs it)")
def test_where_bpf_is_refused_vnetd_says_so_and_veth_guests_still_work(lab):
    """Without BPF (strace makes every bpf() fail with EPERM) vnetd logs one
    line, runs its own datapath, reads veth guests through a packet socket,
    and refuses SET datapath kernel."""
    hosts = {h: lab.add_host(h) for h in (1, 2)}
    gns = {h: lab.guest_ns(f"g{h}") for h in (1, 2)}
    by_host = {h: [(f"g{h}", guest_mac(h))] for h in (1, 2)}
    attach = {f"g{h}": f"netns {gns[h]} veth" for h in (1, 2)}
    # Host 1 has no finishing pair (no BPF): host 2's underlay must finish
    # checksums and segment as a NIC would, not pass its packets as they are
    # (docs/datapath.md, offloads across the fast path).
    lab.x(hosts[2], "ethtool", "-K", "eth0", "tx", "off")
    d2 = lab.start_vnetd(hosts[2], mesh_config(2, by_host, mtu=FAST_MTU, attach=attach))
    d1 = lab.start_vnetd_traced(hosts[1], mesh_config(1, by_host, mtu=FAST_MTU, attach=attach),
                                "-o", "/dev/null", "-e", "trace=bpf", "-e", "inject=bpf:error=EPERM")
    try:
        g = {h: lab.veth_guest(hosts[h], f"g{h}", h, gns[h]) for h in (1, 2)}
        assert "path=user" in d1.ctl("INTERFACE", "LIST").stdout
        r = lab.ping(g[1], g[2], count=20, wait=1)
        assert r.returncode == 0 and " 0% packet loss" in r.stdout, r.stdout
        transfer(lab, g[1], g[2], 20 * 1000 * 1000)
        lines = [l for l in d1.log_text().splitlines() if "kernel fast path unavailable" in l]
        assert len(lines) == 1, d1.log_text()
        bad = d1.ctl("SET", "datapath", "kernel", check=False)
        assert bad.returncode != 0 and "not loaded" in bad.stderr + bad.stdout
        s = d1.stats()
        assert s["fastpath"]["loaded"] == "no" and s["paths"]["kernel_frames"] == 0, s["fastpath"]
        assert "datapath_in_force=user_(kernel_fast_path_not_loaded)" in d1.ctl("SHOW").stdout
        # The other host, with its fast path, carried its side in the kernel.
        assert fast(d2)["hit_guest"] > 10
    finally:
        assert lab.stop_traced(d1) == 0, d1.log_text()


def test_hostile_traffic_at_a_fast_path_host_is_dropped_and_counted_while_legit_traffic_flows(lab):
    """test_hostile's attack, at a host whose guests are on the kernel fast
    path: what the kernel does not take reaches vnetd and is counted exactly
    as before; the forged frames to g3 are each delivered once (by either
    path), and each of their 20 000 made-up flows is offered to the kernel
    once: installed, or counted `rate_limited` (how many depends on how fast
    vnetd runs; test_more_flows_than_the_map_holds_... pins the limit and
    the map's eviction down)."""
    from test_hostile import BATCHES, STREAM, rss_kb, run_hostile, rx_packets
    layout = {1: [1, 3], 2: [2]}
    _, d, g = veth_mesh(lab, layout, mtu=1000, extra={1: "LINK ADD 198.18.0.2 vxlan vni 42 name vx\n"})
    evil = lab.add_host(9)
    d1 = d[1]
    assert lab.reaches(g[1], g[2])
    rss0 = rss_kb(d1.proc.pid)
    recv = lab.popen(g[1].ns, "python3", STREAM, "recv", 5001, stdout=subprocess.PIPE, text=True)
    assert recv.stdout.readline().strip() == "listening"
    send = lab.popen(g[2].ns, "python3", STREAM, "send", g[1].ip, 5001, "eof",
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    before = d1.stats()
    assert before["interface g1"]["fast_out_frames"] > 50, "the stream flows in the kernel before the attack"
    g3_rx = rx_packets(lab, g[3])
    run_hostile(lab, evil, g[1], g[2], g[3], send)
    assert send.poll() is None, "the stream ended before the hostile input did"
    sent = send.communicate(input="", timeout=60)[0].split()
    got = recv.communicate(timeout=60)[0].split()
    assert got[:2] == sent and int(sent[0]) > 1_000_000, (sent, got)
    drops = {
        ("link 198.18.0.2", "malformed"): BATCHES["runts"],
        ("link 198.18.0.2", "no_route"): BATCHES["no_route"],
        ("interface g1", "oversize"): BATCHES["oversize"],
        ("global", "unknown_sender"): BATCHES["strangers"] + BATCHES["vxlan_unknown_vni"] + BATCHES["flood"],
        ("global", "malformed"): BATCHES["runts"] + BATCHES["vxlan_bad_header"],
    }

    def deltas():
        after = d1.stats()
        c = {k: after[k[0]][f"drop_{k[1]}"] - before[k[0]][f"drop_{k[1]}"] for k in drops}
        c["g3 delivered"] = after["interface g3"]["out_frames"] - before["interface g3"]["out_frames"]
        c["g3 received"] = rx_packets(lab, g[3]) - g3_rx
        return c

    want = {**drops, "g3 delivered": BATCHES["forged"], "g3 received": BATCHES["forged"]}
    counted = wait_until(lambda: (c := deltas()) == want and c, timeout=5) or deltas()
    assert counted == want, fast(d1)
    f = fast(d1)
    assert f["drop_encap"] == 0 and f["drop_decap"] == 0, f
    offered = {k: f[k] - before["fastpath"][k] for k in ("installs", "rate_limited", "install_failures")}
    # The forged flows, and the few the stream and the batches' frames add.
    assert offered["install_failures"] == 0, offered
    assert BATCHES["forged"] <= offered["installs"] + offered["rate_limited"] <= BATCHES["forged"] + 20, offered
    assert rss_kb(d1.proc.pid) - rss0 < 64 * 1024
    # The legit flow is (back) in the kernel after the flood.
    hits = fast(d1)["hit_net"]
    assert "20 received" in lab.ping(g[2], g[1], count=20).stdout
    assert fast(d1)["hit_net"] >= hits + 15


def test_more_flows_than_the_map_holds_leave_room_for_new_ones_and_installs_are_rate_limited(lab):
    """The `flows` map holds 16 Ki entries, least recently used evicted
    first: 24 000 flows offered under the install rate limit all get in
    (none refused), and a flow that starts only after them is carried by
    the kernel. Installs are rate-limited per dispatcher (20 000/s, burst
    2 000): a burst beyond that is counted `rate_limited`, and every flow
    vnetd offers is either installed or counted so.
    Catches: `flows` made a plain hash (a full map refuses installs:
    install_failures > 0 and the new flow stays on the slow path); the rate
    limit gone or uncounted."""
    hosts, d, g = veth_mesh(lab, {1: [1], 2: [2]})
    d1 = d[1]
    # g1 and g2 have not talked yet: their flow is new after the flood.
    for a, b in ((1, 2), (2, 1)):
        lab.x(g[a].ns, "ip", "neigh", "replace", g[b].ip, "lladdr", g[b].mac, "dev", g[a].tap, "nud", "permanent")

    def counters():
        f = fast(d1)
        return {k: f[k] for k in ("installs", "install_failures", "rate_limited", "miss_net", "hit_net", "hit_guest")}

    def grew(before):
        now = counters()
        return {k: now[k] - before[k] for k in now}

    # Host 2 writes 24 000 frames for g1, each from its own made-up MAC,
    # at 8 000 a second (under the limit): each a miss, each offered once.
    n = 24_000
    c0, rx0 = counters(), rx_packets(lab, g[1])
    from_peer(lab, hosts, "flows", n, g[1].mac, "02:f1:00:00:00:00", rate=8000)
    assert wait_until(lambda: rx_packets(lab, g[1]) - rx0 >= n, timeout=10), "g1 did not get every frame"
    flood = grew(c0)
    entries = fast(d1)["entries"]
    print("flood:", flood, "entries", entries)
    assert flood["miss_net"] == n, flood
    assert flood["installs"] + flood["rate_limited"] == n and flood["install_failures"] == 0, flood
    # More were installed than the map holds: room was made by eviction.
    assert flood["installs"] > 16384 and entries <= 16384, (flood, entries)

    # A new legitimate flow is installed and carried in the kernel, both ways.
    c1 = counters()
    assert "20 received" in lab.ping(g[1], g[2], count=20).stdout
    legit = grew(c1)
    assert legit["hit_guest"] >= 18 and legit["hit_net"] >= 18, legit
    assert legit["install_failures"] == 0, legit

    # A burst: 10 000 new flows arrive while vnetd is stopped (as if busy),
    # so it offers them faster than 20 000/s once it runs: beyond the burst
    # of 2 000 plus what the rate refills meanwhile, they are rate-limited
    # (and still delivered, by the slow path).
    b = 10_000
    c2, rx2 = counters(), rx_packets(lab, g[1])
    d1.proc.send_signal(signal.SIGSTOP)
    try:
        from_peer(lab, hosts, "flows", b, g[1].mac, "02:f2:00:00:00:00")
    finally:
        d1.proc.send_signal(signal.SIGCONT)
    assert wait_until(lambda: rx_packets(lab, g[1]) - rx2 >= b, timeout=10), "g1 did not get every frame"
    burst = grew(c2)
    print("burst:", burst)
    assert burst["miss_net"] == b, burst
    assert burst["installs"] + burst["rate_limited"] == b and burst["install_failures"] == 0, burst
    assert burst["rate_limited"] > 0 and burst["installs"] >= 2000, burst


def test_the_kernel_takes_only_whole_valid_ipv4_headers_from_a_link(lab):
    """`from_network` decapsulates a datagram from a link's address only if
    its outer IPv4 header is whole and valid (docs/reliability.md): each bad
    kind below is written onto the underlay with the peer's address and an
    inner frame whose flow is in the kernel, and none is carried by the
    kernel. What the stack accepts (fragments reassembled, options, excess
    length trimmed) reaches vnetd and is delivered by the slow path; a bad
    header checksum is dropped and counted by the stack (Ip InHdrErrors).
    Catches: the header checksum check, the fragment check or the length
    checks removed from from_network (a mutant without the checksum check
    delivers the corrupt datagrams)."""
    hosts, d, g = veth_mesh(lab, {1: [1], 2: [2]})
    for a, b in ((1, 2), (2, 1)):
        lab.x(g[a].ns, "ip", "neigh", "replace", g[b].ip, "lladdr", g[b].mac, "dev", g[a].tap, "nud", "permanent")
    assert "5 received" in lab.ping(g[1], g[2], count=5).stdout  # (link, g1, g2) installed on host 1
    n = 50

    def ip_stat(name):
        lines = [l.split() for l in lab.x(hosts[1], "cat", "/proc/net/snmp").stdout.splitlines() if l.startswith("Ip:")]
        return int(dict(zip(lines[0], lines[1]))[name])

    def counts():
        s = d[1].stats()
        link = s["link 198.18.0.2"]
        return {"kernel": s["fastpath"]["hit_net"], "slow path": link["in_frames"] - link["fast_in_frames"],
                "g1 received": rx_packets(lab, g[1]), "header errors": ip_stat("InHdrErrors")}

    want = {
        "good": {"kernel": n, "slow path": 0, "g1 received": n, "header errors": 0},
        "csum": {"kernel": 0, "slow path": 0, "g1 received": 0, "header errors": n},
        **{kind: {"kernel": 0, "slow path": n, "g1 received": n, "header errors": 0}
           for kind in ("frag", "options", "trailing", "udp_len")},
    }
    got = {}
    for kind, expect in want.items():
        c0 = counts()
        from_peer(lab, hosts, kind, n, g[1].mac, g[2].mac)

        def delta():
            return {k: v - c0[k] for k, v in counts().items()}

        got[kind] = wait_until(lambda: (c := delta()) == expect and c, timeout=3) or delta()
    assert got == want


def test_the_kernel_takes_only_datagrams_addressed_to_this_host_with_a_checksum_it_can_trust(lab):
    """A hostile host on the underlay forges datagrams from host 2's vnetd
    to host 1 (the peer's address and port, an inner frame g2 -> g1 whose
    flow is in host 1's kernel) that host 1's UDP socket would never take.
    `from_network` carries none of them: each goes up the host stack,
    counted `not_for_us` or `slow_csum`, and the stack does with it what it
    does without the fast path (here: drops it, and counts it).
    - to another address (198.18.0.77), sent by the hostile host through the
      switch with a neighbour entry giving host 1's MAC for it (tools/spoof.py);
    - to host 1's address in a frame for another MAC (the device takes it as
      PACKET_OTHERHOST: promiscuous, or a switch flooding);
    - to host 1's address in an Ethernet broadcast: the stack takes it (Linux
      accepts unicast IP in an L2 broadcast unless
      drop_unicast_in_l2_multicast is set) and vnetd's socket delivers it;
    - with a wrong UDP checksum: the device did not verify it, so the stack
      does, and drops it (Udp InCsumErrors); a right one goes by vnetd.
    Datagrams with no UDP checksum (as the fast path sends) stay in the kernel.
    Catches: the pkt_type, destination address or UDP checksum check gone
    from `from_network` (the kernel delivers those datagrams to g1)."""
    hosts, d, g = veth_mesh(lab, {1: [1], 2: [2]})
    evil = lab.add_host(9)
    for a, b in ((1, 2), (2, 1)):
        lab.x(g[a].ns, "ip", "neigh", "replace", g[b].ip, "lladdr", g[b].mac, "dev", g[a].tap, "nud", "permanent")
    assert "5 received" in lab.ping(g[1], g[2], count=5).stdout  # (link, g1, g2) installed on host 1
    h1_mac = lab.x(hosts[1], "cat", "/sys/class/net/eth0/address").stdout.strip()
    elsewhere = "198.18.0.77"  # no host's
    lab.x(evil, "ip", "neigh", "replace", elsewhere, "lladdr", h1_mac, "dev", "eth0", "nud", "permanent")
    n = 50

    def snmp(proto, name):
        lines = [l.split() for l in lab.x(hosts[1], "cat", "/proc/net/snmp").stdout.splitlines()
                 if l.startswith(proto + ":")]
        return int(dict(zip(lines[0], lines[1]))[name])

    def counts():
        s = d[1].stats()
        f, link = s["fastpath"], s["link 198.18.0.2"]
        return {"kernel": f["hit_net"], "not_for_us": f.get("not_for_us"), "slow_csum": f.get("slow_csum"),
                "slow path": link["in_frames"] - link["fast_in_frames"], "g1 received": rx_packets(lab, g[1]),
                "Ip InAddrErrors": snmp("Ip", "InAddrErrors"), "Udp InCsumErrors": snmp("Udp", "InCsumErrors")}

    # g2's frame to g1, as host 2's vnetd sends it: its MACs, then padding.
    frame = bytes.fromhex(g[1].mac.replace(":", "") + g[2].mac.replace(":", "")) + b"\x88\xb5" + bytes(46)
    send = {
        "to another address": lambda: lab.x(evil, "python3", SPOOF, underlay_ip(2), 9000, elsewhere, 9000,
                                            frame.hex(), n),
        "for another MAC": lambda: from_peer(lab, hosts, "good", n, g[1].mac, g[2].mac, dst_mac="02:00:00:00:99:99"),
        "broadcast": lambda: from_peer(lab, hosts, "good", n, g[1].mac, g[2].mac, dst_mac="ff:ff:ff:ff:ff:ff"),
        "bad UDP checksum": lambda: from_peer(lab, hosts, "udp_csum", n, g[1].mac, g[2].mac),
        "good UDP checksum": lambda: from_peer(lab, hosts, "udp_sum", n, g[1].mac, g[2].mac),
        "no UDP checksum": lambda: from_peer(lab, hosts, "good", n, g[1].mac, g[2].mac),
    }
    zero = {k: 0 for k in counts()}
    want = {
        "to another address": {**zero, "not_for_us": n, "Ip InAddrErrors": n},
        "for another MAC": {**zero, "not_for_us": n},
        "broadcast": {**zero, "not_for_us": n, "slow path": n, "g1 received": n},
        "bad UDP checksum": {**zero, "slow_csum": n, "Udp InCsumErrors": n},
        "good UDP checksum": {**zero, "slow_csum": n, "slow path": n, "g1 received": n},
        "no UDP checksum": {**zero, "kernel": n, "g1 received": n},
    }
    got = {}
    for kind, expect in want.items():
        c0 = counts()
        send[kind]()

        def delta():
            return {k: (v - c0[k] if v is not None and c0[k] is not None else None) for k, v in counts().items()}

        got[kind] = wait_until(lambda: (c := delta()) == expect and c, timeout=3) or delta()
        print(kind, got[kind])
    assert got == want


def test_what_the_kernel_does_not_carry_goes_on_to_the_devices_other_programs(lab):
    """`from_network` returns TCX_NEXT for what it does not carry, so a
    program after it on the underlay device still sees it (here a classic
    TC filter, which runs after the TCX programs, mirroring every UDP
    datagram to a veth whose transmit count the test reads): plain UDP and
    VNET datagrams that miss, but not the datagrams the kernel carried.
    Catches: `PASS` made TC_ACT_OK (TCX_PASS: the stack still gets the
    datagram, but the device's later programs are skipped)."""
    hosts, d, g = veth_mesh(lab, {1: [1], 2: [2]})
    h1 = hosts[1]
    for a, b in ((1, 2), (2, 1)):
        lab.x(g[a].ns, "ip", "neigh", "replace", g[b].ip, "lladdr", g[b].mac, "dev", g[a].tap, "nud", "permanent")
    assert "5 received" in lab.ping(g[1], g[2], count=5).stdout  # the flow is in the kernel
    lab.x(h1, "ip", "link", "add", "mon", "type", "veth", "peer", "name", "monp")
    for dev in ("mon", "monp"):  # no IPv6 chatter of their own
        lab.x(h1, "sysctl", "-qw", f"net.ipv6.conf.{dev}.disable_ipv6=1")
        lab.x(h1, "ip", "link", "set", dev, "up")
    lab.x(h1, "tc", "qdisc", "add", "dev", "eth0", "clsact")
    lab.x(h1, "tc", "filter", "add", "dev", "eth0", "ingress", "protocol", "ip", "u32", "match", "ip", "protocol",
          "17", "0xff", "action", "mirred", "egress", "mirror", "dev", "mon")
    seen = lambda: int(lab.x(h1, "cat", "/sys/class/net/mon/statistics/tx_packets").stdout)

    def during(what):
        s0, f0, rx0 = seen(), fast(d[1]), rx_packets(lab, g[1])
        what()
        time.sleep(0.3)
        f = fast(d[1])
        return {"seen after": seen() - s0, "kernel": f["hit_net"] - f0["hit_net"],
                "missed": f["miss_net"] - f0["miss_net"], "g1 received": rx_packets(lab, g[1]) - rx0}

    got = {
        # VNET's, carried by the kernel: the program after it sees none.
        "carried": during(lambda: lab.ping(g[2], g[1], count=20)),
        # VNET datagrams with no flow in the kernel (vnetd delivers them).
        "missed": during(lambda: from_peer(lab, hosts, "flows", 30, g[1].mac, "02:f3:00:00:00:00")),
        # Not VNET's at all: UDP to another port.
        "other": during(lambda: lab.x(hosts[2], "python3", "-c",
                                      "import socket;s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
                                      f"for _ in range(40): s.sendto(b'x',({underlay_ip(1)!r},7777))\n")),
    }
    assert got == {"carried": {"seen after": 0, "kernel": 20, "missed": 0, "g1 received": 20},
                   "missed": {"seen after": 30, "kernel": 0, "missed": 30, "g1 received": 30},
                   "other": {"seen after": 40, "kernel": 0, "missed": 0, "g1 received": 0}}


def test_frames_the_kernel_cannot_send_as_they_are_go_to_vnetd_counted_by_reason(lab):
    """docs/datapath.md, "Stays on the slow path": frames whose flow is in
    the kernel but that the kernel cannot encapsulate as they are go to
    vnetd, counted by reason, and still arrive: a frame longer than the link
    takes unsegmented (guests with MTU 1500 on a 1500-byte underlay:
    `slow_big`, and vnetd sends it whole, fragmented) and a guest's UDP GSO
    (`slow_gso`). (ARP, `slow_not_ip`: the IPv6-and-ARP test.)
    Catches: the length check in `encap` removed (shown: the long frames
    are lost), or either frame counted under another reason. (Without its
    own GSO check `encap` would still give a guest's UDP GSO to vnetd:
    bpf_skb_adjust_room refuses it, and that refusal is counted `slow_gso`
    too.)"""
    hosts, d, g = veth_mesh(lab, {1: [1], 2: [2]}, mtu=1500)
    for a, b in ((1, 2), (2, 1)):
        lab.x(g[a].ns, "ip", "neigh", "replace", g[b].ip, "lladdr", g[b].mac, "dev", g[a].tap, "nud", "permanent")
    assert "5 received" in lab.ping(g[1], g[2], count=5).stdout  # both ways in the kernel
    f1, f2 = fast(d[1]), fast(d[2])
    o1 = d[1].stats()["offload"]["fragmented"]
    # 1472 bytes of ping: 1514-byte frames, 1542 bytes with VNET/P's 28 + 14 over a 1500-byte link.
    r = lab.ping(g[1], g[2], count=10, size=1472)
    assert "10 received" in r.stdout, r.stdout
    for h, f in ((1, f1), (2, f2)):
        now = fast(d[h])
        big = {k: now[k] - f[k] for k in ("slow_big", "hit_guest", "drop_encap")}
        assert big == {"slow_big": 10, "hit_guest": 0, "drop_encap": 0}, (h, big)
    assert d[1].stats()["offload"]["fragmented"] - o1 == 10

    # A guest's UDP GSO: 10 datagrams of 1000 bytes in one send (UDP_SEGMENT).
    f1, rx0 = fast(d[1]), rx_packets(lab, g[2])
    lab.x(g[1].ns, "python3", "-c",
          "import socket;s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
          "s.setsockopt(socket.IPPROTO_UDP, 103, 1000)\n"  # UDP_SEGMENT
          f"s.sendto(b'u'*10000,({g[2].ip!r},7))\n")
    assert wait_until(lambda: rx_packets(lab, g[2]) - rx0 >= 10, timeout=5), rx_packets(lab, g[2]) - rx0
    now = fast(d[1])
    gso = {k: now[k] - f1[k] for k in ("slow_gso", "hit_guest", "drop_encap")}
    assert gso == {"slow_gso": 1, "hit_guest": 0, "drop_encap": 0}, gso
    time.sleep(0.2)
    assert rx_packets(lab, g[2]) - rx0 == 10


@pytest.mark.parametrize("link", ["udp over IPv6", "tcp", "vxlan"])
def test_links_the_kernel_does_not_serve_stay_on_the_slow_path(lab, link):
    """docs/datapath.md: the kernel carries UDP links over IPv4 only; over
    IPv6 (the outer UDP checksum), TCP and VXLAN links every frame is
    vnetd's, nothing is installed, and guests still talk.
    Catches: `flow_for` installing entries for a link the kernel has no
    header for (frames would be `slow_route` or lost)."""
    kw = {"udp over IPv6": {"addr": underlay_ip6}, "tcp": {"link": "tcp key lab"},
          "vxlan": {"link": "vxlan vni 42"}}[link]
    _, d, g = veth_mesh(lab, {1: [1], 2: [2]}, **kw)
    assert lab.reaches(g[1], g[2])
    r = lab.ping(g[1], g[2], count=20)
    assert "20 received" in r.stdout, r.stdout
    for h in (1, 2):
        f = fast(d[h])
        assert (f["installs"], f["entries"], f["hit_guest"], f["hit_net"], f["slow_route"]) == (0, 0, 0, 0, 0), (h, f)
        assert f["miss_guest"] >= 20, (h, f)


def test_a_host_relaying_between_links_does_it_in_vnetd(lab):
    """Link-to-link relaying stays on the slow path: host 2 carries g1's
    and g3's frames between its two links in vnetd, and installs nothing.
    Catches: relayed flows installed in the kernel (from_network would
    carry them, and the kernel does not encapsulate from a link)."""
    hosts = {h: lab.add_host(h) for h in (1, 2, 3)}
    gns = {n: lab.guest_ns(f"g{n}") for n in (1, 3)}
    d = {}
    for h, n, far in ((1, 1, 3), (3, 3, 1)):
        d[h] = lab.start_vnetd(hosts[h], f"INTERFACE ADD g{n} {guest_mac(n)} mtu {FAST_MTU} netns {gns[n]} veth\n"
                                         f"LINK ADD {underlay_ip(2)} 9000 udp\n"
                                         f"ROUTE ADD any {guest_mac(n)} interface {guest_mac(n)} any\n"
                                         f"ROUTE ADD any {guest_mac(far)} edge {underlay_ip(2)} any\n")
    d[2] = lab.start_vnetd(hosts[2], f"LINK ADD {underlay_ip(1)} 9000 udp\nLINK ADD {underlay_ip(3)} 9000 udp\n"
                                     f"ROUTE ADD any {guest_mac(1)} edge {underlay_ip(1)} any\n"
                                     f"ROUTE ADD any {guest_mac(3)} edge {underlay_ip(3)} any\n")
    g = {n: lab.veth_guest(hosts[h], f"g{n}", n, gns[n]) for h, n in ((1, 1), (3, 3))}
    for a, b in ((1, 3), (3, 1)):  # no broadcast routes: no ARP
        lab.x(g[a].ns, "ip", "neigh", "replace", g[b].ip, "lladdr", g[b].mac, "dev", g[a].tap, "nud", "permanent")
    r = lab.ping(g[1], g[3], count=20)
    assert "20 received" in r.stdout, r.stdout
    f2 = fast(d[2])
    assert (f2["installs"], f2["entries"], f2["hit_net"]) == (0, 0, 0), f2
    assert f2["miss_net"] >= 40, f2
    # The guests' own hosts carry their side in the kernel.
    assert fast(d[1])["hit_guest"] >= 15 and fast(d[3])["hit_net"] >= 15


def test_ipv6_and_arp_inside_the_guests_cross_the_kernel_fast_path(lab):
    """Frames that are not IPv4 inside (IPv6, ARP) are carried and handed
    to the guest as what they are (a decapsulated frame's protocol is read
    again from its own header). ARP takes the paths docs/datapath.md gives
    it: the kernel encapsulates it round the finishing pair (a hit, never
    `slow_not_ip`: it needs no vnetd) and decapsulates it like any hit
    (`hit_net`), into the guest through the veth's host end.
    Catches: non-IP frames decapsulated with the outer protocol kept or
    handed to vnetd (the ARP counts below), or encapsulated as IP."""
    # IPv6 finds its neighbours at 33:33:ff + the address's last 24 bits.
    extra = {h: f"ROUTE ADD any 33:33:ff:00:00:{h:02x} interface {guest_mac(h)} any\n"
                f"ROUTE ADD any 33:33:ff:00:00:{3 - h:02x} edge {underlay_ip(3 - h)} interface\n" for h in (1, 2)}
    _, d, g = veth_mesh(lab, {1: [1], 2: [2]}, extra=extra)
    for n in (1, 2):
        lab.x(g[n].ns, "sysctl", "-qw", f"net.ipv6.conf.g{n}.disable_ipv6=0")
        lab.x(g[n].ns, "ip", "-6", "addr", "add", f"fd00:198:19::{n}/64", "dev", f"g{n}", "nodad")
    r = lab.x(g[1].ns, "ping", "-6", "-n", "-c", "20", "-i", "0.05", "fd00:198:19::2", check=False)
    assert "20 received" in r.stdout, r.stdout
    recv = lab.popen(g[2].ns, "python3", XFER, "recv", 5003, "::", stdout=-1, text=True)
    assert recv.stdout.readline().strip() == "listening"
    sent = lab.x(g[1].ns, "python3", XFER, "send", "fd00:198:19::2", 5003, 30_000_000, timeout=120).stdout.split()
    assert recv.communicate(timeout=60)[0].split() == sent
    f1, f2 = fast(d[1]), fast(d[2])
    assert f1["hit_guest"] > 100 and f2["hit_net"] > 100, (f1, f2)
    # ARP after the flows are in the kernel: both guests forget their
    # neighbours; g1's request (broadcast, one destination: its entry is
    # installed) and g2's reply hit; each sending host encapsulates its ARP
    # in the kernel (round the finishing pair, not slow_not_ip) and each
    # receiving host decapsulates it: 5 echoes (or replies) and at least one
    # ARP frame each way.
    assert "3 received" in lab.ping(g[1], g[2], count=3).stdout  # IPv4's first ARP: its entries installed
    lab.x(g[1].ns, "ip", "neigh", "flush", "dev", "g1")
    lab.x(g[2].ns, "ip", "neigh", "flush", "dev", "g2")
    f1, f2 = fast(d[1]), fast(d[2])
    resolved = {h: d[h].stats()[f"link {underlay_ip(3 - h)}"]["fast_resolved_frames"] for h in (1, 2)}
    assert "5 received" in lab.ping(g[1], g[2], count=5).stdout
    for h, f in ((1, f1), (2, f2)):
        now = fast(d[h])
        arp = {k: now[k] - f[k] for k in ("slow_not_ip", "hit_guest", "hit_net", "miss_guest", "miss_net")}
        assert arp["slow_not_ip"] == 0 and arp["hit_guest"] >= 6 and arp["hit_net"] >= 6, (h, arp)
        # ARP round the finishing pair leaves by the link's kept next hop too.
        assert d[h].stats()[f"link {underlay_ip(3 - h)}"]["fast_resolved_frames"] == resolved[h]


def neighbour(lab, host, ip: str) -> tuple[str, str]:
    """Host's neighbour entry for `ip` on eth0: (MAC, state), or ("", "")."""
    out = lab.x(host, "ip", "neigh", "show", ip, "dev", "eth0").stdout.split()
    mac = out[out.index("lladdr") + 1] if "lladdr" in out else ""
    return mac, (out[-1] if out else "")


def test_encapsulated_frames_go_to_the_next_hop_the_neighbour_table_gives_and_it_is_kept_confirmed(lab):
    """The fast path writes the outer Ethernet header itself, to the MAC the
    kernel's neighbour table holds for the link's next hop (kept by vnetd,
    fast/next_hops.rs), instead of a route and neighbour lookup per packet.
    The table is the authority: an entry gone stale is confirmed as the stack
    would confirm one it sends to (its datagrams no longer pass through it);
    a wrong MAC in the table is followed (pings stop), and when the entry goes
    the kernel resolves the hop again and the frames flow.
    Catches: a hop never refreshed (pings never come back), a stale entry
    never confirmed (it stays stale: the fast path would keep a dead peer's
    MAC forever), no fallback while the hop is unknown."""
    hosts, d, g = veth_mesh(lab, {1: [1], 2: [2]})
    lab.x(hosts[1], "sysctl", "-qw", "net.ipv4.neigh.eth0.delay_first_probe_time=1")
    assert lab.reaches(g[1], g[2])
    assert wait_until(lambda: fast(d[1])["next_hops"] == 1 and fast(d[2])["next_hops"] == 1, timeout=5), fast(d[1])
    mac2 = lab.x(hosts[2], "cat", "/sys/class/net/eth0/address").stdout.strip()
    assert neighbour(lab, hosts[1], underlay_ip(2))[0] == mac2
    link = lambda: d[1].stats()["link 198.18.0.2"]  # noqa: E731
    before = link()
    assert "20 received" in lab.ping(g[1], g[2], count=20).stdout
    after = link()
    # Carried by the kernel, every one with the hop vnetd keeps: none needed
    # the kernel to resolve it.
    assert after["fast_out_frames"] - before["fast_out_frames"] >= 19, after
    assert after["fast_resolved_frames"] == before["fast_resolved_frames"], after

    # Stale: confirmed (delay, a unicast probe, reachable) with no help from
    # other traffic (the guests' own ARP, which takes the kernel's way, is
    # kept off by permanent entries).
    for a, b in ((g[1], g[2]), (g[2], g[1])):
        lab.x(a.ns, "ip", "neigh", "replace", b.ip, "dev", a.tap, "lladdr", b.mac, "nud", "permanent")
    lab.x(hosts[1], "ip", "neigh", "replace", underlay_ip(2), "dev", "eth0", "lladdr", mac2, "nud", "stale")
    pinger = lab.popen(g[1].ns, "ping", "-q", "-i", "0.05", "-c", "200", g[2].ip, stdout=subprocess.DEVNULL)
    assert wait_until(lambda: neighbour(lab, hosts[1], underlay_ip(2))[1] == "REACHABLE", timeout=8), \
        neighbour(lab, hosts[1], underlay_ip(2))
    assert fast(d[1])["next_hop_confirms"] >= 1, fast(d[1])
    pinger.kill()
    pinger.wait()

    # A wrong MAC in the table: followed (the fast path sends there: lost).
    updates = fast(d[1])["next_hop_updates"]
    lab.x(hosts[1], "ip", "neigh", "replace", underlay_ip(2), "dev", "eth0", "lladdr", "02:00:5e:00:00:99", "nud", "permanent")
    assert wait_until(lambda: lab.ping(g[1], g[2], wait=1).returncode != 0, timeout=5), "pings still answered"
    # The entry gone: the hop is forgotten, the kernel resolves it again.
    resolved = link()["fast_resolved_frames"]
    lab.x(hosts[1], "ip", "neigh", "del", underlay_ip(2), "dev", "eth0")
    assert wait_until(lambda: lab.ping(g[1], g[2], wait=1).returncode == 0, timeout=5), "pings not answered again"
    assert link()["fast_resolved_frames"] > resolved, link()
    assert wait_until(lambda: fast(d[1])["next_hops"] == 1, timeout=3)
    assert fast(d[1])["next_hop_updates"] >= updates + 2, fast(d[1])
    assert neighbour(lab, hosts[1], underlay_ip(2))[0] == mac2


def test_the_programs_gso_flags_are_the_running_kernels():
    """The eBPF program tests skb_shinfo's gso_type against SKB_GSO_* values
    it must define itself (an anonymous enum: CO-RE cannot name it). They
    must be the running kernel's, read from its BTF as bpftool prints them.
    Catches the value the program had until 2026-12-03: SKB_GSO_UDP_L4 as
    1 << 16, which is SKB_GSO_UDP (its train checks never fired)."""
    import re
    src = (REPO / "crates" / "vnet-fastpath" / "bpf" / "fastpath.bpf.c").read_text()
    ours = {m[1]: 1 << int(m[2]) for m in re.finditer(r"#define (SKB_GSO_\w+) \(1u << (\d+)\)", src)}
    assert "SKB_GSO_UDP_L4" in ours, ours
    btf = subprocess.run(["bpftool", "btf", "dump", "file", "/sys/kernel/btf/vmlinux"], capture_output=True, text=True, check=True).stdout
    kernel = {m[1]: int(m[2]) for m in re.finditer(r"'(SKB_GSO_\w+)' val=(\d+)", btf)}
    assert {k: kernel.get(k) for k in ours} == ours


def test_a_peers_train_of_datagrams_is_cut_in_the_kernel_and_each_frame_goes_where_its_own_route_says(lab):
    """A peer vnetd sends a pass's frames for one link as one UDP GSO send
    (a train), which a veth underlay delivers unsegmented. When the train's
    first frame has a flow entry, the kernel sends the train round the
    finishing pair (`finish`), which cuts it into its datagrams, and takes
    each one as itself: frames to guests with entries are decapsulated in
    the kernel (`hit_net`), a frame no route names goes to vnetd, which
    drops it and counts it (`no_route`), a datagram too short for a frame
    too (`malformed`). A train whose first frame has no entry goes to vnetd
    whole (`slow_gso`), which reads it as its frames. Datagrams the pair
    loses (its receiving side's queue full, or that side down, as here) are
    counted (`drop_finish`: a datagram each, a train lost whole once), none
    silently.
    Catches: the headers not pulled in (the train passed up uncounted), the
    train decapsulated as its first frame (the rest lost), taken on the
    first frame's route alone (the unrouted frames delivered), the pair's
    losses uncounted (`drop_finish`), or frames that only claim TCP (a
    hostile peer's) lost or stuck on the merging way."""
    h1, h2 = lab.add_host(1), lab.add_host(2)
    peer, nowhere = "02:00:00:00:00:50", "02:00:00:00:00:5e"
    gns = {n: lab.guest_ns(f"g{n}") for n in (1, 3)}
    conf = "".join(f"INTERFACE ADD g{n} {guest_mac(n)} mtu {FAST_MTU} netns {gns[n]} veth\n"
                   f"ROUTE ADD any {guest_mac(n)} interface {guest_mac(n)} any\n" for n in (1, 3))
    d = lab.start_vnetd(h1, conf + f"LINK ADD {underlay_ip(2)} 9000 udp\nROUTE ADD any {peer} edge {underlay_ip(2)} any\n")
    g = {n: lab.veth_guest(h1, f"g{n}", n, gns[n]) for n in (1, 3)}
    for n in (1, 3):  # the guests' answers (ICMP, port 9 is closed) go to the peer, not to an ARP flood
        lab.x(gns[n], "ip", "neigh", "add", "198.19.0.50", "lladdr", peer, "dev", f"g{n}", "nud", "permanent")
    size = 200

    def send(mode, count, *dsts):
        out = lab.x(h2, "python3", REPO / "tests" / "tools" / "train.py", mode, underlay_ip(2), 9000, underlay_ip(1),
                    peer, size, count, ",".join(dsts)).stdout
        assert out.split() == ["sent", str(count)], out

    # Each guest's host end (INTERFACE LIST: host=<name>): what leaves by
    # it (its transmit count) took the merging way, not straight in.
    listing = d.ctl("INTERFACE", "LIST").stdout
    host_end = {n: re.search(rf"\bg{n}\b.*?\bhost=(\S+)", listing).group(1) for n in (1, 3)}

    def by_host_end():
        return sum(int(lab.x(h1, "cat", f"/sys/class/net/{host_end[n]}/statistics/tx_packets").stdout) for n in (1, 3))

    def counts():
        s = d.stats()
        f = s["fastpath"]
        return {"g1": rx_packets(lab, g[1]), "g3": rx_packets(lab, g[3]), "no_route": s["global"]["drop_no_route"],
                "malformed": s["global"]["drop_malformed"],
                **{k: f[k] for k in ("hit_net", "finish", "slow_gso", "from_vnetd", "drop_finish")},
                "by_host_end": by_host_end()}

    # One datagram at a time until the kernel carries both guests' flows.
    def carried():
        c0 = counts()
        send("single", 2, g[1].mac, g[3].mac)
        time.sleep(0.1)
        return counts()["hit_net"] - c0["hit_net"] == 2
    assert wait_until(carried, timeout=10), fast(d)

    def during(mode, count, *dsts):
        c0 = counts()
        send(mode, count, *dsts)
        want_rx = sum(1 for i in range(count) if dsts[i % len(dsts)] != nowhere)
        wait_until(lambda: counts()["g1"] + counts()["g3"] - c0["g1"] - c0["g3"] >= want_rx, timeout=5)
        time.sleep(0.3)
        c = counts()
        return {k: c[k] - c0[k] for k in c}

    # 30 frames: g1, g3, nowhere, g1, g3, ... (10 each) in one send.
    got = during("train", 30, g[1].mac, g[3].mac, nowhere)
    assert got == {"g1": 10, "g3": 10, "no_route": 10, "malformed": 0, "hit_net": 20, "finish": 1, "slow_gso": 0,
                   "from_vnetd": 0, "drop_finish": 0, "by_host_end": 0}, got
    # The first frame routed nowhere: vnetd takes the train and delivers
    # its frames itself (to a veth guest through the fast path's from_vnetd).
    got = during("train", 30, nowhere, g[1].mac, g[3].mac)
    assert got == {"g1": 10, "g3": 10, "no_route": 10, "malformed": 0, "hit_net": 0, "finish": 0, "slow_gso": 1,
                   "from_vnetd": 20, "drop_finish": 0, "by_host_end": 0}, got
    # A hostile peer's train ending in a datagram too short for a frame: cut
    # like any, the runt passed up to vnetd, which drops it and counts it.
    got = during("train-runt", 20, g[1].mac, g[3].mac)
    assert got == {"g1": 10, "g3": 10, "no_route": 0, "malformed": 1, "hit_net": 20, "finish": 1, "slow_gso": 0,
                   "from_vnetd": 0, "drop_finish": 0, "by_host_end": 0}, got
    # A hostile peer's train whose frames claim TCP over headers of garbage:
    # each takes the merging way (out of the host end, into the guest end's
    # NAPI) as any TCP segment does, reaches the guest's device on its own
    # (nothing to merge), and nothing is lost on the way in; the guest's
    # stack judges it (and drops it).
    lost0 = {n: d.stats()[f"interface g{n}"]["drop_delivery_full"] for n in (1, 3)}
    got = during("train-tcp", 20, g[1].mac, g[3].mac)
    assert got == {"g1": 10, "g3": 10, "no_route": 0, "malformed": 0, "hit_net": 20, "finish": 1, "slow_gso": 0,
                   "from_vnetd": 0, "drop_finish": 0, "by_host_end": 20}, got
    assert {n: d.stats()[f"interface g{n}"]["drop_delivery_full"] for n in (1, 3)} == lost0
    # The pair's receiving side down: the train is lost on the way round,
    # whole (a queue that is full instead loses datagrams one by one, each
    # counted), and counted; none of it reaches a guest or vnetd.
    names = [l.split(":")[1].strip().split("@")[0] for l in lab.x(h1, "ip", "-o", "link").stdout.splitlines()]
    [recv] = [n for n in names if n.startswith(("vfy", "vfb"))]  # pinned: vfy<tag>; unpinned: vfb<pid>
    lab.x(h1, "ip", "link", "set", recv, "down")
    try:
        c0 = counts()
        send("train", 30, g[1].mac, g[3].mac)
        assert wait_until(lambda: counts()["drop_finish"] > c0["drop_finish"], timeout=5), counts()
        time.sleep(0.3)
        c = counts()
        got = {k: c[k] - c0[k] for k in c}
        assert got == {"g1": 0, "g3": 0, "no_route": 0, "malformed": 0, "hit_net": 0, "finish": 1, "slow_gso": 0,
                       "from_vnetd": 0, "drop_finish": 1, "by_host_end": 0}, got
    finally:
        lab.x(h1, "ip", "link", "set", recv, "up")
    got = during("train", 20, g[1].mac, g[3].mac)
    assert got == {"g1": 10, "g3": 10, "no_route": 0, "malformed": 0, "hit_net": 20, "finish": 1, "slow_gso": 0,
                   "from_vnetd": 0, "drop_finish": 0, "by_host_end": 0}, got
