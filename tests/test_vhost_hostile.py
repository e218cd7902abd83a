"""Guest memory as an attack surface: a vhost-user frontend (tools/
vhost_frontend.py, a driver written from the spec) that breaks its rings,
descriptors, memory table and messages on purpose, at a vnetd that also
carries a legitimate exchange. vnetd keeps running and forwarding, returns
every chain it takes, counts what it refused, and writes nothing outside
the buffers it was given."""

import os
import signal
import struct
import subprocess
import sys
import time

from netlab import REPO, guest_mac, mesh_config, wait_until

sys.path.insert(0, str(REPO / "tests" / "tools"))
import vhost_frontend as vf  # noqa: E402

FE_MAC = "52:54:00:00:00:fe"
ETHERTYPE = b"\x88\xb5"


def mac(s):
    return bytes.fromhex(s.replace(":", ""))


def rx_packets(lab, g):
    return int(lab.x(g.ns, "cat", f"/sys/class/net/{g.tap}/statistics/rx_packets").stdout)


def cpu_ticks(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])


class Lab2:
    def __init__(self, lab, *vnetd_args):
        self.lab = lab
        h1, h2 = lab.add_host(1), lab.add_host(2)
        self.sock = lab.tmp / "fe.sock"
        by_host = {1: [("g1", guest_mac(1))], 2: [("fe", FE_MAC)]}
        self.h2, self.cfg2 = h2, mesh_config(2, by_host, attach={"fe": f"vhost-user {self.sock}"})
        self.d1 = lab.start_vnetd(h1, mesh_config(1, by_host))
        self.d2 = lab.start_vnetd(h2, self.cfg2, *vnetd_args)
        self.g1 = lab.attach_guest(h1, "g1", 1)
        self.tag = 0

    def alive(self):
        assert self.d2.proc.poll() is None, self.d2.log_text()[-2000:]
        assert self.d2.ctl("SHOW").returncode == 0

    def fe(self):
        return self.d2.stats()["interface fe"]

    def connect(self, **kw):
        f = vf.Frontend(self.sock, **kw)
        f.post_rx()
        assert wait_until(lambda: "connected=yes" in self.d2.ctl("INTERFACE", "LIST").stdout, 5)
        return f

    def from_g1(self, frame: bytes):
        """The namespace guest sends `frame` (to the frontend, if it is
        addressed there)."""
        self.lab.x(self.g1.ns, "python3", "-c",
                   "import socket; s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW); "
                   f"s.bind(('{self.g1.tap}', 0)); s.send(bytes.fromhex('{frame.hex()}'))")

    def frame(self, tag: int, size=46) -> bytes:
        """An Ethernet frame from the frontend to the namespace guest."""
        return mac(self.g1.mac) + mac(FE_MAC) + ETHERTYPE + struct.pack("<I", tag) + bytes((tag + i) % 251 for i in range(size))

    def sniff(self, n, timeout=8.0) -> "Sniffer":
        return Sniffer(self.lab, self.g1, n, timeout)

    def exchange(self, f, head=0):
        """A frame each way between the frontend and the namespace guest."""
        self.tag += 1
        before = rx_packets(self.lab, self.g1)
        f.send_frame(mac(self.g1.mac) + mac(FE_MAC) + ETHERTYPE + struct.pack("<I", self.tag) + bytes(46), head)
        assert wait_until(lambda: rx_packets(self.lab, self.g1) > before, 5), "frontend -> guest"
        payload = struct.pack("<I", self.tag) + b"from-g1" + bytes(39)
        self.from_g1(mac(FE_MAC) + mac(self.g1.mac) + ETHERTYPE + payload)
        got = []
        assert wait_until(lambda: got.extend(f.received()) or any(payload in g for g in got), 5), "guest -> frontend"


SNIFF = r"""
import socket, sys, time
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x88b5))
s.bind((sys.argv[1], 0))
s.settimeout(0.2)
n, end = int(sys.argv[2]), time.time() + float(sys.argv[3])
print("ready", flush=True)
while n and time.time() < end:
    try:
        f, addr = s.recvfrom(70000)
    except socket.timeout:
        continue
    if addr[2] != socket.PACKET_OUTGOING:
        print(f.hex(), flush=True)
        n -= 1
"""


class Sniffer:
    """The frames of ETHERTYPE a namespace guest receives (up to `n`, for at
    most `timeout` seconds), as they arrived."""

    def __init__(self, lab, g, n, timeout):
        self.p = lab.popen(g.ns, "python3", "-c", SNIFF, g.tap, n, timeout, stdout=subprocess.PIPE, text=True)
        assert self.p.stdout.readline().strip() == "ready"

    def frames(self) -> list[bytes]:
        return [bytes.fromhex(line) for line in self.p.communicate(timeout=30)[0].split()]


