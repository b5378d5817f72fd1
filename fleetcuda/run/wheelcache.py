"""The control machine's cache of wheels built on targets, keyed by ABI fingerprint, and who builds what.

Layout: CACHE/<package>-<version>/<fingerprint key>/ holds the wheel and provenance.json (its sha256, the
fingerprint, which target built it and when, when it was last installed). Directories 0700, files 0600.
An entry whose wheel no longer has its recorded sha256 is never installed: it is dropped and rebuilt.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from fleetcuda.run.fingerprint import FIELDS, key
from fleetcuda.run.wheelhouse import sha256

PROVENANCE = "provenance.json"


def cache_dir() -> Path:
    if os.environ.get("FLEETCUDA_CACHE_DIR"):
        return Path(os.environ["FLEETCUDA_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "fleetcuda" / "wheels"


@dataclass
class CacheEntry:
    path: Path  # the entry's directory
    wheel: Path
    provenance: dict

    @property
    def key(self) -> str:
        return self.path.name

    @property
    def sha256(self) -> str:
        return str(self.provenance["sha256"])

    @property
    def fingerprint(self) -> dict[str, str]:
        return dict(self.provenance["fingerprint"])


@dataclass
class Problem:
    path: Path
    why: str


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


_RENAME_EXCHANGE = 2  # renameat2(2) flag: swap two paths in one step
_AT_FDCWD = -100
_libc: ctypes.CDLL | None = None


def _exchange(a: Path, b: Path) -> None:
    """Swap the directories at a and b atomically (Linux renameat2 RENAME_EXCHANGE): every reader of b sees
    either what was there or what replaces it, never nothing. OSError where the system cannot do it."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(_libc, "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(b))


def _replace_dir(new: Path, final: Path) -> Path | None:
    """Put directory `new` at `final`, replacing what is there at once where the system allows it; returns the
    path now holding the replaced directory (for the caller to delete), or None if there was none."""
    try:
        new.rename(final)  # nothing there yet: a plain rename
        return None
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    try:
        _exchange(new, final)
        return new
    except OSError as exc:
        if exc.errno not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    # No atomic swap here: move the old entry aside, then the new one in (a reader may see no entry briefly).
    old = final.with_name(f".old.{final.name}.{os.getpid()}.{threading.get_ident()}")
    final.rename(old)
    new.rename(final)
    return old


def _sha256_fd(fd: int) -> str:
    h = hashlib.sha256()
    while block := os.read(fd, 1 << 20):
        h.update(block)
    return h.hexdigest()


def _write_json(path: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".provenance.")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, path)


def _replaced(where: Path, dfd: int) -> bool:
    """Whether `where` is no longer the directory open as dfd (replaced or removed since it was opened)."""
    try:
        now = os.stat(where)
    except OSError:
        return True
    opened = os.fstat(dfd)
    return (now.st_dev, now.st_ino) != (opened.st_dev, opened.st_ino)


