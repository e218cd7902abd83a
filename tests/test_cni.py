"""The CNI plugin vnet-cni (docs/containers.md), end to end:

- driven by cnitool: two containers on one vnetd ping each other, CHECK
  passes, DEL removes the interface from vnetd, the device from the
  namespace and the IP from host-local, and a second DEL succeeds;
- the spec's environment interface directly, every command and bad input:
  the right CNI error codes, as CNI error JSON, and nothing changed in vnetd
  after a failed ADD (IPAM failures and vnetd refusals included); GC; a
  namespace given as /proc/<pid>/ns/net; DEL with vnetd down;
- survival: vnetd stopped and started again, `vnet-cni restore`, and the
  containers keep their device (same ifindex), address, and reach each other;
- podman: two containers on two hosts, each with its own vnetd and CNI
  network, ping each other and move 4 MB intact over HTTP.

cnitool and podman run in a mount namespace of the test's own (see
`MountNs`), so their machine-wide state (libcni's cache in /var/lib/cni,
crun's /run/crun, podman's netns mounts) stays out of the machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

import netlab
from netlab import BIN, VNETD, Lab, run, underlay_ip, wait_until

CNI = BIN / "vnet-cni"
CNI_PATH = f"{BIN}:/usr/lib/cni"
CNITOOL = shutil.which("cnitool")
PODMAN = shutil.which("podman")

needs_cnitool = pytest.mark.skipif(CNITOOL is None, reason="cnitool not installed (scripts/setup installs it)")
needs_podman = pytest.mark.skipif(PODMAN is None, reason="podman not installed (scripts/setup installs it)")


def plugin_conf(lab: Lab, name: str, sock: Path, subnet: str, version: str = "1.0.0", **extra) -> dict:
    """A vnet-cni plugin config of the lab's own: its state and host-local's
    leases in the lab's directory, the CNI network's name prefixed."""
    conf = {
        "cniVersion": version,
        "name": lab.prefix + name,
        "type": "vnet-cni",
        "socket": str(sock),
        "network": "blue",
        "stateDir": str(lab.tmp / "state"),
        "ipam": {"type": "host-local", "subnet": subnet, "dataDir": str(lab.tmp / "ipam")},
    }
    conf.update(extra)
    return conf


@dataclass
class Reply:
    rc: int
    out: dict | None
    err: str


def cni(command: str, conf: dict | str, cid: str = "", netns: str = "", ifname: str = "eth0", args: str = "") -> Reply:
    """Runs the plugin as a runtime does: CNI_* variables, config on stdin."""
    env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "CNI_COMMAND": command, "CNI_PATH": CNI_PATH}
    for k, v in (("CNI_CONTAINERID", cid), ("CNI_NETNS", netns), ("CNI_IFNAME", ifname), ("CNI_ARGS", args)):
        if v:
            env[k] = v
    stdin = conf if isinstance(conf, str) else json.dumps(conf)
    p = subprocess.run([str(CNI)], input=stdin, env=env, capture_output=True, text=True, timeout=30)
    out = json.loads(p.stdout) if p.stdout.strip() else None
    return Reply(p.returncode, out, p.stderr)


def ok(r: Reply) -> dict | None:
    assert r.rc == 0, f"plugin failed: {r.out}\n{r.err}"
    return r.out


def cni_error(r: Reply, code: int) -> dict:
    """The reply is a CNI error result with `code`."""
    assert r.rc != 0, f"expected CNI error {code}, got success: {r.out}"
    assert r.out is not None and r.out.get("code") == code, f"expected code {code}: {r.out}\n{r.err}"
    assert r.out.get("msg") and "cniVersion" in r.out, r.out
    return r.out


def netns_path(ns: str) -> str:
    return f"/run/netns/{ns}"


def device(lab: Lab, ns: str, dev: str = "eth0") -> dict | None:
    """`ip -j addr show dev` in `ns`: ifindex, address (MAC), addr_info."""
    p = lab.x(ns, "ip", "-j", "addr", "show", "dev", dev, check=False)
    return json.loads(p.stdout)[0] if p.returncode == 0 else None


def addresses(dev: dict) -> list[str]:
    return [f"{a['local']}/{a['prefixlen']}" for a in dev["addr_info"] if a["family"] == "inet"]


def ping(lab: Lab, ns: str, ip: str, tries: int = 3) -> bool:
    return any(lab.x(ns, "ping", "-n", "-q", "-c", 1, "-W", 1, ip, check=False).returncode == 0 for _ in range(tries))


def leases(lab: Lab, net: str) -> set[str]:
    """host-local's allocations (a file per IP) for CNI network `net`."""
    d = lab.tmp / "ipam" / net
    return {p.name for p in d.iterdir() if p.name[0].isdigit()} if d.exists() else set()


