"""Planner: recipe + target + variables -> the exact commands of every step, with no I/O.

Dry-run prints exactly these commands; apply, --check and verify send exactly these commands.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from urllib.parse import unquote

from fleetcuda.plan.command import (
    SUDO,
    BuiltCommand,
    HopChain,
    Invocation,
    _check_env_name,
    build,
    internal_label,
    quote,
    step_label,
)
from fleetcuda.plan.inventory import Target
from fleetcuda.plan.recipe import AUTO, Recipe, check_fact_value
from fleetcuda.plan.templating import FILTERS, TemplateError, check_value, render, render_shell, scrub
from fleetcuda.redact import MIN_SECRET, SECRET_NAME, remember, url_credentials
from fleetcuda.remote import PY_DELIMITER, framing, program
from fleetcuda.run.locks import LOCK_STALE_S, TargetLock
from fleetcuda.steps import Scripts, StepContext, StepSpec
from fleetcuda.steps.base import INSTALL_VARS

__all__ = ["LOCK_STALE_S", "TargetLock"]

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
FALSY = {"", "0", "false", "no", "off", "none"}


@dataclass(frozen=True)
class SharedPlan:
    """A step whose wheel is built once per ABI fingerprint (see steps.base.SharedBuild), as exact commands.
    `install` is complete but for the run-time values INSTALL_VARS names (see install_command)."""

    package: str
    version: str
    fingerprint: BuiltCommand
    build: BuiltCommand
    install: Invocation


@dataclass(frozen=True)
class PlannedStep:
    index: int
    name: str
    kind: str
    skipped: str | None  # why `when` skipped it
    check: BuiltCommand | None = None
    apply: BuiltCommand | None = None
    verify: BuiltCommand | None = None
    timeout: int = 1800
    retries: int = 0
    retry_delay: float = 5.0
    expect: str = ""  # what the check proves, in words, for reports
    # The read-only conditions as they run inside the target, what batches of checks are made of:
    # before apply (the check; the verify of an assertion step) and for `verify` (verify, else check).
    pre_probe: Invocation | None = None
    verify_probe: Invocation | None = None
    shared: SharedPlan | None = None
    # `on: host` for a target in a container: its commands run on the host (host_chain), not in the container.
    on_host: bool = False
    summary: str = ""  # what it does, in an operator's words (its kind's describe()): what --check says would run
    # Why the step could not be planned with the values read from the target (a fact that reads `none`): said
    # when the step is reached, so that an earlier step that explains it (a preflight) speaks first.
    unplanned: str | None = None


@dataclass(frozen=True)
class Plan:
    """A target's whole plan, as data: made once (and once more when `auto` facts have been read), then only
    read: by apply, --check, verify, the dry-run views and the export."""

    target: Target
    values: Mapping[str, str]
    steps: tuple[PlannedStep, ...] = ()
    unresolved: tuple[str, ...] = ()  # `auto` vars not yet read from the target
    home: str = "/root"
    secrets: tuple[str, ...] = ()  # values never printed nor put on a command line
    run_id: str = ""  # in every label: what Ctrl-C stops is this run's, never another's
    nonce: str = ""  # in every frame fleetcuda's own shell prints (see framing)


def install_command(target: Target, step: PlannedStep, wheel: str, sha256: str, fingerprint_json: str,
                    provenance_json: str) -> BuiltCommand:
    """A shared build's install of a cached wheel, for this run's wheel: its planned script, given the
    run-time values in the shell variables it reads (public: paths, digests, versions)."""
    assert step.shared is not None
    inv = step.shared.install
    values = dict(zip(INSTALL_VARS, (wheel, sha256, fingerprint_json, provenance_json), strict=True))
    return build(target.chain, replace(inv, shell_vars={**inv.shell_vars, **values}))


def base_values(recipe: Recipe, target: Target, overrides: dict[str, str]) -> dict[str, str]:
    values = dict(recipe.defaults)
    values.update(target.vars)
    values.update(overrides)
    values.update({
        "target": target.id,
        "host": target.host,
        "vmid": str(target.container.vmid) if target.container else "",
        "container": target.name or "",
        "venv": target.venv or "",
        "python": target.python,
    })
    return values


def pending_facts(recipe: Recipe, values: dict[str, str]) -> list[str]:
    return [name for name in recipe.facts if values.get(name) == AUTO]


def home_of(target: Target) -> str:
    if target.container is not None or target.spec.user == "root":
        return "/root"
    return f"/home/{target.spec.user}"


def host_chain(target: Target) -> HopChain:
    """Where a step with `on: host` runs: the target's host, through the same SSH hop (or locally), no pct."""
    return HopChain(ssh=target.chain.ssh)


