#!/usr/bin/env python3
"""VNET control-plane scale benchmark: as many hosts as this machine holds,
each a vnetd and a vnet-agent in its own namespace, with one real etcd.

    python3 bench/scale.py [--hosts 10,25,50] [--guests 2] [--repeats 3]

For each size H: H hosts, each with G guests (TAP interfaces; guest k of
every host is in network n<k>, so each network has a member on every host).
Measured, for each repeat:

  bring-up   from starting the agents until every host routes every guest
             of its networks
  add        a new guest's INTERFACE ADD on host 1 until every host routes it
  migrate    the guest deleted on host 1 and added on host 2, until every
             host routes it to host 2 (and none to host 1)
  etcd       requests etcd served per change (gRPC calls, from its /metrics,
             over the add and the migration, background keep-alives and the
             agents' own counters aside), and watch events it sent
  agents     each agent's CPU (user+system milliseconds per minute of the run)
             and resident memory; vnetd's memory

Writes bench/results/<date>-scale.md and .json. A benchmark: prints figures
and fails only when the testbed cannot be built.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent / "tests"))
from netlab import BIN, Lab, UnixSession, underlay_ip  # noqa: E402

AGENT = BIN / "vnet-agent"
ETCD = 100  # the etcd host's number on the LAN


def mac(host: int, k: int) -> str:
    return "02:5c:00:%02x:%02x:%02x" % (host >> 8, host & 255, k)


def cpu_s(pid: int) -> float:
    """CPU time of every thread of the process, in seconds (schedstat: ns)."""
    return sum(int((t / "schedstat").read_text().split()[0]) for t in Path(f"/proc/{pid}/task").iterdir()) / 1e9


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def calls(before: dict, after: dict) -> dict[str, float]:
    d = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    return {k: v for k, v in d.items() if v}


class World:
    def __init__(self, lab: Lab, hosts: int, guests: int):
        self.lab, self.n, self.g = lab, hosts, guests
        self.etcd_ns = lab.add_host(ETCD)
        self.url = f"http://{underlay_ip(ETCD)}:2379"
        self.etcd = lab.popen(
            self.etcd_ns, "etcd", "--name", "s", "--data-dir", lab.tmp / "etcd",
            "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
            "--listen-peer-urls", f"http://{underlay_ip(ETCD)}:2380",
            "--initial-advertise-peer-urls", f"http://{underlay_ip(ETCD)}:2380",
            "--initial-cluster", f"s=http://{underlay_ip(ETCD)}:2380",
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 30
        while True:
            try:
                self.metrics()
                break
            except Exception:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)
        self.hosts = {i: lab.add_host(i) for i in range(1, hosts + 1)}
        self.d = {}
        self.sess = {}
        for i, h in self.hosts.items():
            conf = "".join(f"INTERFACE ADD s{k} {mac(i, k)} network n{k}\n" for k in range(guests))
            self.d[i] = lab.start_vnetd(h, conf, "--dispatchers", "1")
            self.sess[i] = UnixSession(self.d[i].sock)
        self.agents = {}

    def metrics(self) -> dict[str, float]:
        # etcd's /metrics is in its namespace: fetch it from there.
        out = self.lab.x(self.etcd_ns, "python3", "-c",
                         f"import urllib.request;print(urllib.request.urlopen('{self.url}/metrics',timeout=5).read().decode())").stdout
        res: dict[str, float] = {}
        for line in out.splitlines():
            m = re.match(r'grpc_server_handled_total\{.*grpc_method="(\w+)".*\} (\S+)', line)
            if m:
                res[m.group(1)] = res.get(m.group(1), 0) + float(m.group(2))
            elif line.startswith("etcd_debugging_mvcc_events_total "):
                res["watch_events"] = float(line.split()[1])
        return res

    def start_agents(self):
        for i, h in self.hosts.items():
            log = open(self.lab.tmp / f"agent-{i}.log", "w")
            self.agents[i] = self.lab.popen(
                h, AGENT, "run", "--etcd", self.url, "--host", f"h{i}", "--underlay", underlay_ip(i),
                "--socket", self.d[i].sock, "--ttl", 10, "--interval-ms", 200, "--traffic-s", 0,
                stdout=log, stderr=subprocess.STDOUT)

    def routes(self, i: int) -> list[str]:
        status, lines = self.sess[i].request("ROUTE LIST\n")
        assert status.startswith("OK"), status
        return lines

    def wait(self, cond, timeout=120.0, step=0.02) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if cond():
                return time.monotonic() - t0
            time.sleep(step)
        raise RuntimeError("timed out")

    def everyone_routes(self, m: str, via: str | None, skip: int | None = None) -> bool:
        """Every host but `skip` has m's unicast route to link `via`."""
        for i in self.hosts:
            if i == skip:
                continue
            rs = [r for r in self.routes(i) if f" {m} edge " in r]
            if not rs or (via and not all(f"edge {via} " in r for r in rs)):
                return False
        return True

    def all_converged(self) -> bool:
        want = (self.n - 1) * self.g  # each host routes each remote guest of its networks
        for i in self.hosts:
            remote = {r.split()[3] for r in self.routes(i) if " edge agent." in r and r.split()[2] != "ff:ff:ff:ff:ff:ff"}
            if len(remote) < want:
                return False
        return True

    def ctl(self, i: int, line: str):
        status, _ = self.sess[i].request(line + "\n")
        assert status.startswith("OK"), f"{line}: {status}"


