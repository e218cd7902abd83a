"""WireGuard links end to end: guests' traffic sealed between two vnetds
(ping, 200 MB each way with matching SHA-256), nothing of it readable on the
underlay, forged / replayed / old-session datagrams dropped and counted and
delivered to no guest, a peer that moves to a new address followed, and the
protocol shown to be WireGuard by an unmodified wireguard-go peer."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from netlab import REPO, guest_mac, overlay_ip, underlay_ip, underlay_ip6, wait_until

sys.path.insert(0, str(Path(__file__).parent / "tools"))
from test_datapath import transfer  # noqa: E402

SPOOF = REPO / "tests" / "tools" / "spoof.py"
# The underlay MTU less WireGuard's 88 bytes (outer IPv4 + UDP, its header
# and tag, the inner IPv4 + UDP) less the frame's Ethernet header.
GUEST_MTU = 1500 - 88 - 14
# Over an IPv6 underlay: the outer and the inner header are each 20 bytes
# longer, and the inner packet is padded to 16 bytes within the 1420 bytes
# left after the outer IPv6 + UDP and WireGuard's 32 (1408 of them).
GUEST_MTU_V6 = 1408 - 48 - 14
# A payload pattern the guests send, to look for on the underlay.
PATTERN = "5eca1ed0f00dcafe5eca1ed0f00dcafe"


def public_key(d) -> str:
    line = next(l for l in d.ctl("SHOW").stdout.splitlines() if l.startswith("wireguard "))
    return dict(w.split("=", 1) for w in line.split()[1:])["public_key"]


def wg_config(me: int, peers: dict[int, str], guests: dict[int, list[int]], port_of=lambda h: 51820) -> str:
    """Host `me`'s links (one WireGuard link per other host, named h<n>) and
    routes, for the guests' MACs."""
    lines = []
    for h, key in peers.items():
        lines.append(f"LINK ADD {underlay_ip(h)} {port_of(h)} wireguard {key} name h{h}")
    for n in guests[me]:
        lines.append(f"ROUTE ADD any {guest_mac(n)} interface {guest_mac(n)} any")
        lines.append(f"ROUTE ADD any ff:ff:ff:ff:ff:ff interface {guest_mac(n)} any")
    for h in peers:
        for n in guests[h]:
            lines.append(f"ROUTE ADD any {guest_mac(n)} edge h{h} any")
        lines.append(f"ROUTE ADD any ff:ff:ff:ff:ff:ff edge h{h} interface")
    return "\n".join(lines) + "\n"


def wg_mesh(lab, layout: dict[int, list[int]], *args):
    """Hosts with one vnetd each (a key file it makes itself; `args` more
    arguments), a guest per entry, WireGuard links between every pair."""
    hosts = {h: lab.add_host(h) for h in layout}
    d = {}
    for h in layout:
        ifaces = "".join(f"INTERFACE ADD g{n} {guest_mac(n)} mtu {GUEST_MTU}\n" for n in layout[h])
        d[h] = lab.start_vnetd(hosts[h], ifaces, "--wireguard-key-file", lab.tmp / f"h{h}.wgkey", *args)
    keys = {h: public_key(d[h]) for h in layout}
    for h in layout:
        assert (os.stat(lab.tmp / f"h{h}.wgkey").st_mode & 0o777) == 0o600
        d[h].ctl_file(wg_config(h, {p: keys[p] for p in layout if p != h}, layout))
    g = {n: lab.attach_guest(hosts[h], f"g{n}", n) for h, ns in layout.items() for n in ns}
    return hosts, d, g, keys


def link_stats(d, name):
    return d.stats()[f"link {name}"]


