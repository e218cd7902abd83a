#!/usr/bin/env python3
"""Frames per second a guest's NIC pushes through vnetd, by NIC kind, in
one interleaved run: a DPDK testpmd (txonly, one polling core) is the
guest on host 1; its frames cross vnetd h1, the UDP link and vnetd h2 to a
guest on host 2 (a VM's driver, or a namespace guest's TAP), whose
received-frame count is the figure.

  vhost-vm     VM to VM: testpmd's net_virtio_user port (txonly) on a
               vhost-user interface of host 1 sends to bench/tools/rx_sink.py,
               a virtio driver on a vhost-user interface of host 2 (interrupt-
               driven, real-time on the sender's CPU so that it is not starved
               by the poller); the figure is what the receiving driver took
               from its ring
  vhost-vm-poll
               the same with host 1's dispatcher polling the VM's ring
               (INTERFACE SET pa mode vmm-driven: a polling datapath core)
  vhost-vm-copy
               vhost-vm with `SET cut-through off` on both hosts (every
               frame copied out of the VM's memory): cut-through's default
               decided end to end
  socket       the underlay alone: iperf3 -u, one sendto per datagram of the
               frame's size, host 1 to host 2 (the bare per-datagram socket)
  vhost        testpmd's net_virtio_user port on a vhost-user interface
               (vnetd works its rings; cut-through on, the default)
  vhost-veth   the same to a container: a veth guest on host 2, whose
               vnetd runs with the kernel fast path for the row (`SET
               datapath auto`; `user` for every other row). testpmd's
               datagrams are addressed to the container (its IP, UDP port
               9), where an application reads them (bench/tools/carrier.c
               rx-gro, recvmmsg, on the receiver's CPU as rx_sink.py is);
               the figure is the datagrams the application's socket took
               (UDP InDatagrams in the container), and the row keeps the
               veth's received frames (`nic_pps`) and the socket's drops
               (`app_rcvbuf_drops`, RcvbufErrors). Host 1's vnetd sends the VM's frames as UDP GSO
               trains, which the veth underlay delivers whole; host 2's
               kernel cuts each round its finishing pair and decapsulates
               every frame into the container (docs/datapath.md). Host 2's
               receive runs on host 2's CPU (RPS on its underlay device: a
               veth would run it inline on the sender's CPU), as host 2's
               vnetd does in the VM rows
  vhost-veth-inline
               the same with RPS off: host 2's kernel work inline on host
               1's vnetd's CPU (one core for both hosts' datapaths)
  vxlan-veth   the kernel's own overlay for the same VM and container, no
               vnetd: testpmd's net_tap port (a VM on a TAP, as QEMU's
               `-netdev tap`) in a bridge with a VXLAN device (VNI 42, UDP
               4789) on host 1, the same on host 2 with a veth container
               in the bridge; the same frames to the same application,
               the same figure. Host 1's kernel work on host 1's CPU (RPS
               on the TAP), host 2's on host 2's (RPS on its underlay
               device): the placement of the vhost-veth row
  vhost-copy   the same with `SET cut-through off`
  tap          testpmd's net_af_packet port on a namespace guest's TAP that
               vnetd holds (what a container's or a TAP VM's frames cost)
  dpdk-loop    testpmd's own vhost PMD (net_vhost, rxonly, on the other CPU)
               fed by the same virtio-user sender, no vnetd: the vhost-user
               protocol's ceiling on this machine
  vhost-intake, vhost-copy-intake, tap-intake
               the NIC alone: frames to a MAC no route names, which vnetd h1
               takes from the NIC, routes and drops (no_route); the figure
               is h1's in_frames rate for that interface. The rows that
               end in host 2's TAP are bounded by vnetd h2's one write(2)
               per frame into it (and the guest kernel's receive, which
               that write runs), the same for every NIC kind on host 1

    sudo python3 bench/vhost.py [--reps 3] [--seconds 5] [--sizes 64,1500,66+1434,tso] [--transports ...]
                                [--underlay-mtu 9000] [--base target/previous/<commit>]

With `--base`, every point is measured with this build's vnetd and with
that folder's in turn (a lab each, the order alternating), and a table of
the ratios follows.

With `--underlay-mtu` 1528 or more a 1500-byte frame crosses in one VNET/P
datagram (GSO runs); at 1500 it crosses as two IP fragments, one datagram
per send.

Placement: host 1's vnetd, which takes the sender's frames, is pinned alone
on CPU 0 (`--cpus 0`: the datapath on its own core); the sender polls on
CPU 1, where host 2's vnetd (`--cpus 1`, real-time while event-driven)
preempts it when frames come for the receiver. Two busy-polling testpmds (a receiving one too) and two vnetds do not
fit on this machine's two CPUs (a receiving testpmd sharing a CPU with a
poller or a dispatcher is starved and its ring overflows), so the receive
side of the `vhost`, `vhost-copy` and `tap` rows is the kernel's TAP, and
`vhost-vm` uses rx_sink.py, a driver that sleeps until interrupted.

Sizes: `64`, `1500` (one buffer each), `66+1434` (one frame in two buffers,
headers then payload, as a Linux guest sends TCP: vnetd gathers it), `tso`
(64 KB TCP super-frames in 17 buffers from bench/tools/tso_sender.py, a
virtio driver in Python, since testpmd's txonly sends UDP only: vhost
transports only). Prints min/median/max per
transport, ratios to the TAP path, to the bare socket, to the DPDK loop and to
the kernel's VXLAN (vxlan-veth), and the load
average before/after each point; writes bench/results/<date>-vhost.{json,md}.
A benchmark, never a pass/fail test.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent / "tests"))
from netlab import Lab, guest_mac, mesh_config, overlay_ip, underlay_ip  # noqa: E402
from carriers import TOOL, build_tool  # noqa: E402

MAC_A, MAC_B = "52:54:00:00:00:0a", "52:54:00:00:00:0b"
# Host 1's vnetd, which takes the sender's frames, has CPU 0 to itself (the
# datapath on its own core: VNET/P+'s noise isolation); the sender polls on
# CPU 1, where host 2's vnetd (real-time while event-driven) preempts it
# whenever frames arrive for the receiver.
CPU_PMD, CPU_VNETD = 1, (0, 1)
TRANSPORTS = ["vhost-vm", "vhost-vm-poll", "vhost-vm-copy", "vhost", "vhost-veth", "vhost-veth-inline", "vxlan-veth", "vhost-copy", "tap", "socket", "dpdk-loop", "vhost-intake", "vhost-copy-intake", "tap-intake"]
# A MAC no route names: frames to it are taken from the NIC, routed and
# dropped (no_route) by vnetd h1, nothing further.
NOWHERE = "02:00:00:00:00:99"


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split(" ")[0]


class TsoSender:
    """bench/tools/tso_sender.py in the background on the sender's CPU: a
    virtio driver keeping vnetd's ring full of 64 KB TCP super-frames."""

    def __init__(self, lab: Lab, sock: Path, dst: str, seconds: float):
        cmd = ["taskset", "-c", str(CPU_PMD), sys.executable, str(BENCH / "tools" / "tso_sender.py"), str(sock), dst, MAC_A, str(seconds)]
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lab.other_procs.append(self.p)

    def stop(self) -> str:
        try:
            return self.p.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            self.p.kill()
            return self.p.communicate()[0]


