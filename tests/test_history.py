"""Run history in SQLite: private files, concurrent writers, recent runs and change detection."""

from __future__ import annotations

import io
import multiprocessing
import os
import sqlite3
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from rich.console import Console

from fleetcuda.reports.formats import RunInfo
from fleetcuda.reports.history import (
    Change,
    changes,
    default_history_path,
    recent_runs,
    record,
    render_history,
    target_matcher,
)
from fleetcuda.run.engine import StepResult, TargetResult, exit_code

if TYPE_CHECKING:
    from multiprocessing.synchronize import Barrier

T0 = datetime(2025, 6, 1, 3, 0, 0, tzinfo=UTC)
NVCC_128 = "Cuda compilation tools, release 12.8, V12.8.93"
NVCC_126 = "Cuda compilation tools, release 12.6, V12.6.77"


def info_at(day: int, results: list[TargetResult], mode: str = "verify", recipe: str = "gdn-fastpath") -> RunInfo:
    start = T0 + timedelta(days=day)
    return RunInfo(mode, f"recipes/{recipe}.yaml", recipe, "inventories/lab.yaml", start,
                   start + timedelta(seconds=42), exit_code(results), f"/state/runs/{day}")


def target(name: str, status: str = "ok", nvcc: str = NVCC_128, fast: str = "ok", torch: str = "2.7.0+cu128",
           error: str | None = None) -> TargetResult:
    if status == "unreachable":
        return TargetResult(name, status, [], error or f"{name}: no route to host", None, 10.0)
    steps = [
        StepResult("cuda-compiler", "ok" if nvcc == NVCC_128 else "drift", 0.4, "verified",
                   expected="nvcc reports release 12.8", found=nvcc),
        StepResult("torch-matches-nvcc", "ok", 0.3, "verified", expected="torch CUDA major == nvcc major",
                   found=torch),
        StepResult("fast-path", fast, 1.2, "verified" if fast == "ok" else "verification failed",
                   ["ImportError: causal_conv1d"] if fast == "drift" else [], expected="fast path available",
                   found="fast path: yes" if fast == "ok" else "ImportError: causal_conv1d"),
    ]
    derived = "drift" if any(s.status == "drift" for s in steps) else "ok"
    return TargetResult(name, derived, steps, error, f"/state/runs/{name.replace('/', '_')}.log", 2.0)


# -- paths and permissions ----------------------------------------------------------------------


def test_default_history_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FLEETCUDA_STATE_DIR", str(tmp_path / "s"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "x"))
    assert default_history_path() == tmp_path / "s" / "history.sqlite"
    monkeypatch.delenv("FLEETCUDA_STATE_DIR")
    assert default_history_path() == tmp_path / "x" / "fleetcuda" / "history.sqlite"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_history_path() == tmp_path / "home" / ".local" / "state" / "fleetcuda" / "history.sqlite"


