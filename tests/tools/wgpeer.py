#!/usr/bin/env python3
"""A WireGuard peer and attacker of our own, for the tests and benchmarks
that play one against vnetd (the protocol from the WireGuard paper, section
5; the primitives from `cryptography` and `hashlib`).

As a library:
  Initiator(responder_public, static_private=None): makes initiations
    (with its own key, or keyless: naming any static key, a garbage
    timestamp), takes responses (a `Session`) and cookie replies (MAC2
    for the next initiation).
  Session.seal(packet) / Session.open(message): data messages.
  inner(src, dst, frame): a frame as vnetd carries it inside the tunnel.

As a program (`wgpeer.py flood ...`): a keyless flood of a host's WireGuard
port at a set rate, of initiations naming real keys (MAC1 valid, MAC2 with
the cookie the victim gave this address once it asked for one), and data
messages naming live receiver indices; it prints what it sent and the
cookie replies it got, as JSON, when done.
"""
import hashlib
import hmac
import json
import os
import socket
import struct
import sys
import threading
import time

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives import serialization

CONSTRUCTION = b"Noise_IKpsk2_25519_ChaChaPoly_BLAKE2s"
IDENTIFIER = b"WireGuard v1 zx2c4 Jason@zx2c4.com"
LABEL_MAC1 = b"mac1----"
LABEL_COOKIE = b"cookie--"


def h(*parts: bytes) -> bytes:
    return hashlib.blake2s(b"".join(parts)).digest()


def mac(key: bytes, data: bytes) -> bytes:
    return hashlib.blake2s(data, key=key, digest_size=16).digest()


def hm(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.blake2s).digest()


def kdf(key: bytes, data: bytes, n: int) -> list[bytes]:
    t0 = hm(key, data)
    out, prev = [], b""
    for i in range(1, n + 1):
        prev = hm(t0, prev + bytes([i]))
        out.append(prev)
    return out


def aead(key: bytes, counter: int, plain: bytes, ad: bytes) -> bytes:
    return ChaCha20Poly1305(key).encrypt(b"\0" * 4 + struct.pack("<Q", counter), plain, ad)


def aead_open(key: bytes, counter: int, sealed: bytes, ad: bytes) -> bytes:
    return ChaCha20Poly1305(key).decrypt(b"\0" * 4 + struct.pack("<Q", counter), sealed, ad)


def _rotl(v, c):
    return ((v << c) & 0xFFFFFFFF) | (v >> (32 - c))


def hchacha20(key: bytes, nonce16: bytes) -> bytes:
    """XChaCha20's subkey (draft-irtf-cfrg-xchacha, section 2.2)."""
    s = [0x61707865, 0x3320646E, 0x79622D32, 0x6B206574] + list(struct.unpack("<8I", key)) + list(struct.unpack("<4I", nonce16))

    def qr(a, b, c, d):
        s[a] = (s[a] + s[b]) & 0xFFFFFFFF; s[d] = _rotl(s[d] ^ s[a], 16)
        s[c] = (s[c] + s[d]) & 0xFFFFFFFF; s[b] = _rotl(s[b] ^ s[c], 12)
        s[a] = (s[a] + s[b]) & 0xFFFFFFFF; s[d] = _rotl(s[d] ^ s[a], 8)
        s[c] = (s[c] + s[d]) & 0xFFFFFFFF; s[b] = _rotl(s[b] ^ s[c], 7)

    for _ in range(10):
        qr(0, 4, 8, 12); qr(1, 5, 9, 13); qr(2, 6, 10, 14); qr(3, 7, 11, 15)
        qr(0, 5, 10, 15); qr(1, 6, 11, 12); qr(2, 7, 8, 13); qr(3, 4, 9, 14)
    return struct.pack("<8I", *(s[0:4] + s[12:16]))


def xaead_open(key: bytes, nonce24: bytes, sealed: bytes, ad: bytes) -> bytes:
    sub = hchacha20(key, nonce24[:16])
    return ChaCha20Poly1305(sub).decrypt(b"\0" * 4 + nonce24[16:], sealed, ad)


def tai64n(t: float | None = None) -> bytes:
    t = time.time() if t is None else t
    return struct.pack(">QI", (1 << 62) + 10 + int(t), int((t % 1) * 1e9))


def raw(pub) -> bytes:
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def private_raw(priv) -> bytes:
    return priv.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())


def dh(priv, pub: bytes) -> bytes:
    return priv.exchange(X25519PublicKey.from_public_bytes(pub))


def keypair():
    """A new static key pair: (private key, base64 public key as `wg` prints it)."""
    import base64
    k = X25519PrivateKey.generate()
    return k, base64.b64encode(raw(k.public_key())).decode()


