"""Transports: where a built command is executed. SSH (Fabric/paramiko) or the local machine.

One SSH connection per host, opened on first use and shared by all its containers and steps;
commands run on channels of that connection, a bounded number at once.
"""

from __future__ import annotations

import base64
import hashlib
import os
import select
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import paramiko
from fabric import Config, Connection
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential

from fleetcuda.command import KILL_AFTER_S, BuiltCommand, SshHop
from fleetcuda.errors import FleetcudaError, HostKeyError, UnreachableError

CHANNELS_PER_HOST = 8  # sshd's MaxSessions defaults to 10
# Beyond a step's own `timeout` (enforced on the target), how long we wait before giving up on it.
DEADLINE_MARGIN_S = KILL_AFTER_S + 30
LOCAL_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

OnLine = Callable[[str], None]


@dataclass
class RunResult:
    rc: int
    output: str
    duration: float
    timed_out: bool = False


class Transport:
    def run(self, cmd: BuiltCommand, *, timeout: float | None, on_line: OnLine) -> RunResult:
        raise NotImplementedError

    def abort(self) -> None:
        """Close whatever is running (Ctrl-C); the target's `timeout` wrapper still bounds it."""

    def close(self) -> None:
        pass


class _LineSplitter:
    def __init__(self, on_line: OnLine):
        self.on_line = on_line
        self.buf = ""
        self.parts: list[str] = []

    def feed(self, data: bytes) -> None:
        text = data.decode("utf-8", "replace")
        self.parts.append(text)
        self.buf += text
        *lines, self.buf = self.buf.replace("\r\n", "\n").split("\n")
        for line in lines:
            self.on_line(line)

    def finish(self) -> str:
        if self.buf:
            self.on_line(self.buf)
        return "".join(self.parts)


