"""One target's steps in order: check -> (satisfied: ok) or apply -> verify -> changed; --check stops at
would-change, verify mode only verifies (ok or drift). A failed step stops its target's later steps.

Under --check nothing changes, so a check after a step that would change may fail only because that change
has not been made (nvcc not installed yet): such a check is `unknown` (depends on the steps that would change),
never failed, and the preview goes on. A check that times out, or fails with no earlier step to change, is a
real failure."""

from __future__ import annotations

import time
from dataclasses import replace

from fleetcuda.connectors.base import RunResult
from fleetcuda.plan.planner import Plan, PlannedStep
from fleetcuda.results import StepResult, StepStatus, TargetResult, TargetStatus
from fleetcuda.run.batching import batched_checks
from fleetcuda.run.channel import Interrupted, RunContext, TargetChannel
from fleetcuda.run.diagnosis import (
    ending,
    expected,
    failed,
    found,
    free_space,
    maybe_unreachable,
    network_failure,
    readable,
    stopped,
    tail,
    timed_out,
)
from fleetcuda.run.locking import LockKeeper
from fleetcuda.run.retry import Sleep, apply_with_retries
from fleetcuda.run.shared import SharedBuilds


class StepFailed(Exception):
    def __init__(self, result: StepResult):
        super().__init__(result.detail)
        self.result = result


