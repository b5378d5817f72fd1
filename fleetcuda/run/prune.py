"""Run-log retention: the run directories under `<state dir>/runs` older than a number of days are removed,
always keeping the newest few. `fleetcuda prune` applies it on request; every apply and verify (so the nightly
job) applies the default when it ends: KEEP_DAYS days, at least KEEP_RUNS runs; FLEETCUDA_KEEP_DAYS changes
the days (0: runs never prune).

Standard library only; only directories named as fleetcuda names its runs are touched."""

from __future__ import annotations

import os
import re
import shutil
import time
from calendar import timegm
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

KEEP_DAYS = 30
KEEP_RUNS = 20
# state.make_run_dir: <UTC stamp>-<mode>-<recipe>-<pid>-<random>
RUN_DIR = re.compile(r"^(\d{8}T\d{6}Z)-")


@dataclass(frozen=True)
class Pruned:
    path: Path
    age_days: float


def _started(path: Path) -> float:
    m = RUN_DIR.match(path.name)
    if m:
        return float(timegm(time.strptime(m.group(1), "%Y%m%dT%H%M%SZ")))
    return path.stat().st_mtime


def prune_runs(state_dir: Path, *, older_than_days: float = KEEP_DAYS, keep_runs: int = KEEP_RUNS,
               dry_run: bool = False, keep: Path | None = None, now: float | None = None) -> list[Pruned]:
    """Remove (or, dry_run, list) the runs older than `older_than_days`, never the `keep_runs` newest nor
    `keep` (the run now ending); oldest first."""
    runs = state_dir / "runs"
    if not runs.is_dir():
        return []
    now = time.time() if now is None else now
    found = sorted(((_started(p), p) for p in runs.iterdir() if p.is_dir() and not p.is_symlink()
                    and RUN_DIR.match(p.name)), reverse=True)
    out = []
    for started, path in found[max(keep_runs, 0):]:
        age = (now - started) / 86400
        if age < older_than_days or (keep is not None and path == keep):
            continue
        if not dry_run:
            shutil.rmtree(path, ignore_errors=True)
        out.append(Pruned(path, age))
    return sorted(out, key=lambda p: -p.age_days)


def default_days(environ: Mapping[str, str]) -> float:
    text = environ.get("FLEETCUDA_KEEP_DAYS", "").strip()
    try:
        return float(text) if text else KEEP_DAYS
    except ValueError:
        return KEEP_DAYS


def prune_after_run(state_dir: Path, *, keep: Path, environ: Mapping[str, str] = os.environ) -> list[str]:
    """The default retention, applied as a run ends; what could not be done, as notes (a run never fails for it)."""
    days = default_days(environ)
    if days <= 0:
        return []
    try:
        prune_runs(state_dir, older_than_days=days, keep=keep)
    except OSError as exc:
        return [f"warning: old run logs were not pruned: {exc}"]
    return []