class LocalTransport(Transport):
    """Runs the host-level argv directly (no shell); the environment is a bare PATH."""

    def __init__(self) -> None:
        self._procs: set[subprocess.Popen[bytes]] = set()
        self._lock = threading.Lock()

    def run(self, cmd: BuiltCommand, *, timeout: float | None, on_line: OnLine) -> RunResult:
        start = time.monotonic()
        proc = subprocess.Popen(list(cmd.argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env={"PATH": LOCAL_PATH}, start_new_session=True)
        with self._lock:
            self._procs.add(proc)
        splitter = _LineSplitter(on_line)
        deadline = start + timeout + DEADLINE_MARGIN_S if timeout else None
        timed_out = False
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
                    timed_out = True
                    os.killpg(proc.pid, 9)
                    break
            rc = proc.wait()
        finally:
            with self._lock:
                self._procs.discard(proc)
        return RunResult(rc, splitter.finish(), time.monotonic() - start, timed_out)

    def abort(self) -> None:
        with self._lock:
            for proc in list(self._procs):
                try:
                    os.killpg(proc.pid, 15)
                except ProcessLookupError:
                    pass


def fingerprint(key: paramiko.PKey) -> str:
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def known_hosts_name(address: str, port: int) -> str:
    return address if port == 22 else f"[{address}]:{port}"


class _RefuseUnknown(paramiko.MissingHostKeyPolicy):
    """Never accept a key we have not been told to trust; say how to trust it."""

    def __init__(self, hop: SshHop, known_hosts: str):
        self.hop = hop
        self.known_hosts = known_hosts

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        name = known_hosts_name(self.hop.address, self.hop.port)
        raise HostKeyError(
            f"host key of {name} is not in {self.known_hosts}: {key.get_name()} {fingerprint(key)}. "
            f"If that fingerprint is the host's (ask its admin, or run `ssh-keygen -lf "
            f"/etc/ssh/ssh_host_{key.get_name().removeprefix('ssh-')}_key.pub` on it), trust it with: "
            f"fleetcuda trust -i INVENTORY HOST --fingerprint {fingerprint(key)}"
        )


def _known_hosts_path(hop: SshHop) -> str:
    return os.path.expanduser(hop.known_hosts or "~/.ssh/known_hosts")


def _connection(hop: SshHop) -> Connection:
    known_hosts = _known_hosts_path(hop)
    if not Path(known_hosts).is_file():
        raise HostKeyError(f"known_hosts file {known_hosts} does not exist: host keys are never accepted "
                           f"unseen; record {hop.address}'s key there first (fleetcuda trust)")
    identity = os.path.expanduser(hop.identity_file) if hop.identity_file else None
    conn = Connection(
        hop.address, user=hop.user, port=hop.port,
        config=Config(overrides={"load_ssh_configs": False}),
        gateway=_connection(hop.jump) if hop.jump else None,
        connect_timeout=hop.connect_timeout,
        connect_kwargs={
            "key_filename": [identity] if identity else None,
            "look_for_keys": identity is None,
            "allow_agent": identity is None,
            "banner_timeout": hop.connect_timeout,
            "auth_timeout": hop.connect_timeout,
        },
    )
    # Fabric's client auto-adds unknown keys and reads ~/.ssh/known_hosts; ours reads only the
    # inventory's file and refuses anything not in it.
    client = paramiko.SSHClient()
    client.load_host_keys(known_hosts)
    client.set_missing_host_key_policy(_RefuseUnknown(hop, known_hosts))
    conn.client = client
    return conn


_TRANSIENT = (socket.timeout, ConnectionError, EOFError, paramiko.ssh_exception.NoValidConnectionsError)


class SshTransport(Transport):
    def __init__(self, hop: SshHop, *, attempts: int = 3):
        self.hop = hop
        self.attempts = attempts
        self._conn: Connection | None = None
        self._error: Exception | None = None
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(CHANNELS_PER_HOST)
        self._channels: set[paramiko.Channel] = set()

    def _open(self) -> paramiko.Transport:
        with self._lock:
            if self._error is not None:
                raise self._error  # every container of a dead host fails fast with the same error
            if self._conn is None or not self._conn.is_connected:
                try:
                    self._conn = self._connect()
                except Exception as exc:
                    self._error = self._explain(exc)
                    raise self._error from None
            transport = self._conn.transport
            assert transport is not None
            return transport

    def _connect(self) -> Connection:
        @retry(retry=retry_if_exception_type(_TRANSIENT), stop=stop_after_attempt(self.attempts),
               wait=wait_exponential(multiplier=0.5, max=4), reraise=True)
        def attempt() -> Connection:
            conn = _connection(self.hop)
            conn.open()
            assert conn.transport is not None
            conn.transport.set_keepalive(15)
            return conn

        return attempt()

    def _explain(self, exc: Exception) -> Exception:
        where = f"{self.hop.user}@{known_hosts_name(self.hop.address, self.hop.port)}"
        if isinstance(exc, HostKeyError):
            return exc
        if isinstance(exc, paramiko.BadHostKeyException):
            return HostKeyError(
                f"HOST KEY CHANGED for {where}: expected {fingerprint(exc.expected_key)}, got "
                f"{fingerprint(exc.key)}. This may be an attack; if the host was reinstalled, remove its "
                f"line from {_known_hosts_path(self.hop)} and trust the new key.")
        if isinstance(exc, paramiko.AuthenticationException):
            return UnreachableError(f"{where}: authentication failed ({exc})")
        return UnreachableError(f"{where}: cannot connect: {exc or type(exc).__name__}")

    def run(self, cmd: BuiltCommand, *, timeout: float | None, on_line: OnLine) -> RunResult:
        assert cmd.remote is not None
        transport = self._open()
        start = time.monotonic()
        with self._slots:
            try:
                chan = transport.open_session(timeout=self.hop.connect_timeout)
            except (paramiko.SSHException, EOFError, OSError) as exc:
                raise UnreachableError(f"{self.hop.address}: cannot open a channel: {exc}") from None
            self._channels.add(chan)
            try:
                return self._drain(chan, cmd.remote, start, timeout, on_line)
            finally:
                self._channels.discard(chan)
                chan.close()

    def _drain(self, chan: paramiko.Channel, remote: str, start: float, timeout: float | None,
               on_line: OnLine) -> RunResult:
        chan.set_combine_stderr(True)
        chan.exec_command(remote)
        chan.shutdown_write()  # stdin at EOF: nothing on the target can wait for input
        splitter = _LineSplitter(on_line)
        deadline = start + timeout + DEADLINE_MARGIN_S if timeout else None
        chan.settimeout(1.0)
        while True:
            try:
                data = chan.recv(65536)
            except TimeoutError:
                if chan.closed or not chan.get_transport() or not chan.get_transport().is_active():
                    raise UnreachableError(f"{self.hop.address}: connection lost during the command") from None
                if deadline is not None and time.monotonic() >= deadline:
                    return RunResult(124, splitter.finish(), time.monotonic() - start, timed_out=True)
                continue
            if not data:
                break
            splitter.feed(data)
        output = splitter.finish()
        if not chan.exit_status_ready() and not chan.status_event.wait(5):
            raise UnreachableError(f"{self.hop.address}: connection lost before the exit status arrived")
        rc = chan.recv_exit_status()
        if rc == -1:
            raise UnreachableError(f"{self.hop.address}: connection lost: the command ended without an exit status "
                                   "(the next run's check tells whether it had finished)")
        return RunResult(rc, output, time.monotonic() - start)

    @contextmanager
    def _sftp(self) -> Iterator[paramiko.SFTPClient]:
        """This connection's SFTP subsystem, on one of its channel slots."""
        transport = self._open()
        with self._slots:
            sftp = paramiko.SFTPClient.from_transport(transport)
            assert sftp is not None
            try:
                yield sftp
            except (paramiko.SSHException, EOFError, OSError) as exc:
                raise FleetcudaError(f"{self.hop.address}: sftp: {exc}") from None
            finally:
                sftp.close()

    def put(self, local: Path, remote: str) -> None:
        """Copy a file to the host, created 0600."""
        with self._sftp() as sftp:
            sftp.put(str(local), remote)
            sftp.chmod(remote, 0o600)

    def get(self, remote: str, local: Path) -> None:
        """Copy a file from the host (the local file is created 0600)."""
        with self._sftp() as sftp:
            fd = os.open(local, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as fh:
                sftp.getfo(remote, fh)

    def abort(self) -> None:
        for chan in list(self._channels):
            chan.close()

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


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


def fetch_host_key(hop: SshHop) -> paramiko.PKey:
    """The key a host presents (no authentication), for `fleetcuda trust` to show before recording it."""
    sock = socket.create_connection((hop.address, hop.port), timeout=hop.connect_timeout)
    transport = paramiko.Transport(sock)
    try:
        transport.start_client(timeout=hop.connect_timeout)
        return transport.get_remote_server_key()
    finally:
        transport.close()


def record_host_key(hop: SshHop, key: paramiko.PKey) -> str:
    """Append the key to the hop's known_hosts (created 0600); returns the file's path."""
    path = Path(_known_hosts_path(hop))
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    line = f"{known_hosts_name(hop.address, hop.port)} {key.get_name()} {key.get_base64()}\n"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a") as fh:
        fh.write(line)
    return str(path)


def known_key(hop: SshHop) -> paramiko.PKey | None:
    path = _known_hosts_path(hop)
    if not Path(path).is_file():
        return None
    keys = paramiko.HostKeys(path).lookup(known_hosts_name(hop.address, hop.port))
    return next(iter(keys.values()), None) if keys else None