def host_env(target: Target) -> dict[str, str]:
    """A host step's environment: the SSH user's home, nothing of the container's venv."""
    home = "/root" if target.spec.user == "root" else f"/home/{target.spec.user}"
    return {"HOME": home, "LANG": "C.UTF-8", "PATH": SYSTEM_PATH}


def in_target_argv(target: Target, label: str) -> Callable[[str], list[str]]:
    """For a host step: the argv, run on the host without a shell, that runs a script inside the target
    (`[sudo -n] pct exec VMID -- env -i ... bash -c SCRIPT LABEL`, as every step's command; without containers
    just the `env -i ... bash -c`)."""
    def argv(script: str) -> list[str]:
        env = {"HOME": "/root", "LANG": "C.UTF-8", "PATH": SYSTEM_PATH}
        inv = Invocation(script, env, timeout=120, label=label)
        return list(build(HopChain(pct=target.chain.pct), inv).argv)
    return argv


def pct_argv(target: Target) -> Callable[[str], list[str]] | None:
    pct = target.chain.pct
    if pct is None:
        return None
    return lambda command: [*([SUDO, "-n", "--"] if pct.sudo else []), pct.pct, command, str(pct.vmid)]


def base_env(target: Target, home: str | None = None) -> dict[str, str]:
    env = {"HOME": home or home_of(target), "LANG": "C.UTF-8", "PATH": SYSTEM_PATH}
    if target.venv:
        env["VIRTUAL_ENV"] = target.venv
        env["PATH"] = f"{target.venv}/bin:{SYSTEM_PATH}"
    return env


class Secrets:
    """Which variables and values are secret: variables the recipe lists under `secrets:` or whose names
    look like one (token, password, ...), environment variables named like one, and any value that holds
    a secret value."""

    def __init__(self, recipe: Recipe, values: Mapping[str, str]):
        self.names = {k for k in values if SECRET_NAME.search(k)} | set(getattr(recipe, "secrets", ()))
        self.values: set[str] = {values[k] for k in self.names if k in values and len(values[k]) >= MIN_SECRET}
        for k, v in [*recipe.env.items(), *((k, v) for st in recipe.steps for k, v in st.env.items())]:
            if SECRET_NAME.search(k) and isinstance(v, str) and len(v) >= MIN_SECRET and "{{" not in v:
                self.values.add(v)  # a literal secret in an `env:`
        for v in [*values.values(), *(v for k, v in recipe.env.items()),
                  *(v for st in recipe.steps for v in st.env.values())]:
            self.add_url_credentials(v)  # a password in a URL is a secret whatever its variable is named
        for value in list(self.values):  # what `{{ x | dashed }}` makes of a secret is one too
            self.values.update(f(value) for f in FILTERS.values() if len(f(value)) >= MIN_SECRET)
        remember(self.values)  # whatever error reaches the CLI's boundary (a check of a value quoting it) masks them

    def is_secret(self, name: str, value: str) -> bool:
        if SECRET_NAME.search(name) or name in self.names:
            self.add(value)
            return True
        return any(s in value for s in self.values)

    def pieces(self) -> list[str]:
        """The secrets, and the parts of them that quoting leaves verbatim in a script (between quotes,
        on one line), long enough to be worth hiding."""
        out = set(self.values)
        for value in self.values:
            out.update(p for p in re.split(r"['\r\n]", value) if len(p) >= MIN_SECRET)
        return sorted(out, key=len, reverse=True)

    def add_url_credentials(self, text: object) -> None:
        if isinstance(text, str):
            for c in url_credentials(text):
                self.add(c.password)
                self.add(unquote(c.password))  # as a tool that decodes it (`p%22ss`) would print it

    def add(self, value: str) -> None:
        if len(value) >= MIN_SECRET:
            self.values.add(value)
            remember((value,))


