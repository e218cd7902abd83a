#!/usr/bin/env python3
"""VNET control-plane scale benchmark: as many hosts as this machine holds,
each a vnetd and a vnet-agent in its own namespace, with a real etcd
cluster (3 members by default, each in its own namespace).

    python3 bench/scale.py [--hosts 10,25,50] [--guests 2] [--networks N] [--repeats 3]
                           [--etcd-members 3] [--changes 5]

For each size H: H hosts, each with G guests (TAP interfaces; guest k of
host i is in network n<(i*G + k) mod N>; N defaults to G, so that guest k of
every host is in network n<k> and each network has a member on every host;
with G=4 and N=20 each network has members on H/5 hosts). Measured, for
each repeat:

  bring-up   from starting the agents until every host routes every guest
             of its networks
  add        a new guest's INTERFACE ADD on host 1 until each host of its
             network routes it: each host's delay (a session per host
             blocked in vnetd's WAIT, the time taken as the commit that
             brought the route wakes it), --changes times
  migrate    the guest deleted on host 1 and added on host 2, until each
             host of its network routes it to host 2: each host's delay
  etcd       requests etcd served per change (gRPC calls, from its /metrics,
             over the add and the migration, background keep-alives and the
             agents' own counters aside), and watch events it sent
  idle       10 s with nothing changing: etcd's requests a second by method
             (the lease keep-alives, and everything else), and each agent's
             and vnetd's CPU in percent of one core (with their defaults)
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
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent / "tests"))
from netlab import BIN, Lab, UnixSession, underlay_ip  # noqa: E402

AGENT = BIN / "vnet-agent"
ETCD = 4001  # the first etcd member's host number on the LAN (the others follow; hosts are 1..4000)


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


def machine_cpu() -> dict[str, float]:
    """The machine's CPU seconds so far, by kind (/proc/stat)."""
    f = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, idle, iowait, irq, softirq = (int(x) / hz for x in f[:7])
    return {"user_s": user + nice, "system_s": system, "softirq_s": softirq + irq, "idle_s": idle + iowait}


def calls(before: dict, after: dict) -> dict[str, float]:
    d = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    return {k: v for k, v in d.items() if v}


def net_of(host: int, k: int, guests: int, networks: int) -> str:
    return f"n{(host * guests + k) % networks}"


