"""TCP links open with a key handshake, and the datapath keeps its word when
the topology changes under it.

- A process at the peer's address without the key cannot take over, read or
  cut a live TCP link (code review H1).
- A hand-made peer written from docs/wire-format.md, holding the key, is
  let in and carries frames both ways.
- Frames received on a TCP link go to the guest they were routed to, also
  when an interface is deleted while a run of them is being received
  (code review H2: slots shifted and the run went to another guest).
- Deleting an interface or a TCP link releases it before the request
  returns: the TAP name is free again, the connection is closed, the link's
  thread is gone (code review M2).
- Key files are checked (mode, presence) and a refused link changes nothing."""

import os
import queue
import struct
import subprocess
import sys
import threading
import time

from netlab import REPO, guest_mac, mesh_config, underlay_ip

PEER = REPO / "tests" / "tools" / "tcp_link_peer.py"
sys.path.insert(0, str(REPO / "tests" / "tools"))
from spoof import checksum  # noqa: E402  (the Internet checksum)


def link_line(d, name):
    return next(l for l in d.ctl("LINK", "LIST").stdout.splitlines() if f"name={name} " in l)


def field(line, key):
    return next(w.split("=", 1)[1] for w in line.split() if w.startswith(key + "="))


def wait_until(what, cond, timeout=15):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Peer:
    """tests/tools/tcp_link_peer.py in a namespace, driven line by line."""

    def __init__(self, lab, ns, mode, addr, port, keyfile):
        self.p = lab.popen(ns, sys.executable, PEER, mode, addr, str(port), str(keyfile),
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        lab.other_procs.append(self.p)
        self.lines = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(l.strip()) for l in self.p.stdout], daemon=True).start()

    def line(self, timeout=20):
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("peer said nothing") from None

    def cmd(self, text):
        self.p.stdin.write(text + "\n")
        self.p.stdin.flush()

    def frames(self, n, secs):
        self.cmd(f"frames {n} {secs}")
        out = []
        while (l := self.line(secs + 10)) != "done":
            out.append(bytes.fromhex(l.split()[1]))
        return out


def tcp_frame(dst, src, seq, payload):
    """An Ethernet frame holding a valid IPv4 TCP segment (checksums right)."""
    mac = lambda m: bytes(int(x, 16) for x in m.split(":"))
    sip, dip = bytes([198, 19, 0, 9]), bytes([198, 19, 0, 2])
    ip = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, 40 + len(payload), 7, 0x4000, 64, 6, 0, sip, dip))
    ip[10:12] = struct.pack("!H", checksum(bytes(ip)))
    tcp = bytearray(struct.pack("!HHIIBBHHH", 40000, 5001, seq, 1, 5 << 4, 0x10, 65535, 0, 0))
    pseudo = sip + dip + struct.pack("!BBH", 0, 6, 20 + len(payload))
    tcp[16:18] = struct.pack("!H", checksum(pseudo + bytes(tcp) + payload))
    return mac(dst) + mac(src) + b"\x08\x00" + bytes(ip) + bytes(tcp) + payload


def udp_frame(dst, src, sip, dip, dport, payload):
    """An Ethernet frame holding a valid IPv4 UDP datagram (checksums right)."""
    mac = lambda m: bytes(int(x, 16) for x in m.split(":"))
    sip, dip = bytes(map(int, sip.split("."))), bytes(map(int, dip.split(".")))
    ip = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, 28 + len(payload), 9, 0x4000, 64, 17, 0, sip, dip))
    ip[10:12] = struct.pack("!H", checksum(bytes(ip)))
    udp = bytearray(struct.pack("!HHHH", 40001, dport, 8 + len(payload), 0))
    pseudo = sip + dip + struct.pack("!BBH", 0, 17, 8 + len(payload))
    udp[6:8] = struct.pack("!H", checksum(pseudo + bytes(udp) + payload) or 0xFFFF)
    return mac(dst) + mac(src) + b"\x08\x00" + bytes(ip) + bytes(udp) + payload


def framed(frame):
    return struct.pack("!I", len(frame)) + frame


def one_host_and_a_hand_made_peer(lab, taps, extra=""):
    """Host 1 runs vnetd with `taps` (tap -> guest number) and a TCP link
    `peer` to 198.18.0.2, where a hand-made peer with the key listens."""
    h1, h2 = lab.add_host(1), lab.add_host(2)
    peer = Peer(lab, h2, "listen", underlay_ip(2), 9000, lab.key_dir / "lab")
    assert peer.line() == "listening"
    conf = "".join(f"INTERFACE ADD {t} {guest_mac(n)}\n" for t, n in taps.items())
    conf += f"LINK ADD {underlay_ip(2)} 9000 tcp key lab name peer\n" + extra
    d = lab.start_vnetd(h1, conf)
    guests = {t: lab.attach_guest(h1, t, n) for t, n in taps.items()}
    assert peer.line() == "up"
    wait_until("link up", lambda: "state=up " in link_line(d, "peer"))
    return h1, h2, d, peer, guests


