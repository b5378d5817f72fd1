"""Connectors: where a built command runs, behind one small interface (run, put, get).

`LocalTransport` runs on this machine; `fleetcuda.connectors.ssh.SshTransport` (paramiko, imported only when a
host needs it) on a host over its one SSH connection. The engine and transfers see only `Transport`:
whether a host is this machine is the connector's own `local` attribute, never an isinstance check.
"""

from __future__ import annotations

import codecs
import os
import select
import shutil
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

from fleetcuda.errors import UnreachableError
from fleetcuda.plan.command import KILL_AFTER_S, BuiltCommand

# Beyond a step's own `timeout` (enforced on the target), how long we wait before giving up on it.
DEADLINE_MARGIN_S = KILL_AFTER_S + 30
LOCAL_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

OnLine = Callable[[str], None]


class NoReplyError(UnreachableError):
    """The other side stopped answering: keepalives unanswered, or a command past its deadline."""


@dataclass
class RunResult:
    rc: int
    output: str
    duration: float
    timed_out: bool = False


@dataclass(frozen=True)
class Purpose:
    """What the engine sends a command (or a file) for, as the target's log names it: a step's check, apply,
    verify... all carry the step's one label, so only this tells them apart. Connectors may read it (the fake
    connector's scripted replies match on it); none needs to."""

    target: str
    step: str
    phase: str


_PURPOSE: ContextVar[Purpose | None] = ContextVar("fleetcuda_purpose", default=None)


def current_purpose() -> Purpose | None:
    """The purpose of the command this thread is sending now, if the engine said it."""
    return _PURPOSE.get()


@contextmanager
def purpose(target: str, step: str, phase: str) -> Iterator[None]:
    token = _PURPOSE.set(Purpose(target, step, phase))
    try:
        yield
    finally:
        _PURPOSE.reset(token)


class Transport:
    """A host's connector. `local`: the host is this machine (its files are ours, no staging needed)."""

    local = False

    def run(self, cmd: BuiltCommand, *, timeout: float | None, on_line: OnLine) -> RunResult:
        raise NotImplementedError

    def put(self, local: Path, remote: str) -> None:
        """Copy a file to the host, created 0600."""
        raise NotImplementedError

    def get(self, remote: str, local: Path) -> None:
        """Copy a file from the host; the local file is created 0600."""
        raise NotImplementedError

    def abort(self) -> None:
        """Close whatever is running (Ctrl-C); the target's `timeout` wrapper still bounds it."""

    def close(self) -> None:
        pass


# What is kept of one command's output, whatever the target prints (issue 22.3): in memory (results, frames,
# tails) its first KEEP_HEAD and last KEEP_TAIL characters; in the log, and shown as it comes, its first
# LOG_HEAD, then its last KEEP_TAIL at the end. What is between is counted and said, in its place:
# "[... N bytes dropped ...]". A line longer than MAX_LINE is cut into lines of MAX_LINE. (A command whose
# output is many parts, as a batch of checks each capped on the target, asks for a larger head: output_keep.)
KEEP_HEAD = 64 * 1024
KEEP_TAIL = 64 * 1024
LOG_HEAD = 1024 * 1024
MAX_LINE = 64 * 1024


def dropped_line(count: int) -> str:
    return f"[... {count} bytes dropped ...]"


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


class _LineSplitter:
    """Bytes as they arrive -> whole lines to `on_line`, and the output kept at the end, both bounded (see
    KEEP_HEAD): the first `log_head` characters go to `on_line` line by line as they come, the first `keep_head`
    stay in memory, and the last KEEP_TAIL are kept in a ring (whole lines while they are also streamed, the
    raw text once they are not); at the end `on_line` gets the dropped count and the ring's lines it had not
    had. Linear in the output's size however long its lines; a character split across two reads is decoded
    whole."""

    def __init__(self, on_line: OnLine, keep_head: int | None = None):
        self.on_line = on_line
        self.keep_head = keep_head or KEEP_HEAD
        self.log_head = max(LOG_HEAD, self.keep_head)
        self.pending: list[str] = []
        self.pending_len = 0
        self.head: list[str] = []  # the start of the output, kept in memory
        self.head_len = 0
        self.streamed = 0  # characters given to on_line as they came
        self.ring: deque[tuple[str, bool]] = deque()  # (text, whether on_line had it): the output's last part
        self.ring_len = 0
        self.dropped_mem = 0  # bytes between the head and the ring
        self.dropped_log = 0  # bytes on_line never had
        self.ring_cut = False
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    @property
    def streaming(self) -> bool:
        return self.streamed < self.log_head

    def feed(self, data: bytes) -> None:
        self._text(self.decoder.decode(data))

    def _text(self, text: str) -> None:
        if not text:
            return
        if not self.streaming:  # past what the log gets as it comes: only the ring's last part is kept
            self._keep(text, logged=False)
            return
        *lines, last = text.split("\n")
        offset = 0
        for line in lines:
            offset += len(line) + 1
            if self.pending:
                line = "".join([*self.pending, line])
                self.pending, self.pending_len = [], 0
            self._line(line, "\n")
            if not self.streaming:
                self._keep(text[offset:], logged=False)
                return
        if not last:
            return
        self.pending.append(last)
        self.pending_len += len(last)
        while self.pending_len >= MAX_LINE and self.streaming:  # an endless line: cut into lines of MAX_LINE
            line = "".join(self.pending)
            self.pending, self.pending_len = [line[MAX_LINE:]], len(line) - MAX_LINE
            self._line(line[:MAX_LINE], "\n")
        if not self.streaming and self.pending:
            self._keep("".join(self.pending), logged=False)
            self.pending, self.pending_len = [], 0

    def _line(self, line: str, end: str) -> None:
        self.on_line(line.removesuffix("\r"))
        self.streamed += len(line) + len(end)
        if self.head_len < self.keep_head:
            self.head.append(line + end)
            self.head_len += len(line) + len(end)
        else:
            self._keep(line + end, logged=True)

    def _keep(self, text: str, *, logged: bool) -> None:
        self.ring.append((text, logged))
        self.ring_len += len(text)
        while self.ring_len > KEEP_TAIL:
            first, was_logged = self.ring[0]
            excess = self.ring_len - KEEP_TAIL
            if len(first) <= excess:
                gone = first
                self.ring.popleft()
            else:
                gone = first[:excess]
                self.ring[0] = (first[excess:], was_logged)
            self.ring_cut = not gone.endswith("\n")  # the ring now starts within a line
            self.ring_len -= len(gone)
            size = _nbytes(gone)
            self.dropped_mem += size
            if not was_logged:
                self.dropped_log += size

    def finish(self) -> str:
        self._text(self.decoder.decode(b"", final=True))
        if self.pending:
            line = "".join(self.pending)
            self.pending, self.pending_len = [], 0
            self._line(line, "")
        tail = "".join(t for t, _ in self.ring)
        logged_len = sum(len(t) for t, was_logged in self.ring if was_logged)
        # A ring that starts within a line starts at the next one (what is cut off counts as dropped).
        cut = tail.index("\n") + 1 if self.ring_cut and "\n" in tail else 0
        if cut:
            self.dropped_mem += _nbytes(tail[:cut])
            if cut > logged_len:
                self.dropped_log += _nbytes(tail[logged_len:cut])
        unlogged = tail[max(cut, logged_len):]
        if self.dropped_log:
            self.on_line(dropped_line(self.dropped_log))
        if unlogged:
            for line in unlogged.removesuffix("\n").split("\n"):
                self.on_line(line.removesuffix("\r"))
        tail = tail[cut:]
        head = "".join(self.head)
        if self.dropped_mem:
            head += ("\n" if head and not head.endswith("\n") else "") + dropped_line(self.dropped_mem) + "\n"
        self.head, self.ring, self.ring_len = [], deque(), 0
        return (head + tail).replace("\r\n", "\n")