def records(lab: Lab) -> list[Path]:
    root = lab.tmp / "state"
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")) if root.exists() else []


def vnetd_state(d: netlab.Vnetd) -> str:
    return d.ctl("INTERFACE", "LIST").stdout + d.ctl("ROUTE", "LIST").stdout


class MountNs:
    """A mount namespace of the test's own, held by a `sleep` it started (and
    ends by PID), entered with nsenter. It is a slave of the machine's:
    it sees the lab's namespaces, and nothing mounted in it leaks out.
    /var/lib is a private tmpfs there (libcni caches results in
    /var/lib/cni). With `podman`: /run is a private tmpfs too (crun keeps
    state in /run/crun) with the machine's /run/netns carried over, and
    the cgroup2 hierarchy this machine mounts beside cgroup v1 is unmounted
    (crun 1.8 refuses such a "hybrid" layout)."""

    def __init__(self, lab: Lab, podman: bool = False):
        self.proc = subprocess.Popen(["unshare", "-m", "--propagation", "slave", "sleep", "infinity"])
        lab.other_procs.append(self.proc)
        mine = os.readlink("/proc/self/ns/mnt")
        assert wait_until(lambda: os.readlink(f"/proc/{self.proc.pid}/ns/mnt") != mine), "unshare did not start"
        script = ["mount -t tmpfs tmpfs /var/lib"]
        if podman:
            hold = lab.tmp / "netns-hold"
            hold.mkdir()
            script += [
                "if mountpoint -q /sys/fs/cgroup/unified; then umount /sys/fs/cgroup/unified; fi",
                f"mount --rbind /run/netns {hold}",
                "mount -t tmpfs tmpfs /run",
                "mkdir /run/netns",
                f"mount --move {hold} /run/netns",
                # Shared (and still a slave of the machine's): the netns
                # mounts podman makes here reach the vnetds started from here.
                "mount --make-shared /run/netns",
            ]
        self.run(["sh", "-ec", "\n".join(script)])

    def prefix(self) -> list[str]:
        return ["nsenter", "-t", str(self.proc.pid), "-m"]

    def run(self, cmd, **kw) -> subprocess.CompletedProcess:
        return run([*self.prefix(), *cmd], **kw)


# ---------------------------------------------------------------------------


