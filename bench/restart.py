#!/usr/bin/env python3
"""The outage each guest kind sees when vnetd on its host restarts, in one
interleaved run. Two hosts; vnetd on host 1 is

  kill      SIGKILLed, and started again (same binary, same config) after a
            fixed down time (--down, default 2 s)
  upgrade   running the previous commit's build (scripts/build-previous, or
            --old-bin), SIGTERMed, and the current build started with the same
            config as soon as the old one has exited
  term      SIGTERMed and the same build started again at once (what
            `systemctl restart` does; an upgrade between two builds that both
            pin the kernel datapath)
  takeover  the same build started with --takeover while the running one
            goes on: the running one hands over its kept descriptors (the
            TAPs' files, the link sockets) and exits (an upgrade by
            hand-over, docs/operations.md)

while a probe stream crosses it, one guest kind at a time:

  veth          veth guests g1 (h1) <-> g2 (h2), carried by the kernel fast
                path (pinned in bpffs: it should not notice vnetd going)
  managed       veth guests g9 (h1) <-> g10 (h2), g9 attached at run time
                (not in h1's config: as the CNI plugin and vnet-agent attach
                guests on a managed host), so only vnetd's state file
                (--state) brings it back; a build without one has it
                attached again by a request once it answers
  tap           persistent TAP guests g3 (h1) <-> g4 (h2) that vnetd made in
                the guests' namespaces (`INTERFACE ADD .. netns ..`), user path
  vhost         a QEMU VM (TCG) on h1 on a vhost-user NIC that vnetd serves
                (QEMU `-chardev socket,..,reconnect=1` connects again), and a
                persistent TAP guest g6 on h2
  vhost-client  the same with QEMU serving the socket (`server=on`) and vnetd
                connecting to it (`vhost-user .. client`), TAP guest g8 on h2

The probe is ICMP echo at --rate per second (default 1000) with a sequence
number in each request, sent from the h1 guest to the h2 guest (for the VMs,
from the h2 guest to the VM: the VM has no prober), the guest kernels
answering. Per measurement: probes sent, lost (never answered), the longest
gap between two replies arriving (ms), and "after back": from the moment the
restarted vnetd first answers a request on its control socket to the first
reply that arrives after it (ms; about one probe interval when traffic never
stopped), and the probes sent after that moment that were lost. Each
(kind, event) is measured --repeats times (default 3), interleaved: for each
repeat, for each event, each kind in turn (the order reversed every other
repeat); printed as min / median / max.

All guests are on the same two vnetds all the time (one config per host);
only the measured kind's probe runs. The prober is a Python raw socket
under `chrt -f 1` (as vnetd's event-driven dispatchers), so that other load
does not hold its sends back; its own longest pause is reported. Before each
`upgrade`, h1 is put on the old build: the current vnetd SIGTERMed, its
pinned datapath removed (`vnetd --cleanup`), the old build started (with
--pin-dir if it knows it) and the kind's peer pinged until it answers; so
the upgrade adopts what the old build pinned. While the stream runs after
vnetd is back, h1's NIC of the kind is polled every 10 ms (INTERFACE LIST,
STATS): when a VM's frontend is connected and when vnetd first passes a
frame to and from the guest, a second table; every row's raw numbers,
the restarted vnetd's log (timed from "back") and its drop counters are in
the JSON.

    sudo python3 bench/restart.py [--repeats 3] [--down 2] [--rate 1000]
        [--kinds veth,tap,vhost,vhost-client] [--events kill,upgrade,term]
        [--bin DIR] [--old-bin DIR | --previous COMMIT]

Writes bench/results/<date>-restart.{md,json}. A benchmark: it prints
figures, never pass/fail; it fails only when the testbed cannot be built.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
KINDS = ["veth", "managed", "tap", "vhost", "vhost-client"]
EVENTS = ["kill", "upgrade", "term", "takeover"]


def snapshot(src: Path, dest: Path) -> dict:
    """Copies vnetd and vnetctl from `src` into `dest` (so that a rebuild
    while this runs changes nothing measured); returns their SHA-256s."""
    dest.mkdir(parents=True, exist_ok=True)
    info = {"from": str(src)}
    for name in ("vnetd", "vnetctl"):
        shutil.copy2(src / name, dest / name)
        info[name] = hashlib.sha256((dest / name).read_bytes()).hexdigest()[:16]
    info["built"] = dt.datetime.fromtimestamp((src / "vnetd").stat().st_mtime).isoformat(timespec="seconds")
    return info


# Both binaries are copied before netlab is imported: netlab reads VNET_BIN
# when imported (vnetctl for every request comes from there).
AP = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
AP.add_argument("--repeats", type=int, default=3)
AP.add_argument("--down", type=float, default=2.0, help="seconds vnetd stays dead after SIGKILL (kill)")
AP.add_argument("--rate", type=float, default=1000.0, help="probes per second")
AP.add_argument("--before", type=float, default=1.0, help="seconds of probes before the event")
AP.add_argument("--after", type=float, default=3.0, help="seconds of probes after vnetd answers again")
AP.add_argument("--kinds", default=",".join(KINDS))
AP.add_argument("--events", default=",".join(EVENTS))
AP.add_argument("--bin", help="the current vnetd/vnetctl (default: $VNET_BIN, else target/release)")
AP.add_argument("--old-bin", help="the old vnetd for `upgrade` (default: scripts/build-previous --previous)")
AP.add_argument("--previous", default="", help="the commit whose build is the old binary (default: scripts/build-previous's, "
                "the one before the newest change to vnetd's sources)")
AP.add_argument("--out", default=str(BENCH / "results"), help="where the report goes (default bench/results)")
ARGS = AP.parse_args()
WORK = Path(tempfile.mkdtemp(prefix="vnet-restart-bench-"))
CUR_SRC = Path(ARGS.bin or os.environ.get("VNET_BIN") or REPO / "target" / "release")
BINS = {"current": snapshot(CUR_SRC, WORK / "current")}
os.environ["VNET_BIN"] = str(WORK / "current")
sys.path.insert(0, str(REPO / "tests"))
from netlab import Lab, Vnetd, guest_mac, mesh_config, takes_flag  # noqa: E402
from vm import guest  # noqa: E402
from vm.guest import Console  # noqa: E402

CUR = WORK / "current"
OLD = WORK / "old"

# The probe: ICMP echo requests at a fixed rate from a raw socket, a 32-bit
# sequence number in each payload; every send and every first reply
# timestamped with CLOCK_MONOTONIC (the same clock the harness reads, across
# namespaces). SIGINT ends the sending; replies are awaited 1 s more; then
# one JSON line: send times, reply times (null: never answered).
PROBER = r"""
import json, os, select, signal, socket, struct, sys, time
dst, rate = sys.argv[1], float(sys.argv[2])
iv = 1.0 / rate
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
s.setblocking(False)
ident = os.getpid() & 0xFFFF
stop = []
signal.signal(signal.SIGINT, lambda *a: stop.append(1))
def csum(b):
    t = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    t = (t >> 16) + (t & 0xFFFF)
    t += t >> 16
    return ~t & 0xFFFF
