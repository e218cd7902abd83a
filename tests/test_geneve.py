"""Geneve links (RFC 8926) end to end: vnetd on one host, a real Open
vSwitch (Debian's, the userspace datapath: `datapath_type=netdev`, no kernel
module) on the other with a Geneve port to vnetd, guests on both sides
pinging and moving 100 MB each way with matching SHA-256; and Geneve options
carried and ignored, as RFC 8926 says a receiver may, but a datagram with
critical options dropped and counted."""

import os
import socket
import struct
import subprocess
import time

from netlab import REPO, guest_mac, overlay_ip, run, underlay_ip, wait_until
from test_datapath import transfer

EXAMPLES = REPO / "examples" / "links"
SPOOF = REPO / "tests" / "tools" / "spoof.py"
VNI = 5001
SCHEMA = "/usr/share/openvswitch/vswitch.ovsschema"


class Ovs:
    """ovsdb-server and ovs-vswitchd of one host namespace, in the
    foreground (their PIDs are the ones started), with every file in a
    directory of the lab's."""

    def __init__(self, lab, host: str, name: str):
        self.lab, self.host = lab, host
        self.dir = lab.tmp / f"ovs-{name}"
        self.dir.mkdir()
        self.env = {**os.environ, **{k: str(self.dir) for k in ("OVS_RUNDIR", "OVS_DBDIR", "OVS_LOGDIR", "OVS_SYSCONFDIR")}}
        self.db = self.dir / "db.sock"
        run(["ovsdb-tool", "create", self.dir / "conf.db", SCHEMA])
        self.dbserver = lab.popen(host, "ovsdb-server", self.dir / "conf.db", f"--remote=punix:{self.db}",
                                  f"--unixctl={self.dir}/ovsdb.ctl", f"--log-file={self.dir}/ovsdb.log",
                                  env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert wait_until(self.db.exists, timeout=10), (self.dir / "ovsdb.log").read_text(errors="replace")
        self.vsctl("--no-wait", "init")
        self.vswitchd = lab.popen(host, "ovs-vswitchd", f"unix:{self.db}", f"--unixctl={self.dir}/vswitchd.ctl",
                                  f"--log-file={self.dir}/vswitchd.log", env=self.env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert wait_until(lambda: (self.dir / "vswitchd.ctl").exists(), timeout=10), self.log()

    def vsctl(self, *args):
        return run(["ip", "netns", "exec", self.host, "ovs-vsctl", f"--db=unix:{self.db}", "--timeout=20", *args],
                   env=self.env)

    def appctl(self, *args, check=True):
        return run(["ip", "netns", "exec", self.host, "ovs-appctl", "-t", self.dir / "vswitchd.ctl", *args],
                   env=self.env, check=check)

    def log(self) -> str:
        f = self.dir / "vswitchd.log"
        return f.read_text(errors="replace") if f.exists() else ""

    def stop(self):
        for p in (self.vswitchd, self.dbserver):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=5)


def ovs_host(lab, h: int, remote: str, guest_n: int, mtu: int):
    """A host with no vnetd: Open vSwitch's userspace datapath. Its underlay
    port in a physical bridge that holds the host's address (what OVS's
    userspace tunnels route and resolve by), and an integration bridge with
    a Geneve port to `remote` and a guest's veth."""
    host = lab.add_host(h)
    ovs = Ovs(lab, host, f"h{h}")
    ovs.vsctl("add-br", "br-phy", "--", "set", "bridge", "br-phy", "datapath_type=netdev")
    ovs.vsctl("add-port", "br-phy", "eth0")
    lab.x(host, "ip", "addr", "flush", "dev", "eth0")
    lab.x(host, "ip", "addr", "add", f"{underlay_ip(h)}/24", "dev", "br-phy")
    lab.x(host, "ip", "link", "set", "br-phy", "up")
    ovs.vsctl("add-br", "br-int", "--", "set", "bridge", "br-int", "datapath_type=netdev")
    ovs.vsctl("add-port", "br-int", "gnv0", "--", "set", "interface", "gnv0", "type=geneve",
              f"options:remote_ip={remote}", f"options:key={VNI}")
    x = lab.ns(f"x{guest_n}")
    lab.x(x, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
    lab.x(host, "ip", "link", "add", "vg", "type", "veth", "peer", "name", "eth0", "netns", x, "address", guest_mac(guest_n))
    lab.x(host, "ip", "link", "set", "vg", "up")
    ovs.vsctl("add-port", "br-int", "vg")
    lab.x(x, "ip", "link", "set", "eth0", "mtu", mtu, "up")
    # OVS's userspace datapath reads the veth as a packet socket: a frame
    # left with a partial checksum, or a TSO super-frame, reaches it as it
    # is and leaves in the tunnel that way (no NIC ever finishes it).
    # Have the guest finish its own, as it must where a real NIC is in
    # the path.
    lab.x(x, "ethtool", "-K", "eth0", "tx", "off", "sg", "off", "tso", "off", "gso", "off")
    lab.x(x, "ip", "addr", "add", f"{overlay_ip(guest_n)}/24", "dev", "eth0")
    return host, ovs, type("OvsGuest", (), {"ns": x, "ip": overlay_ip(guest_n), "mac": guest_mac(guest_n)})()


def geneve(vni: int, frame: bytes, options: bytes = b"", critical: bool = False) -> bytes:
    """A Geneve header (with `options`, whole 4-byte words) and the frame."""
    assert len(options) % 4 == 0
    return struct.pack("!BBHI", len(options) // 4, 0x40 if critical else 0, 0x6558, vni << 8) + options + frame


def udp_frame(dst_mac: str, src_mac: str, src_ip: str, dst_ip: str, dport: int, payload: bytes) -> bytes:
    udp = struct.pack("!HHHH", 40000, dport, 8 + len(payload), 0) + payload
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0x4000, 64, 17, 0,
                     socket.inet_aton(src_ip), socket.inet_aton(dst_ip))
    s = sum(struct.unpack("!10H", ip))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    ip = ip[:10] + struct.pack("!H", ~s & 0xFFFF) + ip[12:]
    mac = lambda m: bytes.fromhex(m.replace(":", ""))
    return mac(dst_mac) + mac(src_mac) + b"\x08\x00" + ip + udp


def test_a_geneve_link_interoperates_with_open_vswitch_userspace_geneve(lab):
    h1 = lab.add_host(1)
    # A veth never completes the UDP checksum the kernel leaves partial, and
    # OVS's userspace datapath checks a tunnel's: as a real NIC would, have
    # host 1's kernel finish its own (MACHINE-NOTES: the veth artifact).
    lab.x(h1, "ethtool", "-K", "eth0", "tx", "off")
    _, ovs, x2 = ovs_host(lab, 2, underlay_ip(1), 2, 1450)
    try:
        d1 = lab.start_vnetd(h1, EXAMPLES / "geneve.conf")
        g1 = lab.attach_guest(h1, "g1", 1)
        assert lab.reaches(g1, x2, tries=10), d1.ctl("STATS").stdout + ovs.log()[-3000:]
        assert lab.reaches(x2, g1)
        # The largest frame of the guests' MTU crosses whole, both ways.
        r = lab.x(g1.ns, "ping", "-n", "-q", "-c", "3", "-i", "0.2", "-M", "do", "-s", str(1450 - 28), x2.ip, check=False)
        assert " 0% packet loss" in r.stdout, r.stdout
        transfer(lab, g1, x2, 100_000_000)
        transfer(lab, x2, g1, 100_000_000, port=5002)
        s = d1.stats()["link gnv"]
        assert s["in_frames"] > 50_000 and s["out_frames"] > 50_000, s
        assert d1.stats()["global"]["drop_malformed"] == 0
        line = next(l for l in d1.ctl("LINK", "LIST").stdout.splitlines() if "name=gnv " in l)
        assert "proto=geneve" in line and f"vni={VNI}" in line and f"remote={underlay_ip(2)}:6081" in line, line
        # OVS's side (its userspace tunnel ports keep no counters): its bridge
        # learned host 1's guest behind the Geneve port, and its datapath
        # pushes Geneve with the link's VNI toward host 1.
        port = ovs.vsctl("get", "interface", "gnv0", "ofport").stdout.strip()
        fdb = [l.split() for l in ovs.appctl("fdb/show", "br-int").stdout.splitlines()[1:]]
        assert [port, g1.mac] in [[f[0], f[2]] for f in fdb], fdb
        flows = ovs.appctl("dpctl/dump-flows").stdout
        assert f"geneve(vni=0x{VNI:x})" in flows and f"dst={underlay_ip(1)}" in flows, flows
    finally:
        ovs.stop()


def test_geneve_options_are_skipped_and_critical_ones_dropped_and_counted(lab):
    """RFC 8926: a receiver skips options it does not process, but drops a
    datagram whose C bit says a critical option is there."""
    h1 = lab.add_host(1)
    h3 = lab.add_host(3)
    d1 = lab.start_vnetd(h1, EXAMPLES / "geneve.conf")
    g1 = lab.attach_guest(h1, "g1", 1)
    recv = lab.popen(g1.ns, "python3", "-c",
                     "import socket,sys;s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM);s.bind(('0.0.0.0',7000));"
                     "print('ready',flush=True);s.settimeout(10)\n"
                     "while True:\n  print(s.recv(2048).decode(),flush=True)",
                     stdout=subprocess.PIPE, text=True)
    assert recv.stdout.readline().strip() == "ready"
    before = d1.stats()

    def from_h2(payload: bytes, **kw):
        frame = udp_frame(g1.mac, guest_mac(2), overlay_ip(2), g1.ip, 7000, payload)
        # As host 2 (its address is the link's peer), from a third host.
        lab.x(h3, "python3", SPOOF, underlay_ip(2), "6081", underlay_ip(1), "6081", geneve(VNI, frame, **kw).hex())

    # An option of class 0x0102 (OVN's), type 1 (not critical), 4 bytes of data.
    option = struct.pack("!HBB", 0x0102, 0x01, 1) + b"\xde\xad\xbe\xef"
    from_h2(b"with-options", options=option)
    assert recv.stdout.readline().strip() == "with-options"
    # The same with a critical option (the C bit, and type 0x81): dropped.
    critical = struct.pack("!HBB", 0x0102, 0x81, 1) + b"\xde\xad\xbe\xef"
    from_h2(b"critical", options=critical, critical=True)
    assert wait_until(lambda: d1.stats()["global"]["drop_malformed"] == before["global"]["drop_malformed"] + 1, 5), d1.stats()["global"]
    # Another VNI from the same peer: no link takes it.
    lab.x(h3, "python3", SPOOF, underlay_ip(2), "6081", underlay_ip(1), "6081",
          geneve(VNI + 1, udp_frame(g1.mac, guest_mac(2), overlay_ip(2), g1.ip, 7000, b"other-vni")).hex())
    assert wait_until(lambda: d1.stats()["global"]["drop_unknown_sender"] == before["global"]["drop_unknown_sender"] + 1, 5)
    from_h2(b"after")
    assert recv.stdout.readline().strip() == "after", "the critical or other-VNI datagram reached the guest"
    after = d1.stats()
    assert after["link gnv"]["in_frames"] == before["link gnv"]["in_frames"] + 2
    assert after["interface g1"]["out_frames"] == before["interface g1"]["out_frames"] + 2
    recv.kill()
