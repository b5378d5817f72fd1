"""Shared fixtures: one loopback OpenSSH server with test users and the pct stand-in per session."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.lab.sshd import LoopbackSshd, make_traversable, start_loopback_sshd

REPO = Path(__file__).resolve().parent.parent
SHELLS = {"sh": "/bin/sh", "bash": "/bin/bash", "dash": "/usr/bin/dash", "zsh": "/usr/bin/zsh"}
REQUIRED = ("/usr/sbin/sshd", "/usr/bin/zsh", "/usr/bin/dash", "/usr/bin/sudo")


def need(paths: tuple[str, ...], why: str) -> None:
    """Skip when a real part is missing, except under CI, where that would hide lost coverage."""
    missing = [p for p in paths if not Path(p).exists() and shutil.which(p) is None]
    if missing:
        reason = f"{why} needs {', '.join(missing)} (.ci/run installs them)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture(scope="session")
def sshd_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackSshd]:
    need(REQUIRED, "the loopback ssh lab")
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("the loopback ssh lab needs root")
        pytest.skip("the loopback ssh lab needs root")
    workdir = tmp_path_factory.mktemp("lab")
    make_traversable(workdir)
    server = start_loopback_sshd(workdir)
    yield server
    server.stop()


def run_fleetcuda(*args: str, state: Path, check: bool = False, timeout: float = 600,
                  cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """The real CLI in a subprocess, as a user runs it; its run directories go under `state`."""
    env = {**os.environ, "FLEETCUDA_STATE_DIR": str(state), "FLEETCUDA_CACHE_DIR": str(state / "wheel-cache"),
           "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-m", "fleetcuda", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def labelled_pids(label: str, vmid: int | None = None, script_has: str | None = None) -> list[int]:
    """Processes of a step, by the label fleetcuda gives it as bash's $0 (container processes are visible
    from the host's /proc too); with vmid, only those started by `pct exec VMID`; with script_has, only
    those whose script contains it (the apply rather than the check of the same step)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                args = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            # A step's label is `fleetcuda:<step>@<run id>`: `label` names it without the run id.
            if len(args) > 2 and args[-2].partition(b"@")[0] == label.encode() \
                    and (vmid is None or str(vmid).encode() in args) \
                    and (script_has is None or script_has.encode() in args[-3]):
                pids.append(int(d.name))
    return pids


def env_labelled(label: str) -> list[int]:
    """Processes whose environment carries `label` (with its run id) as FLEETCUDA_LABEL: a step and what it started,
    however those renamed or detached themselves (command.target_argv)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if f"FLEETCUDA_LABEL={label}".encode() in (d / "environ").read_bytes().split(b"\0"):
                    found.append(int(d.name))
            except OSError:
                continue
    return found


def end_step(pids: list[int], label: str, timeout: float = 30) -> None:
    """Kill a step's processes (`pids`, found by labelled_pids(label, ...)) and what they started (a `sleep`, which
    carries the step's label in its environment and keeps the lock while it runs), as a user stopping it would;
    return once none is left."""
    labels = set()
    for pid in pids:
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        labels.update(a.decode() for a in args if a.startswith(label.encode() + b"@"))
    for pid in [*pids, *(p for run_label in labels for p in env_labelled(run_label))]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while any(env_labelled(run_label) for run_label in labels):
        assert time.monotonic() < deadline, "the step's processes did not end"
        time.sleep(0.1)
