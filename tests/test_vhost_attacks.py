"""A hostile vhost-user frontend against its neighbours: the attacks of the
security review of 2026-11-24 (S1-S4, S7), each as the review reproduced
it, and the noisy neighbour of issue 26 doing all of them at once.

The lab (Lab3): host 1 holds g1 (network a) and g2 (network b); host 2 holds
the frontend fe (network a, vhost-user, driven by tools/vhost_frontend.py)
and g3, g4 (network c, TAPs that talk to each other through the same vnetd
dispatcher as fe). The routes are those the agent writes: fe may reach g1
only; host 1 takes frames from its links to any of its guests. A frame of
fe's that reaches g2 has crossed networks; g3 and g4 losing pings is fe
hurting its neighbours."""

import contextlib
import json
import os
import re
import signal
import socket
import stat
import subprocess
import struct
import sys
import time

from netlab import REPO, guest_mac, underlay_ip, wait_until

sys.path.insert(0, str(REPO / "tests" / "tools"))
import vhost_frontend as vf  # noqa: E402

FE_MAC = "52:54:00:00:00:fe"
ETHERTYPE = b"\x88\xb5"
BCAST = "ff:ff:ff:ff:ff:ff"


def mac(s):
    return bytes.fromhex(s.replace(":", ""))


def rx_packets(lab, g):
    return int(lab.x(g.ns, "cat", f"/sys/class/net/{g.tap}/statistics/rx_packets").stdout)


