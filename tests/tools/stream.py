#!/usr/bin/env python3
"""A paced TCP stream that measures its own outages.

  stream.py recv PORT              accept one connection; print "<bytes> <sha256> <longest gap ms>"
  stream.py send HOST PORT SECONDS send 16 KiB every 2 ms for SECONDS (or, given "eof", until
                                   its standard input closes); print "<bytes> <sha256>"
"""
import hashlib
import random
import socket
import sys
import threading
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
        host, port = sys.argv[2], int(sys.argv[3])
        rng = random.Random(7)
        conn = socket.create_connection((host, port), timeout=60)
        stop = threading.Event()
        if sys.argv[4] == "eof":
            threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
            end = time.monotonic() + 3600
        else:
            end = time.monotonic() + float(sys.argv[4])
        while time.monotonic() < end and not stop.is_set():
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
