#!/usr/bin/env python3
"""The kernel fast path of this build against another build's (default: the
previous commit's, scripts/build-previous), interleaved: for each repeat, a
fresh two-host lab (veth guests, tests/netlab.py) per build, and in it

  - ping RTT between the guests, idle (20 pings 0.2 s apart: the CPUs sleep
    between them), median, and steady (1,000 pings 3 ms apart), median and
    99th percentile;
  - a ping flood (20,000), mean RTT;
  - TCP throughput guest to guest (iperf3, 4 s);

and the same between the hosts themselves (native) in the same lab. Prints
min / median / max over the repeats, the ratios to native, and writes
bench/results/<date>-fast-ab.md.

    sudo python3 bench/fast_ab.py [--repeats 5] [--base <commit>]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO / "tests"))
from netlab import Lab, underlay_ip, veth_mesh  # noqa: E402


def rtts(lab, ns, ip, n, interval):
    out = lab.x(ns, "ping", "-n", "-c", n, "-i", interval, ip, timeout=120).stdout
    return [float(m) * 1000 for m in re.findall(r"time=([\d.]+) ms", out)]


def flood(lab, ns, ip):
    out = lab.x(ns, "ping", "-n", "-f", "-c", "20000", "-q", ip, timeout=120).stdout
    return float(re.search(r"= [\d.]+/([\d.]+)/", out).group(1)) * 1000


def tcp(lab, server_ns, client_ns, ip):
    srv = lab.popen(server_ns, "iperf3", "-s", "-1", stdout=subprocess.DEVNULL)
    time.sleep(0.3)
    out = lab.x(client_ns, "iperf3", "-c", ip, "-t", "4", "--json", timeout=60).stdout
    srv.wait(timeout=10)
    return json.loads(out)["end"]["sum_received"]["bits_per_second"] / 1e9


METRICS = [("idle ping µs", "lower"), ("steady ping µs", "lower"), ("steady ping p99 µs", "lower"), ("flood ping µs", "lower"),
           ("TCP Gbit/s", "higher")]


def p99(v):
    v = sorted(v)
    return v[min(len(v) - 1, int(len(v) * 0.99))]


def measure(binary: Path | None) -> dict[str, tuple[float, float]]:
    """(overlay, native) per metric, in one lab."""
    with Lab("fab") as lab:
        h, d, g = veth_mesh(lab, {1: [1], 2: [2]}, binary=binary)
        assert lab.reaches(g[1], g[2])
        lab.x(h[1], "ping", "-c", "3", "-i", "0.01", "-q", underlay_ip(2))
        time.sleep(1.2)  # the next-hop keeper's first pass, where the build has one
        pairs = {"overlay": (g[1].ns, g[2].ns, g[2].ip), "native": (h[1], h[2], underlay_ip(2))}
        out = {}
        for kind, (src, dst, ip) in pairs.items():
            steady = rtts(lab, src, ip, 1000, 0.003)
            out[kind] = {
                "idle ping µs": statistics.median(rtts(lab, src, ip, 20, 0.2)),
                "steady ping µs": statistics.median(steady),
                "steady ping p99 µs": p99(steady),
                "flood ping µs": flood(lab, src, ip),
                "TCP Gbit/s": tcp(lab, dst, src, ip),
            }
        return {m: (out["overlay"][m], out["native"][m]) for m, _ in METRICS}


def mmm(v):
    v = sorted(v)
    return f"{v[0]:.2f} / {statistics.median(v):.2f} / {v[-1]:.2f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--base", default="HEAD~1", help="the build to compare with (a commit; default HEAD~1)")
    a = ap.parse_args()
    base = Path(subprocess.run([REPO / "scripts" / "build-previous", a.base], check=True, capture_output=True,
                               text=True).stdout.strip())
    subprocess.run(["cargo", "build", "--release", "--quiet", "-p", "vnetd", "-p", "vnetctl"], cwd=REPO, check=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    builds = {f"base {base.name[:7]}": base / "vnetd", f"this {head}": None}
    res = {b: {m: [] for m, _ in METRICS} for b in builds}
    nat = {b: {m: [] for m, _ in METRICS} for b in builds}
    for r in range(a.repeats):
        for b, binary in builds.items():
            got = measure(binary)
            for m, (o, n) in got.items():
                res[b][m].append(o)
                nat[b][m].append(n)
            print(f"repeat {r + 1} {b}: " + ", ".join(f"{m} {o:.2f} (native {n:.2f})" for m, (o, n) in got.items()), flush=True)
    lines = [f"# Kernel fast path, {' against '.join(reversed(list(builds)))}", "",
             f"Command: `sudo python3 bench/fast_ab.py --repeats {a.repeats} --base {a.base}` "
             f"({dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC). Veth guests on two hosts; each repeat a "
             "fresh lab per build, the builds interleaved; native = the hosts themselves in the same lab. "
             "min / median / max over the repeats; the ratio is the medians'.", "",
             "| build | metric | overlay | native | overlay ÷ native |", "|---|---|---|---|---|"]
    for b in builds:
        for m, _ in METRICS:
            ratio = statistics.median(res[b][m]) / statistics.median(nat[b][m])
            lines.append(f"| {b} | {m} | {mmm(res[b][m])} | {mmm(nat[b][m])} | {ratio:.2f}× |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = BENCH / "results" / f"{dt.datetime.now():%Y-%m-%d-%H%M%S}-fast-ab.md"
    out.write_text(text)
    print(f"written to {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