class Session:
    def __init__(self, send: bytes, recv: bytes, receiver: int, local: int):
        self.send, self.recv, self.receiver, self.local = send, recv, receiver, local
        self.counter = 0

    def seal(self, packet: bytes) -> bytes:
        c = self.counter
        self.counter += 1
        return struct.pack("<I", 4) + struct.pack("<IQ", self.receiver, c) + aead(self.send, c, packet, b"")

    def open(self, msg: bytes) -> bytes:
        receiver, counter = struct.unpack("<IQ", msg[4:16])
        assert receiver == self.local, "not our session"
        return aead_open(self.recv, counter, msg[16:], b"")


class Initiator:
    """The initiator's side of WireGuard's handshake toward the responder
    holding `responder_public` (32 bytes)."""

    def __init__(self, responder_public: bytes, static_private=None):
        self.rpub = responder_public
        self.static = static_private
        self.cookie = None
        self.last_mac1 = {}
        self.state = {}

    def initiation(self, named: bytes | None = None, sender: int | None = None, timestamp: bytes | None = None) -> bytes:
        """An initiation. With a key of our own, a real one; keyless, it names
        `named` (anyone's public key) and carries a timestamp nobody can
        open: MAC1 valid, refused only after the responder's X25519s."""
        sender = int.from_bytes(os.urandom(4), "little") if sender is None else sender
        c = h(CONSTRUCTION)
        hh = h(h(c, IDENTIFIER), self.rpub)
        e = X25519PrivateKey.generate()
        epub = raw(e.public_key())
        c = kdf(c, epub, 1)[0]
        hh = h(hh, epub)
        c, k = kdf(c, dh(e, self.rpub), 2)
        spub = named if self.static is None else raw(self.static.public_key())
        enc_static = aead(k, 0, spub, hh)
        hh = h(hh, enc_static)
        if self.static is None:
            enc_ts = os.urandom(28)
        else:
            c, k = kdf(c, dh(self.static, self.rpub), 2)
            enc_ts = aead(k, 0, timestamp or tai64n(), hh)
        hh = h(hh, enc_ts)
        msg = struct.pack("<I", 1) + struct.pack("<I", sender) + epub + enc_static + enc_ts
        return self.finish(msg, sender, (e, c, hh))

    def finish(self, msg: bytes, sender: int, state=None) -> bytes:
        """MAC1 and MAC2 (with the cookie we hold, if any) on a message."""
        m1 = mac(h(LABEL_MAC1, self.rpub), msg)
        m2 = mac(self.cookie, msg + m1) if self.cookie else b"\0" * 16
        self.last_mac1[sender] = m1
        if state:
            self.state[sender] = state
        return msg + m1 + m2

    def remac(self, init: bytes) -> bytes:
        """The same initiation, its MAC2 made with the cookie held now."""
        sender = struct.unpack("<I", init[4:8])[0]
        return self.finish(init[:116], sender)

    def take_cookie(self, reply: bytes) -> bool:
        """A cookie reply to one of our messages: its cookie, for MAC2 from now on."""
        receiver = struct.unpack("<I", reply[4:8])[0]
        m1 = self.last_mac1.get(receiver)
        if m1 is None:
            return False
        try:
            self.cookie = xaead_open(h(LABEL_COOKIE, self.rpub), reply[8:32], reply[32:64], m1)
        except Exception:
            return False
        return True

    def response(self, msg: bytes) -> Session:
        sender, receiver = struct.unpack("<II", msg[4:12])
        e, c, hh = self.state[receiver]
        epub_r = msg[12:44]
        c = kdf(c, epub_r, 1)[0]
        hh = h(hh, epub_r)
        c = kdf(c, dh(e, epub_r), 1)[0]
        c = kdf(c, dh(self.static, epub_r), 1)[0]
        c, tau, k = kdf(c, b"\0" * 32, 3)
        hh = h(hh, tau)
        aead_open(k, 0, msg[44:60], hh)
        send, recv = kdf(c, b"", 2)
        return Session(send, recv, sender, receiver)


def inner(src: str, dst: str, frame: bytes, port: int = 9000) -> bytes:
    """A frame as vnetd carries it inside the tunnel: IPv4/UDP, both ports 9000."""
    udp = struct.pack("!HHHH", port, port, 8 + len(frame), 0) + frame
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0x4000, 64, 17, 0, socket.inet_aton(src), socket.inet_aton(dst))
    s = sum(struct.unpack("!10H", ip))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    ip = ip[:10] + struct.pack("!H", ~s & 0xFFFF) + ip[12:]
    return ip + udp


def ethernet(dst: str, src: str, payload: bytes, ethertype: int = 0x88B5) -> bytes:
    return bytes.fromhex(dst.replace(":", "")) + bytes.fromhex(src.replace(":", "")) + struct.pack("!H", ethertype) + payload


