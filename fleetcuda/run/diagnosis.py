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


# What apt (and apt-helper), pip, uv, curl and wget say when the network fails, by kind; the first kind found
# in the output is the diagnosis. Retrying does not fix these (a name that does not resolve, a mirror that
# refuses, a certificate not trusted): they are said in one line, not retried.
NETWORK = (
    ("name resolution", "cannot resolve the name of {hosts}: check the target's DNS (/etc/resolv.conf) or give a "
     "mirror it can resolve", re.compile(r"Temporary failure (?:in name )?resolving|Could not resolve|"
                           r"Temporary failure in name resolution|Name or service not known|unable to resolve host|"
                           r"failed to lookup address|"
                           r"No address associated with hostname|nodename nor servname", re.I)),
    ("TLS", "TLS to {hosts} failed: the target's CA certificates (ca-certificates), its clock, or a proxy that "
     "intercepts TLS", re.compile(r"Certificate verification failed|CERTIFICATE_VERIFY_FAILED|SSL certificate "
                                 r"problem|gnutls_handshake|SSLError|invalid peer certificate|certificate verify "
                                 r"failed", re.I)),
    ("unreachable mirror", "cannot reach {hosts}: the mirror is down or the target has no route to it (a proxy, "
     "a firewall); give a mirror it can reach", re.compile(
         r"Could not connect to|Unable to connect to|Failed to connect to|Connection refused|Network is "
         r"unreachable|No route to host|Connection timed out|connection timed out|ConnectTimeoutError|"
         r"Failed to establish a new connection|tcp connect error", re.I)),
)
_HOST = re.compile(r"resolving '([^']+)'|resolve '([^']+)'|resolve host(?: address)?:? '?([\w.-]+)|host='([^']+)'|"
                   r"connect to ([\w.-]+)[: ]|https?://([\w.-]+)", re.I)


def network_failure(output: str) -> tuple[str, list[str]] | None:
    """A network failure of apt, pip, uv or a download, said in one line (`network: ...`), and the distinct
    lines it is based on; None when the output shows none."""
    lines = output.splitlines()
    for kind, what, pattern in NETWORK:
        hits = [ln.strip() for ln in lines if pattern.search(ln)]
        if not hits:
            continue
        hosts: list[str] = []
        for ln in hits:
            for m in _HOST.finditer(ln):
                host = next(g for g in m.groups() if g)
                if host not in hosts:
                    hosts.append(host)
        shown = ", ".join(hosts[:3]) if hosts else "its mirror (index)"
        seen = list(dict.fromkeys(ln[:200] for ln in hits))
        return f"network ({kind}): " + what.format(hosts=shown) + "; not retried", seen[:3]
    return None


def timed_out(res: RunResult, timeout: float | None) -> bool:
    """The command ran out of time: the control side gave up, or `timeout` on the target stopped it (124 after
    TERM; 128+9 when it had to KILL), which it does only once `timeout` seconds have passed. A 124 or 137 sooner
    is something else: a container stopped under it, the OOM killer, a kill, a timeout of the script's own."""
    if res.timed_out:
        return True
    return res.rc in (124, 137) and bool(timeout) and res.duration >= 0.99 * float(timeout or 0)


def stopped(res: RunResult) -> bool:
    """Out of time or killed (124, 137): whatever it was, an apply that ended so is never re-sent blindly."""
    return res.timed_out or res.rc in (124, 137)


def ending(res: RunResult, timeout: float | None) -> str:
    """How a failed command ended, said as what it was."""
    if timed_out(res, timeout):
        return f"timed out after {timeout}s"
    if res.rc == 137:
        return "killed (exit 137: the container stopped or the process was killed)"
    return f"exit {res.rc}"


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


TAIL_LINE_MAX = 500  # characters of one line of a tail: what a console line, a report or history can hold


def tail(output: str) -> list[str]:
    return [ln if len(ln) <= TAIL_LINE_MAX else ln[:TAIL_LINE_MAX] + f" [... {len(ln) - TAIL_LINE_MAX} more characters]"
            for ln in output.rstrip("\n").splitlines()[-TAIL_LINES:]]
