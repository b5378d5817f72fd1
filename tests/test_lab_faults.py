"""Faults in the lab: dpkg's lock held by someone else, and a container stopped in the middle of a run.
Each leaves the target unchanged or correctly converged, says so plainly, and the next run finishes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, labelled_pids, run_fleetcuda
from tests.test_lab_e2e import GDN, INV, LAB, LABCTL, ct, lab_is_up, reset  # noqa: F401

pytestmark = pytest.mark.lab


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("faults")


def test_dpkg_lock_held_is_waited_for_then_a_clear_failure(state: Path) -> None:
    reset("a/201")
    target = "lab-a/201"
    holder = ("nohup python3 -c 'import fcntl, time; f = open(\"/var/lib/dpkg/lock-frontend\", \"w\"); "
              "fcntl.lockf(f, fcntl.LOCK_EX); time.sleep(60)' >/dev/null 2>&1 & echo $!")
    pid = ct(target, holder).stdout.strip()
    time.sleep(1)
    try:
        started = time.monotonic()
        out = run_fleetcuda("apply", GDN, "-i", INV, "--plain", "--limit", target, "--var", "apt_lock_timeout=4",
                            state=state)
        assert out.returncode == 1, out.stdout
        assert time.monotonic() - started >= 4
        assert "lab-a/201: step cuda-keyring failed: apply: apply failed" in out.stdout
        assert "Could not get lock /var/lib/dpkg/lock-frontend" in out.stdout
        assert f"It is held by process {pid}" in out.stdout
        # Never removed or broken: the holder still has it.
        assert ct(target, f"kill -0 {pid} && test -e /var/lib/dpkg/lock-frontend", check=False).returncode == 0
    finally:
        ct(target, f"kill {pid}", check=False)
    again = run_fleetcuda("apply", GDN, "-i", INV, "--plain", "--limit", target, state=state)
    assert again.returncode == 0, again.stdout


def test_container_stopped_mid_build_then_converges(state: Path) -> None:
    reset("b/301")
    target = "lab-b/301"
    run = subprocess.Popen([sys.executable, "-m", "fleetcuda", "apply", GDN, "-i", INV, "--plain", "--limit", target],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                           env={**os.environ, "FLEETCUDA_STATE_DIR": str(state),
                                "FLEETCUDA_CACHE_DIR": str(state / "empty-cache"), "COLUMNS": "200"})
    deadline = time.monotonic() + 120
    while not labelled_pids("fleetcuda:causal-conv1d", script_has="tar -xzf"):  # the build, not the check
        assert time.monotonic() < deadline and run.poll() is None, "the build never started"
        time.sleep(0.1)
    time.sleep(1)
    subprocess.run(["nsenter", "--net=/run/netns/fclab-b", "lxc-stop", "-P", str(LAB / "hosts/b/lxc"), "-n", "301",
                    "-k"], check=True)
    out, _ = run.communicate(timeout=120)
    assert run.returncode in (1, 3), out
    assert "lab-b/301" in out and ("not running" in out or "causal-conv1d failed" in out), out
    subprocess.run([str(LABCTL), "up"], check=True, capture_output=True, timeout=300)  # starts it again
    verify = run_fleetcuda("verify", GDN, "-i", INV, "--plain", "--limit", target, state=state)
    assert verify.returncode == 1
    assert "lab-b/301 causal-conv1d: drift" in verify.stdout  # a half-built extension is not installed
    again = run_fleetcuda("apply", GDN, "-i", INV, "--plain", "--limit", target, state=state)
    assert again.returncode == 0, again.stdout
    assert "lab-b/301 causal-conv1d: changed" in again.stdout
