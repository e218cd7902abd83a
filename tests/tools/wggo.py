#!/usr/bin/env python3
"""An unmodified WireGuard peer for the tests: Debian's wireguard-go (user
space, over /dev/net/tun: this kernel has no WireGuard module), configured
with `wg` and `ip` in a host's network namespace.

Two shapes:

- `start(...)`, the peer of a vnetd WireGuard link ("full tunnel to the
  peer's underlay address"): every packet this namespace sends to the
  peer's underlay address, a plain vnetd's UDP datagrams to port 9000
  included, leaves inside the tunnel, from this host's own underlay
  address; wireguard-go's own encrypted datagrams (fwmark `fwmark`) go out
  on the underlay as before. What wg-quick does for a full tunnel, with `ip`:

      WG_PROCESS_FOREGROUND=1 wireguard-go DEV &
      wg set DEV private-key KEY listen-port 51820 fwmark 51820 \\
          peer PEER_PUB endpoint PEER_IP:51820 allowed-ips PEER_IP/32
      ip link set DEV mtu 1440 up
      ip route add PEER_IP/32 dev DEV table 51820 src LOCAL_IP
      ip rule add not fwmark 51820 table 51820

  but without wg-quick's `ip rule add table main suppress_prefixlength 0`:
  the peer is on-link (the main table's /24 toward it is more specific
  than /0), so that rule would send the datagrams to it in the clear.
  Decrypted packets from PEER_IP to LOCAL_IP are delivered to LOCAL_IP's
  sockets (Linux takes a local address on any device). A strict
  reverse-path filter (rp_filter=1) must be off in the namespace: the
  unmarked route back to PEER_IP is now DEV, so the peer's own packets on
  the underlay device (its ARP, its WireGuard datagrams) fail the check
  and nothing gets through; start() sets every rp_filter of the namespace
  that is 1 to 0 (loose, 2, would do too) and stop() puts them back.

- `pair(...)`, wireguard-go at both ends with tunnel addresses of their
  own (10.200.0.1/24 and .2/24), for measuring wireguard-go TUN to TUN
  (iperf3 between the tunnel addresses).

Each wireguard-go runs in the foreground (WG_PROCESS_FOREGROUND=1), so its
PID is the one we started (`ip netns exec` and `env` exec it); `stop()`
kills that PID and removes the device, the rule and the route it added.
wireguard-go's control socket is /var/run/wireguard/DEV.sock, a path in
the file system every namespace shares: device names must differ across
namespaces too (put the lab's prefix in them). `wg show DEV` works from
any namespace.

CLI, for manual use (stays up until Ctrl-C or SIGTERM, then cleans up):

    wggo.py genkey PATH
    wggo.py up NS DEV LOCAL_IP PEER_IP PEER_PUBKEY [--key-file F] [--listen-port P]
               [--peer-port P] [--mtu M]
    wggo.py pair NS_A NS_B PREFIX UNDERLAY_A UNDERLAY_B [--tunnel-a 10.200.0.1/24]
               [--tunnel-b 10.200.0.2/24] [--port P]
"""

from __future__ import annotations

import argparse
import atexit
import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from netlab import run, wait_until  # noqa: E402

WG_PORT = 51820
SOCKET_DIR = Path("/var/run/wireguard")
# The tunnel MTU that carries a vnetd WireGuard link's largest datagram
# whole: a 1500-byte underlay less WireGuard's 60 bytes over IPv4 (outer
# IPv4 20, UDP 8, its header 16 and tag 16). wireguard-go's own default,
# 1420, leaves room for an IPv6 outer header and would make the inner
# IPv4/UDP datagrams of frames above 1392 bytes be fragmented.
FULL_TUNNEL_MTU = 1440
# Over an IPv6 underlay: its outer IPv6 header is 40 bytes.
FULL_TUNNEL_MTU_V6 = 1420
TUNNEL_A, TUNNEL_B = "10.200.0.1/24", "10.200.0.2/24"
IFNAMSIZ = 15

# Every WgGo not stopped yet: at exit, its process is killed and its socket
# file removed (a SIGKILLed wireguard-go, e.g. by Lab.close, leaves it).
_live: list["WgGo"] = []


