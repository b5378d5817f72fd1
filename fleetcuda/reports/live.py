"""Reporters at the edge: a rich live view on a terminal, timestamped plain lines otherwise.

What comes from a target (output, details, errors, names) is data, never markup: it goes into rich as
`Text`, or with markup=False, so `[/]` in a check's output is printed as it is.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TYPE_CHECKING, TextIO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from fleetcuda.reports.plain import stamp

if TYPE_CHECKING:
    from rich.live import Live

    from fleetcuda.results import StepResult, TargetResult

STATUS_STYLE = {
    "ok": "green", "changed": "yellow", "skipped": "dim", "would-change": "cyan", "unknown": "blue", "drift": "red",
    "failed": "bold red", "unreachable": "bold red", "interrupted": "magenta", "locked": "bold red",
    "not-run": "yellow",
}


class Reporter:
    """Hooks the engine calls from its worker threads; implementations must be thread-safe."""

    def start(self, mode: str, recipe: str, targets: list[str]) -> None: ...
    def batch_started(self, name: str, targets: list[str]) -> None: ...  # --canary/--serial: from the main thread
    def target_started(self, target: str) -> None: ...
    def step_started(self, target: str, step: str, phase: str) -> None: ...
    def output(self, target: str, step: str, line: str) -> None: ...
    def step_finished(self, target: str, result: StepResult) -> None: ...
    def target_finished(self, result: TargetResult) -> None: ...
    # What the user must hear of although no step failed: a lock not released, another run's lock taken over.
    def notice(self, target: str, text: str) -> None: ...
    def stop(self) -> None: ...


class PlainReporter(Reporter):
    """One timestamped line per event: for cron, CI and pipes. `brief` (verify): what is not fine and each
    target's result, not every step that started or passed; the failures' details and one summary line follow
    the run."""

    def __init__(self, stream: TextIO | None = None, show_output: bool = False, brief: bool = False):
        from fleetcuda.reports.streams import guarded

        self.stream = guarded(stream or sys.stdout)  # a reader that left stops the lines, never the run
        self.show_output = show_output
        self.brief = brief
        self.lock = threading.Lock()

    def _line(self, text: str) -> None:
        with self.lock:
            self.stream.write(f"{stamp()} {text}\n")
            self.stream.flush()

    def start(self, mode: str, recipe: str, targets: list[str]) -> None:
        from fleetcuda.redact import printable  # the recipe's path is the user's: any bytes a file name holds
        self._line(printable(f"{mode} {recipe} on {len(targets)} target(s): {', '.join(targets)}"))

    def batch_started(self, name: str, targets: list[str]) -> None:
        self._line(f"{name}: {', '.join(targets)}")

    def step_started(self, target: str, step: str, phase: str) -> None:
        if not self.brief:
            self._line(f"{target} {step}: {phase}")

    def output(self, target: str, step: str, line: str) -> None:
        if self.show_output:
            self._line(f"{target} {step} | {line}")

    def step_finished(self, target: str, result: StepResult) -> None:
        if not self.brief or result.status not in ("ok", "skipped"):
            self._line(f"{target} {result.name}: {result.status} ({result.detail}, {result.duration:.1f}s)")

    def target_finished(self, result: TargetResult) -> None:
        extra = f": {result.error}" if result.error else ""
        self._line(f"{result.target} done: {result.status}{extra}")

    def notice(self, target: str, text: str) -> None:
        self._line(f"{target}: {text}")


LIVE_COLUMNS = ("target", "status", "step", "elapsed", "last output")
LAST_OUTPUT_MAX = 60
NARROWEST = 8  # a column that would get fewer characters gives way altogether


def column_widths(rows: list[dict[str, str]], width: int) -> dict[str, int]:
    """The live table's columns and their widths for a terminal `width` columns wide: target, status and
    elapsed keep their full width; when the table does not fit, the last output gives way first (shrinks,
    then goes), then the step. Two columns are left free: the terminal echoes Ctrl-C as `^C` after the table's last
    line, and a line it wrapped would push the table's top border out of the region the live view clears."""
    from rich.cells import cell_len

    need = {col: max([cell_len(col), *(cell_len(r[col]) for r in rows)]) for col in LIVE_COLUMNS}
    need["last output"] = min(need["last output"], LAST_OUTPUT_MAX)
    room = width - 2

    def total(widths: dict[str, int]) -> int:  # each column: its text, a space either side, a border
        return sum(widths.values()) + 3 * len(widths) + 1

    widths = dict(need)
    for col in ("last output", "step"):
        over = total(widths) - room
        if over > 0:
            if widths[col] - over >= NARROWEST:
                widths[col] -= over
            else:
                del widths[col]
    over = total(widths) - room
    if over > 0:  # a terminal too narrow even for these: the target's name is cut last
        widths["target"] = max(1, widths["target"] - over)
    return widths


