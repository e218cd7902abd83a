#!/usr/bin/env python3
"""Writes VNET/P datagrams onto the underlay as whole Ethernet frames (a
packet socket), so that every byte of the outer IPv4 and UDP headers is the
caller's: a raw IP socket would fill in the checksum and total length.

  underlay.py DEV DST_MAC SRC_IP DST_IP KIND COUNT INNER_DST INNER_SRC [RATE]

Each datagram goes from SRC_IP:9000 to DST_IP:9000 and carries one frame
INNER_DST <- INNER_SRC (ethertype 0x88b5, 60 bytes). RATE: at most that many
datagrams a second (default: as fast as it goes). KIND:

  good      a valid datagram
  flows     valid, each from its own source MAC: INNER_SRC's first two bytes,
            then the datagram's number (so COUNT distinct flows)
  csum      the IPv4 header checksum is wrong
  frag      the datagram in two IPv4 fragments (which reassemble to `good`)
  options   an IPv4 header with options (IHL 6: one word of NOPs)
  trailing  8 bytes after the IPv4 packet (total length < what arrives)
  udp_len   the UDP length 4 bytes short of the IPv4 payload
  udp_sum   valid, with a UDP checksum (the others carry none: 0)
  udp_csum  a UDP checksum that is wrong

Prints "sent <n>".
"""
import socket
import struct
import sys
import time

from spoof import checksum

PORT = 9000


def mac(m: str) -> bytes:
    return bytes.fromhex(m.replace(":", ""))


def ipv4(src: bytes, dst: bytes, payload: bytes, ident: int, frag: int = 0, options: bytes = b"",
         tot_len: int | None = None, good_sum=True) -> bytes:
    ihl = 5 + len(options) // 4
    tot = 4 * ihl + len(payload) if tot_len is None else tot_len
    h = struct.pack("!BBHHHBBH4s4s", 0x40 | ihl, 0, tot, ident, frag, 64, 17, 0, src, dst) + options
    s = checksum(h)
    if not good_sum:
        s ^= 0x5555
    return h[:10] + struct.pack("!H", s) + h[12:] + payload


def main():
    dev, dst_mac, src_ip, dst_ip, kind, count, inner_dst, inner_src = sys.argv[1:9]
    rate = float(sys.argv[9]) if len(sys.argv) > 9 else 0.0
    count = int(count)
    src, dst = socket.inet_aton(src_ip), socket.inet_aton(dst_ip)
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    s.bind((dev, 0))
    with open(f"/sys/class/net/{dev}/address") as f:
        eth = mac(dst_mac) + mac(f.read().strip()) + b"\x08\x00"
    idst, isrc = mac(inner_dst), mac(inner_src)
    t0 = time.monotonic()
    for i in range(count):
        if kind == "flows":
            isrc = isrc[:2] + struct.pack("!I", i)
        frame = idst + isrc + b"\x88\xb5" + bytes(46)
        udp = struct.pack("!HHHH", PORT, PORT, 8 + len(frame), 0) + frame  # checksum 0: none
        if kind in ("udp_sum", "udp_csum"):
            c = checksum(src + dst + struct.pack("!BBH", 0, 17, len(udp)) + udp) or 0xFFFF
            if kind == "udp_csum":
                c ^= 0x00FF
            udp = udp[:6] + struct.pack("!H", c) + udp[8:]
        ident = i & 0xFFFF
        if kind in ("good", "flows", "udp_sum", "udp_csum"):
            pkts = [ipv4(src, dst, udp, ident)]
        elif kind == "csum":
            pkts = [ipv4(src, dst, udp, ident, good_sum=False)]
        elif kind == "frag":
            # The first 8-byte-aligned part with "more fragments", then the rest.
            cut = 32
            pkts = [ipv4(src, dst, udp[:cut], ident, frag=0x2000), ipv4(src, dst, udp[cut:], ident, frag=cut // 8)]
        elif kind == "options":
            pkts = [ipv4(src, dst, udp, ident, options=b"\x01\x01\x01\x01")]
        elif kind == "trailing":
            pkts = [ipv4(src, dst, udp, ident) + b"\xee" * 8]
        elif kind == "udp_len":
            short = udp[:4] + struct.pack("!H", 8 + len(frame) - 4) + udp[6:]
            pkts = [ipv4(src, dst, short, ident)]
        else:
            sys.exit(f"unknown kind {kind}")
        for p in pkts:
            s.send(eth + p)
        if rate:
            ahead = t0 + (i + 1) / rate - time.monotonic()
            if ahead > 0.002:
                time.sleep(ahead)
    print(f"sent {count}", flush=True)


if __name__ == "__main__":
    main()