def invocation(script: str, env: Mapping[str, str], shell_vars: Mapping[str, str], sources: Mapping[str, str],
               secrets: Secrets, *, timeout: int | None, label: str) -> Invocation:
    """An Invocation whose secret values (in the environment or in {{ }} variables) travel on stdin."""
    public_env, secret_env, public_vars, secret_vars = {}, {}, {}, {}
    # A secret a step kind put into the script's text (a token in an index URL): a variable read from stdin.
    secrets.add_url_credentials(script)  # a password in a URL a step kind or the recipe wrote into the script
    script, spliced = scrub(script, secrets.pieces())
    secret_vars.update(spliced)
    for k, v in env.items():
        (secret_env if secrets.is_secret(k, v) else public_env)[k] = v
    for k, v in shell_vars.items():
        if f"${{{k}}}" not in script:  # only what this script refers to
            continue
        (secret_vars if secrets.is_secret(sources.get(k, k), v) else public_vars)[k] = v
    return Invocation(script, public_env, timeout, label, public_vars, secret_env, secret_vars)


def facts_command(recipe: Recipe, target: Target, values: dict[str, str], names: list[str],
                  home: str | None = None, *, nonce: str, run_id: str = "") -> BuiltCommand:
    """One read-only round trip that prints every pending fact, framed (see framing)."""
    parts, shell_vars, sources = [], {}, {}
    for name in names:
        try:
            body = render_shell(recipe.facts[name], values)
        except TemplateError as exc:
            raise recipe.source.error(("facts", name), str(exc)) from None
        shell_vars.update(body.vars)
        sources.update(body.names)
        # stderr stays out of the value: a library's warning must not become a version number.
        # (Its last line out of its last 64 KiB: `tail -n 1` alone holds an endless line whole.)
        parts.append(f"{framing.frame('fact', name)}\n( {body.text}\n) 2>/dev/null </dev/null | tail -c {CHECK_TAIL} "
                     f"| tail -n 1 | {framing.PAYLOAD}")
    inv = invocation("\n".join(parts), base_env(target, home), shell_vars, sources, Secrets(recipe, values),
                     timeout=120, label=internal_label("facts", run_id))
    cmd = build(target.chain, replace(inv, secret_vars={**framing.nonce_vars(nonce), **inv.secret_vars}))
    return replace(cmd, output_keep=64 * 1024 + len(names) * (2 * CHECK_TAIL + 1024))


def fact_values(output: str, nonce: str) -> dict[str, str]:
    """What the facts printed, as they printed it (unchecked)."""
    return {r.name: r.value for r in framing.read(output, nonce) if isinstance(r, framing.FactRecord)}


def parse_facts(output: str, names: list[str], nonce: str, recipe: Recipe | None = None) -> dict[str, str]:
    """The facts' values; a fact the recipe treats as secret (`secrets:`, or named like one) is never quoted."""
    found = fact_values(output, nonce)
    secret = {n for n in names if SECRET_NAME.search(n) or n in getattr(recipe, "secrets", ())}
    remember(found[n] for n in secret if n in found)  # masked wherever a message of this command quotes it
    missing = [n for n in names if not found.get(n)]
    if missing:
        raise TemplateError(f"could not read {', '.join(missing)} from the target (is the venv's torch there?)")
    return {n: check_fact_value(n, found[n], secret=n in secret) for n in names}


