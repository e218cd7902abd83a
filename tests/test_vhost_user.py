"""A real VM (QEMU, TCG) whose virtio NIC is served by vnetd over
vhost-user: the guest's rings in shared memory, no TAP. It talks across the
overlay to a namespace guest on another host, and keeps talking when vnetd
is killed and started again under it."""

import re
import signal
import subprocess
import time

import pytest

from netlab import REPO
from vm import guest
from vm.guest import Console, parse_counts

XFER = REPO / "tests" / "tools" / "xfer.py"
VM_MAC, VM_IP = guest.VM_MAC, guest.VM_IP
N = 20_000_000

VM_SCRIPT = guest.exchange_script(N, counted=True) + """echo "VNET-COUNTS-IN2-BEFORE $(counts)"
nc -l -p 5004 > /tmp/in
echo "VNET-COUNTS-IN2-AFTER $(counts)"
echo "VNET-SUM-IN2 $(sha256sum /tmp/in) $(wc -c < /tmp/in)"
echo VNET-RESTART-ME
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


@pytest.mark.parametrize("role,mode", [("server", "guest-driven"), ("client", "vmm-driven")])
def test_vhost_user_guest_talks_across_hosts_and_survives_a_vnetd_restart(lab, role, mode):
    """`server`: vnetd serves the socket and QEMU reconnects to it;
    `client`: QEMU serves it and vnetd connects (and reconnects). The 20 MB
    each way run guest-driven in the first, VMM-driven in the second (set at
    run time, as the guest comes up), and the guest's own counters say which
    it was: kicks for every frame, or none while vnetd polled.

    Catches (each tried on a mutated vnetd): VMM-driven that still asks the
    guest for kicks (`set_notify` keeping `kicks_on`: the guest kicked 650
    times in the 20 MB); an interrupt sent to the guest for received frames
    and not counted (`flush`'s `rx_interrupts` increment removed: the guest
    got 242 interrupts, vnetd counted 0)."""
    h2, g1, sock, cfg2 = guest.vhost_user_vm_lab(lab, " client" if role == "client" else "")
    # The guest's transmit interrupts off (virtio_net napi_tx=0: it frees
    # sent buffers as it sends more): its one interrupt line then counts
    # nearly only what vnetd sent for received frames.
    qemu = guest.qemu_vhost_user_command(sock, VM_MAC, f"{VM_IP}/24", VM_SCRIPT, server=role == "client",
                                         module_args={"virtio_net": "napi_tx=0"})
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
    if mode == "vmm-driven":
        # The guest's rings are live: switched at run time.
        d2.ctl("INTERFACE", "SET", "vm9", "mode", "vmm-driven")
    console.wait_for("VNET-PING-OK")
    assert "connected=yes" in d2.ctl("INTERFACE", "LIST").stdout

    # VM -> namespace guest: the guest's TCP hands vnetd TSO super-frames
    # and partial checksums in its own memory; vnetd cuts them for the link.
    sum_out = console.wait_for("VNET-SUM-OUT").split()[1]
    c0 = parse_counts(console.wait_for("VNET-COUNTS-OUT-BEFORE"))
    s0 = d2.stats()
    c1 = parse_counts(console.wait_for("VNET-COUNTS-OUT-AFTER", timeout=180))
    s1 = d2.stats()
    console.wait_for("VNET-SENT")
    got = recv.communicate(timeout=60)[0].split()
    assert got == [str(N), sum_out]
    off = d2.stats()["offload"]
    assert off["segmented"] > 0 and off["segments"] > off["segmented"], off
    # The mode, seen from both sides: guest-driven, the guest kicked its
    # transmit queue for about every frame and nothing polled; VMM-driven,
    # vnetd polled the ring (busy passes) and the guest never kicked (at
    # most once, crossing the avail_event vnetd left when it stopped asking).
    frames = s1["interface vm9"]["in_frames"] - s0["interface vm9"]["in_frames"]
    kicks = c1["kicks"] - c0["kicks"]
    busy = s1["dispatch"]["busy_passes"] - s0["dispatch"]["busy_passes"]
    assert s0["interface vm9"]["running"] == s1["interface vm9"]["running"] == mode, s1["interface vm9"]
    assert frames > 1000, frames
    if mode == "guest-driven":
        assert kicks > frames // 4 and s1["dispatch"]["busy_passes"] == 0, (kicks, frames, s1["dispatch"])
    else:
        assert kicks <= 1 and busy > 10, (kicks, frames, busy)

    # Namespace guest -> VM, twice (plain interrupts, then optimistic):
    # runs of segments merged back into super-frames (the guest negotiated
    # GSO), written straight into its posted buffers. The guest's interrupt
    # count across each is compared with vnetd's.
    def receive(port, tag):
        before = parse_counts(console.wait_for(f"VNET-COUNTS-{tag}-BEFORE"))
        r0 = d2.stats()["interface vm9"]
        sent = send_retrying(lab, g1, port, N)
        after = parse_counts(console.wait_for(f"VNET-COUNTS-{tag}-AFTER", timeout=180))
        r1 = d2.stats()["interface vm9"]
        line = console.wait_for(f"VNET-SUM-{tag} ", timeout=60)
        assert re.search(rf"VNET-SUM-{tag} {sent.stdout.split()[1]}\s+/tmp/in {N}$", line), (line, sent.stdout)
        d = {k: r1[k] - r0[k] for k in r1 if isinstance(r1[k], int)}
        print(tag, "guest interrupts", after["irqs"] - before["irqs"], {k: d[k] for k in (
            "vhost_rx_interrupts", "vhost_tx_interrupts", "evi_sent", "idle_interrupts", "eoc_pending", "out_frames")})
        return after["irqs"] - before["irqs"], d

    # Plain (the default): vnetd interrupts the guest at the end of a pass
    # when its event index asks, and it asks again once it has taken the
    # interrupt; so the guest gets what vnetd counts (its transmit
    # interrupts are off: napi_tx=0), never more (slack 2: a stray frame
    # between the guest's read of its counter and vnetd's), and nearly all
    # (seen: all guest-driven, 2 of 294 fewer VMM-driven): a guest that
    # re-arms from its poll loop can ask again before QEMU read the last
    # write to the eventfd, and QEMU raises one interrupt for both.
    irqs, d = receive(5002, "IN")
    counted = d["vhost_rx_interrupts"] + d["vhost_tx_interrupts"]
    assert d["out_frames"] > 1000 and irqs > 10, (irqs, d)
    assert 0.95 * counted <= irqs <= counted + 2, (irqs, d)
    assert d2.stats()["offload"]["coalesced"] > 0

    # Optimistic: every interrupt for received frames is counted by reason
    # (early, end of the pass, at the idle point, inside a long burst where
    # the guest's event index asked; minus those held while the early one
    # was unread: CI once saw one more than the rest, before the mid-burst
    # ones had their own counter). The guest gets fewer than vnetd sends: a write
    # to an interrupt eventfd QEMU has not read yet (an idle-point interrupt
    # right after an early one) adds nothing. But it got at least every
    # early interrupt (EVI): one is sent only to a guest waiting for one
    # (slack 2, as above: the guest reads its counter before vnetd's are
    # read, and a stray frame between the two reads may bring an EVI the
    # guest has not counted; seen once: 275 EVIs, 274 interrupts).
    d2.ctl("SET", "interrupts", "optimistic")
    irqs, d = receive(5004, "IN2")
    reasons = ("evi_sent", "eoc_masked", "eoc_cold", "eoc_density", "idle_interrupts", "vhost_rx_mid_burst_interrupts")
    assert d["vhost_rx_interrupts"] == sum(d[k] for k in reasons) - d["eoc_pending"], d
    assert 0 < d["evi_sent"] <= irqs + 2 and irqs <= d["vhost_rx_interrupts"] + d["vhost_tx_interrupts"] + 2, (irqs, d)
    # And fewer than vnetd counted (the review's P5: "about half" in
    # docs/vhost-user.md): interrupts written to an eventfd QEMU had not
    # read yet reached the guest as one.
    counted = d["vhost_rx_interrupts"] + d["vhost_tx_interrupts"]
    print(f"optimistic: the guest took {irqs} interrupts of {counted} vnetd sent ({irqs / max(counted, 1):.2f})")
    assert irqs < counted, (irqs, d)
    st = d2.stats()["interface vm9"]
    assert st["vhost_connects"] == 1 and st["vhost_bad_chains"] == 0, st

    # Cut-through: every frame the guest sent is counted in place or copied
    # (with why). A Linux guest's TCP super-frames lie in several buffers
    # (headers, then payload pages): they went gathered, their heads (the
    # 66 bytes of headers) copied and the payload by iovec: every byte of
    # the frames above 256 bytes left uncopied but the heads.
    copied = st["tx_copied_small_frames"] + st["tx_copied_scattered_frames"]
    assert st["tx_in_place_frames"] + copied == st["in_frames"], st
    assert st["tx_gathered_frames"] > 100 and st["tx_copied_scattered_frames"] == 0, st
    print("cut-through", {k: v for k, v in st.items() if k.startswith("tx_") or k.startswith("in_")})
    big = st["in_bytes"] - st["tx_copied_small_bytes"]
    assert st["tx_in_place_bytes"] + st["tx_head_copied_bytes"] == big, st
    assert st["tx_in_place_bytes"] >= 0.93 * big, st

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


def test_a_vm_takes_the_mtu_qemu_gives_it_and_its_full_frames_cross_in_one_datagram(lab):
    """The recipe for a VM on a 1500-byte underlay (docs/vhost-user.md): QEMU's
    `host_mtu` of 1500 - 42 (Ethernet, IPv4, UDP) = 1458, which QEMU serves
    in the virtio config space itself (vnetd needs no part in it). The
    guest's driver takes it, and the guest's biggest frames (1472 bytes)
    then cross in one datagram each: nothing fragmented. Without it a VM's
    1500-byte packets cross as two IP fragments each, which the kernel fast
    path never takes."""
    h2, _, sock, cfg2 = guest.vhost_user_vm_lab(lab)
    d2 = lab.start_vnetd(h2, cfg2)
    script = """echo "VNET-MTU $(cat /sys/class/net/eth0/mtu)"
ping -c 3 -W 2 -s 1430 198.19.0.1 >/dev/null && echo VNET-FULL-OK
ping -c 3 -W 2 -s 1000 198.19.0.1 >/dev/null && echo VNET-SMALL-OK
echo VNET-PINGS-DONE
"""
    qemu = guest.qemu_vhost_user_command(sock, VM_MAC, f"{VM_IP}/24", script, host_mtu=1458)
    vm = lab.popen(h2, *qemu, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    console = Console(vm)
    assert console.wait_for("VNET-MTU").split()[1] == "1458"
    console.wait_for("VNET-PINGS-DONE", timeout=60)
    assert any("VNET-FULL-OK" in l for l in console.seen) and any("VNET-SMALL-OK" in l for l in console.seen), console.seen[-10:]
    # 1458-byte IP packets, 1472-byte frames: each one datagram of 1500.
    st = d2.stats()
    assert st["offload"]["fragmented"] == 0, st["offload"]
    assert st["interface vm9"]["in_frames"] >= 6, st["interface vm9"]
    console.wait_for("VNET-DONE")
    vm.wait(timeout=30)
