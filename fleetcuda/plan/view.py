"""The dry-run: one plan, shown three ways. Pure: no I/O, no printing; `render` returns the text.

What `fleetcuda apply` sends to each target, in the order it sends it (see run/engine.py): the facts
round trip (when `auto` variables must be read), one round trip of every read-only check together with
the lock acquire, then per step its check, apply and verify (for a shared build: the ABI fingerprint,
then either the cached wheel's transfer and install, or the build and the wheel's way back to the cache),
the lock refresh while a step runs long, the lock release, and the removal of what was staged on a host.

Formats:
- `human` (the default, `apply --dry-run`): a summary to review, one screen per plan (`_summary`): per target
  how it is reached and the environment once, what is read from it at run time (`<name>`, see
  templating.Unread), then per step its kind's `describe()` in an operator's words with values resolved, and
  its env, satisfied_if, retries and timeout; targets with equal summaries are one group; the programs sent,
  by name and digest. Lines are wrapped at spaces (`wrap_words`) to `width`.
- `human` with `verbose=True` (`--verbose`): per target the hop chain and the environment once, then every
  round trip as a numbered block
  of the raw script (what the target's bash reads: its `name=value` prologue, then the script), with
  its timeout, label, retries and what it proves. Long programs given in `programs` are shown once, in a
  section at the end, and referred to as `<program NAME sha256:<12 hex>>` where scripts contain them.
  A command exactly like one shown before (most kinds' verify is their check) says `the same command as [N]`.
  No line is over 160 characters: longer ones go on in continuation lines whose gutter is `+`.
- `shell`: the command lines a person can paste into bash or zsh, each after a `#` line saying when apply
  sends it. The lines of the older dry-run (`# step N/M name (kind): phase (note)` then the command) are
  unchanged; lines for what it left out are added among them: target-wide round trips under
  `# round trip WHAT (when)`, a step's transfers and cached-wheel install under `# step` headers of their
  own phases (NEW_STEP_PHASES), and plain remarks as `#   ...`.
- `json`: the same plan as data (below).

Every line of `human` and `shell` is 7-bit ASCII, and every value fleetcuda treats as a secret is `***`.
Values are never trusted to be one line: in `human` each line of a script sits behind a gutter
(`   12 | `) and every other value is escaped (`\\n`, `\\x1b`, `\\u2028`), so no variable can fake a header.

JSON schema "fleetcuda.plan/1" (every string redacted):
- `schema`: "fleetcuda.plan/1"; `recipe`: {`path`, `name`}; `inventory`: its path; `run_id`: what labels
  end with (`@<run_id>`; apply picks a new one each run).
- `programs`: list of {`name`, `sha256` (hex digest of `text`), `text`}: the long programs the scripts
  below contain, each listed once; a script's `programs` names the ones it contains.
- `targets`: list, one per target, of:
  - `id` (`host` or `host/vmid`), `host`, `container` (name or null), `vmid` (or null).
  - `hops`: the chain from this machine to the target's bash, in order; each {`kind`, `argv`} where kind
    is `local`, `ssh` (plus `user`, `address`, `port`, `identity_file`, `known_hosts`, `connect_timeout`,
    `jump`: the same object for the jump host, or null; `argv`: the OpenSSH options), `sudo`, `pct`
    (plus `vmid`, `pct`), or `bash` (`argv` with `<environment>`, `<script>` and `<label>` holes).
  - `environment`: {name: value}: what `env -i` gives every step's commands; a script's `env_changes`
    says what it has on top (`set`) or lacks (`unset`).
  - `facts_pending`: names of the `auto` variables read from the target first (the plan shows `auto`).
  - `steps`: list of {`index` (0-based), `number` (1-based), `name`, `kind`, `description`, `skipped`
    (why `when` skipped it, or null), `expect` (what its check proves), `timeout` (seconds per command),
    `retries` (extra tries of apply), `retry_delay` (seconds, doubled each try, at most 8 times),
    `scripts`: {phase: script}} for the phases it has: `check`, `fingerprint`, `apply`, `verify`,
    `install` and the transfer phases (`install-dir`, `host-dir`, `push`, `fetch-dir`, `pull`,
    `fetch-cleanup`, `cleanup`).
  - `round_trips`: list, in the order apply sends them, of {`order` (1-based), `what` (`facts`,
    `checks`, `lock-acquire`, `step`, `lock-refresh`, `lock-release`, `host-cleanup`), `step` (index or
    null), `phase`, `when` (in words), `kind` (`command`, or `file` for a copy without a command), `line`
    (the pasteable line, as in the shell format), and, when `step` is null, `script`; a step's round trip
    has its script in that step's `scripts[phase]`}. `file` round trips have `file`: {`via` (`sftp` or
    `copy`), `direction` (`put` to the host, `get` from it), `source`, `destination`}.
  - `transfers`: list of {`order` (of its round trip), `step`, `phase`, `via` (`sftp`, `copy`,
    `pct push`, `pct pull`), `source`, `destination`}: every file that moves.
- a script: {`phase`, `runs_on` (`target`: inside the target's bash; `host`: the host's own shell, for
  transfers), `label` (bash's $0), `timeout` (seconds, or null), `env_changes`: {`set`: {name: value},
  `unset`: [names]}, `stdin`: names of the variables it reads from stdin (secrets, the frame nonce),
  `programs`: names, `script`: the raw text bash reads, `line`: the pasteable command}.

Placeholders: what apply learns only while it runs is written in angle brackets (`<wheel>`, `<sha256>`,
the `XXXXXX` of mktemp directories, the lock owner), so those lines are for reading, not pasting as is.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from fleetcuda.plan.command import (
    BASH,
    DEFAULT_PCT,
    ENV,
    LABEL_ENV,
    TARGET_ENV,
    TIMEOUT,
    BuiltCommand,
    HopChain,
    Invocation,
    SshHop,
    build,
    join,
    join_for_paste,
    quote,
    ssh_argv,
)
from fleetcuda.plan.inventory import Inventory, Target
from fleetcuda.plan.planner import (
    SYSTEM_PATH,
    Plan,
    PlannedStep,
    base_env,
    base_values,
    batch_parts,
    facts_command,
    install_command,
    lock_command,
    make_plan,
    pending_facts,
    vmid_of,
)
from fleetcuda.plan.recipe import Recipe
from fleetcuda.redact import Redactor, url_credentials
from fleetcuda.run.locks import LOCK_REFRESH_S, TargetLock

Format = Literal["human", "shell", "json"]
SCHEMA = "fleetcuda.plan/1"
MAX_LINE = 160
# Where apply's own values are unknown before it runs (see the module docstring).
DEFAULT_LOCK_OWNER = "<user>@<machine> pid <pid> since <time> machine <id> boot <id> start <ticks> pidns <ns>"
DEFAULT_RUN_ID = "00000000"
DEFAULT_NONCE = "0" * 16
TARGET_WHEEL_DIR = "/tmp/fleetcuda-wheel.XXXXXX"
HOST_STAGING_DIR = "/tmp/fleetcuda-push.XXXXXX"
WHEEL = "<wheel>.whl"
CACHED_WHEEL = "<cache>/" + WHEEL  # the control machine's wheel cache (FLEETCUDA_CACHE_DIR)
# A step's own scripts, which share its environment (the transfer phases have fleetcuda's own).
STEP_SCRIPTS = ("check", "fingerprint", "install", "apply", "verify")
# Target-wide round trips sent before any step.
HEAD_SENDS = ("facts", "checks", "lock-acquire", "host-checks")
# Phases of a step that the older dry-run did not show: the shell format's added `# step` headers.
NEW_STEP_PHASES = ("install-dir", "host-dir", "put", "push", "install", "fetch-dir", "pull", "get",
                   "fetch-cleanup", "cleanup")

# The notes of the older dry-run, kept word for word (the shell format's existing lines).
CHECK_NOTE = "exit 0 means already satisfied"
FINGERPRINT_NOTE = ("read-only, if the check fails: the target's ABI fingerprint. A wheel cached for it is pushed and "
                    "installed instead of the apply below; otherwise the first target of a fingerprint runs the apply "
                    "(a wheel build) and the others wait for its wheel")
APPLY_NOTE = "runs only if the check fails"
VERIFY_NOTE = "must pass after apply"


# -- the transfer commands, as connectors/transfer.py builds them (tests compare the two) ------------------

def host_command(target: Target, argv: Sequence[str]) -> BuiltCommand:
    """transfer.on_host: argv on the target's host itself, through its login shell (or locally)."""
    return build(HopChain(ssh=target.chain.ssh), Invocation(join(argv), {"PATH": SYSTEM_PATH, "LANG": "C.UTF-8"}))


