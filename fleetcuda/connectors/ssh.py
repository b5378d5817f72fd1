"""Transports: where a built command is executed. SSH (paramiko) or the local machine.

One SSH connection per host, opened on first use and shared by all its containers and steps;
commands run on channels of that connection, a bounded number at once.

What the SSH transport does is what the dry-run line's OpenSSH options say (command.ssh_argv): host
keys only from the hop's own known_hosts file, no ssh config files, only the given identity (or, with
none, the agent and the default keys), jump hosts each verified against their own known_hosts, and a
keepalive that expects replies (ServerAliveInterval/ServerAliveCountMax).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import paramiko
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential

from fleetcuda.connectors.base import (  # noqa: F401  (re-exported: the SSH connector's module names them too)
    DEADLINE_MARGIN_S,
    LOCAL_PATH,
    LocalTransport,
    NoReplyError,
    OnLine,
    RunResult,
    Transport,
    TransportPool,
    _deadline_s,
    _LineSplitter,
)
from fleetcuda.errors import FleetcudaError, HostKeyError, UnreachableError
from fleetcuda.plan.command import BuiltCommand, SshHop

CHANNELS_PER_HOST = 8  # sshd's MaxSessions defaults to 10
# An SFTP request (open, a block read or written) that gets no answer for this long fails the transfer.
SFTP_TIMEOUT_S = 60.0
# A keepalive every KEEPALIVE_INTERVAL_S that must be answered; this many unanswered ones close the
# connection. The dry-run line says the same (ServerAliveInterval/ServerAliveCountMax in command.ssh_argv).
KEEPALIVE_INTERVAL_S = 10.0
KEEPALIVE_COUNT_MAX = 3
# What OpenSSH tries when no identity is given (besides the agent's keys), in its order.
DEFAULT_IDENTITIES = ("~/.ssh/id_rsa", "~/.ssh/id_ecdsa", "~/.ssh/id_ed25519")



def fingerprint(key: paramiko.PKey) -> str:
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def known_hosts_name(address: str, port: int) -> str:
    return address if port == 22 else f"[{address}]:{port}"


# --- known_hosts, read as OpenSSH reads it -----------------------------------------------------------


@dataclass(frozen=True)
class KnownHostLine:
    lineno: int
    marker: str | None  # None, "@revoked" or "@cert-authority"
    hosts: str  # the pattern list, or one hashed name (|1|salt|hash)
    key: paramiko.PKey


def read_known_hosts(path: str | Path) -> list[KnownHostLine]:
    """Every usable line of a known_hosts file. Comments, blank lines, unknown markers, unknown key types
    and lines that do not decode are skipped, as OpenSSH skips them; nothing here raises on content."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    out = []
    for lineno, raw in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
        fields = raw.split()
        if not fields or fields[0].startswith("#"):
            continue
        marker = None
        if fields[0].startswith("@"):
            marker, fields = fields[0], fields[1:]
            if marker not in ("@revoked", "@cert-authority"):
                continue
        if len(fields) < 3:
            continue
        hosts, keytype, blob = fields[:3]
        try:
            key_bytes = base64.b64decode(blob, validate=True)
            key = paramiko.PKey.from_type_string(keytype, key_bytes)
        except (binascii.Error, ValueError, TypeError, IndexError, paramiko.SSHException, paramiko.UnknownKeyType):
            continue
        except Exception:  # noqa: BLE001 - a malformed key blob can fail deep inside a key class
            continue
        out.append(KnownHostLine(lineno, marker, hosts, key))
    return out


def _pattern_matches(pattern: str, name: str) -> bool:
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern.lower())
    return re.fullmatch(regex, name.lower(), re.DOTALL) is not None


def host_matches(hosts: str, name: str) -> bool:
    """Whether a known_hosts host field (patterns with `*`, `?`, `!`, or a hashed name) covers `name`."""
    if hosts.startswith("|1|"):
        parts = hosts.split("|")
        if len(parts) != 4:
            return False
        try:
            salt, want = base64.b64decode(parts[2], validate=True), base64.b64decode(parts[3], validate=True)
        except (binascii.Error, ValueError):
            return False
        return hmac.compare_digest(hmac.new(salt, name.encode(), hashlib.sha1).digest(), want)
    matched = False
    for pattern in hosts.split(","):
        if pattern.startswith("!"):
            if _pattern_matches(pattern[1:], name):
                return False  # a negated match rules the line out, whatever else matches
        elif _pattern_matches(pattern, name):
            matched = True
    return matched


