"""The flagship's first failure on a container without torch, in the lab (through a zsh login and pct exec):
the preflight's own message, never `cuda_version 'none' is not a CUDA version` (issue 25 point 5).
Read-only (`apply --check`, `verify`): it changes no container."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import REPO, run_fleetcuda
from tests.test_lab_e2e import GDN, INV, flat, lab_is_up  # noqa: F401  (the fixture)

pytestmark = pytest.mark.lab
TARGET = "lab-a/200"


def test_the_flagship_without_a_venv_says_so_first(tmp_path: Path) -> None:
    text = (REPO / INV).read_text()
    # The recipe's own default (cuda_version: auto, read from torch), and no venv for 200: its python3 is the
    # system's, which has no torch, so the fact reads `none`.
    text = text.replace('  cuda_version: "12.8"\n', "")
    text = text.replace("        name: train-a0\n        venv: /root/venv\n", "        name: train-a0\n")
    inv = tmp_path / "inv.yaml"
    inv.write_text(text)
    for mode in (["apply", "--check"], ["verify"]):
        out = run_fleetcuda(*mode, GDN, "-i", str(inv), "--plain", "--limit", TARGET, state=tmp_path / "state")
        said = flat(out.stdout + out.stderr)
        assert out.returncode == 1, said
        assert "is not a CUDA version" not in said.split(" preflight", 1)[0], said
        assert re.search(rf"^\S+ {TARGET} preflight: (failed|drift)", out.stdout, re.M), out.stdout
        assert f"no `venv:` set for {TARGET} in the inventory" in said, said
        assert "torch is not importable in /usr" not in said
