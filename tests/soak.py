#!/usr/bin/env python3
"""The soak test (not part of the fast suite): two hosts, four guests, all of
them sending at once for a bounded time: TCP (64 KiB super-frames), UDP of
small and full-size datagrams, big fragmented pings and ARP. It checks that
no vnetd crashes, that resident memory stays flat, and that every vnetd's
counters add up:

    frames in + fan-out copies + (segments - super-frames cut)
        = frames out + frames dropped (all reasons)

  sudo python3 tests/soak.py [--minutes 10] [--out target/soak.json]
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from netlab import REPO, Lab, guest_mac, mesh_config  # noqa: E402


def rss_kb(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def balance(stats):
    g, o, d = stats["global"], stats["offload"], stats["dispatch"]
    drops = sum(v for k, v in g.items() if k.startswith("drop_"))
    lhs = g["in_frames"] + d["fanout_copies"] + (o["segments"] - o["segmented"])
    rhs = g["out_frames"] + drops
    return lhs, rhs, {k: v for k, v in g.items() if k.startswith("drop_") and v}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--out", default=str(REPO / "target" / "soak.json"))
    a = ap.parse_args()
    seconds = int(a.minutes * 60)
    layout = {1: [("g1", guest_mac(1)), ("g2", guest_mac(2))], 2: [("g3", guest_mac(3)), ("g4", guest_mac(4))]}
    ok = True
    with Lab("soak") as lab:
        hosts = {h: lab.add_host(h) for h in layout}
        d = {h: lab.start_vnetd(hosts[h], mesh_config(h, layout)) for h in layout}
        g = {n: lab.attach_guest(hosts[h], f"g{n}", n) for h, gs in layout.items() for n in (int(t[1:]) for t, _ in gs)}
        for a_, b_ in ((1, 3), (2, 4), (3, 2), (4, 1)):
            assert lab.reaches(g[a_], g[b_]), f"g{a_} cannot reach g{b_}"
        procs = []
        for port, (src, dst, extra) in enumerate([
            (1, 3, []),                                  # TCP: super-frames, segmented and merged
            (4, 2, ["-u", "-b", "200M", "-l", "1400"]),  # full-size UDP
            (2, 4, ["-u", "-b", "20M", "-l", "64"]),     # small UDP
        ], start=5201):
            procs.append(lab.popen(g[dst].ns, "iperf3", "-s", "-1", "-p", port, stdout=subprocess.DEVNULL))
            time.sleep(0.3)
            procs.append(lab.popen(g[src].ns, "iperf3", "-c", g[dst].ip, "-p", port, "-t", seconds, *extra,
                                   stdout=subprocess.DEVNULL))
        # Big pings (fragmented in the guest) and ARP churn.
        procs.append(lab.popen(g[3].ns, "ping", "-q", "-i", "0.01", "-s", "8000", "-w", seconds, g[1].ip,
                               stdout=subprocess.DEVNULL))
        samples = []
        start = time.time()
        while time.time() - start < seconds:
            time.sleep(min(10, max(1, seconds / 30)))
            alive = {h: x.proc.poll() is None for h, x in d.items()}
            samples.append({"t": round(time.time() - start), **{f"rss_kb_h{h}": rss_kb(x.proc.pid) for h, x in d.items()}})
            print(f"t={samples[-1]['t']:4d}s  rss h1 {samples[-1]['rss_kb_h1']} kB  h2 {samples[-1]['rss_kb_h2']} kB", flush=True)
            if not all(alive.values()):
                print(f"vnetd died: {alive}")
                ok = False
                break
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        time.sleep(1)
        report = {"seconds": seconds, "samples": samples, "hosts": {}}
        for h, x in d.items():
            if x.proc.poll() is not None:
                ok = False
                continue
            st = x.stats()
            lhs, rhs, drops = balance(st)
            first = [s[f"rss_kb_h{h}"] for s in samples if s["t"] >= min(60, seconds / 3)] or [samples[0][f"rss_kb_h{h}"]]
            growth = max(s[f"rss_kb_h{h}"] for s in samples) - first[0]
            report["hosts"][h] = {"in_plus_expansion": lhs, "out_plus_drops": rhs, "drops": drops,
                                  "frames_in": st["global"]["in_frames"], "rss_growth_kb_after_warmup": growth}
            print(f"host {h}: in+copies+segments {lhs} = out+drops {rhs}: {'ok' if lhs == rhs else 'MISMATCH'}; "
                  f"drops {drops}; RSS growth after warm-up {growth} kB")
            ok &= lhs == rhs and growth < 16 * 1024
    Path(a.out).parent.mkdir(exist_ok=True)
    report["ok"] = ok
    Path(a.out).write_text(json.dumps(report, indent=1))
    print("soak:", "PASSED" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