def in_target_command(target: Target, script: str, timeout: int = 60) -> BuiltCommand:
    """transfer.in_target: a short script inside the target."""
    return build(target.chain, Invocation(script, {"PATH": SYSTEM_PATH, "LANG": "C.UTF-8"}, timeout=timeout,
                                          label="fleetcuda:transfer"))


def pct_argv(target: Target, *args: str) -> list[str]:
    """transfer._pct: pct on the host, through `sudo -n` where the inventory says so."""
    pct = target.chain.pct
    assert pct is not None
    return (["sudo", "-n", "--"] if pct.sudo else []) + [pct.pct, *args]


# -- what apply sends ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FileCopy:
    via: Literal["sftp", "copy"]
    direction: Literal["put", "get"]
    source: str
    destination: str
    ssh: SshHop | None

    def line(self) -> str:
        """A pasteable equivalent: scp with the SSH transport's options, or a private local copy."""
        if self.ssh is None:
            return join_for_paste(["install", "-m", "0600", "--", self.source, self.destination])
        hop = self.ssh
        host = f"[{hop.address}]" if ":" in hop.address else hop.address
        remote = f"{hop.user}@{host}:"
        argv = ["scp", *_scp_options(ssh_argv(hop)[1:]), "--"]
        if self.direction == "put":
            argv += [self.source, remote + self.destination]
        else:
            argv += [remote + self.source, self.destination]
        return join_for_paste(argv)


def _scp_options(options: list[str]) -> list[str]:
    # scp takes ssh's options but for the port, which is -P.
    return ["-P" if o == "-p" and i + 1 < len(options) and options[i + 1].isdigit() else o
            for i, o in enumerate(options)]


@dataclass
class Send:
    """One round trip of apply: a command (or a file copy), when it is sent, and what for."""

    what: str  # facts, checks, lock-acquire, step, lock-refresh, lock-release, host-cleanup
    phase: str
    when: str
    command: BuiltCommand | None = None
    copy: FileCopy | None = None
    step: PlannedStep | None = None
    runs_on: Literal["target", "host"] = "target"
    title: str = ""  # human: what this block is, beyond its phase
    moves: tuple[str, str] | None = None  # pct push/pull: (source, destination)
    detail: str = ""  # human and json: more on when; the shell format keeps the older dry-run's notes as they were
    refs: dict[str, str] = field(default_factory=dict)  # human: exact text -> what to show instead

    @property
    def line(self) -> str:
        if self.command is not None:
            return self.command.display
        assert self.copy is not None
        return self.copy.line()


@dataclass(frozen=True)
class Parsed:
    """A BuiltCommand's argv taken apart: every command fleetcuda builds ends in target_argv's form."""

    env: dict[str, str]
    timeout: int | None
    script: str
    label: str


def parse_command(cmd: BuiltCommand) -> Parsed:
    argv = list(cmd.argv)
    i = argv.index(ENV) + 2  # past `env -i`
    env: dict[str, str] = {}
    while argv[i] not in (TIMEOUT, BASH):
        name, _, value = argv[i].partition("=")
        if name not in (LABEL_ENV, TARGET_ENV):  # fleetcuda's own marks of the run's processes (lock.sh, stop.sh)
            env[name] = value
        i += 1
    timeout = None
    if argv[i] == TIMEOUT:
        timeout = int(argv[i + 3])
        i += 4
    assert argv[i:i + 4] == [BASH, "--noprofile", "--norc", "-c"], argv[i:i + 4]
    return Parsed(env, timeout, argv[i + 4], argv[i + 5])


_STDIN_READ = re.compile(r"^IFS= read -r -d '' ([A-Za-z_][A-Za-z0-9_]*)$", re.M)


def stdin_names(script: str) -> list[str]:
    """The variables a script reads from stdin (see command.Invocation.full_script)."""
    return _STDIN_READ.findall(script)