class Converger:
    def __init__(self, ctx: RunContext, locks: LockKeeper, shared: SharedBuilds, sleep: Sleep):
        self.ctx = ctx
        self.locks = locks
        self.shared = shared
        self.sleep = sleep  # between an apply's retries

    def steps(self, plan: Plan, result: TargetResult, channel: TargetChannel) -> None:
        tid = plan.target.id
        # Every read-only check of the target in one round trip; once a step has changed something,
        # later checks run on their own again, since their answers may have changed too.
        batch = batched_checks(self.ctx, self.locks, plan, channel)
        would_change: list[str] = []  # --check: the steps so far that would change
        for step in plan.steps:
            if self.ctx.cancel.is_set():
                raise Interrupted()
            pre = batch.get(step.index)
            if step.skipped:
                sr = StepResult(step.name, StepStatus.SKIPPED, detail=step.skipped)
            elif step.unplanned:
                sr = _unplanned(step, result)
            elif self.ctx.mode == "verify":
                sr = self._verify_only(channel, step, pre)
            else:
                sr = self._converge(channel, step, pre, would_change)
                if sr.status == StepStatus.WOULD_CHANGE:
                    would_change.append(step.name)
            sr = self._redacted(channel, sr, expected(step))
            result.steps.append(sr)
            self.ctx.reporter.step_finished(tid, sr)
            if sr.status == StepStatus.FAILED:
                raise StepFailed(sr)
            if sr.status == StepStatus.CHANGED:
                batch = {}

    def _not_satisfied(self, step: PlannedStep, phase: str, res: RunResult, start: float, why: str,
                       would_change: list[str]) -> StepResult:
        """An assertion not met: failed, but under --check after steps that would change it is unknown (its
        answer may be theirs to change). A timeout is no answer: it stays a failure."""
        if self.ctx.mode != "check" or not would_change or stopped(res):
            return failed(step, phase, res, start, why)
        last = would_change[-3:]  # the nearest three: a long recipe's whole list says no more
        names = ", ".join(last[:-1]) + (" and " if len(last) > 1 else "") + last[-1]
        if len(would_change) > len(last):
            names += f" (and {len(would_change) - len(last)} earlier step(s))"
        return StepResult(step.name, StepStatus.UNKNOWN, time.monotonic() - start,
                          f"depends on {names}, which would change", tail(res.output), found=found(res.output, step))

    @staticmethod
    def _redacted(channel: TargetChannel, sr: StepResult, expect: str) -> StepResult:
        """Everything a result carries into reports and history, with the target's secrets masked."""
        r = channel.ctx.redactor(channel.target)
        return replace(sr, detail=r(sr.detail), tail=[r(t) for t in sr.tail], expected=r(expect), found=r(sr.found),
                       would_run=r(sr.would_run) if sr.would_run is not None else None)

    def _converge(self, channel: TargetChannel, step: PlannedStep, pre: RunResult | None,
                  would_change: list[str]) -> StepResult:
        target = channel.target
        # A check answered in the batch took its time there: the step's time includes it.
        start = time.monotonic() - (pre.duration if pre is not None else 0.0)
        if step.check is not None or (pre is not None and step.apply is None):
            res = pre or channel.exec(step.name, "check", step.check, step.timeout)  # type: ignore[arg-type]
            if res.rc == 0:
                return StepResult(step.name, StepStatus.OK, time.monotonic() - start, "already satisfied")
            maybe_unreachable(res, target)
            if step.apply is None:
                return self._not_satisfied(step, "check", res, start, "not satisfied, and the step has nothing to "
                                           "apply", would_change)
        if step.apply is None:
            assert step.verify is not None
            res = channel.exec(step.name, "verify", step.verify, step.timeout)
            maybe_unreachable(res, target)
            if res.rc == 0:
                return StepResult(step.name, StepStatus.OK, time.monotonic() - start, "verified")
            return self._not_satisfied(step, "verify", res, start, "verification failed", would_change)
        if self.ctx.mode == "check":
            return StepResult(step.name, StepStatus.WOULD_CHANGE, time.monotonic() - start,
                              "check not satisfied", tail(res.output), would_run=step.summary or step.apply.display,
                              found=found(res.output, step))
        done = "applied and verified"
        if step.shared is not None:
            res, done = self.shared.apply(channel, step)
        else:
            res = apply_with_retries(channel, step, self.sleep)
        if res.rc != 0:
            maybe_unreachable(res, target)
            result = failed(step, "apply", res, start, f"apply failed ({ending(res, step.timeout)})")
            if "No space left on device" in res.output:
                result.detail += "; " + free_space(channel, res.output)
            elif (net := network_failure(res.output)) is not None:
                # One line that says it, and the distinct lines it rests on (apt repeats them per file).
                result.detail += "; " + net[0]
                result.tail = net[1]
            return result
        after = step.verify or step.check
        assert after is not None
        res = channel.exec(step.name, "verify", after, step.timeout)
        if res.rc != 0:
            maybe_unreachable(res, target)
            return failed(step, "verify", res, start, "apply ran, but the verification failed")
        return StepResult(step.name, StepStatus.CHANGED, time.monotonic() - start, done)

    @staticmethod
    def _verify_only(channel: TargetChannel, step: PlannedStep, pre: RunResult | None) -> StepResult:
        start = time.monotonic()
        cmd = step.verify or step.check
        assert cmd is not None
        res = pre or channel.exec(step.name, "verify", cmd, step.timeout)
        took = res.duration if pre else time.monotonic() - start
        if res.rc == 0:
            return StepResult(step.name, StepStatus.OK, took, "verified", found=found(res.output, step))
        maybe_unreachable(res, channel.target)
        lines = [readable(line, step) for line in tail(res.output)]
        if timed_out(res, step.timeout) or res.rc == 137:  # no answer (out of time, or killed): so not drift
            return StepResult(step.name, StepStatus.FAILED, took, f"verification {ending(res, step.timeout)}",
                              lines, found=found(res.output, step))
        return StepResult(step.name, StepStatus.DRIFT, took, "verification failed", lines,
                          found=found(res.output, step))


def _unplanned(step: PlannedStep, result: TargetResult) -> StepResult:
    """A step that could not be planned with what the target's facts read: its own failure, unless an earlier
    step already reported what is wrong (a preflight's drift in verify mode): then it is not run, and says why."""
    earlier = next((s for s in result.steps if s.status in (StepStatus.DRIFT, StepStatus.FAILED)), None)
    if earlier is not None:
        return StepResult(step.name, StepStatus.SKIPPED, detail=f"not run: {earlier.name} found what to fix first "
                          f"({step.unplanned})")
    return StepResult(step.name, StepStatus.FAILED, detail=f"not planned: {step.unplanned}")


def overall(steps: list[StepResult]) -> TargetStatus:
    """A target's status from its steps': the worst of failed, drift, would-change, changed; else ok."""
    statuses = {s.status for s in steps}
    for status in (StepStatus.FAILED, StepStatus.DRIFT, StepStatus.WOULD_CHANGE, StepStatus.CHANGED):
        if status in statuses:
            return TargetStatus(status.value)
    return TargetStatus.OK
