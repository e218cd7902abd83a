"""VTOE end to end (docs/vtoe.md): unmodified programs under `vtoe` in guest
namespaces on two hosts, their TCP connections carried by shadow
connections between the hosts.

The lab: hosts h1, h2, h3 on one LAN. h1 and h2 carry VTOE to each other
(`LINK ADD ... vtoe lab`); h3 is linked to both without it. Guests (veth,
each in its own namespace): g1 on h1; g2, g4, g5 on h2; g3 on h3. h1 has no
route to g4's MAC at all (its frames go nowhere); h1 routes g5's MAC to h2,
but h2 delivers g5's frames only from its own interfaces (its routes forbid
what comes from h1).
"""

import ctypes
import hashlib
import json
import os
import re
import signal
import socket
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from netlab import BIN, REPO, Lab, guest_mac, mpi_agent, overlay_ip, wait_listening, wait_until

VTOE = BIN / "vtoe"
PROBE = REPO / "tests" / "tools" / "vtoe_probe.py"
XFER = REPO / "tests" / "tools" / "xfer.py"
PINGPONG = REPO / "tests" / "tools" / "mpi_pingpong.py"
MTU = 1458

GUESTS = {1: [1], 2: [2, 4, 5], 3: [3]}
VTOE_PEERS = {1: [2], 2: [1], 3: []}


def host_config(h: int, ns: dict[int, str]) -> str:
    lines = []
    for g in GUESTS[h]:
        lines.append(f"INTERFACE ADD g{g} {guest_mac(g)} mtu {MTU} netns {ns[g]} veth")
    for o in GUESTS:
        if o != h:
            vt = " vtoe lab" if o in VTOE_PEERS[h] else ""
            lines.append(f"LINK ADD 198.18.0.{o}{vt}")
    for g in GUESTS[h]:
        mac = guest_mac(g)
        src = "interface" if g == 5 else "any"  # g5: only from this host's interfaces
        lines.append(f"ROUTE ADD any {mac} interface {mac} {src}")
        lines.append(f"ROUTE ADD any ff:ff:ff:ff:ff:ff interface {mac} any")
    for o in GUESTS:
        if o == h:
            continue
        for g in GUESTS[o]:
            if h == 1 and g == 4:
                continue  # h1 does not route g4's frames anywhere
            lines.append(f"ROUTE ADD any {guest_mac(g)} edge 198.18.0.{o} any")
        lines.append(f"ROUTE ADD any ff:ff:ff:ff:ff:ff edge 198.18.0.{o} interface")
    return "\n".join(lines) + "\n"


class World:
    def __init__(self, lab: Lab):
        self.lab = lab
        hosts = {h: lab.add_host(h) for h in GUESTS}
        ns = {g: lab.guest_ns(f"g{g}") for gs in GUESTS.values() for g in gs}
        self.hosts, self.guest_namespaces = hosts, ns
        self.sock = {h: lab.tmp / f"vtoe-h{h}.sock" for h in GUESTS}
        lab.tmp.chmod(0o711)  # guests' unprivileged users reach the sockets
        self.vnetd = {h: self.start(h) for h in GUESTS}
        self.guest = {g: lab.veth_guest(hosts[h], f"g{g}", g, ns[g]) for h, gs in GUESTS.items() for g in gs}
        self.host_of = {g: h for h, gs in GUESTS.items() for g in gs}

    def start(self, h: int):
        return self.lab.start_vnetd(self.hosts[h], host_config(h, self.guest_namespaces), "--vtoe-socket", self.sock[h])

    def ns(self, g: int) -> str:
        return self.guest[g].ns

    def ip(self, g: int) -> str:
        return overlay_ip(g)

    def under(self, g: int, *cmd) -> list:
        """`cmd` run by vtoe in guest g's namespace, on its host's vnetd."""
        return [VTOE, "--socket", self.sock[self.host_of[g]], "-v", *cmd]

    def x(self, g: int, *cmd, vtoe=True, **kw):
        return self.lab.x(self.ns(g), *(self.under(g, *cmd) if vtoe else cmd), **kw)

    def popen(self, g: int, *cmd, vtoe=True, **kw):
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.STDOUT)
        kw.setdefault("text", True)
        return self.lab.popen(self.ns(g), *(self.under(g, *cmd) if vtoe else cmd), **kw)

    def vtoe_stats(self, h: int) -> tuple[dict, list[dict]]:
        """STATS vtoe on host h: the counters, and one dict per connection."""
        counters, conns = {}, []
        for line in self.vnetd[h].ctl("STATS", "vtoe").stdout.splitlines():
            words = line.split()
            kv = dict(w.split("=", 1) for w in words[1:] if "=" in w)
            vals = {k: int(v) if v.isdigit() else v for k, v in kv.items()}
            if words[0] == "vtoe":
                counters = vals
            elif words[0] == "vtoe_conn":
                conns.append(vals)
        return counters, conns

    def tcp_segments(self, g: int) -> int:
        """Segments the guest namespace's own TCP sent and received."""
        rows = [l.split() for l in self.lab.x(self.ns(g), "cat", "/proc/net/snmp").stdout.splitlines() if l.startswith("Tcp:")]
        t = dict(zip(rows[0], rows[1]))
        return int(t["InSegs"]) + int(t["OutSegs"])


@pytest.fixture
def world(lab):
    w = World(lab)
    # The overlay works before anything else (g4 and g5 are not reachable
    # from g1, by the routes).
    for a, b in [(1, 2), (1, 3)]:
        assert lab.reaches(w.guest[a], w.guest[b]), f"g{a} cannot ping g{b}"
    return w


def result(out: str) -> list[str]:
    """The program's last line of output (not the runner's), in words."""
    return [l for l in out.splitlines() if not l.startswith("vtoe: ")][-1].split()


def served(out: str) -> list[dict]:
    """What `vtoe_probe.py serve` reported."""
    return next(json.loads(l) for l in out.splitlines() if l.startswith('{"served"'))["served"]


def own_line(p: subprocess.Popen) -> str:
    """The program's next line of output, past the runner's."""
    while (l := p.stdout.readline()).startswith("vtoe: "):
        pass
    return l.strip()


def finish(p: subprocess.Popen, timeout=60) -> str:
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        raise AssertionError(f"{p.args} did not finish:\n{out}")
    assert p.returncode == 0, out
    return out


def test_iperf3_both_ways_offloaded_tcp_runs_once(world):
    w = world
    before = {g: w.tcp_segments(g) for g in (1, 2)}
    for reverse in (False, True):
        srv = w.popen(2, "iperf3", "-s", "-1")
        wait_listening(w.lab, w.ns(2), 5201)
        args = ["-R"] if reverse else []
        r = w.x(1, "iperf3", "-c", w.ip(2), "-t", "2", "-J", *args, timeout=60)
        res = json.loads(r.stdout)
        gbits = res["end"]["sum_received"]["bits_per_second"] / 1e9
        moved = res["end"]["sum_received"]["bytes"]
        assert gbits > 1 and moved > 250e6, res["end"]
        # The server saw the client's overlay address, and so did the client its peer's.
        assert res["start"]["connected"][0]["local_host"] == w.ip(1)
        assert res["start"]["connected"][0]["remote_host"] == w.ip(2)
        out = finish(srv)
        assert f"Accepted connection from {w.ip(1)}" in out, out
        assert "offloaded connection from" in out
    # Gigabytes crossed; the guests' own TCP saw next to nothing of them
    # (the wake-up connections on the server's loopback and ARP-free setup).
    moved_segments = {g: w.tcp_segments(g) - before[g] for g in (1, 2)}
    assert all(v < 200 for v in moved_segments.values()), moved_segments
    c1, _ = w.vtoe_stats(1)
    c2, _ = w.vtoe_stats(2)
    # iperf3: a control and a data connection per run.
    assert c1["offloaded_out"] == 4 and c2["offloaded_in"] == 4, (c1, c2)
    assert c1["offers"] == 4


