"""The one path from the engine to a target: every command and every file goes through a TargetChannel, which
logs it to the target's log (a `## <time> <step> <phase>` header, then what was sent and how it ended),
redacts the target's secrets from all it writes, and once the run is cancelled refuses to start a command of
the run or a file copy. A transfer's short helper commands (mktemp, pct push/pull, rm) still run then, so that
what a transfer staged on a host is removed.

A TargetChannel is itself a Transport, so connectors.transfer's SFTP + pct push/pull take this same path.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

from fleetcuda.connectors.base import KEEP_TAIL, LOG_HEAD, OnLine, RunResult, Transport, TransportPool, purpose
from fleetcuda.errors import HostKeyError, UnreachableError
from fleetcuda.plan.command import BuiltCommand
from fleetcuda.plan.inventory import Target
from fleetcuda.plan.planner import Plan
from fleetcuda.plan.recipe import Recipe
from fleetcuda.redact import Redactor, printable
from fleetcuda.remote.framing import Unframed
from fleetcuda.reports.live import Reporter
from fleetcuda.run.logtext import by_reference

# The most characters one command's output may take in its log, once escaped: the streamed head and the tail,
# with room for escapes (see exec).
LOG_BUDGET = 2 * LOG_HEAD + 4 * KEEP_TAIL

# Phases whose commands are read-only: after a dropped connection they are sent once more, on a new one.
SAFE_TO_RETRY = {"check", "verify", "read", "acquire", "fingerprint"}
NO_SECRETS = Redactor()


class Interrupted(Exception):
    pass


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def private_file(path: Path) -> IO[str]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    return os.fdopen(fd, "a", encoding="utf-8", errors="backslashreplace", buffering=1)


def log_name(target: Target) -> str:
    return target.id.replace("/", "_") + ".log"


@dataclass
class RunContext:
    """What every part of one run shares: where it logs, how it is cancelled, each target's plan and secrets."""

    recipe: Recipe
    mode: str
    pool: TransportPool
    reporter: Reporter
    run_dir: Path
    run_id: str
    nonce: str
    home: Callable[[Target], str | None]
    cancel: threading.Event = field(default_factory=threading.Event)
    redactors: dict[str, Redactor] = field(default_factory=dict)
    running: dict[str, str] = field(default_factory=dict)  # target id -> label of the command running there now
    plans: dict[str, Plan] = field(default_factory=dict)
    prepared: dict[str, Plan] = field(default_factory=dict)  # made before the run, for targets with no facts to read

    def redactor(self, target: Target) -> Redactor:
        return self.redactors.get(target.id, NO_SECRETS)

    def redact(self, target: Target, text: str) -> str:
        return printable(self.redactor(target)(text))

    def log_path(self, target: Target) -> Path:
        return self.run_dir / log_name(target)

    def append_log(self, target: Target, line: str) -> None:
        with private_file(self.log_path(target)) as log:
            log.write(line + "\n")

    def channel(self, target: Target, log: IO[str]) -> TargetChannel:
        return TargetChannel(self, target, log)


