"""Targets in parallel, up to `forks` (round-robin across hosts), batch after batch (`apply --canary/--serial`,
see rollout.py), and what Ctrl-C or SIGTERM does to a run.

A batch starts once the one before has ended with every target ok or changed; after one that did not, no
other batch starts and their targets end not-run, with the reason. One run throughout: its locks' refresh,
its shared builds (a wheel the canary built is installed by the later batches) and its connections.

The first signal closes the connectors' channels, stops on each target the step that was running there (its
run's STOP command), releases the run's locks and marks what had not ended interrupted; further signals are
ignored until the CLI has recorded the run (cli.execute restores them).
"""

from __future__ import annotations

import signal
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from fleetcuda.errors import FleetcudaError, HostKeyError, UnreachableError
from fleetcuda.plan.command import build, stop_invocation
from fleetcuda.plan.inventory import Target
from fleetcuda.plan.planner import Plan
from fleetcuda.plan.templating import TemplateError
from fleetcuda.results import SUCCESS, TargetResult, TargetStatus
from fleetcuda.run.batching import plan_target
from fleetcuda.run.channel import Interrupted, RunContext, now, private_file
from fleetcuda.run.converge import Converger, StepFailed, overall
from fleetcuda.run.locking import LockKeeper, TargetLocked
from fleetcuda.run.rollout import Batch, batches, stop_reason
from fleetcuda.run.shared import SharedBuilds

# How long, after Ctrl-C, the workers get to notice it and end.
WORKERS_GRACE_S = 30


