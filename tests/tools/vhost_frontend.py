"""A small vhost-user frontend (the driver's side) in Python, for tests: it
connects to a backend's socket, shares a memfd as guest memory, lays out two
split virtqueues (0: receive, 1: transmit) and moves frames, or breaks any of
it on purpose.

Guest physical layout: queue 0 at 0x0000 (descriptors), 0x1000 (avail),
0x2000 (used); queue 1 at 0x4000 / 0x5000 / 0x6000; buffers from 0x10000,
BUF bytes each. The frontend's "user addresses" are the guest addresses plus
USER_BASE (the backend translates ring addresses through the memory table).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import random
import signal
import socket
import struct
import sys
import threading
import time

GET_FEATURES, SET_FEATURES, SET_OWNER = 1, 2, 3
SET_MEM_TABLE, SET_LOG_BASE = 5, 6
SET_VRING_NUM, SET_VRING_ADDR, SET_VRING_BASE, GET_VRING_BASE = 8, 9, 10, 11
SET_VRING_KICK, SET_VRING_CALL = 12, 13
GET_PROTOCOL_FEATURES, SET_PROTOCOL_FEATURES = 15, 16
SET_VRING_ENABLE = 18
VERSION, REPLY, NEED_REPLY = 0x1, 0x4, 0x8
PROTOCOL_F_REPLY_ACK = 1 << 3
PROTOCOL_F_LOG_SHMFD = 1 << 1
F_LOG_ALL = 1 << 26
F_PROTOCOL_FEATURES = 1 << 30
F_VERSION_1 = 1 << 32
F_MRG_RXBUF = 1 << 15
F_EVENT_IDX = 1 << 29
F_INDIRECT = 1 << 28
D_NEXT, D_WRITE, D_INDIRECT = 1, 2, 4
MEM = 1 << 20
USER_BASE = 0x7F00_0000_0000
SIZE = 16
BUF = 0x1000
HDR = 12
RINGS = {0: (0x0000, 0x1000, 0x2000), 1: (0x4000, 0x5000, 0x6000)}


class Frontend:
    """`reply_ack`: negotiate REPLY_ACK (and PROTOCOL_FEATURES) and have every
    set-up message acknowledged (a refusal raises). `resume`: a frontend
    whose connection is gone; this one takes over its guest memory and
    rings, as a VMM does when the backend comes back after a crash (the
    ring's base is then the used index in guest memory, as QEMU sends).
    `sealed`: seal the memory file against shrinking and growing. `size`:
    both queues' size (at most 256, what the layout has room for).
    `log_shmfd`: negotiate LOG_SHMFD too (with `reply_ack`), for `set_log`.
    `rings`: the queues' layout (a subclass for a device with more)."""

    rings = RINGS
    protocol = 0  # vhost-user protocol features asked beyond REPLY_ACK (and LOG_SHMFD)

    def __init__(self, path, features=F_VERSION_1 | F_INDIRECT, mem_size=MEM, region_size=None, setup=True,
                 reply_ack=False, resume: "Frontend | None" = None, sealed=True, size=SIZE, log_shmfd=False):
        assert size <= 256 and size & (size - 1) == 0
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(str(path))
        self.reply_ack = reply_ack
        self.log_shmfd = log_shmfd
        self.size = size
        if resume is not None:
            self.fd, self.mem, mem_size = resume.fd, resume.mem, len(resume.mem)
            self.avail_idx, self.last_used = resume.avail_idx, resume.last_used
            self.next_buf, self.rx_bufs = resume.next_buf, getattr(resume, "rx_bufs", {})
            self.size = resume.size
        else:
            self.fd = os.memfd_create("guest", os.MFD_ALLOW_SEALING if sealed else 0)
            os.ftruncate(self.fd, mem_size)
            if sealed:
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            self.mem = mmap.mmap(self.fd, mem_size)
            self.avail_idx = {q: 0 for q in self.rings}
            self.last_used = {q: 0 for q in self.rings}
            self.next_buf = 0
        self.kick = {q: os.eventfd(0, os.EFD_NONBLOCK) for q in self.rings}
        self.call = {q: os.eventfd(0, os.EFD_NONBLOCK) for q in self.rings}
        if setup:
            self.setup(features, region_size or mem_size, resume=resume is not None)

    # ---- messages ----

    def send(self, req, payload=b"", fds=(), flags=VERSION, size=None):
        hdr = struct.pack("<III", req, flags, len(payload) if size is None else size)
        if fds:
            socket.send_fds(self.sock, [hdr + payload], list(fds))
        else:
            self.sock.sendall(hdr + payload)

    def reply_u64(self) -> int:
        data = b""
        while len(data) < 20:
            chunk = self.sock.recv(20 - len(data))
            if not chunk:
                raise ConnectionError("the backend closed the connection")
            data += chunk
        return struct.unpack("<IIIQ", data)[3]

    def request(self, req, payload=b"", fds=()) -> int:
        """Sends a message asking for REPLY_ACK's acknowledgement and returns
        it: 0 if the backend applied it, non-zero if it refused it."""
        assert self.reply_ack, "REPLY_ACK was not negotiated"
        self.send(req, payload, fds, flags=VERSION | NEED_REPLY)
        return self.reply_u64()

    def _set(self, req, payload=b"", fds=()):
        """A set-up message: acknowledged (and a refusal raised) with REPLY_ACK."""
        if self.reply_ack:
            ack = self.request(req, payload, fds)
            if ack != 0:
                raise RuntimeError(f"request {req} refused ({ack})")
        else:
            self.send(req, payload, fds)

    def setup(self, features, region_size, resume=False):
        self.negotiate(features, region_size)
        self.setup_rings(resume)

    def negotiate(self, features, region_size):
        """Features (and REPLY_ACK if asked), owner, memory table."""
        self.send(GET_FEATURES)
        offered = self.reply_u64()
        if self.reply_ack:
            features |= F_PROTOCOL_FEATURES
            self.send(GET_PROTOCOL_FEATURES)
            if not self.reply_u64() & PROTOCOL_F_REPLY_ACK:
                raise RuntimeError("the backend does not offer REPLY_ACK")
            self.send(SET_PROTOCOL_FEATURES, struct.pack("<Q", PROTOCOL_F_REPLY_ACK | self.protocol | (PROTOCOL_F_LOG_SHMFD if self.log_shmfd else 0)))
        self._set(SET_OWNER)
        self._set(SET_FEATURES, struct.pack("<Q", features & offered))
        self._set(SET_MEM_TABLE, struct.pack("<II", 1, 0) + struct.pack("<QQQQ", 0, region_size, USER_BASE, 0),
                  fds=[self.fd])

    def recv_exact(self, n) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("the backend closed the connection")
            data += chunk
        return data

    def set_log(self, size, file_size=None, sealed=True):
        """SET_LOG_BASE: a dirty-page log of `size` bytes in a new memfd of
        `file_size` bytes (default `size`). True if the backend took it (it
        replies), False if it refused it (no reply: the GET_FEATURES sent
        after it is answered first). The log, mapped, is `self.log`."""
        fd = os.memfd_create("log", os.MFD_ALLOW_SEALING if sealed else 0)
        os.ftruncate(fd, file_size if file_size is not None else size)
        if sealed:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        self.send(SET_LOG_BASE, struct.pack("<QQ", size, 0), fds=[fd])
        self.send(GET_FEATURES)
        req, _, n = struct.unpack("<III", self.recv_exact(12))
        self.recv_exact(n)
        if req == SET_LOG_BASE:
            self.reply_u64()
            self.log = mmap.mmap(fd, os.fstat(fd).st_size)
        os.close(fd)
        return req == SET_LOG_BASE

    def logged_pages(self) -> set[int]:
        """The guest pages (4 KiB, guest-physical) marked in `self.log`."""
        return {8 * i + b for i, byte in enumerate(bytes(self.log)) if byte for b in range(8) if byte & (1 << b)}

    def setup_rings(self, resume=False):
        """Both rings: size, base (0, or with `resume` the used index in
        guest memory), addresses, call and kick descriptors."""
        for q, (desc, avail, used) in self.rings.items():
            self._set(SET_VRING_NUM, struct.pack("<II", q, self.size))
            self._set(SET_VRING_BASE, struct.pack("<II", q, self.used_idx(q) if resume else 0))
            self._set(SET_VRING_ADDR, self.vring_addr_body(q, USER_BASE + desc, USER_BASE + used, USER_BASE + avail))
            self._set(SET_VRING_CALL, struct.pack("<Q", q), fds=[self.call[q]])
            self._set(SET_VRING_KICK, struct.pack("<Q", q), fds=[self.kick[q]])

    @staticmethod
    def vring_addr_body(q, desc, used, avail) -> bytes:
        return struct.pack("<IIQQQQ", q, 0, desc, used, avail, 0)

    def vring_addr(self, q, desc, used, avail):
        self.send(SET_VRING_ADDR, self.vring_addr_body(q, desc, used, avail))

    def vring_enable(self, q, on: bool) -> int:
        """SET_VRING_ENABLE, acknowledged (REPLY_ACK)."""
        return self.request(SET_VRING_ENABLE, struct.pack("<II", q, int(on)))

    def vring_base(self, q) -> int:
        self.send(GET_VRING_BASE, struct.pack("<II", q, 0))
        return struct.unpack("<IIIII", self.sock.recv(20))[4]

    def set_call(self, q, fd) -> int | None:
        """SET_VRING_CALL with `fd`: its acknowledgement with REPLY_ACK (0:
        taken), else None."""
        if self.reply_ack:
            return self.request(SET_VRING_CALL, struct.pack("<Q", q), fds=[fd])
        self.send(SET_VRING_CALL, struct.pack("<Q", q), fds=[fd])
        return None

    def set_kick(self, q, fd) -> int | None:
        """SET_VRING_KICK with `fd`, as set_call."""
        if self.reply_ack:
            return self.request(SET_VRING_KICK, struct.pack("<Q", q), fds=[fd])
        self.send(SET_VRING_KICK, struct.pack("<Q", q), fds=[fd])
        return None

    def truncate(self):
        """Shrinks the memory file to nothing under the backend. Guest
        memory must not be touched afterwards (by this process either: it
        would die of SIGBUS); kicks still go."""
        os.ftruncate(self.fd, 0)

    def close(self):
        self.sock.close()

    # ---- rings ----

    def desc(self, q, i, addr, length, flags=0, nxt=0):
        at = self.rings[q][0] + 16 * i
        self.mem[at:at + 16] = struct.pack("<QIHH", addr, length, flags, nxt)

    def offer(self, q, head, kick=True):
        avail = self.rings[q][1]
        slot = self.avail_idx[q] % self.size
        self.mem[avail + 4 + 2 * slot:avail + 6 + 2 * slot] = struct.pack("<H", head)
        self.avail_idx[q] = (self.avail_idx[q] + 1) & 0xFFFF
        self.set_avail_idx(q, self.avail_idx[q], kick)

    def set_avail_idx(self, q, idx, kick=True):
        self.mem[self.rings[q][1] + 2:self.rings[q][1] + 4] = struct.pack("<H", idx & 0xFFFF)
        if kick:
            os.eventfd_write(self.kick[q], 1)

    def used_idx(self, q) -> int:
        at = self.rings[q][2] + 2
        return struct.unpack("<H", self.mem[at:at + 2])[0]

    def all_used(self, q, timeout=5.0) -> bool:
        """True once the backend has used every chain offered on queue q."""
        deadline = time.monotonic() + timeout
        while self.used_idx(q) != self.avail_idx[q]:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)
        return True

    def used(self, q, k) -> tuple[int, int]:
        at = self.rings[q][2] + 4 + 8 * (k % self.size)
        return struct.unpack("<II", self.mem[at:at + 8])

    def buffer(self) -> int:
        """A fresh buffer's guest address (wrapping over 200 of them)."""
        addr = 0x10000 + BUF * (self.next_buf % 200)
        self.next_buf += 1
        return addr

    def post_rx(self, n=None, length=BUF, first=0):
        """Posts receive buffers in descriptors first..first+n-1 of queue 0
        (n: the rest of the queue)."""
        self.rx_bufs = {} if first == 0 else getattr(self, "rx_bufs", {})
        for i in range(first, first + (self.size - first if n is None else n)):
            addr = self.buffer()
            self.rx_bufs[i] = addr
            self.desc(0, i, addr, length, D_WRITE)
            self.offer(0, i, kick=False)

    def send_frame(self, frame: bytes, head=0):
        """Queues one frame (header, then the frame, in one buffer) in
        descriptor `head` of queue 1 and kicks."""
        addr = self.buffer()
        data = bytes(HDR) + frame
        self.mem[addr:addr + len(data)] = data
        self.desc(1, head, addr, len(data))
        self.offer(1, head)

    def received(self) -> list[bytes]:
        """Frames the backend put in the receive buffers since last asked."""
        out = []
        while self.last_used[0] != self.used_idx(0):
            head, length = self.used(0, self.last_used[0])
            addr = self.rx_bufs.get(head)
            if addr is not None and length >= HDR:
                out.append(bytes(self.mem[addr + HDR:addr + length]))
            self.last_used[0] = (self.last_used[0] + 1) & 0xFFFF
        return out


