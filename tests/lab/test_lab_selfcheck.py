"""Self-checks for the loopback sshd lab and the pct stand-in."""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from .sshd import LoopbackSshd


@pytest.fixture(scope="module")
def lab(sshd_lab: LoopbackSshd) -> LoopbackSshd:
    sshd_lab.add_container(200)
    sshd_lab.add_container(201, running=False, name="web")
    return sshd_lab


def ssh(
    lab: LoopbackSshd, user: str, command: str, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    argv = [*lab.ssh_argv(user), command]
    return subprocess.run(argv, input=input, capture_output=True, text=True, timeout=30)


def pct(
    lab: LoopbackSshd, *args: str, input: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    argv = [str(lab.pct_path), *args]
    return subprocess.run(argv, input=input, env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("shell", ["bash", "zsh", "dash", "sh", "sudo_password"])
def test_every_user_logs_in_with_strict_host_key(lab: LoopbackSshd, shell: str) -> None:
    user = lab.users[shell]
    result = ssh(lab, user, "id -un")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == user


def test_login_shells_are_what_they_claim(lab: LoopbackSshd) -> None:
    zsh = ssh(lab, lab.users["zsh"], "echo $ZSH_VERSION")
    assert zsh.returncode == 0 and zsh.stdout.strip(), zsh
    dash = ssh(lab, lab.users["dash"], "echo \"$BASH_VERSION\"; readlink /proc/$$/exe")
    assert dash.stdout.split("\n")[:2] == ["", "/usr/bin/dash"], dash


def test_nopasswd_sudo_runs_pct_as_root(lab: LoopbackSshd) -> None:
    lab.clear_calls()
    result = ssh(lab, lab.users["zsh"], f"sudo -n {lab.pct_path} list")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0].split() == ["VMID", "Status", "Lock", "Name"]
    assert "201        stopped                 web" in result.stdout
    [call] = lab.calls()
    assert call["argv"] == ["list"] and call["uid"] == 0
    assert call["env"]["SUDO_USER"] == lab.users["zsh"]


def test_sudo_without_nopasswd_fails_fast(lab: LoopbackSshd) -> None:
    started = time.monotonic()
    result = ssh(lab, lab.users["sudo_password"], f"sudo -n {lab.pct_path} list")
    assert result.returncode != 0
    assert "a password is required" in result.stderr
    assert time.monotonic() - started < 10


def test_unknown_host_key_is_refused(lab: LoopbackSshd, tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    result = subprocess.run([*lab.ssh_argv("root", known_hosts=empty), "true"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 255
    assert "Host key verification failed" in result.stderr


NODE = socket.gethostname().split(".")[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["exec", "999", "--", "true"], f"Configuration file 'nodes/{NODE}/lxc/999.conf' does not exist"),
        (["status", "999"], f"Configuration file 'nodes/{NODE}/lxc/999.conf' does not exist"),
        (["exec", "abc", "--", "true"],
         "400 Parameter verification failed.\nvmid: type check ('integer') failed - got 'abc'"),
        (["exec", "99", "--", "true"], "400 Parameter verification failed.\nvmid:"),
        (["exec", "201", "--", "true"], "container '201' not running!"),
        (["exec", "200"], "missing command"),
        (["exec", "200", "--"], "missing command"),
        (["frobnicate"], "ERROR: unknown command 'pct frobnicate'"),
    ],
)
def test_pct_errors_match_proxmox(lab: LoopbackSshd, args: list[str], message: str) -> None:
    result = pct(lab, *args)
    assert result.returncode == 255
    assert result.stderr.startswith(message), result.stderr
    assert result.stdout == ""


def test_pct_status_start_stop(lab: LoopbackSshd) -> None:
    lab.add_container(300, running=False)
    assert pct(lab, "status", "300").stdout == "status: stopped\n"
    assert pct(lab, "start", "300").returncode == 0
    assert pct(lab, "status", "300").stdout == "status: running\n"
    assert pct(lab, "stop", "300").returncode == 0
    assert pct(lab, "status", "300").stdout == "status: stopped\n"


def test_pct_list_is_empty_without_containers(tmp_path: Path) -> None:
    source = (Path(__file__).with_name("pct_standin.py")).read_text()
    script = tmp_path / "pct.py"
    script.write_text(source.replace("__STATE_DIR__", str(tmp_path)))
    result = subprocess.run(["/usr/bin/python3", str(script), "list"], capture_output=True, text=True)
    assert (result.returncode, result.stdout) == (0, "")


def test_exec_passes_argv_status_and_stdin(lab: LoopbackSshd) -> None:
    result = pct(lab, "exec", "200", "--", "printf", "%s|", "a", "b c", "$HOME", "")
    assert (result.returncode, result.stdout) == (0, "a|b c|$HOME||")
    assert pct(lab, "exec", "200", "--", "sh", "-c", "exit 7").returncode == 7
    assert pct(lab, "exec", "200", "--", "cat", input="line1\nline2\n").stdout == "line1\nline2\n"


def test_exec_records_stdin_only_when_asked(lab: LoopbackSshd) -> None:
    payload = "x" * 200_000 + "\n"  # larger than a pipe buffer
    lab.clear_calls()
    assert pct(lab, "exec", "200", "--", "wc", "-c", input=payload).stdout.strip() == "200001"
    flag = lab.state_dir / "record-stdin"
    flag.touch()
    try:
        assert pct(lab, "exec", "200", "--", "wc", "-c", input=payload).stdout.strip() == "200001"
    finally:
        flag.unlink()
    first, second = lab.calls()
    assert "stdin" not in first
    assert second["stdin"] == payload and second["argv"] == ["exec", "200", "--", "wc", "-c"]


def test_exec_environment_handling(lab: LoopbackSshd) -> None:
    env = {**os.environ, "FC_MARK": "1", "SSL_CERT_FILE": "/x", "SSL_CERT_DIR": "/y"}
    kept = pct(lab, "exec", "200", "--", "env", env=env).stdout.splitlines()
    assert "FC_MARK=1" in kept
    assert not [line for line in kept if line.startswith("SSL_CERT_")]
    cleared = pct(lab, "exec", "200", "--keep-env", "0", "--", "env", env=env)
    assert (cleared.returncode, cleared.stdout) == (0, "")
    assert lab.calls()[-1]["env"]["FC_MARK"] == "1"


def test_exec_over_ssh_and_sudo_end_to_end(lab: LoopbackSshd) -> None:
    inner = shlex.join(["sudo", "-n", str(lab.pct_path), "exec", "200", "--", "printf", "%s|", "a", "b c"])
    for shell in ("zsh", "dash", "sh"):
        result = ssh(lab, lab.users[shell], inner)
        assert (result.returncode, result.stdout) == (0, "a|b c|"), (shell, result.stderr)
    cat = shlex.join(["sudo", "-n", str(lab.pct_path), "exec", "200", "--", "cat"])
    piped = ssh(lab, lab.users["zsh"], cat, input="hello\n")
    assert piped.stdout == "hello\n"


def test_pct_installed_root_owned_and_executable(lab: LoopbackSshd) -> None:
    stat = lab.pct_path.stat()
    assert (stat.st_uid, stat.st_mode & 0o7777) == (0, 0o755)
    assert lab.pct_path.read_text().startswith("#!/usr/bin/python3\n")
    assert shutil.which(str(lab.pct_path))