class Lab3:
    """See the module's docstring. `fe_opts`: words after fe's socket (e.g.
    `unsealed-memory`); `args`: host 2's vnetd's own."""

    def __init__(self, lab, *args, fe_opts=""):
        self.lab = lab
        self.h1, self.h2 = lab.add_host(1), lab.add_host(2)
        self.sock = lab.tmp / "fe.sock"
        g1, g2, g3, g4 = (guest_mac(n) for n in (1, 2, 3, 4))
        u1, u2 = underlay_ip(1), underlay_ip(2)
        cfg1 = f"""
INTERFACE ADD g1 {g1} network a
INTERFACE ADD g2 {g2} network b
LINK ADD {u2} 9000 udp
ROUTE ADD any {g1} interface {g1} edge
ROUTE ADD any {g2} interface {g2} edge
ROUTE ADD {g1} {FE_MAC} edge {u2} interface {g1}
"""
        cfg2 = f"""
INTERFACE ADD fe {FE_MAC} network a vhost-user {self.sock} {fe_opts}
INTERFACE ADD g3 {g3} network c
INTERFACE ADD g4 {g4} network c
LINK ADD {u1} 9000 udp
ROUTE ADD any {FE_MAC} interface {FE_MAC} edge
ROUTE ADD {FE_MAC} {g1} edge {u1} interface {FE_MAC}
ROUTE ADD {g3} {g4} interface {g4} interface {g3}
ROUTE ADD {g4} {g3} interface {g3} interface {g4}
ROUTE ADD {g3} {BCAST} interface {g4} interface {g3}
ROUTE ADD {g4} {BCAST} interface {g3} interface {g4}
"""
        self.d1 = lab.start_vnetd(self.h1, cfg1)
        self.d2 = lab.start_vnetd(self.h2, cfg2, *args)
        self.g1 = lab.attach_guest(self.h1, "g1", 1)
        self.g2 = lab.attach_guest(self.h1, "g2", 2)
        self.g3 = lab.attach_guest(self.h2, "g3", 3)
        self.g4 = lab.attach_guest(self.h2, "g4", 4)
        assert lab.reaches(self.g3, self.g4)

    def alive(self):
        assert self.d2.proc.poll() is None, f"vnetd on host 2 died ({self.d2.proc.returncode}): {self.d2.log_text()[-2000:]}"
        assert self.d2.ctl("SHOW").returncode == 0

    def fe(self) -> dict:
        return self.d2.stats()["interface fe"]

    def counter(self, name) -> int:
        """A counter of fe's, on its STATS line or the global one."""
        st = self.d2.stats()
        return st["interface fe"].get(name, 0) + st["global"].get(name, 0)

    def fe_line(self) -> str:
        return next(l for l in self.d2.ctl("INTERFACE", "LIST").stdout.splitlines() if FE_MAC in l or " fe " in f" {l} ")

    def connect(self, **kw) -> vf.Frontend:
        f = vf.Frontend(self.sock, **kw)
        f.post_rx()
        assert wait_until(lambda: "connected=yes" in self.fe_line(), 5), self.fe_line()
        return f

    def to_fe(self, payload: bytes = bytes(50)) -> bytes:
        """g1 sends a frame to the frontend; the frame."""
        frame = mac(FE_MAC) + mac(self.g1.mac) + ETHERTYPE + payload
        self.lab.x(self.g1.ns, "python3", "-c",
                   "import socket; s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW); "
                   f"s.bind(('{self.g1.tap}', 0)); s.send(bytes.fromhex('{frame.hex()}'))")
        return frame

    def burst_to_fe(self, n: int):
        """g1 sends `n` frames to the frontend back to back, while host 2's
        vnetd is held (SIGSTOP): they wait in its socket, so its next pass
        brings them all, more than the 64 frames after which fe's receive
        ring is published mid-burst. (Unheld, whether one pass gets more
        than 64 depends on how fast host 2 drains host 1's runs: a CI run
        once saw none.)"""
        frame = mac(FE_MAC) + mac(self.g1.mac) + ETHERTYPE + bytes(50)
        os.kill(self.d2.proc.pid, signal.SIGSTOP)
        try:
            self.lab.x(self.g1.ns, "python3", "-c",
                       "import socket; s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW); "
                       f"s.bind(('{self.g1.tap}', 0)); f = bytes.fromhex('{frame.hex()}')\n"
                       f"for _ in range({n}): s.send(f)")
            time.sleep(0.5)  # host 1's vnetd sends them on
        finally:
            os.kill(self.d2.proc.pid, signal.SIGCONT)

    def exchange(self, f: vf.Frontend):
        """A frame each way between the frontend and g1."""
        before = rx_packets(self.lab, self.g1)
        f.send_frame(mac(self.g1.mac) + mac(FE_MAC) + ETHERTYPE + bytes(46))
        assert wait_until(lambda: rx_packets(self.lab, self.g1) > before, 5), "frontend -> g1"
        payload = os.urandom(8) + bytes(42)
        self.to_fe(payload)
        got = []
        assert wait_until(lambda: got.extend(f.received()) or any(payload in g for g in got), 5), "g1 -> frontend"

    def feeder(self, per_second: float):
        """g1 sending frames to the frontend at `per_second`, until killed."""
        frame = mac(FE_MAC) + mac(self.g1.mac) + ETHERTYPE + bytes(100)
        return self.lab.popen(self.g1.ns, "python3", "-c",
                              "import socket, time\n"
                              f"s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW); s.bind(('{self.g1.tap}', 0))\n"
                              "while True:\n"
                              f"    s.send(bytes.fromhex('{frame.hex()}'))\n"
                              f"    time.sleep({1 / per_second})\n")

    @contextlib.contextmanager
    def full_calls(self, f: vf.Frontend):
        """Both of f's queues given a full eventfd (tools/vhost_frontend.py)
        as their call descriptor; yields the descriptors, closed after."""
        full = [vf.full_eventfd() for _ in vf.RINGS]
        try:
            for q in vf.RINGS:
                assert f.set_call(q, full[q]) == 0, f"an eventfd refused as queue {q}'s call"
            yield full
        finally:
            for fd in full:
                os.close(fd)

    def neighbours_unharmed(self, after: str):
        """g3 and g4 (fe's neighbours on host 2) ping each other 40 times
        without loss, and vnetd is alive."""
        p = self.pings(n=40, interval=0.05)
        print(f"g3 -> g4 {after}: {p}")
        assert p.lost == 0, f"g3 -> g4 lost {p.lost} of {p.sent} pings {after}: {p}"
        self.alive()

    def pings(self, n=200, interval=0.01) -> "Pings":
        """g3 pings g4 `n` times."""
        p = self.lab.x(self.g3.ns, "ping", "-n", "-c", n, "-i", interval, "-W", 1, self.g4.ip,
                       check=False, timeout=n * interval + 30)
        return Pings(n, [float(t) for t in re.findall(r"time=([\d.]+) ms", p.stdout)])

    def median_pings(self, what: str) -> "Pings":
        """Three runs of 200 pings g3 -> g4, the run of the median p99
        returned: one run's p99 (its second slowest ping) on this 2-core VM
        swings from 0.3 to 4 ms with nobody attacking; a starved or frozen
        dispatcher shows in every run. Every run's losses are kept on the
        one returned."""
        runs = sorted((self.pings() for _ in range(3)), key=lambda r: (r.lost, r.p99))
        median = runs[1]
        median.lost_all = sum(r.lost for r in runs)
        print(f"g3 -> g4 {what}: {median} (runs {[round(r.p99, 3) for r in runs]})", flush=True)
        return median

    def iperf(self, seconds=3) -> float:
        """iperf3 TCP from g3 to g4 for `seconds`: Gbit/s received (0 if
        it could not run)."""
        srv = self.lab.popen(self.g4.ns, "iperf3", "-s", "-1", "-B", self.g4.ip,
                             stdout=open(os.devnull, "w"), stderr=open(os.devnull, "w"))
        wait_until(lambda: "5201" in self.lab.x(self.g4.ns, "ss", "-Hltn").stdout, 5)
        c = self.lab.x(self.g3.ns, "iperf3", "-c", self.g4.ip, "-t", seconds, "-J", check=False, timeout=seconds + 30)
        srv.kill()
        srv.wait()
        try:
            return json.loads(c.stdout)["end"]["sum_received"]["bits_per_second"] / 1e9
        except (ValueError, KeyError):
            return 0.0


