#!/usr/bin/env python3
"""VNET control-plane scale benchmark: as many hosts as this machine holds,
each a vnetd and a vnet-agent in its own namespace, with a real etcd
cluster (3 members by default, each in its own namespace).

    python3 bench/scale.py [--hosts 10,25,50] [--guests 2] [--repeats 3] [--etcd-members 3]

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
  idle       10 s with nothing changing: etcd's requests a second by method
             (the lease keep-alives, and everything else), and each agent's
             CPU in percent of one core (agents run with their defaults)
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
ETCD = 250  # the first etcd member's host number on the LAN (the others follow; hosts are 1..249)


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
    def __init__(self, lab: Lab, hosts: int, guests: int, members: int = 3):
        self.lab, self.n, self.g = lab, hosts, guests
        ids = [ETCD + k for k in range(members)]
        self.etcd_nss = [lab.add_host(m) for m in ids]
        self.etcd_ns = self.etcd_nss[0]
        self.urls = [f"http://{underlay_ip(m)}:2379" for m in ids]
        self.url = ",".join(self.urls)
        peers = ",".join(f"m{m}=http://{underlay_ip(m)}:2380" for m in ids)
        self.etcds = [lab.popen(
            ns, "etcd", "--name", f"m{m}", "--data-dir", lab.tmp / f"etcd-{m}",
            "--listen-client-urls", url, "--advertise-client-urls", url,
            "--listen-peer-urls", f"http://{underlay_ip(m)}:2380",
            "--initial-advertise-peer-urls", f"http://{underlay_ip(m)}:2380",
            "--initial-cluster", peers,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for ns, m, url in zip(self.etcd_nss, ids, self.urls)]
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
        """gRPC requests handled, by method, summed over the members; watch
        events sent (the members' own counts summed)."""
        res: dict[str, float] = {}
        for ns, url in zip(self.etcd_nss, self.urls):
            # Each member's /metrics is in its namespace: fetched from there.
            out = self.lab.x(ns, "python3", "-c",
                             f"import urllib.request;print(urllib.request.urlopen('{url}/metrics',timeout=5).read().decode())").stdout
            for line in out.splitlines():
                m = re.match(r'grpc_server_handled_total\{.*grpc_method="(\w+)".*\} (\S+)', line)
                k = re.match(r'grpc_server_msg_received_total\{.*grpc_method="LeaseKeepAlive".*\} (\S+)', line)
                if m:
                    res[m.group(1)] = res.get(m.group(1), 0) + float(m.group(2))
                elif k:
                    # A keep-alive is a message on a stream, not a request.
                    res["keepalive_msgs"] = res.get("keepalive_msgs", 0) + float(k.group(1))
                elif line.startswith("etcd_debugging_mvcc_events_total "):
                    res["watch_events"] = res.get("watch_events", 0) + float(line.split()[1])
        return res

    def start_agents(self):
        for i, h in self.hosts.items():
            log = open(self.lab.tmp / f"agent-{i}.log", "w")
            self.agents[i] = self.lab.popen(
                h, AGENT, "run", "--etcd", self.url, "--host", f"h{i}", "--underlay", underlay_ip(i),
                "--socket", self.d[i].sock, "--ttl", 10,
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


IDLE = 10.0


def run_size(hosts: int, guests: int, members: int) -> dict:
    with Lab("scale") as lab:
        w = World(lab, hosts, guests, members)
        t0 = time.monotonic()
        w.start_agents()
        bring_up = w.wait(w.all_converged, timeout=300)
        time.sleep(1.0)
        res = {"hosts": hosts, "guests_per_host": guests, "bring_up_s": bring_up}
        routes_per_host = [len(w.routes(i)) for i in w.hosts]
        res["routes_per_host"] = statistics.median(routes_per_host)

        m = mac(0xFFF, 1)
        # Idle: nothing changes for IDLE seconds. What etcd serves (the
        # baseline the changes are measured against) and what each agent
        # spends.
        time.sleep(2.0)
        b0 = w.metrics()
        c0 = [cpu_s(p.pid) for p in w.agents.values()]
        time.sleep(IDLE)
        c1 = [cpu_s(p.pid) for p in w.agents.values()]
        b1 = w.metrics()
        bg = {k: v / IDLE for k, v in calls(b0, b1).items()}
        res["idle_agent_cpu_pct"] = [(b - a) / IDLE * 100 for a, b in zip(c0, c1)]
        res["idle_keepalives_per_s"] = round(bg.get("keepalive_msgs", 0), 1)
        res["idle_other_per_s"] = round(sum(v for k, v in bg.items() if k not in ("LeaseKeepAlive", "keepalive_msgs", "watch_events")), 2)
        res["idle_watch_events_per_s"] = round(bg.get("watch_events", 0), 1)
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
        for e in w.etcds:
            e.terminate()
            e.wait(timeout=10)
        return res


def mmm(xs):
    return min(xs), statistics.median(xs), max(xs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", default="10,25,50")
    ap.add_argument("--guests", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--etcd-members", type=int, default=3)
    ap.add_argument("--out", default=str(BENCH / "results"))
    a = ap.parse_args()
    if shutil.which("etcd") is None:
        sys.exit("scale: etcd not installed (scripts/setup)")
    sizes = [int(x) for x in a.hosts.split(",")]
    runs: dict[int, list[dict]] = {n: [] for n in sizes}
    for r in range(a.repeats):
        for n in sizes:
            res = run_size(n, a.guests, a.etcd_members)
            runs[n].append(res)
            print(f"repeat {r + 1}, {n} hosts: bring-up {res['bring_up_s']:.2f} s, add {res['add_s'] * 1000:.0f} ms, "
                  f"migrate {res['migrate_s'] * 1000:.0f} ms, routes/host {res['routes_per_host']}, "
                  f"agent cpu {statistics.median(res['agent_cpu_ms_per_min']):.0f} ms/min, "
                  f"rss {statistics.median(res['agent_rss_mb']):.1f} MB; idle: etcd {res['idle_keepalives_per_s']} keep-alives/s "
                  f"and {res['idle_other_per_s']} other requests/s, agent CPU {statistics.median(res['idle_agent_cpu_pct']):.3f} % "
                  f"of a core (max {max(res['idle_agent_cpu_pct']):.3f})", flush=True)
    stamp = dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = "python3 bench/scale.py " + " ".join(sys.argv[1:])
    (out / f"{stamp}-scale.json").write_text(json.dumps({"command": cmd, "runs": runs}, indent=1))
    f = lambda t: " / ".join(f"{x:.0f}" for x in t)
    f2 = lambda t: " / ".join(f"{x:.2f}" for x in t)
    md = [f"# Control-plane scale benchmark, {stamp}", "",
          f"Command: `{cmd}` (kernel {os.uname().release}, {os.cpu_count()} CPUs; every host, agent and etcd on "
          f"this one machine; etcd: {a.etcd_members} member(s)). min / median / max over {a.repeats} runs; per-agent figures over all agents of all runs.", "",
          "| hosts | routes per host | bring-up (s) | add: every host routes it (ms) | migration followed (ms) | "
          "etcd calls per add | per migration | watch events per add | agent CPU (ms per minute) | agent RSS (MB) | vnetd RSS (MB) | "
          "idle: etcd keep-alives/s | idle: other etcd requests/s | idle: agent CPU (% of a core) |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in sizes:
        rs = runs[n]
        unary = lambda d: sum(v for k, v in d.items() if k not in ("watch_events", "LeaseKeepAlive", "keepalive_msgs", "Watch"))
        md.append(
            f"| {n} | {statistics.median(x['routes_per_host'] for x in rs):.0f} | {f2(mmm([x['bring_up_s'] for x in rs]))} | "
            f"{f(mmm([x['add_s'] * 1000 for x in rs]))} | {f(mmm([x['migrate_s'] * 1000 for x in rs]))} | "
            f"{f(mmm([unary(x['etcd_add']) for x in rs]))} | {f(mmm([unary(x['etcd_migrate']) for x in rs]))} | "
            f"{f(mmm([x['etcd_add'].get('watch_events', 0) for x in rs]))} | "
            f"{f(mmm([c for x in rs for c in x['agent_cpu_ms_per_min']]))} | "
            f"{f2(mmm([c for x in rs for c in x['agent_rss_mb']]))} | {f2(mmm([c for x in rs for c in x['vnetd_rss_mb']]))} | "
            f"{f2(mmm([x['idle_keepalives_per_s'] for x in rs]))} | {f2(mmm([x['idle_other_per_s'] for x in rs]))} | "
            f"{' / '.join(f'{v:.3f}' for v in mmm([c for x in rs for c in x['idle_agent_cpu_pct']]))} |")
    md += ["", "etcd calls: gRPC requests etcd handled during the change (Range, Txn, Put...), less its background "
           "rate (lease keep-alives, measured over the idle 10 s before); the JSON has them by method. Idle: nothing changing for 10 s after bring-up; the agents run with their defaults (a full pass on vnetd's or etcd's report of a change, a 1-s interface poll, a 60-s full pass, traffic written only when it moved)."]
    text = "\n".join(md) + "\n"
    (out / f"{stamp}-scale.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