class RichReporter(Reporter):
    """A live table: each target's current step and how long it has been running."""

    def __init__(self, console: Console):
        self.console = console
        self.lock = threading.Lock()
        self.rows: dict[str, dict[str, object]] = {}
        self.live: Live | None = None

    def start(self, mode: str, recipe: str, targets: list[str]) -> None:
        self.console.print(Text.assemble((mode, "bold"), f" {recipe} on {len(targets)} target(s)"))
        for t in targets:
            self.rows[t] = {"status": "pending", "step": "", "since": time.monotonic(), "last": ""}
        from rich.live import Live  # the live display only: history, reports and plain runs never need it

        self.live = Live(get_renderable=self._table, console=self.console, refresh_per_second=4, transient=True)
        self.live.start()

    def _table(self) -> Table:
        now = time.monotonic()
        rows = []
        with self.lock:
            for t, row in self.rows.items():
                status = str(row["status"])
                elapsed = f"{now - float(row['since']):.0f}s" if status == "running" else ""  # type: ignore[arg-type]
                rows.append({"target": t, "status": status, "step": str(row["step"]), "elapsed": elapsed,
                             "last output": str(row["last"])})
        widths = column_widths(rows, self.console.width)
        table = Table(show_header=True, header_style="bold", expand=False)
        for col, width in widths.items():
            table.add_column(col, overflow="ellipsis", no_wrap=True, width=width)
        for row in rows:
            cells = {col: Text(text) for col, text in row.items()}
            cells["status"].stylize(STATUS_STYLE.get(row["status"], ""))
            table.add_row(*(cells[col] for col in widths))
        return table

    def batch_started(self, name: str, targets: list[str]) -> None:
        # Above the live table, which stays: the rows of later batches wait as pending.
        self.console.print(Text.assemble((name, "bold"), f": {', '.join(targets)}"), highlight=False)

    def target_started(self, target: str) -> None:
        with self.lock:
            self.rows[target].update(status="running", since=time.monotonic())

    def step_started(self, target: str, step: str, phase: str) -> None:
        with self.lock:
            self.rows[target].update(step=f"{step} ({phase})", last="")

    def output(self, target: str, step: str, line: str) -> None:
        with self.lock:
            self.rows[target]["last"] = line.strip()[:200]

    def step_finished(self, target: str, result: StepResult) -> None:
        if result.status in ("changed", "failed", "drift", "would-change", "unknown"):
            style = STATUS_STYLE.get(result.status, "")
            self.console.print(Text.assemble(f"{target} {result.name}: ", (str(result.status), style),
                                             f" ({result.detail}, {result.duration:.1f}s)"), highlight=False)

    def target_finished(self, result: TargetResult) -> None:
        with self.lock:
            self.rows[result.target].update(status=result.status, step="", last=result.error or "")

    def notice(self, target: str, text: str) -> None:
        self.console.print(Text.assemble((target, "bold yellow"), f": {text}"), highlight=False)

    def stop(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None


def summary(results: list[TargetResult], console: Console, *, table: bool = True) -> None:
    """Final per-target table (unless `table` is false: off a terminal it is printed on request), then the
    failures with their output tail and log path."""
    if table:
        grid = Table(title="summary", show_header=True, header_style="bold")
        for col in ("target", "result", "changed", "steps", "time"):
            grid.add_column(col)
        for r in results:
            style = STATUS_STYLE.get(r.status, "")
            grid.add_row(Text(r.target), Text(str(r.status), style=style), str(r.changed), str(len(r.steps)),
                         f"{r.duration:.1f}s")
        console.print(grid)
    for r in results:
        for s in r.steps:
            if s.status in ("failed", "drift"):
                console.print(Text.assemble((r.target, "bold red"), ": step ", (s.name, "bold"),
                                            f" {s.status}: {s.detail}"), highlight=False)
                if s.expected:
                    console.print(f"    expected: {s.expected}", markup=False, highlight=False)
                for line in s.tail:
                    console.print(f"    {line}", markup=False, highlight=False)
            elif s.status == "would-change":
                # What it would do, in words (the step kind's summary; --dry-run --verbose: every command).
                console.print(Text.assemble(f"{r.target}: step ", (s.name, "bold"), " would change: ",
                                            s.would_run or s.detail), highlight=False)
            elif s.status == "unknown":
                console.print(Text.assemble(f"{r.target}: step ", (s.name, "bold"), " ",
                                            ("unknown", STATUS_STYLE["unknown"]), f": {s.detail}"), highlight=False)
        if r.error and r.status != "not-run":
            console.print(Text.assemble((r.target, "bold red"), f": {r.status}: {r.error}"), highlight=False)
        if r.status in ("failed", "unreachable", "drift", "interrupted", "locked") and r.log:
            console.print(f"    full log: {r.log}", markup=False, highlight=False, soft_wrap=True)
    # A stopped rollout: one line per reason, not one per target of a large fleet.
    not_run: dict[str, list[str]] = {}
    for r in results:
        if r.status == "not-run":
            not_run.setdefault(r.error or "not started", []).append(r.target)
    for why, names in not_run.items():
        console.print(Text.assemble((", ".join(names), "bold"), ": ", ("not-run", STATUS_STYLE["not-run"]),
                                    f": {why}"), highlight=False)
