#!/usr/bin/env python3
"""This build's links against another build's (default: the previous
commit's, scripts/build-previous), alternated build by build in one run, as
issue 42 asks of the link refactor ("speed unchanged: within ±3 %"):

  vm-vm        a VM's frames to the other host's VM, 1500 B: bench/vhost.py's
               `vhost-vm` row (testpmd's virtio-user port on a vhost-user
               interface of host 1, rx_sink.py's virtio driver on host 2,
               9000-byte underlay), Mpps the receiving driver took
  wireguard    guest → guest TCP (iperf3) over vnetd's WireGuard link, TAP guests
  tcp          the same over a TCP link
  vxlan        the same over a VXLAN link between two vnetds
  udp-user     the same over VNET/P's UDP link, `SET datapath user` (the
               plaintext user path every TAP guest's frame takes)
  to-container a VM's stream into a container: guest → guest TCP over the
               UDP link from a host whose vnetd cuts the guest's super-
               frames into segments (`SET datapath user`, as for a VM) to a
               veth guest on a host with the kernel fast path, which cuts
               each train round its finishing pair and hands the segments
               to the guest's kernel to merge (GRO)

and, in the same labs, with no vnetd, the anchors the ratios need: `native`
(host → host TCP on the underlay) and `kernel-vxlan` (guest → guest through
the Linux kernel's own VXLAN and a bridge on each host). Every workload runs
each rep for each build, in alternating order (old, new; then new, old),
each on a fresh lab. Prints min / median / max per build, new ÷ old, and
each overlay's ratio to native and to the kernel's VXLAN; writes
bench/results/<date>-links-ab.{json,md}. A benchmark, never a pass/fail test.

    sudo python3 bench/links_ab.py [--base <commit>] [--reps 5] [--seconds 4] [--workloads ...]
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "tools"))
from netlab import Lab, guest_mac, mesh_config, overlay_ip, underlay_ip, veth_mesh  # noqa: E402
from test_wireguard import GUEST_MTU as WG_MTU, public_key, wg_config  # noqa: E402

OVERLAYS = ["vm-vm", "wireguard", "tcp", "vxlan", "udp-user", "to-container"]
ANCHORS = ["native", "kernel-vxlan"]
# Guest MTUs: each link's largest frame on a 1500-byte underlay, less 14.
MTU = {"udp-user": 1458, "tcp": 1446, "vxlan": 1450, "wireguard": WG_MTU}
LINK = {"udp-user": "9000 udp", "tcp": "9000 tcp key lab", "vxlan": "vxlan vni 42"}


def load_vhost():
    spec = importlib.util.spec_from_file_location("vhost_bench", BENCH / "vhost.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def iperf(lab: Lab, server_ns: str, client_ns: str, ip: str, seconds: float) -> float:
    srv = lab.popen(server_ns, "iperf3", "-s", "-1", stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        out = lab.x(client_ns, "iperf3", "-c", ip, "-t", f"{seconds:g}", "--json", timeout=seconds + 60).stdout
    finally:
        srv.wait(timeout=30)
    return json.loads(out)["end"]["sum_received"]["bits_per_second"] / 1e9


def guests_over(lab: Lab, kind: str, binary: Path | None):
    """Two hosts with vnetd (`binary`) and a TAP guest each, joined by a
    link of `kind`; the guests."""
    hosts = {h: lab.add_host(h) for h in (1, 2)}
    if kind == "wireguard":
        d = {h: lab.start_vnetd(hosts[h], f"INTERFACE ADD g{h} {guest_mac(h)} mtu {WG_MTU}\n",
                                "--wireguard-key-file", lab.tmp / f"h{h}.wgkey", binary=binary) for h in (1, 2)}
        keys = {h: public_key(d[h]) for h in (1, 2)}
        for h, p in ((1, 2), (2, 1)):
            d[h].ctl_file(wg_config(h, {p: keys[p]}, {1: [1], 2: [2]}))
    else:
        layout = {1: [("g1", guest_mac(1))], 2: [("g2", guest_mac(2))]}
        d = {h: lab.start_vnetd(hosts[h], mesh_config(h, layout, mtu=MTU[kind], link=LINK[kind]), binary=binary)
             for h in (1, 2)}
    for x in d.values():
        x.ctl("SET", "datapath", "user")
    g = {h: lab.attach_guest(hosts[h], f"g{h}", h) for h in (1, 2)}
    assert lab.reaches(g[1], g[2], tries=10), kind
    return g


def kernel_vxlan(lab: Lab):
    """Two hosts, no vnetd: the kernel's VXLAN in a bridge with a veth guest
    on each (MTU 1450); the guests' namespaces and host 2's guest's IP."""
    ns = {}
    for h, peer in ((1, 2), (2, 1)):
        host = lab.add_host(h)
        lab.x(host, "ip", "link", "add", "vx0", "type", "vxlan", "id", "42", "dstport", "4789",
              "remote", underlay_ip(peer), "local", underlay_ip(h), "dev", "eth0")
        lab.x(host, "ip", "link", "add", "br0", "type", "bridge")
        x = lab.ns(f"x{h}")
        lab.x(x, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
        lab.x(host, "ip", "link", "add", "vg", "type", "veth", "peer", "name", "eth0", "netns", x)
        for dev in ("vx0", "vg"):
            lab.x(host, "ip", "link", "set", dev, "master", "br0", "mtu", "1450", "up")
        lab.x(host, "ip", "link", "set", "br0", "up")
        lab.x(x, "ip", "link", "set", "eth0", "mtu", "1450", "up")
        lab.x(x, "ip", "addr", "add", f"{overlay_ip(h)}/24", "dev", "eth0")
        ns[h] = x
    assert lab.x(ns[1], "ping", "-c", "1", "-W", "5", overlay_ip(2), check=False).returncode == 0
    return ns


def measure(workload: str, binary: Path | None, seconds: float, vhost) -> float | None:
    with Lab("lab") as lab:
        if workload == "vm-vm":
            b = vhost.Bench(lab, binary, 9000)
            pps = b.measure("vhost-vm", "1500", seconds)
            return None if pps is None else pps / 1e6
        if workload == "native":
            h = {i: lab.add_host(i) for i in (1, 2)}
            return iperf(lab, h[2], h[1], underlay_ip(2), seconds)
        if workload == "kernel-vxlan":
            ns = kernel_vxlan(lab)
            return iperf(lab, ns[2], ns[1], overlay_ip(2), seconds)
        if workload == "to-container":
            _, _, g = veth_mesh(lab, {1: [1], 2: [2]}, extra={1: "SET datapath user\n"}, binary=binary)
            assert lab.reaches(g[1], g[2], tries=10), workload
            return iperf(lab, g[2].ns, g[1].ns, g[2].ip, seconds)
        g = guests_over(lab, workload, binary)
        return iperf(lab, g[2].ns, g[1].ns, g[2].ip, seconds)


def build(commit: str) -> Path:
    out = subprocess.run([REPO / "scripts" / "build-previous", commit], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"cannot build {commit}:\n{out.stderr}")
    return Path(out.stdout.strip())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD~1", help="the other build's commit (default: the previous one)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=4)
    ap.add_argument("--workloads", default=",".join(OVERLAYS + ANCHORS))
    args = ap.parse_args()
    if shutil.which("dpdk-testpmd") is None:
        sys.exit("dpdk-testpmd not found: apt-get install dpdk-dev (scripts/setup does)")
    workloads = args.workloads.split(",")
    base = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", args.base], capture_output=True, text=True, check=True).stdout.strip()
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    # Changes to the code the builds are made of (not to docs or benches).
    dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no", "--", "crates", "Cargo.toml", "Cargo.lock"],
                           capture_output=True, text=True).stdout.strip()
    subprocess.run(["cargo", "build", "--release", "--quiet", "-p", "vnetd", "-p", "vnetctl"], cwd=REPO, check=True)
    # Both builds copied aside, so a rebuild during the run changes nothing.
    stamp = dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    new = REPO / "target" / "ab" / stamp
    new.mkdir(parents=True)
    for f in ("vnetd", "vnetctl"):
        shutil.copy2(REPO / "target" / "release" / f, new / f)
    builds = {"old": build(args.base), "new": new}
    vhost = load_vhost()
    points = []
    for rep in range(args.reps):
        for w in workloads:
            order = ["old", "new"] if rep % 2 == 0 else ["new", "old"]
            if w in ANCHORS:
                order = ["-"]
            for b in order:
                folder = builds.get(b)
                v = measure(w, folder / "vnetd" if folder else None, args.seconds, vhost)
                p = {"workload": w, "build": b, "rep": rep, "value": v}
                points.append(p)
                print(json.dumps(p), flush=True)

    def vals(w, b):
        return sorted(p["value"] for p in points if p["workload"] == w and p["build"] == b and p["value"] is not None)

    med = lambda w, b: statistics.median(vals(w, b)) if vals(w, b) else None  # noqa: E731
    cmd = f"sudo python3 bench/links_ab.py --base {args.base} --reps {args.reps} --seconds {args.seconds:g}"
    if workloads != OVERLAYS + ANCHORS:
        cmd += f" --workloads {','.join(workloads)}"
    lines = [f"# Links, this build against another's, {stamp}", "", f"`{cmd}`", "",
             f"old = {base}, new = {head}{' with uncommitted changes' if dirty else ''}; every workload on a fresh "
             "two-host lab, the builds alternating within each rep. `vm-vm` in Mpps (1500-byte frames), the rest "
             "guest → guest (or host → host) TCP in Gbit/s.", "",
             "| workload | old min / median / max | new min / median / max | new ÷ old | new ÷ native | new ÷ kernel VXLAN |",
             "|---|---|---|---|---|---|"]
    fmt = lambda xs: f"{xs[0]:.3f} / {statistics.median(xs):.3f} / {xs[-1]:.3f}" if xs else "-"  # noqa: E731
    nat, kvx = med("native", "-"), med("kernel-vxlan", "-")
    for w in workloads:
        if w in ANCHORS:
            lines.append(f"| {w} | - | {fmt(vals(w, '-'))} | - | - | - |")
            continue
        o, n = med(w, "old"), med(w, "new")
        r = lambda ref: f"{n / ref:.2f}" if n and ref and w != "vm-vm" else "-"  # noqa: E731
        lines.append(f"| {w} | {fmt(vals(w, 'old'))} | {fmt(vals(w, 'new'))} | "
                     f"{n / o:.3f} | {r(nat)} | {r(kvx)} |" if o and n else f"| {w} | failed | | | | |")
    if med("wireguard", "new") and med("udp-user", "new"):
        lines += ["", f"WireGuard ÷ the plaintext user path (new): {med('wireguard', 'new') / med('udp-user', 'new'):.2f}."]
    md = "\n".join(lines) + "\n"
    out = BENCH / "results" / f"{stamp}-links-ab"
    out.with_suffix(".json").write_text(json.dumps({"command": cmd, "old": base, "new": head, "points": points}, indent=1))
    out.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {out}.json and .md")


if __name__ == "__main__":
    main()
