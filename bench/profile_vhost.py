#!/usr/bin/env python3
"""What one frame from a VM costs vnetd's dispatcher, this build against
another's, in one interleaved run: testpmd's net_virtio_user port (txonly,
64-byte frames by default, one polling lcore on CPU 1) is the VM on a
vhost-user interface of one host, whose vnetd (one dispatcher, CPU 0) takes
each frame from the ring, routes it and drops it (a MAC no route names):
the NIC's intake, the part of the VM's path the ring walk is in. Per build
and rep: frames taken per second, the dispatcher's CPU time per frame
(/proc), and, in the last rep, `perf record` of the dispatcher thread for
the window: its top symbols (self time).

    sudo python3 bench/profile_vhost.py --base target/previous/<commit> [--reps 3] [--seconds 4]
                                        [--size 64] [--cut-through off]

Writes bench/results/<date>-profile-vhost.{json,md}. A benchmark, never a
pass/fail test.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent / "tests"))
sys.path.insert(0, str(BENCH))
from netlab import Lab, mesh_config  # noqa: E402
from vhost import NOWHERE, Pmd, loadavg  # noqa: E402
from vhost_mq import dispatcher_cpu  # noqa: E402

MAC_A = "52:54:00:00:00:0a"


def dispatcher_tids(pid: int) -> list[str]:
    return [t.name for t in Path(f"/proc/{pid}/task").iterdir() if (t / "comm").read_text().startswith("dispatcher")]


def top_symbols(data: Path, n: int) -> list[tuple[float, str]]:
    r = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--stdio", "--sort", "symbol",
                        "--percent-limit", "0.5"], capture_output=True, text=True)
    out = []
    for line in r.stdout.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "%" not in line:
            continue
        pct, _, rest = line.partition("%")
        try:
            out.append((float(pct), re.sub(r"(\s+-)+$", "", rest.split("] ", 1)[-1].strip())))
        except ValueError:
            continue
    return out[:n]


def measure(lab: Lab, binary: Path | None, size: int, cut_through: str, seconds: float, profile: Path | None) -> dict:
    h = lab.add_host(1) if not lab.hosts else next(iter(lab.hosts))
    sock = lab.tmp / "pv.sock"
    cfg = (mesh_config(1, {1: [("pa", MAC_A)]}, attach={"pa": f"vhost-user {sock} unsealed-memory"})
           + f"SET datapath user\nSET cut-through {cut_through}\n")
    d = lab.start_vnetd(h, cfg, "--cpus", "0", "--dispatcher-sched", "normal", binary=binary)
    try:
        args = ["--forward-mode=txonly", f"--txpkts={size}", f"--eth-peer=0,{NOWHERE}"]
        pmd = Pmd(lab, h, "a", f"net_virtio_user0,path={sock},mac={MAC_A}", args, 1)
        time.sleep(2)  # start-up and the first partial second
        perf = None
        if profile:
            tids = ",".join(dispatcher_tids(d.proc.pid))
            perf = subprocess.Popen(["perf", "record", "-q", "-F", "2999", "-t", tids, "-o", str(profile), "--", "sleep", str(seconds)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t0, n0, c0 = time.time(), d.stats()["interface pa"]["in_frames"], dispatcher_cpu(d.proc.pid)
        time.sleep(seconds)
        t1, n1, c1 = time.time(), d.stats()["interface pa"]["in_frames"], dispatcher_cpu(d.proc.pid)
        if perf:
            perf.wait(timeout=30)
        pmd.stop()
        frames = n1 - n0
        return {"pps": frames / (t1 - t0), "ns_per_frame": 1e9 * (c1 - c0) / frames if frames else None}
    finally:
        d.stop()


def spread(v: list[float]) -> str:
    return f"{min(v):.3g} / {statistics.median(v):.3g} / {max(v):.3g}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="a folder with another build's vnetd (scripts/build-previous)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--cut-through", default="off", choices=("on", "off"))
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    if shutil.which("dpdk-testpmd") is None:
        sys.exit("dpdk-testpmd not found: apt-get install dpdk-dev (scripts/setup does)")
    if shutil.which("perf") is None:
        subprocess.run(["apt-get", "install", "-y", "-qq", "linux-perf"], check=True, capture_output=True)
    builds = {"this": None, "base": Path(args.base) / "vnetd"}
    tmp = Path(tempfile.mkdtemp())
    lab = Lab(tag="pv")
    rows, tops = [], {}
    try:
        for rep in range(args.reps):
            order = list(builds) if rep % 2 == 0 else list(builds)[::-1]
            for name in order:
                data = tmp / f"{name}.perf" if rep == args.reps - 1 else None
                row = {"rep": rep, "build": name, "load_before": loadavg(),
                       **measure(lab, builds[name], args.size, args.cut_through, args.seconds, data), "load_after": loadavg()}
                rows.append(row)
                print(json.dumps(row), flush=True)
                if data:
                    tops[name] = top_symbols(data, args.top)
    finally:
        lab.close()
    table = [f"{args.size}-byte frames, cut-through {args.cut_through}, one dispatcher on CPU 0, testpmd on CPU 1.", "",
             "| build | Mpps taken, min / median / max | dispatcher CPU ns per frame, min / median / max |", "|---|---|---|"]
    for name in builds:
        rs = [r for r in rows if r["build"] == name]
        table.append(f"| {name} | {spread([r['pps'] / 1e6 for r in rs])} | {spread([r['ns_per_frame'] for r in rs if r['ns_per_frame']])} |")
    med = {n: statistics.median(r["ns_per_frame"] for r in rows if r["build"] == n and r["ns_per_frame"]) for n in builds}
    table += ["", f"this / base, CPU per frame (medians): {med['this'] / med['base']:.2f}", ""]
    for name in builds:
        table += [f"`perf record` of the dispatcher, {name}, last rep (self time, top {args.top}):", "", "| % | symbol |", "|---|---|"]
        table += [f"| {p:.1f} | `{s}` |" for p, s in tops.get(name, [])]
        table.append("")
    stamp = dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    out = BENCH / "results" / f"{stamp}-profile-vhost"
    cmd = "sudo python3 bench/profile_vhost.py " + " ".join(sys.argv[1:])
    out.with_suffix(".json").write_text(json.dumps({"command": cmd, "rows": rows, "top": tops}, indent=1))
    out.with_suffix(".md").write_text(f"# A VM's frame in vnetd's dispatcher: this build against {args.base}\n\n`{cmd}`\n\n" + "\n".join(table) + "\n")
    print("\n".join(table))
    print(f"wrote {out}.json and .md")


if __name__ == "__main__":
    main()
