"""Guest memory as an attack surface: a vhost-user frontend (tools/
vhost_frontend.py, a driver written from the spec) that breaks its rings,
descriptors, memory table and messages on purpose, at a vnetd that also
carries a legitimate exchange. vnetd keeps running and forwarding, returns
every chain it takes, counts what it refused, and writes nothing outside
the buffers it was given."""

import struct
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
    def __init__(self, lab):
        self.lab = lab
        h1, h2 = lab.add_host(1), lab.add_host(2)
        self.sock = lab.tmp / "fe.sock"
        by_host = {1: [("g1", guest_mac(1))], 2: [("fe", FE_MAC)]}
        self.d1 = lab.start_vnetd(h1, mesh_config(1, by_host))
        self.d2 = lab.start_vnetd(h2, mesh_config(2, by_host, attach={"fe": f"vhost-user {self.sock}"}))
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

    def exchange(self, f, head=0):
        """A frame each way between the frontend and the namespace guest."""
        self.tag += 1
        before = rx_packets(self.lab, self.g1)
        f.send_frame(mac(self.g1.mac) + mac(FE_MAC) + ETHERTYPE + struct.pack("<I", self.tag) + bytes(46), head)
        assert wait_until(lambda: rx_packets(self.lab, self.g1) > before, 5), "frontend -> guest"
        payload = struct.pack("<I", self.tag) + b"from-g1" + bytes(39)
        frame = mac(FE_MAC) + mac(self.g1.mac) + ETHERTYPE + payload
        self.lab.x(self.g1.ns, "python3", "-c",
                   "import socket; s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW); "
                   f"s.bind(('{self.g1.tap}', 0)); s.send(bytes.fromhex('{frame.hex()}'))")
        got = []
        assert wait_until(lambda: got.extend(f.received()) or any(payload in g for g in got), 5), "guest -> frontend"


def test_a_hostile_frontend_breaks_nothing_but_its_own_frames(lab):
    t = Lab2(lab)
    f = t.connect()
    t.exchange(f)
    base = 0x20000  # a buffer the attacks point at

    # Transmit chains that cannot be read: each is returned to the guest
    # unread and counted (`bad`), and the next legitimate frame still goes.
    # A looping chain is cut at the queue's size (virtio-queue's bound) and
    # taken as the frame its descriptors make, whatever that is.
    attacks = {
        "outside memory": (True, lambda h: f.desc(1, h, 1 << 40, 100)),
        "write-only": (True, lambda h: f.desc(1, h, base, 100, vf.D_WRITE)),
        "indirect table outside memory": (True, lambda h: f.desc(1, h, 1 << 40, 32, vf.D_INDIRECT)),
        "nested indirect": (True, lambda h: (f.mem.__setitem__(slice(base, base + 16), struct.pack("<QIHH", base, 64, vf.D_INDIRECT, 0)),
                                             f.desc(1, h, base, 16, vf.D_INDIRECT))),
        "loop": (False, lambda h: (f.desc(1, h, base, 50, vf.D_NEXT, h + 1), f.desc(1, h + 1, base, 50, vf.D_NEXT, h))),
    }
    for what, (counted, make) in attacks.items():
        bad, used = t.fe()["vhost_bad_chains"], f.used_idx(1)
        make(4)
        f.offer(1, 4)
        assert wait_until(lambda: f.used_idx(1) != used, 5), f"{what}: chain not returned"
        t.alive()
        if counted:
            assert t.fe()["vhost_bad_chains"] > bad, what
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

    # Receive buffers the guest cannot be written to (read-only), then ones
    # outside its memory: frames for it are dropped and counted, and the
    # memory around stays untouched.
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
    f.send(vf.SET_VRING_NUM, struct.pack("<II", 5, 16))  # no queue 5
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
    f = t.connect(features=vf.F_VERSION_1 | vf.F_INDIRECT | (1 << 0) | (1 << 11))  # + CSUM, HOST_TSO4
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
