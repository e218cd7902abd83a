"""The many-host control plane (docs/controller.md) with a real etcd: three
hosts, each a vnetd and a vnet-agent, guests in two overlay networks. Nobody
writes a link or a route by hand: each guest is declared once, on its host,
with `INTERFACE ADD ... network <name>`, and the agents derive the rest.

- ping within a network across hosts, and nothing across networks (on one
  host too), ARP included;
- a user's own routes are never touched, and the agent's are marked;
- an agent killed: its host's guests are withdrawn elsewhere once its lease
  expires; restarted: they come back;
- a guest migrated under an open TCP connection, which survives; the
  re-route time is measured;
- etcd's RBAC as `vnet-agent auth` provisions it (every test runs with it):
  a host with its own credentials cannot rewrite, delete or revoke another
  host's records, and its claim of a MAC another host holds is ignored and
  counted everywhere.
"""

from __future__ import annotations

import base64
import json
import shutil
import signal
import socket
import statistics
import subprocess
import time

import pytest

from netlab import BIN, Lab, UnixSession, overlay_ip, underlay_ip, wait_until

AGENT = BIN / "vnet-agent"
ETCD_PORT = 2379
TTL = 2

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd-server not installed (scripts/setup)")

# (host, guest number, network): guest n has overlay_ip(n) and MAC 02:00:00:00:00:<n>
GUESTS = [(1, 11, "a"), (1, 21, "b"), (2, 12, "a"), (3, 13, "a"), (3, 23, "b")]


def mac(n: int) -> str:
    return "02:00:00:00:00:%02x" % n


def reg(h: int) -> str:
    """Host h's registration key (docs/controller.md)."""
    return f"/vnet/host/h{h}/reg"


# The agents' hand-over window: a claim older than this that waited behind
# a holder never takes the MAC (the default is 10 s; shorter here so a test
# need not wait it out).
HANDOVER_MS = 1500


def gkey(h: int, n: int) -> str:
    """Where host h's claims of guest n's MAC are (each `<this><epoch>`)."""
    return f"/vnet/host/h{h}/guests/{mac(n)}/"


# An epoch for a claim written by hand (16 hex digits, as the agent's).
EPOCH = "0000000000000001"


def claimed_by(o, h: int, n: int) -> list[str]:
    """Host h's claims of guest n's MAC in etcd, as JSON texts."""
    out = o.etcdctl("get", "--prefix", gkey(h, n)).stdout.splitlines()
    return out[1::2]


def make_certs(dir):
    """A CA, etcd's server certificate (for its underlay IP) and a client
    certificate for the agents, all EC P-256, made with openssl."""
    def x(*a):
        subprocess.run(["openssl", *map(str, a)], check=True, capture_output=True, cwd=dir)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    x("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", 1, "-subj", "/CN=vnet-test-ca")
    for name, ext in [("server", f"subjectAltName=IP:{underlay_ip(100)}\nextendedKeyUsage=serverAuth"),
                      ("agent", "extendedKeyUsage=clientAuth")]:
        (dir / f"{name}.ext").write_text(ext.replace("\\n", "\n") + "\n")
        x("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        x("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
          "-out", f"{name}.crt", "-days", 1, "-extfile", f"{name}.ext")


