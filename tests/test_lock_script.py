"""remote/lock.sh in real bash, against real processes: the apply lock stands for the work on the target, not for
the control process that took it. While a process of the owner's run still runs there (its label, bash's $0 or
`timeout`'s last argument, is `fleetcuda:<step>@<run id>`), the lock is neither taken over (its control process
dead), nor removed as stale, nor released (a release over a new connection after the old one dropped).

(Run as root, the lock directories are /run/lock's, as on a target; each test uses a name nobody else does.)"""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetcuda.remote import framing
from fleetcuda.run.locks import LOCK_STALE_S, TargetLock, lock_state

NONCE = "0123456789abcdef"
OWNER = "alice@ctl pid 4242 since 2026-12-01T09:00:00Z machine 0123456789ab boot 89abcdef start 5150 pidns 4.5"


def lock_call(script: str, home: Path) -> tuple[int, list[framing.Frame]]:
    res = subprocess.run(["bash", "-c", f"IFS= read -r -d '' fcn\n{script}"], input=NONCE + "\0",
                         env={"PATH": "/usr/bin:/bin", "HOME": str(home)}, capture_output=True, text=True, timeout=60)
    return res.returncode, framing.parse(res.stdout, NONCE)


def words(frames: list[framing.Frame]) -> list[list[str]]:
    return [list(f.fields) for f in frames if f.kind == "lock"]


@pytest.fixture
def vmid(tmp_path: Path) -> Iterator[int]:
    vmid = 900000000 + secrets.randbelow(99999999)
    yield vmid
    for p in (Path("/run/lock"), Path("/run"), tmp_path / ".cache"):
        for d in p.glob(f"fleetcuda-apply-{vmid}*"):
            subprocess.run(["rm", "-rf", "--", str(d)], check=False)


def lockdir(vmid: int, home: Path) -> Path:
    return next(d for p in (Path("/run/lock"), Path("/run"), home / ".cache")
                for d in p.glob(f"fleetcuda-apply-{vmid}*") if d.is_dir())


def labelled(label: str, how: str = "bash") -> subprocess.Popen[bytes]:
    """A process of a step as fleetcuda starts it: bash with the label as $0 (`sleep; exit`: bash must not exec
    its last command), or `timeout ... bash -c SCRIPT LABEL` (the label is timeout's last argument too)."""
    argv = ["bash", "-c", "sleep 60; exit 0", label]
    if how == "timeout":
        argv = ["timeout", "-k", "5", "60", "bash", "-c", "sleep 60", label]
    # As fleetcuda starts it: the label in its environment too (command.target_argv), which lock.sh reads.
    proc = subprocess.Popen(argv, start_new_session=True,
                            env={"PATH": "/usr/bin:/bin", "FLEETCUDA_LABEL": label})
    deadline = time.monotonic() + 10
    while Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")[-2:-1] != [label.encode()]:
        assert time.monotonic() < deadline, "the labelled process never started"
        time.sleep(0.02)
    return proc


def end(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, 9)
    proc.wait()


def take(vmid: int, home: Path, run: str) -> TargetLock:
    """The lock, taken by `OWNER`'s run `run`."""
    lock = TargetLock(f"{OWNER} run {run}")  # as the engine makes it: TargetLock(run_owner(), run_id=run)
    rc, frames = lock_call(lock.acquire(vmid), home)
    assert rc == 0 and lock_state(frames)[0] == "held"
    assert (lockdir(vmid, home) / "owner").read_text() == f"{OWNER} run {run}\n"
    return lock