def genkey(path: str | Path) -> tuple[Path, str]:
    """A private key file in `wg genkey`'s format (base64 and a newline),
    mode 600 whatever the umask; returns (path, its public key)."""
    path = Path(path)
    private = run(["wg", "genkey"]).stdout
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(private)
    return path, public_key_of(path)


def public_key_of(key_file: str | Path) -> str:
    return run(["wg", "pubkey"], input=Path(key_file).read_text()).stdout.strip()


@dataclass
class WgGo:
    ns: str
    dev: str
    public_key: str
    key_file: Path
    proc: subprocess.Popen
    log: Path
    listen_port: int
    # What was added beyond the device, for stop() to remove: `ip` argument
    # lists, each removed by the same words with "del" for "add".
    added: list[list[str]] = field(default_factory=list)
    # sysctls changed, with their values before: stop() restores them.
    sysctls: list[tuple[str, str]] = field(default_factory=list)
    tunnel_ip: str | None = None  # pair(): this end's tunnel address

    @property
    def pid(self) -> int:
        return self.proc.pid

    def x(self, *cmd, check=True, timeout=30) -> subprocess.CompletedProcess:
        return run(["ip", "netns", "exec", self.ns, *cmd], check=check, timeout=timeout)

    def wg(self, *args, check=True) -> subprocess.CompletedProcess:
        """`wg <args>` against this device (e.g. "show", or "set" ...)."""
        return run(["wg", *[str(a) for a in args]], check=check)

    def peers(self) -> dict[str, dict]:
        """`wg show DEV dump` per peer public key: endpoint, allowed_ips,
        latest_handshake (Unix seconds, 0: none), rx_bytes, tx_bytes."""
        lines = self.wg("show", self.dev, "dump").stdout.splitlines()[1:]
        out = {}
        for line in lines:
            key, _psk, endpoint, allowed, hs, rx, tx, _ka = line.split("\t")
            out[key] = {"endpoint": endpoint, "allowed_ips": allowed, "latest_handshake": int(hs),
                        "rx_bytes": int(rx), "tx_bytes": int(tx)}
        return out

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout=5.0) -> int | None:
        """Removes the rule and route, kills wireguard-go (SIGTERM, then
        SIGKILL), removes the device if it outlived it and the socket file
        if left. Safe to call twice, and with the namespace already gone."""
        ns_there = self.ns in run(["ip", "netns", "list"], check=False).stdout.split()
        if ns_there:
            for words in reversed(self.added):
                run(["ip", "-n", self.ns, *[("del" if w == "add" else w) for w in words]], check=False)
            for key, value in reversed(self.sysctls):
                self.x("sysctl", "-qw", f"{key}={value}", check=False)
        self.added, self.sysctls = [], []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout)
        if ns_there:
            run(["ip", "-n", self.ns, "link", "del", self.dev], check=False)
        _remove_socket(self.dev)
        if self in _live:
            _live.remove(self)
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _remove_socket(dev: str):
    try:
        (SOCKET_DIR / f"{dev}.sock").unlink()
    except FileNotFoundError:
        pass


@atexit.register
def _sweep():
    for w in list(_live):
        try:
            w.stop(timeout=2)
        except Exception:  # keep sweeping
            if w.proc.poll() is None:
                w.proc.kill()
            _remove_socket(w.dev)


def _launch(ns: str, dev: str, key_file: Path | None, workdir: Path, lab=None) -> WgGo:
    """wireguard-go DEV in `ns`, in the foreground, and its key; waits for
    its control socket."""
    if len(dev) > IFNAMSIZ:
        raise ValueError(f"device name {dev!r} is longer than {IFNAMSIZ} characters")
    sock = SOCKET_DIR / f"{dev}.sock"
    if sock.exists():
        raise RuntimeError(f"{sock} exists: another wireguard-go uses the name {dev} (names are global)")
    if key_file is None:
        key_file, public = genkey(workdir / f"{dev}.key")
    else:
        key_file, public = Path(key_file), public_key_of(key_file)
    log = workdir / f"{dev}-wireguard-go.log"
    env = ["env", "WG_PROCESS_FOREGROUND=1", "LOG_LEVEL=error"]
    with open(log, "a") as lf:
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *env, "wireguard-go", dev],
                                stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if lab is not None:
        lab.other_procs.append(proc)  # killed by Lab.close if the test does not stop() it
    w = WgGo(ns=ns, dev=dev, public_key=public, key_file=Path(key_file), proc=proc, log=log, listen_port=0)
    _live.append(w)
    if not wait_until(lambda: sock.exists() or proc.poll() is not None, timeout=10) or proc.poll() is not None:
        w.stop()
        raise RuntimeError(f"wireguard-go {dev} in {ns} did not start:\n{log.read_text(errors='replace')}")
    return w


