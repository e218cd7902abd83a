#!/usr/bin/env python3
"""VNET benchmark: one command, run as root.

Builds a two-host testbed in network namespaces (hosts h1, h2 joined directly
by one veth pair, the "physical network"), and measures, interleaved (for each
repeat: for each configuration), ping RTT by payload size, TCP throughput,
UDP goodput and loss, TCP request/response latency, TCP connection setup
time and per-host CPU for:

  native         h1 <-> h2 over the veth
  vxlan          the kernel's VXLAN + Linux bridge, guests in namespaces
  vnet-guest     vnetd on each host, dispatch mode guest-driven
  vnet-vmm       ... vmm-driven
  vnet-adaptive  ... adaptive
  vnet-poll      ... vmm-driven with immediate yield: the papers' evaluation setting
  vnet-tcp       ... over a TCP link; vnet-vxlan ... over a VXLAN link
  vnet-kernel    veth guests on the same vnetds, carried by the kernel fast path
  vnet-vtoe      the same veth guests, their programs under `vtoe`: TCP carried
                 whole by shadow connections between the hosts (VTOE); ping and
                 UDP are not TCP, so only TCP throughput, request/response and
                 connection setup are measured

once per underlay MTU (default 1500 and 9000). Writes bench/results/
<date>.md (tables), <date>.json (raw numbers), <date>-*.png (plots) and
latest.md. See bench/README.md.

Exit status: 0 when the testbed was built (whatever the numbers are, and even
when some configuration is unavailable, e.g. `SET mode` refused); 2 when any
part of the testbed could not be built (namespaces, veth, VXLAN, vnetd); 130
when interrupted (partial results are still written).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"

DEFAULT_CONFIGS = ["native", "vxlan", "vnet-kernel", "vnet-vtoe", "vnet-guest", "vnet-vmm", "vnet-adaptive", "vnet-poll",
                   "vnet-tcp", "vnet-vxlan"]
# "vnet" (opt-in, --configs): vnetd as started, no SET mode (its default dispatch).
ALL_CONFIGS = DEFAULT_CONFIGS + ["vnet"]
# The SET commands that make each vnet configuration. The three modes run with
# the default yield strategy (adaptive); vnet-poll is the papers' evaluation
# setting (VNET/P Table 1: immediate yield), VMM-driven: a polling dispatcher.
VNET_SETTINGS = {
    "vnet-guest": [("mode", "guest-driven"), ("yield", "adaptive")],
    "vnet-vmm": [("mode", "vmm-driven"), ("yield", "adaptive")],
    "vnet-adaptive": [("mode", "adaptive"), ("yield", "adaptive")],
    "vnet-poll": [("mode", "vmm-driven"), ("yield", "immediate")],
    # The other link kinds (issue 4), in the default (adaptive) mode: both
    # vnetds have a UDP, a TCP and a VXLAN link to each other, and the routes
    # to the peer's guest are swapped to the configuration's link at run time.
    "vnet-tcp": [("mode", "adaptive"), ("yield", "adaptive")],
    "vnet-vxlan": [("mode", "adaptive"), ("yield", "adaptive")],
    # The kernel fast path (issue 10): its own veth guests (kg1, kg2) on the
    # same vnetds, always routed over the UDP link; vnetd's defaults.
    "vnet-kernel": [("datapath", "auto"), ("mode", "adaptive")],
    # VTOE (issue 12): the fast path's guests again, their programs under
    # vtoe; the link carries a VTOE key.
    "vnet-vtoe": [("datapath", "auto"), ("mode", "adaptive")],
    "vnet": None,
}
# Which link carries guest traffic in each vnet configuration (link names).
VNET_LINK = {"vnet-tcp": "tcp", "vnet-vxlan": "vx"}
VNET_MODES = {cfg: (s[0][1] if s else None) for cfg, s in VNET_SETTINGS.items()}
PING_SIZES = [64, 256, 1024, 4096, 8192]

VXLAN_OVERHEAD = 50   # outer IP 20 + UDP 8 + VXLAN 8 + inner Ethernet 14
VNET_OVERHEAD = 42    # outer IP 20 + UDP 8 + inner Ethernet 14 (VNET/P carries the bare frame)

IPERF_PORT = 5201
SOCKPERF_PORT = 11111
CONNECT_PORT = 7100
CONNECTS = 300

UNDERLAY = {1: "198.18.0.1", 2: "198.18.0.2"}
OVERLAY = {1: "198.19.0.1", 2: "198.19.0.2"}
# The kernel fast path's veth guests (vnet-kernel): their own addresses and MACs.
KOVERLAY = {1: "198.19.0.11", 2: "198.19.0.12"}
KMAC = {1: "02:00:00:00:01:01", 2: "02:00:00:00:01:02"}


def log(msg: str = ""):
    print(msg, flush=True)


def sh(cmd, check=True, timeout=60, **kw) -> subprocess.CompletedProcess:
    cmd = [str(c) for c in cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} -> {p.returncode}\n{p.stdout}{p.stderr}".rstrip())
    return p


class Interrupted(Exception):
    pass


# --------------------------------------------------------------------------
# preparation: setup script, build, private copy of the binaries
# --------------------------------------------------------------------------

def run_setup() -> str | None:
    """Runs bench/setup; returns a warning on failure (the run goes on and
    whatever tool is missing shows up as measurement errors)."""
    env = dict(os.environ, PYTHON=sys.executable)     # matplotlib for the interpreter running this
    p = subprocess.run([str(BENCH / "setup")], cwd=REPO, text=True, capture_output=True, env=env)
    sys.stdout.write(p.stdout)
    if p.returncode != 0:
        sys.stdout.write(p.stderr)
        return f"bench/setup failed ({p.returncode}): {p.stderr.strip()[-500:]}"
    return None


def build(attempts: int = 3, wait_s: int = 20) -> str | None:
    """cargo build --release; retried (the code may be mid-edit). Returns a
    warning when it never succeeded (the existing binaries are then used)."""
    cargo = shutil.which("cargo") or str(Path.home() / ".cargo" / "bin" / "cargo")
    last = ""
    for i in range(attempts):
        log(f"building: cargo build --release (attempt {i + 1}/{attempts}; waits if another build holds the lock)")
        try:
            p = subprocess.run([cargo, "build", "--release"], cwd=REPO, text=True, capture_output=True,
                               timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as e:
            last = str(e)
        else:
            if p.returncode == 0:
                return None
            last = "\n".join(p.stderr.strip().splitlines()[-15:])
        log(f"build failed:\n{last}")
        if i + 1 < attempts:
            time.sleep(wait_s)
    return f"cargo build --release failed {attempts} times; benchmarked the existing binaries. Last error:\n{last}"


def snapshot_binaries(dest: Path, src: Path | None = None) -> dict:
    """Copies vnetd/vnetctl so a rebuild during the run cannot change them."""
    info = {}
    src = src or REPO / "target" / "release"
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("vnetd", "vnetctl", "vtoe"):
        s = src / name
        if not s.exists():
            info[name] = None
            continue
        shutil.copy2(s, dest / name)
        h = hashlib.sha256((dest / name).read_bytes()).hexdigest()
        info[name] = {"sha256": h[:16], "path": str(s),
                      "mtime": dt.datetime.fromtimestamp(s.stat().st_mtime).isoformat(timespec="seconds")}
    return info


def git_info() -> str:
    try:
        rev = sh(["git", "-C", REPO, "rev-parse", "--short", "HEAD"]).stdout.strip()
        dirty = sh(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"]).stdout.strip()
        return rev + (" (working tree has uncommitted changes)" if dirty else "")
    except Exception as e:  # noqa: BLE001
        return f"unknown ({e})"


def machine_info() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "kernel": platform.release(), "arch": platform.machine(),
            "cpu": cpu, "hostname": platform.node()}


def tool_versions() -> dict:
    out = {}
    for name, cmd in (("iperf3", ["iperf3", "--version"]), ("sockperf", ["sockperf", "--version"]),
                      ("ping", ["ping", "-V"])):
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
            out[name] = (p.stdout or p.stderr).strip().splitlines()[0]
        except Exception as e:  # noqa: BLE001
            out[name] = f"unavailable ({e})"
    return out


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


# --------------------------------------------------------------------------
# CPU accounting
# --------------------------------------------------------------------------

def cpu_times() -> dict[int, tuple[int, int]]:
    """{cpu: (busy, total)} in jiffies from /proc/stat."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        m = re.match(r"cpu(\d+)\s+(.*)", line)
        if not m:
            continue
        f = [int(x) for x in m.group(2).split()]
        total = sum(f[:8])             # user nice system idle iowait irq softirq steal
        idle = f[3] + f[4]             # idle + iowait
        out[int(m.group(1))] = (total - idle, total)
    return out


