"""The drop reasons a user can cause from outside, each counted exactly
where the frame was dropped (docs/control-language.md, Counters): a guest
whose NIC is down (`down`), a link the kernel cannot send on (`tx_error`),
a UDP socket whose send buffer is full (`queue_full`). (`no_route`,
`unknown_sender`, `malformed` and `oversize` are in test_hostile.py,
test_overlay.py and test_links.py.) In each, every frame vnetd took in is
either sent or counted."""

import time

from netlab import wait_until
from test_overlay import build_mesh


def blast(lab, g, dst_ip, n, size=100):
    """n UDP datagrams from guest g to dst_ip, as fast as it goes."""
    lab.x(g.ns, "python3", "-c",
          "import socket;s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
          f"for _ in range({n}): s.sendto(b'q'*{size},({dst_ip!r},7))\n")


def rx_packets(lab, g) -> int:
    return int(lab.x(g.ns, "cat", f"/sys/class/net/{g.tap}/statistics/rx_packets").stdout)


def pin_neighbour(lab, g, ip, mac):
    lab.x(g.ns, "ip", "neigh", "replace", ip, "lladdr", mac, "dev", g.tap, "nud", "permanent")


def delta(after, before, key):
    return {k: v - before[key][k] for k, v in after[key].items() if isinstance(v, int)}


def settled(d, key, field, want, timeout=5):
    """Polls until d's counter reaches `want` (or the deadline); returns the stats."""
    wait_until(lambda: d.stats()[key][field] >= want, timeout=timeout)
    return d.stats()


def test_frames_for_a_guest_whose_nic_is_down_are_counted_down(lab):
    _, d, g = build_mesh(lab, {1: [1], 2: [2]})
    assert lab.reaches(g[1], g[2])
    pin_neighbour(lab, g[1], g[2].ip, g[2].mac)
    lab.x(g[2].ns, "ip", "link", "set", "g2", "down")
    before = d[2].stats()
    blast(lab, g[1], g[2].ip, 100)
    after = settled(d[2], "interface g2", "drop_down", before["interface g2"]["drop_down"] + 100)
    got = delta(after, before, "interface g2")
    assert got["drop_down"] == 100 and got["out_frames"] == 0, got
    assert after["global"]["drop_down"] == 100
    # Up again: delivered again.
    lab.x(g[2].ns, "ip", "link", "set", "g2", "up")
    assert lab.reaches(g[1], g[2])


def test_a_link_the_kernel_cannot_send_on_counts_tx_error(lab):
    # A link to an address host 1 has no route to: every send fails (ENETUNREACH).
    _, d, g = build_mesh(lab, {1: [1], 2: [2]})
    d[1].ctl_file("LINK ADD 10.255.0.1 name nowhere\nROUTE ADD any 02:00:00:00:00:77 edge nowhere any\n")
    pin_neighbour(lab, g[1], "198.19.0.77", "02:00:00:00:00:77")
    before = d[1].stats()
    blast(lab, g[1], "198.19.0.77", 100)
    after = settled(d[1], "link nowhere", "drop_tx_error", 100)
    got = delta(after, before, "link nowhere")
    assert got["drop_tx_error"] == 100 and got["out_frames"] == 0, got
    assert delta(after, before, "interface g1")["in_frames"] == 100
    # The guest's other link is unaffected.
    assert lab.reaches(g[1], g[2])


