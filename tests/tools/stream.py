#!/usr/bin/env python3
"""A paced TCP stream that measures its own outages.

  stream.py recv PORT              accept one connection; print "<bytes> <sha256> <longest gap ms>"
  stream.py send HOST PORT SECONDS send 16 KiB every 2 ms for SECONDS; print "<bytes> <sha256>"
"""
import hashlib
import random
import socket
import sys
import time


def main():
    h = hashlib.sha256()
    total = 0
    if sys.argv[1] == "recv":
        srv = socket.create_server(("0.0.0.0", int(sys.argv[2])))
        print("listening", flush=True)
        conn, _ = srv.accept()
        last, gap = time.monotonic(), 0.0
        while chunk := conn.recv(1 << 16):
            now = time.monotonic()
            gap = max(gap, now - last)
            last = now
            h.update(chunk)
            total += len(chunk)
        print(total, h.hexdigest(), round(gap * 1000, 1), flush=True)
    else:
        host, port, seconds = sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
        rng = random.Random(7)
        conn = socket.create_connection((host, port), timeout=60)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            chunk = rng.randbytes(16384)
            conn.sendall(chunk)
            h.update(chunk)
            total += len(chunk)
            time.sleep(0.002)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)
        print(total, h.hexdigest(), flush=True)


if __name__ == "__main__":
    main()
