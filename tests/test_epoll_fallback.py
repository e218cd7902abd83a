"""Without epoll_pwait2 (kernels before 5.11, or a seccomp profile that
refuses it) the dispatcher falls back to epoll_wait and still forwards, and
control changes still take effect at once (code review M1: it used to spin,
forward nothing, and make every request wait 2 s).

vnetd runs under strace, which makes every epoll_pwait2 fail with ENOSYS."""

import shutil
import subprocess
import time

import pytest

from netlab import guest_mac, mesh_config


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_without_epoll_pwait2_the_dispatcher_falls_back_and_forwards(lab):
    by_host = {h: [(f"g{h}", guest_mac(h))] for h in (1, 2)}
    hosts = {h: lab.add_host(h) for h in (1, 2)}
    d2 = lab.start_vnetd(hosts[2], mesh_config(2, by_host))
    trace = lab.tmp / "strace.out"
    d1 = lab.start_vnetd_traced(hosts[1], mesh_config(1, by_host), "-o", trace,
                                "-e", "trace=epoll_pwait2", "-e", "inject=epoll_pwait2:error=ENOSYS")
    try:
        g = {h: lab.attach_guest(hosts[h], f"g{h}", h) for h in (1, 2)}
        assert lab.reaches(g[1], g[2]), d1.log_text()
        r = lab.ping(g[1], g[2], count=20, wait=1)
        assert r.returncode == 0 and " 0% packet loss" in r.stdout, r.stdout
        # A change is in force when its request returns, at once (not after
        # the 2 s publish deadline).
        t = time.monotonic()
        d1.ctl("LINK", "ADD", "198.18.0.77", "name", "spare")
        assert time.monotonic() - t < 0.5
        # The dispatcher sleeps in epoll_wait instead of spinning.
        busy = float(subprocess.run(["ps", "-o", "%cpu=", "-p", str(vnetd_pid(d1.proc.pid))],
                                    capture_output=True, text=True).stdout or 0)
        assert busy < 50, f"vnetd uses {busy}% CPU while idle"
        assert "epoll_pwait2 unavailable" in d1.log_text()
        assert "ENOSYS (Function not implemented) (INJECTED)" in trace.read_text()
    finally:
        assert lab.stop_traced(d1) == 0, d1.log_text()
    assert d2.proc.poll() is None


def vnetd_pid(strace_pid: int) -> int | None:
    """The vnetd that strace (run through `ip netns exec`) started."""
    out = subprocess.run(["pgrep", "-P", str(strace_pid), "-x", "vnetd"], capture_output=True, text=True).stdout.split()
    return int(out[0]) if out else None