def busy_pct(before, after, cpu) -> float | None:
    if cpu not in before or cpu not in after:
        return None
    db = after[cpu][0] - before[cpu][0]
    dtot = after[cpu][1] - before[cpu][1]
    return round(100.0 * db / dtot, 1) if dtot > 0 else None


def proc_cpu_ticks(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = text.rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])     # utime + stime (fields 14, 15), all threads


# --------------------------------------------------------------------------
# the testbed
# --------------------------------------------------------------------------

class Endpoint:
    """Where a configuration's traffic runs: client side (host 1) and server
    side (host 2) namespaces, the server's address and the guest MTU; what
    the client and the server programs run under (vtoe, for vnet-vtoe)."""

    def __init__(self, client_ns, server_ns, server_ip, mtu, wrap_client=(), wrap_server=()):
        self.client_ns, self.server_ns, self.server_ip, self.mtu = client_ns, server_ns, server_ip, mtu
        self.wrap_client, self.wrap_server = list(wrap_client), list(wrap_server)


class Testbed:
    def __init__(self, netlab, mtu: int, configs: list[str], cpus: dict[int, int]):
        self.netlab = netlab
        self.lab = netlab.Lab(tag="bench")
        self.mtu = mtu
        self.configs = configs
        self.cpus = cpus
        self.hosts: dict[int, str] = {}
        self.vx_guests: dict[int, str] = {}
        self.vnetds: dict[int, object] = {}
        self.vn_guests: dict[int, object] = {}
        self.k_guests: dict[int, str] = {}
        self.vnet_starts = 0
        self.vnet_link = "udp"
        self.vnet_logs: list[dict] = []
        self.closed = False

    # ---- commands, pinned to the host's CPU ----

    def host_of(self, ns: str) -> int:
        for i in (1, 2):
            if ns in (self.hosts.get(i), self.vx_guests.get(i), self.k_guests.get(i)) or \
                    (i in self.vn_guests and ns == self.vn_guests[i].ns):
                return i
        raise KeyError(ns)

    def pinned(self, ns: str, *cmd) -> list[str]:
        return ["ip", "netns", "exec", ns, "taskset", "-c", str(self.cpus[self.host_of(ns)]),
                *[str(c) for c in cmd]]

    def x(self, ns, *cmd, check=True, timeout=60):
        return self.lab.x(ns, *cmd, check=check, timeout=timeout)

    def spawn(self, ns: str, *cmd, logname: str) -> tuple[subprocess.Popen, Path]:
        logf = self.lab.tmp / f"{logname}-{time.monotonic_ns()}.log"
        with open(logf, "w") as lf:
            p = subprocess.Popen(self.pinned(ns, *cmd), stdout=lf, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL)
        self.lab.other_procs.append(p)
        return p, logf

    # ---- building ----

    def _quiet_ns(self, ns):
        self.x(ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
        self.x(ns, "sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1")

    def build_underlay(self):
        for i in (1, 2):
            self.hosts[i] = self.lab.ns(f"h{i}")
            self._quiet_ns(self.hosts[i])
        # One veth pair straight from h1 to h2, made inside the namespaces.
        sh(["ip", "link", "add", "eth0", "netns", self.hosts[1], "mtu", self.mtu, "type", "veth",
            "peer", "name", "eth0", "netns", self.hosts[2], "mtu", self.mtu])
        for i in (1, 2):
            self.x(self.hosts[i], "ip", "addr", "add", f"{UNDERLAY[i]}/24", "dev", "eth0")
            self.x(self.hosts[i], "ip", "link", "set", "eth0", "up")
        if self.x(self.hosts[1], "ping", "-n", "-q", "-c", "3", "-i", "0.2", "-W", "2", UNDERLAY[2],
                  check=False).returncode != 0:
            raise RuntimeError("underlay: h1 cannot ping h2 over the veth")

    def build_vxlan(self):
        gmtu = self.mtu - VXLAN_OVERHEAD
        for i, other in ((1, 2), (2, 1)):
            h = self.hosts[i]
            g = self.lab.ns(f"x{i}")
            self._quiet_ns(g)
            self.vx_guests[i] = g
            self.x(h, "ip", "link", "add", "vx42", "type", "vxlan", "id", "42", "dstport", "4789",
                   "remote", UNDERLAY[other], "local", UNDERLAY[i], "dev", "eth0")
            self.x(h, "ip", "link", "set", "vx42", "mtu", gmtu)
            self.x(h, "ip", "link", "add", "br0", "type", "bridge")
            sh(["ip", "link", "add", "vxg", "netns", h, "mtu", gmtu, "type", "veth",
                "peer", "name", "eth0", "netns", g, "mtu", gmtu])
            self.x(h, "ip", "link", "set", "vx42", "master", "br0")
            self.x(h, "ip", "link", "set", "vxg", "master", "br0")
            for dev in ("vx42", "vxg", "br0"):
                self.x(h, "ip", "link", "set", dev, "up")
            self.x(g, "ip", "addr", "add", f"{OVERLAY[i]}/24", "dev", "eth0")
            self.x(g, "ip", "link", "set", "eth0", "up")

    def start_vnet(self):
        """One vnetd per host (pinned), its TAP moved into a guest namespace."""
        nl = self.netlab
        gmtu = self.mtu - VNET_OVERHEAD
        guests = {1: [("vg1", nl.guest_mac(1))], 2: [("vg2", nl.guest_mac(2))]}
        self.vnet_starts += 1
        self.vnet_link = "udp"
        for i in (1, 2):
            g = self.lab.ns(f"k{i}")
            self._quiet_ns(g)
            self.k_guests[i] = g
        for i in (1, 2):
            h = self.hosts[i]
            name = h.removeprefix(self.lab.prefix)
            tag = f"{name}-{self.vnet_starts}"
            sock = self.lab.tmp / f"{tag}.sock"
            logf = self.lab.tmp / f"{tag}-vnetd.log"
            conf = self.lab.tmp / f"{tag}.conf"
            conf.write_text(vnet_config(nl, i, guests, gmtu, self.k_guests[i]))
            cmd = ["ip", "netns", "exec", h, "taskset", "-c", str(self.cpus[i]), str(nl.VNETD),
                   "--control-unix", str(sock), "--control-tcp", "none", "--config", str(conf), "--state", "none",
                   "--vtoe-socket", str(self.vtoe_socket(i)),
                   "--link-key-dir", str(self.lab.key_dir),
                   # the kernel VXLAN configuration holds 4789 in the same host namespaces
                   "--vxlan-port", "4790"]
            with open(logf, "w") as lf:
                proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            d = nl.Vnetd(self.lab, h, sock, proc, logf)
            self.lab.daemons.append(d)
            self.vnetds[i] = d
            self.lab.wait_ready(d)
        for i in (1, 2):
            self.vn_guests[i] = self.lab.attach_guest(self.hosts[i], f"vg{i}", i, mtu=gmtu)
            self.x(self.k_guests[i], "ip", "addr", "add", f"{KOVERLAY[i]}/24", "dev", "kg")
            self.x(self.k_guests[i], "ip", "link", "set", "kg", "up")

    def vtoe_socket(self, i: int) -> Path:
        return self.lab.tmp / f"vtoe-h{i}.sock"

    def vnet_alive(self) -> bool:
        return len(self.vnetds) == 2 and all(d.proc.poll() is None for d in self.vnetds.values())

    def stop_vnet(self):
        """Stops both vnetds and deletes their guest namespaces (for a restart)."""
        for i, d in list(self.vnetds.items()):
            try:
                rc = d.stop(timeout=5)
            except Exception:  # noqa: BLE001
                rc = None
            self.vnet_logs.append({"host": i, "start": self.vnet_starts, "returncode": rc,
                                   "log": d.log_text()})
            if d in self.lab.daemons:
                self.lab.daemons.remove(d)
        self.vnetds.clear()
        for n in (1, 2):
            for ns in (f"{self.lab.prefix}g{n}", f"{self.lab.prefix}k{n}"):
                if ns in self.lab.namespaces:
                    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
                    self.lab.namespaces.remove(ns)
        self.vn_guests.clear()
        self.k_guests.clear()

    def endpoint(self, cfg: str) -> Endpoint:
        if cfg == "native":
            return Endpoint(self.hosts[1], self.hosts[2], UNDERLAY[2], self.mtu)
        if cfg == "vxlan":
            return Endpoint(self.vx_guests[1], self.vx_guests[2], OVERLAY[2], self.mtu - VXLAN_OVERHEAD)
        if cfg == "vnet-kernel":
            return Endpoint(self.k_guests[1], self.k_guests[2], KOVERLAY[2], self.mtu - VNET_OVERHEAD)
        if cfg == "vnet-vtoe":
            vtoe = self.netlab.BIN / "vtoe"
            return Endpoint(self.k_guests[1], self.k_guests[2], KOVERLAY[2], self.mtu - VNET_OVERHEAD,
                            [vtoe, "--socket", self.vtoe_socket(1)], [vtoe, "--socket", self.vtoe_socket(2)])
        # A VXLAN link's header takes 8 bytes more of each datagram.
        extra = 8 if VNET_LINK.get(cfg) == "vx" else 0
        return Endpoint(self.vn_guests[1].ns, self.vn_guests[2].ns, OVERLAY[2], self.mtu - VNET_OVERHEAD - extra)

    def close(self):
        if self.closed:
            return
        self.closed = True
        if self.vnetds:
            self.stop_vnet()
        self.lab.close()


# --------------------------------------------------------------------------
# measurements
# --------------------------------------------------------------------------

def wait_listening(bed: Testbed, ns: str, port: int, proc: subprocess.Popen, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode} before listening on {port}")
        out = bed.x(ns, "ss", "-Hltn", f"sport = :{port}", check=False).stdout
        if out.strip():
            return
        time.sleep(0.05)
    raise RuntimeError(f"server not listening on port {port} after {timeout}s")


def end_proc(p: subprocess.Popen, sig=signal.SIGTERM, timeout=5):
    if p.poll() is None:
        try:
            p.send_signal(sig)
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)


