"""Engine: per target, check -> (satisfied: ok) or apply -> verify -> changed.

A failing step stops that target only. Targets run in parallel up to `forks`; all targets of a
host share its one transport. Every command and its output go to the target's log in the run
directory, which is private (0700, files 0600).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Literal

from tenacity import RetryError, Retrying, stop_after_attempt, wait_exponential

from fleetcuda import __version__
from fleetcuda.connectors import transfer
from fleetcuda.connectors.base import RunResult, TransportPool
from fleetcuda.errors import FleetcudaError, HostKeyError, InputError, UnreachableError
from fleetcuda.plan.command import BuiltCommand, Invocation, build, quote, stop_invocation
from fleetcuda.plan.inventory import Target
from fleetcuda.plan.planner import (
    SYSTEM_PATH,
    Plan,
    PlannedStep,
    Secrets,
    base_values,
    batch_command,
    facts_command,
    lock_command,
    make_plan,
    parse_batch,
    parse_facts,
    pending_facts,
    vmid_of,
)
from fleetcuda.plan.recipe import Recipe
from fleetcuda.plan.templating import TemplateError
from fleetcuda.redact import Redactor, printable
from fleetcuda.remote import framing
from fleetcuda.reports.live import Reporter
from fleetcuda.results import StepResult as StepResult
from fleetcuda.results import StepStatus, TargetStatus
from fleetcuda.results import TargetResult as TargetResult
from fleetcuda.results import exit_code as exit_code
from fleetcuda.run import fingerprint
from fleetcuda.run.locks import LOCK_REFRESH_S, LOCK_STALE_S, TargetLock, lock_state, owner_is_dead
from fleetcuda.run.wheelcache import BuildBroker, CacheEntry, WheelCache
from fleetcuda.run.wheelhouse import sha256

Mode = Literal["apply", "check", "verify"]
TAIL_LINES = 20
# Exit codes of a check that mean "could not look", not "not satisfied": command not found by
# pct/sudo/ssh, or killed.
_UNREACHABLE_RC = {255}


class Interrupted(Exception):
    pass


class TargetLocked(FleetcudaError):
    pass


class StepFailed(Exception):
    def __init__(self, result: StepResult):
        super().__init__(result.detail)
        self.result = result


def state_dir() -> Path:
    if os.environ.get("FLEETCUDA_STATE_DIR"):
        return Path(os.environ["FLEETCUDA_STATE_DIR"])
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "fleetcuda"


def make_run_dir(mode: str, recipe: str, root: Path | None = None) -> Path:
    base = root or state_dir()
    runs = base / "runs"
    try:
        runs.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(runs.parent, 0o700)
        os.chmod(runs, 0o700)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        # mkdtemp: unique even for two runs of one process within a second; created 0700.
        path = Path(tempfile.mkdtemp(prefix=f"{stamp}-{mode}-{recipe}-{os.getpid()}-", dir=runs))
    except OSError as exc:
        where = "FLEETCUDA_STATE_DIR" if os.environ.get("FLEETCUDA_STATE_DIR") else "state directory"
        raise InputError(where, None, str(base), f"cannot make the run directory there: {exc.strerror or exc}; "
                         "set FLEETCUDA_STATE_DIR to a directory of yours") from None
    return path


def _private_file(path: Path) -> IO[str]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    return os.fdopen(fd, "a", encoding="utf-8", errors="backslashreplace", buffering=1)


class Engine:
    def __init__(self, recipe: Recipe, targets: list[Target], overrides: dict[str, str], mode: Mode,
                 pool: TransportPool, reporter: Reporter, run_dir: Path, forks: int = 8,
                 home: Callable[[Target], str | None] = lambda t: None, lock: TargetLock | None = None,
                 cache: WheelCache | None = None):
        self.recipe = recipe
        self.targets = targets
        self.overrides = overrides
        self.mode = mode
        self.pool = pool
        self.reporter = reporter
        self.run_dir = run_dir
        self.forks = max(1, forks)
        self.home = home
        self.cancel = threading.Event()
        # In every label and frame of this run: its commands are told apart from any other run's.
        self.run_id = secrets.token_hex(4)
        self.nonce = framing.new_nonce()
        self._redactors: dict[str, Redactor] = {}
        self.lock = lock if mode == "apply" else None
        self._held: set[str] = set()  # targets whose apply lock this run holds
        self._refresh_stop = threading.Event()
        self.lock_refresh_s = float(os.environ.get("FLEETCUDA_LOCK_REFRESH_S") or LOCK_REFRESH_S)
        self._running: dict[str, str] = {}  # target id -> label of the command running there now
        self._plans: dict[str, Plan] = {}
        self.stopped: dict[str, str] = {}
        self.interrupted = False
        self.cache = cache or WheelCache()
        self.broker = BuildBroker(self.cache)
        # A cached wheel goes to each host once, whatever the number of its containers that install it.
        self._host_copies: dict[tuple[str, str], tuple[Target, str]] = {}
        self._host_copy_locks: dict[tuple[str, str], threading.Lock] = {}
        self._host_copy_guard = threading.Lock()
        self._host_copies_closed = False

    # -- whole run -------------------------------------------------------------------------

    def run(self) -> list[TargetResult]:
        results = {t.id: TargetResult(t.id) for t in self.targets}
        executor = ThreadPoolExecutor(max_workers=self.forks, thread_name_prefix="fleetcuda")
        refresher = threading.Thread(target=self._refresh_locks, name="fleetcuda-lock-refresh", daemon=True)
        if self.lock is not None:
            refresher.start()
        futures: dict[Future[None], Target] = {
            executor.submit(self._run_target, t, results[t.id]): t for t in interleave_hosts(self.targets)}
        try:
            pending = set(futures)
            while pending:
                _, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
        except KeyboardInterrupt:
            # Close the channels, then stop what they had started on each target (closing an SSH
            # channel leaves a non-tty command running), then release the targets' locks. A second
            # Ctrl-C or SIGTERM must not cut that short (it is bounded): from here on they are ignored,
            # until the caller has recorded the run (cli.execute restores them).
            self.interrupted = True
            ignore_stop_signals()
            self.cancel.set()
            running = dict(self._running)  # before the channels close and the workers forget it
            self.pool.abort()
            for fut in futures:
                fut.cancel()
            self.stopped = self._stop_remote(running)
            wait(set(futures), timeout=30)
            for target in self.targets:
                if target.id in self._held:
                    self._release_after_interrupt(target)
            for r in results.values():
                if r.status in (TargetStatus.PENDING, TargetStatus.RUNNING):
                    r.status = TargetStatus.INTERRUPTED
                if r.target in self.stopped:
                    r.status, r.error = TargetStatus.INTERRUPTED, self.stopped[r.target]
        finally:
            self._refresh_stop.set()
            executor.shutdown(wait=False, cancel_futures=True)
            self._remove_host_copies()
            self.pool.close()
        for r in results.values():  # a worker that never got to say how it ended did not succeed
            if r.status in (TargetStatus.PENDING, TargetStatus.RUNNING):
                r.status = TargetStatus.INTERRUPTED if self.interrupted else TargetStatus.FAILED
                r.error = r.error or ("interrupted" if self.interrupted else "ended without a result")
        return [results[t.id] for t in self.targets]

    def _refresh_locks(self) -> None:
        """Touch every lock this run holds, so that a long step never lets another run take it as stale."""
        assert self.lock is not None
        while not self._refresh_stop.wait(self.lock_refresh_s):
            for tid in list(self._held):
                plan = self._plans.get(tid)
                if plan is None:
                    continue
                cmd = lock_command(plan, self.lock.refresh(vmid_of(plan)))
                try:
                    self.pool.get(plan.target.host).run(cmd, timeout=60, on_line=lambda line: None)
                except Exception:  # the next refresh tries again; a lost host fails its own step
                    pass

    def _stop_remote(self, running: dict[str, str]) -> dict[str, str]:
        """Stop, on each target, the step that was running when Ctrl-C or SIGTERM came."""
        stopped: dict[str, str] = {}
        for target in self.targets:
            label = running.get(target.id)
            if not label:
                continue
            try:
                res = self.pool.get(target.host).run(build(target.chain, stop_invocation(label)), timeout=60,
                                                     on_line=lambda line: None)
                what = res.output.strip().splitlines()[-1] if res.output.strip() else f"exit {res.rc}"
            except (FleetcudaError, OSError) as exc:
                what = f"could not stop it: {exc}"
            step = label.removeprefix("fleetcuda:").partition("@")[0]
            stopped[target.id] = f"interrupted during {step}: {what}"
            self._append_log(target, f"# {stopped[target.id]}")
        return stopped

    def _release_after_interrupt(self, target: Target) -> None:
        plan = self._plans.get(target.id)
        if plan is None or self.lock is None:
            return
        try:
            res = self.pool.get(target.host).run(lock_command(plan, self.lock.release(vmid_of(plan))),
                                                 timeout=60, on_line=lambda line: None)
            if self._lock_word(plan, res) == "released":
                self._held.discard(target.id)
                self._append_log(target, "# lock released after the interruption")
        except (FleetcudaError, OSError):
            pass

    def _append_log(self, target: Target, line: str) -> None:
        with _private_file(self.run_dir / (target.id.replace("/", "_") + ".log")) as log:
            log.write(line + "\n")

    # -- one target -------------------------------------------------------------------------

    def _run_target(self, target: Target, result: TargetResult) -> None:
        """Whatever happens inside, the target ends in a final status with its reason: an error we did not
        foresee is a failure with its message, never a target left `running` (nor a run that exits 0)."""
        if self.cancel.is_set():
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
            try:
                self.reporter.target_finished(result)
            except Exception:  # a reporter must never turn a result into a traceback
                pass

    def _run_target_logged(self, target: Target, result: TargetResult, start: float) -> None:
        log_path = self.run_dir / (target.id.replace("/", "_") + ".log")
        result.log = str(log_path)
        result.status = TargetStatus.RUNNING
        self.reporter.target_started(target.id)
        with _private_file(log_path) as log:
            log.write(f"# fleetcuda {self.mode} {self.recipe.path} on {target.id} at {_now()}\n")
            plan = None
            try:
                plan = self._plan(target, log)
                self._steps(plan, result, log)
                result.status = _overall(self.mode, result.steps)
            except TargetLocked as exc:
                result.status, result.error = TargetStatus.LOCKED, str(exc)
            except StepFailed:
                result.status = TargetStatus.FAILED
            except (UnreachableError, HostKeyError) as exc:
                result.status, result.error = TargetStatus.UNREACHABLE, self._redact(target, str(exc))
            except Interrupted:
                result.status, result.error = TargetStatus.INTERRUPTED, "interrupted"
            except (FleetcudaError, TemplateError) as exc:
                result.status, result.error = TargetStatus.FAILED, self._redact(target, str(exc))
            except Exception as exc:
                result.status = TargetStatus.FAILED
                result.error = self._redact(target, f"internal error: {type(exc).__name__}: {exc}")
                log.write("# " + self._redact(target, traceback.format_exc()).replace("\n", "\n# ") + "\n")
            finally:
                if not self.cancel.is_set():  # after Ctrl-C the main thread stops the step first, then releases
                    self._release(target, plan, log)
            result.duration = time.monotonic() - start
            log.write(f"# result: {result.status}{' - ' + result.error if result.error else ''}\n")

    def _redact(self, target: Target, text: str) -> str:
        return printable(self._redactors.get(target.id, _NO_SECRETS)(text))

    def _redacted(self, target: Target, sr: StepResult, expect: str) -> StepResult:
        """Everything a result carries into reports and history, with the target's secrets masked."""
        r = self._redactors.get(target.id, _NO_SECRETS)
        return replace(sr, detail=r(sr.detail), tail=[r(t) for t in sr.tail], expected=r(expect), found=r(sr.found),
                       would_run=r(sr.would_run) if sr.would_run is not None else None)

    def _plan(self, target: Target, log: IO[str]) -> Plan:
        values = base_values(self.recipe, target, self.overrides)
        # Secrets known before facts are read; the plan's own list (facts included) replaces it.
        self._redactors[target.id] = Redactor(Secrets(self.recipe, values).values)
        names = pending_facts(self.recipe, values)
        if names:
            cmd = facts_command(self.recipe, target, values, names, self.home(target), nonce=self.nonce,
                                run_id=self.run_id)
            res = self._exec(target, "facts", "read", cmd, log, timeout=120)
            if res.rc != 0:
                self._maybe_unreachable(res, target)
            values = {**values, **parse_facts(res.output, names, self.nonce)}
        plan = make_plan(self.recipe, target, values, self.home(target), run_id=self.run_id, nonce=self.nonce)
        self._redactors[target.id] = Redactor(plan.secrets)
        if names:
            log.write(self._redact(target, "# facts: " + ", ".join(f"{n}={values[n]}" for n in names)) + "\n")
        self._plans[target.id] = plan
        return plan

    def _steps(self, plan: Plan, result: TargetResult, log: IO[str]) -> None:
        tid = plan.target.id
        # Every read-only check of the target in one round trip; once a step has changed something,
        # later checks run on their own again, since their answers may have changed too.
        batch = self._batch(plan, log)
        for step in plan.steps:
            if self.cancel.is_set():
                raise Interrupted()
            pre = batch.get(step.index)
            if step.skipped:
                sr = StepResult(step.name, StepStatus.SKIPPED, detail=step.skipped)
            elif self.mode == "verify":
                sr = self._verify_only(plan.target, step, log, pre)
            else:
                sr = self._converge(plan.target, step, log, pre)
            sr = self._redacted(plan.target, sr, step.expect)
            result.steps.append(sr)
            self.reporter.step_finished(tid, sr)
            if sr.status == StepStatus.FAILED:
                raise StepFailed(sr)
            if sr.status == StepStatus.CHANGED:
                batch = {}

    def _batch(self, plan: Plan, log: IO[str]) -> dict[int, RunResult]:
        verify = self.mode == "verify"
        lock = self.lock if self.mode == "apply" else None
        probes = [(s.index, p) for s in plan.steps if not s.skipped
                  for p in [s.verify_probe if verify else s.pre_probe] if p is not None]
        if len(probes) < 2:
            if lock is not None:
                cmd = lock_command(plan, lock.acquire(vmid_of(plan)))
                res = self._exec(plan.target, "lock", "acquire", cmd, log, None)
                if self._took_over_dead_lock(plan, res, log):
                    res = self._exec(plan.target, "lock", "acquire", cmd, log, None)
                self._lock_state(plan, res)
            return {}
        cmd = batch_command(plan, probes, lock)
        res = self._exec(plan.target, "all-steps", "verify" if verify else "check", cmd, log, None)
        if lock is not None:
            if self._took_over_dead_lock(plan, res, log):
                res = self._exec(plan.target, "all-steps", "check", cmd, log, None)
            self._lock_state(plan, res)
        parsed = parse_batch(res.output, plan.nonce)
        if not parsed:
            self._maybe_unreachable(res, plan.target)
            return {}
        for i, r in sorted(parsed.items()):  # the log has the framed stream; say each check's answer plainly
            log.write(f"# batched {plan.steps[i].name}: exit {r.rc} after {r.duration_ms} ms\n")
        return {i: RunResult(r.rc, r.output, r.duration_ms / 1000) for i, r in parsed.items()}

    def _lock_word(self, plan: Plan, res: RunResult) -> str | None:
        return lock_state(framing.parse(res.output, plan.nonce))[0]

    def _took_over_dead_lock(self, plan: Plan, res: RunResult, log: IO[str]) -> bool:
        """A lock left by a run of this machine whose process is gone (killed, crashed) is taken over."""
        assert self.lock is not None
        word, fields = lock_state(framing.parse(res.output, plan.nonce))
        if word != "busy" or len(fields) < 2:
            return False
        owner = " ".join(fields[1:])
        if not owner_is_dead(owner):
            return False
        cmd = lock_command(plan, self.lock.take_over(vmid_of(plan), owner))
        done = self._exec(plan.target, "lock", "take-over", cmd, log, None)
        return self._lock_word(plan, done) == "taken-over"

    def _lock_state(self, plan: Plan, res: RunResult) -> None:
        for f in framing.parse(res.output, plan.nonce):
            if f.kind != "lock" or not f.fields:
                continue
            word, fields = f.fields[0], f.fields[1:]
            if word == "busy":
                where, owner = (fields[0] if fields else "?"), " ".join(fields[1:])
                raise TargetLocked(f"another fleetcuda apply holds {where} on {plan.target.id}: {owner or '?'}"
                                   f" (wait with --lock-wait SECONDS; a lock its run has not refreshed for "
                                   f"{LOCK_STALE_S // 60} min is taken over)")
            if word == "held":
                self._held.add(plan.target.id)
            elif word == "released":
                self._held.discard(plan.target.id)
        if plan.target.id not in self._held and res.rc != 0:
            self._maybe_unreachable(res, plan.target)

    def _release(self, target: Target, plan: Plan | None, log: IO[str]) -> None:
        if self.lock is None or plan is None or target.id not in self._held:
            return
        try:
            res = self._exec_always(target, "lock", "release",
                                    lock_command(plan, self.lock.release(vmid_of(plan))), log)
            if self._lock_word(plan, res) == "released":
                self._held.discard(target.id)
        except (FleetcudaError, OSError) as exc:
            log.write(f"# could not release the lock: {exc}\n")

    def _converge(self, target: Target, step: PlannedStep, log: IO[str], pre: RunResult | None) -> StepResult:
        start = time.monotonic()
        if step.check is not None or (pre is not None and step.apply is None):
            res = pre or self._exec(target, step.name, "check", step.check, log, step.timeout)  # type: ignore[arg-type]
            if res.rc == 0:
                return StepResult(step.name, StepStatus.OK, time.monotonic() - start, "already satisfied")
            self._maybe_unreachable(res, target)
            if step.apply is None:
                return self._failed(step, "check", res, start, "not satisfied, and the step has nothing to apply")
        if step.apply is None:
            assert step.verify is not None
            res = self._exec(target, step.name, "verify", step.verify, log, step.timeout)
            self._maybe_unreachable(res, target)
            if res.rc == 0:
                return StepResult(step.name, StepStatus.OK, time.monotonic() - start, "verified")
            return self._failed(step, "verify", res, start, "verification failed")
        if self.mode == "check":
            return StepResult(step.name, StepStatus.WOULD_CHANGE, time.monotonic() - start,
                              "check not satisfied", _tail(res.output),
                              would_run=step.apply.display)
        done = "applied and verified"
        if step.shared is not None:
            res, done = self._apply_shared(target, step, log)
        else:
            res = self._apply(target, step, log)
        if res.rc != 0:
            self._maybe_unreachable(res, target)
            why = f"timed out after {step.timeout}s" if timed_out(res) else f"exit {res.rc}"
            failed = self._failed(step, "apply", res, start, f"apply failed ({why})")
            if "No space left on device" in res.output:
                failed.detail += "; " + self._free_space(target, res.output, log)
            return failed
        after = step.verify or step.check
        assert after is not None
        res = self._exec(target, step.name, "verify", after, log, step.timeout)
        if res.rc != 0:
            self._maybe_unreachable(res, target)
            return self._failed(step, "verify", res, start, "apply ran, but the verification failed")
        return StepResult(step.name, StepStatus.CHANGED, time.monotonic() - start, done)

    def _verify_only(self, target: Target, step: PlannedStep, log: IO[str], pre: RunResult | None) -> StepResult:
        start = time.monotonic()
        cmd = step.verify or step.check
        assert cmd is not None
        res = pre or self._exec(target, step.name, "verify", cmd, log, step.timeout)
        took = res.duration if pre else time.monotonic() - start
        if res.rc == 0:
            return StepResult(step.name, StepStatus.OK, took, "verified", found=_found(res.output))
        self._maybe_unreachable(res, target)
        if timed_out(res):  # it could not answer in time: not an answer, so not drift
            return StepResult(step.name, StepStatus.FAILED, took, f"verification timed out after {step.timeout}s",
                              _tail(res.output), found=_found(res.output))
        return StepResult(step.name, StepStatus.DRIFT, took, "verification failed", _tail(res.output),
                          found=_found(res.output))

    def _apply(self, target: Target, step: PlannedStep, log: IO[str]) -> RunResult:
        assert step.apply is not None
        if step.retries == 0:
            return self._exec(target, step.name, "apply", step.apply, log, step.timeout)

        def attempt() -> RunResult:
            if self.cancel.is_set():
                raise Interrupted()
            res = self._exec(target, step.name, "apply", step.apply, log, step.timeout)  # type: ignore[arg-type]
            if res.rc != 0 and not timed_out(res):  # an apply that ran out of time is never re-sent blindly
                log.write(f"# apply failed (exit {res.rc}); retrying\n")
                raise _Retry(res)
            return res

        try:
            for try_ in Retrying(stop=stop_after_attempt(step.retries + 1), reraise=False,
                                 wait=wait_exponential(multiplier=step.retry_delay, max=step.retry_delay * 8),
                                 retry=lambda rs: isinstance(rs.outcome.exception(), _Retry)):
                with try_:
                    return attempt()
        except RetryError as exc:
            last = exc.last_attempt.exception()
            assert isinstance(last, _Retry)
            return last.result
        raise AssertionError("unreachable")

    # -- build once per ABI fingerprint ---------------------------------------------------------

    def _apply_shared(self, target: Target, step: PlannedStep, log: IO[str]) -> tuple[RunResult, str]:
        """Install the cached wheel for this target's fingerprint; or build it here (one target per fingerprint
        builds, the others wait for it) and bring it back to the cache; or, if that gave no wheel, build here."""
        shared = step.shared
        assert shared is not None
        res = self._exec(target, step.name, "fingerprint", shared.fingerprint, log, 300)
        fp = fingerprint.parse(res.output) if res.rc == 0 else None
        if fp is None:
            self._maybe_unreachable(res, target)
            log.write("# no ABI fingerprint (see above): building here, and not sharing the wheel\n")
            return self._build_alone(target, step, log), "applied and verified (built here; no ABI fingerprint)"
        fkey = fingerprint.key(fp)
        log.write(f"# ABI fingerprint {fkey}: {fingerprint.describe(fp)}\n")

        def waiting(builder: str) -> None:
            log.write(f"# waiting for {builder}, which builds the wheel for fingerprint {fkey}\n")
            self.reporter.step_started(target.id, step.name, f"waiting for the build on {builder}")

        turn = self.broker.turn(fp, target.id, self.cancel.is_set, waiting)
        if turn.role == "build":
            return self._build_and_publish(target, step, fp, turn.note, log)
        if turn.role == "cancelled":
            raise Interrupted()
        if turn.note:
            log.write(f"# {turn.note}\n")
        if turn.role == "build-alone":
            return self._build_alone(target, step, log), f"applied and verified (built here: {turn.note})"
        assert turn.role == "install" and turn.entry is not None
        try:
            res = self._install_cached(target, step, turn.entry, log)
        except (FleetcudaError, OSError) as exc:
            res = RunResult(1, str(exc), 0.0)
            log.write(f"# {exc}\n")
        if res.rc == 0:
            built_on = turn.entry.provenance.get("built_on", "?")
            return res, f"installed the wheel built on {built_on} for fingerprint {fkey}"
        log.write("# the cached wheel did not install (see above): building here instead\n")
        return self._build_alone(target, step, log), "applied and verified (built here: the cached wheel failed)"

    def _build_and_publish(self, target: Target, step: PlannedStep, fp: dict[str, str], note: str,
                           log: IO[str]) -> tuple[RunResult, str]:
        """The build the other targets of this fingerprint wait for: whatever happens, they are told."""
        entry, why = None, ""
        try:
            if note:
                log.write(f"# {note}\n")
            res = self._apply(target, step, log)
            if res.rc != 0:
                why = f"the build failed on {target.id}"
                return res, ""
            try:
                entry = self._publish(target, step, fp, res, log)
            except (FleetcudaError, OSError) as exc:
                why = f"fetching it from {target.id} failed: {exc}"
                log.write(f"# the wheel stays installed here, but is not cached: {why}\n")
                return res, "applied and verified (built here; the wheel could not be cached)"
            return res, f"built here and cached for fingerprint {fingerprint.key(fp)} (sha256 {entry.sha256[:12]})"
        except BaseException as exc:
            why = why or ("interrupted" if isinstance(exc, Interrupted | KeyboardInterrupt)
                          else f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self.broker.finished(fp, entry, target.id, why)

    def _build_alone(self, target: Target, step: PlannedStep, log: IO[str]) -> RunResult:
        res = self._apply(target, step, log)
        wheel = fingerprint.parse_wheel(res.output) if res.rc == 0 else None
        if wheel is not None:  # nobody fetches it: remove what the build left for the control machine
            self._cleanup_wheel(target, wheel[0], log)
        return res

    def _cleanup_wheel(self, target: Target, path: str, log: IO[str]) -> None:
        try:
            transfer.in_target(self.pool.get(target.host), target, f"rm -rf -- {quote(str(Path(path).parent))}",
                               "removing the built wheel's directory", timeout=60)
        except (FleetcudaError, OSError) as exc:
            log.write(f"# could not remove {Path(path).parent}: {exc}\n")

    def _publish(self, target: Target, step: PlannedStep, fp: dict[str, str], res: RunResult,
                 log: IO[str]) -> CacheEntry:
        """Bring the wheel a build left in the target to the cache, checked against the sha256 it printed."""
        wheel = fingerprint.parse_wheel(res.output)
        if wheel is None:
            raise FleetcudaError("the build printed no wheel to fetch")
        path, sha = wheel
        try:
            recorded = fingerprint.parse(res.output)
            if recorded != fp:
                raise FleetcudaError("the target's ABI fingerprint changed during the build")
            scratch = self.cache.incoming()
            try:
                local = scratch / Path(path).name
                start = time.monotonic()
                transfer.fetch(self.pool.get(target.host), target, path, local)
                actual = sha256(local)
                if actual != sha:
                    raise FleetcudaError(f"{local.name} arrived with sha256 {actual}, not the {sha} the target read")
                entry = self.cache.store(local, fp, {
                    "built_on": target.id, "host": target.host,
                    "vmid": target.container.vmid if target.container else None,
                    "built_at": _now(), "build_seconds": round(res.duration, 1), "recipe": self.recipe.path,
                    "step": step.name, "fleetcuda": __version__}, sha=actual)
                log.write(f"# cached {local.name} ({entry.provenance['size']} bytes, sha256 {sha}) in {entry.path}, "
                          f"fetched in {time.monotonic() - start:.1f}s\n")
                return entry
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        finally:
            self._cleanup_wheel(target, path, log)

    def _install_cached(self, target: Target, step: PlannedStep, entry: CacheEntry, log: IO[str]) -> RunResult:
        assert step.shared is not None
        transport = self.pool.get(target.host)
        start = time.monotonic()
        where = transfer.in_target(transport, target, "mktemp -d /tmp/fleetcuda-wheel.XXXXXX", "mktemp", 60)
        ct_dir = where.strip().splitlines()[-1]
        ct_path = f"{ct_dir}/{entry.wheel.name}"
        try:
            if target.container is None:
                transfer.to_host(transport, entry.wheel, ct_path)
            else:
                transfer.into_container(transport, target, self._host_copy(target, entry, log), ct_path, perms="0600")
        except BaseException:
            self._cleanup_wheel(target, ct_path, log)  # the install script, which removes it, will not run
            raise
        log.write(f"# {entry.wheel.name} (sha256 {entry.sha256}, built on {entry.provenance.get('built_on')} at "
                  f"{entry.provenance.get('built_at')}) copied to {ct_path} in {time.monotonic() - start:.1f}s\n")
        provenance = {"source": "control machine cache", "wheel_sha256": entry.sha256, "key": entry.key,
                      "built_on": entry.provenance.get("built_on"), "built_at": entry.provenance.get("built_at")}
        cmd = step.shared.install(ct_path, entry.sha256, json.dumps(entry.fingerprint), json.dumps(provenance))
        res = self._exec(target, step.name, "install", cmd, log, step.timeout)
        if res.rc == 0:
            self.cache.note_install(entry, target.id)
        return res

    def _host_copy(self, target: Target, entry: CacheEntry, log: IO[str]) -> str:
        """The cached wheel on the target's host, uploaded once per host and run (pct reads local files)."""
        transport = self.pool.get(target.host)
        if transport.local:  # pct reads the cache's file where it is
            return str(entry.wheel)
        slot = (target.host, entry.key)
        with self._host_copy_guard:
            lock = self._host_copy_locks.setdefault(slot, threading.Lock())
        with lock:
            with self._host_copy_guard:
                if self._host_copies_closed:
                    raise Interrupted()
                known = self._host_copies.get(slot)
            if known is None:
                staging = transfer.host_staging_dir(transport, target)
                start = time.monotonic()
                try:
                    transfer.to_host(transport, entry.wheel, f"{staging}/{entry.wheel.name}")
                except BaseException:
                    transfer.remove_on_host(transport, target, staging)
                    raise
                log.write(f"# uploaded {entry.wheel.name} to {target.host}:{staging} for this host's containers in "
                          f"{time.monotonic() - start:.1f}s\n")
                # Only a complete upload is remembered (a failed one is tried again by the next container).
                with self._host_copy_guard:
                    self._host_copies[slot] = known = (target, staging)
            return f"{known[1]}/{entry.wheel.name}"

    def _remove_host_copies(self) -> None:
        with self._host_copy_guard:
            self._host_copies_closed = True
            copies = list(self._host_copies.values())
            self._host_copies.clear()
        for target, staging in copies:
            try:
                transfer.remove_on_host(self.pool.get(target.host), target, staging)
            except (FleetcudaError, OSError):
                pass

    def _free_space(self, target: Target, output: str, log: IO[str]) -> str:
        """A full disk, said plainly: which filesystem, how much is free, on which target."""
        paths = {"/tmp"} | {m.rstrip(".,;:") for line in output.splitlines() if "No space left" in line
                            for m in re.findall(r"(/[\w./+@-]+)", line)}
        report = 'NR == 2 { printf "%s on %s: %d MiB free of %d MiB\\n", p, $6, $4 / 1024, $2 / 1024 }'
        script = ("for p in " + " ".join(quote(p) for p in sorted(paths)) + "; do\n"
                  '  while [ ! -e "$p" ]; do p=$(dirname "$p"); done\n'
                  f'  df -Pk "$p" | awk -v p="$p" {quote(report)}\n'
                  "done\n"
                  # Tools often do not say which file they were writing: name every filesystem that is full.
                  f"df -Pk 2>/dev/null | awk {quote(FULL_FILESYSTEMS)}")
        cmd = build(target.chain, Invocation(script, {"PATH": SYSTEM_PATH}, timeout=60, label="fleetcuda:df"))
        try:
            res = self._exec(target, "disk", "free-space", cmd, log, 60)
        except (FleetcudaError, OSError):
            return f"disk full on {target.id}"
        lines = sorted(set(res.output.strip().splitlines()))
        return f"disk full on {target.id}: " + "; ".join(lines)

    def _failed(self, step: PlannedStep, phase: str, res: RunResult, start: float, why: str) -> StepResult:
        return StepResult(step.name, StepStatus.FAILED, time.monotonic() - start, f"{phase}: {why}", _tail(res.output))

    def _maybe_unreachable(self, res: RunResult, target: Target) -> None:
        """pct's own errors (stopped container, unknown vmid, sudo wanting a password) end the target."""
        if target.container is not None and target.spec.sudo and res.output.startswith("sudo: "):
            first = res.output.splitlines()[0]
            raise UnreachableError(f"{target.id}: `sudo -n` refused ({first}); give {target.spec.user} "
                                   f"passwordless sudo for {target.spec.pct} (fleetcuda never sends passwords)")
        if res.rc in _UNREACHABLE_RC:
            tail = [ln for ln in res.output.splitlines() if ln.strip()][-3:]
            raise UnreachableError(f"{target.id}: " + (" / ".join(tail) or f"exit {res.rc}"))

    def _exec_always(self, target: Target, step: str, phase: str, cmd: BuiltCommand, log: IO[str]) -> RunResult:
        """Cleanup that must run even after Ctrl-C (it is short and bounded)."""
        log.write(f"\n## {_now()} {step} {phase}\n$ {cmd.display}\n")
        res = self.pool.get(target.host).run(cmd, timeout=60, on_line=lambda line: log.write(printable(line) + "\n"))
        log.write(f"## exit {res.rc} after {res.duration:.2f}s\n")
        return res

    def _exec(self, target: Target, step: str, phase: str, cmd: BuiltCommand, log: IO[str],
              timeout: float | None) -> RunResult:
        if self.cancel.is_set():
            raise Interrupted()
        redactor = self._redactors.get(target.id, _NO_SECRETS)

        def redact(text: str) -> str:  # what a target said, as it may be shown and stored
            return printable(redactor(text))

        self.reporter.step_started(target.id, step, phase)
        log.write(f"\n## {_now()} {step} {phase}\n$ {redact(cmd.display)}\n")

        def on_line(line: str) -> None:
            line = redact(line)
            log.write(line + "\n")
            self.reporter.output(target.id, step, line)

        transport = self.pool.get(target.host)
        # A dropped connection is retried (once, on a new connection) only where that is safe: read-only
        # commands. An apply is never re-sent blindly; the next run's check decides.
        attempts = 2 if phase in SAFE_TO_RETRY else 1
        self._running[target.id] = cmd.label
        try:
            for attempt in range(attempts):
                try:
                    res = transport.run(cmd, timeout=timeout, on_line=on_line)
                    break
                except (UnreachableError, OSError, EOFError) as exc:
                    if self.cancel.is_set():
                        raise Interrupted() from None
                    if attempt + 1 >= attempts or isinstance(exc, HostKeyError):
                        raise
                    log.write(f"# {exc}; the command is read-only, so it is sent once more\n")
                    time.sleep(1)
        finally:
            self._running.pop(target.id, None)
        # What ends up in results (tails, found) and so in reports and history: redacted too.
        res = RunResult(res.rc, redact(res.output), res.duration, res.timed_out)
        log.write(f"## exit {res.rc}{' (timed out)' if res.timed_out else ''} after {res.duration:.2f}s\n")
        if self.cancel.is_set():
            raise Interrupted()
        return res


_NO_SECRETS = Redactor()


FULL_FILESYSTEMS = ('NR > 1 && $2 > 0 && $5 + 0 >= 98 '
                    '{ printf "%s: %d MiB free of %d MiB\\n", $6, $4 / 1024, $2 / 1024 }')


SAFE_TO_RETRY = {"check", "verify", "read", "acquire", "fingerprint"}


class _Retry(Exception):
    def __init__(self, result: RunResult):
        super().__init__(f"exit {result.rc}")
        self.result = result


def _overall(mode: Mode, steps: list[StepResult]) -> TargetStatus:
    statuses = {s.status for s in steps}
    for status in (StepStatus.FAILED, StepStatus.DRIFT, StepStatus.WOULD_CHANGE, StepStatus.CHANGED):
        if status in statuses:
            return TargetStatus(status.value)
    return TargetStatus.OK


def timed_out(res: RunResult) -> bool:
    """The command ran out of time: the control side gave up, or `timeout` on the target stopped it
    (124 after TERM; 128+9 when it had to KILL)."""
    return res.timed_out or res.rc in (124, 137)


def ignore_stop_signals() -> None:
    """SIGINT and SIGTERM ignored (only the main thread may set handlers; elsewhere there are none to set)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


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


def _found(output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def _tail(output: str) -> list[str]:
    return output.rstrip("\n").splitlines()[-TAIL_LINES:]


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
