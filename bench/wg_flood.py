#!/usr/bin/env python3
"""A keyless flood of a host's WireGuard port, against its guests' traffic:
one interleaved run on two hosts with a WireGuard link (TAP guests g1, g2;
1500-byte underlay) and an attacker host h3 that knows the public keys.

Each repetition measures, for `--seconds`, guest g1 → g2 TCP (iperf3, one
stream) and, at the same time, g1 → g2 pings every 10 ms, in three modes:

  none     no flood
  sink     the flooder runs at the same rate into a socket of its own host
           (what the attacker's own CPU costs this 2-core machine, without
           a datagram reaching host 2)
  flood    the flooder at `--rate` datagrams/s to host 2's WireGuard port:
           initiations naming host 1's key (MAC1 valid; MAC2 with the cookie
           host 2 gave h3's address, once asked), and one in four a data
           message naming the live link's receiver index

After each flood window, both hosts' links are made again and the time to
the first ping through (a new handshake, under the flood) is taken. It
prints min/median/max of each figure per mode, the ratios flood ÷ none and
flood ÷ sink, and the CPU vnetd's threads on host 2 took under the flood;
writes bench/results/<date>-wg-flood.{json,md}. A benchmark, never a
pass/fail test.

    sudo python3 bench/wg_flood.py [--reps 3] [--seconds 8] [--rate 50000]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "tools"))
from netlab import Lab, tcp_and_pings, underlay_ip  # noqa: E402
from test_wireguard import link_stats, public_key  # noqa: E402
from test_wireguard_attacks import WGPEER, link_index, remake_link  # noqa: E402
from wireguard import setup_wireguard  # noqa: E402

MODES = ["none", "sink", "flood"]


def thread_ticks(pid: int) -> dict[str, int]:
    """CPU ticks (user + system) of each thread of `pid`, by name."""
    out: dict[str, int] = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{t}/stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        f = stat[stat.rindex(")") + 2:].split()
        out[name] = out.get(name, 0) + int(f[11]) + int(f[12])
    return out


def vnetd_pid(d) -> int:
    """The vnetd process under `ip netns exec`."""
    kids = subprocess.run(["pgrep", "-P", str(d.proc.pid)], capture_output=True, text=True).stdout.split()
    return int(kids[0]) if kids else d.proc.pid


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--rate", type=int, default=50000)
    args = ap.parse_args()
    stamp = dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    points = []
    with Lab("wgf") as lab:
        g = setup_wireguard(lab)
        d = {h: next(x for x in lab.daemons if x.host.endswith(f"h{h}")) for h in (1, 2)}
        keys = {h: public_key(d[h]) for h in (1, 2)}
        h3 = lab.add_host(3)
        # The sink: a socket of h3's own that is never read.
        sink = lab.popen(h3, "python3", "-c", "import socket,time;s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM);"
                         "s.bind(('127.0.0.1',51820));time.sleep(1e6)")
        assert lab.x(g[1].ns, "ping", "-c", "1", "-W", "5", g[2].ip, check=False).returncode == 0
        pid2 = vnetd_pid(d[2])
        hz = os.sysconf("SC_CLK_TCK")
        for rep in range(args.reps):
            order = MODES if rep % 2 == 0 else MODES[::-1]
            for mode in order:
                flood = None
                if mode != "none":
                    dst = underlay_ip(2) if mode == "flood" else "127.0.0.1"
                    span = args.seconds + 8
                    flood = lab.popen(h3, "python3", WGPEER, "flood", dst, "51820", str(args.rate), str(span), keys[2], keys[1],
                                      str(link_index(d[2], "h1")), stdout=subprocess.PIPE, text=True)
                    time.sleep(1.5)
                w0, t0 = thread_ticks(pid2), time.monotonic()
                w = tcp_and_pings(lab, g[1], g[2], args.seconds)
                p = {"mode": mode, "rep": rep, "gbps": w["gbps"], "ping_sent": w["ping_sent"], "ping_lost": w["ping_lost"],
                     "loss_pct": 100.0 * w["ping_lost"] / max(w["ping_sent"], 1), "rtt_ms": w["rtt_avg_ms"]}
                w1, t1 = thread_ticks(pid2), time.monotonic()
                p["cpu_pct"] = {k: round(100.0 * (w1.get(k, 0) - w0.get(k, 0)) / hz / (t1 - t0), 1) for k in w1
                                if w1.get(k, 0) - w0.get(k, 0) > 0}
                # A new handshake, now (under the flood, if any).
                remake_link(d[1], 2, keys[2])
                remake_link(d[2], 1, keys[1])
                t = time.monotonic()
                while lab.x(g[1].ns, "ping", "-c", "1", "-W", "0.2", g[2].ip, check=False).returncode != 0:
                    if time.monotonic() - t > 30:
                        break
                p["handshake_s"] = round(time.monotonic() - t, 3)
                if flood is not None:
                    r = json.loads(flood.communicate(timeout=60)[0])
                    p["flood"] = {**r, "rate": round(sum(r["sent"].values()) / r["seconds"])}
                w = d[2].stats()["wireguard"]
                p["host2_wireguard"] = w
                points.append(p)
                print(json.dumps(p), flush=True)
        sink.kill()
    cmd = f"sudo python3 bench/wg_flood.py --reps {args.reps} --seconds {args.seconds:g} --rate {args.rate}"

    def stat(mode, key):
        xs = sorted(p[key] for p in points if p["mode"] == mode)
        return xs[0], statistics.median(xs), xs[-1]

    med = {m: stat(m, "gbps")[1] for m in MODES}
    lines = [f"# A keyless flood of the WireGuard port, {stamp}", "", f"`{cmd}`", "",
             "Guest g1 → g2 over a WireGuard link (TAP guests, 1500-byte underlay): TCP (iperf3, one stream) and pings "
             "every 10 ms side by side; h3 floods host 2's port at the rate shown (`flood`) or the same into its own "
             "socket (`sink`). One interleaved run.", "",
             "| mode | TCP Gbit/s min / median / max | ping loss % (max) | ping RTT ms (median) | new handshake s (max) | flood datagrams/s (median) |",
             "|---|---|---|---|---|---|"]
    for m in MODES:
        g_ = stat(m, "gbps")
        rates = [p["flood"]["rate"] for p in points if p["mode"] == m and "flood" in p]
        lines.append(f"| {m} | {g_[0]:.2f} / {g_[1]:.2f} / {g_[2]:.2f} | {stat(m, 'loss_pct')[2]:.2f} | "
                     f"{stat(m, 'rtt_ms')[1]:.3f} | {stat(m, 'handshake_s')[2]:.2f} | "
                     f"{statistics.median(rates) if rates else 0:.0f} |")
    cpu = [p["cpu_pct"] for p in points if p["mode"] == "flood"]
    names = sorted({k for c in cpu for k in c})
    lines += ["", f"TCP under the flood ÷ none: {med['flood'] / med['none']:.2f} (target ≥ 0.8); "
              f"÷ sink (the attacker's own CPU taken out): {med['flood'] / med['sink']:.2f}.", "",
              "Host 2's vnetd threads under the flood, % of one CPU (median over reps): " +
              ", ".join(f"{n} {statistics.median(c.get(n, 0) for c in cpu):.1f}" for n in names) + "."]
    last = [p for p in points if p["mode"] == "flood"][-1]["host2_wireguard"]
    lines += ["", f"Host 2's `STATS` `wireguard` line at the end: {' '.join(f'{k}={v}' for k, v in last.items())}."]
    md = "\n".join(lines) + "\n"
    print(md)
    out = REPO / "bench" / "results"
    (out / f"{stamp}-wg-flood.json").write_text(json.dumps({"command": cmd, "points": points}, indent=1))
    (out / f"{stamp}-wg-flood.md").write_text(md)
    print(f"wrote {out / stamp}-wg-flood.json and .md")


if __name__ == "__main__":
    main()
