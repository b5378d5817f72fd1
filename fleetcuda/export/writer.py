"""Writes an exported project: directory 0700, files 0600, never over someone else's files.

Everything under `dest` is done through a descriptor of `dest` opened with O_NOFOLLOW (and of each
subdirectory, made by this writer): a `dest` swapped for a symlink between the checks and the writes
makes the export fail rather than write where the symlink points."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from fleetcuda.errors import InputError
from fleetcuda.export.ansible import MARKER

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_dir(name: str | Path, dir_fd: int | None = None, *, what: str) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise InputError("-o", None, what, f"is not a directory (or was replaced meanwhile): {exc.strerror}") from None


MANIFEST = "# files this export wrote (a re-export replaces these and leaves anything else alone):"


def _written_by_last_export(fd: int) -> list[str] | None:
    """The files the previous export listed in its marker; None for a marker without a list (an old export)."""
    try:
        mfd = os.open(MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    except OSError:
        return None
    with os.fdopen(mfd, encoding="utf-8", errors="replace") as fh:
        lines = fh.read(1 << 20).splitlines()
    if MANIFEST not in lines:
        return None
    names = lines[lines.index(MANIFEST) + 1:]
    # Only names this writer can have written: a file at the top or one directory down, no way out.
    return [n for n in names if n and not n.startswith("/") and ".." not in n.split("/") and n.count("/") <= 1]


def _remove(fd: int, name: str) -> None:
    try:
        if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
            shutil.rmtree(name, dir_fd=fd)
        else:
            os.unlink(name, dir_fd=fd)
    except FileNotFoundError:
        pass


def write_project(dest: Path, files: dict[str, str]) -> None:
    """Write `files` under `dest`. A non-empty `dest` is refused unless it holds a previous export (its
    marker file); then the files that export wrote are replaced, so no file of an older export (a removed host)
    is left, and files the user added (a vaulted secrets.yml) stay."""
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise InputError("-o", None, str(dest), "is not a directory")
    try:
        dest.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError("-o", None, str(dest), f"cannot be made: {exc.strerror}") from None
    fd = _open_dir(dest, what=str(dest))
    try:
        entries = os.listdir(fd)
        if entries:
            try:
                marker = os.stat(MARKER, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                marker = None
            if marker is None or not stat.S_ISREG(marker.st_mode):
                raise InputError("-o", None, str(dest), f"is not empty and holds no previous export ({MARKER}): "
                                                        "name an empty or new directory")
            written = _written_by_last_export(fd)
            if written is None:  # an export from before the list: everything in it was its own
                for name in entries:
                    _remove(fd, name)
            else:
                for top in {n.partition("/")[0] for n in written if "/" in n}:
                    try:
                        if not stat.S_ISDIR(os.stat(top, dir_fd=fd, follow_symlinks=False).st_mode):
                            os.unlink(top, dir_fd=fd)  # where the export made a directory: replaced, not followed
                    except FileNotFoundError:
                        pass
                for name in [*written, MARKER]:
                    parent, _, base = name.rpartition("/")
                    if not parent:
                        _remove(fd, base)
                        continue
                    try:
                        sub = _open_dir(parent, fd, what=str(dest / parent))
                    except InputError:
                        continue  # gone, or no longer a directory of ours: nothing of ours to remove there
                    try:
                        _remove(sub, base)
                    finally:
                        os.close(sub)
                for name in {n.partition("/")[0] for n in written if "/" in n}:
                    try:
                        os.rmdir(name, dir_fd=fd)  # only when nothing of the user's is left in it
                    except OSError:
                        pass
        os.fchmod(fd, 0o700)
        files = {**files, MARKER: files.get(MARKER, "") + MANIFEST + "\n"
                 + "".join(f"{rel}\n" for rel in sorted(files) if rel != MARKER)}
        dirs: dict[str, int] = {"": fd}
        try:
            for rel, text in sorted(files.items()):
                parent, _, name = rel.rpartition("/")
                if parent not in dirs:
                    assert "/" not in parent and parent not in ("", ".", ".."), rel
                    try:
                        os.mkdir(parent, 0o700, dir_fd=fd)
                    except FileExistsError:  # kept for the user's files in it: ours were removed above
                        pass
                    dirs[parent] = _open_dir(parent, fd, what=str(dest / parent))
                # O_EXCL and O_NOFOLLOW: what this export writes was removed above, so anything found here is
                # the user's (or appeared meanwhile): refused, never overwritten.
                try:
                    out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                  dir_fd=dirs[parent])
                except FileExistsError:
                    raise InputError("-o", None, str(dest / rel), "exists and is not a file of the previous "
                                     "export: move it away, then export again") from None
                with os.fdopen(out, "w", encoding="utf-8") as fh:
                    fh.write(text)
        finally:
            for sub, sub_fd in dirs.items():
                if sub:
                    os.close(sub_fd)
    finally:
        os.close(fd)
