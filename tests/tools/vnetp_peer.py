#!/usr/bin/env python3
"""A VNET/P peer written from docs/wire-format.md alone: each UDP datagram is
one whole Ethernet frame. It sends COUNT ICMP echo requests (from MAC/IP
PEER_MAC/PEER_IP) to a guest over a vnetd link and checks every reply it
gets back, byte by byte. Prints "replies <n> bad <m>".

  vnetp_peer.py BIND_IP PORT VNETD_IP GUEST_MAC GUEST_IP PEER_MAC PEER_IP COUNT SIZE
"""
import socket
import struct
import sys
import time

from spoof import checksum


def mac(m: str) -> bytes:
    return bytes.fromhex(m.replace(":", ""))


def main():
    bind_ip, port, vnetd_ip, gmac, gip, pmac, pip, count, size = sys.argv[1:10]
    port, count, size = int(port), int(count), int(size)
    gmac, pmac = mac(gmac), mac(pmac)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((bind_ip, port))
    s.settimeout(2)
    payload = bytes((i * 7) & 0xFF for i in range(size))
    replies = bad = 0
    for seq in range(1, count + 1):
        icmp = struct.pack("!BBHHH", 8, 0, 0, 0x4242, seq) + payload
        icmp = icmp[:2] + struct.pack("!H", checksum(icmp)) + icmp[4:]
        ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(icmp), seq, 0, 64, 1, 0,
                         socket.inet_aton(pip), socket.inet_aton(gip))
        ip = ip[:10] + struct.pack("!H", checksum(ip)) + ip[12:]
        s.sendto(gmac + pmac + b"\x08\x00" + ip + icmp, (vnetd_ip, port))
        try:
            data, frm = s.recvfrom(65535)
        except socket.timeout:
            continue
        # The datagram is the frame: Ethernet, IPv4, ICMP echo reply.
        ok = (frm == (vnetd_ip, port) and data[0:6] == pmac and data[6:12] == gmac and data[12:14] == b"\x08\x00"
              and len(data) == 14 + 20 + 8 + size and checksum(data[14:34]) == 0
              and data[34] == 0 and checksum(data[34:]) == 0
              and struct.unpack("!HH", data[38:42]) == (0x4242, seq) and data[42:] == payload)
        replies += ok
        bad += not ok
        time.sleep(0.01)
    print(f"replies {replies} bad {bad}", flush=True)


if __name__ == "__main__":
    main()