class WheelCache:
    def __init__(self, root: Path | None = None):
        self.root = root or cache_dir()
        self._lock = threading.Lock()  # installs on several targets note their use at once

    def _private_root(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.root, 0o700)

    def entry_dir(self, fingerprint: dict[str, str]) -> Path:
        return self.root / f"{fingerprint['package']}-{fingerprint['version']}" / key(fingerprint)

    def lookup(self, fingerprint: dict[str, str]) -> CacheEntry | Problem | None:
        """The usable entry for this fingerprint, a Problem if there is a broken one, or None."""
        where = self.entry_dir(fingerprint)
        if not where.is_dir():
            return None
        entry = self._read(where)
        if isinstance(entry, Problem):
            return entry
        if entry.fingerprint != {k: fingerprint[k] for k in FIELDS}:
            return Problem(where, "its provenance names another fingerprint")
        return entry

    def _read(self, where: Path) -> CacheEntry | Problem:
        """Read one entry through a handle on its directory, so that an entry replaced meanwhile (store swaps the
        whole directory) is read whole, old or new; a read spoiled by a replacement is tried again."""
        found: CacheEntry | Problem = Problem(where, "it kept being replaced while read")
        for _ in range(5):
            try:
                dfd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except FileNotFoundError:
                return Problem(where, "it was removed while read")
            except OSError as exc:
                return Problem(where, f"unreadable: {exc.strerror or exc}")
            try:
                found = self._read_at(where, dfd)
                if isinstance(found, CacheEntry) or not _replaced(where, dfd):
                    return found
            finally:
                os.close(dfd)
        return found

    def _read_at(self, where: Path, dfd: int) -> CacheEntry | Problem:
        try:
            fd = os.open(PROVENANCE, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dfd)
            with os.fdopen(fd, encoding="utf-8") as fh:
                provenance = json.loads(fh.read())
            wheel = where / provenance["wheel"]
            if Path(provenance["wheel"]).name != provenance["wheel"] or not provenance["wheel"].endswith(".whl"):
                return Problem(where, "its provenance names no wheel file")
            try:
                wfd = os.open(provenance["wheel"], os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
            except FileNotFoundError:
                return Problem(where, f"{wheel.name} is missing")
            try:
                if not stat.S_ISREG(os.fstat(wfd).st_mode):
                    return Problem(where, f"{wheel.name} is missing")
                actual = _sha256_fd(wfd)
            finally:
                os.close(wfd)
            if actual != provenance["sha256"]:
                return Problem(where, f"{wheel.name} has sha256 {actual[:16]}..., not the recorded "
                                      f"{str(provenance['sha256'])[:16]}... (changed or truncated)")
            if not isinstance(provenance.get("fingerprint"), dict):
                return Problem(where, "its provenance has no fingerprint")
        except FileNotFoundError:
            return Problem(where, f"{PROVENANCE} is missing (an interrupted store?)")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return Problem(where, f"{PROVENANCE} is unreadable: {exc}")
        return CacheEntry(where, wheel, provenance)

    def store(self, wheel_file: Path, fingerprint: dict[str, str], provenance: dict,
              sha: str | None = None) -> CacheEntry:
        """Move a fetched wheel into the cache (replacing any entry for the fingerprint), atomically.
        `sha`: its sha256 when the caller has just checked it (a wheel can be hundreds of MB: hashed once)."""
        self._private_root()
        final = self.entry_dir(fingerprint)
        final.parent.mkdir(exist_ok=True, mode=0o700)
        staging = Path(tempfile.mkdtemp(dir=final.parent, prefix=".incoming."))
        try:
            wheel = staging / wheel_file.name
            shutil.move(str(wheel_file), wheel)
            os.chmod(wheel, 0o600)
            data = {**provenance, "wheel": wheel.name, "sha256": sha or sha256(wheel), "size": wheel.stat().st_size,
                    "fingerprint": {k: fingerprint[k] for k in FIELDS}, "key": key(fingerprint),
                    "stored_at": _now(), "last_used": _now(), "installs": 0}
            _write_json(staging / PROVENANCE, data)
            # Atomic: a reader of the entry (another target's install) sees the old one or the new one.
            old = _replace_dir(staging, final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return CacheEntry(final, final / data["wheel"], data)

    def incoming(self) -> Path:
        """A private scratch directory inside the cache for a wheel being fetched."""
        self._private_root()
        return Path(tempfile.mkdtemp(dir=self.root, prefix=".fetch."))

    def note_install(self, entry: CacheEntry, target: str) -> None:
        with self._lock:
            self._note_install(entry, target)

    def _note_install(self, entry: CacheEntry, target: str) -> None:
        data = dict(entry.provenance)
        data["last_used"] = _now()
        data["installs"] = int(data.get("installs", 0)) + 1
        data["last_installed_on"] = target
        try:
            _write_json(entry.path / PROVENANCE, data)
        except OSError:
            pass  # bookkeeping only
        entry.provenance = data

    def entries(self) -> list[CacheEntry | Problem]:
        out: list[CacheEntry | Problem] = []
        if not self.root.is_dir():
            return out
        for package in sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            for where in sorted(p for p in package.iterdir() if p.is_dir() and not p.name.startswith(".")):
                out.append(self._read(where))
        return out

    def prune(self, *, everything: bool = False, older_than_days: float | None = None, package: str | None = None,
              dry_run: bool = False) -> list[tuple[Path, str]]:
        """Remove broken entries and leftovers of interrupted fetches; with options, also usable entries not used
        for `older_than_days`, of one `package`, or all. Returns what was (or would be) removed, and why."""
        removed: list[tuple[Path, str]] = []
        cutoff = time.time() - older_than_days * 86400 if older_than_days is not None else None
        for item in self.entries():
            if isinstance(item, Problem):
                removed.append((item.path, f"broken: {item.why}"))
                continue
            prov = item.provenance
            if package is not None and prov["fingerprint"]["package"] != package:
                continue
            if everything or package is not None and cutoff is None:
                removed.append((item.path, "asked for"))
            elif cutoff is not None and _epoch(str(prov.get("last_used", prov.get("stored_at", "")))) < cutoff:
                removed.append((item.path, f"not used since {prov.get('last_used')}"))
        if self.root.is_dir():
            for pattern in (".fetch.*", "*/.incoming.*", "*/.old.*"):
                removed += [(leftover, "left by an interrupted run") for leftover in self.root.glob(pattern)]
        if not dry_run:
            for path, _ in removed:
                shutil.rmtree(path, ignore_errors=True)
            for package_dir in (self.root.iterdir() if self.root.is_dir() else []):
                if package_dir.is_dir() and not any(package_dir.iterdir()):
                    package_dir.rmdir()
        return removed


def render_cache(root: Path, items: list[CacheEntry | Problem], console: Console) -> None:
    """The cache as a table. Every cell is data (rich Text, control and bidi characters escaped): a fingerprint's
    fields and a wheel's provenance came from the build target (`2.11.0[/]` is a version, never markup)."""
    from fleetcuda.redact import printable

    def cell(value: object, style: str = "") -> Text:
        return Text(printable(str(value)), style=style)

    if not items:
        console.print(cell(f"no wheels cached in {root}"))
        return
    table = Table(title=cell(f"cached wheels ({root})"))
    for col in ("package", "fingerprint", "torch", "CUDA", "python", "nvcc", "archs", "built on", "built at",
                "installs", "size", "sha256"):
        table.add_column(col, overflow="fold")
    for item in items:
        if isinstance(item, Problem):
            table.add_row(cell(item.path.parent.name, "red"), cell(item.path.name), cell(f"broken: {item.why}", "red"),
                          *[""] * 9)
            continue
        p, f = item.provenance, item.fingerprint
        size = p.get("size", 0)
        table.add_row(*(cell(v) for v in (
            f"{f['package']} {f['version']}", item.key, f["torch"], f["torch_cuda"], f["abi"], f["nvcc"], f["archs"],
            p.get("built_on", "?"), p.get("built_at", "?"), p.get("installs", 0),
            _size(size) if isinstance(size, int) else size, item.sha256[:12])))
    console.print(table)
    console.print("fleetcuda cache prune: drop broken entries; --older-than DAYS, --package P or --all for more",
                  markup=False, highlight=False)


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def _epoch(stamp: str) -> float:
    try:
        return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return 0.0


@dataclass
class Turn:
    """What a target does for a fingerprint: install a cached wheel, build (and publish) it, or build alone."""

    role: str  # install | build | build-alone
    entry: CacheEntry | None = None
    note: str = ""


class BuildBroker:
    """One build per fingerprint per run: the first target to ask builds; the others with the same fingerprint
    wait for it, then install its wheel. If that build or its fetch fails, each waiter builds for itself."""

    def __init__(self, cache: WheelCache):
        self.cache = cache
        self._lock = threading.Lock()
        self._building: dict[str, tuple[threading.Event, str]] = {}  # key -> (done, builder target)
        self._failed: dict[str, tuple[str, str]] = {}  # key -> (builder, why)
        self._verified: dict[str, CacheEntry] = {}

    def turn(self, fingerprint: dict[str, str], target: str, cancelled: Callable[[], bool],
             on_wait: Callable[[str], None] = lambda builder: None) -> Turn:
        k = key(fingerprint)
        waited_for = ""
        while True:
            with self._lock:
                entry = self._verified.get(k)
                note = ""
                if entry is None:
                    found = self.cache.lookup(fingerprint)
                    if isinstance(found, CacheEntry):
                        entry = self._verified[k] = found
                    elif isinstance(found, Problem):
                        note = f"cached wheel not used: {found.why}; building again"
                if entry is not None:
                    return Turn("install", entry, f"waited for the build on {waited_for}" if waited_for else "")
                if k in self._failed:
                    builder, why = self._failed[k]
                    return Turn("build-alone", note=f"the build on {builder} gave no wheel ({why}); building here")
                if k not in self._building:
                    self._building[k] = (threading.Event(), target)
                    return Turn("build", note=note)
                done, builder = self._building[k]
            waited_for = builder
            on_wait(builder)
            while not done.wait(0.5):
                if cancelled():
                    return Turn("cancelled")

    def finished(self, fingerprint: dict[str, str], entry: CacheEntry | None, builder: str, why: str = "") -> None:
        k = key(fingerprint)
        with self._lock:
            if entry is not None:
                self._verified[k] = entry
            else:
                self._failed[k] = (builder, why or "failed")
            done, _ = self._building.pop(k, (threading.Event(), ""))
        done.set()
