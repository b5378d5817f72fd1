"""What a command may read of the world it runs in: streams, environment variables, paths and a clock.

`main()` makes one `Environment.from_process()` per call unless it is given one; a test gives it StringIO
streams, a mapping of variables and a temporary state directory, and runs every command in-process.
Light on purpose: importing it must cost nothing a `--help` would notice.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from rich.console import Console


def _utc_now() -> datetime:
    return datetime.now(UTC)


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if isatty is not None else False
    except (OSError, ValueError):  # a closed or detached stream is no terminal
        return False


def state_dir_of(environ: Mapping[str, str], home: Path) -> Path:
    """fleetcuda.state.state_dir's rule, for this environment's variables and home."""
    from fleetcuda.state import state_dir

    return state_dir(environ, home)


@dataclass(frozen=True)
class Environment:
    """Everything a command reads of its surroundings; frozen, so a command cannot change it for the next."""

    stdout: TextIO
    stderr: TextIO
    stdin: TextIO
    stdout_is_terminal: bool
    stderr_is_terminal: bool
    environ: Mapping[str, str]
    home: Path  # a local target's HOME (containers and SSH hosts get theirs from the planner)
    # Where a scheduled job runs, and what the relative paths its argv names are made absolute against. Files
    # named on the command line are opened by the loaders, from the process's own cwd: for a caller that
    # sets this, the two should agree (from_process: they do).
    cwd: Path
    state_dir: Path  # run directories, the history database and the crontab's lock live here
    clock: Callable[[], datetime] = field(default=_utc_now)  # aware UTC: a run's started/finished times

    @classmethod
    def from_process(cls) -> Environment:
        """This process's streams (as they are now: a caller may have replaced sys.stdout), variables and cwd."""
        home = Path(os.path.expanduser("~"))  # never raises (Path.home() may, without HOME or a passwd entry)
        return cls(stdout=sys.stdout, stderr=sys.stderr, stdin=sys.stdin,
                   stdout_is_terminal=_is_terminal(sys.stdout), stderr_is_terminal=_is_terminal(sys.stderr),
                   environ=os.environ, home=home, cwd=Path.cwd(), state_dir=state_dir_of(os.environ, home))

    @classmethod
    def with_streams(cls, stdout: TextIO, stderr: TextIO, stdin: TextIO, *, environ: Mapping[str, str],
                     home: Path, cwd: Path, state_dir: Path | None = None, stdout_is_terminal: bool = False,
                     stderr_is_terminal: bool = False, clock: Callable[[], datetime] = _utc_now) -> Environment:
        """An environment of given streams and variables (tests, embedding); the state directory follows
        `environ` as in a real process unless named."""
        return cls(stdout=stdout, stderr=stderr, stdin=stdin, stdout_is_terminal=stdout_is_terminal,
                   stderr_is_terminal=stderr_is_terminal, environ=environ, home=home, cwd=cwd,
                   state_dir=state_dir if state_dir is not None else state_dir_of(environ, home), clock=clock)

    def guarded(self) -> Environment:
        """The same environment, its stdout and stderr guarded: a reader that left or a terminal that closed
        stops what is written there, never the command (fleetcuda.reports.streams)."""
        from dataclasses import replace

        from fleetcuda.reports.streams import guarded

        return replace(self, stdout=guarded(self.stdout), stderr=guarded(self.stderr))

    @property
    def state_dir_source(self) -> str:
        """How messages name the state directory: the variable that set it, if one did."""
        return "FLEETCUDA_STATE_DIR" if self.environ.get("FLEETCUDA_STATE_DIR") else "state directory"

    @property
    def history_path(self) -> Path:
        return self.state_dir / "history.sqlite"

    def resolve(self, path: str) -> Path:
        """An absolute path for `path` as this environment's cwd sees it."""
        return (self.cwd / path).resolve()

    def console(self, *, stderr: bool = False, stamped: bool = False) -> Console:
        """A rich console on stdout (or stderr). Rich decides whether it is a terminal as it always does
        (isatty, FORCE_COLOR, TTY_COMPATIBLE), unless this environment calls a stream a terminal that is none
        (a test's StringIO): then it is one. Off a terminal it is `reports.plain`'s: nothing wraps, no line ends
        in spaces, and with `stamped` (a run's progress and summary) each line starts with the date and time."""
        from rich.console import Console  # not at the top: --help and the dry-run never draw

        stream, terminal = (self.stderr, self.stderr_is_terminal) if stderr else (self.stdout, self.stdout_is_terminal)
        force = True if terminal and not _is_terminal(stream) else None
        console = Console(file=stream, force_terminal=force, stderr=stderr, _environ=self.environ)
        if console.is_terminal:
            return console
        from fleetcuda.reports.plain import plain_console

        return plain_console(stream, self.environ, stderr=stderr, clock=self.clock if stamped else None)

    def say(self, text: str) -> None:
        """One line on stderr, 7-bit: whatever bytes a message carries, it cannot garble the terminal."""
        self.stderr.write(text.encode("ascii", "backslashreplace").decode("ascii") + "\n")
