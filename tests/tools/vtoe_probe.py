#!/usr/bin/env python3
"""What a program sees of a socket, and what it can do with it: run under
`vtoe` (or not) in a guest namespace by tests/test_vtoe.py. Each mode prints
one JSON object.

  vtoe_probe.py serve PORT N        epoll on a non-blocking listener; for N
                                    connections: the address accept gave, the
                                    socket's names, then read to EOF and send
                                    back "<bytes> <sha256>" and close
  vtoe_probe.py client HOST PORT N  a non-blocking connect with TCP_NODELAY
                                    and SO_SNDBUF set first; a forked child
                                    and a dup'ed descriptor each send half of
                                    N bytes; half-close; read the answer
  vtoe_probe.py escape HOST PORT TARGET_PORT [UNIX_PATH]
                                    connect, then try to leave the connection:
                                    disconnect (AF_UNSPEC) and connect to
                                    127.0.0.1:TARGET_PORT, bind, listen,
                                    SO_BINDTODEVICE, list interfaces with
                                    SIOCGIFCONF; then hold the socket until
                                    stdin closes. With UNIX_PATH the socket is
                                    first handed (SCM_RIGHTS) to `attempts`
                                    listening there, which tries instead
  vtoe_probe.py attempts UNIX_PATH TARGET_PORT
                                    wait for a socket on UNIX_PATH and try the
                                    same on it (holding it until stdin closes)
  vtoe_probe.py hijack RUNNER_SOCKET IP PORT PROOF...
                                    a raw session on vnetd's runner socket (no
                                    runner: any user of the guest can do this)
                                    registering the listener IP:PORT once per
                                    PROOF, sent with it: "none" (no socket),
                                    "other-port" (a listener of its own on
                                    IP:PORT+1), "own-netns" (a listener on
                                    IP:PORT in a user and network namespace of
                                    its own). Prints {"answers": [...]}, then
                                    takes every offloaded connection vnetd
                                    hands it: reads what comes, answers
                                    "attacker"; when stdin closes prints
                                    {"stolen": [what each sent]}
  vtoe_probe.py connect-raw RUNNER_SOCKET SRC_IP:PORT DST_IP:PORT
                                    a raw session asking vnetd to offload a
                                    connection to DST (whatever the runner
                                    would refuse); prints vnetd's answer and,
                                    for a socket, what the far end sends first
"""
import array
import ctypes
import errno
import fcntl
import hashlib
import json
import os
import select
import socket
import struct
import sys

libc = ctypes.CDLL(None, use_errno=True)
SIOCGIFCONF = 0x8912


def names(s):
    def get(f):
        try:
            return "%s:%d" % f()[:2]
        except OSError as e:
            return errno.errorcode.get(e.errno, str(e.errno))
    return {"sockname": get(s.getsockname), "peername": get(s.getpeername)}


def serve(port, n):
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(16)
    srv.setblocking(False)
    print(json.dumps({"listening": port}), flush=True)
    ep = select.epoll()
    ep.register(srv.fileno(), select.EPOLLIN)
    done = []
    while len(done) < n:
        for _ in ep.poll(30):
            try:
                c, addr = srv.accept()
            except BlockingIOError:
                continue  # a spurious wake-up, as epoll allows
            c.setblocking(True)
            rec = {"accepted_from": "%s:%d" % addr, **names(c)}
            h, total = hashlib.sha256(), 0
            try:
                while chunk := c.recv(1 << 16):
                    h.update(chunk)
                    total += len(chunk)
                c.sendall(f"{total} {h.hexdigest()}".encode())
            except OSError as e:
                rec["error"] = errno.errorcode.get(e.errno, str(e.errno))
            c.close()
            rec.update(bytes=total, sha256=h.hexdigest())
            done.append(rec)
    print(json.dumps({"served": done}), flush=True)


def client(host, port, n):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    s.setblocking(False)
    r = {}
    err = s.connect_ex((host, port))
    r["connect"] = errno.errorcode.get(err, "OK") if err else "OK"
    _, w, _ = select.select([], [s], [], 10)
    r["writable"] = bool(w)
    r["so_error"] = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    r["nodelay"] = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    r["sndbuf"] = s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    r.update(names(s))
    s.setblocking(True)
    data = os.urandom(n)
    half = n // 2
    pid = os.fork()
    if pid == 0:
        s.sendall(data[:half])  # the child, through the inherited socket
        os._exit(0)
    _, st = os.waitpid(pid, 0)
    r["child_status"] = st
    d = socket.socket(fileno=os.dup(s.fileno()))
    d.sendall(data[half:])  # the parent, through a dup
    d.close()
    s.shutdown(socket.SHUT_WR)
    answer = b""
    while chunk := s.recv(4096):
        answer += chunk
    r["answer"] = answer.decode()
    r["expect"] = f"{n} {hashlib.sha256(data).hexdigest()}"
    print(json.dumps(r), flush=True)