sent, recv, errors = [], {}, 0
pad = bytes(52)
def drain():
    while True:
        try:
            p = s.recv(2048)
        except BlockingIOError:
            return
        now = time.monotonic()
        ihl = (p[0] & 15) * 4
        if len(p) < ihl + 12:
            continue
        typ, _, _, pid, _ = struct.unpack("!BBHHH", p[ihl:ihl + 8])
        if typ != 0 or pid != ident:
            continue
        n = struct.unpack("!I", p[ihl + 8:ihl + 12])[0]
        if n < len(sent) and n not in recv:
            recv[n] = now
print("ready", flush=True)
nxt = time.monotonic()
while not stop:
    now = time.monotonic()
    if now >= nxt:
        n = len(sent)
        body = struct.pack("!I", n) + pad
        c = csum(struct.pack("!BBHHH", 8, 0, 0, ident, n & 0xFFFF) + body)
        t = time.monotonic()
        try:
            s.sendto(struct.pack("!BBHHH", 8, 0, c, ident, n & 0xFFFF) + body, (dst, 0))
        except OSError:
            errors += 1
        sent.append(t)
        nxt += iv
        if nxt < t - iv:
            nxt = t  # fell behind (descheduled): carry on, no burst
        continue
    select.select([s], [], [], max(0.0, nxt - now))
    drain()
end = time.monotonic() + 1.0
while time.monotonic() < end:
    select.select([s], [], [], 0.05)
    drain()
