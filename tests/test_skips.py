"""The test command's skip policy (tests/conftest.py): a test skipped for a
missing dependency fails the run under CI=true and under scripts/test
(VNET_STRICT_SKIPS=1); only a skip whose reason holds on every machine here,
and says so, stays a skip. Checked by running pytest on a file of skips with
this directory's conftest."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent

CASES = '''
import pytest

@pytest.mark.skipif(True, reason="dpdk-testpmd not installed")
def test_marked():
    pass

def test_called():
    pytest.skip("needs strace")

@pytest.mark.skip(reason="on every machine here: no vsock in this kernel")
def test_machine_wide():
    pass

def test_runs():
    pass
'''


def run_cases(tmp_path, **env):
    for f in ("conftest.py", "netlab.py"):
        shutil.copy(HERE / f, tmp_path / f)
    (tmp_path / "test_cases.py").write_text(CASES)
    e = {k: v for k, v in os.environ.items() if k not in ("CI", "VNET_STRICT_SKIPS")}
    e.update(env, VNET_BIN=str(tmp_path))  # no cargo build for this inner run
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "test_cases.py"],
        cwd=tmp_path, env=e, capture_output=True, text=True, timeout=120,
    )


def test_a_skip_for_a_missing_dependency_fails_the_test_command(tmp_path):
    for env in ({"VNET_STRICT_SKIPS": "1"}, {"CI": "true"}):
        p = run_cases(tmp_path, **env)
        assert p.returncode == 1, p.stdout + p.stderr
        assert "ERROR test_cases.py::test_marked" in p.stdout, p.stdout
        assert "FAILED test_cases.py::test_called" in p.stdout, p.stdout
        assert "dpdk-testpmd not installed" in p.stdout and "needs strace" in p.stdout
        # The machine-wide reason stays a skip; the plain test passes.
        assert "SKIPPED [1] test_cases.py" in p.stdout and "no vsock" in p.stdout, p.stdout
        assert "PASSED test_cases.py::test_runs" in p.stdout


def test_outside_the_test_command_a_skip_stays_a_skip(tmp_path):
    p = run_cases(tmp_path, VNET_STRICT_SKIPS="0")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1 passed, 3 skipped" in p.stdout, p.stdout
