import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import netlab  # noqa: E402


def pytest_sessionstart(session):
    if os.geteuid() != 0:
        pytest.exit("the end-to-end tests make network namespaces: run them as root", returncode=2)
    # Always: a no-op when the binaries are fresh, and never stale ones tested.
    # (VNET_BIN names binaries built elsewhere: those are tested as they are.)
    if "VNET_BIN" not in os.environ:
        subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=netlab.REPO, check=True)


# The test command (scripts/test) runs the end-to-end tests in three
# streams: "side" and "main" side by side, then "alone". "alone" holds the
# tests that bound a time, a rate or a loss under load (a neighbour's p99, a
# ping lost at a migration, iperf3's intervals across a restart), which
# another test's CPU on this 2-core machine would make fail; "side" the ones
# that mostly wait (sessions timing out, locks, etcd and its agents, a vnetd
# down a minute) and use little CPU; "main" the rest. Without VNET_STREAM
# (pytest run by hand) every test runs, one after the other.
ALONE = {"test_vhost_attacks.py", "test_wireguard_attacks.py", "test_neigh.py", "test_fastpath.py", "test_restart.py",
         "test_migration.py", "test_vhost_user.py", "test_scale.py", "test_faults.py", "test_apps.py"}
SIDE = {"test_control_security.py", "test_tcp_link_auth.py", "test_structure.py", "test_controller.py",
        "test_wireguard_timers.py", "test_skips.py", "test_examples.py", "test_confine.py"}
SIDE_TESTS = {"test_restart.py::test_vnetd_down_60_s_established_flows_keep_flowing_and_new_ones_are_counted"}


def stream_of(nodeid: str) -> str:
    path, _, name = nodeid.partition("::")
    module = Path(path).name
    if f"{module}::{name.split('[')[0]}" in SIDE_TESTS or module in SIDE:
        return "side"
    return "alone" if module in ALONE else "main"


def pytest_collection_modifyitems(config, items):
    want = os.environ.get("VNET_STREAM")
    if not want:
        return
    if want not in ("side", "main", "alone"):
        raise pytest.UsageError(f"VNET_STREAM={want}: it is side, main or alone")
    keep = [i for i in items if stream_of(i.nodeid) == want]
    config.hook.pytest_deselected(items=[i for i in items if stream_of(i.nodeid) != want])
    items[:] = keep


def pytest_collection_finish(session):
    # WireGuard's timers take 200 s to watch: their lab starts now and runs
    # beside the other tests (tests/wg_timers.py).
    if any(item.nodeid.startswith("tests/test_wireguard_timers.py") or "test_wireguard_timers.py::" in item.nodeid
           for item in session.items):
        import wg_timers
        wg_timers.start()


@pytest.fixture
def lab(request):
    """A fresh namespace lab, torn down (namespaces, devices, processes) even
    on failure. The test fails (an error at teardown) if one of its vnetds
    died, panicked or did not exit 0 on SIGTERM, or if the lab left anything
    with its prefix behind."""
    lab = netlab.Lab(tag="t")
    try:
        yield lab
    finally:
        failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
        if failed:
            for d in lab.daemons:
                print(f"--- vnetd log on {d.host} ---\n{d.log_text()}")
        problems = lab.close()
    if problems:
        if not failed:
            for name, text in lab.saved_logs.items():
                print(f"--- vnetd log on {name} ---\n{text}")
        pytest.fail("lab teardown: " + "; ".join(problems), pytrace=False)


# A test skipped because something is missing is a test that did not run: in
# the test command (scripts/test sets VNET_STRICT_SKIPS=1) and under CI=true it
# fails the run, so that a missing dependency cannot pass unnoticed. A skip
# whose reason holds on every machine of this project stays a skip; its
# reason says so by starting with EVERY_MACHINE.
EVERY_MACHINE = "on every machine here: "


def strict_skips() -> bool:
    return os.environ.get("CI", "").lower() == "true" or os.environ.get("VNET_STRICT_SKIPS") == "1"


def skip_reason(rep) -> str:
    lr = rep.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:
        return str(lr[2])
    return str(lr)


def not_run(reason: str) -> str:
    return (f"skipped for a missing dependency, which fails the test command: {reason} "
            "(scripts/setup installs every dependency; VNET_STRICT_SKIPS=0 outside CI lets it skip)")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if strict_skips():
        if hasattr(rep, "wasxfail"):
            # An expected failure is a test that does not say what it
            # checks: it fails the test command too, passing or failing,
            # unless its reason holds on every machine.
            reason = str(rep.wasxfail)
            if not reason.startswith(EVERY_MACHINE):
                rep.outcome = "failed"
                rep.longrepr = f"marked xfail, which fails the test command: {reason or '(no reason)'}"
        elif rep.skipped:
            reason = skip_reason(rep).removeprefix("Skipped: ")
            if not reason.startswith(EVERY_MACHINE):
                rep.outcome = "failed"
                rep.longrepr = not_run(reason)
    setattr(item, "rep_" + rep.when, rep)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_make_collect_report(collector):
    # A whole module skipped while it is collected (`pytest.skip(...,
    # allow_module_level=True)`, `pytest.importorskip`) is tests that did not
    # run, as one skipped test is.
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and strict_skips():
        reason = skip_reason(rep).removeprefix("Skipped: ")
        if not reason.startswith(EVERY_MACHINE):
            rep.outcome = "failed"
            rep.longrepr = not_run(reason)
