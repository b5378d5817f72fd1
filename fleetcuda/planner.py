"""Planner: recipe + target + variables -> the exact commands of every step, with no I/O.

Dry-run prints exactly these commands; apply, --check and verify send exactly these commands.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from fleetcuda.command import BuiltCommand, Invocation, build, join, quote, target_argv
from fleetcuda.inventory import Target
from fleetcuda.recipe import AUTO, Recipe, check_fact_value
from fleetcuda.steps import Scripts, StepContext, StepSpec
from fleetcuda.templating import TemplateError, render

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
FALSY = {"", "0", "false", "no", "off", "none"}
FACT_MARK = "@@fleetcuda-fact"


@dataclass
class SharedPlan:
    """A step whose wheel is built once per ABI fingerprint (see steps.base.SharedBuild), as exact commands."""

    package: str
    version: str
    fingerprint: BuiltCommand
    build: BuiltCommand
    install: Callable[[str, str, str, str], BuiltCommand]  # (wheel path, sha256, fingerprint json, provenance)


@dataclass
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


@dataclass
class Plan:
    target: Target
    values: dict[str, str]
    steps: list[PlannedStep] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)  # `auto` vars not yet read from the target
    home: str = "/root"


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


def base_env(target: Target, home: str | None = None) -> dict[str, str]:
    env = {"HOME": home or home_of(target), "LANG": "C.UTF-8", "PATH": SYSTEM_PATH}
    if target.venv:
        env["VIRTUAL_ENV"] = target.venv
        env["PATH"] = f"{target.venv}/bin:{SYSTEM_PATH}"
    return env


def facts_command(recipe: Recipe, target: Target, values: dict[str, str], names: list[str],
                  home: str | None = None) -> BuiltCommand:
    """One read-only round trip that prints every pending fact between markers."""
    parts = []
    for name in names:
        body = _render(recipe, ("facts", name), recipe.facts[name], values, shell=True)
        # stderr stays out of the value: a library's warning must not become a version number.
        parts.append(f"echo {FACT_MARK} {name}\n( {body}\n) 2>/dev/null | tail -n 1\necho {FACT_MARK} end $?")
    return build(target.chain, Invocation("\n".join(parts), base_env(target, home), timeout=120,
                                          label="fleetcuda:facts"))


def parse_facts(output: str, names: list[str]) -> dict[str, str]:
    found: dict[str, str] = {}
    current: str | None = None
    for line in output.splitlines():
        if line.startswith(FACT_MARK + " "):
            word = line.split()[1]
            current = word if word != "end" else None
            continue
        if current:
            found[current] = line.strip()
    missing = [n for n in names if not found.get(n)]
    if missing:
        raise TemplateError(f"could not read {', '.join(missing)} from the target (is the venv's torch there?)")
    return {n: check_fact_value(n, found[n]) for n in names}


def make_plan(recipe: Recipe, target: Target, values: dict[str, str], home: str | None = None) -> Plan:
    plan = Plan(target, values, unresolved=pending_facts(recipe, values), home=home or home_of(target))
    env = {**base_env(target, home), **recipe.env}
    exports: dict[str, str] = {}
    prepend: list[str] = []
    ctx = StepContext(values, target.python, recipe.name)
    for i, step in enumerate(recipe.steps):
        skip = _skip_reason(recipe, i, step.when, values)
        planned = PlannedStep(i, step.name, step.kind, skip, timeout=step.timeout,
                              retries=step.retries, retry_delay=step.retry_delay)
        plan.steps.append(planned)
        if skip:
            continue
        try:
            scripts = step.scripts(ctx)  # type: ignore[attr-defined]
        except (TemplateError, ValueError) as exc:
            raise recipe.source.error(recipe.step_loc(i), f"{exc} (target {target.id})") from None
        step_env = {k: _render(recipe, recipe.step_loc(i, "env") + (k,), str(v), values, shell=False)
                    for k, v in step.env.items()}
        if step.satisfied_if:
            scripts = _or_satisfied(scripts, _render(recipe, recipe.step_loc(i, "satisfied_if"), step.satisfied_if,
                                                     values, shell=True))
        exports.update(scripts.exports)
        prepend = scripts.path_prepend + [p for p in prepend if p not in scripts.path_prepend]
        full_env = {**env, **exports, **step_env}
        if prepend:
            full_env["PATH"] = ":".join(prepend) + ":" + full_env["PATH"]

        # The step and its environment are bound now: a shared build's install command is made at run time.
        def cmd(script: str | None, step: StepSpec = step, env: dict[str, str] = full_env) -> BuiltCommand | None:
            if script is None:
                return None
            return build(target.chain, Invocation(script, env, timeout=step.timeout, label=f"fleetcuda:{step.name}"))

        apply = scripts.apply
        if apply is not None and step.kind == "shell":
            apply = "set -e -o pipefail\n" + apply
        planned.check, planned.apply, planned.verify = cmd(scripts.check), cmd(apply), cmd(scripts.verify)
        planned.expect = scripts.expect or step.description or "exit 0"
        if scripts.shared is not None:
            sb = scripts.shared
            planned.shared = SharedPlan(
                sb.package, sb.version, cmd(sb.fingerprint), cmd(sb.build),  # type: ignore[arg-type]
                lambda path, sha, fp, prov, sb=sb, cmd=cmd: cmd(sb.install(path, sha, fp, prov)))  # type: ignore[misc]
        pre = scripts.check if scripts.check is not None else (scripts.verify if apply is None else None)
        post = scripts.verify if scripts.verify is not None else scripts.check
        label = f"fleetcuda:{step.name}"
        planned.pre_probe = Invocation(pre, full_env, step.timeout, label) if pre is not None else None
        planned.verify_probe = Invocation(post, full_env, step.timeout, label) if post is not None else None
    return plan


BATCH_MARK = "@@fleetcuda-batch"


LOCK_MARK = "@@fleetcuda-lock"
LOCK_TTL_S = 6 * 3600  # a lock older than this is taken over: its run died without releasing it


@dataclass(frozen=True)
class TargetLock:
    """One `fleetcuda apply` at a time per target: a lock directory on the target itself, so two
    control machines cannot converge the same container at once. Released when the run ends."""

    owner: str  # user@host, pid and start time of this run
    wait_s: int = 0

    @staticmethod
    def name(target: Target) -> str:
        # Named after the vmid, which is what identifies the container whatever the inventory calls it.
        return f"fleetcuda-apply-{target.container.vmid}" if target.container else "fleetcuda-apply"

    def acquire(self, target: Target) -> str:
        name = self.name(target)
        return "\n".join([
            # A tmpfs (/run/lock, else /run) where there is one: a restart clears what a dead run left.
            f"lockdir=/run/lock/{name}",
            f'{{ [ -d /run/lock ] && [ -w /run/lock ]; }} || lockdir=/run/{name}',
            f'{{ [ -d /run ] && [ -w /run ]; }} || lockdir="$HOME/.cache/{name}.lock"',
            'mkdir -p "$(dirname "$lockdir")"',
            f"deadline=$(( $(date +%s) + {int(self.wait_s)} ))",
            'while ! mkdir "$lockdir" 2>/dev/null; do',
            # Ours already (a reply lost with a dropped connection, then the command sent again).
            f'  [ "$(cat "$lockdir/owner" 2>/dev/null)" = {quote(self.owner)} ] && break',
            '  age=$(( $(date +%s) - $(stat -c %Y "$lockdir" 2>/dev/null || date +%s) ))',
            f'  if [ "$age" -gt {LOCK_TTL_S} ]; then',
            f'    echo "{LOCK_MARK} stale $(cat "$lockdir/owner" 2>/dev/null)"; rm -rf "$lockdir"; continue',
            "  fi",
            '  if [ "$(date +%s)" -ge "$deadline" ]; then',
            f'    echo "{LOCK_MARK} busy $lockdir $(cat "$lockdir/owner" 2>/dev/null)"; exit 75',
            "  fi",
            "  sleep 2",
            "done",
            f'printf "%s\\n" {quote(self.owner)} > "$lockdir/owner"',
            f'echo "{LOCK_MARK} held"',
        ])

    def release(self, target: Target) -> str:
        return self._remove_if_owned_by(target, self.owner, "released")

    def take_over(self, target: Target, dead_owner: str) -> str:
        """Remove a lock whose owner is known to be dead (a run on this machine that no longer exists)."""
        return self._remove_if_owned_by(target, dead_owner, "taken over")

    def _remove_if_owned_by(self, target: Target, owner: str, said: str) -> str:
        name = self.name(target)
        return "\n".join([
            f"for lockdir in /run/lock/{name} /run/{name} \"$HOME/.cache/{name}.lock\"; do",
            f'  if [ "$(cat "$lockdir/owner" 2>/dev/null)" = {quote(owner)} ]; then rm -rf "$lockdir"; '
            f'echo "{LOCK_MARK} {said}"; fi',
            "done",
        ])


def lock_command(plan: Plan, script: str) -> BuiltCommand:
    env = {"PATH": SYSTEM_PATH, "LANG": "C.UTF-8", "HOME": plan.home}
    return build(plan.target.chain, Invocation(script, env, timeout=3600, label="fleetcuda:lock"))


def batch_command(plan: Plan, probes: list[tuple[int, Invocation]], lock: TargetLock | None = None) -> BuiltCommand:
    """One round trip for many read-only checks: each runs exactly as on its own (same env -i argv,
    same timeout), framed by markers so the results come back per step, not scraped from a mix.
    With a lock, it is taken first; and if every check passed (nothing to apply), released at once."""
    lines = ["set +e", "now() { date +%s%3N; }", "all_ok=1"]
    if lock is not None:
        lines.append(lock.acquire(plan.target))
    for index, probe in probes:
        lines.append(f"echo {BATCH_MARK} begin {index}; t=$(now)")
        lines.append(f"{join(target_argv(probe))} </dev/null 2>&1; rc=$?")
        lines.append(f'echo; echo {BATCH_MARK} end {index} "$rc" "$(( $(now) - t ))"; [ "$rc" = 0 ] || all_ok=0')
    if lock is not None:
        lines.append(f'if [ "$all_ok" = 1 ]; then\n{lock.release(plan.target)}\nfi')
    total = sum(p.timeout or 0 for _, p in probes) + 60 + (lock.wait_s if lock else 0)
    env = {"PATH": SYSTEM_PATH, "LANG": "C.UTF-8", "HOME": plan.home}
    return build(plan.target.chain, Invocation("\n".join(lines), env, timeout=total, label="fleetcuda:batch"))


@dataclass
class BatchResult:
    rc: int
    output: str
    duration_ms: int


def parse_batch(output: str) -> dict[int, BatchResult]:
    results: dict[int, BatchResult] = {}
    current: int | None = None
    buf: list[str] = []
    for line in output.split("\n"):
        if line.startswith(BATCH_MARK + " "):
            parts = line.split()
            if parts[1] == "begin" and len(parts) == 3 and parts[2].isdigit():
                current, buf = int(parts[2]), []
                continue
            if parts[1] == "end" and len(parts) == 5 and current is not None and parts[2] == str(current):
                text = "\n".join(buf)
                results[current] = BatchResult(int(parts[3]), text[:-1] if text.endswith("\n") else text,
                                               int(parts[4]) if parts[4].isdigit() else 0)
                current = None
                continue
        if current is not None:
            buf.append(line)
    return results


def _or_satisfied(scripts: Scripts, condition: str) -> Scripts:
    """The step holds if `condition` does, whatever its own check says; said in the output."""
    guard = (f"if {{\n{condition.strip()}\n}} >/dev/null 2>&1; then\n"
             f"  echo {quote('satisfied_if holds: ' + ' '.join(condition.split())[:200])}\n  exit 0\nfi\n")

    def wrap(script: str | None) -> str | None:
        return guard + script if script is not None else None

    return replace(scripts, check=wrap(scripts.check), verify=wrap(scripts.verify))


def _render(recipe: Recipe, loc: tuple, text: str, values: dict[str, str], *, shell: bool) -> str:
    try:
        return render(text, values, shell=shell)
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
