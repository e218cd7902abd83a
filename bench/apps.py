#!/usr/bin/env python3
"""The papers' application evaluation, re-made on VNET: what an MPI job gets
from each transport, in one interleaved run, between guests on two hosts.

Transports (every one that exists):

  native       the two host namespaces, over their veth (no overlay)
  vxlan        the kernel's VXLAN + bridge, guests in namespaces
  vnet-user    TAP guests, vnetd's user-level datapath (its default settings)
  vnet-kernel  veth guests, VNET's kernel fast path (vnetd as slow path)
  vnet-vtoe    the same veth guests, the MPI ranks under `vtoe`: their TCP
               connections carried whole by shadow connections (VTOE)

Measurements, as vnetp-cluster-computing-2013 (figures 10-13) and the VNET/P+
and VTOE papers made them, with the programs Debian ships:

  MPI ping-pong   NetPIPE's NPopenmpi, 1 B to 4 MiB: one-way latency and
                  bandwidth against message size (the papers used Intel's IMB
                  PingPong, which Debian does not ship; NetPIPE times the same
                  blocking send/receive ping-pong)
  HPCC            Debian's hpcc with 2 ranks (one per host; --ranks 4: two per
                  host): PingPong and ring latency/bandwidth, MPIRandomAccess
                  (GUP/s), MPIFFT (Gflop/s)
  pings           --pings 64-byte pings 3 ms apart: p50/p99/max (VNET/P+ fig. 6)

Ranks reach each other only over the transport under test: OpenMPI's TCP BTL
on the transport's subnet (pml ob1, btl tcp,self: no shared memory), the
out-of-band channel too; `--bind-to none` (2 CPUs, shared by ranks and
daemons, as a user's job would). OpenMPI starts the far rank through `ip
netns exec` (no ssh).

    sudo python3 bench/apps.py                    # about 15 minutes
    sudo python3 bench/apps.py --repeats 5 --ranks 4
    sudo python3 bench/apps.py --smoke            # one short ping-pong over VNET (the test suite's)

Writes bench/results/<date>-apps.{json,md} and PNG plots shaped like the
papers' figures (-apps-latency.png, -apps-bandwidth.png, -apps-hpcc.png). A
benchmark, never a pass/fail test: it prints min/median/max over the repeats
and ratios to native and to VXLAN.
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
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent / "tests"))
from netlab import BIN, Lab, guest_mac, mesh_config, mpi_agent, overlay_ip, underlay_ip, wait_until  # noqa: E402

VXLAN_OVERHEAD = 50
VNET_OVERHEAD = 42
TRANSPORTS = ["native", "vxlan", "vnet-user", "vnet-kernel", "vnet-vtoe"]
# Sizes the tables show (the plots show every size NetPIPE measured).
LAT_SIZES = [1, 8, 1024, 65536]
BW_SIZES = [65536, 1 << 20, 4 << 20]
# HPCC summary keys: (key, label, unit, higher is better).
HPCC_KEYS = [
    ("AvgPingPongLatency_usec", "PingPong latency", "µs", False),
    ("AvgPingPongBandwidth_GBytes", "PingPong bandwidth", "GB/s", True),
    ("NaturallyOrderedRingLatency_usec", "ring latency (natural)", "µs", False),
    ("NaturallyOrderedRingBandwidth_GBytes", "ring bandwidth (natural)", "GB/s", True),
    ("RandomlyOrderedRingLatency_usec", "ring latency (random)", "µs", False),
    ("RandomlyOrderedRingBandwidth_GBytes", "ring bandwidth (random)", "GB/s", True),
    ("MPIRandomAccess_GUPs", "MPIRandomAccess", "GUP/s", True),
    ("MPIFFT_Gflops", "MPIFFT", "Gflop/s", True),
]


class Pair:
    """Two guests (or hosts) and how MPI runs between them."""

    def __init__(self, a: str, b: str, subnet: str, ping_ip: str | None, agent: Path, wrap=(), env=()):
        self.a, self.b, self.subnet, self.ping_ip = a, b, subnet, ping_ip
        self.agent, self.wrap, self.env = agent, list(wrap), list(env)

    def mpirun(self, lab: Lab, ranks: int, prog: list[str], wdir: Path, timeout: int):
        per = ranks // 2
        cmd = [*(["env", *self.env] if self.env else []), "mpirun", "--allow-run-as-root",
               "-H", f"{self.a}:{per},{self.b}:{per}", "-np", str(ranks), "--map-by", "node",
               "--bind-to", "none", "--mca", "rtc_hwloc_vmhole", "none",  # see tests/test_vtoe.py
               "--mca", "plm_rsh_agent", str(self.agent), "--mca", "oob_tcp_if_include", self.subnet,
               "--mca", "pml", "ob1", "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", self.subnet,
               "-wdir", str(wdir), *self.wrap, *prog]
        return lab.x(self.a, *cmd, check=False, timeout=timeout)


def netpipe(lab: Lab, pair: Pair, max_bytes: int, out: Path, exact: bool = False) -> dict:
    """NetPIPE's ping-pong from 1 B to max_bytes: {size: (one-way µs, Mbit/s)}.
    `exact`: only its sizes, without the ±3-byte neighbours it adds to each
    (a third of the time)."""
    perturb = ["-p", "0"] if exact else []
    r = pair.mpirun(lab, 2, ["NPopenmpi", "-l", "1", "-u", str(max_bytes), *perturb, "-o", str(out)], out.parent, 900)
    if r.returncode != 0 or not out.exists():
        return {"error": (r.stdout + r.stderr)[-800:]}
    rows = {}
    for line in out.read_text().splitlines():
        f = line.split()
        if len(f) >= 3:
            size = int(float(f[0]))
            rows[size] = (float(f[2]) * 1e6, float(f[1]))  # NetPIPE: bytes, Mbit/s, seconds one way
    return {"rows": rows}


HPCC_INPUT = """HPLinpack benchmark input file
Innovative Computing Laboratory, University of Tennessee
HPL.out      output file name (if any)
8            device out (6=stdout,7=stderr,file)
1            # of problems sizes (N)
{n}         Ns
1            # of NBs
80           NBs
0            PMAP process mapping (0=Row-,1=Column-major)
1            # of process grids (P x Q)
{p}            Ps
{q}            Qs
16.0         threshold
1            # of panel fact
2            PFACTs (0=left, 1=Crout, 2=Right)
1            # of recursive stopping criterium
4            NBMINs (>= 1)
1            # of panels in recursion
2            NDIVs
1            # of recursive panel fact.
1            RFACTs (0=left, 1=Crout, 2=Right)
1            # of broadcast
1            BCASTs (0=1rg,1=1rM,2=2rg,3=2rM,4=Lng,5=LnM)
1            # of lookahead depth
1            DEPTHs (>=0)
2            SWAP (0=bin-exch,1=long,2=mix)
64           swapping threshold
0            L1 in (0=transposed,1=no-transposed) form
0            U  in (0=transposed,1=no-transposed) form
1            Equilibration (0=no,1=yes)
8            memory alignment in double (> 0)
##### This line (no. 32) is ignored (it serves as a separator). ######
0                      		Number of additional problem sizes for PTRANS
1200 10000 30000        	values of N
0                       	number of additional blocking sizes for PTRANS
40 9 8 13 13 20 16 32 64       	values of NB
"""


def hpcc(lab: Lab, pair: Pair, ranks: int, n: int, wdir: Path) -> dict:
    """One HPCC run: its summary's keys (HPCC_KEYS), or the error."""
    wdir.mkdir(parents=True, exist_ok=True)
    (wdir / "hpccinf.txt").write_text(HPCC_INPUT.format(n=n, p=1, q=ranks))
    r = pair.mpirun(lab, ranks, ["hpcc"], wdir, 900)
    out = wdir / "hpccoutf.txt"
    if r.returncode != 0 or not out.exists():
        return {"error": (r.stdout + r.stderr)[-800:]}
    text = out.read_text(errors="replace")
    summary = text.split("Begin of Summary section.", 1)[-1]
    vals = dict(re.findall(r"^(\w+)=(\S+)$", summary, re.M))
    got = {}
    for key, *_ in HPCC_KEYS:
        try:
            got[key] = float(vals[key])
        except (KeyError, ValueError):
            pass
    if len(got) < len(HPCC_KEYS):
        return {"error": f"summary without {[k for k, *_ in HPCC_KEYS if k not in got]}"}
    return got