def ignore_stop_signals() -> None:
    """SIGINT, SIGTERM and SIGHUP ignored (only the main thread may set handlers; elsewhere there are none to set)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)


def interleave_hosts(targets: list[Target]) -> list[Target]:
    """Round-robin across hosts: with --forks below the fleet's size, every host starts working (and
    opens its one connection) at once, instead of host after host."""
    by_host: dict[str, list[Target]] = {}
    for t in targets:
        by_host.setdefault(t.host, []).append(t)
    queues = list(by_host.values())
    out: list[Target] = []
    for i in range(max((len(q) for q in queues), default=0)):
        out += [q[i] for q in queues if i < len(q)]
    return out


class Executor:
    def __init__(self, ctx: RunContext, targets: list[Target], overrides: dict[str, str], forks: int,
                 locks: LockKeeper, shared: SharedBuilds, converger: Converger,
                 rollout: list[Batch[Target]] | None = None):
        self.ctx = ctx
        self.targets = targets
        self.batches = rollout or batches(targets)
        if sorted(t.id for b in self.batches for t in b.targets) != sorted(t.id for t in targets):
            raise ValueError("the rollout's batches must hold each of the run's targets once")
        self.overrides = overrides
        self.forks = max(1, forks)
        self.locks = locks
        self.shared = shared
        self.converger = converger
        self.stopped: dict[str, str] = {}  # target id -> what was stopped there after Ctrl-C
        self.interrupted = False

    def run(self) -> list[TargetResult]:
        results = {t.id: TargetResult(t.id) for t in self.targets}
        executor = ThreadPoolExecutor(max_workers=self.forks, thread_name_prefix="fleetcuda")
        futures: dict[Future[None], Target] = {}
        try:
            # Inside the try: a Ctrl-C that comes while the first targets already run is handled like any other.
            self.locks.start_refreshing()
            for i, batch in enumerate(self.batches):
                if len(self.batches) > 1:  # a KeyboardInterrupt in it is a Ctrl-C between batches
                    _never_raise(self.ctx.reporter.batch_started, batch.name, [t.id for t in batch.targets])
                submitted = {executor.submit(self._run_target, t, results[t.id]): t
                             for t in interleave_hosts(list(batch.targets))}
                futures.update(submitted)
                pending = set(submitted)
                while pending:
                    _, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                failed = [(t.id, str(results[t.id].status)) for t in batch.targets
                          if results[t.id].status not in SUCCESS]
                if failed and i + 1 < len(self.batches):
                    self._not_run(self.batches[i + 1:], results, stop_reason(batch, failed))
                    break
        except KeyboardInterrupt:
            # Close the channels, then stop what they had started on each target (closing an SSH
            # channel leaves a non-tty command running), then release the targets' locks. A second
            # Ctrl-C or SIGTERM must not cut that short (it is bounded): from here on they are ignored,
            # until the caller has recorded the run (cli.execute restores them).
            self.interrupted = True
            ignore_stop_signals()
            self.ctx.cancel.set()
            running = dict(self.ctx.running)  # before the channels close and the workers forget it
            self.ctx.pool.abort()
            for fut in futures:
                fut.cancel()
            self.stopped = self._stop_remote(running)
            wait(set(futures), timeout=WORKERS_GRACE_S)
            for target in self.targets:
                self.locks.release_after_interrupt(target)
            for r in results.values():
                if r.status == TargetStatus.PENDING:  # queued, or in a batch that had not started
                    r.status, r.error = TargetStatus.INTERRUPTED, "not started: interrupted"
                elif r.status == TargetStatus.RUNNING:
                    r.status = TargetStatus.INTERRUPTED
                if r.target in self.stopped:
                    r.status, r.error = TargetStatus.INTERRUPTED, self.stopped[r.target]
        finally:
            self.locks.stop_refreshing()
            executor.shutdown(wait=False, cancel_futures=True)
            self.shared.remove_host_copies()
            self.ctx.pool.close()
        for r in results.values():  # a worker that never got to say how it ended did not succeed
            if r.status in (TargetStatus.PENDING, TargetStatus.RUNNING):
                r.status = TargetStatus.INTERRUPTED if self.interrupted else TargetStatus.FAILED
                r.error = r.error or ("interrupted" if self.interrupted else "ended without a result")
        return [results[t.id] for t in self.targets]

    def _not_run(self, later: list[Batch[Target]], results: dict[str, TargetResult], why: str) -> None:
        """The targets of the batches after a failed one: never started, and said so (summary, reports, history)."""
        for batch in later:
            for t in batch.targets:
                result = results[t.id]
                result.status, result.error = TargetStatus.NOT_RUN, why
                _never_raise(self.ctx.reporter.target_finished, result)

    def _stop_remote(self, running: dict[str, str]) -> dict[str, str]:
        """Stop, on each target, the step that was running when Ctrl-C or SIGTERM came."""
        stopped: dict[str, str] = {}
        for target in self.targets:
            label = running.get(target.id)
            if not label:
                continue
            try:
                res = self.ctx.pool.get(target.host).run(build(target.chain, stop_invocation(label)), timeout=60,
                                                         on_line=lambda line: None)
                what = res.output.strip().splitlines()[-1] if res.output.strip() else f"exit {res.rc}"
            except (FleetcudaError, OSError) as exc:
                what = f"could not stop it: {exc}"
            step = label.removeprefix("fleetcuda:").partition("@")[0]
            stopped[target.id] = f"interrupted during {step}: {what}"
            self.ctx.append_log(target, f"# {stopped[target.id]}")
        return stopped

    # -- one target -------------------------------------------------------------------------

    def _run_target(self, target: Target, result: TargetResult) -> None:
        """Whatever happens inside, the target ends in a final status with its reason: an error we did not
        foresee is a failure with its message, never a target left `running` (nor a run that exits 0)."""
        if self.ctx.cancel.is_set():
            result.status = TargetStatus.INTERRUPTED
            return
        start = time.monotonic()
        try:
            self._run_target_logged(target, result, start)
        except BaseException as exc:
            if result.status in (TargetStatus.PENDING, TargetStatus.RUNNING):
                result.status = TargetStatus.FAILED
                result.error = f"internal error: {type(exc).__name__}: {exc}"
            result.duration = time.monotonic() - start
            if not isinstance(exc, Exception):
                raise
        finally:
            _never_raise(lambda: self.ctx.reporter.target_finished(result))

    def _run_target_logged(self, target: Target, result: TargetResult, start: float) -> None:
        ctx = self.ctx
        log_path = ctx.log_path(target)
        result.log = str(log_path)
        result.status = TargetStatus.RUNNING
        ctx.reporter.target_started(target.id)
        with private_file(log_path) as log:
            log.write(f"# fleetcuda {ctx.mode} {ctx.recipe.path} on {target.id} at {now()}\n")
            channel = ctx.channel(target, log)
            plan: Plan | None = None
            try:
                plan = plan_target(ctx, target, self.overrides, channel)
                self.converger.steps(plan, result, channel)
                result.status = overall(result.steps)
            except TargetLocked as exc:
                result.status, result.error = TargetStatus.LOCKED, str(exc)
            except StepFailed:
                result.status = TargetStatus.FAILED
            except (UnreachableError, HostKeyError) as exc:
                result.status, result.error = TargetStatus.UNREACHABLE, ctx.redact(target, str(exc))
            except Interrupted:
                result.status, result.error = TargetStatus.INTERRUPTED, "interrupted"
            except (FleetcudaError, TemplateError) as exc:
                result.status, result.error = TargetStatus.FAILED, ctx.redact(target, str(exc))
            except Exception as exc:
                result.status = TargetStatus.FAILED
                result.error = ctx.redact(target, f"internal error: {type(exc).__name__}: {exc}")
                log.write("# " + ctx.redact(target, traceback.format_exc()).replace("\n", "\n# ") + "\n")
            finally:
                if not ctx.cancel.is_set():  # after Ctrl-C the main thread stops the step first, then releases
                    self.locks.release(target, plan, channel)
            result.duration = time.monotonic() - start
            log.write(f"# result: {result.status}{' - ' + result.error if result.error else ''}\n")


def _never_raise(call: Callable[..., None], *args: object) -> None:
    try:
        call(*args)
    except Exception:  # a reporter must never turn a result into a traceback
        pass