def test_record_creates_private_database(tmp_path: Path) -> None:
    path = tmp_path / "state" / "fleetcuda" / "history.sqlite"
    old_umask = os.umask(0o022)
    try:
        run_id = record(path, info_at(0, [target("pve/200")]), [target("pve/200")])
    finally:
        os.umask(old_umask)
    assert run_id == 1
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.parent.parent.stat().st_mode) == 0o700
    for sidecar in (path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        if sidecar.exists():
            assert stat.S_IMODE(sidecar.stat().st_mode) == 0o600
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        rows = conn.execute("SELECT target, step, status, expected, found FROM step_results ORDER BY position")
        assert rows.fetchall() == [
            ("pve/200", "cuda-compiler", "ok", "nvcc reports release 12.8", NVCC_128),
            ("pve/200", "torch-matches-nvcc", "ok", "torch CUDA major == nvcc major", "2.7.0+cu128"),
            ("pve/200", "fast-path", "ok", "fast path available", "fast path: yes"),
        ]
    assert record(path, info_at(1, [target("pve/200")]), [target("pve/200")]) == 2


def test_reading_a_missing_history_is_empty(tmp_path: Path) -> None:
    assert recent_runs(tmp_path / "none.sqlite") == []
    assert changes(tmp_path / "none.sqlite") == []
    assert not (tmp_path / "none.sqlite").exists()


# -- concurrency --------------------------------------------------------------------------------


def _record_many(path: str, tag: str, count: int, barrier: Barrier) -> None:
    barrier.wait()
    for i in range(count):
        results = [target(f"{tag}/{i}"), target(f"{tag}/{i}-b", nvcc=NVCC_126)]
        record(path, info_at(i, results, recipe=tag), results)


@pytest.mark.parametrize("processes", [2, 6])
def test_processes_record_at_once(tmp_path: Path, processes: int) -> None:
    path = str(tmp_path / "h" / "history.sqlite")  # no process finds a database: they all create it at once
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(processes)
    tags = [f"p{i}" for i in range(processes)]
    procs = [ctx.Process(target=_record_many, args=(path, tag, 25, barrier)) for tag in tags]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * processes
    with sqlite3.connect(path) as conn:
        per_recipe = dict(conn.execute("SELECT recipe_name, count(*) FROM runs GROUP BY recipe_name"))
        assert per_recipe == dict.fromkeys(tags, 25)
        assert conn.execute("SELECT count(*) FROM target_results").fetchone()[0] == 50 * processes
        assert conn.execute("SELECT count(*) FROM step_results").fetchone()[0] == 150 * processes
    assert len(recent_runs(path, limit=1000)) == 25 * processes


# -- recent runs --------------------------------------------------------------------------------


def test_recent_runs_newest_first_with_pattern(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite"
    day0 = [target("pve-gpu1/200"), target("pve-gpu2/300", status="unreachable")]
    day1 = [target("pve-gpu1/200", nvcc=NVCC_126), target("gpu-box")]
    ids = [record(path, info_at(0, day0), day0), record(path, info_at(1, day1), day1)]
    runs = recent_runs(path)
    assert [r.id for r in runs] == ids[::-1]
    assert runs[0].finished_at == T0 + timedelta(days=1, seconds=42)
    assert runs[0].target_status == {"drift": 1, "ok": 1} and runs[0].failing_checks == 1
    assert runs[0].exit_code == 1 and runs[0].mode == "verify" and runs[0].recipe_name == "gdn-fastpath"
    assert [r.id for r in recent_runs(path, limit=1)] == [ids[1]]
    only_gpu2 = recent_runs(path, target_pattern="pve-gpu2/*")
    assert [r.id for r in only_gpu2] == [ids[0]] and only_gpu2[0].target_status == {"unreachable": 1}
    assert [r.id for r in recent_runs(path, target_pattern="gpu-box, pve-gpu2/*")] == ids[::-1]
    assert [r.id for r in recent_runs(path, target_pattern="pve-*,!pve-gpu1/*")] == [ids[0]]
    assert recent_runs(path, target_pattern="nomatch*") == []


def test_target_matcher() -> None:
    m = target_matcher(" pve-*/20?, gpu-box ,!pve-gpu9/*")
    assert m("pve-gpu1/200") and m("gpu-box")
    assert not m("pve-gpu1/210") and not m("pve-gpu9/200") and not m("other")
    assert target_matcher(None)("anything") and target_matcher("")("anything")
    assert target_matcher("!x*")("y") and not target_matcher("!x*")("xy")


# -- changes ------------------------------------------------------------------------------------


def test_changes_between_the_last_two_runs(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite"
    day0 = [target("pve/200"), target("pve/201", fast="drift"), target("pve/202"), target("pve/203")]
    day1 = [target("pve/200"), target("pve/201", fast="drift"), target("pve/202"), target("pve/203")]
    day2 = [target("pve/200", nvcc=NVCC_126),           # pass -> fail, and the version it found changed
            target("pve/201", torch="2.8.0+cu128"),     # fail -> pass, and a found value changed while ok
            target("pve/202"),                           # nothing changed
            target("pve/203", status="unreachable"),     # only the target row, not one row per check
            target("pve/204")]                           # first run: nothing to compare
    first, second, third = (record(path, info_at(d, rs), rs) for d, rs in enumerate((day0, day1, day2)))
    # An apply run after the verify runs is not compared with them.
    apply_run = [target("pve/200")]
    record(path, info_at(3, apply_run, mode="apply"), apply_run)

    rows = changes(path)
    at1, at2 = T0 + timedelta(days=1, seconds=42), T0 + timedelta(days=2, seconds=42)

    def c(tgt: str, step: str | None, kind: str, before: str, after: str) -> Change:
        return Change(tgt, "gdn-fastpath", step, kind, before, after, second, third, at1, at2)

    assert rows == [
        c("pve/200", None, "target", "ok", "drift"),
        c("pve/200", "cuda-compiler", "broke", "ok", "drift"),
        c("pve/200", "cuda-compiler", "found", NVCC_128, NVCC_126),
        c("pve/201", None, "target", "drift", "ok"),
        c("pve/201", "torch-matches-nvcc", "found", "2.7.0+cu128", "2.8.0+cu128"),
        c("pve/201", "fast-path", "fixed", "drift", "ok"),
        c("pve/201", "fast-path", "found", "ImportError: causal_conv1d", "fast path: yes"),
        c("pve/203", None, "target", "ok", "unreachable"),
    ]
    assert first < second
    assert changes(path, target_pattern="pve/200") == rows[:3]
    assert changes(path, target_pattern="pve/20[23]") == rows[-1:]
    # Any mode: pve/200's last two runs are now day 2 (verify) and day 3 (apply).
    assert [(r.target, r.kind, r.step) for r in changes(path, target_pattern="pve/200", mode=None)] == [
        ("pve/200", "target", None), ("pve/200", "fixed", "cuda-compiler"), ("pve/200", "found", "cuda-compiler")]


def test_changes_added_removed_and_per_recipe(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite"
    before = [TargetResult("gpu-box", "ok", [StepResult("a", "ok", found="1"), StepResult("gone", "ok")])]
    after = [TargetResult("gpu-box", "ok", [StepResult("a", "skipped"), StepResult("new", "ok")])]
    record(path, info_at(0, before), before)
    other = [TargetResult("gpu-box", "ok", [StepResult("zzz", "ok")])]
    record(path, info_at(1, other, recipe="other"), other)  # another recipe on the same target
    record(path, info_at(2, after), after)
    assert [(r.recipe, r.step, r.kind, r.before, r.after) for r in changes(path)] == [
        ("gdn-fastpath", "a", "status", "ok", "skipped"),  # a skipped check's empty found is no news
        ("gdn-fastpath", "new", "added", "", "ok"),
        ("gdn-fastpath", "gone", "removed", "ok", ""),
    ]
    assert changes(path, recipe="other") == []


# -- terminal -----------------------------------------------------------------------------------


def test_render_history(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite"
    for day, nvcc in enumerate((NVCC_128, NVCC_126)):
        rs = [target("pve/200", nvcc=nvcc)]
        record(path, info_at(day, rs), rs)
    buf = io.StringIO()
    console = Console(file=buf, width=220, color_system=None)
    render_history(recent_runs(path), console)
    render_history(changes(path), console)
    render_history([], console, title="changes")
    out = buf.getvalue()
    for text in ("recent runs", "2025-06-02T03:00:42Z", "1 drift", "changes since the previous run", "broke",
                 NVCC_126, "#1 2025-06-01T03:00:42Z -> #2 2025-06-02T03:00:42Z", "changes: nothing recorded"):
        assert text in out, text