@needs_cnitool
def test_cnitool_adds_containers_that_ping_and_check_and_del_cleanly(lab):
    host = lab.ns("h1")
    d = lab.start_vnetd(host)
    c1, c2 = lab.guest_ns("c1"), lab.guest_ns("c2")
    netdir = lab.tmp / "net.d"
    netdir.mkdir()
    # The shipped example, pointed at the lab (its socket, state and leases)
    # and spoken in 1.1.0 (STATUS; host-local itself stops at 1.0.0).
    conflist = json.loads((netlab.REPO / "examples" / "cni" / "10-vnet.conflist").read_text())
    net = conflist["name"] = lab.prefix + "blue"
    conflist["cniVersion"] = "1.1.0"
    plugin = conflist["plugins"][0]
    assert plugin["capabilities"] == {"mac": True}
    plugin.update(socket=str(d.sock), stateDir=str(lab.tmp / "state"))
    plugin["ipam"]["dataDir"] = str(lab.tmp / "ipam")
    (netdir / "10-vnet.conflist").write_text(json.dumps(conflist))
    mnt = MountNs(lab)
    env = {**os.environ, "NETCONFPATH": str(netdir), "CNI_PATH": CNI_PATH}

    def cnitool(*args, check=True, **extra_env):
        return mnt.run(["cnitool", *args], env={**env, **extra_env}, check=check)

    cnitool("status", net, netns_path(c1))
    # c1's MAC from the runtime (the mac capability), c2's derived.
    res = {c1: json.loads(cnitool("add", net, netns_path(c1), CAP_ARGS='{"mac": "02:cc:00:00:01:01"}').stdout),
           c2: json.loads(cnitool("add", net, netns_path(c2)).stdout)}
    assert res[c1]["interfaces"][0]["mac"] == "02:cc:00:00:01:01"
    listing = d.ctl("INTERFACE", "LIST").stdout
    ips = {}
    for c, r in res.items():
        iface, ip = r["interfaces"][0], r["ips"][0]
        assert (iface["name"], iface["sandbox"], ip["interface"]) == ("eth0", netns_path(c), 0), r
        dev = device(lab, c)
        assert dev["address"] == iface["mac"] and ip["address"] in addresses(dev)
        assert "UP" in dev["flags"] and dev["mtu"] == 1458
        assert f"mac={iface['mac']} mtu=1458 attach=veth netns={c} network=blue ifname=eth0" in listing, listing
        ips[c] = ip["address"].split("/")[0]
    assert leases(lab, net) == set(ips.values())
    routes = d.ctl("ROUTE", "LIST").stdout
    assert routes.count("owner cni") == 4, routes

    assert ping(lab, c1, ips[c2]) and ping(lab, c2, ips[c1])
    cnitool("check", net, netns_path(c1))
    cnitool("check", net, netns_path(c2))

    # DEL: the interface (and its routes) out of vnetd, the device out of
    # the namespace, the IP back to host-local; again: still success.
    mac1 = res[c1]["interfaces"][0]["mac"]
    cnitool("del", net, netns_path(c1))
    assert mac1 not in vnetd_state(d)
    assert device(lab, c1) is None
    assert leases(lab, net) == {ips[c2]}
    cnitool("del", net, netns_path(c1))
    assert ping(lab, c2, ips[c2])  # c2 untouched (its own address answers)
    cnitool("del", net, netns_path(c2))
    assert vnetd_state(d) == ""
    assert leases(lab, net) == set() and records(lab) == []