def tail(path: Path, n=5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-n:])
    except OSError:
        return ""


def connectivity(bed: Testbed, ep: Endpoint) -> bool:
    for _ in range(2):
        p = bed.x(ep.client_ns, "ping", "-n", "-q", "-c", "3", "-i", "0.1", "-W", "1", ep.server_ip,
                  check=False, timeout=20)
        if p.returncode == 0:
            return True
    return False


def measure_ping(bed: Testbed, ep: Endpoint, size: int, count: int) -> dict:
    p = sh(bed.pinned(ep.client_ns, "ping", "-n", "-q", "-c", count, "-i", "0.01", "-s", size,
                      "-W", "2", ep.server_ip), check=False, timeout=count * 2 + 15)
    out = p.stdout
    m = re.search(r"(\d+) packets transmitted, (\d+) received", out)
    res = {}
    if m:
        sent, recv = int(m.group(1)), int(m.group(2))
        res["loss_pct"] = round(100.0 * (sent - recv) / sent, 1) if sent else None
    m = re.search(r"= ([\d.]+)/([\d.]+)/([\d.]+)/([\d.]+) ms", out)
    if not m:
        raise RuntimeError(f"ping -s {size}: no RTT ({(out + p.stderr).strip()[-200:]})")
    mn, avg, mx, mdev = (float(v) * 1000.0 for v in m.groups())   # ms -> µs
    res.update(avg_us=round(avg, 1), min_us=round(mn, 1), max_us=round(mx, 1), mdev_us=round(mdev, 1))
    return res


def iperf3(bed: Testbed, ep: Endpoint, duration: int, extra: list, cpu_pids: list[int]) -> tuple[dict, dict]:
    """One iperf3 test client (host 1) -> one-off server (host 2). Returns the
    client's JSON and the CPU usage seen during the client run."""
    srv, srv_log = bed.spawn(ep.server_ns, *ep.wrap_server, "iperf3", "-s", "-1", "-p", IPERF_PORT, logname="iperf3-s")
    try:
        wait_listening(bed, ep.server_ns, IPERF_PORT, srv)
        cpu0, t0 = cpu_times(), time.monotonic()
        ticks0 = {pid: proc_cpu_ticks(pid) for pid in cpu_pids}
        p = sh(bed.pinned(ep.client_ns, *ep.wrap_client, "iperf3", "-c", ep.server_ip, "-p", IPERF_PORT, "-t", duration,
                          "-J", "--connect-timeout", "3000", *extra), check=False, timeout=duration + 40)
        cpu1, t1 = cpu_times(), time.monotonic()
        ticks1 = {pid: proc_cpu_ticks(pid) for pid in cpu_pids}
    finally:
        end_proc(srv)
    hz = os.sysconf("SC_CLK_TCK")
    cpu = {"h1_busy_pct": busy_pct(cpu0, cpu1, bed.cpus[1]), "h2_busy_pct": busy_pct(cpu0, cpu1, bed.cpus[2]),
           "wall_s": round(t1 - t0, 2)}
    for idx, pid in enumerate(cpu_pids, start=1):
        a, b = ticks0.get(pid), ticks1.get(pid)
        cpu[f"vnetd_h{idx}_pct"] = round(100.0 * (b - a) / hz / (t1 - t0), 1) if a is not None and b is not None else None
    try:
        data = json.loads(p.stdout)
    except json.JSONDecodeError:
        raise RuntimeError(f"iperf3 {' '.join(map(str, extra))}: no JSON (rc {p.returncode}): "
                           f"{(p.stdout + p.stderr).strip()[-300:]}; server: {tail(srv_log)}") from None
    if data.get("error"):
        raise RuntimeError(f"iperf3 {' '.join(map(str, extra))}: {data['error']}")
    return data, cpu


def measure_tcp(bed, ep, duration, cpu_pids) -> dict:
    data, cpu = iperf3(bed, ep, duration, [], cpu_pids)
    end = data["end"]
    rx, tx = end["sum_received"], end["sum_sent"]
    return {"gbps": round(rx["bits_per_second"] / 1e9, 3), "sender_gbps": round(tx["bits_per_second"] / 1e9, 3),
            "retransmits": tx.get("retransmits"), "cpu": cpu,
            "iperf3_cpu": end.get("cpu_utilization_percent")}


