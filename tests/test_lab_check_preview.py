"""`apply --check` on a fresh lab container previews the whole recipe: every step ok, would-change or unknown,
exit 0 (4 with --detailed-exitcode), and nothing changed. A container of the lab's default topology, as
`labctl up` makes it: torch in /root/venv, no CUDA toolchain (this module resets nothing: it looks first)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import run_fleetcuda
from tests.test_lab_e2e import GDN, INV, TARGETS, ct, lab_is_up

__all__ = ["lab_is_up"]  # the fixture, autouse in this module too

pytestmark = pytest.mark.lab

STATE = "dpkg-query -W -f='${Package} ${db:Status-Abbrev}\\n' 'cuda-*' 2>/dev/null | sort; " \
        "ls /usr/local /etc/profile.d; /root/venv/bin/pip list --format=freeze 2>/dev/null | sort"


def bare() -> str:
    """A container without the toolchain nor the extensions (none: skipped, since this module resets nothing)."""
    for target in TARGETS[:3]:  # lab-b/301 has no GPU passthrough: its gpu step is skipped
        probe = ct(target, "test -e /usr/local/cuda-12.8 || /root/venv/bin/python -c 'import causal_conv1d'",
                   check=False)
        if probe.returncode != 0:
            return target
    pytest.skip("no lab container is fresh (another test converged them): `labctl reset` makes them so")


def test_check_on_a_fresh_container_previews_every_step(tmp_path: Path) -> None:
    target = bare()
    before = ct(target, STATE).stdout
    common = ["-i", INV, "--limit", target, "--check", "--plain", "--var", "cuda_version=auto"]
    proc = run_fleetcuda("apply", GDN, *common, state=tmp_path / "s")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    statuses = dict(re.findall(rf"^\S+ {re.escape(target)} (\S+): (ok|would-change|unknown|failed|skipped) \(",
                               proc.stdout, re.M))
    assert len(statuses) == 11 and "failed" not in statuses.values(), proc.stdout
    # What a fresh container lacks would change; what needs it cannot be known before it is there.
    for step in ("cuda-compiler", "cuda-home", "causal-conv1d", "fla-core"):
        assert statuses[step] == "would-change", (step, proc.stdout)
    assert statuses["preflight"] == "ok"  # torch is there: the preflight's own checks pass
    for step in ("torch-matches-nvcc", "fast-path"):
        assert statuses[step] == "unknown", (step, proc.stdout)
    flat = " ".join(proc.stdout.split())
    assert f"{target}: step cuda-compiler would change: apt: install cuda-nvcc-12-8 cuda-cudart-dev-12-8 (" in flat
    assert f"{target}: step torch-matches-nvcc unknown: depends on " in flat
    assert f"{target} done: would-change" in proc.stdout
    detailed = run_fleetcuda("apply", GDN, *common, "--detailed-exitcode", state=tmp_path / "s")
    assert detailed.returncode == 4, detailed.stdout + detailed.stderr
    assert ct(target, STATE).stdout == before  # --check changed nothing