@dataclass(frozen=True)
class HostKeys:
    """What one known_hosts file says about one host name."""

    path: str
    name: str
    trusted: tuple[paramiko.PKey, ...]
    revoked: tuple[paramiko.PKey, ...]

    def is_revoked(self, key: paramiko.PKey) -> bool:
        return any(k.asbytes() == key.asbytes() for k in self.revoked)

    def is_trusted(self, key: paramiko.PKey) -> bool:
        return not self.is_revoked(key) and any(k.asbytes() == key.asbytes() for k in self.trusted)

    def revoked_error(self, key: paramiko.PKey) -> HostKeyError:
        return HostKeyError(f"host key of {self.name} is REVOKED in {self.path}: {key.get_name()} {fingerprint(key)}; "
                            "it is never accepted. The host must get a new key, trusted with fleetcuda trust")


def host_keys(path: str, name: str) -> HostKeys:
    """Keys for `name`; @revoked keys (for that name, or for `*`) never count as trusted, @cert-authority
    lines (certificates are not supported) are ignored."""
    trusted: list[paramiko.PKey] = []
    revoked: list[paramiko.PKey] = []
    for line in read_known_hosts(path):
        if line.marker == "@cert-authority" or not host_matches(line.hosts, name):
            continue
        (revoked if line.marker == "@revoked" else trusted).append(line.key)
    revoked_blobs = {k.asbytes() for k in revoked}
    return HostKeys(path, name, tuple(k for k in trusted if k.asbytes() not in revoked_blobs), tuple(revoked))


def _preferred_key_types(keys: HostKeys, offered: tuple[str, ...] | list[str]) -> list[str]:
    """Host key algorithms with those of the known keys first, as OpenSSH orders them."""
    first: list[str] = []
    for key in keys.trusted:
        names = ["rsa-sha2-512", "rsa-sha2-256", "ssh-rsa"] if key.get_name() == "ssh-rsa" else [key.get_name()]
        first += [n for n in names if n in offered and n not in first]
    return first + [t for t in offered if t not in first]


def _known_hosts_path(hop: SshHop) -> str:
    return os.path.expanduser(hop.known_hosts or "~/.ssh/known_hosts")


def _where(hop: SshHop) -> str:
    return f"{hop.user}@{known_hosts_name(hop.address, hop.port)}"


class _Verify(paramiko.MissingHostKeyPolicy):
    """Called for a key of a host with no trusted key: refuse it, saying how to trust it (or that it is revoked)."""

    def __init__(self, hop: SshHop, keys: HostKeys):
        self.hop = hop
        self.keys = keys

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        if self.keys.is_revoked(key):
            raise self.keys.revoked_error(key)
        raise HostKeyError(
            f"host key of {self.keys.name} is not in {self.keys.path}: {key.get_name()} {fingerprint(key)}. "
            f"If that fingerprint is the host's (ask its admin, or run `ssh-keygen -lf "
            f"/etc/ssh/ssh_host_{key.get_name().removeprefix('ssh-')}_key.pub` on it), trust it with: "
            f"{self.hop.trust_command or 'fleetcuda trust -i INVENTORY HOST'} --fingerprint {fingerprint(key)}"
        )


def _identity_kwargs(hop: SshHop) -> dict[str, object]:
    """As OpenSSH: with an identity file, that key only (IdentitiesOnly=yes); without, the agent's keys and
    the default key files that exist."""
    if hop.identity_file:
        return {"key_filename": [os.path.expanduser(hop.identity_file)], "allow_agent": False,
                "look_for_keys": False}
    defaults = [p for p in map(os.path.expanduser, DEFAULT_IDENTITIES) if os.access(p, os.R_OK)]
    return {"key_filename": defaults, "allow_agent": True, "look_for_keys": False}


