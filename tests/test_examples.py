"""The shipped example configs (the demo's) build a working overlay."""

from netlab import REPO, Lab

LAYOUT = {1: [("g1", 1), ("g2", 2)], 2: [("g3", 3)], 3: [("g4", 4)]}


VETH = {"g1", "g2", "g3"}


def test_demo_configs_connect_every_guest(lab: Lab):
    hosts = {h: lab.add_host(h) for h in LAYOUT}
    gns = {name: lab.guest_ns(name) for name in VETH}
    daemons = {h: lab.start_vnetd(hosts[h], lab.config_text(REPO / "examples" / "demo" / f"h{h}.conf"))
               for h in LAYOUT}
    g = {name: lab.veth_guest(hosts[h], name, n, gns[name]) if name in VETH else lab.attach_guest(hosts[h], name, n)
         for h, gs in LAYOUT.items() for name, n in gs}
    failed = [(a, b) for a in g for b in g if a != b and not lab.reaches(g[a], g[b])]
    assert failed == []
    # The veth guests' traffic went through the kernel (between g1 and g3
    # at least: both ends are fast-path ports); g4's host has none.
    assert lab.ping(g["g1"], g["g3"], count=10).returncode == 0
    assert daemons[1].stats()["paths"]["kernel_frames"] > 0
    assert daemons[2].stats()["paths"]["kernel_frames"] > 0
    assert daemons[3].stats()["paths"]["kernel_frames"] == 0
    # g4 reaches g3 through its per-source default route (dst-MAC none).
    routes = daemons[3].ctl("ROUTE", "LIST").stdout.splitlines()
    (default,) = [line.split()[1] for line in routes if " none " in line]
    assert daemons[3].stats()[f"route {default}"]["frames"] > 0
