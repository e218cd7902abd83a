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
    if not (netlab.VNETD.exists() and netlab.VNETCTL.exists()):
        subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=netlab.REPO, check=True)


@pytest.fixture
def lab(request):
    """A fresh namespace lab, torn down (namespaces, devices, processes) even on failure."""
    with netlab.Lab(tag="t") as lab:
        yield lab
        if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
            for d in lab.daemons:
                print(f"--- vnetd log on {d.host} ---\n{d.log_text()}")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
