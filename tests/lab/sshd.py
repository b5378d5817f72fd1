"""A throwaway OpenSSH server on 127.0.0.1 with a Proxmox ``pct`` stand-in.

``start_loopback_sshd`` needs root: it creates local users, a sudoers drop-in
and starts ``/usr/sbin/sshd`` with its own config.  Every step is idempotent,
so it can run several times in one machine session.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = Path("/usr/sbin/sshd")
SUDOERS_DROPIN = Path("/etc/sudoers.d/fleetcuda-test")
STANDIN_SOURCE = Path(__file__).with_name("pct_standin.py")

# login shell name -> (user, shell path); root keeps its own account.
TEST_USERS = {
    "zsh": ("fcz", "/usr/bin/zsh"),
    "dash": ("fcd", "/usr/bin/dash"),
    "sh": ("fcs", "/bin/sh"),
    "sudo_password": ("fcp", "/bin/bash"),
}
NOPASSWD_USERS = ("fcz", "fcd", "fcs")


class LabError(RuntimeError):
    """The loopback lab could not be set up."""


@dataclass
class LoopbackSshd:
    address: str
    port: int
    known_hosts: Path
    identity: Path
    pct_path: Path
    state_dir: Path
    users: dict[str, str]
    workdir: Path
    log: Path
    pid: int

    def ssh_argv(self, user: str, *, known_hosts: Path | None = None) -> list[str]:
        """``ssh`` argv (without the remote command) that trusts only our host key."""
        return [
            "ssh", "-F", "/dev/null",
            "-o", "BatchMode=yes",
            "-o", "StrictHostKeyChecking=yes",
            "-o", f"UserKnownHostsFile={known_hosts or self.known_hosts}",
            "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", "IdentitiesOnly=yes",
            "-o", "ConnectTimeout=5",
            "-i", str(self.identity),
            "-p", str(self.port),
            f"{user}@{self.address}",
        ]

    def add_container(self, vmid: int, running: bool = True, name: str | None = None) -> None:
        lines = [f"status: {'running' if running else 'stopped'}"]
        if name is not None:
            lines.append(f"name: {name}")
        (self.state_dir / f"{vmid}.conf").write_text("\n".join(lines) + "\n")

    def calls(self) -> list[dict]:
        text = (self.state_dir / "calls.jsonl").read_text(encoding="utf-8")
        return [json.loads(line) for line in text.splitlines() if line]

    def clear_calls(self) -> None:
        (self.state_dir / "calls.jsonl").write_text("")

    def stop(self) -> None:
        # SIGTERM to the listener only; live sessions are separate processes
        # that end when their clients disconnect.
        _kill_listener(self.pid, self.workdir / "sshd_config")


def _kill_listener(pid: int, config: Path) -> None:
    """SIGTERM ``pid`` if it still is the sshd started with ``config``; wait for its exit.

    Waiting matters: on exit sshd unlinks its pidfile, which may by then be a new lab's.
    """
    proc = Path(f"/proc/{pid}")
    try:
        # pids get reused; sshd rewrites its title but keeps "-f CONFIG" in it.
        if str(config).encode() not in (proc / "cmdline").read_bytes():
            return
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        # Not our child, so it may linger as a zombie until init reaps it.
        while (proc / "stat").read_text().split(") ")[-1][0] != "Z":
            if time.monotonic() > deadline:
                raise LabError(f"sshd {pid} ignored SIGTERM")
            time.sleep(0.02)
    except (FileNotFoundError, ProcessLookupError):
        pass


def _run(*argv: str | Path, input: str | None = None) -> str:
    proc = subprocess.run(
        [str(a) for a in argv], input=input, capture_output=True, text=True, timeout=60
    )
    if proc.returncode != 0:
        raise LabError(f"{' '.join(map(str, argv))} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def _keygen(path: Path, comment: str) -> None:
    if not path.exists():
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", path)
    path.chmod(0o600)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def make_traversable(path: Path) -> None:
    """Add o+rx to ``path`` and to every ancestor lacking o+x (pytest tmp dirs are 0700).

    Only adds bits, so /tmp's sticky 1777 and the like stay as they are.
    """
    for directory in [path, *path.parents]:
        mode = directory.stat().st_mode
        if not mode & 0o001:
            directory.chmod((mode & 0o7777) | 0o055)


def _check_traversable(path: Path) -> None:
    # Non-root logins (and sudo) must reach pct_path; fail early with the culprit.
    for directory in [path, *path.parents]:
        if not directory.stat().st_mode & 0o001:
            raise LabError(f"{directory} is not world-executable; see make_traversable()")


def _ensure_user(name: str, shell: str) -> None:
    try:
        pwd.getpwnam(name)
    except KeyError:
        _run("useradd", "--system", "--create-home", "--shell", shell, name)
    # '*' instead of useradd's '!': with UsePAM no, sshd refuses '!'-locked accounts
    # even for public-key logins, while '*' only means "no password".
    _run("usermod", "--shell", shell, "--password", "*", name)


def _install_sudoers(pct_path: Path) -> None:
    nopasswd = ",".join(NOPASSWD_USERS)
    body = (
        "# fleetcuda test lab (tests/lab/sshd.py)\n"
        f"{nopasswd} ALL=(root) NOPASSWD: {pct_path}\n"
        # fcp may use sudo, but only with a password: `sudo -n` must fail.
        "fcp ALL=(root) ALL\n"
    )
    candidate = SUDOERS_DROPIN.with_name("fleetcuda-test.new")  # the '.' makes sudo ignore it
    candidate.write_text(body)
    candidate.chmod(0o440)
    _run("visudo", "-cf", candidate)
    candidate.replace(SUDOERS_DROPIN)


def _install_pct(workdir: Path) -> tuple[Path, Path]:
    state_dir = workdir / "pct-state"
    bin_dir = workdir / "bin"
    for directory in (state_dir, bin_dir):
        directory.mkdir(mode=0o755, exist_ok=True)
        os.chown(directory, 0, 0)
        directory.chmod(0o755)
    calls = state_dir / "calls.jsonl"
    calls.touch()
    # World-writable so a pct call made without sudo is recorded too (uid != 0).
    calls.chmod(0o666)
    source = STANDIN_SOURCE.read_text(encoding="utf-8")
    source = source.replace('STATE_DIR = "__STATE_DIR__"', f"STATE_DIR = {str(state_dir)!r}", 1)
    pct_path = bin_dir / "pct"
    pct_path.write_text("#!/usr/bin/python3\n" + source, encoding="utf-8")
    os.chown(pct_path, 0, 0)
    pct_path.chmod(0o755)
    return pct_path, state_dir


def _write_sshd_config(workdir: Path, port: int, host_key: Path, users: list[str]) -> Path:
    config = workdir / "sshd_config"
    lines = [
        "ListenAddress 127.0.0.1",
        f"Port {port}",
        f"HostKey {host_key}",
        f"PidFile {workdir / 'sshd.pid'}",
        f"AuthorizedKeysFile {workdir / 'authorized_keys'}/%u",
        # StrictModes walks every parent of the key file and rejects /tmp (1777).
        "StrictModes no",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "PermitRootLogin prohibit-password",
        "UsePAM no",
        f"AllowUsers {' '.join(users)}",
        "MaxSessions 32",
        "MaxStartups 64:64:64",
        "PrintMotd no",
        "LogLevel VERBOSE",
    ]
    # OpenSSH >= 9.8 throttles sources with failed logins, which tests cause on
    # purpose; older sshd rejects the unknown keyword, so retry without it.
    for extra in (["PerSourcePenalties no"], []):
        config.write_text("\n".join([*lines, *extra]) + "\n")
        complaint = _sshd_test(config)
        if not complaint:
            return config
    raise LabError(f"sshd -t rejected {config}: {complaint}")


def _sshd_test(config: Path) -> str:
    """Return sshd's complaint about ``config``, or "" if it is valid."""
    proc = subprocess.run([str(SSHD), "-t", "-f", str(config)], capture_output=True, text=True)
    return proc.stderr.strip() if proc.returncode else ""


