"""The command layer's promise: any script reaches the target's bash byte for byte, whatever the
SSH login shell (sh, bash, dash, zsh), and the dry-run line does the same when pasted into bash or
zsh, interactive ones included.

The login shells here are the real ones; `pct` and `ssh` are recorders that write their argv, so
the property is checked on exactly what those programs would receive.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetcuda.plan import command
from fleetcuda.plan.command import HopChain, Invocation, PctHop, SshHop, build, quote, quote_for_paste
from tests.conftest import SHELLS, need

# Scripts full of what breaks naive quoting.
NASTY = st.text(
    alphabet=st.one_of(
        st.sampled_from(list("'\"$`\\\n\t !*?~#=;&|<>(){}[]-%^,:@ ")),
        st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters="\x00"),
    ),
    max_size=60,
)
ENV_VALUES = st.dictionaries(
    st.from_regex(r"[A-Z_][A-Z0-9_]{0,8}", fullmatch=True), NASTY, max_size=3)

RECORDER = """#!/bin/sh
printf '%s\\0' "$@" > {out}
"""


@pytest.fixture(scope="module")
def recorders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    need(tuple(SHELLS.values()), "the quoting tests")
    d = tmp_path_factory.mktemp("rec")
    out: dict[str, Path] = {}
    for name in ("pct", "ssh"):
        script = d / name
        script.write_text(RECORDER.format(out=d / f"{name}.argv"))
        script.chmod(0o755)
        out[name] = script
    out["dir"] = d
    return out


def recorded(path: Path) -> list[str]:
    data = path.read_bytes()
    assert data.endswith(b"\0")
    return data[:-1].decode("utf-8", "surrogateescape").split("\0")


def expected_inner(script: str, env: dict[str, str]) -> list[str]:
    return command.target_argv(Invocation(script, env), 200)


@pytest.mark.parametrize("shell", list(SHELLS))
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=NASTY, env=ENV_VALUES)
def test_login_shell_passes_script_byte_for_byte(recorders: dict[str, Path], shell: str, script: str,
                                                 env: dict[str, str]) -> None:
    chain = HopChain(SshHop("192.0.2.1", "root"), PctHop(200, pct=str(recorders["pct"])))
    built = build(chain, Invocation(script, env))
    # sshd runs `<login shell> -c <string>` with the user's environment; that is what this does.
    proc = subprocess.run([SHELLS[shell], "-c", built.remote], capture_output=True, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    argv = recorded(recorders["dir"] / "pct.argv")
    assert argv == ["exec", "200", "--", *expected_inner(script, env)]
    assert argv[-2] == script


@pytest.mark.parametrize("shell", ["bash", "zsh"])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=NASTY)
def test_dry_run_line_pasted_into_shell_gives_ssh_the_exact_command(recorders: dict[str, Path], shell: str,
                                                                     script: str) -> None:
    chain = HopChain(SshHop("192.0.2.1", "root", port=2222, identity_file="~/.ssh/id x"),
                     PctHop(200, sudo=True))
    built = build(chain, Invocation(script, {"CUDA_HOME": "/usr/local/cuda-12.8"}))
    assert "\n" not in built.display
    env = {"PATH": f"{recorders['dir']}:/usr/bin:/bin", "HOME": str(recorders["dir"])}
    proc = subprocess.run([SHELLS[shell], "-c", built.display], capture_output=True, env=env)
    assert proc.returncode == 0, proc.stderr
    argv = recorded(recorders["dir"] / "ssh.argv")
    assert argv[-1] == built.remote
    assert argv[-3:-1] == ["--", "root@192.0.2.1"]


@pytest.mark.parametrize("shell", ["bash", "zsh"])
@pytest.mark.parametrize("script", [
    "echo 'hi!' \"$HOME\" `date` !! !$ ^x^y",
    "python3 -c \"print('a b')\"\nexit 0",
    "x='it'\\''s'; echo \"$x\" # done",
])
def test_dry_run_line_survives_interactive_history_expansion(recorders: dict[str, Path], shell: str,
                                                             script: str) -> None:
    """A user pastes into an interactive shell, where `!` triggers history expansion."""
    built = build(HopChain(SshHop("192.0.2.1", "root"), PctHop(200)), Invocation(script))
    env = {"PATH": f"{recorders['dir']}:/usr/bin:/bin", "HOME": str(recorders["dir"]), "TERM": "dumb"}
    args = [SHELLS[shell], "--norc", "-i"] if shell == "bash" else [SHELLS[shell], "-f", "-i"]
    # History is on in a terminal; with stdin from a pipe it must be switched on by hand.
    enable = "set -o history; set -H" if shell == "bash" else "setopt BANG_HIST"
    lines = f"{enable}\necho previous\n{built.display}\nexit\n"
    proc = subprocess.run(args, input=lines.encode(), capture_output=True, env=env)
    argv = recorded(recorders["dir"] / "ssh.argv")
    assert argv[-1] == built.remote, proc.stderr


def test_plain_words_stay_readable() -> None:
    assert quote("/usr/sbin/pct") == "/usr/sbin/pct"
    assert quote("PATH=/usr/bin:/bin") == "PATH=/usr/bin:/bin"
    # zsh expands a leading `=` and `~`; every shell globs
    for word in ("=nvcc", "~root", "*.deb", "a b", "", "x;y", "$HOME"):
        assert quote(word) != word
    assert quote_for_paste("line1\nline2") == "$'line1\\nline2'"
    assert quote_for_paste("don't!") == "$'don\\'t\\041'"


def test_nul_is_refused() -> None:
    with pytest.raises(ValueError):
        quote("a\x00b")


def test_sudo_and_local_chains() -> None:
    inv = Invocation("true", {"A": "1"})
    sudo = build(HopChain(SshHop("h", "ops"), PctHop(201, sudo=True)), inv)
    assert sudo.argv[:7] == ("sudo", "-n", "--", "/usr/sbin/pct", "exec", "201", "--")
    local = build(HopChain(), inv)
    assert local.remote is None
    assert local.argv == ("/usr/bin/env", "-i", "A=1", "FLEETCUDA_LABEL=fleetcuda", "/bin/bash", "--noprofile",
                          "--norc", "-c", "true", "fleetcuda")
    assert os.path.basename(local.argv[0]) == "env"
