#!/usr/bin/env python3
"""One guest's broadcast storm against the other guests' traffic (storm
control, issue 44): one interleaved run on two hosts, veth guests on the
kernel fast path (g1 and g3 on host 1, g2 on host 2; 1500-byte underlay;
`SET storm-pps` left at its default).

Each repetition measures, for `--seconds`, g3 → g2 TCP (iperf3, one
stream) and, at the same time, g3 → g2 pings every 10 ms, in three modes:

  none    no storm
  sink    the storm's sender runs at the same rate into a veth pair of
          g1's own namespace (what the sender's own CPU costs this 2-core
          machine, without a frame reaching vnetd)
  storm   g1 sends `--rate` broadcast frames a second out of its NIC

It prints min/median/max of each figure per mode and the ratios storm ÷
none and storm ÷ sink, and how many of the storm's frames host 1 let
through and dropped (`drop_storm`); writes bench/results/<date>-storm.{json,md}.
A benchmark, never a pass/fail test.

    sudo python3 bench/storm.py [--reps 3] [--seconds 8] [--rate 100000]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO / "tests"))
from netlab import Lab, tcp_and_pings, veth_mesh  # noqa: E402

MODES = ["none", "sink", "storm"]

# Broadcast frames at `rate` a second for `seconds`, out of `dev`, in
# batches paced by the clock; prints how many were sent.
STORM = r"""
import json, socket, sys, time
dev, mac, rate, seconds = sys.argv[1], bytes.fromhex(sys.argv[2].replace(":", "")), int(sys.argv[3]), float(sys.argv[4])
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind((dev, 0))
f = b"\xff" * 6 + mac + b"\x88\xb5" + bytes(46)
n, t0 = 0, time.time()
while (now := time.time()) - t0 < seconds:
    due = int((now - t0) * rate)
    while n < due:
        try:
            s.send(f)
        except OSError:
            pass
        n += 1
    time.sleep(0.001)
print(json.dumps({"sent": n, "seconds": time.time() - t0}))
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--rate", type=int, default=100000)
    args = ap.parse_args()
    stamp = dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    points = []
    with Lab("storm") as lab:
        hosts, d, g = veth_mesh(lab, {1: [1, 3], 2: [2]})
        # The sink: a veth pair of g1's own namespace, nobody reading its
        # other end (this kernel has no dummy devices).
        lab.x(g[1].ns, "ip", "link", "add", "sink0", "type", "veth", "peer", "name", "sink1")
        lab.x(g[1].ns, "ip", "link", "set", "sink0", "up")
        lab.x(g[1].ns, "ip", "link", "set", "sink1", "up")
        assert lab.x(g[3].ns, "ping", "-c", "2", "-W", "2", g[2].ip, check=False).returncode == 0
        for rep in range(args.reps):
            order = MODES if rep % 2 == 0 else MODES[::-1]
            for mode in order:
                sender = None
                s0 = d[1].stats()["interface g1"]
                if mode != "none":
                    dev = g[1].tap if mode == "storm" else "sink0"
                    sender = lab.popen(g[1].ns, "python3", "-c", STORM, dev, g[1].mac, str(args.rate), str(args.seconds + 2),
                                       stdout=subprocess.PIPE, text=True)
                    time.sleep(1.0)
                p = {"mode": mode, "rep": rep, **tcp_and_pings(lab, g[3], g[2], args.seconds)}
                if sender is not None:
                    r = json.loads(sender.communicate(timeout=60)[0])
                    p["storm_rate"] = round(r["sent"] / r["seconds"])
                s1 = d[1].stats()["interface g1"]
                p["dropped_storm"] = s1["drop_storm"] - s0["drop_storm"]
                p["through"] = s1["in_frames"] - s0["in_frames"] - p["dropped_storm"]
                points.append(p)
                print(json.dumps(p), flush=True)
    cmd = f"sudo python3 bench/storm.py --reps {args.reps} --seconds {args.seconds:g} --rate {args.rate}"

    def stat(mode, key):
        xs = sorted(p[key] for p in points if p["mode"] == mode)
        return xs[0], statistics.median(xs), xs[-1]

    med = {m: stat(m, "gbps")[1] for m in MODES}
    rtt = {m: stat(m, "rtt_avg_ms")[1] for m in MODES}
    lines = [f"# One guest's broadcast storm against the others' traffic, {stamp}", "", f"`{cmd}`", "",
             "Guest g3 → g2 across two hosts (veth guests on the kernel fast path, 1500-byte underlay): TCP (iperf3, "
             "one stream) and pings every 10 ms side by side, while g1 (g3's neighbour on host 1) sends broadcast "
             "frames at the rate shown out of its NIC (`storm`) or into a veth pair of its own namespace (`sink`). "
             "Storm control at its default (`SET storm-pps` 1000). One interleaved run.", "",
             "| mode | TCP Gbit/s min / median / max | pings lost (max) | ping RTT ms avg (median) / max (max) | storm frames/s sent (median) | through host 1 / dropped (`drop_storm`), median per window |",
             "|---|---|---|---|---|---|"]
    for m in MODES:
        g_ = stat(m, "gbps")
        rates = [p["storm_rate"] for p in points if p["mode"] == m and "storm_rate" in p]
        lines.append(f"| {m} | {g_[0]:.2f} / {g_[1]:.2f} / {g_[2]:.2f} | {stat(m, 'ping_lost')[2]} | "
                     f"{stat(m, 'rtt_avg_ms')[1]:.3f} / {stat(m, 'rtt_max_ms')[2]:.3f} | "
                     f"{statistics.median(rates) if rates else 0:.0f} | "
                     f"{statistics.median(p['through'] for p in points if p['mode'] == m):.0f} / "
                     f"{statistics.median(p['dropped_storm'] for p in points if p['mode'] == m):.0f} |")
    lines += ["", f"TCP under the storm ÷ none: {med['storm'] / med['none']:.2f}, ÷ sink (the sender's own CPU taken "
              f"out): {med['storm'] / med['sink']:.2f} (target: within 10 %); ping RTT storm ÷ none "
              f"{rtt['storm'] / rtt['none']:.2f}, ÷ sink {rtt['storm'] / rtt['sink']:.2f}."]
    md = "\n".join(lines) + "\n"
    print(md)
    out = REPO / "bench" / "results"
    (out / f"{stamp}-storm.json").write_text(json.dumps({"command": cmd, "points": points}, indent=1))
    (out / f"{stamp}-storm.md").write_text(md)
    print(f"wrote {out / stamp}-storm.json and .md")


if __name__ == "__main__":
    main()