def test_every_command_through_the_environment_and_bad_input(lab):
    host = lab.ns("h1")
    d = lab.start_vnetd(host)
    c1, c2 = lab.guest_ns("c1"), lab.guest_ns("c2")
    conf = plugin_conf(lab, "env", d.sock, "10.77.2.0/24", version="1.1.0")
    net = conf["name"]

    v = ok(cni("VERSION", '{"cniVersion": "1.0.0"}'))
    assert v == {"cniVersion": "1.0.0", "supportedVersions": ["0.3.1", "0.4.0", "1.0.0", "1.1.0"]}

    # Bad input: the spec's codes, and nothing changed anywhere.
    before = vnetd_state(d)
    nobody = str(lab.tmp / "nobody.sock")
    ns1 = netns_path(c1)
    bad = [
        ("ADD", "{not json", ns1, 6),
        ("ADD", {**conf, "routes": "bgp"}, ns1, 7),
        ("ADD", {**conf, "mtu": 20}, ns1, 7),
        ("ADD", {**conf, "mtu": "big"}, ns1, 7),
        ("ADD", {**conf, "network": "a b"}, ns1, 7),
        ("ADD", {**conf, "ipMasq": True}, ns1, 2),
        ("ADD", {**conf, "cniVersion": "0.2.0"}, ns1, 1),
        ("ADD", conf, netns_path(lab.prefix + "nothere"), 3),
        ("ADD", conf, "", 4),
        ("FROB", conf, ns1, 4),
        ("CHECK", {**conf, "cniVersion": "0.3.1"}, ns1, 1),
        ("GC", {**conf, "cniVersion": "1.0.0"}, "", 1),
        ("STATUS", {**conf, "cniVersion": "0.4.0"}, "", 1),
        ("ADD", {**conf, "socket": nobody}, ns1, 11),
        ("STATUS", {**conf, "socket": nobody}, "", 50),
        ("ADD", {**conf, "ipam": {"type": "no-such-ipam"}}, ns1, 101),
    ]
    for command, c, ns, code in bad:
        e = cni_error(cni(command, c, cid="bad1", netns=ns), code)
        assert e["cniVersion"] in ("1.1.0", "1.0.0", "0.3.1", "0.4.0"), e
    e = cni_error(cni("ADD", {**conf, "routes": "bgp"}, cid="bad1", netns=ns1), 7)
    assert "routes" in e["msg"] and "bgp" in e["msg"]
    e = cni_error(cni("ADD", conf, cid="bad1"), 4)
    assert "CNI_NETNS" in e["msg"]
    cni_error(cni("ADD", conf, cid="bad/1", netns=ns1), 4)
    # The IPAM plugin fails after vnetd made the veth: all of it taken back.
    bad_ipam = {**conf, "ipam": {"type": "host-local", "subnet": "10.77.2.0/33", "dataDir": str(lab.tmp / "ipam")}}
    e = cni("ADD", bad_ipam, cid="bad1", netns=ns1)
    assert e.rc != 0 and "IPAM plugin host-local" in e.out["msg"], e
    # vnetd refuses (the namespace has an eth0 already): its reason comes through.
    lab.x(c2, "ip", "link", "add", "eth0", "type", "veth", "peer", "name", "eth0p")
    e = cni_error(cni("ADD", conf, cid="bad2", netns=netns_path(c2)), 100)
    assert "vnetd refused" in e["msg"] and "exists" in e["msg"], e
    lab.x(c2, "ip", "link", "del", "eth0")
    assert vnetd_state(d) == before, "a failed ADD changed vnetd"
    assert device(lab, c1) is None and device(lab, c2) is None
    assert records(lab) == [] and leases(lab, net) == set()

    # ADD, in a 0.4.0 config: IPs carry their version.
    conf04 = {**conf, "cniVersion": "0.4.0"}
    r1 = ok(cni("ADD", conf04, cid="cid1", netns=ns1))
    assert r1["cniVersion"] == "0.4.0" and r1["ips"][0]["version"] == "4"
    assert r1["interfaces"] == [{"name": "eth0", "mac": r1["interfaces"][0]["mac"], "sandbox": ns1}]
    addr1 = r1["ips"][0]["address"]
    assert addr1 in addresses(device(lab, c1))
    assert len(records(lab)) == 1

    # CHECK against the prevResult; then with the address gone it fails.
    assert ok(cni("CHECK", {**conf04, "prevResult": r1}, cid="cid1", netns=ns1)) is None
    lab.x(c1, "ip", "addr", "del", addr1, "dev", "eth0")
    e = cni_error(cni("CHECK", {**conf04, "prevResult": r1}, cid="cid1", netns=ns1), 104)
    assert addr1 in e["msg"]
    lab.x(c1, "ip", "addr", "add", addr1, "dev", "eth0")
    cni_error(cni("CHECK", conf04, cid="cid1", netns=ns1), 7)  # no prevResult

    assert ok(cni("STATUS", conf)) is None

    # GC: an attachment not in cni.dev/valid-attachments goes as DEL would.
    r2 = ok(cni("ADD", conf, cid="cid2", netns=netns_path(c2)))
    mac2, addr2 = r2["interfaces"][0]["mac"], r2["ips"][0]["address"].split("/")[0]
    assert "version" not in r2["ips"][0]
    assert ping(lab, c1, addr2)
    valid = [{"containerID": "cid1", "ifname": "eth0"}]
    assert ok(cni("GC", {**conf, "cni.dev/valid-attachments": valid})) is None
    assert mac2 not in vnetd_state(d) and device(lab, c2) is None
    assert leases(lab, net) == {addr1.split("/")[0]} and len(records(lab)) == 1
    assert ok(cni("CHECK", {**conf04, "prevResult": r1}, cid="cid1", netns=ns1)) is None

    # DEL, twice; DEL of what never was.
    ok(cni("DEL", {**conf04, "prevResult": r1}, cid="cid1", netns=ns1))
    assert vnetd_state(d) == "" and device(lab, c1) is None
    ok(cni("DEL", {**conf04, "prevResult": r1}, cid="cid1", netns=ns1))
    ok(cni("DEL", conf, cid="never", ifname="eth7"))
    assert records(lab) == [] and leases(lab, net) == set()


