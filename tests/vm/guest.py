"""A tiny QEMU guest for end-to-end tests with real VMs.

Built once and cached in target/guest/: Debian's kernel (the uncompressed
vmlinux, which QEMU boots through its PVH entry in a few seconds under TCG)
and an initramfs of busybox, the virtio-net modules, the host's ethtool (with
the libraries it loads: busybox has none, and the driver's own counters, e.g.
how often the guest kicked its transmit queue, are only in `ethtool -S`) and
an init script that runs the commands given on the kernel command line.
"""

from __future__ import annotations

import gzip
import hashlib
import lzma
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

# The VM of the vhost-user tests and benches.
VM_MAC = "52:54:00:00:00:09"
VM_IP = "198.19.0.9"

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / "target" / "guest"
MODULES = ["virtio_ring", "virtio", "virtio_pci_modern_dev", "virtio_pci_legacy_dev", "virtio_pci",
           "failover", "net_failover", "virtio_net",
           "vsock", "vmw_vsock_virtio_transport_common", "vmw_vsock_virtio_transport"]
# Host programs copied in with the shared libraries `ldd` names for them.
# socat: the guest's vsock client and listener (busybox has none).
PROGRAMS = ["/usr/sbin/ethtool", "/usr/bin/socat"]

INIT = r"""#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /tmp /bin /sbin
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sys /sys
/bin/busybox mount -t devtmpfs dev /dev
/bin/busybox --install -s /bin
arg() { sed -n "s/.*vnet\.$1=\([^ ]*\).*/\1/p" /proc/cmdline; }
# A module's parameters, if any: vnet.<module>=<p1=v1,p2=v2>.
for m in %(modules)s; do insmod /lib/$m.ko $(arg $m | tr , ' ') || echo "VNET-ERROR insmod $m"; done
ip link set lo up
ip link set eth0 up
ip addr add "$(arg ip)" dev eth0
echo VNET-GUEST-UP
# The test's script, base64 on the command line.
arg script | base64 -d > /tmp/script
sh /tmp/script
echo VNET-DONE
poweroff -f
"""


