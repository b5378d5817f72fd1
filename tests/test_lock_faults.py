"""The apply lock through the real CLI, over SSH to the loopback lab (sudo, a `pct exec` stand-in whose
containers share this machine's /proc): it stands for the work on the target, and is released whenever it may
have been taken.

- A run killed (SIGKILL) mid-step: its step goes on in the container; the next apply refuses (locked, saying
  that run's processes still run there) instead of running the same step alongside, and takes the lock over once
  they have ended.
- A connection dropped mid-step: the step goes on; the release sent over a new connection keeps the lock while it
  runs, and the next apply refuses until it has ended, then finds the work done.
- SIGTERM, SIGINT or SIGHUP during the first round trip (the batched checks, with the lock): exit 130 and the
  lock released.
"""

from __future__ import annotations

import contextlib
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
from tests.lab.sshd import LoopbackSshd

SLOW = str(REPO / "tests/data/slow.yaml")
SLOW_CHECKS = str(REPO / "tests/data/slow_checks.yaml")


@pytest.fixture
def env(sshd_lab: LoopbackSshd, tmp_path: Path) -> Iterator[dict[str, object]]:
    """A container of a vmid nobody else uses (its lock is this machine's /run/lock/fleetcuda-apply-N), on a root
    login (the sudo logins' sudoers drop-in is shared by every loopback lab of this machine)."""
    vmid = 3000 + secrets.randbelow(6000)
    sshd_lab.add_container(vmid, name=f"c{vmid}")
    root = tmp_path / "root"
    root.mkdir()
    os.chmod(tmp_path, 0o755)
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"hosts:\n  bashhost:\n    address: 127.0.0.1\n    port: {sshd_lab.port}\n    user: root\n"
                   f"    identity_file: {sshd_lab.identity}\n    known_hosts: {sshd_lab.known_hosts}\n"
                   f"    pct: {sshd_lab.pct_path}\n    sudo: false\n    containers:\n"
                   f"      {vmid}:\n        name: c{vmid}\n")
    yield {"inv": inv, "root": root, "state": tmp_path / "fc", "bashhost": vmid}
    for pid in step_pids(vmid, 40) + step_pids(vmid, 20):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    subprocess.run(["rm", "-rf", f"/run/lock/fleetcuda-apply-{vmid}"], check=False)


def start(*args: str, state: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "fleetcuda", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env={**os.environ, "FLEETCUDA_STATE_DIR": str(state), "COLUMNS": "200"})