@pytest.mark.parametrize("how", ["bash", "timeout"])
def test_a_dead_owners_lock_is_not_taken_over_while_its_steps_run(tmp_path: Path, vmid: int, how: str) -> None:
    run = secrets.token_hex(4)
    lock = take(vmid, tmp_path, run)
    step = labelled(f"fleetcuda:slow-marker@{run}", how)
    try:
        rc, frames = lock_call(TargetLock("bob@ctl2 pid 1 since x machine m boot b start 1 pidns 4.5 "
                                          "run feedf00d").take_over(vmid, lock.owner), tmp_path)
        assert words(frames)[0][0] == "working" and words(frames)[0][2] == f"fleetcuda:slow-marker@{run}"
        assert lock_state(frames)[0] == "kept"
        assert (lockdir(vmid, tmp_path) / "owner").read_text() == f"{lock.owner}\n"  # still theirs
    finally:
        end(step)
    rc, frames = lock_call(TargetLock("bob run feedf00d").take_over(vmid, lock.owner), tmp_path)
    assert lock_state(frames)[0] == "taken-over"


def test_a_stale_lock_is_not_removed_while_its_steps_run(tmp_path: Path, vmid: int) -> None:
    run = secrets.token_hex(4)
    take(vmid, tmp_path, run)
    old = time.time() - LOCK_STALE_S - 60
    os.utime(lockdir(vmid, tmp_path), (old, old))
    step = labelled(f"fleetcuda:build@{run}")
    other = TargetLock("bob@ctl2 pid 7 since x machine m boot b start 1 pidns 4.5 run feedf00d")
    try:
        rc, frames = lock_call(other.acquire(vmid), tmp_path)
        assert rc == 75
        working = words(frames)[0]  # the step's bash and its `sleep`, which carries its label too
        assert working[0] == "working" and int(working[1]) >= 1 and working[2] == f"fleetcuda:build@{run}"
        assert lock_state(frames)[0] == "busy"
    finally:
        end(step)
    rc, frames = lock_call(other.acquire(vmid), tmp_path)
    assert rc == 0 and [w[0] for w in words(frames)] == ["stale", "held"]


def test_a_release_keeps_the_lock_while_the_runs_steps_run(tmp_path: Path, vmid: int) -> None:
    """After a lost connection the step goes on in the container: the release sent over a new connection
    keeps the lock for it; once it has ended, the release gives the lock back."""
    run = secrets.token_hex(4)
    lock = take(vmid, tmp_path, run)
    step = labelled(f"fleetcuda:slow-marker@{run}")
    try:
        rc, frames = lock_call(lock.release(vmid), tmp_path)
        assert [w[0] for w in words(frames)] == ["working", "kept"]
        assert lockdir(vmid, tmp_path).is_dir()
    finally:
        end(step)
    rc, frames = lock_call(lock.release(vmid), tmp_path)
    assert lock_state(frames)[0] == "released"
    with pytest.raises(StopIteration):
        lockdir(vmid, tmp_path)


def test_only_the_owners_run_counts(tmp_path: Path, vmid: int) -> None:
    """Another run's steps, and fleetcuda's own commands of the owner's run (its batch, this lock script), do
    not keep a lock."""
    run = secrets.token_hex(4)
    lock = take(vmid, tmp_path, run)
    others = [labelled(f"fleetcuda:slow-marker@{secrets.token_hex(4)}"), labelled(f"fleetcuda-batch@{run}"),
              labelled(f"fleetcuda:slow-marker@x{run}")]
    try:
        rc, frames = lock_call(lock.release(vmid), tmp_path)
        assert [w[0] for w in words(frames)] == ["released"]
    finally:
        for p in others:
            end(p)


def test_a_lock_naming_no_run_is_kept_by_nothing(tmp_path: Path, vmid: int) -> None:
    """An owner that names no run (or a run id no label can hold) is not looked for: the lock behaves as before."""
    lock = TargetLock(OWNER + " run *")
    rc, frames = lock_call(lock.acquire(vmid), tmp_path)
    step = labelled("fleetcuda:x@abc")
    try:
        rc, frames = lock_call(lock.release(vmid), tmp_path)
        assert [w[0] for w in words(frames)] == ["released"]
    finally:
        end(step)


