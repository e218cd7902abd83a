#!/usr/bin/env python3
"""Plain vs optimistic interrupts (VNET/P+) for a real guest on a vhost-user
NIC, in one interleaved run: a QEMU guest (TCG) on host 2's vnetd, pinged
and sent a TCP stream by a namespace guest on host 1.

    sudo python3 bench/vhost_irq.py [--rounds 3] [--pings 300] [--bytes 20000000]

Each round runs both policies (`SET interrupts plain`, then `optimistic`,
the order alternating by round), and for each:

  - ping: `--pings` echo requests 10 ms apart from the namespace guest to the
    VM; RTT p50/p99 (ms) and the VM's interrupts per received frame;
  - stream: `--bytes` over TCP to the VM; MB/s and interrupts per frame.

"Interrupts" are the guest's own count (its /proc/interrupts, the virtio
lines: under TCG the device has no MSI-X, vectors=0, so one line counts the
receive and the transmit-completion interrupts together) per frame the guest
received (its eth0 rx_packets: a merged super-frame is one), and vnetd's
calls for received frames (`vhost_rx_interrupts`, eventfd writes) per frame
vnetd delivered (`out_frames`: a merged super-frame counts its segments). Only a real guest shows this: DPDK's virtio-user polls.
TCG makes every figure slow; the comparison between the policies is the
point. Writes bench/results/<date>-vhost-irq.{json,md}. A benchmark, never a
pass/fail test.
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
sys.path.insert(0, str(BENCH.parent / "tests"))
from netlab import REPO, Lab  # noqa: E402
from vm import guest  # noqa: E402
from vm.guest import Console  # noqa: E402

XFER = REPO / "tests" / "tools" / "xfer.py"
VM_MAC, VM_IP = guest.VM_MAC, guest.VM_IP

# The VM prints its counters each time it is poked on port 6000, and sinks
# every stream on port 5002.
VM_SCRIPT = """
(while true; do nc -l -p 5002 > /dev/null; done) &
while true; do
  nc -l -p 6000 > /dev/null
  irq=$(grep virtio /proc/interrupts | awk '{for (i = 2; i <= NF; i++) if ($i ~ /^[0-9]+$/) s += $i} END {print s + 0}')
  echo "VNET-COUNT $irq $(cat /sys/class/net/eth0/statistics/rx_packets)"
done
"""


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split(" ")[0]


class Bench:
    def __init__(self, lab: Lab, args):
        self.lab, self.args = lab, args
        h2, self.g1, sock, cfg2 = guest.vhost_user_vm_lab(lab)
        self.d2 = lab.start_vnetd(h2, cfg2)
        qemu = guest.qemu_vhost_user_command(sock, VM_MAC, f"{VM_IP}/24", VM_SCRIPT)
        self.vm = lab.popen(h2, *qemu, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        self.console = Console(self.vm)
        self.console.wait_for("VNET-GUEST-UP")
        assert lab.reaches(self.g1, type("G", (), {"ip": VM_IP})(), tries=30)

    def counts(self) -> tuple[int, int, int, int]:
        """(guest interrupts, guest rx frames, vnetd calls, vnetd frames to the VM)."""
        for _ in range(100):
            r = self.lab.x(self.g1.ns, "python3", "-c",
                           f"import socket; socket.create_connection(('{VM_IP}', 6000), 2).close()", check=False)
            if r.returncode == 0:
                break
            time.sleep(0.1)
        line = self.console.wait_for("VNET-COUNT", timeout=30).split()
        st = self.d2.stats()["interface vm9"]
        return int(line[1]), int(line[2]), st["vhost_rx_interrupts"], st["out_frames"]

    def measure(self, policy: str) -> dict:
        self.d2.ctl("SET", "interrupts", policy)
        out = {"policy": policy, "load_before": loadavg()}
        c0 = self.counts()
        p = self.lab.x(self.g1.ns, "ping", "-c", self.args.pings, "-i", "0.01", "-W", "1", VM_IP, check=False, timeout=600)
        rtts = sorted(float(m) for m in re.findall(r"time=([\d.]+)", p.stdout))
        c1 = self.counts()
        t = time.time()
        s = self.lab.x(self.g1.ns, "python3", XFER, "send", VM_IP, 5002, self.args.bytes, check=False, timeout=600)
        secs = time.time() - t
        c2 = self.counts()
        frames = lambda a, b: max(b[1] - a[1], 1)
        out.update({
            "ping_replies": len(rtts),
            "rtt_p50_ms": rtts[len(rtts) // 2] if rtts else None,
            "rtt_p99_ms": rtts[min(len(rtts) - 1, int(len(rtts) * 0.99))] if rtts else None,
            "ping_irq_per_frame": (c1[0] - c0[0]) / frames(c0, c1),
            "ping_calls_per_frame": (c1[2] - c0[2]) / max(c1[3] - c0[3], 1),
            "stream_ok": s.returncode == 0,
            "stream_MBps": self.args.bytes / secs / 1e6,
            "stream_irq_per_frame": (c2[0] - c1[0]) / frames(c1, c2),
            "stream_calls_per_frame": (c2[2] - c1[2]) / max(c2[3] - c1[3], 1),
            "load_after": loadavg(),
        })
        return out


def summary(rows: list[dict]) -> list[str]:
    keys = ["rtt_p50_ms", "rtt_p99_ms", "ping_irq_per_frame", "ping_calls_per_frame",
            "stream_MBps", "stream_irq_per_frame", "stream_calls_per_frame"]
    lines = ["| metric | plain min/median/max | optimistic min/median/max | optimistic / plain (medians) |",
             "|---|---|---|---|"]
    for k in keys:
        cells, med = [], {}
        for pol in ("plain", "optimistic"):
            v = [r[k] for r in rows if r["policy"] == pol and r[k] is not None]
            if not v:
                cells.append("-")
                continue
            med[pol] = statistics.median(v)
            cells.append(f"{min(v):.3f} / {med[pol]:.3f} / {max(v):.3f}")
        ratio = f"{med['optimistic'] / med['plain']:.2f}" if len(med) == 2 and med["plain"] else "-"
        lines.append(f"| {k} | {cells[0]} | {cells[1]} | {ratio} |")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pings", type=int, default=300)
    ap.add_argument("--bytes", type=int, default=20_000_000)
    args = ap.parse_args()
    lab = Lab(tag="irq")
    rows = []
    try:
        b = Bench(lab, args)
        for r in range(args.rounds):
            order = ("plain", "optimistic") if r % 2 == 0 else ("optimistic", "plain")
            for pol in order:
                row = b.measure(pol)
                row["round"] = r
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        lab.close()
    stamp = dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    out = BENCH / "results" / f"{stamp}-vhost-irq"
    cmd = "sudo python3 bench/vhost_irq.py " + " ".join(sys.argv[1:])
    table = summary(rows)
    out.with_suffix(".json").write_text(json.dumps({"command": cmd, "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(f"# vhost-user interrupts, plain vs optimistic\n\n`{cmd}`\n\n" + "\n".join(table) + "\n")
    print("\n".join(table))
    print(f"wrote {out}.json and .md")


if __name__ == "__main__":
    main()
