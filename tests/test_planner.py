"""Planner: facts and variables in, exact commands out (pyinfra-style), plus the kinds' scripts run for real
through the local transport's argv."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from fleetcuda.plan.inventory import load_inventory
from fleetcuda.plan.planner import base_values, facts_command, make_plan, parse_facts, pending_facts
from fleetcuda.plan.recipe import load_recipe
from fleetcuda.plan.templating import TemplateError
from tests.conftest import REPO

GDN = REPO / "recipes" / "gdn-fastpath.yaml"
EXAMPLE = REPO / "inventories" / "example.yaml"


def test_flagship_plan_for_the_example_follows_the_seeds() -> None:
    recipe, inv = load_recipe(GDN), load_inventory(EXAMPLE)
    (target,) = inv.targets
    assert target.id == "pve-gpu1/200" and target.python == "/root/venv/bin/python"
    values = base_values(recipe, target, {})
    # max_jobs comes from the inventory, cuda from the group; the venv's Python X.Y is read from the target
    assert pending_facts(recipe, values) == ["python_xy"]
    plan = make_plan(recipe, target, values)
    steps = {s.name: s for s in plan.steps}
    assert list(steps) == ["preflight", "gpu-passthrough", "host-toolchain", "cuda-keyring", "cuda-compiler",
                           "cuda-home", "build-deps", "torch-matches-nvcc", "causal-conv1d", "fla-core", "fast-path"]
    assert "cuda-nvcc-12-8 cuda-cudart-dev-12-8" in steps["cuda-compiler"].apply.argv[-2]
    build = steps["causal-conv1d"].apply.argv
    env = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in build if "=" in a and a.isascii() and a[0].isupper()}
    assert env["CUDA_HOME"] == "/usr/local/cuda-12.8"
    assert env["CAUSAL_CONV1D_FORCE_BUILD"] == "TRUE"
    assert env["MAX_JOBS"] == "8"
    assert env["PATH"].startswith("/usr/local/cuda-12.8/bin:/root/venv/bin:")
    script = build[-2]
    assert build[-1] == "fleetcuda:causal-conv1d"  # bash $0: how an interrupted run finds it
    assert "--no-build-isolation" in script and "--no-cache-dir" in script and "--no-cache " in script
    assert "causal-conv1d==1.7.0" in script
    assert build[:5] == ("/usr/sbin/pct", "exec", "200", "--", "/usr/bin/env")
    assert "-i" == build[5]
    # The uv from the container's vars is preferred, pip the fallback.
    assert "uv=/root/.local/bin/uv" in script
    # Every step can be checked, so a second run is a no-op.
    assert all(s.check or s.verify for s in plan.steps)
    assert all(s.check for s in plan.steps if s.apply)


def test_variable_precedence(tmp_path: Path) -> None:
    recipe_path = tmp_path / "r.yaml"
    recipe_path.write_text("name: r\nvars:\n  a: recipe\n  b: recipe\n  c: recipe\n  d: recipe\n  e: recipe\n"
                           "  f: recipe\nsteps:\n  - name: s\n    check: echo {{ a }}\n")
    inv_path = tmp_path / "i.yaml"
    inv_path.write_text("vars: {b: inventory, c: inventory, d: inventory, e: inventory, f: inventory}\n"
                        "groups:\n  g1:\n    members: [h/200]\n    vars: {c: g1, d: g1, e: g1, f: g1}\n"
                        "  g2:\n    members: [h]\n    vars: {c: g2}\n"
                        "hosts:\n  h:\n    address: x\n    vars: {d: host, e: host, f: host}\n"
                        "    containers:\n      200:\n        vars: {e: container, f: container}\n")
    recipe, inv = load_recipe(recipe_path), load_inventory(inv_path)
    values = base_values(recipe, inv.targets[0], {"f": "cli"})
    assert [values[k] for k in "abcdef"] == ["recipe", "inventory", "g2", "host", "container", "cli"]


def test_auto_values_come_from_one_fact_round_trip() -> None:
    recipe, inv = load_recipe(GDN), load_inventory(EXAMPLE)
    target = inv.targets[0]
    values = base_values(recipe, target, {"cuda_version": "auto", "max_jobs": "auto", "python_xy": "3.11"})
    names = pending_facts(recipe, values)
    assert names == ["cuda_version", "max_jobs"]
    nonce = "0123456789abcdef"
    cmd = facts_command(recipe, target, values, names, nonce=nonce)
    assert 'find_spec("torch")' in cmd.argv[-2] and "nproc" in cmd.argv[-2]  # torch.version.cuda, unimported
    mark = f"@@fleetcuda:{nonce}"
    output = f"\n{mark} fact cuda_version\n| 13.0\n\n{mark} fact max_jobs\n| 16\n"
    facts = parse_facts(output, names, nonce)
    assert facts == {"cuda_version": "13.0", "max_jobs": "16"}
    plan = make_plan(recipe, target, {**values, **facts})
    compiler = next(s for s in plan.steps if s.name == "cuda-compiler")
    assert "cuda-nvcc-13-0" in compiler.apply.argv[-2]
    with pytest.raises(TemplateError):
        parse_facts(f"{mark} fact cuda_version\n| $(reboot)\n", ["cuda_version"], nonce)
    with pytest.raises(TemplateError):
        parse_facts("", ["cuda_version"], nonce)
    # A fact's own output can never pose as a frame: its lines arrive prefixed, so this reads as no value.
    with pytest.raises(TemplateError):
        parse_facts(f"{mark} fact cuda_version\n| {mark} fact max_jobs\n", ["cuda_version"], nonce)


def test_when_skips_steps(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("name: r\nvars:\n  flag: false\n  mode: a\nsteps:\n"
                    "  - name: one\n    when: flag\n    check: 'true'\n"
                    "  - name: two\n    when: '!flag'\n    check: 'true'\n"
                    "  - name: three\n    when: mode == b\n    check: 'true'\n"
                    "  - name: four\n    when: mode != b\n    check: 'true'\n")
    recipe = load_recipe(path)
    inv = tmp_path / "i.yaml"
    inv.write_text("hosts:\n  h:\n    kind: local\n")
    target = load_inventory(inv).targets[0]
    plan = make_plan(recipe, target, base_values(recipe, target, {}))
    assert [s.name for s in plan.steps if not s.skipped] == ["two", "four"]
    assert plan.steps[0].check is None


def _run(argv: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=120)


def test_env_file_and_pip_kinds_run_for_real(tmp_path: Path) -> None:
    """The scripts the kinds generate, executed by the real bash the local transport would start."""
    profile = tmp_path / "profile.d" / "cuda-home.sh"
    pytest_version = version("pytest")
    recipe_path = tmp_path / "r.yaml"
    recipe_path.write_text(f"""name: r