class Overlay:
    def __init__(self, lab: Lab, tls: bool = False, encrypt: bool = False, interval_ms: int = 100):
        self.lab = lab
        self.encrypt = encrypt
        # The agents' safety-net poll of their vnetd (`--interval-ms`):
        # short here, so a test need not wait for one; the migration test
        # runs the default (10 s), so that only `WAIT` can move its routes.
        self.interval_ms = interval_ms
        self.etcd_ns = lab.add_host(100)
        self.tls = lab.tmp / "pki" if tls else None
        if self.tls:
            self.tls.mkdir()
            make_certs(self.tls)
        self.etcd_url = f"{'https' if tls else 'http'}://{underlay_ip(100)}:{ETCD_PORT}"
        self.start_etcd()
        wait_until(lambda: self.etcdctl("endpoint", "health", check=False).returncode == 0, timeout=20)
        self.provision()
        self.hosts = {i: lab.add_host(i) for i in (1, 2, 3)}
        wg = lambda i: ["--wireguard-key-file", lab.tmp / f"h{i}.wgkey"] if encrypt else []  # noqa: E731
        self.d = {i: lab.start_vnetd(h, None, *wg(i)) for i, h in self.hosts.items()}
        self.agents: dict[int, subprocess.Popen] = {}
        self.guest_ns = {}
        for h, n, net in GUESTS:
            self.add_guest(h, n, net)
        for i in self.hosts:
            self.start_agent(i)

    def start_etcd(self):
        # bcrypt cost 4 (etcd's least, default 10): every etcdctl and agent
        # login checks a password, and the tests make many; what is checked
        # is who may write what, not the hash's strength.
        url = self.etcd_url
        tls = []
        if self.tls:
            t = self.tls
            tls = ["--cert-file", t / "server.crt", "--key-file", t / "server.key", "--client-cert-auth",
                   "--trusted-ca-file", t / "ca.crt"]
        self.etcd = self.lab.popen(
            self.etcd_ns, "etcd", "--bcrypt-cost", "4", "--name", "t1", "--data-dir", self.lab.tmp / "etcd",
            "--listen-client-urls", url, "--advertise-client-urls", url,
            "--listen-peer-urls", f"http://{underlay_ip(100)}:2380",
            "--initial-advertise-peer-urls", f"http://{underlay_ip(100)}:2380",
            "--initial-cluster", f"t1=http://{underlay_ip(100)}:2380", *tls,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def password(self, user: str):
        """The file holding `user`'s etcd password (made on first use)."""
        f = self.lab.tmp / f"etcd-{user}.pw"
        if not f.exists():
            f.write_text(base64.b32encode(__import__("os").urandom(15)).decode() + "\n")
        return f

    def provision(self):
        """etcd's RBAC as docs/controller.md says to set it up: root, a user
        per host that writes only its own records, a reader for `show`."""
        base = [AGENT, "auth", "--etcd", self.etcd_url, *self.tls_args()]
        self.lab.x(self.etcd_ns, *base, "enable", "--root-password-file", self.password("root"))
        root = [*base, "--user", "root", "--password-file", self.password("root")]
        for i in (1, 2, 3):
            self.lab.x(self.etcd_ns, *root, "add-host", f"h{i}", "--new-password-file", self.password(f"vnet-host-h{i}"))
        self.lab.x(self.etcd_ns, *root, "add-reader", "vnet-show", "--new-password-file", self.password("vnet-show"))

    def creds(self, user: str) -> list:
        return ["--user", user, "--password-file", self.password(user)]

    def tls_args(self, cert="agent"):
        t = self.tls
        return ["--cacert", t / "ca.crt", "--cert", t / f"{cert}.crt", "--key", t / f"{cert}.key"] if t else []

    def etcdctl(self, *args, check=True, user="root"):
        pw = self.password(user).read_text().strip()
        return self.lab.x(self.etcd_ns, "env", "ETCDCTL_API=3", "etcdctl", "--endpoints", self.etcd_url,
                          *self.tls_args(), f"--user={user}:{pw}", *args, check=check)

    def add_guest(self, host: int, n: int, net: str):
        ns = self.guest_ns.get(n) or self.lab.guest_ns(f"g{n}")
        self.guest_ns[n] = ns
        self.d[host].ctl("INTERFACE", "ADD", f"g{n}", mac(n), "netns", ns, "network", net)
        self.lab.x(ns, "ip", "addr", "replace", f"{overlay_ip(n)}/24", "dev", f"g{n}")
        self.lab.x(ns, "ip", "link", "set", f"g{n}", "up")

    def start_agent(self, i: int, *extra):
        log = open(self.lab.tmp / f"agent-h{i}.log", "a")
        p = self.lab.popen(self.hosts[i], AGENT, "run", "--etcd", self.etcd_url, "--host", f"h{i}",
                           "--underlay", underlay_ip(i), "--socket", self.d[i].sock, "--ttl", TTL,
                           "--interval-ms", self.interval_ms, "--traffic-s", 1, "--handover-ms", HANDOVER_MS,
                           *self.tls_args(), *self.creds(f"vnet-host-h{i}"),
                           *(["--encrypt"] if self.encrypt else []), *extra,
                           stdout=log, stderr=subprocess.STDOUT)
        self.agents[i] = p

    def ping(self, a: int, b: int, count=1, wait=1) -> bool:
        return self.lab.x(self.guest_ns[a], "ping", "-n", "-q", "-c", count, "-W", wait, overlay_ip(b),
                          check=False, timeout=count * wait + 10).returncode == 0

    def routes(self, i: int) -> list[str]:
        return self.d[i].ctl("ROUTE", "LIST").stdout.splitlines()

    def routed(self, i: int, n: int) -> bool:
        return any(mac(n) in r for r in self.routes(i))

    def log(self, i: int) -> str:
        return (self.lab.tmp / f"agent-h{i}.log").read_text(errors="replace")


def show(o: Overlay) -> dict:
    out = o.lab.x(o.etcd_ns, AGENT, "show", "--etcd", o.etcd_url, *o.tls_args(), *o.creds("vnet-show"), "--json").stdout
    return json.loads(out)


@pytest.fixture
def overlay(lab, request):
    o = Overlay(lab, tls=getattr(request, "param", False))
    yield o
    stop(o)


@pytest.fixture
def encrypted(lab):
    o = Overlay(lab, encrypt=True)
    yield o
    stop(o)


def stop(o: Overlay):
    for i, p in o.agents.items():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                assert p.wait(timeout=5) == 0, f"agent h{i} exit status"
            except subprocess.TimeoutExpired:
                p.kill()
                pytest.fail(f"agent h{i} did not stop on SIGTERM")
        assert "panicked" not in o.log(i)
    o.etcd.terminate()
    o.etcd.wait(timeout=10)


def converged(o: Overlay, timeout=15):
    """Every host routes every guest of its networks (by the rules' MACs)."""
    def ok():
        for i in o.hosts:
            nets = {net for h, _, net in GUESTS if h == i}
            for h, n, net in GUESTS:
                if net in nets and h != i and not o.routed(i, n):
                    return False
        return True
    assert wait_until(ok, timeout=timeout), "\n".join(o.log(i) for i in o.hosts)


def test_networks_declared_once_reach_their_members_across_hosts_and_no_one_else(overlay):
    o = overlay
    converged(o)
    # Within network a, across hosts both ways (ARP first: nothing pinned).
    for a, b in [(11, 12), (11, 13), (12, 13), (13, 11)]:
        assert o.ping(a, b, count=2), f"g{a} -> g{b} in network a"
    # Within b, across hosts.
    assert o.ping(21, 23, count=2) and o.ping(23, 21)
    # Across networks: not on another host, not even on the same host.
    for a, b in [(11, 21), (21, 11), (11, 23), (12, 23), (23, 13), (13, 23)]:
        assert not o.ping(a, b), f"g{a} (network {dict((n, x) for _, n, x in GUESTS)[a]}) reached g{b}"
    # The agent's routes are marked; host 2 has nothing of network b.
    r2 = o.routes(2)
    assert r2 and all(r.endswith(" owner agent") for r in r2)
    assert not any(mac(21) in r or mac(23) in r for r in r2)
    links = o.d[1].ctl("LINK", "LIST").stdout
    assert "name=agent.h2" in links and "name=agent.h3" in links
    # etcd holds the hosts and the guests as docs/controller.md says.
    keys = o.etcdctl("get", "--prefix", "/vnet/", "--keys-only").stdout.split()
    want = [reg(i) for i in (1, 2, 3)] + [gkey(h, n) for h, n, _ in GUESTS]
    # (A claim's key ends in its epoch.)
    assert sorted(k.rsplit("/", 1)[0] + "/" if "/guests/" in k else k for k in keys if not k.endswith("/traffic")) == sorted(want)


def test_a_users_routes_stay_and_the_agent_fills_in_around_them(overlay):
    o = overlay
    converged(o)
    # A user adds, by hand, one of the very rules the agent wants, and one
    # of their own; the agent neither duplicates nor removes either.
    same = f"{mac(11)} {mac(12)} edge agent.h2 interface {mac(11)}"
    wait_until(lambda: any(r.endswith(same + " owner agent") for r in o.routes(1)))
    idx = next(r.split()[1] for r in o.routes(1) if r.endswith(same + " owner agent"))
    o.d[1].ctl_file(f"ROUTE DEL {idx}\nROUTE ADD {same}\nLINK ADD 198.18.0.77 name mine\n"
                    f"ROUTE ADD any 02:00:00:00:00:77 edge mine any\n")
    time.sleep(1.0)
    mine = [r for r in o.routes(1) if "owner" not in r]
    assert len(mine) == 2 and any(r.endswith(same) for r in mine), mine
    assert not any(r.endswith(same + " owner agent") for r in o.routes(1))
    assert o.ping(11, 12)


def test_an_agent_killed_is_withdrawn_after_its_lease_and_comes_back_restarted(overlay):
    o = overlay
    # A second guest of network a on host 3: host 3's own vnetd then has
    # frames of its own to carry, guest to guest, while its agent is dead.
    o.add_guest(3, 33, "a")
    converged(o)
    assert wait_until(lambda: any(f"{mac(13)} {mac(33)} interface {mac(33)}" in r for r in o.routes(3)), timeout=10)
    assert o.ping(11, 13) and o.ping(13, 33)
    pinger = o.lab.popen(o.guest_ns[13], "ping", "-n", "-q", "-i", "0.1", "-w", "60", overlay_ip(33),
                         stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    o.agents[3].kill()
    o.agents[3].wait()
    killed = time.monotonic()
    assert wait_until(lambda: not o.routed(1, 13) and not o.routed(2, 13), timeout=TTL + 8)
    took = time.monotonic() - killed
    # The agent renews its lease every third of the TTL (and passes every
    # 100 ms), so the lease can run out two thirds of a TTL after the kill,
    # no earlier (1.4 s was seen with TTL 2 s).
    assert took >= TTL * 2 / 3 - 0.2, f"withdrawn after {took:.1f} s, before the {TTL} s lease could run out"
    assert "name=agent.h3" not in o.d[1].ctl("LINK", "LIST").stdout
    # Host 3's own vnetd kept forwarding meanwhile, its agent dead past its
    # lease: every ping between its two guests, sent from before the kill
    # until after the withdrawal, came back.
    time.sleep(0.5)
    pinger.send_signal(signal.SIGINT)
    out = pinger.communicate(timeout=10)[0]
    sent = int(out.split(" packets transmitted")[0].split()[-1])
    assert " 0% packet loss" in out and sent >= 10 * (TTL - 0.5), out
    o.start_agent(3)
    converged(o)
    assert o.ping(11, 13, count=2)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_a_managed_hosts_vnetd_restarted_keeps_its_veth_guests_flowing(overlay, sig):
    """The deployment users run: vnetd with no config file, its guests
    attached at run time, its links and routes from the agent (etcd). Host
    1's vnetd is SIGKILLed (2 s down) or SIGTERMed and started again at
    once, under a 500/s ping between veth guests of network a on hosts 1
    and 2: its state file brings back the guest and the agent's links and
    routes before the start sweeps the kernel datapath, so the kernel
    carries the flow throughout: at most 5 pings lost (issue 43's bound;
    main lost 9 and 15 here), and the agent, reconnected, finds nothing to
    change. Catches: run-time state not recorded or restored after the
    sweep (the guest's attachment swept: pings lost until the agent and the
    CNI plugin add everything again), the agent re-adding what is there."""
    o = overlay
    for h, n in ((1, 31), (2, 32)):
        ns = o.lab.guest_ns(f"g{n}")
        o.guest_ns[n] = ns
        o.d[h].ctl("INTERFACE", "ADD", f"g{n}", mac(n), "mtu", "1458", "netns", ns, "veth", "network", "a")
        o.lab.x(ns, "ip", "addr", "replace", f"{overlay_ip(n)}/24", "dev", f"g{n}")
        o.lab.x(ns, "ip", "link", "set", f"g{n}", "up")
    assert wait_until(lambda: o.routed(1, 32) and o.routed(2, 31), timeout=15)
    assert o.ping(31, 32, count=3)
    routes = sorted(o.routes(1))
    ping = o.lab.popen(o.guest_ns[31], "ping", "-q", "-i", "0.002", "-c", "2500", "-W", "1", overlay_ip(32),
                       stdout=subprocess.PIPE, text=True)
    time.sleep(1)
    o.d[1].stop(sig)
    time.sleep(2.0 if sig == signal.SIGKILL else 0.0)
    o.d[1] = o.lab.start_vnetd(o.hosts[1], None)
    out = ping.communicate(timeout=60)[0]
    got = int(out.split(" received")[0].rsplit(None, 1)[1])
    assert got >= 2495, out
    log = o.d[1].log_text()
    assert "swept 0 attachment(s), 0 port(s), 0 link(s)" in log, log
    assert sorted(o.routes(1)) == routes
    time.sleep(1)  # the agent's passes after its reconnect
    assert "applied" not in o.d[1].log_text().split("vnetd ready")[1], o.d[1].log_text()


def test_a_guest_migrated_under_an_open_tcp_connection_is_rerouted_everywhere(overlay):
    o = overlay
    # Host 2 keeps a member of network a after g12 leaves (g32): every host
    # then has a route to g12 to change.
    o.add_guest(2, 32, "a")
    converged(o)
    assert wait_until(lambda: any(f"{mac(32)} {mac(12)} interface {mac(12)}" in r for r in o.routes(2))
                      and o.routed(1, 32), timeout=10)
    # A TCP connection g11 -> g12 (network a), bytes flowing both ways.
    srv = o.lab.popen(o.guest_ns[12], "python3", "-c", ECHO, overlay_ip(12), stdout=subprocess.PIPE, text=True)
    assert srv.stdout.readline().strip() == "listening"
    cli = o.lab.popen(o.guest_ns[11], "python3", "-c", CLIENT, overlay_ip(12), stdout=subprocess.PIPE, text=True)
    assert cli.stdout.readline().strip() == "connected"
    time.sleep(0.5)
    # g12's address (its ARP request, learned by host 2) is bound on host 1.
    o.lab.x(o.guest_ns[12], "ip", "neigh", "flush", "all")
    assert o.ping(12, 11)
    ip12 = overlay_ip(12)
    bound = lambda i: f"neigh {ip12} {mac(12)} owner agent" in o.d[i].ctl("NEIGH", "LIST").stdout
    assert wait_until(lambda: bound(1), timeout=10), o.log(1)
    # g12 moves from host 2 to host 3: deleted (detached) there, added here.
    o.d[2].ctl("INTERFACE", "DEL", "g12", "detach")
    moved = time.monotonic()
    o.d[3].ctl("INTERFACE", "ADD", "g12", mac(12), "netns", o.guest_ns[12], "network", "a")
    # Routed to its new host on every host: host 1's and host 2's guests of
    # network a reach it over the link to host 3; host 3 delivers it to its
    # interface, from its own guest and from the links. Catches a host that
    # does not follow (shown with host 2's agent stopped: host 2 had no route
    # to g12 at all).
    def to_g12(i):
        return {(f[2], f"{f[4]} {f[5]}") for f in (x.split() for x in o.routes(i)) if f[3] == mac(12)}
    want = {1: {(mac(11), "edge agent.h3")}, 2: {(mac(32), "edge agent.h3")},
            3: {(mac(13), f"interface {mac(12)}"), ("any", f"interface {mac(12)}")}}
    rerouted = lambda: all(to_g12(i) == want[i] for i in o.hosts)
    assert wait_until(rerouted, timeout=10, interval=0.01), {i: to_g12(i) for i in o.hosts}
    reroute = time.monotonic() - moved
    assert o.ping(11, 12), "g12 reachable at its new host"
    assert o.ping(13, 12), "and from its new neighbour"
    assert o.ping(32, 12), "and from its old one"
    out = cli.communicate(timeout=30)[0]
    srv.wait(timeout=10)
    assert "ok" in out, out
    # Host 3 claims the guest now, and host 2 no longer.
    # (host 2's released claim is forgotten once nothing waited behind it and
    # host 3's claim has the address it kept: it stays till then, as host 3
    # may claim before it reads the release or, as here under load, read it
    # before it claims).
    # (host 3's claim carries the address g12 held at host 2: below).
    assert wait_until(lambda: [json.loads(v) for v in claimed_by(o, 3, 12)] == [{"network": "a", "ips": [overlay_ip(12)]}]
                      and claimed_by(o, 2, 12) == [], timeout=5), \
        (claimed_by(o, 3, 12), claimed_by(o, 2, 12), o.etcdctl("get", "--prefix", "/vnet/host/", "--keys-only").stdout,
         "--- agent h2 ---", o.log(2)[-4000:], "--- agent h3 ---", o.log(3)[-4000:])
    # Its address binding follows it, though g12 said nothing at its new
    # host: host 3 publishes what it held at host 2, host 2 (which has g32
    # of network a) binds it now, host 1 still does, and host 3, where it
    # is local, does not; g32's ARP for it is answered on host 2 and goes
    # nowhere.
    assert wait_until(lambda: bound(2) and bound(1) and not bound(3), timeout=10), (o.log(2), o.log(3))
    from test_neigh import ask
    from netlab import Guest
    g32 = Guest(ns=o.guest_ns[32], tap="g32", mac=mac(32), ip=overlay_ip(32), host=o.hosts[2])
    asked = o.d[2].stats()["dispatch"]["neigh_answered"]
    assert ask(o.lab, g32, ip12, n=5) == {"answered": 5, "from": {mac(12): 5}}
    assert o.d[2].stats()["dispatch"]["neigh_answered"] - asked + o.d[2].stats()["interface g32"].get("fast_neigh_answered", 0) >= 5
    # A measured figure (docs/controller.md), not a pass/fail bound: the
    # agents' 100 ms pass and the polling above are in it.
    print(f"re-routed on every host {reroute * 1000:.0f} ms after the INTERFACE ADD")


# Echoes what it reads until EOF.
ECHO = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5201)); s.listen(1); print("listening", flush=True)
c, _ = s.accept()
while True:
    b = c.recv(65536)
    if not b:
        break
    c.sendall(b)