def make_plan(recipe: Recipe, target: Target, values: dict[str, str], home: str | None = None, *,
              run_id: str = "", nonce: str | None = None, defer_step_errors: bool = False) -> Plan:
    """`defer_step_errors`: a step that cannot be planned with these values (facts read from the target) is
    planned as `unplanned`, with the error, instead of failing the whole plan before any step has run."""
    nonce = nonce or framing.new_nonce()
    secrets = Secrets(recipe, values)
    recipe_env = {k: _render(recipe, ("env", k), v, values) for k, v in recipe.env.items()}
    for k, v in recipe_env.items():
        _check(recipe, ("env", k), f"env {k}", v)
    env = {**base_env(target, home), **recipe_env}
    exports: dict[str, str] = {}
    prepend: list[str] = []
    steps: list[PlannedStep] = []
    for i, step in enumerate(recipe.steps):
        skip = _skip_reason(recipe, i, step.when, values)
        planned = PlannedStep(i, step.name, step.kind, skip, timeout=step.timeout,
                              retries=step.retries, retry_delay=step.retry_delay)
        if skip:
            steps.append(planned)
            continue
        label = step_label(step.name, run_id)
        on_host = step.on == "host" and target.chain.pct is not None  # without containers, host == target
        chain = host_chain(target) if on_host else target.chain
        ctx = StepContext(values, "python3" if on_host else target.python, recipe.name)
        if step.on == "host":
            ctx.in_target, ctx.pct = in_target_argv(target, label), pct_argv(target)
        try:
            scripts = step.scripts(ctx)  # type: ignore[attr-defined]
            if step.satisfied_if:
                try:
                    condition = ctx.shell(step.satisfied_if)
                except TemplateError as exc:
                    raise recipe.source.error(recipe.step_loc(i, "satisfied_if"), str(exc)) from None
                scripts = _or_satisfied(scripts, condition)
        except (TemplateError, ValueError) as exc:
            error = recipe.source.error(recipe.step_loc(i), f"{exc} (target {target.id})")
            if not defer_step_errors:
                raise error from None
            steps.append(replace(planned, unplanned=str(error)))
            continue
        if on_host and (scripts.shared is not None or scripts.exports or scripts.path_prepend):
            raise recipe.source.error(recipe.step_loc(i, "on"), "a step on the host cannot build a shared wheel "
                                      "nor export variables to the container's steps")
        step_env = {k: _render(recipe, recipe.step_loc(i, "env") + (k,), str(v), values)
                    for k, v in step.env.items()}
        for k, v in [*step_env.items(), *scripts.exports.items()]:
            _check(recipe, recipe.step_loc(i, "env") + (k,), f"env {k}", v)
        exports.update(scripts.exports)
        prepend = scripts.path_prepend + [p for p in prepend if p not in scripts.path_prepend]
        full_env = {**env, **exports, **step_env}
        if prepend:
            full_env["PATH"] = ":".join(prepend) + ":" + full_env["PATH"]
        if on_host:  # the host's own environment, cleared the same way: nothing of the container's
            full_env = {**host_env(target), **recipe_env, **step_env}

        def inv(script: str, step: StepSpec = step, env: dict[str, str] = full_env, ctx: StepContext = ctx,
                label: str = label) -> Invocation:
            made = invocation(script, env, ctx.shell_vars, ctx.sources, secrets, timeout=step.timeout, label=label)
            return framing.with_nonce(made, nonce)  # a step script that prints frames (a shared build's)

        def cmd(script: str | None, inv: Callable[[str], Invocation] = inv,
                chain: HopChain = chain) -> BuiltCommand | None:
            return build(chain, inv(script)) if script is not None else None

        apply = scripts.apply
        if apply is not None and step.kind == "shell":
            apply = "set -e -o pipefail\n" + apply
        shared = None
        if scripts.shared is not None:
            sb = scripts.shared
            shared = SharedPlan(sb.package, sb.version, cmd(sb.fingerprint), cmd(sb.build),  # type: ignore[arg-type]
                                inv(sb.install))
        pre = scripts.check if scripts.check is not None else (scripts.verify if apply is None else None)
        post = scripts.verify if scripts.verify is not None else scripts.check
        steps.append(replace(
            planned, check=cmd(scripts.check), apply=cmd(apply), verify=cmd(scripts.verify),
            expect=scripts.expect or step.description or "exit 0", shared=shared,
            pre_probe=inv(pre) if pre is not None else None, verify_probe=inv(post) if post is not None else None,
            on_host=on_host, summary=step.describe(ctx)))
    return Plan(target, MappingProxyType(dict(values)), tuple(steps), unresolved=tuple(pending_facts(recipe, values)),
                home=home or home_of(target), secrets=tuple(sorted(secrets.values, key=len, reverse=True)),
                run_id=run_id, nonce=nonce)


@dataclass(frozen=True)
class RunPlan:
    """Every target's plan for one run, made before anything runs (bad input is found here), with the run's id
    and nonce. A target with `auto` facts is planned once more, by the engine, after reading them."""

    run_id: str
    nonce: str
    plans: Mapping[str, Plan]  # by target id


def plan_run(recipe: Recipe, targets: list[Target], overrides: dict[str, str],
             home: Callable[[Target], str | None], run_id: str, nonce: str) -> RunPlan:
    plans = {t.id: make_plan(recipe, t, base_values(recipe, t, overrides), home(t), run_id=run_id, nonce=nonce)
             for t in targets}
    return RunPlan(run_id, nonce, MappingProxyType(plans))


def lock_command(plan: Plan, script: str) -> BuiltCommand:
    env = {"PATH": SYSTEM_PATH, "LANG": "C.UTF-8", "HOME": plan.home}
    return build(plan.target.chain, Invocation(script, env, timeout=3600, label=internal_label("lock", plan.run_id),
                                               secret_vars=framing.nonce_vars(plan.nonce)))


def vmid_of(plan: Plan) -> int | None:
    return plan.target.container.vmid if plan.target.container else None


