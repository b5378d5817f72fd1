"""The SSH transport against the loopback OpenSSH server: authentication as OpenSSH does it (agent and
default keys without an identity_file; only the identity_file with one), and control-side deadlines: a
link that goes silent without a reset (the sshd session SIGSTOPped), a command past its deadline, and a
stalled SFTP transfer each end in a clear error within seconds instead of a hang or a fake timeout."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fleetcuda.connectors import base as connector
from fleetcuda.connectors.ssh import LocalTransport, SshTransport
from fleetcuda.errors import FleetcudaError, UnreachableError
from fleetcuda.plan.command import BuiltCommand, SshHop
from tests.lab.sshd import LoopbackSshd


def lab_hop(lab: LoopbackSshd, *, identity: str | None = "lab", port: int | None = None,
            known_hosts: Path | None = None) -> SshHop:
    return SshHop("127.0.0.1", "root", port=port or lab.port,
                  identity_file=str(lab.identity) if identity == "lab" else identity,
                  known_hosts=str(known_hosts or lab.known_hosts), connect_timeout=5)


def remote(text: str) -> BuiltCommand:
    return BuiltCommand(argv=(), remote=text, display="")


def bounded(fn: Callable[[], object], limit: float) -> tuple[object, float]:
    """fn's result (or the exception it raised) and how long it took; fails if it is still running after
    `limit` seconds, instead of hanging the test."""
    box: dict[str, object] = {}

    def call() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["value"] = exc

    start = time.monotonic()
    th = threading.Thread(target=call, daemon=True)
    th.start()
    th.join(limit)
    assert not th.is_alive(), f"still waiting after {limit} s"
    return box["value"], time.monotonic() - start


def sshd_pid(pid: int) -> bool:
    return Path(f"/proc/{pid}/comm").read_text().strip() == "sshd"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HOME and no agent: the default keys are what this test puts there."""
    h = tmp_path / "home"
    (h / ".ssh").mkdir(parents=True, mode=0o700)
    monkeypatch.setenv("HOME", str(h))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    return h


def test_without_identity_file_the_default_key_is_used(sshd_lab: LoopbackSshd, home: Path) -> None:
    shutil.copy(sshd_lab.identity, home / ".ssh" / "id_ed25519")
    (home / ".ssh" / "id_ed25519").chmod(0o600)
    t = SshTransport(lab_hop(sshd_lab, identity=None), attempts=1)
    try:
        res = t.run(remote("echo via-default-key"), timeout=None, on_line=lambda _: None)
        assert (res.rc, res.output.strip()) == (0, "via-default-key")
    finally:
        t.close()


def test_without_identity_file_the_agent_is_used(sshd_lab: LoopbackSshd, home: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    sock = tmp_path / "agent.sock"
    out = subprocess.run(["ssh-agent", "-s", "-a", str(sock)], capture_output=True, text=True, check=True).stdout
    pid = int(re.search(r"SSH_AGENT_PID=(\d+)", out).group(1))  # type: ignore[union-attr]
    try:
        env = {**os.environ, "SSH_AUTH_SOCK": str(sock)}
        subprocess.run(["ssh-add", str(sshd_lab.identity)], env=env, capture_output=True, check=True)
        monkeypatch.setenv("SSH_AUTH_SOCK", str(sock))
        t = SshTransport(lab_hop(sshd_lab, identity=None), attempts=1)
        try:
            assert t.run(remote("echo via-agent"), timeout=None, on_line=lambda _: None).output.strip() == "via-agent"
        finally:
            t.close()
    finally:
        os.kill(pid, signal.SIGTERM)


def test_with_identity_file_only_that_key_is_offered(sshd_lab: LoopbackSshd, home: Path, tmp_path: Path) -> None:
    """Like OpenSSH's IdentitiesOnly=yes: a working default key does not stand in for a wrong identity_file."""
    shutil.copy(sshd_lab.identity, home / ".ssh" / "id_ed25519")
    (home / ".ssh" / "id_ed25519").chmod(0o600)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "unknown")], check=True)
    t = SshTransport(lab_hop(sshd_lab, identity=str(tmp_path / "unknown")), attempts=1)
    try:
        with pytest.raises(UnreachableError, match="authentication failed"):
            t.run(remote("true"), timeout=None, on_line=lambda _: None)
    finally:
        t.close()


def test_a_silent_link_is_noticed_within_seconds(sshd_lab: LoopbackSshd) -> None:
    """The session's sshd process is stopped (no reset, no FIN: the kernel still ACKs): keepalives go
    unanswered and the command ends with 'no reply', not a hang until some deadline."""
    t = SshTransport(lab_hop(sshd_lab), attempts=1, keepalive_interval=1, keepalive_count_max=3)
    stopped: list[int] = []

    def on_line(line: str) -> None:
        if not stopped and line.strip().isdigit():
            pid = int(line)
            assert sshd_pid(pid)  # the login shell's parent: the per-connection sshd process
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)

    try:
        # timeout=None: no step deadline at all; only the keepalive can notice.
        exc, took = bounded(lambda: t.run(remote("echo $PPID; exec sleep 120"), timeout=None, on_line=on_line), 20)
        assert stopped
        assert isinstance(exc, UnreachableError), exc
        assert type(exc).__name__ == "NoReplyError"
        assert f"no reply from root@[127.0.0.1]:{sshd_lab.port} within 4 s" in str(exc)
        assert took < 15
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        t.close()


