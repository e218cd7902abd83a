"""A hostile guest's vsock driver (tools/vsock_driver.py: packets written by
hand on the vsock device's rings) against vnetd's vsock device
(`INTERFACE ADD ... vhost-user <socket> vsock <cid>`): every packet no
guest may send is dropped and counted, connections and held bytes are
bounded, host programs that misbehave stall nothing, a broken ring breaks
only its own device until its frontend resets it; and the other VM's
vsock device (vm8) works throughout.

The lab: one host whose vnetd serves vm9 (CID 7) and vm8 (CID 8), each with
a host program listening on `<socket>.vsock-host_<port>` (the hybrid
convention, docs/vtoe.md)."""

import os
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time

from netlab import REPO, wait_until

sys.path.insert(0, str(REPO / "tests" / "tools"))
import vhost_frontend as vf  # noqa: E402
import vsock_driver as vd  # noqa: E402

BUF_ALLOC = 256 * 1024
MAX_CONNS = 1024


class Listener:
    """A host program on `path`: accepts every connection (`accept=False`:
    never, with a backlog of one), keeps what each sends if `read`, and
    echoes nothing unless asked (`send`)."""

    def __init__(self, path, read=True, accept=True):
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.bind(str(path))
        self.s.listen(4096 if accept else 1)
        self.s.setblocking(False)
        self.read = read
        self.conns: list[socket.socket] = []
        self.got: dict[int, bytearray] = {}
        self.eof: set[int] = set()
        self.lock = threading.Lock()
        self.sel = selectors.DefaultSelector()
        if accept:
            self.sel.register(self.s, selectors.EVENT_READ, None)
        self.stop = False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        while not self.stop:
            for key, _ in self.sel.select(0.05):
                if key.data is None:
                    try:
                        c, _ = self.s.accept()
                    except BlockingIOError:
                        continue
                    c.setblocking(False)
                    with self.lock:
                        i = len(self.conns)
                        self.conns.append(c)
                        self.got[i] = bytearray()
                    if self.read:
                        self.sel.register(c, selectors.EVENT_READ, i)
                    continue
                i = key.data
                try:
                    b = key.fileobj.recv(1 << 16)
                except BlockingIOError:
                    continue
                except ConnectionError:
                    b = b""  # reset: ended, as an EOF
                with self.lock:
                    if b:
                        self.got[i] += b
                    else:
                        self.eof.add(i)
                        self.sel.unregister(key.fileobj)

    def accepted(self) -> int:
        with self.lock:
            return len(self.conns)

    def bytes_of(self, i) -> bytes:
        with self.lock:
            return bytes(self.got[i])

    def drain(self, i) -> tuple[int, bool]:
        """What connection `i` (not read so far) holds: its bytes read now
        to the end, and whether it ended (EOF or reset) rather than stayed open."""
        c, n = self.conns[i], 0
        c.setblocking(True)
        c.settimeout(2)
        try:
            while True:
                b = c.recv(1 << 16)
                if not b:
                    return n, True
                n += len(b)
        except ConnectionError:
            return n, True
        except socket.timeout:
            return n, False

    def close(self):
        self.stop = True
        self.t.join(timeout=2)
        for c in self.conns:
            c.close()
        self.s.close()


class VsockLab:
    def __init__(self, lab):
        self.lab = lab
        self.h = lab.add_host(1)
        cfg = "".join(f"INTERFACE ADD vm{n} 52:54:00:00:00:0{n} vhost-user {lab.tmp}/vm{n}.sock vsock {cid}\n"
                      for n, cid in ((9, 7), (8, 8)))
        self.d = lab.start_vnetd(self.h, cfg)
        self.listeners: list[Listener] = []

    def listen(self, vm, port, **kw) -> Listener:
        lst = Listener(self.lab.tmp / f"vm{vm}.sock.vsock-host_{port}", **kw)
        self.listeners.append(lst)
        return lst

    def driver(self, vm, cid) -> vd.Driver:
        return vd.Driver(self.lab.tmp / f"vm{vm}.sock.vsock", cid)

    def st(self, vm=9) -> dict:
        return self.d.stats()[f"interface vm{vm}"]

    def alive(self):
        assert self.d.proc.poll() is None, f"vnetd died ({self.d.proc.returncode}): {self.d.log_text()[-2000:]}"
        assert self.d.ctl("SHOW").returncode == 0

    def close(self):
        for lst in self.listeners:
            lst.close()


