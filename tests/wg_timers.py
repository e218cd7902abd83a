"""WireGuard's timers, watched for 200 s in a lab of their own that runs
beside the other tests (started by conftest.py when test_wireguard_timers.py
is collected; that test reads what it saw):

- a link to a host where nothing answers: its frames wait, its handshake is
  retried every 5 s, given up after 90 s (the frames then counted
  `unreachable`), and started again by the next frame;
- a link carrying a ping a second: the initiator rekeys after 2 minutes, and
  a data message recorded at the start is a replay while its session lives
  and belongs to no session once the session expired, 3 minutes after it
  was made.

Every reading is taken with the time it was taken at, for the test to judge.
"""

from __future__ import annotations

import subprocess
import threading
import time
import traceback

import netlab
from netlab import guest_mac, overlay_ip, underlay_ip

WGKEY_NOBODY = "yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBmk="
RUN_S = 200.0


class Scenario(threading.Thread):
    def __init__(self):
        super().__init__(name="wireguard-timers", daemon=True)
        self.readings: list[tuple[float, str, dict]] = []
        self.notes: dict[str, object] = {}
        self.error: str | None = None
        self.problems: list[str] = []

    def note(self, t0: float, what: str, stats: dict):
        self.readings.append((time.monotonic() - t0, what, stats))

    def run(self):
        try:
            with netlab.Lab("tw") as lab:
                self.scenario(lab)
            self.problems = lab.problems
        except Exception:
            self.error = traceback.format_exc()

    def scenario(self, lab: netlab.Lab):
        from test_wireguard import capture, datagrams, link_stats, public_key, stop_capture, wg_config
        hosts = {h: lab.add_host(h) for h in (1, 2, 3, 9)}
        key = lambda h: lab.tmp / f"h{h}.wgkey"  # noqa: E731
        d = {h: lab.start_vnetd(hosts[h], f"INTERFACE ADD g{h} {guest_mac(h)}\n", "--wireguard-key-file", key(h)) for h in (1, 2, 3)}
        keys = {h: public_key(d[h]) for h in (2, 3)}
        # Host 1's link goes to host 9, where no vnetd runs.
        d[1].ctl_file(wg_config(1, {9: WGKEY_NOBODY}, {1: [1], 9: [9]}))
        d[2].ctl_file(wg_config(2, {3: keys[3]}, {2: [2], 3: [3]}))
        d[3].ctl_file(wg_config(3, {2: keys[2]}, {2: [2], 3: [3]}))
        g = {h: lab.attach_guest(hosts[h], f"g{h}", h) for h in (1, 2, 3)}
        send5 = ("import socket,time;s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
                 f"for _ in range({{n}}): s.sendto(b'w'*100,({overlay_ip(9)!r},9)); time.sleep(0.01)\n")
        lab.x(g[1].ns, "ip", "neigh", "replace", overlay_ip(9), "lladdr", guest_mac(9), "dev", g[1].tap, "nud", "permanent")
        pcap = lab.tmp / "h2-data.pcap"
        cap = capture(lab, hosts[3], "eth0", pcap, ("udp", "and", "src", "host", underlay_ip(2)))
        t0 = time.monotonic()
        self.notes["start"] = t0
        lab.x(g[1].ns, "python3", "-c", send5.format(n=5))
        ping = lab.popen(g[2].ns, "ping", "-n", "-q", "-i", "1", "-c", str(int(RUN_S)), g[3].ip,
                         stdout=subprocess.PIPE, text=True)
        time.sleep(3)
        stop_capture(cap)
        data = [p for p in datagrams(lab, pcap) if p[0] == 4 and len(p) > 100]
        self.notes["captured"] = len(data)
        spoof = netlab.REPO / "tests" / "tools" / "spoof.py"

        def replay():
            lab.x(hosts[2], "python3", spoof, underlay_ip(2), "51820", underlay_ip(3), "51820", data[0].hex(), "1")

        replayed = {"early": False, "late": False}
        # Read every 5 s; replay the recorded datagram at 60 s and 190 s;
        # after host 1's handshake is given up, one more frame at 100 s.
        more_sent = False
        while time.monotonic() - t0 < RUN_S - 2:
            now = time.monotonic() - t0
            self.note(t0, "h1.h9", link_stats(d[1], "h9"))
            self.note(t0, "h1.global", d[1].stats()["global"])
            for h, p in ((2, 3), (3, 2)):
                self.note(t0, f"h{h}.h{p}", link_stats(d[h], f"h{p}"))
            if data and now >= 60 and not replayed["early"]:
                replay()
                replayed["early"] = True
                self.notes["early_replay_at"] = now
            if data and now >= 190 and not replayed["late"]:
                replay()
                replayed["late"] = True
                self.notes["late_replay_at"] = now
            if now >= 100 and not more_sent:
                lab.x(g[1].ns, "python3", "-c", send5.format(n=1))
                more_sent = True
                self.notes["more_sent_at"] = now
            time.sleep(5 - (time.monotonic() - t0) % 5)
        time.sleep(1)
        for h, p in ((2, 3), (3, 2)):
            self.note(t0, f"h{h}.h{p}", link_stats(d[h], f"h{p}"))
        out = ping.communicate(timeout=30)[0]
        self.notes["ping"] = out.strip().splitlines()[-2] if out.strip() else ""


_running: Scenario | None = None


def start() -> Scenario:
    global _running
    if _running is None:
        _running = Scenario()
        _running.start()
    return _running