def wait_for(what: str, ready: object, timeout: float = 30, run: subprocess.Popen[str] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not ready():  # type: ignore[operator]
        if time.monotonic() > deadline or (run is not None and run.poll() is not None):
            if run is not None and run.poll() is None:
                run.kill()
            raise AssertionError(f"{what} never happened" + (f": {run.communicate()[0]}" if run else ""))
        time.sleep(0.1)


def step_pids(vmid: int, seconds: int) -> list[int]:
    """The slow-marker step's apply in container vmid (not its check: `sleep <seconds>` is in its script), by
    its script (`pct exec VMID` on the host may be gone with its session, while the step goes on)."""
    def in_container(pid: int) -> bool:
        try:
            return f"fc_vmid={vmid}\n".encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False  # ended meanwhile

    return [pid for pid in labelled_pids("fleetcuda:slow-marker", script_has=f"fc_seconds={seconds}\n")
            if in_container(pid)]


def sshd_serving(pid: int) -> int:
    """The sshd process of the session a process was started by (its nearest `sshd:` ancestor)."""
    while pid > 1:
        if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sshd:"):
            return pid
        pid = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    raise AssertionError("no sshd session above the step")


def common(env: dict[str, object], host: str) -> list[str]:
    return ["-i", str(env["inv"]), "--var", f"root={env['root']}", "--plain", "--limit", f"{host}/{env[host]}"]


def test_a_killed_runs_step_keeps_its_lock_until_it_ends(env: dict[str, object]) -> None:
    vmid = env["bashhost"]
    assert isinstance(vmid, int)
    first = start("apply", SLOW, *common(env, "bashhost"), "--var", "seconds=40", state=env["state"])
    wait_for("the step", lambda: step_pids(vmid, 40), run=first)
    first.kill()  # SIGKILL: no release, no stop; the step goes on in the container
    first.wait()
    second = run_fleetcuda("apply", SLOW, *common(env, "bashhost"), "--var", "seconds=0", state=env["state"])
    assert second.returncode == 1, second.stdout
    assert re.search(rf"bashhost/{vmid} done: locked: another fleetcuda apply holds /run/lock/fleetcuda-apply-{vmid}"
                     rf" on bashhost/{vmid}: root@\S+ pid {first.pid} .*its fleetcuda process has ended, but \d+ "
                     r"process\(es\) of that run still run there \(fleetcuda:slow-marker@\w+\)", second.stdout), \
        second.stdout
    assert "slow-marker apply" not in second.stdout  # the step did not run a second time alongside the first
    assert step_pids(vmid, 40)  # nor was the first one touched
    # It ends (here: killed, as a user would, or it finishes): its bash, and what it started (the `sleep`, which
    # carries the step's label in its environment, FLEETCUDA_LABEL, and keeps the lock while it runs).
    end_step(step_pids(vmid, 40), "fleetcuda:slow-marker")
    third = run_fleetcuda("apply", SLOW, *common(env, "bashhost"), "--var", "seconds=0", state=env["state"])
    assert third.returncode == 0, third.stdout
    assert f"bashhost/{vmid} lock: take-over" in third.stdout and f"bashhost/{vmid} done: changed" in third.stdout


def test_a_dropped_connection_keeps_the_lock_while_its_step_runs(env: dict[str, object]) -> None:
    vmid = env["bashhost"]
    assert isinstance(vmid, int)
    marker = Path(str(env["root"])) / f"ct{vmid}" / "slow"
    first = start("apply", SLOW, *common(env, "bashhost"), "--var", "seconds=20", state=env["state"])
    wait_for("the step", lambda: step_pids(vmid, 20), run=first)
    pids = step_pids(vmid, 20)
    assert pids, "the step ended early"
    os.kill(sshd_serving(pids[0]), signal.SIGKILL)  # the link goes away
    out, _ = first.communicate(timeout=120)
    assert first.returncode == 3, out  # unreachable: connection lost
    assert step_pids(vmid, 20), "the step was expected to go on in the container"
    second = run_fleetcuda("apply", SLOW, *common(env, "bashhost"), "--var", "seconds=0", state=env["state"])
    assert second.returncode == 1, second.stdout
    assert "process(es) of that run still run there (fleetcuda:slow-marker@" in second.stdout, second.stdout
    assert not marker.exists()  # nothing ran the step alongside the first
    log = (Path(out.split("logs: ")[-1].split()[0]) / f"bashhost_{vmid}.log").read_text()
    assert re.search(r"# lock kept: \d+ process\(es\) of this run still run on bashhost/\d+ "
                     r"\(fleetcuda:slow-marker@\w+\)", log), log
    assert Path(f"/run/lock/fleetcuda-apply-{vmid}").is_dir()
    wait_for("the first step's end", lambda: marker.exists() and not step_pids(vmid, 20), timeout=60)
    third = run_fleetcuda("apply", SLOW, *common(env, "bashhost"), "--var", "seconds=0", state=env["state"])
    assert third.returncode == 0, third.stdout
    assert f"bashhost/{vmid} done: ok" in third.stdout  # the first run's step had done the work, once
    assert len(marker.read_text().splitlines()) == 1


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_signal_during_the_first_round_trip_releases_the_lock(env: dict[str, object], signame: str) -> None:
    vmid = env["bashhost"]
    lockdir = Path(f"/run/lock/fleetcuda-apply-{vmid}")
    run = start("apply", SLOW_CHECKS, *common(env, "bashhost"), state=env["state"])

    def lock_taken() -> bool:
        with contextlib.suppress(OSError):
            return f" pid {run.pid} " in (lockdir / "owner").read_text()
        return False

    wait_for("the lock", lock_taken, run=run)
    time.sleep(0.5)  # the batch took the lock first; its slow check runs for 30 s
    run.send_signal(getattr(signal, signame))
    out, _ = run.communicate(timeout=120)
    assert run.returncode == 130, out
    assert not lockdir.exists(), out  # released: other applies do not find the target locked for 15 min
    again = run_fleetcuda("apply", SLOW_CHECKS, *common(env, "bashhost"), "--var", "check_seconds=0",
                          state=env["state"])
    assert again.returncode == 0, again.stdout


def test_a_live_apply_from_another_pid_namespace_is_not_taken_over(env: dict[str, object]) -> None:
    """Two control machines that are containers of one host (same machine id and boot id, each its own pid
    namespace): the second apply refuses, it does not take the first one's lock over as dead."""
    vmid = env["bashhost"]
    assert isinstance(vmid, int)
    first = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, "-m",
                              "fleetcuda", "apply", SLOW, *common(env, "bashhost"), "--var", "seconds=40"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                             env={**os.environ, "FLEETCUDA_STATE_DIR": str(env["state"]), "COLUMNS": "200"})
    try:
        wait_for("the step", lambda: step_pids(vmid, 40), run=first)
        second = run_fleetcuda("apply", SLOW, *common(env, "bashhost"), "--var", "seconds=0", state=env["state"])
        assert second.returncode == 1, second.stdout
        assert re.search(rf"bashhost/{vmid} done: locked: another fleetcuda apply holds "
                         rf"/run/lock/fleetcuda-apply-{vmid} on bashhost/{vmid}: root@\S+ pid 1 ", second.stdout), \
            second.stdout
        assert "take-over" not in second.stdout and "slow-marker: apply" not in second.stdout
        assert step_pids(vmid, 40)  # the first run's step goes on
    finally:
        # Its fleetcuda (pid 1 there, the child of unshare here) is told to stop: it stops its step and releases.
        children = Path(f"/proc/{first.pid}/task/{first.pid}/children").read_text().split()
        for pid in children:
            os.kill(int(pid), signal.SIGTERM)
        out, _ = first.communicate(timeout=120)
    assert "interrupted during slow-marker" in out, out
    assert not Path(f"/run/lock/fleetcuda-apply-{vmid}").exists(), out
