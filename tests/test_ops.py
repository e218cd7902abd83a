"""Operating VNET with the tools its users already have: Prometheus metrics
(checked by prometheus_client's OpenMetrics parser, values equal to STATS),
JSON replies for every command, `vnetctl top`, and the service side: the
systemd units (systemd-analyze verify), sd_notify readiness, RELOAD, JSON
logs, man pages and completions, and vnetd under exactly the unit's
capabilities."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

import netlab
from netlab import REPO, VNETCTL, VNETD, guest_mac, run, wait_until

UNIT_CAPS = None  # read from dist/systemd/vnetd.service by unit_caps()


def two_hosts_veth(lab, *vnetd_args):
    """Two hosts, a veth guest on each (the kernel fast path's kind), in a
    full mesh; returns (d1, d2, g1, g2)."""
    h1, h2 = lab.add_host(1), lab.add_host(2)
    n1, n2 = lab.guest_ns("c1"), lab.guest_ns("c2")
    guests = {1: [("g1", guest_mac(1))], 2: [("g2", guest_mac(2))]}
    attach = {"g1": f"netns {n1} veth", "g2": f"netns {n2} veth"}
    d1 = lab.start_vnetd(h1, netlab.mesh_config(1, guests, mtu=1458, attach=attach), *vnetd_args)
    d2 = lab.start_vnetd(h2, netlab.mesh_config(2, guests, mtu=1458, attach=attach))
    g1 = lab.veth_guest(h1, "g1", 1, n1)
    g2 = lab.veth_guest(h2, "g2", 2, n2)
    assert lab.reaches(g1, g2)
    return d1, d2, g1, g2


def scrape(lab, host, port=9190, path="/metrics"):
    p = lab.x(host, "curl", "-sS", "-o", "-", "-w", "\n%{http_code} %{content_type}", f"http://127.0.0.1:{port}{path}")
    body, _, status = p.stdout.rpartition("\n")
    return body, status


def samples(text):
    """{(name, frozenset(labels)): value} from OpenMetrics text, parsed by
    prometheus_client (which rejects what is not valid OpenMetrics)."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def text_records(lines):
    """The text reply's `key=value` words per line (what JSON must match)."""
    recs = []
    for line in lines:
        kv = {}
        words = line.split()
        for i, w in enumerate(words[1:], 1):
            if w.startswith("rule="):
                kv["rule"] = " ".join([w[5:], *words[i + 1:]])
                break
            m = re.fullmatch(r"([a-z0-9_-]+)=(.*)", w)
            if m:
                kv[m.group(1)] = m.group(2)
        recs.append((words[0] if words else "", kv))
    return recs


# ---- metrics ----

def test_metrics_parse_and_equal_stats(lab):
    d1, d2, g1, g2 = two_hosts_veth(lab, "--metrics", "9190")
    lab.ping(g1, g2, count=20, check=True)
    # A frame to nobody: a drop with a reason, which the metrics must show.
    lab.x(g1.ns, "ip", "neigh", "replace", "10.99.0.77", "lladdr", "02:00:00:00:00:77", "dev", "g1")
    lab.x(g1.ns, "ip", "route", "add", "10.99.0.0/24", "dev", "g1")
    lab.x(g1.ns, "ping", "-c", "3", "-i", "0.05", "-W", "1", "10.99.0.77", check=False)

    before = d1.stats()
    body, status = scrape(lab, d1.host)
    after = d1.stats()
    assert status.startswith("200 application/openmetrics-text"), status
    assert body.rstrip().endswith("# EOF")
    m = samples(body)

    def between(name, labels, kind, field):
        v = m[(name, frozenset(labels.items()))]
        lo, hi = int(before[kind][field]), int(after[kind][field])
        assert lo <= v <= hi, (name, labels, v, lo, hi)
        return v

    # Every counter of every interface and link, and the global ones.
    checked = 0
    for kind in [k for k in after if k.startswith(("interface ", "link "))]:
        what, name = kind.split(" ", 1)
        for field, v in after[kind].items():
            if not isinstance(v, int) or field == "name":
                continue
            if field.startswith("drop_"):
                between(f"vnet_{what}_drops_total", {what: name, "reason": field[5:]}, kind, field)
            elif field not in ("id",):
                between(f"vnet_{what}_{field}_total", {what: name}, kind, field)
            checked += 1
    levels = {"rx_batch_mean", "cache_entries", "entries", "loaded", "enabled", "next_hops"}
    for kind in ("global", "paths", "offload", "dispatch", "fastpath"):
        for field, v in after[kind].items():
            if field in levels:
                continue
            if field.startswith("drop_"):
                between(f"vnet_{kind}_drops_total", {"reason": field[5:]}, kind, field)
            else:
                between(f"vnet_{kind}_{field}_total", {}, kind, field)
            checked += 1
    assert checked > 70, checked
    assert ("vnet_dispatch_rx_batch_mean", frozenset()) in m  # vnet_fastpath_entries: the test below
    assert m[("vnet_fastpath_next_hops", frozenset())] == after["fastpath"]["next_hops"]
    assert between("vnet_interface_in_frames_total", {"interface": "g1"}, "interface g1", "in_frames") >= 20
    assert between("vnet_global_drops_total", {"reason": "no_route"}, "global", "drop_no_route") >= 1
    assert m[("vnet_fastpath_enabled", frozenset())] == 1
    assert m[("vnet_routes", frozenset())] == len([k for k in after if k.startswith("route ")])
    assert m[("vnet_interface_mode", frozenset({"interface": "g1", "configured": "guest-driven", "running": "guest-driven"}.items()))] == 1
    assert ("vnet_build_info", frozenset({"version": d1.ctl("SHOW").stdout.split("version=")[1].split()[0]}.items())) in m

    # Bounded labels: no route or connection appears as a label.
    assert not any(dict(labels).keys() - {"interface", "link", "reason", "configured", "running", "version"} for _, labels in m)

    # Only GET /metrics; the rest is refused, and nothing listens without --metrics.
    assert scrape(lab, d1.host, path="/nope")[1].startswith("404")
    post = lab.x(d1.host, "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST", "http://127.0.0.1:9190/metrics")
    assert post.stdout == "405"
    assert lab.x(d2.host, "curl", "-s", "http://127.0.0.1:9190/metrics", check=False).returncode != 0
    # Loopback only, for a bare port.
    listen = [l.split()[3] for l in lab.x(d1.host, "ss", "-Hltn", "sport = :9190").stdout.splitlines()]
    assert listen == ["127.0.0.1:9190"], listen


def test_fastpath_entries_gauge_follows_the_kernels_flows(lab):
    """`vnet_fastpath_entries` is a gauge of the kernel's flow entries: it
    equals STATS' `fastpath entries` at each scrape, goes down when a
    route's flows are revoked and up again with new flows.
    Catches: a gauge stuck at a value (the old `>= 0` could not fail), or
    one that only counts installs (it would not go down)."""
    d1, d2, g1, g2 = two_hosts_veth(lab, "--metrics", "9190")

    def reading():
        before = d1.stats()["fastpath"]["entries"]
        body, status = scrape(lab, d1.host)
        assert status.startswith("200"), status
        gauge = samples(body)[("vnet_fastpath_entries", frozenset())]
        after = d1.stats()["fastpath"]["entries"]
        assert before == gauge == after, (before, gauge, after)
        return gauge

    lab.ping(g1, g2, count=5, check=True)
    full = reading()
    assert full >= 2, full  # g1 -> g2 out over the link, g2 -> g1 in from it
    # The route to g2 deleted: its flows are revoked before the reply.
    to_g2 = next(l for l in d1.ctl("ROUTE", "LIST").stdout.splitlines() if f" {guest_mac(2)} edge " in l)
    d1.ctl("ROUTE", "DEL", to_g2.split()[1])
    fewer = reading()
    assert fewer < full, (fewer, full)
    # Back, and traffic again: new entries.
    d1.ctl("ROUTE", "ADD", *to_g2.split()[2:])
    lab.ping(g1, g2, count=5, check=True)
    assert reading() > fewer


HOLDER = """
import socket, sys
n, port = int(sys.argv[1]), int(sys.argv[2])
held = []
for i in range(n):
    s = socket.create_connection(("127.0.0.1", port))
    if i % 3 == 0:
        s.sendall(b"GET /metrics HTTP/1.1\\r\\nHost: x")   # half a request, never finished
    held.append(s)                                             # the others: idle, never a request
print("holding", flush=True)
sys.stdin.read()                                               # until the test lets go
"""


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_metrics_endpoint_survives_hostile_clients(lab):
    """The scrape answers, complete and correct, WHILE hostile connections
    are held open: first 30 (a third with half a request, the rest idle),
    then 300; and after junk requests. tiny_http serves each connection on
    a thread of a pool that grows with them (docs/operations.md gives the
    measured cost); the thread count is printed and bounded above, so a
    costlier server is seen, and the threads must go with the connections.
    Catches: a scrape that waits behind the held connections, as with a
    server that serves one connection at a time (Python's single-threaded
    HTTPServer, tried by hand in vnetd's place, does not answer in 5 s)."""
    h1 = lab.add_host(1)
    d = lab.start_vnetd(h1, None, "--metrics", "9190")
    holder_py = lab.tmp / "holder.py"
    holder_py.write_text(HOLDER)
    base = threads_of(d.proc.pid)
    version = d.ctl("SHOW").stdout.split("version=")[1].split()[0]
    for n in (30, 300):
        holder = lab.popen(h1, "python3", holder_py, n, 9190, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "holding"
        # The bound: an answer within 5 s (it takes ~0.005 s here).
        p = lab.x(h1, "curl", "-sS", "-m", "5", "-o", "-", "-w", "\n%{http_code}", "http://127.0.0.1:9190/metrics",
                  check=False)
        body, _, status = p.stdout.rpartition("\n")
        assert p.returncode == 0 and status == "200", (n, p)
        m = samples(body)
        assert m[("vnet_routes", frozenset())] == 0 and m[("vnet_global_in_frames_total", frozenset())] == 0
        assert ("vnet_build_info", frozenset({"version": version}.items())) in m
        held = threads_of(d.proc.pid)
        print(f"{n} connections held: vnetd has {held} threads ({base} before)")
        assert held - base <= n + 10, (n, base, held)
        holder.stdin.close()
        assert holder.wait(10) == 0
    # Junk, each on a connection of its own; then a scrape still answers.
    script = lab.tmp / "junk.py"
    script.write_text("""
import socket
for junk in [b"\\x00\\xff" * 5000 + b"\\r\\n\\r\\n", b"GET " + b"/" * 100000 + b" HTTP/1.1\\r\\n\\r\\n",
             b"GET /metrics HTTP/1.1\\r\\n" + b"X: " + b"y" * 200000 + b"\\r\\n\\r\\n", b"BREW /pot HTCPCP/1.0\\r\\n\\r\\n"]:
    s = socket.create_connection(("127.0.0.1", 9190)); s.settimeout(5)
    try:
        s.sendall(junk); s.recv(100)
    except OSError:
        pass
    s.close()
print("done")
""")
    assert lab.x(h1, "python3", script, timeout=60).stdout.strip() == "done"
    body, status = scrape(lab, h1)
    assert status.startswith("200"), status
    assert samples(body)
    # The held connections' threads are gone with them.
    assert wait_until(lambda: threads_of(d.proc.pid) <= base + 5, timeout=10), threads_of(d.proc.pid)
    assert d.proc.poll() is None


# ---- JSON ----

def test_json_for_every_command_has_the_texts_fields(lab):
    d1, d2, g1, g2 = two_hosts_veth(lab)
    lab.ping(g1, g2, count=3, check=True)
    reads = ["SHOW", "STATS", "STATS interfaces", "STATS links", "STATS routes", "STATS global", "STATS vtoe",
             "INTERFACE LIST", "LINK LIST", "ROUTE LIST"]
    for cmd in reads:
        text = d1.ctl(*cmd.split()).stdout.splitlines()
        out = d1.ctl("-j", *cmd.split())
        recs = json.loads(out.stdout)
        assert json.loads(d1.ctl("-p", *cmd.split()).stdout) is not None
        assert len(recs) == len(text), cmd
        for rec, (kind, kv) in zip(recs, text_records(text)):
            assert rec["kind"] == kind, (cmd, rec)
            for k, v in kv.items():
                # Counters may move between the two readings; the rest is equal.
                got = rec[k]
                if isinstance(got, (int, float)) and not isinstance(got, bool):
                    assert re.fullmatch(r"\d+(\.\d+)?", v), (cmd, k, v)
                else:
                    assert got == v, (cmd, k, got, v)
    routes = json.loads(d1.ctl("-j", "ROUTE", "LIST").stdout)
    assert {"kind": "route", "id": 0, "rule": f"any {guest_mac(1)} interface {guest_mac(1)} any"} in routes
    help_ = json.loads(d1.ctl("-j", "HELP").stdout)
    assert any("ROUTE ADD" in r["text"] for r in help_)

    # Changes, and what they say.
    add = json.loads(d1.ctl("-j", "ROUTE", "ADD", "any", "02:00:00:00:00:99", "edge", netlab.underlay_ip(2), "any").stdout)
    assert add[0]["kind"] == "change" and add[0]["verb"] == "added" and add[0]["object"] == "route"
    assert add[0]["rule"] == f"any 02:00:00:00:00:99 edge {netlab.underlay_ip(2)} any"
    set_ = json.loads(d1.ctl("-j", "SET", "quota", "32").stdout)
    assert set_[0]["kind"] == "set" and set_[0]["quota"] == 32
    batch = lab.tmp / "batch.conf"
    batch.write_text(f"ROUTE DEL {add[0]['id']}\nSET quota 64\n")
    both = json.loads(d1.ctl("-j", "--file", batch).stdout)
    assert [r["kind"] for r in both] == ["change", "set"] and both[0]["verb"] == "deleted"

    # Errors: JSON too, exit 1, and nothing changed.
    listing = d1.ctl("ROUTE", "LIST").stdout
    bad = d1.ctl("-j", "ROUTE", "ADD", "any", "nonsense", check=False)
    assert bad.returncode == 1
    assert json.loads(bad.stdout)["error"].startswith("line 1: ")
    assert d1.ctl("ROUTE", "LIST").stdout == listing
    gone = run([VNETCTL, "-j", "--socket", lab.tmp / "nobody.sock", "SHOW"], check=False)
    assert gone.returncode == 2 and "cannot connect" in json.loads(gone.stdout)["error"]


def test_json_protocol_in_band(lab):
    h1 = lab.add_host(1)
    d = lab.start_vnetd(h1, None)
    s = netlab.UnixSession(d.sock)
    s.send("FORMAT json\n")
    assert json.loads(s.readline()) == {"ok": True, "records": []}
    s.send("LINK LIST\n")
    assert json.loads(s.readline()) == {"ok": True, "records": []}
    s.send("BEGIN\nFORMAT text\nCOMMIT\n")
    err = json.loads(s.readline())
    assert err["ok"] is False and "FORMAT" in err["error"]
    s.send("FORMAT yaml\n")
    assert "json or text" in json.loads(s.readline())["error"]
    s.send("FORMAT text\n")
    assert s.readline() == b"OK 0\n"
    s.send("FORMAT json\n" + "x" * 5000 + "\n")
    assert json.loads(s.readline())["ok"] is True
    closing = json.loads(s.readline())
    assert closing["ok"] is False and "longer than" in closing["error"]
    s.close()


def test_json_refused_clearly_by_an_older_vnetd(lab):
    """A vnetd from before FORMAT answers it as any unknown command (its
    exact words, taken from one): vnetctl -j says so, as JSON, and exits 1."""
    sock = lab.tmp / "old.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(sock))
    srv.listen(1)

    def old_vnetd():
        c, _ = srv.accept()
        line = c.makefile("rb").readline().decode().strip()
        c.sendall(f"ERR line 1: unknown command '{line}' (try HELP): {line}\n".encode())
        c.close()

    t = threading.Thread(target=old_vnetd)
    t.start()
    p = run([VNETCTL, "-j", "--socket", sock, "SHOW"], check=False)
    t.join(5)
    srv.close()
    assert p.returncode == 1
    err = json.loads(p.stdout)["error"]
    assert "older than this client" in err and "unknown command 'FORMAT json'" in err


# ---- top ----

def test_top_shows_rates_paths_and_drops(lab):
    d1, d2, g1, g2 = two_hosts_veth(lab)
    lab.x(g2.ns, "ip", "link", "set", "g2", "mtu", "1458")
    srv = lab.popen(g2.ns, "iperf3", "-s", "-1", "-p", "5201", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    netlab.wait_listening(lab, g2.ns, 5201)
    cli = lab.popen(g1.ns, "iperf3", "-c", g2.ip, "-p", "5201", "-t", "4", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # Unknown destination: no_route drops while top watches.
    lab.x(g1.ns, "ip", "neigh", "replace", "10.99.0.77", "lladdr", "02:00:00:00:00:77", "dev", "g1")
    lab.x(g1.ns, "ip", "route", "add", "10.99.0.0/24", "dev", "g1")
    pinger = lab.popen(g1.ns, "ping", "-q", "-c", "40", "-i", "0.05", "10.99.0.77", stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    out = d1.ctl("top", "-n", "2", "-i", "1").stdout
    cli.wait(20)
    pinger.wait(10)
    srv.wait(10)
    screens = out.strip().split("\n\n")
    assert len(screens) == 2, out
    last = screens[-1].splitlines()
    assert "datapath: kernel fast path + vnetd" in last[0]
    row = next(l for l in last if l.split()[1:2] == ["g1"])
    cols = row.split()
    assert cols[2:5] == ["veth", "kernel", "guest-driven"], row
    in_fps, in_gbps = float(cols[5]), float(cols[6])
    assert in_fps > 1000 and in_gbps > 0.05, row
    assert int(cols[9]) > 50, row  # most frames in the kernel
    assert re.search(r"drops: .*no_route=\d+/s", last[-1]), last[-1]
    link = next(l for l in last if l.startswith("l0"))
    assert link.split()[2] == "udp"


# ---- service ----

def unit_caps():
    text = (REPO / "dist/systemd/vnetd.service").read_text()
    caps = re.search(r"^CapabilityBoundingSet=(.*)$", text, re.M).group(1).split()
    assert caps == re.search(r"^AmbientCapabilities=(.*)$", text, re.M).group(1).split()
    return [c.removeprefix("CAP_").lower() for c in caps]


def test_install_units_verify_and_docs_generate(tmp_path):
    dest = tmp_path / "root"
    env = dict(os.environ, DESTDIR=str(dest), PREFIX="/usr/local")
    run([REPO / "scripts/install"], env=env, timeout=600)
    prefix = dest / "usr/local"
    units = dest / "etc/systemd/system"
    for name in ("vnetd.service", "vnet-agent.service"):
        # Verify the installed unit as it would run from the staged tree.
        text = (units / name).read_text().replace("/usr/local/", f"{prefix}/")
        (tmp_path / name).write_text(text)
    p = run(["systemd-analyze", "verify", tmp_path / "vnetd.service", tmp_path / "vnet-agent.service"],
            check=False, env=dict(os.environ, MANPATH=str(prefix / "share/man")))
    assert p.returncode == 0 and p.stderr.strip() == "", p.stderr
    unit = (units / "vnetd.service").read_text()
    assert "Type=notify" in unit and "ExecReload=/usr/local/bin/vnetctl --socket /run/vnetd.sock RELOAD" in unit
    # What the units point a reader to exists: their Documentation= files
    # are installed, and the files their comments name are in the repository.
    for name in ("vnetd.service", "vnet-agent.service"):
        text = (units / name).read_text()
        docs = [u.removeprefix("file:") for l in re.findall(r"^Documentation=(.*)$", text, re.M) for u in l.split()
                if u.startswith("file:")]
        assert docs and all((dest / d.lstrip("/")).is_file() for d in docs), (name, docs)
        for ref in re.findall(r"\b(docs/[\w.-]+\.md)\b", text):
            assert (REPO / ref).is_file(), (name, ref)
    for page, section in (("vnetd", "8"), ("vnetctl", "1")):
        man = run(["man", "-l", "-P", "cat", prefix / f"share/man/man{section}/{page}.{section}"],
                  env=dict(os.environ, MANWIDTH="100")).stdout
        assert "--socket" in man or "--config" in man, man[:400]
    bash = prefix / "share/bash-completion/completions/vnetctl"
    assert run(["bash", "-n", bash]).returncode == 0
    # The completion offers vnetctl's options.
    probe = run(["bash", "-c", f"source {bash}; COMP_WORDS=(vnetctl --); COMP_CWORD=1; _vnetctl vnetctl -- vnetctl; "
                 "printf '%s\\n' \"${COMPREPLY[@]}\""]).stdout.split()
    assert "--json" in probe and "--socket" in probe
    assert (prefix / "share/zsh/site-functions/_vnetd").read_text().startswith("#compdef vnetd")
    assert "complete -c vnetctl" in (prefix / "share/fish/vendor_completions.d/vnetctl.fish").read_text()
    assert os.access(prefix / "lib/cni/vnet-cni", os.X_OK)


def test_sd_notify_ready_means_ready_and_json_logs(lab):
    """READY=1 comes once the config is in force and the socket answers;
    before it, the descriptors it keeps go to the store (FDSTORE=1);
    STOPPING=1 at SIGTERM; with --log-format json every log line is JSON."""
    h1 = lab.add_host(1)
    n1 = lab.guest_ns("c1")
    notify = lab.tmp / "notify.sock"
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(str(notify))
    rx.settimeout(15)
    conf = lab.tmp / "h1.conf"
    conf.write_text(f"INTERFACE ADD g1 {guest_mac(1)} mtu 1458 netns {n1} veth\nROUTE ADD any {guest_mac(1)} interface {guest_mac(1)} any\n")
    sock, log = lab.tmp / "h1.sock", lab.tmp / "h1.log"
    with open(log, "w") as lf:
        proc = subprocess.Popen(["ip", "netns", "exec", h1, VNETD, "--control-unix", sock, "--config", conf, "--state", lab.tmp / "h1.state",
                                 "--log-format", "json"], stdout=lf, stderr=subprocess.STDOUT,
                                env=dict(os.environ, NOTIFY_SOCKET=str(notify)))
    lab.other_procs.append(proc)
    # Descriptors it keeps for its next start go to the store first
    # (FDSTORE=1, docs/operations.md "Kept descriptors"): its link socket.
    stored = []
    while "READY=1" not in (msg := rx.recv(4096).decode()).split("\n"):
        fields = dict(l.split("=", 1) for l in msg.split("\n") if "=" in l)
        assert fields.get("FDSTORE") == "1" and fields.get("FDNAME"), msg
        stored.append(fields["FDNAME"])
    assert "udp 0.0.0.0 9000 0/1" in stored, stored
    # At READY, without waiting: the socket answers and the config is in force.
    listing = run([VNETCTL, "--socket", sock, "INTERFACE", "LIST"]).stdout
    assert "name=g1" in listing
    proc.send_signal(signal.SIGTERM)
    assert "STOPPING=1" in rx.recv(4096).decode()
    assert proc.wait(10) == 0
    rx.close()
    lines = log.read_text().splitlines()
    assert len(lines) >= 3
    recs = [json.loads(l) for l in lines]
    assert all({"timestamp", "level", "message"} <= r.keys() for r in recs)
    assert any("vnetd ready" in r["message"] for r in recs)


def test_reload_applies_what_changed_in_the_config(lab):
    h1, h2 = lab.add_host(1), lab.add_host(2)
    n1 = lab.guest_ns("c1")
    conf = lab.tmp / "h1.conf"
    base = [f"INTERFACE ADD g1 {guest_mac(1)} mtu 1458 netns {n1} veth",
            f"LINK ADD {netlab.underlay_ip(2)}",
            f"ROUTE ADD any {guest_mac(1)} interface {guest_mac(1)} any",
            f"ROUTE ADD any {guest_mac(2)} edge {netlab.underlay_ip(2)} any"]
    conf.write_text("\n".join(base) + "\n")
    d = lab.start_vnetd(h1, conf)
    # Something the config did not make: RELOAD leaves it alone.
    d.ctl("ROUTE", "ADD", "any", "02:00:00:00:00:42", "edge", netlab.underlay_ip(2), "any", "owner", "cni")
    ifindex = lab.x(n1, "cat", "/sys/class/net/g1/ifindex").stdout
    # Unchanged reload: nothing to do.
    assert "0 line(s) gone, 0 new, 4 unchanged" in d.ctl("RELOAD").stdout
    # Drop a route, add a link and a route; reorder and comment the rest.
    conf.write_text("# edited\n" + "\n".join([base[2], "  " + base[0] + "   # the guest", base[1],
                                              f"LINK ADD {netlab.underlay_ip(3)} name h3",
                                              f"ROUTE ADD any {guest_mac(3)} edge h3 any"]) + "\n")
    out = d.ctl("RELOAD").stdout
    assert "1 line(s) gone, 2 new, 3 unchanged" in out, out
    routes = d.ctl("ROUTE", "LIST").stdout
    assert guest_mac(2) not in routes and guest_mac(3) in routes and "02:00:00:00:00:42" in routes
    assert "name=h3" in d.ctl("LINK", "LIST").stdout
    # The guest was not touched.
    assert lab.x(n1, "cat", "/sys/class/net/g1/ifindex").stdout == ifindex
    # A config that does not parse changes nothing.
    before = d.ctl("SHOW").stdout
    conf.write_text(conf.read_text() + "ROUTE ADD any nonsense\n")
    bad = d.ctl("RELOAD", check=False)
    assert bad.returncode == 1 and "line 7: " in bad.stderr, bad.stderr
    # One that parses but cannot apply changes nothing either.
    conf.write_text(conf.read_text().replace("ROUTE ADD any nonsense\n", "ROUTE ADD any 02:00:00:00:00:07 edge nolink any\n"))
    bad = d.ctl("RELOAD", check=False)
    # The refusal names the file's line, not the reload's own request.
    assert bad.returncode == 1 and f"{conf}: line 7: " in bad.stderr and "nolink" in bad.stderr, bad.stderr
    assert d.ctl("SHOW").stdout == before
    # A SET line applies; taken out again, its setting stays as it is.
    good = conf.read_text().replace("ROUTE ADD any 02:00:00:00:00:07 edge nolink any\n", "")
    conf.write_text(good + "SET quota 32\n")
    assert "0 line(s) gone, 1 new" in d.ctl("RELOAD").stdout
    assert " quota=32 " in d.ctl("SHOW").stdout
    conf.write_text(good)
    assert "1 line(s) gone, 0 new" in d.ctl("RELOAD").stdout
    assert " quota=32 " in d.ctl("SHOW").stdout
    # RELOAD is a request of its own, for admins; without --config it says so.
    assert "of its own" in d.ctl("--file", _write(lab, "RELOAD\nLINK LIST\n"), check=False).stderr
    d0 = lab.start_vnetd(h2, None)
    assert "started without --config" in d0.ctl("RELOAD", check=False).stderr


def test_reload_refuses_a_changed_interface_line_and_two_reloads_change_it(lab):
    """docs/operations.md, ExecReload: an interface line changed (another
    MTU) is a delete and an add of the interface in one request, which
    vnetd refuses, TAP and veth alike: while a route line of the config uses
    the interface ("used by routes"), and otherwise because a deleted
    interface cannot come back in the same request ("add it again in
    another one"). The reload fails naming the file's line and changes
    nothing; two reloads (without the interface and its routes' lines,
    then with the new lines) make the change.
    Catches: a refusal that leaves the interface deleted, a reload that
    half-applies, or a changed line silently ignored."""
    h1 = lab.add_host(1)
    n2, n3 = lab.guest_ns("c2"), lab.guest_ns("c3")
    conf = lab.tmp / "h1.conf"
    # name -> [interface line (with {mtu}), route lines through it]
    lines = {
        "g1": [f"INTERFACE ADD g1 {guest_mac(1)} mtu {{mtu}}", []],                            # a TAP
        "g2": [f"INTERFACE ADD g2 {guest_mac(2)} mtu {{mtu}} netns {n2} veth",                # a veth, routed
               [f"ROUTE ADD any {guest_mac(2)} interface {guest_mac(2)} any"]],
        "g3": [f"INTERFACE ADD g3 {guest_mac(3)} mtu {{mtu}} netns {n3} veth", []],            # a veth
    }
    mtus = {"g1": 1500, "g2": 1458, "g3": 1458}

    def write(skip=None):
        text = []
        for name, (iface, routes) in lines.items():
            if name != skip:
                text += [iface.format(mtu=mtus[name]), *routes]
        conf.write_text("\n".join(text) + "\n")

    def state():
        return d.ctl("INTERFACE", "LIST").stdout + d.ctl("ROUTE", "LIST").stdout

    write()
    d = lab.start_vnetd(h1, conf)
    for name, why in (("g1", "interface g1 is deleted by this request; add it again in another one"),
                      ("g2", "interface g2 is used by routes"),
                      ("g3", "interface g3 is deleted by this request; add it again in another one")):
        before = state()
        mtus[name] = 1400
        write()
        bad = d.ctl("RELOAD", check=False)
        assert bad.returncode == 1 and why in bad.stderr, bad.stderr
        assert f"{conf}: line " in bad.stderr or f"{conf}: taking back 'INTERFACE ADD {name} " in bad.stderr, bad.stderr
        assert state() == before, "a refused reload changed something"
        # Two reloads: the interface (and the routes through it) out, then back, changed.
        n = 1 + len(lines[name][1])
        write(skip=name)
        assert f"{n} line(s) gone, 0 new" in d.ctl("RELOAD").stdout
        write()
        assert f"0 line(s) gone, {n} new" in d.ctl("RELOAD").stdout
        assert f"name={name} mac={guest_mac(int(name[1]))} mtu=1400 " in d.ctl("INTERFACE", "LIST").stdout
    assert lab.x(n2, "cat", "/sys/class/net/g2/mtu").stdout.strip() == "1400"


def _write(lab, text):
    p = lab.tmp / f"f{time.monotonic_ns()}.conf"
    p.write_text(text)
    return p


def unit_settings() -> dict[str, str]:
    """The [Service] settings of dist/systemd/vnetd.service (last one wins)."""
    text = (REPO / "dist/systemd/vnetd.service").read_text()
    return dict(re.findall(r"^([A-Za-z]+)=(.*)$", text.split("[Service]")[1].split("[Install]")[0], re.M))


RESTRICT = REPO / "tests" / "tools" / "restrict_families.py"

# The unit's sandbox without systemd (there is none as init on these
# machines), run as root before privileges are dropped. $1: the lab's
# directory, which holds what the unit keeps in /run and /etc (socket,
# config, keys); $2, $3: the checkout and the binaries under test (installed,
# they would be in /usr/local); the rest: the command.
SANDBOX = r"""
set -e
lab=$1; repo=$2; bin=$3; shift 3
# PrivateTmp=yes: /tmp and /var/tmp of its own; the lab's directory bound
# back at its path (it stands for /run and /etc here), and so are the
# checkout and the binaries if they live under /tmp.
mkdir -p "$lab/.privtmp"
mount -t tmpfs -o mode=1777 tmpfs "$lab/.privtmp"
for p in "$lab" "$repo" "$bin"; do
    case "$p" in
        /tmp/*) mkdir -p "$lab/.privtmp/${p#/tmp/}"; mount --bind "$p" "$lab/.privtmp/${p#/tmp/}" ;;
    esac
done
mount --move "$lab/.privtmp" /tmp
mount -t tmpfs -o mode=1777 tmpfs /var/tmp
# Not the unit's: the CNI plugin's default state directory (/var/lib/cni/vnet,
# which the unit's ExecStartPost reads) kept in the lab, the machine's untouched.
mount -t tmpfs tmpfs /var/lib
mkdir -p /var/lib/cni
mount --bind "$lab/var-lib-cni" /var/lib/cni
# ProtectSystem=full: /usr, /boot, /efi and /etc read-only.
for d in /usr /boot /efi /etc; do
    if [ -d "$d" ]; then mount --bind "$d" "$d"; mount -o remount,bind,ro "$d"; fi
done
# ProtectHome=yes: /home, /root and /run/user empty and inaccessible.
for d in /home /root /run/user; do
    if [ -d "$d" ]; then mount -t tmpfs -o mode=000 tmpfs "$d"; fi
done
# LimitMEMLOCK=infinity, where root may raise it (not on these machines: no
# CAP_SYS_RESOURCE; eBPF maps are charged to the memory cgroup since 5.11).
ulimit -l unlimited 2>/dev/null || true
exec "$@"
"""


def in_unit_sandbox(lab, host: str, cmd: list, settings: dict[str, str]) -> list[str]:
    """`cmd` in `host` under the unit's sandbox: the mounts above, then
    NoNewPrivileges, the capability bounding and ambient sets
    (Capability­BoundingSet=, AmbientCapabilities=) and RestrictAddressFamilies
    (tests/tools/restrict_families.py, a seccomp filter as systemd's)."""
    caps = ",".join(["-all"] + [f"+{c.removeprefix('CAP_').lower()}" for c in settings["CapabilityBoundingSet"].split()])
    families = ",".join(settings["RestrictAddressFamilies"].split())
    return ["unshare", "-m", "--propagation", "slave", "sh", "-ec", SANDBOX, "sh", str(lab.tmp), str(REPO), str(netlab.BIN.resolve()),
            "ip", "netns", "exec", host, "setpriv", "--no-new-privs", f"--bounding-set={caps}",
            f"--inh-caps={caps}", f"--ambient-caps={caps}", "--",
            "/usr/bin/python3", str(RESTRICT), families, "--", *[str(c) for c in cmd]]


def test_vnetd_runs_in_its_units_sandbox(lab):
    """vnetd under what dist/systemd/vnetd.service gives it, reproduced
    without systemd: NoNewPrivileges, exactly the unit's capabilities
    (bounding and ambient sets), RestrictAddressFamilies (a seccomp filter:
    another family fails as under systemd), ProtectSystem=full,
    ProtectHome, PrivateTmp, LimitMEMLOCK. There it starts VTOE (its cgroup
    and eBPF guard), loads the kernel fast path, makes veth guests in their
    namespaces and carries their traffic in the kernel, serves --metrics;
    and after a restart a container is back from vnetd's state file, which
    the unit's own ExecStartPost line (`vnet-cni restore`, paths mapped to
    the lab) then finds held.
    Not reproduced: Delegate=yes (only systemd delegates a cgroup subtree),
    ProtectClock, ProtectKernelModules, LockPersonality (docs/operations.md).
    Catches: a capability, an address family or a writable path vnetd needs
    and the unit does not give (the filter itself is checked to refuse a
    family left out)."""
    unit = unit_settings()
    # The settings reproduced here, as the unit has them.
    assert {k: unit[k] for k in ("NoNewPrivileges", "ProtectSystem", "ProtectHome", "PrivateTmp", "LimitMEMLOCK")} == \
        {"NoNewPrivileges": "yes", "ProtectSystem": "full", "ProtectHome": "yes", "PrivateTmp": "yes",
         "LimitMEMLOCK": "infinity"}
    assert unit["CapabilityBoundingSet"].split() == unit["AmbientCapabilities"].split()
    caps = unit_caps()
    (lab.tmp / "var-lib-cni").mkdir()
    h1, h2 = lab.add_host(1), lab.add_host(2)
    # The sandbox itself, probed: AF_XDP (which works here outside it) is
    # refused as systemd refuses a family not listed; /etc and /usr are
    # read-only; /tmp holds only the lab's directory; /root is empty.
    probe = ["/usr/bin/python3", "-c", textwrap.dedent("""
        import os, socket
        for name, fam, kind in (("AF_INET", 2, 2), ("AF_NETLINK", 16, 3), ("AF_XDP", 44, 3)):
            try:
                socket.socket(fam, kind).close()
                print(name, "ok")
            except OSError as e:
                print(name, e.errno)
        for p in ("/etc/vnet-probe", "/usr/vnet-probe"):
            try:
                open(p, "w")
                print(p, "written")
            except OSError as e:
                print(p, e.errno)
        print(os.listdir("/tmp"), os.listdir("/root"))
        """)]
    outside = lab.x(h1, *probe).stdout.splitlines()
    assert outside[2] == "AF_XDP ok", outside
    inside = run(in_unit_sandbox(lab, h1, probe, unit)).stdout.splitlines()
    # /tmp holds the lab's directory alone (and the checkout and binaries,
    # where they live under /tmp themselves).
    kept = {p.parts[2] for p in (lab.tmp, REPO, netlab.BIN.resolve()) if p.parts[1] == "tmp"}
    assert inside[:5] == ["AF_INET ok", "AF_NETLINK ok", "AF_XDP 97", "/etc/vnet-probe 30", "/usr/vnet-probe 30"], inside
    listed_tmp, listed_root = inside[5].split("] ")
    assert sorted(eval(listed_tmp + "]")) == sorted(kept) and listed_root == "[]", inside

    n1, n2 = lab.guest_ns("c1"), lab.guest_ns("c2")
    guests = {1: [("g1", guest_mac(1))], 2: [("g2", guest_mac(2))]}
    attach = {"g1": f"netns {n1} veth", "g2": f"netns {n2} veth"}
    conf = lab.tmp / "h1.conf"
    # With a direct link onto a LAN device, which vnetd works through a
    # packet socket (AF_PACKET).
    lab.x(h1, "ip", "link", "add", "lan0", "type", "veth", "peer", "name", "lan1")
    conf.write_text(netlab.mesh_config(1, guests, mtu=1458, attach=attach) + "LINK ADD direct lan0 name lan\n")
    sock = lab.tmp / "h1.sock"
    vnetd = [VNETD, "--config", conf, "--control-unix", sock, "--link-key-dir", lab.key_dir, "--state", lab.tmp / "h1.state",
             "--vtoe-socket", lab.tmp / "vtoe-h1.sock", "--metrics", "9190", "--allow-direct", "lan0"]

    def start(n):
        log = lab.tmp / f"h1-sandbox-{n}.log"
        with open(log, "w") as lf:
            proc = subprocess.Popen(in_unit_sandbox(lab, h1, vnetd, unit), stdout=lf, stderr=subprocess.STDOUT)
        lab.other_procs.append(proc)
        d = netlab.Vnetd(lab, h1, sock, proc, log)
        lab.wait_ready(d)
        # unshare, sh, ip, setpriv and the filter exec'd: the PID is vnetd's.
        status = Path(f"/proc/{proc.pid}/status").read_text()
        assert re.search(r"^Name:\s+vnetd$", status, re.M), status
        bnd = int(re.search(r"CapBnd:\s+([0-9a-f]+)", status).group(1), 16)
        assert bin(bnd).count("1") == len(caps), status
        assert re.search(r"NoNewPrivs:\s+1", status) and re.search(r"Seccomp:\s+2", status), status
        return d

    d1 = start(1)
    d2 = lab.start_vnetd(h2, netlab.mesh_config(2, guests, mtu=1458, attach=attach))
    g1, g2 = lab.veth_guest(h1, "g1", 1, n1), lab.veth_guest(h2, "g2", 2, n2)
    assert lab.reaches(g1, g2)
    lab.ping(g1, g2, count=20, check=True)
    st = d1.stats()
    assert st["fastpath"]["loaded"] == "yes" and st["interface g1"]["fast_in_frames"] > 0, st["fastpath"]
    assert "unavailable" not in d1.log_text()
    assert "vtoe enabled=yes" in d1.ctl("SHOW").stdout
    body, status = scrape(lab, h1)
    assert status.startswith("200") and samples(body)
    # The IPv6 underlay's socket too (AF_INET6; without it vnetd serves IPv4 only).
    udp = lab.x(h1, "ss", "-Hlun", "sport = :9000").stdout
    assert "0.0.0.0:9000" in udp and "[::]:9000" in udp, udp

    # A container through the CNI plugin, in the state directory the unit's
    # restore line reads; vnetd restarted; the unit's ExecStartPost, as written.
    c3 = lab.guest_ns("c3")
    cni_conf = {"cniVersion": "1.0.0", "name": lab.prefix + "unit", "type": "vnet-cni", "socket": str(sock),
                "stateDir": str(lab.tmp / "var-lib-cni" / "vnet")}
    env = {"PATH": os.environ["PATH"], "CNI_COMMAND": "ADD", "CNI_CONTAINERID": "u1",
           "CNI_NETNS": f"/run/netns/{c3}", "CNI_IFNAME": "eth0", "CNI_PATH": str(netlab.BIN)}
    added = json.loads(run([netlab.BIN / "vnet-cni"], input=json.dumps(cni_conf), env=env).stdout)
    mac3 = added["interfaces"][0]["mac"]
    ifindex = lab.x(c3, "cat", "/sys/class/net/eth0/ifindex").stdout
    d1.proc.send_signal(signal.SIGTERM)
    assert d1.proc.wait(10) == 0
    d1 = start(2)
    # vnetd restored the container itself (its state file, in the
    # sandbox's /run equivalent): the unit's restore line finds it held.
    assert f"mac={mac3}" in d1.ctl("INTERFACE", "LIST").stdout
    post = unit["ExecStartPost"]
    assert post.startswith("-/usr/local/lib/cni/vnet-cni "), post
    argv = [a.replace("/usr/local/lib/cni/", f"{netlab.BIN}/").replace("/run/vnetd.sock", str(sock))
            for a in post[1:].split()]
    out = run(in_unit_sandbox(lab, h1, argv, unit)).stdout
    assert "0 restored, 1 already in vnetd, 0 without a namespace, 0 failed" in out, out
    assert f"mac={mac3}" in d1.ctl("INTERFACE", "LIST").stdout
    assert lab.x(c3, "cat", "/sys/class/net/eth0/ifindex").stdout == ifindex
    d1.proc.send_signal(signal.SIGTERM)
    assert d1.proc.wait(10) == 0
