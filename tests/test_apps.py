"""The application benchmark's recipe (bench/apps.py), kept from rotting: one
short OpenMPI ping-pong (NetPIPE) between two guests on two hosts over VNET's
kernel fast path, ranks started through `ip netns exec`, TCP BTL only."""

import re
import subprocess
import sys

from netlab import REPO


def test_mpi_pingpong_smoke_over_vnet():
    p = subprocess.run([sys.executable, REPO / "bench/apps.py", "--smoke"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = dict((int(m[0]), (float(m[1]), float(m[2])))
                for m in re.findall(r"smoke:\s+(\d+) B\s+([\d.]+) us\s+([\d.]+) Mbit/s", p.stdout))
    assert set(rows) == {1, 8, 1024, 65536}, p.stdout
    # One-way latency of a small message: tens of µs here, not milliseconds.
    assert 1 < rows[8][0] < 2000, rows
    # 64 KiB messages move at hundreds of Mbit/s at least.
    assert rows[65536][1] > 100, rows