class World:
    def __init__(self, lab: Lab, hosts: int, guests: int, members: int = 3, networks: int | None = None, ttl: int = 10,
                 etcd_dir: Path | None = None):
        self.lab, self.n, self.g, self.ttl = lab, hosts, guests, ttl
        etcd_dir = etcd_dir or lab.tmp
        self.nets = networks or guests
        ids = [ETCD + k for k in range(members)]
        self.etcd_nss = [lab.add_host(m) for m in ids]
        self.etcd_ns = self.etcd_nss[0]
        self.urls = [f"http://{underlay_ip(m)}:2379" for m in ids]
        self.url = ",".join(self.urls)
        peers = ",".join(f"m{m}=http://{underlay_ip(m)}:2380" for m in ids)
        self.etcd_cmds = [[
            "etcd", "--name", f"m{m}", "--data-dir", etcd_dir / f"etcd-{m}",
            "--listen-client-urls", url, "--advertise-client-urls", url,
            "--listen-peer-urls", f"http://{underlay_ip(m)}:2380",
            "--initial-advertise-peer-urls", f"http://{underlay_ip(m)}:2380",
            "--initial-cluster", peers] for m, url in zip(ids, self.urls)]
        self.etcds = [lab.popen(ns, *cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                      for ns, cmd in zip(self.etcd_nss, self.etcd_cmds)]
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
            conf = "".join(f"INTERFACE ADD s{k} {mac(i, k)} network {self.net(i, k)}\n" for k in range(guests))
            # The user datapath: TAP guests do not use the kernel fast path,
            # and 1,000 sets of its eBPF maps would take 20 GB.
            self.d[i] = lab.start_vnetd(h, conf, "--dispatchers", "1", "--no-fast-path")
            self.sess[i] = UnixSession(self.d[i].sock)
        self.agents = {}
        # Each network's members, by host.
        self.members: dict[str, dict[int, int]] = {}
        for i in self.hosts:
            for k in range(guests):
                m = self.members.setdefault(self.net(i, k), {})
                m[i] = m.get(i, 0) + 1
        self.converged: set[int] = set()

    def net(self, i: int, k: int) -> str:
        return net_of(i, k, self.g, self.nets)

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
                "--socket", self.d[i].sock, "--ttl", self.ttl,
                stdout=log, stderr=subprocess.STDOUT)

    def routes(self, i: int) -> list[str]:
        try:
            status, lines = self.sess[i].request("ROUTE LIST\n")
        except OSError:
            # vnetd ends a session idle past its bound (a long bring-up):
            # asked again on a new one.
            self.sess[i] = UnixSession(self.d[i].sock)
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
        """Every host routes each remote guest of its networks (hosts found
        so once are not asked again: at 1,000 hosts each asking is a
        listing of thousands of routes)."""
        for i in self.hosts:
            if i in self.converged:
                continue
            nets = {self.net(i, k) for k in range(self.g)}
            want = sum(c for n in nets for h, c in self.members[n].items() if h != i)
            remote = {r.split()[3] for r in self.routes(i) if " edge agent." in r and r.split()[2] != "ff:ff:ff:ff:ff:ff"}
            if len(remote) < want:
                return False
            self.converged.add(i)
        return True

    def delays(self, hosts: list[int], m: str, via: str, change) -> list[float]:
        """Runs `change()` and returns, for each of `hosts`, the seconds
        until it routes `m` by link `via`: a session per host blocks in
        vnetd's `WAIT` and the time is taken as the commit that brought the
        route wakes it (the check after it is not counted)."""
        ready = threading.Barrier(len(hosts) + 1)
        out: dict[int, float] = {}
        t0 = [0.0]

        def watch(i: int):
            s = UnixSession(self.d[i].sock)
            try:
                n = int(s.request("WAIT\n")[1][0].split()[1])
                ready.wait()
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    status, lines = s.request(f"WAIT {n} 5000\n")
                    t = time.monotonic()
                    n = int(lines[0].split()[1])
                    # Only the routes naming m: a host's whole table is
                    # thousands of lines, and 200 threads reading them
                    # would queue for the CPUs (and Python's lock) the
                    # hosts are measured on.
                    _, rs = s.request(f"ROUTE LIST {m}\n")
                    if any(f" {m} edge {via} " in r for r in rs):
                        out[i] = t - t0[0]
                        return
            finally:
                s.close()

        ts = [threading.Thread(target=watch, args=(i,), daemon=True) for i in hosts]
        for t in ts:
            t.start()
        ready.wait()
        t0[0] = time.monotonic()
        change()
        for t in ts:
            t.join(timeout=150)
        missing = [i for i in hosts if i not in out]
        if missing:
            raise RuntimeError(f"{len(missing)} hosts never routed {m} by {via} (hosts {missing[:10]}...)")
        return [out[i] for i in hosts]

    def etcd_status(self) -> dict[int, dict]:
        """Each live member's status (index in self.etcds -> etcdctl's
        endpoint status), asked from the first live member's namespace."""
        live = [k for k, p in enumerate(self.etcds) if p.poll() is None]
        eps = ",".join(self.urls[k] for k in live)
        out = self.lab.x(self.etcd_nss[live[0]], "env", "ETCDCTL_API=3", "etcdctl", "--endpoints", eps,
                         "--command-timeout", "3s", "endpoint", "status", "-w", "json", check=False).stdout
        return {self.urls.index(e["Endpoint"]): e["Status"] for e in json.loads(out or "[]")}

    def leader(self) -> int | None:
        for k, st in self.etcd_status().items():
            if st["leader"] == st["header"]["member_id"]:
                return k
        return None

    def restart_member(self, k: int):
        """Member k started again on its data (it rejoins as it left)."""
        self.etcds[k] = self.lab.popen(self.etcd_nss[k], *self.etcd_cmds[k], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def until_each(self, hosts: list[int], done, change, timeout=150.0) -> list[float]:
        """Runs `change()` and returns, for each of `hosts`, the seconds
        until `done(routes)` holds of its routes naming the guest (`done`
        gets host and routes): a session per host blocks in vnetd's WAIT,
        the time taken as the commit that made it so wakes it."""
        ready = threading.Barrier(len(hosts) + 1)
        out: dict[int, float] = {}
        t0 = [0.0]

        def watch(i: int):
            s = UnixSession(self.d[i].sock)
            try:
                n = int(s.request("WAIT\n")[1][0].split()[1])
                ready.wait()
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    status, lines = s.request(f"WAIT {n} 5000\n")
                    t = time.monotonic()
                    n = int(lines[0].split()[1])
                    if done(i, s):
                        out[i] = t - t0[0]
                        return
            finally:
                s.close()

        ts = [threading.Thread(target=watch, args=(i,), daemon=True) for i in hosts]
        for t in ts:
            t.start()
        ready.wait()
        t0[0] = time.monotonic()
        change()
        for t in ts:
            t.join(timeout=timeout + 30)
        missing = [i for i in hosts if i not in out]
        if missing:
            raise RuntimeError(f"{len(missing)} hosts never saw the change (hosts {missing[:10]}...)")
        return [out[i] for i in hosts]

    def ctl(self, i: int, line: str):
        try:
            status, _ = self.sess[i].request(line + "\n")
        except OSError:
            # vnetd ended the idle session: asked again on a new one.
            self.sess[i] = UnixSession(self.d[i].sock)
            status, _ = self.sess[i].request(line + "\n")
        assert status.startswith("OK"), f"{line}: {status}"


IDLE = 10.0


# The kernel's ARP table is one for all namespaces, 1,024 entries at most by
# default: 1,000 hosts' entries in the etcd members' namespaces overflow it
# ("neighbor table overflow", agents that cannot connect). Raised for the run
# (each real host has a table of its own), and put back after.
NEIGH_THRESH = {"gc_thresh1": 8192, "gc_thresh2": 32768, "gc_thresh3": 65536}


def run_size(hosts: int, guests: int, members: int, networks: int | None, changes: int, ttl: int = 10,
             failures: bool = False, churn_ms: int = 50, etcd_on_disk: bool = False) -> dict:
    sysctl = Path("/proc/sys/net/ipv4/neigh/default")
    # etcd's data in memory (tmpfs), unless asked: three members here share
    # this machine's one disk, where a sync takes 4 ms under the bring-up's
    # load (each member of a real cluster has a disk of its own).
    import tempfile
    etcd_dir = None if etcd_on_disk else Path(tempfile.mkdtemp(prefix="vnet-scale-etcd-", dir="/dev/shm"))
    before = {k: (sysctl / k).read_text() for k in NEIGH_THRESH}
    try:
        for k, v in NEIGH_THRESH.items():
            (sysctl / k).write_text(str(max(v, int(before[k]))))
        with Lab("scale") as lab:
            return measure(lab, hosts, guests, members, networks, changes, ttl, failures, churn_ms, etcd_dir)
    finally:
        if etcd_dir:
            shutil.rmtree(etcd_dir, ignore_errors=True)
        for k, v in before.items():
            (sysctl / k).write_text(v)


def measure(lab: Lab, hosts: int, guests: int, members: int, networks: int | None, changes: int, ttl: int = 10,
            failures: bool = False, churn_ms: int = 50, etcd_dir: Path | None = None) -> dict:
    """One run in `lab` (tests/test_scale.py runs a small one)."""
    w = World(lab, hosts, guests, members, networks, ttl, etcd_dir)
    cpu0 = machine_cpu()
    e0 = [cpu_s(p.pid) for p in w.etcds]
    v0 = sum(cpu_s(d.proc.pid) for d in w.d.values())
    t0 = time.monotonic()
    w.start_agents()
    # From the first agent's start (the rest start one after another: 1,000
    # take tens of seconds to spawn here, the first ones working meanwhile).
    spawned = time.monotonic() - t0
    w.wait(w.all_converged, timeout=1500, step=1.0)
    bring_up = time.monotonic() - t0
    # Where the bring-up's CPU went (a profile by process): the etcd
    # members, the agents, the vnetds, and the machine as a whole (user,
    # system, softirq: the kernel's share is the namespaces' networking).
    cpu1 = machine_cpu()
    bring_up_cpu = {"wall_s": round(bring_up, 1), "spawn_s": round(spawned, 1), "cpus": os.cpu_count(),
                    "etcd_s": round(sum(cpu_s(p.pid) for p in w.etcds) - sum(e0), 1),
                    "agents_s": round(sum(cpu_s(p.pid) for p in w.agents.values()), 1),
                    "vnetds_s": round(sum(cpu_s(d.proc.pid) for d in w.d.values()) - v0, 1),
                    **{k: round(cpu1[k] - cpu0[k], 1) for k in cpu0}}
    time.sleep(1.0)
    res = {"hosts": hosts, "guests_per_host": guests, "networks": w.nets, "bring_up_s": bring_up, "bring_up_cpu": bring_up_cpu}
    routes_per_host = [len(w.routes(i)) for i in w.hosts]
    res["routes_per_host"] = statistics.median(routes_per_host)

    # Idle: nothing changes for IDLE seconds. What etcd serves (the
    # baseline the changes are measured against) and what each agent
    # and vnetd spends.
    time.sleep(2.0)
    b0 = w.metrics()
    c0 = [cpu_s(p.pid) for p in w.agents.values()]
    v0 = [cpu_s(d.proc.pid) for d in w.d.values()]
    time.sleep(IDLE)
    c1 = [cpu_s(p.pid) for p in w.agents.values()]
    v1 = [cpu_s(d.proc.pid) for d in w.d.values()]
    b1 = w.metrics()
    bg = {k: v / IDLE for k, v in calls(b0, b1).items()}
    res["idle_agent_cpu_pct"] = [(b - a) / IDLE * 100 for a, b in zip(c0, c1)]
    res["idle_vnetd_cpu_pct"] = [(b - a) / IDLE * 100 for a, b in zip(v0, v1)]
    res["idle_keepalives_per_s"] = round(bg.get("keepalive_msgs", 0), 1)
    res["idle_other_per_s"] = round(sum(v for k, v in bg.items() if k not in ("LeaseKeepAlive", "keepalive_msgs", "watch_events")), 2)
    res["idle_watch_events_per_s"] = round(bg.get("watch_events", 0), 1)
    # Changes: a guest added on host 1 in the network of its guest 0,
    # then migrated to host 2 (a host of another network when there are
    # several: the guest is new there) and back, each host of the
    # network timed.
    net = w.net(1, 0)
    members = sorted(w.members[net])
    minus_bg = lambda d, secs: {k: round(v - bg.get(k, 0) * secs, 1) for k, v in d.items()}
    res["add_delays_s"], res["migrate_delays_s"], res["etcd_add"], res["etcd_migrate"] = [], [], [], []
    for c in range(changes):
        m = mac(0xF00 + c, 1)
        m0 = w.metrics()
        ta = time.monotonic()
        d = w.delays([i for i in members if i != 1], m, "agent.h1", lambda: w.ctl(1, f"INTERFACE ADD new{c} {m} network {net}"))
        res["add_delays_s"].append(d)
        m1 = w.metrics()
        res["etcd_add"].append(minus_bg(calls(m0, m1), time.monotonic() - ta))
        tm = time.monotonic()

        def migrate():
            w.ctl(1, f"INTERFACE DEL new{c}")
            w.ctl(2, f"INTERFACE ADD new{c} {m} network {net}")

        d = w.delays([i for i in members if i != 2], m, "agent.h2", migrate)
        res["migrate_delays_s"].append(d)
        m2 = w.metrics()
        res["etcd_migrate"].append(minus_bg(calls(m1, m2), time.monotonic() - tm))
        w.ctl(2, f"INTERFACE DEL new{c}")
        time.sleep(0.5)
    if failures:
        # Each phase's failure is recorded, not raised: the figures before
        # it are kept.
        for name, phase in (("churn", lambda: churn_with_leader_killed(w, churn_ms, churn_s=20.0, kill_after=5.0)),
                            ("member_down", lambda: member_down_a_minute(w, res["churn"]["killed"])),
                            ("host_killed", lambda: host_killed(w, max(w.hosts)))):
            try:
                res[name] = phase()
            except Exception as e:  # a benchmark reports what broke
                res[name] = {"error": f"{type(e).__name__}: {e}"}
                print(f"{name}: {e}", flush=True)
    keep = os.environ.get("VNET_SCALE_LOGS")
    if keep:
        # The agents' logs, for looking into a run (VNET_SCALE_LOGS=<dir>).
        Path(keep).mkdir(parents=True, exist_ok=True)
        for f in lab.tmp.glob("agent-*.log"):
            shutil.copy(f, Path(keep) / f.name)
    res["add_s"] = max(max(d) for d in res["add_delays_s"])
    res["migrate_s"] = max(max(d) for d in res["migrate_delays_s"])
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


def churn_with_leader_killed(w: World, churn_ms: int, churn_s: float, kill_after: float) -> dict:
    """Guests added, deleted and migrated across the overlay every
    `churn_ms` (each on a host of the guest's network), the etcd leader
    SIGKILLed `kill_after` seconds in. Each change is timed at one observer
    host of its network (a WAIT session, then `ROUTE LIST <mac>`); after
    the churn every host's routes are checked against what the changes
    left: no change lost, every host converged."""
    import random
    rnd = random.Random(44)
    nets = sorted(w.members)
    observer = {n: sorted(w.members[n])[len(w.members[n]) // 2] for n in nets}
    lock = threading.Lock()
    live: dict[str, tuple[int, str]] = {}  # churn guest -> (host, network)
    gone: set[str] = set()
    pending: dict[str, tuple[float, int | None, str]] = {}  # mac -> (when, host or None, network)
    seen: list[tuple[float, float]] = []  # (change time, delay)
    stop = threading.Event()

    def observe(n: str):
        o = observer[n]
        ws, q = UnixSession(w.d[o].sock), UnixSession(w.d[o].sock)
        count = int(ws.request("WAIT\n")[1][0].split()[1])
        while not stop.is_set():
            _, lines = ws.request(f"WAIT {count} 500\n")
            t = time.monotonic()
            count = int(lines[0].split()[1])
            with lock:
                mine = [(m, v) for m, v in pending.items() if v[2] == n]
            for m, (t0, h, _) in mine:
                rs = q.request(f"ROUTE LIST {m}\n")[1]
                ok = (not rs) if h is None else any(f"any {m} interface {m} edge" in r for r in rs) if h == o \
                    else any(f" {m} edge agent.h{h} " in r for r in rs)
                if ok:
                    with lock:
                        if pending.get(m, (None,))[0] == t0:
                            del pending[m]
                            seen.append((t0, t - t0))
        ws.close()
        q.close()

    obs = [threading.Thread(target=observe, args=(n,), daemon=True) for n in nets]
    for t in obs:
        t.start()
    time.sleep(1.0)
    t_start = time.monotonic()
    killed_at, killed = None, None
    ops = {"add": 0, "delete": 0, "migrate": 0}
    k = 0
    while time.monotonic() - t_start < churn_s:
        tick = time.monotonic()
        if killed_at is None and tick - t_start >= kill_after:
            killed = w.leader()
            w.etcds[killed].kill()
            w.etcds[killed].wait()
            killed_at = time.monotonic()
        with lock:
            settled = [m for m in live if m not in pending]
        op = rnd.choice(["add", "add", "delete", "migrate"]) if settled else "add"
        if op == "add":
            i = rnd.choice(list(w.hosts))
            n = w.net(i, rnd.randrange(w.g))
            m = mac(0xE00 + k // 250, 2 + k % 250)
            k += 1
            w.ctl(i, f"INTERFACE ADD c{m[-5:].replace(':', '')} {m} network {n}")
            with lock:
                live[m] = (i, n)
                pending[m] = (time.monotonic(), i, n)
        else:
            m = rnd.choice(settled)
            i, n = live[m]
            w.ctl(i, f"INTERFACE DEL c{m[-5:].replace(':', '')}")
            if op == "delete":
                with lock:
                    del live[m]
                    gone.add(m)
                    pending[m] = (time.monotonic(), None, n)
            else:
                j = rnd.choice([h for h in w.members[n] if h != i])
                w.ctl(j, f"INTERFACE ADD c{m[-5:].replace(':', '')} {m} network {n}")
                with lock:
                    live[m] = (j, n)
                    pending[m] = (time.monotonic(), j, n)
        ops[op] += 1
        time.sleep(max(0.0, churn_ms / 1000 - (time.monotonic() - tick)))
    churn_end = time.monotonic()
    deadline = churn_end + 60
    while time.monotonic() < deadline:
        with lock:
            if not pending:
                break
        time.sleep(0.2)
    stop.set()
    for t in obs:
        t.join(timeout=5)
    with lock:
        lost = len(pending)
        lost_macs = {m: ("deleted" if h is None else f"at h{h}") for m, (_, h, _) in pending.items()}
    # Every host: what the changes left.
    t_conv = time.monotonic()
    wrong: dict[int, str] = {}  # host -> the first guest it routes otherwise

    def host_ok(i: int) -> bool:
        rs = w.routes(i)
        nets_i = {w.net(i, kk) for kk in range(w.g)}
        for m, (h, n) in live.items():
            if n not in nets_i and h != i:
                if any(m in r for r in rs):
                    wrong[i] = m
                    return False
            elif h == i:
                if not any(f" any {m} interface {m} edge" in r for r in rs):
                    wrong[i] = m
                    return False
            elif not any(f" {m} edge agent.h{h} " in r for r in rs):
                wrong[i] = m
                return False
        for m in gone:
            if any(m in r for r in rs):
                wrong[i] = m
                return False
        wrong.pop(i, None)
        return True

    todo = set(w.hosts)
    while todo and time.monotonic() - t_conv < 120:
        todo = {i for i in todo if not host_ok(i)}
        if todo:
            time.sleep(1.0)
    # Which guests the hosts left behind route otherwise (MAC -> hosts).
    unconverged: dict[str, int] = {}
    for i in todo:
        unconverged[wrong.get(i, "?")] = unconverged.get(wrong.get(i, "?"), 0) + 1
    before = [d for t0, d in seen if killed_at is None or t0 < killed_at]
    during = [d for t0, d in seen if killed_at is not None and killed_at <= t0]
    return {"churn_ms": churn_ms, "churn_s": churn_s, "ops": ops, "changes": sum(ops.values()),
            "rate_per_s": round(sum(ops.values()) / (churn_end - t_start), 1),
            "killed_member": killed, "lost": lost, "lost_macs": lost_macs, "hosts_not_converged": len(todo),
            "not_converged_by_mac": unconverged,
            "converged_s_after_churn": round(time.monotonic() - churn_end, 2),
            "delays_before_kill_s": before, "delays_from_kill_s": during, "killed": killed}


def member_down_a_minute(w: World, member: int, down_s: float = 60.0) -> dict:
    """Member `member` (already killed) stays down `down_s`: guests added
    and deleted meanwhile are followed by every host of their network
    (timed); then it starts again on its data, and the time until it has
    caught up (its revision the leader's) and a change after is timed."""
    t_down = time.monotonic()
    net = w.net(1, 0)
    members = sorted(w.members[net])
    during = []
    c = 0
    while time.monotonic() - t_down < down_s - 10:
        m = mac(0xD00 + c, 1)
        d = w.delays([i for i in members if i != 1], m, "agent.h1", lambda: w.ctl(1, f"INTERFACE ADD down{c} {m} network {net}"))
        during.extend(d)
        w.ctl(1, f"INTERFACE DEL down{c}")
        c += 1
        time.sleep(8.0)
    time.sleep(max(0.0, down_s - (time.monotonic() - t_down)))
    t_back = time.monotonic()
    w.restart_member(member)
    caught = None
    while time.monotonic() - t_back < 120:
        st = w.etcd_status()
        if member in st and len(st) == len(w.etcds):
            revs = {k: v["header"]["revision"] for k, v in st.items()}
            if revs[member] == max(revs.values()):
                caught = time.monotonic() - t_back
                break
        time.sleep(0.2)
    m = mac(0xD80, 1)
    after = w.delays([i for i in members if i != 1], m, "agent.h1", lambda: w.ctl(1, f"INTERFACE ADD back0 {m} network {net}"))
    w.ctl(1, "INTERFACE DEL back0")
    return {"down_s": down_s, "adds_while_down": c, "delays_while_down_s": during, "caught_up_s": caught, "delays_after_s": after}


def host_killed(w: World, victim: int) -> dict:
    """Host `victim`'s vnetd and agent SIGKILLed: the time until each other
    host of its first guest's network no longer routes that guest (its
    lease runs out: between two thirds of --ttl and --ttl, then a pass)."""
    m = mac(victim, 0)
    net = w.net(victim, 0)
    hosts = [i for i in sorted(w.members[net]) if i != victim]

    def kill():
        w.agents[victim].kill()
        w.d[victim].proc.kill()

    d = w.until_each(hosts, lambda i, s: not s.request(f"ROUTE LIST {m}\n")[1], kill, timeout=w.ttl * 3 + 60)
    return {"victim": victim, "ttl_s": w.ttl, "withdrawn_s": d}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def mmm(xs):
    return min(xs), statistics.median(xs), max(xs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", default="10,25,50")
    ap.add_argument("--guests", type=int, default=2)
    ap.add_argument("--networks", type=int, default=None, help="networks (default: as many as guests per host)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--changes", type=int, default=5, help="guests added and migrated per run")
    ap.add_argument("--etcd-members", type=int, default=3)
    ap.add_argument("--ttl", type=int, default=10, help="the agents' lease (s): a host gone is withdrawn after it")
    ap.add_argument("--failures", action="store_true",
                    help="then: churn with the etcd leader killed, that member down a minute, a host killed")
    ap.add_argument("--churn-ms", type=int, default=50, help="a change every this many ms in the churn")
    ap.add_argument("--etcd-on-disk", action="store_true", help="etcd's data on disk, not tmpfs")
    ap.add_argument("--out", default=str(BENCH / "results"))
    ap.add_argument("--report", metavar="JSON", help="write the .md of a run's .json again (nothing is run)")
    a = ap.parse_args()
    if a.report:
        src = Path(a.report)
        saved = json.loads(src.read_text())
        runs = {int(n): rs for n, rs in saved["runs"].items()}
        a = ap.parse_args(saved["command"].split()[2:])
        report(a, sorted(runs), runs, src.with_suffix(".md"), saved["command"])
        return
    if shutil.which("etcd") is None:
        sys.exit("scale: etcd not installed (scripts/setup)")
    sizes = [int(x) for x in a.hosts.split(",")]
    runs: dict[int, list[dict]] = {n: [] for n in sizes}
    for r in range(a.repeats):
        for n in sizes:
            res = run_size(n, a.guests, a.etcd_members, a.networks, a.changes, a.ttl, a.failures, a.churn_ms, a.etcd_on_disk)
            runs[n].append(res)
            adds = [x for d in res["add_delays_s"] for x in d]
            migs = [x for d in res["migrate_delays_s"] for x in d]
            print(f"repeat {r + 1}, {n} hosts: bring-up {res['bring_up_s']:.2f} s, add p50/p99/max "
                  f"{pct(adds, .5) * 1000:.0f}/{pct(adds, .99) * 1000:.0f}/{max(adds) * 1000:.0f} ms, migrate "
                  f"{pct(migs, .5) * 1000:.0f}/{pct(migs, .99) * 1000:.0f}/{max(migs) * 1000:.0f} ms, routes/host {res['routes_per_host']}, "
                  f"agent cpu {statistics.median(res['agent_cpu_ms_per_min']):.0f} ms/min, "
                  f"rss {statistics.median(res['agent_rss_mb']):.1f} MB; idle: etcd {res['idle_keepalives_per_s']} keep-alives/s "
                  f"and {res['idle_other_per_s']} other requests/s, agent CPU {statistics.median(res['idle_agent_cpu_pct']):.3f} % "
                  f"of a core (max {max(res['idle_agent_cpu_pct']):.3f}), vnetd {statistics.median(res['idle_vnetd_cpu_pct']):.3f} %", flush=True)
    stamp = dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = "python3 bench/scale.py " + " ".join(sys.argv[1:])
    (out / f"{stamp}-scale.json").write_text(json.dumps({"command": cmd, "runs": runs}, indent=1))
    report(a, sizes, runs, out / f"{stamp}-scale.md", cmd)


def report(a, sizes: list[int], runs: dict[int, list[dict]], path: Path, cmd: str):
    stamp = path.name.removesuffix("-scale.md")
    f = lambda t: " / ".join(f"{x:.0f}" for x in t)
    f2 = lambda t: " / ".join(f"{x:.2f}" for x in t)
    f3 = lambda t: " / ".join(f"{x:.3f}" for x in t)
    md = [f"# Control-plane scale benchmark, {stamp}", "",
          f"Command: `{cmd}` (kernel {os.uname().release}, {os.cpu_count()} CPUs; every host, agent and etcd on "
          f"this one machine; etcd: {a.etcd_members} member(s)). min / median / max over {a.repeats} runs unless said; "
          f"per-agent and per-vnetd figures over all of them in all runs; delays over every host of the changed guest's "
          f"network, {a.changes} changes a run.", "",
          "| hosts | networks | routes per host | bring-up, from the first agent started (s) | add: a host routes it, p50 / p99 / max (ms) | "
          "migration followed, p50 / p99 / max (ms) | etcd calls per add | per migration | watch events per add | "
          "agent CPU (ms per minute) | agent RSS (MB) | vnetd RSS (MB) | "
          "idle: etcd keep-alives/s | idle: other etcd requests/s | idle: agent CPU (% of a core) | idle: vnetd CPU (% of a core) |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in sizes:
        rs = runs[n]
        unary = lambda d: sum(v for k, v in d.items() if k not in ("watch_events", "LeaseKeepAlive", "keepalive_msgs", "Watch"))
        adds = [x * 1000 for r in rs for d in r["add_delays_s"] for x in d]
        migs = [x * 1000 for r in rs for d in r["migrate_delays_s"] for x in d]
        md.append(
            f"| {n} | {rs[0]['networks']} | {statistics.median(x['routes_per_host'] for x in rs):.0f} | {f2(mmm([x['bring_up_s'] for x in rs]))} | "
            f"{f((pct(adds, .5), pct(adds, .99), max(adds)))} | {f((pct(migs, .5), pct(migs, .99), max(migs)))} | "
            f"{f(mmm([unary(e) for x in rs for e in x['etcd_add']]))} | {f(mmm([unary(e) for x in rs for e in x['etcd_migrate']]))} | "
            f"{f(mmm([e.get('watch_events', 0) for x in rs for e in x['etcd_add']]))} | "
            f"{f(mmm([c for x in rs for c in x['agent_cpu_ms_per_min']]))} | "
            f"{f2(mmm([c for x in rs for c in x['agent_rss_mb']]))} | {f2(mmm([c for x in rs for c in x['vnetd_rss_mb']]))} | "
            f"{f2(mmm([x['idle_keepalives_per_s'] for x in rs]))} | {f2(mmm([x['idle_other_per_s'] for x in rs]))} | "
            f"{f3(mmm([c for x in rs for c in x['idle_agent_cpu_pct']]))} | {f3(mmm([c for x in rs for c in x['idle_vnetd_cpu_pct']]))} |")
    md += ["", "etcd calls: gRPC requests etcd handled during the change (Range, Txn, Put...), less its background "
           "rate (lease keep-alives, measured over the idle 10 s before); the JSON has them by method. Idle: nothing changing "
           "for 10 s after bring-up; the agents run with their defaults (vnetd's tables read only when its change count moved, "
           f"reported by WAIT or seen at a 10-s count poll; keep-alives at a third of the lease, --ttl {a.ttl} s; a derive only for a change in the host's own networks; a 60-s full "
           "pass; traffic not written)."]
    for n in sizes:
        for r in runs[n]:
            c = r.get("bring_up_cpu")
            if c:
                md += ["", f"Where the bring-up's CPU went ({n} hosts, {c['wall_s']} s on {c['cpus']} CPUs = "
                       f"{c['wall_s'] * c['cpus']:.0f} CPU-s, counted from the first agent's start; starting them all took {c.get('spawn_s', '?')} s): etcd members {c['etcd_s']} s, agents {c['agents_s']} s, "
                       f"vnetds {c['vnetds_s']} s; the machine: user {c['user_s']} s, system {c['system_s']} s, "
                       f"softirq {c['softirq_s']} s, idle {c['idle_s']} s."]
    fails = [(n, r) for n in sizes for r in runs[n] if "churn" in r]
    if fails:
        q = lambda xs, f: f"{pct(xs, .5) * 1000:.0f} / {pct(xs, .99) * 1000:.0f} / {max(xs) * 1000:.0f}" if xs else "-"
        md += ["", "Failures at scale (`--failures`): churn (guests added, deleted and migrated on random hosts, each timed at "
               "an observer host of its network) with the etcd leader SIGKILLed 5 s in; that member down 60 s, changes timed "
               "meanwhile, then started again; a host's vnetd and agent SIGKILLed, each host of its first guest's network timed "
               "until the guest is withdrawn (its lease runs out).", "",
               "| hosts | churn: changes (rate /s) | lost | hosts not converged (120 s after) | delay before the kill, p50 / p99 / max (ms) "
               "| from the kill on | member down: change followed p99 (ms) | its catch-up (s) | after it: p99 (ms) | host killed: withdrawn, min / p50 / max (s), TTL |",
               "|---|---|---|---|---|---|---|---|---|---|"]
        for n, r in fails:
            c, m, h = r["churn"], r.get("member_down", {}), r.get("host_killed", {})
            if "error" in c:
                md.append(f"| {n} | {c['error']} | | | | | | | | |")
                continue
            w = h.get("withdrawn_s", [])
            md.append(f"| {n} | {c['changes']} ({c['rate_per_s']}) | {c['lost']} | {c['hosts_not_converged']} | "
                      f"{q(c['delays_before_kill_s'], 0)} | {q(c['delays_from_kill_s'], 0)} | "
                      f"{pct(m['delays_while_down_s'], .99) * 1000:.0f} | {m['caught_up_s'] if m['caught_up_s'] is None else round(m['caught_up_s'], 2)} | {pct(m['delays_after_s'], .99) * 1000:.0f} | "
                      f"{min(w):.1f} / {pct(w, .5):.1f} / {max(w):.1f}, {h['ttl_s']} |" if "delays_while_down_s" in m and w else
                      f"| {n} | {c['changes']} ({c['rate_per_s']}) | {c['lost']} | {c['hosts_not_converged']} | "
                      f"{q(c['delays_before_kill_s'], 0)} | {q(c['delays_from_kill_s'], 0)} | {m.get('error', '-')} | | | {h.get('error', '-')} |")
    text = "\n".join(md) + "\n"
    path.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