print(json.dumps({"sent": sent, "recv": [recv.get(i) for i in range(len(sent))], "send_errors": errors}))
"""

# What the VMs run once up: nothing (their kernels answer the probes).
VM_SCRIPT = "echo VNET-IDLE\nwhile :; do sleep 3600; done\n"


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def ask(sock: Path, timeout=30.0) -> bool:
    """One request on vnetd's control socket; True once it answered OK."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    try:
        s.connect(str(sock))
        s.sendall(b"SHOW\n")
        return s.makefile("rb").readline().startswith(b"OK")
    except OSError:
        return False
    finally:
        s.close()


class Bed:
    """Two hosts, one guest pair per kind, vnetd h1 restartable."""

    def __init__(self, lab: Lab, kinds: list[str]):
        self.lab, self.kinds = lab, kinds
        self.h1, self.h2 = lab.add_host(1), lab.add_host(2)
        self.ns = {}
        by_host, attach = {1: [], 2: []}, {}
        vm_mac = {"vhost": "52:54:00:00:00:05", "vhost-client": "52:54:00:00:00:07"}
        pairs = {"veth": (1, 2), "tap": (3, 4), "vhost": (5, 6), "vhost-client": (7, 8), "managed": (9, 10)}
        for k in kinds:
            a, b = pairs[k]
            for n, h in ((a, 1), (b, 2)):
                if k.startswith("vhost") and n == a:
                    by_host[1].append((f"vm{a}", vm_mac[k]))
                    attach[f"vm{a}"] = f"vhost-user vm{a}.sock" + (" client" if k == "vhost-client" else "")
                    continue
                self.ns[n] = lab.guest_ns(f"g{n}")
                by_host[h].append((f"g{n}", guest_mac(n)))
                attach[f"g{n}"] = f"netns {self.ns[n]}" + (" veth" if k in ("veth", "managed") else "")
        self.conf = {}
        for h in (1, 2):
            self.conf[h] = lab.tmp / f"h{h}.conf"
            self.conf[h].write_text(mesh_config(h, by_host, mtu=1458, attach=attach))
        # The managed guest's lines leave h1's config for a request made
        # at run time.
        self.runtime = ""
        if "managed" in kinds:
            full = self.conf[1].read_text().splitlines()
            self.runtime = "".join(l + "\n" for l in full if guest_mac(9) in l or " g9 " in l)
            self.conf[1].write_text("".join(l + "\n" for l in full if not (guest_mac(9) in l or " g9 " in l)))
        self.consoles = {}
        # QEMU serves vm7's socket: it must be there before vnetd connects.
        if "vhost-client" in kinds:
            self.boot_vm(7, vm_mac["vhost-client"], server=True)
        self.d1 = self.start(self.h1, 1, CUR, pinned=True)
        self.attach_runtime(self.d1)
        self.d2 = self.start(self.h2, 2, CUR, pinned=True)
        if "vhost" in kinds:
            self.boot_vm(5, vm_mac["vhost"], server=False)
        for n, ns in self.ns.items():
            lab.x(ns, "ip", "addr", "add", f"198.19.0.{n}/24", "dev", f"g{n}")
            lab.x(ns, "ip", "link", "set", f"g{n}", "up")
        for n, c in self.consoles.items():
            c.wait_for("VNET-IDLE", timeout=120)
        # (namespace of the prober, address it probes)
        self.probe = {"veth": (self.ns.get(1), "198.19.0.2"), "managed": (self.ns.get(9), "198.19.0.10"),
                      "tap": (self.ns.get(3), "198.19.0.4"),
                      "vhost": (self.ns.get(6), "198.19.0.5"), "vhost-client": (self.ns.get(8), "198.19.0.7")}
        # The kind's NIC on h1 (vnetd's interface name).
        self.nic = {"veth": "g1", "managed": "g9", "tap": "g3", "vhost": "vm5", "vhost-client": "vm7"}
        # The probing guest's device (in the namespace of self.probe).
        self.probe_dev = {"veth": "g1", "managed": "g9", "tap": "g3", "vhost": "g6", "vhost-client": "g8"}
        self.binary = "current"

    def attach_runtime(self, d: Vnetd):
        """The managed guest attached by a request (when `d` does not have
        it already: restored from its state file)."""
        if self.runtime and "name=g9 " not in d.ctl("INTERFACE", "LIST").stdout:
            d.ctl_file(self.runtime)

    def boot_vm(self, n: int, mac: str, server: bool):
        cmd = guest.qemu_vhost_user_command(self.lab.tmp / f"vm{n}.sock", mac, f"198.19.0.{n}/24", VM_SCRIPT,
                                            mem_mb=128, server=server)
        vm = self.lab.popen(self.h1, *cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        self.consoles[n] = Console(vm)

    def start(self, host: str, h: int, binary: Path, pinned: bool, wait=True, extra=()) -> Vnetd:
        """vnetd from `binary` on `host` with its config (as Lab.start_vnetd,
        but `--pin-dir` only for a build that pins: the old one may not
        know the option)."""
        lab = self.lab
        sock = lab.tmp / f"h{h}.sock"
        log = lab.tmp / f"h{h}-vnetd-{len(lab.daemons)}.log"
        cmd = [binary / "vnetd", "--control-unix", sock, "--link-key-dir", lab.key_dir,
               "--vhost-user-dir", lab.tmp, "--config", self.conf[h]]
        if pinned:
            cmd += ["--pin-dir", lab.pin_dir(host)]
        if takes_flag(binary / "vnetd", "--state"):
            cmd += ["--state", lab.state_file(host)]
        cmd += list(extra)
        with open(log, "a") as lf:
            proc = subprocess.Popen(["ip", "netns", "exec", host, *map(str, cmd)], stdout=lf, stderr=subprocess.STDOUT)
        d = Vnetd(lab, host, sock, proc, log)
        d.config = self.conf[h]
        lab.daemons.append(d)
        if wait:
            lab.wait_ready(d, timeout=30)
        return d

    def answers(self, kind: str, timeout=20.0) -> bool:
        """Pings the kind's peer until it answers (ARP resolved, a VM
        reconnected)."""
        ns, ip = self.probe[kind]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.lab.x(ns, "ping", "-n", "-q", "-c", "1", "-W", "1", ip, check=False).returncode == 0:
                return True
        return False

    def downgrade(self):
        """h1 onto the old build: the current one stopped, its pinned
        datapath removed (so that the old build makes its own, which the
        upgrade then adopts; a build that knows no pins would leave the
        attachments beside its own), the old one started (pinned, if it
        knows how)."""
        self.d1.stop(signal.SIGTERM, timeout=30)
        self.lab.x(self.h1, CUR / "vnetd", "--cleanup", "--pin-dir", self.lab.pin_dir(self.h1), "--state", "none")
        self.d1 = self.start(self.h1, 1, OLD, pinned=BINS["old"]["pins"])
        self.attach_runtime(self.d1)
        self.binary = "old"

    def restart(self, event: str, down: float) -> dict:
        """The event on vnetd h1; returns its times (CLOCK_MONOTONIC)."""
        t_stop = time.monotonic()
        if event == "takeover":
            old = self.d1
            d = self.start(self.h1, 1, CUR, pinned=True, wait=False, extra=["--takeover"])
            t_spawn = time.monotonic()
            old.proc.wait(timeout=30)
            old.stopped_with = signal.SIGTERM
            t_exit = time.monotonic()
            while not ask(d.sock):
                if d.proc.poll() is not None:
                    raise RuntimeError(f"vnetd h1 exited {d.proc.returncode} at the takeover:\n{d.log_text()}")
                if time.monotonic() - t_spawn > 30:
                    raise RuntimeError(f"vnetd h1 not back in 30 s:\n{d.log_text()}")
                time.sleep(0.002)
            t_back, wall_back = time.monotonic(), time.time()
            self.d1, self.binary = d, "current"
            return {"t_stop": t_stop, "t_exit": t_exit, "t_spawn": t_spawn, "t_back": t_back, "wall_back": wall_back,
                    "old_exit": old.proc.returncode, "vnetd": d}
        if event == "kill":
            self.d1.stop(signal.SIGKILL)
            time.sleep(max(0.0, down - (time.monotonic() - t_stop)))
        else:
            self.d1.stop(signal.SIGTERM, timeout=30)
        t_exit = time.monotonic()
        old_rc = self.d1.proc.returncode
        d = self.start(self.h1, 1, CUR, pinned=True, wait=False)
        t_spawn = time.monotonic()
        while not ask(d.sock):
            if d.proc.poll() is not None:
                raise RuntimeError(f"vnetd h1 exited {d.proc.returncode} at restart:\n{d.log_text()}")
            if time.monotonic() - t_spawn > 30:
                raise RuntimeError(f"vnetd h1 not back in 30 s:\n{d.log_text()}")
            time.sleep(0.002)
        t_back, wall_back = time.monotonic(), time.time()
        self.d1, self.binary = d, "current"
        return {"t_stop": t_stop, "t_exit": t_exit, "t_spawn": t_spawn, "t_back": t_back, "wall_back": wall_back,
                "old_exit": old_rc, "vnetd": d}


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def log_since_back(d: Vnetd, wall_back: float) -> list[tuple[float, str]]:
    """The restarted vnetd's log lines as (ms after it answered, text)."""
    out = []
    for line in d.log_text().splitlines():
        line = ANSI.sub("", line).strip()
        stamp, _, text = line.partition(" ")
        try:
            t = dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.timezone.utc).timestamp()
        except ValueError:
            continue
        out.append((round((t - wall_back) * 1e3, 1), text.strip()))
    return out


