#!/usr/bin/env python3
"""Where the CPU goes on the kernel fast path: two hosts, veth guests, a ping
flood (40,000 x 64 B) from g1 to g2 while `perf record -a -g` samples every
CPU for 4 s. Then: perf report -i /tmp/vnet-fast-perf.data --no-children
--sort symbol --stdio.

    sudo python3 bench/profile_fast.py
"""
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from netlab import Lab, veth_mesh  # noqa: E402
with Lab("p") as lab:
    _, d, g = veth_mesh(lab, {1: [1], 2: [2]})
    assert lab.reaches(g[1], g[2])
    lab.x(g[1].ns, "ping", "-c", "20", "-i", "0.01", "-q", g[2].ip)
    perf = subprocess.Popen(["perf", "record", "-a", "-g", "-o", "/tmp/vnet-fast-perf.data", "--", "sleep", "4"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    r = lab.x(g[1].ns, "ping", "-f", "-c", "40000", "-q", g[2].ip, timeout=60)
    print(r.stdout.strip().splitlines()[-2:])
    perf.wait()
    print(d[1].stats()["fastpath"])
