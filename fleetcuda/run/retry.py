"""A step's apply, retried up to its `retries` with exponential backoff; an apply that ran out of time or was
killed (124/137) is never re-sent blindly, nor one that failed on the network (diagnosis.network_failure): another
try meets the same DNS, mirror or certificate."""

from __future__ import annotations

from collections.abc import Callable

from tenacity import RetryError, Retrying, stop_after_attempt, wait_exponential

from fleetcuda.connectors.base import RunResult
from fleetcuda.plan.planner import PlannedStep
from fleetcuda.run.channel import Interrupted, TargetChannel
from fleetcuda.run.diagnosis import network_failure, stopped

Sleep = Callable[[float], None]


class _Retry(Exception):
    def __init__(self, result: RunResult):
        super().__init__(f"exit {result.rc}")
        self.result = result


def apply_with_retries(channel: TargetChannel, step: PlannedStep, sleep: Sleep) -> RunResult:
    """`sleep` waits between attempts (time.sleep; tests pass one that only records)."""
    assert step.apply is not None
    if step.retries == 0:
        return channel.exec(step.name, "apply", step.apply, step.timeout)

    def attempt(number: int) -> RunResult:
        if channel.ctx.cancel.is_set():
            raise Interrupted()
        res = channel.exec(step.name, "apply", step.apply, step.timeout)  # type: ignore[arg-type]
        if res.rc != 0 and not stopped(res):  # an apply that ran out of time (or was killed): never re-sent
            net = network_failure(res.output)
            if net is not None:  # a name that does not resolve, a mirror that refuses: another try is the same
                channel.write(f"# apply failed (exit {res.rc}): {net[0]}")
                return res
            if number > step.retries:
                channel.write(f"# apply failed (exit {res.rc}) on its last attempt ({number} of {number})")
                return res
            channel.write(f"# apply failed (exit {res.rc}); retrying (attempt {number + 1} of {step.retries + 1})")
            raise _Retry(res)
        return res

    try:
        for try_ in Retrying(stop=stop_after_attempt(step.retries + 1), reraise=False, sleep=sleep,
                             wait=wait_exponential(multiplier=step.retry_delay, max=step.retry_delay * 8),
                             retry=lambda rs: isinstance(rs.outcome.exception(), _Retry)):
            with try_:
                return attempt(try_.retry_state.attempt_number)
    except RetryError as exc:
        last = exc.last_attempt.exception()
        assert isinstance(last, _Retry)
        return last.result
    raise AssertionError("unreachable")