def measure_udp(bed, ep, duration, cpu_pids) -> dict:
    length = ep.mtu - 28
    data, cpu = iperf3(bed, ep, duration, ["-u", "-b", "0", "-l", length], cpu_pids)
    end = data["end"]
    s = end.get("sum_received") or end["sum"]
    if "sum_received" in end:
        gbps = s["bits_per_second"] / 1e9
    else:   # older iperf3: derive the receiver's goodput from the loss report
        gbps = (s["packets"] - s["lost_packets"]) * length * 8 / s["seconds"] / 1e9
    sent = end.get("sum_sent") or end["sum"]
    return {"gbps": round(gbps, 3), "loss_pct": round(s.get("lost_percent", 0.0), 2),
            "sender_gbps": round(sent["bits_per_second"] / 1e9, 3), "len": length,
            "packets": s.get("packets"), "lost_packets": s.get("lost_packets"), "cpu": cpu}


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def measure_rr(bed, ep, duration) -> dict:
    srv, srv_log = bed.spawn(ep.server_ns, *ep.wrap_server, "sockperf", "sr", "--tcp", "-i", ep.server_ip,
                             "-p", SOCKPERF_PORT, logname="sockperf-s")
    try:
        wait_listening(bed, ep.server_ns, SOCKPERF_PORT, srv)
        p = sh(bed.pinned(ep.client_ns, *ep.wrap_client, "sockperf", "pp", "--tcp", "-i", ep.server_ip, "-p", SOCKPERF_PORT,
                          "-t", duration), check=False, timeout=duration + 40)
    finally:
        end_proc(srv, sig=signal.SIGINT)
    out = ANSI.sub("", p.stdout + p.stderr)
    m = re.search(r"avg-latency=([\d.]+) \(std-dev=([\d.]+)\)", out)
    if not m:
        raise RuntimeError(f"sockperf pp: no avg-latency (rc {p.returncode}): {out.strip()[-300:]}")
    res = {"avg_us": float(m.group(1)), "std_us": float(m.group(2))}
    for key, pat in (("p50_us", r"percentile 50\.000 =\s*([\d.]+)"), ("p99_us", r"percentile 99\.000 =\s*([\d.]+)"),
                     ("min_us", r"<MIN> observation =\s*([\d.]+)"), ("max_us", r"<MAX> observation =\s*([\d.]+)")):
        mm = re.search(pat, out)
        res[key] = float(mm.group(1)) if mm else None
    mm = re.search(r"\[Valid Duration\].*?ReceivedMessages=(\d+)", out)
    res["messages"] = int(mm.group(1)) if mm else None
    return res


def measure_connect(bed, ep) -> dict:
    """CONNECTS blocking connects one after another (bench/tools/connect_time.py)."""
    tool = BENCH / "tools" / "connect_time.py"
    srv, srv_log = bed.spawn(ep.server_ns, *ep.wrap_server, sys.executable, tool, "serve", CONNECT_PORT, ep.server_ip,
                             logname="connect-s")
    try:
        wait_listening(bed, ep.server_ns, CONNECT_PORT, srv)
        p = sh(bed.pinned(ep.client_ns, *ep.wrap_client, sys.executable, tool, "measure", ep.server_ip, CONNECT_PORT,
                          CONNECTS), check=False, timeout=120)
    finally:
        end_proc(srv)
    line = next((l for l in p.stdout.splitlines() if l.startswith("{")), None)
    if line is None:
        raise RuntimeError(f"connect_time: no result (rc {p.returncode}): {(p.stdout + p.stderr).strip()[-300:]}; "
                           f"server: {tail(srv_log)}")
    return json.loads(line)


def vtoe_counters(bed: Testbed) -> dict:
    """What VTOE did on each host (STATS vtoe's counters)."""
    out = {}
    for i in (1, 2):
        try:
            line = bed.vnetds[i].ctl("STATS", "vtoe").stdout.splitlines()[0]
            out[f"h{i}"] = {k: int(v) for k, v in (w.split("=", 1) for w in line.split()[1:]) if v.isdigit()}
        except Exception:  # noqa: BLE001
            pass
    return out


def vnet_counters(bed: Testbed) -> dict:
    """Per host: vnetd's global drop counters, the guest TAP's kernel drop
    counters and the host namespace's UDP error counters (socket buffers)."""
    out = {}
    for i in (1, 2):
        c = {}
        d = bed.vnetds.get(i)
        try:
            st = d.stats()
            for k, v in st.get("global", {}).items():
                if isinstance(v, int) and k.startswith("drop_"):
                    c[f"vnetd.{k}"] = v
            # What the kernel fast path carried and gave up (vnet-kernel).
            for k, v in st.get("fastpath", {}).items():
                if isinstance(v, int) and k.startswith(("hit_", "miss_", "slow_", "drop_", "finish")):
                    c[f"fast.{k}"] = v
        except Exception:  # noqa: BLE001
            pass
        g = bed.vn_guests.get(i)
        if g is not None:
            p = bed.x(g.ns, "cat", f"/sys/class/net/{g.tap}/statistics/tx_dropped",
                      f"/sys/class/net/{g.tap}/statistics/rx_dropped", check=False)
            v = p.stdout.split()
            if len(v) == 2:
                c["tap.tx_dropped"], c["tap.rx_dropped"] = int(v[0]), int(v[1])
        p = bed.x(bed.hosts[i], "cat", "/proc/net/snmp", check=False)
        udp = [l.split()[1:] for l in p.stdout.splitlines() if l.startswith("Udp:")]
        if len(udp) == 2:
            for k, v in zip(*udp):
                if k in ("InErrors", "RcvbufErrors", "SndbufErrors", "MemErrors"):
                    c[f"host_udp.{k}"] = int(v)
        out[f"h{i}"] = c
    return out


def counter_delta(before: dict, after: dict) -> dict:
    out = {}
    for h, a in after.items():
        b = before.get(h) or {}
        d = {k: a[k] - b[k] for k in a if k in b and a[k] - b[k]}
        if d:
            out[h] = d
    return out


def background_busy(bed: Testbed, wait_idle: float = 0, threshold: float = 20.0, seconds=0.5) -> dict:
    """CPU busy on the two CPUs while this harness is idle (other load on the
    machine). With wait_idle > 0, waits up to that long for both to be under
    `threshold` %."""
    start = time.monotonic()
    while True:
        a = cpu_times()
        time.sleep(seconds)
        b = cpu_times()
        res = {"h1": busy_pct(a, b, bed.cpus[1]), "h2": busy_pct(a, b, bed.cpus[2])}
        waited = time.monotonic() - start - seconds
        quiet = all(v is not None and v < threshold for v in res.values())
        if quiet or waited + seconds > wait_idle:
            if wait_idle > 0:
                res["waited_s"] = round(max(waited, 0.0), 1)
            return res


def measure_config(bed: Testbed, cfg: str, args) -> dict:
    ep = bed.endpoint(cfg)
    rec = {"started": dt.datetime.now().isoformat(timespec="seconds"), "errors": [],
           "ping": {}, "tcp": None, "udp": None, "rr": None, "conn": None,
           "background_busy_pct": background_busy(bed, args.wait_idle), "loadavg": loadavg()}
    pids = [bed.vnetds[i].proc.pid for i in (1, 2)] if cfg in VNET_MODES else []
    before = vnet_counters(bed) if cfg in VNET_MODES else {}
    rec["connectivity"] = connectivity(bed, ep)
    if not rec["connectivity"]:
        rec["errors"].append(f"no connectivity: {ep.client_ns} cannot ping {ep.server_ip}; measurements skipped")
        return rec
    # VTOE carries TCP only: ping and UDP take vnet-kernel's path, measured there.
    tcp_only = cfg == "vnet-vtoe"
    for size in [] if tcp_only else PING_SIZES:
        try:
            rec["ping"][str(size)] = measure_ping(bed, ep, size, args.ping_count)
        except Interrupted:
            raise
        except Exception as e:  # noqa: BLE001
            rec["errors"].append(str(e))
    vt0 = vtoe_counters(bed) if tcp_only else {}
    for key, fn in (("tcp", lambda: measure_tcp(bed, ep, args.duration, pids)),
                    ("udp", None if tcp_only else lambda: measure_udp(bed, ep, args.duration, pids)),
                    ("rr", lambda: measure_rr(bed, ep, args.duration)),
                    ("conn", lambda: measure_connect(bed, ep))):
        if fn is None:
            continue
        try:
            rec[key] = fn()
        except Interrupted:
            raise
        except Exception as e:  # noqa: BLE001
            rec["errors"].append(f"{key}: {e}")
        time.sleep(0.3)
    if cfg in VNET_MODES:
        rec["drops"] = counter_delta(before, vnet_counters(bed))
    if tcp_only:
        # Every connection of the run offloaded, or the numbers are not VTOE's.
        rec["vtoe"] = counter_delta(vt0, vtoe_counters(bed))
        offers = sum(v.get("offers", 0) for v in rec["vtoe"].values())
        offloaded = sum(v.get("offloaded_out", 0) for v in rec["vtoe"].values())
        if offers != offloaded:
            rec["errors"].append(f"vtoe: {offloaded} of {offers} connections offloaded: {rec['vtoe']}")
    return rec


