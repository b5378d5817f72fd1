"""Ctrl-C (SIGINT) while a step runs, in-process on the fake connector: the connectors are aborted, the run's
STOP command is sent for what was running, the run's locks are released, every target that had not ended is
interrupted, and a second signal during that cleanup is ignored."""

from __future__ import annotations

import os
import shlex
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetcuda.connectors.base import RunResult
from fleetcuda.connectors.fake import Call, exit_with, ok
from fleetcuda.results import ExitStatus, TargetStatus, exit_code
from fleetcuda.run.wheelcache import WheelCache
from tests.run_support import FP, STEP, TWO_CONTAINERS, WHEEL, WHEEL_BYTES, fake_fleet, log_of, make_engine

SLOW = "  - name: slow\n    check: test -e /done\n    apply: sleep 600\n"


@pytest.fixture
def signals() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt in the main thread, as in the CLI; the engine leaves both signals ignored
    after an interruption (the CLI restores them once the run is recorded): restored here."""
    saved = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, saved[0])
    signal.signal(signal.SIGTERM, saved[1])


def ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_while_a_step_runs_stops_it_releases_the_lock_and_interrupts(tmp_path: Path, signals: None) -> None:
    assert threading.current_thread() is threading.main_thread()
    # forks=1: h/201 runs, h/202 waits for a worker and never starts.
    engine, fake = make_engine(tmp_path, SLOW, inventory=TWO_CONTAINERS, locked=True, forks=1)
    fake.on(step="slow", phase="check", reply=exit_with(1))
    gate = fake.block(step="slow", phase="apply")
    stops: list[Call] = []

    def stop(call: Call) -> RunResult:
        stops.append(call)
        ctrl_c()  # a second Ctrl-C, while the run cleans up: ignored
        return ok("stopped 1 process(es) labelled fleetcuda:slow (or of run x); 0 needed KILL\n")

    fake.on(label="fleetcuda-stop", reply=stop)
    threading.Thread(target=lambda: (gate.wait_entered(), ctrl_c()), daemon=True).start()

    try:
        results = {r.target: r for r in engine.run()}
    except KeyboardInterrupt:
        pytest.fail("a Ctrl-C escaped from the run: the second one was not ignored")

    assert engine.interrupted and fake.aborted >= 1
    running = results["h/201"]
    assert running.status == TargetStatus.INTERRUPTED
    assert running.error == ("interrupted during slow: stopped 1 process(es) labelled fleetcuda:slow (or of run x); "
                             "0 needed KILL")
    assert engine.stopped == {"h/201": running.error}
    assert results["h/202"].status == TargetStatus.INTERRUPTED and results["h/202"].steps == []
    # The STOP command went to the target that was running, for that step of this run only.
    [stopped] = stops
    assert stopped.place == 201 and stopped.cmd is not None
    assert stopped.cmd.label == f"fleetcuda-stop@{engine.run_id}"
    assert shlex.split(stopped.script.splitlines()[0]) == ["set", "--", engine.run_id,
                                                           f"fleetcuda:slow@{engine.run_id}"]
    # Its lock was released by the main thread; h/202 never took one.
    assert fake.locks.owners == {}
    assert [(w, name) for w, name, _ in fake.locks.events] == [("held", "fleetcuda-apply-201"),
                                                                ("released", "fleetcuda-apply-201")]
    log = log_of(engine, "h/201")
    assert "# interrupted during slow: stopped 1 process(es)" in log
    assert "# lock released after the interruption" in log
    assert exit_code(list(results.values())) == ExitStatus.INTERRUPTED
    # Stop signals stay ignored until the caller has recorded the run.
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN and signal.getsignal(signal.SIGTERM) == signal.SIG_IGN


def test_ctrl_c_during_a_transfer_aborts_it(tmp_path: Path, signals: None) -> None:
    """A put is aborted like a command: the target is interrupted and no install follows."""
    wheel = tmp_path / WHEEL
    wheel.write_bytes(WHEEL_BYTES)
    WheelCache(tmp_path / "cache").store(wheel, FP, {"built_on": "h/900"})
    fake = fake_fleet()
    gate = fake.block(kind="put")
    engine, _ = make_engine(tmp_path, STEP, inventory=TWO_CONTAINERS.replace("      202:\n        venv: /root/venv\n",
                                                                             ""), fake=fake)
    threading.Thread(target=lambda: (gate.wait_entered(), ctrl_c()), daemon=True).start()
    [result] = engine.run()
    assert gate.aborted and result.status == TargetStatus.INTERRUPTED and result.error == "interrupted"
    assert fake.calls_for(phase="install") == [] and fake.calls_for(phase="apply") == []  # nor a build instead
    assert "building here instead" not in log_of(engine, "h/201")
    assert " ext put\n$ put " in log_of(engine, "h/201") and "(put failed: " in log_of(engine, "h/201")
    assert fake.files.paths(None) == []  # the partial upload's staging directory was removed


TWO_CHECKS = ("  - name: a\n    check: test -e /a\n    apply: touch /a\n"
              "  - name: b\n    check: test -e /b\n    apply: touch /b\n")


def test_ctrl_c_during_the_first_round_trip_releases_the_lock_it_may_have_taken(tmp_path: Path,
                                                                                 signals: None) -> None:
    """The batch (checks and the lock) was sent and the target took the lock, but no answer came before Ctrl-C:
    the lock is released all the same (else every other apply would find the target locked for 15 min)."""
    engine, fake = make_engine(tmp_path, TWO_CHECKS, inventory=TWO_CONTAINERS.replace(
        "      202:\n        venv: /root/venv\n", ""), locked=True)
    gate = fake.block(label="fleetcuda-batch")
    lock = engine.locks.lock
    assert lock is not None

    def target_takes_the_lock_then_ctrl_c() -> None:
        gate.wait_entered()
        fake.locks.hold("fleetcuda-apply-201", lock.owner)  # what the batch's first lines did on the target
        ctrl_c()

    threading.Thread(target=target_takes_the_lock_then_ctrl_c, daemon=True).start()
    [result] = engine.run()
    assert engine.interrupted and result.status == TargetStatus.INTERRUPTED
    assert fake.locks.owners == {}  # released
    assert [(w, name) for w, name, _ in fake.locks.events] == [("released", "fleetcuda-apply-201")]
    assert "# lock released after the interruption" in log_of(engine, "h/201")
