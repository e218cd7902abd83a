"""A real VM (QEMU, TCG) whose virtio NIC is served by vnetd over
vhost-user: the guest's rings in shared memory, no TAP. It talks across the
overlay to a namespace guest on another host, and keeps talking when vnetd
is killed and started again under it."""

import re
import signal
import subprocess
import time

import pytest

from netlab import REPO, guest_mac, mesh_config
from vm import guest
from vm.guest import Console

XFER = REPO / "tests" / "tools" / "xfer.py"
VM_MAC = "52:54:00:00:00:09"
VM_IP = "198.19.0.9"
N = 20_000_000

VM_SCRIPT = guest.exchange_script(N) + """echo VNET-RESTART-ME
nc -l -p 5003 > /tmp/again
echo "VNET-AGAIN $(cat /tmp/again)"
i=0
until ping -c 1 -W 1 198.19.0.1 >/dev/null; do i=$((i+1)); [ $i -gt 20 ] && break; done
echo VNET-PING-AFTER $i
"""


def send_retrying(lab, g, port, n, attempts=50):
    for _ in range(attempts):
        sent = lab.x(g.ns, "python3", XFER, "send", VM_IP, port, n, check=False, timeout=120)
        if sent.returncode == 0:
            return sent
        time.sleep(0.2)
    raise AssertionError(f"could not send to the VM: {sent.stderr}")


@pytest.mark.parametrize("role", ["server", "client"])
def test_vhost_user_guest_talks_across_hosts_and_survives_a_vnetd_restart(lab, role):
    """`server`: vnetd serves the socket and QEMU reconnects to it;
    `client`: QEMU serves it and vnetd connects (and reconnects)."""
    guest.build()
    h1, h2 = lab.add_host(1), lab.add_host(2)
    sock = lab.tmp / "vm9.sock"
    by_host = {1: [("g1", guest_mac(1))], 2: [("vm9", VM_MAC)]}
    how = f"vhost-user {sock}" + (" client" if role == "client" else "")
    cfg2 = mesh_config(2, by_host).replace(f"INTERFACE ADD vm9 {VM_MAC}", f"INTERFACE ADD vm9 {VM_MAC} {how}")
    cfg2 += "SET interrupts optimistic\n"
    lab.start_vnetd(h1, mesh_config(1, by_host))
    g1 = lab.attach_guest(h1, "g1", 1)
    qemu = guest.qemu_vhost_user_command(sock, VM_MAC, f"{VM_IP}/24", VM_SCRIPT, server=role == "client")
    if role == "client":
        vm = lab.popen(h2, *qemu, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        d2 = lab.start_vnetd(h2, cfg2)
    else:
        d2 = lab.start_vnetd(h2, cfg2)
        vm = lab.popen(h2, *qemu, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    listing = d2.ctl("INTERFACE", "LIST").stdout
    assert "attach=vhost-user" in listing and f"vhost-user={sock}" in listing, listing

    recv = lab.popen(g1.ns, "python3", XFER, "recv", 5001, stdout=subprocess.PIPE, text=True)
    assert recv.stdout.readline().strip() == "listening"
    console = Console(vm)
    console.wait_for("VNET-GUEST-UP")
    console.wait_for("VNET-PING-OK")
    assert "connected=yes" in d2.ctl("INTERFACE", "LIST").stdout

    # VM -> namespace guest: the guest's TCP hands vnetd TSO super-frames
    # and partial checksums in its own memory; vnetd cuts them for the link.
    sum_out = console.wait_for("VNET-SUM-OUT").split()[1]
    console.wait_for("VNET-SENT", timeout=180)
    got = recv.communicate(timeout=60)[0].split()
    assert got == [str(N), sum_out]
    off = d2.stats()["offload"]
    assert off["segmented"] > 0 and off["segments"] > off["segmented"], off

    # Namespace guest -> VM: runs of segments merged back into super-frames
    # (the guest negotiated GSO), written straight into its posted buffers.
    assert lab.reaches(g1, type("G", (), {"ip": VM_IP})())
    sent = send_retrying(lab, g1, 5002, N)
    line = console.wait_for("VNET-SUM-IN", timeout=180)
    assert re.search(rf"VNET-SUM-IN {sent.stdout.split()[1]}\s+/tmp/in {N}$", line), (line, sent.stdout)
    st = d2.stats()["interface vm9"]
    assert st["in_frames"] > 1000 and st["out_frames"] > 1000, st
    assert st["vhost_connects"] == 1 and st["vhost_rx_interrupts"] > 0 and st["vhost_bad_chains"] == 0, st
    assert d2.stats()["offload"]["coalesced"] > 0
    # Optimistic interrupts (set above): every interrupt the guest got for
    # received frames has a reason, and early ones were sent.
    reasons = ("evi_sent", "eoc_masked", "eoc_cold", "eoc_density", "idle_interrupts")
    assert st["evi_sent"] > 0, st
    assert st["vhost_rx_interrupts"] == sum(st[k] for k in reasons) - st["eoc_pending"], st
    # Cut-through: every frame the guest sent is counted in place or copied
    # (with why). A Linux guest's TCP super-frames lie in several buffers
    # (headers, then payload pages): they went gathered, headers copied and
    # payload by iovec, so nearly every byte left uncopied.
    copied = st["tx_copied_small_frames"] + st["tx_copied_scattered_frames"]
    assert st["tx_in_place_frames"] + copied == st["in_frames"], st
    assert st["tx_gathered_frames"] > 100 and st["tx_copied_scattered_frames"] == 0, st
    print("cut-through", {k: v for k, v in st.items() if k.startswith("tx_") or k.startswith("in_")})
    assert st["tx_in_place_bytes"] > 0.9 * (st["in_bytes"] - st["tx_copied_small_bytes"]), st

    # VMM-driven: the dispatcher polls the guest's ring (kicks off); traffic
    # still flows both ways, and the interface says it runs so.
    d2.ctl("INTERFACE", "SET", "vm9", "mode", "vmm-driven")
    before = d2.stats()["interface vm9"]["in_frames"]
    assert lab.reaches(g1, type("G", (), {"ip": VM_IP})())
    st = d2.stats()["interface vm9"]
    assert st["running"] == "vmm-driven" and st["in_frames"] > before, st["running"]

    # vnetd dies under the running guest and a new one takes its place: the
    # VM reconnects (or is reconnected to) without a reboot.
    console.wait_for("VNET-RESTART-ME")
    d2.stop(signal.SIGKILL)
    d2 = lab.start_vnetd(h2, cfg2)
    sent = send_retrying(lab, g1, 5003, 1000)
    console.wait_for("VNET-AGAIN", timeout=60)
    after = console.wait_for("VNET-PING-AFTER", timeout=60)
    assert int(after.split()[1]) <= 20, after
    console.wait_for("VNET-DONE")
    vm.wait(timeout=30)
    st = d2.stats()["interface vm9"]
    assert st["vhost_connects"] >= 1, f"connects {st['vhost_connects']}"
    assert st["in_frames"] > 0 and st["out_frames"] > 0, f"in {st['in_frames']} out {st['out_frames']}"