def exchange(drv: vd.Driver, lst: Listener, port, src_port, n=1000):
    """A connection from the guest to `port`: `n` bytes each way, intact,
    then closed by the guest; the listener's connection index."""
    before = lst.accepted()
    ans = drv.connect(src_port, port)
    assert ans is not None and ans.op == vd.RESPONSE, ans
    assert wait_until(lambda: lst.accepted() > before, 5), "the host program saw no connection"
    i = before
    data = os.urandom(n)
    step = vf.BUF - vd.HDR
    for at in range(0, n, step):
        drv.packet(src_port, port, vd.RW, data[at:at + step])
    assert wait_until(lambda: len(lst.bytes_of(i)) >= n, 5), len(lst.bytes_of(i))
    assert lst.bytes_of(i) == data
    back = os.urandom(n // 2)
    lst.conns[i].sendall(back)
    got = b""
    while len(got) < len(back):
        p = drv.wait_for(lambda p: p.dst_port == src_port and p.op == vd.RW, 5)
        assert p is not None, f"{len(got)} of {len(back)} bytes came back"
        got += p.payload
    assert got == back
    drv.packet(src_port, port, vd.SHUTDOWN, flags=vd.SHUT_RCV | vd.SHUT_SEND)
    assert drv.wait_for(lambda p: p.dst_port == src_port and p.op == vd.RST, 5) is not None, "no reset ended the close"
    return i


def test_packets_no_guest_may_send_are_dropped_counted_and_harm_no_one(lab):
    """Another VM's CID as the source, another guest as the destination,
    SEQPACKET (not offered), an op virtio does not define, a length past
    the chain, a length on a REQUEST, a chain shorter than a header: each
    dropped and counted (`vsock_bad_packets`, the short chain as
    `vsock_vhost_bad_chains`), none answered, none reaching a host program.
    A packet for no connection is answered with a reset and counted
    (`vsock_unknown_packets`). A guest that sends past the credit vnetd
    gave it (256 KiB held, the host program not reading) is reset, its host
    socket closed, what vnetd holds bounded. vm8, and vm9's own good
    connections before and after, work throughout."""
    t = VsockLab(lab)
    try:
        l9, l8 = t.listen(9, 5000), t.listen(8, 5000)
        drv, drv8 = t.driver(9, 7), t.driver(8, 8)
        assert drv.config() == struct.pack("<Q", 7) and drv8.config() == struct.pack("<Q", 8)
        exchange(drv, l9, 5000, 40000)

        bad = [
            vd.header(8, vd.HOST_CID, 40001, 5000, vd.REQUEST),             # vm8's CID, from vm9
            vd.header(7, 8, 40002, 5000, vd.REQUEST),                       # to another guest
            vd.header(7, 1, 40003, 5000, vd.REQUEST),                       # to the hypervisor's CID
            vd.header(7, vd.HOST_CID, 40004, 5000, vd.REQUEST, kind=vd.SEQPACKET),
            vd.header(7, vd.HOST_CID, 40005, 5000, 99),                    # no such op
            vd.header(7, vd.HOST_CID, 40000, 5000, vd.RW, length=5000) + bytes(100),  # past the chain
            vd.header(7, vd.HOST_CID, 40006, 5000, vd.REQUEST, length=10) + bytes(10),
        ]
        before = t.st()
        for b in bad:
            drv.send_raw(b)
        drv.send_raw(bytes(20))                                             # shorter than a header
        assert drv.sent_all(), "vnetd took the bad packets' chains back"
        assert wait_until(lambda: t.st()["vsock_bad_packets"] - before["vsock_bad_packets"] == len(bad), 5), t.st()
        after = t.st()
        assert after["vsock_vhost_bad_chains"] - before["vsock_vhost_bad_chains"] == 1, after
        assert after["vsock_guest_connects"] == before["vsock_guest_connects"], after
        assert l9.accepted() == 1, "a refused packet reached the host program"
        time.sleep(0.2)
        assert drv.poll() == [], "a refused packet was answered"

        drv.packet(40010, 5000, vd.RW, b"x" * 10)                         # no such connection
        rst = drv.wait_for(lambda p: p.dst_port == 40010, 5)
        assert rst is not None and rst.op == vd.RST and (rst.src_cid, rst.dst_cid) == (vd.HOST_CID, 7), rst
        assert t.st()["vsock_unknown_packets"] - before["vsock_unknown_packets"] == 1, t.st()

        # Past the credit: the host program reads nothing.
        slow = t.listen(9, 5001, read=False)
        ans = drv.connect(40020, 5001)
        assert ans is not None and ans.op == vd.RESPONSE and ans.buf_alloc == BUF_ALLOC, ans
        chunk = bytes(vf.BUF - vd.HDR)
        sent, rst = 0, None
        while sent < 8 * BUF_ALLOC and rst is None:
            drv.packet(40020, 5001, vd.RW, chunk)
            sent += len(chunk)
            rst = next((p for p in drv.poll() if p.dst_port == 40020 and p.op == vd.RST), None)
        rst = rst or drv.wait_for(lambda p: p.dst_port == 40020 and p.op == vd.RST, 5)
        assert rst is not None, f"no reset after {sent} bytes past a credit of {BUF_ALLOC}"
        st = t.st()
        assert st["vsock_credit_violations"] == 1, st
        assert wait_until(lambda: slow.accepted() == 1, 2)
        got, ended = slow.drain(0)
        assert ended, "the host socket of the reset connection stayed open"
        # What the host program got: what its socket took before vnetd's
        # buffer filled, never more than the guest sent.
        assert 0 < got <= sent, (got, sent)

        # vm9's next connection and vm8's work.
        exchange(drv, l9, 5000, 40030)
        exchange(drv8, l8, 5000, 40000)
        st8 = t.st(8)
        assert st8["vsock_bad_packets"] == 0 and st8["vsock_credit_violations"] == 0, st8
        t.alive()
    finally:
        t.close()


def test_connections_past_the_limit_are_refused_and_the_limit_frees_as_they_close(lab):
    """A guest opening 1100 connections to a host program that accepts
    them all: 1024 (`MAX_CONNS`) answered, the rest reset and counted
    (`vsock_over_limit`); once 100 are closed, new ones are answered again;
    vm8 connects meanwhile."""
    t = VsockLab(lab)
    try:
        hold = t.listen(9, 6000, read=False)
        l8 = t.listen(8, 5000)
        drv, drv8 = t.driver(9, 7), t.driver(8, 8)
        n = MAX_CONNS + 76
        for k in range(n):
            drv.packet(20000 + k, 6000, vd.REQUEST)
        answers = {}
        deadline = time.monotonic() + 30
        while len(answers) < n and time.monotonic() < deadline:
            for p in drv.poll():
                if p.op in (vd.RESPONSE, vd.RST):
                    answers[p.dst_port] = p.op
            time.sleep(0.002)
        ops = list(answers.values())
        assert len(answers) == n, f"{len(answers)} of {n} connections answered"
        assert (ops.count(vd.RESPONSE), ops.count(vd.RST)) == (MAX_CONNS, n - MAX_CONNS), (ops.count(vd.RESPONSE), ops.count(vd.RST))
        assert t.st()["vsock_over_limit"] == n - MAX_CONNS, t.st()
        assert wait_until(lambda: hold.accepted() == MAX_CONNS, 10), hold.accepted()
        exchange(drv8, l8, 5000, 40000)

        opened = [port for port, op in answers.items() if op == vd.RESPONSE]
        for port in opened[:100]:
            drv.packet(port, 6000, vd.RST)
        assert drv.sent_all()
        ans = drv.connect(30000, 6000)
        assert ans is not None and ans.op == vd.RESPONSE, ans
        assert t.st()["vsock_over_limit"] == n - MAX_CONNS, t.st()
        t.alive()
    finally:
        t.close()


def test_a_host_program_that_never_accepts_stalls_none_of_the_vms_other_connections(lab):
    """A host program listening on port 7000 with a backlog of one and
    never accepting: the guest's connections to it past the backlog are
    reset at once (`vsock_refused`), not waited for, and meanwhile the
    guest's connection to port 5000 carries bytes both ways."""
    t = VsockLab(lab)
    try:
        t.listen(9, 7000, accept=False)
        l9 = t.listen(9, 5000)
        drv = t.driver(9, 7)
        # Each answered within drv.connect's 5 s: a connect that waited
        # for the program would hold the device's thread, and every
        # connection of the VM's, for as long as the program does.
        answers = [drv.connect(21000 + k, 7000) for k in range(10)]
        assert all(a is not None for a in answers), answers
        refused = [a for a in answers if a.op == vd.RST]
        assert len(refused) >= 7, answers
        assert t.st()["vsock_refused"] >= len(refused), t.st()
        exchange(drv, l9, 5000, 40000)
        t.alive()
    finally:
        t.close()


def test_a_chain_longer_than_the_queue_breaks_only_its_device_until_the_frontend_resets_it(lab):
    """A transmit chain whose indirect table is longer than the queue: the
    ring is broken (`vsock_vhost_long_chains`, `vsock_vhost_broken_rings`)
    and vm9's connections stop; vm8's go on. A new frontend connection
    resets the device: the connections the guest had are dropped
    (`vsock_dropped_at_stop`), and new ones work."""
    t = VsockLab(lab)
    try:
        l9, l8 = t.listen(9, 5000), t.listen(8, 5000)
        drv, drv8 = t.driver(9, 7), t.driver(8, 8)
        ans = drv.connect(40000, 5000)
        assert ans is not None and ans.op == vd.RESPONSE, ans
        table = 0xA0000
        entries = 2 * vd.SIZE
        for i in range(entries):
            nxt = i + 1 < entries
            drv.mem[table + 16 * i:table + 16 * i + 16] = struct.pack("<QIHH", vd.TX_BASE, 16, vf.D_NEXT if nxt else 0, i + 1 if nxt else 0)
        drv.desc(1, 0, table, 16 * entries, vf.D_INDIRECT)
        drv.offer(1, 0)
        assert wait_until(lambda: t.st()["vsock_vhost_broken_rings"] == 1, 5), t.st()
        assert t.st()["vsock_vhost_long_chains"] == 1, t.st()
        exchange(drv8, l8, 5000, 40000)
        drv.close()
        drv = t.driver(9, 7)
        assert wait_until(lambda: t.st()["vsock_dropped_at_stop"] >= 1, 5), t.st()
        exchange(drv, l9, 5000, 40001)
        t.alive()
    finally:
        t.close()


def rss_kib(pid) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_guest_within_its_credit_cannot_make_vnetd_hold_more_than_the_devices_pool(lab):
    """48 connections to a host program that reads nothing, the guest
    sending on each as much as its credit allows (256 KiB held each, past
    what the host socket took): vnetd holds at most 8 MiB for the device
    (`HELD_MAX`), resetting the connections that need more
    (`vsock_held_full`), never one for credit (the guest kept to it); its
    resident memory grows by less than the pool and a margin, not by the
    12 MiB the connections' credit adds up to; vm8 works meanwhile."""
    t = VsockLab(lab)
    try:
        t.listen(9, 5002, read=False)
        l8 = t.listen(8, 5000)
        drv, drv8 = t.driver(9, 7), t.driver(8, 8)
        before = rss_kib(t.d.proc.pid)
        chunk = bytes(vf.BUF - vd.HDR)
        sent_total, reset = 0, set()
        for k in range(48):
            port = 50000 + k
            ans = drv.connect(port, 5002)
            assert ans is not None and ans.op == vd.RESPONSE, ans
            alloc, fwd, tx = ans.buf_alloc, ans.fwd_cnt, 0
            stalls = 0
            while stalls < 3 and port not in reset:
                if tx - fwd + len(chunk) <= alloc:
                    drv.packet(port, 5002, vd.RW, chunk)
                    tx += len(chunk)
                    sent_total += len(chunk)
                    stalls = 0
                else:
                    drv.packet(port, 5002, vd.CREDIT_REQUEST)
                    time.sleep(0.02)
                    stalls += 1
                for p in drv.poll():
                    if p.op == vd.RST:
                        reset.add(p.dst_port)
                    elif p.dst_port == port:
                        alloc, fwd = p.buf_alloc, p.fwd_cnt
        st = t.st()
        grew = rss_kib(t.d.proc.pid) - before
        print(f"{sent_total / 1e6:.1f} MB sent on 48 connections, {len(reset)} reset, vnetd grew {grew} KiB", flush=True)
        assert st["vsock_credit_violations"] == 0, st
        assert st["vsock_held_full"] >= 1 and len(reset) >= st["vsock_held_full"], (st, reset)
        assert grew < 8 * 1024 + 4 * 1024, f"vnetd grew {grew} KiB"
        exchange(drv8, l8, 5000, 40000)
        t.alive()
    finally:
        t.close()


def test_a_vm_flooding_its_vsock_device_stops_no_other_vms_connections(lab):
    """The noisy neighbour: vm9's driver (its own process) sends every
    packet no guest may send, packets for no connection and connections
    asked for where nothing listens, as fast as it can, for 8 s. Meanwhile vm8 makes 10
    connections carrying 64 KB each way: every one answered and intact
    (each within exchange's 5 s). How long vm8's exchanges took, quiet and
    under the flood, is printed (not bounded: on this 2-core machine the
    flooder's own CPU is most of what vm8 loses). vm9's flood is refused
    and counted throughout."""
    t = VsockLab(lab)
    try:
        # vm9's connects find nothing listening: refused, as fast as it asks.
        l8 = t.listen(8, 5000)
        drv8 = t.driver(8, 8)
        began = time.monotonic()
        for k in range(10):
            exchange(drv8, l8, 5000, 41000 + k, n=64_000)
        quiet = time.monotonic() - began
        flooder = t.lab.popen(t.h, sys.executable, str(REPO / "tests" / "tools" / "vsock_driver.py"), "flood",
                              str(t.lab.tmp / "vm9.sock.vsock"), "7", "8", stdout=subprocess.PIPE, text=True)
        try:
            assert wait_until(lambda: t.st()["vsock_bad_packets"] > 1000, 10), t.st()
            began = time.monotonic()
            for k in range(10):
                exchange(drv8, l8, 5000, 42000 + k, n=64_000)
            flooded = time.monotonic() - began
            still = t.st()["vsock_bad_packets"]
            time.sleep(0.5)
            assert t.st()["vsock_bad_packets"] > still, "the flood was over before vm8's exchanges were"
        finally:
            out = flooder.communicate(timeout=30)[0]
        st9, st8 = t.st(9), t.st(8)
        print(f"vm8: 10 exchanges of 64 KB each way in {quiet:.2f} s quiet, {flooded:.2f} s under vm9's flood "
              f"of {out.strip()} packets ({st9['vsock_bad_packets']} refused, {st9['vsock_unknown_packets']} for no "
              f"connection, {st9['vsock_guest_connects']} connects)", flush=True)
        assert st8["vsock_bad_packets"] == 0 and st8["vsock_unknown_packets"] == 0, st8
        t.alive()
    finally:
        t.close()