def test_a_namespace_given_by_proc_path_is_bind_mounted_and_released(lab):
    host = lab.ns("h1")
    d = lab.start_vnetd(host)
    conf = plugin_conf(lab, "proc", d.sock, "10.77.3.0/24")
    holder = subprocess.Popen(["unshare", "-n", "sleep", "infinity"])
    lab.other_procs.append(holder)
    mine = os.readlink("/proc/self/ns/net")
    assert wait_until(lambda: os.readlink(f"/proc/{holder.pid}/ns/net") != mine)
    mount = None
    try:
        r = ok(cni("ADD", conf, cid="proc1", netns=f"/proc/{holder.pid}/ns/net"))
        assert r["interfaces"][0]["sandbox"] == f"/proc/{holder.pid}/ns/net"
        rec = json.loads(records(lab)[0].read_text())
        assert rec["netnsBound"] and rec["netnsName"].startswith("vnet-cni-")
        mount = Path(netns_path(rec["netnsName"]))
        assert mount.exists()
        dev = run(["nsenter", "-t", holder.pid, "-n", "ip", "-j", "addr", "show", "dev", "eth0"]).stdout
        assert r["ips"][0]["address"].split("/")[0] in dev
        assert f"netns={rec['netnsName']}" in d.ctl("INTERFACE", "LIST").stdout
        ok(cni("DEL", conf, cid="proc1"))
        assert not mount.exists()
        assert vnetd_state(d) == "" and records(lab) == []
    finally:
        if mount is not None and mount.exists():
            subprocess.run(["umount", "-l", str(mount)])
            mount.unlink(missing_ok=True)


def test_del_with_vnetd_down_releases_everything(lab):
    host = lab.ns("h1")
    d = lab.start_vnetd(host)
    c1 = lab.guest_ns("c1")
    conf = plugin_conf(lab, "down", d.sock, "10.77.4.0/24")
    ok(cni("ADD", conf, cid="cid1", netns=netns_path(c1)))
    assert d.stop() == 0
    assert device(lab, c1) is not None, "the veth outlives vnetd"
    ok(cni("DEL", conf, cid="cid1", netns=netns_path(c1)))
    assert device(lab, c1) is None, "the device was deleted directly"
    assert lab.x(host, "ip", "-o", "link", "show", "type", "veth").stdout.count("vh") == 0, "the host end went with it"
    assert records(lab) == [] and leases(lab, conf["name"]) == set()


