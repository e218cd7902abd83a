"""A guest's virtio-vsock driver in Python, for tests: a vhost-user frontend
(tools/vhost_frontend.py) with the vsock device's three queues (0: receive,
1: transmit, 2: event), which writes and reads vsock packets (virtio 1.2,
5.10.6) itself, so that it can send what no kernel would: other CIDs,
unknown ops, lengths past the chain, bytes past its credit, more
connections than allowed.

Layout: the net frontend's queues 0 and 1, queue 2 at 0x8000 / 0x9000 /
0xA000; receive buffer i at 0x10000 + i * BUF, transmit buffer j at
0x50000 + j * BUF (SIZE of each, one per descriptor, reused in turn).
"""

from __future__ import annotations

import struct
import time

import vhost_frontend as vf

HOST_CID = 2
HDR = 44
STREAM, SEQPACKET = 1, 2
REQUEST, RESPONSE, RST, SHUTDOWN, RW, CREDIT_UPDATE, CREDIT_REQUEST = range(1, 8)
SHUT_RCV, SHUT_SEND = 1, 2
SIZE = 64
RX_BASE, TX_BASE = 0x10000, 0x50000
GET_CONFIG = 24
PROTOCOL_F_CONFIG = 1 << 9


def header(src_cid, dst_cid, src_port, dst_port, op, length=0, flags=0, buf_alloc=1 << 18, fwd_cnt=0, kind=STREAM):
    return struct.pack("<QQIIIHHIII", src_cid, dst_cid, src_port, dst_port, length, kind, op, flags, buf_alloc, fwd_cnt)


class Packet:
    def __init__(self, raw: bytes):
        (self.src_cid, self.dst_cid, self.src_port, self.dst_port, self.len, self.type, self.op, self.flags,
         self.buf_alloc, self.fwd_cnt) = struct.unpack("<QQIIIHHIII", raw[:HDR])
        self.payload = raw[HDR:HDR + self.len]

    def __repr__(self):
        return (f"Packet(op={self.op} {self.src_cid}:{self.src_port} -> {self.dst_cid}:{self.dst_port} "
                f"len={self.len} flags={self.flags} buf_alloc={self.buf_alloc} fwd_cnt={self.fwd_cnt})")


