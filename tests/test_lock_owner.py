"""Whose lock is dead: only where that can be known. Two control machines that are containers of one host share
its machine id and boot id, but not a pid namespace: a pid of one is not to be looked up in the other (it is
gone there, or another process). Real pid namespaces (`unshare --pid --fork --mount-proc`, as root) stand for
them; "dead" stays decided where it can be, in this process's own namespace."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fleetcuda.run import locks
from fleetcuda.run.locks import owner_is_dead, run_owner

REPO = Path(__file__).resolve().parents[1]

needs_unshare = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                   reason="a second pid namespace needs root and unshare")


def in_namespace(code: str, *, mount_proc: bool = True) -> subprocess.Popen[str]:
    """Python, running this tree's fleetcuda, as the first process of a new pid namespace (same machine and boot)."""
    argv = ["unshare", "--pid", "--fork", *(["--mount-proc"] if mount_proc else []), sys.executable, "-c", code]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


@needs_unshare
def test_a_live_run_of_another_pid_namespace_is_not_dead() -> None:
    """Its pid (1 there) names another process here: its lock waits for staleness, it is not taken over."""
    other = in_namespace("import sys; from fleetcuda.run.locks import run_owner\n"
                         "print(run_owner(), flush=True); sys.stdin.read()")
    try:
        assert other.stdout is not None
        owner = other.stdout.readline().strip()
        assert re.search(r" pid 1 ", owner), owner  # the same machine id and boot id as ours
        assert owner_is_dead(owner) is False
    finally:
        other.communicate("", timeout=30)


@needs_unshare
def test_a_live_run_of_this_namespace_is_not_dead_seen_from_another() -> None:
    """Seen from a container of this host, our pid is gone (its pids are others): still not dead."""
    other = in_namespace("import sys; from fleetcuda.run.locks import owner_is_dead\n"
                         "print(owner_is_dead(sys.stdin.readline().strip()), flush=True)")
    out, _ = other.communicate(run_owner() + "\n", timeout=30)
    assert out.strip() == "False"


@needs_unshare
def test_without_a_proc_of_its_own_namespace_nothing_is_dead() -> None:
    """A pid namespace whose /proc is its parent's: os.getpid's pids cannot be looked up there."""
    other = in_namespace("from fleetcuda.run import locks\n"
                         "print(getattr(locks, 'pid_namespace', lambda: 'none')(), "
                         "locks.owner_is_dead(locks.run_owner(4194000)), flush=True)", mount_proc=False)
    out, _ = other.communicate("", timeout=30)
    assert out.split() == ["?", "False"]


def test_a_dead_run_of_this_namespace_is_dead() -> None:
    """Where it can be known, it still is: a run of this machine, boot and pid namespace whose process is gone."""
    assert locks.pid_namespace() != "?"
    proc = subprocess.Popen(["sleep", "60"])
    owner = run_owner(proc.pid)
    assert owner_is_dead(owner) is False
    proc.kill()
    proc.wait()
    assert owner_is_dead(owner) is True
    assert owner_is_dead(owner + " run 0badcafe") is True  # as a lock's owner file holds it


def test_an_owner_that_names_no_pid_namespace_is_not_dead() -> None:
    """An owner written before pid namespaces were named (or by a machine with no id) waits for staleness."""
    dead = re.sub(r" pid \d+ ", " pid 4194000 ", run_owner())
    assert owner_is_dead(dead) is True
    assert owner_is_dead(dead.partition(" pidns ")[0]) is False
    assert owner_is_dead(re.sub(r" machine \S+ ", " machine unknown ", dead)) is False
    assert owner_is_dead(re.sub(r" boot \S+ ", " boot 00000000 ", dead)) is False  # rebooted, or another machine