def run_size(hosts: int, guests: int) -> dict:
    with Lab("scale") as lab:
        w = World(lab, hosts, guests)
        t0 = time.monotonic()
        w.start_agents()
        bring_up = w.wait(w.all_converged, timeout=300)
        time.sleep(1.0)
        res = {"hosts": hosts, "guests_per_host": guests, "bring_up_s": bring_up}
        routes_per_host = [len(w.routes(i)) for i in w.hosts]
        res["routes_per_host"] = statistics.median(routes_per_host)

        m = mac(0xFFF, 1)
        # Baseline: what etcd serves in the background over a while (keep-alives, passes).
        b0 = w.metrics()
        time.sleep(3.0)
        b1 = w.metrics()
        bg = {k: v / 3.0 for k, v in calls(b0, b1).items()}
        # Add.
        m0 = w.metrics()
        ta = time.monotonic()
        w.ctl(1, f"INTERFACE ADD new0 {m} network n0")
        res["add_s"] = w.wait(lambda: w.everyone_routes(m, "agent.h1", skip=1))
        m1 = w.metrics()
        dt_add = time.monotonic() - ta
        # Migrate: delete on host 1, add on host 2.
        tm = time.monotonic()
        w.ctl(1, "INTERFACE DEL new0")
        w.ctl(2, f"INTERFACE ADD new0 {m} network n0")
        res["migrate_s"] = w.wait(lambda: w.everyone_routes(m, "agent.h2", skip=2))
        m2 = w.metrics()
        dt_mig = time.monotonic() - tm
        minus_bg = lambda d, secs: {k: round(v - bg.get(k, 0) * secs, 1) for k, v in d.items()}
        res["etcd_add"] = minus_bg(calls(m0, m1), dt_add)
        res["etcd_migrate"] = minus_bg(calls(m1, m2), dt_mig)
        res["etcd_background_per_s"] = {k: round(v, 1) for k, v in bg.items()}
        elapsed = time.monotonic() - t0
        cpu = [cpu_s(p.pid) for p in w.agents.values()]
        res["agent_cpu_ms_per_min"] = [x * 1000 * 60 / elapsed for x in cpu]
        res["agent_rss_mb"] = [rss_mb(p.pid) for p in w.agents.values()]
        res["vnetd_rss_mb"] = [rss_mb(d.proc.pid) for d in w.d.values()]
        for p in w.agents.values():
            p.terminate()
            p.wait(timeout=10)
        for s in w.sess.values():
            s.close()
        w.etcd.terminate()
        w.etcd.wait(timeout=10)
        return res


def mmm(xs):
    return min(xs), statistics.median(xs), max(xs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", default="10,25,50")
    ap.add_argument("--guests", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(BENCH / "results"))
    a = ap.parse_args()
    if shutil.which("etcd") is None:
        sys.exit("scale: etcd not installed (scripts/setup)")
    sizes = [int(x) for x in a.hosts.split(",")]
    runs: dict[int, list[dict]] = {n: [] for n in sizes}
    for r in range(a.repeats):
        for n in sizes:
            res = run_size(n, a.guests)
            runs[n].append(res)
            print(f"repeat {r + 1}, {n} hosts: bring-up {res['bring_up_s']:.2f} s, add {res['add_s'] * 1000:.0f} ms, "
                  f"migrate {res['migrate_s'] * 1000:.0f} ms, routes/host {res['routes_per_host']}, "
                  f"agent cpu {statistics.median(res['agent_cpu_ms_per_min']):.0f} ms/min, "
                  f"rss {statistics.median(res['agent_rss_mb']):.1f} MB", flush=True)
    stamp = dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = "python3 bench/scale.py " + " ".join(sys.argv[1:])
    (out / f"{stamp}-scale.json").write_text(json.dumps({"command": cmd, "runs": runs}, indent=1))
    f = lambda t: " / ".join(f"{x:.0f}" for x in t)
    f2 = lambda t: " / ".join(f"{x:.2f}" for x in t)
    md = [f"# Control-plane scale benchmark, {stamp}", "",
          f"Command: `{cmd}` (kernel {os.uname().release}, {os.cpu_count()} CPUs; every host, agent and etcd on "
          f"this one machine). min / median / max over {a.repeats} runs; per-agent figures over all agents of all runs.", "",
          "| hosts | routes per host | bring-up (s) | add: every host routes it (ms) | migration followed (ms) | "
          "etcd calls per add | per migration | watch events per add | agent CPU (ms per minute) | agent RSS (MB) | vnetd RSS (MB) |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in sizes:
        rs = runs[n]
        unary = lambda d: sum(v for k, v in d.items() if k not in ("watch_events", "LeaseKeepAlive", "Watch"))
        md.append(
            f"| {n} | {statistics.median(x['routes_per_host'] for x in rs):.0f} | {f2(mmm([x['bring_up_s'] for x in rs]))} | "
            f"{f(mmm([x['add_s'] * 1000 for x in rs]))} | {f(mmm([x['migrate_s'] * 1000 for x in rs]))} | "
            f"{f(mmm([unary(x['etcd_add']) for x in rs]))} | {f(mmm([unary(x['etcd_migrate']) for x in rs]))} | "
            f"{f(mmm([x['etcd_add'].get('watch_events', 0) for x in rs]))} | "
            f"{f(mmm([c for x in rs for c in x['agent_cpu_ms_per_min']]))} | "
            f"{f2(mmm([c for x in rs for c in x['agent_rss_mb']]))} | {f2(mmm([c for x in rs for c in x['vnetd_rss_mb']]))} |")
    md += ["", "etcd calls: gRPC requests etcd handled during the change (Range, Txn, Put...), less its background "
           "rate (lease keep-alives, measured for 3 s before); the JSON has them by method."]
    text = "\n".join(md) + "\n"
    (out / f"{stamp}-scale.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