class Session:
    """A control session on vnetd's Unix socket, kept for many requests."""

    def __init__(self, sock: Path):
        self.s = socket.socket(socket.AF_UNIX)
        self.s.settimeout(10)
        self.s.connect(str(sock))
        self.f = self.s.makefile("rwb")

    def request(self, line: str) -> list[str]:
        self.f.write(line.encode() + b"\n")
        self.f.flush()
        status = self.f.readline().decode()
        n = int(status[3:]) if status.startswith("OK ") else 0
        return [self.f.readline().decode().rstrip("\n") for _ in range(n)]

    def close(self):
        self.s.close()


def watch(sock: Path, nic: str, t_back: float, t_end: float) -> dict:
    """Until `t_end`, every 10 ms: is the restarted vnetd's NIC `nic`
    connected (vhost-user), and has it passed a frame to the guest (out)
    and from it (in). Each the first time seen, in ms after `t_back`
    (None: not within the window). The user path's counters: a veth
    guest's frames are the kernel's and are not counted here."""
    seen = {"connected_ms": None, "first_out_ms": None, "first_in_ms": None}
    try:
        s = Session(sock)
    except OSError:
        return seen
    try:
        while time.monotonic() < t_end and None in seen.values():
            t = (time.monotonic() - t_back) * 1e3
            listing = next((l for l in s.request("INTERFACE LIST") if f" name={nic} " in l), "")
            stats = next((l for l in s.request("STATS") if l.startswith("interface ") and f" name={nic} " in l), "")
            kv = dict(w.split("=", 1) for w in stats.split() if "=" in w)
            if "vhost-user=" not in listing:
                seen.pop("connected_ms", None)  # not a vhost-user NIC
            elif seen["connected_ms"] is None and "connected=yes" in listing:
                seen["connected_ms"] = round(t, 1)
            if seen["first_out_ms"] is None and int(kv.get("out_frames", 0)) > 0:
                seen["first_out_ms"] = round(t, 1)
            if seen["first_in_ms"] is None and int(kv.get("in_frames", 0)) > 0:
                seen["first_in_ms"] = round(t, 1)
            time.sleep(0.01)
    except (OSError, ValueError):
        pass
    finally:
        s.close()
    return seen


