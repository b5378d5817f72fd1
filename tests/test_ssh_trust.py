"""`fleetcuda trust` and host-key verification against real known_hosts files, through the real CLI and
the loopback OpenSSH server: --yes never records an unseen key, the key is fetched through the host's jump
hosts (whose keys must be trusted already), and known_hosts files with @revoked / @cert-authority markers,
hashed names and garbage are read as OpenSSH reads them."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleetcuda.connectors.ssh import SshTransport
from fleetcuda.errors import HostKeyError
from fleetcuda.plan.command import BuiltCommand, SshHop
from tests.conftest import REPO
from tests.lab.sshd import LoopbackSshd


def cli(*args: str, state: Path) -> subprocess.CompletedProcess[str]:
    """The real CLI, without a terminal (stdin /dev/null), as cron or a script runs it."""
    env = {**os.environ, "FLEETCUDA_STATE_DIR": str(state), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "fleetcuda", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, stdin=subprocess.DEVNULL, timeout=120)


def host_pub(lab: LoopbackSshd) -> tuple[str, str]:
    fields = (lab.workdir / "ssh_host_ed25519_key.pub").read_text().split()
    return fields[0], fields[1]


def real_fingerprint(lab: LoopbackSshd) -> str:
    return subprocess.run(["ssh-keygen", "-lf", str(lab.workdir / "ssh_host_ed25519_key.pub")], capture_output=True,
                          text=True, check=True).stdout.split()[1]


def inventory(lab: LoopbackSshd, path: Path, known_hosts: Path, *, jump_known_hosts: Path | None = None) -> Path:
    text = (f"hosts:\n  target:\n    address: 127.0.0.1\n    port: {lab.port}\n    user: root\n"
            f"    identity_file: {lab.identity}\n    known_hosts: {known_hosts}\n    connect_timeout: 5\n")
    if jump_known_hosts is not None:
        text += (f"    jump: bastion\n  bastion:\n    address: 127.0.0.1\n    port: {lab.port}\n    user: root\n"
                 f"    identity_file: {lab.identity}\n    known_hosts: {jump_known_hosts}\n    connect_timeout: 5\n")
    path.write_text(text)
    return path


def logins(lab: LoopbackSshd) -> int:
    return lab.log.read_text(errors="replace").count("Accepted publickey for root")


def test_yes_without_fingerprint_records_nothing(sshd_lab: LoopbackSshd, tmp_path: Path) -> None:
    kh = tmp_path / "kh" / "known_hosts"
    inv = inventory(sshd_lab, tmp_path / "inv.yaml", kh)
    proc = cli("trust", "target", "-i", str(inv), "--yes", state=tmp_path / "state")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "pass --fingerprint SHA256:" in proc.stderr
    assert not kh.exists()
    # With the fingerprint the host really has, --yes records it.
    ok = cli("trust", "target", "-i", str(inv), "--yes", "--fingerprint", real_fingerprint(sshd_lab),
             state=tmp_path / "state")
    assert ok.returncode == 0, ok.stderr
    kind, blob = host_pub(sshd_lab)
    assert kh.read_text() == f"[127.0.0.1]:{sshd_lab.port} {kind} {blob}\n"


def test_trust_through_a_jump_host_whose_key_is_unknown_is_refused(sshd_lab: LoopbackSshd, tmp_path: Path) -> None:
    kh = tmp_path / "known_hosts"
    jump_kh = tmp_path / "bastion_known_hosts"
    jump_kh.write_text("")  # the jump host's key is not trusted: it must not be reached blindly
    inv = inventory(sshd_lab, tmp_path / "inv.yaml", kh, jump_known_hosts=jump_kh)
    proc = cli("trust", "target", "-i", str(inv), "--fingerprint", real_fingerprint(sshd_lab), state=tmp_path / "s")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert f"host key of [127.0.0.1]:{sshd_lab.port} is not in {jump_kh}" in proc.stderr
    assert not kh.exists() and jump_kh.read_text() == ""


def test_trust_fetches_the_key_through_the_jump_host(sshd_lab: LoopbackSshd, tmp_path: Path) -> None:
    kh = tmp_path / "known_hosts"
    inv = inventory(sshd_lab, tmp_path / "inv.yaml", kh, jump_known_hosts=sshd_lab.known_hosts)
    before = logins(sshd_lab)
    proc = cli("trust", "target", "-i", str(inv), "--fingerprint", real_fingerprint(sshd_lab), state=tmp_path / "s")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The key was read over a channel of an authenticated connection to the jump host, not directly.
    assert logins(sshd_lab) == before + 1
    assert kh.read_text().startswith(f"[127.0.0.1]:{sshd_lab.port} ssh-ed25519 ")
    assert f"via [127.0.0.1]:{sshd_lab.port}" in proc.stdout


def hop(lab: LoopbackSshd, known_hosts: Path) -> SshHop:
    return SshHop("127.0.0.1", "root", port=lab.port, identity_file=str(lab.identity), known_hosts=str(known_hosts),
                  connect_timeout=5)


def echo(text: str) -> BuiltCommand:
    return BuiltCommand(argv=(), remote=f"echo {text}", display="")


def other_key(tmp_path: Path) -> tuple[str, str]:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    fields = (tmp_path / "other.pub").read_text().split()
    return fields[0], fields[1]


def test_markers_hashed_names_and_garbage_are_read_as_openssh_reads_them(sshd_lab: LoopbackSshd,
                                                                         tmp_path: Path) -> None:
    kind, blob = host_pub(sshd_lab)
    okind, oblob = other_key(tmp_path)
    name = f"[127.0.0.1]:{sshd_lab.port}"
    kh = tmp_path / "known_hosts"
    salt = os.urandom(20)  # OpenSSH's HashKnownHosts form: |1|salt|HMAC-SHA1(salt, name)
    digest = hmac.new(salt, name.encode(), hashlib.sha1).digest()
    hashed_line = f"|1|{base64.b64encode(salt).decode()}|{base64.b64encode(digest).decode()} {kind} {blob}"
    lines = [
        "# a comment",
        f"@cert-authority *.example.org {okind} {oblob}",
        f"@revoked other.example.org {okind} {oblob}",
        "garbage without fields",
        f"{name} ssh-ed25519 not-base64!!",
        f"{name} ssh-unknown-type AAAA",
        f"!{name},* {okind} {oblob}",  # negated: never for this host
        hashed_line,
    ]
    kh.write_text("\n".join(lines) + "\n")
    t = SshTransport(hop(sshd_lab, kh), attempts=1)
    try:
        assert t.run(echo("ok"), timeout=None, on_line=lambda _: None).output.strip() == "ok"
    finally:
        t.close()
    # trust reads the same file without a crash and sees the key as trusted.
    inv = inventory(sshd_lab, tmp_path / "inv.yaml", kh)
    proc = cli("trust", "target", "-i", str(inv), state=tmp_path / "s")
    assert proc.returncode == 0 and "already trusted" in proc.stdout, proc.stdout + proc.stderr


def test_a_revoked_key_is_refused_by_the_transport_and_by_trust(sshd_lab: LoopbackSshd, tmp_path: Path) -> None:
    kind, blob = host_pub(sshd_lab)
    name = f"[127.0.0.1]:{sshd_lab.port}"
    kh = tmp_path / "known_hosts"
    kh.write_text(f"{name} {kind} {blob}\n@revoked * {kind} {blob}\n")
    t = SshTransport(hop(sshd_lab, kh), attempts=1)
    try:
        with pytest.raises(HostKeyError, match="REVOKED") as exc:
            t.run(echo("no"), timeout=None, on_line=lambda _: None)
        assert real_fingerprint(sshd_lab) in str(exc.value)
    finally:
        t.close()
    only_revoked = tmp_path / "kh2"
    only_revoked.write_text(f"@revoked {name} {kind} {blob}\n")
    inv = inventory(sshd_lab, tmp_path / "inv.yaml", only_revoked)
    proc = cli("trust", "target", "-i", str(inv), "--fingerprint", real_fingerprint(sshd_lab), state=tmp_path / "s")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "REVOKED" in proc.stderr and "Traceback" not in proc.stderr
    assert only_revoked.read_text() == f"@revoked {name} {kind} {blob}\n"  # nothing recorded


def test_host_patterns() -> None:
    from fleetcuda.connectors.ssh import host_matches

    assert host_matches("a.example,b.example", "b.example")
    assert host_matches("*.example", "A.Example")
    assert not host_matches("*.example,!bad.example", "bad.example")
    assert host_matches("[10.0.0.?]:2222", "[10.0.0.1]:2222")
    assert not host_matches("[10.0.0.1]:2222", "10.0.0.1")
    assert not host_matches("|1|garbage", "x")


@pytest.mark.parametrize("answer", ["y", "n"])
def test_on_a_terminal_the_key_is_recorded_only_after_yes(sshd_lab: LoopbackSshd, tmp_path: Path, answer: str) -> None:
    kh = tmp_path / "known_hosts"
    inv = inventory(sshd_lab, tmp_path / "inv.yaml", kh)
    master, slave = os.openpty()
    try:
        env = {**os.environ, "FLEETCUDA_STATE_DIR": str(tmp_path / "s")}
        proc = subprocess.Popen([sys.executable, "-m", "fleetcuda", "trust", "target", "-i", str(inv)], cwd=REPO,
                                env=env, stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        os.write(master, f"{answer}\n".encode())
        out, err = proc.communicate(timeout=60)
    finally:
        os.close(master)
        os.close(slave)
    assert real_fingerprint(sshd_lab) in out and "Record this key" in out
    if answer == "y":
        assert proc.returncode == 0, err
        assert kh.read_text().startswith(f"[127.0.0.1]:{sshd_lab.port} ssh-ed25519 ")
    else:
        assert proc.returncode == 1 and "nothing recorded" in out
        assert not kh.exists()


def test_any_of_several_keys_of_one_type_is_accepted_as_openssh_does(sshd_lab: LoopbackSshd, tmp_path: Path) -> None:
    kind, blob = host_pub(sshd_lab)
    okind, oblob = other_key(tmp_path)
    name = f"[127.0.0.1]:{sshd_lab.port}"
    kh = tmp_path / "known_hosts"
    kh.write_text(f"{name} {okind} {oblob}\n{name} {kind} {blob}\n")  # an old key of the same type first
    t = SshTransport(hop(sshd_lab, kh), attempts=1)
    try:
        assert t.run(echo("ok"), timeout=None, on_line=lambda _: None).output.strip() == "ok"
    finally:
        t.close()
