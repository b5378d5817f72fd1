"""The one place that wraps commands: script + environment + hop chain -> exact command.

Pure: no I/O. Two shells parse what we send, no more: the SSH user's login shell on the host
(sshd runs `<login shell> -c '<string>'`), and the bash we start inside the target. `pct exec`
and `sudo` pass an argv list through without a shell. So we build the argv that must reach the
host, quote every word once for a POSIX-ish login shell (sh, bash, dash and zsh agree on plain
single quotes), and start the target's bash with a cleared environment, naming every variable
the step needs: pct exec keeps the caller's environment by default, and the SSH session's
variables (SSH_CONNECTION, LANG, ...) must not reach the container.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

ENV = "/usr/bin/env"
BASH = "/bin/bash"
TIMEOUT = "/usr/bin/timeout"
SUDO = "sudo"
DEFAULT_PCT = "/usr/sbin/pct"
# Seconds between timeout's TERM and KILL, so a step's processes never outlive it.
KILL_AFTER_S = 10

# Words made only of these need no quotes in sh, bash, dash or zsh (zsh expands a leading `=`
# and `~`, every shell globs `*?[`, so those never appear unquoted).
_PLAIN_WORD = re.compile(r"[A-Za-z0-9_/.:@%+,-][A-Za-z0-9_/.:@%+,=-]*\Z")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def quote(word: str) -> str:
    """Quote one word for a non-interactive sh, bash, dash or zsh (the SSH login shell)."""
    if "\x00" in word:
        raise ValueError("a NUL byte cannot be passed in a command")
    if _PLAIN_WORD.match(word):
        return word
    return "'" + word.replace("'", "'\"'\"'") + "'"


def quote_for_paste(word: str) -> str:
    """Quote one word for an interactive bash or zsh, on one line.

    Plain single quotes when the word allows it; otherwise ANSI-C `$'...'`, which both shells
    read the same way. `!` is written as an octal escape so that interactive history expansion
    never sees one, and newlines as `\\n` so the command stays one line.
    """
    if "\x00" in word:
        raise ValueError("a NUL byte cannot be passed in a command")
    if _PLAIN_WORD.match(word):
        return word
    if not any(c in word for c in "'!\\") and all(c.isprintable() for c in word):
        return "'" + word + "'"
    out = []
    for c in word:
        if c == "\\":
            out.append("\\\\")
        elif c == "'":
            out.append("\\'")
        elif c == "\n":
            out.append("\\n")
        elif c == "\t":
            out.append("\\t")
        elif c == "!" or (ord(c) < 0x20 or ord(c) == 0x7F):
            out.append(f"\\{ord(c):03o}")
        else:
            out.append(c)
    return "$'" + "".join(out) + "'"


def join(argv: Sequence[str]) -> str:
    return " ".join(quote(a) for a in argv)


def join_for_paste(argv: Sequence[str]) -> str:
    return " ".join(quote_for_paste(a) for a in argv)


@dataclass(frozen=True)
class SshHop:
    address: str
    user: str
    port: int = 22
    identity_file: str | None = None
    known_hosts: str | None = None
    jump: SshHop | None = None
    connect_timeout: int = 10


@dataclass(frozen=True)
class PctHop:
    vmid: int
    pct: str = DEFAULT_PCT
    sudo: bool = False


@dataclass(frozen=True)
class HopChain:
    """local -> [ssh host] -> [sudo -n] -> [pct exec vmid --] -> bash."""

    ssh: SshHop | None = None
    pct: PctHop | None = None


@dataclass(frozen=True)
class Invocation:
    """What runs inside the target: a bash script with exactly this environment."""

    script: str
    env: Mapping[str, str] = field(default_factory=dict)
    timeout: int | None = None
    # bash's $0, the last word of the command line: lets an interrupted run find what it left running.
    label: str = "fleetcuda"


@dataclass(frozen=True)
class BuiltCommand:
    argv: tuple[str, ...]  # what the host (or the local machine) must execute
    remote: str | None  # exact string for the SSH exec channel; None for local targets
    display: str  # one line a user can paste into bash or zsh for the same effect
    label: str = "fleetcuda"  # the target-side label of what runs (see stop_invocation)


def target_argv(inv: Invocation) -> list[str]:
    """argv that starts bash inside the target with a cleared, explicit environment."""
    argv = [ENV, "-i"]
    for name, value in inv.env.items():
        if not _ENV_NAME.match(name):
            raise ValueError(f"invalid environment variable name {name!r}")
        argv.append(f"{name}={value}")
    if inv.timeout:
        argv += [TIMEOUT, "-k", str(KILL_AFTER_S), str(int(inv.timeout))]
    # Not a login shell and no rc files: nothing from /etc/profile.d, by design.
    argv += [BASH, "--noprofile", "--norc", "-c", inv.script, inv.label]
    return argv


# Run inside a target after Ctrl-C: TERM (then KILL) every process whose last argument is the label
# of the step that was running. `timeout` passes the signal on to the step's whole process group.
STOP_SCRIPT = r"""label=$1
stop() {
  n=0
  for d in /proc/[0-9]*; do
    pid=${d#/proc/}
    [ "$pid" = "$$" ] && continue
    last=$(tr '\0' '\n' < "$d/cmdline" 2>/dev/null | tail -n 1) || continue
    if [ "$last" = "$label" ]; then kill "-$1" "$pid" 2>/dev/null && n=$((n + 1)); fi
  done
  echo "$n"
}
first=$(stop TERM)
for _ in 1 2 3 4 5 6 7 8 9 10; do [ "$(stop 0)" = 0 ] && break; sleep 1; done
left=$(stop KILL)
echo "stopped $first process(es) labelled $label; $left needed KILL"
"""


def stop_invocation(label: str) -> Invocation:
    """What fleetcuda runs in a target to stop the step labelled `label` (after Ctrl-C or SIGTERM)."""
    return Invocation(f"set -- {quote(label)}\n" + STOP_SCRIPT, {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                      timeout=60, label="fleetcuda:stop")


def host_argv(chain: HopChain, inner: Sequence[str]) -> list[str]:
    argv: list[str] = []
    if chain.pct is not None:
        if chain.pct.sudo:
            argv += [SUDO, "-n", "--"]
        argv += [chain.pct.pct, "exec", str(chain.pct.vmid), "--"]
    return argv + list(inner)


def ssh_argv(hop: SshHop) -> list[str]:
    """OpenSSH client options equivalent to what the SSH transport does: keys verified, no prompts."""
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
            "-o", f"ConnectTimeout={hop.connect_timeout}"]
    if hop.known_hosts:
        argv += ["-o", f"UserKnownHostsFile={hop.known_hosts}"]
    if hop.identity_file:
        argv += ["-o", "IdentitiesOnly=yes", "-i", hop.identity_file]
    if hop.port != 22:
        argv += ["-p", str(hop.port)]
    if hop.jump is not None:
        argv += ["-J", _jump_spec(hop.jump)]
    return argv


def _jump_spec(hop: SshHop) -> str:
    spec = f"{hop.user}@{hop.address}" + (f":{hop.port}" if hop.port != 22 else "")
    return f"{_jump_spec(hop.jump)},{spec}" if hop.jump else spec


def build(chain: HopChain, inv: Invocation) -> BuiltCommand:
    argv = host_argv(chain, target_argv(inv))
    if chain.ssh is None:
        return BuiltCommand(tuple(argv), None, join_for_paste(argv), inv.label)
    remote = join(argv)
    hop = chain.ssh
    # `--` stops ssh's option parsing, so the destination and command are never read as options.
    display = join_for_paste([*ssh_argv(hop), "--", f"{hop.user}@{hop.address}", remote])
    return BuiltCommand(tuple(argv), remote, display, inv.label)
