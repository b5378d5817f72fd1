"""A step's apply is retried up to its `retries`, with growing waits between attempts; an apply that ran out of
time, or whose connection dropped, is never sent again."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetcuda.connectors.base import RunResult
from fleetcuda.connectors.fake import Call, exit_with
from fleetcuda.errors import UnreachableError
from fleetcuda.results import StepStatus, TargetStatus
from tests.run_support import Sleeps, log_of, make_engine


def flaky(retries: int, delay: float, timeout: int = 1800) -> str:
    return (f"  - name: fetch\n    check: test -e /opt/x\n    apply: curl -fo /opt/x https://example.invalid/x\n"
            f"    retries: {retries}\n    retry_delay: {delay}\n    timeout: {timeout}\n")


def test_a_failing_apply_is_retried_up_to_retries_with_growing_waits(tmp_path: Path) -> None:
    sleeps = Sleeps()
    engine, fake = make_engine(tmp_path, flaky(retries=3, delay=2), sleep=sleeps)
    fake.on(step="fetch", phase="check", reply=exit_with(1))
    fake.on(step="fetch", phase="apply", reply=exit_with(22, "curl: (22) The requested URL returned error: 503"))
    [result] = engine.run()
    assert len(fake.calls_for(step="fetch", phase="apply")) == 4  # the first try and 3 retries
    assert sleeps.waits == [2, 4, 8]  # retry_delay, doubled each time
    [step] = result.steps
    assert step.status == StepStatus.FAILED and step.detail == "apply: apply failed (exit 22)"
    log = log_of(engine, "h")
    assert log.count("# apply failed (exit 22); retrying") == 3  # never after the last attempt
    assert "# apply failed (exit 22) on its last attempt (4 of 4)" in log


def test_an_apply_that_succeeds_on_a_retry_changes_the_step(tmp_path: Path) -> None:
    sleeps = Sleeps()
    engine, fake = make_engine(tmp_path, flaky(retries=5, delay=1), sleep=sleeps)
    fake.on(step="fetch", phase="check", reply=exit_with(1))
    fake.on(step="fetch", phase="apply", reply=exit_with(22), times=2)
    [result] = engine.run()
    assert result.steps[0].status == StepStatus.CHANGED
    assert len(fake.calls_for(step="fetch", phase="apply")) == 3 and sleeps.waits == [1, 2]


def test_without_retries_a_failed_apply_is_sent_once(tmp_path: Path) -> None:
    sleeps = Sleeps()
    engine, fake = make_engine(tmp_path, flaky(retries=0, delay=1), sleep=sleeps)
    fake.on(step="fetch", phase="check", reply=exit_with(1))
    fake.on(step="fetch", phase="apply", reply=exit_with(1))
    engine.run()
    assert len(fake.calls_for(phase="apply")) == 1 and sleeps.waits == []


@pytest.mark.parametrize("rc", [124, 137])
def test_an_apply_that_timed_out_is_never_retried(tmp_path: Path, rc: int) -> None:
    sleeps = Sleeps()
    engine, fake = make_engine(tmp_path, flaky(retries=3, delay=1, timeout=5), sleep=sleeps)
    fake.on(step="fetch", phase="check", reply=exit_with(1))
    fake.on(step="fetch", phase="apply", reply=RunResult(rc, "", 5.0))  # `timeout` ends it after its 5 s
    [result] = engine.run()
    assert len(fake.calls_for(phase="apply")) == 1 and sleeps.waits == []
    assert result.steps[0].detail == "apply: apply failed (timed out after 5s)"


def test_an_apply_the_control_side_gave_up_on_is_never_retried(tmp_path: Path) -> None:
    sleeps = Sleeps()
    engine, fake = make_engine(tmp_path, flaky(retries=3, delay=1, timeout=5), sleep=sleeps)
    fake.on(step="fetch", phase="check", reply=exit_with(1))
    fake.on(step="fetch", phase="apply", reply=RunResult(1, "", 40.0, timed_out=True))
    [result] = engine.run()
    assert len(fake.calls_for(phase="apply")) == 1 and "timed out after 5s" in result.steps[0].detail


def test_an_apply_whose_connection_dropped_is_not_sent_again(tmp_path: Path) -> None:
    engine, fake = make_engine(tmp_path, flaky(retries=3, delay=1), sleep=Sleeps())
    fake.on(step="fetch", phase="check", reply=exit_with(1))

    def dropped(call: Call) -> RunResult:
        raise UnreachableError("h: connection lost")

    fake.on(step="fetch", phase="apply", reply=dropped)
    [result] = engine.run()
    assert len(fake.calls_for(phase="apply")) == 1
    assert result.status == TargetStatus.UNREACHABLE and result.error == "h: connection lost"