@dataclass
class TargetView:
    target: Target
    plan: Plan
    pending: list[str]
    sends: list[Send]
    environment: dict[str, str]
    descriptions: list[str | None]


def plan_target(recipe: Recipe, target: Target, overrides: dict[str, str], home: str | None, *, run_id: str,
                nonce: str, lock: TargetLock) -> TargetView:
    values = base_values(recipe, target, overrides)
    plan = make_plan(recipe, target, values, home, run_id=run_id, nonce=nonce)
    pending = pending_facts(recipe, values)
    sends: list[Send] = []
    if pending:
        sends.append(Send("facts", "read", f"first, before any step: reads {', '.join(pending)} (now 'auto' below); "
                          "read-only", facts_command(recipe, target, values, pending, home, nonce=nonce, run_id=run_id),
                          title="facts: " + ", ".join(f"{n}=auto" for n in pending)))
    every = [(s.index, s.on_host, s.pre_probe) for s in plan.steps if not s.skipped and s.pre_probe is not None]
    probes = [(i, p) for i, on_host, p in every if not on_host]
    host_probes = [(i, p) for i, on_host, p in every if on_host]  # one batch of their own, on the host
    batched = len(probes) >= 2
    vmid = vmid_of(plan)
    numbers = {s.index: s for s in plan.steps}

    def batch_with_refs(probes: list[tuple[int, Invocation]], **kw: object) -> tuple[BuiltCommand, dict[str, str]]:
        command, parts = batch_parts(plan, probes, **kw)  # type: ignore[arg-type]
        refs: dict[str, str] = {}
        for index, part in parts.items():
            step = numbers[index]
            phase = "check" if step.check is not None else "verify"
            refs[part] = (f"<step {index + 1} {step.name}: its {phase}, in a subshell with its own environment, "
                          "variables and secrets, as sent on its own below>")
        return command, refs

    if batched:
        command, refs = batch_with_refs(probes, lock=lock)
        sends.append(Send("checks", "check", "before any step: every step's read-only check (or an assertion "
                          "step's verify) in one round trip, after taking the target's lock; if every check passes "
                          "the lock is released at once. Sent again after a take-over of a lock its dead run left",
                          command, title="checks + lock acquire", refs=refs))
    else:
        sends.append(Send("lock-acquire", "acquire", "before any step: takes the target's lock (again after a "
                          "take-over of a lock its dead run left)", lock_command(plan, lock.acquire(vmid)),
                          title="lock acquire"))
    if len(host_probes) >= 2:
        host_batch, host_refs = batch_with_refs(host_probes, on_host=True)
        sends.append(Send("host-checks", "check", "before any step: the read-only checks of the steps that run on "
                          "the host (on: host), in one round trip there; no lock (the lock is the container's)",
                          host_batch, runs_on="host", title="host checks", refs=host_refs))
    for step in plan.steps:
        if not step.skipped:
            sends += _step_sends(target, step, len(host_probes) >= 2 if step.on_host else batched)
    sends.append(Send("lock-refresh", "refresh", f"every {LOCK_REFRESH_S} s while the lock is held, so that no "
                      "other run takes it over as stale", lock_command(plan, lock.refresh(vmid)), title="lock refresh"))
    sends.append(Send("lock-release", "release", "last, whatever happened (also after Ctrl-C): releases the lock if "
                      "this run holds it", lock_command(plan, lock.release(vmid)), title="lock release"))
    if target.container is not None and target.chain.ssh is not None and any(s.shared for s in plan.steps):
        sends.append(Send("host-cleanup", "cleanup", "at the end of the run, once per host, if a cached wheel was "
                          "uploaded there: removes its staging directory",
                          host_command(target, ["rm", "-rf", "--", HOST_STAGING_DIR]), runs_on="host",
                          title="remove the host's staging directory"))
    step_envs = [parse_command(s.command).env for s in sends
                 if s.what == "step" and s.command is not None and s.runs_on == "target"
                 and s.phase in ("check", "apply", "verify", "fingerprint", "install")]
    # The target's own environment (what every command starts from), then what all of its steps' commands share.
    environment = base_env(target, home)
    environment.update({k: v for k, v in _common(step_envs).items() if k not in environment} if step_envs else {})
    descriptions = [st.description for st in recipe.steps]
    return TargetView(target, plan, pending, sends, environment, descriptions)


def _common(envs: list[dict[str, str]]) -> dict[str, str]:
    first = envs[0]
    return {k: v for k, v in first.items() if all(e.get(k) == v for e in envs[1:])}


def _step_sends(target: Target, step: PlannedStep, batched: bool) -> list[Send]:
    out: list[Send] = []

    def add(phase: str, when: str, command: BuiltCommand, detail: str = "") -> None:
        out.append(Send("step", phase, when, command, step=step, detail=detail,
                        runs_on="host" if step.on_host else "target"))

    in_batch = (f"in the batch of {'host ' if step.on_host else ''}checks above; sent on its own only if an earlier "
                "step changed something" if batched else "sent on its own")
    if step.check is not None:
        add("check", CHECK_NOTE, step.check, in_batch)
    shared = step.shared
    if shared is not None:
        add("fingerprint", FINGERPRINT_NOTE, shared.fingerprint)
        out += _cached_install(target, step)
    if step.apply is not None:
        add("apply", APPLY_NOTE, step.apply)
        if shared is not None:
            out += _publish(target, step)
    if step.verify is not None:
        add("verify", VERIFY_NOTE, step.verify, in_batch if step.apply is None and step.check is None else "")
    return out


