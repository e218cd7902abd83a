"""The shipped example configs (the demo's) build a working overlay."""

from netlab import REPO, Lab

LAYOUT = {1: [("g1", 1), ("g2", 2)], 2: [("g3", 3)], 3: [("g4", 4)]}


def test_demo_configs_connect_every_guest(lab: Lab):
    hosts = {h: lab.add_host(h) for h in LAYOUT}
    daemons = {h: lab.start_vnetd(hosts[h], REPO / "examples" / "demo" / f"h{h}.conf") for h in LAYOUT}
    g = {tap: lab.attach_guest(hosts[h], tap, n) for h, gs in LAYOUT.items() for tap, n in gs}
    failed = [(a, b) for a in g for b in g if a != b and not lab.reaches(g[a], g[b])]
    assert failed == []
    # g4 reaches g3 through its per-source default route (dst-MAC none).
    routes = daemons[3].ctl("ROUTE", "LIST").stdout.splitlines()
    (default,) = [line.split()[1] for line in routes if " none " in line]
    assert daemons[3].stats()[f"route {default}"]["frames"] > 0