def attempt(s, target_port):
    """Every way out we know of, each result by name."""
    r = {"before": names(s)}
    fd = s.fileno()

    def call(f):
        try:
            f()
            return "OK"
        except OSError as e:
            return errno.errorcode.get(e.errno, str(e.errno))

    unspec = struct.pack("HH12x", socket.AF_UNSPEC, 0)
    ret = libc.connect(fd, ctypes.c_char_p(unspec), len(unspec))
    r["disconnect"] = "OK" if ret == 0 else errno.errorcode.get(ctypes.get_errno(), "?")
    r["connect_host"] = call(lambda: s.connect(("127.0.0.1", target_port)))
    r["bind"] = call(lambda: s.bind(("0.0.0.0", 0)))
    r["listen"] = call(lambda: s.listen(4))
    try:
        r["listening_on"] = s.getsockname()[1]
    except OSError:
        r["listening_on"] = None
    r["bindtodevice"] = call(lambda: s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, b"lo"))
    buf = array.array("B", b"\0" * 4096)
    ifc = struct.pack("iL", 4096, buf.buffer_info()[0])
    try:
        out = fcntl.ioctl(fd, SIOCGIFCONF, ifc)
        size = struct.unpack("iL", out)[0]
        raw = buf.tobytes()[:size]
        r["ifconf"] = [raw[i:i + 16].split(b"\0")[0].decode() for i in range(0, size, 40)]
    except OSError as e:
        r["ifconf"] = errno.errorcode.get(e.errno, str(e.errno))
    r["after"] = names(s)
    return r


def escape(host, port, target_port, unix_path=None):
    s = socket.create_connection((host, port), timeout=10)
    if unix_path:
        u = socket.socket(socket.AF_UNIX)
        u.connect(unix_path)
        socket.send_fds(u, [b"x"], [s.fileno()])
        print(u.recv(65536).decode(), flush=True)
        return
    print(json.dumps(attempt(s, target_port)), flush=True)
    sys.stdin.read()


def attempts(unix_path, target_port):
    l = socket.socket(socket.AF_UNIX)
    l.bind(unix_path)
    l.listen(1)
    print(json.dumps({"ready": unix_path}), flush=True)
    c, _ = l.accept()
    _, fds, _, _ = socket.recv_fds(c, 16, 1)
    s = socket.socket(fileno=fds[0])
    c.sendall(json.dumps(attempt(s, target_port)).encode())
    c.close()
    sys.stdin.read()


def runner_hello(path):
    """A session on vnetd's runner socket, in whichever version it speaks."""
    for version in (2, 1):
        u = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        u.settimeout(5)
        u.connect(path)
        u.send(bytes([1, version]))
        try:
            if u.recv(64) == bytes([1, version]):
                return u
        except OSError:
            pass
        u.close()
    raise SystemExit("vnetd welcomed no version")


def v4(ip, port):
    return socket.inet_aton(ip) + port.to_bytes(2, "big")


def proof_socket(kind, ip, port):
    if kind == "none":
        return None
    if kind == "own-netns":
        CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
        if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "unshare")
        # Back to the guest's namespace for nothing: the session is made.
    s = socket.socket()
    s.setsockopt(socket.SOL_IP, 15, 1)  # IP_FREEBIND: the address need not be here
    s.bind((ip, port + 1 if kind == "other-port" else port))
    s.listen(4)
    return s


def hijack(path, ip, port, proofs):
    u = runner_hello(path)
    answers, keep = [], []
    for kind in proofs:
        s = proof_socket(kind, ip, port)
        msg = bytes([3]) + v4(ip, port)
        if s is None:
            u.send(msg)
        else:
            socket.send_fds(u, [msg], [s.fileno()])
            keep.append(s)
        a = u.recv(64)
        answers.append({"proof": kind, "type": a[0], "why": a[7] if a[0] == 9 and len(a) > 7 else None})
    print(json.dumps({"answers": answers}), flush=True)
    stolen = []
    u.settimeout(None)
    while True:
        r, _, _ = select.select([u, sys.stdin], [], [])
        if sys.stdin in r and not sys.stdin.readline():
            break
        if u in r:
            m, fds, _, _ = socket.recv_fds(u, 64, 4)
            if not m:
                break
            for fd in fds:
                c = socket.socket(fileno=fd)
                c.settimeout(5)
                try:
                    stolen.append(c.recv(200).decode(errors="replace"))
                    c.sendall(b"attacker")
                except OSError as e:
                    stolen.append(errno.errorcode.get(e.errno, str(e.errno)))
                c.close()
    print(json.dumps({"stolen": stolen}), flush=True)


def connect_raw(path, src, dst):
    u = runner_hello(path)
    (sip, sport), (dip, dport) = [(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for a in (src, dst)]
    u.send(bytes([2]) + (7).to_bytes(4, "big") + v4(sip, sport) + v4(dip, dport))
    u.settimeout(15)
    m, fds, _, _ = socket.recv_fds(u, 64, 4)
    r = {"type": m[0] if m else None}
    if m and m[0] == 4:
        r["fallback"] = m[5]
    if m and m[0] == 5:
        r["failed"] = m[9]
    if fds:
        c = socket.socket(fileno=fds[0])
        c.settimeout(5)
        try:
            r["banner"] = c.recv(200).decode(errors="replace")
        except OSError as e:
            r["banner_error"] = errno.errorcode.get(e.errno, str(e.errno))
    print(json.dumps(r), flush=True)


def main():
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "serve":
        serve(int(args[0]), int(args[1]))
    elif mode == "client":
        client(args[0], int(args[1]), int(args[2]))
    elif mode == "escape":
        escape(args[0], int(args[1]), int(args[2]), args[3] if len(args) > 3 else None)
    elif mode == "attempts":
        attempts(args[0], int(args[1]))
    elif mode == "hijack":
        hijack(args[0], args[1], int(args[2]), args[3:])
    elif mode == "connect-raw":
        connect_raw(args[0], args[1], args[2])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
