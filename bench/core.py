#!/usr/bin/env python3
"""VNET core benchmark: what a rule table of 1,000 to 100,000 routes costs one
vnetd, tried as a user would. One command, run as root:

    python3 bench/core.py [--sizes 1000,10000,100000] [--repeats 3]

For each size, interleaved over the repeats, a vnetd in a host namespace with
two TAP guests (g1 sends, g2 receives) and one link is started with a config
of that many routes (one per remote guest MAC, as docs/controller.md's agent
writes them), and measured:

  load      config applied (vnetd's own log line) and ready to answer, from
            the process start
  change    one `ROUTE ADD` and one `ROUTE DEL` on a kept control session,
            each a request of its own, paced under the session's rate limit:
            the round trip, which is what a user waits for
  memory    vnetd's resident set with the table loaded
  burst     g1 sends 3,000 frames, each to a different routed MAC, as fast
            as a raw socket can: how many reach g2, and where the others were
            counted (vnetd's drops, the TAP's own queue)

and, for the table alone (crates/vnet-core/examples/table_bench.rs): build
time, one change on a shared table, and one lookup that misses every cache,
against the plain scan the index replaced.

Writes bench/results/<date>-core.md and .json. A benchmark: it prints figures
and fails only when the testbed cannot be built.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent / "tests"))
from netlab import BIN, Lab, UnixSession  # noqa: E402

BURST = 3000
ETH_P = 0x88B5  # IEEE local experimental


def mac(i: int) -> str:
    return "02:76:%02x:%02x:%02x:%02x" % tuple(i.to_bytes(4, "big"))


G1, G2 = mac(1), mac(2)


def config(n: int, ns1: str, ns2: str) -> str:
    lines = [
        f"INTERFACE ADD g1 {G1} netns {ns1}",
        f"INTERFACE ADD g2 {G2} netns {ns2}",
        "LINK ADD 127.0.0.2 name peer",
        f"ROUTE ADD any {G1} interface {G1} any",
        f"ROUTE ADD any {G2} interface {G2} any",
        f"ROUTE ADD any ff:ff:ff:ff:ff:ff interface {G1} any",
        f"ROUTE ADD any ff:ff:ff:ff:ff:ff interface {G2} any",
        "ROUTE ADD any ff:ff:ff:ff:ff:ff edge peer interface",
    ]
    # The remote guests: every one routed to g2 here, so that a frame to
    # any of them arrives somewhere it can be counted.
    lines += [f"ROUTE ADD any {mac(1000 + i)} interface {G2} any" for i in range(max(0, n - 5))]
    return "\n".join(lines) + "\n"


def mmm(xs: list[float]) -> list[float]:
    return [min(xs), statistics.median(xs), max(xs)]


def request(s: UnixSession, text: str) -> float:
    t = time.perf_counter()
    status, _ = s.request(text + "\n")
    took = time.perf_counter() - t
    if not status.startswith("OK"):
        raise RuntimeError(f"{text}: {status}")
    return took


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


SENDER = r"""
import socket, sys, time
n, first, macs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
count = 3000
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind((n, 0))
src = bytes.fromhex(sys.argv[4].replace(":", ""))
frames = []
for k in range(count):
    i = first + (k * 7919) % macs
    dst = bytes([2, 0x76]) + i.to_bytes(4, "big")
    frames.append(dst + src + (0x88B5).to_bytes(2, "big") + k.to_bytes(4, "big") + bytes(56))
sent = 0
for f in frames:
    try:
        s.send(f)
        sent += 1
    except BlockingIOError:
        pass
print(sent)
"""

RECEIVER = r"""
import socket, sys, time
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x88B5))
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
s.bind((sys.argv[1], 0))
print("ready", flush=True)
s.settimeout(1.0)
seen = set()
while True:
    try:
        f = s.recv(2048)
    except socket.timeout:
        break
    seen.add(int.from_bytes(f[14:18], "big"))