def _client(hop: SshHop, sock: paramiko.Channel | None) -> paramiko.SSHClient:
    """An authenticated connection to one hop (over `sock`, a channel of the previous hop, if given)."""
    path = _known_hosts_path(hop)
    if not Path(path).is_file():
        raise HostKeyError(f"known_hosts file {path} does not exist: host keys are never accepted "
                           f"unseen; record {hop.address}'s key there first: "
                           f"{hop.trust_command or 'fleetcuda trust -i INVENTORY HOST'}")
    keys = host_keys(path, known_hosts_name(hop.address, hop.port))
    candidates = list(keys.trusted)
    for tries_left in range(len(candidates), -1, -1):
        client = paramiko.SSHClient()  # reads no known_hosts file of its own: only what we add
        by_type: dict[str, paramiko.PKey] = {}
        for key in candidates:
            by_type.setdefault(key.get_name(), key)
        for key in by_type.values():
            client.get_host_keys().add(keys.name, key.get_name(), key)
        client.set_missing_host_key_policy(_Verify(hop, keys))
        try:
            client.connect(hop.address, port=hop.port, username=hop.user, sock=sock, timeout=hop.connect_timeout,
                           banner_timeout=hop.connect_timeout, auth_timeout=hop.connect_timeout,
                           **_identity_kwargs(hop))  # type: ignore[arg-type]
            return client
        except paramiko.BadHostKeyException as exc:
            client.close()
            if keys.is_revoked(exc.key):
                raise keys.revoked_error(exc.key) from None
            if keys.is_trusted(exc.key) and sock is None and tries_left:
                # Another line of the file holds this very key (several keys of one type): accept it.
                candidates = [exc.key] + [k for k in candidates if k.asbytes() != exc.key.asbytes()]
                continue
            raise HostKeyError(
                f"HOST KEY CHANGED for {_where(hop)}: expected {fingerprint(exc.expected_key)}, got "
                f"{fingerprint(exc.key)}. This may be an attack; if the host was reinstalled, remove its "
                f"line from {path} and trust the new key.") from None
        except BaseException:
            client.close()
            raise
    raise AssertionError("unreachable")


def _open_chain(hop: SshHop) -> list[paramiko.SSHClient]:
    """Connections to every hop, outermost jump host first, the hop itself last."""
    hops = []
    current: SshHop | None = hop
    while current is not None:
        hops.insert(0, current)
        current = current.jump
    clients: list[paramiko.SSHClient] = []
    try:
        for h in hops:
            try:
                sock = _tunnel(clients[-1], h) if clients else None
                clients.append(_client(h, sock))
            except Exception as exc:
                if h is not hop and not isinstance(exc, FleetcudaError):
                    exc.fleetcuda_hop = h  # type: ignore[attr-defined]  # named by _explain
                raise
        return clients
    except BaseException:
        for c in reversed(clients):
            c.close()
        raise


def _tunnel(via: paramiko.SSHClient, to: SshHop) -> paramiko.Channel:
    transport = via.get_transport()
    assert transport is not None
    return transport.open_channel("direct-tcpip", (to.address, to.port), ("", 0), timeout=to.connect_timeout)


def explain(exc: Exception, hop: SshHop, final: SshHop | None = None) -> Exception:
    """A connection failure as the error the user sees, naming the hop that failed (a jump host's own
    failures name it, and the host it was a jump host for)."""
    if isinstance(exc, FleetcudaError):
        return exc
    final = final or hop
    failed = getattr(exc, "fleetcuda_hop", None) or hop
    where = _where(failed) + ("" if failed is final else f" (jump host for {_where(final)})")
    if isinstance(exc, paramiko.AuthenticationException):
        return UnreachableError(f"{where}: authentication failed ({exc})")
    return UnreachableError(f"{where}: cannot connect: {exc or type(exc).__name__}")


class _Keepalive(threading.Thread):
    """OpenSSH's ServerAliveInterval/ServerAliveCountMax: every `interval` s a keepalive request that
    must be answered; after `count_max` unanswered ones the connection is closed, which ends every
    channel on it. (paramiko's own set_keepalive sends without waiting for a reply.)"""

    def __init__(self, transport: paramiko.Transport, interval: float, count_max: int):
        super().__init__(name="fleetcuda-keepalive", daemon=True)
        self.transport = transport
        self.interval = interval
        self.count_max = count_max
        self.dead = False
        self._halt = threading.Event()

    def run(self) -> None:
        pending: threading.Thread | None = None
        missed = 0
        while not self._halt.wait(self.interval):
            if not self.transport.is_active():
                return
            if pending is not None and pending.is_alive():
                missed += 1  # the previous request is still unanswered
                if missed >= self.count_max:
                    self.dead = True
                    threading.Thread(target=self.transport.close, daemon=True).start()
                    return
                continue
            missed = 0
            pending = threading.Thread(target=self._ping, name="fleetcuda-keepalive-request", daemon=True)
            pending.start()

    def _ping(self) -> None:
        try:  # returns on a reply (success or failure both prove the other side is alive) or when closed
            self.transport.global_request("keepalive@openssh.com", wait=True)
        except Exception:  # noqa: BLE001 - a closed transport; the watchdog notices
            pass

    def stop(self) -> None:
        self._halt.set()


_TRANSIENT = (socket.timeout, ConnectionError, EOFError, paramiko.ssh_exception.NoValidConnectionsError)


