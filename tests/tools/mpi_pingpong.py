#!/usr/bin/env python3
"""An MPI ping-pong between two ranks that checks every byte: rank 0 sends
pseudo-random messages of growing size, rank 1 sends each back, rank 0
compares. Prints one line per size ("<bytes> <rounds> <usec per round trip>")
and "ok" at the end. Run under mpirun with two ranks."""
import random
import sys
import time

from mpi4py import MPI


def main():
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    sizes = [int(s) for s in sys.argv[1:]] or [1, 64, 1024, 65536, 1 << 20, 4 << 20]
    for size in sizes:
        rounds = max(3, min(200, (8 << 20) // max(size, 1)))
        msg = bytearray(random.Random(size).randbytes(size))
        buf = bytearray(size)
        comm.Barrier()
        t = time.perf_counter()
        for _ in range(rounds):
            if rank == 0:
                comm.Send(msg, dest=1)
                comm.Recv(buf, source=1)
            else:
                comm.Recv(buf, source=0)
                comm.Send(buf, dest=0)
        dt = time.perf_counter() - t
        if rank == 0:
            if buf != msg:
                print(f"{size} bytes came back different", flush=True)
                comm.Abort(1)
            print(f"{size} {rounds} {dt / rounds * 1e6:.1f}", flush=True)
    if rank == 0:
        print("ok", flush=True)


if __name__ == "__main__":
    main()