def _wait_for_sshd(port: int, pid_file: Path, log: Path, log_offset: int) -> int | None:
    """Return the listener's pid once it serves ``port``; None if the port was taken.

    sshd daemonizes before binding, so its exit status says nothing about the bind;
    the pidfile is written only after the listen sockets are up.
    """
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if pid_file.exists() and pid_file.read_text().strip():
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                return int(pid_file.read_text())
        with log.open("rb") as handle:
            handle.seek(log_offset)
            if b"Cannot bind any address" in handle.read():
                return None
        time.sleep(0.05)
    raise LabError(f"sshd did not come up on 127.0.0.1:{port} within 10 s; see {log}")


def _launch_sshd(workdir: Path, host_key: Path, users: list[str], log: Path) -> tuple[int, int]:
    """Start a daemonized sshd on a free port; return (port, listener pid)."""
    # Privilege separation directory; normally created by systemd's RuntimeDirectory.
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    pid_file = workdir / "sshd.pid"
    if pid_file.exists():  # stop a lab left running in this workdir: its pidfile goes now
        old_pid = pid_file.read_text().strip()
        if old_pid.isdigit():
            _kill_listener(int(old_pid), workdir / "sshd_config")
        pid_file.unlink(missing_ok=True)
    log.touch()
    for _attempt in range(3):  # the free port can be taken before sshd binds it
        port = _free_port()
        config = _write_sshd_config(workdir, port, host_key, users)
        log_offset = log.stat().st_size
        _run(SSHD, "-f", config, "-E", log)
        pid = _wait_for_sshd(port, pid_file, log, log_offset)
        if pid is not None:
            return port, pid
    raise LabError(f"sshd could not bind a free port; see {log}")


