"""A lab of network namespaces for VNET's end-to-end tests, demo and benchmark.

Hosts are namespaces joined by veth pairs to a Linux bridge in a "switch"
namespace (the physical LAN, 198.18.0.0/24: the benchmarking range). Each host
runs its own vnetd; guests are namespaces holding the TAP their host's vnetd
made for them (overlay addresses in 198.19.0.0/24).

Everything a Lab makes carries its per-run prefix and is removed by
`Lab.close()`, which runs even when a test fails. Processes are ended by the
PIDs the lab started, never by name.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(os.environ.get("VNET_BIN", REPO / "target" / "release"))
VNETD = BIN / "vnetd"
VNETCTL = BIN / "vnetctl"

_counter = itertools.count()


def run(cmd, check=True, timeout=60, **kw) -> subprocess.CompletedProcess:
    """Runs a command, capturing text output; raises with the output on failure."""
    cmd = [str(c) for c in cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} -> {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


def underlay_ip(i: int) -> str:
    return f"198.18.0.{i}"


def overlay_ip(n: int) -> str:
    return f"198.19.0.{n}"


def guest_mac(n: int) -> str:
    return f"02:00:00:00:{n >> 8:02x}:{n & 0xff:02x}"


@dataclass
class Guest:
    ns: str
    tap: str
    mac: str
    ip: str
    host: str


@dataclass
class Vnetd:
    lab: "Lab"
    host: str
    sock: Path
    proc: subprocess.Popen
    log: Path

    def ctl(self, *words, check=True, timeout=30) -> subprocess.CompletedProcess:
        return run([VNETCTL, "--socket", self.sock, *words], check=check, timeout=timeout)

    def ctl_file(self, text: str, check=True) -> subprocess.CompletedProcess:
        path = self.lab.tmp / f"req-{next(_counter)}.conf"
        path.write_text(text)
        return self.ctl("--file", path, check=check)

    def stats(self) -> dict[str, dict[str, int | str]]:
        """STATS as {"global": {...}, "interface <name>": {...}, "link <name>": {...}, "route <idx>": {...}}."""
        out = {}
        for line in self.ctl("STATS").stdout.splitlines():
            words = line.split()
            kind = words[0]
            kv = dict(w.split("=", 1) for w in words[1:] if "=" in w and not w.startswith("rule="))
            vals = {k: int(v) if v.isdigit() else v for k, v in kv.items()}
            if kind in ("global", "offload", "dispatch"):
                out[kind] = vals
            elif kind == "route":
                out[f"route {words[1]}"] = vals
            else:
                out[f"{kind} {vals['name']}"] = vals
        return out

    def stop(self, sig=signal.SIGTERM, timeout=10) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class Lab:
    def __init__(self, tag: str = "t"):
        self.prefix = f"vn{os.getpid() % 100000}{tag}{next(_counter)}-"
        self.tmp = Path(tempfile.mkdtemp(prefix=f"vnet-{self.prefix}"))
        self.namespaces: list[str] = []
        self.daemons: list[Vnetd] = []
        self.other_procs: list[subprocess.Popen] = []
        self.switch: str | None = None
        self.hosts: dict[str, int] = {}
        # TCP links' keys (vnetd --link-key-dir): "lab" for the tests' own
        # configs, "h1-h2" for the shipped examples.
        self.key_dir = self.tmp / "link-keys"
        self.key_dir.mkdir(mode=0o700)
        for name in ("lab", "h1-h2"):
            self.link_key(name)

    def link_key(self, name: str, secret: bytes | None = None) -> bytes:
        """Writes key file `name` (mode 600) into the labs's key dir."""
        secret = secret if secret is not None else os.urandom(24).hex().encode()
        path = self.key_dir / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secret + b"\n")
        return secret

    # ---- namespaces and the underlay ----

    def ns(self, name: str) -> str:
        full = self.prefix + name
        run(["ip", "netns", "add", full])
        self.namespaces.append(full)
        self.x(full, "ip", "link", "set", "lo", "up")
        return full

    def x(self, ns: str, *cmd, check=True, timeout=60) -> subprocess.CompletedProcess:
        return run(["ip", "netns", "exec", ns, *cmd], check=check, timeout=timeout)

    def popen(self, ns: str, *cmd, **kw) -> subprocess.Popen:
        p = subprocess.Popen(["ip", "netns", "exec", ns, *[str(c) for c in cmd]], **kw)
        self.other_procs.append(p)
        return p

    def add_host(self, i: int, mtu: int = 1500) -> str:
        """Host namespace h<i> with eth0 = underlay_ip(i) on the shared LAN."""
        if self.switch is None:
            self.switch = self.ns("sw")
            self.x(self.switch, "ip", "link", "add", "br0", "type", "bridge")
            self.x(self.switch, "ip", "link", "set", "br0", "up")
        host = self.ns(f"h{i}")
        run(["ip", "link", "add", "eth0", "netns", host, "mtu", mtu, "type", "veth",
             "peer", "name", f"p{i}", "netns", self.switch, "mtu", mtu])
        self.x(self.switch, "ip", "link", "set", f"p{i}", "master", "br0", "up")
        self.x(host, "ip", "addr", "add", f"{underlay_ip(i)}/24", "dev", "eth0")
        self.x(host, "ip", "-6", "addr", "add", f"{underlay_ip6(i)}/64", "dev", "eth0", "nodad")
        self.x(host, "ip", "link", "set", "eth0", "up")
        self.hosts[host] = i
        return host

    # ---- vnetd ----

    def start_vnetd(self, host: str, config: str | Path | None = None, *args, wait=True) -> Vnetd:
        name = host.removeprefix(self.prefix)
        sock = self.tmp / f"{name}.sock"
        log = self.tmp / f"{name}-vnetd-{next(_counter)}.log"
        cmd = [VNETD, "--control-unix", sock, "--link-key-dir", self.key_dir, *args]
        if config is not None:
            if not isinstance(config, Path):
                path = self.tmp / f"{name}-{next(_counter)}.conf"
                path.write_text(config)
                config = path
            cmd += ["--config", config]
        with open(log, "w") as lf:
            proc = subprocess.Popen(["ip", "netns", "exec", host, *[str(c) for c in cmd]],
                                    stdout=lf, stderr=subprocess.STDOUT)
        d = Vnetd(self, host, sock, proc, log)
        self.daemons.append(d)
        if wait:
            self.wait_ready(d)
        return d

    def wait_ready(self, d: Vnetd, timeout: float = 10):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if d.proc.poll() is not None:
                raise RuntimeError(f"vnetd on {d.host} exited {d.proc.returncode}:\n{d.log_text()}")
            if d.sock.exists() and d.ctl("SHOW", check=False).returncode == 0:
                return
            time.sleep(0.05)
        raise RuntimeError(f"vnetd on {d.host} not ready in {timeout}s:\n{d.log_text()}")

    # ---- guests ----

    def attach_guest(self, host: str, tap: str, n: int, mtu: int | None = None, ns: str | None = None) -> Guest:
        """Moves the TAP vnetd made on `host` into a guest namespace (a new
        one, or `ns` again) and gives it overlay_ip(n). The TAP's MAC is the
        one vnetd registered."""
        g = ns
        if g is None:
            g = self.ns(f"g{n}")
            # No IPv6 chatter (router solicitations etc.) in the guests.
            self.x(g, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
            self.x(g, "sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1")
        self.x(host, "ip", "link", "set", tap, "netns", g)
        if mtu:
            self.x(g, "ip", "link", "set", tap, "mtu", mtu)
        self.x(g, "ip", "addr", "add", f"{overlay_ip(n)}/24", "dev", tap)
        self.x(g, "ip", "link", "set", tap, "up")
        mac = self.x(g, "cat", f"/sys/class/net/{tap}/address").stdout.strip()
        return Guest(ns=g, tap=tap, mac=mac, ip=overlay_ip(n), host=host)

    def ping(self, src: Guest, dst: Guest, count=1, wait=2, size=None, check=False):
        cmd = ["ping", "-n", "-q", "-c", count, "-W", wait]
        if size is not None:
            cmd += ["-s", size]
        if count > 1:
            cmd += ["-i", "0.05"]
        return self.x(src.ns, *cmd, dst.ip, check=check, timeout=count * wait + 10)

    def reaches(self, src: Guest, dst: Guest, tries=3, **kw) -> bool:
        return any(self.ping(src, dst, **kw).returncode == 0 for _ in range(tries))

    # ---- teardown ----

    def close(self):
        for d in self.daemons:
            try:
                d.stop(timeout=5)
            except Exception:
                pass
        for p in self.other_procs:
            if p.poll() is None:
                p.kill()
                try:
                    p.wait(timeout=5)
                except Exception:
                    pass
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def underlay_ip6(i: int) -> str:
    return f"fd00:198:18::{i}"


def mesh_config(me: int, guests_by_host: dict[int, list[tuple[str, str]]], mtu: int | None = None,
                link: str = "9000 udp", addr=underlay_ip) -> str:
    """The config of host `me` in a full mesh: an interface per local guest,
    a link per other host (`LINK ADD <addr(h)> <link>`), unicast routes by MAC
    and broadcast fan-out (to every local guest; to every link only for frames
    from local guests, so a broadcast crosses each link once)."""
    lines = [f"# host {me}: full-mesh VNET config"]
    mtu_opt = f" mtu {mtu}" if mtu else ""
    for tap, mac in guests_by_host.get(me, []):
        lines.append(f"INTERFACE ADD {tap} {mac}{mtu_opt}")
    others = [h for h in sorted(guests_by_host) if h != me]
    for h in others:
        lines.append(f"LINK ADD {addr(h)} {link}")
    for tap, mac in guests_by_host.get(me, []):
        lines.append(f"ROUTE ADD any {mac} interface {mac} any")
        lines.append(f"ROUTE ADD any ff:ff:ff:ff:ff:ff interface {mac} any")
    for h in others:
        for _, mac in guests_by_host[h]:
            lines.append(f"ROUTE ADD any {mac} edge {addr(h)} any")
        lines.append(f"ROUTE ADD any ff:ff:ff:ff:ff:ff edge {addr(h)} interface")
    return "\n".join(lines) + "\n"