def vnet_config(nl, i: int, guests: dict, gmtu: int, kns: str) -> str:
    """Host i's vnetd config: its TAP guest and its veth guest (in `kns`, for
    the fast path), a UDP, a TCP and a VXLAN link to the other host, and
    routes over the UDP link."""
    peer = 3 - i
    mac, peer_mac = guests[i][0][1], guests[peer][0][1]
    return (f"INTERFACE ADD {guests[i][0][0]} {mac} mtu {gmtu}\n"
            f"INTERFACE ADD kg {KMAC[i]} mtu {gmtu} netns {kns} veth\n"
            f"LINK ADD {UNDERLAY[peer]} 9000 udp name udp vtoe lab\n"
            f"LINK ADD {UNDERLAY[peer]} 9000 tcp key lab name tcp\n"
            f"LINK ADD {UNDERLAY[peer]} 4790 vxlan vni 42 name vx\n"
            f"ROUTE ADD any {KMAC[i]} interface {KMAC[i]} any\n"
            f"ROUTE ADD any ff:ff:ff:ff:ff:ff interface {KMAC[i]} any\n"
            f"ROUTE ADD any {KMAC[peer]} edge udp any\n"
            f"ROUTE ADD any {mac} interface {mac} any\n"
            f"ROUTE ADD any ff:ff:ff:ff:ff:ff interface {mac} any\n"
            + route_lines(peer_mac, "udp"))


def route_lines(peer_mac: str, link: str, verb: str = "ADD") -> str:
    return (f"ROUTE {verb} any {peer_mac} edge {link} any\n"
            f"ROUTE {verb} any ff:ff:ff:ff:ff:ff edge {link} interface\n")


def use_link(bed: Testbed, link: str) -> tuple[bool, str]:
    """Moves the routes to the peer's guest onto `link`, on both hosts, each
    in one all-or-nothing request."""
    if bed.vnet_link == link:
        return True, ""
    for i in (1, 2):
        peer_mac = bed.netlab.guest_mac(3 - i)
        req = route_lines(peer_mac, bed.vnet_link, "DEL") + route_lines(peer_mac, link)
        p = bed.vnetds[i].ctl_file(req, check=False)
        if p.returncode != 0:
            return False, f"h{i}: moving routes to link {link} refused: {p.stderr.strip()}"
    bed.vnet_link = link
    if link == "tcp":
        # Wait for the TCP link to be up.
        deadline = time.time() + 15
        while time.time() < deadline:
            if all("state=up" in bed.vnetds[i].ctl("LINK", "LIST").stdout for i in (1, 2)):
                break
            time.sleep(0.1)
    return True, f"routes on link {link}"


def set_mode(bed: Testbed, cfg: str) -> tuple[bool, str]:
    """The configuration's SET commands on both vnetds, and its link.
    Returns (accepted, message)."""
    ok, msg = use_link(bed, VNET_LINK.get(cfg, "udp"))
    if not ok:
        return ok, msg
    msgs = [msg] if msg else []
    for i in (1, 2):
        for key, value in VNET_SETTINGS[cfg]:
            try:
                p = bed.vnetds[i].ctl("SET", key, value, check=False, timeout=30)
            except subprocess.TimeoutExpired:
                return False, f"h{i}: `vnetctl SET {key} {value}` got no reply in 30 s"
            text = (p.stdout + p.stderr).strip().replace("\n", " ")
            if p.returncode != 0:
                return False, f"h{i}: `vnetctl SET {key} {value}` refused (rc {p.returncode}): {text}"
        msgs.append(f"h{i}: {text}")
    return True, "; ".join(msgs)


# --------------------------------------------------------------------------
# one phase (one underlay MTU)
# --------------------------------------------------------------------------

def run_phase(netlab, mtu: int, args, cpus, state: dict) -> dict:
    phase = {"mtu": mtu, "guest_mtu": {"native": mtu, "vxlan": mtu - VXLAN_OVERHEAD,
                                       "vnet": mtu - VNET_OVERHEAD},
             "built": False, "build_errors": [], "notes": [],
             "configs": {c: {"available": True, "reason": None, "repeats": [], "mode_reply": None}
                         for c in args.configs}}
    state["phases"].append(phase)
    bed = Testbed(netlab, mtu, args.configs, cpus)
    state["beds"].append(bed)
    vnet_cfgs = [c for c in args.configs if c in VNET_MODES]
    try:
        log(f"\n=== underlay MTU {mtu}: building testbed (prefix {bed.lab.prefix}) ===")
        try:
            bed.build_underlay()
        except Interrupted:
            raise
        except Exception as e:  # noqa: BLE001
            phase["build_errors"].append(f"underlay: {e}")
            for c in args.configs:
                phase["configs"][c].update(available=False, reason="testbed not built (underlay)")
            state["exit"] = 2
            log(f"!! underlay could not be built: {e}")
            return phase
        if "vxlan" in args.configs:
            try:
                bed.build_vxlan()
            except Interrupted:
                raise
            except Exception as e:  # noqa: BLE001
                phase["build_errors"].append(f"vxlan: {e}")
                phase["configs"]["vxlan"].update(available=False, reason=f"testbed: VXLAN not built: {e}")
                state["exit"] = 2
                log(f"!! VXLAN could not be built: {e}")
        if vnet_cfgs:
            try:
                if not state["have_vnetd"]:
                    raise RuntimeError("no vnetd binary (target/release/vnetd missing)")
                bed.start_vnet()
            except Interrupted:
                raise
            except Exception as e:  # noqa: BLE001
                phase["build_errors"].append(f"vnet: {e}")
                for c in vnet_cfgs:
                    phase["configs"][c].update(available=False, reason=f"testbed: vnetd not started: {str(e)[:300]}")
                state["exit"] = 2
                log(f"!! vnetd could not be started: {e}")
        phase["built"] = True

        restarted = False
        for r in range(args.repeats):
            for cfg in args.configs:
                c = phase["configs"][cfg]
                if not c["available"]:
                    continue
                if cfg in VNET_MODES:
                    if not bed.vnet_alive():
                        dead = "; ".join(f"h{i} vnetd exited {d.proc.returncode}"
                                         for i, d in bed.vnetds.items() if d.proc.poll() is not None)
                        if restarted:
                            for vc in vnet_cfgs:
                                phase["configs"][vc].update(available=False,
                                                            reason=f"vnetd exited again after a restart ({dead})")
                            log(f"!! vnetd died again ({dead}); vnet configurations skipped from now on")
                            continue
                        phase["notes"].append(f"repeat {r + 1}, before {cfg}: {dead}; restarted the vnetd pair")
                        log(f"!! {dead}; restarting the vnetd pair")
                        restarted = True
                        bed.stop_vnet()
                        try:
                            bed.start_vnet()
                        except Exception as e:  # noqa: BLE001
                            for vc in vnet_cfgs:
                                phase["configs"][vc].update(available=False, reason=f"vnetd restart failed: {e}")
                            state["exit"] = 2
                            continue
                    if VNET_SETTINGS[cfg] is not None:
                        ok, msg = set_mode(bed, cfg)
                        if not ok and not bed.vnet_alive():
                            # it died, not refused: the next repeat restarts it
                            c["repeats"].append({"repeat": r, "ping": {}, "tcp": None, "udp": None, "rr": None,
                                                 "errors": [f"vnetd exited: {msg}"]})
                            log(f"[mtu {mtu}] {cfg}: vnetd exited: {msg}")
                            continue
                        if not ok:
                            c.update(available=False, reason=msg)
                            log(f"[mtu {mtu}] {cfg}: unavailable: {msg}")
                            continue
                        if c["mode_reply"] is None:
                            c["mode_reply"] = msg
                        time.sleep(0.2)
                    if "show" not in c:
                        try:
                            c["show"] = bed.vnetds[1].ctl("SHOW", check=False).stdout.splitlines()[:15]
                        except subprocess.TimeoutExpired:
                            c["show"] = ["SHOW timed out"]
                elif bed.vnet_alive():
                    # Not a vnet configuration: keep the idle vnetds from
                    # polling (vnet-poll's setting) while it is measured.
                    for d in bed.vnetds.values():
                        d.ctl("SET", "mode", "guest-driven", check=False)
                        d.ctl("SET", "yield", "adaptive", check=False)
                log(f"[mtu {mtu}] repeat {r + 1}/{args.repeats} {cfg} ...")
                try:
                    rec = measure_config(bed, cfg, args)
                except Interrupted:
                    raise
                except Exception as e:  # noqa: BLE001  (a harness bug or a hung tool: report, go on)
                    rec = {"started": dt.datetime.now().isoformat(timespec="seconds"), "ping": {}, "tcp": None,
                           "udp": None, "rr": None, "errors": [f"measurement aborted: {e!r}"]}
                rec["repeat"] = r
                c["repeats"].append(rec)
                log("    " + one_line(rec))
                for e in rec["errors"]:
                    log(f"    error: {e}")
    finally:
        if bed.vnetds:
            bed.stop_vnet()
        phase["vnetd_logs"] = [{"host": l["host"], "start": l["start"], "returncode": l["returncode"],
                                "problems": log_problems(l["log"]), "tail": l["log"].splitlines()[-20:]}
                               for l in bed.vnet_logs]
    return phase


