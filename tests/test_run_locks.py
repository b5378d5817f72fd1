"""One apply at a time per target: another live run's lock stops the target before anything is applied, a dead
run's lock is taken over, the run's own lock is refreshed while held and released however the target ends."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest

from fleetcuda.connectors.base import RunResult
from fleetcuda.connectors.fake import Call, FakeTransport, exit_with
from fleetcuda.errors import UnreachableError
from fleetcuda.results import ExitStatus, StepStatus, TargetStatus, exit_code
from fleetcuda.run.locks import run_owner
from tests.run_support import make_engine

ONE_STEP = "  - name: a\n    check: test -e /a\n    apply: touch /a\n"
TWO_STEPS = ONE_STEP + "  - name: b\n    check: test -e /b\n    apply: touch /b\n"
LOCK = "fleetcuda-apply"  # a host's own lock (a container's is fleetcuda-apply-<vmid>)
ANOTHER_RUN = "alice@ctl2 pid 4242 since 2026-12-01T09:00:00Z machine 0123456789ab boot 89abcdef start 5150"


def dead_run_of_this_machine() -> str:
    """An owner as run_owner writes it, of this machine and boot, whose process is gone."""
    return re.sub(r" pid \d+ ", " pid 4194000 ", run_owner())


def unsatisfied(fake: FakeTransport, *steps: str) -> None:
    for step in steps:
        fake.on(step=step, phase="check", reply=exit_with(1))


@pytest.mark.parametrize("steps", [ONE_STEP, TWO_STEPS], ids=["lock-alone", "lock-in-the-batch"])
def test_a_lock_another_live_run_holds_fails_the_target_and_nothing_is_applied(tmp_path: Path, steps: str) -> None:
    engine, fake = make_engine(tmp_path, steps, locked=True)
    unsatisfied(fake, "a", "b")
    fake.locks.hold(LOCK, ANOTHER_RUN)
    [result] = engine.run()
    assert result.status == TargetStatus.LOCKED and result.steps == []
    assert result.error is not None
    assert result.error.startswith(f"another fleetcuda apply holds /run/lock/{LOCK} on h: {ANOTHER_RUN}")
    assert "--lock-wait" in result.error
    assert fake.calls_for(phase="apply") == [] and fake.calls_for(phase="take-over") == []
    assert fake.locks.owners == {LOCK: ANOTHER_RUN}  # theirs, untouched
    assert exit_code([result]) == ExitStatus.FAILED


@pytest.mark.parametrize("steps", [ONE_STEP, TWO_STEPS], ids=["lock-alone", "lock-in-the-batch"])
def test_a_dead_runs_lock_is_taken_over_and_the_run_goes_on(tmp_path: Path, steps: str) -> None:
    engine, fake = make_engine(tmp_path, steps, locked=True)
    unsatisfied(fake, "a", "b")
    dead = dead_run_of_this_machine()
    fake.locks.hold(LOCK, dead)
    [result] = engine.run()
    assert result.status == TargetStatus.CHANGED
    assert [w for w, _, _ in fake.locks.events] == ["busy", "taken-over", "held", "released"]
    assert fake.locks.events[1] == ("taken-over", LOCK, dead)
    assert len(fake.calls_for(phase="take-over")) == 1
    assert fake.locks.owners == {}


def test_the_lock_is_released_when_the_target_ends(tmp_path: Path) -> None:
    engine, fake = make_engine(tmp_path, TWO_STEPS, locked=True)
    unsatisfied(fake, "a")
    [result] = engine.run()
    assert result.status == TargetStatus.CHANGED
    assert [w for w, _, _ in fake.locks.events] == ["held", "released"]
    def same_run(owner: str) -> str:  # the owner says when it was made, to the second: compare the rest
        return re.sub(r" since \S+ ", " ", owner)

    # It was this run's: this process, and this run's id (whose processes the target keeps the lock for).
    assert same_run(fake.locks.events[0][2]) == same_run(f"{run_owner()} run {engine.run_id}")
    assert [c.phase for c in fake.calls_for(step="lock")] == ["release"]
    assert fake.locks.owners == {}


def test_the_lock_is_released_after_a_failed_step(tmp_path: Path) -> None:
    engine, fake = make_engine(tmp_path, TWO_STEPS, locked=True)
    unsatisfied(fake, "a", "b")
    fake.on(step="a", phase="apply", reply=exit_with(1, "E: Unable to locate package"))
    [result] = engine.run()
    assert result.status == TargetStatus.FAILED and result.steps[0].status == StepStatus.FAILED
    assert [w for w, _, _ in fake.locks.events] == ["held", "released"] and fake.locks.owners == {}


def test_with_nothing_to_apply_the_batch_gives_the_lock_back_at_once(tmp_path: Path) -> None:
    engine, fake = make_engine(tmp_path, TWO_STEPS, locked=True)
    [result] = engine.run()
    assert result.status == TargetStatus.OK
    assert [w for w, _, _ in fake.locks.events] == ["held", "released"]
    assert fake.calls_for(step="lock") == []  # no round trip of its own: the batch released it


def test_other_modes_take_no_lock(tmp_path: Path) -> None:
    engine, fake = make_engine(tmp_path, TWO_STEPS, mode="check", locked=True)
    fake.locks.hold(LOCK, ANOTHER_RUN)
    [result] = engine.run()
    assert result.status == TargetStatus.OK and [w for w, _, _ in fake.locks.events] == []


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_the_lock_is_refreshed_while_held(tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if how == "environment":
        monkeypatch.setenv("FLEETCUDA_LOCK_REFRESH_S", "0.01")
        engine, fake = make_engine(tmp_path, ONE_STEP, locked=True)
    else:
        engine, fake = make_engine(tmp_path, ONE_STEP, locked=True, lock_refresh_s=0.01)
    unsatisfied(fake, "a")
    gate = fake.block(step="a", phase="apply")

    def release_after_refreshes() -> None:
        gate.wait_entered()
        deadline = time.monotonic() + 3
        while fake.locks.said("refreshed") < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        gate.release()

    helper = threading.Thread(target=release_after_refreshes, daemon=True)
    helper.start()
    [result] = engine.run()
    helper.join(5)
    assert result.status == TargetStatus.CHANGED
    words = [w for w, _, _ in fake.locks.events]
    assert words.count("refreshed") >= 2, words
    # Only while held: after the release, nothing refreshes a lock this run no longer has.
    assert words[0] == "held" and words[-1] == "released" and set(words[1:-1]) == {"refreshed"}
    time.sleep(0.05)
    assert fake.locks.said("refreshed") == words.count("refreshed")


def test_a_lock_taken_by_a_batch_whose_answer_was_lost_is_released(tmp_path: Path) -> None:
    """The batch took the lock on the target, then its connection dropped before any answer (and again when sent
    once more): the target is unreachable, and the lock it may hold is released over a new connection."""
    engine, fake = make_engine(tmp_path, TWO_STEPS, locked=True)
    lock = engine.locks.lock
    assert lock is not None

    def took_the_lock_then_dropped(call: Call) -> RunResult:
        fake.locks.hold(LOCK, lock.owner)
        raise UnreachableError("h: connection lost")

    fake.on(label="fleetcuda-batch", reply=took_the_lock_then_dropped)
    [result] = engine.run()
    assert result.status == TargetStatus.UNREACHABLE
    assert fake.locks.owners == {} and [w for w, _, _ in fake.locks.events] == ["released"]
