"""What runs on targets: the framing protocol and the programs fleetcuda sends.

Every program that runs on a target is a real file next to this one (Python programs are ruff-checked and
tested through their own `main()`; shell scripts with `bash -n`). The file's text is exactly what is sent:
parameters reach a program through its argv, its environment or its stdin, never by formatting its text, so
a dry run can show each program once, by name and digest (`catalog()`), and find it verbatim in every script.

A Python program is sent as the body of a quoted heredoc (`python_heredoc`), a shell script as the text of
shell functions or commands that the sending script then calls with arguments.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Literal

Language = Literal["python", "bash"]

# name -> (file in this package, language). A program not listed here is not sent anywhere.
PROGRAMS: dict[str, tuple[str, Language]] = {
    "fingerprint": ("fingerprint.py", "python"),
    "import_check": ("import_check.py", "python"),
    "arch_patch": ("arch_patch.py", "python"),
    "doctor_probe": ("doctor_probe.py", "python"),
    "fast_path_gate": ("fast_path_gate.py", "python"),
    "pyserver": ("pyserver.py", "python"),
    "gpu_passthrough": ("gpu_passthrough.py", "python"),
    "gpu_container_probe": ("gpu_container_probe.sh", "bash"),
    "detect_archs": ("detect_archs.sh", "bash"),
    "fetch": ("fetch.sh", "bash"),
    "lock": ("lock.sh", "bash"),
    "stop": ("stop.sh", "bash"),
    "discover_probe": ("discover_probe.sh", "bash"),
}

# The heredoc delimiter of a Python program; no program may contain it as a line of its own.
PY_DELIMITER = "FLEETCUDA_PY"


@dataclass(frozen=True)
class Program:
    name: str
    language: Language
    text: str  # exactly what is sent, as it appears in every script that carries it
    sha256: str

    @property
    def digest(self) -> str:
        """A short name for what the dry run shows instead of the text."""
        return self.sha256[:12]


@cache
def program(name: str) -> Program:
    try:
        filename, language = PROGRAMS[name]
    except KeyError:
        raise KeyError(f"no remote program {name!r} (known: {', '.join(PROGRAMS)})") from None
    text = resources.files(__package__).joinpath(filename).read_text(encoding="utf-8")
    if not text.endswith("\n"):
        text += "\n"
    if language == "python" and PY_DELIMITER in text.splitlines():
        raise ValueError(f"{filename} holds a line {PY_DELIMITER}, which would end its heredoc")
    return Program(name, language, text, hashlib.sha256(text.encode()).hexdigest())


def catalog() -> dict[str, Program]:
    """Every program fleetcuda sends, by name."""
    return {name: program(name) for name in PROGRAMS}


def python_heredoc(python: str, name: str, args: str = "", env: str = "") -> str:
    """Shell code that runs program `name` with `python` (a shell word, e.g. `"$PYTHON"`), the program's
    text on its stdin as a quoted heredoc (nothing in it is expanded). `args` and `env` are shell words
    already quoted by the caller (`env` as `NAME=value` assignments for this one process)."""
    prog = program(name)
    if prog.language != "python":
        raise ValueError(f"{name} is not a Python program")
    head = " ".join(w for w in (env, python, "-", args) if w)
    return f"{head} <<'{PY_DELIMITER}'\n{prog.text}{PY_DELIMITER}"


def shell_text(name: str) -> str:
    prog = program(name)
    if prog.language != "bash":
        raise ValueError(f"{name} is not a shell script")
    return prog.text
