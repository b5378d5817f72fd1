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


class _LineSplitter:
    """Bytes as they arrive -> whole lines to `on_line`, and the whole text at the end. Linear in the
    output's size however long its lines (a partial line is kept as pieces, joined once it ends); a
    character split across two reads is decoded whole."""

    def __init__(self, on_line: OnLine):
        self.on_line = on_line
        self.pending: list[str] = []
        self.parts: list[str] = []
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, data: bytes) -> None:
        self._text(self.decoder.decode(data))

    def _text(self, text: str) -> None:
        if not text:
            return
        self.parts.append(text)
        if "\n" not in text:
            self.pending.append(text)
            return
        first, *rest = text.split("\n")
        lines = ["".join([*self.pending, first]), *rest[:-1]]
        self.pending = [rest[-1]] if rest[-1] else []
        for line in lines:
            self.on_line(line.removesuffix("\r"))

    def finish(self) -> str:
        self._text(self.decoder.decode(b"", final=True))
        if self.pending:
            self.on_line("".join(self.pending))
            self.pending = []
        return "".join(self.parts).replace("\r\n", "\n")


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
        splitter = _LineSplitter(on_line)
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
