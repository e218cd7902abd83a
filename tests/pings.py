"""Where each ping of a run went: tcpdump captures on the pinging guest's
interface and on every host's underlay, read back (pcap, Ethernet), and
every ICMP echo request and reply found in them, bare or carried in a VNET/P
UDP datagram (the bare frame as the payload, docs/wire-format.md).

A ping lost is then placed where it was lost (its request never left the
pinger's host, reached a host and was answered by none, or its reply
reached the pinger's host and not the pinger), so a test can hold each
host's vnetd to the drops it counted, rather than the sum of all."""

from __future__ import annotations

import signal
import struct
import subprocess
from pathlib import Path

ECHO_REQUEST, ECHO_REPLY = 8, 0


def echoes(path: Path, udp_port: int | None) -> list[tuple[str, str, str, int, int]]:
    """The ICMP echoes in a pcap file: (outer source IP, outer destination
    IP, "request"/"reply", id, seq) in capture order. With `udp_port`, only
    echoes carried in UDP to or from that port (the outer addresses the
    underlay's); without, bare ones (the outer addresses the echo's own)."""
    data = path.read_bytes()
    if len(data) < 24:
        return []
    magic = struct.unpack_from("<I", data)[0]
    endian = "<" if magic in (0xA1B2C3D4, 0xA1B23C4D) else ">"
    linktype = struct.unpack_from(endian + "I", data, 20)[0]
    assert linktype == 1, f"{path}: link type {linktype}, not Ethernet"
    out, off = [], 24
    while off + 16 <= len(data):
        incl = struct.unpack_from(endian + "I", data, off + 8)[0]
        pkt = data[off + 16:off + 16 + incl]
        off += 16 + incl
        found = _echo(pkt, udp_port)
        if found:
            out.append(found)
    return out


def _ipv4(frame: bytes):
    """(source, destination, protocol, payload) of an Ethernet frame holding
    IPv4 (one VLAN tag skipped), or None."""
    if len(frame) < 14:
        return None
    et, o = struct.unpack_from("!H", frame, 12)[0], 14
    if et == 0x8100 and len(frame) >= 18:
        et, o = struct.unpack_from("!H", frame, 16)[0], 18
    if et != 0x0800 or len(frame) < o + 20 or frame[o] >> 4 != 4:
        return None
    ihl = (frame[o] & 15) * 4
    proto = frame[o + 9]
    src = ".".join(map(str, frame[o + 12:o + 16]))
    dst = ".".join(map(str, frame[o + 16:o + 20]))
    return src, dst, proto, frame[o + ihl:]


def _echo(pkt: bytes, udp_port: int | None):
    ip = _ipv4(pkt)
    if not ip:
        return None
    src, dst, proto, payload = ip
    if udp_port is not None:
        if proto != 17 or len(payload) < 8:
            return None
        sport, dport = struct.unpack_from("!HH", payload)
        if udp_port not in (sport, dport):
            return None
        inner = _ipv4(payload[8:])
        if not inner:
            return None
        _, _, proto, payload = inner
    if proto != 1 or len(payload) < 8 or payload[0] not in (ECHO_REQUEST, ECHO_REPLY):
        return None
    ident, seq = struct.unpack_from("!HH", payload, 4)
    return src, dst, "request" if payload[0] == ECHO_REQUEST else "reply", ident, seq


class Capture:
    """tcpdump writing every frame of one interface in one namespace to a
    file, until stopped."""

    def __init__(self, lab, ns: str, dev: str, path: Path, bpf: str):
        self.path = path
        self.p = lab.popen(ns, "tcpdump", "-n", "-U", "-s", "256", "-B", "4096", "-i", dev, "-w", path, bpf,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        # tcpdump says "listening on" once its socket is open.
        line = self.p.stderr.readline()
        assert "listening on" in line, line

    def stop(self):
        self.p.send_signal(signal.SIGINT)
        self.p.communicate(timeout=10)


def place(lost: list[int], pinger: list, hosts: dict[str, tuple[str, list]], home: str) -> dict[int, str]:
    """Where each lost seq went missing: {seq: host name, or "<home> out" /
    "<home> in"}. `pinger`: the echoes on the pinging guest's interface;
    `hosts`: each host's name to (its underlay IP, the echoes on its
    underlay), `home` (the pinger's host) among them. A request that left
    the pinger and reached no other host: lost at home, going out. One that
    reached host X and whose reply no host sent: lost on X (by its vnetd, or
    the guest it was for). A reply some host sent that the pinger never got:
    lost at home, coming in (or on the underlay, if home never received
    it: "<home> in, not received")."""
    ident = next((i for _, _, kind, i, _ in pinger if kind == "request"), None)
    where = {}
    for seq in lost:
        def seen(name, kind, inbound):
            ip, caught = hosts[name]
            return any(k == kind and i == ident and s == seq and (dst == ip) == inbound
                       for _, dst, k, i, s in caught)
        away = [n for n in hosts if n != home]
        reached = [n for n in away if seen(n, "request", True)]
        if not reached:
            where[seq] = f"{home} out"
        elif any(seen(n, "reply", False) for n in away):
            where[seq] = f"{home} in" if seen(home, "reply", True) else f"{home} in, not received"
        else:
            where[seq] = reached[-1]
    return where
