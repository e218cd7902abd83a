#!/usr/bin/env python3
"""Applications over each transport, in one run: OpenMPI ping-pong (NetPIPE's
NPopenmpi, TCP BTL, ranks busy-polling as MPI does) and ping steadiness
(3,000 pings of 64 B, 3 ms apart, as VNET/P+'s figure 6), between two guests
on two hosts:

  native       the two host namespaces, over their veth
  vxlan        the kernel's VXLAN + bridge, guests in namespaces
  vnet-kernel  veth guests, VNET's kernel fast path
  vnet-vtoe    the same veth guests, the ranks under `vtoe`: their TCP
               connections carried whole by shadow connections (VTOE); its
               pings are vnet-kernel's (ICMP is not TCP), so none are taken
  vnet-user    TAP guests, vnetd's user-level datapath, its default settings

    sudo python3 bench/apps.py [--repeats 3] [--max-bytes 1048576] [--pings 3000]

Prints, per transport and repeat, the 8-byte one-way latency and the 1 MiB
bandwidth NetPIPE measured, then min/median/max and the ratios to native and
to VXLAN, and the pings' p50/p99/max; writes bench/results/<date>-apps.json
and .md. A benchmark, never a
pass/fail test. No CPU pinning: ranks and daemons share the machine's two
CPUs, as a user's MPI job would (`--bind-to none`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent / "tests"))
from netlab import BIN, Lab, guest_mac, mesh_config, overlay_ip, underlay_ip  # noqa: E402

VXLAN_OVERHEAD = 50
VNET_OVERHEAD = 42


def agent_script(tmp: Path) -> Path:
    p = tmp / "mpi-agent"
    p.write_text('#!/bin/sh\nh="$1"; shift\nexec ip netns exec "$h" sh -c "$*"\n')
    p.chmod(0o755)
    return p


def vtoe_agent_script(tmp: Path, sockets: dict[str, Path]) -> Path:
    """The agent for ranks under vtoe: each host's ranks find their vnetd by
    VNETD_SOCKET."""
    p = tmp / "mpi-agent-vtoe"
    cases = "\n".join(f"  {ns}) s={sock} ;;" for ns, sock in sockets.items())
    p.write_text(f'#!/bin/sh\nh="$1"; shift\ncase "$h" in\n{cases}\nesac\n'
                 f'exec ip netns exec "$h" env VNETD_SOCKET="$s" sh -c "$*"\n')
    p.chmod(0o755)
    return p


def netpipe(lab: Lab, agent: Path, a: str, b: str, subnet: str, max_bytes: int, out: Path,
            wrap: list[str] = (), env: list[str] = ()) -> dict:
    cmd = [*(["env", *env] if env else []), "mpirun", "--allow-run-as-root", "-H", f"{a},{b}", "-np", "2",
           "--bind-to", "none", "--mca", "rtc_hwloc_vmhole", "none",  # see tests/test_vtoe.py
           "--mca", "plm_rsh_agent", str(agent), "--mca", "oob_tcp_if_include", subnet,
           "--mca", "pml", "ob1", "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", subnet,
           *wrap, "NPopenmpi", "-u", str(max_bytes), "-o", str(out)]
    r = lab.x(a, *cmd, check=False, timeout=600)
    if r.returncode != 0 or not out.exists():
        return {"error": (r.stdout + r.stderr)[-800:]}
    rows = []
    for line in out.read_text().splitlines():
        f = line.split()
        if len(f) >= 3:
            rows.append((int(float(f[0])), float(f[1]), float(f[2])))  # bytes, Mbit/s, seconds (one way)
    small = min((r for r in rows if r[0] >= 8), key=lambda r: r[0])
    big = max(rows, key=lambda r: r[0])
    return {"lat8_us": small[2] * 1e6, "lat_bytes": small[0], "bw_mbps": big[1], "bw_bytes": big[0], "rows": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-bytes", type=int, default=1 << 20)
    ap.add_argument("--pings", type=int, default=3000)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/mpi.py: run as root")
    results: dict[str, list[dict]] = {t: [] for t in ("native", "vxlan", "vnet-kernel", "vnet-vtoe", "vnet-user")}
    pings: dict[str, dict] = {}
    with Lab("mpi") as lab:
        h = {i: lab.add_host(i) for i in (1, 2)}
        for i in (1, 2):
            lab.x(h[i], "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
        # VXLAN guests x1, x2 (198.19.1.0/24).
        x = {}
        for i, o in ((1, 2), (2, 1)):
            x[i] = lab.guest_ns(f"x{i}")
            m = 1500 - VXLAN_OVERHEAD
            lab.x(h[i], "ip", "link", "add", "vx42", "type", "vxlan", "id", "42", "dstport", "4789",
                  "remote", underlay_ip(o), "local", underlay_ip(i), "dev", "eth0")
            lab.x(h[i], "ip", "link", "set", "vx42", "mtu", m)
            lab.x(h[i], "ip", "link", "add", "br0", "type", "bridge")
            subprocess.run(["ip", "link", "add", "vxg", "netns", h[i], "mtu", str(m), "type", "veth",
                            "peer", "name", "eth0", "netns", x[i], "mtu", str(m)], check=True)
            for dev in ("vx42", "vxg"):
                lab.x(h[i], "ip", "link", "set", dev, "master", "br0")
            for dev in ("vx42", "vxg", "br0"):
                lab.x(h[i], "ip", "link", "set", dev, "up")
            lab.x(x[i], "ip", "addr", "add", f"198.19.1.{i}/24", "dev", "eth0")
            lab.x(x[i], "ip", "link", "set", "eth0", "up")
        # VNET: veth guests k1, k2 (overlay_ip 11, 12) and TAP guests g1, g2.
        k = {i: lab.guest_ns(f"k{i}") for i in (1, 2)}
        gm = 1500 - VNET_OVERHEAD
        by_host = {i: [(f"g{i}", guest_mac(i)), (f"k{i}", guest_mac(10 + i))] for i in (1, 2)}
        attach = {f"k{i}": f"netns {k[i]} veth" for i in (1, 2)}
        vtoe_sock = {i: lab.tmp / f"vtoe-h{i}.sock" for i in (1, 2)}
        daemons = {i: lab.start_vnetd(h[i], mesh_config(i, by_host, mtu=gm, attach=attach, link="9000 udp vtoe lab"),
                                      "--vtoe-socket", vtoe_sock[i]) for i in (1, 2)}
        g = {i: lab.attach_guest(h[i], f"g{i}", i, mtu=gm) for i in (1, 2)}
        kg = {i: lab.veth_guest(h[i], f"k{i}", 10 + i, k[i]) for i in (1, 2)}
        pairs = {
            "native": (h[1], h[2], "198.18.0.0/24"),
            "vxlan": (x[1], x[2], "198.19.1.0/24"),
            "vnet-kernel": (k[1], k[2], "198.19.0.0/24"),
            "vnet-vtoe": (k[1], k[2], "198.19.0.0/24"),
            "vnet-user": (g[1].ns, g[2].ns, "198.19.0.0/24"),
        }
        server_ip = {"native": underlay_ip(2), "vxlan": "198.19.1.2", "vnet-kernel": overlay_ip(12),
                     "vnet-user": overlay_ip(2)}
        # Each pair must see only its own partner on the subnet: the TAP and
        # veth guests share 198.19.0.0/24, which is fine (one NIC each).
        agent = agent_script(lab.tmp)
        vtoe_agent = vtoe_agent_script(lab.tmp, {k[i]: vtoe_sock[i] for i in (1, 2)})
        vtoe = [str(BIN / "vtoe")]
        for r in range(args.repeats):
            for t, (a, b, subnet) in pairs.items():
                out = lab.tmp / f"np-{t}-{r}.out"
                if t == "vnet-vtoe":
                    res = netpipe(lab, vtoe_agent, a, b, subnet, args.max_bytes, out, wrap=vtoe,
                                  env=[f"VNETD_SOCKET={vtoe_sock[1]}"])
                else:
                    res = netpipe(lab, agent, a, b, subnet, args.max_bytes, out)
                res["repeat"] = r
                results[t].append(res)
                if "error" in res:
                    print(f"[{r + 1}/{args.repeats}] {t:12s} error: {res['error'][-300:]}", flush=True)
                else:
                    print(f"[{r + 1}/{args.repeats}] {t:12s} latency {res['lat_bytes']} B {res['lat8_us']:8.1f} us"
                          f"   bandwidth {res['bw_bytes']} B {res['bw_mbps']:8.1f} Mbit/s", flush=True)
        # What VTOE did: every rank connection offloaded, or vnet-vtoe's numbers are not VTOE's.
        vtoe_counts = {}
        for i in (1, 2):
            line = daemons[i].ctl("STATS", "vtoe").stdout.splitlines()[0]
            vtoe_counts[f"h{i}"] = {k: v for k, v in (w.split("=", 1) for w in line.split()[1:])
                                   if k in ("offers", "offloaded_out", "offloaded_in") or k.startswith("fallback_")}
        print(f"vtoe: {vtoe_counts}", flush=True)
        # Steadiness: many small pings, one transport after another.
        for t, (a, _, _) in pairs.items():
            if t == "vnet-vtoe":
                continue
            out = lab.x(a, "ping", "-n", "-c", str(args.pings), "-i", "0.003", "-W", "1", server_ip[t],
                        check=False, timeout=args.pings * 0.01 + 60).stdout
            rtts = sorted(float(v) * 1000 for v in re.findall(r"time=([\d.]+) ms", out))
            if rtts:
                q = lambda p: rtts[min(len(rtts) - 1, int(p * len(rtts)))]  # noqa: E731
                pings[t] = {"n": len(rtts), "sent": args.pings, "p50": q(0.5), "p99": q(0.99), "max": rtts[-1]}
                print(f"pings {t:12s} n={len(rtts)}/{args.pings} p50 {q(0.5):.0f} us p99 {q(0.99):.0f} us "
                      f"max {rtts[-1]:.0f} us", flush=True)
    summary = {}
    for t, rs in results.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            continue
        lat = sorted(r["lat8_us"] for r in ok)
        bw = sorted(r["bw_mbps"] for r in ok)
        summary[t] = {"lat": (lat[0], statistics.median(lat), lat[-1]), "bw": (bw[0], statistics.median(bw), bw[-1])}
    lines = ["| transport | 8 B latency µs (min/median/max) | × native | × vxlan | 1 MiB Mbit/s (min/median/max) | × native | × vxlan |",
             "|---|---|---:|---:|---|---:|---:|"]
    for t, s in summary.items():
        def ratio(key, ref):
            return f"{s[key][1] / summary[ref][key][1]:.2f}" if ref in summary else "-"
        lines.append(f"| {t} | {s['lat'][0]:.1f} / {s['lat'][1]:.1f} / {s['lat'][2]:.1f} | {ratio('lat', 'native')} | "
                     f"{ratio('lat', 'vxlan')} | {s['bw'][0]:.0f} / {s['bw'][1]:.0f} / {s['bw'][2]:.0f} | "
                     f"{ratio('bw', 'native')} | {ratio('bw', 'vxlan')} |")
    lines += ["", f"Pings ({args.pings} × 64 B, 3 ms apart): RTT in µs.", "",
              "| transport | received | p50 | p99 | max | p99 × native p99 |", "|---|---:|---:|---:|---:|---:|"]
    for t, p in pings.items():
        r = f"{p['p99'] / pings['native']['p99']:.2f}" if "native" in pings else "-"
        lines.append(f"| {t} | {p['n']}/{p['sent']} | {p['p50']:.0f} | {p['p99']:.0f} | {p['max']:.0f} | {r} |")
    table = "\n".join(lines)
    print("\n" + table)
    stamp = dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    res_dir = BENCH / "results"
    (res_dir / f"{stamp}-apps.json").write_text(json.dumps({"args": vars(args), "results": results, "pings": pings,
                                                           "vtoe": vtoe_counts}, indent=1))
    (res_dir / f"{stamp}-apps.md").write_text(
        f"# Applications over each transport, {stamp}\n\nCommand: `sudo python3 bench/apps.py "
        f"--repeats {args.repeats} --max-bytes {args.max_bytes} --pings {args.pings}`\n\n"
        f"OpenMPI ping-pong (NetPIPE NPopenmpi, TCP BTL, --bind-to none, no pinning: ranks and vnetd share "
        f"the 2 CPUs). One-way latency at the smallest size ≥ 8 B; bandwidth at the largest size. vnet-vtoe: "
        f"the ranks under vtoe; what VTOE did over the run (STATS vtoe): {vtoe_counts}\n\n{table}\n")
    print(f"\nresults: bench/results/{stamp}-apps.md")


if __name__ == "__main__":
    main()