def test_a_hostile_frontend_breaks_nothing_but_its_own_frames(lab):
    t = Lab2(lab)
    f = t.connect()
    t.exchange(f)
    base = 0x20000  # a buffer the attacks point at

    # Transmit chains that cannot be read: each is returned to the guest
    # unread and counted (`bad`), and the next legitimate frame still goes.
    attacks = {
        "outside memory": lambda h: f.desc(1, h, 1 << 40, 100),
        "write-only": lambda h: f.desc(1, h, base, 100, vf.D_WRITE),
        "indirect table outside memory": lambda h: f.desc(1, h, 1 << 40, 32, vf.D_INDIRECT),
        "nested indirect": lambda h: (f.mem.__setitem__(slice(base, base + 16), struct.pack("<QIHH", base, 64, vf.D_INDIRECT, 0)),
                                      f.desc(1, h, base, 16, vf.D_INDIRECT)),
    }
    for what, make in attacks.items():
        bad, used = t.fe()["vhost_bad_chains"], f.used_idx(1)
        make(4)
        f.offer(1, 4)
        assert wait_until(lambda: f.used_idx(1) != used, 5), f"{what}: chain not returned"
        t.alive()
        assert t.fe()["vhost_bad_chains"] > bad, what
        t.exchange(f)

    # A looping chain (4 -> 5 -> 4 ...) is cut at the queue's size (16
    # descriptors, virtio-queue's bound) and taken as the frame they make:
    # the 50 bytes at `base` 16 times over, less the virtio-net header.
    # Catches a chain cut anywhere else (e.g. at its first repeat: 2).
    block = bytes(vf.HDR) + t.frame(0x100, size=20)
    assert len(block) == 50
    f.mem[base:base + 50] = block
    sniff, used = t.sniff(1), f.used_idx(1)
    f.desc(1, 4, base, 50, vf.D_NEXT, 5)
    f.desc(1, 5, base, 50, vf.D_NEXT, 4)
    f.offer(1, 4)
    assert wait_until(lambda: f.used_idx(1) != used, 5), "loop: chain not returned"
    assert sniff.frames() == [(block * vf.SIZE)[vf.HDR:]]
    t.alive()
    t.exchange(f)

    # A frame too big for any Ethernet frame vnetd takes (70 KB) and one of
    # nothing but its header: both taken, dropped and counted.
    big = t.fe()["drop_oversize"]
    f.desc(1, 4, 0x30000, 40000, vf.D_NEXT, 5)
    f.desc(1, 5, 0x30000 + 40000, 30000)
    f.offer(1, 4)
    assert wait_until(lambda: t.fe()["drop_oversize"] > big, 5)
    runt = t.d2.stats()["global"]["drop_malformed"]
    f.desc(1, 4, base, vf.HDR)
    f.offer(1, 4)
    assert wait_until(lambda: t.d2.stats()["global"]["drop_malformed"] > runt, 5)
    t.exchange(f)

    # Receive buffers the guest cannot be written to (read-only): frames
    # for it are dropped and counted, and the memory around stays untouched.
    # (Receive buffers outside its memory: test_bad_protocol_messages_...)
    sentinel = b"\xa5" * 64
    f.mem[0x40000:0x40040] = sentinel
    for i in range(vf.SIZE):
        f.desc(0, i, 0x40000, 64, 0)  # no WRITE flag
        f.offer(0, i, kick=False)
    full = t.fe()["drop_queue_full"]
    frame = mac(FE_MAC) + mac(t.g1.mac) + ETHERTYPE + bytes(50)
    lab.x(t.g1.ns, "python3", "-c", "import socket; s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW); "
          f"s.bind(('{t.g1.tap}', 0)); s.send(bytes.fromhex('{frame.hex()}'))")
    assert wait_until(lambda: t.fe()["drop_queue_full"] > full, 5)
    assert bytes(f.mem[0x40000:0x40040]) == sentinel
    t.alive()
    f.close()

    # The avail index run a thousand entries past the ring: no busy loop in
    # vnetd (its CPU time over a second stays small) and it still answers.
    f = t.connect()
    t.exchange(f)
    ticks = cpu_ticks(t.d2.proc.pid)
    f.set_avail_idx(1, f.avail_idx[1] + 1000)
    time.sleep(1)
    t.alive()
    assert cpu_ticks(t.d2.proc.pid) - ticks < 30, "vnetd spun on a broken ring"
    f.close()

    # Protocol abuse, each on its own connection: vnetd refuses or drops the
    # connection and serves the next one.
    f = vf.Frontend(t.sock)
    f.vring_addr(1, vf.USER_BASE + 4 * vf.MEM, vf.USER_BASE, vf.USER_BASE)  # outside every region
    f.send(vf.SET_VRING_NUM, struct.pack("<II", 16, 16))  # no queue 16 (8 pairs: 0..15)
    f.send(vf.SET_VRING_NUM, struct.pack("<II", 1, 3))  # not a power of two
    f.send(999)  # no such request
    time.sleep(0.3)
    t.alive()
    f.close()
    f = vf.Frontend(t.sock, setup=False)
    f.send(vf.SET_FEATURES, b"\x01", size=0xFFFF)  # a size the body never has
    f.close()
    f = vf.Frontend(t.sock, setup=False)
    f.send(vf.SET_VRING_KICK, struct.pack("<Q", 1))  # a kick with no descriptor
    f.close()
    # A memory table larger than the file behind it: refused, so nothing is
    # mapped past the file's end (touching it would kill vnetd with SIGBUS).
    f = vf.Frontend(t.sock, mem_size=64 << 10, region_size=vf.MEM)
    f.desc(1, 0, 0x80000, 100)  # in the region, past the file
    f.offer(1, 0)
    time.sleep(0.5)
    t.alive()
    f.close()

    # After all of it, a well-behaved frontend works.
    f = t.connect()
    t.exchange(f)
    t.exchange(f)
    assert t.fe()["vhost_connects"] >= 6
    f.close()