def log_problems(text: str, limit=30) -> list[str]:
    """vnetd log lines at WARN/ERROR (or panics), de-duplicated."""
    seen, out = set(), []
    for line in ANSI.sub("", text).splitlines():
        if re.search(r"\b(WARN|ERROR|warn|error|panicked)\b", line):
            key = re.sub(r"^\S+\s+", "", line)      # without the timestamp
            if key not in seen:
                seen.add(key)
                out.append(line.strip())
    return out[:limit]


def one_line(rec: dict) -> str:
    parts = []
    if rec.get("tcp"):
        t = rec["tcp"]
        parts.append(f"tcp {t['gbps']:.2f} Gbit/s (cpu h1 {t['cpu']['h1_busy_pct']}% h2 {t['cpu']['h2_busy_pct']}%)")
    if rec.get("udp"):
        parts.append(f"udp {rec['udp']['gbps']:.2f} Gbit/s loss {rec['udp']['loss_pct']}%")
    if rec.get("rr"):
        parts.append(f"rr {rec['rr']['avg_us']:.1f} us")
    if rec.get("conn"):
        parts.append(f"connect {rec['conn']['median_us']:.0f} us")
    p = rec.get("ping", {})
    if p:
        parts.append("ping " + " ".join(f"{s}:{v['avg_us']:.0f}" for s, v in p.items()) + " us")
    return ", ".join(parts) or "no results"


# --------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------

def get(rec, *path):
    for k in path:
        if rec is None:
            return None
        rec = rec.get(k) if isinstance(rec, dict) else None
    return rec


METRICS = [
    # key, title, unit, better, path in a repeat record, decimals
    ("tcp", "TCP throughput (iperf3, receiver)", "Gbit/s", "higher", ("tcp", "gbps"), 2),
    ("udp", "UDP goodput (iperf3 -u -b 0, receiver)", "Gbit/s", "higher", ("udp", "gbps"), 2),
    ("udp_loss", "UDP loss (iperf3 -u -b 0)", "%", "lower", ("udp", "loss_pct"), 2),
    ("rr", "TCP request/response latency (sockperf pp --tcp, avg one-way = RTT/2)", "µs", "lower", ("rr", "avg_us"), 1),
    ("conn", f"TCP connection setup (blocking connect(), median of {CONNECTS} in a row)", "µs", "lower",
     ("conn", "median_us"), 1),
    ("cpu_h1", "CPU busy on host 1 (cpu0) during the TCP throughput run", "%", "lower", ("tcp", "cpu", "h1_busy_pct"), 1),
    ("cpu_h2", "CPU busy on host 2 (cpu1) during the TCP throughput run", "%", "lower", ("tcp", "cpu", "h2_busy_pct"), 1),
    ("vnetd_h1", "vnetd CPU on host 1 during the TCP throughput run (% of one CPU)", "%", "lower",
     ("tcp", "cpu", "vnetd_h1_pct"), 1),
    ("vnetd_h2", "vnetd CPU on host 2 during the TCP throughput run (% of one CPU)", "%", "lower",
     ("tcp", "cpu", "vnetd_h2_pct"), 1),
] + [
    (f"ping{s}", f"Ping RTT, {s}-byte payload (avg of ping -s {s})", "µs", "lower", ("ping", str(s), "avg_us"), 1)
    for s in PING_SIZES
]


def stats(vals):
    v = [x for x in vals if isinstance(x, (int, float)) and math.isfinite(x)]
    if not v:
        return None
    return {"min": min(v), "median": statistics.median(v), "max": max(v), "n": len(v)}


def summarize(state) -> dict:
    """{mtu: {cfg: {metric: stats}}}"""
    out = {}
    for ph in state["phases"]:
        m = out.setdefault(ph["mtu"], {})
        for cfg, c in ph["configs"].items():
            m[cfg] = {key: stats([get(r, *path) for r in c["repeats"]]) for key, _, _, _, path, _ in METRICS}
            for h in ("h1", "h2"):
                m[cfg][f"bg_{h}"] = stats([get(r, "background_busy_pct", h) for r in c["repeats"]])
    return out


def fmt(v, d):
    if v is None:
        return "—"
    return f"{v:.{d}f}"


def ratio(a, b):
    if a is None or b is None or b == 0:
        return "—"
    return f"{a / b:.2f}×"