class Pmd:
    """A testpmd in the background (in namespace `ns`, or the root one)."""

    def __init__(self, lab: Lab, ns: str | None, name: str, vdev: str, args: list[str], cpu: int):
        self.prefix = f"{lab.prefix}{name}"
        # Forwarding lcore on `cpu`; the main lcore (stats once a second) on the other.
        cmd = ["dpdk-testpmd", "--lcores", f"0@{1 - cpu},1@{cpu}", "--no-pci", "--no-huge", "-m", "512", f"--file-prefix={self.prefix}",
               "--vdev", vdev, "--", "--nb-cores=1", "--stats-period", "1", "--total-num-mbufs=16384", *args]
        if ns:
            cmd = ["ip", "netns", "exec", ns, *cmd]
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        lab.other_procs.append(self.p)

    def stop(self) -> str:
        self.p.send_signal(signal.SIGINT)
        try:
            out = self.p.communicate(timeout=20)[0]
        except subprocess.TimeoutExpired:
            self.p.kill()
            out = self.p.communicate()[0]
        shutil.rmtree(f"/var/run/dpdk/{self.prefix}", ignore_errors=True)
        return out


def rx_rate(out: str) -> float | None:
    """The median of testpmd's per-second Rx-pps samples after the first
    with traffic (a partial second)."""
    pps = [int(x) for x in re.findall(r"Rx-pps:\s+(\d+)", out)]
    start = next((i for i, v in enumerate(pps) if v > 0), len(pps))
    pps = pps[start + 1:] or pps[start:]
    return statistics.median(pps) if pps else None


