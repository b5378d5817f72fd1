"""The dry-run line's ssh command means what the SSH transport does: checked with the real OpenSSH client
(`ssh -G` for the options it resolves, and real connections to the loopback sshd), pasted into real shells."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from fleetcuda.connectors import ssh as transport
from fleetcuda.plan.command import HopChain, Invocation, SshHop, build
from tests.conftest import SHELLS, need
from tests.lab.sshd import LoopbackSshd

RESOLVE = """#!/bin/sh
exec /usr/bin/ssh -G "$@" > {out} 2>&1
"""
RECORD = """#!/bin/sh
printf '%s\\0' "$@" > {out}
"""


def fake_ssh(d: Path, body: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    out = d / "out"
    script = d / "ssh"
    script.write_text(body.format(out=out))
    script.chmod(0o755)
    return out


def paste(display: str, shell: str, path: str, home: Path) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([SHELLS[shell], "-c", display], capture_output=True, timeout=60,
                          env={"PATH": path, "HOME": str(home), "SHELL": SHELLS[shell]})


def resolved(out: Path) -> dict[str, list[str]]:
    conf: dict[str, list[str]] = {}
    for line in out.read_text().splitlines():
        key, _, value = line.partition(" ")
        conf.setdefault(key, []).append(value)
    return conf


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_ssh_G_of_the_printed_line_resolves_what_the_transport_uses(tmp_path: Path, shell: str) -> None:
    need(("/usr/bin/ssh", SHELLS[shell]), "ssh -G")
    hop = SshHop("127.0.0.1", "root", port=2222, identity_file=str(tmp_path / "keys dir" / "id 1"),
                 known_hosts=str(tmp_path / "known hosts dir" / "known_hosts"), connect_timeout=7)
    assert hop.identity_file is not None
    Path(hop.identity_file).parent.mkdir()
    Path(hop.identity_file).write_text("")  # ssh drops an -i file that does not exist
    built = build(HopChain(hop), Invocation("true"))
    out = fake_ssh(tmp_path / "bin", RESOLVE)
    proc = paste(built.display, shell, f"{tmp_path / 'bin'}:/usr/bin:/bin", tmp_path)
    assert proc.returncode == 0, out.read_text() if out.exists() else proc.stderr
    conf = resolved(out)
    # The transport reads host keys from this one file only: no global file, no second user file.
    assert conf["userknownhostsfile"] == [transport._known_hosts_path(hop)]
    assert conf["globalknownhostsfile"] == ["/dev/null"]
    # No ssh config is read: /etc/ssh/ssh_config's SendEnv (LANG, LC_*) would pass the session's locale on.
    assert "sendenv" not in conf and conf["gssapiauthentication"] == ["no"]
    assert conf["identityfile"] == [hop.identity_file] and conf["identitiesonly"] == ["yes"]
    assert conf["batchmode"] == ["yes"] and conf["stricthostkeychecking"] == ["true"]
    assert conf["updatehostkeys"] == ["false"]
    assert conf["serveraliveinterval"] == [f"{transport.KEEPALIVE_INTERVAL_S:g}"]
    assert conf["serveralivecountmax"] == [str(transport.KEEPALIVE_COUNT_MAX)]
    assert conf["connecttimeout"] == ["7"] and conf["port"] == ["2222"]
    assert conf["user"] == ["root"] and conf["hostname"] == ["127.0.0.1"]


def _copy_known_hosts(lab: LoopbackSshd, path: Path, name: str = "127.0.0.1") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(lab.known_hosts.read_text().replace("[127.0.0.1]", f"[{name}]"))
    return path


@pytest.mark.parametrize("shell", ["bash", "zsh"])
@pytest.mark.parametrize("jump", [False, True])
def test_the_printed_line_connects_like_the_transport(sshd_lab: LoopbackSshd, tmp_path: Path, shell: str,
                                                      jump: bool) -> None:
    """The host key is only in a known_hosts file whose path has a space (so is the jump host's): the pasted
    line must verify it there, like the transport, through the jump host with its own options."""
    # The target is named `localhost`, the jump host 127.0.0.1 (one sshd, two names).
    kh = _copy_known_hosts(sshd_lab, tmp_path / "my hosts" / "known_hosts", "localhost")
    via = None
    if jump:
        via = SshHop("127.0.0.1", "root", port=sshd_lab.port, identity_file=str(sshd_lab.identity),
                     known_hosts=str(_copy_known_hosts(sshd_lab, tmp_path / "jump hosts" / "known_hosts")),
                     connect_timeout=5)
    hop = SshHop("localhost", "root", port=sshd_lab.port, identity_file=str(sshd_lab.identity), known_hosts=str(kh),
                 connect_timeout=5, jump=via)
    built = build(HopChain(hop), Invocation("echo reached-$((6 * 7))"))
    proc = paste(built.display, shell, "/usr/bin:/bin", tmp_path)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    assert proc.stdout.decode().strip() == "reached-42"
    t = transport.SshTransport(hop, attempts=1)
    try:
        assert t.run(built, timeout=None, on_line=lambda _: None).output.strip() == "reached-42"
    finally:
        t.close()


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_the_printed_line_is_7bit_ascii_and_means_the_same_bytes(tmp_path: Path, shell: str) -> None:
    need((SHELLS[shell],), "pasting the dry-run line")
    hop = SshHop("192.0.2.1", "root", identity_file="/keys/clé \u2028x", known_hosts="/kh/h\u00f4tes")
    script = "echo 'caf\u00e9 \u00fc' \"\u65e5\u672c\" \x1b[0m!"
    built = build(HopChain(hop), Invocation(script))
    assert built.display.isascii() and "\n" not in built.display
    assert all(c.isprintable() for c in built.display)
    out = fake_ssh(tmp_path / "bin", RECORD)
    proc = paste(built.display, shell, f"{tmp_path / 'bin'}:/usr/bin:/bin", tmp_path)
    assert proc.returncode == 0, proc.stderr
    argv = out.read_bytes()[:-1].decode("utf-8", "surrogateescape").split("\0")
    assert argv[-1] == built.remote and argv[-3:-1] == ["--", "root@192.0.2.1"]
    assert argv[argv.index("-i") + 1] == hop.identity_file
    assert 'UserKnownHostsFile="/kh/h\u00f4tes"' in argv
