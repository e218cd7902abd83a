"""A 50-host smoke of the control plane at scale (bench/scale.py, issue 44):
50 hosts, each a real vnetd and vnet-agent in its own namespace, two guests
each in 5 networks, on a 3-member etcd cluster. Asserted as a user of the
overlay would check it, never timed:

- every host routes every remote guest of its networks (bring-up);
- a guest added on one host is routed by every host of its network, and
  after its migration to another host every one of them routes it there;
- nothing grows when nothing changes: 10 s idle cost etcd no request but the
  leases' keep-alives (no periodic pass writes or reads etcd);
- a change costs etcd O(1) writes, not one per host, and each host a watch
  event or two.

The figures (delays, CPU) are the benchmark's to print: `python3
bench/scale.py`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import scale  # noqa: E402


def unary(calls: dict) -> float:
    """etcd's requests in a change window, less streams' messages."""
    return sum(v for k, v in calls.items() if k not in ("watch_events", "LeaseKeepAlive", "keepalive_msgs", "Watch"))


def test_fifty_hosts_converge_follow_changes_and_cost_etcd_nothing_idle(lab):
    res = scale.measure(lab, hosts=50, guests=2, members=3, networks=5, changes=2)
    # vnetd --no-fast-path loaded no kernel datapath: nothing pinned.
    for host in lab.hosts:
        pins = lab.pin_dir(host)
        assert not pins.exists() or not any(pins.iterdir()), f"{host}: {list(pins.iterdir())}"
    # Bring-up converged (measure raises otherwise); each host routes the
    # remote guests of its networks: 2 networks of 5, 20 members each.
    assert res["routes_per_host"] > 0
    # Every host of the network routed each added and migrated guest
    # (measure raises if one never did): one delay per host.
    members = 50 * 2 // 5
    for d in res["add_delays_s"]:
        assert len(d) == members - 1
    for d in res["migrate_delays_s"]:
        assert len(d) >= members - 1
    # Idle: the keep-alives, and nothing else.
    assert res["idle_keepalives_per_s"] > 0
    assert res["idle_other_per_s"] == 0, res["etcd_background_per_s"]
    # A change: a write or two (the claim; the release and the new claim at
    # a migration), whatever the number of hosts.
    for calls in res["etcd_add"]:
        assert unary(calls) <= 2, calls
        # ...and each host one watch event (the claim), not a resync.
        assert calls.get("watch_events", 0) <= 2 * 50, calls
    # A migration: the old host's release and the new host's claim; when
    # the new host claimed first (a hand-over), its claim made again and
    # the early one deleted, and the old released record deleted: five at
    # most, whatever the number of hosts.
    for calls in res["etcd_migrate"]:
        assert unary(calls) <= 5, calls