# Milliseconds since the epoch into $fc_m: bash 5's EPOCHREALTIME costs no process; older bash forks date.
_CLOCK = ('if [ -n "${EPOCHREALTIME:-}" ]; then fc_ms() { fc_m=${EPOCHREALTIME/[.,]/}; fc_m=$(( fc_m / 1000 )); }\n'
          'else fc_ms() { fc_m=$(date +%s%3N); }; fi')
# The batch shell's own names, removed in each check's subshell before the check's own are set.
_BATCH_NAMES = "fc_m fc_t fc_rc fc_d all_ok"
# The batch shell's environment; a check's is exactly what it names (and PWD, SHLVL, as a new bash has).
_BASH_EXPORTS = "PATH LANG HOME"


# What the batch keeps of a check's output (issue 22.3): its first CHECK_HEAD and last CHECK_TAIL bytes, and how
# many were between ("[... N bytes dropped ...]" in their place). The check writes into a pipe, never into
# this shell's memory: fc_cap keeps the head (bash's read) and the tail (tail -c) in files of a private
# directory (dd counts what follows the head), fc_show prints them as payload lines, with builtins. Without a
# directory, the head only, printed at once. The directory is removed however the batch ends (a check's
# subshell resets these traps: it shows none).
CHECK_HEAD = 64 * 1024
CHECK_TAIL = 64 * 1024
_CAP = f"""fc_d=$(mktemp -d "${{TMPDIR:-/tmp}}/fleetcuda-out.XXXXXX" 2>/dev/null) || fc_d=
trap 'rm -rf "$fc_d"' EXIT; trap 'exit 143' TERM; trap 'exit 129' HUP
fc_cap() {{
  if [ -n "$fc_d" ]; then
    local LC_ALL=C fc_x  # (the head by bash's read: no process for what most checks print)
    if IFS= read -r -d '' -N {CHECK_HEAD} fc_x; then
      printf '%s' "$fc_x" >"$fc_d/h"
      dd bs=65536 2>"$fc_d/n" | tail -c {CHECK_TAIL} >"$fc_d/t"
    else
      printf '%s' "$fc_x" >"$fc_d/h"; : >"$fc_d/t"
    fi
  else
    {{ head -c {CHECK_HEAD}; cat >/dev/null; }} | sed 's/^/| /'
  fi
}}
fc_show() {{
  [ -n "$fc_d" ] || return 0
  local LC_ALL=C fc_n=0 fc_a fc_b fc_x fc_l fc_r
  mapfile fc_l <"$fc_d/h"; mapfile fc_r <"$fc_d/t"
  if [ "${{#fc_r[@]}}" -gt 0 ]; then
    while read -r fc_a fc_b fc_x; do [[ $fc_b == byte* ]] && fc_n=$fc_a; done <"$fc_d/n"
    if [ "$fc_n" -gt {CHECK_TAIL} ]; then
      fc_n=$(( fc_n - {CHECK_TAIL} ))
      if [ "${{#fc_r[@]}}" -gt 1 ]; then fc_n=$(( fc_n + ${{#fc_r[0]}} )); fc_r=("${{fc_r[@]:1}}"); fi
      [[ ${{fc_l[-1]}} == *$'\\n' ]] || fc_l[-1]+=$'\\n'
      fc_l+=("[... $fc_n bytes dropped ...]"$'\\n')
    elif [[ ${{fc_l[-1]}} != *$'\\n' ]]; then
      fc_l[-1]+=${{fc_r[0]}}; fc_r=("${{fc_r[@]:1}}")
    fi
    fc_l+=("${{fc_r[@]}}")
  fi
  while [ "${{#fc_l[@]}}" -gt 0 ] && [ "${{fc_l[-1]}}" = $'\\n' ]; do unset 'fc_l[-1]'; done
  [ "${{#fc_l[@]}}" -eq 0 ] || printf '| %s' "${{fc_l[@]}}"
}}"""