class TargetChannel(Transport):
    """One target's commands and files, logged, redacted and cancellable (see the module's docstring).

    `step` names what transfers are for in the log's headers; `cancellable=False` is for cleanup that must run
    even after Ctrl-C (it is short and bounded)."""

    def __init__(self, ctx: RunContext, target: Target, log: IO[str], step: str = "transfer",
                 cancellable: bool = True):
        self.ctx = ctx
        self.target = target
        self.log = log
        self.step = step
        self.cancellable = cancellable

    @property
    def transport(self) -> Transport:
        return self.ctx.pool.get(self.target.host)

    @property  # type: ignore[override]
    def local(self) -> bool:  # whether the host is this machine is the connector's to say
        return self.transport.local

    def for_step(self, step: str) -> TargetChannel:
        return TargetChannel(self.ctx, self.target, self.log, step, self.cancellable)

    def uncancellable(self) -> TargetChannel:
        return TargetChannel(self.ctx, self.target, self.log, self.step, cancellable=False)

    def write(self, line: str) -> None:
        """A line of fleetcuda's own in the target's log (a `# ...` note)."""
        self.log.write(line + "\n")

    def redact(self, text: str) -> str:
        return self.ctx.redact(self.target, text)

    def _check_cancel(self) -> None:
        if self.cancellable and self.ctx.cancel.is_set():
            raise Interrupted()

    # -- commands -------------------------------------------------------------------------

    def exec(self, step: str, phase: str, cmd: BuiltCommand, timeout: float | None, *,
             hold_output: bool = False) -> RunResult:
        """A command of the run: reported as it starts, its output logged and reported line by line, redacted.
        `hold_output`: the output may hold secrets known only once it is read (a secret fact): the caller logs it."""
        self._check_cancel()
        redact = self.redact
        tid = self.target.id
        self.ctx.reporter.step_started(tid, step, phase)
        self.log.write(f"\n## {now()} {step} {phase}\n$ {redact(by_reference(cmd.display))}\n")

        shown = Unframed(self.ctx.nonce)  # what the target printed, without fleetcuda's frames
        # The connector bounds what it hands on in characters as they came (connectors.base.LOG_HEAD); escaped for
        # the log (a NUL is `\x00`) they can be four times as long: the log takes at most LOG_BUDGET of them.
        logged = [0, 0]  # characters written, characters not

        def on_line(line: str) -> None:
            if hold_output:
                return
            line = redact(line)
            if logged[0] + len(line) > LOG_BUDGET:
                logged[1] += len(line) + 1
                return
            logged[0] += len(line) + 1
            self.log.write(line + "\n")
            if (text := shown(line)) is not None:
                self.ctx.reporter.output(tid, step, text)

        transport = self.transport
        # A dropped connection is retried (once, on a new connection) only where that is safe: read-only
        # commands. An apply is never re-sent blindly; the next run's check decides.
        attempts = 2 if phase in SAFE_TO_RETRY else 1
        self.ctx.running[tid] = cmd.label
        try:
            for attempt in range(attempts):
                try:
                    with purpose(tid, step, phase):
                        res = transport.run(cmd, timeout=timeout, on_line=on_line)
                    break
                except (UnreachableError, OSError, EOFError) as exc:
                    if self.ctx.cancel.is_set():
                        raise Interrupted() from None
                    if attempt + 1 >= attempts or isinstance(exc, HostKeyError):
                        raise
                    self.log.write(f"# {exc}; the command is read-only, so it is sent once more\n")
                    time.sleep(1)
        finally:
            self.ctx.running.pop(tid, None)
        if logged[1]:
            self.log.write(f"# [... {logged[1]} characters of escaped output not logged: over {LOG_BUDGET} ...]\n")
        # What ends up in results (tails, found) and so in reports and history: redacted too.
        res = RunResult(res.rc, redact(res.output), res.duration, res.timed_out)
        self.log.write(f"## exit {res.rc}{' (timed out)' if res.timed_out else ''} after {res.duration:.2f}s\n")
        if self.ctx.cancel.is_set():
            raise Interrupted()
        return res

    def exec_always(self, step: str, phase: str, cmd: BuiltCommand) -> RunResult:
        """Cleanup that must run even after Ctrl-C (it is short and bounded)."""
        self.log.write(f"\n## {now()} {step} {phase}\n$ {by_reference(cmd.display)}\n")
        with purpose(self.target.id, step, phase):
            res = self.transport.run(cmd, timeout=60, on_line=lambda line: self.log.write(printable(line) + "\n"))
        self.log.write(f"## exit {res.rc} after {res.duration:.2f}s\n")
        return res

    # -- the Transport interface, for connectors.transfer -------------------------------------

    def run(self, cmd: BuiltCommand, *, timeout: float | None, on_line: OnLine) -> RunResult:
        """A transfer's helper command (mktemp, pct push/pull, rm): logged under the step it serves."""
        redact = self.redact
        self.log.write(f"\n## {now()} {self.step} transfer\n$ {redact(by_reference(cmd.display))}\n")

        def logged(line: str) -> None:
            self.log.write(redact(line) + "\n")
            on_line(line)

        try:
            with purpose(self.target.id, self.step, "transfer"):
                res = self.transport.run(cmd, timeout=timeout, on_line=logged)
        except (UnreachableError, OSError, EOFError):
            if self.cancellable and self.ctx.cancel.is_set():  # its channel was closed by Ctrl-C
                raise Interrupted() from None
            raise
        self.log.write(f"## exit {res.rc}{' (timed out)' if res.timed_out else ''} after {res.duration:.2f}s\n")
        return res

    def put(self, local: Path, remote: str) -> None:
        self._copy("put", f"{local} -> {self.target.host}:{remote}", lambda: self.transport.put(local, remote))

    def get(self, remote: str, local: Path) -> None:
        self._copy("get", f"{self.target.host}:{remote} -> {local}", lambda: self.transport.get(remote, local))

    def _copy(self, phase: str, what: str, copy: Callable[[], None]) -> None:
        self._check_cancel()
        self.log.write(f"\n## {now()} {self.step} {phase}\n$ {phase} {self.redact(what)}\n")
        start = time.monotonic()
        try:
            with purpose(self.target.id, self.step, phase):
                copy()
        except BaseException as exc:
            # Ended as a command's "## exit" line: cli's interruption summary takes the other `## ` lines as starts.
            self.log.write(f"## exit 1 after {time.monotonic() - start:.2f}s ({phase} failed: "
                           f"{self.redact(str(exc))})\n")
            if isinstance(exc, Exception):
                self._check_cancel()  # aborted by Ctrl-C: an interruption, not a failed copy
            raise
        self.log.write(f"## exit 0 after {time.monotonic() - start:.2f}s\n")
        # Ctrl-C aborts a transfer as it aborts a command (the connector's abort closes its channel).
        self._check_cancel()

    def abort(self) -> None:
        """Nothing of its own: Ctrl-C aborts the host's connector through the pool, for all its targets."""

    def close(self) -> None:
        """The pool closes the host's connector at the end of the run."""