def test_200_mb_arrive_whole_and_the_connection_is_listed_while_open(world):
    w = world
    n = 200 * 1000 * 1000
    recv = w.popen(2, "python3", XFER, "recv", "7001")
    wait_listening(w.lab, w.ns(2), 7001)
    # `hold`: the connection stays open after its last byte until the test
    # closes the sender's standard input (`finish`), so that it is listed
    # however fast the 200 MB go (a CI run's first listing came after the
    # connection had closed).
    send = w.popen(1, "python3", XFER, "send", w.ip(2), "7001", str(n), "hold", stdin=subprocess.PIPE)
    # While it runs, both vnetds list it, with the guests' and the hosts' ends.
    listed = wait_until(lambda: [c for c in w.vtoe_stats(1)[1] if c["guest"].endswith(f"{w.ip(2)}:7001")], timeout=10)
    assert listed, w.vtoe_stats(1)
    c = listed[0]
    assert c["dir"] == "out" and c["iface"] == "g1" and c["guest"].startswith(f"{w.ip(1)}:")
    assert re.fullmatch(r"198\.18\.0\.1:\d+->198\.18\.0\.2:9002", c["shadow"]), c
    sent, got = result(finish(send, 120)), result(finish(recv, 120))
    assert sent[0] == str(n) and sent[-2:] == got[-2:], (sent, got)
    # Once closed, it is gone from the list (the kernel told vnetd).
    assert wait_until(lambda: not w.vtoe_stats(1)[1] and not w.vtoe_stats(2)[1], timeout=10), (w.vtoe_stats(1), w.vtoe_stats(2))


def stuck_threads(pid: int) -> str:
    """The system call and wait channel of every thread of `pid` and its
    children (the vtoe runner and the program it runs)."""
    out = []
    pids = [pid]
    for p in pids:
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                base = f"/proc/{p}/task/{t}"
                read = lambda f: open(f"{base}/{f}").read().strip()
                out.append(f"{p}/{t} {read('comm')}: syscall {read('syscall').split(' ')[0]} wchan {read('wchan')}")
                pids += [int(c) for c in read("children").split()]
        except OSError:
            continue
    return "; ".join(out)


def test_curl_fetches_from_python_http_server(world):
    w = world
    body = "vtoe over vnet\n" * 1000
    (w.lab.tmp / "www").mkdir()
    (w.lab.tmp / "www" / "index.txt").write_text(body)
    srv = w.popen(2, "python3", "-m", "http.server", "8080", "--bind", "0.0.0.0", "--directory", w.lab.tmp / "www")
    wait_listening(w.lab, w.ns(2), 8080)
    try:
        for _ in range(3):
            r = w.x(1, "curl", "-sS", "--max-time", "20", f"http://{w.ip(2)}:8080/index.txt", timeout=30)
            assert r.stdout == body
    finally:
        srv.send_signal(signal.SIGINT)
        try:
            out = srv.communicate(timeout=10)[0]
        except subprocess.TimeoutExpired:
            # Seen twice in full runs, never alone: say where the server's
            # threads wait (the system call, and the kernel's wait channel)
            # before it is killed.
            where = stuck_threads(srv.pid)
            srv.kill()
            out = srv.communicate()[0]
            raise AssertionError(f"the server under vtoe did not exit on SIGINT within 10 s: {where}\n{out[-2000:]}")
    # The server logged the client's overlay address for every request.
    assert out.count(f'{w.ip(1)} - - ') == 3, out
    assert w.vtoe_stats(2)[0]["offloaded_in"] == 3


def test_redis_benchmark_against_redis_server(world):
    w = world
    srv = w.popen(2, "redis-server", "--port", "6380", "--save", "", "--appendonly", "no", "--protected-mode", "no")
    wait_listening(w.lab, w.ns(2), 6380)
    try:
        r = w.x(1, "redis-benchmark", "-h", w.ip(2), "-p", "6380", "-c", "10", "-n", "5000", "-t", "set,get", "-q", timeout=120)
        rates = re.findall(r"^(SET|GET): ([\d.]+) requests per second", r.stdout, re.M)
        assert {k for k, _ in rates} == {"SET", "GET"} and all(float(v) > 0 for _, v in rates), r.stdout
        r = w.x(1, "redis-cli", "-h", w.ip(2), "-p", "6380", "CLIENT", "LIST", timeout=30)
        assert f"addr={w.ip(1)}:" in r.stdout, r.stdout
    finally:
        srv.terminate()
        srv.communicate(timeout=10)
    c1, _ = w.vtoe_stats(1)
    # redis-benchmark's 10 clients for each test, and the redis-cli.
    assert c1["offloaded_out"] >= 21 and c1["offers"] == c1["offloaded_out"], c1


def test_openmpi_ping_pong_over_the_tcp_btl(world):
    w = world
    # OpenMPI starts its daemons without ssh; each host's ranks find their
    # vnetd by VNETD_SOCKET, as `vtoe` does.
    agent = mpi_agent(w.lab.tmp, {w.ns(g): w.sock[w.host_of[g]] for g in (1, 2)})
    subnet = "198.19.0.0/24"
    before = {g: w.tcp_segments(g) for g in (1, 2)}
    # Every rank runs under vtoe: `mpirun ... vtoe <program>`.
    r = w.lab.x(w.ns(1), "env", f"VNETD_SOCKET={w.sock[1]}",
                "mpirun", "--allow-run-as-root", "-H", f"{w.ns(1)},{w.ns(2)}", "-np", "2", "--bind-to", "none",
                # No topology in shared memory: hwloc's placement of it
                # sometimes lands on the orted's stack (a segfault, seen here).
                "--mca", "rtc_hwloc_vmhole", "none",
                "--mca", "plm_rsh_agent", agent, "--mca", "oob_tcp_if_include", subnet, "--mca", "pml", "ob1",
                "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", subnet,
                VTOE, "/usr/bin/python3", PINGPONG, "1", "1024", "65536", "1048576", "4194304", timeout=240)
    assert r.stdout.strip().endswith("ok"), r.stdout + r.stderr
    c1, _ = w.vtoe_stats(1)
    c2, _ = w.vtoe_stats(2)
    # The ranks' connection (the TCP BTL's) is offloaded: one side
    # connected, the other accepted.
    assert c1["offloaded_out"] + c2["offloaded_out"] >= 1, (c1, c2)
    assert c1["offloaded_out"] == c2["offloaded_in"] and c2["offloaded_out"] == c1["offloaded_in"], (c1, c2)
    # Each rank's own TCP carried the MPI runtime's control connections
    # (not under vtoe) and nothing of the messages: the guest kernel would
    # have needed a segment per 1406 bytes for them, acknowledgements aside.
    lines = [l.split() for l in r.stdout.splitlines() if re.fullmatch(r"\d+ \d+ [\d.]+", l.strip())]
    data = sum(2 * int(size) * int(rounds) for size, rounds, _ in lines)
    assert data > 50e6, r.stdout
    moved = {g: w.tcp_segments(g) - before[g] for g in (1, 2)}
    assert all(v < data / (MTU - 52) / 50 for v in moved.values()), (moved, data)


def test_socket_semantics_nonblocking_connect_epoll_fork_dup_half_close(world):
    w = world
    srv = w.popen(2, "python3", PROBE, "serve", "7002", "1")
    wait_listening(w.lab, w.ns(2), 7002)
    r = json.loads(w.x(1, "python3", PROBE, "client", w.ip(2), "7002", "3000000", timeout=60).stdout.splitlines()[0])
    sv = served(finish(srv))[0]
    # Non-blocking connect: EINPROGRESS (as the kernel's own would answer),
    # then writable at once with no error.
    assert r["connect"] == "EINPROGRESS" and r["writable"] and r["so_error"] == 0, r
    # Options set before connect are the connection's.
    assert r["nodelay"] == 1 and r["sndbuf"] == 2 << 20, r
    # Both ends see the overlay's addresses, accept's included.
    assert r["sockname"].startswith(w.ip(1) + ":") and r["peername"] == f"{w.ip(2)}:7002", r
    assert sv["accepted_from"] == r["sockname"] == sv["peername"], (r, sv)
    assert sv["sockname"] == f"{w.ip(2)}:7002"
    # A forked child and a dup wrote into one stream; after the half-close
    # the server read it all to EOF and still answered.
    assert r["child_status"] == 0 and r["answer"] == r["expect"], r
    assert w.vtoe_stats(1)[0]["offloaded_out"] == 1


