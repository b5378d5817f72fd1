"""Start-up imports only what the command needs: `--help` and `history` load no pydantic, yaml, paramiko or
rich live display; a dry-run loads no paramiko (it never connects); a local run no SSH connector.

Each case runs `fleetcuda.cli.main(argv)` in a fresh interpreter and reads its sys.modules afterwards: which
heavy modules a command pulled in, which a user feels as start-up time (paramiko alone is ~0.1 s of CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

HEAVY = ("paramiko", "cryptography", "pydantic", "yaml", "rich", "rich.console", "rich.live", "tenacity", "sqlite3",
         "fleetcuda.connectors.ssh", "fleetcuda.run.engine", "fleetcuda.plan.inventory", "fleetcuda.plan.planner")

PROBE = """
import io, json, sys
from fleetcuda.cli import main
out = io.StringIO()
sys.stdout = out
try:
    code = main(json.loads(sys.argv[1]))
except SystemExit as exc:
    code = exc.code
sys.stdout = sys.__stdout__
loaded = [m for m in json.loads(sys.argv[2]) if m in sys.modules]
print(json.dumps({"code": code, "out": out.getvalue(), "loaded": loaded}))
"""


def probe(argv: list[str], state: Path) -> tuple[int, str, set[str]]:
    """main(argv) in a fresh interpreter: its exit status, its stdout, and which of HEAVY it loaded."""
    env = {**os.environ, "FLEETCUDA_STATE_DIR": str(state), "FLEETCUDA_CACHE_DIR": str(state / "cache")}
    env.pop("FLEETCUDA_INVENTORY", None)
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(argv), json.dumps(HEAVY)], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.splitlines()[-1])
    return found["code"], found["out"], set(found["loaded"])


@pytest.mark.parametrize("argv", [["--help"], ["history", "--help"], ["apply", "--help"], ["wheelhouse", "--help"]],
                         ids=" ".join)
def test_help_loads_no_heavy_module(tmp_path: Path, argv: list[str]) -> None:
    code, out, loaded = probe(argv, tmp_path)
    assert code == 0 and out.startswith("usage: fleetcuda")
    assert loaded == set()


def test_history_reads_the_database_without_recipe_inventory_or_connection_modules(tmp_path: Path) -> None:
    code, out, loaded = probe(["history", "--format", "json"], tmp_path)
    assert code == 0 and json.loads(out)["runs"] == []
    assert loaded.isdisjoint({"paramiko", "pydantic", "yaml", "rich.live", "tenacity", "fleetcuda.run.engine",
                              "fleetcuda.plan.inventory"})


def test_schedule_show_loads_no_recipe_or_connection_modules(tmp_path: Path) -> None:
    code, out, loaded = probe(["schedule", "show", "--systemd", "--unit-dir", str(tmp_path)], tmp_path)
    assert code == 1 and "no fleetcuda verify job named 'nightly' is installed" in out
    assert loaded.isdisjoint({"paramiko", "pydantic", "yaml", "rich.live", "fleetcuda.run.engine"})


def test_a_dry_run_of_ssh_targets_loads_no_ssh_connector_nor_engine(tmp_path: Path) -> None:
    code, out, loaded = probe(["apply", "recipes/gdn-fastpath.yaml", "-i", "inventories/lab.yaml", "--dry-run",
                               "--format", "shell", "--limit", "lab-a/200"], tmp_path)
    assert code == 0 and "# target lab-a/200" in out
    assert {"pydantic", "fleetcuda.plan.planner"} <= loaded  # it did load and plan
    assert loaded.isdisjoint({"paramiko", "cryptography", "fleetcuda.connectors.ssh", "fleetcuda.run.engine",
                              "tenacity", "rich"})


def test_a_local_verify_loads_the_engine_but_no_ssh_connector(tmp_path: Path) -> None:
    recipe, inventory = tmp_path / "r.yaml", tmp_path / "i.yaml"
    recipe.write_text("name: r\nsteps:\n  - name: s\n    verify: 'true'\n")
    inventory.write_text("hosts:\n  h:\n    kind: local\n")
    code, out, loaded = probe(["verify", str(recipe), "-i", str(inventory), "--plain"], tmp_path)
    assert code == 0 and "h done: ok" in out
    assert "fleetcuda.run.engine" in loaded  # it did run
    assert loaded.isdisjoint({"paramiko", "fleetcuda.connectors.ssh", "rich.live"})


def test_the_ssh_connector_is_loaded_when_a_host_needs_it(tmp_path: Path) -> None:
    recipe, inventory = tmp_path / "r.yaml", tmp_path / "far.yaml"
    recipe.write_text("name: r\nsteps:\n  - name: s\n    verify: 'true'\n")
    inventory.write_text(f"hosts:\n  far:\n    address: 127.0.0.1\n    port: 1\n    user: root\n"
                         f"    known_hosts: {tmp_path / 'known_hosts'}\n")
    (tmp_path / "known_hosts").write_text("")
    code, out, loaded = probe(["verify", str(recipe), "-i", str(inventory), "--plain", "--no-history"], tmp_path)
    assert code == 3 and "far done: unreachable" in out  # nothing listens on port 1
    assert {"paramiko", "fleetcuda.connectors.ssh"} <= loaded
