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

from fleetcuda.remote import shell_text

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
    if not any(c in word for c in "'!\\") and all(c.isprintable() and c.isascii() for c in word):
        return "'" + word + "'"
    # One pass of str.translate for ASCII (a character loop cost 90% of planning a flagship target), then the
    # rest: 7-bit ASCII on screen, whatever the locale: each byte of a non-ASCII character's UTF-8 (or the
    # original byte, for a lone surrogate from argv) as \xHH, which bash and zsh turn back into the same bytes.
    text = word.translate(_PASTE_ESCAPES)
    if not text.isascii():
        text = _NON_ASCII.sub(_hex_bytes, text)
    return "$'" + text + "'"


# `!` as an octal escape, so that interactive history expansion never sees one; newlines as `\n`, so the command
# stays one line; other control characters in octal.
_PASTE_ESCAPES = {ord("\\"): "\\\\", ord("'"): "\\'", ord("\n"): "\\n", ord("\t"): "\\t", ord("!"): "\\041",
                  0x7F: "\\177",
                  **{c: f"\\{c:03o}" for c in range(0x20) if c not in (0x09, 0x0A)}}
_NON_ASCII = re.compile(r"[^\x00-\x7f]")


def _hex_bytes(m: re.Match[str]) -> str:
    c = m.group()
    try:
        raw = c.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raw = c.encode("utf-8", "surrogatepass")
    return "".join(f"\\x{b:02x}" for b in raw)


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
    # The command that trusts this hop's key, as the user runs it (`fleetcuda trust -i INVENTORY HOST`): said
    # by the error of a key not yet trusted. Not part of what the hop is.
    trust_command: str = field(default="", compare=False, repr=False)


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
    """What runs inside the target: a bash script with exactly this environment.

    `shell_vars` are set (not exported) before the script, each value quoted once: what `{{ x }}` in a
    script refers to. Secrets never appear on a command line, where anyone on the target could read
    them with `ps`: `secret_env` (exported) and `secret_vars` (not) are read from stdin, NUL-separated,
    by the first lines of the script."""

    script: str
    env: Mapping[str, str] = field(default_factory=dict)
    timeout: int | None = None
    # bash's $0, the last word of the command line: lets an interrupted run find what it left running.
    label: str = "fleetcuda"
    shell_vars: Mapping[str, str] = field(default_factory=dict)
    secret_env: Mapping[str, str] = field(default_factory=dict)
    secret_vars: Mapping[str, str] = field(default_factory=dict)

    @property
    def stdin(self) -> str:
        """What must be written to the command's stdin (then closed): the secrets, in prologue order."""
        return "".join(v + "\0" for v in [*self.secret_vars.values(), *self.secret_env.values()])

    def full_script(self) -> str:
        lines = [f"{name}={quote(value)}" for name, value in self.shell_vars.items()]
        for name in [*self.secret_vars, *self.secret_env]:
            _check_env_name(name)
            lines.append(f"IFS= read -r -d '' {name}")
        if self.secret_env:
            lines.append("export " + " ".join(self.secret_env))
        return "".join(line + "\n" for line in lines) + self.script


@dataclass(frozen=True)
class BuiltCommand:
    argv: tuple[str, ...]  # what the host (or the local machine) must execute
    remote: str | None  # exact string for the SSH exec channel; None for local targets
    display: str  # one line a user can paste into bash or zsh for the same effect (secrets: from stdin)
    label: str = "fleetcuda"  # the target-side label of what runs (see stop_invocation)
    stdin: str = ""  # written to the command's stdin, which is then closed: never shown, never logged
    # Characters of its output's head kept in memory, where more than connectors.base.KEEP_HEAD (0): a batch
    # of checks, each capped on the target, whose frames must all be read.
    output_keep: int = 0


LABEL_ENV = "FLEETCUDA_LABEL"
TARGET_ENV = "FLEETCUDA_TARGET"


def _check_env_name(name: str) -> None:
    if not _ENV_NAME.match(name):
        raise ValueError(f"invalid environment variable name {name!r}")


def target_argv(inv: Invocation, vmid: int | None = None) -> list[str]:
    """argv that starts bash inside the target with a cleared, explicit environment; `vmid`: the container's."""
    argv = [ENV, "-i"]
    for name, value in inv.env.items():
        _check_env_name(name)
        argv.append(f"{name}={value}")
    # The label (bash's $0) in the environment too: every process the command starts keeps it, however it renames
    # or detaches itself (`exec -a`, setsid), so that stop.sh and lock.sh find the run's processes.
    argv.append(f"{LABEL_ENV}={inv.label}")
    if vmid is not None:
        # Which container's: where containers share one /proc (local stand-ins, a host's view), a lock stands
        # only for the processes of its own container (lock.sh).
        argv.append(f"{TARGET_ENV}={vmid}")
    if inv.timeout:
        argv += [TIMEOUT, "-k", str(KILL_AFTER_S), str(int(inv.timeout))]
    # Not a login shell and no rc files: nothing from /etc/profile.d, by design.
    argv += [BASH, "--noprofile", "--norc", "-c", inv.full_script(), inv.label]
    return argv