class _Connection:
    def __init__(self, clients: list[paramiko.SSHClient], keepalive: _Keepalive):
        self.clients = clients
        self.keepalive = keepalive
        transport = clients[-1].get_transport()
        assert transport is not None
        self.transport = transport

    @property
    def is_connected(self) -> bool:
        return self.transport.is_active()

    def close(self) -> None:
        self.keepalive.stop()
        for c in reversed(self.clients):
            c.close()


class SshTransport(Transport):
    def __init__(self, hop: SshHop, *, attempts: int = 3, keepalive_interval: float = KEEPALIVE_INTERVAL_S,
                 keepalive_count_max: int = KEEPALIVE_COUNT_MAX, sftp_timeout: float = SFTP_TIMEOUT_S):
        self.hop = hop
        self.attempts = attempts
        self.keepalive_interval = keepalive_interval
        self.keepalive_count_max = keepalive_count_max
        self.sftp_timeout = sftp_timeout
        self._conn: _Connection | None = None
        self._error: Exception | None = None
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(CHANNELS_PER_HOST)
        self._channels: set[paramiko.Channel] = set()

    @property
    def _silence_s(self) -> float:
        return self.keepalive_interval * (self.keepalive_count_max + 1)

    def _open(self) -> _Connection:
        with self._lock:
            if self._error is not None:
                raise self._error  # every container of a dead host fails fast with the same error
            if self._conn is None or not self._conn.is_connected:
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
                try:
                    self._conn = self._connect()
                except Exception as exc:
                    self._error = self._explain(exc)
                    raise self._error from None
            return self._conn

    def _connect(self) -> _Connection:
        @retry(retry=retry_if_exception_type(_TRANSIENT), stop=stop_after_attempt(self.attempts),
               wait=wait_exponential(multiplier=0.5, max=4), reraise=True)
        def attempt() -> _Connection:
            clients = _open_chain(self.hop)
            transport = clients[-1].get_transport()
            assert transport is not None
            keepalive = _Keepalive(transport, self.keepalive_interval, self.keepalive_count_max)
            keepalive.start()
            return _Connection(clients, keepalive)

        return attempt()

    def _explain(self, exc: Exception) -> Exception:
        return explain(exc, self.hop)

    def _no_reply(self, conn: _Connection, what: str) -> NoReplyError | None:
        if conn.keepalive.dead:
            return NoReplyError(f"no reply from {_where(self.hop)} within {self._silence_s:g} s "
                                f"({self.keepalive_count_max} keepalives unanswered){what}; connection closed")
        return None

    def run(self, cmd: BuiltCommand, *, timeout: float | None, on_line: OnLine) -> RunResult:
        assert cmd.remote is not None
        conn = self._open()
        start = time.monotonic()
        with self._slots:
            try:
                chan = conn.transport.open_session(timeout=self.hop.connect_timeout)
            except (paramiko.SSHException, EOFError, OSError) as exc:
                raise self._no_reply(conn, "") or \
                    UnreachableError(f"{self.hop.address}: cannot open a channel: {exc}") from None
            self._channels.add(chan)
            try:
                return self._drain(conn, chan, cmd.remote, getattr(cmd, "stdin", ""), start, timeout, on_line,
                                   getattr(cmd, "output_keep", 0))
            finally:
                self._channels.discard(chan)
                chan.close()

    def _drain(self, conn: _Connection, chan: paramiko.Channel, remote: str, stdin: str, start: float,
               timeout: float | None, on_line: OnLine, keep: int = 0) -> RunResult:
        chan.set_combine_stderr(True)
        chan.settimeout(self._silence_s)
        try:
            chan.exec_command(remote)
            if stdin:  # the command's secrets; never on its command line
                chan.sendall(stdin.encode("utf-8", "surrogateescape"))
            chan.shutdown_write()  # stdin at EOF: nothing on the target can wait for input
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise self._no_reply(conn, " starting the command") or \
                UnreachableError(f"{self.hop.address}: connection lost starting the command: {exc}") from None
        splitter = _LineSplitter(on_line, keep)
        limit = _deadline_s(timeout)
        deadline = start + limit if limit else None
        chan.settimeout(1.0)
        while True:
            try:
                data = chan.recv(65536)
            except TimeoutError:
                if chan.closed or not chan.get_transport() or not chan.get_transport().is_active():
                    splitter.finish()
                    raise self._no_reply(conn, " during the command") or \
                        UnreachableError(f"{self.hop.address}: connection lost during the command") from None
                if deadline is not None and time.monotonic() >= deadline:
                    splitter.finish()
                    raise NoReplyError(
                        f"no reply from {_where(self.hop)} within {limit:g} s: the command had not ended "
                        f"{DEADLINE_MARGIN_S} s after its {timeout:g} s timeout (the next run's check tells "
                        "whether it had finished)") from None
                continue
            if not data:
                break
            splitter.feed(data)
        output = splitter.finish()
        if not chan.exit_status_ready() and not chan.status_event.wait(5):
            raise self._no_reply(conn, " before the exit status arrived") or \
                UnreachableError(f"{self.hop.address}: connection lost before the exit status arrived")
        rc = chan.recv_exit_status()
        if rc == -1:
            raise self._no_reply(conn, " during the command") or \
                UnreachableError(f"{self.hop.address}: connection lost: the command ended without an exit status "
                                 "(the next run's check tells whether it had finished)")
        return RunResult(rc, output, time.monotonic() - start)

    @contextmanager
    def _sftp(self, what: str) -> Iterator[paramiko.SFTPClient]:
        """This connection's SFTP subsystem, on one of its channel slots; every request on it must be
        answered within sftp_timeout (a stalled transfer fails, naming the host and the file)."""
        conn = self._open()
        where = _where(self.hop)
        with self._slots:
            sftp = chan = None
            try:
                chan = conn.transport.open_session(timeout=self.hop.connect_timeout)
                chan.settimeout(self.sftp_timeout)
                chan.invoke_subsystem("sftp")
                sftp = paramiko.SFTPClient(chan)
                yield sftp
            except TimeoutError:
                raise self._no_reply(conn, f" during sftp {what}") or NoReplyError(
                    f"no reply from {where} within {self.sftp_timeout:g} s during sftp {what}: "
                    "the transfer stalled") from None
            except (paramiko.SSHException, EOFError, OSError) as exc:
                raise self._no_reply(conn, f" during sftp {what}") or \
                    FleetcudaError(f"{self.hop.address}: sftp {what}: {exc}") from None
            finally:
                if sftp is not None:
                    sftp.close()
                elif chan is not None:
                    chan.close()

    def put(self, local: Path, remote: str) -> None:
        """Copy a file to the host, created 0600."""
        with self._sftp(f"put {local} -> {remote}") as sftp:
            sftp.put(str(local), remote)
            sftp.chmod(remote, 0o600)

    def get(self, remote: str, local: Path) -> None:
        """Copy a file from the host (the local file is created 0600)."""
        with self._sftp(f"get {remote} -> {local}") as sftp:
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