def _loosen_rp_filter(w: WgGo):
    """Every strict (1) rp_filter of `w`'s namespace to 0 (the effective
    value on a device is the larger of `all`'s and its own)."""
    out = w.x("sysctl", "-a", "-r", r"^net\.ipv4\.conf\.[^.]+\.rp_filter$").stdout
    for line in out.splitlines():
        key, _, value = (t.strip() for t in line.partition("="))
        if value == "1":
            w.sysctls.append((key, value))
            w.x("sysctl", "-qw", f"{key}=0")


def _workdir(lab, tmp) -> Path:
    if tmp is not None:
        return Path(tmp)
    if lab is not None:
        return Path(lab.tmp)
    return Path(tempfile.mkdtemp(prefix="wggo-"))


def start(ns: str, prefix: str, local_ip: str, peer_ip: str, peer_public_key: str, *,
          listen_port: int = WG_PORT, peer_port: int = WG_PORT, key_file: str | Path | None = None,
          mtu: int | None = None, fwmark: int | None = None, table: int | None = None,
          dev: str | None = None, keepalive: int | None = None, lab=None, tmp=None) -> WgGo:
    """wireguard-go in `ns` (device `dev`, by default `<prefix>wg`) as the
    peer of `peer_ip`:`peer_port` (key `peer_public_key`; IPv4 or IPv6,
    as `local_ip`), listening on
    `listen_port`, carrying everything `ns` sends to `peer_ip` (from
    `local_ip`, this host's underlay address) inside the tunnel.
    `key_file`: this end's private key (default: a new one, see genkey).
    `fwmark` and `table` default to `listen_port`; a second instance in the
    same namespace needs its own. `lab`: a netlab.Lab, whose close() then
    kills the process if the test does not stop() it; files go in its tmp."""
    version = ipaddress.ip_address(local_ip).version
    if ipaddress.ip_address(peer_ip).version != version:
        raise ValueError("the local and the peer's underlay addresses must be of one family")
    # Over IPv6 the tunnel carries IPv6/UDP inside (as a vnetd WireGuard
    # link over IPv6 does), under an outer header 20 bytes longer.
    v6 = version == 6
    fam, plen = (["-6"], 128) if v6 else ([], 32)
    endpoint = f"[{peer_ip}]:{peer_port}" if v6 else f"{peer_ip}:{peer_port}"
    mtu = mtu if mtu is not None else (FULL_TUNNEL_MTU_V6 if v6 else FULL_TUNNEL_MTU)
    fwmark = listen_port if fwmark is None else fwmark
    table = listen_port if table is None else table
    dev = dev or f"{prefix}wg"
    w = _launch(ns, dev, key_file, _workdir(lab, tmp), lab)
    w.listen_port = listen_port
    try:
        cmd = ["wg", "set", dev, "private-key", w.key_file, "listen-port", listen_port, "fwmark", fwmark,
               "peer", peer_public_key, "endpoint", endpoint, "allowed-ips", f"{peer_ip}/{plen}"]
        if keepalive:
            cmd += ["persistent-keepalive", keepalive]
        run(cmd)
        w.x("ip", "link", "set", dev, "mtu", mtu, "up")
        for words in ([*fam, "route", "add", f"{peer_ip}/{plen}", "dev", dev, "table", str(table), "src", local_ip],
                      [*fam, "rule", "add", "not", "fwmark", str(fwmark), "table", str(table)]):
            run(["ip", "-n", ns, *words])
            w.added.append(words)
        _loosen_rp_filter(w)
    except Exception:
        w.stop()
        raise
    return w


