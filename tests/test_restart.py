"""End to end: the kernel datapath outlives vnetd (docs/operations.md, "Restarts
and upgrades"). Two hosts, veth guests on the fast path; vnetd on one host is
killed (SIGKILL), stopped (SIGTERM, as `systemctl restart` does) or replaced
by another build, and started again with its config. What the guests see is
the check: pings counted, long-lived TCP connections used after each event
(a broken one fails the test, as in Cilium's NoInterruptedConnections)."""

import signal
import subprocess
import time

from netlab import REPO, fast_stats, veth_mesh, wait_until

CONNS = REPO / "tests" / "tools" / "conns.py"


def restart(lab, d, sig=signal.SIGKILL, down=2.0, config=None, binary=None):
    """Stops `d` with `sig`, waits `down` seconds, starts vnetd again on
    its host with its config (or `config`); returns the new one."""
    d.stop(sig)
    time.sleep(down)
    return lab.start_vnetd(d.host, config or d.config, binary=binary)


def test_sigkill_and_restart_under_a_500_per_s_ping_loses_no_ping(lab):
    """vnetd on host 1 is SIGKILLed under a 500/s ping between the hosts'
    guests and started again 2 s later: every ping is answered, the guest's
    device and address are untouched, and the new vnetd says it adopted the
    pinned datapath (flows, ports, links, attachments) rather than making one.
    Catches: attachments not pinned (the programs go with vnetd: ~1000 pings
    lost), maps made anew (every flow a miss while vnetd is away), a start
    that removes the adopted entries before its config is in (a window of
    misses), programs not switched (log)."""
    hosts, d, g = veth_mesh(lab, {1: [1], 2: [2]})
    assert "3 received" in lab.ping(g[1], g[2], count=3).stdout
    link0 = lab.x(g[1].ns, "ip", "-o", "addr", "show", "dev", "g1").stdout
    ping = lab.popen(g[1].ns, "ping", "-q", "-i", "0.002", "-c", "3000", "-W", "1", g[2].ip,
                     stdout=subprocess.PIPE, text=True)
    time.sleep(1)
    d1 = restart(lab, d[1])
    out = ping.communicate(timeout=60)[0]
    assert "3000 packets transmitted, 3000 received" in out, out
    log = d1.log_text()
    assert "adopted from" in log and "1 flow entries" not in log, log
    assert lab.x(g[1].ns, "ip", "-o", "addr", "show", "dev", "g1").stdout == link0
    # The new vnetd carries on in the kernel, counters and all.
    f = fast_stats(d1)
    assert f["hit_guest"] >= 2900 and f["hit_net"] >= 2900, f