def pings(lab: Lab, pair: Pair, count: int) -> dict | None:
    out = lab.x(pair.a, "ping", "-n", "-c", str(count), "-i", "0.003", "-W", "1", pair.ping_ip,
                check=False, timeout=count * 0.01 + 60).stdout
    rtts = sorted(float(v) * 1000 for v in re.findall(r"time=([\d.]+) ms", out))
    if not rtts:
        return None
    q = lambda p: rtts[min(len(rtts) - 1, int(p * len(rtts)))]  # noqa: E731
    return {"n": len(rtts), "sent": count, "p50": q(0.5), "p99": q(0.99), "max": rtts[-1]}


def build(lab: Lab, with_vxlan=True, with_tap=True) -> tuple[dict[str, Pair], dict]:
    """Two hosts and every transport's pair of endpoints."""
    h = {i: lab.add_host(i) for i in (1, 2)}
    for i in (1, 2):
        lab.x(h[i], "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
    agent = mpi_agent(lab.tmp)
    pairs = {"native": Pair(h[1], h[2], "198.18.0.0/24", underlay_ip(2), agent)}
    if with_vxlan:
        # VXLAN guests x1, x2 (198.19.1.0/24), each behind its host's bridge.
        x = {}
        m = 1500 - VXLAN_OVERHEAD
        for i, o in ((1, 2), (2, 1)):
            x[i] = lab.guest_ns(f"x{i}")
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
        pairs["vxlan"] = Pair(x[1], x[2], "198.19.1.0/24", "198.19.1.2", agent)
    # VNET: veth guests k1, k2 (overlay_ip 11, 12) and TAP guests g1, g2
    # (overlay_ip 1, 2), one vnetd per host offering VTOE.
    k = {i: lab.guest_ns(f"k{i}") for i in (1, 2)}
    gm = 1500 - VNET_OVERHEAD
    by_host = {i: [(f"k{i}", guest_mac(10 + i))] + ([(f"g{i}", guest_mac(i))] if with_tap else []) for i in (1, 2)}
    attach = {f"k{i}": f"netns {k[i]} veth" for i in (1, 2)}
    vtoe_sock = {i: lab.tmp / f"vtoe-h{i}.sock" for i in (1, 2)}
    daemons = {i: lab.start_vnetd(h[i], mesh_config(i, by_host, mtu=gm, attach=attach, link="9000 udp vtoe lab"),
                                  "--vtoe-socket", vtoe_sock[i]) for i in (1, 2)}
    kg = {i: lab.veth_guest(h[i], f"k{i}", 10 + i, k[i]) for i in (1, 2)}
    if with_tap:
        g = {i: lab.attach_guest(h[i], f"g{i}", i, mtu=gm) for i in (1, 2)}
        pairs["vnet-user"] = Pair(g[1].ns, g[2].ns, "198.19.0.0/24", overlay_ip(2), agent)
    pairs["vnet-kernel"] = Pair(kg[1].ns, kg[2].ns, "198.19.0.0/24", overlay_ip(12), agent)
    vtoe_agent = mpi_agent(lab.tmp, {k[i]: vtoe_sock[i] for i in (1, 2)})
    # ICMP is not TCP: vnet-vtoe's pings would be vnet-kernel's, so none.
    pairs["vnet-vtoe"] = Pair(k[1], k[2], "198.19.0.0/24", None, vtoe_agent,
                              wrap=[str(BIN / "vtoe")], env=[f"VNETD_SOCKET={vtoe_sock[1]}"])
    # MPI's daemons give up on a peer they cannot reach at once: each pair
    # answers a ping first (a loaded machine attaches a guest later).
    for name, pair in pairs.items():
        if pair.ping_ip and not wait_until(lambda: lab.x(pair.a, "ping", "-n", "-c", "1", "-W", "1", pair.ping_ip,
                                                         check=False).returncode == 0, timeout=30, interval=0.2):
            raise RuntimeError(f"{name}: {pair.a} cannot ping {pair.ping_ip} after 30 s")
    return pairs, daemons


def mmm(vals):
    v = sorted(vals)
    return (v[0], statistics.median(v), v[-1]) if v else None


def size_label(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1024 else f"{n} B"


def summarize(results: dict) -> dict:
    """Per transport: ping-pong latency/bandwidth per size and HPCC per key,
    each (min, median, max) over the repeats."""
    out = {}
    for t, r in results.items():
        pp = [x["rows"] for x in r["pingpong"] if "rows" in x]
        sizes = sorted(set.intersection(*(set(p) for p in pp))) if pp else []
        hp = [x for x in r["hpcc"] if "error" not in x]
        out[t] = {
            "lat": {s: mmm([p[s][0] for p in pp]) for s in sizes},
            "bw": {s: mmm([p[s][1] for p in pp]) for s in sizes},
            "hpcc": {k: mmm([x[k] for x in hp]) for k, *_ in HPCC_KEYS} if hp else {},
            "runs": (len(pp), len(r["pingpong"]), len(hp), len(r["hpcc"])),
        }
    return out


def ratio(s, t, ref, get):
    a, b = get(s.get(t, {})), get(s.get(ref, {}))
    return f"{a[1] / b[1]:.2f}" if a and b and b[1] else "-"


def tables(s: dict, ping: dict, hpcc_ranks: int) -> str:
    lines = []

    def row3(v, d):
        return " / ".join(f"{x:.{d}f}" for x in v) if v else "—"

    def by_size(title, key, sizes, d):
        out = ["", f"### MPI ping-pong: {title} (min / median / max; × native, × vxlan)", "",
               "| transport | " + " | ".join(size_label(n) for n in sizes) + " |", "|---|" + "---|" * len(sizes)]
        for t in s:
            cells = []
            for n in sizes:
                v = s[t][key].get(n)
                g = lambda x, n=n: x.get(key, {}).get(n)  # noqa: E731
                cells.append(f"{row3(v, d)} ({ratio(s, t, 'native', g)}, {ratio(s, t, 'vxlan', g)})" if v else "—")
            out.append(f"| {t} | " + " | ".join(cells) + " |")
        return out

    lines += by_size("one-way latency, µs", "lat", LAT_SIZES, 1)[1:]
    lines += by_size("bandwidth, Mbit/s", "bw", BW_SIZES, 0)
    lines += ["", f"### HPCC, {hpcc_ranks} ranks (min / median / max; × native, × vxlan; ↑ higher or ↓ lower is better)", "",
              "| transport | " + " | ".join(f"{lab} {unit} {'↑' if up else '↓'}" for _, lab, unit, up in HPCC_KEYS) + " |",
              "|---|" + "---|" * len(HPCC_KEYS)]
    for t in s:
        cells = []
        for key, _, unit, _ in HPCC_KEYS:
            v = s[t]["hpcc"].get(key)
            g = lambda x, key=key: x.get("hpcc", {}).get(key)  # noqa: E731
            d = 4 if unit in ("GB/s", "GUP/s") else 2 if unit == "Gflop/s" else 1
            cells.append(f"{row3(v, d)} ({ratio(s, t, 'native', g)}, {ratio(s, t, 'vxlan', g)})" if v else "—")
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    if ping:
        lines += ["", "### Pings: 64 B, 3 ms apart, RTT µs", "",
                  "| transport | received | p50 | p99 | max | p99 × native |", "|---|---:|---:|---:|---:|---:|"]
        for t, p in ping.items():
            r = f"{p['p99'] / ping['native']['p99']:.2f}" if "native" in ping else "-"
            lines.append(f"| {t} | {p['n']}/{p['sent']} | {p['p50']:.0f} | {p['p99']:.0f} | {p['max']:.0f} | {r} |")
    return "\n".join(lines)


def plots(s: dict, stamp: str, res_dir: Path) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (bench/setup installs it): no plots")
        return []
    made = []
    style = {"native": "k-", "vxlan": "C1--", "vnet-user": "C2:", "vnet-kernel": "C0-", "vnet-vtoe": "C3-."}
    for key, ylabel, fname, logy in (("lat", "one-way latency (µs)", "latency", True),
                                     ("bw", "bandwidth (Mbit/s)", "bandwidth", False)):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for t, v in s.items():
            pts = sorted(v[key].items())
            if pts:
                ax.plot([p[0] for p in pts], [p[1][1] for p in pts], style.get(t, "-"), label=t, linewidth=1.5)
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"MPI ping-pong (NetPIPE, OpenMPI TCP BTL), medians — {stamp}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        name = f"{stamp}-apps-{fname}.png"
        fig.tight_layout()
        fig.savefig(res_dir / name, dpi=110)
        plt.close(fig)
        made.append(name)
    if "native" in s and s["native"]["hpcc"]:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        ts = [t for t in s if s[t]["hpcc"]]
        width = 0.8 / len(ts)
        for j, t in enumerate(ts):
            rel = []
            for key, _, _, up in HPCC_KEYS:
                a, b = s[t]["hpcc"].get(key), s["native"]["hpcc"].get(key)
                # Performance relative to native: >1 is better, for latencies too.
                rel.append((a[1] / b[1] if up else b[1] / a[1]) if a and b and a[1] and b[1] else 0)
            ax.bar([i + j * width for i in range(len(HPCC_KEYS))], rel, width, label=t)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(HPCC_KEYS))])
        ax.set_xticklabels([lab for _, lab, _, _ in HPCC_KEYS], rotation=25, ha="right", fontsize=8)
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_ylabel("performance relative to native")
        ax.set_title(f"HPCC, medians (latencies inverted: higher is better) — {stamp}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        name = f"{stamp}-apps-hpcc.png"
        fig.savefig(res_dir / name, dpi=110)
        plt.close(fig)
        made.append(name)
    return made


def smoke() -> int:
    """One MPI ping-pong over VNET's kernel fast path, a few sizes: the
    recipe, checked (tests/test_apps.py runs it)."""
    with Lab("mps") as lab:
        pairs, _ = build(lab, with_vxlan=False, with_tap=False)
        out = lab.tmp / "np-smoke.out"
        res = netpipe(lab, pairs["vnet-kernel"], 65536, out, exact=True)
    if "error" in res:
        print(f"smoke: ping-pong failed: {res['error']}")
        return 1
    for size, (lat, bw) in sorted(res["rows"].items()):
        if size in (1, 8, 1024, 65536):
            print(f"smoke: {size:6d} B  {lat:8.1f} us  {bw:9.1f} Mbit/s")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-bytes", type=int, default=4 << 20)
    ap.add_argument("--ranks", type=int, default=2, choices=(2, 4), help="HPCC ranks (half on each host)")
    ap.add_argument("--hpcc-n", type=int, default=2000, help="HPL's N, which sizes HPCC's other tests too")
    ap.add_argument("--pings", type=int, default=1000)
    ap.add_argument("--transports", default=",".join(TRANSPORTS))
    ap.add_argument("--smoke", action="store_true", help="one short ping-pong over VNET, nothing written")
    ap.add_argument("--no-setup", action="store_true", help="skip bench/setup (installs OpenMPI, NetPIPE, HPCC, matplotlib)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/apps.py: run as root")
    if args.smoke:
        sys.exit(smoke())
    if not args.no_setup:
        subprocess.run([BENCH / "setup"], check=True)
    wanted = [t for t in args.transports.split(",") if t]
    if unknown := set(wanted) - set(TRANSPORTS):
        sys.exit(f"bench/apps.py: unknown transports {sorted(unknown)} (have {TRANSPORTS})")
    started = dt.datetime.now()
    stamp = started.strftime("%Y-%m-%d-%H%M%S")
    results = {t: {"pingpong": [], "hpcc": []} for t in wanted}
    ping = {}
    with Lab("app") as lab:
        pairs, daemons = build(lab)
        for r in range(args.repeats):
            for t in wanted:
                p = pairs[t]
                out = lab.tmp / f"np-{t}-{r}.out"
                pp = netpipe(lab, p, args.max_bytes, out)
                results[t]["pingpong"].append(pp)
                hp = hpcc(lab, p, args.ranks, args.hpcc_n, lab.tmp / f"hpcc-{t}-{r}")
                results[t]["hpcc"].append(hp)
                if "error" in pp or "error" in hp:
                    print(f"[{r + 1}/{args.repeats}] {t:12s} error: {(pp.get('error') or hp.get('error'))[-300:]}", flush=True)
                    continue
                rows = pp["rows"]
                print(f"[{r + 1}/{args.repeats}] {t:12s} ping-pong 1 B {rows[1][0]:7.1f} us  4 MiB "
                      f"{rows[max(rows)][1]:8.0f} Mbit/s | HPCC pp {hp['AvgPingPongLatency_usec']:6.1f} us "
                      f"{hp['AvgPingPongBandwidth_GBytes']:.3f} GB/s  RA {hp['MPIRandomAccess_GUPs']:.5f} GUP/s  "
                      f"FFT {hp['MPIFFT_Gflops']:.3f} Gflop/s", flush=True)
        # What VTOE did: every rank connection offloaded, or vnet-vtoe's numbers are not VTOE's.
        vtoe_counts = {}
        for i in (1, 2):
            line = daemons[i].ctl("STATS", "vtoe").stdout.splitlines()[0]
            vtoe_counts[f"h{i}"] = {k: v for k, v in (w.split("=", 1) for w in line.split()[1:])
                                   if k in ("offers", "offloaded_out", "offloaded_in") or k.startswith("fallback_")}
        print(f"vtoe: {vtoe_counts}", flush=True)
        for t in wanted:
            if pairs[t].ping_ip and args.pings:
                if (pr := pings(lab, pairs[t], args.pings)) is not None:
                    ping[t] = pr
                    print(f"pings {t:12s} n={pr['n']}/{pr['sent']} p50 {pr['p50']:.0f} us p99 {pr['p99']:.0f} us "
                          f"max {pr['max']:.0f} us", flush=True)
    minutes = (dt.datetime.now() - started).total_seconds() / 60
    s = summarize(results)
    table = tables(s, ping, args.ranks)
    print("\n" + table)
    res_dir = BENCH / "results"
    made = plots(s, stamp, res_dir)
    cmd = (f"sudo python3 bench/apps.py --repeats {args.repeats} --max-bytes {args.max_bytes} --ranks {args.ranks} "
           f"--hpcc-n {args.hpcc_n} --pings {args.pings} --transports {','.join(wanted)}")
    missing = [t for t in TRANSPORTS if t not in wanted]
    (res_dir / f"{stamp}-apps.json").write_text(json.dumps(
        {"command": cmd, "minutes": minutes, "args": vars(args), "vtoe": vtoe_counts, "pings": ping,
         "results": {t: {"pingpong": [{"rows": {str(k): v for k, v in x["rows"].items()}} if "rows" in x else x
                                      for x in r["pingpong"]], "hpcc": r["hpcc"]} for t, r in results.items()}},
        indent=1))
    runs = ", ".join(f"{t} {v['runs'][0]}/{v['runs'][1]} ping-pong, {v['runs'][2]}/{v['runs'][3]} HPCC" for t, v in s.items())
    (res_dir / f"{stamp}-apps.md").write_text(
        f"# The papers' application benchmarks on VNET, {stamp}\n\n"
        f"Command: `{cmd}` ({minutes:.1f} minutes). Two hosts (network namespaces joined by a veth pair "
        f"through a bridge, underlay MTU 1500; guest MTU vxlan 1450, vnet 1458) on a 2-vCPU VM; "
        f"transports interleaved within each repeat; {args.repeats} repeats. Runs that completed: {runs}."
        + (f" Not measured: {', '.join(missing)}." if missing else "") + "\n\n"
        f"MPI ping-pong: NetPIPE NPopenmpi from 1 B to {size_label(args.max_bytes)} (OpenMPI, TCP BTL, "
        f"`--bind-to none`, no CPU pinning: ranks and vnetd share the 2 CPUs). HPCC: Debian's hpcc, "
        f"{args.ranks} ranks ({args.ranks // 2} per host), HPL N={args.hpcc_n} (which also sizes "
        f"RandomAccess and FFT). vnet-vtoe: the ranks under vtoe; what VTOE did (STATS vtoe): {vtoe_counts}\n\n"
        + "".join(f"![{m}]({m})\n\n" for m in made) + table + "\n")
    print(f"\nresults: bench/results/{stamp}-apps.md ({minutes:.1f} minutes)")


if __name__ == "__main__":
    main()
