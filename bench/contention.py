#!/usr/bin/env python3
"""The slow path under contention (issue 10, item 7): ping RTT between two
TAP guests on two hosts (vnetd's user-level datapath), first idle, then with
a busy-polling process spinning on each of the machine's two CPUs, for each
`--dispatcher-sched` policy given.

    sudo python3 bench/contention.py normal realtime normal realtime

Prints n, p50, p90, p99 and max RTT per policy and phase (400 pings 5 ms
apart). A benchmark, not a test: it asserts nothing about the numbers.
"""
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from netlab import Lab, guest_mac, mesh_config  # noqa: E402

def ping_stats(lab, src, dst, n=400, interval="0.005"):
    out = lab.x(src.ns, "ping", "-n", "-c", str(n), "-i", interval, "-W", "1", dst.ip, check=False, timeout=120).stdout
    rtts = [float(m) for m in re.findall(r"time=([\d.]+) ms", out)]
    rtts.sort()
    if not rtts: return "no replies"
    q = lambda p: rtts[min(len(rtts)-1, int(p*len(rtts)))]
    return f"n={len(rtts)} p50={q(0.5)*1000:.0f}us p90={q(0.9)*1000:.0f}us p99={q(0.99)*1000:.0f}us max={rtts[-1]*1000:.0f}us"

for sched in sys.argv[1:]:
    with Lab("c") as lab:
        h1, h2 = lab.add_host(1), lab.add_host(2)
        by = {1: [("g1", guest_mac(1))], 2: [("g2", guest_mac(2))]}
        d1 = lab.start_vnetd(h1, mesh_config(1, by), "--dispatcher-sched", sched)
        d2 = lab.start_vnetd(h2, mesh_config(2, by), "--dispatcher-sched", sched)
        g1 = lab.attach_guest(h1, "g1", 1); g2 = lab.attach_guest(h2, "g2", 2)
        assert lab.reaches(g1, g2)
        idle = ping_stats(lab, g1, g2)
        spin = [subprocess.Popen(["taskset", "-c", str(c), "python3", "-c", "while True: pass"]) for c in (0, 1)]
        lab.other_procs += spin
        time.sleep(0.5)
        busy = ping_stats(lab, g1, g2)
        for p in spin: p.kill()
        print(f"{sched:12s} idle: {idle}\n{'':12s} busy: {busy}", flush=True)
