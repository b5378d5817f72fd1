"""Helpers for the export tests: the ansible package from PyPI (as benchmarks/run.py installs it), the
export through its CLI entry, and ansible-playbook runs with their recaps."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO

_RECAP = re.compile(r"^(\S+)\s+:\s+ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M)


def _bench():  # noqa: ANN202  (benchmarks/run.py is a script, not a package)
    spec = importlib.util.spec_from_file_location("bench_run", REPO / "benchmarks" / "run.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ansible_playbook() -> Path:
    """ansible-playbook of benchmarks' venv, installed from PyPI with benchmarks' pins when missing."""
    bench = _bench()
    try:
        bench.ensure_ansible()
    except SystemExit as exc:
        if os.environ.get("CI"):
            pytest.fail(f"could not install {bench.ANSIBLE_PINS}: {exc}")
        pytest.skip(f"could not install {bench.ANSIBLE_PINS}: {exc}")
    return Path(bench.ANSIBLE_VENV) / "bin" / "ansible-playbook"


def export(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleetcuda.export.cli", "export", "ansible", *args],
                          capture_output=True, text=True, cwd=cwd, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


@dataclass
class PlaybookRun:
    rc: int
    output: str
    recap: dict[str, dict[str, int]]  # host -> ok, changed, unreachable, failed


def playbook(binary: Path, project: Path, *args: str, home: Path | None = None, timeout: float = 600,
             extra_env: dict[str, str] | None = None) -> PlaybookRun:
    """ansible-playbook in the exported project, with a clean environment (HOME's known_hosts: the export's)."""
    home = home or project / "home"
    (home / ".ssh").mkdir(parents=True, exist_ok=True)
    (home / ".ssh" / "known_hosts").write_text((project / "known_hosts").read_text())
    env = {"PATH": f"{binary.parent}:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(home), "LANG": "C.UTF-8",
           "LC_ALL": "C.UTF-8", "ANSIBLE_NOCOLOR": "1", **(extra_env or {})}
    proc = subprocess.run([str(binary), "-i", "inventory.yml", *args], capture_output=True, text=True, cwd=project,
                          env=env, timeout=timeout)
    out = proc.stdout + proc.stderr
    recap = {m[1]: {"ok": int(m[2]), "changed": int(m[3]), "unreachable": int(m[4]), "failed": int(m[5])}
             for m in _RECAP.finditer(out)}
    return PlaybookRun(proc.returncode, out, recap)
