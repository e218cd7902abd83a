"""A lab of network namespaces for VNET's end-to-end tests, demo and benchmark.

Hosts are namespaces joined by veth pairs to a Linux bridge in a "switch"
namespace (the physical LAN, 198.18.0.0/16: the benchmarking range; host i
is 198.18.0.i up to 255, and 198.18.<i/256>.<i%256> past it). Each host
runs its own vnetd; guests are namespaces holding the TAP their host's vnetd
made for them (overlay addresses in 198.19.0.0/24).

Everything a Lab makes carries its per-run prefix and is removed by
`Lab.close()`, which runs even when a test fails. Processes are ended by the
PIDs the lab started, never by name.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import textwrap
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
    return f"198.18.{i >> 8}.{i & 255}"


def overlay_ip(n: int) -> str:
    return f"198.19.0.{n}"


def overlay_ip6(n: int) -> str:
    return f"fd00:198:19::{n:x}"


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
    # The signal the test itself stopped this vnetd with (None: still the
    # lab's to stop, and it must then be alive and exit 0 on SIGTERM).
    stopped_with: int | None = None
    # The config it was started with (a file), to start it again with.
    config: Path | None = None

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
            if kind in ("global", "offload", "dispatch", "fastpath", "paths", "vtoe", "wireguard"):
                out[kind] = vals
            elif kind == "route":
                vals["rule"] = line.split(" rule=", 1)[1].strip()
                out[f"route {words[1]}"] = vals
            elif kind == "vtoe_conn":
                out[f"vtoe_conn {vals['cookie']}"] = vals
            else:
                out[f"{kind} {vals['name']}"] = vals
        return out

    def stop(self, sig=signal.SIGTERM, timeout=10) -> int:
        if self.proc.poll() is None:
            if self.stopped_with is None:
                self.stopped_with = sig
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


_flags: dict[tuple[str, str], bool] = {}


def takes_flag(binary: Path, flag: str) -> bool:
    """Whether `binary` (a vnetd build) knows `flag`: its --help says so."""
    key = (str(binary), flag)
    if key not in _flags:
        out = subprocess.run([binary, "--help"], capture_output=True, text=True).stdout
        _flags[key] = flag + " " in out or flag + "\n" in out
    return _flags[key]


class Lab:
    def __init__(self, tag: str = "t"):
        self.prefix = f"vn{os.getpid() % 100000}{tag}{next(_counter)}-"
        self.tmp = Path(tempfile.mkdtemp(prefix=f"vnet-{self.prefix}"))
        self.namespaces: list[str] = []
        self.daemons: list[Vnetd] = []
        self.other_procs: list[subprocess.Popen] = []
        self.switch: str | None = None
        self.hosts: dict[str, int] = {}
        # Link keys (vnetd --link-key-dir): "lab" for the tests' own
        # configs, "h1-h2" and "demo" for the shipped examples.
        self.key_dir = self.tmp / "link-keys"
        self.key_dir.mkdir(mode=0o700)
        # The lab's own bpf filesystem: each host's vnetd pins its kernel
        # datapath in a folder of it (--pin-dir), so that it outlives a
        # vnetd restarted by a test; unmounting it at close frees them all.
        self.bpffs = self.tmp / "bpf"
        self.bpffs.mkdir()
        run(["mount", "-t", "bpf", "bpf", str(self.bpffs)])
        for name in ("lab", "h1-h2", "demo"):
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
        self.x(host, "ip", "addr", "add", f"{underlay_ip(i)}/16", "dev", "eth0")
        self.x(host, "ip", "-6", "addr", "add", f"{underlay_ip6(i)}/64", "dev", "eth0", "nodad")
        self.x(host, "ip", "link", "set", "eth0", "up")
        self.hosts[host] = i
        return host

    # ---- vnetd ----

    def start_vnetd(self, host: str, config: str | Path | None = None, *args, wait=True, binary: Path = None,
                    env: dict | None = None, listen_fds: list[tuple[str, int]] | None = None) -> Vnetd:
        """vnetd on `host` (`binary`: another build's, e.g. an earlier
        commit's), with `config` (text, or a file) and more arguments;
        `env`: more environment; `listen_fds`: descriptors passed as systemd
        passes its descriptor store (at 3.., LISTEN_FDS, LISTEN_FDNAMES,
        LISTEN_PID: vnetd's, as `ip netns exec` execs it)."""
        name = host.removeprefix(self.prefix)
        sock = self.tmp / f"{name}.sock"
        log = self.tmp / f"{name}-vnetd-{next(_counter)}.log"
        cmd = [binary or VNETD, "--control-unix", sock, "--link-key-dir", self.key_dir, *args]
        # vhost-user sockets live in the lab's directory, unless the test says.
        if "--vhost-user-dir" not in map(str, args):
            cmd += ["--vhost-user-dir", self.tmp]
        if "--pin-dir" not in map(str, args):
            cmd += ["--pin-dir", self.pin_dir(host)]
        # Each host's run-time state in the lab (a build from before the
        # state file has no --state).
        if "--state" not in map(str, args) and takes_flag(binary or VNETD, "--state"):
            cmd += ["--state", self.state_file(host)]
        if config is not None:
            if not isinstance(config, Path):
                path = self.tmp / f"{name}-{next(_counter)}.conf"
                path.write_text(config)
                config = path
            cmd += ["--config", config]
        argv = ["ip", "netns", "exec", host, *[str(c) for c in cmd]]
        environ = dict(os.environ, **(env or {}))
        moves = None
        if listen_fds:
            environ.update(LISTEN_FDS=str(len(listen_fds)), LISTEN_FDNAMES=":".join(n for n, _ in listen_fds))
            argv = ["sh", "-c", 'LISTEN_PID=$$; export LISTEN_PID; exec "$@"', "sh", *argv]
            srcs = [fd for _, fd in listen_fds]

            def moves():  # in the child: the descriptors at 3.., nothing else
                high = []
                for i, fd in enumerate(srcs):
                    os.dup2(fd, 400 + i)
                    high.append(400 + i)
                for i, fd in enumerate(high):
                    os.dup2(fd, 3 + i)
                os.closerange(3 + len(srcs), 65536)
        with open(log, "a") as lf:  # O_APPEND: lines written by others are not overwritten
            proc = subprocess.Popen(argv, stdout=lf, stderr=subprocess.STDOUT, env=environ,
                                    close_fds=moves is None, preexec_fn=moves)
        d = Vnetd(self, host, sock, proc, log)
        d.config = config
        self.daemons.append(d)
        if wait:
            self.wait_ready(d)
        return d

    def state_file(self, host: str) -> Path:
        """Where `host`'s vnetd records its run-time state (--state)."""
        return self.tmp / f"{host.removeprefix(self.prefix)}.state"

    def pin_dir(self, host: str) -> Path:
        """Where `host`'s vnetd pins its kernel datapath."""
        return self.bpffs / host.removeprefix(self.prefix)

    def start_vnetd_traced(self, host: str, config: str, *strace_args) -> Vnetd:
        """vnetd under strace with `strace_args` (e.g. a fault to inject),
        started and ready. Stop it with `stop_traced`."""
        name = host.removeprefix(self.prefix)
        conf = self.tmp / f"{name}-traced-{next(_counter)}.conf"
        conf.write_text(config)
        sock, log = self.tmp / f"{name}.sock", self.tmp / f"{name}-traced-{next(_counter)}.log"
        with open(log, "w") as lf:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", host, "strace", "-f", *[str(a) for a in strace_args],
                 str(VNETD), "--control-unix", str(sock), "--link-key-dir", str(self.key_dir), "--config", str(conf),
                 "--vhost-user-dir", str(self.tmp), "--pin-dir", str(self.pin_dir(host)), "--state", str(self.state_file(host))],
                stdout=lf, stderr=subprocess.STDOUT)
        self.other_procs.append(proc)
        d = Vnetd(self, host, sock, proc, log)
        self.wait_ready(d)
        return d

    @staticmethod
    def stop_traced(d: Vnetd) -> int:
        """Stops a traced vnetd itself (strace would only detach on
        SIGTERM); returns strace's exit status, which is vnetd's."""
        out = subprocess.run(["pgrep", "-P", str(d.proc.pid), "-x", "vnetd"], capture_output=True, text=True).stdout.split()
        if out:
            subprocess.run(["kill", "-TERM", out[0]])
        return d.proc.wait(timeout=10)

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

    def attach_guest(self, host: str, tap: str, n: int, mtu: int | None = None, ns: str | None = None,
                     ipv6: bool = False) -> Guest:
        """Moves the TAP vnetd made on `host` into a guest namespace (a new
        one, or `ns` again) and gives it overlay_ip(n) (and, with `ipv6`,
        overlay_ip6(n)). The TAP's MAC is the one vnetd registered."""
        g = ns
        if g is None:
            g = self.ns(f"g{n}")
            if not ipv6:
                # No IPv6 chatter (router solicitations etc.) in the guests.
                self.x(g, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
                self.x(g, "sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1")
        self.x(host, "ip", "link", "set", tap, "netns", g)
        if mtu:
            self.x(g, "ip", "link", "set", tap, "mtu", mtu)
        self.x(g, "ip", "addr", "add", f"{overlay_ip(n)}/24", "dev", tap)
        if ipv6:
            self.x(g, "ip", "-6", "addr", "add", f"{overlay_ip6(n)}/64", "dev", tap, "nodad")
        self.x(g, "ip", "link", "set", tap, "up")
        mac = self.x(g, "cat", f"/sys/class/net/{tap}/address").stdout.strip()
        return Guest(ns=g, tap=tap, mac=mac, ip=overlay_ip(n), host=host)

    def config_text(self, path: Path) -> str:
        """A shipped config with its `netns <name>` words pointed at this
        lab's namespace of that name (which carry the lab's prefix)."""
        return re.sub(r"(?i)\bnetns\s+(\S+)", lambda m: f"netns {self.prefix}{m.group(1)}", path.read_text())

    def veth_guest(self, host: str, name: str, n: int, ns: str) -> Guest:
        """The veth guest `name` vnetd made in `ns` (INTERFACE ADD ...
        veth), given overlay_ip(n) and brought up."""
        self.x(ns, "ip", "addr", "add", f"{overlay_ip(n)}/24", "dev", name)
        self.x(ns, "ip", "link", "set", name, "up")
        mac = self.x(ns, "cat", f"/sys/class/net/{name}/address").stdout.strip()
        return Guest(ns=ns, tap=name, mac=mac, ip=overlay_ip(n), host=host)

    def guest_ns(self, name: str) -> str:
        """A guest namespace without IPv6 chatter."""
        g = self.ns(name)
        self.x(g, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
        self.x(g, "sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1")
        return g

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

    def close(self) -> list[str]:
        """Stops everything the lab started and removes what it made; returns
        what went wrong, for the test to fail on: a vnetd that died during
        the test, panicked, or did not exit 0 on SIGTERM (its own or the
        test's), and anything with the lab's prefix left behind."""
        problems = []
        for d in self.daemons:
            try:
                if d.stopped_with is None:
                    if d.proc.poll() is not None:
                        problems.append(f"vnetd on {d.host} died during the test (exit status {d.proc.returncode})")
                    else:
                        rc = d.stop(timeout=5)
                        if rc != 0:
                            problems.append(f"vnetd on {d.host} exited {rc} on SIGTERM (-9: killed after 5 s)")
                elif d.stopped_with in (signal.SIGTERM, signal.SIGINT):
                    rc = d.stop(timeout=5)
                    if rc != 0:
                        problems.append(f"vnetd on {d.host} exited {rc} on signal {d.stopped_with}")
                else:
                    d.stop(timeout=5)
                if "panicked" in d.log_text():
                    problems.append(f"vnetd on {d.host} panicked (log {d.log.name})")
            except Exception as e:  # keep cleaning up
                problems.append(f"stopping vnetd on {d.host}: {e!r}")
        for p in self.other_procs:
            if p.poll() is None:
                p.kill()
                try:
                    p.wait(timeout=5)
                except Exception:
                    problems.append(f"process {p.pid} ({p.args[:6]}) did not end after SIGKILL")
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        # The pinned datapaths go with their bpf filesystem.
        subprocess.run(["umount", "-l", str(self.bpffs)], capture_output=True)
        left = [n.split()[0] for n in run(["ip", "netns", "list"], check=False).stdout.splitlines()
                if n.startswith(self.prefix)]
        if left:
            problems.append(f"namespaces left behind: {left}")
        devs = [l for l in run(["ip", "-o", "link"], check=False).stdout.splitlines() if self.prefix in l]
        if devs:
            problems.append(f"devices left behind: {devs}")
        self.saved_logs = {f"{d.host} ({d.log.name})": d.log_text() for d in self.daemons} if problems else {}
        shutil.rmtree(self.tmp, ignore_errors=True)
        return problems

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.problems = self.close()  # for the caller to fail on (see close)


def wait_until(cond, timeout=5.0, interval=0.05):
    """Polls cond() until it is true or `timeout` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(interval)


def tcp_and_pings(lab: Lab, src, dst, seconds: float) -> dict:
    """iperf3 TCP from guest `src` to `dst` for `seconds` and pings every
    10 ms beside it (the benchmarks' window of a neighbour's traffic):
    Gbit/s received, pings sent and lost, RTT avg and max (ms)."""
    srv = lab.popen(dst.ns, "iperf3", "-s", "-1", stdout=subprocess.DEVNULL)
    time.sleep(0.3)
    ping = lab.popen(src.ns, "ping", "-n", "-q", "-i", "0.01", "-c", str(int(seconds * 100)), "-W", "1", dst.ip,
                     stdout=subprocess.PIPE, text=True)
    out = lab.x(src.ns, "iperf3", "-c", dst.ip, "-t", f"{seconds:g}", "--json", timeout=seconds + 60).stdout
    srv.wait(timeout=30)
    p = ping.communicate(timeout=seconds + 30)[0]
    sent = int(p.split(" packets transmitted")[0].split()[-1])
    got = int(p.split(" packets transmitted, ")[1].split()[0])
    rtt = [float(x) for x in p.split(" = ")[1].split()[0].split("/")] if " = " in p else [float("nan")] * 4
    return {"gbps": json.loads(out)["end"]["sum_received"]["bits_per_second"] / 1e9,
            "ping_sent": sent, "ping_lost": sent - got, "rtt_avg_ms": rtt[1], "rtt_max_ms": rtt[2]}


def wait_listening(lab: Lab, ns: str, port: int, udp=False, timeout=10.0):
    """Waits until something in `ns` listens on `port` (TCP, or bound UDP)."""
    flags = "-Hlun" if udp else "-Hltn"
    if not wait_until(lambda: lab.x(ns, "ss", flags, f"sport = :{port}").stdout.strip(), timeout=timeout):
        raise AssertionError(f"nothing listens on port {port} in {ns} after {timeout} s")


def udp_rcvbuf_errors(lab: Lab, ns: str) -> int:
    """UDP datagrams the kernel dropped in `ns` because a socket's receive
    buffer was full (/proc/net/snmp): the reason an exact count of a flood
    can come up short without vnetd being at fault."""
    lines = [l.split() for l in lab.x(ns, "cat", "/proc/net/snmp").stdout.splitlines() if l.startswith("Udp:")]
    return int(dict(zip(lines[0], lines[1]))["RcvbufErrors"])


# ---- the control protocol, raw (for tests of vnetd's control plane itself) ----

def start_fails(lab: Lab, ns: str, *args, timeout=10) -> str:
    """Starts vnetd in `ns` expecting it to refuse: it must exit 1 with
    exactly one `vnetd: ` line, which is returned."""
    state = [] if "--state" in map(str, args) else ["--state", lab.tmp / "x.state"]
    p = lab.x(ns, VNETD, "--control-unix", lab.tmp / "x.sock", *state, *args, check=False, timeout=timeout)
    assert p.returncode == 1, p
    lines = [l for l in p.stderr.splitlines() if l.startswith("vnetd: ")]
    assert len(lines) == 1, p.stderr
    return lines[0]


def write_token(lab: Lab, name: str, token: str, mode=0o600) -> Path:
    path = lab.tmp / name
    path.write_text(token + "\n")
    path.chmod(mode)
    return path


class UnixSession:
    """One raw session on a vnetd's Unix control socket (from the test's own
    namespace: the socket is a file)."""

    def __init__(self, sock: Path):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(str(sock))
        self.f = self.sock.makefile("rwb")

    def send(self, data: bytes | str):
        self.f.write(data.encode() if isinstance(data, str) else data)
        self.f.flush()

    def readline(self) -> bytes:
        return self.f.readline()

    def reply(self) -> tuple[str, list[str]]:
        """Reads one reply: ("OK n", its n lines) or ("ERR ...", [])."""
        status = self.f.readline().decode().rstrip("\n")
        if status.startswith("OK "):
            return status, [self.f.readline().decode().rstrip("\n") for _ in range(int(status[3:]))]
        return status, []

    def request(self, text: str) -> tuple[str, list[str]]:
        self.send(text)
        return self.reply()

    def close(self):
        self.f.close()
        self.sock.close()


def raw_tcp(lab: Lab, ns: str, text: str, addr="127.0.0.1", port=9101, user: list[str] = ()) -> str:
    """Sends `text` over TCP from namespace `ns` (as `user`: a setpriv
    prefix, or root) and returns all vnetd answers until it closes the
    session (or 15 s pass)."""
    script = lab.tmp / f"raw-{time.monotonic_ns()}.py"
    script.write_text(textwrap.dedent(f"""
        import socket, sys
        s = socket.create_connection(({addr!r}, {port}), timeout=15)
        s.sendall(sys.stdin.buffer.read())
        out = b""
        while True:
            try:
                b = s.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not b:
                break
            out += b
        sys.stdout.write(out.decode())
    """))
    script.chmod(0o644)
    p = run(["ip", "netns", "exec", ns, *user, "python3", script], input=text, check=False, timeout=30)
    assert p.returncode == 0, p
    return p.stdout


def underlay_ip6(i: int) -> str:
    return f"fd00:198:18::{i}"


def mesh_config(me: int, guests_by_host: dict[int, list[tuple[str, str]]], mtu: int | None = None,
                link: str = "9000 udp", addr=underlay_ip, attach: dict[str, str] | None = None) -> str:
    """The config of host `me` in a full mesh: an interface per local guest,
    a link per other host (`LINK ADD <addr(h)> <link>`), unicast routes by MAC
    and broadcast fan-out (to every local guest; to every link only for frames
    from local guests, so a broadcast crosses each link once)."""
    lines = [f"# host {me}: full-mesh VNET config"]
    mtu_opt = f" mtu {mtu}" if mtu else ""
    for tap, mac in guests_by_host.get(me, []):
        extra = f" {attach[tap]}" if attach and tap in attach else ""
        lines.append(f"INTERFACE ADD {tap} {mac}{mtu_opt}{extra}")
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


# Guest MTU that lets every frame cross a 1500-byte underlay whole (the
# VNET/P wire adds 42 bytes: outer IPv4, UDP, and the frame's own Ethernet).
FAST_MTU = 1458


def veth_mesh(lab: "Lab", layout: dict[int, list[int]], mtu=FAST_MTU, extra: dict[int, str] | None = None,
              binary: Path | None = None, **links):
    """layout: host number -> guest numbers. Every guest is a namespace with
    a veth from its host's vnetd. `extra`: more config lines per host;
    `links`: mesh_config's `link` and `addr` (UDP over IPv4 by default);
    `binary`: another build's vnetd.
    Returns (hosts, daemons, guests)."""
    hosts = {h: lab.add_host(h) for h in layout}
    gns = {}
    for ns in layout.values():
        for n in ns:
            g = lab.ns(f"g{n}")
            lab.x(g, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
            lab.x(g, "sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1")
            gns[n] = g
    by_host = {h: [(f"g{n}", guest_mac(n)) for n in ns] for h, ns in layout.items()}
    attach = {f"g{n}": f"netns {gns[n]} veth" for n in gns}
    daemons = {}
    for h in layout:
        conf = mesh_config(h, by_host, mtu=mtu, attach=attach, **links) + ((extra or {}).get(h, ""))
        daemons[h] = lab.start_vnetd(hosts[h], conf, binary=binary)
    guests = {}
    for h, ns in layout.items():
        for n in ns:
            g = gns[n]
            lab.x(g, "ip", "addr", "add", f"{overlay_ip(n)}/24", "dev", f"g{n}")
            lab.x(g, "ip", "link", "set", f"g{n}", "up")
            guests[n] = Guest(ns=g, tap=f"g{n}", mac=guest_mac(n), ip=overlay_ip(n), host=hosts[h])
    return hosts, daemons, guests


def fast_stats(d) -> dict:
    """The `fastpath` line of `d`'s STATS."""
    return d.stats()["fastpath"]


def mpi_agent(tmp: Path, sockets: dict[str, Path] | None = None) -> Path:
    """OpenMPI's launcher for a rank's daemon: `ip netns exec <host> ...`
    (no ssh, ../shared/MACHINE-NOTES.md), with VNETD_SOCKET set per host for
    ranks under vtoe. Each host's daemon gets a session directory of its own:
    the namespaces share /tmp and one hostname, so two daemons started at once
    both made /tmp/ompi.<hostname>.0/jf.<job> and one failed with "File
    exists" (a CI failure)."""
    p = tmp / ("mpi-agent-vtoe" if sockets else "mpi-agent")
    cases = "".join(f"  {ns}) s={sock} ;;\n" for ns, sock in (sockets or {}).items())
    env = ' VNETD_SOCKET="$s"' if sockets else ""
    p.write_text(f'#!/bin/sh\nh="$1"; shift\n'
                 + (f'case "$h" in\n{cases}esac\n' if sockets else "")
                 + f'd="{tmp}/ompi-$h"; mkdir -p "$d"\n'
                 f'exec ip netns exec "$h" env TMPDIR="$d" OMPI_MCA_orte_tmpdir_base="$d"{env} sh -c "$*"\n')
    p.chmod(0o755)
    return p