def flood(args):
    """flood DST PORT RATE SECONDS RESPONDER_PUB_B64 NAMED_KEYS_B64(,..) [INDICES(,..)]"""
    import base64
    dst, port, rate, seconds = args[0], int(args[1]), float(args[2]), float(args[3])
    rpub = base64.b64decode(args[4])
    named = [base64.b64decode(k) for k in args[5].split(",") if k]
    indices = [int(i) for i in args[6].split(",") if i] if len(args) > 6 else []
    me = Initiator(rpub)
    pool = [me.initiation(named=named[i % len(named)]) for i in range(64)]
    data = [struct.pack("<I", 4) + struct.pack("<IQ", (idx << 8) | 1, 1_000_000 + k) + os.urandom(132)
            for k, idx in enumerate(indices * (16 // max(1, len(indices)) + 1))][:16] if indices else []
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    s.bind(("0.0.0.0", 0))
    s.connect((dst, port))
    got = {"cookie_replies": 0, "cookies_taken": 0, "other": 0}
    lock = threading.Lock()
    stop = threading.Event()

    def listen():
        s.settimeout(0.2)
        while not stop.is_set():
            try:
                m = s.recv(2048)
            except (socket.timeout, ConnectionRefusedError):
                continue
            if m[:1] == b"\x03" and len(m) == 64:
                got["cookie_replies"] += 1
                with lock:
                    if me.take_cookie(m):
                        got["cookies_taken"] += 1
                        pool[:] = [me.remac(p) for p in pool]
            else:
                got["other"] += 1

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    sent = {"initiations": 0, "data": 0, "send_errors": 0}
    start = time.monotonic()
    n = 0
    while True:
        now = time.monotonic() - start
        if now >= seconds:
            break
        due = int(now * rate)
        with lock:
            while n < due:
                if data and n % 4 == 3:
                    msg = data[n % len(data)]
                    kind = "data"
                else:
                    msg = pool[n % len(pool)]
                    kind = "initiations"
                try:
                    s.send(msg)
                    sent[kind] += 1
                except OSError:
                    sent["send_errors"] += 1
                n += 1
        time.sleep(0.001)
    stop.set()
    t.join()
    print(json.dumps({"sent": sent, "got": got, "seconds": time.monotonic() - start}))


UDP_SEGMENT = 103


def gso_tail(args):
    """gso-tail PORT DST_IP DST_PORT RESPONDER_PUB_B64 PRIVATE_HEX SRC_IP DST_MAC SRC_MAC COUNT SEG LISTEN_S

    A peer holding its own key (the review's F1): it ignores the responder's
    initiations (so the responder's frames for it wait), makes a handshake
    as initiator, then sends COUNT data messages of SEG bytes each (frames
    from SRC_MAC to DST_MAC) and a fresh initiation as the last, shorter,
    segment of one UDP GSO send. It then listens LISTEN_S seconds and
    prints, as JSON, the frames it got back under its sessions (sizes)."""
    import base64
    port, dst, dport = int(args[0]), args[1], int(args[2])
    rpub, priv = base64.b64decode(args[3]), X25519PrivateKey.from_private_bytes(bytes.fromhex(args[4]))
    src_ip, dst_mac, src_mac, count, seg, listen = args[5], args[6], args[7], int(args[8]), int(args[9]), float(args[10])
    me = Initiator(rpub, priv)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.bind(("0.0.0.0", port))
    s.settimeout(5)
    to = (dst, dport)

    def handshake():
        s.sendto(me.initiation(), to)
        while True:
            m, _ = s.recvfrom(65535)
            if m[:1] == b"\x02" and len(m) == 92:
                return me.response(m)

    sessions = [handshake()]
    frame_len = seg - 16 - 16 - 28
    run = b""
    for k in range(count):
        frame = ethernet(dst_mac, src_mac, bytes([k % 256]) * (frame_len - 14))
        msg = sessions[0].seal(inner(src_ip, dst, frame))
        assert len(msg) == seg, (len(msg), seg)
        run += msg
    run += me.initiation()
    s.sendmsg([run], [(socket.SOL_UDP, UDP_SEGMENT, struct.pack("=H", seg))], 0, to)
    sizes, end = [], time.monotonic() + listen
    s.settimeout(0.2)
    while time.monotonic() < end:
        try:
            m, _ = s.recvfrom(65535)
        except socket.timeout:
            continue
        if m[:1] == b"\x02" and len(m) == 92:
            try:
                sessions.append(me.response(m))
            except Exception:
                pass
        elif m[:1] == b"\x04" and len(m) > 32:
            receiver = struct.unpack("<I", m[4:8])[0]
            for ses in sessions:
                if ses.local == receiver:
                    p = ses.open(m)
                    if p:
                        # The inner packet's own length: what follows it is
                        # WireGuard's padding (to 16 bytes).
                        sizes.append(struct.unpack("!H", p[2:4])[0] - 28)
    print(json.dumps({"frames_back": sizes}))


if __name__ == "__main__":
    {"flood": flood, "gso-tail": gso_tail}[sys.argv[1]](sys.argv[2:])
