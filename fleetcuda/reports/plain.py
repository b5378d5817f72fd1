"""Output off a terminal (a pipe, a file, cron): nothing wraps, no line ends in spaces, and a run's lines are
stamped with the date and time (ISO 8601, UTC).

`plain_console` is the rich console for such a stream: as wide as what it prints (tables as wide as their
content, text never wrapped), writing through `PlainLines`, which strips each line's trailing spaces and,
for a run's progress, puts `stamp()` before it. Standard library and rich only: the CLI builds it per command.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from rich.console import Console

# Wide enough for any table fleetcuda draws; text is not wrapped at all (soft_wrap).
PLAIN_WIDTH = 100_000


def stamp(now: datetime | None = None) -> str:
    """ISO 8601 in UTC, to the second: 2026-12-02T06:53:38Z."""
    return (now or datetime.now(UTC)).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class PlainLines(io.TextIOBase):
    """A text stream over another that writes whole lines only: without trailing spaces, each stamped when
    `clock` is given. What is left without a newline is written at flush/close (rich ends every print in one)."""

    def __init__(self, stream: TextIO, clock: Callable[[], datetime] | None = None):
        self.stream = stream
        self.clock = clock
        self.pending = ""
        self.lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> int:
        with self.lock:
            self.pending += text
            if "\n" in self.pending:
                *lines, self.pending = self.pending.split("\n")
                self.stream.write("".join(self._line(line) + "\n" for line in lines))
                self.stream.flush()
        return len(text)

    def _line(self, line: str) -> str:
        line = line.rstrip()
        return f"{stamp(self.clock())} {line}" if self.clock is not None and line else line

    def flush(self) -> None:
        with self.lock:
            if self.pending:
                self.stream.write(self._line(self.pending))
                self.pending = ""
            self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()


def plain_console(stream: TextIO, environ: Mapping[str, str], *, stderr: bool = False,
                  clock: Callable[[], datetime] | None = None) -> Console:
    """A rich console for a stream that is no terminal: no colours, no wrapping, no trailing spaces; each line
    stamped when `clock` is given."""
    from rich.console import Console

    return Console(file=PlainLines(stream, clock), width=PLAIN_WIDTH, soft_wrap=True, force_terminal=False,
                   no_color=True, highlight=False, emoji=False, stderr=stderr, _environ=dict(environ))