def _cached_install(target: Target, step: PlannedStep) -> list[Send]:
    """engine._install_cached: the cached wheel into the target, then its install script."""
    assert step.shared is not None
    cached = "if a wheel is cached for this fingerprint (instead of the apply below)"
    ct_path = f"{TARGET_WHEEL_DIR}/{WHEEL}"
    sends = [Send("step", "install-dir", f"{cached}: a private directory in the target for the wheel",
                  in_target_command(target, f"mktemp -d {TARGET_WHEEL_DIR}"), step=step)]
    if target.container is None:
        via: Literal["sftp", "copy"] = "sftp" if target.chain.ssh else "copy"
        sends.append(Send("step", "put", f"{cached}: the wheel to the host (created 0600)",
                          copy=FileCopy(via, "put", CACHED_WHEEL, ct_path, target.chain.ssh), step=step,
                          runs_on="host"))
    else:
        host_path = CACHED_WHEEL
        if target.chain.ssh is not None:
            host_path = f"{HOST_STAGING_DIR}/{WHEEL}"
            sends.append(Send("step", "host-dir", f"{cached}, once per host and run: a private staging directory "
                              "on the host", host_command(target, ["mktemp", "-d", HOST_STAGING_DIR]), step=step,
                              runs_on="host"))
            sends.append(Send("step", "put", f"{cached}, once per host and run: the wheel to the host over SFTP "
                              "(created 0600)", copy=FileCopy("sftp", "put", CACHED_WHEEL, host_path,
                                                             target.chain.ssh), step=step, runs_on="host"))
        assert target.container is not None
        sends.append(Send("step", "push", f"{cached}: the wheel from the host into the container",
                          host_command(target, pct_argv(target, "push", str(target.container.vmid), host_path, ct_path,
                                                        "--perms", "0600")), step=step, runs_on="host",
                          moves=(host_path, ct_path)))
    install = install_command(target, step, ct_path, "<sha256>", "<fingerprint json>", "<provenance json>")
    sends.append(Send("step", "install", f"{cached}: checks the wheel's sha256 and fingerprint, installs and records "
                      "it (on failure: the apply below builds here)", install, step=step))
    return sends


def _publish(target: Target, step: PlannedStep) -> list[Send]:
    """engine._publish: after a build that shares its wheel, the wheel back to this machine's cache."""
    built = "after the apply (a wheel build) succeeded, if it shares its wheel"
    ct_path = f"{TARGET_WHEEL_DIR}/{WHEEL}"
    sends: list[Send] = []
    if target.container is None:
        via: Literal["sftp", "copy"] = "sftp" if target.chain.ssh else "copy"
        sends.append(Send("step", "get", f"{built}: the wheel to the cache (checked against the sha256 it printed)",
                          copy=FileCopy(via, "get", ct_path, CACHED_WHEEL, target.chain.ssh), step=step,
                          runs_on="host"))
    else:
        staging = HOST_STAGING_DIR if target.chain.ssh else "<local temporary directory>"
        host_path = f"{staging}/{WHEEL}"
        user = target.chain.ssh.user if target.chain.ssh else "<your user>"
        if target.chain.ssh is not None:
            sends.append(Send("step", "fetch-dir", f"{built}: a private staging directory on the host",
                              host_command(target, ["mktemp", "-d", HOST_STAGING_DIR]), step=step, runs_on="host"))
        sends.append(Send("step", "pull", f"{built}: the wheel out of the container, owned by {user}",
                          host_command(target, pct_argv(target, "pull", str(target.container.vmid), ct_path, host_path,
                                                        "--user", user, "--perms", "0600")), step=step,
                          runs_on="host", moves=(ct_path, host_path)))
        via2: Literal["sftp", "copy"] = "sftp" if target.chain.ssh else "copy"
        sends.append(Send("step", "get", f"{built}: the wheel to the cache (checked against the sha256 it printed)",
                          copy=FileCopy(via2, "get", host_path, CACHED_WHEEL, target.chain.ssh), step=step,
                          runs_on="host"))
        if target.chain.ssh is not None:
            sends.append(Send("step", "fetch-cleanup", f"{built}: removes the staging directory",
                              host_command(target, ["rm", "-rf", "--", HOST_STAGING_DIR]), step=step, runs_on="host"))
    sends.append(Send("step", "cleanup", "after the apply (a wheel build), whether or not the wheel was cached: "
                      "removes the wheel's directory in the target",
                      in_target_command(target, f"rm -rf -- {quote(TARGET_WHEEL_DIR)}"), step=step))
    return sends


# -- text helpers ------------------------------------------------------------------------------------------

_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def ascii_line(text: str) -> str:
    """One line of 7-bit text: controls, tabs and newlines escaped, and all that is not ASCII (as the older
    dry-run's _AsciiWriter did: backslashreplace)."""
    out = []
    for c in text:
        if c in _ESCAPES:
            out.append(_ESCAPES[c])
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(c)
    return "".join(out).encode("ascii", "backslashreplace").decode("ascii")


def to_ascii(text: str) -> str:
    return text.encode("ascii", "backslashreplace").decode("ascii")


