#!/usr/bin/env python3
"""Long-lived TCP connections, Cilium's `NoInterruptedConnections` style.

  conns.py serve PORT          echo every line back, on any number of
                               connections; prints "listening"
  conns.py hold IP PORT N      opens N connections and prints "open N"; then,
                               for every line "check" on stdin, sends a line on
                               each connection and waits (5 s) for its echo,
                               printing "ok N" or "broken K: <why>"; ends at EOF

A connection that was reset, closed or gone quiet across whatever happened
between two checks counts as broken: the test fails on it."""

import selectors
import socket
import sys


def serve(port: int):
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("0.0.0.0", port))
    ls.listen(256)
    sel = selectors.DefaultSelector()
    sel.register(ls, selectors.EVENT_READ)
    print("listening", flush=True)
    while True:
        for key, _ in sel.select():
            s = key.fileobj
            if s is ls:
                c, _ = ls.accept()
                sel.register(c, selectors.EVENT_READ)
                continue
            try:
                data = s.recv(65536)
            except OSError:
                data = b""
            if not data:
                sel.unregister(s)
                s.close()
                continue
            s.sendall(data)


def hold(ip: str, port: int, n: int):
    conns = []
    for _ in range(n):
        c = socket.create_connection((ip, port), timeout=10)
        c.settimeout(5)
        conns.append(c)
    print(f"open {n}", flush=True)
    rounds = 0
    for line in sys.stdin:
        if line.strip() != "check":
            continue
        rounds += 1
        broken = []
        for i, c in enumerate(conns):
            msg = f"{rounds} {i}\n".encode()
            try:
                c.sendall(msg)
                got = b""
                while not got.endswith(b"\n"):
                    part = c.recv(100)
                    if not part:
                        raise ConnectionError("closed by the peer")
                    got += part
                if got != msg:
                    raise ConnectionError(f"echo {got!r}, sent {msg!r}")
            except OSError as e:
                broken.append(f"#{i} {e!r}")
        print(f"broken {len(broken)}: {'; '.join(broken[:5])}" if broken else f"ok {n}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]))
    else:
        hold(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
