#!/usr/bin/env python3
"""Where the time goes: one guest-to-guest iperf3 TCP run through vnetd on the
benchmark's two-host testbed (host 1 pinned to CPU 0, host 2 to CPU 1), with
`perf record -a` (cpu-clock) during it; prints native and VNET throughput and
the top symbols on each CPU.

  python3 bench/profile.py [--mtu 1500] [--mode adaptive] [--yield adaptive] [--seconds 3] [--top 25]
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from netlab import Lab, guest_mac, mesh_config, run  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--mode", default="adaptive")
    ap.add_argument("--yield", dest="yield_", default="adaptive")
    ap.add_argument("--seconds", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    if subprocess.run(["which", "perf"], capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "install", "-y", "-qq", "linux-perf"], check=True, capture_output=True)
    perf_data = Path(tempfile.mkdtemp()) / "vnet.perf"
    with Lab("prof") as lab:
        h1, h2 = lab.ns("h1"), lab.ns("h2")
        run(["ip", "link", "add", "eth0", "netns", h1, "mtu", a.mtu, "type", "veth",
             "peer", "name", "eth0", "netns", h2, "mtu", a.mtu])
        for i, h in ((1, h1), (2, h2)):
            lab.x(h, "ip", "addr", "add", f"198.18.0.{i}/24", "dev", "eth0")
            lab.x(h, "ip", "link", "set", "eth0", "up")
        layout = {1: [("g1", guest_mac(1))], 2: [("g2", guest_mac(2))]}
        daemons = {}
        for i, h in ((1, h1), (2, h2)):
            daemons[i] = lab.start_vnetd(h, mesh_config(i, layout, mtu=a.mtu - 42), "--cpus", str(i - 1))
            daemons[i].ctl("SET", "mode", a.mode)
            daemons[i].ctl("SET", "yield", a.yield_)
        g1, g2 = lab.attach_guest(h1, "g1", 1), lab.attach_guest(h2, "g2", 2)
        lab.ping(g1, g2)

        def iperf(client_ns, server_ns, ip, profile=False):
            srv = subprocess.Popen(["taskset", "-c", "1", "ip", "netns", "exec", server_ns, "iperf3", "-s", "-1"],
                                   stdout=subprocess.DEVNULL)
            time.sleep(0.3)
            prof = None
            if profile:
                prof = subprocess.Popen(["perf", "record", "-a", "-g", "-e", "cpu-clock", "-F", "1999",
                                         "-o", perf_data, "--", "sleep", str(max(1, a.seconds - 1))],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            out = run(["taskset", "-c", "0", "ip", "netns", "exec", client_ns, "iperf3", "-J", "-c", ip,
                       "-t", a.seconds], timeout=a.seconds + 30).stdout
            srv.wait(timeout=10)
            if prof:
                prof.wait()
            return json.loads(out)["end"]["sum_received"]["bits_per_second"] / 1e9

        print(f"native TCP {iperf(h1, h2, '198.18.0.2'):.2f} Gbit/s")
        print(f"vnet   TCP {iperf(g1.ns, g2.ns, g2.ip, profile=True):.2f} Gbit/s "
              f"(mode {a.mode}, yield {a.yield_}, underlay MTU {a.mtu})")
        for i, d in daemons.items():
            s = d.stats()
            print(f"host {i} offload: {s['offload']}")
    for cpu, role in ((0, "host 1: sender (iperf3 client, vnetd h1)"), (1, "host 2: receiver (vnetd h2, iperf3 server)")):
        print(f"\n== CPU {cpu}, {role}: top symbols by share of samples")
        rep = subprocess.run(["perf", "report", "-i", perf_data, "--cpu", str(cpu), "--no-children", "--sort",
                              "comm,sym", "--stdio", "-g", "none"], capture_output=True, text=True).stdout
        lines = [l for l in rep.splitlines() if "%" in l and not l.startswith("#")]
        print("\n".join(lines[:a.top]))


if __name__ == "__main__":
    main()
