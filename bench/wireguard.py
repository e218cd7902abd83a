#!/usr/bin/env python3
"""Guest-to-guest TCP over a WireGuard link, against the same run's other
ways between two hosts: one interleaved run, iperf3 (one stream, `--seconds`
each), every variant on its own pair of host namespaces on one bridge
(1500-byte underlay):

  wireguard     vnetd's WireGuard link, TAP guests (the user path: the only
                path sealed frames take)
  udp-user      vnetd's plaintext VNET/P UDP link, TAP guests, `SET datapath
                user`: the same user path, unsealed
  udp-kernel    vnetd's UDP link with veth guests: the kernel fast path (eBPF)
  wireguard-go  Debian's wireguard-go between the two hosts, iperf3 from TUN
                address to TUN address (a user-space WireGuard anchor; no
                overlay, no guests)

    sudo python3 bench/wireguard.py [--reps 5] [--seconds 5]

Prints min/median/max Gbit/s per variant and the ratios the issue set
(wireguard ÷ udp-user ≥ 0.8, wireguard ÷ wireguard-go ≥ 3); writes
bench/results/<date>-wireguard.{json,md}. A benchmark, never a pass/fail test.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "tools"))
from netlab import Lab, guest_mac, mesh_config, underlay_ip, veth_mesh  # noqa: E402
from test_wireguard import GUEST_MTU, public_key, wg_config  # noqa: E402

VARIANTS = ["wireguard", "udp-user", "udp-kernel", "wireguard-go"]
UDP_MTU = 1500 - 42


def iperf(lab: Lab, server_ns: str, client_ns: str, ip: str, seconds: float) -> float:
    srv = lab.popen(server_ns, "iperf3", "-s", "-1", stdout=subprocess.DEVNULL)
    try:
        import time
        time.sleep(0.3)
        out = lab.x(client_ns, "iperf3", "-c", ip, "-t", f"{seconds:g}", "--json", timeout=seconds + 60).stdout
    finally:
        srv.wait(timeout=30)
    return json.loads(out)["end"]["sum_received"]["bits_per_second"] / 1e9


def setup_wireguard(lab: Lab):
    """Hosts 1 and 2: vnetd with a WireGuard link, TAP guests 1 and 2."""
    hosts = {h: lab.add_host(h) for h in (1, 2)}
    d = {h: lab.start_vnetd(hosts[h], f"INTERFACE ADD g{h} {guest_mac(h)} mtu {GUEST_MTU}\n",
                            "--wireguard-key-file", lab.tmp / f"h{h}.wgkey") for h in (1, 2)}
    keys = {h: public_key(d[h]) for h in (1, 2)}
    for h, p in ((1, 2), (2, 1)):
        d[h].ctl_file(wg_config(h, {p: keys[p]}, {1: [1], 2: [2]}))
    return {h: lab.attach_guest(hosts[h], f"g{h}", h) for h in (1, 2)}


def setup_udp_user(lab: Lab):
    """Hosts 3 and 4: vnetd with a plain UDP link, user datapath, TAP guests 3 and 4."""
    hosts = {h: lab.add_host(h) for h in (3, 4)}
    layout = {3: [("g3", guest_mac(3))], 4: [("g4", guest_mac(4))]}
    d = {h: lab.start_vnetd(hosts[h], mesh_config(h, layout, mtu=UDP_MTU)) for h in (3, 4)}
    for x in d.values():
        x.ctl("SET", "datapath", "user")
    return {h: lab.attach_guest(hosts[h], f"g{h}", h) for h in (3, 4)}


def setup_udp_kernel(lab: Lab):
    """Hosts 5 and 6: veth guests 5 and 6, the kernel fast path."""
    _, _, g = veth_mesh(lab, {5: [5], 6: [6]})
    return g


def setup_wireguard_go(lab: Lab):
    """Hosts 7 and 8: wireguard-go on each, a TUN address each."""
    import wggo
    hosts = {h: lab.add_host(h) for h in (7, 8)}
    return wggo.pair(hosts[7], hosts[8], lab.prefix, underlay_ip(7), underlay_ip(8), lab=lab)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="a subset, comma-separated (the ratios need all)")
    args = ap.parse_args()
    variants = [v for v in VARIANTS if v in args.variants.split(",")]
    started = dt.datetime.now()
    stamp = started.strftime("%Y-%m-%d-%H%M%S")
    points = []
    with Lab("wgb") as lab:
        ends, pair = {}, None
        if "wireguard" in variants:
            g = setup_wireguard(lab)
            ends["wireguard"] = (g[2].ns, g[1].ns, g[2].ip)
        if "udp-user" in variants:
            g = setup_udp_user(lab)
            ends["udp-user"] = (g[4].ns, g[3].ns, g[4].ip)
        if "udp-kernel" in variants:
            g = setup_udp_kernel(lab)
            ends["udp-kernel"] = (g[6].ns, g[5].ns, g[6].ip)
        if "wireguard-go" in variants:
            pair = setup_wireguard_go(lab)
            ends["wireguard-go"] = (pair[1].ns, pair[0].ns, pair[1].tunnel_ip)
        for server_ns, client_ns, ip in ends.values():
            assert lab.x(client_ns, "ping", "-c", "1", "-W", "5", ip, check=False).returncode == 0, ip
        for rep in range(args.reps):
            order = variants if rep % 2 == 0 else variants[::-1]
            for v in order:
                gbps = iperf(lab, *ends[v], args.seconds)
                p = {"variant": v, "rep": rep, "gbps": gbps}
                points.append(p)
                print(json.dumps(p), flush=True)
        for w in pair or ():
            w.stop()
    cmd = f"sudo python3 bench/wireguard.py --reps {args.reps} --seconds {args.seconds:g}"
    if variants != VARIANTS:
        cmd += f" --variants {','.join(variants)}"
    med = {v: statistics.median(p["gbps"] for p in points if p["variant"] == v) for v in variants}
    ratio = lambda v, ref: f"{med[v] / med[ref]:.2f}" if ref in med else "-"  # noqa: E731
    lines = [f"# WireGuard links, {stamp}", "", f"`{cmd}`", "",
             "Guest → guest TCP (iperf3, one stream) across two host namespaces, 1500-byte underlay, "
             "every variant in one interleaved run.", "",
             "| variant | Gbit/s min / median / max | ÷ wireguard-go | ÷ udp-user |", "|---|---|---|---|"]
    for v in variants:
        xs = sorted(p["gbps"] for p in points if p["variant"] == v)
        lines.append(f"| {v} | {xs[0]:.2f} / {statistics.median(xs):.2f} / {xs[-1]:.2f} | "
                     f"{ratio(v, 'wireguard-go')} | {ratio(v, 'udp-user')} |")
    if "wireguard" in med:
        lines += ["", f"Targets: wireguard ÷ udp-user = {ratio('wireguard', 'udp-user')} (≥ 0.8); "
                  f"wireguard ÷ wireguard-go = {ratio('wireguard', 'wireguard-go')} (≥ 3)."]
    md = "\n".join(lines) + "\n"
    print(md)
    out = REPO / "bench" / "results"
    (out / f"{stamp}-wireguard.json").write_text(json.dumps({"command": cmd, "points": points}, indent=1))
    (out / f"{stamp}-wireguard.md").write_text(md)
    print(f"wrote {out / stamp}-wireguard.json and .md")


if __name__ == "__main__":
    main()
