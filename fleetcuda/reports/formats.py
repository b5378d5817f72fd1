"""Machine-readable reports of a run: JSON, JUnit XML, Prometheus text, and a rich table.

Every writer is a pure function of a `RunInfo` and the engine's `list[TargetResult]` that returns text;
`write_atomically` puts that text in place so a reader (CI, node_exporter's textfile collector) never
sees half a file.

JSON schema "fleetcuda.verify/1" (keys always present and always in this order; `null` where unknown):

    {
      "schema": "fleetcuda.verify/1",
      "fleetcuda_version": "0.1.0",
      "mode": "verify",                      # verify | check | apply
      "recipe": {"name": "gdn-fastpath", "path": "recipes/gdn-fastpath.yaml"},
      "inventory": "inventories/lab.yaml",
      "started_at": "2025-06-01T03:00:00Z",  # UTC, RFC 3339
      "finished_at": "2025-06-01T03:01:12Z",
      "duration_s": 72.0,
      "exit_code": 1,                        # the CLI's exit code: 0, 1, 2, 3 or 130
      "run_dir": "/root/.local/state/fleetcuda/runs/...",   # or null
      "summary": {
        "targets": 3,
        "target_status": {"ok": 1, "changed": 0, "would-change": 0, "drift": 1, "failed": 0,
                          "unreachable": 1, "interrupted": 0, "skipped": 0},
        "checks": 16,
        "check_status": {"ok": 14, "changed": 0, "skipped": 1, "would-change": 0, "drift": 1, "failed": 0}
      },
      "targets": [
        {
          "target": "pve-gpu1/200",
          "status": "drift",
          "error": null,                     # why the target stopped (unreachable, bad template...)
          "duration_s": 31.52,
          "log": "/root/.local/state/fleetcuda/runs/.../pve-gpu1_200.log",   # or null
          "checks": [
            {
              "step": "cuda-compiler",
              "status": "drift",             # ok | changed | skipped | would-change | drift | failed
              "detail": "verification failed",
              "expected": "nvcc reports release 12.8",
              "found": "Cuda compilation tools, release 12.6, V12.6.77",
              "duration_s": 0.41,
              "output_tail": ["...", "..."]  # only present when status is drift or failed
            }
          ]
        }
      ]
    }

A status the engine adds later is counted under its own key after the fixed ones (sorted), so old
consumers keep working. Durations are seconds rounded to milliseconds.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from fleetcuda import __version__
from fleetcuda.reports.live import STATUS_STYLE
from fleetcuda.results import StepResult, TargetResult

SCHEMA = "fleetcuda.verify/1"
TARGET_STATUSES = ("ok", "changed", "would-change", "drift", "failed", "unreachable", "interrupted", "skipped")
CHECK_STATUSES = ("ok", "changed", "skipped", "would-change", "drift", "failed")
FAILING = frozenset({"drift", "failed"})
# Statuses at which fleetcuda never got to run the target's checks (not-run: a stopped rollout never started it).
NOT_REACHED = frozenset({"unreachable", "interrupted", "pending", "running", "not-run"})


@dataclass(frozen=True)
class RunInfo:
    """What the report says about the run as a whole (the targets' results come separately)."""

    mode: str
    recipe_path: str
    recipe_name: str
    inventory_path: str
    started_at: datetime
    finished_at: datetime
    exit_code: int
    run_dir: str | None = None
    version: str = __version__

    def __post_init__(self) -> None:
        # A naive datetime would be read as local time by some consumers and as UTC by others.
        for name in ("started_at", "finished_at"):
            value = getattr(self, name)
            if value.tzinfo is None or value.utcoffset() is None:
                raise ValueError(f"RunInfo.{name} must be timezone-aware (got {value!r})")
            object.__setattr__(self, name, value.astimezone(UTC))

    @property
    def duration_s(self) -> float:
        return max(0.0, (self.finished_at - self.started_at).total_seconds())


def iso_utc(value: datetime) -> str:
    """RFC 3339 in UTC with a Z, to the second."""
    return value.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _seconds(value: float) -> float:
    return round(float(value), 3)


def _counts(statuses: Iterable[str], fixed: tuple[str, ...]) -> dict[str, int]:
    counts = dict.fromkeys(fixed, 0)
    extra: dict[str, int] = {}
    for status in statuses:
        if status in counts:
            counts[status] += 1
        else:
            extra[status] = extra.get(status, 0) + 1
    return counts | dict(sorted(extra.items()))


# -- JSON ---------------------------------------------------------------------------------------


def to_dict(info: RunInfo, results: list[TargetResult]) -> dict[str, object]:
    """The JSON report as plain data (see the module docstring for the schema)."""
    checks = [s for r in results for s in r.steps]
    return {
        "schema": SCHEMA,
        "fleetcuda_version": info.version,
        "mode": info.mode,
        "recipe": {"name": info.recipe_name, "path": info.recipe_path},
        "inventory": info.inventory_path,
        "started_at": iso_utc(info.started_at),
        "finished_at": iso_utc(info.finished_at),
        "duration_s": _seconds(info.duration_s),
        "exit_code": info.exit_code,
        "run_dir": info.run_dir,
        "summary": {
            "targets": len(results),
            "target_status": _counts((r.status for r in results), TARGET_STATUSES),
            "checks": len(checks),
            "check_status": _counts((s.status for s in checks), CHECK_STATUSES),
        },
        "targets": [_target_dict(r) for r in results],
    }


def _target_dict(result: TargetResult) -> dict[str, object]:
    return {
        "target": result.target,
        "status": result.status,
        "error": result.error,
        "duration_s": _seconds(result.duration),
        "log": result.log,
        "checks": [_check_dict(s) for s in result.steps],
    }


def _check_dict(step: StepResult) -> dict[str, object]:
    check: dict[str, object] = {
        "step": step.name,
        "status": step.status,
        "detail": step.detail,
        "expected": step.expected,
        "found": step.found,
        "duration_s": _seconds(step.duration),
    }
    if step.status in FAILING:
        check["output_tail"] = list(step.tail)
    return check


def to_json(info: RunInfo, results: list[TargetResult]) -> str:
    """One JSON document, schema "fleetcuda.verify/1", keys in a fixed order, ending in a newline."""
    return json.dumps(to_dict(info, results), indent=2, ensure_ascii=False) + "\n"


# -- JUnit XML ----------------------------------------------------------------------------------

# Characters XML 1.0 cannot carry at all, not even as references (ANSI escapes in a tail, NUL...).
_XML_INVALID = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
TARGET_CASE = "(target)"


def _xml_text(value: object) -> str:
    return _XML_INVALID.sub(lambda m: f"\\x{ord(m.group()):02x}", str(value))


def _failure_body(step: StepResult, log: str | None) -> str:
    lines = [f"expected: {step.expected}" if step.expected else "", f"found: {step.found}" if step.found else ""]
    lines = [ln for ln in lines if ln]
    if step.tail:
        lines += ["output tail:", *step.tail]
    if log:
        lines.append(f"full log: {log}")
    return "\n".join(lines)


def to_junit(info: RunInfo, results: list[TargetResult]) -> str:
    """JUnit XML: one <testsuite> per target, one <testcase> per check.

    drift and failed checks carry a <failure> with the expectation, what was found and the output tail;
    skipped checks a <skipped/>; a target that could not be checked (unreachable, interrupted, or stopped
    by an error outside its checks) gets one extra testcase named "(target)" with an <error>; one that a
    stopped rollout never started (not-run) that testcase with a <skipped/> saying why (the failure is
    the batch's, reported on its own targets).
    """
    root = ET.Element("testsuites", {"name": _xml_text(f"fleetcuda {info.mode} {info.recipe_name}")})
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for result in results:
        suite = ET.SubElement(root, "testsuite", {"name": _xml_text(result.target)})
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        props = ET.SubElement(suite, "properties")
        for key, value in (("status", result.status), ("recipe", info.recipe_name), ("log", result.log)):
            if value:
                ET.SubElement(props, "property", {"name": key, "value": _xml_text(value)})
        for step in result.steps:
            case = ET.SubElement(suite, "testcase", {"classname": _xml_text(result.target),
                                                     "name": _xml_text(step.name),
                                                     "time": f"{step.duration:.3f}"})
            counts["tests"] += 1
            if step.status in FAILING:
                counts["failures"] += 1
                message = f"{step.status}: {step.detail}" if step.detail else step.status
                failure = ET.SubElement(case, "failure", {"message": _xml_text(message), "type": step.status})
                failure.text = _xml_text(_failure_body(step, result.log))
            elif step.status == "skipped":
                counts["skipped"] += 1
                ET.SubElement(case, "skipped", {"message": _xml_text(step.detail)} if step.detail else {})
        explained = any(s.status in FAILING for s in result.steps)
        if result.status == "not-run":
            case = ET.SubElement(suite, "testcase", {"classname": _xml_text(result.target), "name": TARGET_CASE,
                                                     "time": f"{result.duration:.3f}"})
            counts["tests"] += 1
            counts["skipped"] += 1
            ET.SubElement(case, "skipped", {"message": _xml_text(result.error or "not started")})
        elif result.status in NOT_REACHED or ((result.error or result.status in FAILING) and not explained):
            case = ET.SubElement(suite, "testcase", {"classname": _xml_text(result.target), "name": TARGET_CASE,
                                                     "time": f"{result.duration:.3f}"})
            counts["tests"] += 1
            counts["errors"] += 1
            message = f"{result.status}: {result.error}" if result.error else result.status
            error = ET.SubElement(case, "error", {"message": _xml_text(message), "type": result.status})
            error.text = _xml_text(result.error or result.status) + (f"\nfull log: {result.log}" if result.log else "")
        suite.attrib.update({k: str(v) for k, v in counts.items()})
        suite.set("time", f"{result.duration:.3f}")
        suite.set("timestamp", info.started_at.strftime("%Y-%m-%dT%H:%M:%S"))
        for key in totals:
            totals[key] += counts[key]
    root.attrib.update({k: str(v) for k, v in totals.items()})
    root.set("time", f"{info.duration_s:.3f}")
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


# -- Prometheus text exposition -----------------------------------------------------------------

_METRICS: dict[str, str] = {
    "fleetcuda_verify_check_ok": "1 if the check passed in the last run, 0 if it drifted or failed (skipped checks "
                                 "are left out).",
    "fleetcuda_verify_check_duration_seconds": "How long the check took in the last run.",
    "fleetcuda_verify_target_up": "1 if fleetcuda reached the target and ran its checks in the last run.",
    "fleetcuda_verify_target_ok": "1 if every check of the target passed in the last run.",
    "fleetcuda_verify_target_drift_checks": "Checks of the target that drifted or failed in the last run.",
    "fleetcuda_verify_target_duration_seconds": "How long the target took in the last run.",
    "fleetcuda_verify_last_run_timestamp_seconds": "When the last run finished, in seconds since the epoch.",
    "fleetcuda_verify_last_run_duration_seconds": "How long the last run took.",
    "fleetcuda_verify_exit_code": "Exit code of the last run: 0 ok, 1 drift or failed, 3 unreachable, "
                                  "130 interrupted.",
}


def escape_label_value(value: str) -> str:
    r"""Label values per the text format: backslash, double quote and newline escaped as \\, \" and \n."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def to_prometheus(info: RunInfo, results: list[TargetResult]) -> str:
    """Text exposition format for node_exporter's textfile collector; every metric is a gauge.

    Every sample carries a `recipe` label so several nightly jobs (one file per recipe) never collide.
    """
    samples: dict[str, dict[str, str]] = {name: {} for name in _METRICS}

    def add(metric: str, labels: dict[str, str], value: float) -> None:
        text = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in labels.items())
        # A duplicate series makes node_exporter reject the whole file: the first one wins.
        samples[metric].setdefault(text, _number(value))

    run = {"recipe": info.recipe_name}
    for result in results:
        target = {**run, "target": result.target}
        for step in result.steps:
            check = {**target, "step": step.name}
            if step.status != "skipped":
                add("fleetcuda_verify_check_ok", check, 0 if step.status in FAILING else 1)
                add("fleetcuda_verify_check_duration_seconds", check, round(step.duration, 3))
        failing = sum(s.status in FAILING for s in result.steps)
        add("fleetcuda_verify_target_up", target, 0 if result.status in NOT_REACHED else 1)
        add("fleetcuda_verify_target_ok", target, 1 if result.status in ("ok", "changed", "skipped") else 0)
        add("fleetcuda_verify_target_drift_checks", target, failing)
        add("fleetcuda_verify_target_duration_seconds", target, round(result.duration, 3))
    add("fleetcuda_verify_last_run_timestamp_seconds", run, round(info.finished_at.timestamp(), 3))
    add("fleetcuda_verify_last_run_duration_seconds", run, round(info.duration_s, 3))
    add("fleetcuda_verify_exit_code", run, info.exit_code)

    lines: list[str] = []
    for metric, help_text in _METRICS.items():
        if not samples[metric]:
            continue
        lines += [f"# HELP {metric} {_escape_help(help_text)}", f"# TYPE {metric} gauge"]
        lines += [f"{metric}{{{labels}}} {value}" for labels, value in samples[metric].items()]
    return "\n".join(lines) + "\n"


# -- files --------------------------------------------------------------------------------------


def write_atomically(path: str | os.PathLike[str], text: str, mode: int = 0o600) -> Path:
    """Replace `path` with `text` (UTF-8) in one step: readers see the old file or the new one, never half.

    The temporary file lives in the same directory (so os.replace is atomic), starts with a dot and ends
    in .tmp (so node_exporter's *.prom glob never picks it up), and is private from its creation.
    Pass mode=0o644 for a .prom file that node_exporter, running as another user, must read.
    """
    target = Path(path)
    directory = target.parent
    try:
        existing = os.lstat(target)
    except FileNotFoundError:
        existing = None
    if existing is not None and not stat.S_ISREG(existing.st_mode):
        # Replacing it would swap a device (as root: /dev/null itself), a FIFO or a link for our file.
        raise IsADirectoryError(errno.EISDIR if stat.S_ISDIR(existing.st_mode) else errno.EINVAL,
                                "not a regular file: a report replaces a file, never a device, FIFO, link or "
                                "directory (leave out --output to write to stdout)", str(target))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{target.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    # The rename itself is durable only once the directory is synced.
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return target
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)
    return target


# -- terminal -----------------------------------------------------------------------------------


def _styled(status: str) -> Text:
    return Text(status, style=STATUS_STYLE.get(status, ""))


def render_table(info: RunInfo, results: list[TargetResult], console: Console, *, table: bool = True) -> None:
    """Per target and check: status, expected, found, time (unless `table` is false: off a terminal the table
    is printed on request); then failures' output tails and logs, and one summary line.

    Remote text goes in as rich Text, never as markup, so a `[...]` in a check's output prints as is.
    """
    grid = Table(title=Text(f"{info.mode} {info.recipe_name}"), show_header=True, header_style="bold")
    for col in ("target", "check", "status", "expected", "found", "time"):
        grid.add_column(col, overflow="fold")
    for result in results:
        if not result.steps:
            grid.add_row(Text(result.target), Text(""), _styled(result.status), Text(""),
                          Text(result.error or ""), Text(f"{result.duration:.1f}s"))
        for i, step in enumerate(result.steps):
            grid.add_row(Text(result.target if i == 0 else ""), Text(step.name), _styled(step.status),
                          Text(step.expected), Text(step.found), Text(f"{step.duration:.1f}s"))
    if table:
        console.print(grid)
    for result in results:
        blocks: list[Text] = []
        for step in result.steps:
            if step.status not in FAILING:
                continue
            head = Text.assemble((result.target, "bold red"), ": ", (step.name, "bold"), " ",
                                 _styled(step.status), f": {step.detail}" if step.detail else "")
            blocks.append(head)
            if step.expected:
                blocks.append(Text(f"    expected: {step.expected}"))
            if step.found:
                blocks.append(Text(f"    found:    {step.found}"))
            blocks += [Text(f"    | {line}") for line in step.tail]
        if result.error:
            blocks.append(Text.assemble((result.target, "bold red"), ": ", _styled(result.status),
                                        f": {result.error}"))
        if blocks and result.log:
            blocks.append(Text(f"    full log: {result.log}"))
        if blocks:  # unwrapped by rich (the terminal wraps it): a path stays one piece to copy
            console.print(Group(*blocks), highlight=False, soft_wrap=True)
    console.print(Text(summary_line(info, results)), highlight=False, soft_wrap=True)


def summary_line(info: RunInfo, results: list[TargetResult]) -> str:
    """A run in one line: its mode and recipe, targets by status, the exit status, how long, where the logs are."""
    counts = ", ".join(f"{n} {s}" for s, n in _counts((r.status for r in results), TARGET_STATUSES).items() if n)
    return (f"{info.mode} {info.recipe_name}: {len(results)} target(s): {counts or 'none'}; exit {info.exit_code}; "
            f"{info.duration_s:.1f}s" + (f"; logs: {info.run_dir}" if info.run_dir else ""))