def test_vtoe_client_and_plain_server_and_plain_client_and_vtoe_server(world):
    w = world
    # A vtoe client, a plain server: not offloaded (the peer has no listener under vtoe), but connected.
    srv = w.popen(2, "python3", XFER, "recv", "7003", vtoe=False)
    wait_listening(w.lab, w.ns(2), 7003)
    sent = w.x(1, "python3", XFER, "send", w.ip(2), "7003", "1000000", timeout=60)
    assert sent.stdout.split()[-1] == result(finish(srv))[-1]
    assert "not offloaded: no_listener" in sent.stderr, sent.stderr
    # A plain client, a vtoe server: plain too.
    srv = w.popen(2, "python3", XFER, "recv", "7004")
    wait_listening(w.lab, w.ns(2), 7004)
    sent = w.x(1, "python3", XFER, "send", w.ip(2), "7004", "1000000", vtoe=False, timeout=60)
    assert sent.stdout.split()[-1] == result(finish(srv))[-1]
    # A vtoe client to a host whose link carries no VTOE: plain.
    srv = w.popen(3, "python3", XFER, "recv", "7005")
    wait_listening(w.lab, w.ns(3), 7005)
    sent = w.x(1, "python3", XFER, "send", w.ip(3), "7005", "1000000", timeout=60)
    assert sent.stdout.split()[-1] == result(finish(srv))[-1]
    assert "not offloaded: no_vtoe_link" in sent.stderr, sent.stderr
    c1, _ = w.vtoe_stats(1)
    c2, _ = w.vtoe_stats(2)
    assert c1["offloaded_out"] == 0 and c1["fallback_no_listener"] == 1 and c1["fallback_no_vtoe_link"] == 1, c1
    assert c2["declined_no_listener"] == 1, c2


def connect_outcome(w: World, g: int, ip: str, port: int, vtoe: bool) -> str:
    code = (f"import socket\ns = socket.socket(); s.settimeout(4)\n"
            f"try:\n s.connect(({ip!r}, {port})); print('connected')\n"
            f"except socket.timeout: print('timeout')\n"
            f"except OSError as e: print(e.strerror)\n")
    return w.x(g, "python3", "-c", code, vtoe=vtoe, timeout=60).stdout.strip()


# A connect to argv[1]:argv[2]: its error, then how many ARP requests for
# that address the guest sent meanwhile (a packet socket opened before it).
UNRESOLVED = r"""
import socket, sys
ip, port = sys.argv[1], int(sys.argv[2])
p = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))  # ETH_P_ALL: sent frames too
p.setblocking(False)
s = socket.socket()
s.settimeout(8)
try:
    s.connect((ip, port))
    print("connected")
except socket.timeout:
    print("timeout")
except OSError as e:
    print(e.strerror)
n = 0
while True:
    try:
        f, a = p.recvfrom(2048)
    except BlockingIOError:
        break
    n += a[2] == socket.PACKET_OUTGOING and f[12:14] == b"\x08\x06" and f[20:22] == b"\0\1" and f[38:42] == socket.inet_aton(ip)
print(n)
"""


def unresolved_outcome(w: World, g: int, ip: str, port: int, vtoe: bool) -> tuple[str, int]:
    """Guest g connects to `ip`, its neighbour entry flushed first: the
    error, and the ARP requests for `ip` the guest sent."""
    w.lab.x(w.ns(g), "ip", "neigh", "flush", "to", ip, check=False)
    out = w.x(g, "python3", "-c", UNRESOLVED, ip, str(port), vtoe=vtoe, timeout=60).stdout.splitlines()
    return out[-2], int(out[-1])


def test_routes_that_forbid_a_guest_forbid_it_with_vtoe_too(world):
    w = world
    for g in (4, 5):
        w.popen(g, "python3", PROBE, "serve", "7006", "1")
        wait_listening(w.lab, w.ns(g), 7006)
    # h1 routes g4's frames nowhere; h2 takes g5's only from its own guests.
    for g in (4, 5):
        plain = connect_outcome(w, 1, w.ip(g), 7006, vtoe=False)
        offload = connect_outcome(w, 1, w.ip(g), 7006, vtoe=True)
        assert plain == offload == "timeout", (g, plain, offload)
    # An address nobody answers ARP for: EHOSTUNREACH after the guest
    # kernel's own 3 ARP probes, either way (with VTOE, vnetd has the guest's
    # kernel resolve it and refuses the connect when it cannot). Catches: an
    # unresolved destination handed to the Ethernet path (mutated so, the
    # guest sent 6 ARP requests).
    plain = unresolved_outcome(w, 1, overlay_ip(99), 7006, vtoe=False)
    offload = unresolved_outcome(w, 1, overlay_ip(99), 7006, vtoe=True)
    assert plain == offload == ("No route to host", 3), (plain, offload)
    c1, _ = w.vtoe_stats(1)
    c2, _ = w.vtoe_stats(2)
    assert c1["refused_unresolved"] == 1, c1
    assert c1["fallback_no_route"] >= 1 and c1["fallback_peer_routes"] >= 1, c1
    assert c1["offloaded_out"] == 0 and c2["declined_peer_routes"] >= 1, (c1, c2)


PEER = REPO / "tests" / "tools" / "vtoe_peer.py"
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]


def readable_by_nobody(lab, path: Path) -> Path:
    """A copy of `path` that uid 65534 can read, wherever the checkout is
    (a checkout under a 0700 directory is not)."""
    d = lab.tmp / "public"
    d.mkdir(exist_ok=True)
    for p in (lab.tmp, d):
        p.chmod(0o755)
    copy = d / path.name
    shutil.copy(path, copy)
    copy.chmod(0o644)
    return copy