class Pings:
    def __init__(self, sent, times):
        self.sent, self.times = sent, sorted(times)
        self.lost = sent - len(times)

    @property
    def p99(self) -> float:
        """The 99th percentile of the round trips, lost ones counted as
        infinitely long."""
        return self.pct(99)

    def pct(self, q: int) -> float:
        """The q-th percentile of the round trips, lost ones counted as
        infinitely long."""
        k = max(0, -(-q * self.sent // 100) - 1)
        return self.times[k] if k < len(self.times) else float("inf")

    @staticmethod
    def pooled(runs: "list[Pings]") -> "Pings":
        """All the round trips of several runs as one."""
        return Pings(sum(r.sent for r in runs), [t for r in runs for t in r.times])

    def __repr__(self):
        return f"{self.sent - self.lost}/{self.sent} answered, p99 {self.p99:.3f} ms"


# ---- S1 ----

def test_s1_a_frame_changed_after_routing_never_reaches_another_network(lab):
    """S1: fe may reach only g1; it queues 4800 frames to g1 while another
    process flips their destination MAC in guest memory between g1 and g2
    (network b, host 1, which takes frames from its links to any of its
    guests). With cut-through on, then off, no frame reaches g2, and frames
    still reach g1 (those routed while they said g1). vnetd routes on its
    own copy of the headers, so what it sends is what it routed.

    Today's code (cut-through reads guest memory twice) let 159 of 4800
    through in the review."""
    # Dispatcher on CPU 1, the flipper on CPU 0: the flips land while the
    # dispatcher works on the frame.
    t = Lab3(lab, "--cpus", "1")
    for mode in ("off", "on"):
        t.d2.ctl("SET", "cut-through", mode)
        f = t.connect()
        t.exchange(f)
        g1_before, g2_before = rx_packets(lab, t.g1), rx_packets(lab, t.g2)
        flipper = vf.Flipper(f, vf.flip_bufs(f), mac(t.g1.mac), mac(t.g2.mac), cpu=0)
        try:
            queued = vf.flip_frames(f, mac(t.g1.mac) + mac(FE_MAC) + ETHERTYPE + bytes(986), 300)
        finally:
            flipper.stop()
        assert queued == 4800
        time.sleep(0.5)
        to_g1, to_g2 = rx_packets(lab, t.g1) - g1_before, rx_packets(lab, t.g2) - g2_before
        print(f"cut-through {mode}: {queued} frames queued, {to_g1} reached g1, {to_g2} reached g2 (another network)")
        assert to_g2 == 0, f"cut-through {mode}: {to_g2} of {queued} frames crossed into network b"
        assert to_g1 > 0, f"cut-through {mode}: no frame reached g1"
        t.alive()
        f.close()
        assert wait_until(lambda: "connected=no" in t.fe_line(), 5)


# ---- S2 ----

def test_s2_a_pipe_as_call_descriptor_is_refused_and_freezes_nobody(lab):
    """S2: fe passes a full pipe (whose write blocks) as the call descriptor
    of its receive queue and of its transmit queue, then g1 sends it frames
    and fe sends one: g3 and g4 (unrelated guests on the same vnetd) keep
    pinging without loss. vnetd takes only eventfds for call and kick: a
    pipe, a regular file or a socket is refused with a non-zero REPLY_ACK
    and counted (`vhost_refused_fds`).

    Today's code keeps any descriptor and writes to it from the dispatcher:
    the dispatcher sleeps in write(2), every guest on the host loses the
    overlay, the control plane still answers."""
    t = Lab3(lab)
    f = t.connect(reply_ack=True)
    t.exchange(f)
    held = []
    regular = open(lab.tmp / "not-an-eventfd", "w+")
    unix = socket.socketpair()
    acks = {}
    try:
        for q in vf.RINGS:
            r, w = vf.full_pipe()
            held += [r, w]
            acks[f"kick {q}: pipe"] = f.set_kick(q, r)
            acks[f"kick {q}: regular file"] = f.set_kick(q, regular.fileno())
            acks[f"kick {q}: socket"] = f.set_kick(q, unix[0].fileno())
            assert f.set_kick(q, f.kick[q]) == 0, "the frontend's own kick eventfd refused"
            # The pipe last: the call descriptor the queue is left with
            # unless vnetd refuses it.
            acks[f"call {q}: regular file"] = f.set_call(q, regular.fileno())
            acks[f"call {q}: socket"] = f.set_call(q, unix[0].fileno())
            acks[f"call {q}: pipe"] = f.set_call(q, w)
        for k in range(5):
            t.to_fe()
        f.send_frame(mac(t.g1.mac) + mac(FE_MAC) + ETHERTYPE + bytes(46))
        time.sleep(0.3)
        p = t.pings(n=40, interval=0.05)
        print(f"g3 -> g4 with full pipes offered as fe's call descriptors: {p}")
        assert p.lost == 0, f"g3 -> g4 lost {p.lost} of {p.sent} pings: {p}"
        t.alive()
        taken = [what for what, ack in acks.items() if ack == 0]
        assert not taken, f"taken as call/kick descriptors: {taken}"
        assert t.counter("vhost_refused_fds") >= len(acks), t.fe()
    finally:
        for fd in held:
            os.close(fd)  # frees a dispatcher stuck in write(2)
        regular.close()
        unix[0].close()
        unix[1].close()
    f.close()
    f = t.connect()
    t.exchange(f)


def test_s2_a_full_eventfd_as_call_descriptor_freezes_nobody(lab):
    """S2, with an eventfd: a blocking one whose counter is at its largest
    (a write of 1 would sleep), given as the call descriptor of both
    queues. It is an eventfd, so it is taken, and made non-blocking: frames
    still flow both ways between fe and g1 (an interrupt is then simply
    already pending), g3 and g4 keep pinging without loss.

    Today's code writes to it blocking and the dispatcher sleeps."""
    t = Lab3(lab)
    f = t.connect(reply_ack=True)
    t.exchange(f)
    with t.full_calls(f) as full:
        for _ in range(3):
            t.to_fe()
        f.send_frame(mac(t.g1.mac) + mac(FE_MAC) + ETHERTYPE + bytes(46))
        time.sleep(0.3)
        t.neighbours_unharmed("with full eventfds as fe's call descriptors")
        t.exchange(f)
        assert os.get_blocking(full[0]) is False, "vnetd left the call eventfd blocking"
        # The frontend shares the eventfd's open file: it makes it blocking
        # again, its counter still full. vnetd looks before it writes and
        # breaks the ring rather than block.
        os.set_blocking(full[0], True)
        for _ in range(3):
            t.to_fe()
        time.sleep(0.3)
        t.neighbours_unharmed("after fe made its full call eventfd blocking again")
        assert wait_until(lambda: "broken=a-call-descriptor-made-blocking-again" in t.fe_line(), 5), t.fe_line()


def test_s2_a_full_call_descriptor_met_in_the_middle_of_a_burst_freezes_nobody(lab):
    """S2 on the batched path: one pass can bring fe more than 64 frames, and
    its receive ring is then published (and the guest interrupted, if it
    asks) in the middle of the burst, not only at its end. With a full
    eventfd as the call descriptor, then the same one made blocking again by
    the frontend, bursts of 200 frames to fe must neither put vnetd to sleep
    (g3 and g4 keep pinging without loss) nor break anything but fe's ring.
    Catches: a mid-burst interrupt that writes to the descriptor without the
    checks the end of a pass makes."""
    t = Lab3(lab)
    f = t.connect(reply_ack=True, size=256)
    t.exchange(f)
    with t.full_calls(f) as full:
        mid = t.counter("vhost_rx_mid_burst_publishes")
        t.burst_to_fe(200)
        assert wait_until(lambda: t.counter("vhost_rx_mid_burst_publishes") > mid, 5), t.fe()
        t.neighbours_unharmed("after a burst at full call eventfds")
        got = f.received()
        assert len(got) >= 64, len(got)
        # The buffers used so far (the exchange's and the burst's) posted again.
        f.post_rx(n=1 + len(got))
        os.set_blocking(full[0], True)
        t.burst_to_fe(200)
        t.neighbours_unharmed("after a burst at a blocking call eventfd")
        assert wait_until(lambda: "broken=a-call-descriptor-made-blocking-again" in t.fe_line(), 5), t.fe_line()


# ---- S3 ----

def test_s3_receive_chains_of_65535_empty_descriptors_cost_the_neighbours_nothing(lab):
    """S3, the review's attack: 256 receive chains, each an indirect table of 65535
    zero-length read-only descriptors (longer than the queue: refused), with
    mergeable receive buffers (so that vnetd may gather a frame from many
    chains), and g1 sending fe 20 frames a second. Meanwhile g3 pings g4: no loss, and a
    p99 (of three runs of 200, pooled) within 1.5 times that of the runs
    without the frames to fe, taken in turn with them, and those before the
    bomb.
    The ring is marked broken (`vhost_broken_rings`, `broken=` in INTERFACE
    LIST) and left alone until fe connects again. Then, on a new connection,
    two receive chains with no writable byte ahead of good buffers: each is
    returned used with length 0 and counted (`vhost_empty_rx_chains`), and
    the frame goes into the next buffer.

    Today's code walks every chain whole for every frame: at 20 frames/s
    the dispatcher sits at the real-time throttle and the other guests
    lose all their pings."""
    t = Lab3(lab)
    base = t.median_pings("before the attack")
    assert base.lost_all == 0, base
    f = vf.Frontend(t.sock, features=vf.BOMB_FEATURES, size=256, mem_size=4 * vf.MEM)
    vf.empty_chain_bomb(f)
    time.sleep(1)
    # The frames to the bombed ring, on and off in turn: three runs of 200
    # with them and three without, interleaved, each side pooled (its p99 is
    # its 6th slowest of 600). A stretch of the host's own noise then falls
    # on both sides alike, as a before-and-after comparison cannot promise
    # (a CI run saw the attacked p99 1.9 ms, 1.1 before and 0.6 after).
    attacked, quiet, dropped = [], [base], t.counter("drop_down")
    for _ in range(3):
        feed = t.feeder(20)
        try:
            time.sleep(0.2)
            attacked.append(t.pings())
        finally:
            feed.kill()
            feed.wait()
        quiet.append(t.pings())
    attacked, quiet = Pings.pooled(attacked), Pings.pooled(quiet)
    print(f"g3 -> g4 under 256 chains of 65535 empty descriptors, 20 frames/s to them: {attacked}; "
          f"between those runs and before the attack: {quiet}", flush=True)
    # The attack was on while measured: g1's frames kept coming to fe and
    # were dropped for its broken ring (`drop_down`).
    assert t.counter("drop_down") > dropped, t.fe()
    assert attacked.lost == 0, f"g3 -> g4 lost {attacked.lost} of 600 pings under the attack"
    # Within 1.5x the quiet runs', or 0.3 ms on a sub-millisecond baseline
    # (one scheduler hiccup on a loaded 2-core machine); the attack before
    # the fix cost 9 ms on average at 5 frames/s and every ping at 20.
    assert attacked.p99 <= max(1.5 * quiet.p99, quiet.p99 + 0.3), \
        f"p99 {attacked.p99} ms under the attack, {quiet.p99} ms without it"
    t.alive()
    assert t.counter("vhost_broken_rings") >= 1, t.fe()
    assert "broken=" in t.fe_line(), t.fe_line()
    # Frames for a broken ring are dropped, not held for its next
    # connection (they would fill its new buffers with stale frames).
    assert t.counter("vhost_rx_held_frames") == 0, t.fe()
    f.close()

    # Two chains with no writable byte ahead of good buffers, on a new
    # connection (the broken ring is forgotten with the old one).
    f = vf.Frontend(t.sock, size=256, mem_size=4 * vf.MEM)
    for h in (0, 1):
        f.desc(0, h, 0x40000, 64, vf.D_NEXT, 100 + h)
        f.desc(0, 100 + h, 0x40000, 0, 0)
        f.offer(0, h, kick=False)
    f.post_rx(n=14, first=2)
    assert wait_until(lambda: "connected=yes" in t.fe_line(), 5)
    assert "broken=" not in t.fe_line()
    empty = t.counter("vhost_empty_rx_chains")
    payload = os.urandom(8) + bytes(42)
    t.to_fe(payload)
    got = []
    assert wait_until(lambda: got.extend(f.received()) or any(payload in g for g in got), 5), "the frame after two empty chains"
    assert [f.used(0, k) for k in (0, 1)] == [(0, 0), (1, 0)], "empty chains not returned used with length 0"
    assert t.counter("vhost_empty_rx_chains") == empty + 2, t.fe()
    assert "broken=" not in t.fe_line()
    t.exchange(f)


# ---- S4 ----

def test_s4_guest_memory_that_can_shrink_is_refused(lab):
    """S4: a memory file not sealed against shrinking (F_SEAL_SHRINK) is
    refused by SET_MEM_TABLE (a non-zero REPLY_ACK) and counted
    (`vhost_refused_memory`); a sealed one, as QEMU's memory-backend-memfd
    makes, is taken and frames flow.

    Today's code maps any file at least as large as the table says, which
    the frontend can then shrink under it."""
    t = Lab3(lab)
    f = vf.Frontend(t.sock, reply_ack=True, sealed=False, setup=False)
    refused = t.counter("vhost_refused_memory")
    try:
        f.negotiate(vf.F_VERSION_1 | vf.F_INDIRECT, vf.MEM)
        taken = True
    except (RuntimeError, ConnectionError):  # the memory table refused (or the connection dropped)
        taken = False
    assert not taken, "an unsealed memory file was taken"
    assert t.counter("vhost_refused_memory") == refused + 1, t.fe()
    f.close()
    f = t.connect(reply_ack=True)
    t.exchange(f)
    t.alive()


def test_s4_a_frontend_that_truncates_its_memory_breaks_only_its_device(lab):
    """S4: on an interface added with `unsealed-memory` (the admin's choice
    to take memory files that can shrink), a frontend truncates its memfd to
    nothing and kicks, twice over (reconnecting as the review did). vnetd
    survives: the device is broken (`vhost_memory_faults`, `broken=`), g3 and
    g4 keep pinging without loss, and a frontend that connects again works.

    Today's code dies by SIGBUS at the kick (vnetd then has no
    `unsealed-memory` option either: the interface is not even added)."""
    t = Lab3(lab, fe_opts="unsealed-memory")
    for round_ in range(2):
        f = t.connect(sealed=False)
        t.exchange(f)
        # A frame queued (not kicked), the memory gone, then the kick.
        addr = f.buffer()
        data = bytes(vf.HDR) + mac(t.g1.mac) + mac(FE_MAC) + ETHERTYPE + bytes(46)
        f.mem[addr:addr + len(data)] = data
        f.desc(1, 1, addr, len(data))
        f.offer(1, 1, kick=False)
        faults = t.counter("vhost_memory_faults")
        f.truncate()
        os.eventfd_write(f.kick[1], 1)
        t.to_fe()  # and a frame for its receive ring
        time.sleep(0.5)
        t.alive()
        assert t.counter("vhost_memory_faults") > faults, t.fe()
        assert "broken=" in t.fe_line(), t.fe_line()
        p = t.pings(n=40, interval=0.05)
        print(f"round {round_}: g3 -> g4 after fe truncated its memory: {p}")
        assert p.lost == 0, p
        f.close()
    f = t.connect()
    t.exchange(f)
    assert "broken=" not in t.fe_line()


# ---- S7 ----

def test_s7_vhost_user_sockets_are_confined_to_the_vhost_user_dir(lab):
    """S7: a vhost-user socket is a plain name in vnetd's --vhost-user-dir
    (the lab's vnetds get the lab's directory, tests/netlab.py), or an
    absolute path directly in it; anything else is refused by INTERFACE ADD
    with an error naming the directory, for the `client` role too (vnetd
    then connects to nothing). A symbolic link or a regular file planted at
    a name is neither followed nor replaced (the link's target keeps its
    mode and content). The socket vnetd makes is mode 0600. A directory
    that does not exist is made, mode 0755.

    Today's code takes any absolute path (and follows a link with chmod)."""
    import shutil
    import tempfile
    from pathlib import Path

    h = lab.add_host(1)
    d = lab.start_vnetd(h, "")
    home = lab.tmp
    outside = Path(tempfile.mkdtemp(prefix=f"vnet-{lab.prefix}outside-"))
    macs = iter(f"52:54:00:00:07:{i:02x}" for i in range(1, 100))

    def add(name, sock, *extra):
        return d.ctl("INTERFACE", "ADD", name, next(macs), "vhost-user", str(sock), *extra, check=False)

    def listed():
        return d.ctl("INTERFACE", "LIST").stdout

    try:
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(outside / "peer.sock"))
        listener.listen()
        listener.settimeout(1)
        (home / "sub").mkdir()
        refused = [
            (outside / "vm.sock",),
            (home / "sub" / "vm.sock",),
            ("sub/vm.sock",),
            ("../vm.sock",),
            ("..",),
            (".",),
            ("vm@1",),
            ("vm.sock/",),
            (outside / "peer.sock", "client"),
            ("../" + outside.name + "/peer.sock", "client"),
        ]
        for args in refused:
            r = add("vm0", *args)
            assert r.returncode != 0, f"{args} taken"
            assert str(home) in r.stderr + r.stdout, f"{args}: the error does not name the directory: {r.stderr}"
            assert "vm0" not in listed()
        assert not os.path.lexists(outside / "vm.sock") and not os.path.lexists(home / "sub" / "vm.sock")
        try:
            listener.accept()[0].close()
            raise AssertionError("vnetd connected to a socket outside its directory")
        except socket.timeout:
            pass

        # Planted at a name: a link to a file of someone else's, a link to a
        # stale socket, a regular file. Refused, left as they were.
        target = outside / "precious"
        target.write_text("keep me\n")
        target.chmod(0o644)
        (home / "planted").symlink_to(target)
        stale = outside / "stale.sock"
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(stale))
        s.close()
        os.chmod(stale, 0o755)
        (home / "planted-stale").symlink_to(stale)
        (home / "regular").write_text("mine\n")
        before = {p: os.lstat(p) for p in (home / "planted", home / "planted-stale", home / "regular", target, stale)}
        for name in ("planted", "planted-stale", "regular", home / "planted"):
            r = add("vm0", name)
            assert r.returncode != 0, f"{name} taken"
            assert "vm0" not in listed()
        for p, st in before.items():
            now = os.lstat(p)
            assert (now.st_ino, now.st_mode, now.st_mtime_ns) == (st.st_ino, st.st_mode, st.st_mtime_ns), p
        assert target.read_text() == "keep me\n" and (home / "regular").read_text() == "mine\n"

        # Taken: a plain name and an absolute path in the directory; a
        # client of a plain name connects there.
        assert add("vm1", "vm1.sock").returncode == 0
        assert add("vm2", home / "vm2.sock").returncode == 0
        for p in (home / "vm1.sock", home / "vm2.sock"):
            st = os.lstat(p)
            assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, (p, oct(st.st_mode))
        f = vf.Frontend(home / "vm1.sock")
        assert wait_until(lambda: "connected=yes" in next(l for l in listed().splitlines() if "name=vm1 " in l), 5)
        f.close()
        inside = socket.socket(socket.AF_UNIX)
        inside.bind(str(home / "peer.sock"))
        inside.listen()
        inside.settimeout(10)
        assert add("vm3", "peer.sock", "client").returncode == 0
        inside.accept()[0].close()
        inside.close()
        listener.close()
    finally:
        shutil.rmtree(outside, ignore_errors=True)

    # A directory that does not exist yet is made, mode 0755, and sockets
    # go there.
    made = lab.tmp / "run" / "vnet"
    h2 = lab.add_host(2)
    d2 = lab.start_vnetd(h2, "", "--vhost-user-dir", made)
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o755, oct(os.stat(made).st_mode)
    assert d2.ctl("INTERFACE", "ADD", "vm1", "52:54:00:00:07:f0", "vhost-user", "vm1.sock").returncode == 0
    assert stat.S_ISSOCK(os.lstat(made / "vm1.sock").st_mode)
    r = d2.ctl("INTERFACE", "ADD", "vm2", "52:54:00:00:07:f1", "vhost-user", str(home / "vm2b.sock"), check=False)
    assert r.returncode != 0 and str(made) in r.stderr + r.stdout, r

    # A directory others may write (V13), or that another user owns (who
    # could swap a socket for a link whatever its mode: the 2026-11-28
    # review's L4), is refused, and nothing is made in it.
    d2.stop()
    for mode, owner, says in ((0o777, 0, "may be written by others"), (0o755, 65534, "belongs to uid 65534")):
        bad = lab.tmp / f"bad-{mode:o}-{owner}"
        bad.mkdir()
        os.chmod(bad, mode)
        os.chown(bad, owner, owner)
        d3 = lab.start_vnetd(h2, "", "--vhost-user-dir", bad)
        r = d3.ctl("INTERFACE", "ADD", "vm1", "52:54:00:00:07:f2", "vhost-user", "vm1.sock", check=False)
        assert r.returncode != 0 and says in r.stderr + r.stdout, r
        assert os.listdir(bad) == [] and "vm1" not in d3.ctl("INTERFACE", "LIST").stdout
        d3.stop()


