"""VTOE for VMs, its first part: a QEMU guest's vsock device served by
vnetd itself (`INTERFACE ADD ... vhost-user <socket> vsock <cid>`), its
AF_VSOCK streams to the host carried to host programs on Unix sockets (the
hybrid vsock convention: docs/vtoe.md), bytes intact both ways."""

import hashlib
import os
import socket
import subprocess
import threading

from vm import guest
from vm.guest import Console

N = 3_000_000
CID = 7

VM_SCRIPT = f"""
head -c {N} /dev/urandom > /tmp/out
echo "VNET-SUM-OUT $(sha256sum /tmp/out)"
i=0
until socat -u FILE:/tmp/out VSOCK-CONNECT:2:5003; do i=$((i+1)); [ $i -gt 50 ] && break; sleep 0.2; done
echo VNET-SENT
socat -u VSOCK-LISTEN:5004 CREATE:/tmp/in &
echo VNET-LISTENING
wait
echo "VNET-SUM-IN $(sha256sum /tmp/in) $(wc -c < /tmp/in)"
"""


def _serve_once(path, got):
    """Listens on `path`; the first connection's bytes go to `got`."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen(1)

    def run():
        c, _ = s.accept()
        h, n = hashlib.sha256(), 0
        while True:
            b = c.recv(1 << 16)
            if not b:
                break
            h.update(b)
            n += len(b)
        got.append((n, h.hexdigest()))
        c.close()
        s.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _connect_to_guest(path, port, data, tries=100):
    """The hybrid convention from the host: CONNECT <port>, OK <host port>,
    then the stream; half-closed once `data` is sent."""
    import time

    for _ in range(tries):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(path))
        s.sendall(f"CONNECT {port}\n".encode())
        line = b""
        while not line.endswith(b"\n"):
            b = s.recv(1)
            if not b:
                break
            line += b
        if line.startswith(b"OK "):
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            s.recv(1)  # the guest's close
            s.close()
            return line.decode().strip()
        s.close()
        time.sleep(0.2)
    raise AssertionError(f"the guest's port {port} never accepted: last answer {line!r}")


def test_a_vms_vsock_streams_reach_host_programs_both_ways(lab):
    h2, _g1, sock, cfg2 = guest.vhost_user_vm_lab(lab, f" vsock {CID}")
    d2 = lab.start_vnetd(h2, cfg2)
    vsock_sock, host = lab.tmp / "vm9.sock.vsock", lab.tmp / "vm9.sock.vsock-host"
    assert vsock_sock.exists() and host.exists()
    assert oct(os.stat(vsock_sock).st_mode & 0o777) == "0o600"
    got = []
    t = _serve_once(lab.tmp / "vm9.sock.vsock-host_5003", got)
    vm = lab.popen(h2, *guest.qemu_vhost_user_command(sock, guest.VM_MAC, f"{guest.VM_IP}/24", VM_SCRIPT, vsock=vsock_sock),
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    console = Console(vm)
    console.wait_for("VNET-GUEST-UP")
    sum_out = console.wait_for("VNET-SUM-OUT").split()[1]
    console.wait_for("VNET-SENT", timeout=120)
    t.join(timeout=30)
    assert got == [(N, sum_out)], (got, sum_out)

    console.wait_for("VNET-LISTENING")
    data = os.urandom(N)
    ok = _connect_to_guest(host, 5004, data)
    line = console.wait_for("VNET-SUM-IN", timeout=120)
    assert line.split()[1:4:2] == [hashlib.sha256(data).hexdigest(), str(N)], line
    st = d2.stats()["interface vm9"]
    assert st["vsock_cid"] == CID, st
    # The host's first tries may come before the guest listens: refused.
    assert st["vsock_guest_connects"] >= 1 and st["vsock_host_connects"] - st["vsock_guest_refused"] == 1, st
    assert st["vsock_bytes_to_host"] >= N and st["vsock_bytes_to_guest"] == N, st
    assert st["vsock_bad_packets"] == 0 and st["vsock_credit_violations"] == 0, st
    assert ok.startswith("OK ")
    console.wait_for("VNET-DONE")
    vm.wait(timeout=30)