def _cpio_newc(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A newc cpio archive of (path, mode, data) entries."""
    out = bytearray()
    for ino, (name, mode, data) in enumerate(entries + [("TRAILER!!!", 0, b"")], start=1):
        rdev = (5, 1) if name == "dev/console" else (0, 0)
        nb = name.encode() + b"\0"
        hdr = "070701" + "".join(f"{v:08x}" for v in (
            ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(nb), 0))
        out += hdr.encode() + nb
        out += b"\0" * (-len(out) % 4)
        out += data
        out += b"\0" * (-len(out) % 4)
    return bytes(out)


def _programs() -> list[tuple[str, int, bytes]]:
    """cpio entries for PROGRAMS (in /bin) and every library they load, at
    the paths the dynamic loader looks for them (as on the host)."""
    entries, dirs, libs = [], set(), set()
    for prog in PROGRAMS:
        entries.append((f"bin/{Path(prog).name}", 0o100755, Path(prog).read_bytes()))
        out = subprocess.run(["ldd", prog], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            path = next((w for w in line.split() if w.startswith("/")), None)
            if path:
                libs.add(path)
    for lib in sorted(libs):
        parts = Path(lib).parts[1:]
        for i in range(1, len(parts)):
            dirs.add("/".join(parts[:i]))
        entries.append(("/".join(parts), 0o100755, Path(lib).resolve().read_bytes()))
    return [(d, 0o40755, b"") for d in sorted(dirs) if d != "lib"] + entries


def _kernel_package() -> str:
    deps = subprocess.run(["apt-cache", "depends", "linux-image-amd64"], capture_output=True, text=True,
                          check=True).stdout
    for line in deps.splitlines():
        word = line.split(":")[-1].strip()
        if line.strip().startswith("Depends:") and word.startswith("linux-image-"):
            return word
    raise RuntimeError("cannot find the kernel package linux-image-amd64 depends on")


def build() -> tuple[Path, Path]:
    """Returns (vmlinux, initramfs), building them if not cached."""
    key = hashlib.sha256((INIT + " ".join(MODULES + PROGRAMS)).encode()).hexdigest()[:12]
    vmlinux, initrd = CACHE / "vmlinux", CACHE / f"initramfs-{key}.cpio.gz"
    if vmlinux.exists() and initrd.exists():
        return vmlinux, initrd
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        os.chmod(tmp, 0o777)  # apt-get download runs as _apt
        subprocess.run(["apt-get", "download", "-qq", _kernel_package()], cwd=tmp, check=True,
                       capture_output=True)
        deb = next(tmp.glob("linux-image-*.deb"))
        subprocess.run(["dpkg-deb", "-x", deb, tmp / "x"], check=True)
        vmlinuz = next((tmp / "x" / "boot").glob("vmlinuz-*")).read_bytes()
        at = vmlinuz.find(b"\xfd7zXZ\x00")
        if at < 0:
            raise RuntimeError("vmlinuz holds no xz payload")
        raw = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(vmlinuz[at:])
        tmp_vmlinux = CACHE / "vmlinux.tmp"
        if not vmlinux.exists():
            tmp_vmlinux.write_bytes(raw)
        mods = {p.stem: p for p in (tmp / "x" / "lib" / "modules").rglob("*.ko")}
        busybox = Path(shutil.which("busybox") or "/bin/busybox").read_bytes()
        entries = [(d, 0o40755, b"") for d in ("bin", "dev", "lib", "proc", "sys", "tmp")]
        entries.append(("dev/console", 0o20600, b""))
        entries.append(("bin/busybox", 0o100755, busybox))
        entries.append(("init", 0o100755, (INIT % {"modules": " ".join(MODULES)}).encode()))
        for m in MODULES:
            entries.append((f"lib/{m}.ko", 0o100644, mods[m].read_bytes()))
        entries += _programs()
        (CACHE / "initramfs.tmp").write_bytes(gzip.compress(_cpio_newc(entries), 1))
        (CACHE / "initramfs.tmp").rename(initrd)
        if not vmlinux.exists():
            tmp_vmlinux.rename(vmlinux)
    return vmlinux, initrd


def qemu_command(tap: str, mac: str, ip_cidr: str, script: str, mem_mb: int = 256) -> list[str]:
    """QEMU (TCG) booting the guest on a TAP that vnetd made with `qemu`."""
    import base64

    vmlinux, initrd = build()
    b64 = base64.b64encode(script.encode()).decode()
    return [
        "qemu-system-x86_64", "-accel", "tcg", "-cpu", "max", "-m", str(mem_mb), "-smp", "1",
        "-nodefaults", "-no-user-config", "-display", "none", "-serial", "stdio", "-no-reboot",
        "-kernel", str(vmlinux), "-initrd", str(initrd),
        "-append", f"console=ttyS0 panic=-1 quiet vnet.ip={ip_cidr} vnet.script={b64}",
        "-netdev", f"tap,id=n0,ifname={tap},script=no,downscript=no",
        "-device", f"virtio-net-pci,netdev=n0,mac={mac},romfile=",
    ]


def qemu_vhost_user_command(sock, mac: str, ip_cidr: str, script: str, mem_mb: int = 256,
                            server: bool = False, module_args: dict[str, str] | None = None,
                            host_mtu: int | None = None, queues: int = 1, vsock=None) -> list[str]:
    """QEMU (TCG) booting the guest on a vhost-user virtio-net device whose
    backend is at `sock`: QEMU connects there (and reconnects each second
    when the backend restarts), or with `server` listens there for the
    backend. Guest memory must be shared (memfd); `vectors=0` because QEMU
    7.2 under TCG crashes setting up MSI-X for vhost-user. `module_args`:
    parameters for the guest's modules, e.g. {"virtio_net": "napi_tx=0"}.
    `host_mtu`: the MTU QEMU gives the guest's NIC. `queues`: queue pairs
    (multi-queue, `mq=on`), with as many vCPUs, so that the guest's driver
    uses them all by default. `vsock`: the socket of a vhost-user vsock
    device for the VM too (vnetd's `<socket>.vsock`)."""
    import base64

    vmlinux, initrd = build()
    b64 = base64.b64encode(script.encode()).decode()
    mods = "".join(f" vnet.{m}={a.replace(' ', ',')}" for m, a in (module_args or {}).items())
    chardev = f"socket,id=c0,path={sock}," + ("server=on,wait=off" if server else "reconnect=1")
    return [
        "qemu-system-x86_64", "-accel", "tcg", "-cpu", "max", "-m", str(mem_mb), "-smp", str(queues),
        "-nodefaults", "-no-user-config", "-display", "none", "-serial", "stdio", "-no-reboot",
        "-object", f"memory-backend-memfd,id=mem,size={mem_mb}M,share=on", "-numa", "node,memdev=mem",
        "-kernel", str(vmlinux), "-initrd", str(initrd),
        "-append", f"console=ttyS0 panic=-1 quiet vnet.ip={ip_cidr}{mods} vnet.script={b64}",
        "-chardev", chardev,
        "-netdev", "vhost-user,id=n0,chardev=c0" + (f",queues={queues}" if queues > 1 else ""),
        "-device", f"virtio-net-pci,netdev=n0,vectors=0,mac={mac},romfile=" + (f",host_mtu={host_mtu}" if host_mtu else "")
        + (",mq=on" if queues > 1 else ""),
    ] + ([] if vsock is None else [
        "-chardev", f"socket,id=vs0,path={vsock}",  # connected at start: the device is set up before QEMU runs the guest
        "-device", "vhost-user-vsock-pci,chardev=vs0,vectors=0",
    ])


def vhost_user_vm_lab(lab, attach_opts: str = ""):
    """The two hosts of the vhost-user VM tests and benches: host 1's vnetd
    running with namespace guest g1, and host 2's config giving the VM
    (VM_MAC) the vhost-user socket vm9.sock (`attach_opts`: more words for
    its INTERFACE ADD, e.g. " client"); host 2's vnetd not started, since
    whether it or the VM comes first is the caller's. Builds the guest
    image. Returns (h2, g1, sock, cfg2)."""
    from netlab import guest_mac, mesh_config

    build()
    h1, h2 = lab.add_host(1), lab.add_host(2)
    sock = lab.tmp / "vm9.sock"
    by_host = {1: [("g1", guest_mac(1))], 2: [("vm9", VM_MAC)]}
    cfg2 = mesh_config(2, by_host).replace(f"INTERFACE ADD vm9 {VM_MAC}", f"INTERFACE ADD vm9 {VM_MAC} vhost-user {sock}{attach_opts}")
    lab.start_vnetd(h1, mesh_config(1, by_host))
    g1 = lab.attach_guest(h1, "g1", 1)
    return h2, g1, sock, cfg2


# The guest's own counters, as `kicks=<n> irqs=<n>`: how often its driver
# kicked the transmit queue (virtio_net's ethtool statistics) and the
# interrupts its virtio device raised (/proc/interrupts; under TCG the device
# has no MSI-X, vectors=0, so one line counts every queue's).
COUNTS = r"""counts() {
  k=$(ethtool -S eth0 | awk '/tx_queue_0_kicks:/ {print $2}')
  i=$(grep virtio /proc/interrupts | awk '{for (f = 2; f <= NF; f++) if ($f ~ /^[0-9]+$/) s += $f} END {print s + 0}')
  echo "kicks=$k irqs=$i"
}
"""


def parse_counts(line: str) -> dict[str, int]:
    """{"kicks": .., "irqs": ..} from a console line printed with counts()."""
    return {k: int(v) for k, v in (w.split("=") for w in line.split() if "=" in w)}


def exchange_script(n: int, counted: bool = False) -> str:
    """The VM's half of a two-way check with a namespace guest at
    198.19.0.1: ping it, send it `n` random bytes on port 5001, then take
    what it sends on 5002; the console says VNET-PING-OK, VNET-SUM-OUT <sha>,
    VNET-SENT and VNET-SUM-IN <sha> <file> <bytes>. `counted`: also
    VNET-COUNTS-{OUT,IN}-{BEFORE,AFTER} kicks=<n> irqs=<n> (COUNTS) just
    before and after each direction's transfer (IN-BEFORE once it is about
    to listen, before anything is sent to it)."""
    c = (lambda tag: f'echo "VNET-COUNTS-{tag} $(counts)"\n') if counted else (lambda tag: "")
    return (COUNTS if counted else "") + f"""
ping -c 2 -W 2 198.19.0.1 >/dev/null && echo VNET-PING-OK
head -c {n} /dev/urandom > /tmp/out
echo "VNET-SUM-OUT $(sha256sum /tmp/out)"
{c("OUT-BEFORE")}i=0
until nc 198.19.0.1 5001 < /tmp/out; do i=$((i+1)); [ $i -gt 50 ] && break; sleep 0.2; done
{c("OUT-AFTER")}echo VNET-SENT
{c("IN-BEFORE")}nc -l -p 5002 > /tmp/in
{c("IN-AFTER")}echo "VNET-SUM-IN $(sha256sum /tmp/in) $(wc -c < /tmp/in)"
"""


class Console:
    """A VM's serial console, read line by line without blocking the test."""

    def __init__(self, proc):
        self.lines = queue.Queue()
        self.seen = []
        threading.Thread(target=self._pump, args=(proc,), daemon=True).start()

    def _pump(self, proc):
        for line in proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def wait_for(self, marker, timeout=90):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                continue
            self.seen.append(line)
            if marker in line:
                return line
        raise AssertionError(f"VM never printed {marker}; console:\n" + "\n".join(self.seen[-40:]))


if __name__ == "__main__":
    print(build())