# ---- attacks (security review 2026-11-24, S1-S4) ----

def full_pipe() -> tuple[int, int]:
    """A pipe whose buffer is full and whose write end blocks: a call
    descriptor on which write(2) sleeps until someone reads (S2)."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        while True:
            os.write(w, bytes(65536))
    except BlockingIOError:
        pass
    os.set_blocking(w, True)  # the flag is the open file's: the backend's copy blocks too
    return r, w


def full_eventfd() -> int:
    """A blocking eventfd whose counter is at its largest (2^64 - 2): one
    more write(2) of 1 would sleep until someone reads."""
    fd = os.eventfd(0)
    os.eventfd_write(fd, 0xFFFF_FFFF_FFFF_FFFE)
    return fd


# Mergeable receive buffers: a frame may take many chains, so a backend
# that walks them all pays for every one.
BOMB_FEATURES = F_VERSION_1 | F_INDIRECT | F_MRG_RXBUF


_tables: dict[int, bytes] = {}


def _empty_table(entries) -> bytes:
    """An indirect table of `entries` zero-length read-only descriptors,
    each chained to the next."""
    if entries not in _tables:
        body = bytearray(16 * entries)
        for i in range(entries):
            nxt = i + 1 < entries
            struct.pack_into("<QIHH", body, 16 * i, 0x10000, 0, D_NEXT if nxt else 0, i + 1 if nxt else 0)
        _tables[entries] = bytes(body)
    return _tables[entries]


def empty_chain_bomb(f: Frontend, table=0x200000, entries=65535, chains=None):
    """S3: `chains` receive chains (the whole queue by default), each an
    indirect table of `entries` zero-length read-only descriptors (one table
    shared by all, at `table`: 1 MiB for 65535 entries), offered on queue 0.
    Needs a guest memory of table + 16 * entries bytes, and BOMB_FEATURES
    negotiated to hurt."""
    body = _empty_table(entries)
    f.mem[table:table + len(body)] = body
    for h in range(f.size if chains is None else chains):
        f.desc(0, h, table, len(body), D_INDIRECT)
        f.offer(0, h, kick=False)


FLIP = r"""
import ctypes, mmap, os, sys
ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG: SIGKILL when the frontend goes
if os.getppid() == 1:
    sys.exit()