# ---- one guest can never hurt another ----

def test_a_noisy_neighbour_costs_the_other_guests_nothing(lab):
    """Issue 26, item 2: while fe does its worst (tools/vhost_frontend.py
    `attack`: S1 flips, S2 full pipes as call descriptors, S3 chains of
    65535 empty descriptors with g1 sending it 20 frames a second, S4
    truncated memory on an interface with `unsealed-memory`, random bytes
    and well-formed wrong messages on its socket, reconnecting whenever
    vnetd drops it), g3 and g4's ping p95 (of three runs of 200, pooled)
    and iperf3 TCP throughput stay
    within 1.5 times their values without it, no ping is lost, and no frame
    crosses networks (g2 receives nothing); a sub-millisecond ping p95 may
    grow by 0.3 ms (one scheduler tick's worth, as in S3's test). Measured
    baseline, attack, baseline again: throughput against the better
    baseline, the p95 against the worse (the p99 of 200 pings is their
    second slowest, and two quiet runs here differ by up to 8x; what the
    attacks did before costs seconds and lost pings, far outside either);
    a measurement under attack outside the first baseline's bounds is made
    once more, still under attack, as in S3's test, and one of the two
    must hold.

    The attacker runs at the lowest priority (SCHED_IDLE and nice 19):
    this 2-core machine would otherwise share its CPUs between the
    attacker's own Python and the guests' traffic, and the test is of
    vnetd's isolation, not of the CPU scheduler's.

    Today's code: a full pipe freezes the dispatcher, the chains starve it,
    a truncated memfd kills vnetd by SIGBUS."""
    t = Lab3(lab, fe_opts="unsealed-memory")
    g2_before = rx_packets(lab, t.g2)

    def measure(what):
        # Three runs of 200 pings, pooled and judged by their 95th
        # percentile (the 30th slowest of 600): a starved dispatcher slows
        # every ping, while one run's p99 (its second slowest ping) on this
        # 2-core VM swings from 0.3 to 4 ms with nobody attacking, and a
        # quiet run and an attacked one had 0.51 and 1.33 ms in CI.
        t0 = time.monotonic()
        runs = [t.pings() for _ in range(3)]
        t1 = time.monotonic()
        p, gbps = Pings.pooled(runs), t.iperf(5)
        print(f"noisy neighbour, {what}: g3 -> g4 ping {p.sent - p.lost}/{p.sent} answered, "
              f"p50 {p.pct(50):.3f} p95 {p.pct(95):.3f} p99 {p.p99:.3f} ms (runs' p99 {[round(r.p99, 3) for r in runs]}), "
              f"iperf3 {gbps:.2f} Gbit/s", flush=True)
        return p, gbps, (t0, t1, time.monotonic())

    base1 = measure("baseline")
    assert base1[0].lost == 0 and base1[1] > 0, base1
    feed = t.feeder(20)
    attacker = lab.popen(t.h2, "chrt", "-i", "0", "nice", "-n", "19", sys.executable,
                         REPO / "tests" / "tools" / "vhost_frontend.py", "attack", t.sock,
                         t.g1.mac, t.g2.mac, FE_MAC, 60, 26, stdout=subprocess.PIPE, text=True)

    def holds(a, quiet):
        # Within 1.5x, or 0.3 ms on a sub-millisecond baseline, as S3's test:
        # a full run once had 0.42 ms against 0.20 on this shared
        # machine; what the attacks did before (a frozen or starved
        # dispatcher, vnetd killed) costs seconds and lost pings, far
        # outside either.
        q95 = max(b[0].pct(95) for b in quiet)
        return (a[0].pct(95) <= max(1.5 * q95, q95 + 0.3), a[1] * 1.5 >= max(b[1] for b in quiet))

    try:
        time.sleep(3)
        attacked = [measure("under attack")]
        if not all(holds(attacked[0], [base1])):
            # As S3's test: a quiet run here once had a p99 of 18 ms and
            # iperf3 a third of its rate; a starved dispatcher is starved
            # again.
            attacked.append(measure("under attack, again"))
        attacker.send_signal(signal.SIGTERM)
        out = attacker.communicate(timeout=60)[0].strip().splitlines()
    finally:
        feed.kill()
        feed.wait()
    done = out[-1]
    # What the attacker did while each part was measured (the review's
    # V14: at the lowest priority it might barely run while iperf3 fills
    # both CPUs): every kind of attack under way at some time during the
    # pings (an attack started before the window and done inside it, or
    # started inside it, counts for it); during iperf3's 5 s, where the
    # attacker gets the least CPU, attacks under way for 90% of it, of at
    # least three kinds (one run: 1-2 of each kind). Each attempt under
    # attack, the one measured again too.
    stamps = [(float(w[1]), float(w[2]), w[3]) for w in (line.split() for line in out[:-1]) if w[0] == "at"]
    kinds = sorted(set(done_k.split("=")[0] for done_k in done.split()))

    def activity(window):
        t0, t1, t2 = window
        during = {part: {k: sum(1 for s0, s1, w in stamps if w == k and s0 <= b and s1 >= a) for k in kinds}
                  for part, (a, b) in (("pings", (t0, t1)), ("iperf3", (t1, t2)))}
        covered, at = 0.0, t1
        for s0, s1, _ in sorted(stamps):
            if s1 > at and s0 < t2:
                covered += min(s1, t2) - max(s0, at)
                at = min(s1, t2)
        return during, covered / (t2 - t1)

    seen = [activity(a[2]) for a in attacked]
    print(f"noisy neighbour: the attacker did {done}; while measured: "
          + "; ".join(f"{during}, attacks under way for {covered:.0%} of iperf3's run" for during, covered in seen))
    t.alive()
    base2 = measure("baseline again")
    lost = sum(a[0].lost for a in attacked)
    assert lost == 0, f"g3 -> g4 lost {lost} of {600 * len(attacked)} pings under attack"
    quiet = [base1, base2]
    assert any(holds(a, quiet)[0] for a in attacked), \
        f"ping p95 {[a[0].pct(95) for a in attacked]} ms under attack, {[b[0].pct(95) for b in quiet]} ms without"
    assert any(holds(a, quiet)[1] for a in attacked), \
        f"iperf3 {[round(a[1], 2) for a in attacked]} Gbit/s under attack, {[round(b[1], 2) for b in quiet]} without"
    assert rx_packets(lab, t.g2) == g2_before, "frames crossed into network b"
    counts = dict(kv.split("=") for kv in done.split())
    assert all(int(v) > 0 for v in counts.values()), f"not every attack ran: {done}"
    for during, covered in seen:
        assert all(n > 0 for n in during["pings"].values()), f"not every attack ran while the pings were measured: {during}"
        assert covered >= 0.9 and sum(n > 0 for n in during["iperf3"].values()) >= 3, (covered, during)
    f = t.connect()
    t.exchange(f)
