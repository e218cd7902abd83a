#!/usr/bin/env python3
"""A VTOE shadow-connection initiator written from docs/vtoe.md alone (not
from vnetd's code): opens a connection to a vnetd's VTOE port, runs the
handshake with a key, asks for a guest connection, prints the verdict as
JSON, and on acceptance sends DATA and prints what comes back until EOF.

  vtoe_peer.py HOST PORT KEY_FILE SRC_MAC DST_MAC SRC_IP:PORT DST_IP:PORT [DATA]

KEY_FILE "-" means a key nobody holds.

  vtoe_peer.py stall HOST PORT N

opens N connections at once, each sending its HELLO, and waits 1 s for
their CHALLENGEs; then each stalls: the even ones send nothing more, the odd
ones trickle a REQUEST, one byte every 0.5 s. Prints {"held": n} (n
challenged in that second), then waits up to 8 s and prints, for each, the
seconds from its challenge until the responder closed it (null: still open).
"""
import hashlib
import hmac
import json
import os
import socket
import sys

MAGIC = b"VNETVTO1"


def mac(key, label, ni, nr, bound=b""):
    return hmac.new(key, label + ni + nr + bound, hashlib.sha256).digest()


def read_exact(s, n):
    b = b""
    while len(b) < n:
        c = s.recv(n - len(b))
        if not c:
            raise EOFError(f"closed after {len(b)} of {n} bytes")
        b += c
    return b


def addr(a):
    ip, port = a.rsplit(":", 1)
    return socket.inet_aton(ip), int(port).to_bytes(2, "big")


def stall(host, port, n):
    import select
    import time
    socks = []
    for _ in range(n):
        s = socket.create_connection((host, port), timeout=5)
        s.sendall(MAGIC + os.urandom(32))
        socks.append(s)
    # The challenges, as they come (each is 72 bytes: one read).
    conns = []
    end = time.monotonic() + 1
    waiting = list(socks)
    while waiting and time.monotonic() < end:
        readable, _, _ = select.select(waiting, [], [], max(0.0, end - time.monotonic()))
        for s in readable:
            waiting.remove(s)
            if len(s.recv(72)) == 72:
                conns.append((s, time.monotonic()))
    print(json.dumps({"held": len(conns)}), flush=True)
    closed = [None] * len(conns)
    end = time.monotonic() + 8
    next_byte = time.monotonic() + 0.5
    while time.monotonic() < end and None in closed:
        open_ = [s for i, (s, _) in enumerate(conns) if closed[i] is None]
        readable, _, _ = select.select(open_, [], [], max(0.0, min(next_byte, end) - time.monotonic()))
        for i, (s, t) in enumerate(conns):
            if s in readable:
                try:
                    gone = s.recv(64) == b""
                except OSError:
                    gone = True
                if gone:
                    closed[i] = round(time.monotonic() - t, 2)
        if time.monotonic() >= next_byte:
            next_byte += 0.5
            for i, (s, _) in enumerate(conns):
                if i % 2 and closed[i] is None:
                    try:
                        s.send(b"\1")
                    except OSError:
                        pass
    print(json.dumps({"closed_after": closed}), flush=True)


def main():
    if sys.argv[1] == "stall":
        return stall(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    host, port, key_file, src_mac, dst_mac, src, dst = sys.argv[1:8]
    data = sys.argv[8].encode() if len(sys.argv) > 8 else b""
    key = os.urandom(32) if key_file == "-" else open(key_file, "rb").read().rstrip(b"\n")
    out = {}
    s = socket.create_connection((host, int(port)), timeout=5)
    ni = os.urandom(32)
    s.sendall(MAGIC + ni)
    try:
        ch = read_exact(s, 72)
    except (EOFError, OSError) as e:
        print(json.dumps({"challenge": f"none: {e}"}))
        return
    nr = ch[8:40]
    out["challenge_ok"] = ch[:8] == MAGIC and hmac.compare_digest(ch[40:], mac(key, b"vnet-vtoe responder", ni, nr))
    (sip, sport), (dip, dport) = addr(src), addr(dst)
    req = bytes([1, 0]) + bytes.fromhex(src_mac.replace(":", "")) + bytes.fromhex(dst_mac.replace(":", "")) \
        + sip + dip + sport + dport + bytes(6)
    assert len(req) == 32
    s.sendall(req + mac(key, b"vnet-vtoe initiator", ni, nr, req))
    try:
        v = read_exact(s, 36)
    except (EOFError, OSError) as e:
        out["verdict"] = f"none: {e}"
        print(json.dumps(out))
        return
    out["verdict_ok"] = hmac.compare_digest(v[4:], mac(key, b"vnet-vtoe verdict", ni, nr, req + v[:4]))
    out["verdict"] = "accepted" if v[0] == 0 else f"declined {v[1]}"
    if v[0] == 0 and data:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        got = b""
        while c := s.recv(65536):
            got += c
        out["reply"] = got.decode(errors="replace")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
