"""tests/test_arith_values.py's contexts over the real hops: a zsh login, `pct exec` and the container's bash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_fleetcuda
from tests.test_arith_values import _script, _values, accepted
from tests.test_lab_e2e import INV, ct, lab_is_up  # noqa: F401  (lab_is_up: autouse fixture)

pytestmark = pytest.mark.lab


def test_no_accepted_value_runs_through_a_zsh_login_and_pct_exec(tmp_path: Path) -> None:
    """`fleetcuda verify` in lab-a/200 (reached through a zsh login and pct exec) runs every context for
    accepted fuzz values and the red team's relatives that pass the rule; none leaves its sentinel."""
    values = [v for v in _values(400, seed=23) if accepted(v)][:30]
    text, _ = _script(len(values))
    recipe = {"name": "arith", "vars": {f"x{i}": v for i, v in enumerate(values)},
              "steps": [{"name": "contexts", "verify": "rm -rf /tmp/fc-arith && mkdir /tmp/fc-arith && "
                         "cd /tmp/fc-arith || exit 1\n" + text + "true\n"}]}
    r = tmp_path / "arith.yaml"
    r.write_text(json.dumps(recipe))
    proc = run_fleetcuda("verify", str(r), "-i", str(INV), "--limit", "lab-a/200", "--plain",
                         state=tmp_path / "state", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ct("lab-a/200", "find /tmp/fc-arith -name PWN").stdout == ""
    assert ct("lab-a/200", "ls /tmp/fc-arith | wc -l").stdout.strip() == str(len(values))  # every value ran