c.close()
"""

# Sends numbered lines for 4 s (through the migration) and checks each echo.
CLIENT = r"""
import socket, sys, time
s = socket.create_connection((sys.argv[1], 5201), timeout=20); print("connected", flush=True)
f = s.makefile("rwb")
end = time.time() + 4
i = 0
while time.time() < end:
    f.write(b"%d\n" % i); f.flush()
    assert f.readline() == b"%d\n" % i, i
    i += 1
    time.sleep(0.01)
s.shutdown(socket.SHUT_WR)
print("ok", i, flush=True)
"""


def test_the_overlay_and_its_traffic_matrix_are_shown_from_etcd(overlay):
    o = overlay
    converged(o)
    assert o.ping(11, 12, count=20, wait=1)
    assert o.ping(21, 23, count=3)

    def matrix():
        v = show(o)
        t = v["traffic"]
        cell = lambda h, a, b: t.get(h, {}).get("guests", {}).get(f"{mac(a)}>{mac(b)}", {}).get("frames", 0)
        return v if cell("h1", 11, 12) >= 20 and cell("h1", 21, 23) >= 3 and cell("h2", 12, 11) >= 20 else None
    assert wait_until(matrix, timeout=10)
    v = matrix()
    assert set(v["hosts"]) == {"h1", "h2", "h3"}
    assert {m: g["network"] for m, g in v["guests"].items()} == {mac(n): net for _, n, net in GUESTS}
    t = v["traffic"]
    # g11 -> g12: 20 echo requests at least (and ARP) from h1 to h2; the
    # replies the other way; b's pings between h1 and h3; nothing between
    # networks' guests.
    assert t["h1"]["to_hosts"]["h2"]["bytes"] >= 20 * 98
    assert t["h2"]["guests"][f"{mac(12)}>{mac(11)}"]["frames"] >= 20
    assert t["h1"]["guests"][f"{mac(21)}>{mac(23)}"]["frames"] >= 3
    for host in t.values():
        for pair in host["guests"]:
            a, b = pair.split(">")
            nets = {mac(n): net for _, n, net in GUESTS}
            assert nets[a] == nets[b], pair
    text = o.lab.x(o.etcd_ns, AGENT, "show", "--etcd", o.etcd_url, *o.tls_args(), *o.creds("vnet-show")).stdout
    assert "network a guests=3" in text and "traffic between hosts" in text, text


def leases(o: Overlay) -> dict[str, int]:
    """Every host and guest key in etcd, with the lease it is on (a guest
    claim: under its MAC's prefix, `gkey`)."""
    kvs = json.loads(o.etcdctl("get", "--prefix", "/vnet/", "-w", "json").stdout).get("kvs", [])
    keys = {base64.b64decode(kv["key"]).decode(): kv.get("lease", 0) for kv in kvs}
    return {(k.rsplit("/", 1)[0] + "/" if "/guests/" in k else k): v for k, v in keys.items() if k.endswith("/reg") or "/guests/" in k}


def claims_with_revisions(o: Overlay) -> dict[str, int]:
    """Every guest claim's key and the revision etcd created it at."""
    kvs = json.loads(o.etcdctl("get", "--prefix", "/vnet/", "-w", "json").stdout).get("kvs", [])
    return {base64.b64decode(kv["key"]).decode(): kv["create_revision"] for kv in kvs if "/guests/" in base64.b64decode(kv["key"]).decode()}


def test_etcd_down_stops_changes_never_forwarding_and_a_compaction_is_followed(overlay):
    o = overlay
    converged(o)
    before = leases(o)
    # Registrations live on their hosts' leases; claims on none (a claim
    # counts while its host is registered, and keeps its place).
    assert all(before.get(gkey(h, n)) == 0 and before[reg(h)] != 0 for h, n, _ in GUESTS), before
    claims_before = claims_with_revisions(o)
    assert len(claims_before) == len(GUESTS), claims_before
    o.etcd.terminate()
    o.etcd.wait(timeout=10)
    # etcd gone: forwarding goes on, within networks only, for longer than the leases.
    time.sleep(TTL + 1)
    assert o.ping(11, 12, count=3) and o.ping(21, 23)
    assert not o.ping(11, 21)
    # A guest added meanwhile is not published, and changes nothing elsewhere.
    o.add_guest(2, 22, "b")
    time.sleep(1)
    assert not o.routed(1, 22)
    # etcd back (same data): the agents register again (their leases ran
    # out meanwhile), publish, and route the new guest.
    o.start_etcd()
    wait_until(lambda: o.etcdctl("endpoint", "health", check=False).returncode == 0, timeout=20)
    assert wait_until(lambda: o.routed(1, 22) and o.routed(3, 22), timeout=15), o.log(1)

    # Each agent is registered on a live lease: its old one, which etcd
    # restored (and refreshed) with its data and the agent keeps alive
    # through its new connection, or a new one if that had gone; every
    # claim is still there, made at the same revision as before (its place
    # among a MAC's claims kept), and g22's is new.
    def registered_again():
        now = leases(o)
        return all(now.get(reg(h)) not in (None, 0) for h in (1, 2, 3))
    assert wait_until(registered_again, timeout=15), (before, leases(o))
    # Past the leases' TTL (etcd restored them, and expires those nobody
    # keeps alive), every host is still registered and every claim is
    # still there, unchanged.
    time.sleep(TTL + 1)
    assert registered_again(), (before, leases(o))
    now = claims_with_revisions(o)
    assert {k: v for k, v in now.items() if k in claims_before} == claims_before, (claims_before, now)
    assert [k for k in now if k not in claims_before] == [k for k in now if k.startswith(gkey(2, 22))], now
    assert o.ping(22, 21, count=2) and o.ping(23, 22)
    assert not o.ping(22, 11)
    # A compaction of everything so far, under the agents' watches; then a
    # change still reaches every host.
    rev = json.loads(o.etcdctl("endpoint", "status", "-w", "json").stdout)[0]["Status"]["header"]["revision"]
    o.etcdctl("compact", str(rev))
    o.agents[1].send_signal(signal.SIGSTOP)
    try:
        o.add_guest(3, 14, "a")
        assert wait_until(lambda: o.etcdctl("get", "--prefix", gkey(3, 14), "--print-value-only").stdout.strip(), timeout=10)
        rev = json.loads(o.etcdctl("endpoint", "status", "-w", "json").stdout)[0]["Status"]["header"]["revision"]
        o.etcdctl("compact", str(rev))
    finally:
        o.agents[1].send_signal(signal.SIGCONT)
    assert wait_until(lambda: o.routed(1, 14) and o.routed(2, 14), timeout=15), o.log(1)
    assert o.ping(11, 14, count=2)


@pytest.mark.parametrize("overlay", [True], indirect=True)
def test_etcd_over_tls_with_client_certificates(overlay):
    o = overlay
    converged(o)
    assert o.ping(11, 13, count=2)
    # An agent without a client certificate is refused by etcd and changes
    # nothing: its host keeps the routes it has.
    before = o.routes(3)
    o.agents[3].kill()
    o.agents[3].wait()
    log = o.lab.tmp / "agent-nocert.log"
    p = o.lab.popen(o.hosts[3], AGENT, "run", "--etcd", o.etcd_url, "--host", "h3", "--underlay", underlay_ip(3),
                    "--socket", o.d[3].sock, "--cacert", o.tls / "ca.crt", stdout=open(log, "w"),
                    stderr=subprocess.STDOUT)
    time.sleep(3)
    p.terminate()
    p.wait(timeout=10)
    assert "etcd:" in log.read_text() and "registered" not in log.read_text(), log.read_text()
    assert o.routes(3) == before


def test_a_mac_published_by_two_hosts_stays_with_the_first_claim(overlay):
    o = overlay
    converged(o)
    assert o.ping(11, 13)
    # Host 2 gets an interface with g13's MAC (a user forgot g13 on host 3,
    # a clone, or a tenant picking its MAC): its claim is later, so it
    # waits; g13 stays routed to host 3 everywhere. (Before per-host
    # records, the later claim won: host 2 took g13's traffic.)
    dup = o.lab.guest_ns("dup")
    o.d[2].ctl("INTERFACE", "ADD", "dup13", mac(13), "netns", dup, "network", "a")
    assert wait_until(lambda: "host h2 claims it" in o.log(1) and "held by h3, not by our claim" in o.log(2), timeout=10), o.log(2)
    assert any(f"{mac(11)} {mac(13)} edge agent.h3" in r for r in o.routes(1))
    assert not any(f"{mac(11)} {mac(13)} edge agent.h2" in r for r in o.routes(1))
    assert not any(f"any {mac(13)} interface {mac(13)}" in r for r in o.routes(2)), "host 2 routes the waiting interface"
    assert o.ping(11, 13, count=2)
    assert show(o)["contested"] == {mac(13): ["h2"]}
    # The first claim goes (g13 leaves host 3) well after host 2's was made:
    # host 2's claim waited, and a claim that waited never takes the MAC
    # (the security review's F4: a claim made ahead of time took a guest at
    # its migration). Nobody holds it; g13's routes go.
    time.sleep(HANDOVER_MS / 1000 + 0.5)
    o.d[3].ctl("INTERFACE", "DEL", "g13")
    assert wait_until(lambda: not any(o.routed(i, 13) for i in o.hosts), timeout=10), {i: o.routes(i) for i in o.hosts}
    time.sleep(0.5)
    assert mac(13) not in show(o)["guests"] and not any(f"any {mac(13)} interface" in r for r in o.routes(2))
    # Host 2's guest made again (a re-plug) claims anew, after the release:
    # it holds the MAC, and the overlay routes it there.
    o.d[2].ctl("INTERFACE", "DEL", "dup13")
    o.d[2].ctl("INTERFACE", "ADD", "dup13", mac(13), "netns", dup, "network", "a")
    assert wait_until(lambda: any(f"{mac(11)} {mac(13)} edge agent.h2" in r for r in o.routes(1)), timeout=10), o.log(1)
    assert "our claim holds it now" in o.log(2) or show(o)["guests"][mac(13)]["host"] == "h2"
    assert show(o)["guests"][mac(13)] == {"host": "h2", "network": "a"}


def rogue(o: Overlay, *args):
    """etcdctl with host 3's credentials: what a host taken over can do."""
    return o.etcdctl(*args, check=False, user="vnet-host-h3")


def test_a_rogue_host_cannot_rewrite_delete_or_revoke_another_hosts_records(overlay):
    # Security review S9: every agent could write the whole prefix. Host
    # 3's credentials (its agent's, as a host taken over has them) now
    # write host 3's records only: etcd refuses the rest.
    o = overlay
    converged(o)
    assert o.ping(12, 11) and o.ping(13, 11)
    before = leases(o)
    routes, links = routes_and_links(o)
    lease1 = "%x" % before[reg(1)]
    attacks = [
        # host 1's address moved to host 3's: host 1's traffic to host 3
        ("put", reg(1), f'{{"underlay":"{underlay_ip(3)}","port":9000}}'),
        # host 1's guest dropped, host 1's records dropped, all at once
        ("del", "--prefix", gkey(1, 11)),
        ("del", "--prefix", "/vnet/host/h1/"),
        ("del", "--prefix", "/vnet/"),
        # a guest made up under host 1's name; host 1's lease revoked (its
        # keys would go with it)
        ("put", gkey(1, 77) + EPOCH, '{"network":"a"}'),
        ("lease", "revoke", lease1),
    ]
    for a in attacks:
        r = rogue(o, *a)
        assert r.returncode != 0 and "permission denied" in r.stderr, (a, r.stdout, r.stderr)
    # Host 3's own records it may write, and read everything.
    assert rogue(o, "put", "/vnet/host/h3/note", "x").returncode == 0
    assert rogue(o, "get", reg(1)).returncode == 0
    time.sleep(1.0)
    assert leases(o) == before
    assert routes_and_links(o) == (routes, links)
    assert o.ping(12, 11, count=2) and o.ping(13, 11, count=2)


def test_a_rogue_hosts_claim_of_a_mac_another_host_holds_is_ignored_at_the_guests_migration_too(overlay):
    # Host 3's credentials claim g12's MAC (g12 is on host 2, in network a,
    # which host 3 has a member of too): a claim host 3 may write, in its
    # own records, but later than host 2's. Every agent ignores it, says so
    # and counts it; g12's traffic keeps going to host 2. (Before, the later
    # claim won: hosts 1 and 3 sent g12's frames to host 3.) Then g12
    # migrates to host 1: its new host's claim takes the MAC, not host 3's,
    # which waited (the security review's F4: host 3 took g12 there).
    o = overlay
    converged(o)
    assert o.ping(11, 12) and o.ping(13, 12)
    assert rogue(o, "put", gkey(3, 12) + EPOCH, '{"network":"a"}').returncode == 0
    for i in o.hosts:
        assert wait_until(lambda: f"guest {mac(12)}: host h3 claims it" in o.log(i), timeout=10), o.log(i)
    # Each agent's count, as it publishes it (`show`).
    assert wait_until(lambda: all(show(o)["traffic"].get(f"h{i}", {}).get("contested") == 1 for i in o.hosts), timeout=10), show(o)
    v = show(o)
    assert v["guests"][mac(12)] == {"host": "h2", "network": "a"} and v["contested"] == {mac(12): ["h3"]}
    assert any(f"{mac(11)} {mac(12)} edge agent.h2" in r for r in o.routes(1))
    assert not any(r.split()[3] == mac(12) and "edge agent.h3" in r for r in o.routes(1))
    assert o.ping(11, 12, count=2) and o.ping(13, 12, count=2)
    # g12 migrates from host 2 to host 1, as test_migration's VM does: it
    # leaves host 2, then starts on host 1.
    o.d[2].ctl("INTERFACE", "DEL", "g12", "detach")
    o.d[1].ctl("INTERFACE", "ADD", "g12", mac(12), "netns", o.guest_ns[12], "network", "a")
    want = f"{mac(13)} {mac(12)} edge agent.h1"
    assert wait_until(lambda: any(want in r for r in o.routes(3)), timeout=10), (o.routes(3), o.log(3))
    assert wait_until(lambda: show(o)["guests"].get(mac(12)) == {"host": "h1", "network": "a"}, timeout=5), show(o)
    for i in o.hosts:
        assert not any(r.split()[3] == mac(12) and "edge agent.h3" in r for r in o.routes(i)), (i, o.routes(i))
    assert o.ping(13, 12, count=2) and o.ping(11, 12, count=2)
    # Host 3's claim still waits, ignored; host 2's released one stays while
    # it does (it keeps host 3's claim off the chain for every reader).
    assert show(o)["contested"] == {mac(12): ["h3"]}
    assert claimed_by(o, 2, 12) == ['{"network":"a","released":true}']


def test_a_claim_counts_only_while_its_hosts_agent_is_registered(overlay):
    # Host 3's credentials claim a MAC nobody holds, by hand (no lease):
    # the overlay routes it to host 3 while host 3 is registered. Once host
    # 3's agent is gone and its lease ran out, the claim counts for nothing:
    # nothing is routed to it anywhere (before, a claim written without a
    # lease outlived its host's agent).
    o = overlay
    converged(o)
    assert rogue(o, "put", gkey(3, 77) + EPOCH, '{"network":"a"}').returncode == 0
    assert wait_until(lambda: any(f"{mac(11)} {mac(77)} edge agent.h3" in r for r in o.routes(1)), timeout=10), o.routes(1)
    o.agents[3].terminate()
    o.agents[3].wait(timeout=10)
    assert wait_until(lambda: not o.routed(1, 77), timeout=TTL + 10), o.routes(1)
    assert mac(77) not in show(o)["guests"] and show(o)["stranded"].get(mac(77)) == "h3", show(o)


def routes_and_links(o):
    """Every host's routes and links, as listed (ids included)."""
    return {i: o.routes(i) for i in o.hosts}, {i: o.d[i].ctl("LINK", "LIST").stdout for i in o.hosts}


def test_an_agent_restarted_within_its_lease_changes_nothing_anywhere(overlay):
    o = overlay
    converged(o)
    time.sleep(0.5)
    before, links = routes_and_links(o)
    pinger = o.lab.popen(o.guest_ns[12], "ping", "-n", "-q", "-i", "0.02", "-c", "150", overlay_ip(11),
                         stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    o.agents[1].send_signal(signal.SIGTERM)
    assert o.agents[1].wait(timeout=5) == 0
    o.start_agent(1)
    time.sleep(TTL + 1.0)
    # Every route and link on every host is the one that was there (same
    # ids): nothing was withdrawn or made again, and no ping was lost.
    assert routes_and_links(o) == (before, links)
    out = pinger.communicate(timeout=30)[0]
    assert " 0% packet loss" in out, out


def test_hostile_values_in_etcd_are_ignored_and_inject_nothing(overlay):
    # docs/controller.md: what the agent reads from etcd is checked before
    # it becomes a control line. Whoever can write the prefix decides the
    # overlay's routes (that is the trust model), but a malformed value must
    # neither stop the agents nor smuggle another command into vnetd.
    o = overlay
    converged(o)
    time.sleep(0.5)
    before, links = routes_and_links(o)
    # Each value is one a guest of network a would be routed by, so each
    # would reach a control line if the agent did not check it.
    evil_host = "h9\nLINK DEL agent.h2"
    g = lambda host, m: f"/vnet/host/{host}/guests/{m}/{EPOCH}"
    net_a = '{"network":"a"}'
    hostile = {
        # a host name carrying a second command, with a guest in network a
        f"/vnet/host/{evil_host}/reg": '{"underlay":"198.18.0.9","port":9000}',
        g(evil_host, mac(99)): net_a,
        # a MAC carrying one, a MAC that is not one, a multicast MAC
        g("h2", f"{mac(98)} edge agent.h2 any\nLINK DEL agent.h2"): net_a,
        g("h2", "zz:zz:zz:zz:zz:zz"): net_a,
        g("h2", "01:00:5e:00:00:01"): net_a,
        # a network carrying one
        g("h2", mac(92)): '{"network":"a\nLINK DEL agent.h2"}',
        # hosts whose address or port is not one, each with a guest in a
        "/vnet/host/h8/reg": '{"underlay":"198.18.0.8; LINK DEL 0","port":9000}',
        g("h8", mac(97)): net_a,
        "/vnet/host/h7/reg": '{"underlay":"198.18.0.7","port":70000}',
        g("h7", mac(96)): net_a,
        # not JSON, fields missing or of the wrong type
        g("h2", mac(95)): "not json",
        g("h2", mac(94)): '{"host":"h2"}',
        g("h2", mac(93)): '{"network":7}',
    }
    for k, v in hostile.items():
        o.etcdctl("put", k, v)
    time.sleep(3.0)  # several passes and a 2 s resync
    for i in o.hosts:
        assert o.agents[i].poll() is None, f"agent h{i} died:\n{o.log(i)}"
        assert o.routes(i) == before[i], f"host {i}'s routes changed"
        assert o.d[i].ctl("LINK", "LIST").stdout == links[i], f"host {i}'s links changed"
        assert "ignoring" in o.log(i)
    # A well-formed change right after still goes through.
    o.add_guest(3, 14, "a")
    assert wait_until(lambda: o.routed(1, 14) and o.routed(2, 14), timeout=10)
    assert o.ping(11, 14, count=2)


def test_an_encrypted_overlay_links_every_host_by_wireguard_and_nothing_crosses_in_clear(encrypted):
    """`vnet-agent run --encrypt` on three hosts: each publishes its vnetd's
    WireGuard public key in etcd, and the agents link the hosts by WireGuard
    with those keys; the networks work as in clear, and the underlay carries
    only WireGuard."""
    o = encrypted
    converged(o)
    keys = {}
    for i in o.hosts:
        line = next(l for l in o.d[i].ctl("SHOW").stdout.splitlines() if l.startswith("wireguard "))
        keys[i] = dict(w.split("=", 1) for w in line.split()[1:])["public_key"]
    # etcd holds each host's key, as its agent published it.
    hosts = show(o)["hosts"]
    for i in o.hosts:
        assert hosts[f"h{i}"]["wireguard"] == {"port": 51820, "public_key": keys[i]}, hosts
    # Every agent link is WireGuard, to the key the peer published.
    for i in o.hosts:
        links = [l for l in o.d[i].ctl("LINK", "LIST").stdout.splitlines() if "name=agent." in l]
        assert links and all("proto=wireguard" in l for l in links), links
        for l in links:
            peer = int(l.split("name=agent.h", 1)[1].split()[0])
            assert f"peer_key={keys[peer]}" in l and f"remote={underlay_ip(peer)}:51820" in l, l
    # Within a network across hosts, and not across networks.
    pcap = o.lab.tmp / "h1.pcap"
    cap = o.lab.popen(o.hosts[1], "tcpdump", "-i", "eth0", "-s", "0", "-U", "--immediate-mode", "-n", "-w", pcap,
                      "udp", "and", "not", "port", "2379", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    cap.stderr.readline()
    assert o.ping(11, 12, count=3) and o.ping(11, 13, count=3) and o.ping(21, 23, count=3)
    assert not o.ping(11, 23)
    time.sleep(0.3)
    cap.terminate()
    cap.wait(timeout=10)
    out = o.lab.x(o.hosts[1], "tcpdump", "-n", "-r", pcap).stdout
    assert "51820" in out and ".9000" not in out, out
    for i in o.hosts:
        s = o.d[i].stats()
        for name, v in s.items():
            if name.startswith("link agent."):
                assert v["wg_unauthenticated"] == 0 and v["drop_unauthenticated"] == 0, (name, v)


# Sends numbered lines until its stdin closes, checks each echo, and says
# how many and the longest wait for one.
CLIENT_UNTIL_TOLD = r"""
import socket, sys, threading, time
s = socket.create_connection((sys.argv[1], 5201), timeout=20); print("connected", flush=True)
f = s.makefile("rwb")
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
i, longest = 0, 0.0
while not done.is_set():
    t = time.monotonic()
    f.write(b"%d\n" % i); f.flush()
    assert f.readline() == b"%d\n" % i, i
    longest = max(longest, time.monotonic() - t)
    i += 1
    time.sleep(0.01)
s.shutdown(socket.SHUT_WR)
print("ok", i, int(longest * 1000), flush=True)
"""


def test_a_hosts_wireguard_key_rotates_under_an_open_tcp_connection(encrypted):
    """`WIREGUARD ROTATE` on host 2 while g11 (host 1) and g12 (host 2) hold a
    TCP connection with bytes flowing both ways: host 2's agent publishes the
    new key, the other hosts' agents replace their links to host 2 with it,
    and the connection carries on, every echo in order, through and past the
    replacement, with no echo waiting a second or more. The key file holds
    the new key (what vnetd reads at its next start)."""
    o = encrypted
    converged(o)
    def key_of(i):
        line = next(l for l in o.d[i].ctl("SHOW").stdout.splitlines() if l.startswith("wireguard "))
        return dict(w.split("=", 1) for w in line.split()[1:])["public_key"]
    old = key_of(2)
    srv = o.lab.popen(o.guest_ns[12], "python3", "-c", ECHO, overlay_ip(12), stdout=subprocess.PIPE, text=True)
    assert srv.stdout.readline().strip() == "listening"
    cli = o.lab.popen(o.guest_ns[11], "python3", "-c", CLIENT_UNTIL_TOLD, overlay_ip(12), stdin=subprocess.PIPE,
                      stdout=subprocess.PIPE, text=True)
    assert cli.stdout.readline().strip() == "connected"
    time.sleep(0.5)
    rotated = o.d[2].ctl("WIREGUARD", "ROTATE").stdout
    new = key_of(2)
    assert new != old and f"public_key={new}" in rotated
    # The key file holds the new key (mode 600), for vnetd's next start.
    key_file = o.lab.tmp / "h2.wgkey"
    assert key_file.stat().st_mode & 0o777 == 0o600
    on_file = subprocess.run(["wg", "pubkey"], input=key_file.read_text(), capture_output=True, text=True, check=True).stdout.strip()
    assert on_file == new, (on_file, new)
    def peers_have(key):
        return all(f"peer_key={key}" in next(l for l in o.d[i].ctl("LINK", "LIST").stdout.splitlines() if "name=agent.h2 " in l)
                   for i in (1, 3))
    t = time.monotonic()
    assert wait_until(lambda: peers_have(new), timeout=10), [o.d[i].ctl("LINK", "LIST").stdout for i in (1, 3)]
    print(f"peers took the new key {time.monotonic() - t:.2f} s after the rotation")
    assert show(o)["hosts"]["h2"]["wireguard"]["public_key"] == new
    # The stream goes on past the replacement, then stops.
    time.sleep(1.0)
    out = cli.communicate(input="", timeout=30)[0]
    srv.wait(timeout=10)
    assert out.startswith("ok "), out
    count, longest_ms = (int(x) for x in out.split()[1:3])
    print(f"{count} echoes across the rotation, longest wait {longest_ms} ms")
    assert longest_ms < 1000, out
    assert o.ping(13, 12) and o.ping(12, 11)


def test_guests_addresses_are_published_and_their_arp_is_answered_on_the_askers_host(overlay):
    """Guest 12 (host 2, network a) pings guest 11: host 2's vnetd learns its
    address from its ARP request, its agent publishes it with the claim
    (`ips` in etcd), and every other host with a member of network a binds
    it (`NEIGH ... owner agent`); host 3 does not bind it for network b's
    guest, and no host binds its own guests'. Then guest 13 (host 3) asks
    for guest 12's address 50 times: every request is answered on host 3
    with guest 12's MAC, and none crosses host 3's underlay."""
    from test_neigh import ask, arp_on_the_wire
    from test_wireguard import capture, stop_capture
    from netlab import Guest
    o = overlay
    converged(o)
    assert o.ping(12, 11)
    ip12 = overlay_ip(12)

    def published():
        v = json.loads(o.etcdctl("get", "--prefix", "/vnet/host/h2/guests/", "--print-value-only").stdout.splitlines()[0])
        return ip12 in v.get("ips", [])
    assert wait_until(published, timeout=10), o.log(2)

    def bound(i):
        return f"neigh {ip12} {mac(12)} owner agent" in o.d[i].ctl("NEIGH", "LIST").stdout
    assert wait_until(lambda: bound(1) and bound(3), timeout=10), (o.log(1), o.log(3))
    assert not bound(2), "a host binds its own guest's address"
    pcap = o.lab.tmp / "arp-h3.pcap"
    cap = capture(o.lab, o.hosts[3], "eth0", pcap, ("udp",))
    g13 = Guest(ns=o.guest_ns[13], tap="g13", mac=mac(13), ip=overlay_ip(13), host=o.hosts[3])
    r = ask(o.lab, g13, ip12, n=50)
    stop_capture(cap)
    assert r == {"answered": 50, "from": {mac(12): 50}}, r
    assert arp_on_the_wire(o.lab, pcap) == 0
    # Guest 23 (network b, host 3) is not answered for network a's guest:
    # its request is flooded within b and nobody there holds the address.
    g23 = Guest(ns=o.guest_ns[23], tap="g23", mac=mac(23), ip=overlay_ip(23), host=o.hosts[3])
    assert ask(o.lab, g23, ip12, n=3)["answered"] == 0


def etcd_cluster(lab, members=(100, 101, 102)) -> dict[int, subprocess.Popen]:
    """A 3-member etcd cluster, a member per namespace on the LAN (no auth:
    this is about its failures, not its RBAC)."""
    peers = ",".join(f"m{m}=http://{underlay_ip(m)}:2380" for m in members)
    procs = {}
    for m in members:
        ns = lab.add_host(m)
        url = f"http://{underlay_ip(m)}:{ETCD_PORT}"
        procs[m] = lab.popen(ns, "etcd", "--name", f"m{m}", "--data-dir", lab.tmp / f"etcd-{m}",
                             "--listen-client-urls", url, "--advertise-client-urls", url,
                             "--listen-peer-urls", f"http://{underlay_ip(m)}:2380",
                             "--initial-advertise-peer-urls", f"http://{underlay_ip(m)}:2380",
                             "--initial-cluster", peers, "--initial-cluster-state", "new",
                             "--heartbeat-interval", "100", "--election-timeout", "1000",
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return procs


def etcd_leader(lab, ns, members) -> int:
    """The member that leads now."""
    eps = ",".join(f"http://{underlay_ip(m)}:{ETCD_PORT}" for m in members)
    out = lab.x(ns, "env", "ETCDCTL_API=3", "etcdctl", "--endpoints", eps, "endpoint", "status", "-w", "json",
                check=False).stdout
    st = json.loads(out or "[]")
    for s in st:
        if s["Status"]["leader"] == s["Status"]["header"]["member_id"]:
            return int(s["Endpoint"].split("//")[1].split(":")[0].rsplit(".", 1)[1])
    return 0


def test_the_etcd_leader_killed_under_churn_loses_no_change(lab):
    """Three etcd members; host 1's vnetd gets a guest added every 50 ms (and
    every fourth an earlier one deleted) while host 2's agent follows; after
    a second of it the etcd leader is killed (SIGKILL). No change is lost:
    host 2 routes exactly the guests host 1 has, every add and every delete
    followed. The delay of each change (host 1's INTERFACE ADD to host 2's
    route), during the failover and outside it, is printed: a measurement,
    not a bound (issue 44's target: p99 < 2 s during the failover)."""
    members = (100, 101, 102)
    procs = etcd_cluster(lab, members)
    eps = ",".join(f"http://{underlay_ip(m)}:{ETCD_PORT}" for m in members)
    probe = lab.add_host(103)
    assert wait_until(lambda: etcd_leader(lab, probe, members) != 0, timeout=30), "no etcd leader"
    hosts = {i: lab.add_host(i) for i in (1, 2)}
    d = {i: lab.start_vnetd(h, f"INTERFACE ADD s{i} 02:00:00:00:0{i}:00 network a\n") for i, h in hosts.items()}
    agents = {}
    for i, h in hosts.items():
        agents[i] = lab.popen(h, AGENT, "run", "--etcd", eps, "--host", f"h{i}", "--underlay", underlay_ip(i),
                              "--socket", d[i].sock, "--ttl", 5, "--traffic-s", 0,
                              stdout=open(lab.tmp / f"agent-h{i}.log", "a"), stderr=subprocess.STDOUT)
    try:
        # (Rules are `s d edge agent.h1 interface s`: d, the second word, is
        # a host-1 guest.)
        routed = lambda: {r.split()[3] for r in d[2].ctl("ROUTE", "LIST").stdout.splitlines()
                          if r.split()[4:6] == ["edge", "agent.h1"] and r.split()[3] != "ff:ff:ff:ff:ff:ff"}
        assert wait_until(lambda: "02:00:00:00:01:00" in routed(), timeout=20), open(lab.tmp / "agent-h2.log").read()
        s1, s2 = UnixSession(d[1].sock), UnixSession(d[2].sock)
        added: dict[str, float] = {}
        seen: dict[str, float] = {}
        live: set[str] = {"02:00:00:00:01:00"}
        killed_at = None
        t0 = time.monotonic()

        def look():
            status, lines = s2.request("ROUTE LIST\n")
            now = time.monotonic()
            for r in lines:
                w = r.split()
                if w[4:6] == ["edge", "agent.h1"] and w[3] in added and w[3] not in seen:
                    seen[w[3]] = now

        for k in range(60):
            m = "02:00:00:00:1%x:%02x" % (k >> 8, k & 255)
            assert s1.request(f"INTERFACE ADD c{k} {m} network a\n")[0].startswith("OK")
            added[m] = time.monotonic()
            live.add(m)
            if k % 4 == 3:
                gone = "02:00:00:00:1%x:%02x" % ((k - 2) >> 8, (k - 2) & 255)
                assert s1.request(f"INTERFACE DEL c{k - 2}\n")[0].startswith("OK")
                live.discard(gone)
            if killed_at is None and time.monotonic() - t0 > 1.0:
                leader = etcd_leader(lab, probe, members)
                procs[leader].kill()
                killed_at = time.monotonic()
            end = time.monotonic() + 0.05
            while time.monotonic() < end:
                look()
                time.sleep(0.01)
        want = live
        ok = wait_until(lambda: routed() == want, timeout=60)
        final = routed()
        assert ok, f"missing {sorted(want - final)}, extra {sorted(final - want)}\n" + open(lab.tmp / "agent-h2.log").read()[-3000:]
        for _ in range(20):
            look()
        delays = sorted((seen[m] - added[m], added[m] >= killed_at) for m in seen)
        during = sorted(x for x, after in delays if after)
        before = sorted(x for x, after in delays if not after)
        p99 = lambda xs: xs[min(len(xs) - 1, int(len(xs) * 0.99))] if xs else float("nan")
        print(f"etcd leader killed under churn: {len(added)} adds, {len(added) - len(want) + 1} deletes, none lost; "
              f"delay before the kill: median {statistics.median(before) if before else float('nan'):.3f} s, p99 {p99(before):.3f} s; "
              f"from the kill on: median {statistics.median(during) if during else float('nan'):.3f} s, p99 {p99(during):.3f} s, max {max(during) if during else float('nan'):.3f} s")
        s1.close()
        s2.close()
    finally:
        for p in agents.values():
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=10)
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=10)
