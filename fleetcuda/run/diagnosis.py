"""Why a step failed, said plainly: an unreachable target or a refused sudo, a full disk (which filesystem, how
much is free), the last lines of the output; and whether a command ran out of time."""

from __future__ import annotations

import re
import time

from fleetcuda.connectors.base import RunResult
from fleetcuda.errors import FleetcudaError, UnreachableError
from fleetcuda.plan.command import Invocation, build, quote
from fleetcuda.plan.inventory import Target
from fleetcuda.plan.planner import SYSTEM_PATH, PlannedStep
from fleetcuda.results import StepResult, StepStatus
from fleetcuda.run.channel import TargetChannel

TAIL_LINES = 20
# Exit codes of a check that mean "could not look", not "not satisfied": command not found by
# pct/sudo/ssh, or killed.
UNREACHABLE_RC = {255}

FULL_FILESYSTEMS = ('NR > 1 && $2 > 0 && $5 + 0 >= 98 '
                    '{ printf "%s: %d MiB free of %d MiB\\n", $6, $4 / 1024, $2 / 1024 }')


def timed_out(res: RunResult) -> bool:
    """The command ran out of time: the control side gave up, or `timeout` on the target stopped it
    (124 after TERM; 128+9 when it had to KILL)."""
    return res.timed_out or res.rc in (124, 137)


def maybe_unreachable(res: RunResult, target: Target) -> None:
    """pct's own errors (stopped container, unknown vmid, sudo wanting a password) end the target."""
    if target.container is not None and target.spec.sudo and res.output.startswith("sudo: "):
        first = res.output.splitlines()[0]
        raise UnreachableError(f"{target.id}: `sudo -n` refused ({first}); give {target.spec.user} "
                               f"passwordless sudo for {target.spec.pct} (fleetcuda never sends passwords)")
    if res.rc in UNREACHABLE_RC:
        tail_lines = [ln for ln in res.output.splitlines() if ln.strip()][-3:]
        raise UnreachableError(f"{target.id}: " + (" / ".join(tail_lines) or f"exit {res.rc}"))


def free_space(channel: TargetChannel, output: str) -> str:
    """A full disk, said plainly: which filesystem, how much is free, on which target."""
    target = channel.target
    paths = {"/tmp"} | {m.rstrip(".,;:") for line in output.splitlines() if "No space left" in line
                        for m in re.findall(r"(/[\w./+@-]+)", line)}
    report = 'NR == 2 { printf "%s on %s: %d MiB free of %d MiB\\n", p, $6, $4 / 1024, $2 / 1024 }'
    script = ("for p in " + " ".join(quote(p) for p in sorted(paths)) + "; do\n"
              '  while [ ! -e "$p" ]; do p=$(dirname "$p"); done\n'
              f'  df -Pk "$p" | awk -v p="$p" {quote(report)}\n'
              "done\n"
              # Tools often do not say which file they were writing: name every filesystem that is full.
              f"df -Pk 2>/dev/null | awk {quote(FULL_FILESYSTEMS)}")
    cmd = build(target.chain, Invocation(script, {"PATH": SYSTEM_PATH}, timeout=60, label="fleetcuda:df"))
    try:
        res = channel.exec("disk", "free-space", cmd, 60)
    except (FleetcudaError, OSError):
        return f"disk full on {target.id}"
    lines = sorted(set(res.output.strip().splitlines()))
    return f"disk full on {target.id}: " + "; ".join(lines)


def failed(step: PlannedStep, phase: str, res: RunResult, start: float, why: str) -> StepResult:
    return StepResult(step.name, StepStatus.FAILED, time.monotonic() - start, f"{phase}: {why}", tail(res.output))


def found(output: str, step: PlannedStep | None = None) -> str:
    """What the check saw: its last line (programs that print many end with a summary), said as `readable`."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    if not lines:
        return ""
    return (readable(lines[-1], step) if step is not None else lines[-1])[:300]


# bash's own error messages: `<$0>: [eval: ]line <N>: <command>: <what>`, $0 a run's label.
_BASH_ERROR = re.compile(r"^fleetcuda[-:][^\s@:]*@[0-9a-f]+: (?:eval: )?(?:line (\d+): )?")


def _values(step: PlannedStep) -> dict[str, str]:
    probe = step.verify_probe or step.pre_probe
    return dict(probe.shell_vars) if probe is not None else {}


def resolve(text: str, values: dict[str, str]) -> str:
    """`text` with each reference to a step's shell variable (`"${fc_x}"`, `${fc_x}`, `$fc_x`) replaced by its
    value: what a report says names the path or version, not the variable the script used."""
    for name, value in sorted(values.items(), key=lambda kv: len(kv[0]), reverse=True):
        text = text.replace(f'"${{{name}}}"', value).replace(f"${{{name}}}", value)
        text = re.sub(rf"\${re.escape(name)}(?!\w)", lambda _m, v=value: v, text)
    return text


def readable(line: str, step: PlannedStep) -> str:
    """A line of a step's output as reports and history keep it: variables resolved, and bash's error prefix
    (the run's label, a line of the whole batch) replaced by the step's name and the line of its own script
    that runs the failing command, so the same failure reads the same every run."""
    values = _values(step)
    line = resolve(line, values)
    m = _BASH_ERROR.match(line)
    if m is None:
        return line
    rest = line[m.end():]
    command = rest.split(": ", 1)[0].strip()
    probe = step.verify_probe or step.pre_probe
    script = resolve(probe.script, values).splitlines() if probe is not None else []
    own = next((i for i, text in enumerate(script, 1) if command and command in text), None)
    return f"{step.name}: line {own}: {rest}" if own else f"{step.name}: {rest}"


def expected(step: PlannedStep) -> str:
    return resolve(step.expect, _values(step))


def tail(output: str) -> list[str]:
    return output.rstrip("\n").splitlines()[-TAIL_LINES:]