class Bench:
    def __init__(self, lab: Lab, vnetd_bin: str | None, underlay_mtu: int = 1500, veth: bool = False, vxlan: bool = False):
        self.lab = lab
        self.h1, self.h2 = lab.add_host(1, mtu=underlay_mtu), lab.add_host(2, mtu=underlay_mtu)
        self.xc = self.kernel_vxlan(underlay_mtu) if vxlan else None
        self.sa, self.sb = lab.tmp / "a.sock", lab.tmp / "b.sock"
        by_host = {1: [("pa", MAC_A), ("ta", guest_mac(1))], 2: [("pb", MAC_B), ("tb", guest_mac(2))]}
        attach2 = {"pb": f"vhost-user {self.sb} unsealed-memory"}
        self.gv = None
        if veth:  # a container on host 2 (vhost-veth)
            self.gv = lab.guest_ns("gv")
            by_host[2].append(("vb", guest_mac(3)))
            attach2["vb"] = f"netns {self.gv} veth"
        # testpmd's --no-huge memory is a memfd it seals against sealing, so
        # never against shrinking: vnetd takes it only with unsealed-memory.
        c1 = mesh_config(1, by_host, attach={"pa": f"vhost-user {self.sa} unsealed-memory"}) + "SET datapath user\n"
        c2 = mesh_config(2, by_host, attach=attach2) + "SET datapath user\n"
        binary = Path(vnetd_bin) if vnetd_bin else None
        self.d1 = lab.start_vnetd(self.h1, c1, "--cpus", str(CPU_VNETD[0]), binary=binary)
        self.d2 = lab.start_vnetd(self.h2, c2, "--cpus", str(CPU_VNETD[1]), binary=binary)
        self.ga = lab.attach_guest(self.h1, "ta", 1)
        self.gb = lab.attach_guest(self.h2, "tb", 2)
        self.vb = lab.veth_guest(self.h2, "vb", 3, self.gv) if veth else None

    def rx(self, g) -> int:
        """Frames guest `g`'s device received."""
        return self.rx_of(g.ns, g.tap)

    def measure(self, transport: str, size: int, seconds: float) -> float | None:
        lab = self.lab
        # "66+1434": one frame in two buffers (headers, then payload), as a
        # Linux guest sends TCP.
        if size == "tso" and (not transport.startswith("vhost") or transport.startswith("vhost-vm")):
            return None  # only a virtio driver (tso_sender.py) sends these here
        segs = size.split("+")
        tx_args = ["--forward-mode=txonly", f"--txpkts={','.join(segs)}", f"--eth-peer=0,{self.gb.mac}"]
        if len(segs) > 1:
            tx_args.append("--tx-offloads=0x8000")  # RTE_ETH_TX_OFFLOAD_MULTI_SEGS
        if transport == "socket":
            return self.bare_socket(int(frame_len(size)), seconds)
        if transport == "vxlan-veth":
            return self.vxlan_veth(tx_args, seconds)
        if transport.startswith("vhost-vm"):
            # -poll: host 1's dispatcher polls the VM's ring (VMM-driven, a
            # polling core as OVS-DPDK's PMD threads), the VM never kicks.
            mode = "vmm-driven" if transport.endswith("-poll") else "guest-driven"
            self.d1.ctl("INTERFACE", "SET", "pa", "mode", mode)
            try:
                return self.vm_to_vm(tx_args, int(frame_len(size)), seconds, cut_through=not transport.endswith("-copy"))
            finally:
                self.d1.ctl("INTERFACE", "SET", "pa", "mode", "default")
        if transport == "dpdk-loop":  # testpmd's vhost backend receives what virtio-user sends
            sock = lab.tmp / "loop.sock"
            rx = Pmd(lab, None, "b", f"net_vhost0,iface={sock},queues=1", ["--forward-mode=rxonly"], 1 - CPU_PMD)
            time.sleep(1)
            tx = Pmd(lab, None, "a", f"net_virtio_user0,path={sock},mac={MAC_A}", tx_args, CPU_PMD)
            time.sleep(seconds)
            tx.stop()
            return rx_rate(rx.stop())
        intake = transport.endswith("-intake")
        if intake:
            tx_args = to_peer(tx_args, NOWHERE)
            nic = "interface pa" if transport.startswith("vhost") else "interface ta"
            count = lambda: self.d1.stats()[nic]["in_frames"]
        else:
            # vhost-veth: to the container, host 2 on the kernel fast path
            # for the row.
            to = self.vb if transport.startswith("vhost-veth") else self.gb
            tx_args = to_peer(tx_args, to.mac)
            count = lambda: self.rx(to)  # noqa: E731
        fast = transport.startswith("vhost-veth")
        sink = None
        if fast:
            self.d2.ctl("SET", "datapath", "auto")
            self.rps(transport == "vhost-veth")
            # The container's application: a UDP socket on port 9 that
            # testpmd's datagrams are addressed to, read with recvmmsg on
            # the receiver's CPU (as rx_sink.py is for a VM). Without it the
            # container's stack would route and drop each frame as not its
            # own (a route lookup and a dst made and freed per frame).
            tx_args.append(f"--tx-ip={overlay_ip(1)},{to.ip}")
            build_tool()
            sink = lab.popen(self.gv, "taskset", "-c", str(CPU_PMD), TOOL, "rx-gro", "9", str(seconds + 6),
                             stdout=subprocess.PIPE, text=True)
            app = lambda: self.udp_in(self.gv)  # noqa: E731
        try:
            if transport.startswith("vhost"):
                for d in (self.d1, self.d2):
                    d.ctl("SET", "cut-through", "off" if transport.startswith("vhost-copy") else "on")
                if size == "tso":
                    peer = NOWHERE if intake else to.mac
                    tx = TsoSender(lab, self.sa, peer, seconds + 3)
                else:
                    tx = Pmd(lab, self.h1, "a", f"net_virtio_user0,path={self.sa},mac={MAC_A}", tx_args, CPU_PMD)
            else:  # tap
                tx = Pmd(lab, self.ga.ns, "a", "net_af_packet0,iface=ta,blocksz=4096,framesz=2048,framecnt=512",
                         tx_args, CPU_PMD)
            time.sleep(2)  # start-up and the first partial second
            t0, n0, c0 = time.time(), count(), cpu_times()
            a0 = app() if sink else None
            time.sleep(seconds)
            t1, n1, c1 = time.time(), count(), cpu_times()
            self.extra["cpu"] = cpu_shares(c0, c1)
            if sink:
                a1 = app()
                # The figure is what the application's socket took, as
                # rx_sink.py's is what a VM's driver took; the NIC's count
                # is kept beside it.
                self.extra.update(nic_pps=(n1 - n0) / (t1 - t0), app_rcvbuf_drops=a1[1] - a0[1])
                n0, n1 = a0[0], a1[0]
            tx.stop()
        finally:
            if fast:
                self.d2.ctl("SET", "datapath", "user")
                self.rps(False)
            if sink:
                sink.kill()
                sink.wait()
        return (n1 - n0) / (t1 - t0)

    def udp_in(self, ns: str) -> tuple[int, int]:
        """Namespace `ns`'s UDP InDatagrams (queued to a socket) and
        RcvbufErrors (dropped, its socket's queue full)."""
        lines = [l.split() for l in self.lab.x(ns, "cat", "/proc/net/snmp").stdout.splitlines() if l.startswith("Udp:")]
        row = dict(zip(lines[0][1:], lines[1][1:]))
        return int(row["InDatagrams"]), int(row["RcvbufErrors"])

    def rps(self, on: bool):
        """Host 2's receive work (its kernel's, for a container) on host 2's
        CPU: RPS on its underlay device steers each datagram the veth hands
        over to CPU_VNETD[1]'s backlog, as a NIC's interrupt would run on
        the receiving machine; off, it runs inline on the sender's CPU
        (veth's netif_rx), host 1's vnetd paying for both hosts."""
        mask = format(1 << CPU_VNETD[1], "x") if on else "0"
        self.lab.x(self.h2, "sh", "-c", f"echo {mask} > /sys/class/net/eth0/queues/rx-0/rps_cpus")


    def kernel_vxlan(self, underlay_mtu: int) -> str:
        """The kernel's own overlay beside vnetd, for vxlan-veth: a bridge
        with a VXLAN device on each host (the VM's TAP joins host 1's when
        testpmd makes it) and a container on host 2 in its bridge; the
        container's namespace."""
        lab, mtu = self.lab, str(underlay_mtu - 50)
        for h, host, peer in ((1, self.h1, 2), (2, self.h2, 1)):
            lab.x(host, "ip", "link", "add", "vx0", "type", "vxlan", "id", "42", "dstport", "4789",
                  "remote", underlay_ip(peer), "local", underlay_ip(h), "dev", "eth0")
            lab.x(host, "ip", "link", "add", "br0", "type", "bridge")
            lab.x(host, "ip", "link", "set", "vx0", "master", "br0", "mtu", mtu, "up")
            lab.x(host, "ip", "link", "set", "br0", "up")
        xc = lab.guest_ns("xc")
        lab.x(self.h2, "ip", "link", "add", "xv", "type", "veth", "peer", "name", "eth0", "netns", xc)
        lab.x(self.h2, "ip", "link", "set", "xv", "master", "br0", "mtu", mtu, "up")
        lab.x(xc, "ip", "link", "set", "eth0", "mtu", mtu, "up")
        lab.x(xc, "ip", "addr", "add", f"{overlay_ip(4)}/24", "dev", "eth0")
        return xc

    def vxlan_veth(self, tx_args: list[str], seconds: float) -> float | None:
        """testpmd on a TAP in host 1's VXLAN bridge sends to the
        application in host 2's container (vxlan-veth): datagrams per
        second its socket took, as for vhost-veth."""
        lab, xc = self.lab, self.xc
        mac = lab.x(xc, "cat", "/sys/class/net/eth0/address").stdout.strip()
        tx_args = to_peer(tx_args, mac) + [f"--tx-ip={overlay_ip(1)},{overlay_ip(4)}"]
        build_tool()
        sink = lab.popen(xc, "taskset", "-c", str(CPU_PMD), TOOL, "rx-gro", "9", str(seconds + 8), stdout=subprocess.PIPE, text=True)
        self.rps(True)
        tx = Pmd(lab, self.h1, "a", "net_tap0,iface=xt0", tx_args, CPU_PMD)
        try:
            # The TAP is testpmd's (it goes when testpmd does): into the
            # bridge once it is there; host 1's kernel work on host 1's CPU.
            for _ in range(100):
                if lab.x(self.h1, "ip", "link", "set", "xt0", "master", "br0", "up", check=False).returncode == 0:
                    break
                time.sleep(0.1)
            lab.x(self.h1, "sh", "-c", f"echo {1 << CPU_VNETD[0]:x} > /sys/class/net/xt0/queues/rx-0/rps_cpus")
            time.sleep(2)
            t0, a0, n0, c0 = time.time(), self.udp_in(xc), self.rx_of(xc, "eth0"), cpu_times()
            time.sleep(seconds)
            t1, a1, n1, c1 = time.time(), self.udp_in(xc), self.rx_of(xc, "eth0"), cpu_times()
            self.extra.update(cpu=cpu_shares(c0, c1), nic_pps=(n1 - n0) / (t1 - t0), app_rcvbuf_drops=a1[1] - a0[1])
        finally:
            tx.stop()
            self.rps(False)
            sink.kill()
            sink.wait()
        return (a1[0] - a0[0]) / (t1 - t0)

    def rx_of(self, ns: str, dev: str) -> int:
        """Frames device `dev` in namespace `ns` received."""
        return int(self.lab.x(ns, "cat", f"/sys/class/net/{dev}/statistics/rx_packets").stdout)

    def vm_to_vm(self, tx_args: list[str], length: int, seconds: float, cut_through: bool = True) -> float | None:
        """testpmd (the VM on host 1, vhost-user) sends to the VM on host 2,
        bench/tools/rx_sink.py (a virtio driver on its own vhost-user
        interface, interrupt-driven): frames per second its driver took from
        its ring, the median of its per-second counts."""
        lab = self.lab
        tx_args = to_peer(tx_args, MAC_B)
        for d in (self.d1, self.d2):
            d.ctl("SET", "cut-through", "on" if cut_through else "off")
        # Real-time (FIFO 1, as host 2's dispatcher) so that, woken by an
        # interrupt, it takes the CPU from the polling sender beside it:
        # two guests on this machine's second CPU.
        sink = subprocess.Popen(["taskset", "-c", str(CPU_PMD), "chrt", "-f", "1", sys.executable, str(BENCH / "tools" / "rx_sink.py"),
                                 str(self.sb), str(seconds + 3), str(length)], stdout=subprocess.PIPE, text=True)
        lab.other_procs.append(sink)
        time.sleep(1)
        tx = Pmd(lab, self.h1, "a", f"net_virtio_user0,path={self.sa},mac={MAC_A}", tx_args, CPU_PMD)
        try:
            out = json.loads(sink.communicate(timeout=seconds + 30)[0])
        except (subprocess.TimeoutExpired, json.JSONDecodeError):
            sink.kill()
            return None
        finally:
            tx.stop()
            # What testpmd sent after the sink left is held for the sink's
            # next connection (vnet_vhost::held, up to 1 s): let it expire,
            # or the next run's sink counts this run's frames as the wrong
            # length (256 of them, and its run lost, in earlier results).
            time.sleep(1.5)
        if out["bad"]:
            print(f"rx_sink: {out['bad']} frames of the wrong length", file=sys.stderr)
            return None
        # Seconds with traffic, the first (partial) one left out.
        pps = out["per_second"]
        start = next((i for i, v in enumerate(pps) if v > 0), len(pps))
        pps = pps[start + 1:] or pps[start:]
        return statistics.median(pps) if pps else None

    def bare_socket(self, length: int, seconds: float) -> float | None:
        """The underlay alone: one UDP socket on host 1 sending `length`-byte
        datagrams to one on host 2, one sendto each (iperf3 -u -b 0, pinned
        where testpmd sends): datagrams per second received."""
        lab = self.lab
        srv = lab.popen(self.h2, "iperf3", "-s", "-1", "-p", "5209", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)
        r = lab.x(self.h1, "taskset", "-c", str(CPU_PMD), "iperf3", "-c", underlay_ip(2), "-p", "5209", "-u", "-b", "0",
                  "-l", str(length), "-t", str(seconds), "--json", check=False, timeout=seconds + 30)
        srv.wait(timeout=10)
        try:
            end = json.loads(r.stdout)["end"]["sum"]
        except (json.JSONDecodeError, KeyError):
            return None
        return (end["packets"] - end["lost_packets"]) / end["seconds"]


