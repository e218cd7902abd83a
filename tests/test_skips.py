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

@pytest.mark.xfail(reason="dpdk-testpmd not installed")
def test_expected_to_fail():
    assert False

@pytest.mark.xfail(reason="on every machine here: a kernel bug")
def test_machine_wide_xfail():
    assert False
'''

# Whole modules skipped while collected: what the skip rule first missed
# (the 2026-11-28 tests review's E1).
MODULE_SKIP = '''
import pytest
pytest.skip("etcd-server not installed", allow_module_level=True)

def test_never():
    pass
'''

IMPORT_SKIP = '''
import pytest
pytest.importorskip("no_such_module_for_vnet")

def test_never():
    pass
'''


def run_cases(tmp_path, files=("test_cases.py",), **env):
    for f in ("conftest.py", "netlab.py"):
        shutil.copy(HERE / f, tmp_path / f)
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    (tmp_path / "test_import_skip.py").write_text(IMPORT_SKIP)
    e = {k: v for k, v in os.environ.items() if k not in ("CI", "VNET_STRICT_SKIPS", "VNET_STREAM")}
    e.update(env, VNET_BIN=str(tmp_path))  # no cargo build for this inner run
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *files],
        cwd=tmp_path, env=e, capture_output=True, text=True, timeout=120,
    )


def test_a_skip_for_a_missing_dependency_fails_the_test_command(tmp_path):
    for env in ({"VNET_STRICT_SKIPS": "1"}, {"CI": "true"}):
        p = run_cases(tmp_path, **env)
        assert p.returncode != 0, p.stdout + p.stderr
        assert "ERROR test_cases.py::test_marked" in p.stdout, p.stdout
        assert "FAILED test_cases.py::test_called" in p.stdout, p.stdout
        assert "dpdk-testpmd not installed" in p.stdout and "needs strace" in p.stdout
        # An xfail for a missing dependency fails too.
        assert "FAILED test_cases.py::test_expected_to_fail" in p.stdout, p.stdout
        # The machine-wide reasons stay a skip and an xfail; the plain test passes.
        assert "SKIPPED [1] test_cases.py" in p.stdout and "no vsock" in p.stdout, p.stdout
        assert "XFAIL test_cases.py::test_machine_wide_xfail" in p.stdout, p.stdout
        assert "PASSED test_cases.py::test_runs" in p.stdout
        # A module skipped while collected, by a skip or an importorskip, is
        # an error of the collection (which stops the run).
        p = run_cases(tmp_path, files=("test_module_skip.py", "test_import_skip.py"), **env)
        assert p.returncode != 0, p.stdout + p.stderr
        assert "ERROR test_module_skip.py" in p.stdout and "etcd-server not installed" in p.stdout, p.stdout
        assert "ERROR test_import_skip.py" in p.stdout and "no_such_module_for_vnet" in p.stdout, p.stdout


def test_outside_the_test_command_a_skip_stays_a_skip(tmp_path):
    p = run_cases(tmp_path, files=("test_cases.py", "test_module_skip.py", "test_import_skip.py"), VNET_STRICT_SKIPS="0")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1 passed, 5 skipped, 2 xfailed" in p.stdout, p.stdout
