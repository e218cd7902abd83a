#!/usr/bin/env python3
"""A hand-made TCP-link peer, written from docs/wire-format.md (not from
vnetd's code): the key handshake, then length-prefixed frames.

    tcp_link_peer.py listen ADDR PORT KEYFILE    (vnetd connects: we respond)
    tcp_link_peer.py connect ADDR PORT KEYFILE   (we initiate)

KEYFILE may be "-" for a key nobody has. After the handshake it prints
"up" (or "refused <why>" and exits), then obeys lines on stdin:

    send HEX         write these raw bytes
    frames N SECS    read until N frames came (or SECS passed); print
                     "frame HEX" for each, then "done"
    eof SECS         print "eof N" if the connection ends within SECS, else
                     "open N" (N: bytes received meanwhile)
"""

import hashlib
import hmac
import os
import select
import socket
import struct
import sys
import time

MAGIC = b"VNETTCP1"


def mac(key, label, ni, nr):
    return hmac.new(key, label + ni + nr, hashlib.sha256).digest()


def read_exact(s, n):
    b = b""
    while len(b) < n:
        c = s.recv(n - len(b))
        if not c:
            raise EOFError("connection closed")
        b += c
    return b


def main():
    mode, addr, port, keyfile = sys.argv[1:5]
    key = os.urandom(32) if keyfile == "-" else open(keyfile, "rb").read().rstrip(b"\n")
    fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
    if mode == "listen":
        ls = socket.socket(fam, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((addr, int(port)))
        ls.listen(1)
        print("listening", flush=True)
        s, _ = ls.accept()
        hello = read_exact(s, 40)
        assert hello[:8] == MAGIC, hello
        ni, nr = hello[8:], os.urandom(32)
        s.sendall(MAGIC + nr + mac(key, b"vnet-tcp-link responder", ni, nr))
        proof = read_exact(s, 32)
        if not hmac.compare_digest(proof, mac(key, b"vnet-tcp-link initiator", ni, nr)):
            print("refused bad proof", flush=True)
            return
    else:
        s = socket.create_connection((addr, int(port)), timeout=5)
        ni = os.urandom(32)
        s.sendall(MAGIC + ni)
        try:
            ch = read_exact(s, 72)
        except (EOFError, OSError) as e:
            print(f"refused {e}", flush=True)
            return
        nr = ch[8:40]
        if not hmac.compare_digest(ch[40:], mac(key, b"vnet-tcp-link responder", ni, nr)):
            # We do not hold the key: send a proof anyway, as an attacker would.
            s.sendall(os.urandom(32))
        else:
            s.sendall(mac(key, b"vnet-tcp-link initiator", ni, nr))
    s.settimeout(None)
    print("up", flush=True)
    buf = b""
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "send":
            s.sendall(bytes.fromhex(cmd[1]))
            print("sent", flush=True)
        elif cmd[0] == "frames":
            want, deadline = int(cmd[1]), time.time() + float(cmd[2])
            got = 0
            while got < want and time.time() < deadline:
                while len(buf) >= 4 and len(buf) >= 4 + struct.unpack("!I", buf[:4])[0]:
                    n = struct.unpack("!I", buf[:4])[0]
                    print("frame " + buf[4:4 + n].hex(), flush=True)
                    buf = buf[4 + n:]
                    got += 1
                if got >= want:
                    break
                r, _, _ = select.select([s], [], [], max(0.0, deadline - time.time()))
                if r:
                    c = s.recv(65536)
                    if not c:
                        break
                    buf += c
            print("done", flush=True)
        elif cmd[0] == "eof":
            deadline = time.time() + float(cmd[1])
            state = "open"
            while time.time() < deadline:
                r, _, _ = select.select([s], [], [], max(0.0, deadline - time.time()))
                if r:
                    try:
                        c = s.recv(65536)
                    except ConnectionResetError:
                        c = b""
                    if not c:
                        state = "eof"
                        break
                    buf += c
            print(f"{state} {len(buf)}", flush=True)


if __name__ == "__main__":
    main()