fd, size = int(sys.argv[1]), int(sys.argv[2])
a, b = bytes.fromhex(sys.argv[3]), bytes.fromhex(sys.argv[4])
at = [int(x) for x in sys.argv[5].split(",")]
m = mmap.mmap(fd, size)
print("ready", flush=True)
while True:
    for o in at:
        m[o:o + 6] = b
    for o in at:
        m[o:o + 6] = a
"""


class Flipper:
    """S1: another process (so that it runs beside the frontend, not under
    its interpreter lock) sharing the frontend's guest memory, flipping the
    destination MAC of the frames at `bufs` between `a` and `b`, as fast as
    it can, until stopped. `cpu`: the CPU it runs on."""

    def __init__(self, f: Frontend, bufs, a: bytes, b: bytes, cpu=None, nice=0):
        import subprocess
        at = ",".join(str(x + HDR) for x in bufs)
        pre = (["taskset", "-c", str(cpu)] if cpu is not None else []) + (["nice", "-n", str(nice)] if nice else [])
        self.p = subprocess.Popen([*pre, sys.executable, "-c", FLIP, str(f.fd), str(len(f.mem)), a.hex(), b.hex(), at],
                                  pass_fds=[f.fd], stdout=subprocess.PIPE, text=True)
        assert self.p.stdout.readline().strip() == "ready"

    def stop(self):
        self.p.kill()
        self.p.wait()


def flip_frames(f: Frontend, frame: bytes, rounds: int, timeout=5.0) -> int:
    """Queues `frame` in every descriptor of the transmit queue (one buffer
    each, at fixed addresses, written once: a Flipper may be changing them),
    `rounds` times, waiting for each round to come back; how many were
    queued. Returns early if the backend stops returning chains."""
    bufs = [0x10000 + BUF * k for k in range(f.size)]
    data = bytes(HDR) + frame
    for k, addr in enumerate(bufs):
        f.mem[addr:addr + len(data)] = data
        f.desc(1, k, addr, len(data))
    queued = 0
    for _ in range(rounds):
        avail = RINGS[1][1]
        for k in range(f.size):
            slot = (f.avail_idx[1] + k) % f.size
            f.mem[avail + 4 + 2 * slot:avail + 6 + 2 * slot] = struct.pack("<H", k)
        f.avail_idx[1] = (f.avail_idx[1] + f.size) & 0xFFFF
        f.set_avail_idx(1, f.avail_idx[1])
        queued += f.size
        if not f.all_used(1, timeout):
            return queued
    return queued


def flip_bufs(f: Frontend) -> list[int]:
    """The buffers flip_frames uses."""
    return [0x10000 + BUF * k for k in range(f.size)]


# ---- the noisy neighbour ----

def _flips(path, rnd, a, b, src):
    f = Frontend(path)
    fl = Flipper(f, flip_bufs(f), a, b)
    try:
        flip_frames(f, a + src + b"\x88\xb5" + bytes(986), rnd.randint(5, 30), timeout=0.5)
    finally:
        fl.stop()
        f.close()


def _pipes(path, rnd, *_):
    f = Frontend(path)
    f.post_rx()
    held = []
    for q in RINGS:
        r, w = full_pipe()
        held += [r, w]
        f.set_call(q, w)
    f.send_frame(bytes(60))
    time.sleep(rnd.uniform(0.2, 1.0))
    f.close()
    for fd in held:
        os.close(fd)


def _chains(path, rnd, *_):
    f = Frontend(path, features=BOMB_FEATURES, size=256, mem_size=4 * MEM)
    empty_chain_bomb(f)
    time.sleep(rnd.uniform(0.5, 2.0))
    f.close()


def _truncate(path, rnd, a, b, src):
    f = Frontend(path, sealed=False)
    f.post_rx()
    f.send_frame(a + src + b"\x88\xb5" + bytes(50))
    addr = f.buffer()
    data = bytes(HDR) + a + src + b"\x88\xb5" + bytes(50)
    f.mem[addr:addr + len(data)] = data
    f.desc(1, 1, addr, len(data))
    f.offer(1, 1, kick=False)
    f.truncate()
    os.eventfd_write(f.kick[1], 1)
    time.sleep(0.3)
    f.close()


def _garbage(path, rnd, *_):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1)
    s.connect(str(path))
    try:
        s.sendall(rnd.randbytes(rnd.randint(1, 4096)))
    except OSError:
        pass  # vnetd ended the connection: the bytes were sent at it
    time.sleep(0.05)
    s.close()


def _wrong_messages(path, rnd, *_):
    """Well-formed headers with wrong requests, sizes, bodies and
    descriptors, on a connection that may or may not be set up."""
    f = Frontend(path, setup=rnd.random() < 0.5)
    try:
        for _ in range(rnd.randint(1, 40)):
            req = rnd.choice([rnd.randint(0, 50), SET_MEM_TABLE, SET_VRING_ADDR, SET_VRING_NUM, SET_VRING_BASE,
                              SET_VRING_KICK, SET_VRING_CALL, SET_FEATURES, SET_VRING_ENABLE, GET_VRING_BASE])
            body = rnd.randbytes(rnd.choice([0, 4, 8, 12, 40, 48, rnd.randint(0, 300)]))
            fds = [f.kick[0]] if rnd.random() < 0.3 else []
            f.send(req, body, fds=fds, flags=rnd.choice([VERSION, VERSION | NEED_REPLY, rnd.randint(0, 255)]))
    except OSError:
        pass  # vnetd ended the connection on a message it refused: the attack was made
    time.sleep(0.05)
    f.close()


ATTACKS = [_flips, _pipes, _chains, _truncate, _garbage, _wrong_messages]


def attack(path, a: bytes, b: bytes, src: bytes, seconds: float, seed: int):
    """Does its worst on the socket at `path` for `seconds`: S1 flips
    (frames to `a` turned to `b`), S2 full pipes as call descriptors, S3
    empty chain bombs, S4 truncated memory, random bytes and wrong messages,
    each once in every round, in a random order, reconnecting whenever the
    backend drops it; SIGTERM ends it early, after the attack under way.
    Prints `at <start> <end> <attack>` (CLOCK_MONOTONIC seconds) as each one
    is done, so that a test can see it ran while it measured, then how many
    of each it did."""
    rnd = random.Random(seed)
    done = {a_.__name__: 0 for a_ in ATTACKS}
    end = time.monotonic() + seconds
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    order = []
    while time.monotonic() < end and not stop:
        if not order:
            order = rnd.sample(ATTACKS, len(ATTACKS))
        what = order.pop()
        began = time.monotonic()
        try:
            what(path, rnd, a, b, src)
            done[what.__name__] += 1
            print(f"at {began:.3f} {time.monotonic():.3f} {what.__name__.strip('_')}", flush=True)
        except (OSError, RuntimeError, ConnectionError, struct.error):
            time.sleep(0.05)  # dropped or refused: again, on a new connection
    print(" ".join(f"{k.strip('_')}={v}" for k, v in done.items()), flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 8 or sys.argv[1] != "attack":
        sys.exit("usage: vhost_frontend.py attack <socket> <dst-mac> <flipped-mac> <src-mac> <seconds> <seed>")
    mac_ = lambda s: bytes.fromhex(s.replace(":", ""))  # noqa: E731
    attack(sys.argv[2], mac_(sys.argv[3]), mac_(sys.argv[4]), mac_(sys.argv[5]), float(sys.argv[6]), int(sys.argv[7]))
