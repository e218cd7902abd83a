#!/usr/bin/python3
"""Runs a command as systemd's RestrictAddressFamilies= would: socket() and
socketpair() with an address family not listed fail with EAFNOSUPPORT (a
seccomp filter, installed after no_new_privs, kept across exec).

    restrict_families.py AF_UNIX,AF_INET,AF_INET6,AF_NETLINK,AF_PACKET -- vnetd ...

x86-64 only (another architecture, or x32 system calls, kill the process).
Used by tests/test_ops.py to run vnetd in its unit's sandbox without
systemd."""

import ctypes
import os
import socket
import struct
import sys

PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
AUDIT_ARCH_X86_64 = 0xC000003E
RET_ALLOW, RET_KILL, RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
EAFNOSUPPORT = 97
NR_SOCKET, NR_SOCKETPAIR, X32_BIT = 41, 53, 0x40000000
LD_W_ABS, JEQ_K, JGE_K, RET_K = 0x20, 0x15, 0x35, 0x06


def program(families: list[int]) -> list[tuple[int, int, int, int]]:
    """(code, jt, jf, k) instructions; jumps count instructions skipped."""
    allow = RET_K, 0, 0, RET_ALLOW
    refuse = RET_K, 0, 0, RET_ERRNO | EAFNOSUPPORT
    n = len(families)
    prog = [
        (LD_W_ABS, 0, 0, 4),                       # arch
        (JEQ_K, 1, 0, AUDIT_ARCH_X86_64),
        (RET_K, 0, 0, RET_KILL),
        (LD_W_ABS, 0, 0, 0),                       # system call number
        (JGE_K, 0, 1, X32_BIT),
        (RET_K, 0, 0, RET_KILL),
        (JEQ_K, 1, 0, NR_SOCKET),
        (JEQ_K, 0, n + 2, NR_SOCKETPAIR),          # neither: allow
        (LD_W_ABS, 0, 0, 16),                      # args[0], the family (low 32 bits)
    ]
    for i, f in enumerate(families):
        prog.append((JEQ_K, n - i, 0, f))          # listed: allow
    prog += [refuse, allow]
    return prog


def install(families: list[int]):
    prog = program(families)
    buf = b"".join(struct.pack("HBBI", *ins) for ins in prog)
    filt = ctypes.create_string_buffer(buf)

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(prog), ctypes.addressof(filt))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


if __name__ == "__main__":
    sep = sys.argv.index("--")
    names, cmd = sys.argv[1].split(","), sys.argv[sep + 1:]
    install([int(getattr(socket, n)) for n in names])
    os.execvp(cmd[0], cmd)
