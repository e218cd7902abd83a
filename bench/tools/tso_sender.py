#!/usr/bin/env python3
"""A virtio driver that sends TCP super-frames (TSO) on a vhost-user socket,
as fast as the backend takes them, for bench/vhost.py: the traffic testpmd's
txonly cannot make.

Each frame is what a Linux guest with TSO sends: a virtio-net header
(NEEDS_CSUM, GSO_TCPV4, gso_size 1448) and 54 bytes of Ethernet/IPv4/TCP
headers in one buffer, then 64,000 bytes of payload in 16 buffers of 4,000
(pages), the chain in an indirect table. 16 frames are kept in the ring:
each frame the backend returns is offered again. The ring has 32 entries:
a chain (17 descriptors here) may be no longer than the queue (virtio 1.1,
2.7.4; vnetd breaks a ring that has one, `vhost_long_chains`, and with 16
entries the benchmark measured nothing). Prints the frames sent.

    tso_sender.py <socket> <dst-mac> <src-mac> <seconds>
"""

from __future__ import annotations

import os
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "tools"))
from vhost_frontend import D_INDIRECT, D_NEXT, F_INDIRECT, F_VERSION_1, HDR, SIZE, Frontend  # noqa: E402

F_CSUM, F_HOST_TSO4 = 1 << 0, 1 << 11
PAYLOAD, PIECE = 64_000, 4_000
TABLES, DATA, SLOT = 0x8000, 0x10000, 0x11000


def frame_head(dst: bytes, src: bytes) -> bytes:
    vnet = struct.pack("<BBHHHH", 1, 1, 54, 1448, 34, 16) + struct.pack("<H", 0)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 40 + PAYLOAD, 1, 0x4000, 64, 6, 0, bytes([10, 0, 0, 1]), bytes([10, 0, 0, 2]))
    tcp = struct.pack("!HHIIBBHHH", 40000, 5201, 1, 1, 5 << 4, 0x18, 512, 0, 0)
    return vnet + dst + src + b"\x08\x00" + ip + tcp


def main():
    path, dst, src, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    mac = lambda m: bytes(int(x, 16) for x in m.split(":"))
    f = Frontend(path, features=F_VERSION_1 | F_INDIRECT | F_CSUM | F_HOST_TSO4, mem_size=4 << 20, size=2 * SIZE)
    head = frame_head(mac(dst), mac(src))
    assert len(head) == HDR + 54
    payload = bytes(i % 251 for i in range(PIECE))
    n = 1 + PAYLOAD // PIECE
    for s in range(SIZE):
        base, table = DATA + s * SLOT, TABLES + s * 0x200
        f.mem[base:base + len(head)] = head
        entries = [(base, len(head))] + [(base + 0x100 + k * PIECE, PIECE) for k in range(n - 1)]
        for k, (addr, length) in enumerate(entries):
            if k:
                f.mem[addr:addr + length] = payload
            flags = D_NEXT if k + 1 < n else 0
            f.mem[table + 16 * k:table + 16 * k + 16] = struct.pack("<QIHH", addr, length, flags, k + 1)
        f.desc(1, s, table, 16 * n, D_INDIRECT)
        f.offer(1, s, kick=False)
    os.eventfd_write(f.kick[1], 1)
    sent, last = 0, 0
    end = time.time() + seconds
    while time.time() < end:
        u = f.used_idx(1)
        k = (u - last) & 0xFFFF
        if not k:
            continue
        for j in range(k):
            h, _ = f.used(1, last + j)
            f.offer(1, h, kick=False)
        last = u
        sent += k
        os.eventfd_write(f.kick[1], 1)
    print(sent)
    f.close()


if __name__ == "__main__":
    main()