def wrap(first: str, text: str, more: str, width: int = MAX_LINE) -> list[str]:
    """`first + text`, cut into lines of at most `width`; continuation lines start with `more`."""
    lines, prefix = [], first
    while len(prefix) + len(text) > width:
        room = width - len(prefix)
        lines.append(prefix + text[:room])
        text, prefix = text[room:], more
    lines.append(prefix + text)
    return lines


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _program_forms(programs: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """(text to find, name, digest), the longest first: the program as given, and quoted as a shell word."""
    forms = []
    for name, text in programs.items():
        if text:
            forms.append((text, name, _digest(text)))
            if quote(text) != text:
                forms.append((quote(text), name, _digest(text)))
            # A script inside a JSON argument (the argv a host step's program runs in the container).
            if (escaped := json.dumps(text)[1:-1]) != text:
                forms.append((escaped, name, _digest(text)))
    return sorted(forms, key=lambda f: len(f[0]), reverse=True)


def _with_references(script: str, forms: list[tuple[str, str, str]], used: list[str]) -> str:
    for text, name, digest in forms:
        if text in script:
            script = script.replace(text, f"<program {name} sha256:{digest[:12]}>")
            if name not in used:
                used.append(name)
    return script


def _hop_words(chain: HopChain) -> list[str]:
    words: list[str] = []

    def ssh(hop: SshHop) -> None:
        if hop.jump is not None:
            ssh(hop.jump)
        words.append(f"ssh {hop.user}@{hop.address}" + (f" -p {hop.port}" if hop.port != 22 else ""))

    if chain.ssh is not None:
        ssh(chain.ssh)
    else:
        words.append("this machine")
    if chain.pct is not None:
        if chain.pct.sudo:
            words.append("sudo -n")
        pct = "pct" if chain.pct.pct == DEFAULT_PCT else chain.pct.pct
        words.append(f"{pct} exec {chain.pct.vmid}")
    words.append("env -i <environment> [timeout -k 10 <s>] bash --noprofile --norc -c <script> <label>")
    return words


def _env_changes(env: Mapping[str, str], base: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    return {k: v for k, v in env.items() if base.get(k) != v}, [k for k in base if k not in env]


# -- human -----------------------------------------------------------------------------------------------

def _human(recipe: Recipe, inventory: Inventory, views: list[TargetView], programs: Mapping[str, str],
           run_id: str) -> str:
    forms = _program_forms(programs)
    used: list[str] = []
    # The paths are the user's (any bytes a file name may hold, any length): escaped, and wrapped.
    out = [*wrap("# ", ascii_line(f"fleetcuda apply {recipe.path} --dry-run: {len(views)} target(s) from "
                                  f"{inventory.path}"), "#   "),
           "# Nothing was sent. Below, per target, every round trip apply makes, in order, with the raw script",
           f"# each runs. Labels end in @{run_id}, a new run id each run; secrets are read from stdin, shown ***.",
           "# --format shell prints command lines to paste; --format json the same plan as data."]
    for view in views:
        out += _human_target(view, forms, used)
    if used:
        out += ["", "programs (each once; scripts above refer to them as <program NAME sha256:...>)"]
        for name in used:
            text = programs[name]
            out.append(f"  program {ascii_line(name)} sha256:{_digest(text)}")
            out += _block(text)
    return "\n".join(out) + "\n"


def _human_target(view: TargetView, forms: list[tuple[str, str, str]], used: list[str]) -> list[str]:
    t, redact = view.target, Redactor(view.plan.secrets)

    def line(indent: str, text: str) -> list[str]:
        return wrap(indent, ascii_line(redact(text)), indent + "  + ")

    out = ["", f"target {t.id}" + (f" ({t.name})" if t.name else "")]
    out += line("  ", "hops: " + " -> ".join(_hop_words(t.chain)))
    if t.chain.ssh is not None:
        options = join_for_paste(ssh_argv(t.chain.ssh)[1:])
        out += line("  ", "ssh options (the transport's, as OpenSSH options): " + options)
    out.append("  environment of every step's commands (each script says what it adds or lacks):")
    for k, v in view.environment.items():
        out += line("    ", f"{k}={v}")
    if view.pending:
        out += line("  ", f"read from the target before any step (shown as 'auto' below): {', '.join(view.pending)}")
    number = 0
    total = len(view.plan.steps)
    seen: dict[tuple[str, ...], int] = {}  # a command already shown -> its block number
    by_step: dict[int, list[Send]] = {}
    for send in view.sends:
        if send.step is not None:
            by_step.setdefault(send.step.index, []).append(send)
    # Target-wide round trips before the steps, then the steps in order, then the rest.
    head = [s for s in view.sends if s.step is None and s.what in HEAD_SENDS]
    tail = [s for s in view.sends if s.step is None and s.what not in HEAD_SENDS]
    for send in head:
        number += 1
        out += _human_send(number, send, view, forms, used, redact, seen, view.environment)
    for step in view.plan.steps:
        out.append("")
        out += line("  ", f"step {step.index + 1}/{total} {step.name} ({step.kind})"
                    + (f": skipped ({step.skipped})" if step.skipped else ""))
        if step.skipped:
            continue
        description = view.descriptions[step.index]
        if description:
            out += line("    ", f"description: {description}")
        if step.expect != description:
            out += line("    ", f"proves: {step.expect}")
        retry = (f"apply tried up to {step.retries} more time(s) after a failure (never after a timeout), waiting "
                 f"{step.retry_delay:g} s, doubled each time, at most {step.retry_delay * 8:g} s"
                 if step.retries and step.apply is not None else "no retries")
        out += line("    ", f"timeout {step.timeout} s per command; {retry}")
        if step.apply is not None and step.verify is None and step.check is not None:
            out += line("    ", "after apply, the check is sent again as the verification")
        sends = by_step.get(step.index, [])
        # The step's own environment once (its scripts share it); each script then says only how it differs.
        step_env = next((parse_command(s.command).env for s in sends
                         if s.command is not None and s.phase in STEP_SCRIPTS), view.environment)
        out += _env_lines(step_env, view.environment, lambda text: line("    ", text), "this step's env")
        for send in sends:
            number += 1
            out += _human_send(number, send, view, forms, used, redact, seen, step_env)
    out.append("")
    for send in tail:
        number += 1
        out += _human_send(number, send, view, forms, used, redact, seen, view.environment)
    return out


def _env_lines(env: Mapping[str, str], base: Mapping[str, str], line: Callable[[str], list[str]],
               what: str = "env") -> list[str]:
    added, missing = _env_changes(env, base)
    out = []
    for k, v in added.items():
        out += line(f"{what} {'sets' if k in base else 'adds'} {k}={v}")
    if missing:
        out += line(f"{what} lacks " + ", ".join(missing))
    return out


def _human_send(number: int, send: Send, view: TargetView, forms: list[tuple[str, str, str]], used: list[str],
                redact: Redactor, seen: dict[tuple[str, ...], int], base: Mapping[str, str]) -> list[str]:
    indent = "    " if send.step is not None else "  "

    def line(extra: str, text: str) -> list[str]:
        return wrap(indent + extra, ascii_line(redact(text)), indent + extra + "  + ")

    title = send.title or send.phase
    out = line("", f"[{number}] {title} ({send.when}" + (f"; {send.detail})" if send.detail else ")"))
    if send.copy is not None:
        c = send.copy
        where = f"{c.ssh.user}@{c.ssh.address}" if c.ssh else "this machine"
        how = "SFTP" if c.via == "sftp" else "a private copy (0600)"
        arrow = f"{c.source} -> {where}:{c.destination}" if c.direction == "put" else \
            f"{where}:{c.source} -> {c.destination}"
        out += line("    ", f"file, by {how}: {arrow}")
        return out
    assert send.command is not None
    # A verify that is its step's check (most kinds') is the same command: said, not printed twice.
    if send.command.argv in seen:
        out += line("    ", f"the same command as [{seen[send.command.argv]}]: script, environment, label and timeout")
        return out
    seen[send.command.argv] = number
    parsed = parse_command(send.command)
    on = "on the host, through its login shell" if send.runs_on == "host" else "in the target"
    facts = [f"runs {on}", f"label {parsed.label}", f"timeout {parsed.timeout} s" if parsed.timeout else "no timeout"]
    names = stdin_names(parsed.script)
    if names:
        facts.append("reads from stdin: " + ", ".join(names))
    out += line("    ", "; ".join(facts))
    if send.runs_on == "target":
        out += _env_lines(parsed.env, base, lambda text: line("    ", text))
    else:
        out += line("    ", "env " + " ".join(f"{k}={v}" for k, v in parsed.env.items()))
    script = parsed.script
    for text, ref in send.refs.items():
        script = script.replace(text, ref)
    script = _with_references(script, forms, used)
    out += _block(redact(script), indent + "  ")
    return out


def _block(text: str, indent: str = "    ") -> list[str]:
    """A script, line by line behind a numbered gutter; a wrapped line goes on behind a `+` gutter."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    width = max(3, len(str(len(lines))))
    out = []
    for n, raw in enumerate(lines, 1):
        out += wrap(f"{indent}{n:>{width}} | ", ascii_line(raw), f"{indent}{'+':>{width}} | ")
    return out


# -- summary: the default human view, one screen per plan -------------------------------------------------

SUMMARY_WIDTH = 100


NBSP = "\x00"  # wrap_words: a space no line ends at (ascii_line has escaped every NUL of the values before)


def wrap_words(first: str, text: str, more: str, width: int = SUMMARY_WIDTH) -> list[str]:
    """`first + text` wrapped at spaces (not at NBSP) into lines of at most `width`, continuation lines behind
    `more`. A word longer than a whole line is cut after its last `:` that fits (else `,`, else `/`), else where
    it must."""
    lines: list[str] = []
    line = first
    fresh = True  # nothing but the prefix on `line` yet
    for word in text.split(" "):
        candidate = line + ("" if fresh else " ") + word
        if len(candidate) <= width or fresh and len(line) + len(word) <= width:
            line, fresh = candidate, False
            continue
        if not fresh:
            lines.append(line)
            line, fresh = more, True
        while len(line) + len(word) > width:  # a word no line holds (a long PATH): cut after a `:`, `,` or `/`
            room = max(1, width - len(line))
            cut = next((word.rfind(sep, 0, room) + 1 for sep in ":,/" if word.rfind(sep, 0, room) > 0), room)
            lines.append(line + word[:cut])
            word, line = word[cut:], more
        line, fresh = line + word, False
    lines.append(line)
    return [ln.replace(NBSP, " ") for ln in lines]


def display_values(view: TargetView) -> dict[str, str]:
    """The plan's values with every `auto` fact not yet read as `<name>` (what it reads as in the summary)."""
    from fleetcuda.plan.templating import Unread

    return {**view.plan.values, **{name: Unread(name) for name in view.pending}}


def describe_step(recipe: Recipe, view: TargetView, index: int) -> list[str]:
    """One step of the summary: what it does (its kind's describe()), then how apply treats it, as phrases."""
    from fleetcuda.plan.templating import render as render_raw
    from fleetcuda.steps import StepContext

    spec, planned = recipe.steps[index], view.plan.steps[index]
    if planned.skipped:
        return [f"skipped ({planned.skipped})"]
    values = display_values(view)
    python = "python3" if spec.on == "host" else view.target.python
    what = [spec.describe(StepContext(values, python, recipe.name))]  # type: ignore[attr-defined]
    keyrings = [st.name for st, p in zip(recipe.steps[:index], view.plan.steps, strict=False)
                if st.kind == "apt_keyring" and not p.skipped]
    if spec.kind == "apt_packages" and keyrings:
        what[0] += f"; apt's sources include the repo of step {', '.join(keyrings)}"
    notes: list[str] = []
    if spec.description and spec.kind in ("shell", "program"):  # kinds whose fields say little of what they prove
        notes.append(" ".join(spec.description.split()))
    if spec.on == "host" and spec.kind != "gpu_passthrough":
        notes.append("runs on the host, through its login shell")
    if spec.env:
        notes.append("env " + " ".join(f"{k}={render_raw(str(v), values)}" for k, v in spec.env.items()))
    if spec.satisfied_if:
        notes.append("no change needed if: " + " ".join(render_raw(spec.satisfied_if, values).split()))
    tries = [f"apply retried up to {planned.retries} time(s)"] if planned.retries and planned.apply is not None else []
    if spec.timeout != 1800:
        tries.append(f"timeout {spec.timeout} s")
    if tries:
        notes.append("; ".join(tries))
    return what + notes


def _hop_summary(target: Target) -> str:
    words: list[str] = []

    def ssh(hop: SshHop) -> None:
        if hop.jump is not None:
            ssh(hop.jump)
        words.append(f"ssh {hop.user}@{hop.address}" + (f" -p {hop.port}" if hop.port != 22 else ""))

    if target.chain.ssh is not None:
        ssh(target.chain.ssh)
    else:
        words.append("this machine")
    if target.chain.pct is not None:
        pct = "pct" if target.chain.pct.pct == DEFAULT_PCT else target.chain.pct.pct
        words.append(("sudo -n " if target.chain.pct.sudo else "") + f"{pct} exec {target.chain.pct.vmid}")
    return " -> ".join(words)


def _ssh_summary(target: Target) -> str | None:
    hop = target.chain.ssh
    if hop is None:
        return None
    key = f"key {hop.identity_file}" if hop.identity_file else "the default keys"
    known = f"host keys only from {hop.known_hosts}" if hop.known_hosts else "host keys from the default files"
    return f"ssh to {target.host}: {key}, {known}"


def _summary_body(recipe: Recipe, view: TargetView) -> list[tuple[str, str, str]]:
    """A target's plan in the summary, as (first prefix, text, continuation prefix): everything but its hops,
    so that targets with equal bodies are one group."""
    out: list[tuple[str, str, str]] = []
    env = " ".join(f"{k}={v}" for k, v in view.environment.items())
    out.append(("  ", f"environment: env -i {env}", "    "))
    if view.pending:
        out.append(("  ", "read from the target at run time: " + ", ".join(f"<{n}>" for n in view.pending)
                    + " (the recipe's facts; --var NAME=VALUE sets one)", "    "))
    out.append(("  ", "all checks in one round trip, under the target's lock; a step's apply runs only where its "
                "check failed, then its verify", "    "))
    total = len(view.plan.steps)
    width = len(str(total))
    for step in view.plan.steps:
        lines = describe_step(recipe, view, step.index)
        head = f"  {step.index + 1:>{width}} {step.name}: "
        indent = " " * (len(f"  {total}") + 3)
        out.append((head, lines[0], indent))
        out += [(indent, text, indent + "  ") for text in lines[1:]]
    return out


def _summary(recipe: Recipe, inventory: Inventory, views: list[TargetView], programs: Mapping[str, str],
             width: int = SUMMARY_WIDTH) -> str:
    forms = _program_forms(programs)
    used: list[str] = []
    for v in views:  # the programs apply sends, in the order it first sends them
        for send in v.sends:
            if send.command is not None:
                _with_references(parse_command(send.command).script, forms, used)
    n = len(views)
    out = [*wrap_words("# ", ascii_line(f"fleetcuda apply {recipe.path} --dry-run: {n} target(s) from "
                                        f"{inventory.path}; nothing was sent"), "#   ", width),
           *wrap_words("# ", "--verbose: every command in full; --format shell: lines to paste; --format json: data",
                       "#   ", width)]
    groups: dict[tuple[str, ...], list[TargetView]] = {}
    bodies: dict[tuple[str, ...], list[tuple[str, str, str]]] = {}
    for v in views:
        redact = Redactor(v.plan.secrets)

        def hide(text: str, redact: Redactor = redact) -> str:
            # A password in a URL makes the whole value a secret (planner.Secrets), shown nowhere: the whole URL.
            def word(w: str) -> str:
                name, eq, value = w.partition("=")
                keep = name + eq if eq and not url_credentials(name) and name.isidentifier() else ""
                return keep + "***" if url_credentials(w) else w

            return redact(" ".join(word(w) for w in text.split(" ")))

        # The target's own name (a recipe may pass it: `TARGET: "{{ target }}"`) is no difference between plans.
        body = [(a, ascii_line(hide(text)).replace(v.target.id, "<target>"), c)
                for a, text, c in _summary_body(recipe, v)]
        key = tuple(text for _, text, _ in body)
        groups.setdefault(key, []).append(v)
        bodies[key] = body
    for key, members in groups.items():
        out.append("")

        def name(t: Target) -> str:
            return t.id + (f" ({t.name})" if t.name else "")

        if len(members) == 1:
            t = members[0].target
            out += wrap_words("", ascii_line(f"{name(t)}: {_hop_summary(t)}"), "    ", width)
        else:
            out += wrap_words("", ascii_line(", ".join(m.target.id for m in members) + ": same plan"), "    ", width)
            for m in members:
                out += wrap_words("  ", ascii_line(f"{name(m.target)}: {_hop_summary(m.target)}"), "      ", width)
        seen: set[str] = set()
        for m in members:
            said = _ssh_summary(m.target)
            if said is not None and said not in seen:
                seen.add(said)
                out += wrap_words("  ", ascii_line(said), "    ", width)
        for first, text, more in bodies[key]:
            if len(members) == 1:
                text = text.replace("<target>", members[0].target.id)
            out += wrap_words(first, text, more, width)
    if used:
        out.append("")
        out += wrap_words("", "programs sent, by sha256 (--verbose shows them): " + ", ".join(
            f"{ascii_line(u)}{NBSP}{_digest(programs[u])[:12]}" for u in used), "  ", width)
    return "\n".join(out) + "\n"


# -- shell -----------------------------------------------------------------------------------------------

def _shell(recipe: Recipe, inventory: Inventory, views: list[TargetView]) -> str:
    out = [f"# fleetcuda apply {ascii_line(recipe.path)} --dry-run: {len(views)} target(s) from "
           f"{ascii_line(inventory.path)}",
           "# Each command line below can be pasted into bash or zsh; apply sends exactly these, but for the",
           "# run id in labels (@...) and the frame nonce, which are new each run. Secrets are read from stdin.",
           "#   Lines in <angle brackets> are known only while apply runs (a wheel, its sha256, mktemp's XXXXXX).",
           "#   Scripts that frame their output read the frame nonce from stdin: printf '%s\\0' NONCE | <line>."]
    for view in views:
        out += _shell_target(view)
    return to_ascii("\n".join(out) + "\n")


def _shell_target(view: TargetView) -> list[str]:
    t, redact = view.target, Redactor(view.plan.secrets)
    out = ["", f"# target {t.id}{f' ({t.name})' if t.name else ''}"]
    for name in view.pending:
        out.append(f"# {name}=auto is read from the target at run time; commands below show it as 'auto'"
                   f" (pass --var {name}=X, or use --check to see them resolved)")
    total = len(view.plan.steps)
    by_step: dict[int, list[Send]] = {}
    for send in view.sends:
        if send.step is not None:
            by_step.setdefault(send.step.index, []).append(send)
    for send in [s for s in view.sends if s.step is None and s.what in HEAD_SENDS]:
        out += [f"# round trip {send.what} ({ascii_line(send.when)})", redact(send.line)]
    for step in view.plan.steps:
        head = f"# step {step.index + 1}/{total} {step.name} ({step.kind})"
        if step.skipped:
            out.append(f"{head}: skipped ({step.skipped})")
            continue
        for send in by_step.get(step.index, []):
            out += [f"{head}: {send.phase} ({ascii_line(send.when)})", redact(send.line)]
            if send.phase == "apply" and step.retries:
                out.append(f"#   (the apply above is tried up to {step.retries} more time(s) after a failure, "
                           f"never after a timeout, waiting {step.retry_delay:g} s, doubled each time, at most "
                           f"{step.retry_delay * 8:g} s)")
        if step.apply is not None and step.verify is None and step.check is not None:
            out.append("#   (after apply, the check above is sent again as the verification)")
    for send in [s for s in view.sends if s.step is None and s.what not in HEAD_SENDS]:
        out += [f"# round trip {send.what} ({ascii_line(send.when)})", redact(send.line)]
    return out


# -- json ------------------------------------------------------------------------------------------------

def _json(recipe: Recipe, inventory: Inventory, views: list[TargetView], programs: Mapping[str, str],
          run_id: str) -> str:
    forms = _program_forms(programs)
    used: list[str] = []
    targets = [_json_target(v, forms, used) for v in views]
    doc = {
        "schema": SCHEMA,
        "recipe": {"path": recipe.path, "name": recipe.name},
        "inventory": inventory.path,
        "run_id": run_id,
        "programs": [{"name": n, "sha256": _digest(programs[n]), "text": programs[n]} for n in used],
        "targets": targets,
    }
    return json.dumps(doc, indent=1, ensure_ascii=True) + "\n"


def _json_hops(chain: HopChain) -> list[dict[str, object]]:
    def ssh(hop: SshHop) -> dict[str, object]:
        return {"kind": "ssh", "user": hop.user, "address": hop.address, "port": hop.port,
                "identity_file": hop.identity_file, "known_hosts": hop.known_hosts,
                "connect_timeout": hop.connect_timeout, "jump": ssh(hop.jump) if hop.jump else None,
                "argv": ssh_argv(hop)}

    hops: list[dict[str, object]] = [ssh(chain.ssh) if chain.ssh else {"kind": "local", "argv": []}]
    if chain.pct is not None:
        if chain.pct.sudo:
            hops.append({"kind": "sudo", "argv": ["sudo", "-n", "--"]})
        hops.append({"kind": "pct", "vmid": chain.pct.vmid, "pct": chain.pct.pct,
                     "argv": [chain.pct.pct, "exec", str(chain.pct.vmid), "--"]})
    hops.append({"kind": "bash", "argv": [ENV, "-i", "<environment>", BASH, "--noprofile", "--norc", "-c", "<script>",
                                          "<label>"]})
    return hops


def _json_script(send: Send, view: TargetView, redact: Redactor, forms: list[tuple[str, str, str]],
                 used: list[str]) -> dict[str, object]:
    assert send.command is not None
    parsed = parse_command(send.command)
    names: list[str] = []
    _with_references(parsed.script, forms, names)
    for n in names:
        if n not in used:
            used.append(n)
    added, missing = _env_changes(parsed.env, view.environment)
    return {"phase": send.phase, "runs_on": send.runs_on, "label": parsed.label, "timeout": parsed.timeout,
            "env_changes": {"set": {k: redact(v) for k, v in added.items()}, "unset": missing},
            "stdin": stdin_names(parsed.script), "programs": names, "script": redact(parsed.script),
            "line": redact(send.line)}


def _json_target(view: TargetView, forms: list[tuple[str, str, str]], used: list[str]) -> dict[str, object]:
    t, redact = view.target, Redactor(view.plan.secrets)
    steps: list[dict[str, object]] = []
    for step in view.plan.steps:
        steps.append({"index": step.index, "number": step.index + 1, "name": step.name, "kind": step.kind,
                      "description": redact(view.descriptions[step.index] or ""), "skipped": step.skipped,
                      "expect": redact(step.expect), "timeout": step.timeout, "retries": step.retries,
                      "retry_delay": step.retry_delay, "runs_on": "host" if step.on_host else "target",
                      "scripts": {}})
    round_trips: list[dict[str, object]] = []
    transfers: list[dict[str, object]] = []
    for order, send in enumerate(view.sends, 1):
        trip: dict[str, object] = {"order": order, "what": send.what,
                                   "step": send.step.index if send.step else None, "phase": send.phase,
                                   "when": redact(send.when + (f"; {send.detail}" if send.detail else "")),
                                   "kind": "command" if send.command else "file",
                                   "line": redact(send.line)}
        if send.command is not None:
            script = _json_script(send, view, redact, forms, used)
            if send.step is None:
                trip["script"] = script
            else:
                steps[send.step.index]["scripts"][send.phase] = script  # type: ignore[index]
            if send.moves is not None:
                transfers.append({"order": order, "step": send.step.index if send.step else None,
                                  "phase": send.phase, "via": f"pct {send.phase}", "source": send.moves[0],
                                  "destination": send.moves[1]})
        else:
            assert send.copy is not None
            c = send.copy
            trip["file"] = {"via": c.via, "direction": c.direction, "source": c.source, "destination": c.destination}
            transfers.append({"order": order, "step": send.step.index if send.step else None, "phase": send.phase,
                              "via": c.via, "source": c.source, "destination": c.destination})
        round_trips.append(trip)
    return {"id": t.id, "host": t.host, "container": t.name, "vmid": t.container.vmid if t.container else None,
            "hops": _json_hops(t.chain), "environment": {k: redact(v) for k, v in view.environment.items()},
            "facts_pending": view.pending, "steps": steps, "round_trips": round_trips, "transfers": transfers}


# -- entry point -----------------------------------------------------------------------------------------

def render(fmt: Format, recipe: Recipe, inventory: Inventory, targets: list[Target], overrides: dict[str, str],
           home: Callable[[Target], str | None], programs: Mapping[str, str] = {}, run_id: str | None = None,
           nonce: str | None = None, *, lock_owner: str = DEFAULT_LOCK_OWNER, lock_wait_s: int = 0,
           verbose: bool = False, width: int = SUMMARY_WIDTH) -> str:
    """The dry-run of `apply` for these targets, as `fmt` (see the module docstring). `home` gives a target's
    HOME where the planner's default is wrong (a local host: this user's); `programs` maps a name to a long
    program's exact text as scripts contain it; `run_id`, `nonce`, `lock_owner` and `lock_wait_s` are apply's
    (new each run: fixed placeholders when not given)."""
    if fmt not in ("human", "shell", "json"):
        raise ValueError(f"unknown dry-run format {fmt!r}: expected human, shell or json")
    run = run_id or DEFAULT_RUN_ID
    lock = TargetLock(lock_owner, wait_s=lock_wait_s, run_id=run)
    views = [plan_target(recipe, t, overrides, home(t), run_id=run, nonce=nonce or DEFAULT_NONCE, lock=lock)
             for t in targets]
    if fmt == "shell":
        return _shell(recipe, inventory, views)
    if fmt == "json":
        return _json(recipe, inventory, views, programs, run)
    if verbose:
        return _human(recipe, inventory, views, programs, run)
    return _summary(recipe, inventory, views, programs, width)