def host_listener(w: World, h: int, port: int) -> subprocess.Popen:
    """A service on host h's own loopback, which no guest may reach: it
    prints every connection it gets."""
    code = (f"import socket\ns = socket.create_server(('127.0.0.1', {port}))\nprint('up', flush=True)\n"
            f"while True:\n c, a = s.accept(); print('GOT', a, flush=True)\n")
    p = w.lab.popen(w.vnetd[h].host, "python3", "-c", code, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "up"
    return p


def host_listening_ports(w: World, h: int) -> set[int]:
    out = w.lab.x(w.vnetd[h].host, "ss", "-Hltn").stdout
    return {int(l.split()[3].rsplit(":", 1)[1]) for l in out.splitlines()}


def unreachable_from_host(w: World, h: int, ports: set[int]) -> bool:
    """No connection from host h's own namespace gets through to these ports."""
    code = ("import socket, sys\nfor p in sys.argv[1:]:\n try:\n  socket.create_connection(('127.0.0.1', int(p)), timeout=2)\n"
            "  print('reached', p)\n except OSError: pass\n")
    return "reached" not in w.lab.x(w.vnetd[h].host, "python3", "-c", code, *map(str, ports), timeout=30).stdout


def test_an_offloaded_socket_cannot_be_turned_to_the_host_by_whoever_holds_it(world):
    w = world
    target = host_listener(w, 1, 7999)
    w.popen(2, "python3", PROBE, "serve", "7010", "2")
    wait_listening(w.lab, w.ns(2), 7010)
    listened = 0
    for supervised in (True, False):
        before = host_listening_ports(w, 1)
        if supervised:
            # The program itself, unprivileged, under vtoe.
            p = w.lab.popen(w.ns(1), *NOBODY, *w.under(1, "python3", readable_by_nobody(w.lab, PROBE), "escape", w.ip(2), "7010", "7999"),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            r = json.loads(p.stdout.readline())
            holder = p
        else:
            # Handed to a root process of the guest that vtoe does not supervise.
            holder = w.popen(1, "python3", PROBE, "attempts", w.lab.tmp / "pass.sock", "7999", vtoe=False, stdin=subprocess.PIPE)
            assert json.loads(holder.stdout.readline())["ready"]
            out = w.x(1, "python3", PROBE, "escape", w.ip(2), "7010", "7999", w.lab.tmp / "pass.sock", timeout=60).stdout
            r = json.loads([l for l in out.splitlines() if l.startswith("{")][0])
        # Whoever holds it, it reported the overlay's ends, not the host's.
        assert r["before"]["peername"] == f"{w.ip(2)}:7010" and r["before"]["sockname"].startswith(w.ip(1) + ":"), r
        # The guard: a disconnect goes through (no cgroup hook sees it), but
        # then no connect, no bind, no device, and ...
        assert r["connect_host"] == "EPERM" and r["bind"] == "EPERM" and r["bindtodevice"] == "EPERM", r
        # ... a listen on the host port it holds reaches nobody. (This
        # machine's kernel, 6.18.44, refuses a listen on a socket disconnected
        # from an established connection, EINVAL: then no port listens at all.)
        rogue = host_listening_ports(w, 1) - before
        if r["listen"] == "OK":
            assert rogue and unreachable_from_host(w, 1, rogue), rogue
            listened += 1
        else:
            assert r["listen"] == "EINVAL" and not rogue, (r, rogue)
        if supervised:
            assert r["ifconf"] == "EPERM", r  # the runner: no interface ioctl on a host socket
        holder.stdin.close()
        holder.wait(timeout=10)
    target.kill()
    assert "GOT" not in target.communicate()[0]
    c1, _ = w.vtoe_stats(1)
    assert c1["guard_denied_connect"] == 2 and c1["guard_denied_bind"] == 2 and c1["guard_denied_sockopt"] == 2, c1
    assert c1["guard_dropped_in"] >= listened and c1["runner_refused_ioctl"] == 1, c1


def test_a_shadow_connection_needs_the_links_key_and_the_routes(world):
    w = world
    srv = w.popen(2, "python3", PROBE, "serve", "7011", "1")
    wait_listening(w.lab, w.ns(2), 7011)
    key = w.lab.key_dir / "lab"
    args = [guest_mac(1), guest_mac(2), f"{w.ip(1)}:40000", f"{w.ip(2)}:7011"]

    def peer(h, key_file, *a, data="hello"):
        r = w.lab.x(w.vnetd[h].host, "python3", PEER, "198.18.0.2", "9002", key_file, *a, data, timeout=30)
        return json.loads(r.stdout)

    # A stranger without the key (from h1's address): the challenge does not
    # check out for it, and its request is refused.
    r = peer(1, "-", *args)
    assert r["challenge_ok"] is False and r["verdict"].startswith("none"), r
    # From a host with no VTOE link (h3), even with the key: closed at once.
    r = peer(3, key, *args)
    assert r.get("verdict", r.get("challenge", "")).startswith("none"), r
    # With the key, but for a guest h2's routes do not deliver from h1 (g5).
    r = peer(1, key, guest_mac(1), guest_mac(5), f"{w.ip(1)}:40000", f"{w.ip(5)}:7011")
    assert r["verdict_ok"] and r["verdict"] == "declined 12", r  # peer_routes
    # With the key and a port nobody listens on under vtoe.
    r = peer(1, key, guest_mac(1), guest_mac(2), f"{w.ip(1)}:40000", f"{w.ip(2)}:7099")
    assert r["verdict_ok"] and r["verdict"] == "declined 11", r  # no_listener
    # The program got none of these; a well-formed request from h1, written
    # from the spec alone, is accepted and reaches it.
    r = peer(1, key, *args, data="from the spec")
    assert r["verdict_ok"] and r["verdict"] == "accepted", r
    got = served(finish(srv))
    assert len(got) == 1 and got[0]["accepted_from"] == f"{w.ip(1)}:40000", got
    assert got[0]["bytes"] == len("from the spec") and r["reply"].startswith("13 "), (got, r)
    c2, _ = w.vtoe_stats(2)
    assert c2["declined_peer_auth"] == 2 and c2["declined_peer_routes"] == 1 and c2["declined_no_listener"] == 1, c2
    assert c2["offloaded_in"] == 1


def test_stalled_handshakes_are_bounded_and_the_one_beyond_takes_the_ethernet_path(world):
    """reliability.md's VTOE bounds: 64 handshakes in progress at once, a
    stalled one held 2 s at most; beyond them an incoming shadow connection
    is declined (declined_limit) and the guest's connection takes the
    Ethernet path. From h1's address (a VTOE link's), 64 connections stall
    after HELLO, all at once (half of them then trickle their REQUEST a
    byte every 0.5 s); a guest's connection is the 65th. Catches: a per-read
    handshake timeout (the trickling ones were held past 8 s; fixed in
    2d290bc), a pool whose burst of jobs queues behind a few threads (2 of
    the 64 got a challenge within 1 s, and nothing was declined; fixed in
    34eae2f), and any limit that is not enforced."""
    w = world
    srv = w.popen(2, "python3", PROBE, "serve", "7015", "2")
    wait_listening(w.lab, w.ns(2), 7015)
    code = ("import socket, sys\nsys.stdin.readline()\ns = socket.create_connection((sys.argv[1], 7015))\n"
            "s.sendall(b'y' * 1000); s.shutdown(socket.SHUT_WR)\nprint(s.recv(200).decode())\n")
    cli = w.popen(1, "python3", "-c", code, w.ip(2), stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    stall = w.lab.popen(w.vnetd[1].host, "python3", PEER, "stall", "198.18.0.2", "9002", "64", stdout=subprocess.PIPE, text=True)
    assert json.loads(stall.stdout.readline()) == {"held": 64}
    # All 64 handshakes are held: the guest's connection, the 65th, is
    # declined by h2 (closed before a challenge: h1 counts it a protocol
    # failure), and goes over the Ethernet path, whole.
    cli.stdin.write("\n")
    cli.stdin.flush()
    out, err = cli.communicate(timeout=30)
    assert out.startswith("1000 "), (out, err)
    assert "not offloaded: protocol" in err, err
    closed = json.loads(stall.stdout.readline())["closed_after"]
    stall.wait(timeout=10)
    # Each stalled handshake, silent or trickling, was closed 2 s after its
    # challenge (bounds generous for a loaded machine).
    assert all(c is not None and 1.5 <= c <= 4 for c in closed), closed
    c1, _ = w.vtoe_stats(1)
    c2, _ = w.vtoe_stats(2)
    assert c2["declined_limit"] == 1 and c2["declined_protocol"] == 64 and c2.get("offloaded_in", 0) == 0, c2
    assert c1["fallback_protocol"] == 1 and c1["offloaded_out"] == 0, c1
    # Afterwards, the handshakes are free again: a connection is offloaded.
    sent = w.x(1, "python3", PROBE, "client", w.ip(2), "7015", "1000", timeout=60)
    assert f"connect to {w.ip(2)}:7015 offloaded" in sent.stderr, sent.stderr
    got = served(finish(srv))
    assert [g["bytes"] for g in got] == [1000, 1000], got
    assert w.vtoe_stats(2)[0]["offloaded_in"] == 1


# argv[3] connects at once to argv[1]:argv[2], each on a thread of its own,
# after a line on stdin; prints each one's error (or "connected").
MANY_CONNECTS = r"""
import socket, sys, threading
ip, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
out = []
def one():
    s = socket.socket()
    s.settimeout(10)
    try:
        s.connect((ip, port))
        out.append("connected")
    except socket.timeout:
        out.append("timeout")
    except OSError as e:
        out.append(e.strerror)
ts = [threading.Thread(target=one) for _ in range(n)]
print("ready", flush=True)
sys.stdin.readline()
for t in ts:
    t.start()
for t in ts:
    t.join()
print(sorted(set(out)), len(out), flush=True)
"""


def test_connects_being_decided_are_bounded_per_runner_and_in_all(world):
    """reliability.md's VTOE bounds on the connecting side: 64 connects of
    one runner decided at once, 256 over all runners; beyond them a
    connection is not offloaded (fallback_limit) and goes its own way in the
    guest's kernel. Each connect here waits about 3 s in vnetd, which has
    the guest's kernel resolve an address nobody answers (EHOSTUNREACH).
    Catches: the pool's burst queueing (before 34eae2f, all 260 connects of
    the second phase were taken, none limited), and either bound not
    enforced."""
    w = world
    c = lambda: w.vtoe_stats(1)[0]

    def burst(counts: list[int]) -> list[str]:
        w.lab.x(w.ns(1), "ip", "neigh", "flush", "to", overlay_ip(99), check=False)
        progs = [w.popen(1, "python3", "-c", MANY_CONNECTS, overlay_ip(99), "7016", str(n), stdin=subprocess.PIPE,
                         stderr=subprocess.PIPE) for n in counts]
        for p in progs:
            assert p.stdout.readline().strip() == "ready"
        for p in progs:
            p.stdin.write("\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=60) for p in progs]
        for (out, _), n in zip(outs, counts):
            assert out.strip() == f"['No route to host'] {n}", out
        return [err for _, err in outs]

    # One runner, 65 at once: the 65th is not offloaded (and fails as the
    # kernel's own connect does), the 64 others are refused by vnetd.
    err = burst([65])[0]
    assert err.count("not offloaded: limit") == 1 and err.count("refused: ") == 64, err
    assert c()["fallback_limit"] == 1 and c()["refused_unresolved"] == 64, c()
    # Five runners, 52 each (each under its own bound): 256 are decided,
    # 4 are not offloaded.
    errs = burst([52] * 5)
    assert sum(e.count("not offloaded: limit") for e in errs) == 4, errs
    assert c()["fallback_limit"] == 5 and c()["refused_unresolved"] == 64 + 256 and c()["offers"] == 65 + 260, c()


def test_a_runner_registers_1024_listeners_and_no_more(world):
    """reliability.md: 1024 listeners per runner. A program under vtoe
    listens on 1025 ports: each listen succeeds, 1024 are registered
    (offloaded connections reach them), the 1025th is the guest kernel's
    alone. Catches: the bound counted wrong by one (mutated to `>`: 1025
    registered), or not enforced."""
    w = world
    code = ("import socket, sys\nls = []\nfor p in range(20000, 21025):\n"
            " s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            " s.bind(('0.0.0.0', p)); s.listen(4); ls.append(s)\n"
            "print('listening', flush=True)\nsys.stdin.readline()\n"
            "for s in (ls[1023], ls[1024]):\n c, a = s.accept(); print(c.recv(10).decode(), flush=True)\n")
    srv = w.lab.popen(w.ns(2), "prlimit", "--nofile=4096", *w.under(2, "python3", "-c", code), stdin=subprocess.PIPE,
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert own_line(srv) == "listening"  # (past the runner's word on the 1025th)
    assert w.vtoe_stats(2)[0]["listeners"] == 1024 and w.vtoe_stats(2)[0]["listen_refused_limit"] == 1
    send = "import socket, sys\ns = socket.create_connection((sys.argv[1], int(sys.argv[2])))\ns.sendall(sys.argv[2].encode())\n"
    last = w.x(1, "python3", "-c", send, w.ip(2), "21023", timeout=30)
    beyond = w.x(1, "python3", "-c", send, w.ip(2), "21024", timeout=30)
    assert "connect to" in last.stderr and f"{w.ip(2)}:21023 offloaded" in last.stderr, last.stderr
    assert "not offloaded: no_listener" in beyond.stderr, beyond.stderr
    srv.stdin.write("\n")
    srv.stdin.flush()
    out = finish(srv, 30)
    assert "21023\n" in out and "21024\n" in out, out
    assert w.vtoe_stats(2)[0]["offloaded_in"] == 1


RUNNER_VERSION = 2  # a Listen carries its listening socket
RUNNER_HELLO = bytes([1, RUNNER_VERSION])
WELCOME = bytes([1, RUNNER_VERSION])
CLONE_NEWNET = 0x40000000


def runner_session(w: World, ns: str | None, h: int = 1) -> socket.socket:
    """A raw session on host h's runner socket, opened in namespace `ns`
    (None: the test's own, the host's)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if ns is None:
        s.connect(str(w.sock[h]))
        return s
    # Make the socket inside the namespace: the kernel records it there.
    cur = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        assert libc.setns(target, CLONE_NEWNET) == 0
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    finally:
        assert libc.setns(cur, CLONE_NEWNET) == 0
        os.close(cur)
        os.close(target)
    s.connect(str(w.sock[h]))
    return s


def test_the_runner_socket_serves_guests_only_and_refuses_bad_messages(world):
    w = world
    # From the host's own namespace: not a guest.
    s = runner_session(w, None)
    s.settimeout(5)
    assert s.recv(64) == bytes([2])  # NotGuest
    assert s.recv(64) == b""
    # A guest's session: garbage ends it, counted.
    for bad in [b"", b"\x02\x00", bytes([99]), RUNNER_HELLO + b"x"]:
        s = runner_session(w, w.ns(1))
        s.settimeout(5)
        if bad:
            s.send(bad)
        else:
            s.send(RUNNER_HELLO)
            s.send(bytes(200))  # too long
            assert s.recv(64) == WELCOME
        assert s.recv(64) == b"", bad
    # A guest that claims another guest's address as its source is refused:
    # EADDRNOTAVAIL, reason source_not_local (16).
    s = runner_session(w, w.ns(1))
    s.settimeout(10)
    s.send(RUNNER_HELLO)
    assert s.recv(64) == WELCOME
    def addr(ip, port):
        return socket.inet_aton(ip) + port.to_bytes(2, "big")
    s.send(bytes([2]) + (7).to_bytes(4, "big") + addr(w.ip(3), 40000) + addr(w.ip(2), 5201))
    m = s.recv(64)
    assert m[0] == 5 and int.from_bytes(m[1:5], "big") == 7 and int.from_bytes(m[5:9], "big") == 99 and m[9] == 16, m
    s.close()
    c1, _ = w.vtoe_stats(1)
    assert c1["runners_not_guest"] == 1 and c1["bad_messages"] == 4 and c1["refused_source_not_local"] == 1, c1


def test_a_route_deleted_aborts_the_offloaded_connections_it_carried(world):
    w = world
    srv = w.popen(2, "python3", PROBE, "serve", "7012", "2")
    wait_listening(w.lab, w.ns(2), 7012)
    code = ("import socket, sys, errno\ns = socket.create_connection((sys.argv[1], 7012))\ns.sendall(b'x')\n"
            "print('connected', flush=True)\nsys.stdin.readline()\n"
            "try:\n print('read', s.recv(10))\nexcept OSError as e:\n print(errno.errorcode[e.errno], flush=True)\n")
    cli = w.popen(1, "python3", "-c", code, w.ip(2), stdin=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert cli.stdout.readline().strip() == "connected"
    assert w.vtoe_stats(1)[0]["open"] == 1
    # The route that carried it goes: by the reply, the connection is gone too.
    route = f"any {guest_mac(2)} edge 198.18.0.2 any"
    w.vnetd[1].ctl("ROUTE", "DEL", *route.split())
    c1, conns = w.vtoe_stats(1)
    assert c1["revoked"] == 1 and not conns, (c1, conns)
    cli.stdin.write("\n")
    cli.stdin.flush()
    assert cli.communicate(timeout=10)[0].strip() == "ECONNABORTED"
    # Back again: connections are offloaded again.
    w.vnetd[1].ctl("ROUTE", "ADD", *route.split())
    sent = w.x(1, "python3", PROBE, "client", w.ip(2), "7012", "1000", timeout=60)
    assert "connect to" in sent.stderr and "offloaded" in sent.stderr, sent.stderr
    got = served(finish(srv))
    assert got[0].get("error") == "ECONNRESET" and "error" not in got[1], got


def test_a_link_that_loses_its_vtoe_key_revokes_its_connections(world):
    """vtoe.md "Changes follow": an offloaded connection stays only while
    its link carries a VTOE key. There is no LINK SET: a link loses its key
    by being replaced, here in one request, with the same address, name and
    routes. Catches: revalidation that only asks whether some route still
    carries the guest's frames (Decision::holds without the same-link and
    key conditions), which the route-deleted test does not; and, on the
    Ethernet path afterwards, a replaced fast-path link that lost its
    sender-address entry to the old one (commit 89a5088: the plain
    connection then hung, its peer's segments dropped as corrupt)."""
    w = world
    srv = w.popen(2, "python3", PROBE, "serve", "7014", "2")
    wait_listening(w.lab, w.ns(2), 7014)
    code = ("import socket, sys, errno\ns = socket.create_connection((sys.argv[1], 7014))\ns.sendall(b'x')\n"
            "print('connected', flush=True)\nsys.stdin.readline()\n"
            "try:\n print('read', s.recv(10))\nexcept OSError as e:\n print(errno.errorcode[e.errno], flush=True)\n")
    cli = w.popen(1, "python3", "-c", code, w.ip(2), stdin=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert cli.stdout.readline().strip() == "connected"
    assert w.vtoe_stats(1)[0]["open"] == 1
    routes = [f"any {guest_mac(g)} edge 198.18.0.2 any" for g in (2, 5)] + ["any ff:ff:ff:ff:ff:ff edge 198.18.0.2 interface"]
    w.vnetd[1].ctl_file("".join(f"ROUTE DEL {r}\n" for r in routes) + "LINK DEL 198.18.0.2\nLINK ADD 198.18.0.2\n"
                        + "".join(f"ROUTE ADD {r}\n" for r in routes))
    assert " vtoe=" not in w.vnetd[1].ctl("LINK", "LIST").stdout.split("198.18.0.2")[0].splitlines()[-1]
    # By the reply, the connection is gone: its program gets ECONNABORTED,
    # its peer a reset.
    c1, conns = w.vtoe_stats(1)
    assert c1["revoked"] == 1 and not conns, (c1, conns)
    cli.stdin.write("\n")
    cli.stdin.flush()
    assert cli.communicate(timeout=10)[0].strip() == "ECONNABORTED"
    # New connections over that link take the Ethernet path, and work.
    sent = w.x(1, "python3", PROBE, "client", w.ip(2), "7014", "1000", timeout=60)
    assert "not offloaded: no_vtoe_link" in sent.stderr, sent.stderr
    got = served(finish(srv))
    assert got[0].get("error") == "ECONNRESET" and got[1]["bytes"] == 1000 and "error" not in got[1], got
    assert w.vtoe_stats(1)[0]["fallback_no_vtoe_link"] == 1


# For each line on stdin: a connection to argv[1]:argv[2] that sends the
# line's number of bytes, half-closes and prints the answer.
CONNECT_ON_DEMAND = r"""
import socket, sys
for line in sys.stdin:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20)
    s.sendall(b"z" * int(line))
    s.shutdown(socket.SHUT_WR)
    print(s.recv(200).decode(), flush=True)
    s.close()
"""


def test_a_runner_whose_vnetd_is_away_takes_the_ethernet_path_until_it_is_back(world):
    """vtoe.md "vnetd restarts": a runner whose vnetd went away lets new
    connections take the Ethernet path, and offloads again once vnetd is
    back. h1's vnetd is killed and started again without VTOE (so the
    Ethernet path runs, and the runner finds no VTOE socket), then with it.
    Catches: a runner that fails connects while vnetd is away (mutated to
    answer ECONNREFUSED: the second connection failed), or that does not
    look for vnetd again."""
    w = world
    srv = w.popen(2, "python3", PROBE, "serve", "7017", "3")
    wait_listening(w.lab, w.ns(2), 7017)
    cli = w.popen(1, "python3", "-c", CONNECT_ON_DEMAND, w.ip(2), "7017", stdin=subprocess.PIPE, stderr=subprocess.DEVNULL)

    def connect(n: int) -> str:
        cli.stdin.write(f"{n}\n")
        cli.stdin.flush()
        return cli.stdout.readline().strip()

    assert connect(100).startswith("100 ")
    assert w.vtoe_stats(1)[0]["offloaded_out"] == 1 and w.vtoe_stats(2)[0]["offloaded_in"] == 1
    w.vnetd[1].stop(signal.SIGKILL)
    plain = w.lab.start_vnetd(w.hosts[1], host_config(1, w.guest_namespaces))
    assert "vtoe enabled=no" in plain.ctl("SHOW").stdout
    # vnetd is away for the runner: the connection is a plain one, whole.
    assert connect(200).startswith("200 ")
    assert w.vtoe_stats(2)[0]["offloaded_in"] == 1 and w.vtoe_stats(2)[0]["runners"] == 1
    # VTOE back: the runner finds it again by itself (it looks every second).
    plain.stop()
    w.vnetd[1] = w.start(1)
    assert wait_until(lambda: w.vtoe_stats(1)[0]["runners"] == 1, timeout=10), w.vtoe_stats(1)
    assert connect(300).startswith("300 ")
    assert w.vtoe_stats(1)[0]["offloaded_out"] == 1 and w.vtoe_stats(2)[0]["offloaded_in"] == 2
    cli.stdin.close()
    assert cli.wait(timeout=10) == 0
    got = served(finish(srv))
    assert [g["bytes"] for g in got] == [100, 200, 300] and not any("error" in g for g in got), got


def test_static_binaries_and_nested_runners_are_offloaded(world):
    """vtoe.md "What escapes interception": static binaries are not an
    escape (seccomp sees system calls, not library calls), and a vtoe under
    another vtoe runs its program as is, served by the outer runner. A
    static busybox nc connects and listens under vtoe; a program under two
    runners connects. Fails if a static binary's connect or listen escapes
    interception (as it would a preload library's); catches a nested runner
    that fails instead of running its program (mutated so: exit 127)."""
    w = world
    busybox = shutil.which("busybox")
    ldd = subprocess.run(["ldd", busybox], capture_output=True, text=True)
    assert "not a dynamic executable" in ldd.stdout + ldd.stderr, ldd
    # A static client.
    srv = w.popen(2, "python3", PROBE, "serve", "7018", "2")
    wait_listening(w.lab, w.ns(2), 7018)
    nc = w.lab.popen(w.ns(1), *w.under(1, busybox, "nc", w.ip(2), "7018"), stdin=subprocess.PIPE,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = nc.communicate("static\n", timeout=30)
    assert f"connect to {w.ip(2)}:7018 offloaded" in err, err
    # Nested: the inner runner sees the filter already there and runs its
    # program as is; the outer runner offloads its connection.
    r = w.x(1, *w.under(1, "python3", PROBE, "client", w.ip(2), "7018", "1000"), timeout=60)  # vtoe vtoe python3 ...
    assert "already under a vtoe runner, running as is" in r.stderr, r.stderr
    assert r.stderr.count(f"connect to {w.ip(2)}:7018 offloaded") == 1, r.stderr
    res = json.loads(r.stdout.splitlines()[0])
    assert res["answer"] == res["expect"], res
    got = served(finish(srv))
    assert [g["bytes"] for g in got] == [7, 1000] and got[0]["sha256"] == hashlib.sha256(b"static\n").hexdigest(), got
    # A static listener.
    lst = w.lab.popen(w.ns(2), *w.under(2, busybox, "nc", "-l", "-p", "7019"), stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True)
    wait_listening(w.lab, w.ns(2), 7019)
    w.x(1, "python3", "-c", "import socket, sys\ns = socket.create_connection((sys.argv[1], 7019))\ns.sendall(b'to busybox')",
        w.ip(2), timeout=30)
    out, err = lst.communicate(timeout=30)
    assert out == "to busybox" and "offloaded connection from" in err, (out, err)
    assert w.vtoe_stats(1)[0]["offloaded_out"] == 3 and w.vtoe_stats(2)[0]["offloaded_in"] == 3


def test_no_key_is_revealed_and_vnetd_keeps_nothing_of_the_guests(world):
    """vtoe.md's security table: "no key is revealed" and "no guest memory
    mapped", as far as they can be seen from outside. While an offloaded
    connection is open: the link's VTOE key appears in nothing vnetd
    answers or logs, on either host, text or JSON, nor in what the runner
    says; vnetd maps only its own binary and system libraries (nothing
    shared: no memfd, no guest file), and keeps no descriptor of the socket
    it handed over. Catches (each mutated so): the key shown with its name
    in LINK LIST and SHOW; a shadow socket vnetd keeps after the handover."""
    w = world
    srv = w.popen(2, "python3", PROBE, "serve", "7020", "1")
    wait_listening(w.lab, w.ns(2), 7020)
    code = ("import os, socket, sys\ns = socket.create_connection((sys.argv[1], 7020))\n"
            "print(os.getpid(), s.fileno(), flush=True)\nsys.stdin.readline()\ns.sendall(b'k'); s.close()\n")
    cli = w.popen(1, "python3", "-c", code, w.ip(2), stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    pid, fd = cli.stdout.readline().split()
    socket_inode = os.readlink(f"/proc/{pid}/fd/{fd}")
    assert socket_inode.startswith("socket:["), socket_inode
    assert w.vtoe_stats(1)[0]["open"] == 1 and w.vtoe_stats(2)[0]["open"] == 1
    for h in (1, 2):
        vp = w.vnetd[h].proc.pid
        held = set()
        for f in os.listdir(f"/proc/{vp}/fd"):
            try:
                held.add(os.readlink(f"/proc/{vp}/fd/{f}"))
            except FileNotFoundError:
                pass  # closed between the listing and the look (a netlink query's): not kept
        # (the program's socket is h1's; h2 handed over the far end)
        assert socket_inode not in held and not any(x.startswith(("/proc/", "memfd:", "/dev/shm")) for x in held), held
        mapped = {l.split(None, 5)[5] for l in Path(f"/proc/{vp}/maps").read_text().splitlines() if len(l.split(None, 5)) == 6}
        own = str((BIN / "vnetd").resolve())
        foreign = [m for m in mapped if not (m.startswith(("[", "/usr/lib/", "/lib/", "/lib64/", own)))]
        assert not foreign, foreign
    texts = []
    for h in (1, 2):
        for cmd in (["SHOW"], ["LINK", "LIST"], ["STATS"], ["-j", "SHOW"], ["-j", "LINK", "LIST"], ["-j", "STATS"]):
            texts.append(w.vnetd[h].ctl(*cmd).stdout)
    cli.stdin.write("\n")
    cli.stdin.flush()
    texts.append(cli.communicate(timeout=20)[1])
    texts.append(finish(srv))
    texts += [w.vnetd[h].log_text() for h in (1, 2)]
    key = (w.lab.key_dir / "lab").read_text().strip()
    for t in texts:
        assert key[:16] not in t and key[-16:] not in t, t
    assert "vtoe=lab" in texts[1]  # the key's name, as LINK LIST shows it


def vtoe_cgroup(pid: int) -> Path:
    """The cgroup (v2) process `pid` is in, as a directory of this process's
    view of the cgroup2 tree (vnetd sees it at another mount point, in the
    mount namespace of `ip netns exec`)."""
    rel = next(l[3:] for l in Path(f"/proc/{pid}/cgroup").read_text().splitlines() if l.startswith("0::"))
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    root = next(l.split(" - ")[0].split()[4] for l in mounts if l.split(" - ")[1].startswith("cgroup2 "))
    return Path(root) / rel.lstrip("/")


def test_offloaded_connections_outlive_vnetd_stay_guarded_and_vtoe_comes_back(world):
    w = world
    srv = w.popen(2, "python3", PROBE, "serve", "7013", "2")
    wait_listening(w.lab, w.ns(2), 7013)
    code = ("import socket, sys, errno, struct, ctypes\ns = socket.create_connection((sys.argv[1], 7013))\n"
            "print('connected', flush=True)\nsys.stdin.readline()\n"
            "s.sendall(b'after'); s.shutdown(socket.SHUT_WR)\nprint(s.recv(200).decode(), flush=True)\n"
            "libc = ctypes.CDLL(None, use_errno=True)\nu = struct.pack('HH12x', 0, 0)\nlibc.connect(s.fileno(), u, 16)\n"
            "try:\n s.connect(('127.0.0.1', 7999)); print('REACHED')\nexcept OSError as e:\n print(errno.errorcode[e.errno])\n")
    cli = w.popen(1, "python3", "-c", code, w.ip(2), stdin=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert cli.stdout.readline().strip() == "connected"
    # Each vnetd sits in a cgroup of its own, vnet-vtoe-<pid>.
    old = {h: vtoe_cgroup(w.vnetd[h].proc.pid) for h in (1, 2)}
    assert all(c.name == f"vnet-vtoe-{w.vnetd[h].proc.pid}" and c.is_dir() for h, c in old.items()), old
    # Both vnetds die at once, as hard as can be.
    for h in (1, 2):
        w.vnetd[h].stop(signal.SIGKILL)
    target = host_listener(w, 1, 7999)
    cli.stdin.write("\n")
    cli.stdin.flush()
    answer, after = cli.communicate(timeout=20)[0].split("\n")[:2]
    # The connection went on without them, and the guard with it.
    assert answer.startswith("5 "), answer
    assert after == "EPERM", after
    target.kill()
    assert "GOT" not in target.communicate()[0]
    # vnetd again: the server's runner registers its listener anew by itself,
    # and connections are offloaded again.
    for h in (1, 2):
        w.vnetd[h] = w.start(h)
    # The new vnetds swept the cgroups of the killed ones (no process left
    # in them; the guard's programs stay with the sockets) and made their
    # own. Catches: M2 of the 2026-11-25 review (join_cgroup's sweep of
    # vnet-vtoe-* removed: both old cgroups stay).
    for h in (1, 2):
        new = vtoe_cgroup(w.vnetd[h].proc.pid)
        assert new.name == f"vnet-vtoe-{w.vnetd[h].proc.pid}" and new.is_dir(), new
    left = [c for c in old.values() if c.exists()]
    assert not left, f"cgroups of killed vnetds left behind: {left}"
    assert wait_until(lambda: w.vtoe_stats(2)[0].get("listeners") == 1, timeout=10), w.vtoe_stats(2)
    sent = w.x(1, "python3", PROBE, "client", w.ip(2), "7013", "1000", timeout=60)
    assert "offloaded" in sent.stderr, sent.stderr
    got = served(finish(srv))
    assert got[0]["bytes"] == 5 and got[1]["bytes"] == 1000, got
    assert w.vtoe_stats(1)[0]["offloaded_out"] == 1 and w.vtoe_stats(2)[0]["offloaded_in"] == 1


# The client of a service: sends a secret, half-closes, prints the answer.
SEND_SECRET = r"""
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20)
s.sendall(b"secret-password")
s.shutdown(socket.SHUT_WR)
print(s.recv(200).decode(), flush=True)
"""

# Listen refusals (vnet_core::vtoe::ListenRefusal) as NotListening carries them.
NOT_LISTENING = 9
NO_SOCKET, WRONG_ADDRESS, OTHER_NAMESPACE, TAKEN = 1, 4, 5, 6


def test_a_guest_user_cannot_take_over_a_listener_it_does_not_hold(world):
    """Review S5 (2026-11-24), as reproduced there: root in g2 runs a
    service under vtoe on 0.0.0.0:7021; uid 65534 in g2 opens a raw session
    on vnetd's runner socket and registers 198.19.0.2:7021 (a specific
    address beat the wildcard, and the later registration won). g1's
    client, under vtoe, sends the service its password. The attacker tries
    three proofs: none (as the review did), a listener of its own on
    another port, and a listener bound to that very address in a user and
    network namespace of its own. Each is refused and counted, and g1's
    connection is offloaded to the real service. Failed before the fix:
    every registration was answered Listening and the attacker read
    "secret-password" (the client got "attacker")."""
    w = world
    srv = w.popen(2, "python3", PROBE, "serve", "7021", "1")
    wait_listening(w.lab, w.ns(2), 7021)
    assert wait_until(lambda: w.vtoe_stats(2)[0].get("listeners") == 1, timeout=10), w.vtoe_stats(2)
    attacker = w.lab.popen(w.ns(2), *NOBODY, "python3", readable_by_nobody(w.lab, PROBE), "hijack", w.sock[2], w.ip(2), "7021",
                           "none", "other-port", "own-netns", stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    answers = json.loads(attacker.stdout.readline())["answers"]
    got = w.x(1, "python3", "-c", SEND_SECRET, w.ip(2), "7021", timeout=60)
    attacker.stdin.close()
    stolen = json.loads(attacker.stdout.readline())["stolen"]
    attacker.wait(timeout=10)
    # The client reached the real service, offloaded; the attacker nothing.
    assert not stolen, stolen
    assert got.stdout.strip() == f"15 {hashlib.sha256(b'secret-password').hexdigest()}", got.stdout + got.stderr
    assert f"connect to {w.ip(2)}:7021 offloaded" in got.stderr, got.stderr
    assert served(finish(srv))[0]["accepted_from"].startswith(w.ip(1) + ":")
    # Each registration refused, with its reason, and counted.
    assert [(a["type"], a["why"]) for a in answers] == [
        (NOT_LISTENING, NO_SOCKET), (NOT_LISTENING, WRONG_ADDRESS), (NOT_LISTENING, OTHER_NAMESPACE)], answers
    c2, _ = w.vtoe_stats(2)
    assert c2["listen_refused_no_socket"] == 1 and c2["listen_refused_wrong_address"] == 1, c2
    assert c2["listen_refused_other_namespace"] == 1 and c2["offloaded_in"] == 1, c2


# Listens on 0.0.0.0:argv[1] with SO_REUSEPORT (so that the kernel lets
# another program of the same user listen there too), says so, then at
# each line on stdin: "stop" stops listening (shutdown), anything else
# accepts one connection and prints what it sent.
REUSEPORT_LISTENER = r"""
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(8)
print("listening", flush=True)
for line in sys.stdin:
    if line.strip() == "stop":
        s.shutdown(socket.SHUT_RDWR)
        print("stopped", flush=True)
    else:
        c, a = s.accept()
        print("got", c.recv(100).decode(), flush=True)
        c.close()
"""


def test_a_live_listener_is_never_replaced_and_one_that_stops_listening_is(world):
    """vtoe.md: a live registration is never overwritten. Two programs of
    root in g2, each under its own vtoe, listen on 0.0.0.0:7022 with
    SO_REUSEPORT (the kernel allows it: same user): the second is refused
    (taken) and counted, and keeps only the guest kernel's connections.
    When the first stops listening (it keeps its descriptor, and its
    runner lives on), its registration ends: a third program's listen is
    registered, and g1's connection is offloaded to it. Before the fix the
    second registration replaced the first (no refusal was counted)."""
    w = world
    progs = []
    for i in range(2):
        p = w.popen(2, "python3", "-c", REUSEPORT_LISTENER, "7022", stdin=subprocess.PIPE)
        assert own_line(p) == "listening"
        progs.append(p)
    c2, _ = w.vtoe_stats(2)
    assert c2.get("listen_refused_taken") == 1 and c2["listeners"] == 1, c2
    progs[0].stdin.write("stop\n")
    progs[0].stdin.flush()
    assert own_line(progs[0]) == "stopped"
    assert wait_until(lambda: w.vtoe_stats(2)[0]["listeners"] == 0, timeout=10), w.vtoe_stats(2)
    third = w.popen(2, "python3", "-c", REUSEPORT_LISTENER, "7022", stdin=subprocess.PIPE)
    assert own_line(third) == "listening"
    assert w.vtoe_stats(2)[0]["listeners"] == 1
    third.stdin.write("accept\n")
    third.stdin.flush()
    sent = w.x(1, "python3", "-c", "import socket, sys\ns = socket.create_connection((sys.argv[1], 7022))\ns.sendall(b'to the third')",
               w.ip(2), timeout=30)
    assert f"{w.ip(2)}:7022 offloaded" in sent.stderr, sent.stderr
    assert own_line(third) == "got to the third"
    out = []
    for p in progs + [third]:
        p.stdin.close()
        p.wait(timeout=10)
        out.append(p.stdout.read())
    # The second program's runner said so (its -v summary).
    assert "1 listener(s) not registered" in out[1], out[1]
    c2, _ = w.vtoe_stats(2)
    assert c2["listen_refused_taken"] == 1 and c2["offloaded_in"] == 1, c2


# Serves its banner to every connection on argv[1]:argv[2], and prints
# each peer.
BANNER = r"""
import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("up", flush=True)
while True:
    c, a = s.accept()
    print("GOT", a, flush=True)
    c.sendall(b"LOOPBACK-ONLY-ADMIN\n")
    c.close()
"""


def test_a_guest_cannot_reach_another_guests_loopback(world):
    """Review S6 (2026-11-24), as reproduced there: g1, root in its own
    namespace as a container's root is, routes 127.0.0.1 on-link to g2's
    MAC; g2 runs a service under vtoe bound to 127.0.0.1. g1's runner would
    not offer such a connect, so g1 speaks to vnetd on a raw session. Then
    the far end alone (vtoe_peer.py with h1's key, as a vnetd that let it
    through would ask): a loopback destination or source, and an address of
    g2 that is not on the interface the frames go to (one on g2's lo), to a
    wildcard service. Every one is refused and counted; neither service
    sees a connection. Failed before the fix: g1 read LOOPBACK-ONLY-ADMIN,
    and h2 accepted all three peer requests."""
    w = world
    lo_srv = w.popen(2, "python3", "-c", BANNER, "127.0.0.1", "7023")
    any_srv = w.popen(2, "python3", "-c", BANNER, "0.0.0.0", "7024")
    for p in (lo_srv, any_srv):
        assert own_line(p) == "up"
    # g1's routes: 127.0.0.1 leaves on-link by g1, to g2's MAC.
    g1 = w.ns(1)
    w.lab.x(g1, "ip", "rule", "add", "pref", "10", "to", "127.0.0.1", "lookup", "100")
    w.lab.x(g1, "ip", "route", "add", "127.0.0.1/32", "dev", "g1", "table", "100")
    w.lab.x(g1, "ip", "rule", "del", "pref", "0", "lookup", "local")
    w.lab.x(g1, "ip", "rule", "add", "pref", "100", "lookup", "local")
    w.lab.x(g1, "ip", "neigh", "replace", "127.0.0.1", "lladdr", guest_mac(2), "dev", "g1", "nud", "permanent")
    assert " dev g1 " in w.lab.x(g1, "ip", "route", "get", "127.0.0.1").stdout
    r = json.loads(w.lab.x(g1, "python3", PROBE, "connect-raw", w.sock[1], f"{w.ip(1)}:40001", "127.0.0.1:7023", timeout=60).stdout)
    assert "banner" not in r, r
    assert r == {"type": 4, "fallback": 19}, r  # Fallback, bad_address
    # The far end on its own.
    key = w.lab.key_dir / "lab"
    w.lab.x(w.ns(2), "ip", "addr", "add", "10.77.0.2/32", "dev", "lo")

    def peer(src, dst):
        r = w.lab.x(w.vnetd[1].host, "python3", PEER, "198.18.0.2", "9002", key, guest_mac(1), guest_mac(2), src, dst, "x", timeout=30)
        return json.loads(r.stdout)["verdict"]

    verdicts = [peer(f"{w.ip(1)}:40002", "127.0.0.1:7024"), peer("127.0.0.1:40003", f"{w.ip(2)}:7024"),
                peer(f"{w.ip(1)}:40004", "10.77.0.2:7024")]
    assert verdicts == ["declined 19", "declined 19", "declined 13"], verdicts  # bad_address, not_local
    for p in (lo_srv, any_srv):
        p.kill()
        assert "GOT" not in p.communicate()[0]
    c1, _ = w.vtoe_stats(1)
    c2, _ = w.vtoe_stats(2)
    assert c1["fallback_bad_address"] == 1 and c1["offloaded_out"] == 0, c1
    assert c2["declined_bad_address"] == 2 and c2["declined_not_local"] == 1 and c2.get("offloaded_in", 0) == 0, c2