CAPTURE = r"""
import socket, struct, sys, time
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
s.bind((sys.argv[1], 0))
s.settimeout(0.5)
got, end = {}, time.time() + 8
print("ready", flush=True)
while time.time() < end and sum(map(len, got.values())) < int(sys.argv[2]):
    try:
        f = s.recv(70000)
    except socket.timeout:
        continue
    if f[12:14] != b"\x08\x00" or f[23] != 6 or struct.unpack("!H", f[36:38])[0] != 5201:
        continue
    total = struct.unpack("!H", f[16:18])[0]
    got[struct.unpack("!I", f[38:42])[0]] = f[54:14 + total]
print(b"".join(got[k] for k in sorted(got)).hex())
"""


def super_frame(dst: bytes, src: bytes, payload: bytes, vnet=(1, 1, 54, 1448, 34, 16), ethertype=b"\x08\x00") -> bytes:
    """A virtio-net header and the 54 bytes of headers of a TCP/IPv4
    super-frame carrying `payload` (the TCP checksum left for vnetd)."""
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 40 + len(payload), 7, 0x4000, 64, 6, 0, bytes([10, 9, 0, 1]), bytes([10, 9, 0, 2]))
    tcp = struct.pack("!HHIIBBHHH", 40000, 5201, 1000, 1, 5 << 4, 0x18, 512, 0, 0)
    return struct.pack("<BBHHHHH", *vnet, 0) + dst + src + ethertype + ip + tcp


def send_in_pieces(f, head: bytes, payload: bytes, sizes) -> int:
    """Queues `head` in one buffer and `payload` in buffers of the `sizes`
    given (cycled), the chain in an indirect table; how many buffers."""
    table, data = 0x48000, 0x50000
    entries, at = [(data, len(head))], data + 0x100
    f.mem[data:data + len(head)] = head
    k = 0
    while k < len(payload):
        n = min(sizes[len(entries) % len(sizes)], len(payload) - k)
        f.mem[at:at + n] = payload[k:k + n]
        entries.append((at, n))
        at, k = at + n + 5, k + n  # gaps: the pieces are not contiguous
    for i, (addr, n) in enumerate(entries):
        last = i + 1 == len(entries)
        f.mem[table + 16 * i:table + 16 * i + 16] = struct.pack("<QIHH", addr, n, 0 if last else vf.D_NEXT, i + 1)
    f.desc(1, 4, table, 16 * len(entries), vf.D_INDIRECT)
    f.offer(1, 4)
    return len(entries)