# Run inside a target after Ctrl-C: stops every process of one run, found by its label (see stop.sh).
STOP_SCRIPT = shell_text("stop")


def stop_invocation(label: str) -> Invocation:
    """What fleetcuda runs in a target to stop what its run `label@<run>` had started there (after Ctrl-C
    or SIGTERM). A label without a run id stops only processes of exactly that label's run-less form."""
    run = label.rpartition("@")[2] if "@" in label else ""
    if not run:
        raise ValueError(f"label {label!r} names no run")
    return Invocation(f"set -- {quote(run)} {quote(label)}\n" + STOP_SCRIPT, {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                      timeout=60, label=internal_label("stop", run))


def step_label(step: str, run_id: str = "") -> str:
    """bash's $0 for a step's commands: unique per run, so stopping one run's step never touches another's."""
    return f"fleetcuda:{step}" + (f"@{run_id}" if run_id else "")


def internal_label(what: str, run_id: str = "") -> str:
    """fleetcuda's own commands: `fleetcuda-` is never a step's label, whatever the step is called."""
    return f"fleetcuda-{what}" + (f"@{run_id}" if run_id else "")


def host_argv(chain: HopChain, inner: Sequence[str]) -> list[str]:
    argv: list[str] = []
    if chain.pct is not None:
        if chain.pct.sudo:
            argv += [SUDO, "-n", "--"]
        argv += [chain.pct.pct, "exec", str(chain.pct.vmid), "--"]
    return argv + list(inner)


def ssh_argv(hop: SshHop) -> list[str]:
    """OpenSSH client options equivalent to what the SSH transport does (fleetcuda.connectors.ssh).

    No ssh config file is read (-F /dev/null: neither ~/.ssh/config nor /etc/ssh/ssh_config, whose
    SendEnv would pass LANG on); host keys only from the hop's own known_hosts, never added to it;
    only the given identity (or, with none, the agent and the default keys); publickey only, no
    prompts; keepalives that must be answered (transport.KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT_MAX);
    each jump host with its own options, through a ProxyCommand (`-J` would reach jump hosts with
    the default options). Values OpenSSH tokenizes or expands are written for OpenSSH: double quotes
    around the known_hosts path (a space would split it into two files), `%` doubled.
    """
    known_hosts = hop.known_hosts or "~/.ssh/known_hosts"
    for path in (known_hosts, hop.identity_file or ""):
        if "${" in path:  # OpenSSH expands ${VAR} in these paths and has no escape for it
            raise ValueError(f"a path with '${{' cannot be given to OpenSSH: {path!r}")
    kh_value = known_hosts.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    argv = ["ssh", "-F", "/dev/null", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
            "-o", "UpdateHostKeys=no", "-o", "PreferredAuthentications=publickey",
            "-o", f"ConnectTimeout={hop.connect_timeout}", "-o", "ServerAliveInterval=10",
            "-o", "ServerAliveCountMax=3", "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", f'UserKnownHostsFile="{kh_value}"']
    if hop.identity_file:
        argv += ["-o", "IdentitiesOnly=yes", "-i", hop.identity_file.replace("%", "%%")]
    if hop.port != 22:
        argv += ["-p", str(hop.port)]
    if hop.jump is not None:
        argv += ["-o", "ProxyCommand=" + _jump_spec(hop.jump, hop)]
    return argv


def _jump_spec(jump: SshHop, to: SshHop) -> str:
    """The ProxyCommand that reaches `to` through `jump`: an ssh to the jump host with its own options
    (and its own ProxyCommand), forwarding stdin/stdout to `to`. OpenSSH runs it with `$SHELL -c`
    after expanding `%` tokens, hence quote() and the doubled `%`."""
    target = f"[{to.address}]:{to.port}" if ":" in to.address else f"{to.address}:{to.port}"
    return join([*ssh_argv(jump), "-W", target, "--", f"{jump.user}@{jump.address}"]).replace("%", "%%")


def build(chain: HopChain, inv: Invocation) -> BuiltCommand:
    argv = host_argv(chain, target_argv(inv, chain.pct.vmid if chain.pct is not None else None))
    if chain.ssh is None:
        return BuiltCommand(tuple(argv), None, join_for_paste(argv), inv.label, inv.stdin)
    remote = join(argv)
    hop = chain.ssh
    # `--` stops ssh's option parsing, so the destination and command are never read as options.
    display = join_for_paste([*ssh_argv(hop), "--", f"{hop.user}@{hop.address}", remote])
    return BuiltCommand(tuple(argv), remote, display, inv.label, inv.stdin)