def test_keepalives_keep_a_quiet_command_alive(sshd_lab: LoopbackSshd) -> None:
    t = SshTransport(lab_hop(sshd_lab), attempts=1, keepalive_interval=0.5, keepalive_count_max=2)
    try:
        res = t.run(remote("sleep 4; echo done"), timeout=None, on_line=lambda _: None)
        assert (res.rc, res.output.strip()) == (0, "done")
    finally:
        t.close()


def test_past_the_deadline_it_is_no_reply_not_a_target_timeout(sshd_lab: LoopbackSshd,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The target's own `timeout` must end a step; if nothing comes back by the control-side deadline
    (here 1 s + a 2 s margin) that is the host not replying, never exit 124 as if the step had timed out."""
    monkeypatch.setattr(connector, "DEADLINE_MARGIN_S", 2)
    t = SshTransport(lab_hop(sshd_lab), attempts=1)
    try:
        exc, took = bounded(lambda: t.run(remote("exec sleep 30"), timeout=1, on_line=lambda _: None), 20)
        assert isinstance(exc, UnreachableError), exc
        assert f"no reply from root@[127.0.0.1]:{sshd_lab.port} within 3 s" in str(exc)
        assert took < 10
    finally:
        t.close()
    local = LocalTransport()
    exc, took = bounded(lambda: local.run(BuiltCommand(argv=("/bin/sleep", "30"), remote=None, display=""),
                                          timeout=1, on_line=lambda _: None), 20)
    assert isinstance(exc, UnreachableError), exc
    assert "no reply from the local machine within 3 s" in str(exc)
    assert took < 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def sftp_sshd(sshd_lab: LoopbackSshd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """A second sshd like the lab's (same keys and users) that also serves SFTP (the lab's has no Subsystem)."""
    d = tmp_path_factory.mktemp("sftp-sshd")
    os.chmod(d, 0o755)
    port = _free_port()
    text = (sshd_lab.workdir / "sshd_config").read_text()
    text = re.sub(r"(?m)^Port \d+$", f"Port {port}", text)
    text = re.sub(r"(?m)^PidFile .*$", f"PidFile {d / 'sshd.pid'}", text)
    (d / "sshd_config").write_text(text + "Subsystem sftp /usr/lib/openssh/sftp-server\n")
    subprocess.run(["/usr/sbin/sshd", "-f", str(d / "sshd_config"), "-E", str(d / "sshd.log")], check=True)
    deadline = time.monotonic() + 10
    while not (d / "sshd.pid").exists() or not (d / "sshd.pid").read_text().strip():
        assert time.monotonic() < deadline, (d / "sshd.log").read_text()
        time.sleep(0.05)
    pid = int((d / "sshd.pid").read_text())
    kind, blob = (sshd_lab.workdir / "ssh_host_ed25519_key.pub").read_text().split()[:2]
    kh = d / "known_hosts"
    kh.write_text(f"[127.0.0.1]:{port} {kind} {blob}\n")
    try:
        yield port, kh
    finally:
        os.kill(pid, signal.SIGTERM)


def _release(fifo: Path, flags: int) -> None:
    """Give the blocked open() on the FIFO its other end, so sftp-server goes on (and sees we left)."""
    try:
        os.close(os.open(fifo, flags | os.O_NONBLOCK))
    except OSError:
        pass


@pytest.mark.parametrize("direction", ["get", "put"])
def test_a_stalled_sftp_transfer_fails_naming_host_and_file(sshd_lab: LoopbackSshd, sftp_sshd: tuple[int, Path],
                                                            tmp_path: Path, direction: str) -> None:
    """sftp-server blocks in open() on a FIFO nobody writes (or reads): the transfer must fail within
    the SFTP deadline, naming host and file, while the connection itself stays healthy."""
    port, kh = sftp_sshd
    fifo = tmp_path / "stalled.fifo"
    os.mkfifo(fifo)
    local = tmp_path / "local"
    local.write_text("payload\n")
    t = SshTransport(lab_hop(sshd_lab, port=port, known_hosts=kh), attempts=1, sftp_timeout=2)
    try:
        t.put(local, str(tmp_path / "ok-copy"))  # SFTP works on this server
        assert (tmp_path / "ok-copy").read_text() == "payload\n"
        if direction == "get":
            exc, took = bounded(lambda: t.get(str(fifo), tmp_path / "fetched"), 30)
        else:
            exc, took = bounded(lambda: t.put(local, str(fifo)), 30)
        assert isinstance(exc, FleetcudaError), exc
        assert "127.0.0.1" in str(exc) and str(fifo) in str(exc), str(exc)
        assert took < 12
        assert t.run(remote("echo still-fine"), timeout=None, on_line=lambda _: None).output.strip() == "still-fine"
    finally:
        _release(fifo, os.O_WRONLY if direction == "get" else os.O_RDONLY)
        t.close()