def test_a_hand_made_peer_with_the_key_carries_frames_both_ways(lab):
    extra = (f"ROUTE ADD any {guest_mac(1)} interface {guest_mac(1)} edge\n"
             f"ROUTE ADD any {guest_mac(9)} edge peer interface\n")
    h1, h2, d, peer, g = one_host_and_a_hand_made_peer(lab, {"ga": 1}, extra)
    # Peer -> guest: a UDP datagram the peer frames by hand reaches a socket
    # in the guest, payload and source intact. (vnetd's out_frames alone
    # would also count a frame written to the wrong TAP or mangled.)
    ga = g["ga"]
    rx = lab.popen(ga.ns, sys.executable, "-c",
                   "import socket,sys\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
                   f"s.bind(({ga.ip!r},5001))\nprint('bound',flush=True)\ns.settimeout(10)\n"
                   "data,src=s.recvfrom(2048)\nprint(src[0],data.decode(),flush=True)\n",
                   stdout=subprocess.PIPE, text=True)
    assert rx.stdout.readline().strip() == "bound"
    frame = udp_frame(guest_mac(1), guest_mac(9), "198.19.0.9", ga.ip, 5001, b"hello over tcp")
    peer.cmd("send " + framed(frame).hex())
    assert peer.line() == "sent"
    out, _ = rx.communicate(timeout=15)
    assert out.strip() == "198.19.0.9 hello over tcp", out
    assert d.stats()["interface ga"]["out_frames"] == 1
    # Guest -> peer: a frame the guest sends to MAC 9 comes out framed.
    lab.x(g["ga"].ns, "ip", "neigh", "replace", "198.19.0.9", "lladdr", guest_mac(9), "dev", "ga", "nud", "permanent")
    lab.x(g["ga"].ns, "ping", "-c", "1", "-W", "1", "198.19.0.9", check=False)
    got = peer.frames(1, 5)
    assert len(got) == 1 and got[0][:6] == bytes.fromhex(guest_mac(9).replace(":", ""))
    assert got[0][12:14] == b"\x08\x00"
    assert d.stats()["link peer"]["out_frames"] == 1


def test_a_stranger_at_the_peers_address_cannot_take_over_the_link(lab):
    by_host = {h: [(f"g{h}", guest_mac(h))] for h in (1, 2)}
    hosts = {h: lab.add_host(h) for h in (1, 2)}
    d = {h: lab.start_vnetd(hosts[h], mesh_config(h, by_host, link="9000 tcp key lab")) for h in (1, 2)}
    g = {h: lab.attach_guest(hosts[h], f"g{h}", h) for h in (1, 2)}
    peer_name = underlay_ip(2)
    wait_until("link up", lambda: "state=up " in link_line(d[1], peer_name))
    assert lab.reaches(g[1], g[2])
    connects = int(field(link_line(d[1], peer_name), "connects"))
    # From host 2's own address (any process there, or behind its NAT):
    # a full handshake attempt without the key...
    stranger = Peer(lab, hosts[2], "connect", underlay_ip(1), 9000, "-")
    assert stranger.line() == "up"  # it got the challenge and sent a forged proof
    # ...meets a closed connection, having received nothing after the challenge,
    # while the guests go on talking over the live connection.
    pinger = lab.popen(g[1].ns, "ping", "-c", "20", "-i", "0.05", g[2].ip, stdout=subprocess.PIPE, text=True)
    stranger.cmd("eof 5")
    assert stranger.line() == "eof 0"
    # The old, unauthenticated way in (a length prefix and a frame) gets nothing either.
    lab.x(hosts[2], "python3", "-c",
          "import socket;s=socket.create_connection(('198.18.0.1',9000));"
          "s.sendall(b'\\x00\\x00\\x00\\x40'+b'x'*64);s.settimeout(7);"
          "assert s.recv(100)==b'', 'got data'", timeout=30)
    out, _ = pinger.communicate(timeout=30)
    assert pinger.returncode == 0 and " 0% packet loss" in out, out
    line = link_line(d[1], peer_name)
    assert field(line, "state") == "up"
    assert int(field(line, "connects")) == connects, "the live connection was never replaced"
    assert int(field(line, "auth_failures")) == 2
    assert "TCP link connection refused" in d[1].log_text()
    assert lab.reaches(g[1], g[2])


def test_a_run_received_across_a_topology_change_goes_to_its_guest(lab):
    # gb is the only destination; deleting ga shifted every later slot in
    # the old code, and the pending run went to gc.
    extra = f"ROUTE ADD any {guest_mac(2)} interface {guest_mac(2)} edge\n"
    h1, h2, d, peer, g = one_host_and_a_hand_made_peer(lab, {"ga": 1, "gb": 2, "gc": 3}, extra)
    f1 = framed(tcp_frame(guest_mac(2), guest_mac(9), 1000, b"a" * 100))
    f2 = framed(tcp_frame(guest_mac(2), guest_mac(9), 1100, b"b" * 100))
    # Frame 1 and the first bytes of frame 2: a run is open, frame 2 pending.
    peer.cmd("send " + (f1 + f2[:2]).hex())
    assert peer.line() == "sent"
    wait_until("frame 1 delivered", lambda: d.stats()["interface gb"]["out_frames"] == 1, timeout=5)
    d.ctl("INTERFACE", "DEL", "ga")
    peer.cmd("send " + f2[2:].hex())
    assert peer.line() == "sent"
    wait_until("frame 2 delivered", lambda: d.stats()["interface gb"]["out_frames"] == 2, timeout=5)
    s = d.stats()
    assert s["interface gc"]["out_frames"] == 0
    assert s["link peer"]["in_frames"] == 2
    assert s["link peer"]["drop_no_route"] == 0  # both frames were routed


