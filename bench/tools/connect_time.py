#!/usr/bin/env python3
"""TCP connection setup time: how long connect() takes until the connection
is established, as a program sees it.

  connect_time.py serve PORT [ADDR]     accept and close connections until killed
  connect_time.py measure HOST PORT N   N connects, one after another; prints JSON:
                                        min/median/p99/max microseconds per connect()

Each connect is blocking (it returns once the three-way handshake is done,
or, under vtoe, once the shadow connection is open); the socket is then
closed before the next.
"""
import json
import socket
import statistics
import sys
import time


def serve(port, addr="0.0.0.0"):
    s = socket.create_server((addr, port), backlog=128)
    while True:
        c, _ = s.accept()
        c.close()


def measure(host, port, n):
    times = []
    for _ in range(n):
        s = socket.socket()
        t = time.perf_counter()
        s.connect((host, port))
        times.append((time.perf_counter() - t) * 1e6)
        s.close()
    times.sort()
    print(json.dumps({"n": n, "min_us": round(times[0], 1), "median_us": round(statistics.median(times), 1),
                      "p99_us": round(times[int(0.99 * (n - 1))], 1), "max_us": round(times[-1], 1)}))


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]), *sys.argv[3:4])
    else:
        measure(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