def fetch_host_key(hop: SshHop) -> paramiko.PKey:
    """The key a host presents (no authentication), for `fleetcuda trust` to show before recording it.

    Reached the way the transport reaches it: through its jump hosts, each of them authenticated and
    verified against its own known_hosts (never auto-accepted), then a direct-tcpip channel to the host.
    """
    try:
        gateways = _open_chain(hop.jump) if hop.jump else []
    except Exception as exc:
        assert hop.jump is not None
        raise explain(exc, hop.jump, hop) from None
    transport = None
    try:
        if gateways:
            sock: socket.socket | paramiko.Channel = _tunnel(gateways[-1], hop)
        else:
            sock = socket.create_connection((hop.address, hop.port), timeout=hop.connect_timeout)
        transport = paramiko.Transport(sock)
        opts = transport.get_security_options()
        known = host_keys(_known_hosts_path(hop), known_hosts_name(hop.address, hop.port))
        opts.key_types = _preferred_key_types(known, opts.key_types)
        transport.start_client(timeout=hop.connect_timeout)
        return transport.get_remote_server_key()
    finally:
        if transport is not None:
            transport.close()
        for c in reversed(gateways):
            c.close()


def record_host_key(hop: SshHop, key: paramiko.PKey) -> str:
    """Append the key to the hop's known_hosts (created 0600); returns the file's path."""
    path = Path(_known_hosts_path(hop))
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    line = f"{known_hosts_name(hop.address, hop.port)} {key.get_name()} {key.get_base64()}\n"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a+") as fh:
        fh.seek(0, os.SEEK_END)
        if fh.tell() > 0:
            fh.seek(fh.tell() - 1)
            if fh.read(1) != "\n":
                line = "\n" + line  # never glue the new line onto an unterminated last one
        fh.write(line)
    return str(path)


def hop_host_keys(hop: SshHop) -> HostKeys:
    """What the hop's known_hosts says about it."""
    return host_keys(_known_hosts_path(hop), known_hosts_name(hop.address, hop.port))


def known_key(hop: SshHop) -> paramiko.PKey | None:
    keys = hop_host_keys(hop).trusted
    return keys[0] if keys else None