def drops(counters: dict) -> dict:
    return {k: v for k, v in counters.items() if k.startswith("drop_") and isinstance(v, int) and v}


def analyse(data: dict, ev: dict) -> dict:
    sent, recv = data["sent"], data["recv"]
    t_back = ev["t_back"]
    arrivals = sorted(r for r in recv if r is not None)
    # Gaps between replies arriving; the stream's end counts as a point, so
    # that an outage still open at the end is seen.
    points = arrivals + [max(sent[-1], arrivals[-1] if arrivals else 0)]
    gap, gap_at = 0.0, None
    for a, b in zip(points, points[1:]):
        if b - a > gap:
            gap, gap_at = b - a, a
    after = [r for r in arrivals if r >= t_back]
    rtts = [r - s for s, r in zip(sent, recv) if r is not None]
    pause = max((b - a for a, b in zip(sent, sent[1:])), default=0.0)
    return {
        "sent": len(sent),
        "lost": sum(r is None for r in recv),
        "send_errors": data["send_errors"],
        "gap_ms": gap * 1e3,
        "gap_from_stop_ms": (gap_at - ev["t_stop"]) * 1e3 if gap_at is not None else None,
        "after_back_ms": (after[0] - t_back) * 1e3 if after else None,
        "lost_after_back": sum(1 for s, r in zip(sent, recv) if s >= t_back and r is None),
        "pause_ms": pause * 1e3,  # the prober's own longest pause between two sends (descheduled)
        "late": sum(1 for x in rtts if x > 0.1),  # answered, but held > 100 ms (queued while vnetd was away)
        "rtt_max_ms": max(rtts) * 1e3 if rtts else None,
        "rtt_median_ms": statistics.median(rtts) * 1e3 if rtts else None,
        "down_ms": (t_back - ev["t_stop"]) * 1e3,
        "start_ms": (t_back - ev["t_spawn"]) * 1e3,
        "stop_ms": (ev["t_exit"] - ev["t_stop"]) * 1e3,
    }