vars:
  cuda: "12.8"
steps:
  - name: cuda-home
    kind: env_file
    path: {profile}
    vars:
      CUDA_HOME: /usr/local/cuda-{{{{ cuda }}}}
    path_prepend: ["/usr/local/cuda-{{{{ cuda }}}}/bin"]
  - name: pinned-ok
    kind: pip_install
    python: {sys.executable}
    packages: ["pytest=={pytest_version}", "PyYAML"]
    imports: [pytest, yaml]
  - name: pinned-wrong
    kind: pip_install
    python: {sys.executable}
    packages: ["pytest==0.0.1"]
  - name: shows-env
    verify: 'test "$CUDA_HOME" = /usr/local/cuda-12.8 && case "$PATH" in /usr/local/cuda-12.8/bin:*) ;; *) false;; esac'
""")
    inv = tmp_path / "i.yaml"
    inv.write_text("hosts:\n  h:\n    kind: local\n")
    recipe, target = load_recipe(recipe_path), load_inventory(inv).targets[0]
    steps = {s.name: s for s in make_plan(recipe, target, base_values(recipe, target, {})).steps}
    env_step = steps["cuda-home"]
    assert _run(env_step.check.argv).returncode != 0
    assert _run(env_step.apply.argv).returncode == 0
    assert _run(env_step.check.argv).returncode == 0
    assert profile.read_text().splitlines()[1:] == ["export CUDA_HOME=/usr/local/cuda-12.8",
                                                    'export PATH=/usr/local/cuda-12.8/bin:"$PATH"']
    assert oct(profile.stat().st_mode & 0o777) == "0o644"
    sourced = subprocess.run(["bash", "-c", f". {profile}; echo $CUDA_HOME"], capture_output=True, text=True)
    assert sourced.stdout.strip() == "/usr/local/cuda-12.8"
    profile.write_text("# edited by hand\n")
    assert _run(env_step.check.argv).returncode != 0  # drift is noticed

    ok = _run(steps["pinned-ok"].check.argv)
    assert ok.returncode == 0, ok.stdout
    assert f"pytest: {pytest_version}" in ok.stdout
    wrong = _run(steps["pinned-wrong"].check.argv)
    assert wrong.returncode == 1
    assert f"pytest: found {pytest_version}, want 0.0.1" in wrong.stdout
    assert _run(steps["shows-env"].verify.argv).returncode == 0


def test_targets_are_started_round_robin_across_hosts(tmp_path: Path) -> None:
    from fleetcuda.run.engine import interleave_hosts

    inv = tmp_path / "i.yaml"
    inv.write_text("hosts:\n" + "".join(
        f"  h{h}:\n    address: x{h}\n    containers:\n" + "".join(f"      {h}0{c}: {{}}\n" for c in range(3))
        for h in (1, 2)))
    order = [t.id for t in interleave_hosts(load_inventory(inv).targets)]
    assert order == ["h1/100", "h2/200", "h1/101", "h2/201", "h1/102", "h2/202"]


def test_the_flagship_plans_for_a_gpu_machine_whose_cuda_version_is_read_from_torch() -> None:
    """inventories/h200.yaml leaves cuda_version `auto` (a fact): planning before facts are read must not refuse it
    (the gpu-passthrough step once did, so the H200 run stopped at exit 2 before anything was sent)."""
    from fleetcuda.plan.planner import plan_run

    recipe, inv = load_recipe(GDN), load_inventory(REPO / "inventories" / "h200.yaml")
    run = plan_run(recipe, inv.select(None), {}, lambda t: None, run_id="r", nonce="0123456789abcdef")
    plan = run.plans["h200"]
    assert "cuda_version" in plan.unresolved
    gpu = next(s for s in plan.steps if s.name == "gpu-passthrough")
    assert gpu.verify is not None and "--cuda-version auto" in gpu.verify.argv[-2]
