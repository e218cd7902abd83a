"""Hostile input at a running vnetd: garbage from strangers and from forged
peer addresses, floods, broken framing, all while a legitimate TCP stream
goes on. It keeps forwarding the legitimate traffic, its memory stays
bounded, and every dropped datagram is counted under a reason."""

import subprocess
import sys
import time

from netlab import REPO, guest_mac, mesh_config, udp_rcvbuf_errors, wait_until

HOSTILE = REPO / "tests" / "tools" / "hostile.py"
STREAM = REPO / "tests" / "tools" / "stream.py"

# What tools/hostile.py sends, batch by batch (datagrams).
BATCHES = {"runts": 140, "no_route": 50, "oversize": 20, "strangers": 300, "vxlan_bad_header": 30,
           "vxlan_unknown_vni": 30, "flood": 30000, "forged": 20000}


def rss_kb(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def rx_packets(lab, g):
    return int(lab.x(g.ns, "cat", f"/sys/class/net/{g.tap}/statistics/rx_packets").stdout)


def run_hostile(lab, evil, g1, g2, g3, stream):
    """Runs tools/hostile.py from host `evil` at host 1 (peer: host 2) and
    checks it sent every batch, with the legitimate `stream` still running
    after each."""
    hostile = lab.popen(evil, "python3", HOSTILE, "198.18.0.1", "198.18.0.2", "198.18.0.9",
                        g1.mac, g2.mac, g3.mac, stdout=subprocess.PIPE, text=True)
    done = {}
    for line in hostile.stdout:
        if line.strip() == "done":
            break
        name, n = line.split()
        done[name] = int(n)
        assert stream.poll() is None, f"the stream had ended before batch {name}"
    assert hostile.wait(timeout=60) == 0
    assert done == BATCHES


def test_hostile_traffic_is_dropped_and_counted_while_legit_traffic_flows(lab):
    # g3 is on host 1 too, and nobody talks to it: only the forged frames reach it.
    layout = {1: [("g1", guest_mac(1)), ("g3", guest_mac(3))], 2: [("g2", guest_mac(2))]}
    h1, h2, evil = lab.add_host(1), lab.add_host(2), lab.add_host(9)  # evil: 198.18.0.9, no vnetd
    # Guests take 1000-byte MTUs, so a forged frame that fits the LAN can still be too big for them.
    d1 = lab.start_vnetd(h1, mesh_config(1, layout, mtu=1000) + "LINK ADD 198.18.0.2 vxlan vni 42 name vx\n"
                                                                 "LINK ADD 198.18.0.2 tcp key lab name t2\n")
    lab.start_vnetd(h2, mesh_config(2, layout, mtu=1000))
    g1, g2, g3 = lab.attach_guest(h1, "g1", 1), lab.attach_guest(h2, "g2", 2), lab.attach_guest(h1, "g3", 3)
    assert lab.reaches(g1, g2)
    rss0 = rss_kb(d1.proc.pid)
    rcvbuf0 = udp_rcvbuf_errors(lab, h1)

    # The legitimate traffic: a paced TCP stream from g2 to g1 (8 MB/s) that
    # runs until the whole hostile phase is over.
    recv = lab.popen(g1.ns, "python3", STREAM, "recv", 5001, stdout=subprocess.PIPE, text=True)
    assert recv.stdout.readline().strip() == "listening"
    send = lab.popen(g2.ns, "python3", STREAM, "send", g1.ip, 5001, "eof",
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)  # under way
    assert d1.stats()["interface g1"]["out_frames"] > 100, "the stream flows before the attack"
    before = d1.stats()
    g3_rx = rx_packets(lab, g3)

    # The hostile input, from one process on the stranger's host.
    run_hostile(lab, evil, g1, g2, g3, send)
    # A TCP link's stream out of step: the peer, past the key handshake,
    # announces a bad length; vnetd counts it and closes the connection at once.
    peer = subprocess.run(["ip", "netns", "exec", h2, sys.executable, REPO / "tests" / "tools" / "tcp_link_peer.py",
                           "connect", "198.18.0.1", "9000", lab.key_dir / "lab"],
                          input="send 0000000568656c6c6f\neof 2\n", capture_output=True, text=True, timeout=30)
    assert peer.stdout.split("\n")[:3] == ["up", "sent", "eof 0"], peer.stdout + peer.stderr
    # The legitimate stream was still running after the last hostile batch.
    assert send.poll() is None, "the stream ended before the hostile input did"
    time.sleep(0.3)
    sent = send.communicate(input="", timeout=60)[0].split()  # its stdin closed: it ends
    got = recv.communicate(timeout=60)[0].split()
    assert got[:2] == sent and int(sent[0]) > 1_000_000, (sent, got)
    gap_ms = float(got[2])

    drops = {
        ("link 198.18.0.2", "malformed"): BATCHES["runts"],
        ("link 198.18.0.2", "no_route"): BATCHES["no_route"],
        ("interface g1", "oversize"): BATCHES["oversize"],
        # Strangers, the unknown VNI and the flood: unknown sender; the bad
        # VXLAN header: malformed (no link to blame); the TCP stream: its link.
        ("global", "unknown_sender"): BATCHES["strangers"] + BATCHES["vxlan_unknown_vni"] + BATCHES["flood"],
        ("global", "malformed"): BATCHES["runts"] + BATCHES["vxlan_bad_header"] + 1,
        ("link t2", "malformed"): 1,
    }

    def deltas():
        after = d1.stats()
        got = {k: after[k[0]][f"drop_{k[1]}"] - before[k[0]][f"drop_{k[1]}"] for k in drops}
        got["g3 delivered"] = after["interface g3"]["out_frames"] - before["interface g3"]["out_frames"]
        got["g3 received"] = rx_packets(lab, g3) - g3_rx
        return got

    want = {**drops, "g3 delivered": BATCHES["forged"], "g3 received": BATCHES["forged"]}
    counted = wait_until(lambda: (c := deltas()) == want and c, timeout=5) or deltas()
    # Each drop reason counts exactly what was sent, and the 20 000 forged
    # frames (the only traffic to g3) were each delivered once.
    assert counted == want, f"UDP receive-buffer drops in h1: {udp_rcvbuf_errors(lab, h1) - rcvbuf0}"
    # Everything else the stream's link and g1 saw was the stream's own: no drop.
    after = d1.stats()
    assert after["global"]["drop_no_route"] == BATCHES["no_route"]
    assert after["interface g1"]["drop_oversize"] == BATCHES["oversize"]
    # The stream kept flowing through the attack.
    assert gap_ms < 1000, f"the stream stalled {gap_ms} ms"
    # The route cache held to its bounds: the 20 000 made-up source MACs came
    # from one origin (the forged peer), which may hold a quarter of the 16 Ki
    # entries; the few other flows take a handful more.
    entries = after["dispatch"]["cache_entries"]
    print("route cache entries after the flood:", entries)
    assert 1024 <= entries <= 4096 + 64, entries
    # Bounded memory: the flood and the garbage left no lasting growth.
    assert rss_kb(d1.proc.pid) - rss0 < 64 * 1024, (rss0, rss_kb(d1.proc.pid))
    assert d1.proc.poll() is None
    assert lab.reaches(g1, g2)
    print(f"stream: {sent[0]} bytes, longest gap {gap_ms} ms")