def measure(bed: Bed, kind: str, event: str, a) -> dict:
    row = {"kind": kind, "event": event, "load_before": loadavg()}
    if event == "upgrade":
        bed.downgrade()
    if not bed.answers(kind):
        row["error"] = f"{kind}: no answer before the event (vnetd h1: {bed.binary})"
        return row
    ns, ip = bed.probe[kind]
    h2_drops = drops(bed.d2.stats()["global"])
    # drop_upcall_full is the TAP's own tx_dropped, kept by the kernel across
    # vnetds: counted from here. (vnetd's own drop_* start at 0 with it.)
    tap_dropped0 = bed.d1.stats().get(f"interface {bed.nic[kind]}", {}).get("drop_upcall_full", 0)
    # ARP in the probing guest's namespace: the guest (or, for the VMs, the
    # VM, whose ARP crosses to it) resolving its peer again after the event.
    arp = bed.lab.popen(ns, "tcpdump", "-n", "-l", "-tt", "-i", bed.probe_dev[kind], "arp",
                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    time.sleep(0.3)  # tcpdump listening
    # Real-time (FIFO 1, as vnetd's event-driven dispatchers), so that other
    # load on the machine does not hold the prober's sends back.
    p = bed.lab.popen(ns, "chrt", "-f", "1", sys.executable, "-c", PROBER, ip, a.rate, stdout=subprocess.PIPE, text=True)
    if p.stdout.readline().strip() != "ready":
        row["error"] = "prober did not start"
        return row
    time.sleep(a.before)
    t_end = None
    try:
        ev = bed.restart(event, a.down)
        t_end = ev["t_back"] + a.after
        timeline = watch(ev["vnetd"].sock, bed.nic[kind], ev["t_back"], t_end)
    finally:
        time.sleep(max(0.0, t_end - time.monotonic()) if t_end else a.after)
        p.send_signal(signal.SIGINT)
        out = p.communicate(timeout=60)[0]
        arp.send_signal(signal.SIGINT)
        arp_out = arp.communicate(timeout=30)[0]
    row.update(analyse(json.loads(out.strip().splitlines()[-1]), ev))
    row.update(timeline)
    # ARP seen after the event, in ms after "back"; the first reply's time.
    stop_wall = ev["wall_back"] - (ev["t_back"] - ev["t_stop"])
    row["arp"] = [(round((float(w[0]) - ev["wall_back"]) * 1e3, 1), " ".join(w[1:8]))
                  for w in (line.split() for line in arp_out.splitlines()) if w and float(w[0]) >= stop_wall]
    replies = [t for t, text in row["arp"] if "Reply" in text]
    row["arp_reply_ms"] = replies[0] if replies else None
    # The restarted vnetd's own account, timed from when it answered (its
    # config applied, its fast path adopted, a VM's frontend connected).
    row["vnetd_log"] = log_since_back(ev["vnetd"], ev["wall_back"])
    # Frames the restarted vnetd dropped (all its life is this measurement),
    # at the kind's NIC on h1 and in all; and h2's over the measurement.
    st = bed.d1.stats()
    nic = dict(st.get(f"interface {bed.nic[kind]}", {}))
    if "drop_upcall_full" in nic:
        nic["drop_upcall_full"] -= tap_dropped0
    row["h1_nic_drops"] = drops(nic)
    row["h1_drops"] = drops(st["global"])
    row["h2_drops"] = {k: v - h2_drops.get(k, 0) for k, v in drops(bed.d2.stats()["global"]).items()
                       if v != h2_drops.get(k, 0)}
    row["h1_nic_dropped"] = sum(row["h1_nic_drops"].values())
    row["old_exit"] = ev["old_exit"]
    row["load_after"] = loadavg()
    return row


COLUMNS = [("down_ms", "vnetd down (ms)", 0), ("start_ms", "vnetd start (ms)", 0), ("sent", "sent", 0),
           ("lost", "lost", 0), ("gap_ms", "longest gap (ms)", 1), ("after_back_ms", "after back (ms)", 1),
           ("lost_after_back", "lost after back", 0), ("late", "late (> 100 ms)", 0),
           ("pause_ms", "prober's longest pause (ms)", 1)]
# Where the time after vnetd is back goes, at h1's NIC of the kind (its
# user-path counters: nothing for veth, whose frames the kernel carries).
TIMELINE = [("connected_ms", "VM connected (ms after back)", 0), ("first_out_ms", "first frame to the guest (ms)", 0),
            ("first_in_ms", "first frame from the guest (ms)", 0),
            ("arp_reply_ms", "guest's peer resolved by ARP (ms)", 0),
            ("h1_nic_dropped", "dropped at the NIC by vnetd h1", 0)]


LEGEND = """*vnetd down*: from the signal to the restarted vnetd's first answer on its control socket
("back"); *vnetd start*: from its exec to that answer. *lost*: probes never answered; *longest gap*:
the longest time between two replies arriving (an outage that includes the down time); *after
back*: from "back" to the first reply that arrives after it (about one probe interval, ~1 ms, when
traffic never stopped); *lost after back*: probes sent after "back" never answered; *late*:
answered, but more than 100 ms after they were sent (held in a queue during the outage); *prober's
longest pause*: the longest the prober itself went without sending (descheduled): a *longest gap*
no larger than it is the prober's, not the path's. For the VMs the probes go from the h2 guest to
the VM and back."""

TIMELINE_LEGEND = """Polled every 10 ms on the restarted vnetd h1 from "back" to the end: when the VM's frontend is
connected (vhost-user), and when vnetd h1 first passed a frame to the guest and from it (user-path
counters: a veth guest's frames are the kernel's, not counted); *peer resolved by ARP*: the first
ARP reply seen (tcpdump in the probing guest's namespace) after the event, if any: a guest that lost
its neighbour entry for its peer (a TAP's or a VM's link went down with vnetd) must ARP again, and
the probes wait for that (an ARP long after "back" with nothing lost, e.g. a veth guest's, is
the guest's periodic neighbour check); *dropped at the NIC*: frames the restarted vnetd dropped at that NIC in
the measurement (drop_down: for a VM whose rings are not running, e.g. not yet reconnected;
drop_upcall_full: the TAP's own tx_dropped over the measurement)."""


def summarize(rows: list[dict], kinds: list[str], events: list[str], columns=COLUMNS) -> list[str]:
    out = ["| kind | event | n | " + " | ".join(c[1] for c in columns) + " |",
           "|---|---|---|" + "---|" * len(columns)]
    for e in events:
        for k in kinds:
            rs = [r for r in rows if r["kind"] == k and r["event"] == e]
            ok = [r for r in rs if "error" not in r]
            cells = []
            for key, _, prec in columns:
                v = [r[key] for r in ok if r.get(key) is not None]
                cells.append(" / ".join(f"{x:.{prec}f}" for x in (min(v), statistics.median(v), max(v))) if v else "-")
            out.append(f"| {k} | {e} | {len(ok)}/{len(rs)} | " + " | ".join(cells) + " |")
    return out


def old_binary(a) -> Path:
    if a.old_bin:
        return Path(a.old_bin)
    p = subprocess.run([REPO / "scripts" / "build-previous", *([a.previous] if a.previous else [])], capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"scripts/build-previous {a.previous} failed:\n{p.stderr}")
    return Path(p.stdout.strip().splitlines()[-1])


def main():
    a = ARGS
    kinds, events = a.kinds.split(","), a.events.split(",")
    cmd = "sudo python3 bench/restart.py " + " ".join(sys.argv[1:])
    git = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    if subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                      text=True).stdout.strip():
        git += " (working tree has uncommitted changes)"
    prev = None
    if "upgrade" in events:
        src = old_binary(a)
        BINS["old"] = snapshot(src, OLD)
        if not a.old_bin:
            prev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", src.name],
                                  capture_output=True, text=True).stdout.strip()
        BINS["old"]["pins"] = "--pin-dir" in subprocess.run([OLD / "vnetd", "--help"], capture_output=True,
                                                            text=True).stdout
    if any(k.startswith("vhost") for k in kinds):
        guest.build()
    meta = {"command": cmd, "date": dt.datetime.now().isoformat(timespec="seconds"), "git": git, "previous": prev,
            "binaries": BINS, "nproc": os.cpu_count(), "kernel": platform.release(), "load_start": loadavg(),
            "settings": {k: getattr(a, k) for k in ("repeats", "down", "rate", "before", "after")}}
    print(json.dumps(meta), flush=True)
    rows, problems = [], []
    lab = Lab(tag="rs")
    try:
        bed = Bed(lab, kinds)
        for rep in range(a.repeats):
            for e in events:
                for k in (kinds if rep % 2 == 0 else kinds[::-1]):
                    try:
                        row = {"rep": rep, **measure(bed, k, e, a)}
                    except Exception as x:  # noqa: BLE001 -- the testbed broke: report what was measured
                        rows.append({"rep": rep, "kind": k, "event": e, "error": f"{x!r}"[:2000]})
                        raise
                    rows.append(row)
                    print(json.dumps({x: y for x, y in row.items() if x != "vnetd_log"}), flush=True)
                    if os.environ.get("RESTART_BENCH_LOG"):
                        print("\n".join(f"  {t:+9.1f} ms  {x}" for t, x in row.get("vnetd_log", [])), flush=True)
        for name, d in (("h1", bed.d1), ("h2", bed.d2)):
            meta[f"stats_{name}"] = {k: v for k, v in d.stats().items() if not k.startswith("route")}
    except Exception as x:  # noqa: BLE001
        print(f"stopped: {x!r}", file=sys.stderr)
        meta["stopped"] = f"{x!r}"[:2000]
    finally:
        problems = lab.close()
        shutil.rmtree(WORK, ignore_errors=True)
    meta["load_end"] = loadavg()
    meta["lab_problems"] = problems
    table = summarize(rows, kinds, events)
    timeline = summarize(rows, kinds, events, TIMELINE)
    stamp = dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    out = Path(a.out) / f"{stamp}-restart"
    out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    old = BINS.get("old")
    md = [f"# vnetd restarts: what the guests see, {stamp}", "", f"`{cmd}`", "",
          f"Machine: {os.cpu_count()} CPUs, kernel {platform.release()}, load {meta['load_start']} → {meta['load_end']}. "
          f"Code: git {git}; vnetd sha256 {BINS['current']['vnetd']} (built {BINS['current']['built']})"
          + (f"; old vnetd ({prev or old['from']}) sha256 {old['vnetd']}, "
             f"{'pins' if old['pins'] else 'does not pin'} its kernel datapath" if old else "") + ".",
          f"Probe: ICMP echo at {a.rate:g}/s, {a.before:g} s before the event and {a.after:g} s after vnetd answers; "
          f"kill: down {a.down:g} s. min / median / max over the repeats (n: measured / tried).", "", *table, "",
          LEGEND, "", "## Where the time after vnetd is back goes", "", *timeline, "", TIMELINE_LEGEND]
    if any("error" in r for r in rows):
        md += ["", "Errors:", *[f"- repeat {r['rep']} {r['kind']} {r['event']}: {r['error']}" for r in rows if "error" in r]]
    if meta.get("stopped"):
        md += ["", f"The run stopped early (the testbed broke): `{meta['stopped']}`"]
    if problems:
        md += ["", "Lab teardown:", *[f"- {p}" for p in problems]]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(table + [""] + timeline))
    print(f"wrote {out}.json and .md")
    if meta.get("stopped"):
        sys.exit(2)


if __name__ == "__main__":
    main()
