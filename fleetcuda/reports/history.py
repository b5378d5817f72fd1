"""History of runs in SQLite: what each target's checks found, run after run, and what changed.

The database is private (0600, its directory 0700 when fleetcuda creates it) and safe for several
fleetcuda processes at once: WAL mode, a busy timeout, and one short write transaction per run.

Target patterns (`target_pattern`) are comma-separated fnmatch globs matched against target ids
(`pve-gpu1/200`, `pve-*`, `*/20?`); `!glob` excludes, as in --limit. None or "" means every target.
"""

from __future__ import annotations

import fnmatch
import os
import random
import sqlite3
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from fleetcuda.errors import FleetcudaError, InputError
from fleetcuda.reports.formats import FAILING, RunInfo, iso_utc
from fleetcuda.reports.live import STATUS_STYLE
from fleetcuda.results import TargetResult, normalised

SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 30.0
PASSING = frozenset({"ok", "changed"})

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    started_at TEXT NOT NULL,
    finished_at TEXT NOT NULL,
    mode TEXT NOT NULL,
    recipe_name TEXT NOT NULL,
    recipe_path TEXT NOT NULL,
    inventory_path TEXT NOT NULL,
    exit_code INTEGER NOT NULL,
    run_dir TEXT,
    version TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS target_results (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    target TEXT NOT NULL,
    status TEXT NOT NULL,
    error TEXT,
    duration_s REAL NOT NULL,
    log TEXT,
    PRIMARY KEY (run_id, target)
);
CREATE TABLE IF NOT EXISTS step_results (
    run_id INTEGER NOT NULL,
    target TEXT NOT NULL,
    position INTEGER NOT NULL,
    step TEXT NOT NULL,
    status TEXT NOT NULL,
    expected TEXT NOT NULL,
    found TEXT NOT NULL,
    detail TEXT NOT NULL,
    duration_s REAL NOT NULL,
    PRIMARY KEY (run_id, target, position),
    FOREIGN KEY (run_id, target) REFERENCES target_results(run_id, target) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS target_results_by_target ON target_results(target, run_id);
"""


class HistoryError(FleetcudaError):
    """The history database cannot be used: damaged, unreadable, or from a newer fleetcuda."""


_SQLITE_MAX_INT = 2**63 - 1  # `--runs 99999999999999999999` means "all", not an OverflowError
# SQLite's primary result codes for "this is not (or no longer) a database".
_SQLITE_CORRUPT, _SQLITE_NOTADB = 11, 26


def _history_error(db: Path, exc: BaseException) -> HistoryError:
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(exc, sqlite3.DatabaseError) and (
            (code is not None and code & 0xFF in (_SQLITE_CORRUPT, _SQLITE_NOTADB))
            or "not a database" in str(exc) or "malformed" in str(exc)):
        return HistoryError(f"the history file {db} is damaged ({exc}); move it aside (fleetcuda starts a new "
                            "one) or restore it from a backup")
    if isinstance(exc, OSError):
        return HistoryError(f"cannot use the history file {db}: {exc.strerror or exc}")
    return HistoryError(f"cannot use the history file {db}: {exc}")


def check_state_dir(path: Path | None = None) -> Path:
    """The state directory (FLEETCUDA_STATE_DIR or the XDG default), refused as bad input when it, or what
    would be its parent, exists and is not a directory: then no run directory, history or report can be made."""
    if path is None:
        from fleetcuda.state import state_dir
    directory = path if path is not None else state_dir()
    source = "FLEETCUDA_STATE_DIR" if path is None and os.environ.get("FLEETCUDA_STATE_DIR") else "state directory"
    for d in (directory, *directory.parents):
        if not os.path.exists(d):
            continue  # made on first use (or below a file, which the loop reaches next)
        if not os.path.isdir(d):
            what = "is not a directory" if d == directory else f"is below {d}, which is not a directory"
            raise InputError(source, None, "", f"{directory} {what}; name a directory")
        break
    return directory


def check_output_path(option: str, path: str) -> Path:
    """A report path (--output, --report FORMAT=PATH) checked before the run, not after it: its directory exists
    and a file can be made there (the report is written atomically, through a temporary file beside it), and
    the path is not a directory or a device. Bad input otherwise (InputError naming the option)."""
    shown = path if path.isprintable() else ascii(path)
    target = Path(path)
    try:
        os.fsencode(path)  # a NUL, or a surrogate that no bytes stand for
        if "\0" in path:
            raise ValueError("a path cannot contain a NUL character")
        st = os.stat(target)
    except (FileNotFoundError, NotADirectoryError):  # the directory checks below say which
        st = None
    except (OSError, ValueError) as exc:
        raise InputError(option, None, "", f"{shown}: {getattr(exc, 'strerror', None) or exc}") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise InputError(option, None, "", f"{shown} is a directory; name a file")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise InputError(option, None, "", f"{shown} is not a regular file (it would be replaced)")
    parent = target.parent
    if not parent.exists():
        raise InputError(option, None, "", f"{shown}: directory {parent} does not exist")
    if not parent.is_dir():
        raise InputError(option, None, "", f"{shown}: {parent} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".fleetcuda.", suffix=".probe")
    except OSError as exc:
        raise InputError(option, None, "", f"{shown}: cannot write in {parent}: {exc.strerror or exc}") from None
    os.close(fd)
    os.unlink(probe)
    return target


def default_history_path() -> Path:
    """`$FLEETCUDA_STATE_DIR/history.sqlite`, else `${XDG_STATE_HOME:-~/.local/state}/fleetcuda/history.sqlite`."""
    from fleetcuda.state import state_dir

    return state_dir() / "history.sqlite"


# -- target patterns ----------------------------------------------------------------------------


def target_matcher(pattern: str | None) -> Callable[[str], bool]:
    """A predicate for comma-separated fnmatch globs; `!glob` excludes; None/"" matches everything."""
    parts = [p.strip() for p in (pattern or "").split(",") if p.strip()]
    include = [p for p in parts if not p.startswith("!")]
    exclude = [p[1:] for p in parts if p.startswith("!")]

    def match(target: str) -> bool:
        if include and not any(fnmatch.fnmatchcase(target, p) for p in include):
            return False
        return not any(fnmatch.fnmatchcase(target, p) for p in exclude)

    return match


# -- connection ---------------------------------------------------------------------------------


def _make_private_dirs(directory: Path) -> None:
    """Create the missing directories 0700; directories that already exist are left as they are."""
    missing: list[Path] = []
    for d in (directory, *directory.parents):
        if d.exists():
            break
        missing.append(d)
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            continue  # another process made it first
        os.chmod(d, 0o700)  # mkdir's mode goes through the umask


def _create_private_file(path: Path) -> None:
    # Create the file ourselves, 0600, before sqlite does it with the umask's mode; sqlite then gives the
    # -wal and -shm files the same mode as the database.
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


@contextmanager
def _connect(path: str | os.PathLike[str], create: bool) -> Iterator[sqlite3.Connection]:
    """A connection; any SQLite or file error (a damaged file, a directory in its place) is a HistoryError."""
    db = Path(path)
    try:
        with _open(db, create) as conn:
            yield conn
    except HistoryError:
        raise
    except (sqlite3.Error, OSError, RuntimeError) as exc:
        if isinstance(exc, FileNotFoundError) and not create and not db.exists():
            raise
        raise _history_error(db, exc) from exc


@contextmanager
def _open(db: Path, create: bool) -> Iterator[sqlite3.Connection]:
    if create:
        _make_private_dirs(db.parent)
        _create_private_file(db)
    elif not db.exists():
        raise FileNotFoundError(f"no history at {db} (nothing recorded yet)")
    # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE), never left open by the module.
    with closing(sqlite3.connect(db, timeout=BUSY_TIMEOUT_S, isolation_level=None)) as conn:
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        conn.execute("PRAGMA foreign_keys = ON")
        if create:
            _use_wal(conn)
            conn.execute("PRAGMA synchronous = NORMAL")
            _migrate(conn)
        yield conn


def _use_wal(conn: sqlite3.Connection) -> None:
    """WAL: readers never block the writer. The mode is stored in the file, so it is switched once."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    delay = 0.005
    while True:
        try:
            if str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
                conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            # The switch needs an exclusive lock, and SQLite answers "locked" at once, without waiting for
            # busy_timeout, while another process is opening the same new database: wait and retry here.
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 0.25)


