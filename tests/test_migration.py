"""A VM live-migrated between hosts with its network (docs/vhost-user.md,
"Live migration"): real QEMUs (TCG) on vnetd's vhost-user NICs, three hosts
with vnet-agents and a real etcd (the overlay of test_controller.py).

The VM runs on host 1; host 2 has an interface for it too (where it will
arrive) with an incoming QEMU attached. The overlay follows the running VM,
not the configuration: the MAC is claimed only where the VM's rings run, so
host 2 claims it when QEMU resumes the VM there, and host 1 withdraws when
QEMU stops it. A guest on host 3 pings the VM every 10 ms and holds a TCP
connection to it across the move.

- migrated h1 -> h2: the connection survives, every echo in order, no
  duplicate reply; the outage (longest gap between ping replies), QEMU's
  own downtime and the time the claim took to move are printed; no more
  pings lost than drops the vnetds counted; then migrated back, h2 -> h1;
- a migration cancelled during its pre-copy: the VM stays on host 1, its
  routes never move, its pings go on, host 2 never claims it.
"""

from __future__ import annotations

import json
import queue
import re
import signal
import socket
import subprocess
import time

import pytest

from pings import Capture, echoes, place
from netlab import overlay_ip, underlay_ip, wait_until
from test_controller import Overlay, converged, gkey, mac, pytestmark  # noqa: F401 (etcd needed)
from vm import guest
from vm.guest import Console

VM = 40
VM_MAC = mac(VM)
VM_IP = overlay_ip(VM)
MIG_PORT = 4444

# The VM: an echo server for the TCP connection, its interface's counts
# of frames received and sent every 0.2 s, then idle.
VM_SCRIPT = """
nc -ll -p 5201 -e cat &
s=/sys/class/net/eth0/statistics
(while true; do echo "VNET-COUNTS $(cat $s/rx_packets) $(cat $s/tx_packets)"; sleep 0.2; done) &
echo VNET-READY
sleep 100000
"""

# From host 3's guest: numbered lines echoed by the VM, each checked, until
# its standard input closes; "ok <lines> <longest wait for an echo, ms>".
CLIENT = r"""
import socket, sys, threading, time
s = socket.create_connection((sys.argv[1], 5201), timeout=30); print("connected", flush=True)
f = s.makefile("rwb")
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
i, worst = 0, 0.0
while not stop.is_set():
    t = time.monotonic()
    f.write(b"%d\n" % i); f.flush()
    got = f.readline()
    assert got == b"%d\n" % i, (i, got)
    worst = max(worst, time.monotonic() - t)
    i += 1
    time.sleep(0.01)
s.close()
print("ok", i, round(worst * 1000), flush=True)
"""


class Qmp:
    """QEMU's machine protocol on a Unix socket."""

    def __init__(self, path, timeout=30):
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.s = socket.socket(socket.AF_UNIX)
                self.s.connect(str(path))
                break
            except OSError:
                self.s.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        self.f = self.s.makefile("rw")
        json.loads(self.f.readline())  # the greeting
        self.cmd("qmp_capabilities")

    def cmd(self, name, **args):
        self.f.write(json.dumps({"execute": name, "arguments": args}) + "\n")
        self.f.flush()
        while True:
            r = json.loads(self.f.readline())
            if "event" in r:
                continue
            if "error" in r:
                raise AssertionError(f"QMP {name}: {r['error']}")
            return r["return"]

    def close(self):
        self.s.close()