print(len(seen), flush=True)
"""


def tap_tx_dropped(lab: Lab, ns: str, dev: str) -> int:
    out = lab.x(ns, "ip", "-j", "-s", "link", "show", dev).stdout
    return int(json.loads(out)[0]["stats64"]["tx"]["dropped"])


def one(n: int) -> dict:
    with Lab("core") as lab:
        host = lab.ns("h")
        lab.x(host, "ip", "link", "set", "lo", "up")
        ns1, ns2 = lab.guest_ns("g1"), lab.guest_ns("g2")
        conf = lab.tmp / "core.conf"
        conf.write_text(config(n, ns1, ns2))
        t0 = time.perf_counter()
        d = lab.start_vnetd(host, conf, "--udp-port", "9000", wait=False)
        ready = None
        while time.perf_counter() - t0 < 60:
            if d.proc.poll() is not None:
                raise RuntimeError(f"vnetd exited:\n{d.log_text()}")
            try:
                s = UnixSession(d.sock)
                status, _ = s.request("LINK LIST\n")
                if status.startswith("OK"):
                    ready = time.perf_counter() - t0
                    break
                s.close()
            except OSError:
                time.sleep(0.005)
        if ready is None:
            raise RuntimeError("vnetd not ready in 60 s")
        applied = None
        for line in d.log_text().splitlines():
            if "changes applied in" in line:
                applied = float(line.rsplit("applied in ", 1)[1].split()[0])
        rss = rss_kb(d.proc.pid)

        add, dele = [], []
        for k in range(100):
            time.sleep(0.003)  # under the session's 1,000 requests/s
            rule = f"any {mac(0x0F000000 + k)} edge peer any"
            add.append(request(s, f"ROUTE ADD {rule}"))
            time.sleep(0.003)
            dele.append(request(s, f"ROUTE DEL {rule}"))
        s.close()

        for ns, dev in ((ns1, "g1"), (ns2, "g2")):
            lab.x(ns, "ip", "link", "set", dev, "up")

        def burst(macs: int) -> dict:
            recv = lab.popen(ns2, sys.executable, "-c", RECEIVER, "g2", stdout=subprocess.PIPE, text=True)
            assert recv.stdout.readline().strip() == "ready"
            before = d.stats()
            drop0 = tap_tx_dropped(lab, ns1, "g1")
            sender = lab.x(ns1, sys.executable, "-c", SENDER, "g1", 1000, macs, G1)
            sent = int(sender.stdout.strip())
            got = int(recv.communicate(timeout=30)[0].strip())
            after = d.stats()
            return {
                "macs": macs,
                "sent": sent,
                "arrived": got,
                "read_by_vnetd": int(after["interface g1"]["in_frames"]) - int(before["interface g1"]["in_frames"]),
                "vnetd_drops": {k: int(v) - int(before["global"].get(k, 0)) for k, v in after["global"].items()
                                if k.startswith("drop") and int(v) - int(before["global"].get(k, 0))},
                "tap_queue_dropped": tap_tx_dropped(lab, ns1, "g1") - drop0,
                "vnetd_counted_queue_drops": int(after["interface g1"]["drop_upcall_full"])
                - int(before["interface g1"]["drop_upcall_full"]),
            }

        time.sleep(0.2)
        spread = burst(min(BURST, max(1, n - 5)))
        time.sleep(0.2)
        one_dst = burst(1)
        return {
            "routes": n,
            "ready_s": ready,
            "applied_s": applied,
            "rss_kb": rss,
            "add_us": [x * 1e6 for x in add],
            "del_us": [x * 1e6 for x in dele],
            "burst": spread,
            "burst_one_mac": one_dst,
        }


def table_bench(sizes: list[int]) -> list[dict]:
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "vnet-core", "--example", "table_bench"],
                   cwd=BENCH.parent, check=True)
    exe = BENCH.parent / "target" / "release" / "examples" / "table_bench"
    out = subprocess.run([exe, *map(str, sizes)], check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(BENCH / "results"))
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    runs: dict[int, list[dict]] = {n: [] for n in sizes}
    for r in range(a.repeats):
        for n in sizes:
            res = one(n)
            runs[n].append(res)
            b = res["burst"]
            print(f"repeat {r + 1} {n} routes: ready {res['ready_s']:.3f} s (applied {res['applied_s']} s), "
                  f"add median {statistics.median(res['add_us']):.0f} us, rss {res['rss_kb']} kB, "
                  f"burst {b['arrived']}/{b['sent']} (to one MAC: {res['burst_one_mac']['arrived']})", flush=True)
    core = table_bench(sizes)
    stamp = dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    outdir = Path(a.out)
    outdir.mkdir(parents=True, exist_ok=True)
    cmd = "python3 bench/core.py " + " ".join(sys.argv[1:])
    (outdir / f"{stamp}-core.json").write_text(json.dumps({"command": cmd, "runs": runs, "table": core}, indent=1))
    md = [f"# Core benchmark, {stamp}", "", f"Command: `{cmd}` (kernel {os.uname().release}, "
          f"{os.cpu_count()} CPUs). min / median / max over {a.repeats} runs (change: over all their requests).", "",
          "## One vnetd, as a user meets it", "",
          "| routes | load: applied (s) | load: ready (s) | ROUTE ADD (µs) | ROUTE DEL (µs) | vnetd RSS (MB) | burst of 3,000 frames to 3,000 MACs: arrived | lost in the TAP queue (kernel / vnetd's drop_upcall_full) | other vnetd drops | the same burst to one MAC: arrived |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    f3 = lambda v: " / ".join(f"{x:.3f}" for x in v)
    f0 = lambda v: " / ".join(f"{x:.0f}" for x in v)
    for n in sizes:
        rs = runs[n]
        md.append(
            f"| {n:,} | {f3(mmm([x['applied_s'] for x in rs]))} | {f3(mmm([x['ready_s'] for x in rs]))} | "
            f"{f0(mmm([u for x in rs for u in x['add_us']]))} | {f0(mmm([u for x in rs for u in x['del_us']]))} | "
            f"{f0(mmm([x['rss_kb'] / 1024 for x in rs]))} | "
            f"{' / '.join(str(x['burst']['arrived']) + '/' + str(x['burst']['sent']) for x in rs)} | "
            f"{' / '.join(str(x['burst']['tap_queue_dropped']) + '/' + str(x['burst']['vnetd_counted_queue_drops']) for x in rs)} | "
            f"{' / '.join(str(sum(x['burst']['vnetd_drops'].values())) for x in rs)} | "
            f"{' / '.join(str(x['burst_one_mac']['arrived']) for x in rs)} |")
    md += ["", "## The rule table alone (`cargo run --release -p vnet-core --example table_bench`)", "",
           "| rules | build (ms) | one add, shared table (µs, min/med/max) | one delete (µs) | miss lookup (ns, min/med/max of 20 × 5,000) | broadcast to 107 ports (ns) | plain scan it replaced (ns) |",
           "|---|---|---|---|---|---|---|"]
    for c in core:
        md.append(f"| {c['rules']:,} | {c['build_s'] * 1000:.1f} | {f3(c['add_us'])} | {f3(c['del_us'])} | "
                  f"{f0(c['miss_ns'])} | {c['broadcast_ns']:.0f} | {c['linear_scan_ns']:,.0f} |")
    text = "\n".join(md) + "\n"
    (outdir / f"{stamp}-core.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