# The client of remote/pyserver.py: `fc_py N ARGV...` runs `python ARGV` in interpreter server N (a fork of an
# interpreter that has imported torch), with this shell's environment, directory and streams; when the server
# cannot (or is gone), the real interpreter runs instead. Builtins only, except compgen's one fork and mkfifo.
_PY_CLIENT = r"""fc_py() {
  local - IFS=$' \t\n' fc_n=$1 fc_v fc_fd fc_q fc_r fc_um fc_state= fc_tok fc_me=$BASHPID; shift
  set +x  # (local -: the check's own options come back on return) no trace of the environment sent below
  fc_q="$fc_pyd/q.$BASHPID"; fc_r="$fc_pyd/r.$BASHPID"
  if builtin kill -0 "${fc_pypid[fc_n]}" 2>/dev/null && command mkfifo -m 600 "$fc_r" 2>/dev/null; then
    fc_um=$(builtin umask)
    fc_tok=${SRANDOM:-$RANDOM}${RANDOM}$BASHPID  # the server's answers to this call carry it; other lines are not
    builtin umask 077  # the request holds the check's environment: private, as the directory is
    { builtin printf '%s\0' "$fc_tok" "$fc_um" "$#" "$@"
      for fc_v in $(builtin compgen -e); do builtin printf '%s\0' "$fc_v=${!fc_v}"; done
      builtin printf '%s\0' "_=${fc_pyexe[fc_n]}"; } >"$fc_q"  # what bash puts in $_ for a command it runs
    builtin umask "$fc_um"
    builtin exec {fc_fd}<>"$fc_r"
    # From a subshell: the server reopens this shell's stdout, which a redirection here changes meanwhile.
    ( builtin printf '%s %s\n' "$fc_me" "$fc_tok" >"$fc_pyd/in.$fc_n" )
    while :; do
      if [[ -z $fc_state ]] && ! [[ -p $fc_pyd/in.$fc_n ]]; then fc_v=fallback; break; fi
      if IFS= builtin read -r -t 1 -u "$fc_fd" fc_v; then
        [[ $fc_v == fallback ]] && break  # (untokened: whoever says it, the real interpreter runs)
        [[ $fc_v == "$fc_tok "* ]] || continue
        fc_v=${fc_v#"$fc_tok "}
        [[ $fc_v == started ]] || break
        fc_state=started
      elif ! builtin kill -0 "${fc_pypid[fc_n]}" 2>/dev/null; then
        # Gone before it started this command: the real interpreter runs it; after: it is not run twice.
        if [[ $fc_state == started ]]; then fc_v=lost; else fc_v=fallback; fi
        break
      elif [[ -e $fc_pyd/s.$fc_tok ]]; then
        # The server also leaves its answer in a file: a line lost on the FIFO costs a second, not a hang.
        IFS= builtin read -r fc_v <"$fc_pyd/s.$fc_tok"
        break
      elif [[ -e $fc_pyd/t.$fc_tok ]]; then
        fc_state=started
      elif [[ -z $fc_state ]]; then
        # Not started yet (the server busy importing torch, or the request not seen): say it again; the server
        # takes each token once.
        ( builtin printf '%s %s\n' "$fc_me" "$fc_tok" >"$fc_pyd/in.$fc_n" )
      fi
    done
    builtin exec {fc_fd}<&-
    command rm -f "$fc_q" "$fc_r" "$fc_pyd/s.$fc_tok" "$fc_pyd/t.$fc_tok"
    [[ $fc_v == fallback || $fc_v == lost || $fc_v =~ ^[0-9]+$ ]] || fc_v=lost  # never `return` a non-number
    case $fc_v in
      fallback) ;;
      lost) builtin printf 'fleetcuda: the interpreter server ended while it ran this command\n' >&2; return 125 ;;
      *) return "$fc_v" ;;
    esac
  fi
  command "${fc_pyexe[fc_n]}" "$@"
}"""
# A Python path that can name a shell function (what the batch defines to send its calls to a server).
_FUNCTION_PATH = re.compile(r"/[A-Za-z0-9_./+-]+\Z")


def _server_pythons(plan: Plan, probes: list[tuple[int, Invocation]]) -> list[str]:
    """The Pythons this batch's checks run by path: the target's, when a check names it."""
    python = plan.target.python
    if not python or not _FUNCTION_PATH.match(python):
        return []
    uses = [p for _, p in probes if python in p.script or python in p.shell_vars.values()]
    return [python] if uses else []


def _python_servers(plan: Plan, pythons: list[str]) -> list[str]:
    """Batch lines that start one interpreter server per Python (torch imported while the shell checks run)
    and make a call of that Python, by its path, a call of the server (a shell function of that name)."""
    if not pythons:
        return []
    server = program("pyserver")
    lines = ['fc_pyd=$(mktemp -d "${TMPDIR:-/tmp}/fleetcuda-py.XXXXXX" 2>/dev/null) || fc_pyd=', _PY_CLIENT]
    label = internal_label("pyserver", plan.run_id)
    for n, python in enumerate(pythons):
        lines += [f'if [ -n "$fc_pyd" ] && mkfifo -m 600 "$fc_pyd/in.{n}"; then',
                  f"fc_pyexe[{n}]={quote(python)}",
                  f"{quote(python)} - \"$fc_pyd\" {n} torch {quote(label)} <<'{PY_DELIMITER}' >/dev/null 2>&1 &",
                  server.text + PY_DELIMITER,
                  f"fc_pypid[{n}]=$!",
                  # Held open here, read and write: a request is never stuck on a server that died starting.
                  f'exec {{fc_pyin}}<>"$fc_pyd/in.{n}"',
                  f'function {python} {{ fc_py {n} "$@"; }}',
                  "fi"]
    return lines


