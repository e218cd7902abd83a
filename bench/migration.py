#!/usr/bin/env python3
"""A VM's live migration between hosts, timed: the outage its network sees
against QEMU's own downtime, over repeated moves.

Three hosts (namespaces) with vnetd, vnet-agent and a real etcd, the overlay
of tests/test_controller.py; a QEMU VM (TCG, 128 MiB) on vhost-user NICs of
hosts 1 and 2 is migrated h1 -> h2 -> h1 -> ... (--moves, default 6) with
QEMU's `migrate` over TCP, while a guest on host 3 pings it (--interval,
default 0.01 s) and holds a TCP echo stream to it. Each move is checked as
tests/test_migration.py checks it (`move()`: the stream intact, no duplicate
reply, no more pings lost than drops vnetd counted) and timed:

  QEMU total / downtime   what QEMU's query-migrate reports (downtime: the VM
                          stopped, from the source's stop to the destination
                          running)
  rings stop -> start     from the source vnetd logging the VM's rings
                          stopped to the destination vnetd logging them
                          started (QEMU's switch-over, seen by vnetd)
  start -> re-routed      from the rings starting to host 3's agent applying
                          the route to the new host (vnetd WAIT -> agent ->
                          etcd -> host 3's agent -> host 3's vnetd)
  ping outage             the longest gap between two ping replies at host 3
                          (resolution: the ping interval)
  beyond downtime         ping outage - QEMU downtime (the issue's target:
                          under 100 ms)
  lost in a row           the most requests lost one after another (what the
                          network itself lost; the outage also holds replies
                          the guest was slow to give)
  slowest reply           the longest round trip answered: a guest that just
                          resumed under TCG answers late while QEMU translates
                          its code again

    sudo python3 bench/migration.py [--moves 6] [--interval 0.01]

Writes bench/results/<date>-migration.{md,json}. A benchmark: it prints
figures (min / median / max), never pass/fail; it fails only when the
testbed cannot be built or a move breaks what the test checks.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO / "tests"))

import netlab  # noqa: E402
import test_migration as tm  # noqa: E402
from netlab import wait_until  # noqa: E402

COLUMNS = [
    ("qemu_total_ms", "QEMU total (ms)"),
    ("qemu_downtime_ms", "QEMU downtime (ms)"),
    ("rings_stopped_to_started_ms", "rings stop → start (ms)"),
    ("started_to_rerouted_ms", "start → host 3 re-routed (ms)"),
    ("ping_outage_ms", "ping outage (ms)"),
    ("beyond_downtime_ms", "outage beyond downtime (ms)"),
    ("pings_lost", "pings lost"),
    ("pings_lost_in_a_row", "pings lost in a row"),
    ("slowest_ping_reply_ms", "slowest ping reply (ms)"),
    ("lost_at_host_3", "pings lost at host 3"),
    ("lost_on_the_vm_side", "pings lost on the VM's side"),
    ("drops_counted", "drops counted"),
    ("tcp_longest_wait_ms", "TCP longest echo wait (ms)"),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moves", type=int, default=6)
    ap.add_argument("--interval", type=float, default=0.01)
    args = ap.parse_args()
    subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=REPO, check=True)
    began = time.monotonic()
    lab = netlab.Lab(tag="m")
    rows = []
    try:
        o = tm.setup(lab)
        try:
            at = {1: tm.boot_on_h1(o)}
            for k in range(args.moves):
                frm, to = (1, 2) if k % 2 == 0 else (2, 1)
                if to in at:
                    # The paused QEMU the VM left there goes first.
                    at.pop(to).quit()
                    assert wait_until(lambda: "connected=no" in tm.iface(o, to), timeout=10)
                at[to] = tm.incoming(o, to)
                r = tm.move(o, frm, to, at[frm], at[to], ping_interval=args.interval)
                r["beyond_downtime_ms"] = r["ping_outage_ms"] - r["qemu_downtime_ms"]
                rows.append(r)
                print(tm.describe(r), flush=True)
        finally:
            tm.teardown(o)
    finally:
        problems = lab.close()
    if problems:
        print("lab teardown:", problems, file=sys.stderr)
    write(rows, args, time.monotonic() - began)


def write(rows, args, seconds):
    stamp = dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    out = BENCH / "results"
    out.mkdir(exist_ok=True)
    cmd = f"sudo python3 bench/migration.py --moves {args.moves} --interval {args.interval}"
    md = [f"# VM live migration: network outage against QEMU's downtime ({stamp})", "",
          f"`{cmd}` ({seconds / 60:.1f} minutes; {platform.node()}, kernel {platform.release()}; "
          f"QEMU TCG 128 MiB, pings every {args.interval * 1000:.0f} ms from host 3, agents and etcd as in "
          "tests/test_migration.py)", "",
          "| | min | median | max |", "|---|---|---|---|"]
    for key, name in COLUMNS:
        v = [r[key] for r in rows]
        md.append(f"| {name} | {min(v):g} | {statistics.median(v):g} | {max(v):g} |")
    md += ["", "Each move:", "", "| move | " + " | ".join(n for _, n in COLUMNS) + " |",
           "|---|" + "---|" * len(COLUMNS)]
    for r in rows:
        md.append(f"| h{r['from']} → h{r['to']} | " + " | ".join(f"{r[k]:g}" for k, _ in COLUMNS) + " |")
    (out / f"{stamp}-migration.md").write_text("\n".join(md) + "\n")
    (out / f"{stamp}-migration.json").write_text(json.dumps({"command": cmd, "moves": rows}, indent=1) + "\n")
    print("\n".join(md))
    print(f"\nresults: bench/results/{stamp}-migration.md")


if __name__ == "__main__":
    main()