def test_containers_survive_a_vnetd_restart_with_restore(lab):
    host = lab.ns("h1")
    d = lab.start_vnetd(host)
    # Dual stack: IPv6 neighbour discovery needs the routes to the addresses'
    # solicited-node groups the plugin adds with routes: local.
    ipam = {"type": "host-local", "dataDir": str(lab.tmp / "ipam"),
            "ranges": [[{"subnet": "10.77.5.0/24"}], [{"subnet": "fd77:5::/64"}]]}
    conf = plugin_conf(lab, "keep", d.sock, "", ipam=ipam)
    cs = [lab.ns("c1"), lab.ns("c2")]
    res = [ok(cni("ADD", conf, cid=f"cid{i}", netns=netns_path(c))) for i, c in enumerate(cs)]
    ips = [[ip["address"] for ip in r["ips"]] for r in res]
    assert all(len(a) == 2 and ":" in a[1] for a in ips), ips
    before = [device(lab, c) for c in cs]

    def reachable():
        return all(ping(lab, cs[a], ip.split("/")[0]) for a, b in ((0, 1), (1, 0)) for ip in ips[b])

    assert reachable()
    assert d.stop() == 0  # SIGTERM
    d2 = lab.start_vnetd(host)
    assert d2.ctl("INTERFACE", "LIST").stdout == ""
    restore = [CNI, "restore", "--state-dir", lab.tmp / "state", "--socket", d2.sock]
    out = run(restore).stdout
    assert out.count("restored ") == 2 and "2 restored, 0 already in vnetd" in out, out
    for c, dev, addrs in zip(cs, before, ips):
        now = device(lab, c)
        assert (now["ifindex"], now["address"]) == (dev["ifindex"], dev["address"]), "the same device"
        have = [f"{a['local']}/{a['prefixlen']}" for a in now["addr_info"]]
        assert all(a in have for a in addrs), (addrs, have)
    assert d2.ctl("ROUTE", "LIST").stdout.count("owner cni") == 6  # unicast, broadcast, IPv6 group each
    assert reachable()
    # Again: nothing to do.
    assert "0 restored, 2 already in vnetd" in run(restore).stdout
    for i, c in enumerate(cs):
        ok(cni("DEL", conf, cid=f"cid{i}", netns=netns_path(c)))
    assert vnetd_state(d2) == "" and leases(lab, conf["name"]) == set()


def start_vnetd_in(lab: Lab, mnt: MountNs, host: str, config: str) -> netlab.Vnetd:
    """vnetd in `host`, started from the test's mount namespace (where
    podman's netns mounts are), and handed to the lab like any other."""
    name = host.removeprefix(lab.prefix)
    sock, log, conf = lab.tmp / f"{name}.sock", lab.tmp / f"{name}-vnetd.log", lab.tmp / f"{name}.conf"
    conf.write_text(config)
    with open(log, "a") as lf:
        # nsenter and `ip netns exec` exec: the PID is vnetd's.
        proc = subprocess.Popen([*mnt.prefix(), "ip", "netns", "exec", host, str(VNETD), "--control-unix", str(sock),
                                 "--link-key-dir", str(lab.key_dir), "--config", str(conf)],
                                stdout=lf, stderr=subprocess.STDOUT)
    d = netlab.Vnetd(lab, host, sock, proc, log)
    lab.daemons.append(d)
    lab.wait_ready(d)
    return d


def busybox_rootfs(path: Path) -> Path:
    (path / "bin").mkdir(parents=True)
    shutil.copy("/bin/busybox", path / "bin" / "busybox")
    for tool in ("sh", "ping", "ip", "wget", "httpd", "sha256sum", "sleep", "cat"):
        (path / "bin" / tool).symlink_to("busybox")
    return path