def cpu_times() -> dict[str, list[int]]:
    """Each CPU's /proc/stat times (user nice system idle iowait irq softirq ...)."""
    return {l.split()[0]: [int(x) for x in l.split()[1:]] for l in Path("/proc/stat").read_text().splitlines()
            if l.startswith("cpu") and l[3].isdigit()}


def cpu_shares(a: dict, b: dict) -> dict[str, dict[str, float]]:
    """Per CPU between two cpu_times(): the share of its time in user code,
    the kernel (system), softirq (the network's receive work) and idle."""
    out = {}
    for cpu in a:
        d = [y - x for x, y in zip(a[cpu], b[cpu])]
        total = sum(d[:8]) or 1
        out[cpu] = {"user": round((d[0] + d[1]) / total, 3), "system": round(d[2] / total, 3),
                    "softirq": round((d[5] + d[6]) / total, 3), "idle": round((d[3] + d[4]) / total, 3)}
    return out


def to_peer(tx_args: list[str], mac: str) -> list[str]:
    """testpmd's arguments with `mac` as the frames' destination (the other
    arguments, `--tx-offloads` among them, kept)."""
    return [a for a in tx_args if not a.startswith("--eth-peer=")] + [f"--eth-peer=0,{mac}"]


def frame_len(size: str) -> int:
    """Bytes in a frame of `size` ("1500", "66+1434"; "tso": a 64,054-byte
    super-frame)."""
    return 64_054 if size == "tso" else sum(int(x) for x in size.split("+"))