def pair(ns_a: str, ns_b: str, prefix: str, underlay_a: str, underlay_b: str, *,
         tunnel_a: str = TUNNEL_A, tunnel_b: str = TUNNEL_B, port: int = WG_PORT,
         mtu: int | None = None, lab=None, tmp=None) -> tuple[WgGo, WgGo]:
    """wireguard-go at both ends (devices `<prefix>wa` in `ns_a`, `<prefix>wb`
    in `ns_b`), peered over the underlay addresses, each with its tunnel
    address (`tunnel_a`/`tunnel_b`, CIDR): iperf3 between the tunnel
    addresses measures wireguard-go TUN to TUN. `mtu`: the tunnels' (default
    wireguard-go's own, 1420)."""
    work = _workdir(lab, tmp)
    ends = []
    try:
        for ns, dev in ((ns_a, f"{prefix}wa"), (ns_b, f"{prefix}wb")):
            ends.append(_launch(ns, dev, None, work, lab))
        a, b = ends
        for me, peer, my_tunnel, peer_tunnel, peer_underlay in (
                (a, b, tunnel_a, tunnel_b, underlay_b), (b, a, tunnel_b, tunnel_a, underlay_a)):
            me.listen_port = port
            me.tunnel_ip = my_tunnel.split("/")[0]
            run(["wg", "set", me.dev, "private-key", me.key_file, "listen-port", port,
                 "peer", peer.public_key, "endpoint", f"{peer_underlay}:{port}",
                 "allowed-ips", f"{peer_tunnel.split('/')[0]}/32"])
            me.x("ip", "addr", "add", my_tunnel, "dev", me.dev)
            if mtu:
                me.x("ip", "link", "set", me.dev, "mtu", mtu)
            me.x("ip", "link", "set", me.dev, "up")
    except Exception:
        for w in ends:
            w.stop()
        raise
    return a, b


def _wait_for_signal():
    done = []
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, lambda *_: done.append(1))
    while not done:
        time.sleep(0.2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("genkey")
    g.add_argument("path")
    u = sub.add_parser("up")
    for a in ("ns", "dev", "local_ip", "peer_ip", "peer_public_key"):
        u.add_argument(a)
    u.add_argument("--key-file")
    u.add_argument("--listen-port", type=int, default=WG_PORT)
    u.add_argument("--peer-port", type=int, default=WG_PORT)
    u.add_argument("--mtu", type=int, default=None)
    p = sub.add_parser("pair")
    for a in ("ns_a", "ns_b", "prefix", "underlay_a", "underlay_b"):
        p.add_argument(a)
    p.add_argument("--tunnel-a", default=TUNNEL_A)
    p.add_argument("--tunnel-b", default=TUNNEL_B)
    p.add_argument("--port", type=int, default=WG_PORT)
    p.add_argument("--mtu", type=int)
    args = ap.parse_args()
    if args.cmd == "genkey":
        print(genkey(args.path)[1])
        return
    tmp = Path(tempfile.mkdtemp(prefix="wggo-"))  # the keys it makes; removed at the end
    try:
        if args.cmd == "up":
            ends = [start(args.ns, "", args.local_ip, args.peer_ip, args.peer_public_key, dev=args.dev,
                          key_file=args.key_file, listen_port=args.listen_port, peer_port=args.peer_port,
                          mtu=args.mtu, tmp=tmp)]
        else:
            ends = list(pair(args.ns_a, args.ns_b, args.prefix, args.underlay_a, args.underlay_b,
                             tunnel_a=args.tunnel_a, tunnel_b=args.tunnel_b, port=args.port, mtu=args.mtu, tmp=tmp))
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        for w in ends:
            print(f"{w.ns} {w.dev} public_key={w.public_key} pid={w.pid} key_file={w.key_file}"
                  + (f" tunnel_ip={w.tunnel_ip}" if w.tunnel_ip else ""), flush=True)
        print("up (Ctrl-C to stop)", flush=True)
        _wait_for_signal()
    finally:
        for w in ends:
            w.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
