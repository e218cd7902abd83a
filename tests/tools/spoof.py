#!/usr/bin/env python3
"""Sends UDP datagrams with a forged source address (raw IPv4), as a stranger
on the underlay pretending to be a vnetd peer would.

  spoof.py SRC_IP SRC_PORT DST_IP DST_PORT HEXPAYLOAD [COUNT]
"""
import socket
import struct
import sys


def checksum(b: bytes) -> int:
    if len(b) % 2:
        b += b"\0"
    s = sum(struct.unpack(f"!{len(b) // 2}H", b))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def main():
    src, sport, dst, dport, payload = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), bytes.fromhex(sys.argv[5])
    count = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    udp = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload  # checksum 0: none (IPv4)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, 17, 0,
                     socket.inet_aton(src), socket.inet_aton(dst))
    ip = ip[:10] + struct.pack("!H", checksum(ip)) + ip[12:]
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    for _ in range(count):
        s.sendto(ip + udp, (dst, 0))


if __name__ == "__main__":
    main()