def batch_command(plan: Plan, probes: list[tuple[int, Invocation]], lock: TargetLock | None = None, *,
                  on_host: bool = False) -> BuiltCommand:
    return batch_parts(plan, probes, lock, on_host=on_host)[0]


def batch_parts(plan: Plan, probes: list[tuple[int, Invocation]], lock: TargetLock | None = None, *,
                on_host: bool = False) -> tuple[BuiltCommand, dict[int, str]]:
    """The batch command, and each check's part of its script by step index (what the dry-run refers to).

    One round trip for many read-only checks, in one shell: each check runs in a subshell of it, with
    exactly its own environment, variables and secrets (the batch's own removed first), its script given to
    `eval` (a syntax error stays that check's failure), its output framed (see framing), so no check can
    forge another's result or its own. One timeout covers the batch (the sum of the checks' own): a batch that
    does not finish is not believed, and each step then checks on its own, with its own timeout.
    With a lock, it is taken first; and if every check passed (nothing to apply), released at once.
    `on_host`: the probes of steps that run on the target's host, in a batch there (never with the lock,
    which is the container's, nor with an interpreter server: the venv is the container's)."""
    lines = ["set +e", _CLOCK, "all_ok=1"]
    if lock is not None:
        lines.append(lock.acquire(vmid_of(plan)))
    pythons = [] if on_host else _server_pythons(plan, probes)
    lines += _python_servers(plan, pythons)
    lines.append(_CAP)
    secret_vars: dict[str, str] = framing.nonce_vars(plan.nonce)
    batch_secrets = list(secret_vars)
    parts: dict[int, str] = {}
    for index, probe in probes:
        # The step's label first (the log and the fake connector read which check this is).
        # (Redirections inside: on the assignment they would make its status 0.)
        body = [f": {quote(probe.label)}", "exec </dev/null 2>&1", f"unset -v {_BASH_EXPORTS} {_BATCH_NAMES}",
                "unset -f fc_ms fc_cap fc_show", "trap - EXIT TERM HUP"]
        for name, value in probe.env.items():
            _check_env_name(name)
            body.append(f"export {name}={quote(value)}")
        body += [f"{name}={quote(value)}" for name, value in probe.shell_vars.items()]
        mine = []
        for name, value, export in [*((n, v, False) for n, v in probe.secret_vars.items()),
                                    *((n, v, True) for n, v in probe.secret_env.items())]:
            _check_env_name(name)
            # From this shell's variables (read from our stdin): assignments and export are builtins, so
            # the secret is on no command line.
            var = f"fcs_{len(secret_vars) - 1}"
            secret_vars[var] = value
            mine.append(var)
            body.append(("export " if export else "") + f'{name}="${var}"')
        others = [v for v in batch_secrets if v not in probe.secret_vars]
        body.append("unset -v " + " ".join([*others, *(v for v in mine if v not in probe.secret_vars)]))
        body.append(f"eval {quote(probe.script)}")
        batch_secrets += mine
        lines.append(f"{framing.frame('begin', str(index))}; fc_ms; fc_t=$fc_m")
        # Its output through fc_cap (head and tail, see _CAP), then printed with `| ` before each line.
        parts[index] = "\n".join(body)
        lines.append("(\n" + parts[index] + "\n) | fc_cap; fc_rc=${PIPESTATUS[0]}; fc_show")
        over = ""
        if probe.timeout:
            # One timeout covers the batch: a check that took longer than its own is what, on its own, timeout
            # would have stopped, and is counted so: 124.
            over = (f'if [ "$fc_t" -gt {int(probe.timeout) * 1000} ]; then fc_rc=124; printf \'| %s\\n\' '
                    f'"fleetcuda: over this check\'s timeout of {int(probe.timeout)} s"; fi; ')
        lines.append(f"fc_ms; fc_t=$(( fc_m - fc_t )); {over}{framing.frame('end', str(index), '$fc_rc', '$fc_t')}; "
                     '[ "$fc_rc" = 0 ] || all_ok=0')
    if lock is not None:
        lines.append(f'if [ "$all_ok" = 1 ]; then\n{lock.release(vmid_of(plan))}\nfi')
    if pythons:
        lines.append('if [ -n "$fc_pyd" ]; then kill "${fc_pypid[@]}" 2>/dev/null; rm -rf "$fc_pyd"; fi')
    lines.append('if [ -n "$fc_d" ]; then rm -rf "$fc_d"; fi')
    lines.append(framing.frame("done", str(len(probes))))
    total = sum(p.timeout or 0 for _, p in probes) + 30 + (lock.wait_s if lock else 0)
    env = host_env(plan.target) if on_host else {"PATH": SYSTEM_PATH, "LANG": "C.UTF-8", "HOME": plan.home}
    cmd = build(host_chain(plan.target) if on_host else plan.target.chain,
                Invocation("\n".join(lines), env, timeout=total, label=internal_label("batch", plan.run_id),
                           secret_vars=secret_vars))
    # Every check's capped output (twice its size at most with the `| ` prefixes) and its frames, read whole.
    keep = 64 * 1024 + len(probes) * (2 * (CHECK_HEAD + CHECK_TAIL) + 1024)
    return replace(cmd, output_keep=keep), parts


