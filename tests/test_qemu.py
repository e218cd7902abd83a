"""A real VM (QEMU, TCG) on a TAP that vnetd made with `qemu`, talking
across the overlay to a namespace guest on another host."""

import re
import subprocess
import time

import pytest

from netlab import REPO, guest_mac, mesh_config
from vm import guest
from vm.guest import Console

XFER = REPO / "tests" / "tools" / "xfer.py"
VM_MAC = "52:54:00:00:00:09"
VM_IP = "198.19.0.9"
N = 4_000_000

VM_SCRIPT = guest.exchange_script(N)


@pytest.mark.parametrize("datapath", ["user", "kernel"])
def test_qemu_guest_talks_to_a_namespace_guest_across_hosts(lab, datapath):
    """With `user`, vnetd reads and writes the QEMU TAP; with `kernel`, the
    fast path carries the VM's frames (the namespace guest on the other
    host is a TAP guest, so its host runs them through vnetd either way)."""
    guest.build()
    h1, h2 = lab.add_host(1), lab.add_host(2)
    by_host = {1: [("g1", guest_mac(1))], 2: [("vm9", VM_MAC)]}
    setting = f"SET datapath {datapath}\n"
    cfg2 = mesh_config(2, by_host).replace(f"INTERFACE ADD vm9 {VM_MAC}", f"INTERFACE ADD vm9 {VM_MAC} qemu") + setting
    lab.start_vnetd(h1, mesh_config(1, by_host) + setting)
    d2 = lab.start_vnetd(h2, cfg2)
    assert "attach=qemu" in d2.ctl("INTERFACE", "LIST").stdout
    g1 = lab.attach_guest(h1, "g1", 1)

    recv = lab.popen(g1.ns, "python3", XFER, "recv", 5001, stdout=subprocess.PIPE, text=True)
    assert recv.stdout.readline().strip() == "listening"
    vm = lab.popen(h2, *guest.qemu_command("vm9", VM_MAC, f"{VM_IP}/24", VM_SCRIPT),
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    console = Console(vm)
    console.wait_for("VNET-GUEST-UP")
    console.wait_for("VNET-PING-OK")
    # VM -> namespace guest: the VM's TCP hands QEMU TSO super-frames and
    # partial checksums, which vnetd must finish before they cross the link.
    sum_out = console.wait_for("VNET-SUM-OUT").split()[1]
    console.wait_for("VNET-SENT")
    got = recv.communicate(timeout=60)[0].split()
    assert got == [str(N), sum_out]
    off = d2.stats()["offload"]
    if datapath == "user":
        assert off["segmented"] > 0 and off["segments"] > off["segmented"], off
    else:
        # The kernel encapsulated the VM's super-frames whole.
        f = d2.stats()["fastpath"]
        assert f["hit_guest"] > 100 and f["drop_encap"] == 0, f
    # Namespace guest -> VM.
    assert lab.reaches(g1, type("G", (), {"ip": VM_IP})())
    for _ in range(50):
        sent = lab.x(g1.ns, "python3", XFER, "send", VM_IP, 5002, N, check=False, timeout=120)
        if sent.returncode == 0:
            break
        time.sleep(0.2)
    assert sent.returncode == 0, sent.stderr
    line = console.wait_for("VNET-SUM-IN")
    assert re.search(rf"VNET-SUM-IN {sent.stdout.split()[1]}\s+/tmp/in {N}$", line), (line, sent.stdout)
    console.wait_for("VNET-DONE")
    vm.wait(timeout=30)
    if datapath == "user":
        # The VM's virtio-net left checksums partial (its ACKs, small
        # segments): vnetd finished them in software before they crossed.
        assert d2.stats()["offload"]["checksums"] > 0, d2.stats()["offload"]
    else:
        # Frames to the VM too: decapsulated and handed to QEMU's TAP.
        f = d2.stats()["fastpath"]
        assert f["hit_net"] > 100, f
    # The TAP stays when vnetd stops (SIGTERM leaves the kernel datapath,
    # and QEMU's NIC with it: docs/operations.md), marked as vnetd's for the
    # next one to take over; INTERFACE DEL is what removes it.
    d2.stop()
    assert "vm9" in lab.x(h2, "ip", "-o", "link").stdout