class Driver(vf.Frontend):
    """The guest `cid`'s driver on the vsock device at `path` (vnetd's
    `<socket>.vsock`): set up, every receive buffer posted."""

    rings = {**vf.RINGS, 2: (0x8000, 0x9000, 0xA000)}
    protocol = PROTOCOL_F_CONFIG

    def __init__(self, path, cid, **kw):
        self.cid = cid
        self.tx_next = 0
        self.got: list[Packet] = []
        super().__init__(path, features=vf.F_VERSION_1 | vf.F_INDIRECT, size=SIZE, reply_ack=True, **kw)
        # PROTOCOL_FEATURES negotiated: the rings start once enabled.
        for q in self.rings:
            if self.vring_enable(q, True) != 0:
                raise RuntimeError(f"queue {q} not enabled")
        for i in range(SIZE):
            self.desc(0, i, RX_BASE + i * vf.BUF, vf.BUF, vf.D_WRITE)
            self.offer(0, i, kick=False)
        self.set_avail_idx(0, self.avail_idx[0])

    def config(self, offset=0, size=8) -> bytes:
        """GET_CONFIG: what vnetd says of the device (its guest CID, le64)."""
        self.send(GET_CONFIG, struct.pack("<III", offset, size, 0) + bytes(size))
        _req, _flags, n = struct.unpack("<III", self.recv_exact(12))
        body = self.recv_exact(n)
        return body[12:12 + size]

    # ---- transmit ----

    def send_raw(self, data: bytes, *, kick=True, wait=True):
        """Queues `data` (header and payload) as one chain of one buffer."""
        assert len(data) <= vf.BUF
        j = self.tx_next % SIZE
        self.tx_next += 1
        if wait:
            self.wait_tx_room()
        addr = TX_BASE + j * vf.BUF
        self.mem[addr:addr + len(data)] = data
        self.desc(1, j, addr, len(data))
        self.offer(1, j, kick=kick)

    def wait_tx_room(self, timeout=5.0):
        """Until fewer than SIZE chains are outstanding on the transmit ring."""
        deadline = time.monotonic() + timeout
        while (self.avail_idx[1] - self.used_idx(1)) & 0xFFFF >= SIZE:
            if time.monotonic() > deadline:
                raise TimeoutError("vnetd took no transmit chain")
            time.sleep(0.0005)

    def packet(self, src_port, dst_port, op, payload=b"", **kw):
        """A packet from this guest to its host."""
        kw.setdefault("src_cid", self.cid)
        kw.setdefault("dst_cid", HOST_CID)
        src, dst = kw.pop("src_cid"), kw.pop("dst_cid")
        kw.setdefault("length", len(payload))
        self.send_raw(header(src, dst, src_port, dst_port, op, **kw) + payload)

    def sent_all(self, timeout=5.0) -> bool:
        """True once vnetd has taken every chain queued."""
        return self.all_used(1, timeout)

    # ---- receive ----

    def poll(self) -> list[Packet]:
        """Packets vnetd put in the receive buffers since last asked; their
        buffers posted again."""
        out = []
        while self.last_used[0] != self.used_idx(0):
            head, length = self.used(0, self.last_used[0])
            addr = RX_BASE + head * vf.BUF
            if length >= HDR:
                out.append(Packet(bytes(self.mem[addr:addr + length])))
            self.last_used[0] = (self.last_used[0] + 1) & 0xFFFF
            self.offer(0, head, kick=False)
        if out:
            self.set_avail_idx(0, self.avail_idx[0])
        self.got += out
        return out

    def wait_for(self, match, timeout=5.0) -> Packet | None:
        """The first packet (received now or earlier, not yet matched) for
        which `match` is true, taken out of `got`."""
        deadline = time.monotonic() + timeout
        while True:
            for i, p in enumerate(self.got):
                if match(p):
                    return self.got.pop(i)
            if time.monotonic() > deadline:
                return None
            if not self.poll():
                time.sleep(0.002)

    def connect(self, src_port, dst_port, timeout=5.0) -> Packet | None:
        """REQUEST, and vnetd's answer (RESPONSE or RST)."""
        self.packet(src_port, dst_port, REQUEST)
        return self.wait_for(lambda p: p.dst_port == src_port and p.src_port == dst_port and p.op in (RESPONSE, RST),
                             timeout)


def flood(path, cid, seconds):
    """A hostile guest for `seconds`: every kind of packet no guest may send,
    packets for no connection, and connections opened and dropped, as fast
    as it can, its receive ring drained as it goes. Prints how many
    packets it sent."""
    d = Driver(path, cid)
    bad = [
        header(cid + 1, HOST_CID, 1, 5000, REQUEST),
        header(cid, cid + 1, 2, 5000, REQUEST),
        header(cid, HOST_CID, 3, 5000, REQUEST, kind=SEQPACKET),
        header(cid, HOST_CID, 4, 5000, 99),
        header(cid, HOST_CID, 5, 5000, RW, length=4000) + bytes(8),
        header(cid, HOST_CID, 6, 5000, RW, length=8) + bytes(8),   # no such connection
        bytes(20),
    ]
    sent, k = 0, 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for b in bad:
            d.send_raw(b, kick=False)
        port = 10000 + k % 50000
        k += 1
        d.send_raw(header(cid, HOST_CID, port, 5000, REQUEST), kick=False)
        d.send_raw(header(cid, HOST_CID, port, 5000, RST))
        sent += len(bad) + 2
        d.poll()
        d.got.clear()
    print(sent, flush=True)


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 5 or sys.argv[1] != "flood":
        sys.exit("usage: vsock_driver.py flood <socket> <cid> <seconds>")
    flood(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