@needs_podman
def test_podman_containers_on_two_hosts_ping_and_move_data(lab):
    hosts = {1: lab.add_host(1), 2: lab.add_host(2)}
    mnt = MountNs(lab, podman=True)
    mac = {1: "02:cc:00:00:02:01", 2: "02:cc:00:00:02:02"}
    # Each vnetd: a link to the other host, the other container's MAC and
    # broadcasts routed over it; the plugin adds routes to its own container.
    d = {}
    for me, other in ((1, 2), (2, 1)):
        peer = underlay_ip(other)
        d[me] = start_vnetd_in(lab, mnt, hosts[me], f"LINK ADD {peer}\nROUTE ADD any {mac[other]} edge {peer} any\n"
                                                    f"ROUTE ADD any ff:ff:ff:ff:ff:ff edge {peer} interface\n")
    netdir, plugdir = lab.tmp / "cni-net", lab.tmp / "cni-bin"
    netdir.mkdir()
    plugdir.mkdir()
    (plugdir / "vnet-cni").symlink_to(CNI)
    nets = {}
    for i in (1, 2):
        nets[i] = f"{lab.prefix}h{i}"
        ipam = {"type": "host-local", "dataDir": str(lab.tmp / "ipam"),
                "ranges": [[{"subnet": "10.77.9.0/24", "rangeStart": f"10.77.9.{10 * i}", "rangeEnd": f"10.77.9.{10 * i + 9}"}]]}
        plugin = {"type": "vnet-cni", "socket": str(d[i].sock), "network": "blue",
                  "stateDir": str(lab.tmp / "state"), "ipam": ipam}
        (netdir / f"{nets[i]}.conflist").write_text(json.dumps({"cniVersion": "1.0.0", "name": nets[i], "plugins": [plugin]}))
    conf = lab.tmp / "containers.conf"
    conf.write_text(f"""
[containers]
# This machine's hard limits are below podman's defaults; cgroups: see MountNs.
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]
cgroups = "disabled"
[engine]
cgroup_manager = "cgroupfs"
events_logger = "none"
[network]
network_backend = "cni"
cni_plugin_dirs = ["{plugdir}", "/usr/lib/cni"]
network_config_dir = "{netdir}"
""")
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}
    store = lab.tmp / "podman"

    def podman(*args, check=True, timeout=60):
        return mnt.run(["podman", "--root", store / "root", "--runroot", store / "run", "--tmpdir", store / "tmp", *args],
                       env=env, check=check, timeout=timeout)

    server_root = busybox_rootfs(lab.tmp / "rootfs2")
    client_root = busybox_rootfs(lab.tmp / "rootfs1")
    (server_root / "www").mkdir()
    blob = os.urandom(4 << 20)
    (server_root / "www" / "blob").write_bytes(blob)
    server, server_ip = lab.prefix + "srv", "10.77.9.20"
    try:
        podman("run", "-d", "--name", server, "--network", nets[2], "--mac-address", mac[2], "--rootfs", server_root,
               "/bin/httpd", "-f", "-p", "8080", "-h", "/www")
        # The veth's host end is in host 2's namespace, where its vnetd runs.
        listing = d[2].ctl("INTERFACE", "LIST").stdout
        assert f"mac={mac[2]}" in listing and "attach=veth" in listing and "network=blue" in listing, listing
        host_end = listing.split(" host=")[1].split()[0]
        lab.x(hosts[2], "ip", "link", "show", host_end)
        script = (f"ping -c 3 -W 2 {server_ip} >/dev/null || exit 7; "
                  f"for i in 1 2 3 4 5; do wget -q -O - http://{server_ip}:8080/blob | sha256sum && exit 0; sleep 0.5; done; exit 8")
        out = podman("run", "--rm", "--cap-add", "NET_RAW", "--network", nets[1], "--mac-address", mac[1],
                     "--rootfs", client_root, "/bin/sh", "-c", script).stdout
        assert hashlib.sha256(blob).hexdigest() in out, out
    finally:
        podman("rm", "-f", "-t", "0", "--all", check=False)
    # podman's DEL took everything back.
    for i in (1, 2):
        assert "owner cni" not in d[i].ctl("ROUTE", "LIST").stdout and d[i].ctl("INTERFACE", "LIST").stdout == ""
        assert leases(lab, nets[i]) == set()
    assert records(lab) == []
