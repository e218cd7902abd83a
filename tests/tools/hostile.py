#!/usr/bin/env python3
"""The hostile input of test_hostile.py, from one process on a stranger's
host: garbage, floods and frames with a vnetd peer's address forged (raw
IPv4), sent batch after batch at a vnetd. After each batch it prints
"<batch> <datagrams>"; at the end, "done".

  hostile.py VNETD_IP PEER_IP STRANGER_IP MAC_G1 MAC_G2 MAC_G3
"""
import os
import random
import socket
import struct
import sys
import time

from spoof import checksum


def mac(m: str) -> bytes:
    return bytes.fromhex(m.replace(":", ""))


def frame(dst: bytes, src: bytes, size: int) -> bytes:
    return dst + src + b"\x88\xb5" + b"z" * (size - 14)


def main():
    target, peer, stranger = sys.argv[1:4]
    g1, g2, g3 = (mac(m) for m in sys.argv[4:7])
    raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((stranger, 0))
    sent = 0

    def forged(src, payload: bytes, dport=9000, sport=9000):
        """A UDP datagram with source address `src`, whoever that is."""
        nonlocal sent
        u = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload  # checksum 0: none
        h = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(u), 0, 0, 64, 17, 0,
                        socket.inet_aton(src), socket.inet_aton(target))
        raw.sendto(h[:10] + struct.pack("!H", checksum(h)) + h[12:] + u, (target, 0))
        sent += 1
        if sent % 200 == 0:
            time.sleep(0.002)  # a flood, but not one the receive buffer cannot hold

    def batch(name, n):
        print(name, n, flush=True)

    # Runts (0..13 bytes) with the peer's forged address: malformed, on its link.
    for size in range(14):
        for _ in range(10):
            forged(peer, os.urandom(size))
    batch("runts", 140)
    # Frames for MACs no route claims, forged from the peer: no route.
    for _ in range(50):
        forged(peer, frame(bytes([2, 0xee, random.randrange(256), 0, 0, 1]), g2, 60))
    batch("no_route", 50)
    # Frames too big for g1 (MTU 1000), forged from the peer: oversize.
    for _ in range(20):
        forged(peer, frame(g1, g2, 1400))
    batch("oversize", 20)
    # From the stranger's own address, which no link has: unknown sender.
    for _ in range(300):
        forged(stranger, frame(g1, g2, 100))
    batch("strangers", 300)
    # VXLAN: a bad header (I flag clear) from the stranger; an unknown VNI from the peer.
    for _ in range(30):
        forged(stranger, bytes(8) + frame(g1, g2, 60), dport=4789)
    batch("vxlan_bad_header", 30)
    for _ in range(30):
        forged(peer, bytes([8, 0, 0, 0, 0, 0, 99, 0]) + frame(g1, g2, 60), dport=4789)
    batch("vxlan_unknown_vni", 30)
    # A flood of made-up source MACs from the stranger (unknown sender), through a plain socket.
    for i in range(30000):
        udp.sendto(g1 + bytes([2, i >> 16 & 255, i >> 8 & 255, i & 255, 0, 7]) + b"\x88\xb5" + b"f" * 46, (target, 9000))
        if i % 200 == 199:
            time.sleep(0.002)
    batch("flood", 30000)
    # Valid frames for g3 from 20 000 made-up source MACs, forged from the
    # peer: delivered, and the route cache must stay bounded.
    for i in range(20000):
        forged(peer, g3 + bytes([2, 0xf0, i >> 16 & 255, i >> 8 & 255, i & 255, 7]) + b"\x88\xb5" + b"f" * 46)
    batch("forged", 20000)
    print("done", flush=True)


if __name__ == "__main__":
    main()
