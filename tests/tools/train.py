#!/usr/bin/env python3
"""A peer vnetd's datagrams, from docs/wire-format.md: one Ethernet frame per
UDP datagram, each an IPv4/UDP packet of SIZE bytes in all from PEER_MAC to
one of DST_MACS (in the order given, cycled to COUNT frames). As `single`,
one sendto per datagram; as `train`, all in one send with UDP_SEGMENT (UDP
GSO, as vnetd sends a pass's frames to one link), which a veth underlay
delivers to the other host unsegmented; as `train-runt`, the same train
ending in an 8-byte datagram, too short to hold a frame (a hostile peer's);
as `train-tcp`, the train with every frame claiming to be TCP (IP protocol
6) over the same bytes, a TCP header of garbage (a hostile peer's too).
Prints "sent <n>" (frames, the runt not counted).

  train.py single|train|train-runt|train-tcp BIND_IP PORT TO_IP PEER_MAC SIZE COUNT DST_MAC[,DST_MAC...]
"""
import socket
import struct
import sys

from spoof import checksum

UDP_SEGMENT = 103


def mac(m: str) -> bytes:
    return bytes.fromhex(m.replace(":", ""))


def frame(dst: bytes, src: bytes, size: int, seq: int, proto: int = 17) -> bytes:
    payload = bytes((seq + i) & 0xFF for i in range(size - 14 - 28))
    udp = struct.pack("!HHHH", 4000, 9, 8 + len(payload), 0) + payload
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), seq & 0xFFFF, 0, 64, proto, 0,
                     socket.inet_aton("198.19.0.50"), socket.inet_aton("198.19.0.1"))
    ip = ip[:10] + struct.pack("!H", checksum(ip)) + ip[12:]
    return dst + src + b"\x08\x00" + ip + udp


def main():
    mode, bind_ip, port, to_ip, peer, size, count, dsts = sys.argv[1:9]
    port, size, count = int(port), int(size), int(count)
    dsts = [mac(m) for m in dsts.split(",")]
    proto = 6 if mode == "train-tcp" else 17
    frames = [frame(dsts[i % len(dsts)], mac(peer), size, i, proto) for i in range(count)]
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((bind_ip, port))
    if mode.startswith("train"):
        s.setsockopt(socket.IPPROTO_UDP, UDP_SEGMENT, size)
        s.sendto(b"".join(frames) + (b"\xee" * 8 if mode == "train-runt" else b""), (to_ip, port))
    else:
        for f in frames:
            s.sendto(f, (to_ip, port))
    print("sent", count)


if __name__ == "__main__":
    main()
