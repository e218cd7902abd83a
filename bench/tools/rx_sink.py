#!/usr/bin/env python3
"""A receiving virtio-net driver on a vhost-user socket, for bench/vhost.py:
the guest on host 2 when frames go VM to VM. It does what a guest's driver
does and little else, so that it fits beside a busy-polling sender on this
machine's two CPUs (a second testpmd, polling, does not: its ring overflows
whenever the sender has the CPU).

One receive queue of 1024 buffers of 2 KiB (one frame each: no mergeable
buffers), event index on: it asks to be interrupted after a quarter of the
ring fills, sleeps on the call eventfd in between (with a 10 ms timeout),
and hands every used buffer back at once. The frames counted are the used
index's advance; each used length is checked against `expect` (frame
length + the 12-byte virtio-net header), and a frame of another length is
counted as bad. Prints one JSON line: frames, bad, and the per-second
rates.

    rx_sink.py <socket> <seconds> <frame-length>
"""

from __future__ import annotations

import json
import os
import select
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "tools"))
from vhost_frontend import (D_WRITE, F_VERSION_1, HDR, SET_VRING_ADDR, SET_VRING_BASE, SET_VRING_CALL,  # noqa: E402
                            SET_VRING_KICK, SET_VRING_NUM, USER_BASE, Frontend)

F_EVENT_IDX = 1 << 29
N = 1024
BUF = 2048
# Receive queue: descriptors, avail (with used_event after it), used; a
# small transmit queue nobody uses; then the buffers.
RX_DESC, RX_AVAIL, RX_USED = 0x0000, 0x4000, 0x5000
TX_DESC, TX_AVAIL, TX_USED, TX_SIZE = 0x8000, 0x8400, 0x8800, 16
BUFS = 0x10000
MEM = BUFS + N * BUF


def main():
    path, seconds, frame_len = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    expect = frame_len + HDR
    f = Frontend(path, features=F_VERSION_1 | F_EVENT_IDX, mem_size=MEM, setup=False)
    f.negotiate(F_VERSION_1 | F_EVENT_IDX, MEM)
    mem = f.mem
    for i in range(N):
        struct.pack_into("<QIHH", mem, RX_DESC + 16 * i, BUFS + BUF * i, BUF, D_WRITE, 0)
    struct.pack_into(f"<{N}H", mem, RX_AVAIL + 4, *range(N))
    used_event = RX_AVAIL + 4 + 2 * N
    struct.pack_into("<H", mem, used_event, N // 4 - 1)
    struct.pack_into("<HH", mem, RX_AVAIL, 0, N)  # flags, idx: every buffer posted
    for q, size, (d, a, u) in ((0, N, (RX_DESC, RX_AVAIL, RX_USED)), (1, TX_SIZE, (TX_DESC, TX_AVAIL, TX_USED))):
        f.send(SET_VRING_NUM, struct.pack("<II", q, size))
        f.send(SET_VRING_BASE, struct.pack("<II", q, 0))
        f.send(SET_VRING_ADDR, f.vring_addr_body(q, USER_BASE + d, USER_BASE + u, USER_BASE + a))
        f.send(SET_VRING_CALL, struct.pack("<Q", q), fds=[f.call[q]])
        f.send(SET_VRING_KICK, struct.pack("<Q", q), fds=[f.kick[q]])
    call = f.call[0]
    poll = select.poll()
    poll.register(call, select.POLLIN)
    last, avail, frames, bad = 0, N, 0, 0
    per_second, mark, at_mark = [], time.time(), 0
    end = time.time() + seconds
    while (now := time.time()) < end:
        if now - mark >= 1.0:
            per_second.append((frames - at_mark) / (now - mark))
            mark, at_mark = now, frames
        poll.poll(10)
        try:
            os.eventfd_read(call)
        except BlockingIOError:
            pass
        u = struct.unpack_from("<H", mem, RX_USED + 2)[0]
        k = (u - last) & 0xFFFF
        if not k:
            continue
        # The used entries (id, len), in at most two runs round the ring.
        start = last % N
        first = min(k, N - start)
        used = struct.unpack_from(f"<{2 * first}I", mem, RX_USED + 4 + 8 * start)
        if first < k:
            used += struct.unpack_from(f"<{2 * (k - first)}I", mem, RX_USED + 4)
        ids, lens = used[0::2], used[1::2]
        if os.environ.get("SINK_DEBUG"):
            exp = [(start + j) % N for j in range(k)]
            if list(ids) != exp or (avail + k - u) & 0xFFFF > N:
                print("odd", last, u, k, avail, ids[:5], exp[:5], lens[:5], file=sys.stderr, flush=True)
        bad += k - lens.count(expect)
        # Every buffer back at once, in the order used.
        slot = avail % N
        head = min(k, N - slot)
        struct.pack_into(f"<{head}H", mem, RX_AVAIL + 4 + 2 * slot, *ids[:head])
        if head < k:
            struct.pack_into(f"<{k - head}H", mem, RX_AVAIL + 4, *ids[head:])
        avail = (avail + k) & 0xFFFF
        last = u
        frames += k
        # Interrupt again once a quarter of the ring is used.
        struct.pack_into("<H", mem, used_event, (last + N // 4 - 1) & 0xFFFF)
        struct.pack_into("<H", mem, RX_AVAIL + 2, avail)
    print(json.dumps({"frames": frames, "bad": bad, "per_second": per_second}))
    f.close()


if __name__ == "__main__":
    main()