def _check_version(conn: sqlite3.Connection) -> int:
    version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    if version > SCHEMA_VERSION:
        raise RuntimeError(f"history schema {version} is newer than this fleetcuda understands ({SCHEMA_VERSION})")
    return version


def _migrate(conn: sqlite3.Connection) -> None:
    if _check_version(conn) == SCHEMA_VERSION:
        return
    # IMMEDIATE takes the write lock first, so two processes creating the schema at once take turns.
    conn.execute("BEGIN IMMEDIATE")
    try:
        if _check_version(conn) < SCHEMA_VERSION:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


# -- writing ------------------------------------------------------------------------------------


def _warn(message: str) -> None:
    print(f"fleetcuda: warning: {message}", file=sys.stderr)


def record(path: str | os.PathLike[str], info: RunInfo, results: list[TargetResult], *,
           on_error: Callable[[str], None] | None = _warn) -> int | None:
    """Store one run with each target's result and each check's status, expected, found; return its id.

    A history that cannot be written (a damaged file, say) must not cost the run its result and reports:
    the problem goes to on_error (by default a warning on stderr) and None is returned. on_error=None raises
    the HistoryError instead.
    """
    try:
        return _record(path, info, results)
    except HistoryError as exc:
        if on_error is None:
            raise
        on_error(f"{exc}; this run was not recorded in the history")
        return None