def test_a_full_udp_send_buffer_counts_queue_full(lab):
    # Host 1's underlay NIC drains at 1 Mbit/s (tbf, with room to queue and
    # never drop): the link's UDP socket buffer fills, and vnetd's sends
    # fail with EAGAIN.
    hosts, d, g = build_mesh(lab, {1: [1], 2: [2]})
    assert lab.reaches(g[1], g[2])
    pin_neighbour(lab, g[1], g[2].ip, g[2].mac)
    lab.x(hosts[1], "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "1mbit", "burst", "5kb", "limit", "200mb")
    # The guest's burst must reach vnetd whole: a TAP queue of 1000 frames
    # overflows under it (the guest's own drop, before vnetd), and then the
    # socket buffer might never fill.
    lab.x(g[1].ns, "ip", "link", "set", g[1].tap, "txqueuelen", "50000")
    before = d[1].stats()
    n = 20_000
    blast(lab, g[1], g[2].ip, n, size=1400)
    key = "link 198.18.0.2"
    wait_until(lambda: d[1].stats()["interface g1"]["in_frames"] - before["interface g1"]["in_frames"] >= n, timeout=5)
    after = d[1].stats()
    link, g1 = delta(after, before, key), delta(after, before, "interface g1")
    # Some queued (vnetd forces a 16 MiB socket buffer: about 8500 such
    # datagrams), the rest counted.
    assert link["drop_queue_full"] > 1000 and link["out_frames"] > 1000, link
    # Every frame g1 sent was sent on, or counted (nothing else is going on).
    assert g1["in_frames"] == link["out_frames"] + link["drop_queue_full"], (g1, link)
    assert after["global"]["drop_queue_full"] == link["drop_queue_full"]
    qdisc = lab.x(hosts[1], "tc", "-s", "qdisc", "show", "dev", "eth0").stdout
    assert "dropped 0," in qdisc, qdisc  # the kernel dropped nothing below vnetd
    assert lab.x(g[1].ns, "cat", f"/sys/class/net/{g[1].tap}/statistics/tx_dropped").stdout.strip() == "0" 


def test_frames_a_guest_sent_while_vnetd_was_behind_are_counted_where_its_tap_dropped_them(lab):
    """vnetd stopped (as if busy): the guest's TAP queue fills and the
    kernel drops the rest. STATS says how many, equal to the device's own
    count, wherever the guest keeps the device (it renames it here); the
    frames the queue held are forwarded once vnetd runs again, so the other
    guest receives exactly the 3000 sent less those dropped.
    Catches: frames held in the queue lost or sent twice on resuming; a
    drop count that is not what was lost (the receiver's own count is
    independent of the sender's sysfs counter that STATS reads)."""
    import signal
    _, d, g = build_mesh(lab, {1: [1], 2: [2]})
    lab.x(g[1].ns, "ip", "link", "set", "g1", "down")
    lab.x(g[1].ns, "ip", "link", "set", "g1", "name", "eth7")
    lab.x(g[1].ns, "ip", "link", "set", "eth7", "up")
    lab.x(g[1].ns, "ip", "neigh", "replace", g[2].ip, "lladdr", g[2].mac, "dev", "eth7", "nud", "permanent")
    # No ARP either way: g2's receive count is the blast's datagrams alone
    # (g2 answers each with an ICMP error, which is g2's transmit).
    pin_neighbour(lab, g[2], g[1].ip, g[1].mac)
    kernel = lambda: int(lab.x(g[1].ns, "cat", "/sys/class/net/eth7/statistics/tx_dropped").stdout)
    k0, before = kernel(), d[1].stats()["interface g1"]["drop_upcall_full"]
    rx0 = rx_packets(lab, g[2])
    d[1].proc.send_signal(signal.SIGSTOP)
    try:
        blast(lab, g[1], g[2].ip, 3000)
    finally:
        d[1].proc.send_signal(signal.SIGCONT)
    lost = kernel() - k0
    assert lost > 1000, f"the TAP's queue should have overflowed, the kernel counted {lost}"
    after = d[1].stats()
    assert after["interface g1"]["drop_upcall_full"] - before == lost
    # The frames it held were forwarded once vnetd ran again, each once.
    assert wait_until(lambda: rx_packets(lab, g[2]) - rx0 >= 3000 - lost, timeout=5), rx_packets(lab, g[2]) - rx0
    time.sleep(0.3)  # nothing more comes
    assert rx_packets(lab, g[2]) - rx0 == 3000 - lost, (rx_packets(lab, g[2]) - rx0, lost)