def summarize(rows: list[dict], transports: list[str], sizes: list[str]) -> list[str]:
    out = ["| size | transport | Mpps min / median / max | Gbit/s (median) | / tap (or tap-intake) | / socket | / dpdk-loop | / vxlan-veth | load before→after |",
           "|---|---|---|---|---|---|---|---|---|"]
    for size in sizes:
        med = {}
        for t in transports:
            v = [r["pps"] for r in rows if r["size"] == size and r["transport"] == t and r["pps"] is not None]
            if v:
                med[t] = statistics.median(v)
        for t in transports:
            v = [r["pps"] for r in rows if r["size"] == size and r["transport"] == t and r["pps"] is not None]
            loads = ", ".join(f"{r['load_before']}→{r['load_after']}" for r in rows if r["size"] == size and r["transport"] == t)
            if not loads:
                continue  # not measured at this size
            if not v:
                out.append(f"| {size} | {t} | failed | - | - | - | - | - | {loads} |")
                continue
            m = med[t]
            ratio = lambda ref: f"{m / med[ref]:.2f}" if med.get(ref) else "-"
            base = "tap-intake" if t.endswith("-intake") else "tap"
            out.append(f"| {size} | {t} | {min(v) / 1e6:.3f} / {m / 1e6:.3f} / {max(v) / 1e6:.3f} | "
                       f"{m * frame_len(size) * 8 / 1e9:.2f} | {ratio(base)} | {ratio('socket')} | {ratio('dpdk-loop')} | {ratio('vxlan-veth')} | {loads} |")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=6)
    ap.add_argument("--sizes", default="64,1500")
    ap.add_argument("--transports", default=",".join(TRANSPORTS))
    ap.add_argument("--underlay-mtu", type=int, default=1500,
                    help="the hosts' LAN MTU: 1528 or more carries a 1500-byte frame in one VNET/P datagram")
    ap.add_argument("--base", help="a folder with another build's vnetd (scripts/build-previous prints one): "
                                   "every point measured with this build and that one in turn, in one run")
    args = ap.parse_args()
    if shutil.which("dpdk-testpmd") is None:
        sys.exit("dpdk-testpmd not found: apt-get install dpdk-dev (scripts/setup does)")
    sizes = args.sizes.split(",")
    transports = args.transports.split(",")
    builds = [("this", None)] + ([("base", str(Path(args.base) / "vnetd"))] if args.base else [])
    labs = {name: Lab(tag=f"vh{name[0]}" if args.base else "vh") for name, _ in builds}
    rows = []
    try:
        benches = {name: Bench(labs[name], binary, args.underlay_mtu, veth=any(t.startswith("vhost-veth") for t in transports),
                               vxlan="vxlan-veth" in transports) for name, binary in builds}
        for rep in range(args.reps):
            for size in sizes:
                order = transports if rep % 2 == 0 else transports[::-1]
                for t in order:
                    if size == "tso" and (not t.startswith("vhost") or t.startswith("vhost-vm")):
                        continue  # only a virtio driver (tso_sender.py) sends super-frames here
                    if t == "vxlan-veth" and (size == "tso" or frame_len(size) - 14 > args.underlay_mtu - 50):
                        continue  # VXLAN's 50 bytes: a packet this long does not fit the underlay unfragmented
                    turn = builds if (rep + len(rows)) % 2 == 0 else builds[::-1]
                    for name, _ in turn:
                        row = {"rep": rep, "size": size, "transport": t, "build": name, "load_before": loadavg()}
                        benches[name].extra = {}
                        row["pps"] = benches[name].measure(t, size, args.seconds)
                        row.update(benches[name].extra)
                        row["load_after"] = loadavg()
                        rows.append(row)
                        print(json.dumps(row), flush=True)
        for build, b in benches.items():
            for name, d in (("h1", b.d1), ("h2", b.d2)):
                st = d.stats()
                rows.append({"vnetd": name, "build": build, "global": st["global"], "offload": st["offload"],
                             "fastpath": st.get("fastpath"), "paths": st.get("paths"),
                             "nics": {k: v for k, v in st.items() if k.startswith("interface")}})
    finally:
        for lab in labs.values():
            lab.close()
    points = [r for r in rows if "pps" in r]
    table = []
    for name, _ in builds:
        if args.base:
            table += ["", f"**{name}** ({args.base if name == 'base' else 'this build'})", ""]
        table += summarize([r for r in points if r["build"] == name], transports, sizes)
    if args.base:
        table += ["", "| size | transport | this / base (medians) |", "|---|---|---|"]
        for size in sizes:
            for t in transports:
                med = {n: [r["pps"] for r in points if (r["size"], r["transport"], r["build"]) == (size, t, n) and r["pps"]] for n, _ in builds}
                if med["this"] and med["base"]:
                    table.append(f"| {size} | {t} | {statistics.median(med['this']) / statistics.median(med['base']):.2f} |")
    stamp = dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    out = BENCH / "results" / f"{stamp}-vhost"
    cmd = "sudo python3 bench/vhost.py " + " ".join(sys.argv[1:])
    out.with_suffix(".json").write_text(json.dumps({"command": cmd, "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(f"# vhost-user frames per second\n\n`{cmd}`\n\n" + "\n".join(table) + "\n")
    print("\n".join(table))
    print(f"wrote {out}.json and .md")


if __name__ == "__main__":
    main()
