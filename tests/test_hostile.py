"""Hostile input at a running vnetd: garbage from strangers and from forged
peer addresses, floods, broken framing. It keeps forwarding the legitimate
traffic of the same run, its memory stays bounded, and every dropped datagram
is counted under a reason."""

import os
import random
import socket
import subprocess
import sys
import time

from netlab import REPO, guest_mac, mesh_config
from test_datapath import transfer

SPOOF = REPO / "tests" / "tools" / "spoof.py"
XFER = REPO / "tests" / "tools" / "xfer.py"


def rss_kb(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def frame(dst: str, src: str, size: int) -> bytes:
    return bytes.fromhex(dst.replace(":", "")) + bytes.fromhex(src.replace(":", "")) + b"\x88\xb5" + b"z" * (size - 14)


def test_hostile_traffic_is_dropped_and_counted_while_legit_traffic_flows(lab):
    layout = {1: [("g1", guest_mac(1))], 2: [("g2", guest_mac(2))]}
    h1, h2, evil = lab.add_host(1), lab.add_host(2), lab.add_host(9)  # evil: 198.18.0.9, no vnetd
    # Guests take 1000-byte MTUs, so a forged frame that fits the LAN can still be too big for them.
    d1 = lab.start_vnetd(h1, mesh_config(1, layout, mtu=1000) + "LINK ADD 198.18.0.2 vxlan vni 42 name vx\n"
                                                                 "LINK ADD 198.18.0.2 tcp key lab name t2\n")
    lab.start_vnetd(h2, mesh_config(2, layout, mtu=1000))
    g1, g2 = lab.attach_guest(h1, "g1", 1), lab.attach_guest(h2, "g2", 2)
    assert lab.reaches(g1, g2)
    rss0 = rss_kb(d1.proc.pid)
    before = d1.stats()

    # The legitimate traffic of the same run: 100 MB from g2 to g1.
    n = 100_000_000
    recv = lab.popen(g1.ns, "python3", XFER, "recv", 5001, stdout=subprocess.PIPE, text=True)
    assert recv.stdout.readline().strip() == "listening"
    send = lab.popen(g2.ns, "python3", XFER, "send", g1.ip, 5001, n, stdout=subprocess.PIPE, text=True)

    def spoof(src, payload: bytes, count=1, dport=9000):
        lab.x(evil, "python3", SPOOF, src, 9000, "198.18.0.1", dport, payload.hex(), count)

    # Runts (0..13 bytes) with the peer's forged address: malformed, on its link.
    for size in range(14):
        spoof("198.18.0.2", os.urandom(size), count=10)
    runts = 14 * 10
    # Frames for MACs no route claims, forged from the peer: no route.
    for _ in range(50):
        spoof("198.18.0.2", frame(f"02:ee:{random.randrange(256):02x}:00:00:01", guest_mac(2), 60))
    # Frames too big for g1 (MTU 1000), forged from the peer: oversize.
    spoof("198.18.0.2", frame(guest_mac(1), guest_mac(2), 1400), count=20)
    # From an address with no link: unknown sender.
    strangers = 300
    spoof("198.18.0.9", frame(guest_mac(1), guest_mac(2), 100), count=strangers)
    # VXLAN: a bad header (I flag clear) and an unknown VNI, from the stranger.
    spoof("198.18.0.9", bytes(8) + frame(guest_mac(1), guest_mac(2), 60), count=30, dport=4789)
    spoof("198.18.0.2", bytes([8, 0, 0, 0, 0, 0, 99, 0]) + frame(guest_mac(1), guest_mac(2), 60), count=30, dport=4789)
    # A flood of made-up source MACs from a stranger (unknown sender).
    code = ("import socket,os\n"
            "s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
            "for i in range(30000):\n"
            "    s.sendto(bytes.fromhex('020000000001')+bytes([2,i>>16&255,i>>8&255,i&255,0,7])+b'\\x88\\xb5'+b'f'*46,('198.18.0.1',9000))\n")
    lab.x(evil, "python3", "-c", code)
    flooded = 30000
    # A flood of valid frames from 20000 made-up source MACs, forged from the
    # peer: delivered to g1, and the route cache must stay bounded.
    forged = 20000
    code = ("import socket,struct\n"
            "def ck(b):\n"
            "    s=sum(struct.unpack('!10H',b))\n"
            "    while s>>16: s=(s&0xffff)+(s>>16)\n"
            "    return ~s&0xffff\n"
            "r=socket.socket(socket.AF_INET,socket.SOCK_RAW,socket.IPPROTO_RAW)\n"
            f"for i in range({forged}):\n"
            "    p=bytes.fromhex('020000000001')+bytes([2,0xf0,i>>16&255,i>>8&255,i&255,7])+b'\\x88\\xb5'+b'f'*46\n"
            "    u=struct.pack('!HHHH',9000,9000,8+len(p),0)+p\n"
            "    h=struct.pack('!BBHHHBBH4s4s',0x45,0,20+len(u),0,0,64,17,0,socket.inet_aton('198.18.0.2'),socket.inet_aton('198.18.0.1'))\n"
            "    r.sendto(h[:10]+struct.pack('!H',ck(h))+h[12:]+u,('198.18.0.1',0))\n")
    g1_out = d1.stats()["interface g1"]["out_frames"]
    lab.x(evil, "python3", "-c", code)
    # A TCP link's stream out of step: the peer, past the key handshake,
    # announces a bad length; vnetd counts it and closes the connection.
    peer = subprocess.run(["ip", "netns", "exec", h2, sys.executable, REPO / "tests" / "tools" / "tcp_link_peer.py",
                           "connect", "198.18.0.1", "9000", lab.key_dir / "lab"],
                          input="send 0000000568656c6c6f\neof 5\n", capture_output=True, text=True, timeout=30)
    assert peer.stdout.split("\n")[:3] == ["up", "sent", "eof 0"], peer.stdout + peer.stderr

    sent = send.communicate(timeout=300)[0].split()
    got = recv.communicate(timeout=60)[0].split()
    assert got == sent and sent[0] == str(n), "the legitimate transfer arrived whole"
    time.sleep(0.5)
    after = d1.stats()

    def delta(key, reason):
        return after[key][f"drop_{reason}"] - before[key][f"drop_{reason}"]

    assert delta("link 198.18.0.2", "malformed") == runts
    assert delta("link 198.18.0.2", "no_route") >= 50
    assert delta("interface g1", "oversize") == 20
    # Strangers, the unknown VNI and the flood: unknown sender; the bad VXLAN
    # header: malformed (no link to blame).
    assert delta("global", "unknown_sender") == strangers + 30 + flooded
    assert delta("global", "malformed") == runts + 30 + 1
    assert delta("link t2", "malformed") == 1
    assert after["interface g1"]["out_frames"] - g1_out >= forged  # delivered, with the transfer's own
    # Bounded memory: the flood and the garbage left no lasting growth.
    assert rss_kb(d1.proc.pid) - rss0 < 64 * 1024, (rss0, rss_kb(d1.proc.pid))
    assert d1.proc.poll() is None
    assert lab.reaches(g1, g2)