def _deadline_s(timeout: float | None) -> float | None:
    return timeout + DEADLINE_MARGIN_S if timeout else None


class LocalTransport(Transport):
    """Runs the host-level argv directly (no shell); the environment is a bare PATH.

    As over SSH: a command still running past its control-side deadline (its `timeout` plus
    DEADLINE_MARGIN_S, by when the target's own `timeout` has long ended it) is killed and raises
    NoReplyError; it is never reported as if the step itself had timed out.
    """

    local = True

    def __init__(self) -> None:
        self._procs: set[subprocess.Popen[bytes]] = set()
        self._lock = threading.Lock()

    def run(self, cmd: BuiltCommand, *, timeout: float | None, on_line: OnLine) -> RunResult:
        start = time.monotonic()
        stdin = getattr(cmd, "stdin", "")  # secrets, then EOF: nothing can wait for more input
        proc = subprocess.Popen(list(cmd.argv), stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={"PATH": LOCAL_PATH},
                                start_new_session=True)
        with self._lock:
            self._procs.add(proc)
        if proc.stdin is not None:
            try:
                proc.stdin.write(stdin.encode("utf-8", "surrogateescape"))
                proc.stdin.close()
            except BrokenPipeError:
                pass
        splitter = _LineSplitter(on_line, getattr(cmd, "output_keep", 0))
        limit = _deadline_s(timeout)
        deadline = start + limit if limit else None
        assert proc.stdout is not None
        try:
            while True:
                wait = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
                ready, _, _ = select.select([proc.stdout], [], [], wait)
                if ready:
                    data = os.read(proc.stdout.fileno(), 65536)
                    if not data:
                        break
                    splitter.feed(data)
                elif deadline is not None and time.monotonic() >= deadline:
                    try:
                        os.killpg(proc.pid, 9)
                    except ProcessLookupError:
                        pass
                    proc.wait()
                    splitter.finish()
                    raise NoReplyError(f"no reply from the local machine within {limit:g} s: the command was "
                                       "still running past its deadline and was killed")
            rc = proc.wait()
        finally:
            proc.stdout.close()
            with self._lock:
                self._procs.discard(proc)
        return RunResult(rc, splitter.finish(), time.monotonic() - start)

    def put(self, local: Path, remote: str) -> None:
        _private_copy(local, Path(remote))

    def get(self, remote: str, local: Path) -> None:
        _private_copy(Path(remote), local)

    def abort(self) -> None:
        with self._lock:
            for proc in list(self._procs):
                try:
                    os.killpg(proc.pid, 15)
                except ProcessLookupError:
                    pass


def _private_copy(src: Path, dst: Path) -> None:
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(src, "rb") as fin, os.fdopen(fd, "wb") as fout:
        shutil.copyfileobj(fin, fout)


class TransportPool:
    """One transport per host for the whole run."""

    def __init__(self, factory: Callable[[str], Transport]):
        self._factory = factory
        self._transports: dict[str, Transport] = {}
        self._lock = threading.Lock()

    def get(self, host: str) -> Transport:
        with self._lock:
            if host not in self._transports:
                self._transports[host] = self._factory(host)
            return self._transports[host]

    def abort(self) -> None:
        for t in list(self._transports.values()):
            t.abort()

    def close(self) -> None:
        for t in list(self._transports.values()):
            t.close()
