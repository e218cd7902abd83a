#!/usr/bin/env python3
"""Moves bytes over TCP and reports their SHA-256, to check a transfer end to end.

  xfer.py recv PORT [ADDR]     accept one connection (on ADDR, default 0.0.0.0; IPv6 too), print "<bytes> <sha256>"
  xfer.py send HOST PORT N [hold]
                               send N pseudo-random bytes, print "<bytes> <sha256>";
                               with `hold`, keep the connection open after the last
                               byte until standard input ends (a test looks at it open)
"""
import hashlib
import random
import socket
import sys


def main():
    mode = sys.argv[1]
    h = hashlib.sha256()
    total = 0
    if mode == "recv":
        addr = sys.argv[3] if len(sys.argv) > 3 else "0.0.0.0"
        srv = socket.create_server((addr, int(sys.argv[2])), family=socket.AF_INET6 if ":" in addr else socket.AF_INET)
        print("listening", flush=True)
        conn, _ = srv.accept()
        while chunk := conn.recv(1 << 20):
            h.update(chunk)
            total += len(chunk)
    else:
        host, port, n = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        rng = random.Random(n)
        conn = socket.create_connection((host, port), timeout=60)
        while total < n:
            chunk = rng.randbytes(min(1 << 20, n - total))
            conn.sendall(chunk)
            h.update(chunk)
            total += len(chunk)
        if len(sys.argv) > 5 and sys.argv[5] == "hold":
            sys.stdin.read()
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)
    conn.close()
    print(total, h.hexdigest(), flush=True)


if __name__ == "__main__":
    main()
