"""The streams fleetcuda writes to the user through: writing there never stops a run (issue 22.9b).

A reader that left (`fleetcuda apply | head -3`: EPIPE) or a terminal that closed (EIO) makes the first write
that meets it fail; from then on that stream takes nothing, quietly, and its descriptor points at /dev/null (so
that the interpreter's last flush cannot fail either). Convergence, the exit status, the reports written to files
and the history record go on as if it were read. Light on purpose: the CLI wraps its streams before anything.
"""

from __future__ import annotations

import os
import threading
from typing import TextIO


class GuardedStream:
    """`stream`, except that a write or flush that fails (OSError, or ValueError on a closed file) ends writing to
    it. Everything else (isatty, fileno, encoding...) is the stream's own."""

    def __init__(self, stream: TextIO):
        self._stream = stream
        self._lock = threading.Lock()
        self.broken = False

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self._stream.write(text)
            except (OSError, ValueError):
                self._break()
        return len(text)

    def writelines(self, lines: list[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except (OSError, ValueError):
                self._break()

    def _break(self) -> None:
        with self._lock:
            if self.broken:
                return
            self.broken = True
            try:
                fd = self._stream.fileno()
            except (AttributeError, OSError, ValueError):  # not a file (a test's StringIO): nothing to flush at exit
                return
            try:
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, fd)
                os.close(null)
            except OSError:
                pass

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


def guarded(stream: TextIO) -> TextIO:
    """`stream` wrapped once (a guarded stream is returned as it is)."""
    if isinstance(stream, GuardedStream):
        return stream
    return GuardedStream(stream)  # type: ignore[return-value]