def test_the_lock_names_the_run_it_stands_for() -> None:
    """The owner file's last words name the run whose labelled processes the lock stands for."""
    assert TargetLock(OWNER, run_id="abcd1234").owner == f"{OWNER} run abcd1234"
    assert "fleetcuda_lock_acquire fleetcuda-apply-7 " f"'{OWNER} run abcd1234' 0 " in \
        TargetLock(OWNER, run_id="abcd1234").acquire(7)


def _detached_worker(run: str) -> int:
    """A step, started as fleetcuda starts one, that leaves a worker which renamed and detached itself
    (`setsid`, `exec -a`): its cmdline carries no label; the pid of the worker."""
    from fleetcuda.plan.command import Invocation, target_argv

    script = "setsid bash -c 'exec -a worker sleep 60' </dev/null >/dev/null 2>&1 &\necho $!"
    out = subprocess.run(target_argv(Invocation(script, {"PATH": "/usr/bin:/bin"}, timeout=None,
                                                label=f"fleetcuda:daemon@{run}")),
                         capture_output=True, text=True, timeout=30, check=True).stdout
    pid = int(out.split()[0])
    deadline = time.monotonic() + 10
    while b"worker" not in Path(f"/proc/{pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return pid


def test_a_worker_that_renamed_and_detached_itself_still_keeps_the_lock_and_is_stopped(tmp_path: Path,
                                                                                         vmid: int) -> None:
    """The second attack: a step's `setsid` + `exec -a` child escaped the label, so the lock was taken over
    and a Ctrl-C stopped nothing while it ran on. The label it inherited in its environment finds it."""
    from fleetcuda.plan.command import stop_invocation, target_argv

    run = secrets.token_hex(4)
    lock = take(vmid, tmp_path, run)
    pid = _detached_worker(run)
    try:
        rc, frames = lock_call(TargetLock("bob run feedf00d").take_over(vmid, lock.owner), tmp_path)
        assert lock_state(frames)[0] == "kept", words(frames)
        stop = subprocess.run(target_argv(stop_invocation(f"fleetcuda:daemon@{run}")), capture_output=True,
                              text=True, timeout=60)
        assert "stopped 1 process(es)" in stop.stdout, stop.stdout + stop.stderr
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and b"worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline, "the worker still runs"
            time.sleep(0.05)
    finally:
        subprocess.run(["kill", "-9", str(pid)], capture_output=True)
    rc, frames = lock_call(TargetLock("bob run feedf00d").take_over(vmid, lock.owner), tmp_path)
    assert lock_state(frames)[0] == "taken-over"


def test_a_wrapper_outside_the_container_or_another_containers_step_keeps_no_lock(tmp_path: Path, vmid: int) -> None:
    """Where containers share one /proc (local stand-ins): a process whose last argument is the run's label
    without the label in its environment (a `pct exec`/sudo wrapper), or a step of the same run in another
    container (FLEETCUDA_TARGET), does not keep this container's lock (a flaky e2e run released no lock)."""
    run = secrets.token_hex(4)
    lock = take(vmid, tmp_path, run)
    wrapper = subprocess.Popen(["bash", "-c", "sleep 60; exit 0", f"fleetcuda:make-dir@{run}"], start_new_session=True,
                               env={"PATH": "/usr/bin:/bin"})
    other = subprocess.Popen(["bash", "-c", "sleep 60; exit 0", f"fleetcuda:make-dir@{run}"], start_new_session=True,
                             env={"PATH": "/usr/bin:/bin", "FLEETCUDA_LABEL": f"fleetcuda:make-dir@{run}",
                                  "FLEETCUDA_TARGET": str(vmid + 1)})
    try:
        time.sleep(0.3)
        rc, frames = lock_call(lock.release(vmid), tmp_path)
        assert lock_state(frames)[0] == "released", words(frames)
    finally:
        end(wrapper)
        end(other)