def test_a_super_frame_in_odd_pieces_arrives_whole_and_lies_in_pieces_are_dropped(lab):
    """Gathered cut-through: a TSO super-frame whose payload lies in 25
    buffers of odd lengths (1, 3, 1999 ...) is cut into segments from the
    pieces, their checksums summed across odd boundaries; host 1 merges
    them again only if every checksum is right, and the guest gets the
    payload byte for byte. Frames whose headers lie (offload on a non-TCP
    frame, a checksum field past the head) are dropped and counted."""
    t = Lab2(lab)
    # A queue of 64: the chain (26 buffers, in an indirect table) may be no
    # longer than the queue (virtio 1.2, 2.7.5.3.1).
    f = t.connect(features=vf.F_VERSION_1 | vf.F_INDIRECT | (1 << 0) | (1 << 11), size=64)  # + CSUM, HOST_TSO4
    t.exchange(f)
    payload = bytes((i * 7 + i // 256) % 256 for i in range(20000))
    cap = lab.popen(t.g1.ns, "python3", "-c", CAPTURE, t.g1.tap, str(len(payload)), stdout=-1, text=True)
    assert cap.stdout.readline().strip() == "ready"
    fe0 = t.fe()
    n = send_in_pieces(f, super_frame(mac(t.g1.mac), mac(FE_MAC), payload), payload, [1, 1999, 3, 997, 1000])
    assert n == 26
    out = cap.communicate(timeout=20)[0].strip()
    assert bytes.fromhex(out) == payload, f"got {len(out) // 2} of {len(payload)} bytes"
    fe1 = t.fe()
    assert fe1["tx_gathered_frames"] == fe0["tx_gathered_frames"] + 1, fe1
    assert fe1["tx_head_copied_bytes"] - fe0["tx_head_copied_bytes"] == 54, fe1
    # Host 1 merged the 14 segments back (it merges only segments whose
    # checksums are right).
    assert t.d1.stats()["offload"]["coalesced_segments"] >= 14

    malformed = t.d2.stats()["global"]["drop_malformed"]
    # Segmentation asked of an ARP frame.
    send_in_pieces(f, super_frame(mac(t.g1.mac), mac(FE_MAC), payload[:3000], ethertype=b"\x08\x06"), payload[:3000], [1000])
    assert wait_until(lambda: t.d2.stats()["global"]["drop_malformed"] == malformed + 1, 5)
    # A partial checksum whose field lies past the head (in guest memory
    # vnetd does not write).
    send_in_pieces(f, super_frame(mac(t.g1.mac), mac(FE_MAC), payload[:1400], vnet=(1, 0, 0, 0, 34, 600)), payload[:1400], [700])
    assert wait_until(lambda: t.d2.stats()["global"]["drop_malformed"] == malformed + 2, 5)
    t.alive()
    t.exchange(f)


def test_bad_protocol_messages_are_refused_with_an_ack_and_change_nothing(lab):
    """With REPLY_ACK negotiated, each malformed set-up message gets a
    non-zero acknowledgement, and set-up then finishes on the same
    connection with valid values: frames go both ways, and the same
    messages sent to the running device are refused and change nothing.
    Rings start enabled (this frontend never enables them); a later
    SET_VRING_ENABLE 0 is obeyed on each ring, and 1 starts it again (a frame
    queued meanwhile then goes). Receive buffers outside guest memory: the
    frame for the guest is dropped and counted (`tx_error`). A ring that
    runs past the end of its region never starts.

    Catches (tried on mutated builds): a queue size taken without the
    power-of-two check (acknowledged 0); a ring started without checking
    its extent (virtio-queue's `is_valid` skipped: the frame was taken); a
    transmit ring enabled again that waits for the next kick (the bug this
    test found)."""
    t = Lab2(lab)
    f = vf.Frontend(t.sock, reply_ack=True, setup=False)
    f.negotiate(vf.F_VERSION_1 | vf.F_INDIRECT, vf.MEM)
    u, outside = vf.USER_BASE, vf.USER_BASE + 4 * vf.MEM
    bad = {
        "size of queue 16": (vf.SET_VRING_NUM, struct.pack("<II", 16, vf.SIZE)),
        "size 3": (vf.SET_VRING_NUM, struct.pack("<II", 1, 3)),
        "size 0": (vf.SET_VRING_NUM, struct.pack("<II", 1, 0)),
        "size 2048": (vf.SET_VRING_NUM, struct.pack("<II", 1, 2048)),
        "base of queue 16": (vf.SET_VRING_BASE, struct.pack("<II", 16, 0)),
        "addresses of queue 16": (vf.SET_VRING_ADDR, f.vring_addr_body(16, u + 0x4000, u + 0x6000, u + 0x5000)),
        "descriptors outside memory": (vf.SET_VRING_ADDR, f.vring_addr_body(1, outside, u + 0x6000, u + 0x5000)),
        "used ring outside memory": (vf.SET_VRING_ADDR, f.vring_addr_body(1, u + 0x4000, outside, u + 0x5000)),
        "avail ring outside memory": (vf.SET_VRING_ADDR, f.vring_addr_body(1, u + 0x4000, u + 0x6000, outside)),
        "enable queue 16": (vf.SET_VRING_ENABLE, struct.pack("<II", 16, 1)),
    }

    def all_refused():
        for what, (req, body) in bad.items():
            assert f.request(req, body) != 0, what
        assert f.request(vf.SET_VRING_KICK, struct.pack("<Q", 16), fds=[f.kick[1]]) != 0, "kick of queue 16"
        assert f.request(vf.SET_VRING_CALL, struct.pack("<Q", 16), fds=[f.call[1]]) != 0, "call of queue 16"

    all_refused()
    f.setup_rings()  # every message acknowledged with 0, or it raises
    f.post_rx()
    assert wait_until(lambda: "connected=yes" in t.d2.ctl("INTERFACE", "LIST").stdout, 5)
    assert t.fe()["vhost_connects"] == 1
    t.exchange(f)
    all_refused()
    t.exchange(f)

    # SET_VRING_ENABLE 0 on the transmit ring: a frame queued there stays
    # (not taken, not returned) until the ring is enabled again.
    assert f.vring_enable(1, False) == 0
    sniff, used = t.sniff(1), f.used_idx(1)
    f.send_frame(t.frame(0x200))
    time.sleep(0.5)
    assert f.used_idx(1) == used, "a disabled ring was worked"
    assert f.vring_enable(1, True) == 0
    assert wait_until(lambda: f.used_idx(1) != used, 5), "the frame queued while disabled was not taken"
    assert sniff.frames() == [t.frame(0x200)]
    # ... and on the receive ring: a frame for the guest is held (bounded:
    # vnet-vhost's held.rs), not written while the ring is disabled, and
    # written once it is enabled again.
    assert f.vring_enable(0, False) == 0
    held, down, used = t.fe()["vhost_rx_held_frames"], t.fe()["drop_down"], f.used_idx(0)
    t.from_g1(mac(FE_MAC) + mac(t.g1.mac) + ETHERTYPE + bytes(50))
    assert wait_until(lambda: t.fe()["vhost_rx_held_frames"] == held + 1, 5)
    time.sleep(0.2)
    assert f.used_idx(0) == used and t.fe()["drop_down"] == down
    delivered = t.fe()["vhost_rx_held_delivered"]
    assert f.vring_enable(0, True) == 0
    assert wait_until(lambda: f.used_idx(0) == (used + 1) & 0xFFFF, 5), "the held frame was not written"
    assert t.fe()["vhost_rx_held_delivered"] == delivered + 1
    t.exchange(f)
    # Held longer than a second: expired (counted), never written.
    assert f.vring_enable(0, False) == 0
    expired, used = t.fe()["vhost_rx_held_expired"], f.used_idx(0)
    t.from_g1(mac(FE_MAC) + mac(t.g1.mac) + ETHERTYPE + bytes(50))
    assert wait_until(lambda: t.fe()["vhost_rx_held_frames"] == held + 2, 5)
    time.sleep(1.3)
    assert f.vring_enable(0, True) == 0
    assert wait_until(lambda: t.fe()["vhost_rx_held_expired"] == expired + 1, 5)
    assert f.used_idx(0) == used
    t.exchange(f)

    # Receive buffers outside guest memory: the frame is dropped and counted
    # (vnetd could not write it), the buffer returned with nothing written.
    for i in range(vf.SIZE):
        f.desc(0, i, 1 << 40, vf.BUF, vf.D_WRITE)
    failed, used = t.fe()["drop_tx_error"], f.used_idx(0)
    t.from_g1(mac(FE_MAC) + mac(t.g1.mac) + ETHERTYPE + bytes(50))
    assert wait_until(lambda: t.fe()["drop_tx_error"] == failed + 1, 5)
    assert f.used_idx(0) == (used + 1) & 0xFFFF and f.used(0, used)[1] == 0
    t.alive()
    f.close()

    # A transmit ring that starts inside the memory region but runs past its
    # end (the used ring 8 bytes before it): refused, or taken and never
    # started; a frame queued on it is not taken.
    f = vf.Frontend(t.sock, reply_ack=True, setup=False)
    f.negotiate(vf.F_VERSION_1 | vf.F_INDIRECT, vf.MEM)
    for q, (desc, avail, used) in vf.RINGS.items():
        used = vf.MEM - 8 if q == 1 else used
        assert f.request(vf.SET_VRING_NUM, struct.pack("<II", q, vf.SIZE)) == 0
        assert f.request(vf.SET_VRING_BASE, struct.pack("<II", q, 0)) == 0
        f.request(vf.SET_VRING_ADDR, f.vring_addr_body(q, u + desc, u + used, u + avail))
        assert f.request(vf.SET_VRING_CALL, struct.pack("<Q", q), fds=[f.call[q]]) == 0
        assert f.request(vf.SET_VRING_KICK, struct.pack("<Q", q), fds=[f.kick[q]]) == 0
    taken, sniff = t.fe()["in_frames"], t.sniff(1, timeout=1.5)
    f.send_frame(t.frame(0x500))
    assert sniff.frames() == [] and t.fe()["in_frames"] == taken
    t.alive()
    f.close()
    f = t.connect()
    t.exchange(f)


def test_frames_queued_while_vnetd_was_gone_are_sent_when_it_comes_back(lab):
    """vnetd SIGKILLed under a connected frontend; the guest queues three
    frames while none runs; a new vnetd replaces the stale socket, the
    frontend connects again with the same memory and rings (the base it
    gives is the used index in guest memory, as QEMU sends after a backend
    crash) and the three frames arrive, in order, and nothing else: the
    frame taken before the kill is not sent again.

    Catches: a restarted backend that starts from the avail index (skipping
    what was queued) or from 0 (sending old frames again: tried, by
    ignoring SET_VRING_BASE)."""
    t = Lab2(lab)
    f = t.connect()
    t.exchange(f)
    sniff = t.sniff(4, timeout=15)
    t.d2.stop(signal.SIGKILL)
    queued = [t.frame(0x300 + k) for k in range(3)]
    for k, frame in enumerate(queued):
        f.send_frame(frame, head=k)  # the kicks reach nobody
    t.d2 = lab.start_vnetd(t.h2, t.cfg2)
    f = vf.Frontend(t.sock, resume=f)
    assert sniff.frames() == queued
    assert f.used_idx(1) == f.avail_idx[1]
    t.exchange(f)  # into the receive buffers posted before the kill


def test_a_guest_whose_interrupt_was_lost_hears_of_its_frames_at_a_new_call_descriptor_and_a_restart(lab):
    """A guest (event index) interrupted for one frame and left its event
    index before it (it never took that interrupt: it went to a descriptor
    the frontend then replaced and cleared, as QEMU does with the one it
    starts a ring with, or vnetd was killed before it sent it). No later
    frame crosses that index, so vnetd, obeying it, never interrupts again:
    a VM deaf after vnetd's restart, 1 CI run in 3 under load. A running
    ring's new call descriptor, and a ring starting, interrupt it once.

    Catches (each tried): no interrupt at SET_VRING_CALL on a running ring;
    none at a ring's start after a restart."""
    t = Lab2(lab)
    f = vf.Frontend(t.sock, features=vf.F_VERSION_1 | vf.F_INDIRECT | vf.F_EVENT_IDX)
    f.post_rx()
    assert wait_until(lambda: "connected=yes" in t.d2.ctl("INTERFACE", "LIST").stdout, 5)
    used_event = vf.RINGS[0][1] + 4 + 2 * f.size
    f.mem[used_event:used_event + 2] = struct.pack("<H", 0)

    def drain(fd):
        try:
            return os.eventfd_read(fd)
        except BlockingIOError:
            return 0

    def from_g1(tag):
        t.tag += 1
        t.from_g1(mac(FE_MAC) + mac(t.g1.mac) + ETHERTYPE + struct.pack("<I", tag) + bytes(46))

    from_g1(1)
    assert wait_until(lambda: f.used_idx(0) == 1, 5)
    drain(f.call[0])  # the one interrupt, "lost"
    from_g1(2)
    assert wait_until(lambda: f.used_idx(0) == 2, 5)
    time.sleep(0.3)
    assert drain(f.call[0]) == 0, "interrupted though the event index did not ask"
    # The frontend gives the running ring a new call descriptor.
    new = os.eventfd(0, os.EFD_NONBLOCK)
    f.set_call(0, new)
    assert wait_until(lambda: drain(new) > 0, 3), "a new call descriptor, and the guest still not told"
    # vnetd killed; a new one, and the frontend resumes: the ring's start
    # interrupts the guest, though nothing new came.
    t.d2.stop(signal.SIGKILL)
    t.d2 = lab.start_vnetd(t.h2, t.cfg2)
    f = vf.Frontend(t.sock, features=vf.F_VERSION_1 | vf.F_INDIRECT | vf.F_EVENT_IDX, resume=f)
    assert wait_until(lambda: drain(f.call[0]) > 0, 5), "restarted, and the guest not told"
    assert t.fe()["vhost_start_interrupts"] >= 2, t.fe()


def watch(f, bufs, last, seen):
    """Spins on the transmit ring's used index until every queued chain is
    back (5 s at most), noting each value it takes and overwriting each
    returned buffer at once."""
    deadline = time.time() + 5
    while last != f.avail_idx[1] and time.time() < deadline:
        now = f.used_idx(1)
        if now != last:
            seen.append(now)
            while last != now:
                head = f.used(1, last)[0]
                f.mem[bufs[head]:bufs[head] + 1100] = b"\xee" * 1100
                last = (last + 1) & 0xFFFF


def test_a_buffer_goes_back_to_the_guest_only_after_its_frame_is_sent(lab):
    """Cut-through sends a frame from the guest's own buffer, so the buffer
    must not be returned before the send. Sixteen frames queued at once (one
    kick) are taken in one pass; the frontend watches the used index and
    overwrites each buffer the moment it is returned. Every frame arrives
    as queued, and the used index moves once, from 0 to 16 new entries: the
    buffers go back only after the pass's sends are done.

    Catches (tried: a mutated vnetd that publishes each used entry as soon
    as the chain is taken) a buffer returned before its frame was sent."""
    # vnetd's dispatcher on CPU 1 and this watcher on CPU 0: the dispatcher
    # runs real-time, and woken on the watcher's CPU it would finish its
    # pass before the watcher looks again.
    t = Lab2(lab, "--cpus", "1")
    f = t.connect()
    t.exchange(f)
    frames = [t.frame(0x400 + k, size=1000) for k in range(vf.SIZE)]
    bufs = {}
    for k, frame in enumerate(frames):
        bufs[k] = f.buffer()
        data = bytes(vf.HDR) + frame
        f.mem[bufs[k]:bufs[k] + len(data)] = data
        f.desc(1, k, bufs[k], len(data))
        at = vf.RINGS[1][1] + 4 + 2 * ((f.avail_idx[1] + k) % vf.SIZE)
        f.mem[at:at + 2] = struct.pack("<H", k)
    sniff = t.sniff(vf.SIZE)
    start = f.used_idx(1)
    seen, last = [start], start
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    try:
        f.avail_idx[1] = (f.avail_idx[1] + vf.SIZE) & 0xFFFF
        f.set_avail_idx(1, f.avail_idx[1])  # all 16 at once, one kick
        watch(f, bufs, last, seen)
    finally:
        os.sched_setaffinity(0, cpus)
    assert seen == [start, (start + vf.SIZE) & 0xFFFF], seen
    assert sniff.frames() == frames


def test_the_socket_replaces_only_a_stale_socket_and_goes_with_its_interface(lab):
    """The rules for a served socket's path (docs/vhost-user.md): a regular
    file, a symbolic link (even to a stale socket) and a socket something
    listens on are refused and left as they were; a stale socket (nobody
    listens) is replaced; the socket is made mode 0600; it goes with INTERFACE
    DEL and when vnetd exits, but only if it is still the one vnetd made.
    (The paths are in the lab's --vhost-user-dir; paths elsewhere, plain
    names and planted links: test_vhost_attacks.py, S7.)

    Catches (tried): the listening check removed (vnetd replaced the live
    socket)."""
    import os
    import socket
    import stat

    h = lab.add_host(1)
    d = lab.start_vnetd(h, "")
    tmp = lab.tmp

    def add(name, path):
        return d.ctl("INTERFACE", "ADD", name, "52:54:00:00:01:01", "vhost-user", str(path), check=False)

    def stale_socket(path):
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()
        os.chmod(path, 0o755)

    regular = tmp / "regular"
    regular.write_text("keep me\n")
    stale = tmp / "stale-target"
    stale_socket(stale)
    link = tmp / "link"
    link.symlink_to(stale)
    live = tmp / "live"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(live))
    listener.listen()
    before = {p: os.lstat(p) for p in (regular, link, live, stale)}
    for path in (regular, link, live):
        r = add("vm1", path)
        assert r.returncode != 0 and "not replaced" in r.stderr + r.stdout, (path, r)
        assert "vm1" not in d.ctl("INTERFACE", "LIST").stdout
    for p, st in before.items():
        now = os.lstat(p)
        assert (now.st_ino, now.st_mode, now.st_mtime_ns) == (st.st_ino, st.st_mode, st.st_mtime_ns), p
    assert regular.read_text() == "keep me\n" and os.readlink(link) == str(stale)
    c = socket.socket(socket.AF_UNIX)
    c.connect(str(live))  # still listening, still ours
    listener.accept()[0].close()
    c.close()

    # A stale socket is replaced by vnetd's own, mode 0600 (the stale one
    # was 0755), that a frontend can connect to (the stale one refused).
    r = add("vm1", stale)
    assert r.returncode == 0, r
    now = os.lstat(stale)
    assert stat.S_IMODE(before[stale].st_mode) == 0o755
    assert stat.S_ISSOCK(now.st_mode) and stat.S_IMODE(now.st_mode) == 0o600, oct(now.st_mode)
    f = vf.Frontend(stale)
    assert wait_until(lambda: "connected=yes" in d.ctl("INTERFACE", "LIST").stdout, 5)
    f.close()
    # Gone with INTERFACE DEL.
    d.ctl("INTERFACE", "DEL", "vm1")
    assert not os.path.lexists(stale)
    # A socket whose file someone replaced is not removed: the new file stays.
    other = tmp / "other.sock"
    assert add("vm2", other).returncode == 0
    other.unlink()
    other.write_text("someone else's\n")
    d.ctl("INTERFACE", "DEL", "vm2")
    assert other.read_text() == "someone else's\n"
    # Gone when vnetd exits.
    last = tmp / "last.sock"
    assert add("vm3", last).returncode == 0 and os.path.exists(last)
    assert d.stop() == 0
    assert not os.path.lexists(last)
    listener.close()


def test_dirty_page_logs_are_checked_and_a_good_one_gets_every_page_vnetd_writes_and_no_other(lab):
    """Live migration's dirty-page log (docs/vhost-user.md, "Live
    migration") from a frontend that may lie: a log that is not sealed
    against shrinking, lies past its file's end, or is over 64 MiB is
    refused (no reply; `vhost_refused_logs`) and the device goes on. A good
    one, with LOG_ALL acknowledged, gets the guest pages vnetd wrote (both
    used rings, the receive buffer the frame went to) marked, and none it
    only read (descriptor tables, avail rings, the transmit buffer); with
    LOG_ALL off again nothing more is marked.

    Catches: used-ring writes made around guest memory's bitmap (the used
    pages unmarked), logging left on after LOG_ALL went (pages marked in the
    last step), a log mapped without its size checked against the file."""
    t = Lab2(lab)
    f = vf.Frontend(t.sock, reply_ack=True, log_shmfd=True, setup=False)
    f.send(vf.GET_FEATURES)
    offered = f.reply_u64()
    assert offered & vf.F_LOG_ALL, hex(offered)
    f.negotiate(vf.F_VERSION_1 | vf.F_INDIRECT, vf.MEM)
    f.setup_rings()
    f.post_rx()
    assert wait_until(lambda: "connected=yes" in t.d2.ctl("INTERFACE", "LIST").stdout, 5)
    assert not f.set_log(4096, sealed=False), "a log that could shrink"
    assert not f.set_log(8192, file_size=4096), "a log past its file's end"
    assert not f.set_log((64 << 20) + 8), "a log over 64 MiB"
    assert t.fe()["vhost_refused_logs"] == 3 and t.fe()["vhost_dirty_logs"] == 0, t.fe()
    t.exchange(f)
    t.alive()

    pages = vf.MEM // 4096
    assert f.set_log(pages // 8)
    assert f.request(vf.SET_FEATURES, struct.pack("<Q", vf.F_VERSION_1 | vf.F_INDIRECT | vf.F_PROTOCOL_FEATURES | vf.F_LOG_ALL)) == 0
    assert t.fe()["vhost_dirty_logs"] == 1
    assert f.logged_pages() == set()
    tx_buf_page = (0x10000 + vf.BUF * (f.next_buf % 200)) // 4096
    t.exchange(f)
    rx_pages = {a // 4096 for a in f.rx_bufs.values()}
    got = f.logged_pages()
    used = {vf.RINGS[q][2] // 4096 for q in vf.RINGS}
    read_only = {a // 4096 for q in vf.RINGS for a in vf.RINGS[q][:2]} | {tx_buf_page}
    assert used <= got, (sorted(got), used)
    assert got & rx_pages, (sorted(got), rx_pages)
    assert got <= used | rx_pages and not got & read_only, (sorted(got), read_only)

    assert f.request(vf.SET_FEATURES, struct.pack("<Q", vf.F_VERSION_1 | vf.F_INDIRECT | vf.F_PROTOCOL_FEATURES)) == 0
    f.log[:] = bytes(len(f.log))
    t.exchange(f)
    assert f.logged_pages() == set(), "logging went on without LOG_ALL"
    assert "dirty-page logging off" in t.d2.log_text()
    t.alive()


def test_a_frontend_flipping_its_rings_wakes_waiters_at_a_bounded_pace_and_its_last_state_is_reported(lab):
    """The security review's L3: each start or stop of a frontend's rings
    was a change, which wakes vnet-agent's `WAIT` (a pass of the agent:
    vnetd read, etcd maybe written). A frontend that starts and stops its
    rings 400 times in 2 s is reported in a burst of 4 then once every
    100 ms (about 24 changes, not 400), and the state it ends in is the
    one reported within the next 100 ms."""
    t = Lab2(lab)
    f = t.connect(reply_ack=True)
    t.exchange(f)
    from netlab import UnixSession
    s = UnixSession(t.d2.sock)
    before = int(s.request("WAIT\n")[1][0].split()[1])
    start = time.monotonic()
    for k in range(400):
        assert f.vring_enable(0, k % 2 == 1) == 0
        time.sleep(0.005)
    took = time.monotonic() - start
    time.sleep(0.3)
    after = int(s.request("WAIT\n")[1][0].split()[1])
    s.close()
    assert after - before <= 4 + took / 0.1 + 3, (after - before, took)
    assert after - before >= 4, "the flips were not reported at all"
    # It ended enabled: running, as reported.
    line = next(l for l in t.d2.ctl("INTERFACE", "LIST").stdout.splitlines() if " fe " in l or "name=fe" in l)
    assert "running=yes" in line, line
    t.exchange(f)
    t.alive()