def start_loopback_sshd(workdir: Path) -> LoopbackSshd:
    """Start sshd on a free loopback port, with test users and a pct stand-in."""
    if os.geteuid() != 0:
        raise LabError("start_loopback_sshd needs root")
    missing = [tool for tool in (str(SSHD), "ssh", "ssh-keygen", "sudo", "visudo")
               if shutil.which(tool) is None]
    if missing:
        raise LabError(f"missing tools: {', '.join(missing)}")
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    workdir.chmod(0o755)
    _check_traversable(workdir)

    users = {"bash": "root"}
    for shell_name, (user, shell) in TEST_USERS.items():
        _ensure_user(user, shell)
        users[shell_name] = user

    host_key = workdir / "ssh_host_ed25519_key"
    identity = workdir / "id_ed25519"
    _keygen(host_key, "fleetcuda-lab-host")
    _keygen(identity, "fleetcuda-lab-client")
    keys_dir = workdir / "authorized_keys"
    keys_dir.mkdir(mode=0o755, exist_ok=True)
    client_pub = identity.with_suffix(".pub").read_text()
    for user in users.values():
        (keys_dir / user).write_text(client_pub)
        (keys_dir / user).chmod(0o644)

    pct_path, state_dir = _install_pct(workdir)
    _install_sudoers(pct_path)

    log = workdir / "sshd.log"
    port, pid = _launch_sshd(workdir, host_key, list(users.values()), log)
    host_pub = host_key.with_suffix(".pub").read_text().split()
    known_hosts = workdir / "known_hosts"
    known_hosts.write_text(f"[127.0.0.1]:{port} {host_pub[0]} {host_pub[1]}\n")

    lab = LoopbackSshd(
        address="127.0.0.1", port=port, known_hosts=known_hosts, identity=identity,
        pct_path=pct_path, state_dir=state_dir, users=users, workdir=workdir,
        log=log, pid=pid,
    )
    try:
        for user in users.values():
            probe = subprocess.run([*lab.ssh_argv(user), "true"],
                                   capture_output=True, text=True, timeout=30)
            if probe.returncode != 0:
                raise LabError(f"ssh {user}@127.0.0.1 failed: {probe.stderr.strip()}; see {log}")
    except BaseException:
        lab.stop()
        raise
    return lab