def metric_table(ph, summ, key, dec) -> list[str]:
    lines = ["| configuration | n | min | median | max | ÷ native | ÷ vxlan |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    nat = get(summ.get("native", {}), key, "median")
    vx = get(summ.get("vxlan", {}), key, "median")
    for cfg, c in ph["configs"].items():
        s = summ[cfg][key]
        if not c["available"] and not c["repeats"]:
            lines.append(f"| {cfg} | unavailable | — | — | — | — | — |")
        elif s is None:
            lines.append(f"| {cfg} | 0/{len(c['repeats'])} | — | — | — | — | — |")
        else:
            lines.append(f"| {cfg} | {s['n']}/{len(c['repeats'])} | {fmt(s['min'], dec)} | {fmt(s['median'], dec)} | "
                         f"{fmt(s['max'], dec)} | {ratio(s['median'], nat)} | {ratio(s['median'], vx)} |")
    return lines


OVERVIEW = [("tcp", "TCP Gbit/s ↑", 2), ("udp", "UDP Gbit/s ↑", 2), ("udp_loss", "UDP loss % ↓", 2),
            ("ping64", "RTT 64 B µs ↓", 1), ("ping8192", "RTT 8192 B µs ↓", 1), ("rr", "TCP RR µs ↓", 1),
            ("conn", "connect µs ↓", 1),
            ("cpu_h1", "CPU h1 % ↓", 1), ("cpu_h2", "CPU h2 % ↓", 1), ("bg_h1", "idle-time load h1/h2 %", 1)]


def short_warning(w: str) -> str:
    """The first line, plus the compiler's `error...` lines for a failed build."""
    lines = w.strip().splitlines()
    errs = [l.strip() for l in lines[1:] if l.strip().startswith("error")]
    return " ".join([lines[0]] + [f"`{e}`" for e in errs[:3]]) if lines else ""


def write_markdown(state, summary, stamp, plots) -> str:
    meta = state["meta"]
    L = [f"# VNET benchmark {meta['date']}", "",
         f"Command: `{meta['command']}` (in `{meta['cwd']}`, as root)", "",
         f"Machine: nproc {meta['machine']['nproc']}, kernel {meta['machine']['kernel']} ({meta['machine']['arch']}), "
         f"CPU {meta['machine']['cpu'] or '?'}; load average at start {meta['load_start']}, at end {meta.get('load_end', '?')}", "",
         f"Code: git {meta['git']}; vnetd {get(meta, 'binaries', 'vnetd', 'path') or '—'}, sha256 "
         f"{get(meta, 'binaries', 'vnetd', 'sha256') or '—'}, built {get(meta, 'binaries', 'vnetd', 'mtime') or '—'}", "",
         f"Settings: repeats {meta['repeats']}, duration {meta['duration']} s, ping count {meta['ping_count']}, "
         f"wait-idle {meta['wait_idle']} s, "
         f"underlay MTUs {', '.join(map(str, meta['mtus']))}, configurations {', '.join(meta['configs'])}; "
         f"host 1 pinned to CPU {meta['cpus']['1']}, host 2 to CPU {meta['cpus']['2']}. "
         f"Tools: {meta['tools'].get('iperf3', '?')}; {meta['tools'].get('sockperf', '?')}.", "",
         f"Raw numbers: [{stamp}.json]({stamp}.json). Each value below is one repeat's result; columns are "
         f"min / median / max over the repeats (n = repeats with a value / repeats run); ratios are "
         f"median ÷ the native median and median ÷ the kernel-VXLAN median.", ""]
    if meta.get("interrupted"):
        L += ["**Interrupted: partial results.**", ""]
    if meta.get("warnings"):
        L += ["Warnings (details in the JSON):", ""] + [f"- {short_warning(w)}" for w in meta["warnings"]] + [""]

    L += ["## Overview (medians)", ""]
    for ph in state["phases"]:
        s = summary.get(ph["mtu"], {})
        L += [f"Underlay MTU {ph['mtu']} (guest MTU: vxlan {ph['guest_mtu']['vxlan']}, vnet {ph['guest_mtu']['vnet']}). "
              f"↑ higher is better, ↓ lower is better. The last column is how busy cpu0/cpu1 were in the 0.5 s "
              f"before the configuration's measurements, with the harness idle (other load on the machine).", "",
              "| configuration | " + " | ".join(t for _, t, _ in OVERVIEW) + " |",
              "|---|" + "---:|" * len(OVERVIEW)]
        for cfg, c in ph["configs"].items():
            if not c["available"] and not c["repeats"]:
                L.append(f"| {cfg} | " + " | ".join(["unavailable"] + ["—"] * (len(OVERVIEW) - 1)) + " |")
            else:
                cells = []
                for k, _, d in OVERVIEW:
                    v = fmt(get(s.get(cfg, {}), k, "median"), d)
                    if k == "bg_h1":
                        v += "/" + fmt(get(s.get(cfg, {}), "bg_h2", "median"), d)
                    cells.append(v)
                L.append(f"| {cfg} | " + " | ".join(cells) + " |")
        L.append("")

    if plots:
        L += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]

    for key, title, unit, better, _, dec in METRICS:
        L += [f"## {title}", "", f"Unit: {unit}; **{better} is better**.", ""]
        for ph in state["phases"]:
            L += [f"### underlay MTU {ph['mtu']}", ""]
            L += metric_table(ph, summary.get(ph["mtu"], {}), key, dec)
            L.append("")

    notes = []
    for ph in state["phases"]:
        for e in ph["build_errors"]:
            notes.append(f"MTU {ph['mtu']}: testbed error: {e}")
        for n in ph["notes"]:
            notes.append(f"MTU {ph['mtu']}: {n}")
        for cfg, c in ph["configs"].items():
            if not c["available"]:
                notes.append(f"MTU {ph['mtu']}: {cfg} unavailable: {c['reason']}")
            if c.get("mode_reply"):
                notes.append(f"MTU {ph['mtu']}: {cfg}: SET mode reply from {c['mode_reply'].split('; h2:')[0]}")
            for r in c["repeats"]:
                for e in r["errors"]:
                    notes.append(f"MTU {ph['mtu']}, repeat {r['repeat'] + 1}, {cfg}: {e}")
                for h, d in (r.get("drops") or {}).items():
                    notes.append(f"MTU {ph['mtu']}, repeat {r['repeat'] + 1}, {cfg}: {h} drop/error counters "
                                 f"rose during the measurements: " + ", ".join(f"{k}=+{v}" for k, v in d.items()))
        for l in ph.get("vnetd_logs", []):
            if l["problems"]:
                notes.append(f"MTU {ph['mtu']}: vnetd h{l['host']} (start {l['start']}, exit {l['returncode']}) "
                             f"logged: " + " / ".join(f"`{x}`" for x in l["problems"][:5]))
            elif l["returncode"] not in (0, None):
                notes.append(f"MTU {ph['mtu']}: vnetd h{l['host']} exited {l['returncode']}")
    L += ["## Notes", "",
          "- The system is shared: CPU % is whole-CPU busy time from /proc/stat (anything else running on "
          "cpu0/cpu1 counts too; kernel softirq work is charged to whichever CPU ran it).",
          "- sockperf reports one-way latency = round trip / 2; ping reports the full round trip.",
          "- Ping payloads larger than the guest MTU are IP-fragmented (e.g. 4096 and 8192 B at MTU 1500)."]
    L += [f"- {n}" for n in notes] if notes else ["- No errors."]
    L.append("")
    return "\n".join(L)


