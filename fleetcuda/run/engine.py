"""Engine: per target, check -> (satisfied: ok) or apply -> verify -> changed.

A failing step stops that target only. Targets run in parallel up to `forks`; all targets of a
host share its one transport. Every command and its output go to the target's log in the run
directory, which is private (0700, files 0600).

This is the facade the CLI and the tests drive; the work is done by fleetcuda.run's parts, each with one job:
executor (threads, interrupts), converge (a target's steps), retry (an apply's retries), locking (the apply
lock), batching (facts and batched checks), shared (builds shared per ABI fingerprint), diagnosis (why a step
failed), channel (the one logged, redacted, cancellable path to a target, commands and files alike).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from fleetcuda.connectors.base import TransportPool
from fleetcuda.plan.inventory import Target
from fleetcuda.plan.planner import RunPlan
from fleetcuda.plan.recipe import Recipe
from fleetcuda.remote import framing
from fleetcuda.reports.live import Reporter
from fleetcuda.results import StepResult as StepResult
from fleetcuda.results import TargetResult as TargetResult
from fleetcuda.results import exit_code as exit_code
from fleetcuda.run.channel import Interrupted as Interrupted
from fleetcuda.run.channel import RunContext
from fleetcuda.run.converge import Converger
from fleetcuda.run.converge import StepFailed as StepFailed
from fleetcuda.run.diagnosis import timed_out as timed_out
from fleetcuda.run.executor import Executor
from fleetcuda.run.executor import ignore_stop_signals as ignore_stop_signals
from fleetcuda.run.executor import interleave_hosts as interleave_hosts
from fleetcuda.run.locking import LockKeeper
from fleetcuda.run.locking import TargetLocked as TargetLocked
from fleetcuda.run.locks import LOCK_REFRESH_S, TargetLock
from fleetcuda.run.retry import Sleep
from fleetcuda.run.rollout import Batch
from fleetcuda.run.shared import SharedBuilds
from fleetcuda.run.wheelcache import WheelCache
from fleetcuda.state import make_run_dir as make_run_dir
from fleetcuda.state import state_dir as state_dir

Mode = Literal["apply", "check", "verify"]


class Engine:
    """`planned`: the run's plans, made by the caller (else each target is planned when it starts);
    `lock_refresh_s`: how often held locks are refreshed (default FLEETCUDA_LOCK_REFRESH_S, else
    LOCK_REFRESH_S); `sleep`: what waits between an apply's retries (time.sleep; tests pass one that records);
    `rollout`: the batches of `apply --canary/--serial` (rollout.batches; default: every target in one)."""

    def __init__(self, recipe: Recipe, targets: list[Target], overrides: dict[str, str], mode: Mode,
                 pool: TransportPool, reporter: Reporter, run_dir: Path, forks: int = 8,
                 home: Callable[[Target], str | None] = lambda t: None, lock: TargetLock | None = None,
                 cache: WheelCache | None = None, *, lock_refresh_s: float | None = None,
                 sleep: Sleep = time.sleep, planned: RunPlan | None = None,
                 rollout: list[Batch[Target]] | None = None):
        self.recipe = recipe
        self.targets = targets
        self.mode = mode
        self.run_dir = run_dir
        # In every label and frame of this run: its commands are told apart from any other run's. `planned`: the
        # plans the CLI made before the run (with this run's id and nonce), run as they are.
        self.ctx = RunContext(recipe, mode, pool, reporter, run_dir,
                              run_id=planned.run_id if planned else secrets.token_hex(4),
                              nonce=planned.nonce if planned else framing.new_nonce(), home=home,
                              prepared=dict(planned.plans) if planned else {})
        if lock_refresh_s is None:
            lock_refresh_s = float(os.environ.get("FLEETCUDA_LOCK_REFRESH_S") or LOCK_REFRESH_S)
        if lock is not None and not lock.run_id:  # the lock stands for this run's labelled processes (lock.sh)
            lock = dataclasses.replace(lock, run_id=self.ctx.run_id)
        self.locks = LockKeeper(self.ctx, lock if mode == "apply" else None, lock_refresh_s)
        self.cache = cache or WheelCache()
        self.shared = SharedBuilds(self.ctx, self.cache, sleep)
        self.converger = Converger(self.ctx, self.locks, self.shared, sleep)
        self.executor = Executor(self.ctx, targets, overrides, forks, self.locks, self.shared, self.converger,
                                 rollout)

    def run(self) -> list[TargetResult]:
        return self.executor.run()

    @property
    def run_id(self) -> str:
        return self.ctx.run_id

    @property
    def lock_refresh_s(self) -> float:
        return self.locks.refresh_s

    @lock_refresh_s.setter
    def lock_refresh_s(self, seconds: float) -> None:  # read by the refresh thread at each wait
        self.locks.refresh_s = seconds

    @property
    def cancel(self) -> threading.Event:
        return self.ctx.cancel

    @property
    def interrupted(self) -> bool:
        """Whether Ctrl-C or SIGTERM stopped the run (stop signals stay ignored until the CLI restores them)."""
        return self.executor.interrupted

    @property
    def stopped(self) -> dict[str, str]:
        """Target id -> what was stopped there after the interruption."""
        return self.executor.stopped
