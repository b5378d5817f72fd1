"""The apply lock in the lab's real containers (SSH, `sudo pct exec`, each container its own pid namespace): a
step that goes on after its run's fleetcuda was killed, or after its connection dropped, keeps the target's lock
until it ends; the next apply refuses meanwhile (never runs the same step alongside it), then resumes."""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, end_step, labelled_pids, run_fleetcuda
from tests.test_lab_e2e import INV, ct, lab_is_up  # noqa: F401
from tests.test_lock_faults import sshd_serving

pytestmark = pytest.mark.lab

SLOW = str(REPO / "tests/data/slow.yaml")
TARGET = "lab-b/300"  # sudo -n pct exec


@pytest.fixture
def where(tmp_path: Path) -> Iterator[dict[str, str]]:
    root = f"/tmp/fc-locks-{secrets.token_hex(4)}"  # in the container: nothing of anyone else's
    yield {"root": root, "state": str(tmp_path / "fc")}
    end_step(labelled_pids("fleetcuda:slow-marker", script_has=f"fc_root={root}\n"), "fleetcuda:slow-marker")
    ct(TARGET, f"rm -rf {root}", check=False)


def apply(where: dict[str, str], seconds: int) -> list[str]:
    return ["apply", SLOW, "-i", INV, "--plain", "--limit", TARGET, "--var", f"root={where['root']}",
            "--var", f"seconds={seconds}"]


def start(where: dict[str, str], seconds: int) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "fleetcuda", *apply(where, seconds)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env={**os.environ, "FLEETCUDA_STATE_DIR": where["state"], "COLUMNS": "200"})


def step(where: dict[str, str], seconds: int) -> list[int]:
    """The step's processes in the container, seen from the lab machine's /proc (its apply, not its check)."""
    return [p for p in labelled_pids("fleetcuda:slow-marker", script_has=f"fc_seconds={seconds}\n")
            if p in labelled_pids("fleetcuda:slow-marker", script_has=f"fc_root={where['root']}\n")]


def wait_for_step(run: subprocess.Popen[str], where: dict[str, str], seconds: int) -> list[int]:
    deadline = time.monotonic() + 60
    while not step(where, seconds):
        assert time.monotonic() < deadline and run.poll() is None, "the step never started"
        time.sleep(0.1)
    return step(where, seconds)


@pytest.mark.parametrize("fault", ["fleetcuda-killed", "connection-dropped"])
def test_a_step_that_goes_on_keeps_the_lock_until_it_ends(where: dict[str, str], fault: str) -> None:
    first = start(where, 45)
    pids = wait_for_step(first, where, 45)
    if fault == "fleetcuda-killed":
        first.kill()
    else:
        os.kill(sshd_serving(pids[0]), signal.SIGKILL)
    out, _ = first.communicate(timeout=120)
    assert step(where, 45), f"the step was expected to go on in the container: {out}"
    second = run_fleetcuda(*apply(where, 0), state=Path(where["state"]))
    assert second.returncode == 1, second.stdout
    assert re.search(rf"{TARGET} done: locked: another fleetcuda apply holds /run/lock/fleetcuda-apply-300 on "
                     rf"{TARGET}: .* pid {first.pid} .*its fleetcuda process has ended, but \d+ process\(es\) of that "
                     r"run still run there \(fleetcuda:slow-marker@\w+\)", second.stdout), second.stdout
    assert "slow-marker: apply" not in second.stdout  # not run alongside the first
    end_step(step(where, 45), "fleetcuda:slow-marker")  # the step ends (here: stopped from outside)
    deadline = time.monotonic() + 30
    while step(where, 45):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    third = run_fleetcuda(*apply(where, 0), state=Path(where["state"]))
    assert third.returncode == 0, third.stdout
    assert f"{TARGET} lock: take-over" in third.stdout and f"{TARGET} done: changed" in third.stdout