def test_deleted_objects_are_released_before_the_request_returns(lab):
    extra = f"ROUTE ADD any {guest_mac(1)} interface {guest_mac(1)} edge\n"
    h1, h2, d, peer, g = one_host_and_a_hand_made_peer(lab, {"ga": 1}, extra)
    pid = d.proc.pid

    def threads():
        names = []
        for t in os.listdir(f"/proc/{pid}/task"):
            try:
                names.append(open(f"/proc/{pid}/task/{t}/comm").read().strip())
            except FileNotFoundError:  # a thread that just ended
                pass
        return names
    assert "tcp-link" in threads()
    # An interface deleted and added again by the next request: its TAP was
    # closed when DEL returned.
    d.ctl("INTERFACE", "ADD", "gx", guest_mac(5))
    d.ctl("INTERFACE", "DEL", "gx")
    d.ctl("INTERFACE", "ADD", "gx", guest_mac(5))
    # The TCP link: its connection is closed and its thread gone when DEL returns.
    d.ctl_file(f"ROUTE DEL any {guest_mac(1)} interface {guest_mac(1)} edge\nLINK DEL peer\n")
    assert "tcp-link" not in threads()
    peer.cmd("eof 1")
    assert peer.line() == "eof 0"
    assert d.ctl("LINK", "LIST").stdout == ""


def test_key_files_are_checked_and_a_refused_link_changes_nothing(lab):
    h1 = lab.add_host(1)
    d = lab.start_vnetd(h1)
    loose = lab.key_dir / "loose"
    lab.link_key("loose")
    os.chmod(loose, 0o644)
    short = lab.key_dir / "short"
    lab.link_key("short", b"too-short")
    cases = [
        ("loose", "is mode 644: others may read it"),
        ("short", "holds 9 bytes; a key has 16 at least"),
        ("absent", "cannot open key file"),
    ]
    for key, why in cases:
        r = d.ctl_file(f"INTERFACE ADD ga {guest_mac(1)}\nLINK ADD 198.18.0.2 tcp key {key}\n", check=False)
        assert r.returncode != 0 and why in r.stdout + r.stderr, (key, r.stdout, r.stderr)
        assert "line 2" in r.stdout + r.stderr
    os.symlink(lab.key_dir / "lab", lab.key_dir / "via-link")
    r = d.ctl("LINK", "ADD", "198.18.0.2", "tcp", "key", "via-link", check=False)
    assert r.returncode != 0 and "cannot open key file" in r.stdout + r.stderr
    assert d.ctl("LINK", "LIST").stdout == "" and d.ctl("INTERFACE", "LIST").stdout == ""


def test_a_peer_that_stops_reading_is_cut_off(lab):
    # The peer holds the key, then never reads again: its window closes, the
    # link's send buffer fills (queue_full), and TCP_USER_TIMEOUT (15 s) ends
    # the connection instead of pinning it forever (code review M4).
    extra = (f"ROUTE ADD any {guest_mac(1)} interface {guest_mac(1)} edge\n"
             f"ROUTE ADD any {guest_mac(9)} edge peer interface\n")
    h1, h2, d, peer, g = one_host_and_a_hand_made_peer(lab, {"ga": 1}, extra)
    connects = int(field(link_line(d, "peer"), "connects"))
    lab.x(g["ga"].ns, "ip", "neigh", "replace", "198.19.0.9", "lladdr", guest_mac(9), "dev", "ga", "nud", "permanent")
    t0 = time.monotonic()
    blast = lab.popen(g["ga"].ns, "python3", "-c",
                      "import socket,time\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
                      "end=time.time()+40\n"
                      "while time.time()<end:\n"
                      "    [s.sendto(b'z'*1400,('198.19.0.9',7)) for _ in range(200)]\n"
                      "    time.sleep(0.01)\n")
    try:
        wait_until("the link to go down", lambda: field(link_line(d, "peer"), "state") != "up", timeout=35)
        took = time.monotonic() - t0
    finally:
        blast.kill()
        blast.wait()
    s = d.stats()["link peer"]
    assert s["drop_queue_full"] > 0, s
    print(f"link down {took:.1f} s after the peer stopped reading")
    assert 10 < took < 30, took  # the user timeout, not a read error
    assert "TCP link down" in d.log_text()
    assert int(field(link_line(d, "peer"), "connects")) == connects
