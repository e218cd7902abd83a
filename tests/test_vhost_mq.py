"""Multi-queue vhost-user (issue 45): a QEMU guest with `queues=4` and four
vCPUs, whose virtio-net driver runs all four queue pairs by default, and
then two after `ethtool -L eth0 combined 2`. vnetd serves each pair's
transmit queue from a dispatcher of its own (pairs spread over the
dispatchers) and spreads frames for the guest over the receive queues it
runs, by flow."""

import subprocess
import time

from vm import guest
from vm.guest import Console

VM_MAC, VM_IP = guest.VM_MAC, guest.VM_IP

# Eight TCP flows from the VM to g1 at once (each its own connection, so
# the guest's driver picks a transmit queue per flow), the bytes of each
# checked at g1; then the guest runs two pairs only.
SCRIPT = """echo "VNET-CHANNELS $(ethtool -l eth0 | awk '/Combined/ {print $2}' | tr '\\n' ' ')"
ping -c 2 -W 2 198.19.0.1 >/dev/null && echo VNET-PING-OK
for p in 1 2 3 4 5 6 7 8; do
  (head -c 1000000 /dev/urandom > /tmp/f$p; echo "VNET-SUM $p $(sha256sum < /tmp/f$p | cut -c1-16)"
   i=0; until nc 198.19.0.1 600$p < /tmp/f$p; do i=$((i+1)); [ $i -gt 50 ] && break; sleep 0.2; done) &
done
wait
echo VNET-FLOWS-DONE
nc -l -p 5999 > /dev/null
ethtool -L eth0 combined 2 && echo "VNET-NOW $(ethtool -l eth0 | awk '/Combined/ {print $2}' | tail -1)"
nc -l -p 5998 > /dev/null
"""

# g1's side: a listener per port 6001..6008, each connection's bytes hashed.
RECEIVER = """
import hashlib, socket, sys, threading
out = {}
def take(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(1)
    c, _ = s.accept(); h = hashlib.sha256()
    while True:
        b = c.recv(65536)
        if not b: break
        h.update(b)
    out[port - 6000] = h.hexdigest()[:16]
ts = [threading.Thread(target=take, args=(6000 + p,)) for p in range(1, 9)]
[t.start() for t in ts]; print("READY", flush=True); [t.join() for t in ts]
print(" ".join(f"{p}={out[p]}" for p in sorted(out)), flush=True)
"""


def pairs(st, key) -> list[int]:
    return [int(v) for v in str(st["interface vm9"][key]).split(",")]


def udp_flows(lab, g, n):
    """g sends one UDP datagram from each of `n` source ports to the VM."""
    lab.x(g.ns, "python3", "-c",
          "import socket\n"
          f"for p in range(30000, 30000 + {n}):\n"
          "    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(('0.0.0.0', p))\n"
          f"    s.sendto(b'x' * 32, ('{VM_IP}', 9)); s.close()\n")


def knock(lab, g, port):
    for _ in range(100):
        knocked = lab.x(g.ns, "python3", "-c", f"import socket; socket.create_connection(('{VM_IP}', {port}), 2).close()", check=False)
        if knocked.returncode == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"the VM never listened on {port}")


def test_a_vm_with_four_queue_pairs_uses_each_keeps_each_flow_in_order_and_follows_ethtool(lab):
    h2, g1, sock, cfg2 = guest.vhost_user_vm_lab(lab)
    d2 = lab.start_vnetd(h2, cfg2, "--dispatchers", "2")
    recv = lab.popen(g1.ns, "python3", "-c", RECEIVER, stdout=subprocess.PIPE, text=True)
    assert recv.stdout.readline().strip() == "READY"
    ofo0 = lab.x(g1.ns, "nstat", "-az", "TcpExtTCPOFOQueue").stdout
    qemu = guest.qemu_vhost_user_command(sock, VM_MAC, f"{VM_IP}/24", SCRIPT, queues=4)
    vm = lab.popen(h2, *qemu, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    console = Console(vm)
    channels = console.wait_for("VNET-CHANNELS", timeout=120).split()[1:]
    assert channels == ["4", "4"], f"the guest's combined channels (max, current): {channels}"
    console.wait_for("VNET-PING-OK", timeout=60)
    console.wait_for("VNET-FLOWS-DONE", timeout=240)
    got = recv.communicate(timeout=60)[0].split()
    sent = {l.split()[1]: l.split()[2] for l in console.seen if l.startswith("VNET-SUM ")}
    assert dict(w.split("=") for w in got) == sent, (got, sent)
    # Each flow's segments reached g1 in order: none went into TCP's
    # out-of-order queue (one flow's frames never cross two dispatchers).
    ofo = lab.x(g1.ns, "nstat", "-az", "TcpExtTCPOFOQueue").stdout
    print("g1's out-of-order queue, before and after:", ofo0.split()[-2:], ofo.split()[-2:])
    assert int(ofo.split()[-2]) == 0, ofo

    st = d2.stats()
    tx = pairs(st, "vhost_pair_tx_frames")
    print("frames from the VM per transmit queue:", tx)
    assert st["interface vm9"]["vhost_pairs_running"] == 4, st["interface vm9"]
    assert len(tx) == 4 and all(n > 0 for n in tx), f"not every transmit queue carried the flows: {tx}"
    # Frames for the VM: 64 flows spread over its four receive queues.
    udp_flows(lab, g1, 64)
    time.sleep(0.5)
    rx1 = pairs(d2.stats(), "vhost_pair_rx_frames")
    print("frames to the VM per receive queue:", rx1)
    assert len(rx1) == 4 and all(n > 0 for n in rx1), rx1

    # Two pairs: QEMU disables the other two's rings; everything goes to
    # pairs 0 and 1 from then on.
    knock(lab, g1, 5999)
    assert console.wait_for("VNET-NOW", timeout=60).split()[1] == "2"
    deadline = time.time() + 10
    while d2.stats()["interface vm9"]["vhost_pairs_running"] != 2 and time.time() < deadline:
        time.sleep(0.1)
    assert d2.stats()["interface vm9"]["vhost_pairs_running"] == 2, d2.stats()["interface vm9"]
    # (From here: the knock's own segments reached the VM before.)
    time.sleep(0.5)
    rx1 = pairs(d2.stats(), "vhost_pair_rx_frames")
    udp_flows(lab, g1, 64)
    time.sleep(0.5)
    rx2 = pairs(d2.stats(), "vhost_pair_rx_frames")
    print("after ethtool -L combined 2:", rx2)
    more = [b - a for a, b in zip(rx1, rx2)]
    assert more[0] > 0 and more[1] > 0 and more[2] == more[3] == 0 and sum(more) == 64, more
    knock(lab, g1, 5998)
    console.wait_for("VNET-DONE", timeout=60)
    vm.wait(timeout=30)