@dataclass
class BatchResult:
    rc: int
    output: str
    duration_ms: int


def parse_batch(output: str, nonce: str) -> dict[int, BatchResult]:
    """Each check's result, from its own frames. Only a batch whose frames are exactly what the batch shell
    prints counts: `begin`/`end` per check in order, then `done` last. A check can print no frame (its output
    is prefixed), so any other frame was written past that (into the batch's own stdout, say, with the nonce
    read from its memory): nothing of that batch is believed, and each step checks on its own."""
    frames = framing.parse(output, nonce)
    if not frames or not isinstance(framing.record(frames[-1]), framing.Done):
        return {}
    records = framing.records(frames)
    results: dict[int, BatchResult] = {}
    open_index: int | None = None
    text = ""
    seen: set[int] = set()
    for r in records[:-1]:
        if isinstance(r, framing.CheckBegin) and open_index is None and r.index not in seen:
            open_index, text = r.index, r.output
        elif isinstance(r, framing.CheckEnd) and r.index == open_index:
            results[r.index] = BatchResult(r.rc, text, r.duration_ms)
            seen.add(r.index)
            open_index = None
        elif isinstance(r, framing.LockRecord):
            continue
        else:
            return {}
    done = records[-1]
    if open_index is not None or not isinstance(done, framing.Done) or done.count != len(results):
        return {}
    return results


def _or_satisfied(scripts: Scripts, condition: str) -> Scripts:
    """The step holds if `condition` does, whatever its own check says; said in the output."""
    guard = (f"if {{\n{condition.strip()}\n}} >/dev/null 2>&1; then\n"
             f"  echo {quote('satisfied_if holds: ' + ' '.join(condition.split())[:200])}\n  exit 0\nfi\n")

    def wrap(script: str | None) -> str | None:
        return guard + script if script is not None else None

    return replace(scripts, check=wrap(scripts.check), verify=wrap(scripts.verify))


def _check(recipe: Recipe, loc: tuple, what: str, value: str) -> None:
    try:
        check_value(what, value)
    except TemplateError as exc:
        raise recipe.source.error(loc, str(exc)) from None


def _render(recipe: Recipe, loc: tuple, text: str, values: dict[str, str]) -> str:
    try:
        return render(text, values)
    except TemplateError as exc:
        raise recipe.source.error(loc, str(exc)) from None


def _skip_reason(recipe: Recipe, index: int, when: str | None, values: dict[str, str]) -> str | None:
    if not when:
        return None
    expr = when.strip()
    if "==" in expr or "!=" in expr:
        op = "==" if "==" in expr else "!="
        name, _, expected = (p.strip() for p in expr.partition(op))
        actual = _lookup(recipe, index, name, values)
        holds = (actual == expected.strip("'\"")) == (op == "==")
    else:
        negate = expr.startswith("!")
        name = expr.lstrip("!").strip()
        holds = (_lookup(recipe, index, name, values).lower() not in FALSY) != negate
    return None if holds else f"when: {expr}"


def _lookup(recipe: Recipe, index: int, name: str, values: dict[str, str]) -> str:
    if name not in values:
        raise recipe.source.error(recipe.step_loc(index, "when"), f"undefined variable {name!r}")
    return values[name]