def _text(value: object) -> object:
    """A string SQLite can store: a path from a non-UTF-8 argv holds lone surrogates (surrogateescape), which
    UTF-8 cannot encode; they are kept as backslash escapes (`\\udcff`)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


def _record(path: str | os.PathLike[str], info: RunInfo, results: list[TargetResult]) -> int:
    run_row = tuple(_text(v) for v in (
        iso_utc(info.started_at), iso_utc(info.finished_at), info.mode, info.recipe_name, info.recipe_path,
        info.inventory_path, info.exit_code, info.run_dir, info.version))
    targets: dict[str, TargetResult] = {}
    for r in results:
        targets.setdefault(r.target, r)  # the engine's ids are unique; never fail a run's record over one
    with _connect(path, create=True) as conn:
        conn.execute("BEGIN IMMEDIATE")
        try:
            cur = conn.execute(
                "INSERT INTO runs (started_at, finished_at, mode, recipe_name, recipe_path, inventory_path, "
                "exit_code, run_dir, version) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", run_row)
            run_id = int(cur.lastrowid or 0)
            conn.executemany(
                "INSERT INTO target_results (run_id, target, status, error, duration_s, log) VALUES (?, ?, ?, ?, ?, ?)",
                [(run_id, _text(r.target), _text(r.status), _text(r.error), round(r.duration, 3), _text(r.log))
                 for r in targets.values()])
            conn.executemany(
                "INSERT INTO step_results (run_id, target, position, step, status, expected, found, detail, "
                "duration_s) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(run_id, _text(r.target), i, _text(s.name), _text(s.status), _text(s.expected), _text(s.found),
                  _text(s.detail), round(s.duration, 3)) for r in targets.values() for i, s in enumerate(r.steps)])
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    return run_id


# -- reading ------------------------------------------------------------------------------------


@dataclass
class RunSummary:
    """One recorded run; the counts cover only the targets that matched the pattern."""

    id: int
    started_at: datetime
    finished_at: datetime
    mode: str
    recipe_name: str
    recipe_path: str
    inventory_path: str
    exit_code: int
    run_dir: str | None
    version: str
    target_status: dict[str, int] = field(default_factory=dict)  # status -> number of targets
    failing_checks: int = 0  # drift or failed checks

    @property
    def targets(self) -> int:
        return sum(self.target_status.values())


@dataclass(frozen=True)
class Change:
    """One difference in a target between its previous and its last recorded run (same recipe and mode).

    kind: "broke" (a check went pass -> fail), "fixed" (fail -> pass), "status" (any other status change of
    a check, e.g. ok -> skipped), "found" (the check's `found` line changed, e.g. a version), "added" /
    "removed" (a check only in the last / previous run), "target" (the target's own status changed).
    before/after hold statuses, or the found values for "found".
    """

    target: str
    recipe: str
    step: str | None  # None for kind "target"
    kind: str
    before: str
    after: str
    previous_run: int
    run: int
    previous_at: datetime
    at: datetime


def _dt(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).astimezone(UTC)


@contextmanager
def _reading(path: str | os.PathLike[str], target_pattern: str | None) -> Iterator[sqlite3.Connection | None]:
    """A connection for queries, with fc_match(target) for the pattern; None when there is no history yet
    (no file, or a file whose creator has not written its schema yet)."""
    db = Path(path)
    if not db.exists():
        yield None
        return
    with _connect(db, create=False) as conn:
        if _check_version(conn) == 0:
            yield None
            return
        conn.create_function("fc_match", 1, target_matcher(target_pattern), deterministic=True)
        yield conn


def recent_runs(path: str | os.PathLike[str], limit: int = 20, target_pattern: str | None = None,
                recipe: str | None = None) -> list[RunSummary]:
    """The last `limit` runs, newest first, that included a target matching `target_pattern`."""
    with _reading(path, target_pattern) as conn:
        if conn is None:
            return []
        rows = conn.execute(
            "SELECT r.id, r.started_at, r.finished_at, r.mode, r.recipe_name, r.recipe_path, r.inventory_path, "
            "r.exit_code, r.run_dir, r.version FROM runs r "
            "WHERE (?1 IS NULL OR r.recipe_name = ?1) AND EXISTS "
            "(SELECT 1 FROM target_results t WHERE t.run_id = r.id AND fc_match(t.target)) "
            "ORDER BY r.finished_at DESC, r.id DESC LIMIT ?2",
            (recipe, min(max(0, limit), _SQLITE_MAX_INT))).fetchall()
        runs = [RunSummary(id=row[0], started_at=_dt(row[1]), finished_at=_dt(row[2]), mode=row[3],
                           recipe_name=row[4], recipe_path=row[5], inventory_path=row[6], exit_code=row[7],
                           run_dir=row[8], version=row[9]) for row in rows]
        by_id = {r.id: r for r in runs}
        if by_id:
            marks = ",".join("?" * len(by_id))
            for run_id, status, n in conn.execute(
                    f"SELECT run_id, status, count(*) FROM target_results WHERE run_id IN ({marks}) "
                    "AND fc_match(target) GROUP BY run_id, status ORDER BY run_id, status", list(by_id)):
                by_id[run_id].target_status[status] = n
            for run_id, n in conn.execute(
                    f"SELECT run_id, count(*) FROM step_results WHERE run_id IN ({marks}) AND fc_match(target) "
                    "AND status IN ('drift', 'failed') GROUP BY run_id", list(by_id)):
                by_id[run_id].failing_checks = n
    return runs


def changes(path: str | os.PathLike[str], target_pattern: str | None = None, mode: str | None = "verify",
            recipe: str | None = None) -> list[Change]:
    """For each (recipe, target) matching the pattern: what changed between its last two recorded runs.

    Only runs of `mode` are compared (None: any mode), since an apply's "changed" is not a verify's "ok".
    A target recorded only once has nothing to compare and yields no rows.
    """
    with _reading(path, target_pattern) as conn:
        if conn is None:
            return []
        # The last two runs of each (recipe, target), newest first.
        pairs = conn.execute(
            "SELECT recipe_name, target, run_id, finished_at, status, nth FROM ("
            " SELECT r.recipe_name, t.target, t.run_id, r.finished_at, t.status, row_number() OVER ("
            "  PARTITION BY r.recipe_name, t.target ORDER BY r.finished_at DESC, r.id DESC) AS nth"
            " FROM target_results t JOIN runs r ON r.id = t.run_id"
            " WHERE fc_match(t.target) AND (?1 IS NULL OR r.mode = ?1) AND (?2 IS NULL OR r.recipe_name = ?2)"
            ") WHERE nth <= 2 ORDER BY recipe_name, target, nth", (mode, recipe)).fetchall()
        last: dict[tuple[str, str], list[tuple[int, str, str]]] = {}
        for recipe_name, target, run_id, finished_at, status, _ in pairs:
            last.setdefault((recipe_name, target), []).append((run_id, finished_at, status))
        out: list[Change] = []
        for (recipe_name, target), runs in last.items():
            if len(runs) < 2:
                continue
            (new_id, new_at, new_status), (old_id, old_at, old_status) = runs
            diffs: list[tuple[str | None, str, str, str]] = []
            if new_status != old_status:
                diffs.append((None, "target", old_status, new_status))
            diffs += _step_changes(_steps(conn, old_id, target), _steps(conn, new_id, target))
            out += [Change(target, recipe_name, step, kind, before, after, old_id, new_id, _dt(old_at), _dt(new_at))
                    for step, kind, before, after in diffs]
    return out


def _steps(conn: sqlite3.Connection, run_id: int, target: str) -> dict[str, tuple[str, str]]:
    rows = conn.execute("SELECT step, status, found FROM step_results WHERE run_id = ? AND target = ? "
                        "ORDER BY position", (run_id, target))
    return {step: (status, found) for step, status, found in rows}


def _step_changes(old: dict[str, tuple[str, str]],
                  new: dict[str, tuple[str, str]]) -> list[tuple[str | None, str, str, str]]:
    """(step, kind, before, after) for each difference between two runs' checks of one target."""
    out: list[tuple[str | None, str, str, str]] = []
    # A run that never reached the target has no checks: that is the "target" row, not N "removed" rows.
    if not old or not new:
        return out
    for step in [*new, *(s for s in old if s not in new)]:
        if step not in old:
            out.append((step, "added", "", new[step][0]))
            continue
        if step not in new:
            out.append((step, "removed", old[step][0], ""))
            continue
        (old_status, old_found), (new_status, new_found) = old[step], new[step]
        if old_status != new_status:
            if old_status in PASSING and new_status in FAILING:
                kind = "broke"
            elif old_status in FAILING and new_status in PASSING:
                kind = "fixed"
            else:
                kind = "status"
            out.append((step, kind, old_status, new_status))
        # A skipped check prints nothing: its empty found is no news. Run ids and the batch's line numbers
        # (in values recorded before found named the step's own line) are no news either.
        if normalised(old_found) != normalised(new_found) and "skipped" not in (old_status, new_status):
            out.append((step, "found", old_found, new_found))
    return out


# -- terminal -----------------------------------------------------------------------------------


def _styled(status: str) -> Text:
    return Text(status, style=STATUS_STYLE.get(status, ""))


_KIND_STYLE = {"broke": "bold red", "fixed": "green", "found": "yellow", "target": "bold", "added": "cyan",
               "removed": "magenta", "status": ""}


def render_history(rows: Sequence[RunSummary] | Sequence[Change], console: Console, title: str | None = None) -> None:
    """A rich table of `recent_runs(...)` or of `changes(...)` rows (whichever the list holds)."""
    if not rows:
        console.print(Text(title + ": nothing recorded" if title else "nothing recorded"), highlight=False)
        return
    if isinstance(rows[0], Change):
        table = Table(title=title or "changes since the previous run", show_header=True, header_style="bold")
        for col in ("target", "recipe", "check", "change", "before", "after", "runs"):
            table.add_column(col, overflow="fold")
        for c in rows:
            assert isinstance(c, Change)
            table.add_row(Text(c.target), Text(c.recipe), Text(c.step or ""),
                          Text(c.kind, style=_KIND_STYLE.get(c.kind, "")),
                          _styled(c.before) if c.kind != "found" else Text(c.before),
                          _styled(c.after) if c.kind != "found" else Text(c.after),
                          Text(f"#{c.previous_run} {iso_utc(c.previous_at)} -> #{c.run} {iso_utc(c.at)}"))
    else:
        table = Table(title=title or "recent runs", show_header=True, header_style="bold")
        for col in ("run", "finished", "mode", "recipe", "exit", "targets", "failing checks", "time"):
            table.add_column(col, overflow="fold")
        for r in rows:
            assert isinstance(r, RunSummary)
            statuses = Text(", ").join(Text.assemble(f"{n} ", _styled(s)) for s, n in r.target_status.items())
            seconds = (r.finished_at - r.started_at).total_seconds()
            table.add_row(str(r.id), iso_utc(r.finished_at), Text(r.mode), Text(r.recipe_name),
                          Text(str(r.exit_code), style="" if r.exit_code == 0 else "red"), statuses,
                          str(r.failing_checks), f"{seconds:.0f}s")
    console.print(table)
