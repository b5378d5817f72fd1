"""Writes an exported project: directory 0700, files 0600, never over someone else's files."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from fleetcuda.errors import InputError
from fleetcuda.export.ansible import MARKER


def write_project(dest: Path, files: dict[str, str]) -> None:
    """Write `files` under `dest`. A non-empty `dest` is refused unless it holds a previous export (its
    marker file); then its contents are replaced, so no file of an older export (a removed host) is left."""
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise InputError("-o", None, str(dest), "is not a directory")
    if dest.exists() and any(dest.iterdir()):
        if not (dest / MARKER).is_file():
            raise InputError("-o", None, str(dest), f"is not empty and holds no previous export ({MARKER}): "
                                                    "name an empty or new directory")
        for entry in dest.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    dest.mkdir(mode=0o700, parents=True, exist_ok=True)
    dest.chmod(0o700)
    for rel, text in sorted(files.items()):
        path = dest / rel
        if path.parent != dest:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # O_EXCL and O_NOFOLLOW: the directory was just emptied, so anything found here appeared meanwhile.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
