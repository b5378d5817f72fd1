"""Typed results: what a run found per step and per target, and the exit status it maps to.

Pure data, no I/O: the engine fills these, reports and history read them (neither imports the engine).
Statuses are `StrEnum`s, so they compare equal to, and serialize as, the plain words reports print.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum


class StepStatus(StrEnum):
    OK = "ok"
    CHANGED = "changed"
    SKIPPED = "skipped"
    WOULD_CHANGE = "would-change"
    # --check: a check that failed while an earlier step would change, whose answer may well be that change's
    # (nvcc not there yet because the step installing it has not run): neither ok nor a failure.
    UNKNOWN = "unknown"
    DRIFT = "drift"
    FAILED = "failed"


class TargetStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    OK = "ok"
    CHANGED = "changed"
    WOULD_CHANGE = "would-change"
    DRIFT = "drift"
    FAILED = "failed"
    UNREACHABLE = "unreachable"
    LOCKED = "locked"
    INTERRUPTED = "interrupted"
    NOT_RUN = "not-run"  # never started: an earlier batch of a --canary/--serial rollout failed (see its error)


class ExitStatus(IntEnum):
    """fleetcuda's exit codes, the one place they are defined."""

    OK = 0
    FAILED = 1  # a target failed, drifted, was locked by another run, or ended in any other non-success state
    INPUT = 2  # bad inventory, recipe, argument or local file
    UNREACHABLE = 3  # a target could not be reached (and none failed)
    WOULD_CHANGE = 4  # `apply --check --detailed-exitcode` only: nothing failed, and some step would change
    INTERNAL = 70  # a bug of fleetcuda's (EX_SOFTWARE): said in one line, the traceback with FLEETCUDA_DEBUG=1
    INTERRUPTED = 130


# What a target may end in and still count as success; anything else (including a status added later,
# or a target left pending or running by an error) is a failure.
SUCCESS = frozenset({TargetStatus.OK, TargetStatus.CHANGED, TargetStatus.WOULD_CHANGE})


@dataclass
class StepResult:
    name: str
    status: StepStatus | str
    duration: float = 0.0
    detail: str = ""
    tail: list[str] = field(default_factory=list)
    would_run: str | None = None
    expected: str = ""  # what the step's check proves when it passes
    found: str = ""  # the last line the check printed: what it saw


# bash names a failing command's script by its $0, which holds the run id (`fleetcuda:<step>@<run id>`,
# `fleetcuda-batch@<run id>`), and a line of the whole command (the batch's): both differ from run to run.
_RUN_LABEL = re.compile(r"(fleetcuda[-:][^\s@:]*)@[0-9a-f]+(?:: (?:eval: )?line \d+)?")


def normalised(found: str) -> str:
    """A check's `found` as history compares it: without run ids and the run's own line numbers, so that the
    same drift read on another night is the same value."""
    return _RUN_LABEL.sub(r"\1", found)


@dataclass
class TargetResult:
    target: str
    status: TargetStatus | str = TargetStatus.PENDING
    steps: list[StepResult] = field(default_factory=list)
    error: str | None = None
    log: str | None = None
    duration: float = 0.0

    @property
    def changed(self) -> int:
        return sum(s.status == StepStatus.CHANGED for s in self.steps)


def exit_code(results: list[TargetResult], *, detailed: bool = False) -> ExitStatus:
    """OK only when every target ended in a success status; INTERRUPTED wins, then UNREACHABLE when that
    is the only kind of failure, else FAILED. `detailed` (`apply --check --detailed-exitcode`): a success in
    which some target would change is WOULD_CHANGE, as `terraform plan -detailed-exitcode` says 2.

    Targets a stopped rollout never started (not-run) are never a success, but they do not hide why it
    stopped: a canary that was unreachable is exit 3 with the rest not-run, as when it was alone."""
    statuses = {str(r.status) for r in results}
    if TargetStatus.INTERRUPTED in statuses:
        return ExitStatus.INTERRUPTED
    bad = statuses - SUCCESS
    if not bad:
        return ExitStatus.WOULD_CHANGE if detailed and TargetStatus.WOULD_CHANGE in statuses else ExitStatus.OK
    if bad - {TargetStatus.NOT_RUN} == {TargetStatus.UNREACHABLE}:
        return ExitStatus.UNREACHABLE
    return ExitStatus.FAILED
