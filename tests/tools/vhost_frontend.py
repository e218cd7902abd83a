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

import mmap
import os
import socket
import struct

GET_FEATURES, SET_FEATURES, SET_OWNER = 1, 2, 3
SET_MEM_TABLE = 5
SET_VRING_NUM, SET_VRING_ADDR, SET_VRING_BASE, GET_VRING_BASE = 8, 9, 10, 11
SET_VRING_KICK, SET_VRING_CALL = 12, 13
GET_PROTOCOL_FEATURES, SET_PROTOCOL_FEATURES = 15, 16
SET_VRING_ENABLE = 18
VERSION, REPLY, NEED_REPLY = 0x1, 0x4, 0x8
PROTOCOL_F_REPLY_ACK = 1 << 3
F_PROTOCOL_FEATURES = 1 << 30
F_VERSION_1 = 1 << 32
F_MRG_RXBUF = 1 << 15
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
    ring's base is then the used index in guest memory, as QEMU sends)."""

    def __init__(self, path, features=F_VERSION_1 | F_INDIRECT, mem_size=MEM, region_size=None, setup=True,
                 reply_ack=False, resume: "Frontend | None" = None):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(str(path))
        self.reply_ack = reply_ack
        if resume is not None:
            self.fd, self.mem, mem_size = resume.fd, resume.mem, len(resume.mem)
            self.avail_idx, self.last_used = resume.avail_idx, resume.last_used
            self.next_buf, self.rx_bufs = resume.next_buf, getattr(resume, "rx_bufs", {})
        else:
            self.fd = os.memfd_create("guest")
            os.ftruncate(self.fd, mem_size)
            self.mem = mmap.mmap(self.fd, mem_size)
            self.avail_idx = {q: 0 for q in RINGS}
            self.last_used = {q: 0 for q in RINGS}
            self.next_buf = 0
        self.kick = {q: os.eventfd(0, os.EFD_NONBLOCK) for q in RINGS}
        self.call = {q: os.eventfd(0, os.EFD_NONBLOCK) for q in RINGS}
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
            self.send(SET_PROTOCOL_FEATURES, struct.pack("<Q", PROTOCOL_F_REPLY_ACK))
        self._set(SET_OWNER)
        self._set(SET_FEATURES, struct.pack("<Q", features & offered))
        self._set(SET_MEM_TABLE, struct.pack("<II", 1, 0) + struct.pack("<QQQQ", 0, region_size, USER_BASE, 0),
                  fds=[self.fd])

    def setup_rings(self, resume=False):
        """Both rings: size, base (0, or with `resume` the used index in
        guest memory), addresses, call and kick descriptors."""
        for q, (desc, avail, used) in RINGS.items():
            self._set(SET_VRING_NUM, struct.pack("<II", q, SIZE))
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

    def close(self):
        self.sock.close()

    # ---- rings ----

    def desc(self, q, i, addr, length, flags=0, nxt=0):
        at = RINGS[q][0] + 16 * i
        self.mem[at:at + 16] = struct.pack("<QIHH", addr, length, flags, nxt)

    def offer(self, q, head, kick=True):
        avail = RINGS[q][1]
        slot = self.avail_idx[q] % SIZE
        self.mem[avail + 4 + 2 * slot:avail + 6 + 2 * slot] = struct.pack("<H", head)
        self.avail_idx[q] = (self.avail_idx[q] + 1) & 0xFFFF
        self.set_avail_idx(q, self.avail_idx[q], kick)

    def set_avail_idx(self, q, idx, kick=True):
        self.mem[RINGS[q][1] + 2:RINGS[q][1] + 4] = struct.pack("<H", idx & 0xFFFF)
        if kick:
            os.eventfd_write(self.kick[q], 1)

    def used_idx(self, q) -> int:
        at = RINGS[q][2] + 2
        return struct.unpack("<H", self.mem[at:at + 2])[0]

    def used(self, q, k) -> tuple[int, int]:
        at = RINGS[q][2] + 4 + 8 * (k % SIZE)
        return struct.unpack("<II", self.mem[at:at + 8])

    def buffer(self) -> int:
        """A fresh buffer's guest address (wrapping over 200 of them)."""
        addr = 0x10000 + BUF * (self.next_buf % 200)
        self.next_buf += 1
        return addr

    def post_rx(self, n=SIZE, length=BUF):
        """Posts receive buffers in descriptors 0..n-1 of queue 0."""
        self.rx_bufs = {}
        for i in range(n):
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