def make_plots(state, summary, stamp) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        state["meta"].setdefault("warnings", []).append(f"no plots: matplotlib unavailable ({e})")
        return []
    files = []
    phases = [ph for ph in state["phases"] if ph["built"]]
    if not phases:
        return []
    configs = state["meta"]["configs"]

    # RTT vs payload size, one panel per underlay MTU (cf. VNET/P figure 9).
    fig, axes = plt.subplots(1, len(phases), figsize=(6 * len(phases), 4.5), squeeze=False)
    for ax, ph in zip(axes[0], phases):
        s = summary.get(ph["mtu"], {})
        for cfg in configs:
            xs, ys, lo, hi = [], [], [], []
            for size in PING_SIZES:
                st = get(s.get(cfg, {}), f"ping{size}")
                if st:
                    xs.append(size)
                    ys.append(st["median"])
                    lo.append(st["median"] - st["min"])
                    hi.append(st["max"] - st["median"])
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=cfg)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(PING_SIZES, [str(x) for x in PING_SIZES])
        ax.set_xlabel("ICMP payload (bytes)")
        ax.set_ylabel("RTT (µs, log scale), median of repeats")
        ax.set_title(f"Ping RTT, underlay MTU {ph['mtu']}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    name = f"{stamp}-rtt.png"
    fig.savefig(RESULTS / name, dpi=110)
    plt.close(fig)
    files.append(name)

    # TCP and UDP throughput bars per configuration and MTU (cf. VNET/P figure 8).
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), squeeze=False)
    width = 0.8 / len(phases)
    for ax, (key, title) in zip(axes[0], (("tcp", "TCP throughput"), ("udp", "UDP goodput"))):
        for j, ph in enumerate(phases):
            s = summary.get(ph["mtu"], {})
            xs, ys, lo, hi = [], [], [], []
            for k, cfg in enumerate(configs):
                st = get(s.get(cfg, {}), key)
                if st:
                    xs.append(k + (j - (len(phases) - 1) / 2) * width)
                    ys.append(st["median"])
                    lo.append(st["median"] - st["min"])
                    hi.append(st["max"] - st["median"])
            bars = ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=f"MTU {ph['mtu']}")
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.set_xticks(range(len(configs)), configs, rotation=15)
        ax.set_ylabel("Gbit/s, median of repeats")
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    name = f"{stamp}-throughput.png"
    fig.savefig(RESULTS / name, dpi=110)
    plt.close(fig)
    files.append(name)
    return files


def write_results(state, stamp) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    state["meta"]["load_end"] = loadavg()
    summary = summarize(state)
    raw = {"meta": state["meta"],
           "phases": state["phases"],
           "summary": {str(m): s for m, s in summary.items()}}
    (RESULTS / f"{stamp}.json").write_text(json.dumps(raw, indent=1, default=str))
    plots = []
    try:
        plots = make_plots(state, summary, stamp)
    except Exception as e:  # noqa: BLE001
        state["meta"].setdefault("warnings", []).append(f"plotting failed: {e}")
        traceback.print_exc()
    md = write_markdown(state, summary, stamp, plots)
    path = RESULTS / f"{stamp}.md"
    path.write_text(md)
    shutil.copyfile(path, RESULTS / "latest.md")
    return path


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------

def parse_args(argv):
    ap = argparse.ArgumentParser(description="VNET benchmark: native vs kernel VXLAN vs vnetd dispatch modes, "
                                             "in a two-host namespace testbed. Run as root.")
    ap.add_argument("--repeats", type=int, help="repeats per configuration (default 5; --quick: 1)")
    ap.add_argument("--duration", type=int, help="seconds per iperf3/sockperf test (default 5; --quick: 2)")
    ap.add_argument("--ping-count", type=int, help="pings per payload size (default 20; --quick: 5)")
    ap.add_argument("--quick", action="store_true", help="smoke test: repeats 1, duration 2, ping count 5")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help=f"comma-separated, from {','.join(ALL_CONFIGS)} (default {','.join(DEFAULT_CONFIGS)}; "
                         "'vnet' = vnetd in its default mode, no SET mode)")
    ap.add_argument("--mtus", default="1500,9000", help="underlay MTUs, one phase each (default 1500,9000)")
    ap.add_argument("--wait-idle", type=float, default=0, metavar="S",
                    help="before each configuration, wait up to S seconds for both CPUs to be under 20%% busy "
                         "with other load (default 0: only measure that load)")
    ap.add_argument("--no-setup", action="store_true", help="do not run bench/setup")
    ap.add_argument("--no-build", action="store_true", help="do not run cargo build --release")
    ap.add_argument("--bin", type=Path, help="take vnetd and vnetctl from this directory (implies --no-build)")
    a = ap.parse_args(argv)
    a.repeats = a.repeats if a.repeats is not None else (1 if a.quick else 5)
    a.duration = a.duration if a.duration is not None else (2 if a.quick else 5)
    a.ping_count = a.ping_count if a.ping_count is not None else (5 if a.quick else 20)
    a.configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = [c for c in a.configs if c not in ALL_CONFIGS]
    if bad or not a.configs:
        ap.error(f"unknown configuration(s) {bad}; choose from {','.join(ALL_CONFIGS)}")
    try:
        a.mtus = [int(m) for m in a.mtus.split(",") if m.strip()]
    except ValueError:
        ap.error("--mtus: comma-separated integers")
    if not a.mtus or any(m < 576 or m > 65535 for m in a.mtus):
        ap.error("--mtus: each between 576 and 65535")
    if a.repeats < 1 or a.duration < 1 or a.ping_count < 1:
        ap.error("--repeats, --duration and --ping-count must be at least 1")
    return a


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if os.geteuid() != 0:
        log("bench/run.py: run as root (it makes network namespaces)")
        return 2
    for tool in ("ip", "taskset"):
        if not shutil.which(tool):
            log(f"bench/run.py: {tool} not found; cannot build the testbed")
            return 2

    started = dt.datetime.now()
    stamp = started.strftime("%Y-%m-%d-%H%M%S")
    warnings = []
    if not args.no_setup:
        w = run_setup()
        if w:
            warnings.append(w)
    if not args.no_build and args.bin is None:
        w = build()
        if w:
            warnings.append(w)

    bindir = Path(tempfile.mkdtemp(prefix="vnet-bench-bin-"))
    ncpu = os.cpu_count() or 1
    cpus = {1: 0, 2: 1 if ncpu > 1 else 0}
    if ncpu < 2:
        warnings.append("only one CPU: both hosts share CPU 0")
    state = {
        "meta": {"date": started.strftime("%Y-%m-%d %H:%M:%S"), "stamp": stamp,
                 "command": "python3 " + shlex.join(sys.argv) if argv is None else shlex.join(argv),
                 "cwd": os.getcwd(), "machine": machine_info(), "git": git_info(),
                 "binaries": snapshot_binaries(bindir, args.bin), "tools": tool_versions(),
                 "repeats": args.repeats, "duration": args.duration, "wait_idle": args.wait_idle, "ping_count": args.ping_count,
                 "ping_sizes": PING_SIZES, "mtus": args.mtus, "configs": args.configs,
                 "cpus": {"1": cpus[1], "2": cpus[2]}, "load_start": loadavg(), "warnings": warnings},
        "phases": [], "beds": [], "exit": 0,
    }
    state["have_vnetd"] = bool(state["meta"]["binaries"].get("vnetd")) and \
        bool(state["meta"]["binaries"].get("vnetctl"))

    os.environ["VNET_BIN"] = str(bindir)      # netlab reads it at import
    sys.path.insert(0, str(REPO / "tests"))
    import netlab  # noqa: E402

    def on_term(signum, frame):
        raise Interrupted(f"signal {signum}")

    old_term = signal.signal(signal.SIGTERM, on_term)
    old_int = signal.signal(signal.SIGINT, on_term)
    code = 0
    try:
        for mtu in args.mtus:
            bed_phase = run_phase(netlab, mtu, args, cpus, state)
            bed = state["beds"][-1]
            sig = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                bed.close()
            finally:
                signal.signal(signal.SIGINT, sig)
            del bed_phase
        code = state["exit"]
    except Interrupted as e:
        log(f"\ninterrupted ({e}); cleaning up and writing partial results")
        state["meta"]["interrupted"] = True
        code = 130
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        state["meta"].setdefault("warnings", []).append("harness error: " + traceback.format_exc(limit=3))
        code = 2
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for bed in state["beds"]:
            try:
                bed.close()
            except Exception:  # noqa: BLE001
                traceback.print_exc()
        shutil.rmtree(bindir, ignore_errors=True)
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)

    state.pop("beds")
    path = write_results(state, stamp)
    log(f"\nresults: {path}\n         {RESULTS / 'latest.md'}")
    if code:
        log(f"exit {code}: " + ("interrupted" if code == 130 else "part of the testbed could not be built (see Notes)"))
    return code


if __name__ == "__main__":
    sys.exit(main())
