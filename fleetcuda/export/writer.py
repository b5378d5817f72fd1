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


def write_project(dest: Path, files: dict[str, str]) -> None:
    """Write `files` under `dest`. A non-empty `dest` is refused unless it holds a previous export (its
    marker file); then its contents are replaced, so no file of an older export (a removed host) is left."""
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
            for name in entries:
                if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    shutil.rmtree(name, dir_fd=fd)
                else:
                    os.unlink(name, dir_fd=fd)
        os.fchmod(fd, 0o700)
        dirs: dict[str, int] = {"": fd}
        try:
            for rel, text in sorted(files.items()):
                parent, _, name = rel.rpartition("/")
                if parent not in dirs:
                    assert "/" not in parent and parent not in ("", ".", ".."), rel
                    os.mkdir(parent, 0o700, dir_fd=fd)
                    dirs[parent] = _open_dir(parent, fd, what=str(dest / parent))
                # O_EXCL and O_NOFOLLOW: the directory was just emptied, so anything found here appeared meanwhile.
                out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                              dir_fd=dirs[parent])
                with os.fdopen(out, "w", encoding="utf-8") as fh:
                    fh.write(text)
        finally:
            for sub, sub_fd in dirs.items():
                if sub:
                    os.close(sub_fd)
    finally:
        os.close(fd)