def capture(lab, ns, dev, path, filt=()):
    p = lab.popen(ns, "tcpdump", "-i", dev, "-s", "0", "-U", "--immediate-mode", "-n", "-w", path, *filt,
                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    # tcpdump says "listening on" once it captures.
    p.stderr.readline()
    return p


def stop_capture(p):
    time.sleep(0.3)
    p.terminate()
    p.wait(timeout=10)


def packets(path) -> list[bytes]:
    """The packets in a capture, without pcap's own headers."""
    data = Path(path).read_bytes()
    out, at = [], 24
    while at + 16 <= len(data):
        incl = int.from_bytes(data[at + 8:at + 12], "little")
        out.append(data[at + 16:at + 16 + incl])
        at += 16 + incl
    return out


def udp_payload(pkt: bytes) -> bytes | None:
    """A packet's UDP payload (Ethernet + IPv4 or IPv6 + UDP), or None."""
    if len(pkt) > 42 and pkt[12:14] == b"\x08\x00" and pkt[23] == 17:
        return pkt[14 + (pkt[14] & 15) * 4 + 8:]
    if len(pkt) > 62 and pkt[12:14] == b"\x86\xdd" and pkt[20] == 17:
        return pkt[14 + 40 + 8:]
    return None


def datagrams(lab, path) -> list[bytes]:
    """The UDP payloads in a capture."""
    return [p for p in map(udp_payload, packets(path)) if p is not None]


# WireGuard's fixed fields before a message's sealed or random part: type
# and reserved, then indices (a data message's counter too); and the sizes
# of the handshake messages (initiation, response, cookie reply).
WG_FIELDS = {1: 8, 2: 12, 3: 8, 4: 16}
WG_SIZES = {1: 148, 2: 92, 3: 64}


def is_wireguard(p: bytes) -> bool:
    """A UDP payload shaped as a WireGuard message (a GSO run of data
    messages counts as one). A frame in clear to MAC 02:00:00:00:00:0N
    starts as a message type would; it has none of these sizes."""
    if len(p) < 32 or p[0] not in WG_FIELDS or p[1:4] != b"\0\0\0":
        return False
    return p[0] == 4 or len(p) == WG_SIZES[p[0]]


def in_clear(path) -> list[bytes]:
    """What of a capture could hold a guest's bytes in clear: of each
    WireGuard datagram the part after its fixed fields (a GSO run shows as
    one datagram, its data messages back to back, each starting with the
    same type and receiver index); every other packet whole. Indices,
    counters and pcap's own headers are left out: they are numbers that may
    spell anything, a MAC among them."""
    out = []
    for pkt in packets(path):
        p = udp_payload(pkt)
        if p is None or not is_wireguard(p):
            out.append(pkt)
        elif p[0] != 4:
            out.append(p[WG_FIELDS[p[0]]:])
        else:
            starts = [m.start() for m in re.finditer(re.escape(p[:8]), p)]
            out += [p[a + 16:b] for a, b in zip(starts, starts[1:] + [len(p)])]
    return out


def leaked(path, needle: bytes) -> bool:
    return any(needle in chunk for chunk in in_clear(path))


def test_a_wireguard_link_carries_ping_and_200_mb_each_way_and_the_underlay_sees_none_of_it(lab):
    hosts, d, g, keys = wg_mesh(lab, {1: [1], 2: [2]})
    pcap = lab.tmp / "underlay.pcap"
    cap = capture(lab, hosts[1], "eth0", pcap)
    # Pings carrying a known pattern, and a TCP stream.
    assert lab.x(g[1].ns, "ping", "-n", "-q", "-c", "5", "-i", "0.05", "-p", PATTERN, g[2].ip, check=False).returncode == 0
    transfer(lab, g[1], g[2], 2_000_000)
    stop_capture(cap)
    seen = datagrams(lab, pcap)
    # (GSO runs show as one packet each on the veth.)
    assert len(seen) > 20, len(seen)
    # Nothing of the guests' frames is on the wire: not the pattern, not
    # their MACs, not their IP addresses; every datagram is WireGuard's
    # (message types 1-4, to or from port 51820).
    assert not leaked(pcap, bytes.fromhex(PATTERN)[:8])
    for mac in (g[1].mac, g[2].mac):
        assert not leaked(pcap, bytes.fromhex(mac.replace(":", ""))), mac
    for ip in (g[1].ip, g[2].ip):
        assert not leaked(pcap, bytes(int(x) for x in ip.split("."))), ip
    assert all(map(is_wireguard, seen))
    # 200 MB each way, SHA-256 checked by the receiver.
    transfer(lab, g[1], g[2], 200_000_000, port=5002)
    transfer(lab, g[2], g[1], 200_000_000, port=5003)
    for h, peer in ((1, 2), (2, 1)):
        s = link_stats(d[h], f"h{peer}")
        assert s["wg_handshakes"] >= 1, s
        assert s["in_frames"] > 100_000 and s["out_frames"] > 100_000, s
        assert s["wg_unauthenticated"] == s["wg_replays"] == s["drop_unauthenticated"] == 0, s
        line = next(l for l in d[h].ctl("LINK", "LIST").stdout.splitlines() if f"name=h{peer} " in l)
        assert "proto=wireguard" in line and f"peer_key={keys[peer]}" in line
        assert f"endpoint={underlay_ip(peer)}:51820" in line and "handshake_age_s=never" not in line


def test_a_wireguard_link_takes_88_bytes_so_a_1412_byte_frame_crosses_a_1500_byte_underlay_whole(lab):
    """W16: the link's overhead is 88 bytes (outer IPv4 + UDP, WireGuard's
    header and tag, the inner IPv4 + UDP): a guest at MTU 1398 sends a full
    frame of 1412 bytes, which leaves as one 1500-byte IPv4 packet (UDP
    payload 1472), not a fragment."""
    hosts, d, g, keys = wg_mesh(lab, {1: [1], 2: [2]})
    assert lab.reaches(g[1], g[2])
    pcap = lab.tmp / "full.pcap"
    cap = capture(lab, hosts[1], "eth0", pcap, ("udp", "and", "dst", "host", underlay_ip(2)))
    # An echo request of 1370 bytes: IPv4 1398, the frame 1412.
    r = lab.x(g[1].ns, "ping", "-n", "-q", "-c", "3", "-i", "0.2", "-M", "do", "-s", "1370", g[2].ip, check=False)
    stop_capture(cap)
    assert " 0% packet loss" in r.stdout, r.stdout
    pkts = [p for p in packets(pcap) if len(p) > 14 + 20 + 8]
    data = [p for p in pkts if (udp_payload(p) or b"\0")[:1] == b"\x04"]
    sizes = sorted({int.from_bytes(p[16:18], "big") for p in data})
    assert sizes and sizes[-1] == 1500, sizes
    assert max(len(udp_payload(p)) for p in data) == 1472
    # No IP fragment among them (flags MF, or an offset).
    assert all(int.from_bytes(p[20:22], "big") & 0x3FFF == 0 for p in pkts), "a fragment on the underlay"


def test_forged_replayed_and_old_session_datagrams_are_dropped_counted_and_reach_no_guest(lab):
    hosts, d, g, keys = wg_mesh(lab, {1: [1], 2: [2]}, "--metrics", "9190")
    assert lab.reaches(g[1], g[2])
    # A real data datagram from host 1 to host 2, taken off the wire.
    pcap = lab.tmp / "one.pcap"
    cap = capture(lab, hosts[2], "eth0", pcap, ("udp", "and", "src", "host", underlay_ip(1)))
    lab.x(g[1].ns, "ping", "-n", "-q", "-c", "3", "-i", "0.1", g[2].ip, check=False)
    stop_capture(cap)
    data = [p for p in datagrams(lab, pcap) if p[0] == 4 and len(p) > 100]
    assert data, "no data datagram captured"
    real = data[-1]
    time.sleep(0.5)

    def sent_from_h1(payload: bytes, count=1):
        lab.x(hosts[1], "python3", SPOOF, underlay_ip(1), "51820", underlay_ip(2), "51820", payload.hex(), str(count))

    def counts():
        s = link_stats(d[2], "h1")
        gs = d[2].stats()["interface g2"]
        return s, gs["out_frames"]

    before, to_guest = counts()
    # Replayed: the same datagram again, ten times, from the peer's address.
    sent_from_h1(real, 10)
    assert wait_until(lambda: counts()[0]["wg_replays"] == before["wg_replays"] + 10, 5), counts()[0]
    # Forged: the peer's address, a live receiver index, fresh counters
    # (past the replay check) and the sealed bytes changed.
    counter = int.from_bytes(real[8:16], "little")
    for k in range(5):
        forged = bytearray(real)
        forged[8:16] = (counter + 1000 + k).to_bytes(8, "little")
        forged[40] ^= 0x55
        sent_from_h1(bytes(forged))
    assert wait_until(lambda: counts()[0]["wg_unauthenticated"] == before["wg_unauthenticated"] + 5, 5), counts()[0]
    after, to_guest_after = counts()
    assert after["drop_unauthenticated"] == before["drop_unauthenticated"] + 15, after
    assert after["in_frames"] == before["in_frames"], "a refused datagram became a frame"
    assert to_guest_after == to_guest, "a refused datagram reached the guest"
    # Not a roam: the endpoint stays where the authentic datagrams came from.
    assert after["wg_roams"] == 0
    # /metrics has the same numbers as STATS.
    from test_ops import samples, scrape
    body, status = scrape(lab, hosts[2])
    m = samples(body)
    link = frozenset({("link", "h1")})
    assert m[("vnet_link_wg_replays_total", link)] == after["wg_replays"], status
    assert m[("vnet_link_wg_unauthenticated_total", link)] == after["wg_unauthenticated"]
    assert m[("vnet_link_drops_total", link | {("reason", "unauthenticated")})] == after["drop_unauthenticated"]
    # Under an old session: host 2 forgets its sessions with host 1 (the link
    # made again, under a new receiver index); the datagram's session and
    # index are gone with them: a datagram of no link, counted so.
    d[2].ctl_file(f"ROUTE DEL any {guest_mac(1)} edge h1 any\nROUTE DEL any ff:ff:ff:ff:ff:ff edge h1 interface\nLINK DEL h1\n"
                  f"LINK ADD {underlay_ip(1)} wireguard {keys[1]} name h1\n"
                  f"ROUTE ADD any {guest_mac(1)} edge h1 any\nROUTE ADD any ff:ff:ff:ff:ff:ff edge h1 interface\n")
    before, g_before = link_stats(d[2], "h1"), d[2].stats()["global"]
    sent_from_h1(real, 3)
    assert wait_until(lambda: d[2].stats()["global"]["drop_unknown_sender"] == g_before["drop_unknown_sender"] + 3, 5)
    s = link_stats(d[2], "h1")
    assert s["in_frames"] == before["in_frames"] and d[2].stats()["global"]["in_frames"] == g_before["in_frames"] + 3, s
    # Garbage to the port and handshakes from a stranger's key: counted
    # daemon-wide (no link to name), and the link still works.
    g_before = d[2].stats()["global"]
    lab.x(hosts[1], "python3", SPOOF, underlay_ip(1), "40000", underlay_ip(2), "51820", "deadbeef" * 8, "4")
    assert wait_until(lambda: d[2].stats()["global"]["drop_malformed"] >= g_before["drop_malformed"] + 4, 5)
    assert lab.reaches(g[1], g[2], tries=10), (d[1].ctl("STATS", "links").stdout, d[2].ctl("STATS", "links").stdout, d[2].ctl("LINK", "LIST").stdout)


def test_a_third_host_replaying_a_handshake_moves_nothing(lab):
    """Handshake initiations replayed in a burst from another address (over
    the rate limit, so answered by cookie replies): the link keeps its
    endpoint, counts no session and no roam, and carries on."""
    hosts, d, g, keys = wg_mesh(lab, {1: [1], 2: [2]})
    h3 = lab.add_host(3)
    assert lab.reaches(g[1], g[2])
    # Host 1 makes its link again: a fresh initiation, taken off the wire.
    pcap = lab.tmp / "init.pcap"
    cap = capture(lab, hosts[2], "eth0", pcap, ("udp", "and", "src", "host", underlay_ip(1)))
    d[1].ctl_file(f"ROUTE DEL any {guest_mac(2)} edge h2 any\nROUTE DEL any ff:ff:ff:ff:ff:ff edge h2 interface\nLINK DEL h2\n"
                  f"LINK ADD {underlay_ip(2)} wireguard {keys[2]} name h2\n"
                  f"ROUTE ADD any {guest_mac(2)} edge h2 any\nROUTE ADD any ff:ff:ff:ff:ff:ff edge h2 interface\n")
    assert lab.reaches(g[1], g[2], tries=5)
    stop_capture(cap)
    inits = [p for p in datagrams(lab, pcap) if p[0] == 1 and len(p) == 148]
    assert inits, "no initiation captured"
    before, hub_before = link_stats(d[2], "h1"), d[2].stats()["wireguard"]

    def refused():
        after, hub = link_stats(d[2], "h1"), d[2].stats()["wireguard"]
        return (after["wg_replays"] - before["wg_replays"]) + (hub["cookies_sent"] - hub_before["cookies_sent"])

    lab.x(h3, "python3", SPOOF, underlay_ip(3), "51820", underlay_ip(2), "51820", inits[-1].hex(), "40")
    # Refused as stale (boringtun's timestamp check: a replay), or asked
    # for a cookie: every one of them, none taken.
    assert wait_until(lambda: refused() == 40, 5), refused()
    after = link_stats(d[2], "h1")
    line = next(l for l in d[2].ctl("LINK", "LIST").stdout.splitlines() if "name=h1 " in l)
    assert f"endpoint={underlay_ip(1)}:51820" in line, line
    assert after["wg_roams"] == before["wg_roams"] and after["wg_handshakes"] == before["wg_handshakes"], (before, after)
    assert lab.reaches(g[2], g[1], tries=3)


def test_a_peer_that_moves_to_a_new_address_is_followed(lab):
    hosts, d, g, keys = wg_mesh(lab, {1: [1], 2: [2]})
    assert lab.reaches(g[1], g[2])
    # Host 1 changes its address; host 2's link still names the old one.
    lab.x(hosts[1], "ip", "addr", "del", f"{underlay_ip(1)}/16", "dev", "eth0")
    lab.x(hosts[1], "ip", "addr", "add", "198.18.0.101/16", "dev", "eth0")
    # Host 1 speaks first (its guest pings); host 2 answers to where the
    # authentic datagrams now come from.
    assert lab.reaches(g[1], g[2], tries=10)
    s = link_stats(d[2], "h1")
    assert s["wg_roams"] >= 1, s
    line = next(l for l in d[2].ctl("LINK", "LIST").stdout.splitlines() if "name=h1 " in l)
    assert "endpoint=198.18.0.101:51820" in line, line
    assert lab.reaches(g[2], g[1], tries=5)


def test_frames_waiting_for_a_session_are_bounded_at_250_and_the_rest_counted(lab):
    """A WireGuard link to a host where nothing answers: the guest's frames
    for it wait for a session that never comes. 250 wait (boringtun keeps
    them for the handshake); each frame beyond is dropped at once, counted
    `queue_full` on the link; none is sent, and the handshake was tried.
    Catches: the bound gone (tried: MAX_WAITING raised to 100000, then
    boringtun's own queue drops the rest uncounted: queue_full stayed 0),
    frames beyond it sent or lost without a count."""
    h1, _ = lab.add_host(1), lab.add_host(2)
    d = lab.start_vnetd(h1, f"INTERFACE ADD g1 {guest_mac(1)} mtu {GUEST_MTU}\n", "--wireguard-key-file", lab.tmp / "h1.wgkey")
    nobody = "yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBmk="
    d.ctl_file(wg_config(1, {2: nobody}, {1: [1], 2: [2]}))
    g1 = lab.attach_guest(h1, "g1", 1)
    # Unicast to guest 2's MAC (no ARP), paced so that none waits in the
    # kernel's queue to vnetd.
    lab.x(g1.ns, "ip", "neigh", "replace", overlay_ip(2), "lladdr", guest_mac(2), "dev", g1.tap, "nud", "permanent")
    lab.x(g1.ns, "python3", "-c",
          "import socket,time;s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
          f"for _ in range(400): s.sendto(b'w'*100,({overlay_ip(2)!r},9)); time.sleep(0.001)\n")
    assert wait_until(lambda: link_stats(d, "h2")["drop_queue_full"] >= 150, 5), link_stats(d, "h2")
    time.sleep(0.3)
    s = link_stats(d, "h2")
    assert s["drop_queue_full"] == 150 and s["out_frames"] == 0, s
    assert s["wg_initiations"] >= 1 and s["wg_handshakes"] == 0, s
    assert d.stats()["global"]["drop_queue_full"] == 150


def test_wireguard_needs_a_private_key_file_and_a_real_key(lab):
    h = lab.add_host(1)
    d = lab.start_vnetd(h)
    r = d.ctl("LINK", "ADD", underlay_ip(2), "wireguard", "yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBmk=", check=False)
    assert r.returncode != 0 and "--wireguard-key-file" in r.stdout + r.stderr
    d.stop()
    key = lab.tmp / "open.wgkey"
    key.write_text("yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBmk=\n")
    os.chmod(key, 0o644)
    from netlab import start_fails
    err = start_fails(lab, h, "--wireguard-key-file", key)
    assert "others may read it" in err, err
    os.chmod(key, 0o600)
    d = lab.start_vnetd(h, None, "--wireguard-key-file", key)
    r = d.ctl("LINK", "ADD", underlay_ip(2), "wireguard", "not-a-key", check=False)
    assert r.returncode != 0 and "is not a WireGuard key" in r.stdout + r.stderr
    own = public_key(d)
    r = d.ctl("LINK", "ADD", underlay_ip(2), "wireguard", own, check=False)
    assert r.returncode != 0 and "own WireGuard key" in r.stdout + r.stderr
    assert "proto=" not in d.ctl("LINK", "LIST").stdout


def wggo_behind(lab, hosts, d1):
    """Host 2 as the wireguard-go tests have it: Debian's wireguard-go,
    configured by `wg`, peered with host 1's vnetd `d1` and carrying
    everything to host 1's address inside the tunnel, and a plain vnetd
    whose ordinary UDP link to host 1 goes through it (sized to the tunnel's
    MTU, on the user datapath: the kernel fast path would send on the
    underlay device, around the tunnel's policy routing). Host 1 is given
    its WireGuard link and routes at run time. Returns (the wireguard-go
    peer, its key file, host 2's vnetd)."""
    import wggo
    key_file, wg_pub = wggo.genkey(lab.tmp / "h2-wg.key")
    peer = wggo.start(hosts[2], lab.prefix, underlay_ip(2), underlay_ip(1), public_key(d1), key_file=key_file, lab=lab)
    d2 = lab.start_vnetd(hosts[2], f"INTERFACE ADD g2 {guest_mac(2)} mtu {GUEST_MTU}\n"
                         f"LINK ADD {underlay_ip(1)} udp mtu {wggo.FULL_TUNNEL_MTU} name h1\n"
                         f"ROUTE ADD any {guest_mac(2)} interface {guest_mac(2)} any\n"
                         f"ROUTE ADD any ff:ff:ff:ff:ff:ff interface {guest_mac(2)} any\n"
                         f"ROUTE ADD any {guest_mac(1)} edge h1 any\n"
                         f"ROUTE ADD any ff:ff:ff:ff:ff:ff edge h1 interface\n"
                         "SET datapath user\n")
    d1.ctl_file(wg_config(1, {2: wg_pub}, {1: [1], 2: [2]}))
    return peer, key_file, d2


def test_an_unmodified_wireguard_go_peer_with_a_plain_vnetd_interoperates_both_ways(lab):
    """Host 1: vnetd's built-in WireGuard link. Host 2: Debian's wireguard-go,
    configured by `wg`, carrying everything to host 1's address inside the
    tunnel, and a plain vnetd whose ordinary UDP link to host 1 goes through
    it. Guests on both talk; then wireguard-go starts over (no sessions) and
    its side makes the handshake."""
    import wggo
    hosts = {h: lab.add_host(h) for h in (1, 2)}
    d1 = lab.start_vnetd(hosts[1], f"INTERFACE ADD g1 {guest_mac(1)} mtu {GUEST_MTU}\n",
                         "--wireguard-key-file", lab.tmp / "h1.wgkey")
    peer, key_file, d2 = wggo_behind(lab, hosts, d1)
    g = {h: lab.attach_guest(hosts[h], f"g{h}", h) for h in (1, 2)}
    pcap = lab.tmp / "interop.pcap"
    cap = capture(lab, hosts[1], "eth0", pcap)
    assert lab.reaches(g[1], g[2], tries=5)
    transfer(lab, g[1], g[2], 20_000_000)
    transfer(lab, g[2], g[1], 20_000_000, port=5002)
    stop_capture(cap)
    # Everything between the hosts was WireGuard: nothing to port 9000.
    seen = datagrams(lab, pcap)
    assert seen and all(map(is_wireguard, seen))
    # (Not the raw file: there CI once found host 1's guest MAC, spelt by a
    # data message's receiver index, vnetd's first link in its second
    # session, 02 00 00 00, and its counter 256, 00 01 ...)
    assert not leaked(pcap, bytes.fromhex(guest_mac(1).replace(":", "")))
    s1 = link_stats(d1, "h2")
    assert s1["wg_handshakes"] >= 1 and s1["in_frames"] > 10_000 and s1["out_frames"] > 10_000, s1
    assert link_stats(d2, "h1")["in_frames"] > 10_000
    # wireguard-go's own account: a handshake with host 1's key, bytes both ways.
    p = peer.peers()[public_key(d1)]
    assert p["latest_handshake"] > 0 and p["rx_bytes"] > 20_000_000 and p["tx_bytes"] > 20_000_000, p
    # wireguard-go starts over with no session: host 2 speaks first, and
    # wireguard-go's handshake is the one that opens the way.
    peer.stop()
    before = link_stats(d1, "h2")["wg_handshakes"]
    peer = wggo.start(hosts[2], lab.prefix, underlay_ip(2), underlay_ip(1), public_key(d1), key_file=key_file, lab=lab)
    assert lab.reaches(g[2], g[1], tries=10)
    assert link_stats(d1, "h2")["wg_handshakes"] > before
    transfer(lab, g[2], g[1], 20_000_000, port=5003)
    peer.stop()


def test_a_wireguard_link_over_an_ipv6_underlay_interoperates_with_wireguard_go_over_ipv6(lab):
    """Host 1: vnetd's WireGuard link to host 2's IPv6 address. Host 2:
    wireguard-go peered over IPv6, carrying everything to host 1's IPv6
    address inside the tunnel, and a plain vnetd with a UDP link to it.
    Guests talk both ways; every datagram between the hosts is WireGuard
    over IPv6, and wireguard-go's own account has the handshake and the
    bytes."""
    import wggo
    hosts = {h: lab.add_host(h) for h in (1, 2)}
    d1 = lab.start_vnetd(hosts[1], f"INTERFACE ADD g1 {guest_mac(1)} mtu {GUEST_MTU_V6}\n",
                         "--wireguard-key-file", lab.tmp / "h1.wgkey")
    key_file, wg_pub = wggo.genkey(lab.tmp / "h2-wg.key")
    peer = wggo.start(hosts[2], lab.prefix, underlay_ip6(2), underlay_ip6(1), public_key(d1), key_file=key_file, lab=lab)
    d2 = lab.start_vnetd(hosts[2], f"INTERFACE ADD g2 {guest_mac(2)} mtu {GUEST_MTU_V6}\n"
                         f"LINK ADD {underlay_ip6(1)} udp mtu {wggo.FULL_TUNNEL_MTU_V6} name h1\n"
                         f"ROUTE ADD any {guest_mac(2)} interface {guest_mac(2)} any\n"
                         f"ROUTE ADD any ff:ff:ff:ff:ff:ff interface {guest_mac(2)} any\n"
                         f"ROUTE ADD any {guest_mac(1)} edge h1 any\n"
                         f"ROUTE ADD any ff:ff:ff:ff:ff:ff edge h1 interface\n")
    d1.ctl_file(wg_config(1, {2: wg_pub}, {1: [1], 2: [2]}).replace(f"LINK ADD {underlay_ip(2)} ", f"LINK ADD {underlay_ip6(2)} "))
    line = next(l for l in d1.ctl("LINK", "LIST").stdout.splitlines() if "name=h2 " in l)
    # The largest frame the link carries whole: the guests' MTU.
    assert f"max_frame={GUEST_MTU_V6 + 14}" in line, line
    g = {h: lab.attach_guest(hosts[h], f"g{h}", h) for h in (1, 2)}
    pcap = lab.tmp / "interop6.pcap"
    cap = capture(lab, hosts[1], "eth0", pcap, ("udp",))
    assert lab.reaches(g[1], g[2], tries=5)
    # The largest ping that fits, whole both ways (IPv4 of GUEST_MTU_V6).
    r = lab.x(g[1].ns, "ping", "-n", "-q", "-c", "3", "-i", "0.2", "-M", "do", "-s", str(GUEST_MTU_V6 - 28), g[2].ip, check=False)
    assert " 0% packet loss" in r.stdout, r.stdout
    transfer(lab, g[1], g[2], 20_000_000)
    transfer(lab, g[2], g[1], 20_000_000, port=5002)
    stop_capture(cap)
    pkts = packets(pcap)
    assert pkts and all(p[12:14] == b"\x86\xdd" for p in pkts), "a datagram between the hosts over IPv4"
    seen = datagrams(lab, pcap)
    assert seen and all(map(is_wireguard, seen))
    assert not leaked(pcap, bytes.fromhex(guest_mac(1).replace(":", "")))
    s1 = link_stats(d1, "h2")
    assert s1["wg_handshakes"] >= 1 and s1["in_frames"] > 10_000 and s1["out_frames"] > 10_000, s1
    assert f"endpoint=[{underlay_ip6(2)}]:51820" in next(l for l in d1.ctl("LINK", "LIST").stdout.splitlines() if "name=h2 " in l)
    p = peer.peers()[public_key(d1)]
    assert p["endpoint"] == f"[{underlay_ip6(1)}]:51820", p
    assert p["latest_handshake"] > 0 and p["rx_bytes"] > 20_000_000 and p["tx_bytes"] > 20_000_000, p
    peer.stop()


def test_wireguard_rotate_is_an_admin_request_of_its_own_and_writes_the_new_key_to_the_file(lab):
    """W20, W22: `WIREGUARD ROTATE` is refused to a read-only caller and
    beside any other command (nothing changes either way); an admin's
    writes the new key pair over the key file, which `wg pubkey` then reads
    as the public key `SHOW` gives (not beside it: the review's MUT-1 wrote
    `<file>.rotated` and kept the old key, so the next start would have used
    a key every peer had replaced); after a restart vnetd keeps the new key."""
    from netlab import write_token
    h = lab.add_host(1)
    key = lab.tmp / "h1.wgkey"
    admin = write_token(lab, "admin.token", "admin-token-0123456789abcdef")
    read = write_token(lab, "read.token", "read-token-0123456789abcdef")
    d = lab.start_vnetd(h, None, "--wireguard-key-file", key, "--control-tcp", "127.0.0.1:9101",
                        "--control-token-file", admin, "--control-read-token-file", read)
    from netlab import VNETCTL
    old = public_key(d)
    r = lab.x(h, VNETCTL, "--tcp", "127.0.0.1:9101", "--token-file", read, "WIREGUARD", "ROTATE", check=False)
    assert r.returncode == 1 and "permission denied" in r.stderr and "role read" in r.stderr, r
    r = d.ctl_file("WIREGUARD ROTATE\nLINK ADD 198.18.0.9\n", check=False)
    assert r.returncode != 0 and "WIREGUARD ROTATE must be a request of its own" in r.stdout + r.stderr, r
    assert public_key(d) == old and "198.18.0.9" not in d.ctl("LINK", "LIST").stdout

    def file_key() -> str:
        return subprocess.run(["wg", "pubkey"], input=key.read_text(), capture_output=True, text=True, check=True).stdout.strip()

    assert file_key() == old
    d.ctl("WIREGUARD", "ROTATE")
    new = public_key(d)
    assert new != old and file_key() == new, (old, new, file_key())
    assert (key.stat().st_mode & 0o777) == 0o600 and not key.with_suffix(".new").exists()
    d.stop()
    assert public_key(lab.start_vnetd(h, None, "--wireguard-key-file", key)) == new


def test_a_takeover_carries_the_wireguard_session_on_and_wireguard_go_sees_no_new_handshake(lab):
    """Host 1's vnetd, WireGuard-linked to an unmodified wireguard-go on host 2
    (the interop setup above), is upgraded by hand-over (`vnetd --takeover`)
    under a 1000/s ping from host 2's guest. The old vnetd writes out the
    link's session (keys, counters, replay window, timers) and the new one
    goes on with it: no handshake message crosses the underlay from the
    hand-over on, wireguard-go's latest handshake stays the one before,
    the new vnetd's link sends no initiation, and at most one ping of 3000
    is lost (issue 43's bound).
    Catches: the session not carried (boringtun's own behaviour: the new
    vnetd handshakes again, wireguard-go's latest handshake moves, the
    frames of the gap are lost: 2 of 3000 when last measured), the sending
    counter not carried (wireguard-go drops the new vnetd's datagrams as
    replays: pings lost until a rekey)."""
    hosts = {h: lab.add_host(h) for h in (1, 2)}
    wg_args = ("--wireguard-key-file", lab.tmp / "h1.wgkey")
    # Host 1's guest is attached by vnetd (`netns`), as a deployment does:
    # the new vnetd finds its TAP there.
    ns1 = lab.guest_ns("g1")
    d1 = lab.start_vnetd(hosts[1], f"INTERFACE ADD g1 {guest_mac(1)} mtu {GUEST_MTU} netns {ns1}\n", *wg_args)
    # Host 1's link and routes are given at run time: the new vnetd has
    # them from the state file.
    peer, _, _ = wggo_behind(lab, hosts, d1)
    g = {1: lab.veth_guest(hosts[1], "g1", 1, ns1), 2: lab.attach_guest(hosts[2], "g2", 2)}
    try:
        assert lab.reaches(g[2], g[1], tries=5)
        before = peer.peers()[public_key(d1)]["latest_handshake"]
        assert before > 0
        # wireguard-go counts in whole seconds: a handshake from here on
        # shows as a later second.
        time.sleep(1.2)
        pcap = lab.tmp / "takeover.pcap"
        cap = capture(lab, hosts[1], "eth0", pcap)
        ping = lab.popen(g[2].ns, "ping", "-q", "-i", "0.001", "-c", "3000", "-W", "1", g[1].ip,
                         stdout=subprocess.PIPE, text=True)
        time.sleep(1)
        new = lab.start_vnetd(hosts[1], d1.config, *wg_args, "--takeover")
        assert d1.proc.wait(timeout=10) == 0
        d1.stopped_with = signal.SIGTERM
        out = ping.communicate(timeout=60)[0]
        stop_capture(cap)
        got = int(out.split(" received")[0].rsplit(None, 1)[1])
        log = new.log_text()
        print(f"WireGuard link across a takeover, 1000/s ping: {3000 - got} of 3000 lost")
        assert "1 WireGuard session(s) taken on" in log, log
        assert got >= 2999, out + log
        kinds = [p[0] for p in datagrams(lab, pcap) if is_wireguard(p)]
        assert kinds.count(4) > 5000 and not [k for k in kinds if k != 4], f"handshake messages on the underlay: {sorted(set(kinds))}"
        assert peer.peers()[public_key(d1)]["latest_handshake"] == before, "wireguard-go made a new handshake"
        s = link_stats(new, "h2")
        assert s["wg_initiations"] == 0 and s["wg_handshakes"] == 0 and s["in_frames"] > 1000 and s["out_frames"] > 1000, s
        assert "sessions_taken_over=1" in next(l for l in new.ctl("SHOW").stdout.splitlines() if l.startswith("wireguard ")), new.ctl("SHOW").stdout
        line = next(l for l in new.ctl("LINK", "LIST").stdout.splitlines() if "h2" in l)
        assert "handshake_age_s=never" not in line, line
    finally:
        peer.stop()
