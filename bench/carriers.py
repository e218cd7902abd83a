#!/usr/bin/env python3
"""Would AF_XDP carry a link's datagrams faster than the UDP socket vnetd
uses? One interleaved run on this machine's underlay (two host namespaces,
veth through a bridge, copy mode: a veth has no zero-copy AF_XDP), with
bench/tools/carrier.c, one thread per side, the sender on CPU 0 and the
receiver on CPU 1, every pairing of

senders:
  tx-gso    what vnetd does: runs of up to 64 datagrams (65,000 bytes), each
            one message with UDP_SEGMENT, 4 messages per sendmmsg
  tx-mmsg   64 datagrams per sendmmsg, one skb each (vnetd's path for
            frames that cannot be a GSO run)
  tx-xsk    AF_XDP: frames built once in the umem, 64 descriptors per
            kick (sendto), the completion ring reaped each pass
receivers:
  rx-gro    what vnetd does: recvmmsg of 16 with UDP_GRO (runs counted as
            their datagrams)
  rx-xsk    AF_XDP on queue 0 of host 2's eth0 (libxdp's redirect program,
            generic mode), every frame's header read

The figure is the datagrams the receiver took per second of sending, and
beside it what the sender handed the kernel and the packets host 2's eth0
counted (a GSO run crosses a veth as one packet).

    sudo python3 bench/carriers.py [--reps 3] [--seconds 5] [--sizes 64,1500]

Payload sizes are UDP payloads (a VNET datagram holds the guest's frame);
the underlay MTU is 9000 so that 1500 fits; the neighbour entries are
static (rx-xsk takes ARP too). Prints min/median/max Mpps per pairing and
the ratio to vnetd's own (tx-gso → rx-gro); writes
bench/results/<date>-carriers.{json,md}. A benchmark, never a pass/fail test.
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
from netlab import Lab, underlay_ip  # noqa: E402

TOOL_SRC = BENCH / "tools" / "carrier.c"
TOOL = REPO / "target" / "bench" / "carrier"
PORT = 9000
PAIRS = [(t, r) for r in ("rx-gro", "rx-xsk") for t in ("tx-gso", "tx-mmsg", "tx-xsk")]


def build_tool():
    if TOOL.exists() and TOOL.stat().st_mtime >= TOOL_SRC.stat().st_mtime:
        return
    TOOL.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["gcc", "-O2", "-Wall", "-o", TOOL, TOOL_SRC, "-lxdp", "-lbpf"], check=True)


def rx_packets(lab: Lab, ns: str) -> int:
    return int(lab.x(ns, "cat", "/sys/class/net/eth0/statistics/rx_packets").stdout)


def mac_of(lab: Lab, ns: str) -> str:
    return lab.x(ns, "cat", "/sys/class/net/eth0/address").stdout.strip()


def point(lab: Lab, h1: str, h2: str, tx: str, rx: str, payload: int, seconds: float) -> dict:
    """One measurement: `tx` on host 1 sending to `rx` on host 2."""
    src, dst = underlay_ip(1), underlay_ip(2)
    lab.x(h2, "ip", "link", "set", "eth0", "xdpgeneric", "off")  # none left by a receiver that failed
    rx_cmd = [TOOL, rx, PORT, seconds + 2] if rx == "rx-gro" else [TOOL, rx, "eth0", seconds + 2]
    r = lab.popen(h2, "taskset", "-c", "1", *rx_cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1)  # the receiver bound (and its XDP program attached)
    if tx == "tx-xsk":
        tx_cmd = [TOOL, tx, "eth0", mac_of(lab, h1), mac_of(lab, h2), src, dst, PORT, payload, seconds]
    else:
        tx_cmd = [TOOL, tx, src, dst, PORT, payload, seconds]
    before = rx_packets(lab, h2)
    t = lab.x(h1, "taskset", "-c", "0", *[str(c) for c in tx_cmd], timeout=seconds + 30)
    wire = rx_packets(lab, h2) - before
    out, err = r.communicate(timeout=seconds + 30)
    if r.returncode != 0:
        raise RuntimeError(f"{rx} failed: {err[-500:]}")
    got = json.loads(out)
    sent = json.loads(t.stdout)
    return {"pair": f"{tx} → {rx}", "payload": payload, "mpps": got["frames"] / sent["seconds"] / 1e6,
            "sent_mpps": sent["frames"] / sent["seconds"] / 1e6, "wire_mpps": wire / sent["seconds"] / 1e6}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--sizes", default="64,1500")
    ap.add_argument("--no-setup", action="store_true", help="skip bench/setup (installs gcc, libxdp)")
    args = ap.parse_args()
    if not args.no_setup:
        subprocess.run([BENCH / "setup"], check=True)
    build_tool()
    sizes = [int(s) for s in args.sizes.split(",")]
    started = dt.datetime.now()
    stamp = started.strftime("%Y-%m-%d-%H%M%S")
    points = []
    with Lab("car") as lab:
        h1, h2 = lab.add_host(1, mtu=9000), lab.add_host(2, mtu=9000)
        for a, b, i in ((h1, h2, 2), (h2, h1, 1)):
            lab.x(a, "ip", "neigh", "replace", underlay_ip(i), "lladdr", mac_of(lab, b), "dev", "eth0", "nud", "permanent")
        for rep in range(args.reps):
            pairs = PAIRS if rep % 2 == 0 else PAIRS[::-1]
            for size in sizes:
                for tx, rx in pairs:
                    p = point(lab, h1, h2, tx, rx, size, args.seconds)
                    p["rep"] = rep
                    points.append(p)
                    print(json.dumps(p), flush=True)
    cmd = f"sudo python3 bench/carriers.py --reps {args.reps} --seconds {args.seconds:g} --sizes {args.sizes}"
    lines = [f"# AF_XDP against vnetd's UDP socket, {stamp}", "", f"`{cmd}`", "",
             "| payload | sender → receiver | Mpps received min / median / max | sent (median) | packets on host 2's eth0 (median) | ÷ vnetd's (tx-gso → rx-gro) |",
             "|---|---|---|---|---|---|"]
    names = [f"{t} → {r}" for t, r in PAIRS]
    for size in sizes:
        ps = {n: [p for p in points if p["pair"] == n and p["payload"] == size] for n in names}
        ref = statistics.median(p["mpps"] for p in ps[names[0]])
        for n in names:
            v = sorted(p["mpps"] for p in ps[n])
            lines.append(f"| {size} | {n} | {v[0]:.3f} / {statistics.median(v):.3f} / {v[-1]:.3f} | "
                         f"{statistics.median(p['sent_mpps'] for p in ps[n]):.3f} | {statistics.median(p['wire_mpps'] for p in ps[n]):.3f} | "
                         f"{statistics.median(v) / ref:.2f} |")
    md = "\n".join(lines) + "\n"
    print(md)
    out = REPO / "bench" / "results"
    (out / f"{stamp}-carriers.json").write_text(json.dumps({"command": cmd, "points": points}, indent=1))
    (out / f"{stamp}-carriers.md").write_text(md)
    print(f"wrote {out / stamp}-carriers.json and .md")


if __name__ == "__main__":
    main()