class Vm:
    """One QEMU of the VM on host `i`'s vnetd (`incoming`: waiting for a
    migration on the underlay)."""

    def __init__(self, o: Overlay, i: int, incoming: bool):
        lab = o.lab
        self.qmp_path = lab.tmp / f"qmp-h{i}-{time.monotonic_ns()}.sock"
        cmd = guest.qemu_vhost_user_command(lab.tmp / f"vm-h{i}.sock", VM_MAC, f"{VM_IP}/24", VM_SCRIPT, mem_mb=128)
        cmd += ["-qmp", f"unix:{self.qmp_path},server=on,wait=off"]
        if incoming:
            cmd += ["-incoming", f"tcp:{underlay_ip(i)}:{MIG_PORT}"]
        self.proc = lab.popen(o.hosts[i], *cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.console = Console(self.proc)
        self.qmp = Qmp(self.qmp_path)

    def counts(self) -> tuple[int, int]:
        """The frames the guest's interface received and sent, as it
        printed them at least once after this call began."""
        while True:
            try:
                self.console.lines.get_nowait()
            except queue.Empty:
                break
        self.console.wait_for("VNET-COUNTS", timeout=10)
        w = self.console.wait_for("VNET-COUNTS", timeout=10).split()
        return int(w[1]), int(w[2])

    def status(self) -> str:
        return self.qmp.cmd("query-status")["status"]

    def quit(self):
        if self.proc.poll() is None:
            try:
                self.qmp.cmd("quit")
            except (OSError, ValueError, AssertionError):
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.qmp.close()


def migrate(src: Vm, to: int, timeout=120) -> dict:
    """Migrates `src` to host `to`'s incoming QEMU; QEMU's report of it."""
    src.qmp.cmd("migrate", uri=f"tcp:{underlay_ip(to)}:{MIG_PORT}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = src.qmp.cmd("query-migrate")
        if r.get("status") in ("completed", "failed", "cancelled"):
            assert r["status"] == "completed", r
            return r
        time.sleep(0.02)
    raise AssertionError("migration did not complete")


def iface(o: Overlay, i: int) -> str:
    return next(line for line in o.d[i].ctl("INTERFACE", "LIST").stdout.splitlines() if " name=vm " in line)


def claims(o: Overlay) -> set[int]:
    """The hosts whose claim of the VM's MAC stands (not released)."""
    lines = o.etcdctl("get", "--prefix", "/vnet/").stdout.splitlines()
    live = {k for k, v in zip(lines[::2], lines[1::2]) if '"released":true' not in v}
    return {i for i in o.hosts if any(k.startswith(gkey(i, VM)) for k in live)}


def vm_route(o: Overlay, i: int) -> str | None:
    """Where host i sends frames from its guest of network a to the VM."""
    src = {1: mac(11), 2: mac(12), 3: mac(13)}[i]
    for r in o.routes(i):
        w = r.split()
        if w[2] == src and w[3] == VM_MAC:
            return f"{w[4]} {w[5]}"
    return None


class Pinger:
    """Host 3's guest pinging the VM (every 10 ms by default), with timestamps."""

    def __init__(self, o: Overlay, interval=0.01):
        self.p = o.lab.popen(o.guest_ns[13], "ping", "-D", "-n", "-i", str(interval), "-W", "1", VM_IP,
                             stdout=subprocess.PIPE, text=True)

    def stop(self) -> dict:
        self.p.send_signal(signal.SIGINT)
        out = self.p.communicate(timeout=10)[0]
        replies = [(float(m.group(1)), int(m.group(2)), float(m.group(3))) for m in re.finditer(
            r"^\[(\d+\.\d+)\] \d+ bytes from .*icmp_seq=(\d+) .*time=([\d.]+) ms", out, re.M)]
        stamps = [t for t, _, _ in replies]
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        seqs = sorted({q for _, q, _ in replies})
        sent = int(re.search(r"(\d+) packets transmitted", out).group(1))
        return {"sent": sent, "replies": len(stamps), "dups": out.count("DUP!"),
                # Requests never answered between the first and the last
                # answered (the ones still in flight when ping was stopped
                # are not lost).
                "lost": seqs[-1] - seqs[0] + 1 - len(seqs) if seqs else sent,
                "lost_seqs": sorted(set(range(seqs[0], seqs[-1] + 1)) - set(seqs)) if seqs else [],
                "longest_gap_ms": round(max(gaps) * 1000) if gaps else None,
                # Requests lost in a row (the network's own outage, in pings)
                # and the slowest answer (a guest slow to answer after it
                # resumed: TCG translates its code again on the new host).
                "most_lost_in_a_row": max((b - a - 1 for a, b in zip(seqs, seqs[1:])), default=0),
                "slowest_reply_ms": round(max((r for _, _, r in replies), default=0))}


def stamp(text: str, what: str, after: float) -> float | None:
    """The time (s since the epoch) of the first log line saying `what` at
    or after `after` (tracing's RFC 3339 stamps, UTC)."""
    from datetime import datetime
    for line in text.splitlines():
        if what in line:
            m = re.match(r"(?:\x1b\[[0-9;]*m)*(\d{4}-\d\d-\d\dT[\d:.]+)Z", line)
            if m:
                t = datetime.fromisoformat(m.group(1) + "+00:00").timestamp()
                if t >= after:
                    return t
    return None


def counted(o: Overlay, i: int) -> int:
    """Frames host i's vnetd counted as dropped, all reasons, with the
    frames it held for the VM's ring and let expire (`vhost_rx_held_expired`)."""
    st = o.d[i].stats()
    total = sum(v for k, v in st["global"].items() if k.startswith("drop_") and isinstance(v, int))
    return total + st.get("interface vm", {}).get("vhost_rx_held_expired", 0)


def frames(o: Overlay, i: int) -> tuple[int, int]:
    """Frames host i's vnetd wrote into the VM's receive ring and took
    from its transmit ring (`out_frames`, `in_frames` of its interface)."""
    st = o.d[i].stats().get("interface vm", {})
    return st.get("out_frames", 0), st.get("in_frames", 0)


def quiet(o: Overlay, vm: Vm, hosts) -> tuple[tuple[int, int], dict]:
    """The guest's counts and the hosts' `frames`, read while nothing
    moved: the hosts' the same just before and just after the guest's."""
    for _ in range(20):
        v1 = {i: frames(o, i) for i in hosts}
        g = vm.counts()
        v2 = {i: frames(o, i) for i in hosts}
        if v1 == v2:
            return g, v1
    raise AssertionError(f"the VM's traffic never stopped: {v1} {v2}")


def rings(text: str, what: str, after: float) -> dict[int, tuple[int, int]]:
    """Each ring's (next avail, used) in the last log line `vhost-user
    ring <what>` (started or stopped) at or after `after`."""
    from datetime import datetime
    out = {}
    for line in text.splitlines():
        m = re.search(r"(\d{4}-\d\d-\d\dT[\d:.]+)Z.*vhost-user ring " + what + r".*queue=(\d+) next_avail=(\d+) used=(\d+)",
                      re.sub(r"\x1b\[[0-9;]*m", "", line))
        if m and datetime.fromisoformat(m.group(1) + "+00:00").timestamp() >= after:
            out[int(m.group(2))] = (int(m.group(3)), int(m.group(4)))
    return out


def held(o: Overlay, i: int) -> int:
    """Frames host i's vnetd held for the VM's receive ring while it was down."""
    return o.d[i].stats().get("interface vm", {}).get("vhost_rx_held_frames", 0)


class Echoes:
    """Every ICMP echo on host 3's guest's interface and on the three hosts'
    underlays while running (tcpdump), so a lost ping can be placed."""

    def __init__(self, o: Overlay):
        t = time.monotonic_ns()
        self.hosts = {i: Capture(o.lab, h, "eth0", o.lab.tmp / f"h{i}-{t}.pcap", "udp port 9000")
                      for i, h in o.hosts.items()}
        self.guest = Capture(o.lab, o.guest_ns[13], "g13", o.lab.tmp / f"g13-{t}.pcap", "icmp")

    def place(self, lost: list[int]) -> dict[int, str]:
        """Stops the captures (a moment after the last echo) and places each
        lost seq (`pings.place`)."""
        time.sleep(0.2)
        for c in (self.guest, *self.hosts.values()):
            c.stop()
        return place(lost, echoes(self.guest.path, None),
                     {f"h{i}": (underlay_ip(i), echoes(c.path, 9000)) for i, c in self.hosts.items()}, "h3")


def setup(lab) -> Overlay:
    """The overlay of test_controller.py, with an interface for the VM on
    hosts 1 and 2 (no QEMU yet)."""
    guest.build()
    # The agents at their default poll (10 s): what moves the routes in
    # tens of milliseconds is vnetd's `WAIT`, or nothing.
    o = Overlay(lab, interval_ms=10_000)
    o.vms = []
    for i in (1, 2):
        o.d[i].ctl("INTERFACE", "ADD", "vm", VM_MAC, "vhost-user", f"vm-h{i}.sock", "network", "a")
    converged(o)
    return o


def teardown(o: Overlay):
    for v in o.vms:
        v.quit()
    for i, p in o.agents.items():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=5)
        assert "panicked" not in o.log(i)
    o.etcd.terminate()
    o.etcd.wait(timeout=10)


@pytest.fixture
def mig(lab):
    o = setup(lab)
    yield o
    teardown(o)


def boot_on_h1(o: Overlay) -> Vm:
    """The VM running on host 1, reachable from host 3's guest."""
    # Interfaces with no running VM claim nothing, on either host.
    time.sleep(0.5)
    assert claims(o) == set()
    assert "running=no" in iface(o, 1) and "running=no" in iface(o, 2)
    vm = Vm(o, 1, incoming=False)
    o.vms.append(vm)
    vm.console.wait_for("VNET-READY", timeout=120)
    assert wait_until(lambda: "running=yes" in iface(o, 1), timeout=10), iface(o, 1)
    assert wait_until(lambda: claims(o) == {1} and vm_route(o, 3) == "edge agent.h1", timeout=10), (claims(o), o.routes(3))
    assert wait_until(lambda: o.ping(13, VM), timeout=20)
    return vm


def incoming(o: Overlay, i: int) -> Vm:
    """A QEMU on host i waiting for the VM, attached to vnetd there."""
    vm = Vm(o, i, incoming=True)
    o.vms.append(vm)
    assert wait_until(lambda: "connected=yes" in iface(o, i), timeout=20), iface(o, i)
    return vm


def move(o: Overlay, frm: int, to: int, vm_from: Vm, vm_to: Vm, ping_interval=0.01) -> dict:
    """Migrates the VM from host `frm` to `to` while host 3's guest pings it
    and holds a TCP echo stream to it; checks what a user would (the stream
    intact, no duplicate reply, each lost ping placed from captures and no
    more lost on either side, host 3's or the VM's, than that side's vnetds
    counted, nothing held for the VM on the host it left, the claim and
    routes moved, the VM reachable from its network's other guests);
    returns the figures."""
    vm_hosts = (frm, to)
    g0, v0 = quiet(o, vm_from, vm_hosts)
    srv = o.lab.popen(o.guest_ns[13], "python3", "-c", CLIENT, VM_IP, stdin=subprocess.PIPE,
                      stdout=subprocess.PIPE, text=True)
    assert srv.stdout.readline().strip() == "connected"
    caught = Echoes(o)
    pinger = Pinger(o, ping_interval)
    time.sleep(1)
    before = {i: counted(o, i) for i in o.d}
    held_before = held(o, frm)
    began = time.time()
    report = migrate(vm_from, to)
    done = time.monotonic()
    moved = wait_until(lambda: vm_route(o, 3) == f"edge agent.h{to}", timeout=10, interval=0.005)
    seen_ms = (time.monotonic() - done) * 1000
    assert moved, (o.routes(3), o.log(3))
    assert vm_to.status() == "running" and vm_from.status() == "postmigrate"
    assert wait_until(lambda: claims(o) == {to}, timeout=5), claims(o)
    assert "running=yes" in iface(o, to) and "running=no" in iface(o, frm)
    time.sleep(1.5)
    pings = pinger.stop()
    out = srv.communicate(input="", timeout=30)[0].split()
    assert out[:1] == ["ok"] and int(out[1]) > 100, out
    # Every frame the hosts wrote into the VM's receive rings, on either
    # side of the switch-over, is one the guest received (none lost in a
    # ring or written twice), counted once the traffic stopped (M13).
    g1, v1 = quiet(o, vm_to, vm_hosts)
    written = sum(v1[i][0] - v0[i][0] for i in vm_hosts)
    assert g1[0] - g0[0] == written, ("frames the guest received, against those written into its rings", g0, g1, v0, v1)
    drops = {i: counted(o, i) - before[i] for i in o.d}
    assert pings["dups"] == 0, pings
    assert pings["replies"] > 150 and pings["longest_gap_ms"] is not None, pings
    # Each lost ping placed from the captures: its request never left host
    # 3 ("h3 out", host 3 had no route to the VM), or reached host X and
    # was answered by nobody (lost on the VM's side: X's vnetd, the VM, or
    # the new host's vnetd dropping the VM's reply before its routes were
    # in), or its reply reached host 3 and not its guest ("h3 in").
    where = caught.place(pings["lost_seqs"])
    home = sum(1 for w in where.values() if w in ("h3 out", "h3 in"))
    vm_side = sum(1 for w in where.values() if w in (f"h{frm}", f"h{to}"))
    assert home + vm_side == len(where), ("lost between the hosts' underlays", where)
    # No ping lost uncounted, on either side: host 3's losses within its
    # vnetd's drops, the VM side's within the two VM hosts' drops (a bound
    # per side: a frame lost uncounted shows where it outnumbers the
    # frames of the TCP stream dropped beside it).
    assert home <= drops[3], (where, drops)
    assert vm_side <= drops[frm] + drops[to], (where, drops)
    # The old host held nothing for a VM that left it: frames for it after
    # its rings stopped were dropped and counted (`drop_down`), never held
    # for a start that would be on the other host.
    assert held(o, frm) == held_before, ("frames held for a VM that left", held(o, frm) - held_before, drops)
    # From the other members of network a too.
    assert o.ping(11, VM) and o.ping(12, VM)
    # The switch-over from the logs: the VM's rings stopped on the old
    # host, started on the new one, and host 3's vnetd took the agent's new
    # route to the VM (vnetd logs each change it applies).
    stopped = stamp(o.d[frm].log_text(), "vhost-user guest stopped", began)
    started = stamp(o.d[to].log_text(), "vhost-user guest running", began)
    routed = stamp(o.d[3].log_text(), f"ROUTE ADD {mac(13)} {VM_MAC} edge agent.h{to} ", started or began)
    assert stopped and started and routed, (stopped, started, routed)
    # Each ring starts on the new host where it stopped on the old one:
    # the next descriptor to take and the used index alike (QEMU carries
    # the first from GET_VRING_BASE to SET_VRING_BASE, the second lies in
    # guest memory), so no frame is taken twice or skipped (M13).
    left, resumed = rings(o.d[frm].log_text(), "stopped", began), rings(o.d[to].log_text(), "started", began)
    assert set(left) == set(resumed) == {0, 1}, (left, resumed)
    for q in left:
        assert resumed[q] == left[q] and left[q][0] == left[q][1], (q, left, resumed)
    return {"from": frm, "to": to, "qemu_total_ms": report["total-time"], "qemu_downtime_ms": report["downtime"],
            "rings_stopped_to_started_ms": round((started - stopped) * 1000, 1),
            "started_to_rerouted_ms": round((routed - started) * 1000, 1),
            "route_seen_after_completion_ms": round(seen_ms), "ping_outage_ms": pings["longest_gap_ms"],
            "pings_lost_in_a_row": pings["most_lost_in_a_row"], "slowest_ping_reply_ms": pings["slowest_reply_ms"],
            "pings_sent": pings["sent"], "pings_lost": pings["lost"], "drops_counted": sum(drops.values()),
            "lost_at_host_3": home, "lost_on_the_vm_side": vm_side,
            "tcp_echoes": int(out[1]), "tcp_longest_wait_ms": int(out[2]),
            "frames_into_the_vm": written, "tx_base": left[1][0]}


def describe(r: dict) -> str:
    return (f"migrated h{r['from']} -> h{r['to']}: QEMU total {r['qemu_total_ms']} ms, downtime {r['qemu_downtime_ms']} ms; "
            f"rings stopped -> started {r['rings_stopped_to_started_ms']:.0f} ms, started -> host 3 re-routed "
            f"{r['started_to_rerouted_ms']:.0f} ms; ping outage {r['ping_outage_ms']} ms ({r['pings_lost']} of "
            f"{r['pings_sent']} lost, at most {r['pings_lost_in_a_row']} in a row: {r['lost_at_host_3']} at host 3, "
            f"{r['lost_on_the_vm_side']} on the VM's side; {r['drops_counted']} drops counted; "
            f"slowest reply {r['slowest_ping_reply_ms']} ms); TCP {r['tcp_echoes']} echoes in order, "
            f"longest wait {r['tcp_longest_wait_ms']} ms; {r['frames_into_the_vm']} frames written into the VM, "
            f"each received; its rings resumed where they stopped (transmit at {r['tx_base']})")


def test_a_vm_migrated_under_a_ping_and_a_tcp_connection_keeps_both_and_moves_back(mig):
    o = mig
    src = boot_on_h1(o)
    # The incoming QEMU on host 2: connected, its rings not started, so host
    # 2 claims nothing and every route stays (the bug: host 3
    # routed the VM to host 2 within 0.06 s of the interface existing).
    dst = incoming(o, 2)
    time.sleep(0.5)
    assert "running=no" in iface(o, 2) and claims(o) == {1} and vm_route(o, 3) == "edge agent.h1"
    there = move(o, 1, 2, src, dst)
    print(describe(there))
    # Back: the paused QEMU left on host 1 goes, a new incoming one takes
    # its place.
    src.quit()
    assert wait_until(lambda: "connected=no" in iface(o, 1), timeout=10)
    back = move(o, 2, 1, dst, incoming(o, 1))
    print(describe(back))
    # The outage (M10). What the network lost: at most 10 pings in a row
    # (100 ms of requests; 1-4 in 30 moves measured). The whole outage
    # beyond QEMU's own downtime: each move under 200 ms (30 moves: 39-153,
    # the longest a guest under TCG answering late after it resumed), and
    # the better of the two under the target, 100 ms (28 of 30 moves met
    # it: both missing it by chance is 1 in 200; an outage twice as long
    # as measured misses it nearly always). The agents poll every 10 s
    # here: the re-route within 1 s of the rings' start is `WAIT`'s (M11).
    beyond = [r["ping_outage_ms"] - r["qemu_downtime_ms"] for r in (there, back)]
    for r in (there, back):
        assert r["pings_lost_in_a_row"] <= 10, describe(r)
        assert r["started_to_rerouted_ms"] < 1000, describe(r)
    assert max(beyond) < 200 and min(beyond) < 100, (beyond, describe(there), describe(back))


def test_a_cancelled_migration_leaves_the_vm_and_every_route_where_they_were(mig):
    o = mig
    src = boot_on_h1(o)
    incoming(o, 2)
    # A slow pre-copy (128 MiB at 4 MiB/s), cancelled half-way.
    src.qmp.cmd("migrate-set-parameters", **{"max-bandwidth": 4 << 20})
    pinger = Pinger(o)
    src.qmp.cmd("migrate", uri=f"tcp:{underlay_ip(2)}:{MIG_PORT}")
    assert wait_until(lambda: src.qmp.cmd("query-migrate").get("status") == "active", timeout=10)
    during = set()
    for _ in range(20):
        during.add(vm_route(o, 3))
        during |= {f"claims {sorted(claims(o))}"}
        time.sleep(0.05)
    assert src.qmp.cmd("query-migrate")["status"] == "active", "still in pre-copy"
    src.qmp.cmd("migrate_cancel")
    assert wait_until(lambda: src.qmp.cmd("query-migrate")["status"] == "cancelled", timeout=10)
    assert src.status() == "running"
    time.sleep(1)
    pings = pinger.stop()
    assert during == {"edge agent.h1", "claims [1]"}, during
    assert claims(o) == {1} and vm_route(o, 3) == "edge agent.h1"
    assert "running: its rings started" not in o.d[2].log_text()
    # The pre-copy's dirty-page log was set on host 1, and let go.
    st = o.d[1].stats()["interface vm"]
    assert st["vhost_dirty_logs"] >= 1 and st["vhost_refused_logs"] == 0, st
    assert "dirty-page logging off" in o.d[1].log_text()
    assert pings["dups"] == 0 and pings["sent"] - pings["replies"] <= 2, pings
    assert o.ping(13, VM) and o.ping(11, VM)
